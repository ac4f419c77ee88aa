from __future__ import annotations

from datetime import date
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser

from core.commands import OperatorCommand
from inference.usage import reports


class Command(OperatorCommand):
    help = (
        "Roll raw usage records up into daily rollups (re-runnable: a day is recomputed, never counted twice), "
        "then delete raw records older than USAGE_RETENTION_DAYS."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--day", type=date.fromisoformat, help="Recompute only this UTC day (YYYY-MM-DD).")
        parser.add_argument("--no-prune", action="store_true", help="Keep every raw record.")

    def handle(self, *args: Any, day: date | None, no_prune: bool, **options: Any) -> None:
        if day is not None:
            try:
                rows = reports.roll_up_day(day)
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            if rows is None:
                self.stdout.write(f"{day}: no raw records, rollups left as they were.")
            else:
                self.stdout.write(f"{day}: {rows} rollup row(s).")
            return
        days = reports.roll_up()
        self.stdout.write(f"Rolled up {len(days)} day(s)" + (f": {days[0]} to {days[-1]}." if days else "."))
        if not no_prune:
            pruned = reports.prune()
            retention = settings.USAGE_RETENTION_DAYS
            kept = f"older than {retention} day(s)" if retention else "none: USAGE_RETENTION_DAYS is 0"
            self.stdout.write(f"Pruned {pruned} raw record(s) ({kept}).")
