"""Operations endpoints: ``/metrics`` for Prometheus and ``/health`` for load balancers. Neither takes an API key."""

from __future__ import annotations

import hmac

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from inference.usage import health as health_checks
from inference.usage import metrics as prometheus


@never_cache
@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    """Prometheus' text format; behind ``Authorization: Bearer <METRICS_TOKEN>`` when that is set."""
    token = settings.METRICS_TOKEN
    if token and not hmac.compare_digest(request.headers.get("Authorization", "").encode(), f"Bearer {token}".encode()):
        response = HttpResponse(
            "Send 'Authorization: Bearer <METRICS_TOKEN>'.\n", status=401, content_type="text/plain; charset=utf-8"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    body, content_type = prometheus.exposition(request.headers.get("Accept", ""))
    return HttpResponse(body, content_type=content_type)


@never_cache
@require_GET
async def health(request: HttpRequest) -> JsonResponse:
    """200 when the deployment can serve (``ok`` or ``degraded``), 503 when it cannot (``down``)."""
    result = await health_checks.check()
    return JsonResponse(result.as_dict(), status=result.http_status)
