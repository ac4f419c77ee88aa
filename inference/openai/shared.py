"""What chat completions, Responses and the agent runtime's wire format share.

The base request models and how a body is parsed (an invalid one names the exact parameter), the
JSON-schema and function-name rules, metadata bounds, the models API's objects, and the one home of
the builders both response families use: usage objects, logprobs, stream options.
"""

from __future__ import annotations

import re
import time
from collections.abc import Hashable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import orjson
from jsonschema.exceptions import SchemaError
from jsonschema.validators import Draft202012Validator, validator_for
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError, WithJsonSchema

from inference.engine.decoding import parameters_problem
from inference.models import MODEL_ID, MODEL_ID_RULE, is_model_id

from .errors import APIError, invalid_request, unknown_parameter, unsupported_parameter

MAX_TOOLS = 128
# The error type of a validator that refuses something OpenAI's API knows but this one does not serve.
UNSUPPORTED = "unsupported_parameter"
# A function's or a format's name: its length is checked first, so that a long name is reported as too long.
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]

LogprobItems = list[tuple[bytes, float, list[tuple[bytes, float]]]]  # token, its logprob, the top alternatives


class WireModel(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, strict=True)


class LooseModel(BaseModel):
    """Objects whose unknown fields are tolerated (clients echo back what they received)."""

    model_config = ConfigDict(extra="allow", strict=True)


def declared_fields(model: BaseModel) -> dict[str, Any]:
    """``model`` as JSON with only the fields its classes declare, at every depth: what a ``LooseModel`` let
    through without knowing it (ids and annotations clients echo back, or anything else) is left out."""
    return model.model_dump(mode="json", exclude_none=True, exclude=_undeclared(model) or None)


def _undeclared(value: Any) -> dict[Any, Any]:
    """Pydantic's ``exclude`` for the undeclared fields in ``value``, nested as ``value`` is."""
    if isinstance(value, BaseModel):
        spec: dict[Any, Any] = dict.fromkeys(value.model_extra or {}, True)
        for name in type(value).model_fields:
            if inner := _undeclared(getattr(value, name)):
                spec[name] = inner
        return spec
    if isinstance(value, list):
        return {index: inner for index, item in enumerate(value) if (inner := _undeclared(item))}
    return {}


# --- parsing a body -------------------------------------------------------------------------------


def _param(loc: tuple[Any, ...], data: Any, *, missing: bool = False) -> str:
    """The dotted path of a validation error in the request body (``messages.1.content``).

    Pydantic's locations also hold union members and discriminator tags (``literal['auto']``, ``list``,
    ``assistant``); walking the body keeps only the parts that address it, and a missing field's name.
    A tag is the member's ``type``, which a body may also hold as a key (``{"type": "function", "function":
    {...}}``, Chat Completions' shape sent to Responses): of the readings, the first that addresses the field
    the error is about (a missing one absent, any other present) is the one meant.
    """
    readings = _readings(loc, data, missing=missing)
    first, landed = next(readings)
    if not landed:
        first = next((parts for parts, landed in readings if landed), first)
    return ".".join(first)


def _readings(loc: tuple[Any, ...], node: Any, *, missing: bool) -> Iterator[tuple[list[str], bool]]:
    """The ways ``loc`` addresses the body at ``node``: the parts that do, and whether its last part is one."""
    if not loc:
        yield [], False
        return
    part, rest = loc[0], loc[1:]
    if isinstance(node, dict) and isinstance(part, str) and (part in node or (not rest and missing)):
        for parts, landed in _readings(rest, node.get(part), missing=missing):
            yield [part, *parts], landed or (not rest and (part in node) is not missing)
        if node.get("type") != part:
            return
    elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        for parts, landed in _readings(rest, node[part], missing=missing):
            yield [str(part), *parts], landed or not rest
        return
    yield from _readings(rest, node, missing=missing)


def first_repeated(values: Sequence[Hashable]) -> int | None:
    """The index of the first value that came before too, or None when each is its own."""
    seen: set[Hashable] = set()
    for index, value in enumerate(values):
        if value in seen:
            return index
        seen.add(value)
    return None


