"""Two API processes sharing one Redis: how long a revoked key goes on working in each, measured.

Announced (the admin's revocation bumps the version in Redis on commit), it works in neither process from
the first request after the commit. Unannounced (the bump lost to a Redis failure, or a Redis restart that
reset the counter; here a change written straight into the database), each process reads the key again once
its remembered copy is ``API_KEY_CACHE_SECONDS`` old.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest

from tests.conftest import LiveServer, start_server, stop_server
from tests.inference.test_distributed import start_redis

pytestmark = pytest.mark.distributed

CACHE_SECONDS = 3
POLL_SECONDS = 0.05


@dataclass
class TwoProcesses:
    servers: list[LiveServer]

    def new_key(self) -> str:
        key = self.servers[0].manage("create_key", self.servers[0].org).strip()
        for server in self.servers:  # each process authenticates it once, and remembers it
            assert status(server, key) == 200
        return key


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoProcesses]:
    var_dir = tmp_path_factory.mktemp("revocation")
    redis, url = start_redis(var_dir)
    extra = {"REDIS_URL": url, "API_KEY_CACHE_SECONDS": str(CACHE_SECONDS)}
    servers = [start_server(var_dir, extra_env=extra, org="keys") for _ in range(2)]
    yield TwoProcesses(servers)
    for server in servers:
        stop_server(server)
    redis.terminate()


def status(server: LiveServer, key: str) -> int:
    return httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {key}"}, timeout=10).status_code


def seconds_until_refused(servers: list[LiveServer], key: str, since: float, *, give_up: float) -> list[float]:
    """For each process, the seconds from ``since`` to its first 401 for ``key``."""
    refused: dict[int, float] = {}
    while len(refused) < len(servers):
        assert time.monotonic() - since < give_up, f"still accepted after {give_up} s by {len(servers) - len(refused)}"
        for index, server in enumerate(servers):
            if index not in refused and status(server, key) == 401:
                refused[index] = time.monotonic() - since
        time.sleep(POLL_SECONDS)
    return [refused[index] for index in range(len(servers))]


def test_a_key_revoked_as_the_admin_does_is_refused_by_every_process_at_once(two_processes: TwoProcesses) -> None:
    key = two_processes.new_key()
    prefix = key.split("_")[1]

    two_processes.servers[0].manage(
        "shell", "-c", f"from orgs.models import APIKey; APIKey.objects.get(prefix={prefix!r}).revoke()"
    )
    revoked = time.monotonic()

    took = seconds_until_refused(two_processes.servers, key, revoked, give_up=CACHE_SECONDS)
    print(f"announced revocation refused after {', '.join(f'{t * 1000:.0f} ms' for t in took)}")
    assert max(took) < 1.0


def test_a_revocation_no_process_is_told_of_is_refused_by_every_process_within_the_cache_age(
    two_processes: TwoProcesses,
) -> None:
    key = two_processes.new_key()
    remembered = time.monotonic()

    two_processes.servers[0].query(
        "UPDATE orgs_apikey SET revoked_at = ? WHERE prefix = ?",
        datetime.now(UTC).isoformat(sep=" "),
        key.split("_")[1],
    )
    revoked = time.monotonic()

    assert [status(server, key) for server in two_processes.servers] == [200, 200]  # remembered, and trusted
    took = seconds_until_refused(two_processes.servers, key, revoked, give_up=3 * CACHE_SECONDS)
    print(f"unannounced revocation refused after {', '.join(f'{t:.2f} s' for t in took)}")
    assert max(took) <= CACHE_SECONDS - (revoked - remembered) + 0.5
