"""Request ids, ``Server-Timing``, the body's framing and bound for API paths; ids and timing for operations and
for paths that nothing answers; and, for every path but the API's, Django's host check made early enough for its
refusal to carry them too."""

from __future__ import annotations

import functools
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import DisallowedHost
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.urls import Resolver404, ResolverMatch, get_resolver

from inference.openai.errors import (
    APIError,
    body_too_large,
    content_coding_refused,
    invalid_request,
    not_found,
    status_error,
)

from .context import RequestContext, context_of
from .errors import is_api_path, is_browser_path, render, render_exception

# Plain Django views outside the API (no error shape of the API's), timed and numbered like it.
OPERATIONS_PATHS = frozenset({"/health", "/metrics"})

# Django's own logger for this refusal, so that whoever silences it as Django's docs show still does.
_host_logger = logging.getLogger("django.security.DisallowedHost")
_request_id: ContextVar[str] = ContextVar("request_id", default="-")
_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"
# The ASGI scope extension in which ``manage.py serve`` hands over the id it gave the request.
REQUEST_ID_EXTENSION = "b3os.request_id"


def new_request_id() -> str:
    """``req_`` and 26 base-32 characters (130 random bits), drawn from one read of the system's randomness."""
    bits = int.from_bytes(secrets.token_bytes(17))
    return "req_" + "".join(_ALPHABET[(bits >> shift) & 31] for shift in range(0, 130, 5))


def request_id_of(request: HttpRequest) -> str:
    """The id the server gave the request, or else a new one."""
    extensions = getattr(request, "scope", {}).get("extensions") or {}
    given = (extensions.get(REQUEST_ID_EXTENSION) or {}).get("id")
    return given if isinstance(given, str) else new_request_id()


class RequestIdLogFilter(logging.Filter):
    """Puts the request's id on each record logged while it is served; Django's own line for a response
    (``django.request``), logged once the middleware is done, finds it on the request it names."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = _request_id.get()
        if request_id == "-" and (context := context_of(getattr(record, "request", None))) is not None:
            request_id = context.request_id
        record.request_id = request_id
        return True


def _body_length(request: HttpRequest) -> int:
    """The body's size in bytes: as declared, or else as buffered.

    A chunked body (or an HTTP/2 one) declares no ``Content-Length``, and DRF reads no body without one. The
    ASGI handler has buffered the whole body before any middleware runs, so its size is one seek away; it is
    declared here for DRF (and Django's own bound), and bounded like a declared one."""
    declared = request.META.get("CONTENT_LENGTH")
    if declared:
        try:
            return int(declared)
        except ValueError:
            return 0
    # Django's ASGIRequest keeps the buffered body (a spooled temporary file) as ``_stream``; no public handle
    # tells its size without reading it. A WSGI stream without a declared length has nothing to read.
    stream = getattr(request, "_stream", None)
    if stream is None or not getattr(stream, "seekable", lambda: False)():
        return 0
    size: int = stream.seek(0, os.SEEK_END)
    stream.seek(0)
    if size:
        request.META["CONTENT_LENGTH"] = str(size)
    return size


def _content_coding(request: HttpRequest) -> str | None:
    """The body's content coding, unless it is none (``identity``)."""
    coding = request.META.get("HTTP_CONTENT_ENCODING", "").strip()
    return coding if coding and coding.lower() != "identity" else None


def _without_body(response: HttpResponseBase) -> HttpResponseBase:
    """A HEAD answer: the GET's status and headers, its length declared, its body not sent (RFC 9110 9.3.2)."""
    if isinstance(response, HttpResponse):
        length = len(response.content)
        response.content = b""
        response["Content-Length"] = str(length)
    return response


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


def _disallowed_host(request: HttpRequest) -> DisallowedHost | None:
    """Django's host check (``ALLOWED_HOSTS``), made before ``CommonMiddleware`` would make it, so that its refusal
    leaves numbered and timed like any other answer (see ``_host_refused``)."""
    try:
        request.get_host()
    except DisallowedHost as exc:
        return exc
    return None


def _host_refused(exc: DisallowedHost) -> APIError:
    """Logged as the client's mistake it is: a warning, not the error with a traceback Django would log."""
    _host_logger.warning("%s", exc)
    return invalid_request("The Host header names a host this server does not serve.")


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
    """Wraps API requests: request id, timing header, body framing, coding and bound, and the error shape for
    anything that escapes; operations endpoints get the id and timing, and so do paths outside the API and the
    admin, with the error shape (nothing but a 404 is there). The admin's pages are Django's, but for a refused
    host. HEAD answers leave without a body."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response: Callable[[HttpRequest], Awaitable[HttpResponseBase]]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponseBase:
        path = request.path
        api = is_api_path(path)
        # API paths skip CommonMiddleware and its host check (see ``_call_api_view``), as they always have.
        disallowed = None if api else _disallowed_host(request)
        if disallowed is None and is_browser_path(path):
            return await self.get_response(request)
        started = time.perf_counter()
        context = request.api_context = RequestContext(request_id=request_id_of(request))
        token = _request_id.set(context.request_id)
        streaming = False
        try:
            if disallowed is not None:
                response: HttpResponseBase = render(_host_refused(disallowed))
            elif api:
                response = await self._answer_api(request, context)
            elif path in OPERATIONS_PATHS:
                response = await self.get_response(request)
                if response.status_code == 405:  # not the 401 of /metrics: Prometheus reads that one as text
                    response = _ensure_error_shape(response)
            else:
                response = _ensure_error_shape(await self.get_response(request))
            if request.method == "HEAD":
                response = _without_body(response)
            # A streamed body is sent once this returns, by the same task (Django's ASGI handler): the id stays set
            # for it, so that what is logged while it is sent is the request's too. The task ends with the request.
            streaming = response.streaming
            return _finish(context, response, started)
        finally:
            if not streaming:
                _request_id.reset(token)

    async def _answer_api(self, request: HttpRequest, context: RequestContext) -> HttpResponseBase:
        length = _body_length(request)
        if length and (coding := _content_coding(request)) is not None:
            return render(content_coding_refused(coding))
        if length > settings.MAX_REQUEST_BODY_BYTES:
            return render(body_too_large())
        try:
            response = await _call_api_view(request)
        except Exception as exc:  # noqa: BLE001  (last line of defence: always the API's error shape)
            response = render_exception(exc, context)
        return _ensure_error_shape(response)
