from __future__ import annotations

import secrets
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.options import BaseModelAdmin
from django.contrib.admin.widgets import AutocompleteSelect
from django.core.exceptions import ValidationError
from django.db.models import QuerySet
from django.forms.models import BaseInlineFormSet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.html import format_html

from core.admin import ModelAdmin, register_auth_admins

from .models import DISPLAYED_KEY, SLUG_RULE, APIKey, Limit, Organization, hash_key, split_key


def _one_limit_per_scope(scopes: list[object]) -> str | None:
    """What is wrong when an organization's limits name one scope (a model, or None: the default) twice."""
    repeated = {scope for scope in scopes if scopes.count(scope) > 1}
    if None in repeated:
        return "An organization has one default limit (model left blank): keep one of these rows."
    if repeated:
        return f"An organization has one limit per model: {', '.join(sorted(map(str, repeated)))} is named twice."
    return None


def _names_a_row(rows: QuerySet[Any], field: str, value: object) -> bool:
    try:
        return bool(rows.filter(**{field: value}).exists())
    except (ValueError, TypeError, OverflowError, ValidationError):  # not an id at all, or past what the database holds
        return False


class ReadableAutocompleteSelect(AutocompleteSelect):
    """Shows a value that names no row (``abc``, an id past what the database holds) as nothing chosen. Django's
    looks the value up as given to show it chosen, and a value that is no id at all fails that query: a form that
    said "Select a valid choice", or a page opened with ``?organization=abc``, was a server error."""

    def optgroups(self, name: str, value: list[str], attr: dict[str, Any] | None = None) -> Any:
        rows, field = self.choices.queryset.using(self.db), getattr(self.field.remote_field, "field_name", "pk")
        return super().optgroups(name, [choice for choice in value if _names_a_row(rows, field, choice)], attr)


class ReadableAutocompletes(BaseModelAdmin):
    """For every admin and inline with ``autocomplete_fields`` (foreign keys, as all of the project's are)."""

    def formfield_for_foreignkey(self, db_field: Any, request: HttpRequest, **kwargs: Any) -> Any:
        if "widget" not in kwargs and db_field.name in self.get_autocomplete_fields(request):
            kwargs["widget"] = ReadableAutocompleteSelect(db_field, self.admin_site, using=kwargs.get("using"))
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class LimitInlineFormSet(BaseInlineFormSet):
    """The rows of one organization's limits, checked together: each row alone cannot see the others, and the
    database's constraint would refuse the save only after the form was accepted (a server error)."""

    def clean(self) -> None:
        super().clean()
        if any(self.errors):
            return
        kept = [
            form
            for form in self.forms
            if form.cleaned_data and not (self.can_delete and self._should_delete_form(form))
        ]
        scopes: list[object] = [form.cleaned_data.get("model") for form in kept]
        if self.instance.pk is not None:  # rows saved meanwhile, or left out of the posted form
            shown = [form.instance.pk for form in self.initial_forms if form.instance.pk is not None]
            others = Limit.objects.filter(organization=self.instance).exclude(pk__in=shown).select_related("model")
            scopes += [row.model for row in others]
        if problem := _one_limit_per_scope(scopes):
            raise ValidationError(problem)

    def save_existing_objects(self, commit: bool = True) -> list[Limit]:
        # Django saves the rows in their order, each alone: a row moved to a model whose row is deleted, or two rows
        # swapping models, met the database's one-row-per-model constraint half-way (a server error). Rows deleted
        # go first, and rows moved to another model leave their model before any takes it.
        if commit:
            deleted = {form.instance.pk for form in self.deleted_forms if form.instance.pk is not None}
            moved = [
                form.instance.pk
                for form in self.initial_forms
                if form.instance.pk is not None and form.instance.pk not in deleted and "model" in form.changed_data
            ]
            Limit.objects.filter(pk__in=[*deleted, *moved]).delete()  # a moved row is saved again, as it now is
        return super().save_existing_objects(commit)


class LimitInline(ReadableAutocompletes, admin.TabularInline):
    model = Limit
    formset = LimitInlineFormSet
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


class OrganizationForm(forms.ModelForm):
    class Meta:
        model = Organization
        fields = "__all__"
        # Django's slug check runs first and would say letters of either case do.
        error_messages = {"slug": {"invalid": SLUG_RULE}}
        help_texts = {
            "active": "Inactive organizations' keys are refused at once. An organization that has used the API is "
            "deactivated, not deleted: deleting it would delete its usage records with it."
        }


# The people who run the platform: Django's user and group admins, with the project's change lists.
register_auth_admins()


