"""GET /v1/openapi.json: the node's own endpoints, from the request models its views validate with."""

from __future__ import annotations

import re
from typing import Any

import pytest
from django.urls import URLPattern, URLResolver, get_resolver
from jsonschema import Draft202012Validator

from agents.protocol import AgentResponseRequest
from inference.openai.chat import ChatCompletionRequest
from inference.openai.responses import ResponseCreateRequest
from tests.conftest import API, MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)


def api_paths(patterns: list[Any] | None = None, prefix: str = "/") -> set[str]:
    """Every URL the project routes under /v1/, as OpenAPI writes paths."""
    found: set[str] = set()
    for pattern in patterns if patterns is not None else get_resolver().url_patterns:
        route = prefix + re.sub(r"<path:(\w+)>", r"{\1}", str(pattern.pattern))
        if isinstance(pattern, URLResolver):
            found |= api_paths(pattern.url_patterns, route)
        elif isinstance(pattern, URLPattern) and route.startswith("/v1/"):
            found.add(route)
    return found


async def document(api: API) -> dict[str, Any]:
    response = await api.client.get("/v1/openapi.json")
    assert response.status_code == 200
    return response.json()


async def test_it_documents_every_api_endpoint_without_asking_for_a_key(api: API) -> None:
    published = await document(api)

    assert published["openapi"] == "3.1.0"
    assert set(published["paths"]) == api_paths()


async def test_its_request_bodies_are_the_models_the_views_validate_with(api: API) -> None:
    schemas = (await document(api))["components"]["schemas"]

    for model in (ChatCompletionRequest, ResponseCreateRequest, AgentResponseRequest):
        own = model.model_json_schema(ref_template="#/components/schemas/{model}")
        own.pop("$defs", None)
        assert schemas[model.__name__] == own


@pytest.mark.parametrize(("field", "value"), [("stream", True), ("temperature", 0.5), ("max_output_tokens", 16)])
async def test_the_input_token_count_is_documented_as_taking_only_what_shapes_the_input(
    api: API, field: str, value: Any
) -> None:
    published = await document(api)
    operation = published["paths"]["/v1/infer/responses/input_tokens"]["post"]
    ref = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = published["components"]["schemas"][ref.rsplit("/", 1)[1]]
    body = {"model": MODEL_ID, "input": "Hi", field: value}

    assert field not in schema["properties"] and schema["additionalProperties"] is False
    assert (await api.post("/v1/infer/responses/input_tokens", body)).json()["error"]["code"] == "unknown_parameter"
    assert set(operation["responses"]["200"]["content"]) == {"application/json"}


async def test_an_agents_turn_is_documented_as_streamed_only(api: API) -> None:
    published = await document(api)
    operation = published["paths"]["/v1/responses"]["post"]
    schema = published["components"]["schemas"]["AgentResponseRequest"]

    assert schema["properties"]["stream"]["const"] is True and "stream" in schema["required"]
    assert set(operation["responses"]["200"]["content"]) == {"text/event-stream"}


async def test_every_schema_in_it_is_valid_json_schema_and_names_the_b3os_extensions(api: API) -> None:
    schemas = (await document(api))["components"]["schemas"]

    for schema in schemas.values():
        Draft202012Validator.check_schema(schema)
    assert schemas["Model"]["properties"]["b3os"]["required"] == [
        "json_schema",
        "image_input",
        "tools",
        "reasoning",
        "route",
    ]
    assert schemas["ChatCompletionRequest"]["properties"]["model"]["maxLength"] == 200
    assert "route" in schemas["ResponseCreateRequest"]["properties"]


async def test_the_route_it_documents_is_taken_by_both_node_endpoints(api: API) -> None:
    responses = await api.post(
        "/v1/infer/responses", {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 16, "route": "node"}
    )

    assert responses.status_code == 200, responses.content


async def test_it_answers_only_get(api: API) -> None:
    response = await api.client.post("/v1/openapi.json")

    assert response.status_code == 405
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
