"""What the API knows of one request beyond DRF's: its id, the route it took, and its parameters' names.

The middleware opens the context (``request.api_context``) for every API request; the view fills in the
route and, once the body is parsed, the request's parameter names, which the error renderer uses to
name what went wrong below the API in the API's own terms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from inference.openai.errors import ParamNames


@dataclass(slots=True)
class RequestContext:
    request_id: str
    route: str | None = None
    params: ParamNames | None = None


def context_of(request: Any) -> RequestContext | None:
    """The context of a Django or DRF request (DRF's reads through to Django's); ``None`` off the API."""
    context = getattr(request, "api_context", None)
    return context if isinstance(context, RequestContext) else None
