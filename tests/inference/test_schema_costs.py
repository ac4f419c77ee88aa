"""Schemas built to cost the node more than their size: refused by name before anything compiles them."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from django.conf import settings

from inference.engine.runners.grammar_costs import schema_leads_problem
from inference.openai import shared
from tests.conftest import API, MODEL_ID
from tests.inference.test_schema_output import LINKED_LIST

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
RESPONSES = "/v1/infer/responses"


def chat(**overrides: Any) -> dict[str, Any]:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **overrides,
    }


def output_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def fanning_out(levels: int) -> dict[str, Any]:
    """2 KB whose ``$defs`` each lead twice to the next: ``2**levels`` ways to the string at the end, which
    llama.cpp's grammar compiler followed one by one (27 levels: 7 s of a core, each level doubling it)."""
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"}, {"$ref": f"#/$defs/d{i + 1}"}]} for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "string"}
    return {
        "$defs": defs,
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d0"}},
        "required": ["a"],
        "additionalProperties": False,
    }


def with_pattern(pattern: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}


def assert_refused(response: Any, param: str, says: str) -> None:
    assert response.status_code == 400, response.content
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["param"], error["type"]) == (param, "invalid_request_error")
    assert says in error["message"]


async def test_an_output_schema_whose_refs_fan_out_is_refused_before_it_is_compiled(api: API) -> None:
    response = await asyncio.wait_for(api.post(CHAT, chat(response_format=output_schema(fanning_out(27)))), 30)

    assert_refused(response, "response_format.json_schema.schema", "$refs and anyOf/oneOf branches lead")


async def test_a_strict_tool_whose_refs_fan_out_is_named_by_its_place(api: API) -> None:
    tool = {"type": "function", "function": {"name": "fan", "strict": True, "parameters": fanning_out(27)}}

    response = await api.post(CHAT, chat(tools=[tool], tool_choice="required"))

    assert_refused(response, "tools.0.function.parameters", "$refs and anyOf/oneOf branches lead")


async def test_a_responses_text_format_whose_refs_fan_out_is_named(api: API) -> None:
    text = {"format": {"type": "json_schema", "name": "answer", "schema": fanning_out(27)}}

    response = await api.post(RESPONSES, {"model": MODEL_ID, "input": "Hi", "max_output_tokens": 16, "text": text})

    assert_refused(response, "text.format.schema", "$refs and anyOf/oneOf branches lead")


async def test_a_schema_whose_refs_lead_a_few_ways_is_served(api: API) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(fanning_out(8))))

    assert response.status_code == 200, response.content


async def test_a_recursive_schema_is_served_and_its_loop_counted_once(api: API) -> None:
    schema = LINKED_LIST

    response = await api.post(CHAT, chat(response_format=output_schema(schema)))

    assert response.status_code == 200, response.content
    assert schema_leads_problem(schema, most=settings.SCHEMA_MAX_LEADS) is None


def test_the_ways_are_counted_not_followed_however_many_there_are() -> None:
    # 2**5000 ways: followed one by one, the count would never end.
    problem = schema_leads_problem(fanning_out(5000), most=settings.SCHEMA_MAX_LEADS)

    assert problem is not None and str(settings.SCHEMA_MAX_LEADS) in problem


@pytest.mark.parametrize("pattern", ["^[^]a]$", "^a]$", "^x}$", "[]a]"])
async def test_a_pattern_with_a_bracket_that_is_not_escaped_is_refused_rather_than_spinning_for_good(
    api: API, pattern: str
) -> None:
    # Python reads these as regular expressions, llama.cpp's converter looped on them without end.
    response = await asyncio.wait_for(api.post(CHAT, chat(response_format=output_schema(with_pattern(pattern)))), 30)

    assert_refused(response, "response_format.json_schema.schema", "that is not escaped")


@pytest.mark.parametrize("pattern", [r"^[\]a]$", r"^a\]\}$", "^[a-z]{2,3}$", "^[{}]$"])
async def test_a_pattern_whose_brackets_are_escaped_or_in_a_class_is_served(api: API, pattern: str) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(with_pattern(pattern))))

    assert response.status_code == 200, response.content


@pytest.mark.parametrize(
    "pattern",
    ["^a{99999999999999999999}$", "^a{4294967295}$", "(" * 3000 + "a" + ")" * 3000],
    ids=["huge", "32bit", "deep"],
)
async def test_a_pattern_no_regex_engine_takes_is_a_400_not_a_500(api: API, pattern: str) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": with_pattern(pattern)}}

    response = await api.post(CHAT, chat(tools=[tool]))

    assert_refused(response, "tools.0.function.parameters", "not a valid JSON schema")


