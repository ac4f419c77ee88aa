"""Who is asking and whether they may: the caller, admission with its accounting, and what a workflow returns.

Every workflow (chat, Responses, the gateway, an agent turn) admits its request here, so a refusal is
recorded and counted the same way everywhere, and an admitted request shows in flight until its slot
is released.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inference.engine.catalog import get_enabled_model
from inference.engine.exceptions import ModelNotServed, NotStarted, OutputLimitTooLarge, Overloaded
from inference.engine.generation import Done, Failed, Generation, GenerationRequest, prepare
from inference.models import CatalogEntry
from inference.openai.errors import APIError, from_exception, generation_failed
from inference.usage import metrics
from inference.usage.records import Meter
from orgs.admission import Grant, admit, precheck
from orgs.exceptions import LimitExceeded
from orgs.models import APIKey

from . import revocation
from .metered import CLIENT_DISCONNECTED, RESPONSE_TIMED_OUT, Chunk, Ending, Metered, generation_outcome

logger = logging.getLogger("inference.serving")


@dataclass(frozen=True, slots=True)
class Caller:
    api_key: APIKey
    request_id: str

    @property
    def organization_id(self) -> int:
        return self.api_key.organization_id


@dataclass
class Result:
    """A JSON body, or an SSE stream; ``headers`` go on the HTTP response either way."""

    headers: dict[str, str]
    body: dict[str, Any] | None = None
    stream: AsyncIterator[str] | AsyncIterator[bytes] | None = None
    route: str = "node"


def meter_for(caller: Caller, *, model: str, endpoint: str, route: str = "node") -> Meter:
    return Meter(
        organization_id=caller.organization_id,
        organization=caller.api_key.organization.slug,
        api_key_id=caller.api_key.pk,
        model=model,
        endpoint=endpoint,
        route=route,
        request_id=caller.request_id,
    )


def record_error(meter: Meter, generation: Generation | None, exc: BaseException) -> None:
    """The usage record of a request that failed before it could answer (refused by a limit, a full queue, no
    worker, a client that hung up first, or an answer in one body that failed or was left before its end): nothing
    was sent, so its tokens are zero, and what is billed from the records is what was served. A stream that ends
    early counts what it sent (``metered.generation_outcome``)."""
    if isinstance(exc, asyncio.CancelledError) and RESPONSE_TIMED_OUT in exc.args:
        status, code = 504, "timeout"
    elif isinstance(exc, asyncio.CancelledError):
        status, code = CLIENT_DISCONNECTED, "client_disconnected"
    elif (error := from_exception(exc)) is not None:
        status, code = error.status, error.code
    else:
        status, code = 500, "internal_error"
    meter.record(
        status=status, error_code=code, time_to_first_token_ms=generation.time_to_first_token_ms if generation else None
    )


def streamed_result(
    stream: AsyncGenerator[Chunk, None], *, generation: Generation, ending: Ending, grant: Grant, meter: Meter
) -> Result:
    """A generation's answer as a stream: its slot is released and its usage recorded when the stream ends, from the
    terminal event its encoder saw (``ending``)."""
    outcome = Metered(stream, grant=grant, meter=meter, outcome=lambda _: generation_outcome(generation, ending.event))
    return Result(headers=grant.headers, stream=outcome)


def whole_result(
    body: dict[str, Any], *, done: Done | Failed | None, generation: Generation, grant: Grant, meter: Meter
) -> Result:
    """A generation's answer in one body, once it has ended: its slot released and its usage recorded."""
    grant.release()
    generation_outcome(generation, done).record(meter)
    return Result(headers=grant.headers, body=body)


def generation_error(failed: Failed, *, request_id: str) -> APIError:
    """A generation's failure as the client sees it: what failed, and the request id to quote; what the runner
    said (file paths, a library's message) is logged under that id."""
    logger.warning("generation failed in request %s: %s: %s", request_id, failed.code, failed.message)
    return generation_failed(failed.code, request_id=request_id)


def _refused(meter: Meter, exc: LimitExceeded) -> None:
    metrics.rejected(model=meter.model, organization=meter.organization, limit=exc.limit)
    record_error(meter, None, exc)


