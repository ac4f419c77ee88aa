from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html

from .models import APIKey, Limit, Organization


class LimitInline(admin.TabularInline):
    model = Limit
    extra = 0
    fields = ["model", "tokens_per_minute", "requests_per_minute", "requests_in_flight"]
    autocomplete_fields = ["model"]


class APIKeyInline(admin.TabularInline):
    """Keys are listed here; they are created on the key page, which shows the secret once."""

    model = APIKey
    extra = 0
    can_delete = False
    show_change_link = True
    fields = ["name", "display_prefix", "state", "created", "last_used_at", "expires_at"]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "active", "key_count", "created", "add_key_link"]
    list_filter = ["active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [LimitInline, APIKeyInline]

    @admin.display(description="keys")
    def key_count(self, obj: Organization) -> int:
        return obj.api_keys.filter(revoked_at__isnull=True).count()

    @admin.display(description="")
    def add_key_link(self, obj: Organization) -> str:
        url = reverse("admin:orgs_apikey_add") + f"?organization={obj.pk}"
        return format_html('<a href="{}">Create key</a>', url)


class KeyStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("active", "Active"), ("revoked", "Revoked"), ("expired", "Expired")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> QuerySet[APIKey]:
        now = timezone.now()
        if self.value() == "active":
            return queryset.filter(revoked_at__isnull=True).exclude(expires_at__lte=now)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


@admin.register(APIKey)
class APIKeyAdmin(admin.ModelAdmin):
    list_display = ["display_prefix", "name", "organization", "state", "created", "last_used_at", "expires_at"]
    list_filter = ["organization", KeyStateFilter]
    search_fields = ["name", "prefix", "organization__slug", "organization__name"]
    list_select_related = ["organization"]
    readonly_fields = ["display_prefix", "state", "created", "last_used_at", "revoked_at"]
    actions = ["revoke_keys"]

    def get_fields(self, request: HttpRequest, obj: APIKey | None = None) -> list[str]:
        if obj is None:
            return ["organization", "name", "expires_at"]
        return [
            "organization",
            "name",
            "display_prefix",
            "state",
            "created",
            "last_used_at",
            "expires_at",
            "revoked_at",
        ]

    def get_readonly_fields(self, request: HttpRequest, obj: APIKey | None = None) -> list[str]:
        return [*self.readonly_fields, "organization"] if obj else []

    def save_model(self, request: HttpRequest, obj: APIKey, form: Any, change: bool) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        key, raw = APIKey.generate(organization=obj.organization, name=obj.name, expires_at=obj.expires_at)
        obj.pk, obj.prefix, obj.hashed_key, obj.created = key.pk, key.prefix, key.hashed_key, key.created
        messages.warning(
            request,
            format_html(
                'New API key for {}: <code id="new-api-key">{}</code> — copy it now; it is not shown again.',
                obj.organization.slug,
                raw,
            ),
        )

    def has_delete_permission(self, request: HttpRequest, obj: APIKey | None = None) -> bool:
        return False

    @admin.action(description="Revoke selected keys")
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> None:
        count = queryset.filter(revoked_at__isnull=True).update(revoked_at=timezone.now())
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)


@admin.register(Limit)
class LimitAdmin(admin.ModelAdmin):
    list_display = [
        "organization",
        "scope",
        "tokens_per_minute",
        "requests_per_minute",
        "requests_in_flight",
        "updated",
    ]
    list_filter = ["organization", "model"]
    search_fields = ["organization__slug", "model__public_id"]
    autocomplete_fields = ["organization", "model"]
    list_select_related = ["organization", "model"]

    @admin.display(description="model")
    def scope(self, obj: Limit) -> str:
        return obj.model.public_id if obj.model_id else "all models (default)"
