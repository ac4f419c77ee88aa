"""Admission on the request path (embedded mode): requests per minute, tokens per minute, requests in flight."""

from __future__ import annotations

import pytest

from inference.engine import catalog
from inference.models import CatalogEntry, UsageRecord
from inference.usage import records as usage
from orgs import admission
from orgs.exceptions import LimitExceeded
from orgs.models import Limit, Organization
from tests.conftest import API, MODEL_ID, read_stream

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.database]

CHAT = "/v1/infer/chat/completions"


def ask(**overrides) -> dict:
    return {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "temperature": 0,
        **overrides,
    }


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(admission, "clock", fake)
    return fake


async def limit(*, model: CatalogEntry | None = None, **numbers: int | None) -> Limit:
    org = await Organization.objects.aget(slug="acme")
    row = await Limit.objects.acreate(organization=org, model=model, **numbers)
    admission.clear_limits_cache()
    return row


async def test_without_limits_every_request_is_admitted_without_rate_headers(api: API) -> None:
    response = await api.post(CHAT, ask())
    assert response.status_code == 200
    assert "x-ratelimit-limit-requests" not in response


async def test_requests_per_minute_at_over_and_after_the_window(api: API, clock: Clock) -> None:
    await limit(requests_per_minute=2)
    first = await api.post(CHAT, ask())
    assert first["x-ratelimit-limit-requests"] == "2"
    assert first["x-ratelimit-remaining-requests"] == "1"
    assert first["x-ratelimit-reset-requests"] == "1m0s"
    clock.now += 10
    second = await api.post(CHAT, ask())
    assert second.status_code == 200 and second["x-ratelimit-remaining-requests"] == "0"
    clock.now += 5
    refused = await api.post(CHAT, ask())
    assert refused.status_code == 429
    assert refused.json()["error"]["code"] == "rate_limited"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert "requests per minute" in refused.json()["error"]["message"]
    assert refused["Retry-After"] == "45"  # the first request leaves the window 60 s after it came
    assert refused["x-ratelimit-remaining-requests"] == "0"
    clock.now += 45
    assert (await api.post(CHAT, ask())).status_code == 200


async def test_tokens_per_minute_charge_the_input_and_the_maximum_output(api: API, clock: Clock) -> None:
    probe = (await api.post(CHAT, ask())).json()["usage"]["prompt_tokens"]
    await limit(tokens_per_minute=2 * (probe + 10) + 5)
    first = await api.post(CHAT, ask(max_tokens=10))
    assert first.status_code == 200
    assert first["x-ratelimit-remaining-tokens"] == str(probe + 10 + 5)
    clock.now += 20
    assert (await api.post(CHAT, ask(max_tokens=10))).status_code == 200
    refused = await api.post(CHAT, ask(max_tokens=10))
    assert refused.status_code == 429
    assert "tokens per minute" in refused.json()["error"]["message"]
    assert refused["Retry-After"] == "40"
    clock.now += 40
    assert (await api.post(CHAT, ask(max_tokens=10))).status_code == 200


async def test_a_refusal_for_tokens_still_reports_the_requests_left_and_the_tokens_left(api: API) -> None:
    probe = (await api.post(CHAT, ask())).json()["usage"]["prompt_tokens"]
    await limit(requests_per_minute=100, tokens_per_minute=probe + 40)
    assert (await api.post(CHAT, ask(max_tokens=20))).status_code == 200

    refused = await api.post(CHAT, ask(max_tokens=30))

    assert refused.status_code == 429
    assert refused["x-ratelimit-remaining-requests"] == "99"
    assert refused["x-ratelimit-remaining-tokens"] == "20"
    assert refused["x-ratelimit-limit-tokens"] == str(probe + 40)


async def test_an_unset_max_tokens_charges_the_models_maximum(api: API, catalog_model: CatalogEntry) -> None:
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(max_output_tokens=500)
    await limit(tokens_per_minute=400)
    refused = await api.post(CHAT, ask(max_tokens=None))
    assert refused.status_code == 429
    assert "can never fit" in refused.json()["error"]["message"]


