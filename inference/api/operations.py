"""Operations endpoints: ``/metrics`` for Prometheus and ``/health`` for load balancers. Neither takes an API key.

``/health`` tells anyone whether the deployment can serve; what is wrong (error texts, worker host names,
model paths) only those who hold ``METRICS_TOKEN``.
"""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from inference.usage import health as health_checks
from inference.usage import metrics as prometheus


def _bears_metrics_token(request: HttpRequest) -> bool:
    token = settings.METRICS_TOKEN
    scheme, _, credentials = request.headers.get("Authorization", "").partition(" ")
    # The scheme's name is case-insensitive (RFC 9110).
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(credentials.encode(), token.encode())


# Read only, so no CSRF token to check: a POST is refused by method (405), not as a forgery with Django's HTML page.
@csrf_exempt
@never_cache
@require_safe
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus' text format; behind ``Authorization: Bearer <METRICS_TOKEN>`` when that is set."""
    if settings.METRICS_TOKEN and not _bears_metrics_token(request):
        response = HttpResponse(
            "Send 'Authorization: Bearer <METRICS_TOKEN>'.\n", status=401, content_type="text/plain; charset=utf-8"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    body, content_type = prometheus.exposition(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)


@csrf_exempt
@never_cache
@require_safe
async def health(request: HttpRequest) -> JsonResponse:
    """200 when the deployment can serve (``ok`` or ``degraded``), 503 when it cannot (``down``); with the
    metrics token, what each check found."""
    result = await health_checks.current()
    body = result.as_dict() if _bears_metrics_token(request) else {"status": result.status}
    return JsonResponse(body, status=result.http_status)
