"""The Responses API: from a validated request to a generation, and back to a Response or its event stream.

The node stores nothing, so the input items are the whole conversation: they become the chat-template
messages every model is rendered from, after checks that each function_call_output answers a
function_call before it. ``ResponseEncoder`` turns the generation's pieces into output items and
stream events; the one-JSON response is the encoder's final state, so both forms always agree.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from inference.engine import capabilities
from inference.engine.catalog import get_enabled_model
from inference.engine.decoding import (
    ForcedFunction,
    FunctionTool,
    ReasoningPiece,
    TextPiece,
    ToolCallDelta,
    ToolCallPiece,
    ToolCallStart,
    ToolChoice,
)
from inference.engine.exceptions import ContextLengthExceeded, ModelNotServed
from inference.engine.generation import (
    Done,
    Failed,
    Generation,
    GenerationEvent,
    GenerationRequest,
    Logprobs,
    prepare,
)
from inference.engine.prompting import Message
from inference.models import CatalogEntry
from inference.openai import responses as wire
from inference.openai.errors import APIError, invalid_request, unsupported_parameter
from inference.openai.shared import (
    LogprobItems,
    delta_logprob_objects,
    dumps,
    logprob_objects,
    now,
    response_usage,
)
from inference.usage.records import Meter
from orgs.admission import Grant

from .caller import Caller, Result, generation_error, run_admitted, streamed_result, whole_result
from .metered import Ending, generation_outcome

logger = logging.getLogger("inference.serving.responses")

ENDPOINT = "responses"

# An input item, and where the client sent it: ``input.3``, or ``previous_response_id`` for stored history.
LocatedItem = tuple[str, wire.InputItem]


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


# --- input items to a conversation ------------------------------------------------------------------


def _at(where: str, part: str) -> str:
    """A part of an item, as a parameter; stored history is named by the id that brought it, as a whole."""
    return where if where == "previous_response_id" else f"{where}.{part}"


def _part_text(part: wire.InputText | wire.OutputText | wire.Refusal) -> str:
    return part.refusal if isinstance(part, wire.Refusal) else part.text


# The parts a message of each role may hold, as OpenAI takes them (and names them when refusing one): what the model
# wrote is an assistant's alone. input_audio is refused on its own, as content this node does not take.
_ASSISTANT_PARTS = (frozenset({"output_text", "refusal"}), "'output_text' and 'refusal'")
_INPUT_PARTS = (
    frozenset({"input_text", "input_image", "input_file", "input_audio"}),
    "'input_text', 'input_image', and 'input_file'",
)


def _message_content(item: wire.EasyInputMessage, where: str) -> str:
    """The message's text. The node's runners read text only (images were refused with the model's capabilities)."""
    if isinstance(item.content, str):
        return item.content
    texts: list[str] = []
    allowed, supported = _ASSISTANT_PARTS if item.role == "assistant" else _INPUT_PARTS
    for index, part in enumerate(item.content):
        if part.type not in allowed:
            raise invalid_request(
                f"Invalid value: '{part.type}'. Supported values are: {supported}.",
                param=_at(where, f"content.{index}.type"),
                code="invalid_value",
            )
        if isinstance(part, wire.InputImage | wire.InputFile | wire.InputAudio):
            raise invalid_request(
                f"{part.type} content is not supported.",
                param=_at(where, f"content.{index}"),
                code="unsupported_content",
            )
        texts.append(_part_text(part))
    return "".join(texts)


def _output_text(item: wire.FunctionCallOutput, where: str) -> str:
    if isinstance(item.output, str):
        return item.output
    texts = []
    for index, part in enumerate(item.output):
        if not isinstance(part, wire.InputText | wire.OutputText):
            raise invalid_request(
                f"{part.type} content in a function_call_output is not supported; send the output as text.",
                param=_at(where, f"output.{index}"),
                code="unsupported_content",
            )
        texts.append(part.text)
    return "".join(texts)


@dataclass
class _Conversation:
    """Input items folded into chat-template messages, with the bookkeeping the integrity checks need."""

    messages: list[Message] = field(default_factory=list)
    calls: dict[str, str] = field(default_factory=dict)  # call_id: where its function_call is
    answered: dict[str, str] = field(default_factory=dict)  # call_id: where its output is
    reasoning: list[str] = field(default_factory=list)  # replayed reasoning, for the next assistant message

    def assistant(self, content: str | list[dict[str, Any]], *, join: bool) -> Message:
        """The assistant message items belong to: a function_call joins the turn it follows."""
        last = self.messages[-1] if self.messages else None
        if join and last is not None and last["role"] == "assistant":
            message = last
        else:
            message = {"role": "assistant", "content": content}
            self.messages.append(message)
        if self.reasoning:
            message.setdefault("reasoning_content", "\n\n".join(self.reasoning))
            self.reasoning = []
        return message

    def function_call(self, item: wire.FunctionCall, where: str) -> None:
        if item.call_id in self.calls:
            raise invalid_request(
                f"call_id {json.dumps(item.call_id)} is already used by the function_call at "
                f"{self.calls[item.call_id]}",
                param=_at(where, "call_id"),
            )
        # Its arguments go back as the model wrote them, JSON or not: a client answers a call whose arguments do not
        # parse with an error for its output, and the model reads both (as in chat completions).
        self.calls[item.call_id] = where
        message = self.assistant("", join=True)
        call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
        message.setdefault("tool_calls", []).append(call)

    def function_call_output(self, item: wire.FunctionCallOutput, where: str) -> None:
        if item.call_id not in self.calls:
            raise invalid_request(
                f"no function_call with call_id {json.dumps(item.call_id)} comes before this output",
                param=_at(where, "call_id"),
            )
        if item.call_id in self.answered:
            raise invalid_request(
                f"the function_call with call_id {json.dumps(item.call_id)} already has its output at "
                f"{self.answered[item.call_id]}",
                param=_at(where, "call_id"),
            )
        self.answered[item.call_id] = where
        self.messages.append({"role": "tool", "content": _output_text(item, where), "tool_call_id": item.call_id})

    def unanswered(self) -> None:
        for call_id, where in self.calls.items():
            if call_id not in self.answered:
                raise invalid_request(
                    f"no function_call_output with call_id {json.dumps(call_id)} comes after this call",
                    param=_at(where, "call_id"),
                )


def _refuse_item(item: wire.ItemReference | wire.OtherItem, where: str) -> APIError:
    if isinstance(item, wire.ItemReference):
        # Named where the client wrote it: a reference may leave its type out.
        param = _at(where, "type" if item.type else "id")
        return unsupported_parameter(
            param, "item_reference is not supported: items are not looked up by id; send the item itself as input"
        )
    param = _at(where, "type")
    tool = item.type.removesuffix("_output").removesuffix("_call")
    if tool in wire.SERVER_TOOLS or item.type.startswith("mcp_"):
        return unsupported_parameter(
            param,
            f"{item.type} items come from the {tool} tool, which {wire.why_not_offered(tool)}; a request here "
            "offers function tools only",
        )
    return unsupported_parameter(param, f"input items of type {item.type!r} are not supported here")


def conversation(
    items: Sequence[LocatedItem], *, instructions: str | None, needs_a_message: bool = True
) -> list[Message]:
    """The instructions and input items as chat-template messages; raises on items that do not fit together, and,
    with ``needs_a_message``, when they hold no message to respond to.

    Errors name each item where the client sent it, so the agent runtime passes stored history and its own
    output under the names the client knows them by.
    """
    state = _Conversation()
    if instructions:
        state.messages.append({"role": "system", "content": instructions})
    for where, item in items:
        if isinstance(item, wire.EasyInputMessage):
            content = _message_content(item, where)
            if item.role == "assistant":
                state.assistant(content, join=False)
            else:
                # Reasoning that no answer followed (a response cut short while it thought) ended with its turn.
                state.reasoning = []
                state.messages.append({"role": item.role, "content": content})
        elif isinstance(item, wire.FunctionCall):
            state.function_call(item, where)
        elif isinstance(item, wire.FunctionCallOutput):
            state.function_call_output(item, where)
        elif isinstance(item, wire.ReasoningItem):
            # Only readable reasoning can go back to the model; encrypted_content from elsewhere cannot.
            if text := "".join(part.text for part in item.content or ()):
                state.reasoning.append(text)
        else:
            raise _refuse_item(item, where)
    state.unanswered()
    if needs_a_message and all(m["role"] in ("system", "developer") for m in state.messages):
        raise invalid_request(
            "input holds no message for the model to respond to.", param="input", code="invalid_value"
        )
    return state.messages


def input_items(request: wire.ResponseCreateRequest) -> list[LocatedItem]:
    """The request's input as located items (a string is one user message)."""
    if isinstance(request.input, str):
        return [("input.0", wire.EasyInputMessage(role="user", content=request.input))]
    return [(f"input.{index}", item) for index, item in enumerate(request.input)]


# --- the request as a generation -----------------------------------------------------------------


def _tool_choice(request: wire.ResponseCreateRequest) -> ToolChoice:
    choice = request.tool_choice
    if isinstance(choice, wire.ToolChoiceFunction):
        return ForcedFunction(choice.name)
    if isinstance(choice, wire.ToolChoiceAllowed):
        return choice.mode
    return choice if isinstance(choice, str) else "auto"


def _callable_tools(request: wire.ResponseCreateRequest) -> list[wire.FunctionTool]:
    """The function tools the model may call: all, or those ``allowed_tools`` allows."""
    choice = request.tool_choice
    allowed = None
    if isinstance(choice, wire.ToolChoiceAllowed):
        allowed = {t.name for t in choice.tools if isinstance(t, wire.ToolChoiceFunction)}
    return [tool for tool in request.function_tools if allowed is None or tool.name in allowed]


def function_tools(tools: Sequence[wire.FunctionTool]) -> tuple[FunctionTool, ...]:
    return tuple(FunctionTool(t.name, t.description, t.parameters, t.strict) for t in tools)


def to_generation_request(request: wire.ResponseCreateRequest, entry: CatalogEntry) -> GenerationRequest:
    """Check the request against the model's capabilities and translate it."""
    request.refuse_unsupported()
    tools = function_tools(_callable_tools(request))
    fmt = request.text_format
    kind: Literal["text", "json_object", "json_schema"] = "text" if fmt is None else fmt.type
    capabilities.check(
        model_id=entry.public_id,
        offers=entry.capabilities(),
        tools=bool(tools),
        reasoning_effort=request.reasoning_effort,
        structured_output=kind != "text",
        images=request.param_names().image is not None,
    )
    return GenerationRequest(
        messages=conversation(
            input_items(request), instructions=request.instructions, needs_a_message=request.NEEDS_A_MESSAGE
        ),
        tools=tools,
        tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning=capabilities.reasoning_on(model_reasons=entry.reasoning, effort=request.reasoning_effort),
        response_format=kind,
        json_schema=fmt.schema_ if isinstance(fmt, wire.FormatJSONSchema) else None,
        max_output_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        logprobs=request.wants_logprobs,
        top_logprobs=(request.top_logprobs or 0) if request.wants_logprobs else 0,
        truncate=request.truncation == "auto",
    )


def echo(request: wire.ResponseCreateRequest) -> dict[str, Any]:
    """The request's settings as the Response repeats them."""
    choice = request.tool_choice
    if isinstance(choice, wire.ToolChoiceFunction | wire.ToolChoiceAllowed):
        return wire.request_echo(request, tool_choice=choice.model_dump(exclude_unset=True))
    return wire.request_echo(request, tool_choice=choice if isinstance(choice, str) else "auto")


# --- generation events to output items and stream events -------------------------------------------


@dataclass
class _OpenItem:
    """The output item being streamed: a message or reasoning, whose text arrives in pieces."""

    kind: Literal["message", "reasoning"]
    item_id: str
    output_index: int
    text: list[str] = field(default_factory=list)
    logprobs: LogprobItems = field(default_factory=list)

    @property
    def ref(self) -> wire.ContentRef:
        return {"item_id": self.item_id, "output_index": self.output_index, "content_index": 0}

    def part(self) -> dict[str, Any]:
        text = "".join(self.text)
        if self.kind == "message":
            return wire.output_text_part(text, logprob_objects(self.logprobs))
        return wire.reasoning_text_part(text)

    def item(self, status: wire.ItemStatus, content: list[dict[str, Any]]) -> dict[str, Any]:
        build = wire.message_item if self.kind == "message" else wire.reasoning_item
        return build(item_id=self.item_id, status=status, content=content)


@dataclass
class _OpenCall:
    """The function call being streamed, whose arguments arrive in pieces."""

    index: int  # among the output's calls, as the decoder counts them
    item_id: str
    output_index: int
    call_id: str
    name: str
    arguments: list[str] = field(default_factory=list)

    def item(self, status: wire.ItemStatus, arguments: str) -> dict[str, Any]:
        return wire.function_call_item(
            item_id=self.item_id, call_id=self.call_id, name=self.name, status=status, arguments=arguments
        )


class ResponseEncoder:
    """Turns generation events into Responses stream events and keeps the Response they add up to.

    Every method returns the events to send, numbered; ``response`` is the Response so far.
    ``annotate``, when given, maps a finished message's text to its annotations (citations): they are
    sent as ``response.output_text.annotation.added`` and repeated in ``response.output_text.done``.
    """

    def __init__(self, *, echo: dict[str, Any], annotate: Callable[[str], list[dict[str, Any]]] | None = None) -> None:
        self.response_id = _new_id("resp")
        self.created_at = now()
        self.output: list[dict[str, Any]] = []
        self.annotate = annotate
        self._echo = echo
        self._open: _OpenItem | None = None
        self._call: _OpenCall | None = None
        self._pending_logprobs: LogprobItems = []
        self._sequence = 0
        self.response = self._response("in_progress")

    def _response(
        self, status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"], **kwargs: Any
    ) -> dict[str, Any]:
        return wire.response_object(
            response_id=self.response_id,
            created_at=self.created_at,
            status=status,
            output=list(self.output),
            echo=self._echo,
            **kwargs,
        )

    def numbered(self, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Gives events their places in the stream (also events built outside the encoder)."""
        for event in events:
            event["sequence_number"] = self._sequence
            self._sequence += 1
        return events

    def start(self) -> list[dict[str, Any]]:
        return self.numbered(
            [wire.lifecycle_event("created", self.response), wire.lifecycle_event("in_progress", self.response)]
        )

    def feed(self, event: GenerationEvent) -> list[dict[str, Any]]:
        if isinstance(event, Logprobs):
            self._pending_logprobs.extend((lp.token, lp.logprob, list(lp.top)) for lp in event.items)
            return []
        if isinstance(event, TextPiece):
            return self.numbered(self._text("message", event.text))
        if isinstance(event, ReasoningPiece):
            return self.numbered(self._text("reasoning", event.text))
        if isinstance(event, ToolCallStart | ToolCallDelta | ToolCallPiece):
            self._pending_logprobs = []  # the call's: an output_text's logprobs are those of its own text
        if isinstance(event, ToolCallStart):
            return self.numbered([*self._close("completed"), *self._start_call(event)])
        if isinstance(event, ToolCallDelta):
            return self.numbered(self._call_arguments(event.arguments))
        if isinstance(event, ToolCallPiece):
            status: wire.ItemStatus = "completed" if event.complete else "incomplete"
            if self._call is not None and self._call.index == event.index:  # streamed: it ends here
                return self.numbered(self._end_call(status, event.arguments))
            return self.numbered([*self._close("completed"), *self._function_call(event, status)])
        raise TypeError(f"not a piece of output: {event!r}")

    @property
    def open_text(self) -> str:
        """The text of the message being streamed so far; empty when no message is open."""
        return self._open_text("message")

    @property
    def open_reasoning(self) -> str:
        """The text of the reasoning being streamed so far; empty when no reasoning is open."""
        return self._open_text("reasoning")

    def _open_text(self, kind: str) -> str:
        item = self._open
        return "".join(item.text) if item is not None and item.kind == kind else ""

    def open_item(self, item: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
        """Adds an item built elsewhere (a tool the server runs), in progress, after closing the open one.

        Returns its ``output_index`` and the events; ``close_item`` finishes it.
        """
        events = self._close("completed")
        index = len(self.output)
        self.output.append(item)
        events.append(wire.output_item_event("added", output_index=index, item=item))
        return index, self.numbered(events)

    def close_item(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.output[index] = item
        return self.numbered([wire.output_item_event("done", output_index=index, item=item)])

    def refuse(self, refusal: str) -> list[dict[str, Any]]:
        """Ends the answer with a refusal: the message's text part is finished empty (a client replaces what it
        showed) and a refusal part with the message for the user follows it."""
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != "message":
            events += [*self._close("completed"), *self._open_item("message")]
        item, self._open = self._open, None
        assert item is not None
        text = wire.output_text_part("")
        events += [
            wire.output_text_done_event(item.ref, "", [], [] if self.annotate is not None else None),
            wire.content_part_event("done", item.ref, text),
        ]
        at: wire.ContentRef = {**item.ref, "content_index": 1}
        events += [
            wire.content_part_event("added", at, wire.refusal_part("")),
            wire.refusal_delta_event(at, refusal),
            wire.refusal_done_event(at, refusal),
            wire.content_part_event("done", at, wire.refusal_part(refusal)),
        ]
        finished = item.item("completed", [text, wire.refusal_part(refusal)])
        self.output.append(finished)
        events.append(wire.output_item_event("done", output_index=item.output_index, item=finished))
        return self.numbered(events)

    def finish(
        self, done: Done, *, always_completed: bool = False, ends_with_answer: bool = False
    ) -> list[dict[str, Any]]:
        """``always_completed``: a response cut short by ``max_output_tokens`` still ends with
        ``response.completed`` (its status says ``incomplete``), for clients that know only completed and failed.

        An output that holds nothing gets an empty message. ``ends_with_answer`` (the agent runtime's turns) asks
        more: the output ends with the answer's message, empty when the model said nothing, unless calls of the
        client's functions end it (a function_call after the last message). Clients take the last message for the
        answer, and a turn may otherwise end with a tool the service ran, or with reasoning. Without it, output of
        reasoning or function calls alone stands, as OpenAI sends it."""
        truncated = done.finish_reason == "length"
        events: list[dict[str, Any]] = []
        if self._pending_logprobs and (self._open.kind == "message" if self._open is not None else not self.output):
            # Tokens whose text never came (the first bytes of a character the budget cut) keep their logprobs, in
            # a delta of no text: their bytes are in them, as in chat's.
            events += self._text("message", "")
        events += self._close("incomplete" if truncated else "completed")
        answered = bool(self.output)
        if ends_with_answer:
            last_message = max((i for i, item in enumerate(self.output) if item["type"] == "message"), default=-1)
            after = [item["type"] for item in self.output[last_message + 1 :]]
            answered = answered and (not after or "function_call" in after)
        if not answered:
            events += [*self._open_item("message"), *self._close("incomplete" if truncated else "completed")]
        usage = response_usage(
            input_tokens=done.prompt_tokens,
            output_tokens=done.completion_tokens,
            cached_tokens=done.cached_tokens,
            reasoning_tokens=done.reasoning_tokens,
        )
        if truncated:
            self.response = self._response("incomplete", usage=usage, incomplete_reason="max_output_tokens")
            events.append(wire.lifecycle_event("completed" if always_completed else "incomplete", self.response))
        else:
            self.response = self._response("completed", usage=usage, completed_at=now())
            events.append(wire.lifecycle_event("completed", self.response))
        return self.numbered(events)

    def fail_instead(self, events: list[dict[str, Any]], message: str, *, error_code: str) -> list[dict[str, Any]]:
        """``events`` from ``finish`` with their ``response.completed`` withheld (the response could not be kept):
        the response fails in its place, from its sequence number on."""
        self._sequence -= 1
        return events[:-1] + self.fail(message, error_code=error_code, usage=self.response.get("usage"))

    def cancel(self) -> None:
        """The client went away: the Response is what was produced, ``cancelled``; there is nobody to send events to."""
        self._close("incomplete")
        self.response = self._response("cancelled")

    def fail(
        self, message: str, *, error_code: str | None = None, usage: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        """``error_code``, when given, sends an ``error`` event with it just before ``response.failed``; ``usage``,
        the tokens the failed response still counts (what the model wrote before it failed), goes in it."""
        events = self._close("incomplete")
        if error_code is not None:
            events.append(wire.error_event(code=error_code, message=message))
        error = {"code": wire.failed_response_code(error_code), "message": message}
        self.response = self._response("failed", error=error, usage=usage)
        events.append(wire.lifecycle_event("failed", self.response))
        return self.numbered(events)

    def _text(self, kind: Literal["message", "reasoning"], text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._open is None or self._open.kind != kind:
            events += [*self._close("completed"), *self._open_item(kind)]
        item = self._open
        assert item is not None
        item.text.append(text)
        if kind == "reasoning":
            self._pending_logprobs = []  # the reasoning's: an output_text's logprobs are those of its own text
            events.append(wire.reasoning_text_delta_event(item.ref, text))
        else:
            # Logprobs arrive before the text they belong to, which the decoder may have held back.
            logprobs, self._pending_logprobs = self._pending_logprobs, []
            item.logprobs.extend(logprobs)
            events.append(wire.output_text_delta_event(item.ref, text, delta_logprob_objects(logprobs)))
        return events

    def _open_item(self, kind: Literal["message", "reasoning"]) -> list[dict[str, Any]]:
        item = _OpenItem(kind, _new_id("msg" if kind == "message" else "rs"), len(self.output))
        self._open = item
        return [
            wire.output_item_event("added", output_index=item.output_index, item=item.item("in_progress", [])),
            wire.content_part_event("added", item.ref, _empty(kind)),
        ]

    def _close(self, status: wire.ItemStatus) -> list[dict[str, Any]]:
        if self._call is not None:  # a call whose output ended before it did
            return self._end_call("incomplete", "".join(self._call.arguments))
        item, self._open = self._open, None
        if item is None:
            return []
        part = item.part()
        events: list[dict[str, Any]] = []
        if item.kind == "message":
            annotations = self.annotate(part["text"]) if self.annotate is not None else None
            for index, annotation in enumerate(annotations or ()):
                events.append(wire.annotation_added_event(item.ref, index, annotation))
            part["annotations"] = annotations or []
            done = wire.output_text_done_event(
                item.ref, part["text"], delta_logprob_objects(item.logprobs), annotations
            )
        else:
            done = wire.reasoning_text_done_event(item.ref, part["text"])
        finished = item.item(status, [part])
        self.output.append(finished)
        return [
            *events,
            done,
            wire.content_part_event("done", item.ref, part),
            wire.output_item_event("done", output_index=item.output_index, item=finished),
        ]

    def _function_call(self, piece: ToolCallPiece, status: wire.ItemStatus) -> list[dict[str, Any]]:
        """A call that came whole: its arguments in one delta."""
        return [
            *self._start_call(ToolCallStart(piece.index, piece.call_id, piece.name)),
            *self._call_arguments(piece.arguments),
            *self._end_call(status, piece.arguments),
        ]

    def _start_call(self, start: ToolCallStart) -> list[dict[str, Any]]:
        call = _OpenCall(start.index, _new_id("fc"), len(self.output), start.call_id, start.name)
        self._call = call
        return [wire.output_item_event("added", output_index=call.output_index, item=call.item("in_progress", ""))]

    def _call_arguments(self, arguments: str) -> list[dict[str, Any]]:
        call = self._call
        assert call is not None
        call.arguments.append(arguments)
        return [
            wire.function_call_arguments_delta_event(
                item_id=call.item_id, output_index=call.output_index, delta=arguments
            )
        ]

    def _end_call(self, status: wire.ItemStatus, arguments: str) -> list[dict[str, Any]]:
        call, self._call = self._call, None
        assert call is not None
        finished = call.item(status, arguments)
        self.output.append(finished)
        return [
            wire.function_call_arguments_done_event(
                item_id=call.item_id, output_index=call.output_index, name=call.name, arguments=arguments
            ),
            wire.output_item_event("done", output_index=call.output_index, item=finished),
        ]


def _empty(kind: Literal["message", "reasoning"]) -> dict[str, Any]:
    return wire.output_text_part("") if kind == "message" else wire.reasoning_text_part("")


async def complete(*, generation: Generation, encoder: ResponseEncoder, request_id: str) -> tuple[dict[str, Any], Done]:
    """Run to the end and build one Response."""
    async for event in generation.run():
        if isinstance(event, Failed):
            raise generation_error(event, request_id=request_id)
        if isinstance(event, Done):
            encoder.finish(event)
            return encoder.response, event
        encoder.feed(event)
    raise APIError("Generation ended without a result.", code="generation_failed", status=500, type="server_error")


def sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {dumps(event)}\n\n"


async def stream_events(
    *, generation: Generation, encoder: ResponseEncoder, ending: Ending, request_id: str
) -> AsyncGenerator[str, None]:
    """The Responses event stream, ending in ``response.completed``, ``.incomplete`` or ``.failed``.

    ``ending`` receives the terminal event (``Done`` or ``Failed``) for usage accounting.
    """
    for event in encoder.start():
        yield sse(event)
    try:
        async with aclosing(generation.run()) as pieces:
            async for piece in pieces:
                if isinstance(piece, Failed):
                    ending.event = piece
                    # The error event names what failed; response.failed says whether trying again can help.
                    error = generation_error(piece, request_id=request_id)
                    events = encoder.fail(error.message, error_code=error.code, usage=_usage(generation, piece))
                elif isinstance(piece, Done):
                    ending.event = piece
                    events = encoder.finish(piece)
                else:
                    events = encoder.feed(piece)
                for event in events:
                    yield sse(event)
    except Exception:
        # Once the stream has begun, the only way left to report a fault is the stream's own end.
        logger.exception("response stream %s failed", encoder.response_id)
        failed = ending.event = Failed("internal_error", "The server had an error while generating the response.")
        for event in encoder.fail(failed.message, error_code=failed.code, usage=_usage(generation, failed)):
            yield sse(event)


def _usage(generation: Generation, failed: Failed) -> dict[str, Any]:
    """A failed response's usage: as its usage record counts it."""
    counted = generation_outcome(generation, failed)
    return response_usage(
        input_tokens=counted.input_tokens,
        output_tokens=counted.output_tokens,
        cached_tokens=counted.cached_tokens,
        reasoning_tokens=counted.reasoning_tokens,
    )


# --- the workflow ------------------------------------------------------------------------------------


async def count_input_tokens(*, params: wire.ResponseCreateRequest) -> dict[str, Any]:
    """``POST /responses/input_tokens``: the tokens the request's input takes on its model, as a response to it would
    count them (its instructions, tools and output format included). Nothing runs, and nothing is metered."""
    entry = await get_enabled_model(params.model)
    if not entry.served_here:
        raise ModelNotServed(params.model)
    try:
        generation = await prepare(entry=entry, request=to_generation_request(params, entry))
    except ContextLengthExceeded as exc:
        # Counted, though no response could take it: whether an input fits is what a client counts it to learn. An
        # input too long to fit whatever its count, refused before it was counted (``at_least``), stays refused.
        if exc.at_least:
            raise
        return wire.input_tokens_object(exc.prompt_tokens)
    return wire.input_tokens_object(generation.prompt_tokens)


async def create_response(*, params: wire.ResponseCreateRequest, caller: Caller) -> Result:
    async def respond(generation: Generation, grant: Grant, meter: Meter) -> Result:
        sampling = generation.job.sampling
        # As applied: what the request set, else the model's sampling defaults, else OpenAI's.
        encoder = ResponseEncoder(echo={**echo(params), "temperature": sampling.temperature, "top_p": sampling.top_p})
        if params.stream:
            ending = Ending()
            events = stream_events(generation=generation, encoder=encoder, ending=ending, request_id=meter.request_id)
            return streamed_result(events, generation=generation, ending=ending, grant=grant, meter=meter)
        body, done = await complete(generation=generation, encoder=encoder, request_id=meter.request_id)
        return whole_result(body, done=done, generation=generation, grant=grant, meter=meter)

    return await run_admitted(
        caller=caller,
        model=params.model,
        endpoint=ENDPOINT,
        output_limit=params.max_output_tokens,
        translate=lambda entry: to_generation_request(params, entry),
        respond=respond,
    )
