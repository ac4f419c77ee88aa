"""Request workflows of the node API: admission, generation, usage, in one place per endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from orgs.admission import Grant, admit
from orgs.exceptions import LimitExceeded
from orgs.models import APIKey

from inference.serving import chat, responses
from inference.usage import metrics
from inference.openai import chat as protocol
from inference.serving import gateway
from inference.engine.catalog import find_enabled_model, get_enabled_model
from inference.openai.errors import invalid_request
from inference.openai.errors import from_exception as to_api_error
from inference.engine.generation import Done, Generation, prepare
from inference.models import CatalogEntry
from inference.openai.responses import ResponseCreateRequest
from inference.usage.records import Meter


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


async def admit_request(caller: Caller, meter: Meter, *, model_pk: int | None, tokens: int) -> Grant:
    """Admission with its accounting: a refusal is recorded and counted, an admission shows in flight."""
    try:
        grant = await admit(organization_id=caller.organization_id, model_pk=model_pk, tokens=tokens)
    except LimitExceeded as exc:
        metrics.rejected(model=meter.model, organization=meter.organization, limit=exc.limit)
        _record_error(meter, None, exc)
        raise
    gauge = metrics.in_flight(meter.model)
    gauge.inc()
    grant.on_release(gauge.dec)
    return grant


def _record_done(meter: Meter, generation: Generation, done: Done) -> None:
    meter.record(
        status=200,
        input_tokens=done.prompt_tokens,
        output_tokens=done.completion_tokens,
        reasoning_tokens=done.reasoning_tokens,
        cached_tokens=done.cached_tokens,
        time_to_first_token_ms=generation.time_to_first_token_ms,
    )


def _record_error(meter: Meter, generation: Generation | None, exc: BaseException) -> None:
    error = to_api_error(exc)
    meter.record(
        status=error.status if error else 500,
        error_code=error.code if error else "internal_error",
        input_tokens=generation.prompt_tokens if generation else 0,
        output_tokens=generation.completion_tokens if generation else 0,
        time_to_first_token_ms=generation.time_to_first_token_ms if generation else None,
    )


async def _admitted_stream(
    *, chunks: AsyncIterator[str], grant: Grant, meter: Meter, generation: Generation, outcome: dict[str, Any]
) -> AsyncIterator[str]:
    """Relays a stream; whatever way it ends (done, failed, client gone), the slot is released and usage recorded."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        grant.release()
        if (done := outcome.get("done")) is not None:
            _record_done(meter, generation, done)
        elif (failed := outcome.get("failed")) is not None:
            meter.record(
                status=200,
                error_code=failed.code,
                input_tokens=generation.prompt_tokens,
                output_tokens=generation.completion_tokens,
                time_to_first_token_ms=generation.time_to_first_token_ms,
            )
        else:
            # The client went away mid-stream: record what was produced.
            meter.record(
                status=499,
                error_code="client_disconnected",
                input_tokens=generation.prompt_tokens,
                output_tokens=generation.completion_tokens,
                time_to_first_token_ms=generation.time_to_first_token_ms,
            )


async def run_admitted(
    *,
    caller: Caller,
    model: str,
    endpoint: str,
    build: Callable[[CatalogEntry], Awaitable[Generation]],
    respond: Callable[[Generation, Grant, Meter], Awaitable[Result]],
) -> Result:
    """The common path after validation: prepare (context check), admit, respond; usage in every case."""
    entry = await get_enabled_model(model)
    generation = await build(entry)
    meter = meter_for(caller, model=entry.public_id, endpoint=endpoint)
    grant = await admit_request(caller, meter, model_pk=entry.pk, tokens=generation.prompt_tokens + generation.job.sampling.max_tokens)
    try:
        return await respond(generation, grant, meter)
    except BaseException as exc:
        grant.release()
        _record_error(meter, generation, exc)
        raise


