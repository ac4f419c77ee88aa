"""A forced tool call (``required`` or a named function) is a call whose arguments parse and match its schema,
every time: under many seeds, streamed or not, in chat completions and in Responses."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from tests.conftest import API, MODEL_ID, OpenAISpec, read_stream, sse_data

pytestmark = pytest.mark.django_db(transaction=True)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
QUESTION = "What is the weather in Eugene?"
SEEDS = range(4)
# Room for any city's name many times over: a model sampling hot may write a string without end, and then the budget
# closes the call in time (a valid call still), in seconds rather than the minute the model's own limit takes.
CALL_BUDGET = 256
# A schema small models ramble in (they repeat list items): the budget, not the model, ends these calls.
CHOICES = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "options": {"type": "array", "items": {"type": "string"}}},
    "required": ["question", "options"],
}


def chat_body(
    seed: int, *, stream: bool, choice: Any, schema: dict[str, Any] = WEATHER, **extra: Any
) -> dict[str, Any]:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Current weather for a city.", "parameters": schema},
    }
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": [tool],
        "tool_choice": choice,
        "seed": seed,
        "stream": stream,
        "max_tokens": CALL_BUDGET,
        **extra,
    }


def added_up(pieces: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Streamed calls as a client adds them up: the first piece of each (by index) names it, the others carry more of
    its arguments."""
    calls: dict[int, dict[str, Any]] = {}
    for piece in pieces:
        if piece["index"] not in calls:
            calls[piece["index"]] = {**piece, "function": dict(piece["function"])}
        else:
            assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["function"]["arguments"] += piece["function"]["arguments"]
    return list(calls.values())


async def chat_call(api: API, spec: OpenAISpec, body: dict[str, Any]) -> tuple[dict[str, Any], str | None, str]:
    """The one tool call, the message's text and the finish reason, from a completion or its chunks."""
    response = await api.post("/v1/infer/chat/completions", body)
    assert response.status_code == 200, response.content
    if not body["stream"]:
        data = response.json()
        spec.validate("CreateChatCompletionResponse", data)
        choice = data["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        return call["function"], choice["message"]["content"], choice["finish_reason"]
    chunks = [json.loads(item) for item in sse_data(await read_stream(response))[:-1]]
    for chunk in chunks:
        spec.validate("CreateChatCompletionStreamResponse", chunk)
    deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
    (call,) = added_up([call for delta in deltas for call in delta.get("tool_calls") or ()])
    text = "".join(delta.get("content") or "" for delta in deltas)
    return (
        call["function"],
        text or None,
        next(c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]),
    )


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_weather"}}], ids=["required", "named"]
)
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_forced_chat_tool_call_is_a_valid_call(
    api: API, openai_spec: OpenAISpec, seed: int, stream: bool, choice: Any
) -> None:
    function, text, finish_reason = await chat_call(api, openai_spec, chat_body(seed, stream=stream, choice=choice))

    assert function["name"] == "get_weather"
    jsonschema.validate(json.loads(function["arguments"]), WEATHER)
    assert text is None
    # As at OpenAI: a call the request named ends with "stop", a call it required with "tool_calls".
    assert finish_reason == ("tool_calls" if choice == "required" else "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_forced_call_that_outgrows_its_budget_is_closed_in_time(
    api: API, openai_spec: OpenAISpec, seed: int, stream: bool
) -> None:
    body = chat_body(seed, stream=stream, choice="required", schema=CHOICES, max_tokens=40, temperature=1.2)

    function, text, finish_reason = await chat_call(api, openai_spec, body)

    jsonschema.validate(json.loads(function["arguments"]), CHOICES)
    assert text is None
    assert finish_reason in ("tool_calls", "length")


# A required property whose name alone takes 15 tokens.
LONG_NAME = {
    "type": "object",
    "properties": {
        "a": {"type": "integer"},
        "the_full_postal_address_of_the_customer_including_zip_code": {"type": "boolean"},
    },
    "required": ["a", "the_full_postal_address_of_the_customer_including_zip_code"],
}


@pytest.mark.parametrize("max_tokens", [44, 48])
async def test_a_forced_call_whose_required_name_is_long_is_closed_in_time(
    api: API, openai_spec: OpenAISpec, max_tokens: int
) -> None:
    # Closing in time counts the tokens of each required name not written yet, not a flat guess of six.
    body = chat_body(0, stream=False, choice="required", schema=LONG_NAME, max_tokens=max_tokens, temperature=0)

    function, _, finish_reason = await chat_call(api, openai_spec, body)

    jsonschema.validate(json.loads(function["arguments"]), LONG_NAME)
    assert finish_reason in ("tool_calls", "length")


