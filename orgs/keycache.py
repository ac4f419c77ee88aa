"""Authenticated keys, remembered per process until anything about keys or organizations changes.

Every change to a key or an organization (saves, deletes, queryset updates such as the admin's revoke
action) bumps a version: in Redis when distributed, so that every API process sees it on its next
request, or in this process when embedded (the admin runs in the serving process). A request reads
the version and trusts its remembered key only if nothing changed since it was remembered; so a
revocation takes effect at once everywhere, while an unchanged key costs no database query.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from django.conf import settings
from django.utils import timezone

from core.redis import async_client, sync_client

if TYPE_CHECKING:
    from .models import APIKey

VERSION_KEY = "b3os:auth:version"
MAX_ENTRIES = 100_000

_local_version = 0
_lock = threading.Lock()
_entries: dict[str, tuple[int, APIKey]] = {}


def bump() -> None:
    """Something about keys or organizations changed: forget every remembered key, in every process."""
    global _local_version
    with _lock:
        _local_version += 1
        _entries.clear()
    if settings.DISTRIBUTED:
        sync_client().incr(VERSION_KEY)


async def current_version() -> int:
    if settings.DISTRIBUTED:
        value = await async_client().get(VERSION_KEY)
        return int(value or 0)
    return _local_version


def recall(hashed: str, version: int) -> APIKey | None:
    found = _entries.get(hashed)
    if found is None or found[0] != version:
        return None
    key = found[1]
    if key.expires_at is not None and key.expires_at <= timezone.now():
        return None
    return key


def remember(hashed: str, version: int, key: APIKey) -> None:
    if len(_entries) >= MAX_ENTRIES:
        _entries.clear()
    _entries[hashed] = (version, key)
