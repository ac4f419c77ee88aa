"""Keys' last use, written off the request path in batches.

Authentication only notes a key's use in memory; a background thread writes what was noted every
``FLUSH_SECONDS`` in one transaction. A write per use, even at one a minute per key, would take SQLite's
single write lock on the request path and queue requests behind each other and behind usage records.
``flush()`` writes what is noted at once (tests, shutdown).
"""

from __future__ import annotations

import atexit
import logging
import threading
from datetime import datetime

from django.db import close_old_connections, transaction

from .models import APIKey

logger = logging.getLogger("orgs.lastused")

FLUSH_SECONDS = 5.0


class _Writer:
    def __init__(self) -> None:
        self._noted: dict[int, datetime] = {}  # key id: its latest use
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._written = threading.Condition()
        self._writing = False
        self._thread: threading.Thread | None = None

    def note(self, key_id: int, when: datetime) -> None:
        with self._lock:
            if (noted := self._noted.get(key_id)) is None or noted < when:
                self._noted[key_id] = when
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="key-last-use-writer", daemon=True)
                self._thread.start()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything noted so far is written."""
        self._wake.set()
        with self._written:
            self._written.wait_for(lambda: not self._noted and not self._writing, timeout=timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            with self._lock:
                batch, self._noted = self._noted, {}
                self._writing = bool(batch)
            if batch and not self._write(batch):
                with self._lock:  # kept for the next round, unless a newer use was noted meanwhile
                    for key_id, when in batch.items():
                        self._noted.setdefault(key_id, when)
            with self._written:
                self._writing = False
                self._written.notify_all()

    @staticmethod
    def _write(batch: dict[int, datetime]) -> bool:
        try:
            close_old_connections()
            with transaction.atomic():  # one write lock for the batch, on SQLite
                for key_id, when in batch.items():
                    APIKey.objects.filter(pk=key_id).update_bookkeeping(last_used_at=when)
        except Exception:
            logger.exception("writing the last use of %d key(s) failed; kept for the next round", len(batch))
            return False
        return True


_writer = _Writer()
note = _writer.note
flush = _writer.flush
atexit.register(flush, 5.0)
