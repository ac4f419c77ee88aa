"""Many open streams on one API process: what each costs in memory, and what they do to other clients' requests.

One API process (deploy/Procfile's api1, distributed mode over Redis and PostgreSQL) and the fake upstream
(tests/fakes/openai_upstream.py) trickling each stream one chunk a second. First a few closed-loop clients send short
gateway requests with no stream open; then ``--streams`` clients open streams on the gateway route and keep reading
them, and once every one of them has its first chunk the same short requests are measured again. Memory per open
stream is the API process's resident memory with them open, less before, divided by their number.

    .venv/bin/python bench/connections.py [--streams 2000] [--clients 4] [--duration 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Results, build_request, run  # noqa: E402
from tests.deploy.topology import GATEWAY_MODEL, deployment, rss_bytes  # noqa: E402

PATH = "/v1/infer/chat/completions"


class Streams:
    """Slow streams on raw sockets (an HTTP client library per stream would cost the load generator more than the
    server): each sends its request, reads the head and the first chunk, then keeps reading until told to stop."""

    def __init__(self, host: str, port: int, request: bytes) -> None:
        self.host, self.port, self.request = host, port, request
        self.opened = 0
        self.failed: dict[str, int] = {}
        self.stop = asyncio.Event()

    async def one(self) -> None:
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
        except OSError as exc:
            self.failed[type(exc).__name__] = self.failed.get(type(exc).__name__, 0) + 1
            return
        try:
            writer.write(self.request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                self.failed[str(status)] = self.failed.get(str(status), 0) + 1
                return
            await reader.readuntil(b"\n\n")  # the end of the first event
            self.opened += 1
            while not self.stop.is_set():
                if not await reader.read(65536):
                    self.failed["ended early"] = self.failed.get("ended early", 0) + 1
                    return
        except (OSError, asyncio.IncompleteReadError) as exc:
            self.failed[type(exc).__name__] = self.failed.get(type(exc).__name__, 0) + 1
        finally:
            writer.close()


async def short_requests(host: str, port: int, key: str, clients: int, duration: float) -> Results:
    body = {
        "model": GATEWAY_MODEL,
        "route": "gateway",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
    }
    return await run(
        host=host,
        port=port,
        path=PATH,
        body=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}"},
        clients=clients,
        duration=duration,
        warmup=1.0,
    )


async def measure(
    host: str, port: int, key: str, pid: int, args: argparse.Namespace
) -> list[tuple[int, Results, float]]:
    await short_requests(host, port, key, args.clients, 3.0)  # warm: connection pools, caches, allocator
    idle = await short_requests(host, port, key, args.clients, args.duration)
    before = rss_bytes(pid)
    trickle = {
        "model": "trickle",
        "route": "gateway",
        "stream": True,
        "messages": [{"role": "user", "content": "Hi"}],
        "metadata": {"chunks": "600", "interval": "1"},
    }
    streams = Streams(
        host, port, build_request(host, port, PATH, json.dumps(trickle).encode(), {"Authorization": f"Bearer {key}"})
    )
    tasks: list[asyncio.Task[None]] = []
    started = time.monotonic()
    for _ in range(0, args.streams, 100):  # in steps, as clients arrive: the listen backlog is not the test
        tasks += [asyncio.create_task(streams.one()) for _ in range(min(100, args.streams - len(tasks)))]
        await asyncio.sleep(0.1)
    while streams.opened + sum(streams.failed.values()) < args.streams and time.monotonic() - started < 300:
        await asyncio.sleep(0.5)
    print(
        f"  {streams.opened} streams open after {time.monotonic() - started:.1f} s; failed: {streams.failed}",
        flush=True,
    )
    loaded = await short_requests(host, port, key, args.clients, args.duration)
    during = rss_bytes(pid)
    still_open = streams.opened - sum(v for k, v in streams.failed.items() if k == "ended early")
    streams.stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    per_stream = (during - before) / max(1, streams.opened)
    return [(0, idle, before / 2**20), (still_open, loaded, during / 2**20), (-1, loaded, per_stream / 1024)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--clients", type=int, default=4, help="closed-loop clients sending short requests")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds the short requests are measured")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="connections-"))
    try:
        with deployment(work, {"GATEWAY_MAX_CONNECTIONS": str(args.streams + 512)}) as topology:
            key = topology.organization("connections")
            api = topology.start("api1")
            host, port = topology.values["API_HOST"], int(topology.values["API_1_PORT"])
            rows = asyncio.run(measure(host, port, key, api.pid, args))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    per_stream_kb = rows[2][2]
    print()
    print("| open slow streams | short-request clients | short req/s | p50 ms | p99 ms | errors | API process RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for open_streams, results, rss in rows[:2]:
        print(
            f"| {open_streams} | {args.clients} | {results.rps:.0f} | "
            f"{ms(results.percentile(results.latencies, 50))} | "
            f"{ms(results.percentile(results.latencies, 99))} | {results.errors} | {rss:.0f} |"
        )
    print()
    print(f"memory per open stream: {per_stream_kb:.1f} KB")


if __name__ == "__main__":
    main()
