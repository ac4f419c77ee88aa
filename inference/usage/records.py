"""Usage records, written off the request path.

Each request that reaches admission gets a ``Meter``; finishing it queues one ``UsageRecord``. A
background thread writes queued records in batches, so the response never waits on the database.
``flush()`` waits for everything queued so far (tests, shutdown).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, DataError, IntegrityError, close_old_connections, connection, transaction
from django.utils import timezone

from inference.models import UsageRecord
from inference.usage import metrics

logger = logging.getLogger("inference.usage.records")

BATCH_SIZE = 200
BATCH_SECONDS = 0.25


@dataclass
class Meter:
    organization_id: int
    organization: str
    api_key_id: int | None
    model: str
    endpoint: str
    route: str
    request_id: str
    started: float = field(default_factory=time.monotonic)
    created: object = field(default_factory=timezone.now)
    recorded: bool = False

    def record(
        self,
        *,
        status: int,
        error_code: str = "",
        input_tokens: int = 0,
        output_tokens: int = 0,
        reasoning_tokens: int = 0,
        cached_tokens: int = 0,
        time_to_first_token_ms: int | None = None,
    ) -> None:
        """Queue this request's one record; later calls are ignored."""
        if self.recorded:
            return
        self.recorded = True
        total_ms = int((time.monotonic() - self.started) * 1000)
        metrics.observe_request(
            model=self.model,
            organization=self.organization,
            status=status,
            total_ms=total_ms,
            endpoint=self.endpoint,
            error_code=error_code,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            reasoning_tokens=reasoning_tokens,
            cached_tokens=cached_tokens,
            ttft_ms=time_to_first_token_ms,
        )
        _writer.put(
            dict(
                organization_id=self.organization_id,
                api_key_id=self.api_key_id,
                model=self.model,
                endpoint=self.endpoint,
                route=self.route,
                status=status,
                error_code=error_code,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                reasoning_tokens=reasoning_tokens,
                cached_tokens=cached_tokens,
                time_to_first_token_ms=time_to_first_token_ms,
                total_ms=total_ms,
                request_id=self.request_id,
                created=self.created,
            )
        )


class _Writer:
    """Collects records and writes them every ``BATCH_SECONDS`` from its own thread.

    The request path only appends under an uncontended lock: no wake-up per record, and the model
    instances are built here, off the event loop.
    """

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._written = threading.Condition()
        self._writing = False
        self._thread: threading.Thread | None = None

    def put(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records.append(record)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
                self._thread.start()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything queued so far is written."""
        self._wake.set()
        with self._written:
            self._written.wait_for(lambda: not self._records and not self._writing, timeout=timeout)

    def _run(self) -> None:
        while True:
            self._wake.wait(BATCH_SECONDS)
            self._wake.clear()
            with self._lock:
                batch, self._records = self._records, []
                self._writing = bool(batch)
            for start in range(0, len(batch), BATCH_SIZE):
                self._write(batch[start : start + BATCH_SIZE])
            with self._written:
                self._writing = False
                self._written.notify_all()

    @staticmethod
    def _write(batch: list[dict[str, Any]]) -> None:
        for attempt in range(3):
            try:
                close_old_connections()
                _insert(batch)
                return
            except (DataError, IntegrityError):
                # A row the database refuses fails the whole statement: the others are written one by one, so
                # that one bad record never takes every organization's records of the batch with it.
                _insert_each(batch)
                return
            except Exception:
                logger.exception("writing %d usage records failed (attempt %d)", len(batch), attempt + 1)
                time.sleep(0.5 * (attempt + 1))


def _insert(rows: list[dict[str, Any]]) -> None:
    """One INSERT statement, executed for every row, with each value prepared by its model field.

    ``bulk_create`` builds one statement holding every row's placeholders; under load that SQL
    building was an eighth of the API process's CPU, this a small fraction of it.
    """
    fields = [field for field in UsageRecord._meta.concrete_fields if not field.primary_key]
    quote = connection.ops.quote_name
    sql = "INSERT INTO {} ({}) VALUES ({})".format(
        quote(UsageRecord._meta.db_table),
        ", ".join(quote(field.column) for field in fields),
        ", ".join(["%s"] * len(fields)),
    )
    params = [[field.get_db_prep_save(row[field.attname], connection) for field in fields] for row in rows]
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.executemany(sql, params)


def _insert_each(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        try:
            _insert([row])
        except DatabaseError:
            logger.exception("usage record %s could not be written and is dropped", row.get("request_id"))


_writer = _Writer()
flush = _writer.flush
atexit.register(flush, 5.0)
