"""Authenticated keys, remembered per process until anything about keys or organizations changes, and never
for longer than ``API_KEY_CACHE_SECONDS``.

Every committed change to a key or an organization (saves, deletes, queryset updates such as the admin's
revoke action) bumps a version: in Redis when distributed, so that every API process sees it on its next
request; when embedded, in this process (the admin runs in the serving process) and in the modification
time of a file beside the SQLite database, which every process opening that database reads (a management
command or a shell revoking a key). A request reads the version and trusts its remembered key only if
nothing changed since it was remembered; so a revocation takes effect at once everywhere, while an
unchanged key costs no database query (one ``stat`` when embedded).

The bump waits for the commit: bumped before it, a request in between would read the old row and remember
it under the new version, trusted until some unrelated change. The age bound covers what the version
cannot: a bump lost to a Redis failure after the commit, or a Redis restart that resets the counter to a
version some process remembered keys under.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import connections, transaction
from django.utils import timezone

from core.outages import REDIS_ERRORS
from core.redis import async_client, sync_client

if TYPE_CHECKING:
    from .models import APIKey

VERSION_KEY = "b3os:auth:version"
MAX_ENTRIES = 100_000

_local_version = 0
_lock = threading.Lock()
_entries: dict[str, tuple[int, float, APIKey]] = {}  # keyed hash: (version, when remembered (monotonic), key)


logger = logging.getLogger(__name__)


def bump() -> None:
    """Something about keys or organizations changed: forget every remembered key, in every process."""
    global _local_version
    with _lock:
        _local_version += 1
        _entries.clear()
    if settings.DISTRIBUTED:
        try:
            sync_client().incr(VERSION_KEY)
        except REDIS_ERRORS as exc:
            logger.warning(
                "the other processes could not be told at once that keys or organizations changed (Redis: %s: %s); "
                "they see it within API_KEY_CACHE_SECONDS (%s s)",
                type(exc).__name__,
                exc,
                settings.API_KEY_CACHE_SECONDS,
            )
    elif (path := _version_file()) is not None:
        try:
            # Later than the last bump even within the file system's clock tick (a few milliseconds on some).
            stamp = max(time.time_ns(), _file_version() + 1)
            path.touch()
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            logger.exception("could not tell other processes that keys changed (%s)", path)


def _version_file() -> Path | None:
    """Beside the SQLite database file, which every process of an embedded deployment opens; none for an
    in-memory database or another engine."""
    database = connections["default"].settings_dict
    return _beside(database["ENGINE"], str(database.get("NAME") or ""))


@functools.lru_cache(maxsize=8)  # read on every request: the database's name changes only in tests
def _beside(engine: str, name: str) -> Path | None:
    if not engine.endswith("sqlite3") or not name or name == ":memory:" or name.startswith("file:"):
        return None
    return Path(f"{name}.keys-changed")


def _file_version() -> int:
    if (path := _version_file()) is None:
        return 0
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def bump_on_commit() -> None:
    """``bump`` once the current transaction commits (at once outside one).

    Robust: the change is committed whatever happens to the bump, so a failing Redis is logged rather than
    turned into an error for a change that took place; the age bound then limits how long it goes unseen.
    """
    transaction.on_commit(bump, robust=True)


async def current_version() -> int:
    if settings.DISTRIBUTED:
        value = await async_client().get(VERSION_KEY)
        return int(value or 0)
    return _local_version + _file_version()  # both only grow: the sum changes whenever either does


def recall(hashed: str, version: int) -> APIKey | None:
    found = _entries.get(hashed)
    if found is None:
        return None
    remembered_version, remembered_at, key = found
    if remembered_version != version or time.monotonic() - remembered_at >= settings.API_KEY_CACHE_SECONDS:
        return None
    if key.expires_at is not None and key.expires_at <= timezone.now():
        return None
    return key


def remember(hashed: str, version: int, key: APIKey) -> None:
    if settings.API_KEY_CACHE_SECONDS <= 0:
        return
    with _lock:
        if len(_entries) >= MAX_ENTRIES:
            _entries.clear()
        _entries[hashed] = (version, time.monotonic(), key)
