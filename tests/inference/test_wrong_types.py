"""Any field of a full request, given a value of the wrong type, gets an OpenAI-shaped answer: never a 500.

Requests that stay valid run on the toy model (TensorRT-LLM stand-in), so the sweep is quick.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from inference.models import CatalogEntry
from tests.conftest import API
from tests.inference.test_responses import TOY_ID, toy_model  # noqa: F401 (a fixture)

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
RESPONSES_BODY = {
    "model": TOY_ID,
    "instructions": "Be brief.",
    "max_output_tokens": 16,
    "temperature": 0,
    "metadata": {"a": "b"},
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "x"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "52F"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok", "annotations": []}]},
    ],
    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}],
    "tool_choice": "auto",
    "text": {"format": {"type": "text"}},
    "reasoning": {"effort": None},
    "include": [],
}
CHAT_BODY = {
    "model": TOY_ID,
    "max_tokens": 16,
    "temperature": 0,
    "stop": ["\n\n"],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "52F"},
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": True}}],
    "response_format": {"type": "text"},
}
WRONG = [None, -1, 1.5, "x", [], {}, [1], {"a": 1}, True]


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    if prefix:
        yield prefix
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        yield from paths(child, (*prefix, key))


def replaced(body: dict[str, Any], path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    node = body
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return body


@pytest.mark.parametrize(
    ("url", "body"), [("/v1/infer/responses", RESPONSES_BODY), ("/v1/infer/chat/completions", CHAT_BODY)]
)
async def test_no_wrong_value_in_any_field_is_a_server_error(
    api: API,
    toy_model: CatalogEntry,  # noqa: F811  (the fixture, imported)
    url: str,
    body: dict[str, Any],
) -> None:
    assert (await api.post(url, body)).status_code == 200
    failures = []
    for path in paths(body):
        for value in WRONG:
            response = await api.post(url, replaced(body, path, value))
            shaped = response.status_code == 200 or set(response.json()) == {"error"}
            if response.status_code >= 500 or not shaped:
                failures.append((path, value, response.status_code, response.content[:200]))
    assert failures == []