def either_array_of_itself() -> dict[str, Any]:
    """300 bytes whose value is one of two arrays of itself, never empty: each ``[`` the model must write doubles the
    alternatives llama.cpp's grammar keeps alive (15 levels: a minute a token, the model's other streams waiting)."""
    array = {"type": "array", "items": {"$ref": "#/$defs/nest"}, "minItems": 1}
    return {"$defs": {"nest": {"anyOf": [array, dict(array)]}}, "$ref": "#/$defs/nest"}


def arrays_in_arrays(levels: int, branches: int) -> dict[str, Any]:
    defs: dict[str, Any] = {
        f"d{i}": {"anyOf": [{"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for _ in range(branches)]}
        for i in range(levels)
    }
    defs[f"d{levels}"] = {"type": "integer"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


async def test_a_schema_whose_alike_branches_hold_themselves_is_refused_before_it_is_decoded(api: API) -> None:
    body = chat(response_format=output_schema(either_array_of_itself()), max_tokens=60)

    response = await asyncio.wait_for(api.post(CHAT, body), 30)

    assert_refused(response, "response_format.json_schema.schema", "hold themselves")


async def test_alike_branches_nested_past_the_bound_are_named_by_their_place(api: API) -> None:
    tool = {"type": "function", "function": {"name": "nest", "parameters": {"type": "object", "properties": {}}}}
    tool["function"]["parameters"]["properties"]["grid"] = arrays_in_arrays(8, 8)["$defs"]["d0"]
    tool["function"]["parameters"]["$defs"] = arrays_in_arrays(8, 8)["$defs"]

    response = await api.post(CHAT, chat(tools=[tool], tool_choice="required"))

    assert_refused(response, "tools.0.function.parameters", "more than 256 alternatives")


async def test_branches_told_apart_before_they_nest_are_served(api: API) -> None:
    # A tree of nodes, each a leaf or a branch of nodes: both objects, told apart by their first property's constant.
    leaf = {
        "type": "object",
        "properties": {"kind": {"const": "leaf"}, "value": {"type": "integer"}},
        "required": ["kind", "value"],
        "additionalProperties": False,
    }
    branch = {
        "type": "object",
        "properties": {"kind": {"const": "branch"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["kind", "children"],
        "additionalProperties": False,
    }
    node = {"anyOf": [{"$ref": "#/$defs/leaf"}, {"$ref": "#/$defs/branch"}]}
    schema = {"$defs": {"leaf": leaf, "branch": branch, "node": node}, "$ref": "#/$defs/node"}

    response = await api.post(CHAT, chat(response_format=output_schema(schema)))

    assert response.status_code == 200, response.content


async def test_a_few_alike_branches_one_inside_another_are_served(api: API) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(arrays_in_arrays(2, 8))))

    assert response.status_code == 200, response.content


@pytest.fixture
def checked(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The objects in each schema checked against JSON Schema's own schema, as the checks come."""
    sizes: list[int] = []
    real = shared.validator_for

    def counting(schema: Any, **kwargs: Any) -> Any:
        sizes.append(json.dumps(schema).count("{"))
        return real(schema, **kwargs)

    monkeypatch.setattr(shared, "validator_for", counting)
    return sizes


def wide(properties: int) -> dict[str, Any]:
    return {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(properties)}}


async def test_a_schema_too_large_to_check_is_refused_before_it_is_checked(api: API, checked: list[int]) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(wide(5000))))

    assert_refused(response, "response_format.json_schema.schema", "more than 4096 objects in all")
    assert checked == []


async def test_a_requests_schemas_share_one_checking_budget_however_many_tools_hold_them(
    api: API, checked: list[int]
) -> None:
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": wide(150)}} for i in range(40)]

    response = await api.post(CHAT, chat(tools=tools))

    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"].startswith("tools.") and error["param"].endswith(".function.parameters")
    assert "more than 4096 objects in all" in error["message"]
    assert 0 < sum(checked) <= 4096


async def test_a_pattern_too_long_to_check_is_refused_before_it_is_compiled(api: API, checked: list[int]) -> None:
    response = await api.post(CHAT, chat(response_format=output_schema(with_pattern("a" * 20_000))))

    assert_refused(response, "response_format.json_schema.schema", "a pattern is longer than 10000 characters")
    assert checked == []
