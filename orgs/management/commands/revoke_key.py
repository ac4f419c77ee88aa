from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand
from orgs.models import DISPLAYED_KEY, PREFIX_LENGTH, APIKey, hash_key, split_key


class Command(OperatorCommand):
    help = (
        "Revoke an API key, given whole or as the admin's key list shows it (b3os_<prefix>): every API process "
        "refuses it from then on."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("key", help="The key, or b3os_<prefix> as the admin lists it")

    def handle(self, *args: Any, key: str, **options: Any) -> None:
        term = key.strip()
        if split_key(term) is not None:
            found = APIKey.objects.filter(hashed_key=hash_key(term))
        elif (shown := DISPLAYED_KEY.fullmatch(term)) and len(shown["prefix"]) == PREFIX_LENGTH:
            found = APIKey.objects.filter(prefix=shown["prefix"])
        else:
            raise CommandError(
                f"Give the key whole, or b3os_<prefix> with its {PREFIX_LENGTH} characters as the admin lists it."
            )
        api_key = found.select_related("organization").first()
        if api_key is None:
            raise CommandError(f"No key {term!r}.")
        named = f"{api_key.display_prefix} ({api_key.name or 'no name'}) of {api_key.organization.slug!r}"
        if api_key.revoked_at is not None:
            self.stdout.write(f"{named} was revoked already, at {api_key.revoked_at:%Y-%m-%d %H:%M:%S %Z}.")
            return
        api_key.revoke()
        self.stdout.write(f"Revoked {named}.")
