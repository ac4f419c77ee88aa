"""A runner's text read back into pieces, each token's logprobs beside the pieces it belongs to."""

from __future__ import annotations

from typing import Any

from inference.engine.decoding import DecodePlan, ReasoningPiece, StreamDecoder, TextPiece
from inference.engine.generation import Logprobs, _read
from inference.engine.runners.base import TextChunk, TokenLogprob

# A reasoning model's tokens as Qwen's and DeepSeek's write them: the tags tokens of their own, between line breaks.
TOKENS = ["<think>", "\n", "The user wants a river.", "\n", "</think>", "\n\n", "The", " Willamette."]


def read(chunks: list[list[str]]) -> tuple[str, str, list[str]]:
    """The reasoning, the answer, and the tokens the answer's logprobs are of."""
    decoder = StreamDecoder(DecodePlan(reasoning=True))
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
