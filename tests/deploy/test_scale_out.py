"""Two API processes behind HAProxy and two workers on the model's queue, started from deploy/, serve as one node."""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import pytest

from tests.deploy.topology import Topology, sum_samples
from tests.deploy.traffic import Outcome, chat, send

pytestmark = pytest.mark.distributed


async def burst(topology: Topology, key: str, count: int, **request: object) -> list[Outcome]:
    """``count`` requests at once through the load balancer."""
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        return await asyncio.gather(*(send(client, topology.url, key, chat(**request)) for _ in range(count)))  # type: ignore[arg-type]


def requests_served(topology: Topology, number: int) -> float:
    return sum_samples(topology.metrics(number), "b3os_requests_total", status="200")


def jobs_received(topology: Topology, worker: str) -> int:
    return len(re.findall(r"Task inference\.generate\[[^]]+\] received", topology.running[worker].output()))


def test_the_balancer_spreads_requests_over_both_api_processes(topology: Topology) -> None:
    key = topology.organization("spread")
    before = [requests_served(topology, 1), requests_served(topology, 2)]

    outcomes = asyncio.run(burst(topology, key, 40, gateway=True, stream=True))

    assert [o.status for o in outcomes] == [200] * 40
    served = [requests_served(topology, 1) - before[0], requests_served(topology, 2) - before[1]]
    assert sum(served) == 40
    assert min(served) >= 10


def test_both_workers_take_jobs_from_the_model_queue(topology: Topology) -> None:
    key = topology.organization("workers")
    before = {name: jobs_received(topology, name) for name in ("smollm2", "smollm2.2")}

    outcomes = asyncio.run(burst(topology, key, 12, stream=True, max_tokens=24))

    assert [(o.status, o.ended_properly, o.error_code) for o in outcomes] == [(200, True, "")] * 12
    taken = {name: jobs_received(topology, name) - count for name, count in before.items()}
    assert sum(taken.values()) == 12
    assert min(taken.values()) >= 1


def test_a_requests_per_minute_limit_admits_exactly_its_number_across_both_api_processes(topology: Topology) -> None:
    key = topology.organization("race", "--rpm", "50")

    outcomes = asyncio.run(burst(topology, key, 200, gateway=True))

    statuses = [o.status for o in outcomes]
    assert statuses.count(200) == 50
    assert statuses.count(429) == 150
    assert {o.error_code for o in outcomes if o.status == 429} == {"rate_limited"}
    assert all(o.retry_after for o in outcomes if o.status == 429)


def test_beat_schedules_the_usage_rollup_and_the_housekeeping_worker_runs_it(topology: Topology) -> None:
    ran = re.compile(r"Task inference\.rollup_usage\[[^]]+\] succeeded")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not ran.search(topology.running["housekeeping"].output()):
        time.sleep(0.5)

    assert "Sending due task rollup-usage" in topology.running["beat"].output()
    assert ran.search(topology.running["housekeeping"].output())
