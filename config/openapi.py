"""``GET /v1/openapi.json``: an OpenAPI 3.1 document of the node's own endpoints.

Request bodies are the JSON schemas of the request models the views validate with (so the document cannot
drift from what is accepted), responses are OpenAI's objects with this platform's ``b3os`` extensions, and
every error is OpenAI's error object. It spans the node API and the agent runtime, so it is wired here, beside
the URLs of both.
"""

from __future__ import annotations

import functools
from typing import Any, Literal

from django.http import HttpRequest, JsonResponse
from django.views.decorators.http import require_safe
from pydantic.json_schema import models_json_schema

from agents.api import TENANT_HEADER
from agents.protocol import AgentResponseRequest, FeedbackRequest
from inference.models import CAPABILITIES
from inference.openai.chat import ChatCompletionRequest
from inference.openai.responses import ResponseCreateRequest, TokenCountRequest
from inference.openai.usage import PARAMS as USAGE_PARAMS

REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF.format(model=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERRORS = {
    "4XX": _json(_ref("Error"), "The request was refused: OpenAI's error object, naming the parameter."),
    "5XX": _json(_ref("Error"), "The server or the upstream failed: OpenAI's error object."),
}

EXTENSIONS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "additionalProperties": False,
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "param", "code"],
                "additionalProperties": False,
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "param": {"type": ["string", "null"]},
                    "code": {"type": "string"},
                },
            }
        },
    },
    "B3OSRoute": {
        "description": "This platform's: which way the request went, served on the node or by the gateway's upstream.",
        "type": "object",
        "required": ["route"],
        "properties": {"route": {"enum": ["node", "gateway"]}},
    },
    "Model": {
        "type": "object",
        "required": ["id", "object", "created", "owned_by", "b3os"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "model"},
            "created": {"type": "integer"},
            "owned_by": {"type": "string"},
            "b3os": {
                "description": (
                    "This platform's: what the model can do (requests that need more get a 400), and the route that "
                    'serves it: a gateway model is asked for with "route": "gateway".'
                ),
                "type": "object",
                "required": [*CAPABILITIES, "route"],
                "properties": {
                    **{name: {"type": "boolean"} for name in CAPABILITIES},
                    "route": {"enum": ["node", "gateway"]},
                },
            },
        },
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
    },
    "ChatCompletion": {
        "description": "OpenAI's chat.completion (or, streamed, chat.completion.chunk events ending in [DONE]).",
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "chat.completion"},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object"},
            "b3os": _ref("B3OSRoute"),
        },
    },
    "Response": {
        "description": "OpenAI's Response (or, streamed, its events ending in response.completed, .incomplete or "
        ".failed).",
        "type": "object",
        "required": ["id", "object", "status", "output"],
        "properties": {
            "id": {"type": "string"},
            "object": {"const": "response"},
            "status": {"type": "string"},
            "output": {"type": "array", "items": {"type": "object"}},
            "usage": {"type": "object"},
            "b3os": _ref("B3OSRoute"),
        },
    },
    "TokenCounts": {
        "description": "OpenAI's input token count of a Responses request.",
        "type": "object",
        "required": ["object", "input_tokens"],
        "properties": {"object": {"const": "response.input_tokens"}, "input_tokens": {"type": "integer"}},
    },
    "OrganizationUsage": {"type": "object", "required": ["object", "data", "total"]},
    "InstanceList": {"type": "object", "required": ["object", "data"]},
    "Feedback": {"type": "object", "required": ["object", "message_id", "rating"]},
}

STREAM = {"text/event-stream": {"schema": {"type": "string", "description": "Server-sent events."}}}


def _post(
    summary: str,
    request: str,
    response: str,
    *,
    stream: Literal["never", "asked", "always"] = "asked",
    tenant: bool = False,
) -> dict[str, Any]:
    """A POST operation answering ``response``: as JSON, as an event stream when the request asks (``"stream":
    true``), or always as an event stream."""
    ok: dict[str, Any]
    if stream == "always":
        ok = {"description": f"An event stream of {response} events.", "content": STREAM}
    elif stream == "asked":
        ok = _json(_ref(response), 'The answer; with "stream": true, an event stream.')
        ok["content"].update(STREAM)
    else:
        ok = _json(_ref(response), "The answer.")
    operation: dict[str, Any] = {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {"200": ok, **ERRORS},
    }
    if tenant:
        operation["parameters"] = [_tenant()]
    return {"post": operation}


