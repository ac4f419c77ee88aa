"""Chat completions' wire format: the request, its messages and tools, and the completion and chunk objects.

Request models validate the body and say exactly which parameter is wrong; response builders emit
plain dicts, which are cheaper to serialize on the hot path than model instances.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .errors import ParamNames, invalid_request, stream_options_without_stream, unsupported_parameter
from .shared import (
    MAX_TOOLS,
    UNSUPPORTED,
    FunctionName,
    FunctionParameters,
    JSONSchema,
    LogprobItems,
    LooseModel,
    Metadata,
    ModelId,
    ReasoningEffort,
    ServiceTier,
    StreamOptions,
    WireModel,
    logprob_objects,
    mentions_json,
    text_or_list,
    tool_choice_kind,
)


class FunctionDefinition(WireModel):
    name: FunctionName
    description: str | None = None
    parameters: FunctionParameters | None = None
    strict: bool | None = None


class JSONSchemaFormat(WireModel):
    name: FunctionName
    description: str | None = None
    schema_: JSONSchema | None = Field(default=None, alias="schema")
    strict: bool | None = None


# One sequence or up to four (OpenAI's ``maxItems``), tagged so that a bad one is named at its own index (``stop.1``).
StopParam = (
    Annotated[
        Annotated[str, Tag("text")] | Annotated[list[str], Field(max_length=4), Tag("list")],
        Discriminator(text_or_list),
    ]
    | None
)


def normalize_stop(stop: StopParam) -> tuple[str, ...]:
    if stop is None:
        return ()
    values = [stop] if isinstance(stop, str) else stop
    return tuple(v for v in values if v)


# --- chat completions: request ------------------------------------------------------------------


class PromptCacheBreakpoint(WireModel):
    """Where a reusable prompt prefix ends: a hint, as ``prompt_cache_options`` is (the runner reuses prefixes by
    itself)."""

    mode: Literal["explicit"]


class TextPart(WireModel):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class ImageURL(WireModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(WireModel):
    type: Literal["image_url"]
    image_url: ImageURL
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class RefusalPart(WireModel):
    type: Literal["refusal"]
    refusal: str


class AudioPart(LooseModel):
    type: Literal["input_audio"]


class FilePart(LooseModel):
    type: Literal["file"]


UserPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]
# Content as text or as parts, tagged so that a bad part is named at its own index (``messages.0.content.1.type``).
# Parts are at least one (OpenAI's ``minItems: 1``), refused as ``empty_array`` as ``messages: []`` is.
TextContent = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[TextPart], Field(min_length=1), Tag("list")],
    Discriminator(text_or_list),
]
UserContent = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[UserPart], Field(min_length=1), Tag("list")],
    Discriminator(text_or_list),
]
AssistantContent = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[AssistantPart], Field(min_length=1), Tag("list")],
    Discriminator(text_or_list),
]


class SystemMessage(WireModel):
    role: Literal["system", "developer"]
    content: TextContent
    name: str | None = None


class UserMessage(WireModel):
    role: Literal["user"]
    content: UserContent
    name: str | None = None


class ToolCallFunction(LooseModel):
    name: str
    arguments: str


class ToolCall(LooseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    @model_validator(mode="before")
    @classmethod
    def _only_function_calls(cls, value: Any) -> Any:
        """A call of a kind of tool OpenAI knows (``custom``) is refused as unsupported, as that tool is."""
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise PydanticCustomError(
                UNSUPPORTED, "calls of {kind} tools are not supported; only function tools", {"kind": kind[:40]}
            )
        return value


class AssistantMessage(WireModel):
    role: Literal["assistant"]
    content: AssistantContent | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(min_length=1)] | None = None  # OpenAI refuses [] as empty_array
    function_call: Any = None
    audio: Any = None
    # Echoed back by clients that replay the message they received (``parsed``: the openai SDK's ``parse`` and
    # ``stream`` helpers put the structured answer there, and send it back with the message); not read.
    reasoning_content: str | None = None
    annotations: list[Any] | None = None
    parsed: Any = None

    # Fields of an assistant message this node refuses by name: the deprecated form of a call (as the ``functions``
    # parameter is refused), and an earlier audio answer by its id (this node neither makes nor reads audio).
    REFUSED: ClassVar[dict[str, str]] = {
        "function_call": "function_call is deprecated and not supported; use tool_calls",
        "audio": "audio in a message is not supported; this node serves text only",
    }

    @field_validator("function_call", "audio")
    @classmethod
    def _refused(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise PydanticCustomError(UNSUPPORTED, cls.REFUSED[str(info.field_name)])
        return value

    @model_validator(mode="after")
    def _has_something(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls and self.refusal is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(WireModel):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str
    # Not in OpenAI's schema, but OpenAI accepts it and many clients send it (its own cookbook among them): the
    # function's name, already known from the call the message answers.
    name: str | None = None


class FunctionMessage(WireModel):
    role: Literal["function"]
    content: str | None
    name: str


ChatMessage = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage, Field(discriminator="role")
]


class ChatTool(WireModel):
    type: Literal["function"]
    function: FunctionDefinition

    @field_validator("type", mode="before")
    @classmethod
    def _only_functions(cls, kind: Any) -> Any:
        """A kind of tool OpenAI knows (``custom``) is refused as unsupported, naming its type as Responses does, not
        as a malformed function; any other type is an invalid value."""
        if kind == "custom":
            raise PydanticCustomError(UNSUPPORTED, "the custom tool is not supported; only function tools")
        return kind


class NamedToolChoiceFunction(WireModel):
    name: str


class NamedToolChoice(WireModel):
    type: Literal["function"]
    function: NamedToolChoiceFunction


class AllowedTools(WireModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice]


class AllowedToolsChoice(WireModel):
    """Calls only to these tools, in ``mode`` auto or required; ``tools`` still lists every tool."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


