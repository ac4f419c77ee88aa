"""A key revoked, expired or left without its active organization ends the answers it has under way, not only its
next requests: revocation takes effect at once, for what streams too.

Each event loop running answers for keys (generations, gateway streams) has one watch: every ``CHECK_SECONDS`` it
reads the keys' version (``orgs.keycache``: one Redis read, or one ``stat`` when embedded) and, when it changed, an
answer started, one of their keys' expiry came, or ``API_KEY_CACHE_SECONDS`` passed (a lost bump), asks the database
which of those keys are still usable.
An answer whose key is not ends as a failure, ``invalid_api_key``, its usage recorded with what it produced. The
watch ends once its loop has run no such answer for ``IDLE_SECONDS``.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import time
from typing import Protocol

from django.conf import settings

from core.db import db_task
from core.outages import unavailable_service
from inference.engine import generation as generations
from inference.engine.generation import Failed, Generation
from orgs.keycache import current_version
from orgs.models import APIKey

logger = logging.getLogger("inference.serving")

CHECK_SECONDS = 1.0
# Longer than a watched generation takes to start running: one watched just before the watch ends still starts one.
IDLE_SECONDS = 10.0

KEY_REVOKED = Failed(
    "invalid_api_key", "the API key was revoked or expired, or its organization deactivated, during the answer"
)


class Interruptible(Protocol):
    """An answer under way for a key, that ``interrupt`` ends with a failure: a generation, a gateway stream."""

    api_key_id: int | None

    def interrupt(self, failure: Failed) -> None: ...


_watches: dict[asyncio.AbstractEventLoop, asyncio.Task[None]] = {}
_last_watched: dict[asyncio.AbstractEventLoop, float] = {}
# The answers under way that are not generations (which ``generations.running`` lists), with their event loops.
_streams: dict[int, tuple[Interruptible, asyncio.AbstractEventLoop]] = {}


def watch(generation: Generation, api_key_id: int) -> None:
    """Ends ``generation`` with ``KEY_REVOKED`` if its key stops being usable before it ends."""
    generation.api_key_id = api_key_id
    _watching(asyncio.get_running_loop())


def watch_stream(stream: Interruptible, api_key_id: int) -> None:
    """Ends ``stream`` with ``KEY_REVOKED`` if its key stops being usable before ``unwatch_stream``."""
    stream.api_key_id = api_key_id
    loop = asyncio.get_running_loop()
    _streams[id(stream)] = (stream, loop)
    _watching(loop)


def unwatch_stream(stream: Interruptible) -> None:
    _streams.pop(id(stream), None)


def _watching(loop: asyncio.AbstractEventLoop) -> None:
    _last_watched[loop] = time.monotonic()
    if (task := _watches.get(loop)) is None or task.done():
        # In a context of its own: the watch outlives the request that started it, whose id its log lines would bear.
        _watches[loop] = loop.create_task(_watch(loop), context=contextvars.Context())


def _under_way(loop: asyncio.AbstractEventLoop) -> list[Interruptible]:
    running: list[Interruptible] = [g for g in generations.running() if g.api_key_id is not None and g.loop is loop]
    return running + [stream for stream, on in list(_streams.values()) if on is loop]


async def _watch(loop: asyncio.AbstractEventLoop) -> None:
    seen, checked, expiry = None, time.monotonic(), math.inf  # ``expiry``: the first of the keys checked, in unix time
    known: set[int] = set()  # the answers whose keys were checked at version ``seen``
    failing = False  # since the last check that worked: said once, not every round
    while True:
        await asyncio.sleep(CHECK_SECONDS)
        keyed = _under_way(loop)
        if not keyed and time.monotonic() - _last_watched.get(loop, 0.0) > IDLE_SECONDS:
            del _watches[loop], _last_watched[loop]  # no await since the look: a new watch() starts a new watch
            return
        try:
            version = await current_version()
            # An answer new since the last check is checked too: its key may have gone between its request's
            # authentication and its start (an agent's next step starts after its tools ran), at a version seen.
            fresh = any(id(answer) not in known for answer in keyed)
            if (
                version == seen
                and not fresh
                and time.time() < expiry
                and time.monotonic() - checked < settings.API_KEY_CACHE_SECONDS
            ):
                continue
            usable, expiry = await _usable({g.api_key_id for g in keyed if g.api_key_id is not None})
        except Exception as exc:  # Redis or the database away: the next round tries again
            if not failing:
                # An outage is told in one line; anything else is a fault, with its traceback.
                outage = unavailable_service(exc)
                logger.warning(
                    "could not check the keys of the answers under way (%s); trying again each second",
                    f"{outage} unavailable: {type(exc).__name__}: {exc}" if outage else type(exc).__name__,
                    exc_info=None if outage else exc,
                )
            failing = True
            continue
        if failing:
            logger.info("the keys of the answers under way are checked again")
        failing = False
        seen, checked, known = version, time.monotonic(), {id(answer) for answer in keyed}
        for answer in keyed:
            if answer.api_key_id not in usable:
                answer.interrupt(KEY_REVOKED)


@db_task
def _usable(keys: set[int]) -> tuple[set[int], float]:
    """Which of ``keys`` are usable, and when the first of those expires (unix time; infinity for none)."""
    rows = APIKey.objects.usable().filter(pk__in=keys).values_list("pk", "expires_at")
    expiries = [expires.timestamp() for _, expires in rows if expires is not None]
    return {pk for pk, _ in rows}, min(expiries, default=math.inf)
