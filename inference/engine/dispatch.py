"""Getting a generation job to a runner and its events back.

Embedded mode (no ``REDIS_URL``): the job runs on this process's runner threads.
Distributed mode: the job goes as a Celery task to the model's queue; the worker sends the events
to a reply channel of the Channels layer, which this process reads. Both hand the caller the same
batches of events, ending in ``Finished`` or ``JobFailed``.

The worker keeps the stream alive with heartbeats, so a worker that dies is noticed within
``WORKER_SILENCE_TIMEOUT_SECONDS``; a cancelled job is flagged in Redis, where the worker looks
between tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from celery import current_app
from channels.exceptions import ChannelFull
from channels.layers import get_channel_layer
from django.conf import settings

from core.redis import async_client
from inference.engine.execution import JobEvent, JobFailed, decode, encode, get_renderer, get_runner, run_job
from inference.engine.runners.base import Finished, GenerationJob
from inference.models import CatalogEntry

logger = logging.getLogger("inference.engine.dispatch")

CANCEL_KEY = "b3os:cancel:{job_id}"
# The worker side of a job is the Celery task of this name (``inference.tasks.generate``), sent by name so
# that this module, which the task calls into, does not import it back.
GENERATE_TASK = "inference.generate"
HEARTBEAT_SECONDS = 1.0
CANCEL_POLL_SECONDS = 0.2
MESSAGE_TYPE = "job.events"


class Job(Protocol):
    def events(self) -> AsyncIterator[list[JobEvent]]: ...

    async def cancel(self) -> None: ...


class ThreadJob:
    """A job on this process's runner threads (embedded mode)."""

    def __init__(self, job: GenerationJob) -> None:
        self._job = job
        self._cancelled = threading.Event()

    def events(self) -> AsyncIterator[list[JobEvent]]:
        return run_job(self._job, self._cancelled)

    async def cancel(self) -> None:
        self._cancelled.set()


class ChannelJob:
    """A job on a Celery worker, its events read from a reply channel (distributed mode)."""

    def __init__(self, job: GenerationJob, queue: str) -> None:
        self._job = job
        self._queue = queue
        self._layer = get_channel_layer()
        self._finished = False

    async def events(self) -> AsyncIterator[list[JobEvent]]:
        reply = await self._layer.new_channel(prefix="job")
        await asyncio.to_thread(
            current_app.send_task,
            GENERATE_TASK,
            args=[self._job.to_dict(), reply],
            queue=self._queue,
            expires=settings.JOB_START_TIMEOUT_SECONDS,
        )
        started = False
        while True:
            timeout = settings.WORKER_SILENCE_TIMEOUT_SECONDS if started else settings.JOB_START_TIMEOUT_SECONDS
            try:
                message = await asyncio.wait_for(self._layer.receive(reply), timeout)
            except TimeoutError:
                self._finished = True
                if started:
                    yield [JobFailed("worker_lost", "the model worker stopped responding mid-generation")]
                else:
                    yield [JobFailed("no_worker", f"no worker took the job on queue {self._queue} in time")]
                return
            started = True
            events = decode(message["events"])
            if events:
                yield events
                if isinstance(events[-1], Finished | JobFailed):
                    self._finished = True
                    return

    async def cancel(self) -> None:
        if self._finished:
            return
        client = async_client()
        await client.set(CANCEL_KEY.format(job_id=self._job.job_id), b"1", ex=settings.STREAM_MAX_SECONDS + 60)


def start_job(job: GenerationJob, *, queue: str) -> Job:
    return ChannelJob(job, queue) if settings.DISTRIBUTED else ThreadJob(job)


def warm_up_embedded() -> None:
    """Load every enabled model this process serves in embedded mode, so the first request is fast."""
    for entry in CatalogEntry.objects.served_here():
        try:
            get_renderer(entry.runner, entry.runner_settings)
            get_runner(entry.runner, entry.runner_settings)
        except Exception:
            logger.exception("could not load model %s", entry.public_id)


# --- worker side ---------------------------------------------------------------------------------


async def serve_job(job: GenerationJob, reply: str) -> None:
    """Run ``job`` here and send its events to ``reply``; stop if the API side cancels or goes away."""
    layer = get_channel_layer()
    client = async_client()
    cancelled = threading.Event()
    last_sent = time.monotonic()

    async def send(wire: list[list[Any]]) -> None:
        nonlocal last_sent
        try:
            await layer.send(reply, {"type": MESSAGE_TYPE, "events": wire})
        except ChannelFull:
            cancelled.set()  # nobody is reading any more
        last_sent = time.monotonic()

    async def watch() -> None:
        key = CANCEL_KEY.format(job_id=job.job_id)
        while not cancelled.is_set():
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            if await client.exists(key):
                cancelled.set()
            elif time.monotonic() - last_sent >= HEARTBEAT_SECONDS:
                await send([])

    await send([])  # started
    watcher = asyncio.create_task(watch())
    try:
        async for batch in run_job(job, cancelled):
            await send(encode(batch))
    finally:
        watcher.cancel()
