"""The API's one error vocabulary and its one renderer.

Every error of every API path leaves as ``{"error": {"message", "type", "param", "code"}}``. Domain
exceptions (orgs' ``InvalidAPIKey`` and ``LimitExceeded``, runner failures) are mapped here; nothing
else in the project builds an error body.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from rest_framework import exceptions as drf_exceptions

from orgs.exceptions import InvalidAPIKey, LimitExceeded

logger = logging.getLogger("inference.errors")

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


def model_not_available(model: str, *, gateway_hint: bool = True) -> APIError:
    hint = ' Add "route": "gateway" to send the request to the gateway.' if gateway_hint else ""
    return APIError(
        f"The model {model!r} is not served on this node.{hint}",
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
    return APIError("The server had an error while processing your request.", code="internal_error", status=500, type=SERVER)


def to_api_error(exc: BaseException) -> APIError | None:
    """Map any exception that has a client-facing meaning; ``None`` for a genuine server fault."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidAPIKey | drf_exceptions.NotAuthenticated | drf_exceptions.AuthenticationFailed):
        return invalid_api_key()
    if isinstance(exc, LimitExceeded):
        return APIError(
            exc.detail,
            code="rate_limited",
            status=429,
            type=RATE_LIMIT,
            param=None,
            headers={**exc.headers, "Retry-After": str(exc.retry_after)},
        )
    if isinstance(exc, RequestDataTooBig):
        return body_too_large()
    if isinstance(exc, drf_exceptions.ParseError):
        return invalid_request(f"The request body is not valid JSON: {exc.detail}", code="invalid_json")
    if isinstance(exc, drf_exceptions.UnsupportedMediaType):
        return APIError(
            "Send the request body as JSON with 'Content-Type: application/json'.",
            code="unsupported_media_type",
            status=415,
        )
    if isinstance(exc, drf_exceptions.MethodNotAllowed):
        return method_not_allowed(str(exc.detail))
    if isinstance(exc, drf_exceptions.NotFound):
        return not_found()
    if isinstance(exc, drf_exceptions.PermissionDenied):
        return APIError(str(exc.detail), code="permission_denied", status=403, type=PERMISSION)
    if isinstance(exc, drf_exceptions.APIException):
        return APIError(str(exc.detail), code=str(exc.default_code), status=exc.status_code)
    return None


def body_too_large() -> APIError:
    from django.conf import settings

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


def render(error: APIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def render_exception(exc: BaseException, *, request_id: str | None = None) -> JsonResponse:
    error = to_api_error(exc)
    if error is None:
        logger.error("unhandled error in request %s", request_id or "-", exc_info=exc)
        error = internal_error()
    return render(error)


def drf_exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse:
    request = context.get("request")
    response = render_exception(exc, request_id=getattr(request, "request_id", None))
    if isinstance(exc, drf_exceptions.MethodNotAllowed) and (view := context.get("view")) is not None:
        response["Allow"] = ", ".join(view.allowed_methods)
    return response


API_PATH_PREFIXES = ("/v1/",)


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATH_PREFIXES)


# Django-level handlers for API paths that no DRF view reaches (see config.urls).
def handler404(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if not is_api_path(request.path):
        from django.views.defaults import page_not_found

        return page_not_found(request, exception or Exception())
    return render(not_found())


def handler500(request: HttpRequest) -> HttpResponse:
    return render(internal_error())


def handler400(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if isinstance(exception, RequestDataTooBig):
        return render(body_too_large())
    return render(invalid_request("Bad request."))
