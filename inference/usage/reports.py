"""Usage reports: daily rollups of the raw usage records, their retention, and the queries reports run.

Raw ``UsageRecord`` rows (one per request) are rolled up per UTC day into ``UsageDailyRollup`` rows, one
per organization, key, model, endpoint and route. Reports read rollups for the days that have them and
aggregate raw records on the fly for the others (today, or days the rollup has not reached yet), so a
report is complete without waiting for the next rollup and stays fast with millions of raw rows. Raw
records older than ``USAGE_RETENTION_DAYS`` are pruned, never before their day is rolled up.

Latencies are counted in log-scale histogram buckets: bucket ``i`` holds values in
``(GROWTH**(i-1), GROWTH**i]`` milliseconds (bucket 0: up to 1 ms). Histograms add up across rows and
days, and a percentile read from them is within one bucket (under 10%) of the exact value.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from typing import Any, Literal, TypeVar

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import Count, F, Min, Q, QuerySet, Sum, Value
from django.db.models.functions import Ceil, Greatest, Ln, TruncDate
from django.utils import timezone

from inference.models import UsageDailyRollup, UsageRecord
from orgs.models import APIKey, Organization

logger = logging.getLogger("inference.usage.reports")

GROWTH = 1.1
# Days before today that every run rolls up again: a long stream that started before midnight is
# recorded (under its start time) when it ends, after the day was first rolled up.
REROLL_DAYS = 2
MAX_REPORT_DAYS = 366
_ROLLUP_LOCK = 0x62336F73  # a PostgreSQL advisory lock: one rollup at a time across processes

K = TypeVar("K", bound=Hashable)


# --- histograms and tallies -------------------------------------------------------------------------


def bucket_bounds(index: int) -> tuple[float, float]:
    return (0.0, 1.0) if index <= 0 else (GROWTH ** (index - 1), GROWTH**index)


def percentile(histogram: Mapping[int, int], q: float) -> int | None:
    """The ``q``-quantile (0..1) of a histogram, interpolated within its bucket; None when empty."""
    total = sum(histogram.values())
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for index in sorted(histogram):
        count = histogram[index]
        if count and seen + count >= rank:
            low, high = bucket_bounds(index)
            return round(low + (high - low) * max(rank - seen, 0) / count)
        seen += count
    return round(bucket_bounds(max(histogram))[1])


def error_code_of(status: int, error_code: str) -> str | None:
    """How a record counts in error reports: its code, its HTTP status for a bare failure, or None."""
    if error_code:
        return error_code
    if status >= 400:
        return f"http_{status}"
    return None


@dataclass
class Tally:
    """Additive totals of some set of requests."""

    requests: int = 0
    errors: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    reasoning_tokens: int = 0
    cached_tokens: int = 0
    ttft_count: int = 0
    ttft_ms_sum: int = 0
    total_ms_sum: int = 0
    error_codes: Counter[str] = field(default_factory=Counter)
    ttft_histogram: Counter[int] = field(default_factory=Counter)
    total_ms_histogram: Counter[int] = field(default_factory=Counter)

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.input_tokens += other.input_tokens
        self.output_tokens += other.output_tokens
        self.reasoning_tokens += other.reasoning_tokens
        self.cached_tokens += other.cached_tokens
        self.ttft_count += other.ttft_count
        self.ttft_ms_sum += other.ttft_ms_sum
        self.total_ms_sum += other.total_ms_sum
        self.error_codes.update(other.error_codes)
        self.ttft_histogram.update(other.ttft_histogram)
        self.total_ms_histogram.update(other.total_ms_histogram)

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    @property
    def ok(self) -> int:
        return self.requests - self.errors

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ttft_p50(self) -> int | None:
        return percentile(self.ttft_histogram, 0.50)

    @property
    def ttft_p95(self) -> int | None:
        return percentile(self.ttft_histogram, 0.95)

    @property
    def latency_p50(self) -> int | None:
        return percentile(self.total_ms_histogram, 0.50)

    @property
    def latency_p95(self) -> int | None:
        return percentile(self.total_ms_histogram, 0.95)

    @classmethod
    def of_rollup(cls, row: UsageDailyRollup) -> Tally:
        return cls(
            requests=row.requests,
            errors=row.errors,
            input_tokens=row.input_tokens,
            output_tokens=row.output_tokens,
            reasoning_tokens=row.reasoning_tokens,
            cached_tokens=row.cached_tokens,
            ttft_count=row.time_to_first_token_count,
            ttft_ms_sum=row.time_to_first_token_ms_sum,
            total_ms_sum=row.total_ms_sum,
            error_codes=Counter({str(k): int(v) for k, v in row.error_codes.items()}),
            ttft_histogram=Counter({int(k): int(v) for k, v in row.time_to_first_token_histogram.items()}),
            total_ms_histogram=Counter({int(k): int(v) for k, v in row.total_ms_histogram.items()}),
        )


@dataclass(frozen=True, slots=True)
class UsageRow:
    """A day of usage of one organization, key, model, endpoint and route."""

    day: date
    organization_id: int
    api_key_id: int | None
    model: str
    endpoint: str
    route: str
    tally: Tally

    def to_rollup(self) -> UsageDailyRollup:
        t = self.tally
        return UsageDailyRollup(
            day=self.day,
            organization_id=self.organization_id,
            api_key_id=self.api_key_id,
            model=self.model,
            endpoint=self.endpoint,
            route=self.route,
            requests=t.requests,
            errors=t.errors,
            error_codes=dict(t.error_codes),
            input_tokens=t.input_tokens,
            output_tokens=t.output_tokens,
            reasoning_tokens=t.reasoning_tokens,
            cached_tokens=t.cached_tokens,
            time_to_first_token_count=t.ttft_count,
            time_to_first_token_ms_sum=t.ttft_ms_sum,
            time_to_first_token_histogram={str(k): v for k, v in sorted(t.ttft_histogram.items())},
            total_ms_sum=t.total_ms_sum,
            total_ms_histogram={str(k): v for k, v in sorted(t.total_ms_histogram.items())},
        )


# --- days ---------------------------------------------------------------------------------------------


def utc_today() -> date:
    return timezone.now().astimezone(UTC).date()


def day_start(day: date) -> datetime:
    return datetime.combine(day, time.min, tzinfo=UTC)


def days_between(start: date, end: date) -> list[date]:
    """Every day from ``start`` up to, not including, ``end``."""
    return [start + timedelta(days=n) for n in range((end - start).days)]


def _created_on(days: Iterable[date]) -> Q:
    """Records created on any of ``days``, as ranges of ``created`` (so the index serves the query)."""
    ranges: list[list[date]] = []
    for day in sorted(set(days)):
        if ranges and day == ranges[-1][1]:
            ranges[-1][1] = day + timedelta(days=1)
        else:
            ranges.append([day, day + timedelta(days=1)])
    q = Q(pk__in=[])
    for first, after in ranges:
        q |= Q(created__gte=day_start(first), created__lt=day_start(after))
    return q


# --- aggregating raw records ------------------------------------------------------------------------

_DIMENSIONS = ("day", "organization_id", "api_key_id", "model", "endpoint", "route")


def _bucket(field_name: str) -> Any:
    return Ceil(Ln(Greatest(F(field_name), Value(1))) / Value(math.log(GROWTH)))


def aggregate_records(records: QuerySet[UsageRecord]) -> list[UsageRow]:
    """Raw records summed per day and dimension, in three grouped queries (totals, latency, TTFT)."""
    records = records.annotate(day=TruncDate("created", tzinfo=UTC)).order_by()
    tallies: dict[tuple[Any, ...], Tally] = {}
    totals = records.values(*_DIMENSIONS, "status", "error_code").annotate(
        n=Count("id"),
        input_tokens=Sum("input_tokens"),
        output_tokens=Sum("output_tokens"),
        reasoning_tokens=Sum("reasoning_tokens"),
        cached_tokens=Sum("cached_tokens"),
        ttft_count=Count("time_to_first_token_ms"),
        ttft_ms_sum=Sum("time_to_first_token_ms"),
        total_ms_sum=Sum("total_ms"),
    )
    for item in totals:
        tally = tallies.setdefault(tuple(item[d] for d in _DIMENSIONS), Tally())
        tally.requests += item["n"]
        tally.input_tokens += item["input_tokens"] or 0
        tally.output_tokens += item["output_tokens"] or 0
        tally.reasoning_tokens += item["reasoning_tokens"] or 0
        tally.cached_tokens += item["cached_tokens"] or 0
        tally.ttft_count += item["ttft_count"]
        tally.ttft_ms_sum += item["ttft_ms_sum"] or 0
        tally.total_ms_sum += item["total_ms_sum"] or 0
        if (code := error_code_of(item["status"], item["error_code"])) is not None:
            tally.errors += item["n"]
            tally.error_codes[code] += item["n"]
    # Latency is of what was asked for: a refusal (a limit's 429, a bad request's 400) takes no time worth reporting,
    # and a day of them would pull the percentiles to nothing. A failure's time (a 504, an upstream's 502) and a
    # client's hang-up (499) stay in.
    answered = records.exclude(status__gte=400, status__lt=499)
    for item in answered.values(*_DIMENSIONS, bucket=_bucket("total_ms")).annotate(n=Count("id")):
        tallies[tuple(item[d] for d in _DIMENSIONS)].total_ms_histogram[int(item["bucket"])] += item["n"]
    with_ttft = records.filter(time_to_first_token_ms__isnull=False)
    for item in with_ttft.values(*_DIMENSIONS, bucket=_bucket("time_to_first_token_ms")).annotate(n=Count("id")):
        tallies[tuple(item[d] for d in _DIMENSIONS)].ttft_histogram[int(item["bucket"])] += item["n"]
    return [
        UsageRow(day=day, organization_id=org, api_key_id=key, model=model, endpoint=endpoint, route=route, tally=tally)
        for (day, org, key, model, endpoint, route), tally in tallies.items()
    ]


# --- rolling up and pruning -------------------------------------------------------------------------


def _lock_rollups() -> None:
    # SQLite's IMMEDIATE transactions already serialize writers.
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_ROLLUP_LOCK])


def roll_up_day(day: date) -> int | None:
    """Recompute ``day``'s rollups from its raw records: the rows written, or None when it has no raw
    records (they may have been pruned, so existing rollups are kept). Safe to run again."""
    if day >= utc_today():
        raise ValueError(f"{day} is not over yet: only past days are rolled up")
    if _pruned(day) and UsageDailyRollup.objects.filter(day=day).exists():
        raise ValueError(
            f"{day} was rolled up and its raw records pruned: recomputing it from the records left would lose "
            "the rest of its usage"
        )
    # Summed outside the transaction, so SQLite's write lock is not held while reading; the day's
    # rows are then replaced at once, so a report never sees a day half rolled up.
    rows = aggregate_records(UsageRecord.objects.filter(_created_on([day])))
    if not rows:
        return None
    with transaction.atomic():
        _lock_rollups()
        UsageDailyRollup.objects.filter(day=day).delete()
        UsageDailyRollup.objects.bulk_create([row.to_rollup() for row in rows], batch_size=500)
    return len(rows)


def _days_with_records(before: date) -> Iterator[date]:
    """The days before ``before`` that have raw records, oldest first: one index seek per such day, so
    long gaps cost nothing."""
    since: datetime | None = None
    while True:
        records = UsageRecord.objects.filter(created__lt=day_start(before))
        if since is not None:
            records = records.filter(created__gte=since)
        first = records.aggregate(first=Min("created"))["first"]
        if first is None:
            return
        day = first.astimezone(UTC).date()
        yield day
        since = day_start(day + timedelta(days=1))


def roll_up() -> list[date]:
    """Roll up every past day that has raw records and no rollups yet, and the last ``REROLL_DAYS``
    again; the days rolled up."""
    today = utc_today()
    recent = today - timedelta(days=REROLL_DAYS)
    days = list(_days_with_records(today))
    rollups = UsageDailyRollup.objects.filter(day__in=[day for day in days if day < recent or _pruned(day)])
    rolled = set(rollups.order_by().values_list("day", flat=True).distinct())
    again = [day for day in days if day not in rolled or (day >= recent and not _pruned(day))]
    return [day for day in again if roll_up_day(day) is not None]


def _pruned(day: date) -> bool:
    """Whether ``day``'s raw records are pruned (once it is rolled up)."""
    cutoff = retention_cutoff()
    return cutoff is not None and day < cutoff