ORDER = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
                "required": ["name", "qty"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("max_tokens", range(20, 63, 6))
async def test_a_forced_call_whose_list_items_require_properties_is_closed_in_time(
    api: API, openai_spec: OpenAISpec, max_tokens: int
) -> None:
    # Closing counted the names of the items' objects nowhere (a list may be empty), and a name the first item wrote
    # as written for the next: arguments such as {"items": [{"name": "a", "qty": 1}, {"name":", ","qty" :-
    await forced_call_holds_to(
        api, openai_spec, ORDER, "Order many items.", seed=0, max_tokens=max_tokens, temperature=0
    )


async def forced_call_holds_to(
    api: API,
    openai_spec: OpenAISpec,
    schema: dict[str, Any],
    ask: str,
    *,
    seed: int,
    max_tokens: int,
    temperature: float,
) -> None:
    """A required call asked for with ``ask`` comes back as arguments that ``schema`` holds, whole or closed in time."""
    body = chat_body(
        seed, stream=False, choice="required", schema=schema, max_tokens=max_tokens, temperature=temperature
    )
    body["messages"] = [{"role": "user", "content": ask}]

    function, _, finish_reason = await chat_call(api, openai_spec, body)

    jsonschema.validate(json.loads(function["arguments"]), schema)
    assert finish_reason in ("tool_calls", "length")


def strict_object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


# A union told apart by a tag, a map of objects, and a choice of a cheap and a dear branch: what the model commits to
# is known before the string that commits it ends.
COMMITTING = {
    "tagged-union-items": strict_object(
        {
            "shapes": {
                "type": "array",
                "items": {
                    "anyOf": [
                        strict_object({"kind": {"const": "circle"}, "radius": {"type": "integer"}}),
                        strict_object({"kind": {"const": "rect"}, **{n: {"type": "integer"} for n in ("w", "h")}}),
                    ]
                },
            }
        }
    ),
    "map-of-objects": strict_object(
        {"users": {"type": "object", "additionalProperties": strict_object({"age": {"type": "integer"}, "email": {}})}}
    ),
    "cheap-or-dear": {
        "anyOf": [
            strict_object({"op": {"const": "noop"}}),
            strict_object(
                {"op": {"const": "create_record"}, **{n: {"type": "string"} for n in ("first", "last", "city")}}
            ),
        ]
    },
}


@pytest.mark.parametrize("max_tokens", [26, 32, 44, 56])
@pytest.mark.parametrize("schema", COMMITTING.values(), ids=COMMITTING.keys())
async def test_a_forced_call_that_commits_to_a_dearer_part_mid_string_is_closed_in_time(
    api: API, openai_spec: OpenAISpec, schema: dict[str, Any], max_tokens: int
) -> None:
    ask = "Call the tool with sensible values."
    await forced_call_holds_to(api, openai_spec, schema, ask, seed=1, max_tokens=max_tokens, temperature=1.2)


TIME = {
    "type": "object",
    "properties": {"tz": {"type": "string"}, "fmt": {"type": "string", "enum": ["12h", "24h"]}},
    "required": ["tz", "fmt"],
}
# An optional part whose own properties are required: needed only once the model writes it.
WEATHER_WITH_EXTRAS = {
    **WEATHER,
    "properties": {
        **WEATHER["properties"],
        "extra": {
            "type": "object",
            "properties": {"units": {"type": "string"}, "hours": {"type": "integer"}},
            "required": ["units", "hours"],
        },
    },
}


@pytest.mark.parametrize(
    ("schema", "others"),
    [(WEATHER, [("get_time", TIME)]), (WEATHER_WITH_EXTRAS, [])],
    ids=["another-tools-required-properties", "an-optional-objects-required-properties"],
)
async def test_a_forced_call_that_fits_its_budget_is_not_closed_for_names_it_never_needs(
    api: API, openai_spec: OpenAISpec, schema: dict[str, Any], others: list[tuple[str, dict[str, Any]]]
) -> None:
    # Closing counted every name any part of the call's schema requires, and began a dozen tokens early.
    body = chat_body(0, stream=False, choice="required", schema=schema, max_tokens=32, temperature=0)
    body["tools"] += [{"type": "function", "function": {"name": name, "parameters": p}} for name, p in others]

    function, _, finish_reason = await chat_call(api, openai_spec, body)

    assert (function["name"], json.loads(function["arguments"]), finish_reason) == (
        "get_weather",
        {"city": "Eugene"},
        "tool_calls",
    )


@pytest.mark.parametrize("stop", ['"', ":", "city", "{"])
async def test_a_stop_sequence_never_cuts_a_forced_call(api: API, openai_spec: OpenAISpec, stop: str) -> None:
    body = chat_body(0, stream=False, choice="required", max_tokens=40, stop=stop)

    function, text, finish_reason = await chat_call(api, openai_spec, body)

    jsonschema.validate(json.loads(function["arguments"]), WEATHER)
    assert finish_reason == "tool_calls"


async def test_a_stop_sequence_never_cuts_json_schema_output(api: API, openai_spec: OpenAISpec) -> None:
    # A bounded name, so that the whole answer fits the budget whatever city the sampler picks.
    schema = {**WEATHER, "properties": {"city": {"type": "string", "maxLength": 16}}}
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": QUESTION}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "weather", "strict": True, "schema": schema},
        },
        "stop": ['"', "}"],
        "max_tokens": 40,
        "seed": 0,
    }

    response = await api.post("/v1/infer/chat/completions", body)

    assert response.status_code == 200, response.content
    choice = response.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    assert choice["finish_reason"] == "stop"


