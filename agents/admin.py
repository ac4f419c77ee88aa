from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from agents.models import AgentInstance, Document, Feedback, Guardrail, StoredResponse
from agents.protocol import AGENT_CALL
from agents.tools.registry import REGISTRY
from core.admin import ModelAdmin


class AgentInstanceForm(forms.ModelForm):
    tools = forms.MultipleChoiceField(
        choices=[], required=False, widget=forms.CheckboxSelectMultiple, help_text="Tools the runtime runs itself."
    )

    class Meta:
        model = AgentInstance
        fields = "__all__"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["tools"].choices = [
            (name, f"{name}: {tool.description}") for name, tool in sorted(REGISTRY.items())
        ]


# A document longer than this is shown, not edited, on its instance's page: its text would be posted back whole with
# every save of the page, past the body's bound once a few such documents are there.
EDITABLE_TEXT_MAX = 64 * 1024


class DocumentText(forms.CharField):
    """A document's text as a browser posts it back: its line breaks as they were (a textarea sends CRLF), and its
    spaces kept, so that a page saved untouched leaves the document as it was."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{**kwargs, "strip": False})

    def to_python(self, value: Any) -> str:
        text: str = super().to_python(value)
        return text.replace("\r\n", "\n")


class Preview(forms.Textarea):
    """A long text shown as its start, read-only: the rest is not sent to the browser, nor back."""

    def format_value(self, value: Any) -> str | None:
        text = super().format_value(value) or ""
        if len(text) <= EDITABLE_TEXT_MAX:
            return text
        return f"{text[:2000]}\n\n[… {len(text):,} characters in all: upload a file to replace them]"


class DocumentForm(forms.ModelForm):
    upload = forms.FileField(required=False, help_text="A UTF-8 text or Markdown file: replaces the text.")

    class Meta:
        model = Document
        fields = ["title", "url", "text", "upload"]
        field_classes = {"text": DocumentText}

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        text = self.fields["text"]
        text.required = False
        text.widget = forms.Textarea(attrs={"rows": 4, "cols": 60})
        if self.instance.pk is not None and len(self.instance.text) > EDITABLE_TEXT_MAX:
            text.disabled = True  # kept as saved unless a file replaces it
            text.widget = Preview(attrs={"rows": 4, "cols": 60})

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        upload = data.get("upload")
        if upload is not None:
            try:
                data["text"] = upload.read().decode("utf-8")
            except UnicodeDecodeError:
                self.add_error("upload", "The file is not UTF-8 text.")
            else:
                if "\x00" in data["text"]:
                    self.add_error("upload", "The file holds a NUL character, which no text document does.")
        if not (data.get("text") or "").strip() and not self.errors:
            self.add_error("text", "Give the document's text, or upload it.")
        return data


class DocumentInline(admin.StackedInline):
    model = Document
    form = DocumentForm
    extra = 0


class GuardrailInline(admin.StackedInline):
    model = Guardrail
    extra = 0
    fields = [("name", "enabled"), ("applies_to", "kind"), "patterns", "refusal"]


@admin.register(AgentInstance)
class AgentInstanceAdmin(ModelAdmin):
    form = AgentInstanceForm
    list_display = ["instance_id", "name", "model", "first_step", "reasons", "enabled", "tenants", "documents"]
    list_filter = ["enabled", "model", "organizations"]
    search_fields = ["instance_id", "name"]
    filter_horizontal = ["organizations"]
    readonly_fields = ["created", "updated"]
    inlines = [DocumentInline, GuardrailInline]
    fieldsets = [
        (None, {"fields": ["instance_id", "name", "enabled", "model", "organizations"]}),
        ("Behaviour", {"fields": ["instructions", "tools", "first_step", "reasons"]}),
        ("Defaults for requests that set none", {"fields": ["temperature", "max_output_tokens"]}),
        ("Times", {"fields": ["created", "updated"], "classes": ["collapse"]}),
    ]

    def get_queryset(self, request: HttpRequest) -> QuerySet[AgentInstance]:
        return super().get_queryset(request).select_related("model").prefetch_related("organizations", "documents")

    @admin.display(description="tenants")
    def tenants(self, instance: AgentInstance) -> str:
        return ", ".join(org.slug for org in instance.organizations.all()) or "—"

    @admin.display(description="documents")
    def documents(self, instance: AgentInstance) -> int:
        return len(instance.documents.all())


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content or ():
        if part.get("type") == "refusal":
            parts.append(f"[refused] {part.get('refusal', '')}")
        else:
            parts.append(part.get("text", ""))
    return "".join(parts)


def _line(item: dict[str, Any]) -> tuple[str, str]:
    kind = item.get("type", "message")
    if kind == "message":
        return item.get("role", "?"), _text(item.get("content"))
    if kind == AGENT_CALL:
        outcome = f"error: {item['error']}" if item.get("error") else item.get("output") or ""
        return f"server tool {item.get('name')}", f"{item.get('arguments')} → {outcome}"
    if kind == "function_call":
        return f"client tool {item.get('name')}", item.get("arguments", "")
    if kind == "function_call_output":
        return "tool output", _text(item.get("output"))
    if kind == "reasoning":
        return "reasoning", " ".join(part.get("text", "") for part in item.get("content") or ())
    return kind, ""


def conversation_html(items: list[dict[str, Any]]) -> SafeString:
    rows = format_html_join("", "<tr><th>{}</th><td style='white-space: pre-wrap'>{}</td></tr>", map(_line, items))
    return format_html("<table>{}</table>", rows)


class FeedbackInline(admin.StackedInline):
    model = Feedback
    extra = 0
    can_delete = False
    readonly_fields = ["rating", "comment", "meta", "created"]
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(StoredResponse)
class StoredResponseAdmin(ModelAdmin):
    list_display = ["response_id", "created", "organization", "instance", "status", "rating"]
    list_filter = ["organization", "instance", "status", "feedback__rating"]
    search_fields = ["response_id", "thread", "request_id"]
    date_hierarchy = "created"
    list_select_related = ["organization", "instance", "feedback"]
    inlines = [FeedbackInline]
    fields = [
        "response_id",
        ("organization", "instance", "api_key"),
        ("status", "created", "request_id"),
        "previous_link",
        "turn",
        "usage",
    ]
    readonly_fields = [
        "response_id",
        "organization",
        "instance",
        "api_key",
        "status",
        "created",
        "request_id",
        "previous_link",
        "turn",
        "usage",
    ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="rating")
    def rating(self, response: StoredResponse) -> str:
        feedback = getattr(response, "feedback", None)
        return feedback.rating if feedback is not None else "—"

    @admin.display(description="previous turn")
    def previous_link(self, response: StoredResponse) -> SafeString | str:
        if response.previous is None:
            return "— (the conversation's first turn)"
        url = reverse("admin:agents_storedresponse_change", args=[response.previous.pk])
        return format_html('<a href="{}">{}</a>', url, response.previous.response_id)

    @admin.display(description="this turn: input, then output")
    def turn(self, response: StoredResponse) -> SafeString:
        return conversation_html([*response.input_items, *response.output_items])


@admin.register(Feedback)
class FeedbackAdmin(ModelAdmin):
    list_display = ["created", "rating", "comment", "response_link", "organization"]
    list_filter = ["rating", "response__organization", "response__instance"]
    search_fields = ["comment", "response__response_id"]
    list_select_related = ["response__organization"]
    readonly_fields = ["response_link", "rating", "comment", "meta", "created"]
    fields = readonly_fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    @admin.display(description="response")
    def response_link(self, feedback: Feedback) -> SafeString:
        url = reverse("admin:agents_storedresponse_change", args=[feedback.response_id])
        return format_html('<a href="{}">{}</a>', url, feedback.response.response_id)

    @admin.display(description="organization")
    def organization(self, feedback: Feedback) -> str:
        return feedback.response.organization.slug
