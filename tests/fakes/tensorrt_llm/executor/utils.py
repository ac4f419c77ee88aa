"""Mirrors ``tensorrt_llm/executor/utils.py``."""

from __future__ import annotations

import asyncio


def has_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RequestError(RuntimeError):
    """The error raised when the request is failed."""
