"""The Responses API wire format: the request, its input items, and the Response object and stream events.

Request models validate the body and name the exact parameter that is wrong. Top-level fields are
strict (an unknown one is refused), but replayed input items tolerate fields they do not declare:
clients send back what they received (``id``, ``status``, ``annotations``…). Builders emit plain dicts.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar, Literal, TypedDict

from pydantic import AfterValidator, Discriminator, Field, Tag, TypeAdapter, model_validator
from pydantic_core import PydanticCustomError

from .errors import (
    REQUEST_FAULT_CODES,
    APIError,
    ParamNames,
    invalid_request,
    stream_options_without_stream,
    unknown_parameter,
    unsupported_parameter,
)
from .shared import (
    MAX_TOOLS,
    FunctionName,
    FunctionParameters,
    JSONSchema,
    LooseModel,
    Metadata,
    ModelId,
    ReasoningEffort,
    ServiceTierResponses,
    StreamOptions,
    WireModel,
    first_repeated,
    mentions_json,
    tagged,
    text_or_list,
    tool_choice_kind,
)

# --- request: content parts ---------------------------------------------------------------------


class InputText(LooseModel):
    type: Literal["input_text"]
    text: str


class OutputText(LooseModel):
    type: Literal["output_text"]
    text: str


class Refusal(LooseModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(LooseModel):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


class InputFile(LooseModel):
    type: Literal["input_file"]


class InputAudio(LooseModel):
    type: Literal["input_audio"]


ContentPart = Annotated[
    InputText | OutputText | Refusal | InputImage | InputFile | InputAudio, Field(discriminator="type")
]
Content = Annotated[
    Annotated[str, Tag("text")] | Annotated[list[ContentPart], Tag("list")], Discriminator(text_or_list)
]


class SummaryText(LooseModel):
    type: Literal["summary_text"]
    text: str


class ReasoningText(LooseModel):
    type: Literal["reasoning_text"]
    text: str


# --- request: input items -----------------------------------------------------------------------


class EasyInputMessage(LooseModel):
    """A message of any role: ``{"role", "content"}``, or a replayed ``message`` item with its ``id``."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCall(LooseModel):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: Annotated[str, Field(min_length=1)]
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutput(LooseModel):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: Content


class ReasoningItem(LooseModel):
    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class ItemReference(LooseModel):
    """An item named by its ``id`` alone, to be read from storage (its ``type`` may be left out)."""

    type: Literal["item_reference"] | None = None
    id: str


_ITEM_TYPES = frozenset({"message", "function_call", "function_call_output", "reasoning", "item_reference"})
# Every type of input item OpenAI's API knows. One of them this node does not take is refused as unsupported; any
# other names no item at all (a misspelt "message"), an invalid value.
OPENAI_ITEM_TYPES = _ITEM_TYPES | {
    *("additional_tools", "apply_patch_call", "apply_patch_call_output", "code_interpreter_call", "compaction"),
    *("compaction_trigger", "computer_call", "computer_call_output", "custom_tool_call", "custom_tool_call_output"),
    *("file_search_call", "image_generation_call", "local_shell_call", "local_shell_call_output"),
    *("mcp_approval_request", "mcp_approval_response", "mcp_call", "mcp_list_tools", "program", "program_output"),
    *("shell_call", "shell_call_output", "tool_search_call", "tool_search_output", "web_search_call"),
}


def _openai_item_type(value: str) -> str:
    # A namespaced type is a platform's own (the agent runtime's agent_runtime:function_call): its reader decides.
    if value not in OPENAI_ITEM_TYPES and ":" not in value:
        supported = ", ".join(f"'{kind}'" for kind in sorted(_ITEM_TYPES))
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": supported})
    return value


class OtherItem(LooseModel):
    """An item type OpenAI knows and this node does not take (server tools' calls); refused by type."""

    type: Annotated[str, AfterValidator(_openai_item_type)]


def _item_kind(value: Any) -> str:
    if isinstance(value, dict) and value.get("type") is None and "role" not in value and "id" in value:
        return "item_reference"
    role = isinstance(value, dict) and "role" in value
    return tagged(value, _ITEM_TYPES, default="message" if role else None)