def responses_body(seed: int, *, stream: bool, choice: Any) -> dict[str, Any]:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": WEATHER,
    }
    # Responses takes no seed: temperature and the sampler's own draws differ from run to run instead.
    return {
        "model": MODEL_ID,
        "input": QUESTION,
        "tools": [tool],
        "tool_choice": choice,
        "stream": stream,
        "temperature": 0.7 + seed / 10,
        "max_output_tokens": CALL_BUDGET,
    }


async def responses_output(api: API, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await api.post("/v1/infer/responses", body)
    assert response.status_code == 200, response.content
    if not body["stream"]:
        return response.json()["output"]
    events = [json.loads(item) for item in sse_data(await read_stream(response))]
    return events[-1]["response"]["output"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}], ids=["required", "named"])
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_forced_responses_tool_call_is_a_valid_function_call_item(
    api: API, seed: int, stream: bool, choice: Any
) -> None:
    output = await responses_output(api, responses_body(seed, stream=stream, choice=choice))

    assert [item["type"] for item in output] == ["function_call"]
    assert output[0]["name"] == "get_weather"
    jsonschema.validate(json.loads(output[0]["arguments"]), WEATHER)


async def test_a_forced_responses_call_streams_its_arguments_in_pieces_that_add_up_to_the_call(
    api: API, openai_spec: OpenAISpec
) -> None:
    response = await api.post("/v1/infer/responses", responses_body(0, stream=True, choice="required"))
    events = [json.loads(item) for item in sse_data(await read_stream(response))]

    kinds = [event["type"] for event in events]
    added, done = kinds.index("response.output_item.added"), kinds.index("response.function_call_arguments.done")
    deltas = [event["delta"] for event in events if event["type"] == "response.function_call_arguments.delta"]
    assert events[added]["item"]["arguments"] == "" and events[added]["item"]["status"] == "in_progress"
    assert len(deltas) > 1 and added < kinds.index("response.function_call_arguments.delta") < done
    assert "".join(deltas) == events[done]["arguments"] == events[-1]["response"]["output"][0]["arguments"]
    jsonschema.validate(json.loads(events[done]["arguments"]), WEATHER)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("seed", SEEDS)
