"""Naming the OS thread a Python thread runs on, so that ``top -H``, ``ps -L`` and ``/proc/<pid>/task`` tell
the process's threads apart (Python names only its own ``threading.Thread`` objects)."""

from __future__ import annotations

import contextlib
import ctypes
import sys

PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Names the calling OS thread (at most 15 bytes of ``name``); threads it starts later inherit the name."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
