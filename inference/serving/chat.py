"""Chat completions: from a validated request to a generation, and back to completion objects or chunks."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from typing import Any

from inference.openai import chat as protocol
from inference.engine.decoding import FunctionTool, ReasoningPiece, TextPiece, ToolCallPiece
from inference.openai.errors import APIError, invalid_request, unsupported_parameter
from inference.engine.generation import Done, Failed, Generation, GenerationRequest, Logprobs
from inference.models import CatalogEntry
from inference.engine.prompting import Message


def completion_id() -> str:
    return "chatcmpl-" + secrets.token_urlsafe(22).replace("-", "x").replace("_", "y")


def _text(content: str | list[Any] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", None) or getattr(part, "refusal", "") or "" for part in content)


def _messages(request: protocol.ChatCompletionRequest, entry: CatalogEntry) -> list[Message]:
    known_calls: set[str] = set()
    out: list[Message] = []
    for index, message in enumerate(request.messages):
        if isinstance(message, protocol.UserMessage) and isinstance(message.content, list):
            for part_index, part in enumerate(message.content):
                param = f"messages.{index}.content.{part_index}"
                if isinstance(part, protocol.ImagePart) and not entry.image_input:
                    raise invalid_request(
                        f"The model {entry.public_id!r} does not accept image input.", param=param, code="unsupported_content"
                    )
                if isinstance(part, protocol.AudioPart | protocol.FilePart):
                    raise invalid_request(f"{part.type} content is not supported.", param=param, code="unsupported_content")
            if entry.image_input and any(isinstance(p, protocol.ImagePart) for p in message.content):
                content: Any = [
                    {"type": "text", "text": p.text} if isinstance(p, protocol.TextPart) else {"type": "image", "url": p.image_url.url}
                    for p in message.content
                ]
                out.append({"role": "user", "content": content})
                continue
        if isinstance(message, protocol.FunctionMessage):
            raise unsupported_parameter(f"messages.{index}.role", "the function role is deprecated; use tool messages")
        if isinstance(message, protocol.AssistantMessage):
            item: Message = {"role": "assistant", "content": _text(message.content) or message.refusal or ""}
            if message.tool_calls:
                item["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
                    for c in message.tool_calls
                ]
                known_calls.update(c.id for c in message.tool_calls)
            out.append(item)
        elif isinstance(message, protocol.ToolMessage):
            if message.tool_call_id not in known_calls:
                raise invalid_request(
                    f"tool message answers tool_call_id {message.tool_call_id!r}, but no assistant message before it "
                    "has a tool call with that id",
                    param=f"messages.{index}.tool_call_id",
                )
            out.append({"role": "tool", "content": _text(message.content), "tool_call_id": message.tool_call_id})
        else:
            out.append({"role": message.role, "content": _text(message.content)})
    return out


def to_generation_request(request: protocol.ChatCompletionRequest, entry: CatalogEntry) -> GenerationRequest:
    """Check the request against the model's capabilities and translate it."""
    request.refuse_unsupported()
    tools = tuple(
        FunctionTool(t.function.name, t.function.description, t.function.parameters, t.function.strict)
        for t in request.tools or ()
    )
    if tools and not entry.tools:
        raise unsupported_parameter("tools", f"the model {entry.public_id!r} does not support tool calls")
    if request.reasoning_effort not in (None, "none", "minimal") and not entry.reasoning:
        raise unsupported_parameter("reasoning_effort", f"the model {entry.public_id!r} does not reason")
    fmt = request.response_format
    kind = "text" if fmt is None else fmt.type
    if kind != "text" and not entry.json_schema:
        raise unsupported_parameter("response_format", f"the model {entry.public_id!r} does not support structured output")
    schema = fmt.json_schema.schema_ if isinstance(fmt, protocol.ResponseFormatJSONSchema) else None
    choice = request.tool_choice
    tool_choice = choice.function.name if isinstance(choice, protocol.NamedToolChoice) else (choice or "auto")
    return GenerationRequest(
        messages=_messages(request, entry),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        reasoning=entry.reasoning and request.reasoning_effort not in ("none", "minimal"),
        response_format=kind,  # type: ignore[arg-type]
        json_schema=schema if schema is not None else ({} if kind == "json_schema" else None),
        max_output_tokens=request.output_limit,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=protocol.normalize_stop(request.stop),
        frequency_penalty=request.frequency_penalty,
        presence_penalty=request.presence_penalty,
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        max_tokens_param="max_completion_tokens" if request.max_completion_tokens else "max_tokens",
        tool_schema_params=tuple(f"tools.{index}.function.parameters" for index in range(len(tools))),
    )


