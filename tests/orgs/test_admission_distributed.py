"""Two API processes, one Redis, many concurrent clients: no limit is ever exceeded."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL_ID, LiveServer, start_server, stop_server
from tests.inference.test_distributed import Worker, start_redis, start_worker

pytestmark = pytest.mark.distributed


@dataclass
class TwoServers:
    servers: list[LiveServer]
    worker: Worker

    def key_for(self, org: str) -> str:
        return self.servers[0].new_key(org)


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoServers]:
    var_dir: Path = tmp_path_factory.mktemp("limits")
    redis, url = start_redis(var_dir)
    extra = {"REDIS_URL": url}
    servers = [start_server(var_dir, extra_env=extra, org="conc"), start_server(var_dir, extra_env=extra, org="conc")]
    worker = start_worker(servers[0].env, var_dir / "worker.log")
    yield TwoServers(servers=servers, worker=worker)
    worker.stop()
    for server in servers:
        stop_server(server)
    redis.terminate()


def ask(**overrides: object) -> dict:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "temperature": 0,
        **overrides,
    }


async def fire(cluster: TwoServers, key: str, bodies: list[dict]) -> list[httpx.Response]:
    """Every body at once, alternating between the two API processes."""
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:

        async def one(index: int, body: dict) -> httpx.Response:
            server = cluster.servers[index % 2]
            if body.get("stream"):
                async with client.stream("POST", server.url + "/v1/infer/chat/completions", json=body) as response:
                    await response.aread()
                    return response
            return await client.post(server.url + "/v1/infer/chat/completions", json=body)

        return await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))


def admitted_records(cluster: TwoServers, org: str, expected: int) -> list[tuple[str, int]]:
    """The admitted requests' usage records, once the writers have caught up (they write off the request path)."""
    deadline = time.monotonic() + 10
    rows: list[tuple[str, int]] = []
    while time.monotonic() < deadline and len(rows) < expected:
        rows = cluster.servers[0].query(
            "select u.created, u.total_ms from inference_usagerecord u "
            "join orgs_organization o on o.id = u.organization_id where o.slug = ? and u.status = 200",
            org,
        )
        time.sleep(0.2)
    return rows


def test_requests_per_minute_hold_across_processes(two_servers: TwoServers) -> None:
    key = two_servers.key_for("conc-rpm")
    two_servers.servers[0].manage("set_limit", "conc-rpm", "--rpm", "7")
    responses = asyncio.run(fire(two_servers, key, [ask() for _ in range(30)]))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 7
    assert statuses.count(429) == 23
    assert {r.json()["error"]["code"] for r in responses if r.status_code == 429} == {"rate_limited"}
    assert len(admitted_records(two_servers, "conc-rpm", 7)) == 7


def test_tokens_per_minute_hold_across_processes(two_servers: TwoServers) -> None:
    key = two_servers.key_for("conc-tpm")
    probe = asyncio.run(fire(two_servers, key, [ask()]))[0].json()["usage"]["prompt_tokens"]
    per_request = probe + 1
    two_servers.servers[0].manage("set_limit", "conc-tpm", "--tpm", str(5 * per_request + per_request // 2))
    time.sleep(2.5)  # the probe ran unlimited; let both processes see the new limit
    responses = asyncio.run(fire(two_servers, key, [ask() for _ in range(24)]))
    statuses = [r.status_code for r in responses]
    assert statuses.count(200) == 5
    assert statuses.count(429) == 19


def test_requests_in_flight_never_exceed_the_limit(two_servers: TwoServers) -> None:
    key = two_servers.key_for("conc-flight")
    two_servers.servers[0].manage("set_limit", "conc-flight", "--in-flight", "2")
    bodies = [ask(stream=True, max_tokens=12) for _ in range(16)]
    responses = asyncio.run(fire(two_servers, key, bodies))
    assert {r.status_code for r in responses} <= {200, 429}
    assert any(r.status_code == 429 for r in responses)
    admitted = sum(r.status_code == 200 for r in responses)
    intervals = []
    for created, total_ms in admitted_records(two_servers, "conc-flight", admitted):
        start = datetime.fromisoformat(created).timestamp()
        intervals.append((start, start + total_ms / 1000))
    assert len(intervals) == admitted
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    peak = running = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    assert 1 <= peak <= 2


def test_a_client_that_hangs_up_mid_stream_frees_its_slot_in_flight_at_once(two_servers: TwoServers) -> None:
    key = two_servers.key_for("conc-hangup")
    two_servers.servers[0].manage("set_limit", "conc-hangup", "--in-flight", "1")
    time.sleep(2.5)  # let both processes see the new limit
    headers = {"Authorization": f"Bearer {key}"}
    story = ask(stream=True, max_tokens=200, messages=[{"role": "user", "content": "Tell a long story."}])
    with httpx.stream(
        "POST", two_servers.servers[0].url + "/v1/infer/chat/completions", json=story, headers=headers, timeout=60
    ) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: {"))
    hung_up = time.monotonic()

    # Freed when the stream is closed, not left to expire with the slot's time to live (15 s).
    while (
        answer := httpx.post(
            two_servers.servers[1].url + "/v1/infer/chat/completions", json=ask(), headers=headers, timeout=60
        )
    ).status_code == 429 and time.monotonic() - hung_up < 5:
        time.sleep(0.2)
    assert answer.status_code == 200, answer.text