async def test_a_forced_call_its_budget_cannot_hold_comes_back_as_a_call_cut_short(
    api: API, openai_spec: OpenAISpec, seed: int, stream: bool
) -> None:
    body = chat_body(seed, stream=stream, choice="required", schema=CHOICES, max_tokens=6)

    function, text, finish_reason = await chat_call(api, openai_spec, body)

    # As OpenAI cuts a call: the function's name, the arguments as far as they got, and "length".
    assert function["name"] == "get_weather"
    with pytest.raises(ValueError):
        json.loads(function["arguments"])
    assert text is None
    assert finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_call_cut_before_it_names_one_of_several_functions_is_no_call_and_no_text(
    api: API, openai_spec: OpenAISpec, stream: bool
) -> None:
    body = chat_body(0, stream=stream, choice="required", max_tokens=2)
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
    body["tools"].append(other)

    response = await api.post("/v1/infer/chat/completions", body)

    assert response.status_code == 200, response.content
    if stream:
        chunks = [json.loads(item) for item in sse_data(await read_stream(response))[:-1]]
        for chunk in chunks:
            openai_spec.validate("CreateChatCompletionStreamResponse", chunk)
        deltas = [chunk["choices"][0]["delta"] for chunk in chunks if chunk["choices"]]
        assert not any(delta.get("content") or delta.get("tool_calls") for delta in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    else:
        openai_spec.validate("CreateChatCompletionResponse", response.json())
        choice = response.json()["choices"][0]
        assert not choice["message"]["content"] and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_responses_call_its_budget_cannot_hold_is_an_incomplete_function_call_item(
    api: API, openai_spec: OpenAISpec, stream: bool
) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": CHOICES}
    body = {"model": MODEL_ID, "input": QUESTION, "tools": [tool], "stream": stream, "max_output_tokens": 16}
    body["tool_choice"] = {"type": "function", "name": "get_weather"}

    response = await api.post("/v1/infer/responses", body)

    assert response.status_code == 200, response.content
    if stream:
        events = [json.loads(item) for item in sse_data(await read_stream(response))]
        assert events[-1]["type"] == "response.incomplete"
        data = events[-1]["response"]
    else:
        data = response.json()
    openai_spec.validate("Response", data)
    assert data["status"] == "incomplete" and data["incomplete_details"] == {"reason": "max_output_tokens"}
    [call] = data["output"]
    assert call["type"] == "function_call" and call["status"] == "incomplete" and call["name"] == "get_weather"

    # The call goes back as history like any other, with its arguments as far as they got.
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "Nothing to ask."}
    again = await api.post("/v1/infer/responses", {"model": MODEL_ID, "input": [call, answer], "max_output_tokens": 16})
    assert again.status_code == 200, again.content


async def greedy_call(api: API, spec: OpenAISpec, max_tokens: int | None = None) -> tuple[dict[str, Any], str, int]:
    """The forced call of ``get_weather`` greedy decoding writes, its finish reason and its tokens."""
    body = chat_body(0, stream=False, choice="required", temperature=0)
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    function, _, finish_reason = await chat_call(api, spec, body)
    response = await api.post("/v1/infer/chat/completions", body)
    return function, finish_reason, response.json()["usage"]["completion_tokens"]


async def test_a_forced_call_that_fits_its_budget_with_a_few_tokens_to_spare_is_written_whole(
    api: API, openai_spec: OpenAISpec
) -> None:
    unbounded, _, tokens = await greedy_call(api, openai_spec)

    function, finish_reason, _ = await greedy_call(api, openai_spec, max_tokens=tokens + 8)

    assert json.loads(function["arguments"]) == json.loads(unbounded["arguments"])
    assert finish_reason == "tool_calls"


async def test_a_forced_call_its_budget_began_closing_is_whole_when_the_model_wrote_it_so_anyway(
    api: API, openai_spec: OpenAISpec
) -> None:
    # A tool without parameters: the model writes {} whatever the budget, in few tokens.
    body = chat_body(0, stream=False, choice="required", temperature=0)
    body["tools"] = [{"type": "function", "function": {"name": "get_weather"}}]
    unbounded, _, _ = await chat_call(api, openai_spec, body)
    tokens = (await api.post("/v1/infer/chat/completions", body)).json()["usage"]["completion_tokens"]

    # Closing begins a few tokens before the budget runs out, here before the call is written.
    function, _, finish_reason = await chat_call(api, openai_spec, {**body, "max_tokens": tokens + 1})

    # The same call; its spacing may differ, as greedy output can between a prompt prefilled whole and one mostly
    # reused from an earlier job.
    assert json.loads(function["arguments"]) == json.loads(unbounded["arguments"]) == {}
    assert finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_forced_call_closed_early_by_its_budget_says_length_and_is_an_incomplete_item(
    api: API, openai_spec: OpenAISpec, stream: bool
) -> None:
    unbounded, _, tokens = await greedy_call(api, openai_spec)

    function, finish_reason, _ = await greedy_call(api, openai_spec, max_tokens=tokens - 3)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    body = {"model": MODEL_ID, "input": QUESTION, "tools": [tool], "tool_choice": "required", "temperature": 0}
    output = await responses_output(api, {**body, "stream": stream, "max_output_tokens": max(16, tokens - 3)})

    # Whole JSON, so that it can go back as history, but not the call the model meant: the budget ended it.
    jsonschema.validate(json.loads(function["arguments"]), WEATHER)
    assert function["arguments"] != unbounded["arguments"]
    assert finish_reason == "length"
    [call] = output
    assert call["type"] == "function_call" and call["status"] == "incomplete"
