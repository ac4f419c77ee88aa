"""Tool calls and reasoning, shared by every runner.

Runners produce text. This layer decides what that text must look like (a ``Constraint`` for
grammar-constrained decoding) and turns the text back into OpenAI's pieces: answer text, reasoning,
tool calls. Tool calls use the Hermes format that templates with tool support emit::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Eugene"}}
    </tool_call>

and reasoning the ``<think>…</think>`` block of reasoning models.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.engine.runners.base import TOOL_CLOSE, TOOL_OPEN, Constraint, JsonScan, rebased, schema_at

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# The start of a forced call's JSON, ``{"name": "…", "arguments": …``, as far as a cut call got.
_CALL_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"')
_CALL_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')
# A call's JSON up to the object its arguments are, as a grammar writes it: from there they can stream.
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"(?P<name>[^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass(frozen=True, slots=True)
class ForcedFunction:
    """A tool choice that forces a call of this function."""

    name: str


ToolChoice = Literal["none", "auto", "required"] | ForcedFunction


@dataclass(frozen=True, slots=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    strict: bool | None

    def schema(self) -> dict[str, Any]:
        return self.parameters or {"type": "object", "properties": {}}

    def template_form(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name, "parameters": self.schema()}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """How a job's output is constrained and read back."""

    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    reasoning: bool = False
    constraint: Constraint | None = None

    @property
    def reads_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forced(self) -> bool:
        return self.reads_tool_calls and self.tool_choice != "auto"

    @property
    def calls_end_as(self) -> Literal["stop", "tool_calls"]:
        """The finish reason of an output that ends with its calls: OpenAI's chat gives ``stop`` for a call the
        request named (``tool_choice: {"type": "function", …}``) and ``tool_calls`` otherwise."""
        return "stop" if self.reads_tool_calls and isinstance(self.tool_choice, ForcedFunction) else "tool_calls"

    def enforced_schemas(self) -> list[tuple[str | None, dict[str, Any]]]:
        """The schemas the constraint enforces: ``(tool name, parameters)``, or ``(None, schema)`` for the output."""
        if self.constraint is None or self.constraint.kind == "json_object":
            return []
        if self.constraint.kind == "json_schema" and not self.forced:  # the output's format, tools or not
            return [(None, self.constraint.schema or {})]
        calls: list[tuple[str | None, dict[str, Any]]] = [
            (tool.name, tool.schema()) for tool in self.tools if self._enforces(tool)
        ]
        text = self.constraint.text_schema
        return [*calls, (None, text)] if text is not None else calls

    def _enforces(self, tool: FunctionTool) -> bool:
        if isinstance(self.tool_choice, ForcedFunction):
            return tool.name == self.tool_choice.name
        return self.tool_choice == "required" or (not self.forced and bool(tool.strict))


