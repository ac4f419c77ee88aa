"""Daily rollups, retention, report numbers, and ``GET /v1/infer/usage`` on records made directly."""

from __future__ import annotations

import asyncio
import csv
import io
import threading
import time as time_module
from collections.abc import Callable
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission, User
from django.core.management import CommandError, call_command
from django.test import Client, override_settings

from inference import tasks
from inference.models import UsageDailyRollup, UsageRecord
from inference.usage import reading as reading_module
from inference.usage import reports
from orgs.models import APIKey, Organization
from orgs.services import create_api_key
from tests.conftest import API

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]

USAGE = "/v1/infer/usage"
MODEL_A = "b3os/model-a"
MODEL_B = "b3os/model-b"


def today() -> date:
    return reports.utc_today()


def days_ago(n: int) -> date:
    return today() - timedelta(days=n)


def noon(day: date) -> datetime:
    return datetime.combine(day, time(12), tzinfo=UTC)


Record = Callable[..., UsageRecord]


@pytest.fixture
def record(organization: Organization) -> Record:
    """Makes a usage record as the request path would have written it."""
    key = APIKey.objects.create(organization=organization, name="factory", prefix="factory001", hashed_key="x")

    def make(
        *, day: date | None = None, organization: Organization = organization, key: APIKey | None = key, **fields: Any
    ) -> UsageRecord:
        values: dict[str, Any] = {
            "model": MODEL_A,
            "endpoint": "chat.completions",
            "status": 200,
            "input_tokens": 100,
            "output_tokens": 20,
            "time_to_first_token_ms": 50,
            "total_ms": 400,
            "request_id": "req_test",
            **fields,
        }
        return UsageRecord.objects.create(
            organization=organization, api_key=key, created=noon(day or today()), **values
        )

    return make


@pytest.fixture
def other_org() -> Organization:
    return Organization.objects.create(slug="globex", name="Globex")


def staff_client() -> Client:
    client = Client()
    client.force_login(User.objects.create(username="boss", is_staff=True, is_superuser=True))
    return client


def rollup_numbers() -> list[tuple[Any, ...]]:
    return sorted(
        UsageDailyRollup.objects.values_list(
            "day", "organization__slug", "model", "requests", "errors", "input_tokens", "output_tokens", "error_codes"
        )
    )


# --- rolling up -----------------------------------------------------------------------------------


def test_a_past_day_rolls_up_into_one_row_per_organization_key_and_model(
    record: Record, other_org: Organization
) -> None:
    yesterday = days_ago(1)
    record(day=yesterday)
    record(day=yesterday, output_tokens=30, reasoning_tokens=5, cached_tokens=40)
    refused = {"input_tokens": 0, "output_tokens": 0, "time_to_first_token_ms": None}
    record(day=yesterday, status=429, error_code="rate_limited", **refused)
    record(day=yesterday, model=MODEL_B, status=200, error_code="generation_failed")
    record(day=yesterday, organization=other_org, key=None, status=500, error_code="")

    assert reports.roll_up() == [yesterday]

    assert rollup_numbers() == [
        (yesterday, "acme", MODEL_A, 3, 1, 200, 50, {"rate_limited": 1}),
        (yesterday, "acme", MODEL_B, 1, 1, 100, 20, {"generation_failed": 1}),
        (yesterday, "globex", MODEL_A, 1, 1, 100, 20, {"http_500": 1}),
    ]
    row = UsageDailyRollup.objects.get(organization__slug="acme", model=MODEL_A)
    assert (row.reasoning_tokens, row.cached_tokens) == (5, 40)
    assert row.time_to_first_token_count == 2 and row.time_to_first_token_ms_sum == 100
    # The refusal is no answer: its time is left out of the latency.
    assert sum(row.total_ms_histogram.values()) == 2 and sum(row.time_to_first_token_histogram.values()) == 2


