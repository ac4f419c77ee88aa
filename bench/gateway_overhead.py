"""What the platform adds per request on the gateway route, side by side with LiteLLM's proxy.

One run, one machine: a fast fake OpenAI-compatible upstream; then the upstream directly, the platform
with "route": "gateway" in embedded mode and in distributed mode (Redis), and LiteLLM's proxy (installed
by this script into var/litellm-venv), each pinned to the same single CPU core, while the upstream and
the load generator share the other core. At 1, 16 and 64 concurrent clients, streaming and not, it
prints requests per second, latency p50/p99, time to first byte, the latency added over direct, the
CPU milliseconds per request of each gateway's process tree, and the ratios platform / LiteLLM.

    .venv/bin/python bench/gateway_overhead.py [--duration 5] [--clients 1,16,64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.loadgen import Results, run  # noqa: E402

GATEWAY_CORE = "1"
CLIENT_CORE = {0}
MODEL = "upstream/gpt-x"
LITELLM_KEY = "sk-bench-master-key"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(port: int, process: subprocess.Popen[bytes], timeout: float = 120) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"port {port} did not open")


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of a process and all its live descendants."""
    total = 0.0
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / CLK_TCK
            for task in Path(f"/proc/{current}/task").iterdir():
                children = (task / "children").read_text().split()
                stack.extend(int(c) for c in children)
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return total


@dataclass
class Target:
    name: str
    port: int
    path: str
    headers: dict[str, str]
    extra_body: dict[str, object]
    pids: list[int]


def ensure_litellm() -> Path:
    venv = ROOT / "var" / "litellm-venv"
    binary = venv / "bin" / "litellm"
    if not binary.exists():
        print("installing litellm[proxy] into var/litellm-venv …", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "litellm[proxy]"], check=True)
    return binary


def start(cmd: list[str], *, env: dict[str, str], log: Path, core: str | None) -> subprocess.Popen[bytes]:
    prefix = ["taskset", "-c", core] if core is not None and shutil.which("taskset") else []
    return subprocess.Popen(prefix + cmd, cwd=ROOT, env=env, stdout=open(log, "wb"), stderr=subprocess.STDOUT)


def manage(*args: str, env: dict[str, str]) -> str:
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True, capture_output=True, text=True
    ).stdout


def platform_env(var_dir: Path, upstream: str, redis_url: str = "") -> dict[str, str]:
    return {
        **os.environ,
        "B3OS_VAR_DIR": str(var_dir),
        "DATABASE_URL": "",
        "REDIS_URL": redis_url,
        "SECRET_KEY": "bench-gateway-overhead",  # shared by every process, as distributed mode requires
        "GATEWAY_BASE_URL": upstream + "/v1",
        "GATEWAY_API_KEY": "upstream-key",
        "LOG_LEVEL": "WARNING",
    }


def start_platform(
    name: str, work: Path, upstream: str, redis_url: str = ""
) -> tuple[Target, list[subprocess.Popen[bytes]]]:
    var_dir = work / name
    var_dir.mkdir()
    env = platform_env(var_dir, upstream, redis_url)
    manage("migrate", "--noinput", "-v0", env=env)
    manage("add_gateway_model", MODEL, env=env)
    manage("create_org", "bench", env=env)
    key = manage("create_key", "bench", env=env).strip()
    # Real limits, generous enough never to refuse: admission runs on every request.
    manage("set_limit", "bench", "--tpm", "1000000000", "--rpm", "10000000", "--in-flight", "100000", env=env)
    port = free_port()
    process = start(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--no-warm-up"],
        env=env,
        log=var_dir / "serve.log",
        core=GATEWAY_CORE,
    )
    wait_http(port, process)
    target = Target(
        name,
        port,
        "/v1/infer/chat/completions",
        {"Authorization": f"Bearer {key}"},
        {"route": "gateway"},
        [process.pid],
    )
    return target, [process]


def start_litellm(work: Path, upstream: str) -> tuple[Target, list[subprocess.Popen[bytes]]]:
    binary = ensure_litellm()
    config = work / "litellm.yaml"
    config.write_text(
        json.dumps(
            {
                "model_list": [
                    {
                        "model_name": MODEL,
                        "litellm_params": {
                            "model": "openai/gpt-x",
                            "api_base": upstream + "/v1",
                            "api_key": "upstream-key",
                        },
                    }
                ],
                "general_settings": {"master_key": LITELLM_KEY},
                "litellm_settings": {"telemetry": False, "drop_params": True},
            }
        )
    )
    port = free_port()
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "DISABLE_SCHEMA_UPDATE": "True"}
    process = start(
        [str(binary), "--config", str(config), "--port", str(port), "--num_workers", "1"],
        env=env,
        log=work / "litellm.log",
        core=GATEWAY_CORE,
    )
    wait_http(port, process, timeout=180)
    target = Target(
        "litellm", port, "/v1/chat/completions", {"Authorization": f"Bearer {LITELLM_KEY}"}, {}, [process.pid]
    )
    return target, [process]