def _call_schema(tools: tuple[FunctionTool, ...], *, strict_only: bool) -> dict[str, Any]:
    """JSON schema of one call object ``{"name": …, "arguments": …}`` for the given tools.

    Each tool's parameters sit under ``arguments``, so its local ``$ref``s are rebased to point there: written
    against the parameters as the root, they would miss (or meet another tool's ``$defs`` of the same name).
    """
    options = []
    for index, tool in enumerate(tools):
        where = "#/properties/arguments" if len(tools) == 1 else f"#/anyOf/{index}/properties/arguments"
        arguments = rebased(tool.schema(), where) if (tool.strict or not strict_only) else {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": arguments},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def parameters_problem(schema: dict[str, Any]) -> str | None:
    """Why a function's parameters admit no JSON object, or None: a call's arguments are one, and parameters that are a
    ``$ref``, an ``anyOf`` or a ``oneOf`` of strings got a forced call of ``"text"`` for arguments, read back as a
    call cut short (``finish_reason: "length"`` with arguments no client can parse)."""
    known: dict[int, bool] = {}
    root = schema_at(schema, ref) if isinstance(ref := schema.get("$ref"), str) else schema
    branches = (root.get("anyOf") or root.get("oneOf") or []) if isinstance(root, dict) else []
    if _admits_object(schema, schema, known) and all(
        _admits_object(branch, schema, known) for branch in branches if isinstance(branches, list)
    ):
        return None
    return (
        'function parameters must be a JSON object (the arguments are one); its "$ref", "anyOf", "oneOf", '
        '"enum" or "const" admit other values: give the root "type": "object"'
    )


def _admits_object(node: Any, root: Any, known: dict[int, bool]) -> bool:
    """Whether a JSON object may be a value of ``node``, as far as its type, ``const``, ``enum`` and the subschemas
    it leads through say (whatever else holds it is left to the checks that build its grammar). Each subschema is
    judged once (``known``; one met again on its own way is taken to admit one), so that ``$ref``s that lead to the
    same places many ways cost no more than the schema's size."""
    if not isinstance(node, dict):
        return node is not False
    if id(node) in known:
        return known[id(node)]
    known[id(node)] = True
    kind = node.get("type")
    admits = not ((isinstance(kind, str) and kind != "object") or (isinstance(kind, list) and "object" not in kind))
    admits = admits and not ("const" in node and not isinstance(node["const"], dict))
    values = node.get("enum")
    admits = admits and not (isinstance(values, list) and not any(isinstance(value, dict) for value in values))
    if admits and isinstance(ref := node.get("$ref"), str) and (target := schema_at(root, ref)) is not None:
        admits = _admits_object(target, root, known)
    for keyword in ("anyOf", "oneOf"):
        branches = node.get(keyword)
        if admits and isinstance(branches, list):
            admits = any([_admits_object(branch, root, known) for branch in branches])
    parts = node.get("allOf")
    if admits and isinstance(parts, list):
        admits = all([_admits_object(part, root, known) for part in parts])
    known[id(node)] = admits
    return admits


def plan_decoding(
    *,
    tools: tuple[FunctionTool, ...],
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    reasoning: bool,
    response_format: Literal["text", "json_object", "json_schema"] = "text",
    json_schema: dict[str, Any] | None = None,
) -> DecodePlan:
    """Pick the constraint: forced tool calls, strict tools, and JSON output are decoded under a grammar. With strict
    tools the model may call, the output is a call or an answer in the asked format, each holding to its schema. With
    tools none of which is strict, a format asked for holds alone: their calls' arguments would be any object, which
    a small model fills until its budget runs out."""
    constraint: Constraint | None = None
    text_schema: dict[str, Any] | None = None
    if response_format == "json_schema":
        text_schema = json_schema or {}
    elif response_format == "json_object":
        text_schema = {"type": "object"}
    if tools and tool_choice not in ("none", "auto"):
        if isinstance(tool_choice, ForcedFunction):
            chosen = tuple(t for t in tools if t.name == tool_choice.name)
        else:
            chosen = tools
        constraint = Constraint(
            kind="json_schema", schema=_call_schema(chosen, strict_only=False), close_before_limit=True
        )
    elif tools and tool_choice == "auto" and any(t.strict for t in tools):
        calls = _call_schema(tools, strict_only=True)
        constraint = Constraint(kind="tool_calls", schema=calls, text_schema=text_schema)
    elif response_format == "json_schema":
        constraint = Constraint(kind="json_schema", schema=json_schema or {})
    elif response_format == "json_object":
        constraint = Constraint(kind="json_object")
    return DecodePlan(
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        reasoning=reasoning,
        constraint=constraint,
    )


def tool_system_prompt(tools: tuple[FunctionTool, ...]) -> str:
    """Describes the tools to a model whose chat template does not place them itself."""
    listing = "\n".join(json.dumps(tool.template_form(), ensure_ascii=False) for tool in tools)
    return (
        "You may call functions to help answer. The functions, as JSON schemas:\n"
        f"<tools>\n{listing}\n</tools>\n"
        "To call a function, reply with only this, one block per call:\n"
        f'{TOOL_OPEN}\n{{"name": "<function name>", "arguments": <arguments as a JSON object>}}\n{TOOL_CLOSE}'
    )


def parse_json(text: str) -> Any:
    """``text`` as JSON; ``ValueError`` where it is not, or where it nests deeper than Python's parser goes."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def format_tool_call(name: str, arguments: str) -> str:
    """A call as the model writes one. Arguments that are not JSON, or that decode to what no prompt can hold (a
    lone surrogate from a ``\\ud800`` escape), are written as the text they are."""
    try:
        call = json.dumps({"name": name, "arguments": parse_json(arguments) if arguments else {}}, ensure_ascii=False)
        call.encode()
    except (ValueError, RecursionError):  # UnicodeEncodeError is a ValueError
        call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{call}\n{TOOL_CLOSE}"


def new_call_id() -> str:
    return "call_" + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")


# --- reading the output back --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TextPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningPiece:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallPiece:
    index: int
    call_id: str
    name: str
    arguments: str
    # False for a forced call the token budget cut short, or closed early to stay whole JSON: its arguments are as far
    # as they got, as OpenAI's are.
    complete: bool = True


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """A call whose function is known before its arguments are written: ``ToolCallDelta`` pieces follow with its
    arguments as they come, then its ``ToolCallPiece`` with all of them. Only calls a grammar writes stream: their
    arguments are JSON whatever comes next."""

    index: int
    call_id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    arguments: str


Piece = TextPiece | ReasoningPiece | ToolCallStart | ToolCallDelta | ToolCallPiece


@dataclass
class _LiveCall:
    """A call being streamed: its arguments so far, and where they stand as JSON."""

    start: ToolCallStart
    arguments: str = ""
    scan: JsonScan = field(default_factory=JsonScan)
    ended: bool = False

    def take(self, text: str) -> int:
        """How much of ``text`` is still the arguments (all of it, or up to the end of their object)."""
        for at, char in enumerate(text):
            if self.scan.read(char) < 0 and self.scan.depth == 0:
                self.ended = True
                return at + 1
        return len(text)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _names_a_function(body: str) -> bool:
    """Whether a call's body is one: a JSON object naming a function."""
    try:
        data = parse_json(body.strip())
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("name"), str)


