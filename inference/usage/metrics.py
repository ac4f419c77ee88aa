"""Prometheus metrics of the API process, and the small calls the request path makes to feed them.

Each API process exposes its own numbers at ``/metrics``; Prometheus scrapes every process and adds
them up. Labels stay few and bounded: model, organization (slug), status and error code. Model ids come
from the catalog (a client's unknown model is refused before it is counted); even so, past
``MAX_MODEL_LABELS`` distinct ids the others share the label ``other``, and past ``MAX_ERROR_CODE_LABELS``
error codes (a gateway's upstream names its own) likewise, so that nothing a client or an upstream sends can grow
the exposition without bound.

The request path calls:

- ``observe_request(...)`` once per request that reached admission, when its usage is recorded;
- ``in_flight(model).inc()`` when a request is admitted and ``.dec()`` when its slot is released;
- ``rejected(model=..., organization=..., limit=...)`` when admission refuses a request.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.exposition import choose_encoder

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(registry=REGISTRY)
PlatformCollector(registry=REGISTRY)

# Time to first token is tens of milliseconds on a warm GPU and seconds behind a queue; whole
# requests run up to the stream limit.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

REQUESTS = Counter(
    "b3os_requests",
    "Requests that reached admission, by how they ended.",
    ["model", "organization", "endpoint", "status", "code"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "b3os_tokens",
    "Tokens processed: input (prompt), output (completion), and the cached and reasoning parts of them.",
    ["model", "organization", "kind"],
    registry=REGISTRY,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "b3os_time_to_first_token_seconds",
    "Time from the request's arrival to its first generated token.",
    ["model"],
    buckets=TTFT_BUCKETS,
    registry=REGISTRY,
)
REQUEST_DURATION = Histogram(
    "b3os_request_duration_seconds",
    "Time from the request's arrival to its end (the last byte of a stream).",
    ["model", "endpoint"],
    buckets=DURATION_BUCKETS,
    registry=REGISTRY,
)
IN_FLIGHT = Gauge(
    "b3os_requests_in_flight",
    "Admitted requests not finished yet, in this process.",
    ["model"],
    registry=REGISTRY,
)
REJECTED = Counter(
    "b3os_rejected_requests",
    "Requests refused by a limit at admission.",
    ["model", "organization", "limit"],
    registry=REGISTRY,
)


UNAVAILABLE = Counter(
    "b3os_unavailable_responses",
    "Requests answered 503 because a service the node depends on (redis, database) could not be reached.",
    ["service"],
    registry=REGISTRY,
)
INTERNAL_ERRORS = Counter(
    "b3os_internal_errors",
    "Requests answered 500 internal_error: a fault of the node, logged with the request's id. Most fail before "
    "admission, where no usage record or b3os_requests counts them.",
    registry=REGISTRY,
)
USAGE_RECORDS_DROPPED = Counter(
    "b3os_usage_records_dropped",
    "Usage records never written: the database stayed away past the pending bound, or the row was refused.",
    ["reason"],
    registry=REGISTRY,
)
USAGE_RECORDS_PENDING = Gauge(
    "b3os_usage_records_pending",
    "Usage records waiting to be written; they pile up, and are retried, while the database is away.",
    registry=REGISTRY,
)
# Known label values start at 0, so that an outage shows as a rise on a graph rather than as a series appearing.
for _service in ("redis", "database"):
    UNAVAILABLE.labels(_service)
for _reason in ("database_unavailable", "refused", "organization_deleted", "shutdown"):
    USAGE_RECORDS_DROPPED.labels(_reason)


MAX_MODEL_LABELS = 1000
MAX_ERROR_CODE_LABELS = 200
OTHER_LABEL = "other"
_model_labels: set[str] = set()
_error_code_labels: set[str] = set()
_labels_lock = threading.Lock()


def model_label(model: str) -> str:
    """``model`` as a label value: itself, or ``other`` once ``MAX_MODEL_LABELS`` others have been seen."""
    return _bounded(model, _model_labels, MAX_MODEL_LABELS)


def error_code_label(code: str) -> str:
    """An error code as a label value: itself, or ``other`` once ``MAX_ERROR_CODE_LABELS`` others have been seen (a
    gateway's upstream names codes of its own)."""
    return _bounded(code, _error_code_labels, MAX_ERROR_CODE_LABELS)


def _bounded(value: str, seen: set[str], most: int) -> str:
    if value in seen:
        return value
    with _labels_lock:
        if len(seen) >= most:
            return OTHER_LABEL
        seen.add(value)
    return value


def observe_request(
    *,
    model: str,
    organization: str,
    status: int,
    total_ms: float,
    endpoint: str = "",
    error_code: str = "",
    input_tokens: int = 0,
    output_tokens: int = 0,
    reasoning_tokens: int = 0,
    cached_tokens: int = 0,
    ttft_ms: float | None = None,
) -> None:
    """Count one finished request (any outcome) and its tokens and timings."""
    model = model_label(model)
    REQUESTS.labels(model, organization, endpoint, str(status), error_code_label(error_code)).inc()
    for kind, count in (
        ("input", input_tokens),
        ("output", output_tokens),
        ("reasoning", reasoning_tokens),
        ("cached", cached_tokens),
    ):
        if count:
            TOKENS.labels(model, organization, kind).inc(count)
    if ttft_ms is not None:
        TIME_TO_FIRST_TOKEN.labels(model).observe(ttft_ms / 1000)
    REQUEST_DURATION.labels(model, endpoint).observe(total_ms / 1000)


def in_flight(model: str) -> Gauge:
    """The model's in-flight gauge: ``.inc()`` on admission, ``.dec()`` on release."""
    return IN_FLIGHT.labels(model_label(model))


def rejected(*, model: str, organization: str, limit: str) -> None:
    """Count a request refused at admission; ``limit`` names the limit (``requests_per_minute``, …)."""
    REJECTED.labels(model_label(model), organization, limit).inc()


def unavailable(service: str) -> None:
    """Count a request answered 503 because ``service`` (``redis``, ``database``) could not be reached."""
    UNAVAILABLE.labels(service).inc()


def exposition(accept: str = "") -> tuple[bytes, str]:
    """The registry in the format the scraper's ``Accept`` header asks for (Prometheus' classic text
    format by default, OpenMetrics on request), and its content type."""
    encoder, content_type = choose_encoder(accept)
    return encoder(REGISTRY), content_type
