"""From a conversation to the prompt a runner generates from.

A conversation is a list of messages in the Hugging Face chat-template form (``role``, ``content``,
assistant ``tool_calls`` with ``function.name`` / ``function.arguments``, tool ``tool_call_id``), which
both API families convert to. Templates that know tools get them as they are; for the others the
tools are described in the system message and calls and results are written in the Hermes format.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .decoding import FunctionTool, format_tool_call, tool_system_prompt
from .exceptions import ContextLengthExceeded
from .runners.base import PromptRenderer

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    tokens: int


def _text_only(messages: list[Message]) -> list[Message]:
    """Rewrites tool calls and tool results as plain text for templates without tool support."""
    out: list[Message] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            blocks = [
                format_tool_call(call["function"]["name"], _arguments_text(call["function"]["arguments"]))
                for call in message["tool_calls"]
            ]
            content = "\n".join(filter(None, [message.get("content") or "", *blocks]))
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({"role": role, "content": message.get("content") or ""})
    return out


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _with_tool_prompt(messages: list[Message], tools: tuple[FunctionTool, ...]) -> list[Message]:
    prompt = tool_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{prompt}"}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def render_prompt(
    *,
    renderer: PromptRenderer,
    messages: list[Message],
    tools: tuple[FunctionTool, ...],
    describe_tools: bool,
    context_length: int,
) -> RenderedPrompt:
    """Render and count. ``describe_tools`` is false when ``tool_choice`` is ``none``: the model is not told of
    tools. A prompt that cannot fit ``context_length`` whatever its exact count raises ``ContextLengthExceeded``
    before it is counted."""
    # Developer messages are system messages to templates that predate them.
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if renderer.native_tools:
        text = renderer.render(messages, [t.template_form() for t in tools] if (tools and describe_tools) else None)
    else:
        plain = _text_only(messages)
        if tools and describe_tools:
            plain = _with_tool_prompt(plain, tools)
        text = renderer.render(plain, None)
    if (least := renderer.least_tokens(text)) > context_length:
        raise ContextLengthExceeded(
            prompt_tokens=least, context_length=context_length, requested_output=None, at_least=True
        )
    return RenderedPrompt(text=text, tokens=renderer.count_tokens(text))


def check_context(*, prompt_tokens: int, max_output: int | None, context_length: int) -> int:
    """The room left for output, or ``ContextLengthExceeded`` when the prompt, or the output asked for, does not fit."""
    room = context_length - prompt_tokens
    if room <= 0 or (max_output is not None and max_output > room):
        raise ContextLengthExceeded(
            prompt_tokens=prompt_tokens, context_length=context_length, requested_output=max_output
        )
    return room
