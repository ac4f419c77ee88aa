"""What structured output comes back as: a value the client's schema accepts, whatever shape the schema has."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.conftest import API, MODEL_ID

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
RESPONSES = "/v1/infer/responses"

# A linked list as Pydantic writes a recursive model: a root $ref to an object that refers to itself.
LINKED_LIST = {
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "value": {"type": "integer"},
                "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
            },
            "required": ["value", "next"],
            "additionalProperties": False,
        }
    },
    "$ref": "#/$defs/node",
}

SHAPE = {
    "$defs": {
        "circle": {
            "type": "object",
            "properties": {"radius": {"type": "integer"}},
            "required": ["radius"],
            "additionalProperties": False,
        },
        "square": {
            "type": "object",
            "properties": {"side": {"type": "integer"}},
            "required": ["side"],
            "additionalProperties": False,
        },
        "shape": {"anyOf": [{"$ref": "#/$defs/circle"}, {"$ref": "#/$defs/square"}]},
    },
    "$ref": "#/$defs/shape",
}

# A root that is a $ref to a definition with no properties of its own, as Pydantic writes a named type.
ROOT_REFS = {
    "string": {"$defs": {"word": {"type": "string", "maxLength": 10}}, "$ref": "#/$defs/word"},
    "enum": {"$defs": {"color": {"enum": ["red", "green"]}}, "$ref": "#/$defs/color"},
    "array": {
        "$defs": {"pair": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
        "$ref": "#/$defs/pair",
    },
    "union of objects": SHAPE,
}


def chat_with_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 40,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    }


@pytest.mark.parametrize("schema", ROOT_REFS.values(), ids=ROOT_REFS.keys())
async def test_a_root_ref_to_a_definition_without_properties_comes_back_as_a_value_of_that_definition(
    api: API, schema: dict[str, Any]
) -> None:
    response = await api.post(CHAT, chat_with_schema(schema))

    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


async def test_a_responses_text_format_with_a_root_ref_to_a_union_comes_back_as_one_of_its_members(api: API) -> None:
    text = {"format": {"type": "json_schema", "name": "shape", "schema": SHAPE}}
    body = {"model": MODEL_ID, "input": "A shape, as JSON.", "max_output_tokens": 40, "temperature": 0, "text": text}

    response = await api.post(RESPONSES, body)

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "completed"
    message = next(item for item in response.json()["output"] if item["type"] == "message")
    jsonschema.validate(json.loads(message["content"][0]["text"]), SHAPE)


async def test_a_root_ref_to_an_object_still_keeps_its_recursive_definitions(api: API) -> None:
    schema = LINKED_LIST

    response = await api.post(CHAT, {**chat_with_schema(schema), "max_tokens": 12})

    content = response.json()["choices"][0]["message"]["content"]
    assert content.startswith("{") and '"value"' in content


# Patterns as Pydantic and clients write them, with escapes (each failed to compile into a grammar: a 400).
ESCAPED_PATTERNS = {
    "zip": r"^\d{5}$",
    "version": r"^v\d+\.\d+$",
    "phone": r"^\(\d{3}\) \d{3}-\d{4}$",
    "handle": r"^@\w{2,12}$",
}


async def test_string_patterns_with_escapes_come_back_as_values_they_match(api: API) -> None:
    schema = {
        "type": "object",
        "properties": {name: {"type": "string", "pattern": pattern} for name, pattern in ESCAPED_PATTERNS.items()},
        "required": list(ESCAPED_PATTERNS),
        "additionalProperties": False,
    }

    response = await api.post(CHAT, {**chat_with_schema(schema), "max_tokens": 80})

    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


# What the grammar would leave out or read as anyOf, refused where the request wrote it, as other such keywords are.
LEFT_OUT = {
    "not": ({"type": "string", "not": {"enum": ["Paris"]}}, "its 'not' cannot be enforced by this model's grammar"),
    "format": ({"type": "string", "format": "uri"}, "its 'format' of 'uri' cannot be enforced by this model's grammar"),
    "oneOf": (
        {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
        "its 'oneOf' cannot be enforced by this model's grammar where a value may match more than one",
    ),
}


def placed(schema: dict[str, Any], place: str) -> tuple[str, dict[str, Any], str]:
    """A request holding ``schema`` as a chat ``response_format``, a forced strict tool's parameters or a Responses
    ``text.format``: its path, its body, and the parameter a 400 about the schema names."""
    if place == "response_format":
        return CHAT, chat_with_schema(schema), "response_format.json_schema.schema"
    if place == "strict tool":
        tool = {"type": "function", "function": {"name": "visit", "strict": True, "parameters": schema}}
        body = {key: value for key, value in chat_with_schema(schema).items() if key != "response_format"}
        return CHAT, {**body, "tools": [tool], "tool_choice": "required"}, "tools.0.function.parameters"
    text = {"format": {"type": "json_schema", "name": "answer", "schema": schema}}
    return RESPONSES, {"model": MODEL_ID, "input": "Hi", "text": text}, "text.format.schema"


def with_city(city: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": {"city": city}, "required": ["city"], "additionalProperties": False}


@pytest.mark.parametrize(("city", "says"), LEFT_OUT.values(), ids=LEFT_OUT.keys())
@pytest.mark.parametrize("place", ["response_format", "strict tool", "text.format"])
async def test_a_keyword_the_grammar_would_leave_out_is_a_400_naming_where_it_is(
    api: API, place: str, city: dict[str, Any], says: str
) -> None:
    path, body, param = placed(with_city(city), place)

    response = await api.post(path, body)

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, "invalid_value")
    assert says in error["message"]


STRICT_A = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"], "additionalProperties": False}
STRICT_B = {
    "type": "object",
    "properties": {"b": {"type": "integer"}},
    "required": ["b"],
    "additionalProperties": False,
}
# Schemas no finite value matches: a grammar built from them never lets the output close.
ENDLESS = {
    "itself-required": (
        {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"], "additionalProperties": False},
        "no value of it can be written to its end",
    ),
    "refs-in-a-loop": (
        {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
        "no value of it can be written to its end",
    ),
    "an-empty-enum": (with_city({"enum": []}), "no value of it can be written to its end"),
    "closed-objects-joined": (
        with_city({"allOf": [STRICT_A, STRICT_B]}),
        "no value matches its allOf: one of the objects it joins allows no property 'b', which another requires",
    ),
}


@pytest.mark.parametrize(("schema", "says"), ENDLESS.values(), ids=ENDLESS.keys())
@pytest.mark.parametrize("place", ["response_format", "strict tool", "text.format"])
async def test_a_schema_no_value_of_which_ends_is_a_400_naming_where_it_is(
    api: API, place: str, schema: dict[str, Any], says: str
) -> None:
    path, body, param = placed(schema, place)

    response = await api.post(path, body)

    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert error["param"] == param
    assert says in error["message"]


async def test_a_format_comes_back_as_a_value_of_that_format_whatever_the_question(api: API) -> None:
    schema = with_city({"type": "string", "format": "ipv4"})
    body = chat_with_schema(schema)
    body["messages"] = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]

    response = await api.post(CHAT, body)

    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


async def test_a_value_that_ends_as_the_budget_does_is_finished_not_cut(api: API) -> None:
    # The openai SDK's parse() refuses an answer that ended for its length: a whole value must not say so.
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    free = (await api.post(CHAT, chat_with_schema(schema))).json()
    written = free["usage"]["completion_tokens"]
    assert free["choices"][0]["finish_reason"] == "stop"

    exact = (await api.post(CHAT, {**chat_with_schema(schema), "max_tokens": written})).json()
    short = (await api.post(CHAT, {**chat_with_schema(schema), "max_tokens": written - 1})).json()

    assert exact["choices"][0]["message"]["content"] == free["choices"][0]["message"]["content"]
    assert (exact["choices"][0]["finish_reason"], exact["usage"]["completion_tokens"]) == ("stop", written)
    assert short["choices"][0]["finish_reason"] == "length"
