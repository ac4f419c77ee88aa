"""A worker's side of the reply channels: one thread publishes the events of every job the worker runs.

The runner hands on a decode step's events together, from its scheduling thread (a token for each of its sequences).
The publisher takes whatever has been posted since it last looked, makes one message per reply channel of it,
numbered in order, and sends them all in one pipeline of ``PUBLISH`` commands: Redis and the API processes'
subscribers wake once a step, not once for each stream's token, and no job's thread wakes for its events at all.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.outages import REDIS_ERRORS
from core.redis import sync_client
from core.threads import name_native_thread
from inference.engine.execution import JobEvent, encode

logger = logging.getLogger("inference.engine.dispatch")

MESSAGE_TYPE = "job.events"


@dataclass(eq=False)
class Reply:
    """One job's reply channel. A message that cannot be sent keeps its number: should a later one get through, the
    API side ends the stream there rather than show the text with a hole in it."""

    channel: str
    job_id: str
    cancelled: threading.Event  # set when the events have nowhere to go: the job stops
    sent: int = 0  # messages numbered so far
    last_sent: float = field(default_factory=time.monotonic)
    closed: bool = False  # its last event is posted: what the runner sends after it is for nobody


@dataclass(frozen=True, slots=True)
class _Post:
    reply: Reply
    events: list[JobEvent]
    last: bool
    then: Callable[[], object] | None


class Publisher:
    """Publishes posted events from a thread of its own, in the order they were posted."""

    def __init__(self, serialize: Callable[[dict[str, Any]], bytes]) -> None:
        self._serialize = serialize
        self._posted: list[_Post] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def post(
        self, reply: Reply, events: list[JobEvent], *, last: bool = False, then: Callable[[], object] | None = None
    ) -> None:
        """Sends ``events`` (none: a start or a heartbeat) on ``reply`` soon, with whatever else has been posted for
        it meanwhile; ``last``: nothing posted for it after them is sent. ``then`` is called once they have been
        published, dropped (posted after the last) or failed to."""
        with self._cond:
            self._posted.append(_Post(reply, events, last, then))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="reply-publisher", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        name_native_thread("reply-publisher")
        while True:
            with self._cond:
                while not self._posted:
                    self._cond.wait()
                posted, self._posted = self._posted, []
            try:
                self._publish(posted)
            except Exception:  # the thread serves every job: whatever went wrong with these, it carries on
                logger.exception("could not publish the events of %d jobs", len({post.reply for post in posted}))
                for post in posted:
                    post.reply.cancelled.set()
            finally:
                for post in posted:
                    if post.then is not None:
                        try:
                            post.then()
                        except Exception:
                            logger.exception("could not tell job %s that its last events are out", post.reply.job_id)

    def _publish(self, posted: list[_Post]) -> None:
        merged: dict[Reply, list[JobEvent]] = {}
        for post in posted:
            if not post.reply.closed:
                merged.setdefault(post.reply, []).extend(post.events)
                post.reply.closed = post.last
        if not merged:
            return
        messages = []
        for reply, events in merged.items():
            message = {"type": MESSAGE_TYPE, "seq": reply.sent, "events": encode(events)}
            messages.append((reply, self._serialize(message)))
            reply.sent += 1
        try:
            # Tried once more on a new connection when a Redis restart left the pooled one dead (the client's retry);
            # a message that arrives twice is read once.
            with sync_client().pipeline(transaction=False) as pipe:
                for reply, wire in messages:
                    pipe.publish(reply.channel, wire)
                pipe.execute()
        except REDIS_ERRORS as exc:
            # The events have nowhere to go, and the API side has ended the stream already (it watches Redis too).
            for reply, _ in messages:
                if not reply.cancelled.is_set():
                    why = f"{type(exc).__name__}: {exc}"
                    logger.warning("job %s stopped: Redis is unavailable: %s", reply.job_id, why)
                reply.cancelled.set()
            return
        now = time.monotonic()
        for reply, _ in messages:
            reply.last_sent = now
