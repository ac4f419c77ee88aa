"""Faults with real processes, on the topology started from deploy/: a worker killed mid-stream, Redis and
PostgreSQL taken away mid-traffic and brought back, and a crowd of clients hanging up at once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import wait_until
from tests.deploy.topology import Topology, rss_bytes, sum_samples
from tests.deploy.traffic import MODEL, Outcome, Phases, Request, chat, closed_loop, responses, send, summary

LONG_STORY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell a long story about a river."}],
    "max_tokens": 1500,
    "temperature": 0.9,
    "stream": True,
}

# A stream held to a long array: the model cannot end it on its own within a grace period.
HELD_OPEN = {
    **LONG_STORY,
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "numbers", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},
    },
}

pytestmark = pytest.mark.distributed


def jobs_received(topology: Topology, worker: str) -> int:
    return len(re.findall(r"Task inference\.generate\[[^]]+\] received", topology.running[worker].output()))


def in_flight(topology: Topology) -> float:
    return sum(sum_samples(topology.metrics(n), "b3os_requests_in_flight") for n in (1, 2))


def usage_of(topology: Topology, request_id: str) -> list[tuple[int, str]]:
    return topology.sql("select status, error_code from inference_usagerecord where request_id = %s", request_id)


class Traffic:
    """Closed-loop clients through the load balancer on a thread of their own, while the test breaks things."""

    def __init__(
        self, topology: Topology, key: str, mix: list[tuple[Request, float]], *, clients: int, duration: float
    ) -> None:
        self.outcomes: list[Outcome] = []
        self.started = time.monotonic()

        def run() -> None:
            self.outcomes = asyncio.run(
                closed_loop(base_url=topology.url, key=key, mix=mix, clients=clients, duration=duration, timeout=30)
            )

        self.thread = threading.Thread(target=run, name="traffic")
        self.thread.start()

    def at(self, seconds: float) -> float:
        """Sleeps until ``seconds`` into the traffic; the monotonic time then."""
        time.sleep(max(0.0, self.started + seconds - time.monotonic()))
        return time.monotonic()

    def join(self) -> list[Outcome]:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive(), "the clients did not finish"
        return self.outcomes


MIXED = [
    (chat(gateway=True), 3.0),
    (chat(gateway=True, stream=True), 3.0),
    (responses(gateway=True), 1.0),
    (chat(stream=True, max_tokens=6), 1.0),
    (chat(max_tokens=6), 1.0),
]


def assert_outage_was_handled(phases: Phases, pids_before: dict[str, int], topology: Topology) -> None:
    everything = phases.before + phases.during + phases.after
    assert [o.problem for o in everything if o.problem] == [], (
        f"before: {summary(phases.before)}\nduring: {summary(phases.during)}\nafter: {summary(phases.after)}"
    )
    # While a part is away requests may fail, but only with 503 and a time to retry: never a 500, never a hang.
    assert {o.status for o in everything} <= {200, 503}, summary(everything)
    assert all(o.retry_after for o in everything if o.status == 503)
    assert any(o.status == 503 or o.error_code for o in phases.during), summary(phases.during)
    # Recovered without a restart: the same processes, answering everything again.
    assert {name: running.pid for name, running in topology.running.items()} == pids_before
    assert phases.before and all(o.status == 200 and not o.error_code for o in phases.before), summary(phases.before)
    assert phases.after and all(o.status == 200 and not o.error_code for o in phases.after), summary(phases.after)


WORKERS = ("smollm2", "smollm2.2")


@dataclass
class WorkerFault:
    """A stream whose worker was made to fail after its third event: which worker, the stream's events, how long it
    went on after, and the organization's key (it may hold one request in flight)."""

    worker: str = ""
    request_id: str = ""
    events: list[str] = field(default_factory=list)
    ended_after: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def last_error(self) -> str:
        return str(json.loads(self.events[-1])["error"]["code"])


