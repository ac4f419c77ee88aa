"""HAProxy as deploy/haproxy.cfg sets it up, answering by itself when no API process can: in the API's error shape."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import wait_until
from tests.deploy.topology import ROOT, procfile_command
from tests.services import free_port

pytestmark = pytest.mark.distributed


class Balancer:
    """Starts deploy/'s load balancer, as its Procfile line runs it, in front of two API ports."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.processes: list[subprocess.Popen[bytes]] = []

    def __call__(self, api_1_port: int, api_2_port: int, metrics_token: str = "the-metrics-token") -> str:
        """Its URL, once it listens."""
        bind = ("127.0.0.1", free_port())
        environment = {
            "PATH": os.environ["PATH"],
            "METRICS_TOKEN": metrics_token,
            "API_HOST": "127.0.0.1",
            "API_1_PORT": str(api_1_port),
            "API_2_PORT": str(api_2_port),
            "LB_BIND": f"{bind[0]}:{bind[1]}",
            "LB_STATS_BIND": f"127.0.0.1:{free_port()}",
        }
        self.processes.append(
            subprocess.Popen(
                procfile_command("lb"),
                cwd=ROOT,
                env=environment,
                stdout=open(self.log, "ab"),
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a process group of its own, as honcho gives it
            )
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(bind, timeout=1).close()
                return f"http://{bind[0]}:{bind[1]}"
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("haproxy did not start")


@pytest.fixture
def balancer(tmp_path: Path) -> Iterator[Balancer]:
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy is not installed: `make test` installs it")
    started = Balancer(tmp_path / "haproxy.log")
    yield started
    for process in started.processes:
        process.terminate()
        process.wait(timeout=10)


def fake_api(answer: bytes = b"") -> int:
    """A port whose process reads each request, sends ``answer`` and closes the connection; with no answer, as an
    API process that dies mid-request does."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            connection, _ = listener.accept()
            with connection:
                connection.settimeout(1)
                try:
                    connection.recv(65536)
                    connection.sendall(answer)
                except OSError:
                    pass

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def slow_stream_api(pause: float) -> int:
    """A port whose process answers each request with a stream: one event now, the last after ``pause`` seconds."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(connection: socket.socket) -> None:
        with connection:
            try:
                if not connection.recv(65536):
                    return  # the balancer's health check
                connection.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                    + chunk(b"data: first\n\n")
                )
                time.sleep(pause)
                connection.sendall(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
            except OSError:
                pass

    def serve() -> None:
        while True:
            connection, _ = listener.accept()
            threading.Thread(target=answer, args=(connection,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return int(listener.getsockname()[1])


def listening(url: str) -> bool:
    try:
        httpx.get(url + "/v1/infer/models", timeout=5)
    except httpx.ConnectError:
        return False
    return True


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def assert_api_error(response: httpx.Response, code: str) -> None:
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code


def test_with_no_api_process_up_the_balancer_answers_503_in_the_apis_error_shape_with_retry_after(
    balancer: Balancer, tmp_path: Path
) -> None:
    url = balancer(free_port(), free_port())

    response = httpx.post(url + "/v1/infer/chat/completions", json={}, timeout=30)

    assert response.status_code == 503
    assert_api_error(response, "service_unavailable")
    assert response.headers["retry-after"] == "2"
    # An error is a line of the balancer's log (a request answered well is not).
    deadline = time.monotonic() + 5
    while " 503 " not in (log := (tmp_path / "haproxy.log").read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "503 " in log and '"POST /v1/infer/chat/completions' in log, log


# What an API process's /metrics answers.
METRICS = b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: close\r\n\r\nb3os_up 1.0\n"


@pytest.mark.parametrize(
    ("source", "path", "headers", "token", "status"),
    [
        ("127.0.0.1", "/metrics", {}, "", 200),
        ("127.0.0.2", "/metrics", {"Authorization": "Bearer the-metrics-token"}, "the-metrics-token", 200),
        ("127.0.0.2", "/metrics", {}, "the-metrics-token", 403),
        ("127.0.0.2", "/metrics", {"Host": "127.0.0.1"}, "the-metrics-token", 403),
        ("127.0.0.2", "/%6detrics", {}, "the-metrics-token", 403),
        ("127.0.0.2", "//metrics", {}, "the-metrics-token", 403),
        ("127.0.0.2", "/metrics", {"Authorization": "Bearer anything"}, "", 403),
    ],
    ids=[
        "this-host",
        "elsewhere-with-a-token",
        "elsewhere",
        "elsewhere-naming-this-host",
        "elsewhere-percent-encoded",
        "elsewhere-with-two-slashes",
        "elsewhere-with-any-authorization-where-no-token-is-set",
    ],
)
def test_metrics_go_through_the_balancer_only_to_this_host_or_with_a_token(
    balancer: Balancer, source: str, path: str, headers: dict[str, str], token: str, status: int
) -> None:
    api = fake_api(METRICS)
    url = balancer(api, api, metrics_token=token)

    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=30) as client:
        response = client.get(httpx.URL(url).copy_with(raw_path=path.encode()), headers=headers)

    assert response.status_code == status
    if status == 403:
        assert_api_error(response, "forbidden")
        assert "METRICS_TOKEN" in response.json()["error"]["message"]


def test_an_api_process_that_dies_before_answering_is_a_502_in_the_apis_error_shape(balancer: Balancer) -> None:
    url = balancer(fake_api(), fake_api())

    response = httpx.post(url + "/v1/infer/chat/completions", json={}, timeout=30)

    assert response.status_code == 502
    assert_api_error(response, "service_unavailable")


def test_a_balancer_told_to_stop_lets_the_streams_under_way_end_and_takes_no_new_request(balancer: Balancer) -> None:
    api = slow_stream_api(pause=1.5)
    url = balancer(api, api)
    (process,) = balancer.processes

    with httpx.stream("POST", url + "/v1/infer/chat/completions", json={}, timeout=30) as response:
        events = response.iter_lines()
        assert next(events) == "data: first"
        # As honcho stops it (its whole process group), beside the API processes that end their streams.
        os.killpg(process.pid, signal.SIGTERM)
        assert wait_until(lambda: not listening(url), timeout=5)
        rest = [line for line in events if line]

    assert rest == ["data: [DONE]"]
    assert process.wait(timeout=10) == 0
