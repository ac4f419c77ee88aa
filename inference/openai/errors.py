"""OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Every error body the API sends is an ``APIError``'s ``body()``, built here: the wire format raises them for
what a request says wrong, and ``from_exception`` maps the domain's exceptions to them. The renderer
(``inference.api.errors``) turns them into HTTP responses.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from core.outages import unavailable_service
from inference.engine.exceptions import (
    CapabilityMissing,
    ChatTemplateRefused,
    ContextLengthExceeded,
    ModelNotServed,
    ModelUnavailable,
    NotStarted,
    OutputLimitTooLarge,
    Overloaded,
    PenaltyNotApplied,
    SchemaNotEnforceable,
    TooManyTopLogprobs,
)
from orgs.exceptions import InvalidAPIKey, LimitExceeded

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
# Every refusal but a rate limit is an invalid_request_error, as OpenAI's are (a bad key and an unknown model
# included); an upstream's own types are known too, to pass them through the gateway.
ERROR_TYPES = frozenset(
    {INVALID_REQUEST, RATE_LIMIT, SERVER, "authentication_error", "not_found_error", "permission_error"}
)


class APIError(Exception):
    """An error the client sees. ``status`` is the HTTP status; the rest is OpenAI's error object."""

    def __init__(
        self,
        message: str,
        *,
        code: str,
        status: int = 400,
        param: str | None = None,
        type: str = INVALID_REQUEST,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.status = status
        self.param = param
        self.type = type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True, slots=True)
class ParamNames:
    """Where a request's parts are, in its API's own parameter names: how an error found below the API names them.

    Each parsed request offers its own (``param_names()``); the defaults are chat completions'.
    """

    prompt: str = "messages"
    output_limit: str = "max_tokens"  # the output-token limit the client used
    tools: str = "tools"
    tool_schemas: Mapping[str, str] = field(default_factory=dict)  # a function tool's name: where its schema is
    output_format: str = "response_format"
    output_schema: str = "response_format.json_schema.schema"
    reasoning: str = "reasoning_effort"
    top_logprobs: str = "top_logprobs"
    image: str | None = None  # the first image in the conversation


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(message, code=code, param=param)


def stream_options_without_stream() -> APIError:
    return invalid_request(
        "stream_options is only allowed when stream is true.", param="stream_options", code="invalid_value"
    )


def unsupported_parameter(param: str, message: str | None = None) -> APIError:
    return APIError(message or f"{param} is not supported", code="unsupported_parameter", param=param)


def unknown_parameter(param: str) -> APIError:
    """OpenAI's refusal of a parameter the endpoint does not have."""
    return APIError(f"Unrecognized request argument supplied: {param}", code="unknown_parameter", param=param)


def model_missing(message: str, *, code: str = "model_not_available") -> APIError:
    """A 404 naming ``model``: the model the request asked for is not to be had here."""
    return APIError(message, code=code, status=404, param="model")


def model_not_available(model: str) -> APIError:
    return model_missing(
        f"The model {model!r} is not served on this node (GET /v1/infer/models lists the models you can use; "
        'one offered through the gateway is sent there with "route": "gateway").'
    )


def invalid_api_key() -> APIError:
    return APIError(
        "Incorrect or missing API key. Send 'Authorization: Bearer <key>' with an active key.",
        code="invalid_api_key",
        status=401,
    )


def internal_error() -> APIError:
    return APIError(
        "The server had an error while processing your request.", code="internal_error", status=500, type=SERVER
    )


def body_too_large() -> APIError:
    return APIError(
        f"The request body is larger than the limit of {settings.MAX_REQUEST_BODY_BYTES} bytes.",
        code="request_too_large",
        status=413,
    )


def body_too_complex(limit: int, what: str) -> APIError:
    return APIError(f"The request body holds more than {limit} {what}.", code="request_too_large", status=413)


def not_json() -> APIError:
    return APIError(
        "Send the request body as JSON with 'Content-Type: application/json'.",
        code="unsupported_media_type",
        status=415,
    )


def content_coding_refused(coding: str) -> APIError:
    # Not decompressed: a compressed body's size says nothing of what it inflates to. RFC 7694: the 415
    # names the codings that are accepted.
    return APIError(
        f"Request bodies with 'Content-Encoding: {coding[:64]}' are not accepted: send the body uncompressed.",
        code="unsupported_media_type",
        status=415,
        headers={"Accept-Encoding": "identity"},
    )


def not_found() -> APIError:
    return APIError("No API endpoint at this path.", code="not_found", status=404)


