"""The gateway route: requests with ``"route": "gateway"`` go to an upstream OpenAI-compatible server.

The body is forwarded as the client sent it (less ``route``, with the upstream's model id), streams
pass through as they arrive, and upstream failures become the API's own errors. One pooled aiohttp
session per process (per event loop) keeps connections to the upstream warm; aiohttp's client costs
a fraction of httpx's per request, which is most of what this hop adds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from django.conf import settings
from multidict import CIMultiDictProxy

from inference.engine.catalog import find_enabled_model
from inference.models import CatalogEntry
from inference.openai.errors import APIError, invalid_request

from .caller import Caller, Result, admit_request, meter_for, record_error
from .metered import CLIENT_DISCONNECTED, StreamOutcome, metered

ROUTE = "gateway"

CONNECT_TIMEOUT = 5.0
MAX_PENDING_EVENT = 1 << 20

_sessions: dict[int, aiohttp.ClientSession] = {}
UpstreamFailure = (aiohttp.ClientError, asyncio.TimeoutError)


def session() -> aiohttp.ClientSession:
    loop_id = id(asyncio.get_running_loop())
    found = _sessions.get(loop_id)
    if found is None or found.closed:
        found = _sessions[loop_id] = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=settings.GATEWAY_MAX_CONNECTIONS, ttl_dns_cache=300),
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT, sock_read=settings.GATEWAY_TIMEOUT_SECONDS
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )
    return found


@dataclass(frozen=True, slots=True)
class Upstream:
    base_url: str
    api_key: str
    model: str
    entry: CatalogEntry | None

    def url(self, path: str) -> str:
        return self.base_url.rstrip("/") + "/" + path

    def headers(self, request_id: str) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers


def upstream_for(model: str, entry: CatalogEntry | None) -> Upstream:
    if entry is not None and entry.upstream_base_url:
        return Upstream(entry.upstream_base_url, entry.upstream_api_key, entry.upstream_model or entry.public_id, entry)
    if not settings.GATEWAY_BASE_URL:
        raise APIError(
            'No gateway is configured on this node, so "route": "gateway" cannot be served.',
            code="gateway_not_configured",
            status=503,
            param="route",
            type="server_error",
        )
    return Upstream(settings.GATEWAY_BASE_URL, settings.GATEWAY_API_KEY, model, entry)


def estimate_tokens(body: dict[str, Any]) -> int:
    """Admission's charge without the upstream's tokenizer: about four bytes a token, plus the output cap."""
    size = len(orjson.dumps(body.get("messages") or body.get("input") or ""))
    cap = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    return size // 4 + (cap if isinstance(cap, int) and cap > 0 else settings.GATEWAY_DEFAULT_MAX_TOKENS)


@dataclass
class UpstreamUsage:
    """What the upstream reported using, and how its answer went; filled in as the response passes through."""

    started: float
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    status: int = 200
    error_code: str = ""
    first_byte_at: float | None = None

    def read_usage(self, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        self.input_tokens = int(usage.get("prompt_tokens", usage.get("input_tokens", 0)) or 0)
        self.output_tokens = int(usage.get("completion_tokens", usage.get("output_tokens", 0)) or 0)
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details") or {}
        self.reasoning_tokens = int(details.get("reasoning_tokens", 0) or 0) if isinstance(details, dict) else 0
        prompt_details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
        self.cached_tokens = int(prompt_details.get("cached_tokens", 0) or 0) if isinstance(prompt_details, dict) else 0

    def outcome(self, *, ran_to_end: bool = True) -> StreamOutcome:
        """The request's usage record: what the upstream reported, or with the client gone, what it had so far."""
        ttft = None if self.first_byte_at is None else int((self.first_byte_at - self.started) * 1000)
        return StreamOutcome(
            status=self.status if ran_to_end else CLIENT_DISCONNECTED,
            error_code=self.error_code if ran_to_end else "client_disconnected",
            input_tokens=self.input_tokens,
            output_tokens=self.output_tokens,
            reasoning_tokens=self.reasoning_tokens,
            cached_tokens=self.cached_tokens,
            time_to_first_token_ms=ttft,
        )


def upstream_error(status: int, headers: CIMultiDictProxy[str], body: bytes) -> APIError:
    """An upstream's error, in the API's shape. Its own auth failures are the node's problem, not the client's."""
    try:
        detail = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        detail = None
    if status in (401, 403):
        return APIError(
            "The gateway refused the node's credentials.", code="upstream_error", status=502, type="server_error"
        )
    if isinstance(detail, dict) and isinstance(detail.get("message"), str):
        code = detail.get("code")
        return APIError(
            detail["message"],
            code=str(code) if code else ("rate_limited" if status == 429 else "upstream_error"),
            status=status if 400 <= status < 500 else 502,
            param=detail.get("param") if isinstance(detail.get("param"), str) else None,
            type=str(detail.get("type") or ("invalid_request_error" if status < 500 else "server_error")),
            headers={"Retry-After": headers["retry-after"]} if "retry-after" in headers else None,
        )
    return APIError(
        f"The gateway answered {status} without an OpenAI error body.",
        code="upstream_error",
        status=502 if status >= 500 or status < 400 else status,
        type="server_error",
    )


