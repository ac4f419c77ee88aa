"""The node API's views: validate, call one workflow, render."""

from __future__ import annotations

from typing import Any

from django.http import HttpResponseBase
from rest_framework.request import Request
from rest_framework.response import Response

from inference.engine.catalog import get_enabled_model, list_enabled_models
from inference.models import CatalogEntry
from inference.openai import shared
from inference.openai import usage as usage_wire
from inference.openai.chat import ChatCompletionRequest
from inference.openai.errors import stored_responses_not_offered
from inference.openai.responses import ResponseCreateRequest, TokenCountRequest
from inference.serving import chat, gateway, responses
from inference.serving.caller import Caller, Result
from inference.usage import reading

from .base import AsyncAPIView


def _model_object(entry: CatalogEntry) -> dict[str, Any]:
    return shared.model_object(
        model_id=entry.public_id,
        created=int(entry.created.timestamp()),
        owned_by=entry.owned_by,
        capabilities=entry.capabilities(),
        route=entry.route,
    )


def _gateway_bound(request: Request) -> dict[str, Any] | None:
    """The body, if it asks for the gateway route; it is forwarded as sent, not validated as a node request."""
    data = request.data
    if isinstance(data, dict) and data.get("route") == "gateway":
        return data
    return None


class ModelListView(AsyncAPIView):
    http_method_names = ["get"]

    async def get(self, request: Request) -> Response:
        return Response(shared.model_list([_model_object(entry) for entry in await list_enabled_models()]))


class ModelDetailView(AsyncAPIView):
    http_method_names = ["get"]

    async def get(self, request: Request, model_id: str) -> Response:
        return Response(_model_object(await get_enabled_model(model_id)))


class _GenerationView(AsyncAPIView):
    """A generation endpoint: answered by the node, or forwarded as sent when the body asks for the gateway."""

    # POST only: a GET, or a WebSocket upgrade that serve hands over as one, is answered 405 with Allow: POST.
    http_method_names = ["post"]
    upstream_path: str
    endpoint: str

    async def post(self, request: Request) -> HttpResponseBase:
        if (body := _gateway_bound(request)) is not None:
            caller = self.caller(request, route=gateway.ROUTE)
            result = await gateway.forward_to_gateway(
                body=body, caller=caller, path=self.upstream_path, endpoint=self.endpoint
            )
        else:
            result = await self.on_node(request, self.caller(request, route="node"))
        return self.render_result(request, result)

    async def on_node(self, request: Request, caller: Caller) -> Result:
        raise NotImplementedError


class ChatCompletionsView(_GenerationView):
    upstream_path, endpoint = "chat/completions", chat.ENDPOINT

    async def on_node(self, request: Request, caller: Caller) -> Result:
        params = await self.parse(request, ChatCompletionRequest)
        self.names(request, params.param_names())
        return await chat.create_chat_completion(params=params, caller=caller)


class ResponsesView(_GenerationView):
    upstream_path, endpoint = "responses", responses.ENDPOINT

    async def on_node(self, request: Request, caller: Caller) -> Result:
        params = await self.parse(request, ResponseCreateRequest)
        self.names(request, params.param_names())
        return await responses.create_response(params=params, caller=caller)


class ResponseInputTokensView(AsyncAPIView):
    """``POST /responses/input_tokens``: how many tokens a Responses request's input takes on its model."""

    http_method_names = ["post"]

    async def post(self, request: Request) -> Response:
        params = await self.parse(request, TokenCountRequest)
        self.names(request, params.param_names())
        return Response(await responses.count_input_tokens(params=params))


class _NothingStoredView(AsyncAPIView):
    """OpenAI's endpoints on one stored object (retrieve, update, delete, list its parts): this node keeps none."""

    http_method_names = ["get", "post", "delete"]
    WHY = ""

    def why(self, object_id: str) -> str:
        return self.WHY

    async def get(self, request: Request, **path: str) -> Response:
        (object_id,) = path.values()  # the one id in the path, named for its kind (``response_id``)
        raise stored_responses_not_offered(self.why(object_id))

    post = delete = get


class StoredResponseView(_NothingStoredView):
    """``/responses/{id}`` and below (retrieve, delete, cancel, input items): this node keeps no response."""

    WHY = (
        "This node stores no responses, so none can be retrieved, deleted, cancelled or listed: each response is "
        "sent once, as it is made. To go on with a conversation, send it whole as input."
    )
    COMPACT = (
        "This node does not compact conversations (POST /responses/compact): send the conversation whole as input, "
        'with truncation: "auto" to let its oldest turns go when it outgrows the model\'s context.'
    )

    def why(self, object_id: str) -> str:
        return self.COMPACT if object_id.strip("/") == "compact" else self.WHY


class StoredChatCompletionView(_NothingStoredView):
    """``/chat/completions/{id}`` and below (retrieve, update, delete, messages): ``store`` keeps nothing here."""

    WHY = (
        "This node stores no chat completions (store: true is accepted and keeps nothing), so none can be "
        "retrieved, updated, deleted or listed: each completion is sent once, as it is made."
    )


class UsageView(AsyncAPIView):
    """The caller's organization's own usage (never another's): ``?start=&end=&group_by=day|model|key``.

    Days are UTC days; ``start`` is inclusive and ``end`` exclusive (as in OpenAI's usage API); both
    take a date, an ISO 8601 time or unix seconds. The default is the last seven days, today included.
    """

    http_method_names = ["get"]

    async def get(self, request: Request) -> Response:
        query = usage_wire.parse_query(request.query_params)
        organization = request.user
        groups, total = await reading.organization_usage(
            organization_id=organization.pk, start=query.start, end=query.end, group_by=query.group_by
        )
        return Response(usage_wire.organization_usage(organization.slug, query, groups, total))
