"""A runner's text read back into pieces, each token's logprobs beside the pieces it belongs to."""

from __future__ import annotations

from typing import Any

import pytest

from inference.engine import generation
from inference.engine.decoding import (
    DecodePlan,
    FunctionTool,
    ReasoningPiece,
    StreamDecoder,
    TextPiece,
    ToolCallPiece,
    plan_decoding,
)
from inference.engine.exceptions import NotStarted
from inference.engine.generation import GenerationRequest, Logprobs, _read
from inference.engine.runners.base import TextChunk, TokenLogprob
from inference.models import CatalogEntry
from tests.conftest import DEFAULT_MODEL

# A reasoning model's tokens as Qwen's and DeepSeek's write them: the tags tokens of their own, between line breaks.
TOKENS = ["<think>", "\n", "The user wants a river.", "\n", "</think>", "\n\n", "The", " Willamette."]


def read(chunks: list[list[str]], plan: DecodePlan | None = None) -> tuple[str, str, list[str]]:
    """The reasoning, the answer, and the tokens the answer's logprobs are of."""
    decoder = StreamDecoder(plan or DecodePlan(reasoning=True))
    events: list[Any] = []
    for tokens in chunks:
        logprobs = tuple(TokenLogprob(token.encode(), -0.5) for token in tokens)
        events += _read(decoder, TextChunk("".join(tokens), len(tokens), logprobs))
    events += decoder.finish()
    reasoning, answer = "", ""
    of_answer: list[str] = []
    pending: list[str] = []
    for event in events:  # as the APIs read them: logprobs go with the answer's text that comes next
        if isinstance(event, Logprobs):
            pending += [item.token.decode() for item in event.items]
        elif isinstance(event, ReasoningPiece):
            reasoning, pending = reasoning + event.text, []
        elif isinstance(event, TextPiece):
            answer, of_answer, pending = answer + event.text, of_answer + pending, []
    return reasoning, answer, of_answer


def test_the_answers_logprobs_leave_out_the_reasoning_and_its_tags_however_the_tokens_arrive() -> None:
    for chunks in ([[token] for token in TOKENS], [TOKENS], [TOKENS[:5], TOKENS[5:]]):
        reasoning, answer, logprobs = read(chunks)

        assert reasoning.strip() == "The user wants a river."
        assert answer == "The Willamette."
        assert "".join(logprobs).lstrip() == answer and "</think>" not in logprobs


WEATHER = FunctionTool("get_weather", None, {"type": "object"}, None)
# A call, one the request does not allow (of a function it did not offer), the whitespace after each, and text.
CALLS = [
    "Sure.", " ", "<tool_call>", '\n{"name": "get_weather", "arguments": {}}\n', "</tool_call>", "\n", "\n",
    "<tool_call>", '\n{"name": "get_time", "arguments": {}}\n', "</tool_call>", "\n\n", "Done", " now.",
]  # fmt: skip


def test_the_answers_logprobs_leave_out_every_calls_tokens_and_the_whitespace_after_them() -> None:
    plan = plan_decoding(tools=(WEATHER,), tool_choice="auto", parallel_tool_calls=True, reasoning=False)
    for chunks in ([[token] for token in CALLS], [CALLS], [CALLS[:6], CALLS[6:]]):
        _, answer, logprobs = read(chunks, plan)

        # The same text however the tokens arrive, each of its tokens' logprobs and nothing else.
        assert answer == "Sure. Done now."
        assert logprobs == ["Sure.", " ", "Done", " now."]


def test_a_call_the_request_allows_is_read_back_beside_the_answer() -> None:
    plan = plan_decoding(tools=(WEATHER,), tool_choice="auto", parallel_tool_calls=True, reasoning=False)
    decoder = StreamDecoder(plan)
    pieces = [piece for token in CALLS for piece in decoder.feed(token)] + decoder.finish()

    assert [piece.name for piece in pieces if isinstance(piece, ToolCallPiece)] == ["get_weather"]


async def test_once_the_server_refuses_new_generations_one_is_refused_before_it_starts_until_accepted_again() -> None:
    entry = CatalogEntry(**DEFAULT_MODEL)
    request = GenerationRequest(messages=[{"role": "user", "content": "Hello"}], max_output_tokens=2)
    generation.refuse_new()
    try:
        refused = await generation.prepare(entry=entry, request=request)
        with pytest.raises(NotStarted) as error:
            await refused.start()
        assert (error.value.code, error.value.retry_after) == ("server_shutting_down", 2)
    finally:
        generation.refuse_new(None)

    accepted = await generation.prepare(entry=entry, request=request)
    await accepted.start()
    assert accepted.accepted
