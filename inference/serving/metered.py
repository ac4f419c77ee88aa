"""The one metered stream: however a stream ends, its in-flight slot is released and its usage recorded.

Chat completions, Responses, the gateway and agent turns all stream through ``metered``. A stream ends in
one of three ways: it runs to its end (done, or with a failure it reported in the stream itself), or the
client goes away mid-stream; the caller's ``outcome`` tells which, as a ``StreamOutcome``. A source that raises
instead of reporting is the service's fault, recorded as such (500), never as the client's hang-up.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import TypeVar

from inference.engine.generation import Done, Failed, Generation
from inference.usage.records import Meter
from orgs.admission import Grant

Chunk = TypeVar("Chunk", str, bytes)

CLIENT_DISCONNECTED = 499
# The server's own timeout of a response that had not begun: it tells the application in its ``http.disconnect``
# message (``reason``), and the request's task is cancelled with this as its message, so that the usage record says
# 504, as the client was answered, not 499.
RESPONSE_TIMED_OUT = "response_timed_out"

logger = logging.getLogger("inference.serving")


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """How a request ended, as its usage record tells it."""

    status: int
    error_code: str
    input_tokens: int
    output_tokens: int
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    time_to_first_token_ms: int | None = None
    # The deployment had no room for it (a full queue, no worker) before any model took its job: it consumed nothing,
    # and leaves the caller's per-minute windows as they were.
    no_room: bool = False

    def record(self, meter: Meter) -> None:
        meter.record(
            status=self.status,
            error_code=self.error_code,
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            reasoning_tokens=self.reasoning_tokens,
            cached_tokens=self.cached_tokens,
            time_to_first_token_ms=self.time_to_first_token_ms,
        )


@dataclass
class Ending:
    """The terminal event a stream encoder saw: ``Done``, ``Failed``, or ``None`` while it has not ended."""

    event: Done | Failed | None = None


def generation_outcome(generation: Generation, end: Done | Failed | None) -> StreamOutcome:
    """The outcome of one generation: done (the runner's exact counts), failed, or, with no terminal event, cut off
    by the client. A failed or cut-off one counts what was produced, and nothing when it ended before its first
    token (as ``caller.record_error`` counts a request that failed before it could answer, streamed or not)."""
    ttft = generation.time_to_first_token_ms
    if isinstance(end, Done):
        return StreamOutcome(
            200, "", end.prompt_tokens, end.completion_tokens, end.reasoning_tokens, end.cached_tokens, ttft
        )
    started = generation.first_token_at is not None
    status, code = (200, end.code) if isinstance(end, Failed) else (CLIENT_DISCONNECTED, "client_disconnected")
    return StreamOutcome(
        status=status,
        error_code=code,
        input_tokens=generation.prompt_tokens if started else 0,
        output_tokens=generation.completion_tokens if started else 0,
        cached_tokens=generation.cached_tokens if started else 0,
        time_to_first_token_ms=ttft,
    )


class Metered(AsyncIterator[Chunk]):
    """Relays ``chunks``; when they end, however, releases ``grant`` and records ``outcome(ran_to_end)``.

    The source is closed at once when the client goes away, so the model's job is cancelled then, not
    whenever the garbage collector gets to it. Django closes only its own wrapper of a streamed response, so the
    server closes this one itself once the response is sent or abandoned (``aclose``; ``config.asgi``); a stream
    whose sending never began (its client gone just then) is settled there as the client's hang-up.
    """

    def __init__(
        self,
        chunks: AsyncGenerator[Chunk, None],
        *,
        grant: Grant,
        meter: Meter,
        outcome: Callable[[bool], StreamOutcome],
    ) -> None:
        self._chunks: AsyncGenerator[Chunk, None] = chunks
        self._relay: AsyncGenerator[Chunk, None] = _metered(chunks, grant=grant, meter=meter, outcome=outcome)
        self._started = False
        self._grant, self._meter, self._outcome = grant, meter, outcome

    def __aiter__(self) -> Metered[Chunk]:
        return self

    async def __anext__(self) -> Chunk:
        self._started = True
        return await anext(self._relay)

    async def aclose(self) -> None:
        if self._started:
            await self._relay.aclose()
            return
        await self._chunks.aclose()
        if not self._meter.recorded:
            self._grant.release()
            self._outcome(False).record(self._meter)


async def _metered(
    chunks: AsyncGenerator[Chunk, None],
    *,
    grant: Grant,
    meter: Meter,
    outcome: Callable[[bool], StreamOutcome],
) -> AsyncGenerator[Chunk, None]:
    ran_to_end = failed = False
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield chunk
        ran_to_end = True
    except Exception:  # the client's hang-up is GeneratorExit or CancelledError, never this
        failed = True
        logger.exception("request %s: its stream failed while it was served", meter.request_id)
        raise
    finally:
        ended = outcome(ran_to_end)
        if failed:
            ended = replace(ended, status=500, error_code="internal_error", no_room=False)
        try:
            if ended.no_room:
                await grant.withdraw()
        finally:  # recorded and released even if cancelled while the windows are told
            grant.release()
            ended.record(meter)
