"""Chat completions: from a validated request to a generation, and back to a ``chat.completion`` or its chunks."""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from inference.engine import capabilities
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
from inference.engine.generation import Done, Failed, Generation, GenerationRequest, Logprobs
from inference.engine.prompting import Message
from inference.models import CatalogEntry
from inference.openai import chat as wire
from inference.openai.errors import APIError, invalid_request, unsupported_parameter
from inference.openai.shared import LogprobItems, completion_usage, dumps, first_repeated, now
from inference.usage.records import Meter
from orgs.admission import Grant

from .caller import Caller, Result, generation_error, run_admitted, streamed_result, whole_result
from .metered import Ending

ENDPOINT = "chat.completions"
EXTRA = {"b3os": {"route": "node"}}


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_urlsafe(22).replace("-", "x").replace("_", "y")


# --- the request as a generation -------------------------------------------------------------------


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") or "" for part in content)


def _user_content(message: wire.UserMessage, index: int) -> str:
    """The message's text. The node's runners read text only (images were refused with the model's capabilities)."""
    if isinstance(message.content, str):
        return message.content
    for part_index, part in enumerate(message.content):
        if isinstance(part, wire.AudioPart | wire.FilePart | wire.ImagePart):
            raise invalid_request(
                f"{part.type} content is not supported.",
                param=f"messages.{index}.content.{part_index}",
                code="unsupported_content",
            )
    return "".join(part.text for part in message.content if isinstance(part, wire.TextPart))


def messages(request: wire.ChatCompletionRequest) -> list[Message]:
    """The request's messages in the chat template's form. As OpenAI requires, an assistant message's tool calls are
    each answered, once, by the tool messages right after it."""
    waiting: dict[str, None] = {}  # the calls of the last assistant message not answered yet, in order
    asked_at = 0
    out: list[Message] = []
    for index, message in enumerate(request.messages):
        if waiting and not isinstance(message, wire.ToolMessage):
            raise _unanswered(asked_at, waiting)
        if isinstance(message, wire.UserMessage):
            out.append({"role": "user", "content": _user_content(message, index)})
        elif isinstance(message, wire.FunctionMessage):
            raise unsupported_parameter(f"messages.{index}.role", "the function role is deprecated; use tool messages")
        elif isinstance(message, wire.AssistantMessage):
            item: Message = {"role": "assistant", "content": _text(message.content) or message.refusal or ""}
            if message.tool_calls:
                item["tool_calls"] = [
                    {
                        "id": c.id,
                        "type": "function",
                        "function": {"name": c.function.name, "arguments": c.function.arguments},
                    }
                    for c in message.tool_calls
                ]
                ids = [c.id for c in message.tool_calls]
                if (second := first_repeated(ids)) is not None:
                    raise _repeated_call_id(f"messages.{index}.tool_calls.{second}.id", ids[second])
                waiting, asked_at = dict.fromkeys(ids), index
            out.append(item)
        elif isinstance(message, wire.ToolMessage):
            if message.tool_call_id not in waiting:
                raise invalid_request(
                    f"tool message answers tool_call_id {message.tool_call_id!r}, but it is not a call of the "
                    "assistant message before it that is still waiting for its answer: messages with role 'tool' "
                    "must be a response to a preceding message with 'tool_calls'",
                    param=f"messages.{index}.tool_call_id",
                )
            del waiting[message.tool_call_id]
            out.append({"role": "tool", "content": _text(message.content), "tool_call_id": message.tool_call_id})
        else:
            out.append({"role": message.role, "content": _text(message.content)})
    if waiting:
        raise _unanswered(asked_at, waiting)
    return out


def _repeated_call_id(param: str, call_id: str) -> APIError:
    """Two calls of one assistant message under one id: a tool message could not say which of them it answers."""
    return invalid_request(
        f"tool call id {call_id!r} is used by more than one of the assistant message's tool_calls: each call "
        "needs an id of its own, which its tool message names",
        param=param,
    )


def _unanswered(index: int, waiting: dict[str, None]) -> APIError:
    return invalid_request(
        "An assistant message with 'tool_calls' must be followed by tool messages responding to each "
        f"'tool_call_id'. The following tool_call_ids did not have response messages: {', '.join(waiting)}",
        param=f"messages.{index}.tool_calls",
    )


