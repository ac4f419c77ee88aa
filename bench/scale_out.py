"""Scale-out: 1 API process + 1 worker against 2 + 2, started from deploy/ (honcho, HAProxy in front), and the
limits race across both API processes.

One run, one machine: PostgreSQL, Redis, the fake upstream (tests/fakes/openai_upstream.py) and deploy/Procfile's
processes, each started as tests/deploy/topology.py starts them. Both layouts are measured through the load balancer,
on the gateway route and on the node's model (SmolLM2 on the CPU runner): requests per second, p50 and p99. Then
an organization limited to ``--rpm`` requests per minute sends 200 requests at once through the load balancer,
spread over both API processes: how many were admitted, and how many over the limit.

    .venv/bin/python bench/scale_out.py [--duration 10] [--gateway-clients 32] [--node-clients 8] [--rpm 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.loadgen import Results, run  # noqa: E402
from tests.deploy.topology import GATEWAY_MODEL, Topology, deployment  # noqa: E402
from tests.deploy.traffic import MODEL, chat, send  # noqa: E402

CORES = os.cpu_count() or 2


def measure(topology: Topology, key: str, *, gateway: bool, clients: int, duration: float) -> Results:
    host, port = topology.values["LB_BIND"].split(":")
    body = {
        "model": GATEWAY_MODEL if gateway else MODEL,
        "messages": [{"role": "user", "content": "Name one river in Oregon."}],
        "max_tokens": 16,
        "temperature": 0,
    }
    if gateway:
        body["route"] = "gateway"
    return asyncio.run(
        run(
            host=host,
            port=int(port),
            path="/v1/infer/chat/completions",
            body=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {key}"},
            clients=clients,
            duration=duration,
            warmup=min(3.0, duration / 2),
        )
    )


async def limits_race(topology: Topology, key: str, count: int) -> dict[int, int]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        outcomes = await asyncio.gather(*(send(client, topology.url, key, chat(gateway=True)) for _ in range(count)))
    statuses: dict[int, int] = {}
    for outcome in outcomes:
        statuses[outcome.status] = statuses.get(outcome.status, 0) + 1
    return statuses


def wait_balanced(topology: Topology) -> None:
    """Until HAProxy's checks have seen every running API process up (its status page, as CSV)."""
    wanted = {name for name in topology.running if name.startswith("api")}
    for _ in range(100):
        csv = httpx.get(f"http://{topology.values['LB_STATS_BIND']}/stats;csv", timeout=5).text.splitlines()
        up = {row.split(",")[1] for row in csv[1:] if row.startswith("api,") and ",UP," in row}
        if wanted <= up:
            return
        time.sleep(0.2)
    raise RuntimeError(f"HAProxy does not see {wanted} up")


def two_and_two(topology: Topology) -> None:
    """The second API process, and two model workers that split the host's cores (deploy/env.example)."""
    topology.start("api2")
    topology.stop("smollm2")
    topology.set("CPU_RUNNER_THREADS", str(max(1, CORES // 2)))
    topology.start("smollm2")
    topology.start("smollm2", copy=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds measured per cell")
    parser.add_argument("--gateway-clients", type=int, default=32)
    parser.add_argument("--node-clients", type=int, default=8)
    parser.add_argument("--rpm", type=int, default=50)
    parser.add_argument("--race", type=int, default=200, help="concurrent requests in the limits race")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="scale-out-"))
    rows: list[tuple[str, str, int, Results]] = []
    try:
        # One worker alone has every core; two split them (two_and_two).
        with deployment(work, {"CPU_RUNNER_THREADS": str(CORES)}) as topology:
            key = topology.organization("bench")
            for name in ("api1", "lb", "smollm2"):
                topology.start(name)
            layouts = [("1 API + 1 worker", lambda: None), ("2 API + 2 workers", lambda: two_and_two(topology))]
            for layout, grow in layouts:
                grow()
                wait_balanced(topology)
                # Each worker loads its model with its first job: not part of what is measured.
                warm = measure(topology, key, gateway=False, clients=8, duration=4)
                print(f"  warmed the workers up: {warm.statuses}", flush=True)
                for route, gateway, clients in (
                    ("gateway", True, args.gateway_clients),
                    ("node", False, args.node_clients),
                ):
                    results = measure(topology, key, gateway=gateway, clients=clients, duration=args.duration)
                    rows.append((layout, route, clients, results))
                    summary = f"rps={results.rps:8.1f} statuses={results.statuses}"
                    print(f"  measured {layout:18} {route:8} {summary}", flush=True)
            race_key = topology.organization("race", "--rpm", str(args.rpm))
            statuses = asyncio.run(limits_race(topology, race_key, args.race))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ms = lambda v: f"{v * 1000:.1f}"  # noqa: E731
    print()
    print("| layout | route | clients | req/s | p50 ms | p99 ms | errors | vs 1 + 1 |")
    print("|---|---|---|---|---|---|---|---|")
    base = {route: results.rps for layout, route, _, results in rows if layout.startswith("1 ")}
    for layout, route, clients, results in rows:
        ratio = f"{results.rps / base[route]:.2f}×" if base.get(route) else "—"
        print(
            f"| {layout} | {route} | {clients} | {results.rps:.1f} | {ms(results.percentile(results.latencies, 50))} | "
            f"{ms(results.percentile(results.latencies, 99))} | {results.errors} | {ratio} |"
        )
    admitted = statuses.get(200, 0)
    print()
    print("| limit | concurrent requests | admitted | refused (429) | other | over-admissions |")
    print("|---|---|---|---|---|---|")
    other = sum(count for status, count in statuses.items() if status not in (200, 429))
    print(
        f"| {args.rpm} per minute | {args.race} | {admitted} | {statuses.get(429, 0)} | {other} | "
        f"{max(0, admitted - args.rpm)} |"
    )


if __name__ == "__main__":
    main()