def stream_while_its_worker_fails(
    topology: Topology, slug: str, body: dict[str, Any], fail: Callable[[str], None], fault: WorkerFault
) -> None:
    """Streams ``body`` through API process 1 and calls ``fail`` with the name of the worker serving it after the
    stream's third event; fills in ``fault`` as it goes, so that a test's cleanup knows the worker even on failure."""
    fault.headers = {"Authorization": f"Bearer {topology.organization(slug, '--in-flight', '1')}"}
    received = {name: jobs_received(topology, name) for name in WORKERS}
    url = topology.api_url(1) + "/v1/infer/chat/completions"
    failed_at = 0.0
    with httpx.stream("POST", url, json=body, headers=fault.headers, timeout=60) as response:
        fault.request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: "):
                fault.events.append(line[6:])
            if len(fault.events) == 3 and not fault.worker:
                fault.worker = next(n for n, count in received.items() if jobs_received(topology, n) > count)
                failed_at = time.monotonic()  # before: ``fail``'s signal may reach the worker before it returns
                fail(fault.worker)
    fault.ended_after = time.monotonic() - failed_at


def assert_the_other_worker_serves_on(topology: Topology, fault: WorkerFault) -> None:
    # The organization may hold one request in flight: the failed one's slot is free again.
    assert wait_until(lambda: in_flight(topology) == 0, 5)
    survivor = WORKERS[1] if fault.worker == WORKERS[0] else WORKERS[0]
    before = jobs_received(topology, survivor)
    url = topology.api_url(1) + "/v1/infer/chat/completions"
    answer = httpx.post(url, json={**LONG_STORY, "max_tokens": 4, "stream": False}, headers=fault.headers, timeout=60)
    assert answer.status_code == 200, answer.text
    assert jobs_received(topology, survivor) == before + 1


def test_a_worker_killed_mid_stream_ends_the_stream_with_worker_lost_and_the_other_worker_serves_on(
    topology: Topology,
) -> None:
    silence = float(topology.values["WORKER_SILENCE_TIMEOUT_SECONDS"])
    fault = WorkerFault()

    def kill(name: str) -> None:
        os.kill(topology.running[name].pid, signal.SIGKILL)

    try:
        stream_while_its_worker_fails(topology, "killed", LONG_STORY, kill, fault)

        assert fault.last_error == "worker_lost"
        assert fault.ended_after <= silence + 1.0
        assert wait_until(lambda: usage_of(topology, fault.request_id) == [(200, "worker_lost")], 10)
        assert_the_other_worker_serves_on(topology, fault)
    finally:
        if fault.worker:
            topology.stop(fault.worker)
            topology.start("smollm2", copy=2 if fault.worker == WORKERS[1] else 1)


def test_a_worker_stopped_mid_stream_as_honcho_stops_it_ends_the_stream_cleanly_and_the_other_worker_serves_on(
    topology: Topology,
) -> None:
    grace = float(topology.values["SHUTDOWN_GRACE_SECONDS"])
    log = {name: topology.running[name].log for name in WORKERS}
    stopping = threading.Thread()
    fault = WorkerFault()

    def stop(name: str) -> None:
        nonlocal stopping
        stopping = threading.Thread(target=topology.stop, args=(name,))  # honcho passes SIGTERM on
        stopping.start()

    try:
        stream_while_its_worker_fails(topology, "stopped", HELD_OPEN, stop, fault)
        stopping.join(timeout=30)

        # Streamed through the grace period, then ended with an error its client retries, before honcho's kill.
        assert fault.last_error == "server_shutting_down"
        assert grace <= fault.ended_after < 5
        output = log[fault.worker].read_text()
        assert f"ended 1 jobs still running after the {grace:g}s grace period" in output
        assert "stopped (rc=0)" in output, output[-2000:]
        assert wait_until(lambda: usage_of(topology, fault.request_id) == [(200, "server_shutting_down")], 10)
        assert_the_other_worker_serves_on(topology, fault)
    finally:
        if fault.worker:
            stopping.join(timeout=30)
            topology.start("smollm2", copy=2 if fault.worker == WORKERS[1] else 1)


def test_redis_stopped_mid_traffic_is_a_503_with_retry_after_until_it_is_back(topology: Topology) -> None:
    # With limits, admission asks Redis on every request, as the key check does.
    key = topology.organization("redis-outage", "--rpm", "1000000", "--in-flight", "1000")
    pids = {name: running.pid for name, running in topology.running.items()}

    traffic = Traffic(topology, key, MIXED, clients=8, duration=20)
    fault_at = traffic.at(4)
    topology.redis.stop()
    traffic.at(9)
    topology.redis.start()
    repaired_at = traffic.at(9) + 7  # the workers reconnect to the broker within a few seconds
    outcomes = traffic.join()

    assert_outage_was_handled(Phases.split(outcomes, fault_at=fault_at, repaired_at=repaired_at), pids, topology)


