"""The serve command's changes to daphne and Twisted keep their behaviour."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from twisted.internet import endpoints, reactor
from twisted.logger import Logger
from twisted.web.http import _parseContentType

from inference.management.commands.serve import LISTEN_BACKLOG, AcceptFailures, listen_endpoint, media_type
from tests.conftest import MODEL_ID, ROOT, LiveServer, start_server


@pytest.mark.parametrize(
    "header",
    [
        b"application/json",
        b"Application/JSON; charset=utf-8",
        b"multipart/form-data; boundary=----x",
        b"application/x-www-form-urlencoded",
        b"  application/json  ;x=1",
        b'text/plain; charset="utf-8"',
        b"application/json charset",
        b"",
        b"text",
        b"a/b/c",
        b";",
        b"foo/bar;",
    ],
)
def test_the_content_type_is_read_as_twisted_reads_it(header: bytes) -> None:
    assert media_type(header) == _parseContentType(header)


@pytest.mark.parametrize(("host", "interface"), [("127.0.0.1", "127.0.0.1"), ("[::1]", "::1")], ids=["ipv4", "ipv6"])
def test_the_server_listens_with_room_for_a_burst_of_connections_not_twisteds_fifty(host: str, interface: str) -> None:
    described = endpoints.serverFromString(reactor, listen_endpoint(host, 8000))

    assert (described._interface, described._port, described._backlog) == (interface, 8000, LISTEN_BACKLOG)
    assert LISTEN_BACKLOG >= 1024


def test_connections_the_server_could_not_accept_are_told_in_its_log_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    told = AcceptFailures()
    twisted_log = Logger(observer=told)

    for _ in range(3):  # as Twisted says it, for each connection it cannot accept
        twisted_log.info("Could not accept new connection ({acceptError})", acceptError="EMFILE")
    twisted_log.info("EMFILE encountered; releasing reserved file descriptor.")
    twisted_log.info("Starting factory {factory!r}", factory=None)
    AcceptFailures()({"log_format": "Could not accept new connection ({acceptError})", "acceptError": "ECONNABORTED"})

    warnings = [record for record in caplog.records if record.levelname == "WARNING"]
    assert len(warnings) == 1 and "could not accept new connections (EMFILE)" in warnings[0].getMessage()
    assert "ulimit -n" in warnings[0].getMessage()


def test_serve_on_a_port_another_server_holds_says_so_and_exits_with_an_error(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {**os.environ, "B3OS_VAR_DIR": str(tmp_path), "DATABASE_URL": "", "REDIS_URL": ""}

        served = subprocess.run(
            [sys.executable, "manage.py", "serve", "--port", str(port)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    assert served.returncode != 0
    assert f"Cannot listen on 127.0.0.1:{port}: Address already in use" in served.stderr
    assert "Serving on" not in served.stderr


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
def test_serve_on_a_host_that_is_no_address_of_this_machine_says_so(host: str) -> None:
    # It said to stop what holds the port.
    with pytest.raises(CommandError, match=f"Cannot listen on {re.escape(host)}:.*Give an address of this machine"):
        call_command("serve", f"--host={host}", "--port=8802")


@pytest.mark.parametrize("port", ["99999", "-1", "0", "http"])
def test_serve_on_a_port_no_server_can_have_says_which_ports_there_are(port: str) -> None:
    with pytest.raises(CommandError, match=f"a port is a whole number from 1 to 65535, not '{port}'"):
        call_command("serve", f"--port={port}")


def _stream_until_stopped(server: LiveServer, max_tokens: int) -> tuple[list[dict[str, Any]], int]:
    """A streamed chat completion whose server is told to stop (SIGTERM) once its first delta has come: the
    stream's events, and the server's exit status."""
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Write a long story about a river."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    events: list[dict[str, Any]] = []
    with httpx.stream(
        "POST",
        f"{server.base_url}/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {server.key}"},
        timeout=60,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 2:
                    server.process.send_signal(signal.SIGTERM)
            elif line == "data: [DONE]":
                events.append({"done": True})
    return events, server.process.wait(timeout=60)


def test_a_server_told_to_stop_lets_the_stream_under_way_finish_and_records_it(tmp_path: Path) -> None:
    server = start_server(tmp_path / "var")

    events, status = _stream_until_stopped(server, max_tokens=48)

    assert status == 0
    assert events[-1] == {"done": True}
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert server.query("select status, error_code, output_tokens from inference_usagerecord") == [(200, "", 48)]


def test_a_stream_still_running_when_the_grace_period_ends_gets_an_error_event_and_is_recorded(
    tmp_path: Path,
) -> None:
    server = start_server(tmp_path / "var", extra_env={"SHUTDOWN_GRACE_SECONDS": "0"})

    events, status = _stream_until_stopped(server, max_tokens=2000)

    assert status == 0
    assert events[-1]["error"]["code"] == "server_shutting_down"
    assert "retry the request" in events[-1]["error"]["message"]
    ((record_status, code, output_tokens),) = server.query(
        "select status, error_code, output_tokens from inference_usagerecord"
    )
    assert (record_status, code) == (200, "server_shutting_down")
    assert 0 < output_tokens < 2000
