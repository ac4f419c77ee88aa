"""Workflows over organizations, keys and limits."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from core.db import db_task

from . import keycache, lastused
from .exceptions import InvalidAPIKey
from .models import APIKey, Limit, Organization, hash_key, split_key


def authenticate_key(*, raw_key: str) -> APIKey:
    """The usable key for ``raw_key`` with its organization loaded, or ``InvalidAPIKey``.

    No cache: a revocation takes effect at the next request in every process. One read, no write: the
    key's use is noted for the batched writer.
    """
    prefix = split_key(raw_key)
    if prefix is None:
        raise InvalidAPIKey("malformed")
    key = APIKey.objects.usable().select_related("organization").filter(prefix=prefix).first()
    if key is None or not key.matches(raw_key):
        raise InvalidAPIKey("unknown")
    note_use(key)
    return key


def note_use(key: APIKey) -> None:
    """Record a use of ``key``, at most once per ``LAST_USED_GRANULARITY``, off the request path."""
    now = timezone.now()
    if key.needs_last_used_update(now):
        key.last_used_at = now
        lastused.note(key.pk, now)


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
    else:
        note_use(key)
    return key


def create_organization(*, slug: str, name: str = "") -> tuple[Organization, bool]:
    """The organization ``slug``, made if there is none; ``ValidationError`` for a slug or name its form would
    refuse (PostgreSQL would refuse an overlong one only at the insert, SQLite never)."""
    Organization(slug=slug, name=name or slug).full_clean(validate_unique=False)
    return Organization.objects.get_or_create(slug=slug, defaults={"name": name or slug})


def create_api_key(*, organization: Organization, name: str = "", expires_at: datetime | None = None) -> str:
    """A new key's raw secret, shown to its owner once; ``ValidationError`` for a name its form would refuse."""
    APIKey(organization=organization, name=name, expires_at=expires_at).clean_fields(
        exclude=["organization", "prefix", "hashed_key"]
    )
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
    """``ValidationError`` for numbers the limit's form would refuse (negative, or past what the database holds)."""
    Limit(
        organization=organization,
        model_id=model_id,
        tokens_per_minute=tokens_per_minute,
        requests_per_minute=requests_per_minute,
        requests_in_flight=requests_in_flight,
    ).clean_fields(exclude=["organization", "model"])
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
