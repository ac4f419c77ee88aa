"""Redis or the database away: requests are refused with 503 and a time to retry, and usage records wait for the
database instead of being lost. (tests/deploy/test_faults.py takes the real servers away mid-traffic.)"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions as redis_errors
from channels_redis.pubsub import RedisPubSubChannelLayer
from django.db import OperationalError
from django.test import override_settings

from core import redis as core_redis
from core.logs import OutageLogFilter
from core.outages import Misconfigured, unavailable_service
from inference.api import errors
from inference.engine import dispatch
from inference.engine.exceptions import NotStarted
from inference.models import UsageRecord
from inference.usage import metrics, records
from orgs.models import Organization
from orgs.services import create_api_key
from tests.conftest import API, MODEL_ID, wait_until
from tests.services import Redis, free_port

pytestmark = pytest.mark.database

CHAT = "/v1/infer/chat/completions"
ASK = {"model": MODEL_ID, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def sample(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


@pytest.fixture
def redis_away() -> Iterator[None]:
    """Distributed mode with nothing listening where Redis should be."""
    core_redis._async_clients.clear()
    with override_settings(DISTRIBUTED=True, REDIS_URL=f"redis://127.0.0.1:{free_port()}/0"):
        yield
    core_redis._async_clients.clear()


async def test_a_request_while_redis_cannot_be_reached_is_a_503_with_retry_after(api: API, redis_away: None) -> None:
    before = sample("b3os_unavailable_responses_total", service="redis")
    started = time.monotonic()

    response = await api.post(CHAT, ASK)

    assert response.status_code == 503
    assert response.json()["error"] == {
        "message": "The service is temporarily unavailable. Try again in 2 seconds.",
        "type": "server_error",
        "param": None,
        "code": "service_unavailable",
    }
    assert response["Retry-After"] == "2"
    assert time.monotonic() - started < 1.0
    assert sample("b3os_unavailable_responses_total", service="redis") == before + 1


def test_a_job_that_could_not_be_queued_is_a_503_counted_as_redis_unavailable() -> None:
    before = sample("b3os_unavailable_responses_total", service="redis")
    failed = NotStarted("service_unavailable", "the job could not be queued", retry_after=2, outage="redis")

    response = errors.render_exception(failed, None)

    assert response.status_code == 503
    assert sample("b3os_unavailable_responses_total", service="redis") == before + 1


@pytest.mark.parametrize(
    ("code", "why"),
    [("no_worker", "no worker serves the queue"), ("service_unavailable", "the worker that took it died")],
)
def test_a_job_no_worker_took_or_whose_worker_died_is_no_outage_of_redis(code: str, why: str) -> None:
    before = sample("b3os_unavailable_responses_total", service="redis")

    response = errors.render_exception(NotStarted(code, why, retry_after=2), None)

    assert response.status_code == 503
    assert sample("b3os_unavailable_responses_total", service="redis") == before


# --- usage records while the database is away ------------------------------------------------------------


def meter(organization: Organization, request_id: str) -> records.Meter:
    return records.Meter(
        organization_id=organization.pk,
        organization=organization.slug,
        api_key_id=None,
        model=MODEL_ID,
        endpoint="chat.completions",
        route="node",
        request_id=request_id,
    )


@pytest.fixture
def database_away(monkeypatch: pytest.MonkeyPatch) -> Callable[[bool], None]:
    """Switches the usage writer's database away (every insert fails to connect) and back."""
    insert = records._insert
    away = {"now": False}

    def flaky(rows: list[dict[str, Any]]) -> None:
        if away["now"]:
            raise OperationalError("connection to server failed: Connection refused")
        insert(rows)

    monkeypatch.setattr(records, "_insert", flaky)
    return lambda state: away.__setitem__("now", state)


def written(*request_ids: str) -> set[str]:
    return set(UsageRecord.objects.filter(request_id__in=request_ids).values_list("request_id", flat=True))


def test_usage_records_wait_for_the_database_and_are_written_once_it_is_back(
    organization: Organization, database_away: Callable[[bool], None]
) -> None:
    dropped = sample("b3os_usage_records_dropped_total", reason="database_unavailable")
    database_away(True)
    for request_id in ("req_a", "req_b", "req_c"):
        meter(organization, request_id).record(status=200)
    records.flush(timeout=1.0)
    assert written("req_a", "req_b", "req_c") == set()
    assert sample("b3os_usage_records_pending") == 3

    database_away(False)
    records.flush(timeout=5.0)

    assert written("req_a", "req_b", "req_c") == {"req_a", "req_b", "req_c"}
    assert sample("b3os_usage_records_pending") == 0
    assert sample("b3os_usage_records_dropped_total", reason="database_unavailable") == dropped


