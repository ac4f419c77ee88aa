from __future__ import annotations

from typing import Any

from django.conf import settings

from agents.services import prune_responses
from core.commands import OperatorCommand


class Command(OperatorCommand):
    help = (
        "Delete stored agent conversations whose last turn is older than AGENT_RESPONSE_RETENTION_DAYS "
        "(with their feedback). Celery beat runs this hourly in distributed mode."
    )

    def handle(self, *args: Any, **options: Any) -> None:
        deleted = prune_responses()
        days = settings.AGENT_RESPONSE_RETENTION_DAYS
        self.stdout.write(f"{deleted} stored response(s) deleted (retention: {days or 'unlimited'} days).")
