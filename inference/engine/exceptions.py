"""What can go wrong below the API, in the engine's own terms.

Each exception carries the facts (numbers, the model, which tool), never an HTTP status or a request
parameter's name: the wire format (``inference.openai.errors``) maps each to OpenAI's error, naming the
parameters of the API that asked.
"""

from __future__ import annotations

from typing import Literal

from core.outages import Service

Capability = Literal["tools", "json_schema", "reasoning", "image_input"]


class EngineError(Exception):
    """A request the engine cannot serve as asked."""


class ModelNotServed(EngineError):
    """No enabled catalog entry has this id."""

    def __init__(self, model_id: str) -> None:
        super().__init__(f"the model {model_id!r} is not served here")
        self.model_id = model_id


class ModelUnavailable(EngineError):
    """The model is in the catalog, but its runner cannot be loaded in this process."""

    def __init__(self, model_id: str, detail: str) -> None:
        super().__init__(detail)
        self.model_id = model_id
        self.detail = detail


class CapabilityMissing(EngineError):
    """The request needs something the model (or the agent on it) does not offer."""

    def __init__(self, model_id: str, capability: Capability) -> None:
        super().__init__(f"the model {model_id!r} lacks {capability}")
        self.model_id = model_id
        self.capability: Capability = capability


class ChatTemplateRefused(EngineError):
    """The model's chat template cannot render the conversation (roles out of order, say)."""

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class ContextLengthExceeded(EngineError):
    """The prompt, or the prompt with the output asked for, does not fit the model's context."""

    def __init__(
        self,
        *,
        prompt_tokens: int,
        context_length: int,
        requested_output: int | None,
        at_least: bool = False,
        tools_in_prompt: bool = False,
    ) -> None:
        super().__init__(f"{prompt_tokens} prompt tokens and {requested_output} output tokens exceed {context_length}")
        # ``prompt_tokens`` is a lower bound: the prompt was refused before it was counted exactly.
        self.at_least = at_least
        # The prompt describes tools to the model, which take their room in it too.
        self.tools_in_prompt = tools_in_prompt
        self.prompt_tokens = prompt_tokens
        self.context_length = context_length
        self.requested_output = requested_output

    @property
    def prompt_too_long(self) -> bool:
        """The prompt alone fills the context (else it is the output asked for that does not fit)."""
        return self.prompt_tokens >= self.context_length


class SchemaNotEnforceable(EngineError):
    """The runner's constrained decoding cannot express a schema: a tool's parameters (``tool`` names it), the
    tools' schemas together (``all_tools``: each fits, all of them in one grammar do not) or, with neither, the
    output's schema."""

    def __init__(self, *, model_id: str, tool: str | None, problem: str, all_tools: bool = False) -> None:
        super().__init__(problem)
        self.model_id = model_id
        self.tool = tool
        self.all_tools = all_tools
        self.problem = problem


class OutputLimitTooLarge(EngineError):
    """The request asks for more output tokens than the model writes in one response."""

    def __init__(self, *, model_id: str, most: int, asked: int) -> None:
        super().__init__(f"the model {model_id!r} writes at most {most} output tokens, not {asked}")
        self.model_id = model_id
        self.most = most
        self.asked = asked


class TooManyTopLogprobs(EngineError):
    """The request asks for more alternatives per token than the model returns."""

    def __init__(self, *, model_id: str, most: int) -> None:
        super().__init__(f"the model {model_id!r} returns at most {most} top logprobs")
        self.model_id = model_id
        self.most = most


class PenaltyNotApplied(EngineError):
    """The request sets a frequency or presence penalty the model's sampler would ignore."""

    def __init__(self, *, model_id: str, parameter: str) -> None:
        super().__init__(f"the model {model_id!r} does not apply {parameter}")
        self.model_id = model_id
        self.parameter = parameter


class Overloaded(EngineError):
    """Every sequence of the model is busy and its queue is full: try again after ``retry_after`` seconds."""

    def __init__(self, model_id: str, *, retry_after: int) -> None:
        super().__init__(f"the model {model_id!r} is busy")
        self.model_id = model_id
        self.retry_after = retry_after
        self.headers: dict[str, str] = {}  # the caller's rate-limit headers, once it was admitted


class NotStarted(EngineError):
    """No runner took the job for want of one, before any response began: no worker consumes the model's queue
    (``no_worker``), or the job could not be queued (``service_unavailable``). Try again after ``retry_after``."""

    def __init__(self, code: str, detail: str, *, retry_after: int, outage: Service | None = None) -> None:
        super().__init__(detail)
        self.code = code
        self.retry_after = retry_after
        self.outage = outage  # the service whose outage kept the job from its runner, if one did
        self.headers: dict[str, str] = {}  # the caller's rate-limit headers, once it was admitted
