"""Soak: mixed traffic for a while against 2 API processes + 2 workers behind HAProxy, started from deploy/.

Chat and Responses, streamed and not, on the gateway route (the fake upstream) and the node's model (SmolLM2 on the
CPU runner); a share of streaming clients hang up after a few events, and one organization sends more than its
limits allow. Counts every answer by status (the aim: nothing of 500 or above) and samples the resident memory and
open file descriptors of the API processes and the workers, whose slope per hour (least squares over the samples
after a warm-up) shows whether anything grows.

    .venv/bin/python bench/soak.py [--duration 600] [--clients 16]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.deploy.topology import deployment, open_fds, rss_bytes  # noqa: E402
from tests.deploy.traffic import Outcome, chat, closed_loop, responses  # noqa: E402

PROCESSES = ["api1", "api2", "smollm2", "smollm2.2"]
MIX = [
    (chat(gateway=True), 4.0),
    (chat(gateway=True, stream=True), 4.0),
    (responses(gateway=True), 2.0),
    (chat(stream=True, max_tokens=12), 1.0),
    (chat(max_tokens=8), 1.0),
    (responses(stream=True, max_tokens=16), 0.5),
    (responses(max_tokens=16), 0.5),
]


def slope_per_hour(samples: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) samples, per hour."""
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_v = sum(v for _, v in samples) / n
    spread = sum((t - mean_t) ** 2 for t, _ in samples)
    return 0.0 if spread == 0 else sum((t - mean_t) * (v - mean_v) for t, v in samples) / spread * 3600


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 10 minutes)")
    parser.add_argument(
        "--clients", type=int, default=16, help="closed-loop clients of the organization without limits"
    )
    parser.add_argument("--limited-clients", type=int, default=4, help="clients of an organization over its limits")
    parser.add_argument("--sample-every", type=float, default=5.0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    outcomes: list[Outcome] = []
    samples: dict[str, dict[str, list[tuple[float, float]]]] = {p: {"rss": [], "fds": []} for p in PROCESSES}
    try:
        with deployment(work) as topology:
            free = topology.organization("soak")
            limited = topology.organization("soak-limited", "--rpm", "20", "--tpm", "20000", "--in-flight", "2")
            for name in ("api1", "api2", "lb", "beat", "housekeeping"):
                topology.start(name)
            topology.start("smollm2", copy=1)
            topology.start("smollm2", copy=2)
            pids = {name: topology.running[name].pid for name in PROCESSES}

            async def traffic() -> None:
                # Each answer lands in ``outcomes`` as it comes, so progress shows while the clients run.
                loop = functools.partial(
                    closed_loop,
                    base_url=topology.url,
                    mix=MIX,
                    duration=args.duration,
                    honour_retry_after=True,
                    on_outcome=outcomes.append,
                    timeout=120,
                )
                await asyncio.gather(
                    loop(key=free, clients=args.clients, hang_up_share=0.2),
                    loop(key=limited, clients=args.limited_clients, seed=1),
                )

            done = threading.Event()

            def run() -> None:
                asyncio.run(traffic())
                done.set()

            threading.Thread(target=run, daemon=True).start()
            started = time.monotonic()
            warm_up = min(60.0, args.duration / 10)
            while not done.wait(args.sample_every):
                elapsed = time.monotonic() - started
                if elapsed < warm_up:
                    continue
                for name, pid in pids.items():
                    samples[name]["rss"].append((elapsed, rss_bytes(pid) / 2**20))
                    samples[name]["fds"].append((elapsed, float(open_fds(pid))))
                print(f"  {elapsed:6.0f}s  {len(outcomes)} answers so far", flush=True) if int(
                    elapsed
                ) % 60 < args.sample_every else None
    finally:
        shutil.rmtree(work, ignore_errors=True)

    statuses = Counter(o.status for o in outcomes)
    codes = Counter(f"{o.status} {o.error_code}".strip() for o in outcomes if o.status != 200 or o.error_code)
    problems = Counter(o.problem for o in outcomes if o.problem)
    print()
    print(
        f"{len(outcomes)} requests in {args.duration:.0f} s ({len(outcomes) / args.duration:.1f}/s), "
        f"{args.clients} + {args.limited_clients} clients; statuses {dict(sorted(statuses.items()))}"
    )
    print(f"errors and hang-ups by code: {dict(codes.most_common())}")
    print(
        f"responses of 500 or above: {sum(c for s, c in statuses.items() if s >= 500)}; "
        f"no answer: {statuses.get(0, 0)}; "
        f"other problems: {dict(problems) or 'none'}"
    )
    print()
    print("| process | RSS first MB | RSS last MB | RSS slope MB/h | fds first | fds last | fds slope /h |")
    print("|---|---|---|---|---|---|---|")
    for name in PROCESSES:
        rss, fds = samples[name]["rss"], samples[name]["fds"]
        if not rss:
            continue
        print(
            f"| {name} | {rss[0][1]:.0f} | {rss[-1][1]:.0f} | {slope_per_hour(rss):+.1f} | "
            f"{fds[0][1]:.0f} | {fds[-1][1]:.0f} | {slope_per_hour(fds):+.1f} |"
        )


if __name__ == "__main__":
    main()
