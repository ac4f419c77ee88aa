"""Catalog lookups for the API, cached briefly per process: admin changes apply within seconds."""

from __future__ import annotations

import time

from core.db import db_task
from inference.models import CatalogEntry, is_model_id

from .exceptions import ModelNotServed

CACHE_SECONDS = 2.0

_entries: dict[str, tuple[float, CatalogEntry | None]] = {}


def _lookup(model_id: str) -> CatalogEntry | None:
    return CatalogEntry.objects.enabled().filter(public_id=model_id).first()


async def find_enabled_model(model_id: str) -> CatalogEntry | None:
    if not is_model_id(model_id):  # no catalog entry is named so: nothing to look up, nor to remember
        return None
    now = time.monotonic()
    cached = _entries.get(model_id)
    if cached is not None and now - cached[0] < CACHE_SECONDS:
        return cached[1]
    entry = await db_task(_lookup)(model_id)
    if len(_entries) > 10_000:  # unknown ids from clients must not grow the cache without bound
        _entries.clear()
    _entries[model_id] = (now, entry)
    return entry


async def get_enabled_model(model_id: str) -> CatalogEntry:
    entry = await find_enabled_model(model_id)
    if entry is None:
        raise ModelNotServed(model_id)
    return entry


async def list_enabled_models() -> list[CatalogEntry]:
    return await db_task(lambda: list(CatalogEntry.objects.enabled()))()


def clear_cache() -> None:
    _entries.clear()
