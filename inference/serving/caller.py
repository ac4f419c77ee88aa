"""Who is asking and whether they may: the caller, admission with its accounting, and what a workflow returns.

Every workflow (chat, Responses, the gateway, an agent turn) admits its request here, so a refusal is
recorded and counted the same way everywhere, and an admitted request shows in flight until its slot
is released.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from inference.engine.catalog import get_enabled_model
from inference.engine.generation import Generation
from inference.models import CatalogEntry
from inference.openai.errors import from_exception
from inference.usage import metrics
from inference.usage.records import Meter
from orgs.admission import Grant, admit
from orgs.exceptions import LimitExceeded
from orgs.models import APIKey

from .metered import CLIENT_DISCONNECTED


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
    """The usage record of a request that failed before it could answer; ``generation`` is None when no runner
    took it, so it consumed nothing."""
    if isinstance(exc, asyncio.CancelledError):
        status, code = CLIENT_DISCONNECTED, "client_disconnected"
    elif (error := from_exception(exc)) is not None:
        status, code = error.status, error.code
    else:
        status, code = 500, "internal_error"
    meter.record(
        status=status,
        error_code=code,
        input_tokens=generation.prompt_tokens if generation else 0,
        output_tokens=generation.completion_tokens if generation else 0,
        time_to_first_token_ms=generation.time_to_first_token_ms if generation else None,
    )


async def admit_request(caller: Caller, meter: Meter, *, model_pk: int | None, tokens: int) -> Grant:
    """Admission with its accounting: a refusal is recorded and counted, an admission shows in flight."""
    try:
        grant = await admit(organization_id=caller.organization_id, model_pk=model_pk, tokens=tokens)
    except LimitExceeded as exc:
        metrics.rejected(model=meter.model, organization=meter.organization, limit=exc.limit)
        record_error(meter, None, exc)
        raise
    gauge = metrics.in_flight(meter.model)
    gauge.inc()
    grant.on_release(gauge.dec)
    return grant


async def run_admitted(
    *,
    caller: Caller,
    model: str,
    endpoint: str,
    build: Callable[[CatalogEntry], Awaitable[Generation]],
    respond: Callable[[Generation, Grant, Meter], Awaitable[Result]],
) -> Result:
    """The node API's path after validation: prepare (the context check), admit, respond; usage in every case."""
    entry = await get_enabled_model(model)
    generation = await build(entry)
    meter = meter_for(caller, model=entry.public_id, endpoint=endpoint)
    tokens = generation.prompt_tokens + generation.job.sampling.max_tokens
    grant = await admit_request(caller, meter, model_pk=entry.pk, tokens=tokens)
    try:
        # The runner takes the job (or refuses it, overloaded) before any response begins.
        await generation.start()
        return await respond(generation, grant, meter)
    except BaseException as exc:
        grant.release()
        record_error(meter, generation if generation.accepted else None, exc)
        raise
