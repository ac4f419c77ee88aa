"""Log records kept in proportion to what they tell.

A library that meets an outage of Redis may log it on every try while it lasts: channels_redis's receive loop
logs a traceback every second. ``OutageLogFilter`` lets the first one through on one line, then one a minute
saying how many it held back, so an hour without Redis is sixty lines, not 3,600 tracebacks. ``RefusalLogFilter``
keeps a permission refusal on one line, and a 503 a warning.
"""

from __future__ import annotations

import logging
import threading
import time

from django.core.exceptions import PermissionDenied

from core.outages import unavailable_service

OUTAGE_LOG_INTERVAL_SECONDS = 60.0


class OutageLogFilter(logging.Filter):
    """Records whose exception is an outage (``core.outages``) pass once per ``interval`` for each logger and
    message, on one line with the exception's type and text; other records pass as they are."""

    def __init__(self, interval: float = OUTAGE_LOG_INTERVAL_SECONDS) -> None:
        super().__init__()
        self.interval = interval
        self._told: dict[tuple[str, str], float] = {}
        self._held: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or unavailable_service(exc) is None:
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        with self._lock:
            told = self._told.get(key)
            if told is not None and now - told < self.interval:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._told[key] = now
            held = self._held.pop(key, 0)
        message = f"{record.getMessage().rstrip(':')}: {type(exc).__name__}: {exc}"
        if held:
            message += f" ({held} more like it in the last {self.interval:g} s)"
        record.msg, record.args = message, ()
        record.exc_info, record.exc_text = None, None
        return True


class RefusalLogFilter(logging.Filter):
    """Django logs each 403 with the traceback of the ``PermissionDenied`` behind it: an operator's refusal, not a
    fault. It is kept on one line. Django logs every 5xx as an error; a 503 is the node answering that it has no
    room or that a service it needs is away, with ``Retry-After``: the deployment's state, not a fault of the node
    (an outage is logged where it is met), so it is a warning, as a 429 is."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, PermissionDenied):
            record.exc_info, record.exc_text = None, None
        if getattr(record, "status_code", None) == 503 and record.levelno > logging.WARNING:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True