def measure(target: Target, *, clients: int, stream: bool, duration: float) -> tuple[Results, float]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name one river in Oregon."}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    body.update(target.extra_body)
    cpu_before = sum(tree_cpu_seconds(pid) for pid in target.pids)
    results = asyncio.run(
        run(
            host="127.0.0.1",
            port=target.port,
            path=target.path,
            body=json.dumps(body).encode(),
            headers=target.headers,
            clients=clients,
            duration=duration,
            warmup=1.0,
        )
    )
    cpu = sum(tree_cpu_seconds(pid) for pid in target.pids) - cpu_before
    requests = len(results.latencies) + results.errors
    return results, (cpu * 1000 / requests) if requests else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--clients", default="1,16,64")
    parser.add_argument("--skip-litellm", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(c) for c in args.clients.split(",")]
    os.sched_setaffinity(0, CLIENT_CORE)

    work = Path(tempfile.mkdtemp(prefix="gateway-bench-"))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        upstream_proc = start(
            [sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(up_port)],
            env=dict(os.environ),
            log=work / "upstream.log",
            core="0",
        )
        processes.append(upstream_proc)
        wait_http(up_port, upstream_proc)
        upstream = f"http://127.0.0.1:{up_port}"
        targets = [Target("direct", up_port, "/v1/chat/completions", {}, {}, [upstream_proc.pid])]

        embedded, procs = start_platform("platform-embedded", work, upstream)
        targets.append(embedded)
        processes += procs

        redis_port = free_port()
        redis = start(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"],
            env=dict(os.environ),
            log=work / "redis.log",
            core=GATEWAY_CORE,
        )
        processes.append(redis)
        wait_http(redis_port, redis)
        distributed, procs = start_platform("platform-redis", work, upstream, f"redis://127.0.0.1:{redis_port}/0")
        distributed.pids.append(redis.pid)  # Redis does the admission work: it is part of the platform's budget
        targets.append(distributed)
        processes += procs

        if not args.skip_litellm:
            litellm, procs = start_litellm(work, upstream)
            targets.append(litellm)
            processes += procs

        rows: dict[tuple[str, int, bool], tuple[Results, float]] = {}
        for stream in (False, True):
            for clients in concurrencies:
                for target in targets:
                    rows[(target.name, clients, stream)] = measure(
                        target, clients=clients, stream=stream, duration=args.duration
                    )
                    r, cpu = rows[(target.name, clients, stream)]
                    print(
                        f"  measured {target.name:18} c={clients:<3} stream={stream!s:5} rps={r.rps:8.1f} "
                        f"statuses={r.statuses} errors={r.errors}",
                        flush=True,
                    )
        report(rows, targets, concurrencies)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        shutil.rmtree(work, ignore_errors=True)


def report(
    rows: dict[tuple[str, int, bool], tuple[Results, float]], targets: list[Target], concurrencies: list[int]
) -> None:
    ms = lambda v: f"{v * 1000:.2f}"  # noqa: E731
    print()
    print(
        "| mode | clients | target | req/s | p50 ms | p99 ms | first byte p50 ms | added p50 ms | CPU ms/req | errors |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for stream in (False, True):
        for clients in concurrencies:
            direct = rows[("direct", clients, stream)][0]
            direct_p50 = direct.percentile(direct.latencies, 50)
            for target in targets:
                r, cpu = rows[(target.name, clients, stream)]
                p50 = r.percentile(r.latencies, 50)
                added = "—" if target.name == "direct" else ms(p50 - direct_p50)
                cpu_text = "—" if target.name == "direct" else f"{cpu:.2f}"
                print(
                    f"| {'stream' if stream else 'json'} | {clients} | {target.name} | {r.rps:.0f} | {ms(p50)} | "
                    f"{ms(r.percentile(r.latencies, 99))} | {ms(r.percentile(r.first_bytes, 50))} | {added} | "
                    f"{cpu_text} | {r.errors} |"
                )
    names = {t.name for t in targets}
    if "litellm" not in names:
        return
    print()
    print("| mode | clients | platform | req/s ÷ LiteLLM | added latency ÷ LiteLLM | CPU/req ÷ LiteLLM |")
    print("|---|---|---|---|---|---|")
    for stream in (False, True):
        for clients in concurrencies:
            direct = rows[("direct", clients, stream)][0]
            direct_p50 = direct.percentile(direct.latencies, 50)
            lite, lite_cpu = rows[("litellm", clients, stream)]
            lite_added = lite.percentile(lite.latencies, 50) - direct_p50
            for name in ("platform-embedded", "platform-redis"):
                r, cpu = rows[(name, clients, stream)]
                added_s = r.percentile(r.latencies, 50) - direct_p50
                ratio = lambda a, b: f"{a / b:.2f}×" if b else "—"  # noqa: E731
                print(
                    f"| {'stream' if stream else 'json'} | {clients} | {name} | {ratio(r.rps, lite.rps)} | "
                    f"{ratio(added_s, lite_added)} | {ratio(cpu, lite_cpu)} |"
                )


if __name__ == "__main__":
    main()
