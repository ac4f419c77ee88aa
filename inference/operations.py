"""Operations pages: the admin's usage report, ``/metrics`` and ``/health``. None takes an API key."""

from __future__ import annotations

import csv
import hmac
from typing import Any

from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import health as health_checks
from . import metrics as prometheus
from .charts import Series, lines, stacked_bars
from .forms import UsageReportForm
from .reports import Report, Tally, build_report

BLUE, AMBER, RED = "#417690", "#e09b26", "#ba2121"

CSV_COLUMNS = [
    "section", "name", "requests", "errors", "input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens",
    "total_tokens", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms", "latency_p95_ms",
]  # fmt: skip


def usage_report(request: HttpRequest) -> HttpResponse:
    """The admin's usage report (staff only: wrapped in ``admin.site.admin_view`` by the URLconf)."""
    form = UsageReportForm(request.GET)
    report = build_report(form.usage_filter()) if form.is_valid() else None
    if request.GET.get("format") == "csv":
        if report is None:
            return HttpResponse(form.errors.as_text(), status=400, content_type="text/plain; charset=utf-8")
        return _csv_response(report)
    query = request.GET.copy()
    query["format"] = "csv"
    context = {
        **admin.site.each_context(request),
        "title": "Usage report",
        "form": form,
        "report": report,
        "charts": _charts(report) if report else None,
        "csv_query": query.urlencode(),
    }
    return TemplateResponse(request, "admin/usage_report.html", context)


def _charts(report: Report) -> dict[str, Any]:
    days = [day.isoformat() for day, _ in report.days]
    ticks = [day.strftime("%b %d") for day, _ in report.days]
    tallies = [tally for _, tally in report.days]
    return {
        "requests": stacked_bars(
            title="Requests per day",
            labels=days,
            ticks=ticks,
            series=[
                Series("ok", "succeeded", BLUE, [t.ok for t in tallies]),
                Series("errors", "failed", RED, [t.errors for t in tallies]),
            ],
        ),
        "tokens": stacked_bars(
            title="Tokens per day",
            labels=days,
            ticks=ticks,
            series=[
                Series("input_tokens", "input", BLUE, [t.input_tokens for t in tallies]),
                Series("output_tokens", "output", AMBER, [t.output_tokens for t in tallies]),
            ],
        ),
        "latency": lines(
            title="Latency per day (ms)",
            labels=days,
            ticks=ticks,
            unit="",
            series=[
                Series("latency_p50", "latency p50", BLUE, [t.latency_p50 for t in tallies]),
                Series("latency_p95", "latency p95", RED, [t.latency_p95 for t in tallies]),
                Series("ttft_p50", "TTFT p50", AMBER, [t.ttft_p50 for t in tallies]),
            ],
        ),
    }


def _csv_line(section: str, name: str, t: Tally) -> list[Any]:
    return [
        section, name, t.requests, t.errors, t.input_tokens, t.output_tokens, t.reasoning_tokens, t.cached_tokens,
        t.total_tokens, t.ttft_p50, t.ttft_p95, t.latency_p50, t.latency_p95,
    ]  # fmt: skip


def _csv_response(report: Report) -> HttpResponse:
    """Everything the page shows, one table: a ``section`` column says which part of the page a row is."""
    usage = report.usage
    name = f"usage-{usage.start.isoformat()}-{usage.days[-1].isoformat()}.csv"
    response = HttpResponse(content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{name}"'
    writer = csv.writer(response)
    writer.writerow(CSV_COLUMNS)
    writer.writerow(_csv_line("total", "all", report.total))
    for day, tally in report.days:
        writer.writerow(_csv_line("day", day.isoformat(), tally))
    for slug, tally in report.organizations:
        writer.writerow(_csv_line("organization", slug, tally))
    for model, tally in report.models:
        writer.writerow(_csv_line("model", model, tally))
    for code, count in report.error_codes:
        writer.writerow(["error_code", code, "", count, *[""] * (len(CSV_COLUMNS) - 4)])
    return response


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