def test_rolling_up_again_recounts_a_day_instead_of_adding_to_it(record: Record) -> None:
    for n in (1, 2, 5):
        record(day=days_ago(n))
    reports.roll_up()
    first = rollup_numbers()

    assert reports.roll_up() == [days_ago(2), days_ago(1)]  # only the recent days are redone
    assert reports.roll_up_day(days_ago(5)) == 1
    assert rollup_numbers() == first

    record(day=days_ago(1), input_tokens=1)  # a stream that ended after the day was rolled up
    reports.roll_up()
    assert [r[3:6] for r in rollup_numbers() if r[0] == days_ago(1)] == [(2, 0, 101)]


def test_today_is_not_rolled_up_before_it_is_over(record: Record) -> None:
    record(day=today())

    assert reports.roll_up() == []
    with pytest.raises(ValueError):
        reports.roll_up_day(today())
    assert not UsageDailyRollup.objects.exists()


def test_the_command_and_the_celery_task_roll_up(record: Record) -> None:
    record(day=days_ago(3))
    out = io.StringIO()
    call_command("rollup_usage", stdout=out)
    assert "Rolled up 1 day(s)" in out.getvalue()

    UsageDailyRollup.objects.all().delete()
    tasks.rollup_usage.apply()
    assert UsageDailyRollup.objects.count() == 1


def test_the_embedded_server_rolls_up_on_a_thread_of_its_own(record: Record) -> None:
    record(day=days_ago(1))
    stop = threading.Event()

    thread = reports.start_periodic_rollup(interval_seconds=60, stop=stop)
    deadline = time_module.monotonic() + 10
    while not UsageDailyRollup.objects.exists() and time_module.monotonic() < deadline:
        time_module.sleep(0.05)
    stop.set()
    thread.join(timeout=10)

    assert UsageDailyRollup.objects.count() == 1 and not thread.is_alive()


# --- retention ------------------------------------------------------------------------------------


@override_settings(USAGE_RETENTION_DAYS=3)
def test_raw_records_past_retention_are_pruned_once_rolled_up_and_reports_still_count_them(record: Record) -> None:
    for n in (6, 4, 3, 0):
        record(day=days_ago(n))

    result = reports.roll_up_and_prune()

    assert result.pruned == 2
    assert sorted(r.created.date() for r in UsageRecord.objects.all()) == [days_ago(3), today()]
    assert sorted(UsageDailyRollup.objects.values_list("day", flat=True)) == [days_ago(6), days_ago(4), days_ago(3)]
    report = reports.build_report(reports.UsageFilter(start=days_ago(7), end=today() + timedelta(days=1)))
    assert report.total.requests == 4


@override_settings(USAGE_RETENTION_DAYS=3)
def test_pruning_rolls_up_a_day_that_was_never_rolled_up_before_deleting_it(record: Record) -> None:
    record(day=days_ago(10), output_tokens=7)

    assert reports.prune() == 1

    assert list(UsageDailyRollup.objects.values_list("day", "output_tokens")) == [(days_ago(10), 7)]
    with pytest.raises(ValueError, match="raw records pruned"):  # the rollup is all that is left of it
        reports.roll_up_day(days_ago(10))
    assert UsageDailyRollup.objects.count() == 1


@override_settings(USAGE_RETENTION_DAYS=1)
def test_a_record_that_comes_after_its_day_was_pruned_never_replaces_the_days_rollup(record: Record) -> None:
    record(day=days_ago(2), output_tokens=5000)
    reports.roll_up_and_prune()
    record(day=days_ago(2), output_tokens=22)  # written late, after its day's records were pruned

    with pytest.raises(CommandError, match="raw records pruned"):
        call_command("rollup_usage", "--day", days_ago(2).isoformat(), stdout=io.StringIO())
    reports.roll_up()  # the last two days are rolled up again, but not this one: its records are gone

    assert list(UsageDailyRollup.objects.values_list("day", "output_tokens")) == [(days_ago(2), 5000)]


@override_settings(USAGE_RETENTION_DAYS=0)
def test_a_retention_of_zero_keeps_every_raw_record(record: Record) -> None:
    record(day=days_ago(400))

    assert reports.roll_up_and_prune().pruned == 0
    assert UsageRecord.objects.count() == 1


# --- report numbers -------------------------------------------------------------------------------


