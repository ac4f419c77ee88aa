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
from typing import Any, Literal, Protocol, runtime_checkable

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
    # ``tool_calls`` only: what a text answer must be instead of free text, one JSON value matching this schema (an
    # output format asked for beside tools that may be called).
    text_schema: dict[str, Any] | None = None

    @property
    def free_text(self) -> bool:
        """Whether the output may be text of any kind (calls aside), which a stop sequence may cut as it would
        unconstrained text; output that must be whole JSON ends where its grammar ends it."""
        return self.kind == "tool_calls" and self.text_schema is None

    # The output must be whole JSON even when the token budget runs out first (a forced tool call): as
    # the budget nears its end, decoding takes the shortest way to close the value, and the job finishes
    # with reason ``length``. Runners without this ability may cut the value short.
    close_before_limit: bool = False


@dataclass(slots=True)
class JsonScan:
    """Where a JSON text stands as it is read a character at a time: inside a string (just after a backslash in
    one), and how many objects and arrays are open."""

    in_string: bool = False
    escaped: bool = False
    depth: int = 0

    def read(self, char: str) -> int:
        """Reads one character: 1 if it opens an object or an array, -1 if it closes one, else 0."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
            return 0
        if char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
            return 1
        elif char in "}]":
            self.depth -= 1
            return -1
        return 0


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
    """Raw generated text, possibly several tokens at once, and how many of the prompt's tokens the runner found
    cached (told with every chunk, so that a job ended before its ``Finished`` still counts them)."""

    text: str
    tokens: int = 1
    logprobs: tuple[TokenLogprob, ...] = ()
    cached_tokens: int = 0


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


def rebased(schema: Any, where: str, *, in_map: bool = False) -> Any:
    """``schema`` with its local ``$ref``s (``#``, ``#/$defs/…``, ``#/properties/…``) pointing at the same places
    once the schema sits at ``where``, a JSON pointer fragment into an enclosing schema."""
    if isinstance(schema, list):
        return [rebased(item, where) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if in_map:
            out[key] = rebased(value, where)
        elif key in SCHEMA_DATA:
            out[key] = value
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = where + value[1:]
        else:
            out[key] = rebased(value, where, in_map=key in SCHEMA_MAPS)
    return out


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


# What a ``format`` cannot stand beside: each runner's grammar reads one of them and leaves the other out (a pattern
# or a format, never both; a format's string of any length; an enum, a $ref or a union and no format).
_FORMAT_ALONE = ("pattern", "minLength", "maxLength", "const", "enum", "$ref", "anyOf", "oneOf", "allOf")
# The most oneOf branches told apart pair by pair: past it, a oneOf is taken as overlapping.
_ONE_OF_MOST = 128
# How many bare $refs are followed, one to the next, to find what a oneOf branch is.
_REF_HOPS = 8


def keyword_problem(schema: Any, *, formats: frozenset[str]) -> str | None:
    """What in ``schema`` the runners' grammars leave out or read more loosely than JSON Schema means it, so that
    output breaking it would pass as valid: a ``not``, a string ``format`` other than ``formats`` (those the runner's
    grammar enforces) or beside what the grammar would leave out for it, a ``oneOf`` whose branches may overlap (a
    grammar lets a value match any number of them, as ``anyOf`` does). The 400's reason, or None."""
    kinds: dict[int, frozenset[str] | None] = {}  # each subschema's types, found once (``_kinds``)
    for node in subschemas(schema):
        if problem := _node_problem(node, schema, formats, kinds):
            return problem
    return None


def subschemas(schema: Any) -> Iterator[dict[str, Any]]:
    """Every subschema of ``schema`` (not the data under const, enum, default, examples, nor a map of them such as
    ``properties`` itself), walked without recursion: a schema's depth is the client's to choose."""
    stack: list[tuple[Any, bool]] = [(schema, False)]
    while stack:
        node, in_map = stack.pop()
        if isinstance(node, list):
            stack.extend((item, False) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if not in_map:
            yield node
        for key, value in node.items():
            if in_map:
                stack.append((value, False))
            elif key not in SCHEMA_DATA and isinstance(value, dict | list):
                stack.append((value, key in SCHEMA_MAPS))


def _node_problem(
    node: dict[str, Any], root: Any, formats: frozenset[str], kinds: dict[int, frozenset[str] | None]
) -> str | None:
    if "not" in node:
        return "its 'not' cannot be enforced by this model's grammar"
    if isinstance(fmt := node.get("format"), str):
        kind = node.get("type")
        if kind is None:
            return "its 'format' can be enforced by this model's grammar where the type is 'string'"
        if kind == "string" or (isinstance(kind, list) and "string" in kind):
            if fmt not in formats:
                return (
                    f"its 'format' of {fmt!r} cannot be enforced by this model's grammar "
                    f"(it enforces {', '.join(sorted(formats))})"
                )
            if beside := next((keyword for keyword in _FORMAT_ALONE if keyword in node), None):
                return f"its 'format' beside {beside!r} cannot be enforced by this model's grammar: write one of them"
    branches = node.get("oneOf")
    if isinstance(branches, list) and not _apart_all(branches, root, kinds):
        return (
            "its 'oneOf' cannot be enforced by this model's grammar where a value may match more than one of its "
            "branches: write 'anyOf', or tell the branches apart by type or by a required property's const or enum"
        )
    return None


@dataclass(frozen=True, slots=True)
class _Branch:
    """What a oneOf branch is, as far as telling it from the others goes."""

    kinds: frozenset[str] | None  # its JSON types (None: any)
    values: frozenset[Any] | None  # the values its const or enum allows (None: not only those)
    # Its properties whose values a const or an enum lists: those values, and whether the property is required.
    tags: dict[str, tuple[frozenset[Any], bool]]


def _apart_all(branches: list[Any], root: Any, kinds: dict[int, frozenset[str] | None]) -> bool:
    """Whether no value can match two of ``branches``, shown by cheap checks on each pair: types that share no value
    (an integer is a number), consts or enums that share none, or a property whose consts or enums share none,
    required by one of the two and one of them an object's only."""
    if len(branches) > _ONE_OF_MOST:
        return False
    known = [_branch(branch, root, kinds) for branch in branches]
    return all(_apart(known[i], known[j]) for i in range(len(known)) for j in range(i + 1, len(known)))


def _apart(one: _Branch, other: _Branch) -> bool:
    if one.kinds is not None and other.kinds is not None and not _overlap(one.kinds, other.kinds):
        return True
    if one.values is not None and other.values is not None and one.values.isdisjoint(other.values):
        return True
    if not (one.kinds == {"object"} or other.kinds == {"object"}):  # a value of both is an object: its properties hold
        return False
    for name in one.tags.keys() & other.tags.keys():
        (values, required), (other_values, other_required) = one.tags[name], other.tags[name]
        if (required or other_required) and values.isdisjoint(other_values):
            return True
    return False


def _overlap(kinds: frozenset[str], others: frozenset[str]) -> bool:
    numbers = {"integer", "number"}
    return bool(kinds & others) or bool(kinds & numbers and others & numbers)


def _branch(schema: Any, root: Any, kinds: dict[int, frozenset[str] | None]) -> _Branch:
    target = _target(schema, root)
    tags: dict[str, tuple[frozenset[Any], bool]] = {}
    properties = target.get("properties") if isinstance(target, dict) else None
    if isinstance(properties, dict):
        required = target.get("required")
        for name, property_schema in properties.items():
            if (values := _values(_target(property_schema, root))) is not None:
                tags[name] = (values, isinstance(required, list) and name in required)
    return _Branch(_kinds(schema, root, kinds), _values(target), tags)


def _target(schema: Any, root: Any) -> Any:
    """The schema a chain of bare ``$ref``s leads to (``schema`` itself when it is more than a ``$ref``)."""
    for _ in range(_REF_HOPS):
        if not (isinstance(schema, dict) and isinstance(ref := schema.get("$ref"), str)):
            break
        if schema.keys() - {"$ref", "title", "description"}:
            break
        schema = schema_at(root, ref)
    return schema


def _kinds(schema: Any, root: Any, found: dict[int, frozenset[str] | None]) -> frozenset[str] | None:
    """The JSON types a value of ``schema`` may have, or None when they are not plain; ``found`` holds those of the
    subschemas seen so far, each looked at once (one being looked at, met again through a $ref, is None)."""
    if not isinstance(schema, dict):
        return None
    if id(schema) not in found:
        found[id(schema)] = None
        found[id(schema)] = _own_kinds(schema, root, found)
    return found[id(schema)]


def _own_kinds(schema: dict[str, Any], root: Any, found: dict[int, frozenset[str] | None]) -> frozenset[str] | None:
    kind = schema.get("type")
    if isinstance(kind, str):
        return frozenset({kind})
    if isinstance(kind, list) and all(isinstance(one, str) for one in kind):
        return frozenset(kind)
    if "const" in schema:
        return frozenset({_json_type(schema["const"])})
    if isinstance(values := schema.get("enum"), list):
        return frozenset(_json_type(value) for value in values)
    if isinstance(ref := schema.get("$ref"), str):
        return _kinds(schema_at(root, ref), root, found)
    union = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(union, list) and union:
        kinds: set[str] = set()
        for member in union:
            if (member_kinds := _kinds(member, root, found)) is None:
                return None
            kinds |= member_kinds
        return frozenset(kinds)
    return None


def _values(schema: Any) -> frozenset[Any] | None:
    """The values a ``const`` or an ``enum`` allows, comparable as JSON Schema compares them (1 is 1.0)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return frozenset({_frozen(schema["const"])})
    if isinstance(values := schema.get("enum"), list):
        return frozenset(_frozen(value) for value in values)
    return None


def _frozen(value: Any) -> Any:
    """A JSON value as a hashable one, equal where the values are (``True`` equals ``1`` too: never taken apart)."""
    if isinstance(value, dict):
        return frozenset((key, _frozen(item)) for key, item in value.items())
    if isinstance(value, list):
        return tuple(_frozen(item) for item in value)
    return value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


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
    # Whether the runner applies frequency and presence penalties (else a request that sets one is refused).
    penalties: bool = True


Delivery = Callable[[RawEvent | RunnerError], None]


@runtime_checkable
class PushingRunner(Protocol):
    """A runner whose own thread hands each of a job's events to ``deliver`` as it comes, the last a ``Finished``
    or a ``RunnerError``: no thread of the caller's waits on the job. ``start`` refuses a job as ``stream`` does."""

    def start(self, job: GenerationJob, cancelled: Callable[[], bool], deliver: Delivery) -> object: ...


class Runner(Protocol):
    """A loaded model. ``stream`` yields ``TextChunk``s then exactly one ``Finished``.

    ``cancelled`` is polled between tokens; once it returns true the runner stops and finishes with
    reason ``cancelled``. Failures raise ``RunnerError``.
    """

    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]: ...

    def close(self) -> None:
        """Ends the jobs still running and frees what the model holds; the runner takes no job after it."""
        ...