InputItem = Annotated[
    Annotated[EasyInputMessage, Tag("message")]
    | Annotated[FunctionCall, Tag("function_call")]
    | Annotated[FunctionCallOutput, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[ItemReference, Tag("item_reference")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_kind),
]
_INPUT_ITEM: TypeAdapter[InputItem] = TypeAdapter(InputItem)


def input_item(data: dict[str, Any]) -> InputItem:
    """One input item from its JSON form (an item kept from an earlier turn)."""
    return _INPUT_ITEM.validate_python(data)


Input = Annotated[Annotated[str, Tag("text")] | Annotated[list[InputItem], Tag("list")], Discriminator(text_or_list)]


# --- request: tools, formats, reasoning -----------------------------------------------------------


class FunctionTool(WireModel):
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: FunctionParameters | None = None
    strict: bool | None = None
    # Codex sends these; the output schema documents what the client will send back.
    output_schema: dict[str, Any] | None = None
    defer_loading: bool | None = None
    # Who may call the function: the model itself ("direct"), or code OpenAI runs for it ("programmatic").
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None


# Tools that OpenAI runs on its own servers: this node has nothing to run them with.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_2025_08_26",
        "web_search_preview",
        "web_search_preview_2025_03_11",
        "file_search",
        "code_interpreter",
        "mcp",
        "image_generation",
        "tool_search",
    }
)
# Tools the client runs, whose calls OpenAI's models write as items of their own (``computer_call``,
# ``local_shell_call``, ``apply_patch_call``, …): this node's models write function calls only.
CLIENT_BUILT_IN_TOOLS = frozenset(
    {"computer", "computer_use", "computer_use_preview", "local_shell", "shell", "apply_patch"}
)
SERVER_TOOLS = HOSTED_TOOLS | CLIENT_BUILT_IN_TOOLS


def why_not_offered(tool_type: str) -> str:
    """Why a built-in tool of OpenAI's (or its calls' items) is not served here."""
    if tool_type in HOSTED_TOOLS or tool_type.startswith("mcp"):
        return "runs on OpenAI's side"
    return "is called by OpenAI's models through items of its own, which this node's models do not write"


# Every type of tool and tool choice OpenAI's API knows. One of them this node does not serve is refused as
# unsupported; any other names no tool at all (a misspelt "functions"), an invalid value.
OPENAI_TOOL_TYPES = SERVER_TOOLS | {"function", "custom", "namespace", "programmatic_tool_calling", "allowed_tools"}


def _openai_tool_type(value: str) -> str:
    if value not in OPENAI_TOOL_TYPES:
        raise PydanticCustomError("literal_error", "Input should be 'function'", {"expected": "'function'"})
    return value


class OtherTool(LooseModel):
    """A tool, or a tool choice, of a type OpenAI knows and this node does not serve; refused by its type."""

    type: Annotated[str, AfterValidator(_openai_tool_type)]


Tool = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(lambda value: tagged(value, frozenset({"function"}))),
]


def _refusal(tool: OtherTool) -> str:
    if tool.type == "namespace":
        # A namespaced function's calls must come back and be replayed with their namespace, which the
        # function_call items here do not carry: refused whole rather than half served.
        name = (tool.model_extra or {}).get("name")
        named = f" {json.dumps(name)}" if isinstance(name, str) else ""
        return (
            f"namespace tools are not supported: offer the functions of the namespace{named} as top-level "
            "function tools; a request here offers function tools only"
        )
    why = why_not_offered(tool.type) if tool.type in SERVER_TOOLS else "is not supported"
    return f"the {tool.type} tool {why}; a request here offers function tools only"


class ToolChoiceFunction(WireModel):
    type: Literal["function"]
    name: str


AllowedTool = Annotated[
    Annotated[ToolChoiceFunction, Tag("function")] | Annotated[OtherTool, Tag("other")],
    Discriminator(lambda value: tagged(value, frozenset({"function"}))),
]


