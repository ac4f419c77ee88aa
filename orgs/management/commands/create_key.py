from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand, refused
from orgs.models import Organization
from orgs.services import create_api_key


class Command(OperatorCommand):
    help = "Create an API key for an organization and print the key alone on stdout (it is not shown again)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("org_slug", help="The organization's slug")
        parser.add_argument("--name", default="", help="A name for the key, e.g. ci or laptop")

    def handle(self, *args: Any, org_slug: str, name: str, **options: Any) -> None:
        org = Organization.objects.filter(slug=org_slug).first()
        if org is None:
            raise CommandError(f"No organization {org_slug!r}. Create it with: manage.py create_org {org_slug}")
        try:
            raw = create_api_key(organization=org, name=name)
        except ValidationError as exc:
            raise refused(exc) from None
        if not org.active:
            self.stderr.write(
                f"The organization {org_slug!r} is inactive: its keys are refused until it is made active."
            )
        self.stdout.write(raw)
