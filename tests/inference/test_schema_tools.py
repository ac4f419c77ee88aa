"""Function parameters as a client may write them: arguments that parse and match, or a 400 naming them."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.conftest import API, MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
RESPONSES = "/v1/infer/responses"

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}

# Parameters with no "type" whose $ref, anyOf, oneOf or enum admit other values than an object: a forced call was
# decoded as a string and came back as a call "cut short" by a budget it never reached, arguments no client could
# parse.
NOT_AN_OBJECT = {
    "anyOf of strings": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "$ref to a string": {"$defs": {"city": {"type": "string"}}, "$ref": "#/$defs/city"},
    "oneOf of an enum": {"oneOf": [{"enum": ["Paris", "Eugene"]}]},
    # one object among other values: a forced call could still be decoded as a string
    "anyOf of an object and a string": {"anyOf": [CITY, {"type": "string"}]},
}

# Parameters with no "type" that do describe an object.
AN_OBJECT = {
    "$ref to an object": {"$defs": {"city": CITY}, "$ref": "#/$defs/city"},
    "properties alone": {"properties": CITY["properties"], "required": ["city"]},
    "anyOf of an object": {"anyOf": [CITY]},
}


def forced_chat(parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
        "max_tokens": 40,
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}],
        "tool_choice": "required",
    }


@pytest.mark.parametrize("parameters", NOT_AN_OBJECT.values(), ids=NOT_AN_OBJECT.keys())
async def test_chat_parameters_that_admit_other_values_than_an_object_are_a_400_naming_them(
    api: API, parameters: dict[str, Any]
) -> None:
    response = await api.post(CHAT, forced_chat(parameters))

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == "tools.0.function.parameters"
    assert "must be a JSON object" in error["message"]


async def test_responses_parameters_that_admit_other_values_than_an_object_are_a_400_naming_them(api: API) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": NOT_AN_OBJECT["anyOf of strings"]}
    body = {"model": MODEL_ID, "input": "Weather in Paris?", "tools": [tool], "tool_choice": "required"}

    response = await api.post(RESPONSES, body)

    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"] == "tools.0.parameters"


@pytest.mark.parametrize("parameters", AN_OBJECT.values(), ids=AN_OBJECT.keys())
async def test_parameters_without_a_type_that_describe_an_object_get_a_call_whose_arguments_match(
    api: API, parameters: dict[str, Any]
) -> None:
    response = await api.post(CHAT, forced_chat(parameters))

    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), parameters)


# An output format asked for beside tools the model may call: what it answers holds to the format.
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
    "additionalProperties": False,
}


async def test_a_chat_answer_beside_strict_tools_it_may_call_holds_to_the_json_schema_asked_for(api: API) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
        "tools": [tool],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": ANSWER}},
        "max_tokens": 60,
        "temperature": 0,
    }

    response = await api.post(CHAT, body)

    assert response.status_code == 200, response.content
    message = response.json()["choices"][0]["message"]
    if message.get("tool_calls"):
        [call] = message["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)
    else:
        jsonschema.validate(json.loads(message["content"]), ANSWER)


async def test_a_responses_answer_beside_a_strict_tool_holds_to_the_text_format_asked_for(api: API) -> None:
    body = {
        "model": MODEL_ID,
        "input": "What is 2+2?",
        "tools": [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}],
        "text": {"format": {"type": "json_schema", "name": "answer", "strict": True, "schema": ANSWER}},
        "max_output_tokens": 60,
        "temperature": 0,
    }

    response = await api.post(RESPONSES, body)

    assert response.status_code == 200, response.content
    [item] = response.json()["output"]
    if item["type"] == "function_call":
        jsonschema.validate(json.loads(item["arguments"]), CITY)
    else:
        jsonschema.validate(json.loads(item["content"][0]["text"]), ANSWER)


async def test_an_output_schema_beside_tools_that_cannot_be_enforced_is_a_400_naming_the_format(api: API) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    bad = {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3}}}
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Pick."}],
        "tools": [tool],
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": bad}},
    }

    response = await api.post(CHAT, body)

    assert response.status_code == 400, response.content
    assert response.json()["error"]["param"].startswith("response_format")
