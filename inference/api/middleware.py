"""Request ids, ``Server-Timing`` and the body bound for API paths."""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponseBase
from django.urls import Resolver404, ResolverMatch, get_resolver

from inference.openai.errors import body_too_large, not_found, status_error

from .context import RequestContext
from .errors import is_api_path, render, render_exception

_request_id: ContextVar[str] = ContextVar("request_id", default="-")
_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def new_request_id() -> str:
    """``req_`` and 26 base-32 characters (130 random bits), drawn from one read of the system's randomness."""
    bits = int.from_bytes(secrets.token_bytes(17))
    return "req_" + "".join(_ALPHABET[(bits >> shift) & 31] for shift in range(0, 130, 5))


class RequestIdLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = _request_id.get()
        return True


def _declared_length(request: HttpRequest) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


def _finish(context: RequestContext, response: HttpResponseBase, started: float) -> HttpResponseBase:
    response["x-request-id"] = context.request_id
    timing = f"total;dur={(time.perf_counter() - started) * 1000:.3f}"
    if context.route:
        timing += f', infer_route;desc="{context.route}"'
    response["Server-Timing"] = timing
    return response


def _ensure_error_shape(response: HttpResponseBase) -> HttpResponseBase:
    """Django's own error pages (404 and 500 with DEBUG on, CSRF) become the API's error shape."""
    if response.status_code < 400 or response.get("Content-Type", "").startswith("application/json"):
        return response
    error = status_error(response.status_code)
    replaced = render(error)
    if allow := response.get("Allow"):
        replaced["Allow"] = allow
    return replaced


@functools.lru_cache(maxsize=1024)
def _resolve(path: str) -> ResolverMatch:
    """The URLconf never changes while serving: each API path is resolved once (a miss raises, uncached)."""
    return get_resolver().resolve(path)


async def _call_api_view(request: HttpRequest) -> HttpResponseBase:
    """API requests go straight to their view: the API authenticates with keys, so the session, CSRF,
    auth and message middleware that the admin needs have nothing to do here but cost a thread hop each."""
    try:
        match = _resolve(request.path_info)
    except Resolver404:
        return render(not_found())
    request.resolver_match = match
    if iscoroutinefunction(match.func):
        response = await match.func(request, *match.args, **match.kwargs)
    else:
        response = await sync_to_async(match.func, thread_sensitive=False)(request, *match.args, **match.kwargs)
    if callable(getattr(response, "render", None)) and not response.is_rendered:
        response.render()  # DRF's Response renders JSON in memory: no I/O, no thread needed
    response["X-Content-Type-Options"] = "nosniff"
    return response


class api_envelope:  # noqa: N801 (Django middleware naming)
    """Wraps API requests: request id, timing header, body bound, and the error shape for anything that escapes."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        if not is_api_path(request.path):
            return await self.get_response(request)
        started = time.perf_counter()
        context = request.api_context = RequestContext(request_id=new_request_id())  # type: ignore[attr-defined]
        token = _request_id.set(context.request_id)
        try:
            if _declared_length(request) > settings.MAX_REQUEST_BODY_BYTES:
                response: HttpResponseBase = render(body_too_large())
            else:
                try:
                    response = await _call_api_view(request)
                except Exception as exc:  # noqa: BLE001  (last line of defence: always the API's error shape)
                    response = render_exception(exc, context)
                response = _ensure_error_shape(response)
            return _finish(context, response, started)
        finally:
            _request_id.reset(token)
