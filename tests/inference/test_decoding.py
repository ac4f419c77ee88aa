"""Reading a model's text back: a tool call the model chose on its own (``tool_choice: auto``), split anywhere."""

from __future__ import annotations

import json

import pytest

from inference.engine.decoding import FunctionTool, StreamDecoder, TextPiece, ToolCallPiece, plan_decoding

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


def test_a_call_to_a_tool_that_was_not_offered_stays_text() -> None:
    text = CALL.replace("get_weather", "get_stock_price")

    assert decode(text, split=5) == [TextPiece(text)]


def test_without_parallel_tool_calls_only_the_first_call_counts() -> None:
    pieces = decode(CALL + "\n" + CALL, split=0, parallel=False)

    assert [type(p) for p in pieces] == [ToolCallPiece, TextPiece]