def retention_cutoff() -> date | None:
    """The first day whose raw records are kept, or None when they are kept forever."""
    days = settings.USAGE_RETENTION_DAYS
    return utc_today() - timedelta(days=days) if days > 0 else None


def prune() -> int:
    """Delete raw records of days before the retention cutoff, a day at a time, each only once it is
    rolled up; the number of records deleted."""
    cutoff = retention_cutoff()
    if cutoff is None:
        return 0
    deleted = 0
    for day in list(_days_with_records(cutoff)):
        if not UsageDailyRollup.objects.filter(day=day).exists():
            roll_up_day(day)
        count, _ = UsageRecord.objects.filter(_created_on([day])).delete()
        deleted += count
    return deleted


@dataclass(frozen=True, slots=True)
class Maintenance:
    rolled_up: list[date]
    pruned: int


def roll_up_and_prune() -> Maintenance:
    """The periodic job: roll up, then prune."""
    return Maintenance(rolled_up=roll_up(), pruned=prune())


def start_periodic_rollup(
    *, interval_seconds: float | None = None, stop: threading.Event | None = None
) -> threading.Thread:
    """Run ``roll_up_and_prune`` now and then every interval on a daemon thread, until ``stop`` is set:
    the embedded server's stand-in for Celery beat."""
    interval = float(interval_seconds or settings.USAGE_ROLLUP_INTERVAL_SECONDS)
    stopped = stop or threading.Event()

    def loop() -> None:
        while not stopped.is_set():
            try:
                close_old_connections()
                result = roll_up_and_prune()
                if result.rolled_up or result.pruned:
                    logger.info("rolled up %d day(s), pruned %d raw record(s)", len(result.rolled_up), result.pruned)
            except Exception:
                logger.exception("usage rollup failed")
            finally:
                close_old_connections()
            stopped.wait(interval)

    thread = threading.Thread(target=loop, name="usage-rollup", daemon=True)
    thread.start()
    return thread


