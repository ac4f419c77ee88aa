"""The agent runtime's wire format: what its API reference adds to OpenAI's Responses API.

OpenAI's own shapes (input items, output items, stream events) are ``inference.openai.responses``;
here are the request as the runtime takes it, the ``agent_runtime:function_call`` item of a tool the
service runs itself, instances, and feedback.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import orjson
from pydantic import AfterValidator, ConfigDict, Field, model_validator

from inference.openai import responses as wire
from inference.openai.errors import invalid_request, unsupported_parameter
from inference.openai.shared import LooseModel, WireModel

AGENT_CALL = "agent_runtime:function_call"

AgentCallStatus = Literal["in_progress", "completed", "failed"]


# --- what the runtime looks up and keeps -----------------------------------------------------------------

RESPONSE_ID = re.compile(r"resp_[A-Za-z0-9]{1,59}\Z")


def _response_id(value: str) -> str:
    """Only what could be one of the runtime's ids is looked up: anything else names no response, and some
    characters (U+0000) PostgreSQL cannot even compare."""
    if RESPONSE_ID.match(value) is None:
        raise ValueError("expected an ID that begins with 'resp_', followed by letters and digits")
    return value


ResponseId = Annotated[str, AfterValidator(_response_id)]


def unstorable_at(value: Any, where: str) -> str | None:
    """Where ``value`` holds text the runtime cannot keep: U+0000, which PostgreSQL's text and jsonb refuse."""
    if isinstance(value, str):
        return where if "\x00" in value else None
    if isinstance(value, dict):
        if any("\x00" in key for key in value):  # a name of its own
            return where
        parts: Any = value.items()
    elif isinstance(value, list):
        parts = enumerate(value)
    else:
        return None
    return next((found for key, part in parts if (found := unstorable_at(part, f"{where}.{key}")) is not None), None)


def storable(value: Any) -> Any:
    """``value`` with every U+0000 in its text replaced by U+FFFD: for what the model or a server tool produced,
    which the client has been sent as it was, and which the stored turn keeps as near as it can."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, dict):
        return {storable(key): storable(part) for key, part in value.items()}
    if isinstance(value, list):
        return [storable(part) for part in value]
    return value


def unstorable(where: str) -> str:
    return f"{where} holds the character U+0000, which the service cannot store"


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("the character U+0000 cannot be stored")
    return value


def _streamed_only(schema: dict[str, Any]) -> None:
    """The request's JSON schema says what ``refuse_unsupported`` holds it to: ``stream`` true."""
    schema["properties"]["stream"] = {"const": True, "description": "The runtime answers with an event stream only."}
    schema["required"] = [*schema.get("required", ()), "stream"]


class AgentResponseRequest(wire.ResponseCreateRequest):
    """``POST /v1/responses``: ``model`` names an instance; streaming only; the service may keep the conversation."""

    model_config = ConfigDict(json_schema_extra=_streamed_only)

    # The runtime keeps conversations, so previous_response_id is taken; the rest is refused for its own reasons.
    REFUSED: ClassVar[Mapping[str, str]] = {
        "conversation": "conversation objects are not supported: continue with previous_response_id",
        "prompt": "stored prompts are not supported: the instance's instructions apply",
        "context_management": "server-side context management is not supported",
        "moderation": "moderation is configured per instance, as its guardrails",
        "background": "background mode is not supported: responses stream",
        "route": "the agent runtime runs its instances itself: route is for /v1/infer",
    }

    previous_response_id: ResponseId | None = None

    # An instance's server tools can meet ``required`` (see ``AgentTurn._step_tools``); the service checks it has some.
    REQUIRED_NEEDS_TOOLS: ClassVar[bool] = False

    def refuse_unsupported(self) -> None:
        """The stateless API's refusals, less what the runtime keeps, plus what only an agent refuses."""
        if self.stream is not True:
            raise invalid_request(
                'The agent runtime answers with an event stream only: send "stream": true.',
                param="stream",
                code="unsupported_value",
            )
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            raise unsupported_parameter("text.format", "agents answer in text, with citations")
        if self.truncation == "auto":
            raise unsupported_parameter(
                "truncation", "truncation: auto is not supported by the agent runtime; use disabled"
            )
        if isinstance(self.tool_choice, wire.ToolChoiceAllowed):
            raise unsupported_parameter(
                "tool_choice", "allowed_tools is not supported by the agent runtime: send only the tools it may call"
            )
        super().refuse_unsupported()

    @property
    def keeps(self) -> bool:
        """``store`` as OpenAI reads it: unset means true."""
        return self.store is not False


class AgentCall(LooseModel):
    """A server tool's call, as a client replays it in ``input`` (with ``store: false``)."""

    type: Literal["agent_runtime:function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    output: str | None = None
    error: str | None = None


def agent_call_item(
    *,
    item_id: str,
    status: AgentCallStatus,
    call_id: str,
    name: str,
    arguments: str,
    output: str | None = None,
    error: str | None = None,
) -> dict[str, Any]:
    """A tool the service ran: its arguments, then its output, or its error when ``status`` is failed. ``content`` is
    empty: the openai SDKs read an item of a type they do not know as a message, and the Agents SDK goes through a
    message's content (for a refusal), which must then be a list."""
    return {
        "id": item_id,
        "type": AGENT_CALL,
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "output": output,
        "error": error,
        "content": [],
    }


# --- instances ------------------------------------------------------------------------------------


def instance_object(
    *, instance_id: str, name: str, created: int, base_model: str, tools: list[str], reasoning: bool
) -> dict[str, Any]:
    return {
        "id": instance_id,
        "object": "agent_runtime.instance",
        "created": created,
        "name": name,
        "base_model": base_model,
        "tools": tools,
        "reasoning": reasoning,
    }


def instance_list(instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": instances}


# --- feedback -------------------------------------------------------------------------------------


# What a client adds to a rating's meta is kept with it: bounded, as JSON, like the comment.
FEEDBACK_META_MAX_BYTES = 16 * 1024


class FeedbackMeta(LooseModel):
    """``message_id`` is the rated response's id; anything else the client adds is kept with the rating."""

    message_id: ResponseId

    @model_validator(mode="after")
    def _kept_whole(self) -> FeedbackMeta:
        if (where := unstorable_at(self.model_extra, "meta")) is not None:
            raise ValueError(unstorable(where))
        if (size := len(orjson.dumps(self.model_dump(mode="json")))) > FEEDBACK_META_MAX_BYTES:
            raise ValueError(
                f"meta takes {size} bytes as JSON; at most {FEEDBACK_META_MAX_BYTES} are kept with a rating"
            )
        return self


class FeedbackRequest(WireModel):
    meta: FeedbackMeta
    rating: Literal["positive", "negative"]
    # The length is checked on the string itself, before U+0000: a long comment is told of as a string too long.
    comment: Annotated[str, Field(max_length=4000), AfterValidator(_storable)] | None = None


def feedback_object(*, message_id: str, rating: str, comment: str, created_at: int) -> dict[str, Any]:
    return {
        "object": "agent_runtime.feedback",
        "message_id": message_id,
        "rating": rating,
        "comment": comment or None,
        "created_at": created_at,
    }