def validation_error(exc: ValidationError, data: Any) -> APIError:
    first = exc.errors(include_url=False)[0]
    kind = first["type"]
    param = _param(tuple(first["loc"]), data, missing=kind == "missing")
    if kind == "extra_forbidden":
        return unknown_parameter(param)
    if kind == UNSUPPORTED:
        return unsupported_parameter(param, first["msg"])
    if (tagged_error := _tag_error(kind, first, param) or _literal_error(kind, first, param)) is not None:
        return tagged_error
    if kind == "missing":
        return invalid_request(
            f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter"
        )
    if (sized := _in_openai_words(kind, first, param)) is not None:
        return sized
    message = re.sub(r" or instance of \w+", "", first["msg"])  # the class names behind a union are not the API's
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return invalid_request(f"Invalid value for '{param}': {message}.", param=param or None, code="invalid_value")


def _tag_error(kind: str, error: Any, param: str) -> APIError | None:
    """An object of a tagged union (a message by its ``role``, a content part or a format by its ``type``) whose
    tag is missing or unknown: named, as OpenAI names it, at the tag itself (``messages.0.role``), not at the
    object, and in OpenAI's words rather than pydantic's."""
    if kind not in ("union_tag_invalid", "union_tag_not_found"):
        return None
    given, field = error.get("input"), str((error.get("ctx") or {}).get("discriminator", "")).strip("'")
    if not isinstance(given, dict) or not re.fullmatch(r"[a-z_]+", field):
        return None  # a tag worked out by a function, or a value that is no object: the generic words fit
    where = f"{param}.{field}" if param else field
    if field not in given:
        return invalid_request(
            f"Missing required parameter: '{where}'.", param=where, code="missing_required_parameter"
        )
    tag = given[field]
    if not isinstance(tag, str):
        return invalid_type(where, "a string", tag)
    return _not_supported(tag, error["ctx"].get("expected_tags", "").split(", "), param=where)


def _literal_error(kind: str, error: Any, param: str) -> APIError | None:
    """A value outside a fixed set (``reasoning_effort: "extreme"``), with the set, in OpenAI's words."""
    expected = (error.get("ctx") or {}).get("expected")
    if kind != "literal_error" or not isinstance(expected, str):
        return None
    return _not_supported(error.get("input"), re.split(r", | or ", expected), param=param)


def _not_supported(given: Any, supported: list[str], *, param: str) -> APIError:
    shown = repr(given[:64]) if isinstance(given, str) else orjson.dumps(given).decode()[:64]
    listed = " and ".join(supported) if len(supported) < 3 else f"{', '.join(supported[:-1])}, and {supported[-1]}"
    return invalid_request(
        f"Invalid value: {shown}. Supported values are: {listed}.", param=param or None, code="invalid_value"
    )


_BOUNDS = {
    "greater_than_equal": ("ge", "below minimum", "min", ">="),
    "greater_than": ("gt", "below minimum", "min", ">"),
    "less_than_equal": ("le", "above maximum", "max", "<="),
    "less_than": ("lt", "above maximum", "max", "<"),
}


# What a field of each pydantic type expects, and what a JSON value is, in OpenAI's words.
_EXPECTED = {
    **dict.fromkeys(("int_type", "int_parsing", "int_from_float"), "an integer"),
    **dict.fromkeys(("float_type", "float_parsing"), "a decimal"),
    "string_type": "a string",
    **dict.fromkeys(("bool_type", "bool_parsing"), "a boolean"),
    "list_type": "an array",
    **dict.fromkeys(("dict_type", "model_type", "model_attributes_type"), "an object"),
}
_GIVEN: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"),
    (int, "an integer"),
    (float, "a decimal number"),
    (str, "a string"),
    (list, "an array"),
    (dict, "an object"),
)


def invalid_type(param: str, expected: str, given: Any) -> APIError:
    """OpenAI's refusal of a value of the wrong JSON type: ``expected`` says what the parameter takes."""
    what = "null" if given is None else next((name for kind_, name in _GIVEN if isinstance(given, kind_)), "null")
    return invalid_request(
        f"Invalid type for '{param}': expected {expected}, but got {what} instead.", param=param, code="invalid_type"
    )