@pytest.mark.parametrize(
    ("limits", "told"),
    [
        ({"requests_per_minute": 0}, "A limit of 0 admits no request: this one can never be admitted"),
        ({"requests_in_flight": 0}, "A limit of 0 admits no request: this one can never be admitted"),
        ({"tokens_per_minute": 5}, "It can never fit: lower the maximum output tokens or the input."),
    ],
    ids=["no requests per minute", "no requests in flight", "more tokens than a minute allows"],
)
async def test_a_request_no_wait_would_admit_says_so_and_asks_for_no_retry(
    api: API, limits: dict[str, int], told: str
) -> None:
    await limit(**limits)

    refused = await api.post(CHAT, ask(max_tokens=10))

    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limited"
    message = refused.json()["error"]["message"]
    assert told in message and "Try again" not in message
    assert "Retry-After" not in refused and refused["x-should-retry"] == "false"


async def test_a_request_no_wait_would_admit_is_told_so_even_while_another_limit_is_full(api: API) -> None:
    # It was told to retry when the minute's requests cleared, and then refused for good.
    row = await limit(requests_per_minute=1, tokens_per_minute=5000)
    assert (await api.post(CHAT, ask(max_tokens=1))).status_code == 200
    row.tokens_per_minute = 5
    await row.asave()
    admission.clear_limits_cache()

    refused = await api.post(CHAT, ask(max_tokens=10))

    assert refused.status_code == 429
    assert "It can never fit" in refused.json()["error"]["message"]
    assert "Retry-After" not in refused and refused["x-should-retry"] == "false"


async def test_requests_in_flight_are_released_when_the_stream_ends(api: API) -> None:
    await limit(requests_in_flight=1)
    held = await api.post(CHAT, ask(stream=True, max_tokens=4))
    assert held.status_code == 200
    refused = await api.post(CHAT, ask())
    assert refused.status_code == 429
    assert "requests in flight" in refused.json()["error"]["message"]
    assert refused["Retry-After"] == "1"
    await read_stream(held)
    assert (await api.post(CHAT, ask())).status_code == 200


async def test_a_request_that_fails_in_the_runner_still_counts_but_frees_its_slot(
    api: API, clock: Clock, catalog_model: CatalogEntry
) -> None:
    await limit(requests_per_minute=2, requests_in_flight=1)
    # The catalog promises more context than the runner was loaded with: the runner refuses the prompt.
    # (llama.cpp rounds a sequence's context up to a few hundred tokens, so the prompt is longer than that.)
    settings = catalog_model.runner_settings
    small = {**settings, "n_ctx": 16, "parallel": 1}
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(runner_settings=small)
    failed = await api.post(CHAT, ask(messages=[{"role": "user", "content": "word " * 600}]))
    await CatalogEntry.objects.filter(pk=catalog_model.pk).aupdate(runner_settings=settings)
    catalog.clear_cache()

    assert failed.status_code == 400 and failed.json()["error"]["code"] == "context_length_exceeded", failed.content
    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429


async def test_a_per_model_limit_overrides_the_default(api: API, catalog_model: CatalogEntry) -> None:
    await limit(requests_per_minute=1)
    await limit(model=catalog_model, requests_per_minute=3)
    statuses = [(await api.post(CHAT, ask())).status_code for _ in range(4)]
    assert statuses == [200, 200, 200, 429]


async def test_a_changed_limit_applies_within_seconds(api: API, monkeypatch: pytest.MonkeyPatch) -> None:
    row = await limit(requests_per_minute=1)
    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429
    row.requests_per_minute = 10
    await row.asave()
    ticks = iter([1e9, 1e9 + admission.LIMITS_CACHE_SECONDS + 0.1])
    monkeypatch.setattr(admission.time, "monotonic", lambda: next(ticks, 1e9 + 10))
    assert (await api.post(CHAT, ask())).status_code == 200