def _openai_tool_choice_type(value: str) -> str:
    """The one kind of tool choice OpenAI knows and this node does not take, ``custom``; any other type is an
    invalid value, not a feature this node lacks."""
    if value != "custom":
        expected = "'function' or 'allowed_tools'"
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return value


class OtherToolChoice(LooseModel):
    """A kind of tool choice this node does not take (``custom``); refused by its type."""

    type: Annotated[str, AfterValidator(_openai_tool_choice_type)]


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[NamedToolChoice, Tag("function")]
    | Annotated[AllowedToolsChoice, Tag("allowed_tools")]
    | Annotated[OtherToolChoice, Tag("other")],
    Discriminator(tool_choice_kind),
]


class ResponseFormatText(WireModel):
    type: Literal["text"]


class ResponseFormatJSONObject(WireModel):
    type: Literal["json_object"]


class ResponseFormatJSONSchema(WireModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


ResponseFormat = Annotated[
    ResponseFormatText | ResponseFormatJSONObject | ResponseFormatJSONSchema, Field(discriminator="type")
]


class ChatStreamOptions(StreamOptions):
    include_usage: bool | None = None


# Known OpenAI parameters this platform does not implement: refused by name, never ignored.
CHAT_UNSUPPORTED = {
    "audio": "audio output is not supported",
    "functions": "functions is deprecated and not supported; use tools",
    "function_call": "function_call is deprecated and not supported; use tool_choice",
    "logit_bias": "logit_bias is not supported on this model",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported on this node",
    "moderation": "moderation is not supported on this node",
}


def _token_ids(bias: dict[str, int]) -> dict[str, int]:
    for key in bias:
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"invalid key {key[:40]!r}: the keys are token ids, non-negative integers")
    return bias


# OpenAI's ``logit_bias``: token ids to a bias from -100 to 100.
LogitBias = Annotated[dict[str, Annotated[int, Field(ge=-100, le=100)]], AfterValidator(_token_ids)]