def test_percentiles_are_within_a_bucket_of_the_exact_values(record: Record) -> None:
    for ms in range(10, 1001, 10):  # p50 = 500, p95 = 950
        record(day=days_ago(1), total_ms=ms, time_to_first_token_ms=ms // 10)

    tally = reports.total(reports.usage_rows(reports.UsageFilter(start=days_ago(1), end=today())))

    assert tally.latency_p50 == pytest.approx(500, rel=0.05)
    assert tally.latency_p95 == pytest.approx(950, rel=0.05)
    assert tally.ttft_p50 == pytest.approx(50, rel=0.05)
    assert tally.ttft_p95 == pytest.approx(95, rel=0.05)


def test_latency_leaves_refusals_out_and_keeps_failures_in(record: Record) -> None:
    for ms in (400, 500, 600):
        record(day=days_ago(1), total_ms=ms)
    for _ in range(10):
        record(day=days_ago(1), status=429, error_code="rate_limited", total_ms=0)
    record(day=days_ago(1), status=400, error_code="invalid_value", total_ms=1)
    for _ in range(2):  # a failure's time is the failure's: an upstream that hangs shows
        record(day=days_ago(1), status=504, error_code="upstream_timeout", total_ms=60_000)

    tally = reports.total(reports.usage_rows(reports.UsageFilter(start=days_ago(1), end=today())))

    assert (tally.requests, tally.errors) == (16, 13)
    assert tally.latency_p50 == pytest.approx(600, rel=0.05)
    assert tally.latency_p95 == pytest.approx(60_000, rel=0.05)


def test_a_day_rolled_up_while_a_report_reads_it_counts_once(record: Record, monkeypatch: pytest.MonkeyPatch) -> None:
    record(day=days_ago(1), output_tokens=7)
    narrow = reports.UsageFilter.narrow

    def rolled_up_meanwhile(self: reports.UsageFilter, queryset: Any) -> Any:
        if queryset.model is UsageDailyRollup and not UsageDailyRollup.objects.exists():
            reports.roll_up_day(days_ago(1))  # another process's rollup, committed between the report's reads
        return narrow(self, queryset)

    monkeypatch.setattr(reports.UsageFilter, "narrow", rolled_up_meanwhile)
    tally = reports.total(reports.usage_rows(reports.UsageFilter(start=days_ago(1), end=today())))

    assert (tally.requests, tally.output_tokens) == (1, 7)


def test_a_report_reads_the_same_from_rollups_as_from_raw_records(record: Record, other_org: Organization) -> None:
    for n, ms in enumerate((30, 300, 3000, 30000)):
        record(day=days_ago(1 + n % 2), total_ms=ms, model=(MODEL_A, MODEL_B)[n % 2])
        record(day=days_ago(1), organization=other_org, key=None, status=429, error_code="rate_limited", total_ms=ms)
    usage = reports.UsageFilter(start=days_ago(3), end=today())
    from_raw = reports.build_report(usage)

    reports.roll_up()
    UsageRecord.objects.all().delete()
    from_rollups = reports.build_report(usage)

    assert from_rollups == from_raw
    assert from_raw.total.requests == 8 and from_raw.total.errors == 4


def test_the_report_has_every_day_the_top_organizations_and_models_and_errors_by_code(
    record: Record, other_org: Organization
) -> None:
    record(day=days_ago(2), input_tokens=1000)
    record(day=days_ago(2), model=MODEL_B)
    record(day=today(), organization=other_org, key=None, status=429, error_code="rate_limited", input_tokens=5)
    record(day=today(), organization=other_org, key=None, status=499, error_code="client_disconnected")
    reports.roll_up()

    report = reports.build_report(reports.UsageFilter(start=days_ago(3), end=today() + timedelta(days=1)))

    assert [t.requests for _, t in report.days] == [0, 2, 0, 2]
    assert [day for day, _ in report.days] == [days_ago(3), days_ago(2), days_ago(1), today()]
    assert [(slug, t.requests, t.input_tokens) for slug, t in report.organizations] == [
        ("acme", 2, 1100),
        ("globex", 2, 105),
    ]
    assert [(model, t.requests) for model, t in report.models] == [(MODEL_A, 3), (MODEL_B, 1)]
    assert sorted(report.error_codes) == [("client_disconnected", 1), ("rate_limited", 1)]


def test_the_report_narrows_to_an_organization_a_key_and_a_model(record: Record, other_org: Organization) -> None:
    acme_key = record(day=days_ago(1)).api_key
    record(day=days_ago(1), model=MODEL_B)
    record(day=days_ago(1), organization=other_org, key=None)
    record(day=today(), organization=other_org, key=None)
    reports.roll_up()
    window = {"start": days_ago(1), "end": today() + timedelta(days=1)}

    def requests(**narrowing: Any) -> int:
        return reports.build_report(reports.UsageFilter(**window, **narrowing)).total.requests

    assert requests() == 4
    assert requests(organization_id=other_org.pk) == 2
    assert requests(api_key_id=acme_key.pk) == 2
    assert requests(api_key_id=acme_key.pk, model=MODEL_B) == 1


def test_the_admin_report_exports_what_it_shows_as_csv(record: Record) -> None:
    record(day=days_ago(1), status=429, error_code="rate_limited")
    record(day=today(), output_tokens=7)
    client = staff_client()

    page = client.get("/admin/usage/report/", {"organization": "acme"})
    download = client.get("/admin/usage/report/", {"organization": "acme", "format": "csv"})

    assert page.status_code == 200 and b'id="chart-requests"' in page.content
    assert download["Content-Type"].startswith("text/csv")
    assert download["Content-Disposition"] == f'attachment; filename="usage-{days_ago(13)}-{today()}.csv"'
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert (rows[0]["section"], rows[0]["requests"], rows[0]["errors"]) == ("total", "2", "1")
    assert [r["name"] for r in rows if r["section"] == "day"][-2:] == [str(days_ago(1)), str(today())]
    assert [(r["name"], r["errors"]) for r in rows if r["section"] == "error_code"] == [("rate_limited", "1")]


@pytest.mark.parametrize("rolled_up", [False, True])
def test_the_admin_report_filters_on_any_model_it_shows_one_out_of_the_catalog_on_a_day_not_rolled_up_among_them(
    record: Record, rolled_up: bool
) -> None:
    record(day=days_ago(3))
    reports.roll_up()
    record(day=days_ago(1), model="retired/model")  # usage of a model since taken out of the catalog
    if rolled_up:
        reports.roll_up()

    download = staff_client().get("/admin/usage/report/", {"model": "retired/model", "format": "csv"})

    assert download.status_code == 200, download.content
    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    assert (rows[0]["section"], rows[0]["requests"]) == ("total", "1")


@pytest.mark.parametrize("may_view_usage", [False, True])
def test_the_admin_report_is_only_for_staff_who_may_view_usage_records(record: Record, may_view_usage: bool) -> None:
    """Staff given other parts of the admin (the catalog, say) do not read every organization's usage."""
    record(day=today())
    clerk = User.objects.create(username="catalog-keeper", is_staff=True)
    if may_view_usage:
        clerk.user_permissions.add(Permission.objects.get(codename="view_usagerecord"))
    client = Client()
    client.force_login(clerk)

    page = client.get("/admin/usage/report/")
    download = client.get("/admin/usage/report/", {"format": "csv"})
    index = client.get("/admin/").content.decode()

    assert (page.status_code, download.status_code) == ((200, 200) if may_view_usage else (403, 403))
    assert ('id="usage-report-link"' in index) is may_view_usage


def test_the_csv_export_keeps_a_spreadsheet_from_running_names_as_formulas(
    record: Record, other_org: Organization
) -> None:
    formulas = ['=HYPERLINK("https://evil.example","click")', "+1+1", "-2+3", "@SUM(A1)", "\tcmd", "\r=1"]
    for name in formulas:
        record(model=name, status=502, error_code=name)
    record(organization=Organization.objects.create(slug="-cmd", name="Dash"), model="plain/model")

    download = staff_client().get("/admin/usage/report/", {"format": "csv"})

    rows = list(csv.DictReader(io.StringIO(download.content.decode())))
    names = {(r["section"], r["name"]) for r in rows}
    assert {("model", "'" + name) for name in formulas} <= names
    assert {("error_code", "'" + name) for name in formulas} <= names
    assert ("organization", "'-cmd") in names and ("model", "plain/model") in names
    assert all(not r[column].startswith(("=", "+", "-", "@", "\t", "\r")) for r in rows for column in r)
    assert next(r for r in rows if r["section"] == "total")["requests"] == str(len(formulas) + 1)


def test_the_admin_report_says_what_is_wrong_with_its_filters(record: Record) -> None:
    client = staff_client()

    page = client.get("/admin/usage/report/", {"start": str(today()), "end": str(days_ago(3))})
    download = client.get("/admin/usage/report/", {"start": "someday", "format": "csv"})
    reversed_download = client.get(
        "/admin/usage/report/", {"start": str(today()), "end": str(days_ago(3)), "format": "csv"}
    )

    assert page.status_code == 200 and b"must not be after" in page.content
    assert download.status_code == 400 and download.content.startswith(b"start: ")
    assert reversed_download.content.decode() == "'From' must not be after 'Through'.\n"


def test_the_admin_report_refuses_the_last_day_of_the_calendar_as_a_bad_date(record: Record) -> None:
    client = staff_client()
    last_day = {"start": "9999-12-31", "end": "9999-12-31"}

    page = client.get("/admin/usage/report/", last_day)
    download = client.get("/admin/usage/report/", {**last_day, "format": "csv"})
    first_days = client.get("/admin/usage/report/", {"start": "0001-01-01", "end": "0001-01-02"})

    assert page.status_code == 200 and b"Choose a day before 9999-12-31" in page.content
    assert download.status_code == 400 and "Choose a day before" in download.content.decode()
    assert first_days.status_code == 200 and b'id="chart-requests"' in first_days.content


# --- GET /v1/infer/usage --------------------------------------------------------------------------


@pytest.fixture
def two_organizations_usage(record: Record, other_org: Organization) -> None:
    record(day=days_ago(2), input_tokens=10, output_tokens=1)
    record(day=today(), model=MODEL_B, input_tokens=20, output_tokens=2)
    for _ in range(3):
        record(day=days_ago(1), organization=other_org, key=None, model="globex/secret-model", input_tokens=999)
    reports.roll_up()


async def test_an_organization_reads_its_own_usage_and_never_another_ones(
    api: API, two_organizations_usage: None
) -> None:
    response = await api.get(USAGE + "?group_by=model")

    assert response.status_code == 200, response.content
    body = response.json()
    assert body["object"] == "organization.usage" and body["organization"] == "acme"
    assert [(r["model"], r["requests"], r["input_tokens"]) for r in body["data"]] == [
        (MODEL_A, 1, 10),
        (MODEL_B, 1, 20),
    ]
    assert body["total"]["requests"] == 2 and body["total"]["total_tokens"] == 33
    assert "globex" not in response.content.decode()


async def test_usage_by_day_lists_every_day_of_the_range(api: API, two_organizations_usage: None) -> None:
    start = days_ago(2)
    response = await api.get(f"{USAGE}?start={start}&end={today() + timedelta(days=1)}")

    body = response.json()
    assert body["group_by"] == "day" and body["start"] == str(start)
    assert [r["date"] for r in body["data"]] == [str(days_ago(2)), str(days_ago(1)), str(today())]
    assert [r["requests"] for r in body["data"]] == [1, 0, 1]
    assert body["data"][0]["start_time"] == int(noon(start).timestamp()) - 12 * 3600


async def test_usage_by_key_names_the_key_by_its_prefix(api: API, api_key: str, two_organizations_usage: None) -> None:
    response = await api.get(USAGE + "?group_by=key")

    [result] = response.json()["data"]
    assert result["api_key"] == {"prefix": "b3os_factory001_…", "name": "factory"}
    assert result["requests"] == 2 and api_key not in response.content.decode()


async def test_usage_takes_unix_seconds_and_counts_the_whole_day_of_the_end(
    api: API, two_organizations_usage: None
) -> None:
    start = int(noon(days_ago(2)).timestamp())
    end = int(noon(days_ago(1)).timestamp())
    body = (await api.get(f"{USAGE}?start={start}&end={end}")).json()

    assert (body["start"], body["end"]) == (str(days_ago(2)), str(today()))
    assert body["total"]["requests"] == 1


@pytest.mark.parametrize(
    ("query", "param", "code"),
    [
        ("group_by=hour", "group_by", "invalid_value"),
        ("start=last-tuesday", "start", "invalid_value"),
        ("end=99999999999999999999", "end", "invalid_value"),
        ("start=2025-02-01&end=2025-01-01", "end", "invalid_value"),
        ("start=2020-01-01&end=2025-01-01", "start", "invalid_value"),
        ("organization=globex", "organization", "unknown_parameter"),
        ("end=9999-12-31T00:00:01", "end", "invalid_value"),
        ("start=9999-01-01", "start", "invalid_value"),  # after today, with end left to its default
    ],
)
async def test_bad_usage_parameters_are_refused_by_name(api: API, query: str, param: str, code: str) -> None:
    response = await api.get(f"{USAGE}?{query}")

    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


@pytest.mark.parametrize(
    "query",
    ["start=9999-12-30&end=9999-12-31", "start=0001-01-01&end=0001-01-03", "end=0001-01-02", "end=9999-12-31"],
)
async def test_usage_at_the_ends_of_the_calendar_is_an_empty_report(api: API, query: str) -> None:
    response = await api.get(f"{USAGE}?{query}")

    assert response.status_code == 200
    assert response.json()["total"]["requests"] == 0


async def test_usage_needs_a_key(api: API) -> None:
    response = await api.get(USAGE, key="")

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


async def test_a_new_key_of_the_same_organization_sees_the_organization_usage(
    api: API, organization: Organization, two_organizations_usage: None
) -> None:
    from asgiref.sync import sync_to_async

    other_key = await sync_to_async(create_api_key)(organization=organization, name="second")
    body = (await api.get(USAGE + "?group_by=model", key=other_key)).json()

    assert body["total"]["requests"] == 2


async def test_usage_is_read_one_query_at_a_time_and_past_a_few_waiting_the_next_is_a_429(
    api: API, monkeypatch: pytest.MonkeyPatch
) -> None:
    released, reading, most_at_once = threading.Event(), [0], [0]
    real = reports.organization_usage

    def slow(**kwargs: Any) -> Any:
        reading[0] += 1
        most_at_once[0] = max(most_at_once[0], reading[0])
        released.wait(10)
        reading[0] -= 1
        return real(**kwargs)

    monkeypatch.setattr(reports, "organization_usage", slow)
    asked = [asyncio.create_task(api.get(USAGE)) for _ in range(reading_module.MOST_QUEUED + 2)]
    for _ in range(200):  # while the first query is held, only refusals can come back
        if sum(task.done() for task in asked) == 2:
            break
        await asyncio.sleep(0.05)
    released.set()
    answers = [await task for task in asked]

    refused = [answer for answer in answers if answer.status_code == 429]
    assert len(refused) == 2 and sum(answer.status_code == 200 for answer in answers) == reading_module.MOST_QUEUED
    error = refused[0].json()["error"]
    # In the words of every other 429 the node answers: its limits' code.
    assert (error["type"], error["code"], refused[0]["Retry-After"]) == ("rate_limit_error", "rate_limited", "2")
    assert most_at_once[0] == 1


def test_not_even_a_superuser_can_delete_a_usage_record_in_the_admin(record: Record) -> None:
    kept = record()
    client = staff_client()

    page = client.get(f"/admin/inference/usagerecord/{kept.pk}/delete/")
    listing = client.get("/admin/inference/usagerecord/")

    assert page.status_code == 403
    assert listing.status_code == 200 and b"delete_selected" not in listing.content
    assert UsageRecord.objects.filter(pk=kept.pk).exists()
