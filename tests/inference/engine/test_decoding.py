"""Reading a model's text back: a tool call the model chose on its own (``tool_choice: auto``), split anywhere."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from inference.engine.decoding import (
    ForcedFunction,
    FunctionTool,
    StreamDecoder,
    TextPiece,
    ToolCallDelta,
    ToolCallPiece,
    ToolCallStart,
    ToolChoice,
    plan_decoding,
)

WEATHER = FunctionTool("get_weather", "Current weather for a city.", {"type": "object"}, None)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Eugene"}}\n</tool_call>'
OUTPUT = "Let me check. " + CALL


def decode(text: str, *, split: int, parallel: bool = True) -> list[TextPiece | ToolCallPiece]:
    plan = plan_decoding(tools=(WEATHER,), tool_choice="auto", parallel_tool_calls=parallel, reasoning=False)
    decoder = StreamDecoder(plan)
    pieces = decoder.feed(text[:split]) + decoder.feed(text[split:]) + decoder.finish()
    return pieces  # type: ignore[return-value]


@pytest.mark.parametrize("split", range(len(OUTPUT) + 1))
def test_a_tool_call_in_auto_mode_is_read_back_wherever_the_stream_splits_it(split: int) -> None:
    pieces = decode(OUTPUT, split=split)

    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Let me check. "
    [call] = [p for p in pieces if isinstance(p, ToolCallPiece)]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Eugene"})


def test_a_call_the_model_writes_freely_is_sent_whole_once_it_is_known_to_be_one() -> None:
    pieces = decode(OUTPUT, split=len(OUTPUT) // 2)

    assert not any(isinstance(p, ToolCallStart | ToolCallDelta) for p in pieces)


# A call as a grammar writes it; its arguments hold what would end them were it not for the string they are in.
ARGUMENTS = '{"city": "Eu}ge\\"ne{[", "days": [1, {"x": []}]}'
STRICT_WEATHER = FunctionTool("get_weather", None, {"type": "object"}, True)


def streamed(plan_tools: tuple[FunctionTool, ...], tool_choice: ToolChoice, output: str, step: int) -> list[Any]:
    plan = plan_decoding(tools=plan_tools, tool_choice=tool_choice, parallel_tool_calls=True, reasoning=False)
    decoder = StreamDecoder(plan)
    pieces: list[Any] = []
    for at in range(0, len(output), step):
        pieces += decoder.feed(output[at : at + step])
    return pieces + decoder.finish()


def assert_streamed_call(pieces: list[Any], name: str, arguments: str) -> None:
    calls = [p for p in pieces if isinstance(p, ToolCallStart | ToolCallDelta | ToolCallPiece)]
    start, *deltas, whole = calls
    assert isinstance(start, ToolCallStart) and start.name == name
    assert all(isinstance(d, ToolCallDelta) and d.index == start.index and d.arguments for d in deltas)
    assert "".join(d.arguments for d in deltas) == arguments
    assert isinstance(whole, ToolCallPiece) and whole.complete
    assert (whole.index, whole.call_id, whole.name, whole.arguments) == (start.index, start.call_id, name, arguments)


@pytest.mark.parametrize("step", [1, 2, 3, 7, 1000])
def test_a_forced_call_streams_its_arguments_as_they_come(step: int) -> None:
    output = '{"name": "get_weather", "arguments": ' + ARGUMENTS + "}"

    pieces = streamed((WEATHER, STOCKS), "required", output, step)

    assert_streamed_call(pieces, "get_weather", ARGUMENTS)
    if step == 1:  # nothing is held back once the arguments begin
        assert len([p for p in pieces if isinstance(p, ToolCallDelta)]) == len(ARGUMENTS)


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_beside_a_strict_tool_streams_its_arguments_between_the_answers_text(step: int) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": ' + ARGUMENTS + "}\n</tool_call>"

    pieces = streamed((STRICT_WEATHER,), "auto", "Let me check. " + call + "\n" + call, step)

    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Let me check. "
    first = pieces.index(next(p for p in pieces if isinstance(p, ToolCallPiece)))
    assert_streamed_call(pieces[: first + 1], "get_weather", ARGUMENTS)
    assert_streamed_call(pieces[first + 1 :], "get_weather", ARGUMENTS)
    assert [p.index for p in pieces if isinstance(p, ToolCallPiece)] == [0, 1]


def test_a_streamed_call_the_budget_cut_short_ends_incomplete_with_what_was_sent() -> None:
    plan = plan_decoding(tools=(WEATHER,), tool_choice="required", parallel_tool_calls=True, reasoning=False)
    decoder = StreamDecoder(plan)

    pieces = decoder.feed('{"name": "get_weather", "arguments": {"city": "Eu') + decoder.finish(ran_out=True)

    *_, whole = pieces
    sent = "".join(p.arguments for p in pieces if isinstance(p, ToolCallDelta))
    assert isinstance(whole, ToolCallPiece) and not whole.complete and decoder.cut_call
    assert whole.arguments == sent == '{"city": "Eu'


@pytest.mark.parametrize("split", [0, 5, 40])
def test_a_call_to_a_tool_that_was_not_offered_is_left_out_never_sent_as_markup(split: int) -> None:
    text = "Checking. " + CALL.replace("get_weather", "get_stock_price") + " Done."

    pieces = decode(text, split=split)

    assert all(isinstance(p, TextPiece) for p in pieces)
    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == "Checking. Done."


def test_text_that_only_looks_like_a_call_stays_text() -> None:
    text = "<tool_call>\nnot a call\n</tool_call>"

    assert decode(text, split=3) == [TextPiece(text)]


def test_without_parallel_tool_calls_only_the_first_call_counts() -> None:
    pieces = decode(CALL + "\n" + CALL, split=0, parallel=False)

    assert [type(p) for p in pieces] == [ToolCallPiece]


@pytest.mark.parametrize("split", [0, len(CALL), len(CALL) + 9])
def test_without_parallel_tool_calls_nothing_written_after_the_first_call_is_sent_however_the_text_comes(
    split: int,
) -> None:
    # All of it in one piece of text (the consumer was busy while it came), or split around the call.
    pieces = decode(CALL + " and then " + CALL + " and some words after them", split=split, parallel=False)

    assert [type(p) for p in pieces] == [ToolCallPiece]


STOCKS = FunctionTool("get_stock_price", None, {"type": "object"}, None)


@pytest.mark.parametrize(
    ("output", "name", "arguments"),
    [
        ('{"name": "get_stock_price", "arguments": {"sym', "get_stock_price", '{"sym'),
        ('{"name": "get_stock_price", "argu', "get_stock_price", ""),
        ('{"na', None, None),
    ],
)
def test_a_required_call_the_budget_cut_short_is_a_call_of_the_function_it_names(
    output: str, name: str | None, arguments: str | None
) -> None:
    plan = plan_decoding(tools=(WEATHER, STOCKS), tool_choice="required", parallel_tool_calls=True, reasoning=False)
    decoder = StreamDecoder(plan)

    pieces = decoder.feed(output) + decoder.finish()

    if name is None:  # which of the two it was is not known: no call, and no answer either (it is not one)
        assert pieces == [] and not decoder.cut_call
    else:
        [call] = [piece for piece in pieces if isinstance(piece, ToolCallPiece)]
        assert isinstance(call, ToolCallPiece) and not call.complete and decoder.cut_call
        assert (call.name, call.arguments) == (name, arguments)


@pytest.mark.parametrize(
    ("output", "tools", "calls"),
    [
        ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Eu', (WEATHER, STOCKS), 1),
        ('<tool_call>\n{"name": "get_weather", "argu', (WEATHER, STOCKS), 1),
        ('<tool_call>\n{"na', (WEATHER,), 1),
        ('<tool_call>\n{"na', (WEATHER, STOCKS), 0),
        ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "', (WEATHER, STOCKS), 0),
    ],
    ids=["in-its-arguments", "before-its-arguments", "before-its-name", "before-which-of-two", "not-offered"],
)
def test_a_call_the_model_chose_that_the_budget_cut_short_is_a_call_as_far_as_it_got_never_markup(
    output: str, tools: tuple[FunctionTool, ...], calls: int
) -> None:
    plan = plan_decoding(tools=tools, tool_choice="auto", parallel_tool_calls=True, reasoning=False)
    decoder = StreamDecoder(plan)

    pieces = decoder.feed(output) + decoder.finish(ran_out=True)

    assert "".join(p.text for p in pieces if isinstance(p, TextPiece)) == output.partition("<tool_call>")[0]
    cut = [p for p in pieces if isinstance(p, ToolCallPiece)]
    assert len(cut) == calls and decoder.cut_call == bool(calls)
    if cut:
        arguments = output.partition('"arguments": ')[2]
        assert (cut[0].name, cut[0].arguments, cut[0].complete) == ("get_weather", arguments, False)


def test_a_call_the_model_chose_and_ended_unclosed_is_still_read_when_it_parses() -> None:
    decoder = StreamDecoder(
        plan_decoding(tools=(WEATHER,), tool_choice="auto", parallel_tool_calls=True, reasoning=False)
    )

    [call] = decoder.feed(CALL.removesuffix("\n</tool_call>")) + decoder.finish()

    assert isinstance(call, ToolCallPiece) and call.complete and json.loads(call.arguments) == {"city": "Eugene"}


def test_a_named_call_the_budget_cut_short_is_a_call_of_that_function_however_little_came() -> None:
    plan = plan_decoding(
        tools=(WEATHER, STOCKS), tool_choice=ForcedFunction("get_weather"), parallel_tool_calls=True, reasoning=False
    )
    decoder = StreamDecoder(plan)

    [call] = decoder.feed('{"') + decoder.finish()

    assert isinstance(call, ToolCallPiece) and (call.name, call.arguments, call.complete) == ("get_weather", "", False)


# --- the call schema: each tool's parameters, nested under ``arguments`` --------------------------------------

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
    "required": ["street", "city"],
    "additionalProperties": False,
}
# As ``openai.pydantic_function_tool`` writes a model with a nested one.
PERSON = FunctionTool(
    "Person",
    None,
    {
        "$defs": {"Address": ADDRESS},
        "type": "object",
        "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
        "required": ["name", "home"],
        "additionalProperties": False,
    },
    True,
)
HOME = {"street": "1 Main St", "city": "Eugene"}


def call_schema(*tools: FunctionTool, tool_choice: ToolChoice = "required") -> jsonschema.Draft202012Validator:
    plan = plan_decoding(tools=tools, tool_choice=tool_choice, parallel_tool_calls=True, reasoning=False)
    assert plan.constraint is not None and plan.constraint.schema is not None
    return jsonschema.Draft202012Validator(plan.constraint.schema)


@pytest.mark.parametrize("tool_choice", ["required", ForcedFunction("Person"), "auto"])
def test_a_tools_local_refs_still_point_into_its_parameters_in_the_call_schema(tool_choice: ToolChoice) -> None:
    schema = call_schema(PERSON, WEATHER, tool_choice=tool_choice)

    assert schema.is_valid({"name": "Person", "arguments": {"name": "Ann", "home": HOME}})
    assert not schema.is_valid({"name": "Person", "arguments": {"name": "Ann", "home": {"street": "1 Main St"}}})


def test_two_tools_with_a_definition_of_the_same_name_each_keep_their_own() -> None:
    postcode = {"type": "object", "properties": {"zip": {"type": "string"}}, "required": ["zip"]}
    letter = FunctionTool(
        "Letter",
        None,
        {
            "definitions": {"Address": postcode},
            "type": "object",
            "properties": {"to": {"$ref": "#/definitions/Address"}},
        },
        True,
    )
    schema = call_schema(PERSON, letter)

    assert schema.is_valid({"name": "Letter", "arguments": {"to": {"zip": "97401"}}})
    assert not schema.is_valid({"name": "Letter", "arguments": {"to": HOME}})
    assert schema.is_valid({"name": "Person", "arguments": {"name": "Ann", "home": HOME}})


def test_a_ref_to_the_parameters_themselves_or_into_them_points_at_the_arguments() -> None:
    tree = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "child": {"$ref": "#"},
            "nickname": {"$ref": "#/properties/name"},
        },
        "required": ["name"],
    }
    schema = call_schema(FunctionTool("tree", None, tree, True))

    assert schema.is_valid({"name": "tree", "arguments": {"name": "a", "nickname": "b", "child": {"name": "c"}}})
    assert not schema.is_valid({"name": "tree", "arguments": {"name": "a", "child": {"nickname": "c"}}})
    assert not schema.is_valid({"name": "tree", "arguments": {"name": "a", "nickname": 1}})


def test_a_constant_that_holds_a_ref_is_data_and_left_as_written() -> None:
    constant = {"type": "object", "properties": {"link": {"const": {"$ref": "#/x"}}}, "required": ["link"]}
    schema = call_schema(FunctionTool("f", None, constant, True))

    assert schema.is_valid({"name": "f", "arguments": {"link": {"$ref": "#/x"}}})