# --- report queries ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UsageFilter:
    """Which usage a report covers: days from ``start`` up to, not including, ``end``."""

    start: date
    end: date
    organization_id: int | None = None
    api_key_id: int | None = None
    model: str | None = None

    @property
    def days(self) -> list[date]:
        return days_between(self.start, self.end)

    def narrow(self, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.organization_id is not None:
            queryset = queryset.filter(organization_id=self.organization_id)
        if self.api_key_id is not None:
            queryset = queryset.filter(api_key_id=self.api_key_id)
        if self.model:
            queryset = queryset.filter(model=self.model)
        return queryset


def usage_rows(usage: UsageFilter) -> list[UsageRow]:
    """The filter's usage per day and dimension: rollups where a day has them, raw records otherwise. A day rolled
    up while its rollups are read (its raw records stay until they are pruned) would count twice, or not at all:
    they are read again until the days rolled up are the same before and after."""
    today = utc_today()
    last = min(usage.end, today + timedelta(days=1))
    rollups = UsageDailyRollup.objects.filter(day__gte=usage.start, day__lt=min(last, today))

    def rolled_days() -> set[date]:
        return set(rollups.order_by().values_list("day", flat=True).distinct())

    rows: list[UsageRow] = []
    rolled, before = rolled_days(), None
    while rolled != before:  # days are only ever added to the rolled-up ones, so this ends
        rows = [
            UsageRow(r.day, r.organization_id, r.api_key_id, r.model, r.endpoint, r.route, Tally.of_rollup(r))
            for r in usage.narrow(rollups).order_by().iterator(chunk_size=2000)
        ]
        before, rolled = rolled, rolled_days()
    raw_days = [day for day in days_between(usage.start, last) if day not in rolled]
    if raw_days:
        rows += aggregate_records(usage.narrow(UsageRecord.objects.filter(_created_on(raw_days))))
    return rows


def group(rows: Iterable[UsageRow], by: Callable[[UsageRow], K]) -> dict[K, Tally]:
    groups: dict[K, Tally] = {}
    for row in rows:
        groups.setdefault(by(row), Tally()).add(row.tally)
    return groups


def total(rows: Iterable[UsageRow]) -> Tally:
    tally = Tally()
    for row in rows:
        tally.add(row.tally)
    return tally


def _busiest(groups: dict[K, Tally], top: int) -> list[tuple[K, Tally]]:
    return sorted(groups.items(), key=lambda item: (-item[1].total_tokens, -item[1].requests, str(item[0])))[:top]


@dataclass
class Report:
    """What the admin's usage report shows."""

    usage: UsageFilter
    total: Tally
    days: list[tuple[date, Tally]]
    organizations: list[tuple[str, Tally]]
    models: list[tuple[str, Tally]]
    error_codes: list[tuple[str, int]]


def build_report(usage: UsageFilter, *, top: int = 10) -> Report:
    rows = usage_rows(usage)
    by_day = group(rows, lambda row: row.day)
    by_org = group(rows, lambda row: row.organization_id)
    slugs = dict(Organization.objects.filter(pk__in=by_org).values_list("pk", "slug"))
    everything = total(rows)
    return Report(
        usage=usage,
        total=everything,
        days=[(day, by_day.get(day, Tally())) for day in usage.days],
        organizations=[(slugs.get(org_id, f"#{org_id}"), tally) for org_id, tally in _busiest(by_org, top)],
        models=_busiest(group(rows, lambda row: row.model), top),
        error_codes=everything.error_codes.most_common(),
    )


GroupBy = Literal["day", "model", "key"]


@dataclass(frozen=True, slots=True)
class UsageGroup:
    """One line of an organization's usage: a day, a model or a key (``key`` None for deleted keys)."""

    day: date | None = None
    model: str | None = None
    key: APIKey | None = None
    tally: Tally = field(default_factory=Tally)


def organization_usage(
    *, organization_id: int, start: date, end: date, group_by: GroupBy
) -> tuple[list[UsageGroup], Tally]:
    """An organization's own usage, grouped; and its total over the range."""
    rows = usage_rows(UsageFilter(start=start, end=end, organization_id=organization_id))
    if group_by == "day":
        by_day = group(rows, lambda row: row.day)
        groups = [UsageGroup(day=day, tally=by_day.get(day, Tally())) for day in days_between(start, end)]
    elif group_by == "model":
        by_model = group(rows, lambda row: row.model)
        groups = [UsageGroup(model=model, tally=by_model[model]) for model in sorted(by_model)]
    else:
        by_key = group(rows, lambda row: row.api_key_id)
        keys = APIKey.objects.in_bulk([pk for pk in by_key if pk is not None])
        groups = [UsageGroup(key=keys.get(pk) if pk is not None else None, tally=tally) for pk, tally in by_key.items()]
        groups.sort(key=lambda g: (-g.tally.requests, g.key.prefix if g.key else ""))
    return groups, total(rows)
