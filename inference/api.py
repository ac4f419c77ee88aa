"""The node API's views: validate, call one service, render."""

from __future__ import annotations

from datetime import date, datetime, timedelta
from datetime import timezone as dt_timezone
from typing import Any, get_args

from asgiref.sync import sync_to_async
from django.http import HttpResponse, HttpResponseBase, StreamingHttpResponse
import orjson
from rest_framework.request import Request
from rest_framework.response import Response

from . import protocol, reports, services
from .errors import APIError, invalid_request
from .catalog import get_enabled_model, list_enabled_models
from .models import CatalogEntry
from .apiview import AsyncAPIView
from .protocol.responses import ResponseCreateRequest


def _model_object(entry: CatalogEntry) -> dict[str, Any]:
    return protocol.model_object(
        model_id=entry.public_id,
        created=int(entry.created.timestamp()),
        owned_by=entry.owned_by,
        capabilities=entry.capabilities(),
    )


def _caller(request: Request) -> services.Caller:
    request._request.infer_route = "node"
    return services.Caller(api_key=request.auth, request_id=request._request.request_id)


def render_result(request: Request, result: services.Result) -> HttpResponseBase:
    request._request.infer_route = result.route
    response: HttpResponseBase
    if result.stream is not None:
        response = StreamingHttpResponse(result.stream, content_type="text/event-stream; charset=utf-8")
        response["Cache-Control"] = "no-cache"
        response["X-Accel-Buffering"] = "no"
    else:
        response = HttpResponse(orjson.dumps(result.body), content_type="application/json")
    for name, value in result.headers.items():
        response[name] = value
    return response


class ModelListView(AsyncAPIView):
    http_method_names = ["get"]
    async def get(self, request: Request) -> Response:
        return Response(protocol.model_list([_model_object(entry) for entry in await list_enabled_models()]))


class ModelDetailView(AsyncAPIView):
    http_method_names = ["get"]
    async def get(self, request: Request, model_id: str) -> Response:
        return Response(_model_object(await get_enabled_model(model_id)))


def _gateway_bound(request: Request) -> dict[str, Any] | None:
    """The body, if it asks for the gateway route; it is forwarded as sent, not validated as a node request."""
    data = request.data
    if isinstance(data, dict) and data.get("route") == "gateway":
        request._request.infer_route = "gateway"
        return data
    return None


class ChatCompletionsView(AsyncAPIView):
    http_method_names = ["post"]

    async def post(self, request: Request) -> HttpResponseBase:
        caller = _caller(request)
        if (body := _gateway_bound(request)) is not None:
            result = await services.forward_to_gateway(body=body, caller=caller, path="chat/completions", endpoint="chat.completions")
            return render_result(request, result)
        params = protocol.parse(protocol.ChatCompletionRequest, request.data)
        return render_result(request, await services.create_chat_completion(params=params, caller=caller))


class ResponsesView(AsyncAPIView):
    # POST only: a GET, or a WebSocket upgrade that serve hands over as one, is answered 405 with Allow: POST.
    http_method_names = ["post"]

    async def post(self, request: Request) -> HttpResponseBase:
        caller = _caller(request)
        if (body := _gateway_bound(request)) is not None:
            result = await services.forward_to_gateway(body=body, caller=caller, path="responses", endpoint="responses")
            return render_result(request, result)
        params = protocol.parse(ResponseCreateRequest, request.data)
        return render_result(request, await services.create_response(params=params, caller=caller))


# --- usage ---------------------------------------------------------------------------------------

USAGE_PARAMS = ("start", "end", "group_by")
DEFAULT_USAGE_DAYS = 7


def _usage_param_error(name: str, message: str) -> APIError:
    return invalid_request(f"Invalid value for '{name}': {message}", param=name, code="invalid_value")


def _usage_day(raw: str, *, name: str, ceil: bool) -> date:
    """A UTC day from an ISO date, an ISO datetime or unix seconds. ``ceil``: a moment after midnight
    counts its whole day (for the exclusive ``end``)."""
    try:
        if raw.lstrip("-").isdigit():
            moment = datetime.fromtimestamp(int(raw), dt_timezone.utc)
        elif len(raw) == 10:
            return date.fromisoformat(raw)
        else:
            moment = datetime.fromisoformat(raw.replace("Z", "+00:00"))
            moment = moment.astimezone(dt_timezone.utc) if moment.tzinfo else moment.replace(tzinfo=dt_timezone.utc)
    except (ValueError, OverflowError, OSError):
        raise _usage_param_error(name, "use a date (2025-01-31), an ISO 8601 time or unix seconds.") from None
    day = moment.date()
    return day + timedelta(days=1) if ceil and moment != reports.day_start(day) else day


def _usage_query(params: Any) -> tuple[date, date, reports.GroupBy]:
    for name in params:
        if name not in USAGE_PARAMS:
            raise APIError(f"Unrecognized request argument supplied: {name}", code="unknown_parameter", param=name)
    group_by = params.get("group_by") or "day"
    if group_by not in get_args(reports.GroupBy):
        raise _usage_param_error("group_by", "use day, model or key.")
    end = reports.utc_today() + timedelta(days=1)
    if params.get("end"):
        end = _usage_day(params["end"], name="end", ceil=True)
    start = end - timedelta(days=DEFAULT_USAGE_DAYS)
    if params.get("start"):
        start = _usage_day(params["start"], name="start", ceil=False)
    if start >= end:
        raise _usage_param_error("end", "'end' must be after 'start' (it is exclusive).")
    if (end - start).days > reports.MAX_REPORT_DAYS:
        raise _usage_param_error("start", f"the range may span at most {reports.MAX_REPORT_DAYS} days.")
    return start, end, group_by


def _usage_numbers(tally: reports.Tally) -> dict[str, Any]:
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


def _usage_result(group: reports.UsageGroup, group_by: reports.GroupBy) -> dict[str, Any]:
    result: dict[str, Any] = {"object": "organization.usage.result"}
    if group_by == "day":
        assert group.day is not None
        result |= {"date": group.day.isoformat(), "start_time": int(reports.day_start(group.day).timestamp())}
    elif group_by == "model":
        result["model"] = group.model
    else:
        result["api_key"] = {"prefix": group.key.display_prefix, "name": group.key.name} if group.key else None
    return result | _usage_numbers(group.tally)


class UsageView(AsyncAPIView):
    """The caller's organization's own usage (never another's): ``?start=&end=&group_by=day|model|key``.

    Days are UTC days; ``start`` is inclusive and ``end`` exclusive (as in OpenAI's usage API); both
    take a date, an ISO 8601 time or unix seconds. The default is the last seven days, today included.
    """

    http_method_names = ["get"]

    async def get(self, request: Request) -> Response:
        start, end, group_by = _usage_query(request.query_params)
        organization = request.user
        groups, total = await sync_to_async(reports.organization_usage, thread_sensitive=False)(
            organization_id=organization.pk, start=start, end=end, group_by=group_by
        )
        return Response(
            {
                "object": "organization.usage",
                "organization": organization.slug,
                "start": start.isoformat(),
                "end": end.isoformat(),
                "start_time": int(reports.day_start(start).timestamp()),
                "end_time": int(reports.day_start(end).timestamp()),
                "group_by": group_by,
                "data": [_usage_result(group, group_by) for group in groups],
                "total": _usage_numbers(total),
            }
        )
