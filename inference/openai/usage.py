"""The usage API's wire format: ``GET /v1/infer/usage``'s query, and the organization usage object."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any, get_args

from inference.openai.errors import APIError, invalid_request, unknown_parameter
from inference.usage import reports


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """UTC days, ``start`` inclusive and ``end`` exclusive."""

    start: date
    end: date
    group_by: reports.GroupBy


PARAMS = ("start", "end", "group_by")
DEFAULT_DAYS = 7


def _param_error(name: str, message: str) -> APIError:
    return invalid_request(f"Invalid value for '{name}': {message}", param=name, code="invalid_value")


def _day(raw: str, *, name: str, ceil: bool) -> date:
    """A UTC day from an ISO date, an ISO datetime or unix seconds. ``ceil``: a moment after midnight
    counts its whole day (for the exclusive ``end``)."""
    try:
        if raw.lstrip("-").isdigit():
            moment = datetime.fromtimestamp(int(raw), UTC)
        elif len(raw) == 10:
            return date.fromisoformat(raw)
        else:
            moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            moment = moment.astimezone(UTC) if moment.tzinfo else moment.replace(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        raise _param_error(name, "use a date (2025-01-31), an ISO 8601 time or unix seconds.") from None
    day = moment.date()
    if not ceil or moment == reports.day_start(day):
        return day
    if day == date.max:
        raise _param_error(name, "the date is out of range.")
    return day + timedelta(days=1)


def parse_query(params: Mapping[str, str]) -> UsageQuery:
    for name in params:
        if name not in PARAMS:
            raise unknown_parameter(name)
    group_by = params.get("group_by") or "day"
    if group_by not in get_args(reports.GroupBy):
        raise _param_error("group_by", "use day, model or key.")
    end = reports.utc_today() + timedelta(days=1)
    if params.get("end"):
        end = _day(params["end"], name="end", ceil=True)
    start = end - timedelta(days=min(DEFAULT_DAYS, (end - date.min).days))
    if params.get("start"):
        start = _day(params["start"], name="start", ceil=False)
    if start >= end:
        if not params.get("end"):  # the default end, tomorrow: the start the client sent is in the future
            raise _param_error("start", "'start' is after today: there is no usage yet.")
        raise _param_error("end", "'end' must be after 'start' (it is exclusive).")
    if (end - start).days > reports.MAX_REPORT_DAYS:
        raise _param_error("start", f"the range may span at most {reports.MAX_REPORT_DAYS} days.")
    return UsageQuery(start, end, group_by)  # type: ignore[arg-type]


def _numbers(tally: reports.Tally) -> dict[str, Any]:
    return {
        "requests": tally.requests,
        "errors": tally.errors,
        "input_tokens": tally.input_tokens,
        "output_tokens": tally.output_tokens,
        "reasoning_tokens": tally.reasoning_tokens,
        "cached_tokens": tally.cached_tokens,
        "total_tokens": tally.total_tokens,
        "time_to_first_token_ms": {"p50": tally.ttft_p50, "p95": tally.ttft_p95},
        "latency_ms": {"p50": tally.latency_p50, "p95": tally.latency_p95},
        "errors_by_code": dict(tally.error_codes.most_common()),
    }


def _result(group: reports.UsageGroup, group_by: reports.GroupBy) -> dict[str, Any]:
    result: dict[str, Any] = {"object": "organization.usage.result"}
    if group_by == "day":
        assert group.day is not None
        result |= {"date": group.day.isoformat(), "start_time": int(reports.day_start(group.day).timestamp())}
    elif group_by == "model":
        result["model"] = group.model
    else:
        result["api_key"] = {"prefix": group.key.display_prefix, "name": group.key.name} if group.key else None
    return result | _numbers(group.tally)


def organization_usage(
    organization: str, query: UsageQuery, groups: list[reports.UsageGroup], total: reports.Tally
) -> dict[str, Any]:
    return {
        "object": "organization.usage",
        "organization": organization,
        "start": query.start.isoformat(),
        "end": query.end.isoformat(),
        "start_time": int(reports.day_start(query.start).timestamp()),
        "end_time": int(reports.day_start(query.end).timestamp()),
        "group_by": query.group_by,
        "data": [_result(group, query.group_by) for group in groups],
        "total": _numbers(total),
    }
