"""Getting a generation job to a runner and its events back.

Embedded mode (no ``REDIS_URL``): the job runs on this process's runner threads.
Distributed mode: this process opens a reply channel on the Channels layer (Redis pub/sub: one ``PUBLISH`` per
message, pushed to the subscriber) and sends the job as a Celery task to the model's queue; the worker's publisher
(``replies``) puts the events on the reply channel. Both hand the caller the same batches of events, ending in
``Finished`` or ``JobFailed``.

Pub/sub keeps nothing for a subscriber that is not connected, so each message carries a sequence number: a message
lost on the way ends the stream with an error instead of leaving a hole in its text. The worker keeps the stream
alive with heartbeats, so a worker that dies is noticed within ``WORKER_SILENCE_TIMEOUT_SECONDS``; and it stops the
job as soon as nobody listens on the reply channel any more: the client hung up (this process closed the channel),
or this process is gone. A worker also says which queues it consumes, by keeping a key per queue alive in Redis
(``WorkerPresence``): a job on a queue no worker has kept alive for ``PRESENCE_TTL_SECONDS`` fails then, rather than
wait out ``JOB_START_TIMEOUT_SECONDS`` for a worker that is not there.

A Redis restart closes every connection to it, and one pooled on an event loop that is not running (a worker
thread's, between jobs) or not reading (this process's subscriber, with no reply channel open) is found closed only
by the next command sent on it. Both sides are made to carry on by themselves once Redis is back: a command, a
publish or a subscribe that fails on such a connection is made again at once on a new one (``_on_a_live_connection``,
and the Redis clients' one retry), and a
worker waits a moment for the listener of a new job (``LISTENER_WAIT_SECONDS``), since a subscription sent on a
closed connection takes effect only once the Channels layer's receive loop reconnects and subscribes again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection
from typing import Any, Protocol, TypeVar

import redis.exceptions
from celery import current_app
from channels.layers import get_channel_layer
from django.conf import settings

from core.outages import REDIS_ERRORS
from core.redis import async_client, sync_client
from inference.engine.execution import JobEvent, JobFailed, decode, get_renderer, get_runner, run_job, start_on_runner
from inference.engine.replies import Publisher, Reply
from inference.engine.runners.base import Finished, GenerationJob, RunnerError
from inference.models import CatalogEntry

logger = logging.getLogger("inference.engine.dispatch")

# The worker side of a job is the Celery task of this name (``inference.tasks.generate``), sent by name so
# that this module, which the task calls into, does not import it back.
GENERATE_TASK = "inference.generate"
HEARTBEAT_SECONDS = 1.0
OUTAGE_CHECK_SECONDS = 1.0
UNSUBSCRIBE_RETRY_SECONDS = 600.0
LISTENER_POLL_SECONDS = 0.2
# How long a worker waits for a new job's reply channel to be listened on before it drops the job: long enough for an
# API process's Channels layer to notice a connection a Redis restart closed and subscribe again (its receive loop
# looks every 0.1 s), short enough that a job whose client left while it was queued holds a thread only briefly.
LISTENER_WAIT_SECONDS = 1.0
LISTENER_WAIT_POLL_SECONDS = 0.02
# A worker refreshes its queues' keys every PRESENCE_BEAT_SECONDS; each lasts PRESENCE_TTL_SECONDS, and a job waiting
# for its start gives up once its queue's key has been missing that long (a Redis restart empties them for a beat).
PRESENCE_BEAT_SECONDS = 1.0
PRESENCE_TTL_SECONDS = 5
# How long a queue's list past JOB_BACKLOG_MAX is given to shrink (workers with room taking a burst) before a job is
# refused, and how often it is looked at meanwhile.
BACKLOG_WAIT_SECONDS = 0.5
BACKLOG_POLL_SECONDS = 0.05
# How long a job taken off its queue may take to send its first message (a worker waits up to LISTENER_WAIT_SECONDS
# for the listener first) before the job is counted as lost.
LOST_AFTER_SECONDS = 5.0


def queued_key(job_id: str) -> str:
    """Set while the job waits on its queue's list, and deleted by the worker that takes it: a job gone from both the
    list and this key without starting was lost with Redis's memory (a restart without persistence) or its worker."""
    return f"b3os:job-queued:{job_id}"


def presence_key(queue: str) -> str:
    return f"b3os:queue-served:{queue}"