def _get(summary: str, response: str, *, parameters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": {"200": _json(_ref(response), "OK"), **ERRORS}}
    if parameters:
        operation["parameters"] = parameters
    return {"get": operation}


def _not_offered(summary: str, *, tenant: bool = False, id_name: str = "response_id") -> dict[str, Any]:
    """OpenAI's endpoints on one stored object (retrieve, delete; cancel and input_items below a response's id):
    answered with a 404 that says why they are not offered."""
    parameters = [{"name": id_name, "in": "path", "required": True, "schema": {"type": "string"}}]
    if tenant:
        parameters.append(_tenant())
    operation = {"summary": summary, "parameters": parameters, "responses": {"404": ERRORS["4XX"]}}
    return {"get": operation, "post": operation, "delete": operation}


def _tenant() -> dict[str, Any]:
    return {
        "name": TENANT_HEADER,
        "in": "header",
        "required": True,
        "description": "The organization of the API key.",
        "schema": {"type": "string"},
    }


def _query(name: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": {"type": "string"}}


def _counted(definitions: dict[str, Any]) -> dict[str, Any]:
    """The count's request: a Responses request's fields that shape its input, the only ones it takes."""
    schema = definitions["TokenCountRequest"]
    return {**schema, "properties": {k: v for k, v in schema["properties"].items() if k in TokenCountRequest.COUNTED}}


@functools.cache
def document() -> dict[str, Any]:
    _, definitions = models_json_schema(
        [
            (ChatCompletionRequest, "validation"),
            (ResponseCreateRequest, "validation"),
            (TokenCountRequest, "validation"),
            (AgentResponseRequest, "validation"),
            (FeedbackRequest, "validation"),
        ],
        ref_template=REF,
    )
    instances = _get("The agent instances the tenant may use.", "InstanceList", parameters=[_tenant()])
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "b3os-infer",
            "version": "1",
            "description": "OpenAI-compatible inference (/v1/infer) and the stateful agent runtime (/v1). Every "
            "error is OpenAI's error object; fields named b3os are this platform's.",
        },
        "components": {
            "schemas": {
                **definitions["$defs"],
                "TokenCountRequest": _counted(definitions["$defs"]),
                **EXTENSIONS,
            },
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"apiKey": []}],
        "paths": {
            "/v1/infer/models": _get("The models this node offers.", "ModelList"),
            "/v1/infer/models/{model_id}": _get("One model.", "Model", parameters=[model_id]),
            "/v1/infer/chat/completions": _post(
                'Chat completions; "route": "gateway" sends it to the upstream.',
                "ChatCompletionRequest",
                "ChatCompletion",
            ),
            "/v1/infer/chat/completions/{completion_id}": _not_offered(
                "Not offered: this node keeps no chat completion (store keeps nothing).", id_name="completion_id"
            ),
            "/v1/infer/responses": _post(
                'Responses, stateless; "route": "gateway" sends it to the upstream.',
                "ResponseCreateRequest",
                "Response",
            ),
            "/v1/infer/responses/input_tokens": _post(
                "The input tokens a Responses request takes on its model; nothing runs.",
                "TokenCountRequest",
                "TokenCounts",
                stream="never",
            ),
            "/v1/infer/responses/{response_id}": _not_offered("Not offered: this node keeps no response."),
            "/v1/infer/usage": _get(
                "The organization's own usage.",
                "OrganizationUsage",
                parameters=[_query(name) for name in USAGE_PARAMS],
            ),
            "/v1/responses": _post(
                "An agent's turn, streamed.", "AgentResponseRequest", "Response", tenant=True, stream="always"
            ),
            "/v1/responses/{response_id}": _not_offered(
                "Not offered: a stored conversation goes on by previous_response_id.", tenant=True
            ),
            "/v1/instances": instances,
            "/v1/feedback": _post(
                "A rating of a stored response.", "FeedbackRequest", "Feedback", stream="never", tenant=True
            ),
            "/v1/openapi.json": {
                "get": {
                    "summary": "This document.",
                    "security": [],
                    "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}},
                }
            },
        },
    }


@require_safe
async def openapi(request: HttpRequest) -> JsonResponse:
    return JsonResponse(document())
