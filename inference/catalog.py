"""Catalog lookups for the API."""

from __future__ import annotations

from .errors import model_not_available
from .models import CatalogEntry


async def find_enabled_model(model_id: str) -> CatalogEntry | None:
    return await CatalogEntry.objects.enabled().filter(public_id=model_id).afirst()


async def get_enabled_model(model_id: str) -> CatalogEntry:
    entry = await find_enabled_model(model_id)
    if entry is None:
        raise model_not_available(model_id)
    return entry


async def list_enabled_models() -> list[CatalogEntry]:
    return [entry async for entry in CatalogEntry.objects.enabled()]
