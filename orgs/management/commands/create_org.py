from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandParser

from core.commands import OperatorCommand, refused
from orgs.services import create_organization


class Command(OperatorCommand):
    help = "Create an organization (or leave an existing one as it is) and print its slug."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("slug", help="Unique short name, e.g. acme")
        parser.add_argument("--name", default="", help="Display name (defaults to the slug)")

    def handle(self, *args: Any, slug: str, name: str, **options: Any) -> None:
        try:
            org, created = create_organization(slug=slug, name=name)
        except ValidationError as exc:
            raise refused(exc) from None
        self.stderr.write(f"{'Created' if created else 'Exists'}: organization {org.slug}")
        self.stdout.write(org.slug)
