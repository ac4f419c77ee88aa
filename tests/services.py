"""Throwaway servers for the tests: a PostgreSQL cluster and a Redis server on loopback, each of which a test can
stop and start again on the same address (that is how the fault tests take them away mid-traffic).

``make test`` installs both from Debian (``make system-test-deps``).
"""

from __future__ import annotations

import fcntl
import glob
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path


class MissingProgram(RuntimeError):
    """A server program the tests need is not installed (``make test`` installs it)."""


# Test servers listen below the kernel's ephemeral range (32768 and up on Linux), which the suite's own client
# connections draw their source ports from, and each port is claimed for the life of the process by a lock file, so
# that no other test process (the other xdist workers, the PostgreSQL stage running beside them) is handed it while
# the server it was chosen for is still starting.
_PORTS = range(20000, 32000)
_PORT_LOCKS = Path(tempfile.gettempdir()) / "b3os-test-ports"
_claimed: list[int] = []  # lock files' descriptors, held until the process exits


def free_port() -> int:
    """A loopback port no other process listens on or has claimed, claimed by this one until it exits."""
    _PORT_LOCKS.mkdir(exist_ok=True)
    start = random.randrange(len(_PORTS))
    for offset in range(len(_PORTS)):
        port = _PORTS[(start + offset) % len(_PORTS)]
        lock = os.open(_PORT_LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", port))
        except OSError:
            os.close(lock)
            continue
        _claimed.append(lock)
        return port
    raise RuntimeError(f"no free port in {_PORTS}")


def postgres_program(name: str) -> str:
    """A PostgreSQL server program: on PATH, or where Debian's postgresql package puts it."""
    found = shutil.which(name) or next(iter(sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), reverse=True)), None)
    if found is None:
        raise MissingProgram(f"PostgreSQL's {name} is not installed: `make test` installs Debian's postgresql package")
    return found


class Postgres:
    """A cluster in a temporary directory, reached over TCP on loopback (as a remote database is)."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="b3os-pg-"))
        self.port = free_port()
        self.data = self.root / "data"
        if os.geteuid() == 0:
            shutil.chown(self.root, "nobody")

    @property
    def url(self) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *command: str) -> None:
        # PostgreSQL refuses to run as root: as root, its programs run as nobody.
        as_user = ["runuser", "-u", "nobody", "--"] if os.geteuid() == 0 else []
        subprocess.run([*as_user, *command], check=True, capture_output=True, timeout=120)

    def start(self) -> Postgres:
        if not self.data.exists():
            self._run(postgres_program("initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres", "--no-sync")
        # No fsync: the data is thrown away with the cluster, and the suite's many small commits stay cheap.
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=300"
        self._run(
            postgres_program("pg_ctl"), "-D", str(self.data), "-o", options, "-l", str(self.root / "log"), "-w", "start"
        )
        return self

    def stop(self) -> None:
        """Stops at once, as a crash or a failover does: open connections are cut."""
        self._run(postgres_program("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def destroy(self) -> None:
        try:
            self.stop()
        except subprocess.CalledProcessError:
            pass  # already stopped
        shutil.rmtree(self.root, ignore_errors=True)


class Redis:
    """A redis-server without persistence: stopped and started again, it comes back empty, as a restarted cache does."""

    def __init__(self, directory: Path) -> None:
        if shutil.which("redis-server") is None:
            raise MissingProgram("redis-server is not installed: `make test` installs it")
        self.directory = directory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> Redis:
        command = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.process = subprocess.Popen(
            [*command, "--dir", str(self.directory)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            probe = subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True, text=True)
            if probe.stdout.strip() == "PONG":
                return self
            time.sleep(0.1)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def cli(self, *args: str) -> str:
        return subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