def _tool_choice(request: wire.ChatCompletionRequest) -> ToolChoice:
    choice = request.tool_choice
    if isinstance(choice, wire.NamedToolChoice):
        return ForcedFunction(choice.function.name)
    if isinstance(choice, wire.AllowedToolsChoice):
        return choice.allowed_tools.mode
    return choice if isinstance(choice, str) else "auto"  # another kind was refused with the request


def _callable_tools(request: wire.ChatCompletionRequest) -> tuple[FunctionTool, ...]:
    """The function tools the model may call: all, or those ``allowed_tools`` allows."""
    choice = request.tool_choice
    allowed = None
    if isinstance(choice, wire.AllowedToolsChoice):
        allowed = {tool.function.name for tool in choice.allowed_tools.tools}
    return tuple(
        FunctionTool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
        for t in request.tools or ()
        if allowed is None or t.function.name in allowed
    )


def to_generation_request(request: wire.ChatCompletionRequest, entry: CatalogEntry) -> GenerationRequest:
    """Check the request against the model's capabilities and translate it."""
    request.refuse_unsupported()
    fmt = request.response_format
    kind = "text" if fmt is None else fmt.type
    capabilities.check(
        model_id=entry.public_id,
        offers=entry.capabilities(),
        tools=bool(request.tools),
        reasoning_effort=request.reasoning_effort,
        structured_output=kind != "text",
        images=request.param_names().image is not None,
    )
    schema = fmt.json_schema.schema_ if isinstance(fmt, wire.ResponseFormatJSONSchema) else None
    return GenerationRequest(
        messages=messages(request),
        tools=_callable_tools(request),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning=capabilities.reasoning_on(model_reasons=entry.reasoning, effort=request.reasoning_effort),
        response_format=kind,
        json_schema=schema if schema is not None else ({} if kind == "json_schema" else None),
        max_output_tokens=request.output_limit,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=wire.normalize_stop(request.stop),
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
    )


# --- generation events to completion objects ---------------------------------------------------------


def _logprob_items(event: Logprobs) -> LogprobItems:
    return [(lp.token, lp.logprob, list(lp.top)) for lp in event.items]


def _usage(done: Done) -> dict[str, Any]:
    return completion_usage(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        cached_tokens=done.cached_tokens,
        reasoning_tokens=done.reasoning_tokens,
    )


def _ended_without_result() -> APIError:
    return APIError("Generation ended without a result.", code="generation_failed", status=500, type="server_error")


