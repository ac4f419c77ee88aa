"""The agent runtime's wire format: what its contract (``seeds/004``) adds to OpenAI's Responses API.

OpenAI's own shapes (input items, output items, stream events) are ``inference.openai.responses``;
here are the request as the runtime takes it, the ``agent_runtime:function_call`` item of a tool the
service runs itself, instances, and feedback.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from inference.openai.errors import invalid_request, unsupported_parameter
from inference.openai.chat import LooseModel, WireModel
from inference.openai import responses as wire

AGENT_CALL = "agent_runtime:function_call"

AgentCallStatus = Literal["in_progress", "completed", "failed"]


class AgentResponseRequest(wire.ResponseCreateRequest):
    """``POST /v1/responses``: ``model`` names an instance; streaming only; the service may keep the conversation."""

    def refuse_unsupported(self) -> None:
        if self.stream is not True:
            raise invalid_request(
                'The agent runtime answers with an event stream only: send "stream": true.',
                param="stream",
                code="unsupported_value",
            )
        refused = {
            "conversation": "conversation objects are not supported: continue with previous_response_id",
            "prompt": "stored prompts are not supported: the instance's instructions apply",
            "context_management": "server-side context management is not supported",
            "moderation": "moderation is configured per instance, as its guardrails",
        }
        for name, message in refused.items():
            if getattr(self, name) is not None:
                raise unsupported_parameter(name, message)
        if self.background:
            raise unsupported_parameter("background", "background mode is not supported: responses stream")
        if self.truncation == "auto":
            raise unsupported_parameter("truncation", "truncation: auto is not supported; use disabled")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported_parameter("service_tier", f"service_tier {self.service_tier!r} is not offered")
        if self.text is not None and self.text.format is not None and self.text.format.type != "text":
            raise unsupported_parameter("text.format", "agents answer in text, with citations")
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise unsupported_parameter("text.verbosity", "verbosity is not supported on this model")
        for index, value in enumerate(self.include or ()):
            if value not in wire.INCLUDABLE:
                raise unsupported_parameter(f"include.{index}", f"include {value!r} is not available here")
        if isinstance(self.tool_choice, wire.ToolChoiceAllowed):
            raise unsupported_parameter(
                "tool_choice", "allowed_tools is not supported by the agent runtime: send only the tools it may call"
            )
        self._check_tools()

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
    """A tool the service ran: its arguments, then its output, or its error when ``status`` is failed."""
    return {
        "id": item_id,
        "type": AGENT_CALL,
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "output": output,
        "error": error,
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


class FeedbackMeta(LooseModel):
    """``message_id`` is the rated response's id; anything else the client adds is kept with the rating."""

    message_id: Annotated[str, Field(min_length=1, max_length=64)]


class FeedbackRequest(WireModel):
    meta: FeedbackMeta
    rating: Literal["positive", "negative"]
    comment: Annotated[str, Field(max_length=4000)] | None = None


def feedback_object(*, message_id: str, rating: str, comment: str, created_at: int) -> dict[str, Any]:
    return {
        "object": "agent_runtime.feedback",
        "message_id": message_id,
        "rating": rating,
        "comment": comment or None,
        "created_at": created_at,
    }