@dataclass
class StreamDecoder:
    """Incrementally splits generated text into answer text, reasoning and tool calls.

    Text that might be the start of a tag is held back until it is known not to be one, so what is
    streamed as text never has to be taken back.
    """

    plan: DecodePlan
    _buffer: str = ""
    _state: Literal["start", "think", "text", "call", "forced"] = "start"
    _calls: int = 0
    _seen_text: bool = False
    _cut: bool = False
    _live: _LiveCall | None = None
    _after_call: bool = False  # a call has ended, and no text has come since
    raw: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        constraint = self.plan.constraint
        # Calls stream only where a grammar writes them: a forced call, or any call beside a strict tool.
        self._streams_calls = self.plan.forced or (constraint is not None and constraint.kind == "tool_calls")
        if self.plan.forced:
            self._state = "forced"
        elif self.plan.reasoning:
            self._state = "start"
        else:
            self._state = "text"

    @property
    def tool_calls(self) -> int:
        return self._calls

    @property
    def thinking(self) -> bool:
        """Inside the reasoning (between its tags)."""
        return self._state == "think"

    @property
    def calling(self) -> bool:
        """Inside a call (its markup, or a forced call's JSON)."""
        return self._state in ("call", "forced")

    @property
    def after_call(self) -> bool:
        """A call has ended, and nothing but whitespace, which is left out, has come since."""
        return self._after_call

    def feed(self, text: str) -> list[Piece]:
        self.raw.append(text)
        self._buffer += text
        return self._drain(final=False)

    def finish(self, *, ran_out: bool = False) -> list[Piece]:
        """The pieces still held back, once the output has ended; ``ran_out``: it ended because the token budget did
        (a forced call closed early to stay whole JSON is then a call cut short, its arguments not all it meant)."""
        return self._drain(final=True, ran_out=ran_out)

    def _drain(self, *, final: bool, ran_out: bool = False) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if self.ended:
                # The one call the request allows is whole: what the model wrote after it is no part of the answer,
                # however much of it came in the same piece of text.
                self._buffer = ""
                return out
            before = (self._state, len(self._buffer))
            if self._state == "forced":
                self._stream_call(out)
                if final:
                    if self._live is not None:
                        out.append(self._end_live(ran_out=ran_out))
                    else:
                        out.extend(self._forced_calls(self._buffer, ran_out=ran_out))
                    self._buffer = ""
                return out
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(THINK_OPEN):
                    self._buffer = stripped[len(THINK_OPEN) :].lstrip("\n")
                    self._state = "think"
                elif THINK_OPEN.startswith(stripped) and not final:
                    return out
                else:
                    self._state = "text"
            elif self._state == "think":
                end = self._buffer.find(THINK_CLOSE)
                if end >= 0:
                    if end:
                        out.append(ReasoningPiece(self._buffer[:end]))
                    self._buffer = self._buffer[end + len(THINK_CLOSE) :].lstrip("\n")
                    self._state = "text"
                else:
                    keep = 0 if final else _partial_suffix(self._buffer, THINK_CLOSE)
                    if len(self._buffer) > keep:
                        out.append(ReasoningPiece(self._buffer[: len(self._buffer) - keep]))
                        self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
            elif self._state == "text":
                start = self._buffer.find(TOOL_OPEN) if self.plan.reads_tool_calls else -1
                if start >= 0:
                    self._emit_text(out, self._buffer[:start])
                    self._buffer = self._buffer[start + len(TOOL_OPEN) :]
                    self._state = "call"
                else:
                    keep = 0
                    if self.plan.reads_tool_calls and not final:
                        keep = _partial_suffix(self._buffer, TOOL_OPEN)
                    self._emit_text(out, self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return out
            elif self._state == "call" and self._stream_call(out):
                assert self._live is not None
                end = self._buffer.find(TOOL_CLOSE) if self._live.ended else -1
                if end >= 0:
                    out.append(self._end_live(ran_out=False))
                    self._buffer = self._buffer[end + len(TOOL_CLOSE) :]
                    self._state, self._after_call = "text", True
                elif final:
                    out.append(self._end_live(ran_out=ran_out))
                    self._buffer = ""
                    self._state, self._after_call = "text", True
                else:
                    return out
            elif self._state == "call":
                end = self._buffer.find(TOOL_CLOSE)
                if end < 0 and not final:
                    return out
                body = self._buffer if end < 0 else self._buffer[:end]
                self._buffer = "" if end < 0 else self._buffer[end + len(TOOL_CLOSE) :]
                call = self._parse_call(body)
                if call is None and end < 0 and ran_out:
                    # The budget ran out inside the call: it is a call as far as it got, or nothing if it cannot be
                    # told which or is not one the client may get (never the template's markup as an answer).
                    if self.plan.parallel_tool_calls or not self._calls:
                        out.extend(filter(None, [self._cut_call(body)]))
                elif call is not None:
                    out.append(call)
                elif not _names_a_function(body):
                    # Not a well-formed call: it was text after all.
                    self._emit_text(out, TOOL_OPEN + body + ("" if end < 0 else TOOL_CLOSE))
                # Otherwise a call the client may not get (of a function not offered, or past the one it allows):
                # not its to run, and no answer either, least of all in the template's markup. It is left out.
                self._after_call = call is not None or _names_a_function(body) or ran_out
                self._state = "text"
            if (self._state, len(self._buffer)) == before and not final:
                return out
            if final and not self._buffer and self._state in ("text", "start"):
                return out

    def _stream_call(self, out: list[Piece]) -> bool:
        """Streams the call being written, where a grammar writes it: starts it once its function is named and its
        arguments begin, then sends on what came of them. Whether a call is streaming."""
        if self._live is None:
            if not self._streams_calls or (self._calls and not self.plan.parallel_tool_calls):
                return False
            head = _CALL_HEAD.match(self._buffer)
            if head is None or head["name"] not in self._callable():
                return False
            start = ToolCallStart(self._calls, new_call_id(), head["name"])
            self._calls += 1
            self._live = _LiveCall(start)
            self._buffer = self._buffer[head.end() :]
            out.append(start)
        live = self._live
        if not live.ended and self._buffer:
            taken = live.take(self._buffer)
            arguments, self._buffer = self._buffer[:taken], self._buffer[taken:]
            live.arguments += arguments
            out.append(ToolCallDelta(live.start.index, arguments))
        return True

    def _callable(self) -> set[str]:
        forced = self.plan.tool_choice
        return {forced.name} if isinstance(forced, ForcedFunction) else {tool.name for tool in self.plan.tools}

    def _end_live(self, *, ran_out: bool) -> ToolCallPiece:
        """The streamed call, whole: complete when its arguments ended before the output did (a forced call closed
        early to stay whole JSON is a call cut short)."""
        live, self._live = self._live, None
        assert live is not None
        complete = live.ended and not ran_out
        if complete:
            try:
                parse_json(live.arguments)
            except ValueError:
                complete = False
        self._cut |= not complete
        start = live.start
        return ToolCallPiece(start.index, start.call_id, start.name, live.arguments, complete=complete)

    def _emit_text(self, out: list[Piece], text: str) -> None:
        if self._after_call:
            # The whitespace after a call, up to the next call or the text it ends with, is not an answer: left out
            # however the output arrives, a token at a time or many together.
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        if not self._seen_text:
            text = text.lstrip() if self.plan.reasoning else text
        if text:
            self._seen_text = True
            out.append(TextPiece(text))

    def _parse_call(self, body: str) -> ToolCallPiece | None:
        try:
            data = parse_json(body.strip())
        except ValueError:
            return None
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            return None
        names = {tool.name for tool in self.plan.tools}
        if data["name"] not in names:
            return None
        if self._calls and not self.plan.parallel_tool_calls:
            return None
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = parse_json(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        piece = ToolCallPiece(
            index=self._calls,
            call_id=new_call_id(),
            name=data["name"],
            arguments=json.dumps(arguments, ensure_ascii=False),
        )
        self._calls += 1
        return piece

    def _forced_calls(self, text: str, *, ran_out: bool) -> list[Piece]:
        # Output that must be a call and is not one ended before it named its function, among several: it is
        # nothing the client could use, least of all an answer.
        call = self._parse_call(text)
        if call is not None and ran_out:
            self._cut = True
            return [dataclasses.replace(call, complete=False)]
        call = call or self._cut_call(text)
        return [call] if call is not None else []

    def _cut_call(self, text: str) -> ToolCallPiece | None:
        """A call that ended before its JSON did (a forced one's grammar lets nothing else end it early; any other
        was cut by the token budget): the call of the function it names, or of the only one it can be, with its
        arguments as far as they got; None for a function it names that was not offered, or one of several it had
        not named yet."""
        names = self._callable()
        named = _CALL_NAME.match(text)
        if named is not None:
            if named["name"] not in names:
                return None
            name = named["name"]
        elif len(names) == 1:
            (name,) = names
        else:
            return None
        arguments = _CALL_ARGUMENTS.search(text)
        piece = ToolCallPiece(
            index=self._calls,
            call_id=new_call_id(),
            name=name,
            arguments=text[arguments.end() :] if arguments else "",
            complete=False,
        )
        self._calls += 1
        self._cut = True
        return piece

    @property
    def ended(self) -> bool:
        """Whether nothing more of the output can be sent: the one call a request without parallel tool calls may
        make is written whole."""
        return not self.plan.parallel_tool_calls and self._calls > 0 and self._state == "text" and self._live is None

    @property
    def cut_call(self) -> bool:
        """Whether the output ended inside a call."""
        return self._cut
