"""OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.

Every error body the API sends is an ``APIError``'s ``body()``, built here: the wire format raises them for
what a request says wrong, and ``from_exception`` maps the domain's exceptions to them. The renderer
(``inference.api.errors``) turns them into HTTP responses.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

from orgs.exceptions import InvalidAPIKey, LimitExceeded

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
RATE_LIMIT = "rate_limit_error"
SERVER = "server_error"
PERMISSION = "permission_error"


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


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> APIError:
    return APIError(message, code=code, param=param)


def unsupported_parameter(param: str, message: str | None = None) -> APIError:
    return APIError(message or f"{param} is not supported", code="unsupported_parameter", param=param)


def model_not_available(model: str) -> APIError:
    return APIError(
        f"The model {model!r} is not served on this node. Add \"route\": \"gateway\" to send the request to the gateway.",
        code="model_not_available",
        status=404,
        param="model",
        type=NOT_FOUND,
    )


def invalid_api_key() -> APIError:
    return APIError(
        "Incorrect or missing API key. Send 'Authorization: Bearer <key>' with an active key.",
        code="invalid_api_key",
        status=401,
        type=AUTHENTICATION,
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


def not_found() -> APIError:
    return APIError("No API endpoint at this path.", code="not_found", status=404, type=NOT_FOUND)


def method_not_allowed(detail: str = "Method not allowed.") -> APIError:
    return APIError(detail, code="method_not_allowed", status=405)


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


def from_exception(exc: BaseException) -> APIError | None:
    """OpenAI's error for an exception raised below the API, or ``None`` for a genuine server fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidAPIKey):
        return invalid_api_key()
    if isinstance(exc, LimitExceeded):
        return APIError(
            exc.detail,
            code="rate_limited",
            status=429,
            type=RATE_LIMIT,
            headers={**exc.headers, "Retry-After": str(exc.retry_after)},
        )
    return None