def _logprob_items(event: Logprobs) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(lp.token, lp.logprob, list(lp.top)) for lp in event.items]


def _tool_call(piece: ToolCallPiece) -> dict[str, Any]:
    return {"id": piece.call_id, "type": "function", "function": {"name": piece.name, "arguments": piece.arguments}}


def _usage(done: Done) -> dict[str, Any]:
    return protocol.usage_object(
        prompt_tokens=done.prompt_tokens,
        completion_tokens=done.completion_tokens,
        cached_tokens=done.cached_tokens,
        reasoning_tokens=done.reasoning_tokens,
    )


def generation_failed(event: Failed) -> APIError:
    status = 503 if event.code in ("no_worker", "model_not_available") else 500
    return APIError(f"Generation failed: {event.message}", code=event.code, status=status, type="server_error")


async def complete(
    *, generation: Generation, model: str, want_logprobs: bool, extra: dict[str, Any]
) -> tuple[dict[str, Any], Done]:
    """Run to the end and build one ``chat.completion``."""
    text: list[str] = []
    reasoning: list[str] = []
    calls: list[dict[str, Any]] = []
    logprobs: list[tuple[str, float, list[tuple[str, float]]]] = []
    async for event in generation.run():
        if isinstance(event, TextPiece):
            text.append(event.text)
        elif isinstance(event, ReasoningPiece):
            reasoning.append(event.text)
        elif isinstance(event, ToolCallPiece):
            calls.append(_tool_call(event))
        elif isinstance(event, Logprobs):
            logprobs.extend(_logprob_items(event))
        elif isinstance(event, Failed):
            raise generation_failed(event)
        elif isinstance(event, Done):
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
            body = protocol.chat_completion(
                completion_id=completion_id(),
                created=protocol.now(),
                model=model,
                message=message,
                finish_reason=event.finish_reason,
                usage=_usage(event),
                logprobs=protocol.logprobs_content(logprobs) if want_logprobs else None,
                extra=extra,
            )
            return body, event
    raise APIError("Generation ended without a result.", code="generation_failed", status=500, type="server_error")


async def stream_chunks(
    *, generation: Generation, model: str, include_usage: bool, want_logprobs: bool, extra: dict[str, Any], outcome: dict[str, Any]
) -> AsyncIterator[str]:
    """Server-sent ``chat.completion.chunk`` events ending with ``data: [DONE]``, as OpenAI sends them.

    ``outcome`` receives the terminal event (``done`` or ``failed``) for usage accounting.
    """
    cid = completion_id()
    created = protocol.now()

    def chunk(delta: dict[str, Any] | None, usage: dict[str, Any] | None = None, **kwargs: Any) -> str:
        payload = protocol.chat_chunk(completion_id=cid, created=created, model=model, delta=delta, extra=extra, **kwargs)
        if include_usage:
            # With include_usage, OpenAI sends "usage": null on every chunk but the last.
            payload["usage"] = usage
        return f"data: {protocol.dumps(payload)}\n\n"

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    pending_logprobs: list[tuple[str, float, list[tuple[str, float]]]] = []
    async for event in generation.run():
        if isinstance(event, Logprobs):
            pending_logprobs.extend(_logprob_items(event))
            continue
        logprobs = None
        if want_logprobs and pending_logprobs and isinstance(event, TextPiece):
            logprobs = protocol.logprobs_content(pending_logprobs)
            pending_logprobs = []
        if isinstance(event, TextPiece):
            yield chunk({"content": event.text}, logprobs=logprobs)
        elif isinstance(event, ReasoningPiece):
            yield chunk({"reasoning_content": event.text})
        elif isinstance(event, ToolCallPiece):
            yield chunk(
                {
                    "tool_calls": [
                        {
                            "index": event.index,
                            "id": event.call_id,
                            "type": "function",
                            "function": {"name": event.name, "arguments": event.arguments},
                        }
                    ]
                }
            )
        elif isinstance(event, Failed):
            outcome["failed"] = event
            error = generation_failed(event)
            yield f"data: {protocol.dumps(error.body())}\n\n"
            return
        elif isinstance(event, Done):
            outcome["done"] = event
            yield chunk({}, finish_reason=event.finish_reason)
            if include_usage:
                yield chunk(None, usage=_usage(event))
            yield "data: [DONE]\n\n"
            return