def unreachable(exc: BaseException) -> APIError:
    if isinstance(exc, asyncio.TimeoutError):
        return APIError("The gateway did not answer in time.", code="upstream_timeout", status=504, type="server_error")
    return APIError("The gateway could not be reached.", code="upstream_unavailable", status=502, type="server_error")


async def forward_json(
    *, upstream: Upstream, path: str, body: dict[str, Any], request_id: str, tally: UpstreamUsage
) -> dict[str, Any]:
    try:
        async with session().post(
            upstream.url(path), data=orjson.dumps(body), headers=upstream.headers(request_id)
        ) as response:
            content = await response.read()
            status, headers = response.status, response.headers
    except UpstreamFailure as exc:
        raise unreachable(exc) from None
    if status >= 400:
        raise upstream_error(status, headers, content)
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        raise APIError(
            "The gateway answered with a body that is not JSON.", code="upstream_error", status=502, type="server_error"
        ) from None
    if not isinstance(data, dict):
        raise APIError(
            "The gateway answered with a body that is not an object.",
            code="upstream_error",
            status=502,
            type="server_error",
        )
    tally.read_usage(data.get("usage"))
    return data


async def open_stream(
    *, upstream: Upstream, path: str, body: dict[str, Any], request_id: str
) -> aiohttp.ClientResponse:
    """Send the request and wait for the upstream's status line, so failures become a proper HTTP error."""
    try:
        response = await session().post(
            upstream.url(path), data=orjson.dumps(body), headers=upstream.headers(request_id)
        )
    except UpstreamFailure as exc:
        raise unreachable(exc) from None
    if response.status >= 400:
        try:
            content = await response.read()
        except UpstreamFailure:
            content = b""
        finally:
            response.release()
        raise upstream_error(response.status, response.headers, content)
    return response


async def relay_stream(response: aiohttp.ClientResponse, tally: UpstreamUsage) -> AsyncGenerator[bytes, None]:
    """The upstream's bytes as they come; usage is read from the event that carries it."""
    pending = b""
    finished = False
    try:
        async for chunk in response.content.iter_any():
            if tally.first_byte_at is None:
                tally.first_byte_at = time.monotonic()
            yield chunk
            pending = _scan_usage(pending + chunk, tally)
        finished = True
    except TimeoutError:
        tally.status, tally.error_code = 504, "upstream_timeout"
        yield _sse_error(unreachable(TimeoutError()))
    except aiohttp.ClientError:
        tally.status, tally.error_code = 502, "upstream_unavailable"
        yield _sse_error(APIError("The gateway connection broke mid-stream.", code="upstream_unavailable", status=502))
    finally:
        if finished:
            response.release()
        else:
            response.close()  # drop the connection: the upstream stops sending to a client that is gone


def _scan_usage(buffer: bytes, tally: UpstreamUsage) -> bytes:
    """Read usage from complete SSE events in ``buffer``; return the incomplete tail."""
    *events, tail = buffer.split(b"\n\n")
    for event in events:
        if b'"usage"' not in event:
            continue
        for line in event.split(b"\n"):
            if line.startswith(b"data:"):
                try:
                    data = orjson.loads(line[5:].strip())
                except orjson.JSONDecodeError:
                    continue
                if isinstance(data, dict):
                    usage = data.get("usage") or (data.get("response") or {}).get("usage")
                    if usage:
                        tally.read_usage(usage)
    return tail[-MAX_PENDING_EVENT:]


def _sse_error(error: APIError) -> bytes:
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


async def forward_to_gateway(*, body: dict[str, Any], caller: Caller, path: str, endpoint: str) -> Result:
    """Send a request with ``"route": "gateway"`` upstream, under the same admission and accounting."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("Missing required parameter: 'model'.", param="model", code="missing_required_parameter")
    entry = await find_enabled_model(model)
    upstream = upstream_for(model, entry)
    forwarded = {key: value for key, value in body.items() if key != "route"}
    forwarded["model"] = upstream.model
    meter = meter_for(caller, model=model, endpoint=endpoint, route=ROUTE)
    grant = await admit_request(caller, meter, model_pk=entry.pk if entry else None, tokens=estimate_tokens(body))
    tally = UpstreamUsage(started=meter.started)
    try:
        if not body.get("stream"):
            data = await forward_json(
                upstream=upstream, path=path, body=forwarded, request_id=caller.request_id, tally=tally
            )
            extra = data.get("b3os")
            data["b3os"] = {**(extra if isinstance(extra, dict) else {}), "route": ROUTE}
            grant.release()
            tally.outcome().record(meter)
            return Result(headers=grant.headers, body=data, route=ROUTE)
        response = await open_stream(upstream=upstream, path=path, body=forwarded, request_id=caller.request_id)
    except BaseException as exc:
        grant.release()
        record_error(meter, None, exc)
        raise
    stream = metered(
        relay_stream(response, tally),
        grant=grant,
        meter=meter,
        outcome=lambda ran_to_end: tally.outcome(ran_to_end=ran_to_end),
    )
    return Result(headers=grant.headers, stream=stream, route=ROUTE)