def stored_responses_not_offered(why: str) -> APIError:
    """OpenAI's endpoints on one stored response (retrieve, delete, cancel, list its input items), where they are
    not offered: a 404 as for a response not found, saying why."""
    return APIError(why, code="not_found", status=404)


def method_not_allowed(detail: str = "Method not allowed.") -> APIError:
    return APIError(detail, code="method_not_allowed", status=405)


def response_timeout(seconds: float) -> APIError:
    return APIError(
        f"The server did not begin its answer within {seconds:g} s.", code="timeout", status=504, type=SERVER
    )


def status_error(status: int) -> APIError:
    """The error for a bare HTTP status produced outside the API's own code."""
    if status == 404:
        return not_found()
    if status == 405:
        return method_not_allowed()
    if status == 413:
        return body_too_large()
    if status >= 500:
        return internal_error()
    return APIError("The request was refused.", code="invalid_request", status=status)


def service_unavailable() -> APIError:
    """Redis or the database cannot be reached for now: the request may succeed when retried."""
    retry = settings.OUTAGE_RETRY_AFTER_SECONDS
    return APIError(
        f"The service is temporarily unavailable. Try again in {retry} seconds.",
        code="service_unavailable",
        status=503,
        type=SERVER,
        headers={"Retry-After": str(retry)},
    )


# Generation failures that are the deployment's state, not the request's: worth retrying later.
UNAVAILABLE_CODES = ("no_worker", "model_not_available", "service_unavailable", "overloaded", "server_shutting_down")

# What a failed generation is called in front of the client, by the failure's code. The runner's own words
# (file paths, a library's message, a queue's name) are for the log, never for the client.
GENERATION_FAILURES: Mapping[str, str] = {
    "no_worker": "no model worker is serving this model",
    "overloaded": "the model is serving as many requests as it can hold",
    "service_unavailable": "the service became temporarily unavailable",
    "worker_lost": "the model worker stopped responding mid-generation",
    "server_shutting_down": "the server shut down before the answer was complete; retry the request",
    "runner_unavailable": "the model could not be loaded",
    "model_not_available": "the model is not available on this node",
    "context_length_exceeded": "the prompt and its answer do not fit the model's context",
    "invalid_constraint": "the output's constraint could not be enforced",
    "constraint_too_costly": "the output's constraint took too long to enforce for one token; simplify its schema",
    "unsupported_parameter": "the model's sampler does not apply a parameter the request set",
    "invalid_api_key": "the API key was revoked or expired, or its organization deactivated, during the answer",
}
# What a job that never started is told, where a failure's own words speak of an answer under way.
NOT_STARTED: Mapping[str, str] = {"server_shutting_down": "the server is shutting down"}
# Failures the request's own content caused once it ran: a 400, not a server fault.
REQUEST_FAULT_CODES = ("constraint_too_costly", "context_length_exceeded", "unsupported_parameter")


def generation_failed(code: str, *, request_id: str) -> APIError:
    """A generation that failed once it ran (the runner raised, no worker took the job, the worker was lost, Redis
    went away under it)."""
    what = GENERATION_FAILURES.get(code, "the model failed while generating the response")
    message = f"Generation failed: {what}. Quote the request id {request_id} when you report it."
    if code in UNAVAILABLE_CODES:
        headers = {"Retry-After": str(settings.OUTAGE_RETRY_AFTER_SECONDS)}
        return APIError(message, code=code, status=503, type=SERVER, headers=headers)
    if code in REQUEST_FAULT_CODES:
        return APIError(message, code=code, status=400, type=INVALID_REQUEST)
    if code == "invalid_api_key":
        return APIError(message, code=code, status=401, type=INVALID_REQUEST)
    return APIError(message, code=code, status=500, type=SERVER)


