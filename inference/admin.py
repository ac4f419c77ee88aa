from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin, messages

from core.admin import ModelAdmin
from inference.engine.entries import runner_problem, serving_warning
from inference.engine.execution import get_capacity
from inference.models import GATEWAY_PARAMETERS, CatalogEntry, UsageRecord


class CatalogEntryForm(forms.ModelForm):
    """The upstream's key is written, never shown again; left blank, the stored key stays. An entry its runner
    could not serve is not saved (``runner_problem``)."""

    upstream_api_key = forms.CharField(
        required=False,
        widget=forms.PasswordInput(render_value=False),
        help_text="Sent to the upstream; never shown. Leave blank to keep the current key.",
    )
    clear_upstream_api_key = forms.BooleanField(required=False, label="Remove the stored upstream key")
    gateway_parameters = forms.MultipleChoiceField(
        choices=GATEWAY_PARAMETERS,
        required=False,
        widget=forms.CheckboxSelectMultiple,
        help_text="What the node refuses that requests to this model may send through the gateway.",
    )

    class Meta:
        model = CatalogEntry
        fields = "__all__"

    def clean_upstream_api_key(self) -> str:
        entered = self.cleaned_data.get("upstream_api_key") or ""
        return entered or (self.instance.upstream_api_key if self.instance.pk else "")

    def clean(self) -> dict[str, Any]:
        cleaned: dict[str, Any] = super().clean()
        if cleaned.get("clear_upstream_api_key") and self.data.get("upstream_api_key"):
            # Which one was meant cannot be told: the key typed would be dropped without a word.
            self.add_error("upstream_api_key", "Type a new key, or remove the stored one, not both.")
        return cleaned

    def _post_clean(self) -> None:
        # The entry as it would be saved, checked as its runner would load it once the row's own checks pass.
        super()._post_clean()
        if not self.errors and (problem := runner_problem(self.instance)):
            self.add_error(*problem)

    def save(self, commit: bool = True) -> Any:
        if self.cleaned_data.get("clear_upstream_api_key"):
            self.instance.upstream_api_key = ""
        return super().save(commit=commit)


@admin.register(CatalogEntry)
class CatalogEntryAdmin(ModelAdmin):
    form = CatalogEntryForm

    def save_model(self, request: Any, obj: CatalogEntry, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        if warning := serving_warning(obj):
            messages.warning(request, warning)

    list_display = [
        "public_id",
        "runner",
        "enabled",
        "context_length",
        "max_output_tokens",
        "json_schema",
        "image_input",
        "tools",
        "reasoning",
        "queue",
    ]
    list_filter = ["runner", "enabled"]
    search_fields = ["public_id"]
    readonly_fields = ["queue", "created", "capacity"]
    fieldsets = [
        (None, {"fields": ["public_id", "enabled", "owned_by", "created"]}),
        ("Runner", {"fields": ["runner", "runner_settings", "queue", "capacity"]}),
        ("Limits of the model", {"fields": ["context_length", "max_output_tokens"]}),
        ("Sampling", {"fields": ["sampling_defaults"]}),
        (
            "Gateway upstream",
            {
                "fields": [
                    "upstream_base_url",
                    "upstream_api_key",
                    "clear_upstream_api_key",
                    "upstream_model",
                    "gateway_parameters",
                ],
                "classes": ["collapse"],
            },
        ),
        ("Capabilities", {"fields": ["json_schema", "image_input", "tools", "reasoning"]}),
    ]

    UPSTREAM_KEY_FIELDS = ["upstream_api_key", "clear_upstream_api_key"]

    def get_fieldsets(self, request: Any, obj: CatalogEntry | None = None) -> Any:
        """For a user who may only view the entry, whether an upstream key is stored, not the key: Django shows a
        read-only field's value as it is."""
        fieldsets = super().get_fieldsets(request, obj)
        if self.has_change_permission(request, obj):
            return fieldsets
        return [(name, {**options, "fields": _without_the_key(options["fields"])}) for name, options in fieldsets]

    @admin.display(description="Upstream api key")
    def upstream_api_key_stored(self, entry: CatalogEntry) -> str:
        return "stored (never shown)" if entry.upstream_api_key else "none"

    @admin.display(description="Capacity of one loaded copy")
    def capacity(self, entry: CatalogEntry) -> str:
        """For the CPU runner: its sequence slots (``parallel`` in the settings), their context, its queue
        (``queue``), and the KV cache they take in memory."""
        if not entry.pk:
            return "—"
        held = get_capacity(entry.runner, entry.runner_settings)
        if held is None:
            return "—"
        return (
            f"{held.sequences} sequences of {held.context_per_sequence} tokens, {held.queue} more waiting; "
            f"KV cache {held.kv_cache_bytes / 2**20:.0f} MiB"
        )


def _without_the_key(fields: list[str]) -> list[str]:
    shown = [field for field in fields if field not in CatalogEntryAdmin.UPSTREAM_KEY_FIELDS]
    return shown if shown == fields else [*shown[:1], "upstream_api_key_stored", *shown[1:]]


@admin.register(UsageRecord)
class UsageRecordAdmin(ModelAdmin):
    list_display = [
        "created",
        "organization",
        "model",
        "endpoint",
        "route",
        "status",
        "error_code",
        "input_tokens",
        "output_tokens",
        "total_ms",
        "request_id",
    ]
    list_filter = ["organization", "model", "endpoint", "route", "status"]
    search_fields = ["request_id", "model", "organization__slug"]
    date_hierarchy = "created"
    list_select_related = ["organization"]

    def has_add_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_change_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False

    def has_delete_permission(self, request, obj=None) -> bool:  # type: ignore[no-untyped-def]
        return False  # the record of what was served and charged: kept, as the organizations it belongs to are
