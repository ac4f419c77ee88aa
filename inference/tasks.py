"""Celery tasks: thin interfaces over the dispatch services."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from celery import shared_task

from inference.engine.dispatch import GENERATE_TASK, serve_job
from inference.engine.runners.base import GenerationJob
from inference.usage.reports import roll_up_and_prune

_local = threading.local()


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop per worker thread, kept for the thread's life: the Channels layer and the Redis
    client pool connections per loop, so a new loop per task would reconnect every time."""
    loop = getattr(_local, "loop", None)
    if loop is None:
        loop = _local.loop = asyncio.new_event_loop()
    return loop


@shared_task(name=GENERATE_TASK, ignore_result=True, acks_late=False)
def generate(job: dict[str, Any], reply_channel: str) -> None:
    _loop().run_until_complete(serve_job(GenerationJob.from_dict(job), reply_channel))


@shared_task(name="inference.rollup_usage", ignore_result=True)
def rollup_usage() -> None:
    """Roll usage up into daily rollups and prune old raw records (scheduled by Celery beat)."""
    roll_up_and_prune()
