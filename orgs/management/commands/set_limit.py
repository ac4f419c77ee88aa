from __future__ import annotations

import argparse
from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand, refused
from inference.models import CatalogEntry
from orgs.models import Limit, Organization
from orgs.services import set_limit


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
        "Set an organization's limits: its default for every model, or an override for MODEL_ID, which replaces the "
        "default whole. Omitted limits are unlimited; 'none' also means unlimited. With no limit given, shows the row; "
        "--remove deletes it (an override removed, the default applies to the model again)."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("org_slug")
        parser.add_argument("model_id", nargs="?", default=None, help="A catalog model id; omit for the default")
        given = {"default": argparse.SUPPRESS}
        parser.add_argument("--tpm", type=_limit, help="Tokens per minute", **given)
        parser.add_argument("--rpm", type=_limit, help="Requests per minute", **given)
        parser.add_argument("--in-flight", type=_limit, dest="in_flight", help="Requests in flight", **given)
        parser.add_argument("--remove", action="store_true", help="Delete the row instead")

    def handle(self, *args: Any, org_slug: str, model_id: str | None, remove: bool, **options: Any) -> None:
        org = Organization.objects.filter(slug=org_slug).first()
        if org is None:
            raise CommandError(f"No organization {org_slug!r}.")
        entry = None
        if model_id is not None:
            entry = CatalogEntry.objects.filter(public_id=model_id).first()
            if entry is None:
                raise CommandError(f"No catalog model {model_id!r}.")
        limits = {name: options[name] for name in ("tpm", "rpm", "in_flight") if name in options}
        rows = Limit.objects.filter(organization=org, model=entry)
        if remove:
            if limits:
                raise CommandError("--remove deletes the row: give no limits with it.")
            deleted, _ = rows.delete()
            scope = f"{model_id} of {org_slug}" if entry else f"the default of {org_slug}"
            self.stdout.write(f"Removed the row for {scope}." if deleted else f"No row for {scope}: nothing removed.")
            return
        if not limits:  # shown, not changed: omitted limits would all be unlimited
            shown = rows.first()
            if shown is not None:
                self.stdout.write(_shown(shown))
            elif entry is None:
                self.stdout.write("No row: unlimited.")
            else:
                self.stdout.write(f"No row for {model_id}: the default row of {org_slug} applies.")
            return
        try:
            limit = set_limit(
                organization=org,
                model_id=entry.pk if entry else None,
                tokens_per_minute=limits.get("tpm"),
                requests_per_minute=limits.get("rpm"),
                requests_in_flight=limits.get("in_flight"),
            )
        except ValidationError as exc:
            raise refused(exc) from None
        self.stdout.write(_shown(limit))
        if limit.lifts_the_default:
            self.stderr.write(
                f"This row leaves {model_id} unlimited for {org_slug}, whatever its default row says. To have the "
                f"default apply to it again: manage.py set_limit {org_slug} {model_id} --remove"
            )


def _shown(limit: Limit) -> str:
    show = lambda v: "unlimited" if v is None else str(v)  # noqa: E731
    return (
        f"{limit}: tpm={show(limit.tokens_per_minute)} rpm={show(limit.requests_per_minute)} "
        f"in_flight={show(limit.requests_in_flight)}"
    )
