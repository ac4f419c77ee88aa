"""The API's one error renderer: every exception that leaves an API view becomes an HTTP response here.

Errors in OpenAI's terms, and the domain's exceptions mapped to them (``inference.openai.errors``, with the
request's parameter names from its context), DRF's and Django's own; anything else is logged and answered
as a 500. Every error of every API path leaves as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.defaults import page_not_found
from rest_framework import exceptions as drf_exceptions

from core.outages import unavailable_service
from inference.engine.exceptions import NotStarted
from inference.openai.errors import (
    APIError,
    ParamNames,
    body_too_large,
    from_exception,
    internal_error,
    invalid_api_key,
    invalid_request,
    method_not_allowed,
    not_found,
    not_json,
)
from inference.usage import metrics

from .context import RequestContext, context_of

logger = logging.getLogger("inference.api.errors")


def to_api_error(exc: BaseException, names: ParamNames | None = None) -> APIError | None:
    """Map any exception that has a client-facing meaning, naming ``names``' parameters; ``None`` for a genuine
    server fault."""
    if (error := from_exception(exc, names)) is not None:
        return error
    if isinstance(exc, drf_exceptions.NotAuthenticated | drf_exceptions.AuthenticationFailed):
        return invalid_api_key()
    if isinstance(exc, RequestDataTooBig):
        return body_too_large()
    if isinstance(exc, drf_exceptions.ParseError):
        return invalid_request(f"The request body is not valid JSON: {exc.detail}", code="invalid_json")
    if isinstance(exc, drf_exceptions.UnsupportedMediaType):
        return not_json()
    if isinstance(exc, drf_exceptions.MethodNotAllowed):
        return method_not_allowed(str(exc.detail))
    if isinstance(exc, drf_exceptions.NotFound):
        return not_found()
    if isinstance(exc, drf_exceptions.PermissionDenied):
        return APIError(str(exc.detail), code="permission_denied", status=403)
    if isinstance(exc, drf_exceptions.APIException):
        return APIError(str(exc.detail), code=str(exc.default_code), status=exc.status_code)
    return None


def render(error: APIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def render_exception(exc: BaseException, context: RequestContext | None) -> JsonResponse:
    """The response for ``exc``, in the terms of the request's API when the view has parsed it."""
    if (service := unavailable_service(exc)) is not None:
        # An outage, not a bug: one line each, no traceback (there would be one per request while it lasts).
        logger.warning("%s unavailable: %s: %s", service, type(exc).__name__, exc)
        metrics.unavailable(service)
    elif isinstance(exc, NotStarted) and exc.outage is not None:  # said in the log where the job failed to start
        metrics.unavailable(exc.outage)
    error = to_api_error(exc, context.params if context else None)
    if error is None:
        logger.error("unhandled error in request %s", context.request_id if context else "-", exc_info=exc)
        metrics.INTERNAL_ERRORS.inc()
        error = internal_error()
    return render(error)


def drf_exception_handler(exc: Exception, context: dict[str, Any]) -> HttpResponse:
    response = render_exception(exc, context_of(context.get("request")))
    if isinstance(exc, drf_exceptions.MethodNotAllowed) and (view := context.get("view")) is not None:
        response["Allow"] = ", ".join(view.allowed_methods)
    return response


API_PATH_PREFIXES = ("/v1/",)


def is_api_path(path: str) -> bool:
    return path.startswith(API_PATH_PREFIXES)


def is_browser_path(path: str) -> bool:
    """The admin's pages (its reports among them) and their static files: a person in a browser reads their errors,
    so Django's HTML pages stay there. Any other path is asked by a program (a misspelt route: ``/v1``,
    ``//v1/...``, ``/V1/...``), which reads errors as JSON, and gets the API's."""
    return path == "/admin" or path.startswith(("/admin/", settings.STATIC_URL))


# Django-level handlers for paths that no DRF view reaches (see config.urls).
def handler404(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if is_browser_path(request.path):
        return page_not_found(request, exception or Exception())
    return render(not_found())


def handler500(request: HttpRequest) -> HttpResponse:
    metrics.INTERNAL_ERRORS.inc()
    return render(internal_error())


def handler400(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    if isinstance(exception, RequestDataTooBig):
        return render(body_too_large())
    return render(invalid_request("Bad request."))