def _in_openai_words(kind: str, error: Any, param: str) -> APIError | None:
    """OpenAI's own words and codes for a value of the wrong type, a number out of its range, or an array or a
    string of the wrong size."""
    ctx, given = error.get("ctx") or {}, error.get("input")
    if kind in _EXPECTED and (given is None or any(isinstance(given, kind_) for kind_, _ in _GIVEN)):
        expected = _EXPECTED[kind]
        if kind == "list_type" and tuple(error["loc"])[-1:] == ("list",):  # text or parts (``text_or_list``)
            items = {"input": "input items", "stop": "strings"}.get(param, "objects")
            expected = f"one of a string or array of {items}"
        elif param == "tool_choice":  # a mode's name, or a tool's object
            expected = "one of a string or an object"
        return invalid_type(param, expected, given)
    if kind in _BOUNDS and isinstance(given, int | float) and not isinstance(given, bool):
        key, words, end, sign = _BOUNDS[kind]
        bound = ctx[key]
        number, shown = ("decimal", f"{bound:g}") if isinstance(bound, float) else ("integer", str(bound))
        return invalid_request(
            f"Invalid '{param}': {number} {words} value. Expected a value {sign} {shown}, but got {given} instead.",
            param=param,
            code=f"{number}_{words.split()[0]}_{end}_value",
        )
    if kind == "too_long" and isinstance(given, list):
        return invalid_request(
            f"Invalid '{param}': array too long. Expected an array with maximum length {ctx['max_length']}, "
            f"but got an array with length {len(given)} instead.",
            param=param,
            code="array_above_max_length",
        )
    if kind == "too_long" and isinstance(given, dict):
        return invalid_request(
            f"Invalid '{param}': too many properties. Expected an object with at most {ctx['max_length']} "
            f"properties, but got an object with {len(given)} properties instead.",
            param=param,
            code="object_above_max_properties",
        )
    if kind == "too_short" and isinstance(given, list) and not given:
        return invalid_request(
            f"Invalid '{param}': empty array. Expected an array with minimum length {ctx['min_length']}, "
            "but got an empty array instead.",
            param=param,
            code="empty_array",
        )
    if kind == "string_too_long" and isinstance(given, str):
        return invalid_request(
            f"Invalid '{param}': string too long. Expected a string with maximum length {ctx['max_length']}, "
            f"but got a string with length {len(given)} instead.",
            param=param,
            code="string_above_max_length",
        )
    return None


Model = TypeVar("Model", bound=BaseModel)


def parse(model: type[Model], data: Any) -> Model:
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    budget = _schema_budget.set(_Budget(MOST_SUBSCHEMAS_CHECKED))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, data) from None
    finally:
        _schema_budget.reset(budget)


# --- rules both request families apply -------------------------------------------------------------


# Checking a schema against JSON Schema's own schema costs about 0.3 ms a subschema, and a pattern's compilation
# grows with its length: a request's schemas (its tools' and its format's) are given at most this much of it, counted
# first, so that a body of tens of thousands of subschemas is refused before the check rather than after seconds
# of it. No runner's grammar takes schemas that large.
MOST_SUBSCHEMAS_CHECKED = 4096
MOST_PATTERN_CHARACTERS = 10_000


@dataclass(slots=True)
class _Budget:
    left: int


_schema_budget: ContextVar[_Budget | None] = ContextVar("schema_budget", default=None)


def _checking_cost_problem(schema: dict[str, Any]) -> str | None:
    """What makes ``schema`` too costly to check, found by one walk that counts its objects against the request's
    budget (each schema its own outside a request) and measures its patterns; None when it may be checked."""
    budget = _schema_budget.get() or _Budget(MOST_SUBSCHEMAS_CHECKED)
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(item for item in node if isinstance(item, dict | list))
            continue
        budget.left -= 1
        if budget.left < 0:
            return f"the request's schemas hold more than {MOST_SUBSCHEMAS_CHECKED} objects in all"
        patterns = [node.get("pattern")]
        if isinstance(named := node.get("patternProperties"), dict):
            patterns += named
        if any(isinstance(pattern, str) and len(pattern) > MOST_PATTERN_CHARACTERS for pattern in patterns):
            return f"a pattern is longer than {MOST_PATTERN_CHARACTERS} characters"
        stack.extend(value for value in node.values() if isinstance(value, dict | list))
    return None


def _json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A JSON schema valid under its own ``$schema`` draft (2020-12 when it names none), once its size allows the
    check."""
    if problem := _checking_cost_problem(schema):
        raise ValueError(f"too large a JSON schema: {problem}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(part) for part in exc.path)
        raise ValueError(f"not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else "")) from None
    except (OverflowError, RecursionError) as exc:  # a pattern's count past what a regex holds, groups nested past it
        raise ValueError(f"not a valid JSON schema: a pattern no regular expression engine takes ({exc})") from None
    return schema


JSONSchema = Annotated[dict[str, Any], AfterValidator(_json_schema)]


def _function_parameters(schema: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters: a JSON schema of an object, as OpenAI requires (arguments are a JSON object), with
    ``type`` left out or ``"object"``."""
    if "type" in schema and schema["type"] != "object":
        given = orjson.dumps(schema["type"]).decode()
        raise ValueError(f'function parameters must be a JSON schema of type "object", not of type {given}')
    if problem := parameters_problem(schema):
        raise ValueError(problem)
    return schema


