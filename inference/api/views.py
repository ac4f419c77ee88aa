"""The node API's views: validate, call one service, render."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse
import orjson
from rest_framework.request import Request
from rest_framework.response import Response

from inference.openai import chat as protocol
from inference.usage import reports
from inference.serving import caller as services
from inference.engine.catalog import get_enabled_model, list_enabled_models
from inference.models import CatalogEntry
from inference.api.base import AsyncAPIView
from inference.openai import usage as usage_wire
from inference.openai.responses import ResponseCreateRequest


def _model_object(entry: CatalogEntry) -> dict[str, Any]:
    return protocol.model_object(
        model_id=entry.public_id,
        created=int(entry.created.timestamp()),
        owned_by=entry.owned_by,
        capabilities=entry.capabilities(),
    )


def _caller(request: Request) -> services.Caller:
    request._request.infer_route = "node"
    return services.Caller(api_key=request.auth, request_id=request._request.request_id)


def render_result(request: Request, result: services.Result) -> HttpResponseBase:
    request._request.infer_route = result.route
    response: HttpResponseBase
    if result.stream is not None:
        response = StreamingHttpResponse(result.stream, content_type="text/event-stream; charset=utf-8")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
    else:
        response = HttpResponse(orjson.dumps(result.body), content_type="application/json")
    for name, value in result.headers.items():
        response[name] = value
    return response


class ModelListView(AsyncAPIView):
    http_method_names = ["get"]
    async def get(self, request: Request) -> Response:
        return Response(protocol.model_list([_model_object(entry) for entry in await list_enabled_models()]))


class ModelDetailView(AsyncAPIView):
    http_method_names = ["get"]
    async def get(self, request: Request, model_id: str) -> Response:
        return Response(_model_object(await get_enabled_model(model_id)))


def _gateway_bound(request: Request) -> dict[str, Any] | None:
    """The body, if it asks for the gateway route; it is forwarded as sent, not validated as a node request."""
    data = request.data
    if isinstance(data, dict) and data.get("route") == "gateway":
        request._request.infer_route = "gateway"
        return data
    return None


class ChatCompletionsView(AsyncAPIView):
    http_method_names = ["post"]

    async def post(self, request: Request) -> HttpResponseBase:
        caller = _caller(request)
        if (body := _gateway_bound(request)) is not None:
            result = await services.forward_to_gateway(body=body, caller=caller, path="chat/completions", endpoint="chat.completions")
            return render_result(request, result)
        params = protocol.parse(protocol.ChatCompletionRequest, request.data)
        return render_result(request, await services.create_chat_completion(params=params, caller=caller))


class ResponsesView(AsyncAPIView):
    # POST only: a GET, or a WebSocket upgrade that serve hands over as one, is answered 405 with Allow: POST.
    http_method_names = ["post"]

    async def post(self, request: Request) -> HttpResponseBase:
        caller = _caller(request)
        if (body := _gateway_bound(request)) is not None:
            result = await services.forward_to_gateway(body=body, caller=caller, path="responses", endpoint="responses")
            return render_result(request, result)
        params = protocol.parse(ResponseCreateRequest, request.data)
        return render_result(request, await services.create_response(params=params, caller=caller))


# --- usage ---------------------------------------------------------------------------------------


class UsageView(AsyncAPIView):
    """The caller's organization's own usage (never another's): ``?start=&end=&group_by=day|model|key``.

    Days are UTC days; ``start`` is inclusive and ``end`` exclusive (as in OpenAI's usage API); both
    take a date, an ISO 8601 time or unix seconds. The default is the last seven days, today included.
    """

    http_method_names = ["get"]

    async def get(self, request: Request) -> Response:
        query = usage_wire.parse_query(request.query_params)
        organization = request.user
        groups, total = await sync_to_async(reports.organization_usage, thread_sensitive=False)(
            organization_id=organization.pk, start=query.start, end=query.end, group_by=query.group_by
        )
        return Response(usage_wire.organization_usage(organization.slug, query, groups, total))