# What redis-py raises, instead of its ConnectionError, when channels_redis's receive loop and a command of this module
# both reconnect its one pub/sub connection after a Redis restart ("read() called while another coroutine is already
# waiting", a writer already gone): the connection was lost all the same.
_RECONNECT_RACE = (RuntimeError, AttributeError)
_UNSUBSCRIBE_FAILURES: tuple[type[BaseException], ...] = (*REDIS_ERRORS, *_RECONNECT_RACE)


class _Unserved(Exception):
    """No worker has said for ``PRESENCE_TTL_SECONDS`` that it consumes the job's queue."""


class _Busy(TimeoutError):
    """The job's start timed out while workers consumed its queue: they had no room for it in time."""


class _Lost(Exception):
    """The job's ``queued_key`` went without the job starting: nothing holds the job any more."""


T = TypeVar("T")

# Reply channels being opened or closed past their callers: the tasks, held until they end.
_background: set[asyncio.Future[Any]] = set()


def _in_background(work: Awaitable[T]) -> asyncio.Future[T]:
    task = asyncio.ensure_future(work)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


async def _on_a_live_connection(call: Callable[[], Awaitable[T]]) -> T:
    """``call()``, made once more at once when it failed on a pooled connection that Redis had closed.

    redis-py drops a connection a command failed on, so the second try goes out on a new one; with Redis really away,
    that one is refused at once too, and its error is the caller's. Only a connection error is tried again: a
    timeout says Redis is there but not answering, and waiting for it twice helps nobody.
    """
    try:
        return await call()
    except redis.exceptions.ConnectionError:
        return await call()


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
        self._reply: str | None = None
        self._receive: asyncio.Future[dict[str, Any]] | None = None

    async def events(self) -> AsyncIterator[list[JobEvent]]:
        try:
            # Subscribed before the job is sent, so the worker's first message has a listener.
            if (backlog := await self._backlog()) >= settings.JOB_BACKLOG_MAX:
                # With no worker, the list holds the jobs of callers that gave up on them until they expire
                # (JOB_START_TIMEOUT_SECONDS): its length then says nothing of a worker's room.
                if await _on_a_live_connection(lambda: async_client().exists(presence_key(self._queue))):
                    why = f"{backlog} jobs wait on queue {self._queue} for a worker with room"
                    yield [JobFailed("overloaded", why)]
                else:
                    yield [JobFailed("no_worker", f"no worker consumes the queue {self._queue}")]
                return
            reply = await self._open_reply()
            await _on_a_live_connection(
                lambda: async_client().set(
                    queued_key(self._job.job_id), 1, px=math.ceil(settings.JOB_START_TIMEOUT_SECONDS * 1000)
                )
            )
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
            await self._close()
            yield [JobFailed("service_unavailable", f"the job could not be queued: {type(exc).__name__}", "redis")]
            return
        except BaseException:  # cancelled (the client hung up) while the job was being queued: no one will listen
            await self._close()
            raise
        try:
            async for events in self._messages(reply):
                if events and isinstance(events[-1], Finished | JobFailed):
                    await self._close()  # at once, not when the caller lets go of this generator
                    yield events
                    return
                yield events
        finally:
            await self._close()

    async def _open_reply(self) -> str:
        """A new reply channel, subscribed. The subscribe runs as a task of its own (channels_redis's would swallow a
        cancellation, or leave a channel subscribed under a name nobody knows): a caller cancelled while it runs (the
        client hung up) leaves it to finish, and the channel is closed once it is known."""
        opening = _in_background(_on_a_live_connection(self._subscribed_channel))
        try:
            self._reply = reply = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(self._close_opened)
            raise
        return reply

    async def _subscribed_channel(self) -> str:
        try:
            channel: str = await self._layer.new_channel(prefix="job.")
        except _RECONNECT_RACE as exc:
            # channels_redis reads its pub/sub connection from a task of its own, without the lock its subscribe
            # holds: told as the lost connection it is, tried again, else a 503.
            raise redis.exceptions.ConnectionError(f"the reply channel's connection broke: {exc}") from exc
        return channel

    def _close_opened(self, opening: asyncio.Future[str]) -> None:
        if not opening.cancelled() and opening.exception() is None:
            _in_background(self._unsubscribe(opening.result(), None))

    async def _backlog(self) -> int:
        """The jobs waiting on the queue's list for a worker with room. Each worker has taken as many jobs as its
        runner holds, so the list is kept short: past ``JOB_BACKLOG_MAX`` the model has no room, as an embedded
        runner's full queue says at once. Workers take a burst of jobs one at a time, so a list past the bound is
        given ``BACKLOG_WAIT_SECONDS`` to shrink below it before the job is refused."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + BACKLOG_WAIT_SECONDS
        while True:
            backlog: int = await _on_a_live_connection(lambda: async_client().llen(self._queue))
            if backlog < settings.JOB_BACKLOG_MAX or loop.time() >= deadline:
                return backlog
            await asyncio.sleep(BACKLOG_POLL_SECONDS)

    async def _messages(self, reply: str) -> AsyncIterator[list[JobEvent]]:
        """The events of each message on ``reply``, in order; a failure ends them when the worker never answers,
        falls silent, a message is missing or Redis goes away."""
        expected = 0
        while True:
            timeout = settings.WORKER_SILENCE_TIMEOUT_SECONDS if expected else settings.JOB_START_TIMEOUT_SECONDS
            try:
                message = await self._next_message(reply, timeout, first=not expected)
            except REDIS_ERRORS as exc:
                # Redis went away under the job: its events cannot come back, so the stream ends here, cleanly.
                logger.warning("job %s lost its reply channel: %s: %s", self._job.job_id, type(exc).__name__, exc)
                yield [JobFailed("service_unavailable", "the model's events could not be read", "redis")]
                return
            except _Busy:
                yield [JobFailed("overloaded", f"the workers on queue {self._queue} had no room for the job in time")]
                return
            except TimeoutError:
                if expected:
                    yield [JobFailed("worker_lost", "the model worker stopped responding mid-generation")]
                else:
                    yield [JobFailed("no_worker", f"no worker took the job on queue {self._queue} in time")]
                return
            except _Unserved:
                yield [JobFailed("no_worker", f"no worker consumes the queue {self._queue}")]
                return
            except _Lost:
                why = "the job was lost before it started: Redis restarted, or the worker that took it died"
                yield [JobFailed("service_unavailable", why)]
                return
            if message is None:  # this side closed the channel: the job was cancelled
                return
            if isinstance(seq := message.get("seq"), int) and seq < expected:
                continue  # sent again after a connection error, though the first one had arrived after all
            if seq != expected:
                logger.warning("job %s: message %s arrived where %d was due", self._job.job_id, seq, expected)
                yield [JobFailed("service_unavailable", "the model's events were lost on the way")]
                return
            expected += 1
            if events := decode(message["events"]):  # an empty one is the start or a heartbeat
                yield events

    async def _next_message(self, reply: str, timeout: float, *, first: bool) -> dict[str, Any] | None:
        """The next message on ``reply`` within ``timeout`` seconds, else ``TimeoutError``; None once the channel is
        closed. While waiting, Redis is asked every ``OUTAGE_CHECK_SECONDS`` whether it is still there, so a job does
        not hold its client for the whole timeout once Redis is gone (the pub/sub layer reconnects quietly); and, for
        the ``first`` message, whether a worker consumes the queue (``_Unserved`` once none has for a while; ``_Busy``
        when the time is up while one does), and whether the job is still queued or taken (``_Lost`` once it has been
        neither for a while)."""
        loop = asyncio.get_running_loop()
        job_id = self._job.job_id
        deadline = loop.time() + timeout
        served = loop.time()  # when a worker was last known to consume the queue, or the wait began
        present = -math.inf  # when one was last seen to
        held = loop.time()  # when the job was last known to be queued, or the wait began
        self._receive = receive = asyncio.ensure_future(self._layer.receive(reply))
        while not receive.done():
            await asyncio.wait({receive}, timeout=max(0.0, min(OUTAGE_CHECK_SECONDS, deadline - loop.time())))
            if receive.done():
                break
            if loop.time() >= deadline:
                raise _Busy if first and loop.time() - present < PRESENCE_TTL_SECONDS else TimeoutError
            if not first:
                await async_client().ping()
                continue
            async with async_client().pipeline(transaction=False) as pipe:
                consumed, queued = await pipe.exists(presence_key(self._queue)).exists(queued_key(job_id)).execute()
            if queued:
                held = loop.time()
            elif loop.time() - held >= LOST_AFTER_SECONDS:
                raise _Lost
            if consumed:
                served = present = loop.time()
            elif loop.time() - served >= PRESENCE_TTL_SECONDS:
                raise _Unserved
        self._receive = None
        if receive.cancelled():
            return None
        message: dict[str, Any] = receive.result()
        return message

    async def _close(self) -> None:
        """Unsubscribe from the reply channel, which tells the worker to stop if it has not finished. The unsubscribe
        runs as a task of its own, so that a caller cancelled again while it waits (a second hang-up, a server
        shutting down) does not leave the channel subscribed and the job running for nobody."""
        reply, self._reply = self._reply, None
        if reply is None:
            return
        receive, self._receive = self._receive, None
        await asyncio.shield(_in_background(self._unsubscribe(reply, receive)))

    async def _unsubscribe(self, reply: str, receive: asyncio.Future[dict[str, Any]] | None) -> None:
        """Channels has no call for this: a layer closes a channel when a receive on it is cancelled, as when a
        consumer exits."""
        while True:
            receive = receive or asyncio.ensure_future(self._layer.receive(reply))
            await asyncio.sleep(0)  # the receive starts waiting, or takes a message that was still on its way
            if not receive.done():
                receive.cancel()
                _in_background(self._unsubscribed(reply, receive))
                # The unsubscribe goes on by itself if Redis is slow to answer; the caller does not wait for it.
                await asyncio.wait({receive}, timeout=OUTAGE_CHECK_SECONDS)
                return
            receive = None

    async def _unsubscribed(self, reply: str, receive: asyncio.Future[dict[str, Any]]) -> None:
        """Once the cancelled ``receive`` has unsubscribed, or failed to. channels_redis forgets a channel whose
        unsubscribe failed (Redis away), yet its connection (redis-py's ``PubSub``) keeps the channel, and subscribes
        to it again whenever it reconnects, for as long as the process lives. The connection is made to forget it
        too, and Redis is told once a second until it answers (or ``UNSUBSCRIBE_RETRY_SECONDS`` pass)."""
        await asyncio.wait({receive})
        shard = self._layer._get_layer()._get_shard(reply)
        pubsub = shard._pubsub
        if pubsub is not None:
            # Even when the layer's UNSUBSCRIBE was written: on a connection already dead, no answer comes back to
            # take the channel off redis-py's list, and the next connection would subscribe to it again.
            for key in pubsub._normalize_keys({reply: None}):
                pubsub.channels.pop(key, None)
                pubsub.pending_unsubscribe_channels.discard(key)
        if reply not in shard._subscribed_to or pubsub is None:
            return  # the layer's own unsubscribe went out
        shard._subscribed_to.discard(reply)
        deadline = asyncio.get_running_loop().time() + UNSUBSCRIBE_RETRY_SECONDS
        while True:
            try:
                async with shard._lock:  # as the layer sends its own commands on the connection
                    await pubsub.execute_command("UNSUBSCRIBE", reply)
                return
            except _UNSUBSCRIBE_FAILURES:
                if asyncio.get_running_loop().time() >= deadline:
                    logger.warning("reply channel %s may stay subscribed: Redis was away for too long", reply)
                    return
                await asyncio.sleep(OUTAGE_CHECK_SECONDS)

    async def cancel(self) -> None:
        await self._close()


def start_job(job: GenerationJob, *, queue: str) -> Job:
    return ChannelJob(job, queue) if settings.DISTRIBUTED else ThreadJob(job)


def warm_up_embedded() -> None:
    """Load every enabled model this process serves in embedded mode, so the first request is fast."""
    for entry in CatalogEntry.objects.served_here():
        try:
            get_renderer(entry.runner, entry.runner_settings)
            get_runner(entry.runner, entry.runner_settings)
        except RunnerError as exc:  # the entry's settings (a model file not there): one line says which
            logger.error("could not load model %s: %s", entry.public_id, exc)
        except Exception:
            logger.exception("could not load model %s", entry.public_id)


# --- worker side ---------------------------------------------------------------------------------


class WorkerPresence:
    """Keeps the presence keys of the queues this worker consumes alive, from a thread of its own, until stopped."""

    def __init__(self, queues: Collection[str]) -> None:
        self._queues = sorted(queues)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="queue-presence", daemon=True)

    def start(self) -> WorkerPresence:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop refreshing: the keys lapse within ``PRESENCE_TTL_SECONDS`` unless another worker keeps them."""
        self._stopped.set()

    def _beat(self) -> None:
        failing = False  # since the last beat that worked: a fault is told once, not every second
        while not self._stopped.is_set():
            try:
                with sync_client().pipeline(transaction=False) as pipe:
                    for queue in self._queues:
                        pipe.set(presence_key(queue), "1", ex=PRESENCE_TTL_SECONDS)
                    pipe.execute()
                failing = False
            except REDIS_ERRORS as exc:  # Redis away: jobs cannot come either; said again once it is back
                logger.debug("could not renew the queues' presence: %s: %s", type(exc).__name__, exc)
            except Exception:  # whatever it is, the beat goes on: a worker no API process sees gets no job
                if not failing:
                    logger.exception("could not renew the queues' presence; trying again each second")
                failing = True
            self._stopped.wait(PRESENCE_BEAT_SECONDS)


# The jobs this worker runs, each with how to end it from another thread (``end_served_jobs``).
_running: dict[str, Callable[[], object]] = {}
_running_lock = threading.Lock()
SHUT_DOWN = "the model worker shut down before the answer was complete"


def end_served_jobs() -> int:
    """Ends every job this worker still runs: its client is told ``server_shutting_down`` (a server error worth
    retrying) and its runner stops. A worker told to stop calls it once its grace period is over; returns how many
    jobs there were."""
    with _running_lock:
        ends = list(_running.values())
    for end in ends:
        end()
    return len(ends)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


_the_publisher: Publisher | None = None


def _publisher() -> Publisher:
    """The worker's one publisher, made with its first job."""
    global _the_publisher
    with _running_lock:
        if _the_publisher is None:
            _the_publisher = Publisher(get_channel_layer().serialize)
        return _the_publisher


async def serve_job(job: GenerationJob, channel: str) -> None:
    """Run ``job`` here and publish its events on the reply ``channel``; stop once nobody listens there any more, or
    once ``end_served_jobs`` ends it. The events go from the runner's thread to the worker's publisher; this thread
    only watches for the listener and keeps the stream alive with heartbeats until the last one is out."""
    client = async_client()
    publisher = _publisher()
    reply = Reply(channel, job.job_id, threading.Event())
    cancelled = reply.cancelled

    async def listened() -> bool:
        try:
            [(_, listeners)] = await client.pubsub_numsub(channel)
        except REDIS_ERRORS:
            return False  # as in publishing: nobody can read the events any more
        return bool(listeners)

    async def watch() -> None:
        while True:
            await asyncio.sleep(LISTENER_POLL_SECONDS)
            if cancelled.is_set():
                return
            if not await listened():
                logger.info("job %s stopped: nobody listens on its reply channel", job.job_id)
                cancelled.set()
            elif time.monotonic() - reply.last_sent >= HEARTBEAT_SECONDS:
                publisher.post(reply, [])

    try:
        # Taken: the API side waits for the job's first message now. Tried again at once on a connection a Redis
        # restart closed, as the job's first command on this thread's pooled connection.
        await _on_a_live_connection(lambda: client.delete(queued_key(job.job_id)))
    except REDIS_ERRORS:
        pass  # Redis is away: the API side has ended its wait (service_unavailable) or ends it at its next look
    deadline = time.monotonic() + LISTENER_WAIT_SECONDS
    while not await listened():
        if time.monotonic() >= deadline:
            logger.info("job %s stopped: nobody listens on its reply channel", job.job_id)
            return
        await asyncio.sleep(LISTENER_WAIT_POLL_SECONDS)
    publisher.post(reply, [])  # started
    loop = asyncio.get_running_loop()
    out: asyncio.Future[None] = loop.create_future()

    def last_out() -> None:
        loop.call_soon_threadsafe(_resolve, out)

    def shut_down() -> None:
        # The client's last event: the runner's last ones, posted after it, are for nobody.
        publisher.post(reply, [JobFailed("server_shutting_down", SHUT_DOWN)], last=True)
        cancelled.set()

    watcher = asyncio.create_task(watch())
    with _running_lock:
        _running[job.job_id] = shut_down
    try:
        start_on_runner(
            job,
            cancelled,
            put=lambda event: publisher.post(reply, [event]),
            end=lambda event: publisher.post(reply, [event], last=True, then=last_out),
        )
        await out
    finally:
        cancelled.set()
        with _running_lock:
            _running.pop(job.job_id, None)
        watcher.cancel()
