"""The cost of admission and usage accounting per request, embedded and with Redis, side by side with the
same requests when the organization has no limits.

Two views in one run:
- end to end: gateway-route requests (to a fast fake upstream, so the platform is what is measured)
  alternating between an organization with limits and one without, one client, p50/p99 latency;
- in process: the admission call with its release, and the usage record, timed alone.

    .venv/bin/python bench/admission_overhead.py [--requests 1500]
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gateway_overhead import free_port, manage, platform_env, wait_http  # noqa: E402
from bench.loadgen import _read_response, build_request  # noqa: E402


def pct(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] * 1000


async def alternate(port: int, keys: dict[str, str], n: int) -> dict[str, list[float]]:
    body = json.dumps(
        {"model": "upstream/gpt-x", "messages": [{"role": "user", "content": "hi"}], "route": "gateway"}
    ).encode()
    requests = {
        name: build_request("127.0.0.1", port, "/v1/infer/chat/completions", body, {"Authorization": f"Bearer {key}"})
        for name, key in keys.items()
    }
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    timings: dict[str, list[float]] = {name: [] for name in keys}
    for i in range(n * len(keys) + 50):
        name = list(keys)[i % len(keys)]
        started = time.perf_counter()
        writer.write(requests[name])
        status, _ = await _read_response(reader)
        assert status == 200, status
        if i >= 50:
            timings[name].append(time.perf_counter() - started)
    writer.close()
    return timings


def end_to_end(work: Path, upstream: str, redis_url: str, n: int) -> dict[str, list[float]]:
    var = work / ("redis" if redis_url else "embedded")
    var.mkdir()
    env = platform_env(var, upstream, redis_url)
    manage("migrate", "--noinput", "-v0", env=env)
    manage("add_gateway_model", "upstream/gpt-x", env=env)
    keys = {}
    for org in ("no-limits", "limits"):
        manage("create_org", org, env=env)
        keys[org] = manage("create_key", org, env=env).strip()
    manage("set_limit", "limits", "--tpm", "1000000000", "--rpm", "10000000", "--in-flight", "1000", env=env)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "manage.py", "serve", "--port", str(port), "--no-warm-up"],
        cwd=ROOT,
        env=env,
        stdout=open(var / "serve.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(port, server)
        return asyncio.run(alternate(port, keys, n))
    finally:
        server.terminate()
        server.wait(timeout=10)


def in_process(redis_url: str, n: int) -> dict[str, list[float]]:
    """Admission (+ release) and the usage record, timed alone, in a child process with its own settings."""
    code = f"""
import asyncio, json, os, sys, time
sys.path.insert(0, {str(ROOT)!r})
os.environ["DJANGO_SETTINGS_MODULE"] = "config.settings"
import django; django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)
from orgs.models import Organization, Limit
from orgs import admission
from inference.usage.records import Meter, flush
open_org = Organization.objects.get_or_create(slug="open")[0]
limited = Organization.objects.get_or_create(slug="limited")[0]
Limit.objects.update_or_create(
    organization=limited,
    model=None,
    defaults=dict(tokens_per_minute=10**9, requests_per_minute=10**7, requests_in_flight=1000),
)
async def main():
    out = {{"admission, no limits": [], "admission, limits": [], "usage record": []}}
    for i in range({n} * 2):
        org = open_org if i % 2 == 0 else limited
        name = "admission, no limits" if org is open_org else "admission, limits"
        t = time.perf_counter()
        grant = await admission.admit(organization_id=org.pk, model_pk=None, tokens=100)
        grant.release()
        await asyncio.sleep(0)
        out[name].append(time.perf_counter() - t)
        meter = Meter(
            organization_id=org.pk,
            organization=org.slug,
            api_key_id=None,
            model="m",
            endpoint="bench",
            route="node",
            request_id="req_bench",
        )
        t = time.perf_counter()
        meter.record(status=200, input_tokens=10, output_tokens=5)
        out["usage record"].append(time.perf_counter() - t)
    flush()
    print(json.dumps(out))
asyncio.run(main())
"""
    env = {
        **os.environ,
        "B3OS_VAR_DIR": tempfile.mkdtemp(prefix="admission-"),
        "DATABASE_URL": "",
        "REDIS_URL": redis_url,
    }
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1500)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="admission-bench-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        up_port = free_port()
        upstream = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(up_port)], cwd=ROOT
        )
        procs.append(upstream)
        wait_http(up_port, upstream)
        redis_port = free_port()
        redis = subprocess.Popen(
            ["redis-server", "--port", str(redis_port), "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL
        )
        procs.append(redis)
        wait_http(redis_port, redis)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        upstream_url = f"http://127.0.0.1:{up_port}"

        print("| mode | measured | p50 ms | p99 ms | added by limits p50 ms |")
        print("|---|---|---|---|---|")
        for mode, url in (("embedded", ""), ("redis", redis_url)):
            timings = end_to_end(work, upstream_url, url, args.requests)
            base = pct(timings["no-limits"], 50)
            for name, label in (("no-limits", "request, no limits"), ("limits", "request, with limits")):
                p50 = pct(timings[name], 50)
                added = "—" if name == "no-limits" else f"{p50 - base:+.3f}"
                print(f"| {mode} | {label} | {p50:.3f} | {pct(timings[name], 99):.3f} | {added} |")
            parts = in_process(url, args.requests)
            for name, values in parts.items():
                print(f"| {mode} | {name} (in process) | {pct(values, 50):.3f} | {pct(values, 99):.3f} | |")
    finally:
        for proc in procs:
            proc.terminate()


if __name__ == "__main__":
    main()