class GatewayChatRequest(LooseModel):
    """What the gateway reads of a chat body it forwards (whether it streams, what it may cost): the rest goes to the
    upstream as sent, for it to judge."""

    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class ChatCompletionRequest(WireModel):
    model: ModelId
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    stream: bool | None = False
    stream_options: ChatStreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None  # OpenAI's range; more than 1 is refused by name
    stop: StopParam = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # OpenAI's range: a signed 64-bit integer
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    metadata: Metadata | None = None
    store: bool | None = None
    service_tier: ServiceTier | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    reasoning_effort: ReasoningEffort | None = None
    tools: Annotated[list[ChatTool], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    route: Literal["node", "gateway"] | None = None
    # Caching hints, best-effort at OpenAI too: accepted, with no effect here (the runner reuses a prompt's
    # prefix by itself).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    # Known but unsupported: accepted by the schema, in OpenAI's shapes (a value OpenAI would refuse is an invalid
    # one, as for any parameter), so they can be refused by name below.
    audio: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    logit_bias: LogitBias | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    moderation: dict[str, Any] | None = None

    def _texts(self) -> Iterator[str]:
        for message in self.messages:
            content = message.content
            if isinstance(content, str):
                yield content
            elif isinstance(content, list):
                yield from (part.text for part in content if isinstance(part, TextPart))

    def refuse_unsupported(self) -> None:
        for name, message in CHAT_UNSUPPORTED.items():
            value = getattr(self, name)
            if value is not None and not (name == "logit_bias" and value == {}):
                raise unsupported_parameter(name, message)
        if self.verbosity not in (None, "medium"):  # OpenAI's default, as Responses takes it
            raise unsupported_parameter("verbosity", "verbosity is not supported on this model")
        if self.n not in (None, 1):
            raise unsupported_parameter("n", "n must be 1 on this model")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            # Which limit was meant cannot be told: OpenAI refuses the pair rather than pick one.
            raise invalid_request(
                "Setting 'max_tokens' and 'max_completion_tokens' at the same time is not supported.",
                param="max_tokens",
                code="invalid_parameter_combination",
            )
        if isinstance(self.tool_choice, OtherToolChoice):
            raise unsupported_parameter(
                "tool_choice", f"tool_choice of type {self.tool_choice.type[:40]!r} is not supported"
            )
        if self.stream_options is not None and not self.stream:
            raise stream_options_without_stream()
        if self.modalities and set(self.modalities) - {"text"}:
            raise unsupported_parameter("modalities", "only the text modality is supported")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported_parameter("service_tier", f"service_tier {self.service_tier!r} is not offered")
        if isinstance(self.response_format, ResponseFormatJSONObject) and not mentions_json(self._texts()):
            raise invalid_request(
                "'messages' must contain the word 'json' in some form, to use 'response_format' of type 'json_object'.",
                param="messages",
            )
        if self.top_logprobs and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs: true.", param="top_logprobs", code="invalid_value")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise invalid_request(
                "tool_choice is only allowed when tools are specified.", param="tool_choice", code="invalid_value"
            )
        if self.parallel_tool_calls is not None and not self.tools:
            raise invalid_request(
                "Invalid value for 'parallel_tool_calls': 'parallel_tool_calls' is only allowed when 'tools' are "
                "specified.",
                param="parallel_tool_calls",
                code="invalid_value",
            )
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = {tool.function.name for tool in self.tools}
            if self.tool_choice.function.name not in names:
                raise invalid_request(
                    f"tool_choice names the function {self.tool_choice.function.name!r}, which is not in tools.",
                    param="tool_choice.function.name",
                    code="invalid_value",
                )
        if isinstance(self.tool_choice, AllowedToolsChoice) and self.tools:
            names = {tool.function.name for tool in self.tools}
            if not self.tool_choice.allowed_tools.tools:
                raise invalid_request(
                    "allowed_tools needs at least one tool.",
                    param="tool_choice.allowed_tools.tools",
                    code="invalid_value",
                )
            for index, allowed in enumerate(self.tool_choice.allowed_tools.tools):
                if allowed.function.name not in names:
                    raise invalid_request(
                        f"allowed_tools names the function {allowed.function.name!r}, which is not in tools.",
                        param=f"tool_choice.allowed_tools.tools.{index}.function.name",
                        code="invalid_value",
                    )
        if self.tools:
            listed = [tool.function.name for tool in self.tools]
            if len(set(listed)) != len(listed):
                raise invalid_request("Tool names must be unique.", param="tools", code="invalid_value")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def param_names(self) -> ParamNames:
        images = (
            f"messages.{index}.content.{part_index}"
            for index, message in enumerate(self.messages)
            if isinstance(message, UserMessage) and isinstance(message.content, list)
            for part_index, part in enumerate(message.content)
            if isinstance(part, ImagePart)
        )
        return ParamNames(
            prompt="messages",
            output_limit="max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens",
            tool_schemas={
                tool.function.name: f"tools.{index}.function.parameters" for index, tool in enumerate(self.tools or ())
            },
            image=next(images, None),
        )


# --- chat completions: response -----------------------------------------------------------------


def chat_completion(
    *,
    completion_id: str,
    created: int,
    model: str,
    message: dict[str, Any],
    finish_reason: str,
    usage: dict[str, Any],
    logprobs: dict[str, Any] | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}],
        "usage": usage,
        "service_tier": "default",
        **extra,
    }


def chat_chunk(
    *,
    completion_id: str,
    created: int,
    model: str,
    delta: dict[str, Any] | None,
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "service_tier": "default",
        "choices": []
        if delta is None
        else [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if extra:
        chunk.update(extra)
    return chunk


def logprobs_object(items: LogprobItems) -> dict[str, Any]:
    """A choice's ``logprobs``: the content's tokens, with their bytes."""
    return {"content": logprob_objects(items), "refusal": None}