class ToolChoiceAllowed(WireModel):
    """Calls only to these tools, in ``mode`` auto or required; ``tools`` still lists every tool."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[AllowedTool]


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("mode")]
    | Annotated[ToolChoiceFunction, Tag("function")]
    | Annotated[ToolChoiceAllowed, Tag("allowed_tools")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(tool_choice_kind),
]


class FormatText(WireModel):
    type: Literal["text"]


class FormatJSONObject(WireModel):
    type: Literal["json_object"]


class FormatJSONSchema(WireModel):
    type: Literal["json_schema"]
    name: FunctionName
    schema_: JSONSchema = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[FormatText | FormatJSONObject | FormatJSONSchema, Field(discriminator="type")]


class TextConfig(WireModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


ReasoningSummary = Literal["auto", "concise", "detailed"]


class Reasoning(WireModel):
    effort: ReasoningEffort | None = None
    summary: ReasoningSummary | None = None
    generate_summary: ReasoningSummary | None = None
    # OpenAI's execution modes are open-ended strings ("standard", "pro"…); this node has only the standard one.
    mode: str | None = None
    # Which earlier turns' reasoning the model sees: here its chat template decides, which is OpenAI's "auto".
    context: Literal["auto", "current_turn", "all_turns"] | None = None


# OpenAI's ``include`` values: one it does not know is an invalid value, not a parameter this node lacks.
Include = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
# ``include`` values with a meaning here; the others ask for results of server tools.
INCLUDE_LOGPROBS = "message.output_text.logprobs"
INCLUDABLE = frozenset(
    {
        INCLUDE_LOGPROBS,
        # Reasoning comes back as plain reasoning_text, which is all a stateless turn needs.
        "reasoning.encrypted_content",
        # Input images are never stored, so there is nothing to include and nothing lost.
        "message.input_image.image_url",
    }
)

STATELESS = "this node stores nothing: send the whole conversation as input on every turn"


class GatewayResponseRequest(LooseModel):
    """What the gateway reads of a Responses body it forwards (whether it streams, what it may cost): the rest goes
    to the upstream as sent, for it to judge."""

    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    input: str | list[dict[str, Any]] | None = None
    max_output_tokens: Annotated[int, Field(ge=1)] | None = None

    @property
    def output_cap(self) -> int | None:
        return self.max_output_tokens


def duplicate_item(item_id: str) -> APIError:
    """OpenAI's refusal of an item given twice: in one input, or sent again after ``previous_response_id``'s."""
    return invalid_request(
        f"Duplicate item found with id {item_id}. Remove duplicate items from your input and try again.", param="input"
    )


class ResponseCreateRequest(WireModel):
    model: ModelId
    input: Input
    instructions: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=16)] | None = None
    max_tool_calls: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: Reasoning | None = None
    include: list[Include] | None = None
    metadata: Metadata | None = None
    user: str | None = None
    safety_identifier: Annotated[str, Field(max_length=64)] | None = None
    prompt_cache_key: str | None = None
    # Strings OpenAI's own clients (Codex) attach to every request for OpenAI's logs: nothing to do with them here.
    client_metadata: dict[str, str] | None = None
    # Caching hints, best-effort at OpenAI too: accepted, with no effect here.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: ServiceTierResponses | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Known but refused: accepted by the schema so they can be refused by name.
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    background: bool | None = None
    context_management: list[Any] | None = None
    moderation: dict[str, Any] | None = None
    # This platform's: which way the request goes (a request for the gateway is forwarded, not parsed here).
    route: Literal["node", "gateway"] | None = None

    # Known parameters refused by name when set, with why.
    REFUSED: ClassVar[Mapping[str, str]] = {
        "previous_response_id": f"previous_response_id is not supported: {STATELESS}",
        "conversation": f"conversation is not supported: {STATELESS}",
        "prompt": "stored prompts are not supported: send instructions and input instead",
        "context_management": "server-side context management is not supported",
        "moderation": "moderation is not supported on this node",
        "background": f"background mode is not supported: {STATELESS}",
    }

    # Whether ``tool_choice: required`` needs a function tool in ``tools`` (or can be met by tools run elsewhere).
    REQUIRED_NEEDS_TOOLS: ClassVar[bool] = True
    # Whether the input must hold a message to respond to (a request that is only counted need not).
    NEEDS_A_MESSAGE: ClassVar[bool] = True

    def refuse_unsupported(self) -> None:
        for name, message in self.REFUSED.items():
            value = getattr(self, name)
            if value is not None and not (name == "background" and value is False):
                raise unsupported_parameter(name, message)
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported_parameter("service_tier", f"service_tier {self.service_tier!r} is not offered")
        if self.stream_options is not None and not self.stream:
            raise stream_options_without_stream()
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise unsupported_parameter("text.verbosity", "verbosity is not supported on this model")
        if isinstance(self.text_format, FormatJSONObject) and not mentions_json(self._texts()):
            raise invalid_request(
                "Response input messages must contain the word 'json' in some form to use 'text.format' of type "
                "'json_object'.",
                param="input",
            )
        for index, value in enumerate(self.include or ()):
            if value not in INCLUDABLE:
                raise unsupported_parameter(f"include.{index}", f"include {value!r} is not offered here")
        ids = [id for _, id in self.echoed_ids()]
        if (repeated := first_repeated(ids)) is not None:
            raise duplicate_item(ids[repeated])
        self._check_reasoning()
        self._check_tools()

    def echoed_ids(self) -> list[tuple[int, str]]:
        """The ids of the input items that carry one (items a response gave, sent back), with their indexes; not
        the ids item references name."""
        if isinstance(self.input, str):
            return []
        return [
            (index, item_id)
            for index, item in enumerate(self.input)
            if not isinstance(item, ItemReference)
            and isinstance(item_id := (item.model_extra or {}).get("id"), str)
            and item_id
        ]

    def _texts(self) -> Iterator[str]:
        """The instructions and the text of every input message."""
        if self.instructions is not None:
            yield self.instructions
        if isinstance(self.input, str):
            yield self.input
            return
        for item in self.input:
            if isinstance(item, EasyInputMessage):
                if isinstance(item.content, str):
                    yield item.content
                else:
                    yield from (part.text for part in item.content if isinstance(part, InputText | OutputText))

    def _check_reasoning(self) -> None:
        if self.reasoning is None:
            return
        if self.reasoning.mode not in (None, "standard"):
            raise unsupported_parameter(
                "reasoning.mode",
                f"reasoning mode {self.reasoning.mode!r} is not offered: this node has the standard mode only",
            )
        if self.reasoning.context not in (None, "auto"):
            # Replayed reasoning reaches the chat template, whose own rule says which turns' reasoning it renders.
            raise unsupported_parameter(
                "reasoning.context",
                f"reasoning context {self.reasoning.context!r} is not supported: the model's chat template decides "
                "which turns' reasoning it sees; leave it auto",
            )

    def _check_tools(self) -> None:
        names: set[str] = set()
        for index, tool in enumerate(self.tools or ()):
            if isinstance(tool, OtherTool):
                raise unsupported_parameter(f"tools.{index}.type", _refusal(tool))
            if tool.defer_loading:
                raise unsupported_parameter(
                    f"tools.{index}.defer_loading", "deferred tools need tool search, which runs on OpenAI's side"
                )
            if tool.allowed_callers is not None and "direct" not in tool.allowed_callers:
                # A function only code may call would be called here by the model or by nobody: neither was asked.
                raise unsupported_parameter(
                    f"tools.{index}.allowed_callers",
                    'allowed_callers leaves out "direct": this node\'s model calls functions itself, and programmatic '
                    "calls need code that runs on OpenAI's side",
                )
            if tool.name in names:
                raise invalid_request("Tool names must be unique.", param=f"tools.{index}.name", code="invalid_value")
            names.add(tool.name)
        choice = self.tool_choice
        if isinstance(choice, OtherTool):
            raise unsupported_parameter("tool_choice", f"tool_choice of type {choice.type!r} is not supported")
        if isinstance(choice, ToolChoiceFunction) and choice.name not in names:
            raise invalid_request(
                f"tool_choice names the function {choice.name!r}, which is not in tools.",
                param="tool_choice.name",
                code="invalid_value",
            )
        if isinstance(choice, ToolChoiceAllowed):
            self._check_allowed(choice, names)
        if choice == "required" and not names and self.REQUIRED_NEEDS_TOOLS:
            raise invalid_request(
                "tool_choice 'required' needs at least one tool.", param="tool_choice", code="invalid_value"
            )

    @staticmethod
    def _check_allowed(choice: ToolChoiceAllowed, names: set[str]) -> None:
        if not choice.tools:
            raise invalid_request(
                "allowed_tools needs at least one tool.", param="tool_choice.tools", code="invalid_value"
            )
        for index, allowed in enumerate(choice.tools):
            if isinstance(allowed, OtherTool):
                raise unsupported_parameter(
                    f"tool_choice.tools.{index}.type", f"the {allowed.type} tool is not supported; only function tools"
                )
            if allowed.name not in names:
                raise invalid_request(
                    f"tool_choice allows the function {allowed.name!r}, which is not in tools.",
                    param=f"tool_choice.tools.{index}.name",
                    code="invalid_value",
                )

    @property
    def function_tools(self) -> list[FunctionTool]:
        return [tool for tool in self.tools or () if isinstance(tool, FunctionTool)]

    @property
    def text_format(self) -> FormatText | FormatJSONObject | FormatJSONSchema | None:
        return self.text.format if self.text is not None else None

    @property
    def wants_logprobs(self) -> bool:
        return INCLUDE_LOGPROBS in (self.include or ())

    @property
    def reasoning_effort(self) -> str | None:
        return self.reasoning.effort if self.reasoning is not None else None

    def param_names(self) -> ParamNames:
        items = [] if isinstance(self.input, str) else self.input
        images = (
            f"input.{index}.content.{part_index}"
            for index, item in enumerate(items)
            if isinstance(item, EasyInputMessage) and not isinstance(item.content, str)
            for part_index, part in enumerate(item.content)
            if isinstance(part, InputImage)
        )
        return ParamNames(
            prompt="input",
            output_limit="max_output_tokens",
            tool_schemas={
                tool.name: f"tools.{index}.parameters"
                for index, tool in enumerate(self.tools or ())
                if isinstance(tool, FunctionTool)
            },
            output_format="text.format",
            output_schema="text.format.schema",
            reasoning="reasoning.effort",
            image=next(images, None),
        )


# --- response: the Response object and its output items -------------------------------------------


def function_tool_echo(tool: FunctionTool) -> dict[str, Any]:
    """The tool as applied: ``strict`` is the client's value, or null when it left it unset."""
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


