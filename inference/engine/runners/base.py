"""The runner contract: a generation job in, a stream of events out.

Runners know nothing of HTTP or of OpenAI's wire shapes. A job carries a prompt already rendered
with the model's chat template (so the API process can count its tokens before admission), the
sampling parameters and an optional output constraint; a runner yields raw text, and the shared
decoding layer (``inference.engine.decoding``) turns that text into tool calls and reasoning for every
runner alike.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

FinishReason = Literal["stop", "length", "cancelled"]

# The Hermes tool-call block: what a ``tool_calls`` constraint lets a model write, and what decoding reads back.
TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match, enforced by grammar-constrained decoding.

    ``json_schema``: the whole output is one JSON value matching ``schema``.
    ``json_object``: the whole output is one JSON object.
    ``tool_calls``: free text, or one or more ``<tool_call>\n{call}\n</tool_call>`` blocks (the Hermes
    format, see ``inference.engine.decoding``) whose ``{call}`` matches ``schema``.
    """

    kind: Literal["json_schema", "json_object", "tool_calls"]
    schema: dict[str, Any] | None = None
    # The output must be whole JSON even when the token budget runs out first (a forced tool call): as
    # the budget nears its end, decoding takes the shortest way to close the value, and the job finishes
    # with reason ``length``. Runners without this ability may cut the value short.
    close_before_limit: bool = False


@dataclass(frozen=True, slots=True)
class GenerationJob:
    job_id: str
    model_id: str
    runner: str
    runner_settings: dict[str, Any]
    prompt: str
    prompt_tokens: int
    sampling: Sampling
    constraint: Constraint | None = None
    # Spans of ``prompt`` (character offsets) that the request wrote and that spell one of the model's special
    # tokens (``<|im_end|>``): they are read as text, never as the token, so that no message can close its own
    # turn and open another. What the chat template wrote is read with its special tokens.
    literal: tuple[tuple[int, int], ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationJob:
        sampling = dict(data["sampling"])
        sampling["stop"] = tuple(sampling.get("stop") or ())
        constraint = data.get("constraint")
        return cls(
            **{
                **data,
                "sampling": Sampling(**sampling),
                "constraint": Constraint(**constraint) if constraint else None,
                "literal": tuple((start, end) for start, end in data.get("literal") or ()),
            }
        )


def prompt_pieces(prompt: str, literal: tuple[tuple[int, int], ...]) -> Iterator[tuple[str, bool]]:
    """``prompt`` in order as pieces of text, each with whether it is to be read as text only (its special
    tokens spelled out) rather than with special tokens."""
    at = 0
    for start, end in literal:
        if at < start:
            yield prompt[at:start], False
        yield prompt[start:end], True
        at = end
    if at < len(prompt):
        yield prompt[at:], False


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A generated token's logprob and the likeliest alternatives. Tokens are bytes: one can be a piece of a
    character, which no string can hold (the API layer names such a piece)."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass(frozen=True, slots=True)
class TextChunk:
    """Raw generated text, possibly several tokens at once."""

    text: str
    tokens: int = 1
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


RawEvent = TextChunk | Finished


class RunnerError(Exception):
    """Generation failed inside the runner; ``code`` is a stable machine-readable reason."""

    def __init__(self, message: str, *, code: str = "generation_failed") -> None:
        super().__init__(message)
        self.code = code


# JSON Schema keywords whose value maps names to subschemas (there, a key called "pattern" or "$ref" is a
# property's name), and keywords whose value is data, not a schema (left exactly as written).
SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
SCHEMA_DATA = frozenset({"const", "enum", "default", "examples"})


def schema_at(root: Any, ref: str) -> Any:
    """The subschema a local ``$ref`` (``#``, ``#/$defs/Name``: a JSON pointer in a URI fragment) points at, or
    None."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node = root
    for part in urllib.parse.unquote(ref[2:]).split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            return None
    return node


def _any_schema(schema: dict[str, Any]) -> str | None:
    return None


def _no_floor(text: str) -> int:
    return 0


@dataclass(slots=True)
class PromptRenderer:
    """Renders chat messages with a model's template and counts tokens, in the API process."""

    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], str]
    # A rendered prompt's tokens, its literal spans (``GenerationJob.literal``) read as text only.
    count_tokens: Callable[[str, tuple[tuple[int, int], ...]], int]
    # A lower bound on ``count_tokens(text)``, in linear time: a prompt that plainly cannot fit is refused before
    # counting it, which can cost more (llama.cpp's tokenizer slows with the square of the special tokens).
    least_tokens: Callable[[str], int] = _no_floor
    # Whether ``render`` places the tool definitions itself (the template knows tools); when false
    # the decoding layer describes them in the system message.
    native_tools: bool = False
    # Why the runner cannot enforce a JSON schema (features its grammar engine lacks), or None.
    schema_problem: Callable[[dict[str, Any]], str | None] = _any_schema
    # How many alternatives per token the model can return with logprobs (OpenAI allows up to 20).
    max_top_logprobs: int = 20
    # The text of the tokenizer's special tokens, longest first: where a request writes one, it is text.
    special_tokens: tuple[str, ...] = ()


class Runner(Protocol):
    """A loaded model. ``stream`` yields ``TextChunk``s then exactly one ``Finished``.

    ``cancelled`` is polled between tokens; once it returns true the runner stops and finishes with
    reason ``cancelled``. Failures raise ``RunnerError``.
    """

    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]: ...
