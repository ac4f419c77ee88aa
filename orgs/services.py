"""Workflows over organizations, keys and limits."""

from __future__ import annotations

import asyncio
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from core.db import db_task

from . import keycache
from .exceptions import InvalidAPIKey
from .models import APIKey, Limit, Organization, hash_key, split_key


def authenticate_key(*, raw_key: str) -> APIKey:
    """The usable key for ``raw_key`` with its organization loaded, or ``InvalidAPIKey``.

    No cache: a revocation takes effect at the next request in every process.
    """
    prefix = split_key(raw_key)
    if prefix is None:
        raise InvalidAPIKey("malformed")
    key = APIKey.objects.usable().select_related("organization").filter(prefix=prefix).first()
    if key is None or not key.matches(raw_key):
        raise InvalidAPIKey("unknown")
    key.touch(timezone.now())
    return key


async def authenticate_key_async(*, raw_key: str) -> APIKey:
    """``authenticate_key`` for the API's hot path: a key seen before, with nothing changed since, skips the
    database."""
    if split_key(raw_key) is None:
        raise InvalidAPIKey("malformed")
    hashed = hash_key(raw_key)
    version = await keycache.current_version()
    key = keycache.recall(hashed, version)
    if key is None:
        key = await db_task(authenticate_key)(raw_key=raw_key)
        keycache.remember(hashed, version, key)
    elif key.needs_last_used_update(timezone.now()):
        asyncio.get_running_loop().create_task(db_task(key.touch)(timezone.now()))
    return key


def create_organization(*, slug: str, name: str = "") -> tuple[Organization, bool]:
    return Organization.objects.get_or_create(slug=slug, defaults={"name": name or slug})


def create_api_key(*, organization: Organization, name: str = "", expires_at: datetime | None = None) -> str:
    """A new key's raw secret, shown to its owner once."""
    _, raw = APIKey.generate(organization=organization, name=name, expires_at=expires_at)
    return raw


@transaction.atomic
def set_limit(
    *,
    organization: Organization,
    model_id: int | None,
    tokens_per_minute: int | None,
    requests_per_minute: int | None,
    requests_in_flight: int | None,
) -> Limit:
    limit, _ = Limit.objects.update_or_create(
        organization=organization,
        model_id=model_id,
        defaults={
            "tokens_per_minute": tokens_per_minute,
            "requests_per_minute": requests_per_minute,
            "requests_in_flight": requests_in_flight,
        },
    )
    return limit
