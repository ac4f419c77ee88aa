"""Authenticated keys, remembered per process until anything about keys or organizations changes, and never
for longer than ``API_KEY_CACHE_SECONDS``.

Every committed change to a key or an organization (saves, deletes, queryset updates such as the admin's
revoke action) bumps a version: in Redis when distributed, so that every API process sees it on its next
request, or in this process when embedded (the admin runs in the serving process). A request reads the
version and trusts its remembered key only if nothing changed since it was remembered; so a revocation
takes effect at once everywhere, while an unchanged key costs no database query.

The bump waits for the commit: bumped before it, a request in between would read the old row and remember
it under the new version, trusted until some unrelated change. The age bound covers what the version
cannot: a bump lost to a Redis failure after the commit, or a Redis restart that resets the counter to a
version some process remembered keys under.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core.redis import async_client, sync_client

if TYPE_CHECKING:
    from .models import APIKey

VERSION_KEY = "b3os:auth:version"
MAX_ENTRIES = 100_000

_local_version = 0
_lock = threading.Lock()
_entries: dict[str, tuple[int, float, APIKey]] = {}  # keyed hash: (version, when remembered (monotonic), key)


def bump() -> None:
    """Something about keys or organizations changed: forget every remembered key, in every process."""
    global _local_version
    with _lock:
        _local_version += 1
        _entries.clear()
    if settings.DISTRIBUTED:
        sync_client().incr(VERSION_KEY)


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
    return _local_version


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