@override_settings(USAGE_MAX_PENDING_RECORDS=2)
def test_past_the_pending_bound_the_oldest_records_are_dropped_and_counted(
    organization: Organization, database_away: Callable[[bool], None]
) -> None:
    dropped = sample("b3os_usage_records_dropped_total", reason="database_unavailable")
    database_away(True)
    for request_id in ("req_1", "req_2", "req_3", "req_4", "req_5"):
        meter(organization, request_id).record(status=200)
    records.flush(timeout=1.0)

    database_away(False)
    records.flush(timeout=5.0)

    assert written("req_1", "req_2", "req_3", "req_4", "req_5") == {"req_4", "req_5"}
    assert sample("b3os_usage_records_dropped_total", reason="database_unavailable") == dropped + 3


def test_a_row_the_database_refuses_costs_only_itself(organization: Organization) -> None:
    refused = sample("b3os_usage_records_dropped_total", reason="refused")
    meter(organization, "req_good_1").record(status=200)
    bad = meter(organization, "req_bad")
    bad.record(status=-1)  # the column holds no negative number
    meter(organization, "req_good_2").record(status=200)

    records.flush(timeout=5.0)

    assert written("req_good_1", "req_bad", "req_good_2") == {"req_good_1", "req_good_2"}
    assert sample("b3os_usage_records_dropped_total", reason="refused") == refused + 1


def test_a_request_whose_key_was_deleted_while_it_ran_is_recorded_without_the_key(organization: Organization) -> None:
    create_api_key(organization=organization, name="deleted mid-request")
    key = organization.api_keys.get(name="deleted mid-request")
    running = meter(organization, "req_key_gone")
    running.api_key_id = key.pk
    key.delete()  # as the admin's shell or a fixture may: the key's earlier records keep their rows, keyless

    running.record(status=200, input_tokens=5, output_tokens=7)
    records.flush(timeout=5.0)

    record = UsageRecord.objects.get(request_id="req_key_gone")
    assert (record.organization_id, record.api_key_id, record.input_tokens, record.output_tokens) == (
        organization.pk,
        None,
        5,
        7,
    )


def test_a_request_whose_organization_was_deleted_while_it_ran_goes_with_its_records_said_so_without_a_traceback(
    transactional_db: None, caplog: pytest.LogCaptureFixture
) -> None:
    gone = Organization.objects.create(slug="gone-mid-request", name="Gone")
    running = meter(gone, "req_org_gone")
    gone.delete()
    before = sample("b3os_usage_records_dropped_total", reason="organization_deleted")

    with caplog.at_level(logging.WARNING, logger="inference.usage.records"):
        running.record(status=200)
        records.flush(timeout=5.0)

    assert written("req_org_gone") == set()
    assert sample("b3os_usage_records_dropped_total", reason="organization_deleted") == before + 1
    [line] = [r for r in caplog.records if "req_org_gone" in r.getMessage()]
    assert (line.levelname, line.exc_info) == ("WARNING", None)
    assert "deleted organization" in line.getMessage()


@pytest.fixture
def redis_refusing_writes(tmp_path: Path) -> Iterator[Redis]:
    """Distributed mode on a Redis that refuses writes: a replica (after a failover) of a master that is gone."""
    server = Redis(tmp_path).start()
    server.cli("replicaof", "127.0.0.1", str(free_port()))
    core_redis._async_clients.clear()
    core_redis._sync_client = None
    with override_settings(DISTRIBUTED=True, REDIS_URL=server.url):
        yield server
    core_redis._async_clients.clear()
    core_redis._sync_client = None
    server.stop()


@pytest.fixture
def redis_failing_to_save(tmp_path: Path) -> Iterator[Redis]:
    """Distributed mode on a Redis that refuses writes because its last save failed (its directory is gone)."""
    directory = tmp_path / "redis"
    directory.mkdir()
    server = Redis(directory).start()
    server.cli("config", "set", "save", "3600 1")  # saves, so a failed save stops writes
    shutil.rmtree(directory)
    server.cli("bgsave")
    assert wait_until(lambda: "rdb_last_bgsave_status:err" in server.cli("info", "persistence"))
    core_redis._async_clients.clear()
    with override_settings(DISTRIBUTED=True, REDIS_URL=server.url):
        yield server
    core_redis._async_clients.clear()
    assert server.process is not None
    server.process.kill()  # told to stop, it would try to save first, which it cannot
    server.process.wait()