@pytest.mark.parametrize("how", ["deleted", "blanked"])
async def test_a_limit_set_again_after_the_organization_had_none_counts_from_then_on(api: API, how: str) -> None:
    row = await limit(requests_per_minute=5)
    for _ in range(3):
        assert (await api.post(CHAT, ask())).status_code == 200
    if how == "deleted":
        await row.adelete()
    else:
        row.requests_per_minute = None
        await row.asave()
    assert (await api.post(CHAT, ask())).status_code == 200  # uncounted

    if how == "deleted":
        await limit(requests_per_minute=1)
    else:
        row.requests_per_minute = 1
        await row.asave()

    # The requests of the minute before, while the organization had a limit, count no more than the unlimited one.
    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429


async def test_a_limit_removed_and_set_again_from_another_process_counts_from_then_on(api: API) -> None:
    row = await limit(requests_per_minute=2)
    for _ in range(2):
        assert (await api.post(CHAT, ask())).status_code == 200
    # Saved by another process (set_limit, a shell): no signal here, and this one reads it as its cached copy expires.
    await Limit.objects.filter(pk=row.pk).aupdate(requests_per_minute=None)
    admission.clear_limits_cache()
    assert (await api.post(CHAT, ask())).status_code == 200  # unlimited

    await Limit.objects.filter(pk=row.pk).aupdate(requests_per_minute=1)
    admission.clear_limits_cache()

    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429


async def test_a_model_left_unlimited_beside_another_models_limit_counts_from_then_on_once_limited_again(
    api: API, catalog_model: CatalogEntry
) -> None:
    other = await CatalogEntry.objects.acreate(
        public_id="b3os/other", runner=catalog_model.runner, runner_settings=catalog_model.runner_settings
    )
    default = await limit(requests_per_minute=5)
    await limit(model=other, requests_per_minute=5)  # the organization keeps a limit, on another model
    for _ in range(3):
        assert (await api.post(CHAT, ask())).status_code == 200
    await default.adelete()

    await limit(requests_per_minute=1)

    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429


async def test_a_refused_request_leaves_one_usage_record(api: API) -> None:
    await limit(requests_per_minute=0)
    refused = await api.post(CHAT, ask())
    assert refused.status_code == 429
    usage.flush()
    record = await UsageRecord.objects.aget()
    assert (record.status, record.error_code, record.request_id) == (429, "rate_limited", refused["x-request-id"])


async def test_admissions_and_refusals_show_in_the_metrics(api: API) -> None:
    from inference.usage.metrics import REGISTRY

    def sample(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    await limit(requests_per_minute=1)
    before_ok = sample(
        "b3os_requests_total", model=MODEL_ID, organization="acme", endpoint="chat.completions", status="200", code=""
    )
    before_refused = sample(
        "b3os_rejected_requests_total", model=MODEL_ID, organization="acme", limit="requests_per_minute"
    )
    assert (await api.post(CHAT, ask())).status_code == 200
    assert (await api.post(CHAT, ask())).status_code == 429
    assert (
        sample(
            "b3os_requests_total",
            model=MODEL_ID,
            organization="acme",
            endpoint="chat.completions",
            status="200",
            code="",
        )
        == before_ok + 1
    )
    assert (
        sample("b3os_rejected_requests_total", model=MODEL_ID, organization="acme", limit="requests_per_minute")
        == before_refused + 1
    )
    assert sample("b3os_requests_in_flight", model=MODEL_ID) == 0


async def test_a_step_that_fits_once_others_leave_the_window_is_told_when_and_one_that_never_fits_is_not(
    api: API, clock: Clock
) -> None:
    await limit(tokens_per_minute=100)
    org = await Organization.objects.aget(slug="acme")
    await admission.admit(organization_id=org.pk, model_pk=None, tokens=40)  # another request's
    turn = await admission.admit(organization_id=org.pk, model_pk=None, tokens=40)

    with pytest.raises(LimitExceeded) as crowded:
        await turn.charge_within(30)  # 40 + 40 + 30: over, though 40 + 30 alone fits
    with pytest.raises(LimitExceeded) as never:
        await turn.charge_within(61)  # 40 + 61: over whatever else the window holds

    assert "beside the 40 it holds" in crowded.value.detail and "Try again in 60s" in crowded.value.detail
    assert "It can never fit" in never.value.detail and never.value.retry_after is None
    assert turn.charged == 40