async def create_chat_completion(*, params: protocol.ChatCompletionRequest, caller: Caller) -> Result:
    extra = {"b3os": {"route": "node"}}

    async def build(entry: CatalogEntry) -> Generation:
        return await prepare(entry=entry, request=chat.to_generation_request(params, entry))

    async def respond(generation: Generation, grant: Grant, meter: Meter) -> Result:
        want_logprobs = bool(params.logprobs)
        if params.stream:
            outcome: dict[str, Any] = {}
            chunks = chat.stream_chunks(
                generation=generation,
                model=params.model,
                include_usage=bool(params.stream_options and params.stream_options.include_usage),
                want_logprobs=want_logprobs,
                extra=extra,
                outcome=outcome,
            )
            stream = _admitted_stream(chunks=chunks, grant=grant, meter=meter, generation=generation, outcome=outcome)
            return Result(headers=grant.headers, stream=stream)
        body, done = await chat.complete(generation=generation, model=params.model, want_logprobs=want_logprobs, extra=extra)
        grant.release()
        _record_done(meter, generation, done)
        return Result(headers=grant.headers, body=body)

    return await run_admitted(caller=caller, model=params.model, endpoint="chat.completions", build=build, respond=respond)



async def create_response(*, params: ResponseCreateRequest, caller: Caller) -> Result:
    async def build(entry: CatalogEntry) -> Generation:
        return await prepare(entry=entry, request=responses.to_generation_request(params, entry))

    async def respond(generation: Generation, grant: Grant, meter: Meter) -> Result:
        encoder = responses.ResponseEncoder(echo=responses.echo(params))
        if params.stream:
            outcome: dict[str, Any] = {}
            events = responses.stream_events(generation=generation, encoder=encoder, outcome=outcome)
            stream = _admitted_stream(chunks=events, grant=grant, meter=meter, generation=generation, outcome=outcome)
            return Result(headers=grant.headers, stream=stream)
        body, done = await responses.complete(generation=generation, encoder=encoder)
        grant.release()
        _record_done(meter, generation, done)
        return Result(headers=grant.headers, body=body)

    return await run_admitted(caller=caller, model=params.model, endpoint="responses", build=build, respond=respond)


# --- the gateway route -----------------------------------------------------------------------------


async def forward_to_gateway(*, body: dict[str, Any], caller: Caller, path: str, endpoint: str) -> Result:
    """Send a request with ``"route": "gateway"`` upstream, under the same admission and accounting."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    entry = await find_enabled_model(model)
    upstream = gateway.upstream_for(model, entry)
    forwarded = {key: value for key, value in body.items() if key != "route"}
    forwarded["model"] = upstream.model
    meter = meter_for(caller, model=model, endpoint=endpoint, route="gateway")
    grant = await admit_request(caller, meter, model_pk=entry.pk if entry else None, tokens=gateway.estimate_tokens(body))
    tally = gateway.Tally()
    try:
        if not body.get("stream"):
            data = await gateway.forward_json(upstream=upstream, path=path, body=forwarded, request_id=caller.request_id, tally=tally)
            data["b3os"] = {**(data.get("b3os") if isinstance(data.get("b3os"), dict) else {}), "route": "gateway"}
            grant.release()
            _record_tally(meter, tally)
            return Result(headers=grant.headers, body=data, route="gateway")
        response = await gateway.open_stream(upstream=upstream, path=path, body=forwarded, request_id=caller.request_id)
    except BaseException as exc:
        grant.release()
        _record_error(meter, None, exc)
        raise
    stream = _gateway_stream(gateway.relay_stream(response, tally), grant=grant, meter=meter, tally=tally)
    return Result(headers=grant.headers, stream=stream, route="gateway")


def _record_tally(meter: Meter, tally: gateway.Tally, *, disconnected: bool = False) -> None:
    ttft = None if tally.first_byte_at is None else int((tally.first_byte_at - meter.started) * 1000)
    meter.record(
        status=499 if disconnected else tally.status,
        error_code="client_disconnected" if disconnected else tally.error_code,
        input_tokens=tally.input_tokens,
        output_tokens=tally.output_tokens,
        reasoning_tokens=tally.reasoning_tokens,
        cached_tokens=tally.cached_tokens,
        time_to_first_token_ms=ttft,
    )


async def _gateway_stream(chunks: AsyncIterator[bytes], *, grant: Grant, meter: Meter, tally: gateway.Tally) -> AsyncIterator[bytes]:
    finished = False
    try:
        async for chunk in chunks:
            yield chunk
        finished = True
    finally:
        grant.release()
        _record_tally(meter, tally, disconnected=not finished)
