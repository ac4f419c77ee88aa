"""Celery tasks: thin interfaces over the agent services."""

from __future__ import annotations

from celery import shared_task

from . import services


@shared_task(name="agents.prune_responses", ignore_result=True)
def prune_responses() -> None:
    """Delete stored conversations past their retention (scheduled by Celery beat)."""
    services.prune_responses()
