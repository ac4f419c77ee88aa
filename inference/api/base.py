"""The base of the API's views: DRF's APIView with async handlers that stay on the event loop, where a
request is authenticated (``orgs.authentication``) and a workflow's result rendered.

DRF runs its request set-up synchronously; wrapped for async, that costs a fresh thread per request.
Here authentication is awaited on the shared thread pool and the rest of DRF's set-up (parsers,
content negotiation, the exception handler, response finalizing) is DRF's own.
"""

from __future__ import annotations

from typing import Any

import orjson
from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request
from rest_framework.views import APIView

from inference.openai.errors import ParamNames
from inference.openai.shared import Model, parse
from inference.serving.caller import Caller, Result
from orgs.authentication import APIKeyAuthentication

from .context import RequestContext


class JSONOrStream(DefaultContentNegotiation):
    """The API answers JSON, or a stream when the request asks for one in its body; an ``Accept`` header
    (``text/event-stream`` from streaming clients, anything from others) never turns a request into a 406."""

    def select_renderer(
        self, request: Request, renderers: list[BaseRenderer], format_suffix: str | None = None
    ) -> tuple[BaseRenderer, str]:
        return renderers[0], renderers[0].media_type


# Bodies larger than this are parsed and validated on a thread: an 8 MiB body costs the event loop, which serves
# every other request, tens of milliseconds.
OFF_LOOP_BODY_BYTES = 64 * 1024


def _declared_length(request: Request) -> int:
    try:
        return int(request.META.get("CONTENT_LENGTH") or 0)
    except ValueError:
        return 0


class AsyncAPIView(APIView):
    """Every handler is ``async``; ``http_method_names`` lists only the methods the view serves, and HEAD is
    served wherever GET is (RFC 9110), by the GET handler: the envelope sends its answer without the body."""

    authentication_classes = [APIKeyAuthentication]
    content_negotiation_class = JSONOrStream

    @property
    def allowed_methods(self) -> list[str]:
        allowed: list[str] = super().allowed_methods
        return [*allowed, "HEAD"] if "GET" in allowed and "HEAD" not in allowed else allowed

    async def dispatch(self, request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponseBase:
        self.args, self.kwargs = args, kwargs
        drf_request = self.initialize_request(request, *args, **kwargs)
        self.request = drf_request
        self.headers = self.default_response_headers
        try:
            await self.authenticate(drf_request)
            if _declared_length(drf_request) > OFF_LOOP_BODY_BYTES:
                await sync_to_async(lambda: drf_request.data, thread_sensitive=False)()
            self.format_kwarg = None
            drf_request.accepted_renderer, drf_request.accepted_media_type = self.perform_content_negotiation(
                drf_request
            )
            method = drf_request.method.lower()
            if method == "head" and "head" not in self.http_method_names:
                method = "get"
            handler = getattr(self, method, None) if method in self.http_method_names else None
            if handler is None:
                self.http_method_not_allowed(drf_request, *args, **kwargs)
            response = await handler(drf_request, *args, **kwargs)  # type: ignore[misc]
        except Exception as exc:  # noqa: BLE001  (DRF's handler renders every error)
            response = self.handle_exception(exc)
        self.response = self.finalize_response(drf_request, response, *args, **kwargs)
        return self.response

    async def authenticate(self, request: Request) -> None:
        organization, key = await APIKeyAuthentication().aauthenticate(request)
        request.user, request.auth = organization, key

    def context(self, request: Request) -> RequestContext:
        context: RequestContext = request.api_context
        return context

    def caller(self, request: Request, *, route: str) -> Caller:
        """The authenticated caller, for a workflow; ``route`` is the way the request goes until its result says."""
        context = self.context(request)
        context.route = route
        return Caller(api_key=request.auth, request_id=context.request_id)

    async def parse(self, request: Request, model: type[Model]) -> Model:
        """The body as ``model`` (or an OpenAI-shaped 400): validated on a thread when it is large."""
        if _declared_length(request) > OFF_LOOP_BODY_BYTES:
            return await sync_to_async(parse, thread_sensitive=False)(model, request.data)
        return parse(model, request.data)

    def names(self, request: Request, params: ParamNames) -> None:
        """Hands the parsed request's parameter names to the error renderer, for errors found below the API."""
        self.context(request).params = params

    def render_result(self, request: Request, result: Result) -> HttpResponseBase:
        self.context(request).route = result.route
        response: HttpResponseBase
        if result.stream is not None:
            # The charset given, not read back from the Content-Type header by a regex for every chunk.
            response = StreamingHttpResponse(
                result.stream, content_type="text/event-stream; charset=utf-8", charset="utf-8"
            )
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            # Django closes only its own wrapper of the stream: the server closes the stream itself once it is sent
            # or abandoned (``config.asgi``), so its slot and its usage are settled then, not by the garbage collector.
            response.source = result.stream
        else:
            response = HttpResponse(orjson.dumps(result.body), content_type="application/json")
        for name, value in result.headers.items():
            response[name] = value
        return response
