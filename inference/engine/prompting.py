"""From a conversation to the prompt a runner generates from.

A conversation is a list of messages in the Hugging Face chat-template form (``role``, ``content``,
assistant ``tool_calls`` with ``function.name`` / ``function.arguments``, tool ``tool_call_id``), which
both API families convert to. Templates that know tools get them as they are; for the others the
tools are described in the system message and calls and results are written in the Hermes format.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, replace
from typing import Any

from .decoding import FunctionTool, format_tool_call, tool_system_prompt
from .exceptions import ContextLengthExceeded
from .runners.base import PromptRenderer

Message = dict[str, Any]


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    text: str
    tokens: int
    literal: tuple[tuple[int, int], ...] = ()  # see ``GenerationJob.literal``


class _Literals:
    """Keeps the special tokens a request spells (in any string of its messages or tools) out of the template's
    reach: each is swapped for a placeholder no client can guess before rendering, and put back after, its span
    noted so that it is read as text. A template that reshapes a message's text (trims it, splits it) moves the
    placeholders along with the rest."""

    def __init__(self, special_tokens: tuple[str, ...]) -> None:
        self._marker = re.compile("|".join(map(re.escape, special_tokens))) if special_tokens else None
        self._nonce = secrets.token_hex(8)
        self._found: list[str] = []

    def hide(self, value: Any) -> Any:
        if self._marker is None:
            return value
        if isinstance(value, str):
            return self._marker.sub(self._placeholder, value)
        if isinstance(value, list):
            return [self.hide(item) for item in value]
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        return value

    def _placeholder(self, match: re.Match[str]) -> str:
        self._found.append(match.group())
        return f"literal{self._nonce}n{len(self._found) - 1}n"

    def restore(self, text: str) -> tuple[str, tuple[tuple[int, int], ...]]:
        """``text`` with each placeholder back to what it stood for, and the spans those now take."""
        if not self._found:
            return text, ()
        pieces: list[str] = []
        spans: list[tuple[int, int]] = []
        at = length = 0
        for match in re.finditer(f"literal{self._nonce}n([0-9]+)n", text):
            original = self._found[int(match.group(1))]
            pieces += [text[at : match.start()], original]
            length += match.start() - at
            spans.append((length, length + len(original)))
            length += len(original)
            at = match.end()
        pieces.append(text[at:])
        return "".join(pieces), tuple(spans)


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
    literals = _Literals(renderer.special_tokens)
    messages = literals.hide(messages)
    tools = tuple(
        replace(
            tool,
            name=literals.hide(tool.name),
            description=literals.hide(tool.description),
            parameters=literals.hide(tool.parameters),
        )
        for tool in tools
    )
    # Developer messages are system messages to templates that predate them.
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if renderer.native_tools:
        text = renderer.render(messages, [t.template_form() for t in tools] if (tools and describe_tools) else None)
    else:
        plain = _text_only(messages)
        if tools and describe_tools:
            plain = _with_tool_prompt(plain, tools)
        text = renderer.render(plain, None)
    text, literal = literals.restore(text)
    if (least := renderer.least_tokens(text)) > context_length:
        raise ContextLengthExceeded(
            prompt_tokens=least,
            context_length=context_length,
            requested_output=None,
            at_least=True,
            tools_in_prompt=bool(tools) and describe_tools,
        )
    return RenderedPrompt(text=text, tokens=renderer.count_tokens(text, literal), literal=literal)


def check_context(
    *, prompt_tokens: int, max_output: int | None, context_length: int, tools_in_prompt: bool = False
) -> int:
    """The room left for output, or ``ContextLengthExceeded`` when the prompt, or the output asked for, does not fit."""
    room = context_length - prompt_tokens
    if room <= 0 or (max_output is not None and max_output > room):
        raise ContextLengthExceeded(
            prompt_tokens=prompt_tokens,
            context_length=context_length,
            requested_output=max_output,
            tools_in_prompt=tools_in_prompt,
        )
    return room