def charge_within(grant: Grant, meter: Meter) -> Callable[[int], Awaitable[None]]:
    """``grant.charge_within`` for an admitted request's later work (an agent's next step), its refusal counted as
    admission's are; the request records its own ending."""

    async def charge(tokens: int) -> None:
        try:
            await grant.charge_within(tokens)
        except LimitExceeded as exc:
            metrics.rejected(model=meter.model, organization=meter.organization, limit=exc.limit)
            raise

    return charge


async def precheck_request(caller: Caller, meter: Meter, *, model_pk: int | None, tokens: int) -> None:
    """Refuses, with the same accounting as admission, a request that cannot be admitted even at ``tokens`` (a
    lower bound of its charge), before the work of rendering and counting it."""
    try:
        await precheck(organization_id=caller.organization_id, model_pk=model_pk, tokens=tokens)
    except LimitExceeded as exc:
        _refused(meter, exc)
        raise


async def admit_request(caller: Caller, meter: Meter, *, model_pk: int | None, tokens: int) -> Grant:
    """Admission with its accounting: a refusal is recorded and counted, an admission shows in flight."""
    try:
        grant = await admit(organization_id=caller.organization_id, model_pk=model_pk, tokens=tokens)
    except LimitExceeded as exc:
        _refused(meter, exc)
        raise
    gauge = metrics.in_flight(meter.model)
    gauge.inc()
    grant.on_release(gauge.dec)
    return grant


def check_output_limit(entry: CatalogEntry, output_limit: int | None) -> None:
    """Refuses an output limit past what the model writes in one response, as OpenAI does (it is not cut to fit)."""
    if output_limit is not None and output_limit > entry.max_output_tokens:
        raise OutputLimitTooLarge(model_id=entry.public_id, most=entry.max_output_tokens, asked=output_limit)


def least_charge(entry: CatalogEntry, output_limit: int | None) -> int:
    """The fewest tokens admission can charge a request to ``entry``: a prompt of one token and the output it asks
    for (the model's maximum when it sets none), within the model's context."""
    output = min(output_limit or entry.max_output_tokens, entry.max_output_tokens)
    return min(1 + output, entry.context_length)


def _no_room(generation: Generation, exc: BaseException) -> bool:
    """Whether the deployment had no room for the request: a 503 (a full queue, no worker) before any model took its
    job. Such a request consumed nothing and leaves the caller's limits as they were; one the request's own content
    failed (a 400) counts as any admitted request does."""
    error = from_exception(exc) if isinstance(exc, Exception) else None
    return not generation.accepted and error is not None and error.status == 503


async def run_admitted(
    *,
    caller: Caller,
    model: str,
    endpoint: str,
    output_limit: int | None,
    translate: Callable[[CatalogEntry], GenerationRequest],
    respond: Callable[[Generation, Grant, Meter], Awaitable[Result]],
) -> Result:
    """The node API's path after validation: the request checked against its model and translated (a bad request is
    a 400 whatever the caller's limits), a cheap refusal of callers over their limits, prepare (rendering, the context
    check), admit, respond; usage in every case."""
    entry = await get_enabled_model(model)
    if not entry.served_here:
        raise ModelNotServed(model)
    check_output_limit(entry, output_limit)
    request = translate(entry)
    meter = meter_for(caller, model=entry.public_id, endpoint=endpoint)
    await precheck_request(caller, meter, model_pk=entry.pk, tokens=least_charge(entry, output_limit))
    generation = await prepare(entry=entry, request=request)
    tokens = generation.prompt_tokens + generation.job.sampling.max_tokens
    grant = await admit_request(caller, meter, model_pk=entry.pk, tokens=tokens)
    try:
        # The runner takes the job (or refuses it, overloaded) before any response begins.
        await generation.start()
        revocation.watch(generation, caller.api_key.pk)
        return await respond(generation, grant, meter)
    except BaseException as exc:
        try:
            if _no_room(generation, exc):
                await grant.withdraw()
            else:
                grant.release()
        finally:  # recorded even when the withdrawal is cancelled (a second hang-up) or fails
            record_error(meter, generation if generation.accepted else None, exc)
            if isinstance(exc, Overloaded | NotStarted):
                exc.headers = grant.headers  # as every answer to an admitted request has them
        raise
