"""``/metrics`` in Prometheus' format and ``/health``: neither takes an API key."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import OperationalError
from django.test import AsyncClient, Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from inference.models import CatalogEntry
from inference.usage import health, metrics
from tests.conftest import MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)


def families() -> dict[str, Any]:
    response = Client().get("/metrics")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=0.0.4")
    return {family.name: family for family in text_string_to_metric_families(response.content.decode())}


def sample(family: Any, suffix: str = "", **labels: str) -> float:
    [value] = [s.value for s in family.samples if s.name == family.name + suffix and labels.items() <= s.labels.items()]
    return value


# --- /metrics ---------------------------------------------------------------------------------------


def test_metrics_count_requests_tokens_and_timings_by_model_organization_and_status() -> None:
    metrics.observe_request(
        model="m-metrics", organization="acme", endpoint="chat.completions", status=200,
        input_tokens=12, output_tokens=5, cached_tokens=4, ttft_ms=80, total_ms=900,
    )  # fmt: skip
    metrics.observe_request(model="m-metrics", organization="acme", status=429, error_code="rate_limited", total_ms=3)

    found = families()

    requests = found["b3os_requests"]
    assert requests.type == "counter"
    assert sample(requests, "_total", model="m-metrics", organization="acme", status="200") == 1
    assert sample(requests, "_total", model="m-metrics", status="429", code="rate_limited") == 1
    assert sample(found["b3os_tokens"], "_total", model="m-metrics", kind="input") == 12
    assert sample(found["b3os_tokens"], "_total", model="m-metrics", kind="cached") == 4
    assert found["b3os_time_to_first_token_seconds"].type == "histogram"
    assert sample(found["b3os_time_to_first_token_seconds"], "_bucket", model="m-metrics", le="0.1") == 1
    assert sample(found["b3os_request_duration_seconds"], "_count", model="m-metrics", endpoint="chat.completions") == 1


def test_metrics_show_requests_in_flight_and_requests_refused_by_a_limit() -> None:
    gauge = metrics.in_flight("m-gauge")
    gauge.inc()
    gauge.inc()
    gauge.dec()
    metrics.rejected(model="m-gauge", organization="acme", limit="tokens_per_minute")

    found = families()

    assert sample(found["b3os_requests_in_flight"], model="m-gauge") == 1
    assert sample(found["b3os_rejected_requests"], "_total", model="m-gauge", limit="tokens_per_minute") == 1
    assert "process_resident_memory_bytes" in found


def test_metrics_speak_openmetrics_to_a_scraper_that_asks_for_it() -> None:
    response = Client().get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})

    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.rstrip().endswith(b"# EOF")


@override_settings(METRICS_TOKEN="scrape-me")
def test_metrics_need_the_token_when_one_is_set() -> None:
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "Bearer scrape-me"}).status_code == 200


# --- /health ----------------------------------------------------------------------------------------


async def get_health() -> tuple[int, dict[str, Any]]:
    response = await AsyncClient().get("/health")
    return response.status_code, response.json()


async def test_health_says_the_database_answers_redis_is_absent_and_the_model_can_run(
    catalog_model: CatalogEntry,
) -> None:
    status, body = await get_health()

    assert status == 200
    assert body["status"] == "ok" and body["mode"] == "embedded"
    assert body["database"]["status"] == "ok" and body["database"]["latency_ms"] >= 0
    assert body["redis"]["status"] == "absent"
    [model] = body["models"]
    assert model["id"] == MODEL_ID and model["status"] == "ok"
    assert model["workers"] in {"loaded", "loadable"}
    assert model["queue"] == catalog_model.queue


async def test_a_model_whose_weights_are_missing_degrades_health(catalog_model: CatalogEntry) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/missing", runner_settings={"model_path": "/nowhere/model.gguf"})
    await CatalogEntry.objects.acreate(public_id="b3os/off", enabled=False, runner_settings={"model_path": "/nowhere"})

    status, body = await get_health()

    assert status == 200 and body["status"] == "degraded"
    missing = {m["id"]: m for m in body["models"]}["b3os/missing"]
    assert missing["status"] == "error" and missing["workers"] == "unavailable"
    assert "/nowhere/model.gguf" in missing["detail"]
    assert "b3os/off" not in {m["id"] for m in body["models"]}


async def test_health_is_down_with_503_when_the_database_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable() -> None:
        raise OperationalError("could not connect to server")

    monkeypatch.setattr(health, "_ping_database", unreachable)

    status, body = await get_health()

    assert status == 503 and body["status"] == "down"
    assert body["database"]["status"] == "error" and body["database"]["latency_ms"] is None
    assert body["database"]["detail"] == "OperationalError: could not connect to server"


@override_settings(DISTRIBUTED=True, REDIS_URL="redis://127.0.0.1:1/0")
async def test_health_is_down_when_redis_is_configured_but_does_not_answer(catalog_model: CatalogEntry) -> None:
    status, body = await get_health()

    assert status == 503 and body["status"] == "down" and body["mode"] == "distributed"
    assert body["redis"]["status"] == "error"


def test_in_distributed_mode_a_model_is_healthy_when_a_worker_consumes_its_queue(catalog_model: CatalogEntry) -> None:
    idle = CatalogEntry.objects.create(public_id="b3os/idle", runner_settings={})
    replies = {
        "celery@gpu-1": [{"name": catalog_model.queue, "exchange": {"name": catalog_model.queue}}],
        "celery@gpu-2": [{"name": catalog_model.queue}, {"name": "celery"}],
    }

    served, unserved = health.distributed_models([catalog_model, idle], replies)

    assert (served.status, served.workers, served.hosts) == ("ok", "2 worker(s)", ["celery@gpu-1", "celery@gpu-2"])
    assert (unserved.status, unserved.workers) == ("error", "none")
    assert unserved.detail == "no worker consumes the queue model.b3os.idle"
    assert [m.status for m in health.distributed_models([catalog_model], None)] == ["error"]


def test_health_and_metrics_answer_get_only() -> None:
    assert Client().post("/health").status_code == 405
    assert Client().post("/metrics").status_code == 405
