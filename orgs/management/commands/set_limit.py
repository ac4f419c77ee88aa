from __future__ import annotations

import argparse
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand
from inference.models import CatalogEntry
from orgs.models import Organization
from orgs.services import set_limit

from ._problems import refused


def _limit(value: str) -> int | None:
    """A non-negative number, or 'none' / 'unlimited' for no limit."""
    if value.lower() in {"none", "unlimited", ""}:
        return None
    number = int(value) if value.strip().isdigit() else -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"a limit is a whole number of 0 or more, or 'none', not {value!r}")
    return number


class Command(OperatorCommand):
    help = (
        "Set an organization's limits: its default for every model, or an override for MODEL_ID. "
        "Omitted limits are unlimited; 'none' also means unlimited."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("org_slug")
        parser.add_argument("model_id", nargs="?", default=None, help="A catalog model id; omit for the default")
        parser.add_argument("--tpm", type=_limit, default=None, help="Tokens per minute")
        parser.add_argument("--rpm", type=_limit, default=None, help="Requests per minute")
        parser.add_argument("--in-flight", type=_limit, default=None, dest="in_flight", help="Requests in flight")

    def handle(self, *args: Any, org_slug: str, model_id: str | None, tpm: int | None, rpm: int | None,
               in_flight: int | None, **options: Any) -> None:
        org = Organization.objects.filter(slug=org_slug).first()
        if org is None:
            raise CommandError(f"No organization {org_slug!r}.")
        entry = None
        if model_id is not None:
            entry = CatalogEntry.objects.filter(public_id=model_id).first()
            if entry is None:
                raise CommandError(f"No catalog model {model_id!r}.")
        try:
            limit = set_limit(
                organization=org,
                model_id=entry.pk if entry else None,
                tokens_per_minute=tpm,
                requests_per_minute=rpm,
                requests_in_flight=in_flight,
            )
        except ValidationError as exc:
            raise refused(exc) from None
        show = lambda v: "unlimited" if v is None else str(v)  # noqa: E731
        self.stdout.write(
            f"{limit}: tpm={show(limit.tokens_per_minute)} rpm={show(limit.requests_per_minute)} "
            f"in_flight={show(limit.requests_in_flight)}"
        )
