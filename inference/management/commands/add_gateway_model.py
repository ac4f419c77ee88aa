from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.core.management.base import CommandError, CommandParser
from django.db import transaction

from core.commands import OperatorCommand, refused
from inference.engine.entries import serving_warning
from inference.models import GATEWAY, GATEWAY_PARAMETERS, CatalogEntry


class Command(OperatorCommand):
    help = (
        'Offer models through the gateway ("route": "gateway"): a catalog entry with no local runner, sent to '
        "GATEWAY_BASE_URL or to its own upstream. Run again to change it: what is not given stays as it was."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("models", nargs="+", help="The ids clients send as 'model', e.g. openai/gpt-4o")
        parser.add_argument(
            "--upstream-model", help="The model's id at the upstream (default: the id); for one model only"
        )
        parser.add_argument("--upstream-url", help="Its own upstream (default: GATEWAY_BASE_URL)")
        parser.add_argument(
            "--allow",
            help="Comma-separated, of what the node refuses that may go through: "
            + ", ".join(name for name, _ in GATEWAY_PARAMETERS),
        )
        switch = parser.add_mutually_exclusive_group()
        switch.add_argument("--disable", action="store_true", help="Refuse the model without removing it")
        switch.add_argument("--enable", action="store_true", help="Serve a model disabled before")

    def handle(
        self,
        *args: Any,
        models: list[str],
        upstream_model: str | None,
        upstream_url: str | None,
        allow: str | None,
        disable: bool,
        enable: bool,
        **options: Any,
    ) -> None:
        if upstream_model and len(models) > 1:
            raise CommandError("--upstream-model names the upstream's id of one model: give one model with it")
        entries = []
        for model in models:  # every one checked before any is saved
            entry = CatalogEntry.objects.filter(public_id=model).first() or CatalogEntry(
                public_id=model, runner=GATEWAY
            )
            if entry.runner != GATEWAY:
                # Its runner's settings would be lost: that change is the admin's, made knowingly.
                raise CommandError(
                    f"{model} is served here by its {entry.runner} runner: it is not a gateway entry. Change or "
                    "delete it in the admin first, or give the gateway model another id."
                )
            if upstream_model is not None:
                entry.upstream_model = upstream_model
            if upstream_url is not None:
                entry.upstream_base_url = upstream_url
            if allow is not None:
                entry.gateway_parameters = [name.strip() for name in allow.split(",") if name.strip()]
            if disable or enable:
                entry.enabled = enable
            try:
                entry.full_clean()
            except ValidationError as exc:
                raise refused(exc, about=model) from None
            entries.append(entry)
        with transaction.atomic():
            for entry in entries:
                entry.save()
        for entry in entries:
            self.stdout.write(entry.public_id)
            if warning := serving_warning(entry):
                self.stderr.write(warning)
