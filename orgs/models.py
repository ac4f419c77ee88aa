from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import string
from datetime import datetime, timedelta

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone
from django.utils.text import slugify

from . import keycache

KEY_PREFIX = "b3os"
PREFIX_LENGTH = 10  # random characters used to find the row
SECRET_LENGTH = 43  # 256 bits of KEY_ALPHABET
# Letters and digits: a key is selected whole by a double-click, where a '-' would end the selection mid-key.
KEY_ALPHABET = string.ascii_letters + string.digits


def _random_text(length: int) -> str:
    return "".join(secrets.choice(KEY_ALPHABET) for _ in range(length))


LAST_USED_GRANULARITY = timedelta(minutes=1)


class ChangeTrackingQuerySet(models.QuerySet):
    """Bulk updates and deletes invalidate remembered keys too (the admin's revoke action is one)."""

    def update(self, **kwargs: object) -> int:
        count = super().update(**kwargs)
        keycache.bump_on_commit()
        return count

    def update_bookkeeping(self, **kwargs: object) -> int:
        """An update that changes nothing about access (last use), so remembered keys stay valid."""
        return super().update(**kwargs)

    def delete(self) -> tuple[int, dict[str, int]]:
        result = super().delete()
        keycache.bump_on_commit()
        return result


SLUG_RULE = "%(value)r is not a valid slug: use lowercase letters, digits and hyphens."


def validate_organization_slug(value: str) -> None:
    """A slug is what ``slugify`` leaves as it is: it is the agent runtime's tenant id, compared exactly, so ``Demo``
    beside ``demo`` would be two tenants; and it is the rule of ``create_org`` and of the admin's slug filled in from
    the name."""
    if slugify(value) != value:
        raise ValidationError(SLUG_RULE, code="invalid", params={"value": value})


class Organization(models.Model):
    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True, validators=[validate_organization_slug])
    active = models.BooleanField(default=True, help_text="Inactive organizations' keys are refused.")
    created = models.DateTimeField(auto_now_add=True)

    objects = ChangeTrackingQuerySet.as_manager()

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    # An organization is the API's authenticated principal (``request.user``).
    is_authenticated = True
    is_anonymous = False


def hash_key(raw_key: str) -> str:
    """Keyed hash of a whole API key; the only form in which a key is stored."""
    return hmac.new(settings.API_KEY_HASH_SECRET.encode(), raw_key.encode(), hashlib.sha256).hexdigest()


# A key as the admin's key list shows it, or the start of that: its prefix, maybe the underscore and ellipsis after it.
DISPLAYED_KEY = re.compile(rf"{KEY_PREFIX}_(?P<prefix>[^_\s]{{0,{PREFIX_LENGTH}}})(?:_(?:…|\.\.\.)?)?")


def split_key(raw_key: str) -> str | None:
    """The lookup prefix of a well-formed key, or None."""
    parts = raw_key.split("_")
    if len(parts) != 3 or parts[0] != KEY_PREFIX or len(parts[1]) != PREFIX_LENGTH or len(parts[2]) < 32:
        return None
    return parts[1]


class APIKeyQuerySet(ChangeTrackingQuerySet):
    def usable(self) -> APIKeyQuerySet:
        now = timezone.now()
        return self.filter(revoked_at__isnull=True, organization__active=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class APIKey(models.Model):
    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=200, blank=True)
    prefix = models.CharField(max_length=PREFIX_LENGTH, unique=True, editable=False)
    hashed_key = models.CharField(max_length=64, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Leave blank for a key that does not expire.")
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)

    objects = APIKeyQuerySet.as_manager()

    class Meta:
        verbose_name = "API key"
        ordering = ["-created"]

    def __str__(self) -> str:
        return f"{self.name or 'key'} ({self.display_prefix})"

    @property
    def display_prefix(self) -> str:
        return f"{KEY_PREFIX}_{self.prefix}_…" if self.prefix else "—"

    @classmethod
    def generate(
        cls, *, organization: Organization, name: str = "", expires_at: datetime | None = None
    ) -> tuple[APIKey, str]:
        """Create a key; the raw secret is returned here once and never stored."""
        while True:
            prefix = _random_text(PREFIX_LENGTH)
            if not cls.objects.filter(prefix=prefix).exists():
                break
        raw = f"{KEY_PREFIX}_{prefix}_{_random_text(SECRET_LENGTH)}"
        key = cls.objects.create(
            organization=organization, name=name, prefix=prefix, hashed_key=hash_key(raw), expires_at=expires_at
        )
        return key, raw

    def matches(self, raw_key: str) -> bool:
        return hmac.compare_digest(self.hashed_key, hash_key(raw_key))

    @property
    def state(self) -> str:
        if self.revoked_at:
            return "revoked"
        if self.expires_at and self.expires_at <= timezone.now():
            return "expired"
        if not self.organization.active:
            return "organization inactive"  # refused as a revoked key is, until the organization is active again
        return "active"

    def revoke(self) -> None:
        if self.revoked_at is None:
            self.revoked_at = timezone.now()
            self.save(update_fields=["revoked_at"])

    def needs_last_used_update(self, now: datetime) -> bool:
        return self.last_used_at is None or now - self.last_used_at >= LAST_USED_GRANULARITY


class Limit(models.Model):
    """An organization's limits: its default (no model) or an override for one catalog model.

    A blank number means unlimited.
    """

    organization = models.ForeignKey(Organization, on_delete=models.CASCADE, related_name="limits")
    model = models.ForeignKey(
        "inference.CatalogEntry",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="limits",
        help_text="Blank: the organization's default for every model.",
    )
    tokens_per_minute = models.PositiveIntegerField(null=True, blank=True)
    requests_per_minute = models.PositiveIntegerField(null=True, blank=True)
    requests_in_flight = models.PositiveIntegerField(null=True, blank=True)
    updated = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["organization", "model"], name="one_limit_per_org_and_model"),
            models.UniqueConstraint(
                fields=["organization"],
                condition=models.Q(model__isnull=True),
                name="one_default_limit_per_org",
                violation_error_message=(
                    "This organization has a default limit already (model left blank): change that one instead."
                ),
            ),
        ]

    def __str__(self) -> str:
        scope = self.model.public_id if self.model_id else "all models"
        return f"{self.organization.slug} / {scope}"

    @property
    def lifts_the_default(self) -> bool:
        """A model's row with no limit: the model is unlimited for the organization, whatever its default row says."""
        limits = (self.tokens_per_minute, self.requests_per_minute, self.requests_in_flight)
        return self.model_id is not None and limits == (None, None, None)
