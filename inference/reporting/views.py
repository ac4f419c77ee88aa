"""The admin's usage report page: filters, charts, and the CSV export of what it shows."""

from __future__ import annotations

import csv
from typing import Any

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse

from inference.usage.reports import Report, Tally, build_report

from .charts import Series, lines, stacked_bars
from .forms import UsageReportForm

BLUE, AMBER, RED = "#417690", "#e09b26", "#ba2121"

# Who may read the report: whoever may view the usage records it is made of.
PERMISSION = "inference.view_usagerecord"

# A cell a spreadsheet would read as a formula starts with one of these; model names and error codes come
# from clients and upstreams, so any of them may.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r", "\n")

CSV_COLUMNS = [
    "section", "name", "requests", "errors", "input_tokens", "output_tokens", "reasoning_tokens", "cached_tokens",
    "total_tokens", "ttft_p50_ms", "ttft_p95_ms", "latency_p50_ms", "latency_p95_ms",
]  # fmt: skip


def usage_report(request: HttpRequest) -> HttpResponse:
    """The admin's usage report (staff only: wrapped in ``admin.site.admin_view`` by the URLconf), for the staff who
    may view usage records: it shows every organization's."""
    if not request.user.has_perm(PERMISSION):
        raise PermissionDenied
    form = UsageReportForm(request.GET)
    report = build_report(form.usage_filter()) if form.is_valid() else None
    if request.GET.get("format") == "csv":
        if report is None:
            return HttpResponse(_errors_as_text(form), status=400, content_type="text/plain; charset=utf-8")
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


def _errors_as_text(form: UsageReportForm) -> str:
    """The form's errors as plain text (Django's own ``as_text`` escapes them for HTML)."""
    return "".join(
        f"{'' if field == '__all__' else f'{field}: '}{error['message']}\n"
        for field, errors in form.errors.get_json_data().items()
        for error in errors
    )


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
    rows: list[list[Any]] = [CSV_COLUMNS, _csv_line("total", "all", report.total)]
    rows += [_csv_line("day", day.isoformat(), tally) for day, tally in report.days]
    rows += [_csv_line("organization", slug, tally) for slug, tally in report.organizations]
    rows += [_csv_line("model", model, tally) for model, tally in report.models]
    rows += [["error_code", code, "", count, *[""] * (len(CSV_COLUMNS) - 4)] for code, count in report.error_codes]
    csv.writer(response).writerows([csv_cell(value) for value in row] for row in rows)
    return response


def csv_cell(value: Any) -> Any:
    """``value`` as a spreadsheet shows it and never runs it: text that would start a formula gets a leading
    apostrophe, which spreadsheets take as "this is text"."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value
