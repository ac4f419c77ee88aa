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

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.utils import timezone

from core.outages import DATABASE_ERRORS
from inference.models import UsageRecord
from inference.usage import metrics
from orgs.models import APIKey, Organization

logger = logging.getLogger("inference.usage.records")

BATCH_SIZE = 200
BATCH_SECONDS = 0.25
RETRY_SECONDS = 1.0


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

    While the database cannot be reached, records wait and the writer tries again every ``RETRY_SECONDS``, however
    long the outage lasts, holding at most ``USAGE_MAX_PENDING_RECORDS``: past that the oldest are dropped, counted
    in ``b3os_usage_records_dropped_total`` and in the log. A batch the database refuses for what is in it is written
    again row by row, so that one bad row costs only itself.
    """

    def __init__(self) -> None:
        self._records: list[dict[str, Any]] = []
        self._pending: list[dict[str, Any]] = []  # written by the writer thread only
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._written = threading.Condition()
        self._writing = False
        self._outage_since: float | None = None
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
            self._written.wait_for(
                lambda: not self._records and not self._pending and not self._writing, timeout=timeout
            )

    def close(self) -> None:
        """At exit: what could not be written in a few seconds is lost, and said so."""
        self.flush(5.0)
        if lost := len(self._records) + len(self._pending):
            metrics.USAGE_RECORDS_DROPPED.labels("shutdown").inc(lost)
            logger.error("%d usage records were not written before the process ended", lost)

    def _run(self) -> None:
        while True:
            self._wake.wait(RETRY_SECONDS if self._pending else BATCH_SECONDS)
            self._wake.clear()
            with self._lock:
                batch, self._records = self._records, []
                self._writing = bool(batch or self._pending)
            self._pending = self._write_all(self._pending + batch)
            self._bound_pending()
            metrics.USAGE_RECORDS_PENDING.set(len(self._pending))
            with self._written:
                self._writing = False
                self._written.notify_all()

    def _write_all(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Writes ``records`` in batches; the ones left when the database went away."""
        for start in range(0, len(records), BATCH_SIZE):
            batch = records[start : start + BATCH_SIZE]
            try:
                close_old_connections()
                _insert(batch)
            except DATABASE_ERRORS as exc:
                self._database_away(exc, waiting=len(records) - start)
                return records[start:]
            except Exception:  # noqa: BLE001  (the batch holds a row the database refuses: find it)
                if (left := self._write_one_by_one(batch)) is not None:
                    return left + records[start + BATCH_SIZE :]
        if self._outage_since is not None:
            logger.warning("usage records are written again, after %.0f s", time.monotonic() - self._outage_since)
            self._outage_since = None
        return []

    def _write_one_by_one(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
        for index, row in enumerate(batch):
            try:
                close_old_connections()
                try:
                    _insert([row])
                except DATABASE_ERRORS:
                    raise
                except Exception as refusal:  # noqa: BLE001  (see whether what it names is gone)
                    self._write_orphan(row, refusal)
            except DATABASE_ERRORS as exc:
                self._database_away(exc, waiting=len(batch) - index)
                return batch[index:]
        return None

    @staticmethod
    def _write_orphan(row: dict[str, Any], refusal: Exception) -> None:
        """A row the database refused: one whose key was deleted while its request ran is written without the
        key, as the key's deletion left its other records (``SET_NULL``); one whose organization was deleted goes
        with the organization's other records; any other is dropped, said so. Raises only ``DATABASE_ERRORS``."""
        try:
            if not Organization.objects.filter(pk=row["organization_id"]).exists():
                metrics.USAGE_RECORDS_DROPPED.labels("organization_deleted").inc()
                logger.warning("a usage record of a deleted organization was dropped: %s", row.get("request_id"))
                return
            key = row.get("api_key_id")
            if key is not None and not APIKey.objects.filter(pk=key).exists():
                _insert([{**row, "api_key_id": None}])
                return
        except DATABASE_ERRORS:
            raise
        except Exception as exc:  # noqa: BLE001  (the writer's thread must outlive any row)
            refusal = exc
        metrics.USAGE_RECORDS_DROPPED.labels("refused").inc()
        logger.error(
            "a usage record was refused by the database and dropped: %s", row.get("request_id"), exc_info=refusal
        )

    def _database_away(self, exc: BaseException, *, waiting: int) -> None:
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            logger.warning(
                "the database is unavailable (%s: %s): %d usage records wait, retried every %.0f s",
                type(exc).__name__,
                exc,
                waiting,
                RETRY_SECONDS,
            )

    def _bound_pending(self) -> None:
        excess = len(self._pending) - settings.USAGE_MAX_PENDING_RECORDS
        if excess > 0:
            del self._pending[:excess]
            metrics.USAGE_RECORDS_DROPPED.labels("database_unavailable").inc(excess)
            away = time.monotonic() - (self._outage_since or time.monotonic())
            logger.error(
                "dropped %d usage records, the oldest: the database has been unavailable for %.0f s and %d more wait",
                excess,
                away,
                len(self._pending),
            )


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


_writer = _Writer()
flush = _writer.flush
atexit.register(_writer.close)
