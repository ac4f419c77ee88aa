"""The distributed mode started from deploy/ as an operator starts it, on loopback.

A throwaway PostgreSQL cluster and Redis server (``tests.services``), an env file written from deploy/env.example's
names, and each of deploy/Procfile's processes run by honcho, one honcho per process: a process that dies (a worker
killed on purpose) then ends only its own honcho, where one honcho for all would stop every other process with it.
The scale-out and fault tests and the benchmarks in bench/ use this, so the deployment files cannot rot unnoticed.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import manage, new_key
from tests.services import Postgres, Redis, free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROCFILE = DEPLOY / "Procfile"
HONCHO = str(Path(sys.executable).parent / "honcho")
# The gateway models the topology's traffic asks the fake upstream for: a plain one, and one that streams slowly.
GATEWAY_MODEL = "upstream/gpt-x"
GATEWAY_MODELS = (GATEWAY_MODEL, "trickle")


def start_upstream(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The fake OpenAI-compatible upstream (tests/fakes/openai_upstream.py) for the gateway route, and its base URL."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(port)],
        cwd=ROOT,
        stdout=open(directory / "upstream.log", "wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/last", timeout=1)
            return process, f"http://127.0.0.1:{port}/v1"
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("the fake upstream did not start")


def procfile_names() -> list[str]:
    """The process types deploy/Procfile declares, in its order."""
    names = []
    for line in PROCFILE.read_text().splitlines():
        if match := re.match(r"^([A-Za-z0-9_-]+):", line):
            names.append(match.group(1))
    return names


def procfile_command(name: str) -> list[str]:
    """The program and arguments deploy/Procfile runs for ``name`` (its line's words after ``exec``)."""
    for line in PROCFILE.read_text().splitlines():
        if line.startswith(f"{name}:"):
            words = shlex.split(line.split(":", 1)[1])
            return words[1:] if words[0] == "exec" else words
    raise LookupError(f"deploy/Procfile has no {name!r} line")


def env_example_names() -> list[str]:
    return [
        line.split("=", 1)[0]
        for line in (DEPLOY / "env.example").read_text().splitlines()
        if re.match(r"^[A-Z_0-9]+=", line)
    ]


def descendants(pid: int) -> list[int]:
    """Every live process under ``pid``, depth first."""
    found: list[int] = []
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            for task in Path(f"/proc/{current}/task").iterdir():
                children = [int(child) for child in (task / "children").read_text().split()]
                found.extend(children)
                stack.extend(children)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except (FileNotFoundError, ProcessLookupError):
        return []


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Running:
    """One Procfile process under its own honcho."""

    name: str
    honcho: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The program the Procfile line runs (daphne, celery, haproxy), under honcho and its shell."""
        for pid in descendants(self.honcho.pid):
            args = cmdline(pid)
            if (
                args
                and Path(args[0]).name not in {"sh", "dash", "bash"}
                and not any(a.endswith("/honcho") for a in args)
            ):
                return pid
        raise RuntimeError(f"{self.name} has no running program (honcho exited with {self.honcho.poll()})")

    def alive(self) -> bool:
        return self.honcho.poll() is None

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class Topology:
    """deploy/'s processes on loopback, over one PostgreSQL cluster and one Redis server."""

    def __init__(self, directory: Path, *, postgres: Postgres, redis: Redis, overrides: Mapping[str, str] = {}) -> None:
        self.directory = directory
        self.postgres = postgres
        self.redis = redis
        self.values = {
            "DATABASE_URL": postgres.url,
            "REDIS_URL": redis.url,
            "SECRET_KEY": secrets.token_urlsafe(40),
            "B3OS_VAR_DIR": str(directory / "var"),
            "LOG_LEVEL": "WARNING",
            "API_HOST": "127.0.0.1",
            "API_1_PORT": str(free_port()),
            "API_2_PORT": str(free_port()),
            "ALLOWED_HOSTS": "localhost,127.0.0.1",
            "METRICS_TOKEN": "",
            "GATEWAY_BASE_URL": "",
            "GATEWAY_API_KEY": "",
            "JOB_START_TIMEOUT_SECONDS": "60",
            "WORKER_SILENCE_TIMEOUT_SECONDS": "3",
            "SHUTDOWN_GRACE_SECONDS": "4",  # deploy/env.example's: below honcho's 5 s
            "SMOLLM2_CONCURRENCY": "20",
            # Up to two model workers share the host's cores, as deploy/env.example tells operators to.
            "CPU_RUNNER_THREADS": str(max(1, (os.cpu_count() or 2) // 2)),
            "LB_BIND": f"127.0.0.1:{free_port()}",
            "LB_MAXCONN": "4096",
            "LB_STATS_BIND": f"127.0.0.1:{free_port()}",
            **overrides,
        }
        (directory / "var").mkdir(parents=True, exist_ok=True)
        self.env_file = directory / "deploy.env"
        self._write_env()
        self.running: dict[str, Running] = {}

    def _write_env(self) -> None:
        self.env_file.write_text("".join(f"{name}={value}\n" for name, value in self.values.items()))

    def set(self, name: str, value: str) -> None:
        """Changes a variable of the environment file, for the processes started after."""
        self.values[name] = value
        self._write_env()

    # --- set-up, as an operator does it -------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The environment honcho gives its processes: this process's, with the env file over it."""
        return {**os.environ, **self.values}

    def manage(self, *args: str) -> str:
        return manage(*args, env=self.env)

    def migrate(self) -> None:
        """The database, and the gateway models the traffic asks the fake upstream for."""
        self.manage("migrate", "--noinput", "-v0")
        self.manage("add_gateway_model", *GATEWAY_MODELS)

    def organization(self, slug: str, *limits: str) -> str:
        """A new organization's key; ``limits`` are ``manage.py set_limit`` options (``--rpm``, ``50``)."""
        key = new_key(slug, env=self.env)
        if limits:
            self.manage("set_limit", slug, *limits)
        return key

    # --- processes --------------------------------------------------------------------------------

    def start(self, name: str, *, copy: int = 1, wait: bool = True) -> Running:
        """Starts the Procfile's process ``name`` under a honcho of its own; ``copy`` tells copies apart (honcho
        hands it to the process as PORT, which the workers put in their node names)."""
        key = name if copy == 1 else f"{name}.{copy}"
        log = self.directory / f"{key}.log"
        honcho = subprocess.Popen(
            [HONCHO, "-f", str(PROCFILE), "-e", str(self.env_file), "-d", str(ROOT), "start", "-p", str(copy), name],
            cwd=ROOT,
            env=dict(os.environ),
            stdout=open(log, "wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        running = self.running[key] = Running(key, honcho, log)
        if wait:
            self.wait_ready(running)
        return running

    def wait_ready(self, running: Running, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        name = running.name.split(".")[0]
        while time.monotonic() < deadline:
            if not running.alive():
                raise RuntimeError(f"{running.name} exited:\n{running.output()[-4000:]}")
            if self._ready(name, running):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{running.name} was not ready within {timeout}s:\n{running.output()[-4000:]}")

    def _ready(self, name: str, running: Running) -> bool:
        if name in {"api1", "api2"}:
            return self._answers(self.api_url(int(name[-1])) + "/v1/infer/models")
        if name == "lb":
            # Ready once HAProxy found an API process up: before that it answers 503 itself.
            return self._answers(self.url + "/v1/infer/models", refuse=frozenset({503}))
        if name == "beat":
            return "beat: Starting" in running.output()
        return " ready." in running.output()  # Celery workers

    @staticmethod
    def _answers(url: str, refuse: frozenset[int] = frozenset()) -> bool:
        try:
            return httpx.get(url, timeout=2).status_code not in refuse
        except httpx.HTTPError:
            return False

    def stop(self, key: str) -> None:
        """Stops a process as an operator's Ctrl-C does (honcho passes SIGTERM on), and kills whatever outlived it:
        a Celery worker's warm shutdown waits for its running jobs."""
        running = self.running.pop(key)
        # honcho starts each program in a session of its own, so they are found now, while honcho still parents them.
        programs = descendants(running.honcho.pid)
        if running.alive():
            running.honcho.send_signal(signal.SIGTERM)
            try:
                running.honcho.wait(timeout=15)
            except subprocess.TimeoutExpired:
                running.honcho.kill()
                running.honcho.wait(timeout=10)
        for pid in programs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for key in list(self.running):
            self.stop(key)

    # --- what clients and operators see -------------------------------------------------------------

    @property
    def url(self) -> str:
        """The load balancer, where clients go."""
        return "http://" + self.values["LB_BIND"]

    def api_url(self, number: int) -> str:
        return f"http://{self.values['API_HOST']}:{self.values[f'API_{number}_PORT']}"

    def metrics(self, number: int) -> dict[str, float]:
        """One API process's ``/metrics`` samples, as ``name{label="value",…}`` → value."""
        text = httpx.get(self.api_url(number) + "/metrics", timeout=10).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
        return samples

    def sql(self, query: str, *params: Any) -> list[tuple[Any, ...]]:
        import psycopg

        with psycopg.connect(self.postgres.url, connect_timeout=5) as connection:
            return connection.execute(query, params).fetchall()


def sum_samples(samples: Mapping[str, float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(
        value for key, value in samples.items() if key.split("{", 1)[0] == name and all(part in key for part in wanted)
    )


@contextmanager
def deployment(directory: Path, overrides: Mapping[str, str] = {}) -> Iterator[Topology]:
    """PostgreSQL, Redis and the fake upstream started, and a migrated topology over them (its processes for the
    caller to start); everything stopped at the end."""
    with ExitStack() as stack:
        postgres = Postgres().start()
        stack.callback(postgres.destroy)
        redis = Redis(directory).start()
        stack.callback(redis.stop)
        upstream, upstream_url = start_upstream(directory)
        stack.callback(upstream.wait, timeout=10)
        stack.callback(upstream.terminate)
        topology = Topology(
            directory, postgres=postgres, redis=redis, overrides={"GATEWAY_BASE_URL": upstream_url, **overrides}
        )
        stack.callback(topology.close)
        topology.migrate()
        yield topology