FunctionParameters = Annotated[JSONSchema, AfterValidator(_function_parameters)]


def _model_id(value: str) -> str:
    """A client's ``model`` reaches catalog lookups, usage records and metrics only in the catalog's form."""
    if not is_model_id(value):
        raise ValueError(MODEL_ID_RULE)
    return value


ModelId = Annotated[
    str,
    AfterValidator(_model_id),
    WithJsonSchema({"type": "string", "pattern": MODEL_ID.replace("\\Z", "$"), "maxLength": 200}),
]


def tagged(value: Any, known: frozenset[str], *, default: str | None = None) -> str:
    """A union member's tag: the ``type`` of ``value`` when it is one of ``known``, else ``"other"`` (a member that
    names the type it was sent with, to refuse it by name)."""
    kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
    return kind if isinstance(kind, str) and kind in known else "other"


def text_or_list(value: Any) -> str:
    """Tags a ``str | list[...]`` field (content as text or as parts) so that a bad part is reported at its own
    index, not as a string that the list is not."""
    return "text" if isinstance(value, str) else "list"


def tool_choice_kind(value: Any) -> str:
    """Tags a ``tool_choice``: a mode (``"auto"``…), a named function, allowed tools, or another kind, refused by
    its type."""
    return "mode" if isinstance(value, str) else tagged(value, frozenset({"function", "allowed_tools"}))


# OpenAI's service tiers: one it does not know is an invalid value; one this node does not offer is refused by name.
ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
ServiceTierResponses = Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"]
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


# OpenAI's metadata: at most 16 pairs, keys of at most 64 characters and values of at most 512.
Metadata = Annotated[
    dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]],
    Field(max_length=16),
]


class StreamOptions(WireModel):
    """``stream_options`` as Responses takes it; chat completions' adds ``include_usage``."""

    include_obfuscation: bool | None = None


# --- models -------------------------------------------------------------------------------------


def model_object(
    *, model_id: str, created: int, owned_by: str, capabilities: dict[str, bool], route: Literal["node", "gateway"]
) -> dict[str, Any]:
    b3os = {**capabilities, "route": route}
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by, "b3os": b3os}


def model_list(models: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": models}


# --- usage and logprobs in responses ----------------------------------------------------------------


def completion_usage(
    *, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0, reasoning_tokens: int = 0
) -> dict[str, Any]:
    """Chat completions' ``CompletionUsage``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": reasoning_tokens,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def response_usage(
    *, input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int
) -> dict[str, Any]:
    """Responses' ``ResponseUsage``."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


def token_name(token: bytes) -> str:
    """A logprob's ``token``: its text, or, for a piece of a character (which no string holds), ``bytes:`` and
    the bytes escaped, as OpenAI names one ("bytes:\\xf0\\x9f"; ``bytes`` gives the bytes themselves). Bytes
    that are text stay text (``backslashreplace``): how OpenAI names a token mixing both is not documented."""
    try:
        return token.decode()
    except UnicodeDecodeError:
        return "bytes:" + token.decode(errors="backslashreplace")


def logprob_objects(items: LogprobItems) -> list[dict[str, Any]]:
    """Logprobs with their bytes: a chat completion's ``content`` logprobs, a Responses ``output_text``'s."""
    return [
        {
            "token": token_name(token),
            "logprob": logprob,
            "bytes": list(token),
            "top_logprobs": [{"token": token_name(t), "logprob": lp, "bytes": list(t)} for t, lp in top],
        }
        for token, logprob, top in items
    ]


def delta_logprob_objects(items: LogprobItems) -> list[dict[str, Any]]:
    """Logprobs of a Responses text delta event (``ResponseLogProb``: without bytes)."""
    return [
        {
            "token": token_name(token),
            "logprob": logprob,
            "top_logprobs": [{"token": token_name(t), "logprob": lp} for t, lp in top],
        }
        for token, logprob, top in items
    ]


def mentions_json(texts: Iterator[str]) -> bool:
    """Whether any of a request's texts names JSON, which OpenAI requires of a request for JSON mode: the model must
    be told in words what it is asked to write, or it fills its budget with whitespace."""
    return any("json" in text.lower() for text in texts)


def now() -> int:
    return int(time.time())


def dumps(payload: Any) -> str:
    return orjson.dumps(payload).decode()
