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

from core.outages import REDIS_ERRORS
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
OUTAGE_CHECK_SECONDS = 1.0
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
        try:
            await asyncio.to_thread(
                current_app.send_task,
                GENERATE_TASK,
                args=[self._job.to_dict(), reply],
                queue=self._queue,
                expires=settings.JOB_START_TIMEOUT_SECONDS,
                # Celery's default retries a publish for seconds; with the broker away the request fails now instead.
                retry=False,
            )
        except REDIS_ERRORS as exc:
            self._finished = True
            yield [JobFailed("service_unavailable", f"the job could not be queued: {type(exc).__name__}")]
            return
        started = False
        while True:
            timeout = settings.WORKER_SILENCE_TIMEOUT_SECONDS if started else settings.JOB_START_TIMEOUT_SECONDS
            try:
                message = await self._next_message(reply, timeout)
            except REDIS_ERRORS as exc:
                # Redis went away under the job: its events cannot come back, so the stream ends here, cleanly.
                self._finished = True
                logger.warning("job %s lost its reply channel: %s: %s", self._job.job_id, type(exc).__name__, exc)
                yield [JobFailed("service_unavailable", "the model's events could not be read")]
                return
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

    async def _next_message(self, reply: str, timeout: float) -> dict[str, Any]:
        """The next message on ``reply`` within ``timeout`` seconds, else ``TimeoutError``; while waiting, Redis is
        asked every ``OUTAGE_CHECK_SECONDS`` whether it is still there, so a job that waits for a worker does not
        hold its client for the whole start timeout once Redis is gone (the Channels layer does not say)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        receive = asyncio.ensure_future(self._layer.receive(reply))
        try:
            while True:
                wait = max(0.0, min(OUTAGE_CHECK_SECONDS, deadline - loop.time()))
                done, _ = await asyncio.wait({receive}, timeout=wait)
                if done:
                    message: dict[str, Any] = receive.result()
                    return message
                if loop.time() >= deadline:
                    raise TimeoutError
                await async_client().ping()
        finally:
            if not receive.done():
                receive.cancel()

    async def cancel(self) -> None:
        if self._finished:
            return
        try:
            key = CANCEL_KEY.format(job_id=self._job.job_id)
            await async_client().set(key, b"1", ex=settings.STREAM_MAX_SECONDS + 60)
        except REDIS_ERRORS as exc:
            # The worker cannot be told; with Redis away it cannot send events either, so it stops on its own.
            logger.warning("job %s could not be cancelled: %s: %s", self._job.job_id, type(exc).__name__, exc)


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
        except REDIS_ERRORS as exc:
            # The events have nowhere to go, and the API side has ended the stream already (it watches Redis too).
            if not cancelled.is_set():
                logger.warning("job %s stopped: Redis is unavailable: %s: %s", job.job_id, type(exc).__name__, exc)
            cancelled.set()
        last_sent = time.monotonic()

    async def watch() -> None:
        key = CANCEL_KEY.format(job_id=job.job_id)
        while not cancelled.is_set():
            await asyncio.sleep(CANCEL_POLL_SECONDS)
            try:
                asked_to_stop = await client.exists(key)
            except REDIS_ERRORS:
                asked_to_stop = True  # as in send: nobody can read the events any more
            if asked_to_stop:
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