def text_format_echo(fmt: FormatText | FormatJSONObject | FormatJSONSchema | None) -> dict[str, Any]:
    if isinstance(fmt, FormatJSONSchema):
        echo: dict[str, Any] = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
        if fmt.description is not None:
            echo["description"] = fmt.description
        return echo
    return {"type": "text" if fmt is None else fmt.type}


def response_object(
    *,
    response_id: str,
    created_at: int,
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"],
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    completed_at: int | None = None,
    error: dict[str, Any] | None = None,
    incomplete_reason: str | None = None,
    echo: dict[str, Any],
) -> dict[str, Any]:
    """A Response; ``echo`` holds the request's settings as applied (see ``request_echo``)."""
    response = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "completed_at": completed_at,
        "error": error,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "output": output,
        **echo,
    }
    if usage is not None:
        response["usage"] = usage  # OpenAI's schema has no null usage: until it is known, it is left out
    return response


class TokenCountRequest(ResponseCreateRequest):
    """``TokenCountsBody``: a Responses request's input and what shapes its prompt, nothing of how it would run."""

    COUNTED: ClassVar[frozenset[str]] = frozenset(
        {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning"}
        | {"truncation", "previous_response_id", "conversation", "personality"}
    )
    NEEDS_A_MESSAGE: ClassVar[bool] = False
    REFUSED: ClassVar[Mapping[str, str]] = {
        **ResponseCreateRequest.REFUSED,
        "personality": "personality is not supported: the model has no style presets",
    }

    personality: str | None = None

    # Optional, as in TokenCountsBody: instructions and tools alone are counted too.
    input: Input = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def refuse_uncounted(cls, body: Any) -> Any:
        """A Responses parameter that counting takes no part of (``stream``, ``max_output_tokens``) is unknown here, as
        at OpenAI: refused as such in the body as sent, before any value is checked."""
        if isinstance(body, Mapping) and (uncounted := sorted(set(body) - cls.COUNTED)):
            raise unknown_parameter(str(uncounted[0]))
        return body


def input_tokens_object(input_tokens: int) -> dict[str, Any]:
    """``TokenCountsResource``: what ``POST /responses/input_tokens`` answers."""
    return {"object": "response.input_tokens", "input_tokens": input_tokens}


def request_echo(request: ResponseCreateRequest, *, tool_choice: str | dict[str, Any]) -> dict[str, Any]:
    """The parts of a Response that repeat the request's settings, as applied."""
    reasoning = request.reasoning
    echo: dict[str, Any] = {
        "model": request.model,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": request.max_tool_calls,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": None,
        "conversation": None,
        "background": False,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None,
        },
        "service_tier": "default",
        "store": False,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "top_logprobs": request.top_logprobs or 0,
        "text": {"format": text_format_echo(request.text_format), "verbosity": "medium"},
        "tool_choice": tool_choice,
        "tools": [function_tool_echo(tool) for tool in request.function_tools],
        "truncation": request.truncation or "disabled",
        "safety_identifier": request.safety_identifier,
        "prompt_cache_key": request.prompt_cache_key,
        "prompt_cache_retention": request.prompt_cache_retention,
        "metadata": request.metadata or {},
    }
    if request.user is not None:
        echo["user"] = request.user  # OpenAI's schema has no null user: unset, it is left out
    return echo


