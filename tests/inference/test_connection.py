"""How `manage.py serve` holds a connection: a deadline for reading each request, and malformed requests refused in
the API's error shape, over raw sockets against a served process (these happen below Django, in Twisted)."""

from __future__ import annotations

import json
import re
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from http.client import HTTPResponse
from typing import Any

import httpx
import pytest
from twisted.internet import tcp

from inference.api.connection import APIChannel
from tests.conftest import ROOT, LiveServer, start_server, stop_server, wait_for_http
from tests.services import free_port

DEADLINE = 2  # HTTP_REQUEST_READ_TIMEOUT_SECONDS of the served process
LATE = 1.5  # what the deadline may be missed by on a busy machine
CHAT = "/v1/infer/chat/completions"
QUESTION = {"model": "upstream/gpt-x", "route": "gateway", "messages": [{"role": "user", "content": "Hi"}]}


@dataclass
class Served:
    server: LiveServer

    def connect(self) -> socket.socket:
        port = int(self.server.url.rsplit(":", 1)[1])
        return socket.create_connection(("127.0.0.1", port), timeout=DEADLINE + 5)

    def head(self, method: str, path: str, *, body: bytes = b"", extra: str = "") -> bytes:
        return (
            f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {self.server.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        ).encode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    # The gateway's fake upstream answers at once, or paces a stream as long as asked: no model time in these tests.
    port = free_port()
    upstream = subprocess.Popen([sys.executable, "-m", "tests.fakes.openai_upstream", "--port", str(port)], cwd=ROOT)
    wait_for_http(f"http://127.0.0.1:{port}/last", process=upstream)
    server = start_server(
        tmp_path_factory.mktemp("connections"),
        extra_env={
            "HTTP_REQUEST_READ_TIMEOUT_SECONDS": str(DEADLINE),
            "GATEWAY_BASE_URL": f"http://127.0.0.1:{port}/v1",
            "GATEWAY_API_KEY": "upstream-key",
        },
        org="conn",
    )
    server.manage("add_gateway_model", "upstream/gpt-x", "trickle")
    yield Served(server)
    stop_server(server)
    upstream.terminate()


def answer(sock: socket.socket) -> HTTPResponse:
    response = HTTPResponse(sock)
    response.begin()
    return response


def trickle(sock: socket.socket, pieces: Iterable[bytes], *, every: float) -> float:
    """Send ``pieces`` ``every`` seconds apart until the server answers; how long after the first it did."""
    started = time.monotonic()
    for piece in pieces:
        sock.sendall(piece)
        if select.select([sock], [], [], every)[0] or time.monotonic() - started > DEADLINE + LATE:
            break
    return time.monotonic() - started


def closed(sock: socket.socket) -> bool:
    """Whether the server closes the connection within the deadline, without sending anything more."""
    sock.settimeout(DEADLINE + LATE)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def assert_refused(response: HTTPResponse, status: int, code: str) -> dict[str, Any]:
    assert response.status == status
    assert response.getheader("Content-Type") == "application/json"
    assert response.getheader("Connection") == "close"
    assert re.fullmatch(r"req_[0-9a-z]{26}", response.getheader("x-request-id") or "")
    assert (response.getheader("Server-Timing") or "").startswith("total;dur=")
    body = json.loads(response.read())
    assert set(body) == {"error"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == code
    assert body["error"]["param"] is None and body["error"]["message"]
    return body["error"]


# The deadline for reading a request


def test_a_client_trickling_its_headers_gets_a_408_at_the_deadline_and_is_closed(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(b"POST /v1/infer/chat/completions HTTP/1.1\r\nHost: x\r\n")
        took = trickle(sock, (b"X-Pad-%d: y\r\n" % n for n in range(100)), every=0.3)
        assert DEADLINE - 0.3 < took < DEADLINE + LATE
        error = assert_refused(answer(sock), 408, "request_timeout")
        assert f"{DEADLINE} s" in error["message"]
        assert closed(sock)


def test_a_client_trickling_its_body_gets_a_408_at_the_deadline(served: Served) -> None:
    body = json.dumps(QUESTION).encode()
    with served.connect() as sock:
        sock.sendall(served.head("POST", CHAT, body=body))
        took = trickle(sock, (body[n : n + 1] for n in range(len(body))), every=0.3)
        assert DEADLINE - 0.3 < took < DEADLINE + LATE
        assert_refused(answer(sock), 408, "request_timeout")
        assert closed(sock)


def test_a_slow_but_steady_request_within_the_deadline_is_answered(served: Served) -> None:
    body = json.dumps(QUESTION).encode()
    request = served.head("POST", CHAT, body=body) + body
    with served.connect() as sock:
        trickle(sock, (request[n : n + 40] for n in range(0, len(request), 40)), every=(DEADLINE * 0.6) / 10)
        response = answer(sock)
        assert response.status == 200, response.read()
        assert json.loads(response.read())["choices"][0]["message"]["content"]


def test_a_large_body_sent_at_a_steady_rate_within_the_deadline_is_read_whole(served: Served) -> None:
    question = {**QUESTION, "messages": [{"role": "user", "content": "word " * 1_200_000}]}
    body = json.dumps(question).encode()  # 6 MB
    with served.connect() as sock:
        sock.sendall(served.head("POST", CHAT, body=body))
        trickle(sock, (body[n : n + 1_000_000] for n in range(0, len(body), 1_000_000)), every=DEADLINE * 0.6 / 6)
        response = answer(sock)
        assert response.status == 200, response.read()


def test_an_idle_kept_alive_connection_is_closed_quietly_after_the_deadline(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(served.head("GET", "/v1/infer/models"))
        assert answer(sock).read()
        idle = time.monotonic()
        assert closed(sock)
        assert DEADLINE - 0.3 < time.monotonic() - idle < DEADLINE + LATE


def test_the_next_request_on_a_kept_alive_connection_gets_a_deadline_of_its_own(served: Served) -> None:
    request = served.head("GET", "/v1/infer/models")
    with served.connect() as sock:
        sock.sendall(request)
        assert answer(sock).status == 200
        time.sleep(DEADLINE * 0.6)
        # Idle and slow together take longer than the deadline; the request alone does not.
        trickle(sock, (request[n : n + 20] for n in range(0, len(request), 20)), every=DEADLINE * 0.6 / 8)
        assert answer(sock).status == 200


@pytest.mark.parametrize("options", ["keep-alive, close", "close,keep-alive", "keep-alive\r\nConnection: close"])
def test_a_connection_asked_to_close_among_other_options_is_closed_after_its_answer(
    served: Served, options: str
) -> None:
    with served.connect() as sock:
        sock.sendall(served.head("GET", "/v1/infer/models", extra=f"Connection: {options}\r\n"))
        response = answer(sock)
        assert response.status == 200 and response.getheader("Connection") == "close"
        response.read()
        sock.settimeout(DEADLINE / 2)  # closed at once, not at the idle deadline
        assert sock.recv(1) == b""


def test_a_stream_that_runs_past_the_deadline_is_not_cut(served: Served) -> None:
    question = {**QUESTION, "model": "trickle", "stream": True, "metadata": {"chunks": "8", "interval": "0.5"}}
    started = time.monotonic()
    with httpx.stream(
        "POST",
        served.server.url + CHAT,
        json=question,
        headers={"Authorization": f"Bearer {served.server.key}"},
        timeout=DEADLINE + 10,
    ) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert time.monotonic() - started > DEADLINE + 1
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    text = "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks if chunk["choices"])
    assert text == "The Willamette River flows north through Oregon."


# Malformed requests, refused before any application code


def many_headers(count: int, *, size: int) -> str:
    return "".join(f"X-Pad-{n}: {'a' * size}\r\n" for n in range(count))


@pytest.mark.parametrize(
    ("path", "extra", "status", "code"),
    [
        pytest.param(CHAT, "X-Big: " + "a" * 60_000 + "\r\n", 431, "headers_too_large", id="a 60 KB header"),
        pytest.param(CHAT, "X-Big: " + "a" * 1_000_000 + "\r\n", 431, "headers_too_large", id="a 1 MB header"),
        # Still being sent when refused: the refusal must not reset the connection under the client's feet.
        pytest.param(CHAT, "X-Big: " + "a" * 16_000_000 + "\r\n", 431, "headers_too_large", id="a 16 MB header"),
        pytest.param(CHAT, many_headers(20, size=1000), 431, "headers_too_large", id="20 KB of headers in all"),
        pytest.param(CHAT, "X: y\r\n" * 5000, 431, "headers_too_large", id="5000 headers"),
        pytest.param(CHAT + "?q=" + "a" * 20_000, "", 414, "uri_too_long", id="a 20 KB URL"),
        pytest.param(CHAT, "Content-Length: 5\r\n", 400, "malformed_request", id="two Content-Lengths"),
        pytest.param(CHAT, "Transfer-Encoding: chunked\r\n", 400, "malformed_request", id="Transfer-Encoding too"),
        pytest.param(CHAT, "Content-Length: -1\r\n", 400, "malformed_request", id="a negative length"),
        pytest.param(CHAT, "Bad Name: y\r\n", 400, "malformed_request", id="a space in a header name"),
    ],
)
def test_a_malformed_request_head_gets_an_error_in_the_apis_shape(
    served: Served, path: str, extra: str, status: int, code: str
) -> None:
    body = json.dumps(QUESTION).encode()
    with served.connect() as sock:
        sock.sendall(served.head("POST", path, body=body, extra=extra) + body)
        assert_refused(answer(sock), status, code)
        assert closed(sock)


def test_a_malformed_chunked_body_gets_an_error_in_the_apis_shape(served: Served) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    with served.connect() as sock:
        sock.sendall(head + b"zz\r\n{}\r\n0\r\n\r\n")
        error = assert_refused(answer(sock), 400, "malformed_request")
        assert "chunked" in error["message"]
        assert closed(sock)


@pytest.mark.parametrize("body", [b'{"model": "upstream/gpt-x"}', b"--x\r\nContent-Disposition: form-data\r\n\r\n"])
def test_a_multipart_body_is_told_to_be_json_whether_or_not_it_parses(served: Served, body: bytes) -> None:
    head = served.head("POST", CHAT, body=body).replace(
        b"Content-Type: application/json", b"Content-Type: multipart/form-data; boundary=x"
    )
    with served.connect() as sock:
        sock.sendall(head + body)
        response = answer(sock)
        error = json.loads(response.read())["error"]
    assert (response.status, error["code"]) == (415, "unsupported_media_type")
    assert "Content-Type: application/json" in error["message"]


# A body's bound, kept while it arrives


def test_a_declared_length_past_the_bound_is_a_413_before_any_of_the_body_is_sent(served: Served) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Content-Length: 2000000000")
    with served.connect() as sock:
        # Nothing of the body follows: the answer cannot be waiting for it (and no 100 Continue invites it).
        sock.sendall(head.replace(b"\r\n\r\n", b"\r\nExpect: 100-continue\r\n\r\n"))
        error = assert_refused(answer(sock), 413, "request_too_large")
        assert "8388608 bytes" in error["message"]
        assert closed(sock)


def test_an_upload_past_the_bound_at_the_admin_is_a_page_for_the_person_there(served: Served) -> None:
    head = served.head("POST", "/admin/agents/document/add/").replace(b"Content-Length: 0", b"Content-Length: 9000000")
    with served.connect() as sock:
        sock.sendall(head)
        response = answer(sock)
        page = response.read().decode()
    assert response.status == 413 and response.getheader("Content-Type") == "text/html; charset=utf-8"
    assert "<h1>413 Request Entity Too Large</h1>" in page and "bytes" in page


def test_a_declared_length_of_thousands_of_digits_is_a_413_too(served: Served) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Content-Length: " + b"9" * 5000)
    with served.connect() as sock:
        sock.sendall(head)
        assert_refused(answer(sock), 413, "request_too_large")
        assert closed(sock)


def test_a_chunked_body_is_refused_with_a_413_once_it_passes_the_bound_not_after_it_ends(served: Served) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
    with served.connect() as sock:
        sock.sendall(head)
        for _ in range(9):  # 9 MiB, past the 8 MiB bound, and never the last chunk
            sock.sendall(chunk)
        assert_refused(answer(sock), 413, "request_too_large")
        assert closed(sock)


@pytest.mark.parametrize("size", [b"900000", b"7fffffff", b"f" * 20], ids=["9 MiB", "2 GiB", "20 digits"])
def test_a_chunk_declared_past_the_bound_is_refused_with_a_413_before_its_bytes_come(
    served: Served, size: bytes
) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    with served.connect() as sock:
        sock.sendall(head + size + b"\r\n" + b"x" * 1000)
        assert_refused(answer(sock), 413, "request_too_large")
        assert closed(sock)


def chunked(body: bytes, size: int) -> bytes:
    """``body`` framed in chunks of ``size`` bytes, and the last chunk."""
    pieces = (body[n : n + size] for n in range(0, len(body), size))
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"


def test_a_body_of_one_byte_chunks_is_refused_after_a_few_of_them_not_read_to_its_end(served: Served) -> None:
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    with served.connect() as sock:
        sock.sendall(head + b"1\r\n \r\n" * 10_000)  # and never the last chunk
        assert_refused(answer(sock), 400, "too_many_chunks")
        assert closed(sock)


def test_a_large_body_in_chunks_of_a_few_hundred_bytes_is_answered(served: Served) -> None:
    body = json.dumps(QUESTION).encode()[:-1] + b" " * 200_000 + b"}"
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    with served.connect() as sock:
        sock.sendall(head + chunked(body, 300))
        response = answer(sock)
        assert response.status == 200, response.read()


def test_a_chunked_body_within_the_bound_is_answered(served: Served) -> None:
    body = json.dumps(QUESTION).encode()
    head = served.head("POST", CHAT).replace(b"Content-Length: 0", b"Transfer-Encoding: chunked")
    with served.connect() as sock:
        sock.sendall(head + chunked(body, 7))
        response = answer(sock)
        assert response.status == 200, response.read()
        assert json.loads(response.read())["choices"][0]["message"]["content"]


def test_the_server_answers_after_refusing(served: Served) -> None:
    with served.connect() as sock:
        sock.sendall(served.head("GET", "/v1/infer/models"))
        assert answer(sock).status == 200


# --- writing: a piece of a response goes out when it is written, not on the reactor's next turn ---------------


class _Reactor:
    """What a TCP transport asks of its reactor, keeping the descriptors it is asked to watch for writing."""

    def __init__(self) -> None:
        self.writers: list[object] = []

    def addReader(self, reader: object) -> None:  # noqa: N802 (Twisted's name)
        pass

    def removeReader(self, reader: object) -> None:  # noqa: N802 (Twisted's name)
        pass

    def addWriter(self, writer: object) -> None:  # noqa: N802 (Twisted's name)
        if writer not in self.writers:  # a set, as a reactor's
            self.writers.append(writer)

    def removeWriter(self, writer: object) -> None:  # noqa: N802 (Twisted's name)
        self.writers.remove(writer)


@pytest.fixture
def wire() -> Iterator[tuple[APIChannel, Any, socket.socket, _Reactor]]:
    """A channel on a real TCP transport over a socket pair, and the client's end of it."""
    ours, theirs = socket.socketpair()
    theirs.settimeout(2)
    reactor = _Reactor()
    channel = APIChannel()
    transport = tcp.Server(ours, channel, ("127.0.0.1", 50000), None, 1, reactor)  # type: ignore[arg-type]
    channel.transport = transport  # type: ignore[assignment]
    yield channel, transport, theirs, reactor
    ours.close()
    theirs.close()


def test_a_write_with_nothing_buffered_is_on_the_wire_at_once(
    wire: tuple[APIChannel, Any, socket.socket, _Reactor],
) -> None:
    channel, transport, client, reactor = wire
    channel.writeSequence([b"6\r\n", b"data: ", b"\r\n"])
    channel.write(b"hello")
    assert client.recv(100) == b"6\r\ndata: \r\nhello"
    assert reactor.writers == [] and not transport.dataBuffer


def test_a_write_behind_unsent_bytes_waits_its_turn_behind_them(
    wire: tuple[APIChannel, Any, socket.socket, _Reactor],
) -> None:
    channel, transport, client, reactor = wire
    transport.write(b"first ")  # buffered until the reactor finds the socket writable
    channel.write(b"second")
    client.setblocking(False)
    with pytest.raises(BlockingIOError):
        client.recv(100)
    assert reactor.writers == [transport]
    transport.doWrite()
    assert client.recv(100) == b"first second"


def test_what_the_socket_does_not_take_is_buffered_and_sent_in_order(
    wire: tuple[APIChannel, Any, socket.socket, _Reactor],
) -> None:
    channel, transport, client, reactor = wire
    data = bytes(range(256)) * 40_000  # past what a socket's buffers hold
    channel.write(data)
    channel.write(b"tail")
    assert reactor.writers == [transport]
    received = bytearray()
    while len(received) < len(data) + 4:
        transport.doWrite()
        received += client.recv(1 << 20)
    assert bytes(received) == data + b"tail"
