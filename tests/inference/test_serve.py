"""The serve command's changes to daphne and Twisted keep their behaviour."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from twisted.web.http import _parseContentType

from inference.management.commands.serve import media_type
from tests.conftest import ROOT


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


@pytest.mark.parametrize("port", ["99999", "-1", "0", "http"])
def test_serve_on_a_port_no_server_can_have_says_which_ports_there_are(port: str) -> None:
    with pytest.raises(CommandError, match=f"a port is a whole number from 1 to 65535, not '{port}'"):
        call_command("serve", f"--port={port}")