@admin.register(Organization)
class OrganizationAdmin(ModelAdmin):
    form = OrganizationForm
    list_display = ["slug", "name", "active", "key_count", "created", "add_key_link"]
    list_filter = ["active"]
    search_fields = ["slug", "name"]
    prepopulated_fields = {"slug": ["name"]}
    inlines = [LimitInline, APIKeyInline]

    def has_delete_permission(self, request: HttpRequest, obj: Organization | None = None) -> bool:
        """Its usage is what it is billed from: an organization with any is deactivated instead."""
        if obj is not None and (obj.usage_records.exists() or obj.usage_rollups.exists()):
            return False
        return super().has_delete_permission(request, obj)

    def get_actions(self, request: HttpRequest) -> dict[str, Any]:
        # Deleting in bulk would take the usage of every organization selected, and its confirmation page lists
        # each of their usage records first.
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    def save_formset(self, request: HttpRequest, form: Any, formset: Any, change: bool) -> None:
        super().save_formset(request, form, formset, change)
        if formset.model is not Limit:
            return
        for row in Limit.objects.filter(organization=form.instance, model__isnull=False).select_related("model"):
            _warn_if_it_lifts_the_default(request, row)

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
        return [
            ("active", "Active"),
            ("revoked", "Revoked"),
            ("expired", "Expired"),
            ("organization-inactive", "Organization inactive"),
        ]

    def queryset(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> QuerySet[APIKey]:
        now = timezone.now()
        if self.value() == "active":
            return queryset.filter(revoked_at__isnull=True, organization__active=True).exclude(expires_at__lte=now)
        if self.value() == "organization-inactive":
            return queryset.filter(revoked_at__isnull=True, organization__active=False).exclude(expires_at__lte=now)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


# In the session: the token of each add form that made a key, and the key's id (never its secret).
KEYS_MADE = "b3os_keys_made"
KEYS_MADE_KEPT = 20


class APIKeyForm(forms.ModelForm):
    # One per add form: the same form sent again (a reload of the page that showed the secret) makes no second key.
    once = forms.CharField(widget=forms.HiddenInput, required=False, initial=lambda: secrets.token_urlsafe(16))

    class Meta:
        model = APIKey
        fields = "__all__"

    def clean_expires_at(self) -> object:
        expires_at = self.cleaned_data.get("expires_at")
        if self.instance.pk is None and expires_at is not None and expires_at <= timezone.now():
            raise ValidationError("Choose a time in the future: a key that has already expired could never be used.")
        return expires_at


@admin.register(APIKey)
class APIKeyAdmin(ModelAdmin):
    form = APIKeyForm
    list_display = ["display_prefix", "name", "organization", "state", "created", "last_used_at", "expires_at"]
    list_filter = ["organization", KeyStateFilter]
    search_fields = ["name", "prefix", "organization__slug", "organization__name"]
    list_select_related = ["organization"]
    readonly_fields = ["display_prefix", "state", "created", "last_used_at", "revoked_at"]
    actions = ["revoke_keys"]

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[APIKey], search_term: str
    ) -> tuple[QuerySet[APIKey], bool]:
        """A key pasted whole is found if it is one (by its hash), and one typed as the list shows it
        (``b3os_<prefix>_…``, or its start) by its prefix; any other text is searched for as usual."""
        term = search_term.strip()
        if split_key(term) is not None:
            return queryset.filter(hashed_key=hash_key(term)), False
        if shown := DISPLAYED_KEY.fullmatch(term):
            return queryset.filter(prefix__startswith=shown["prefix"]), False
        return super().get_search_results(request, queryset, search_term)

    def get_fields(self, request: HttpRequest, obj: APIKey | None = None) -> list[str]:
        if obj is None:
            return ["organization", "name", "expires_at", "once"]
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
        obj.raw_key = raw  # for response_add, this request only
        if once := form.cleaned_data.get("once"):
            made = list(request.session.get(KEYS_MADE, {}).items())[-(KEYS_MADE_KEPT - 1) :]
            request.session[KEYS_MADE] = {**dict(made), once: key.pk}

    def add_view(self, request: HttpRequest, form_url: str = "", extra_context: Any = None) -> HttpResponse:
        once = request.POST.get("once", "") if request.method == "POST" else ""
        if once and (made := request.session.get(KEYS_MADE, {}).get(once)) is not None:
            self.message_user(
                request,
                "This form made its key already: here it is, not a second one. Its secret was shown once, when it "
                "was made; if it was not copied, revoke the key and create another.",
                messages.WARNING,
            )
            return HttpResponseRedirect(reverse("admin:orgs_apikey_change", args=[made]))
        return super().add_view(request, form_url, extra_context)

    def response_add(self, request: HttpRequest, obj: APIKey, post_url_continue: str | None = None) -> HttpResponse:
        """The new key's secret, shown in this response and nowhere else: not through the messages framework,
        whose cookie or session would carry it to the browser's storage or the database."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "API key created",
            "key": obj,
            "raw_key": obj.raw_key,
        }
        response = TemplateResponse(request, "admin/orgs/apikey/created.html", context)
        add_never_cache_headers(response)
        return response

    def has_delete_permission(self, request: HttpRequest, obj: APIKey | None = None) -> bool:
        """A key is revoked, not deleted, once it has been used: its usage names it. One never used (made by mistake,
        or with an organization that never used the API, deleted with it) may go."""
        if obj is None or obj.usage_records.exists() or obj.usage_rollups.exists():
            return False
        return super().has_delete_permission(request, obj)

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request: HttpRequest, queryset: QuerySet[APIKey]) -> None:
        keys = list(queryset.filter(revoked_at__isnull=True))
        APIKey.objects.filter(pk__in=[key.pk for key in keys]).update(revoked_at=timezone.now())
        for key in keys:  # in each key's history, as a change made on its page would be
            self.log_change(request, key, "Revoked.")
        self.message_user(request, f"Revoked {len(keys)} key(s).", messages.SUCCESS)


def _warn_if_it_lifts_the_default(request: HttpRequest, row: Limit) -> None:
    if row.lifts_the_default:
        messages.warning(
            request,
            f"The row for {row.model} has no limit: it leaves that model unlimited for {row.organization.slug}, "
            "whatever the default row says. Delete the row to have the default apply to it.",
        )


@admin.register(Limit)
class LimitAdmin(ReadableAutocompletes, ModelAdmin):
    def save_model(self, request: HttpRequest, obj: Limit, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        _warn_if_it_lifts_the_default(request, obj)

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