def test_postgres_restarted_mid_traffic_is_a_503_with_retry_after_and_keeps_every_usage_record(
    topology: Topology,
) -> None:
    # The key check, the limits and the catalog are each cached for seconds: traffic reaches the database anyway.
    key = topology.organization("pg-outage", "--rpm", "1000000")
    pids = {name: running.pid for name, running in topology.running.items()}
    dropped_before = sum(sum_samples(topology.metrics(n), "b3os_usage_records_dropped_total") for n in (1, 2))

    traffic = Traffic(topology, key, MIXED, clients=8, duration=20)
    fault_at = traffic.at(4)
    topology.postgres.stop()
    traffic.at(10)
    topology.postgres.start()
    repaired_at = traffic.at(10) + 4
    outcomes = traffic.join()

    assert_outage_was_handled(Phases.split(outcomes, fault_at=fault_at, repaired_at=repaired_at), pids, topology)
    admitted = {o.request_id for o in outcomes if o.status == 200}
    dropped = sum(sum_samples(topology.metrics(n), "b3os_usage_records_dropped_total") for n in (1, 2)) - dropped_before

    def recorded() -> set[str]:
        rows = topology.sql("select request_id from inference_usagerecord where request_id = any(%s)", list(admitted))
        return {row[0] for row in rows}

    assert wait_until(lambda: len(recorded()) + dropped >= len(admitted), 20)
    assert len(recorded()) + dropped == len(admitted)
    assert dropped == 0


def test_two_hundred_clients_hanging_up_mid_stream_free_every_slot_job_and_sequence(topology: Topology) -> None:
    key = topology.organization("hangups", "--in-flight", "1000")
    processes = ["api1", "api2", "smollm2", "smollm2.2"]
    story = Request("chat/node/stream", "/v1/infer/chat/completions", LONG_STORY)

    async def crowd() -> list[Outcome]:
        limits = httpx.Limits(max_connections=220, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(send(client, topology.url, key, story, hang_up_after=1) for _ in range(200)))

    def settled() -> bool:
        # Admission slots are scored by when they expire; expired ones are swept by the next admission.
        now = topology.redis.cli("time").split()[0]
        slots = topology.redis.cli("--scan", "--pattern", "b3os:lim:*:slots").split()
        held = sum(int(topology.redis.cli("zcount", slot, f"({now}", "+inf")) for slot in slots)
        return in_flight(topology) == 0 and held == 0

    def round_of_hang_ups() -> dict[str, int]:
        outcomes = asyncio.run(crowd())
        # The workers hold 40 jobs and Redis a backlog of JOB_BACKLOG_MAX more: the rest are refused at once, and
        # those that were not refused hang up mid-stream, however long they waited for a worker.
        ended = Counter((o.status, o.error_code) for o in outcomes)
        assert set(ended) <= {(200, "client_hung_up"), (503, "overloaded")}, summary(outcomes)
        assert ended[(200, "client_hung_up")] >= 2 * int(topology.values["SMOLLM2_CONCURRENCY"]), summary(outcomes)
        assert wait_until(settled, 30), f"in flight: {in_flight(topology)}"
        return {name: rss_bytes(topology.running[name].pid) for name in processes}

    first = round_of_hang_ups()  # the first round also allocates what the processes keep for the next
    second = round_of_hang_ups()

    # Every sequence and queue place of both workers' runners is free: as many jobs as they hold, all served.
    capacity = 2 * int(topology.values["SMOLLM2_CONCURRENCY"])
    quick = asyncio.run(
        closed_loop(
            base_url=topology.url, key=key, mix=[(chat(max_tokens=2), 1.0)], clients=capacity, duration=0.1, timeout=60
        )
    )
    assert [(o.status, o.error_code) for o in quick] == [(200, "")] * len(quick), summary(quick)
    grown = {name: (second[name] - first[name]) // 2**20 for name in processes}
    assert all(megabytes <= 20 for megabytes in grown.values()), grown