def output_text_part(
    text: str, logprobs: list[dict[str, Any]] | None = None, annotations: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": annotations or [], "logprobs": logprobs or []}


def refusal_part(refusal: str) -> dict[str, Any]:
    return {"type": "refusal", "refusal": refusal}


def url_citation(*, url: str, title: str, start_index: int, end_index: int) -> dict[str, Any]:
    return {"type": "url_citation", "url": url, "title": title, "start_index": start_index, "end_index": end_index}


def reasoning_text_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


ItemStatus = Literal["in_progress", "completed", "incomplete"]


def message_item(*, item_id: str, status: ItemStatus, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def function_call_item(*, item_id: str, status: ItemStatus, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(*, item_id: str, status: ItemStatus, content: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "status": status,
        "summary": [],
        "content": content,
        "encrypted_content": None,
    }


# --- stream events --------------------------------------------------------------------------------
# Each builder returns the event without its ``sequence_number``, which the encoder numbers.


def lifecycle_event(
    kind: Literal["created", "in_progress", "completed", "incomplete", "failed"], response: dict[str, Any]
) -> dict[str, Any]:
    return {"type": f"response.{kind}", "response": response}


def output_item_event(kind: Literal["added", "done"], *, output_index: int, item: dict[str, Any]) -> dict[str, Any]:
    return {"type": f"response.output_item.{kind}", "output_index": output_index, "item": item}


class ContentRef(TypedDict):
    """Where a content event belongs: the item, its place in the output, and the part within it."""

    item_id: str
    output_index: int
    content_index: int


def content_part_event(kind: Literal["added", "done"], at: ContentRef, part: dict[str, Any]) -> dict[str, Any]:
    return {"type": f"response.content_part.{kind}", **at, "part": part}


def output_text_delta_event(at: ContentRef, delta: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "response.output_text.delta", **at, "delta": delta, "logprobs": logprobs}


def output_text_done_event(
    at: ContentRef, text: str, logprobs: list[dict[str, Any]], annotations: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """``annotations``, when given, repeats the part's complete list (OpenAI's event leaves it out)."""
    event = {"type": "response.output_text.done", **at, "text": text, "logprobs": logprobs}
    if annotations is not None:
        event["annotations"] = annotations
    return event


def annotation_added_event(at: ContentRef, annotation_index: int, annotation: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "response.output_text.annotation.added",
        **at,
        "annotation_index": annotation_index,
        "annotation": annotation,
    }


def refusal_delta_event(at: ContentRef, delta: str) -> dict[str, Any]:
    return {"type": "response.refusal.delta", **at, "delta": delta}


def refusal_done_event(at: ContentRef, refusal: str) -> dict[str, Any]:
    return {"type": "response.refusal.done", **at, "refusal": refusal}


# A failed Response's ``error.code`` is one of OpenAI's ``ResponseErrorCode``s; the ``error`` event before it
# carries the API's own code. ``server_error`` tells a client to try again: what the same request cannot get by
# trying again (a prompt past the context, a stored conversation that is full, a schema too costly to enforce, a key
# revoked or expired while it ran; OpenAI's codes have none for a key) is ``invalid_prompt``.
_FAILED_RESPONSE_CODES = {
    "rate_limited": "rate_limit_exceeded",
    "invalid_api_key": "invalid_prompt",
    "conversation_too_large": "invalid_prompt",
    "previous_response_not_found": "invalid_prompt",
    **dict.fromkeys(REQUEST_FAULT_CODES, "invalid_prompt"),
}


def failed_response_code(error_code: str | None) -> str:
    """A failed Response's ``error.code`` for the API's error code that ended it (None: a fault of the server's)."""
    return _FAILED_RESPONSE_CODES.get(error_code or "", "server_error")


def error_event(*, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": message, "param": param}


def reasoning_text_delta_event(at: ContentRef, delta: str) -> dict[str, Any]:
    return {"type": "response.reasoning_text.delta", **at, "delta": delta}


def reasoning_text_done_event(at: ContentRef, text: str) -> dict[str, Any]:
    return {"type": "response.reasoning_text.done", **at, "text": text}


def function_call_arguments_delta_event(*, item_id: str, output_index: int, delta: str) -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.delta",
        "item_id": item_id,
        "output_index": output_index,
        "delta": delta,
    }


def function_call_arguments_done_event(*, item_id: str, output_index: int, name: str, arguments: str) -> dict[str, Any]:
    return {
        "type": "response.function_call_arguments.done",
        "item_id": item_id,
        "output_index": output_index,
        "name": name,
        "arguments": arguments,
    }