async def complete(
    *, generation: Generation, model: str, want_logprobs: bool, request_id: str
) -> tuple[dict[str, Any], Done]:
    """Run to the end and build one ``chat.completion``."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: LogprobItems = []
    pending: LogprobItems = []  # logprobs arrive before the piece of output they belong to
    async for event in generation.run():
        if isinstance(event, TextPiece):
            text.append(event.text)
            logprobs.extend(pending)
            pending = []
        elif isinstance(event, ReasoningPiece):
            reasoning.append(event.text)
            pending = []  # the reasoning's, not the content's
        elif isinstance(event, ToolCallPiece):
            pending = []  # the call's, not the content's
            calls.append(
                {
                    "id": event.call_id,
                    "type": "function",
                    "function": {"name": event.name, "arguments": event.arguments},
                }
            )
        elif isinstance(event, Logprobs):
            pending.extend(_logprob_items(event))
        elif isinstance(event, Failed):
            raise generation_error(event, request_id=request_id)
        elif isinstance(event, Done):
            if text or not calls:
                # Tokens whose text never came (the first bytes of a character the budget cut) keep their logprobs:
                # their bytes are in them.
                logprobs.extend(pending)
            message: dict[str, Any] = {
                "role": "assistant",
                "content": "".join(text) if (text or not calls) else None,
                "refusal": None,
                "annotations": [],
            }
            if calls:
                message["tool_calls"] = calls
            if reasoning:
                message["reasoning_content"] = "".join(reasoning)
            body = wire.chat_completion(
                completion_id=completion_id(),
                created=now(),
                model=model,
                message=message,
                finish_reason=event.finish_reason,
                usage=_usage(event),
                logprobs=wire.logprobs_object(logprobs) if want_logprobs else None,
                extra=EXTRA,
            )
            return body, event
    raise _ended_without_result()


def _call_delta(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """The delta that opens a call: its id and function, with its arguments (all of them, or none yet)."""
    function = {"name": name, "arguments": arguments}
    return {"tool_calls": [{"index": index, "id": call_id, "type": "function", "function": function}]}


async def stream_chunks(
    *,
    generation: Generation,
    model: str,
    include_usage: bool,
    want_logprobs: bool,
    ending: Ending,
    request_id: str,
) -> AsyncGenerator[str, None]:
    """Server-sent ``chat.completion.chunk`` events ending with ``data: [DONE]``, as OpenAI sends them.

    ``ending`` receives the terminal event (``Done`` or ``Failed``) for usage accounting.
    """
    cid = completion_id()
    created = now()

    def chunk(delta: dict[str, Any] | None, usage: dict[str, Any] | None = None, **kwargs: Any) -> str:
        payload = wire.chat_chunk(completion_id=cid, created=created, model=model, delta=delta, extra=EXTRA, **kwargs)
        if include_usage:
            # With include_usage, OpenAI sends "usage": null on every chunk but the last.
            payload["usage"] = usage
        return f"data: {dumps(payload)}\n\n"

    opened = False
    streamed_calls: set[int] = set()  # calls whose arguments went out as they came
    pending_logprobs: LogprobItems = []
    async with aclosing(generation.run()) as events:
        async for event in events:
            if isinstance(event, Logprobs):
                pending_logprobs.extend(_logprob_items(event))
                continue
            if not opened:
                # As OpenAI's first chunk: content null when calls come first, else "", so that a client adding the
                # deltas up gets the message a whole completion has.
                opened = True
                content = None if isinstance(event, ToolCallStart | ToolCallPiece) else ""
                yield chunk({"role": "assistant", "content": content, "refusal": None})
            logprobs = None
            if want_logprobs and pending_logprobs and isinstance(event, TextPiece):
                logprobs = wire.logprobs_object(pending_logprobs)
            if not isinstance(event, Failed | Done):
                pending_logprobs = []  # a reasoning's or a call's logprobs are not the content's
            if isinstance(event, TextPiece):
                yield chunk({"content": event.text}, logprobs=logprobs)
            elif isinstance(event, ReasoningPiece):
                yield chunk({"reasoning_content": event.text})
            elif isinstance(event, ToolCallStart):
                streamed_calls.add(event.index)
                yield chunk(_call_delta(event.index, event.call_id, event.name, ""))
            elif isinstance(event, ToolCallDelta):
                yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
            elif isinstance(event, ToolCallPiece) and event.index not in streamed_calls:
                yield chunk(_call_delta(event.index, event.call_id, event.name, event.arguments))
            elif isinstance(event, Failed):
                ending.event = event
                yield f"data: {dumps(generation_error(event, request_id=request_id).body())}\n\n"
                return
            elif isinstance(event, Done):
                ending.event = event
                if want_logprobs and pending_logprobs and content is not None:
                    # Tokens whose text never came (the first bytes of a character the budget cut), with their bytes.
                    yield chunk({"content": ""}, logprobs=wire.logprobs_object(pending_logprobs))
                yield chunk({}, finish_reason=event.finish_reason)
                if include_usage:
                    yield chunk(None, usage=_usage(event))
                yield "data: [DONE]\n\n"
                return


# --- the workflow ------------------------------------------------------------------------------------


async def create_chat_completion(*, params: wire.ChatCompletionRequest, caller: Caller) -> Result:
    async def respond(generation: Generation, grant: Grant, meter: Meter) -> Result:
        want_logprobs = bool(params.logprobs)
        if params.stream:
            ending = Ending()
            chunks = stream_chunks(
                generation=generation,
                model=params.model,
                include_usage=bool(params.stream_options and params.stream_options.include_usage),
                want_logprobs=want_logprobs,
                ending=ending,
                request_id=meter.request_id,
            )
            return streamed_result(chunks, generation=generation, ending=ending, grant=grant, meter=meter)
        body, done = await complete(
            generation=generation, model=params.model, want_logprobs=want_logprobs, request_id=meter.request_id
        )
        return whole_result(body, done=done, generation=generation, grant=grant, meter=meter)

    return await run_admitted(
        caller=caller,
        model=params.model,
        endpoint=ENDPOINT,
        output_limit=params.output_limit,
        translate=lambda entry: to_generation_request(params, entry),
        respond=respond,
    )