def from_exception(exc: BaseException, names: ParamNames | None = None) -> APIError | None:
    """OpenAI's error for an exception raised below the API, naming ``names``' parameters; ``None`` for a
    genuine server fault."""
    if isinstance(exc, APIError):
        return exc
    names = names or ParamNames()
    if isinstance(exc, ModelNotServed):
        return model_not_available(exc.model_id)
    if isinstance(exc, ModelUnavailable):
        # Why the runner cannot load (a path, a missing package) is the operator's to read in the log.
        return APIError(
            f"The model {exc.model_id!r} cannot be served on this node right now.",
            code="model_not_available",
            status=503,
            type=SERVER,
        )
    if isinstance(exc, CapabilityMissing):
        return _capability_missing(exc, names)
    if isinstance(exc, ContextLengthExceeded):
        return _context_length_exceeded(exc, names)
    if isinstance(exc, SchemaNotEnforceable):
        if exc.all_tools:
            param = names.tools
        else:
            param = names.output_schema if exc.tool is None else names.tool_schemas.get(exc.tool, names.tools)
        return APIError(
            f"The model {exc.model_id!r} cannot enforce the schema in {param}: {exc.problem}",
            code="invalid_value",
            param=param,
        )
    if isinstance(exc, OutputLimitTooLarge):
        return invalid_request(
            f"{names.output_limit} is too large: {exc.asked}. This model supports at most {exc.most} completion "
            f"tokens, whereas you provided {exc.asked}.",
            param=names.output_limit,
            code="invalid_value",
        )
    if isinstance(exc, TooManyTopLogprobs):
        return invalid_request(
            f"The model {exc.model_id!r} returns at most {exc.most} top_logprobs.",
            param=names.top_logprobs,
            code="invalid_value",
        )
    if isinstance(exc, PenaltyNotApplied):
        return unsupported_parameter(
            exc.parameter,
            f"The model {exc.model_id!r} does not apply {exc.parameter}: leave it out, or send 0.",
        )
    if isinstance(exc, ChatTemplateRefused):
        return invalid_request(
            f"The model's chat template cannot render these messages: {exc.detail}", param=names.prompt
        )
    if isinstance(exc, NotStarted):
        what = NOT_STARTED.get(exc.code) or GENERATION_FAILURES.get(exc.code, "no model runner could take the request")
        return APIError(
            f"Generation could not start: {what}. Try again in {exc.retry_after} seconds.",
            code=exc.code,
            status=503,
            type=SERVER,
            headers={**exc.headers, "Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, Overloaded):
        # 429 is the caller's own limits; a server without room for more work answers 503, as OpenAI's does.
        return APIError(
            f"The model {exc.model_id!r} is serving as many requests as it can hold; try again shortly.",
            code="overloaded",
            status=503,
            type=SERVER,
            headers={**exc.headers, "Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, InvalidAPIKey):
        return invalid_api_key()
    if unavailable_service(exc) is not None:
        return service_unavailable()
    if isinstance(exc, LimitExceeded):
        # A request no wait would admit gets no Retry-After, and OpenAI's SDKs, which retry a 429 by themselves,
        # are told not to.
        retry = {"x-should-retry": "false"} if exc.retry_after is None else {"Retry-After": str(exc.retry_after)}
        return APIError(exc.detail, code="rate_limited", status=429, type=RATE_LIMIT, headers={**exc.headers, **retry})
    return None


def _capability_missing(exc: CapabilityMissing, names: ParamNames) -> APIError:
    model = exc.model_id
    if exc.capability == "tools":
        return unsupported_parameter(names.tools, f"the model {model!r} does not support tool calls")
    if exc.capability == "reasoning":
        return unsupported_parameter(
            names.reasoning,
            f"the model {model!r} does not reason: leave {names.reasoning} unset, "
            "or ask for an effort of none or minimal",
        )
    if exc.capability == "json_schema":
        return unsupported_parameter(names.output_format, f"the model {model!r} does not support structured output")
    return invalid_request(
        f"The model {model!r} does not accept image input.", param=names.image, code="unsupported_content"
    )


def _context_length_exceeded(exc: ContextLengthExceeded, names: ParamNames) -> APIError:
    # In each API's own words: chat's messages and completion, a Response's input and output.
    prompt = names.prompt
    answer = "completion" if prompt == "messages" else "output"
    if exc.prompt_too_long or exc.requested_output is None:
        # With tools described to the model, they take their room too: told, so that a client with long tools and a
        # short conversation knows what to shorten.
        read = shorten = prompt
        if exc.tools_in_prompt:
            read, shorten = f"{prompt} and {names.tools}", f"{prompt} or {names.tools}"
        return invalid_request(
            f"This model's maximum context length is {exc.context_length} tokens. However, your {read} resulted "
            f"in {'at least ' if exc.at_least else ''}{exc.prompt_tokens} tokens. Please reduce the length of the "
            f"{shorten}.",
            param=prompt,
            code="context_length_exceeded",
        )
    return invalid_request(
        f"This model's maximum context length is {exc.context_length} tokens. However, you requested "
        f"{exc.prompt_tokens + exc.requested_output} tokens ({exc.prompt_tokens} in the {prompt}, "
        f"{exc.requested_output} in the {answer}). Please reduce the length of the {prompt} or {answer}.",
        # OpenAI's chat names the messages here; a Response, whose input fits, names the output limit to lower.
        param=prompt if prompt == "messages" else names.output_limit,
        code="context_length_exceeded",
    )