@pytest.mark.django_db(transaction=True)  # its usage record is written, by the writer's thread
async def test_redis_refusing_writes_as_it_cannot_save_is_an_outage_answered_503(
    api: API, redis_failing_to_save: Redis
) -> None:
    with pytest.raises(Misconfigured):  # as redis-py reads Redis's MISCONF reply
        await core_redis.async_client().set("k", "v")
    before = sample("b3os_unavailable_responses_total", service="redis")

    response = await api.post(CHAT, ASK)

    assert response.status_code == 503, response.content
    assert response.json()["error"]["code"] == "service_unavailable" and response["Retry-After"]
    # Its job could not be queued: counted as Redis's outage, as the dispatch told the generation.
    assert sample("b3os_unavailable_responses_total", service="redis") == before + 1


@pytest.mark.parametrize(
    "refusal",
    [
        redis_errors.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
        redis_errors.ReadOnlyError("You can't write against a read only replica."),
        redis_errors.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
    ],
    ids=["out-of-memory", "read-only-replica", "master-down"],
)
def test_redis_refusing_writes_for_the_state_it_is_in_is_an_outage_answered_503(refusal: Exception) -> None:
    assert unavailable_service(refusal) == "redis"
    assert errors.to_api_error(refusal, None).body()["error"]["code"] == "service_unavailable"  # type: ignore[union-attr]


async def test_a_connection_to_a_node_refusing_writes_as_a_replica_is_dropped_and_the_command_tried_on_a_new_one(
    redis_refusing_writes: Redis,
) -> None:
    # After a failover the name points at the new master, which only a new connection reaches.
    for client in (core_redis.async_client(), core_redis.sync_client()):
        retry = client.connection_pool.connection_kwargs["retry"]
        assert {redis_errors.ReadOnlyError, redis_errors.MasterDownError} <= set(retry._supported_errors)

    with pytest.raises(redis_errors.ReadOnlyError):  # the same node behind the name: refused again, and said
        await core_redis.async_client().set("k", "v")


def test_a_workers_presence_outlives_redis_refusing_writes_and_is_said_again_once_it_takes_them(
    redis_refusing_writes: Redis,
) -> None:
    presence = dispatch.WorkerPresence(["a-queue"]).start()
    try:
        time.sleep(dispatch.PRESENCE_BEAT_SECONDS * 1.5)  # a beat or two refused
        redis_refusing_writes.cli("replicaof", "no", "one")  # promoted, as after a failover

        deadline = time.monotonic() + 5
        while (
            time.monotonic() < deadline and redis_refusing_writes.cli("exists", dispatch.presence_key("a-queue")) != "1"
        ):
            time.sleep(0.1)
        assert redis_refusing_writes.cli("exists", dispatch.presence_key("a-queue")) == "1"
    finally:
        presence.stop()


# --- what the log says while Redis is away -----------------------------------------------------------------


async def test_while_redis_is_away_the_channel_layer_says_so_on_one_line_and_not_every_second(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the process starts: an outage another test of this process met within the minute is not told again.
    monkeypatch.setattr(logging.getLogger("channels_redis.pubsub"), "filters", [OutageLogFilter()])
    redis = Redis(tmp_path).start()
    layer = RedisPubSubChannelLayer(hosts=[redis.url])
    channel = await layer.new_channel()
    receive = asyncio.ensure_future(layer.receive(channel))

    def layer_records() -> list[logging.LogRecord]:
        return [record for record in caplog.records if record.name == "channels_redis.pubsub"]

    try:
        await asyncio.sleep(0.5)  # subscribed
        redis.stop()
        # Its first try fails once redis-py's own retries have (up to seconds apart): then it tries again each second.
        deadline = time.monotonic() + 30
        while not layer_records() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await asyncio.sleep(3.5)
    finally:
        receive.cancel()
        await asyncio.gather(receive, return_exceptions=True)
        redis.stop()

    told = layer_records()
    assert [record.getMessage().split(": ")[:2] for record in told][:1] == [
        ["Unexpected exception in receive task", "ConnectionError"]
    ]
    assert len([record for record in told if "receive task" in record.getMessage()]) == 1
    assert all(record.exc_info is None for record in told)


def test_an_outage_repeated_is_told_again_after_the_interval_with_how_many_were_held_back() -> None:
    log = logging.getLogger("tests.outage_filter")
    log.propagate = False
    told: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: told.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    log.addFilter(OutageLogFilter(interval=0.2))
    try:
        for _ in range(5):
            try:
                raise redis_errors.ConnectionError("Connection refused")
            except redis_errors.ConnectionError:
                log.exception("Lost Redis:")
        log.error("a bug, not an outage")
        time.sleep(0.25)
        try:
            raise redis_errors.ConnectionError("Connection refused")
        except redis_errors.ConnectionError:
            log.exception("Lost Redis:")
    finally:
        log.removeHandler(handler)

    assert told == [
        "Lost Redis: ConnectionError: Connection refused",
        "a bug, not an outage",
        "Lost Redis: ConnectionError: Connection refused (4 more like it in the last 0.2 s)",
    ]
