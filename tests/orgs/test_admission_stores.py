"""Both admission stores, the in-process one and Redis's, keep the same books: tokens charged after admission count."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from core import redis as redis_clients
from orgs import admission
from tests.inference.test_distributed import start_redis
from tests.services import free_port

LIMITS = admission.Limits(tokens_per_minute=100)
NOW = 1_800_000_000.0


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest, tmp_path: Path, settings: Any) -> AsyncIterator[Any]:
    if request.param == "memory":
        yield admission.MemoryStore()
        return
    server, settings.REDIS_URL = start_redis(tmp_path)
    redis_clients._async_clients.clear()
    try:
        yield admission.RedisStore()
    finally:
        await redis_clients.async_client().aclose()
        redis_clients._async_clients.clear()
        server.terminate()


async def call(result: Any) -> Any:
    """The Redis store's methods are coroutines; the in-process store's are plain calls."""
    return await result if hasattr(result, "__await__") else result


async def test_a_charge_after_admission_counts_against_tokens_per_minute_until_it_leaves_the_window(store: Any) -> None:
    admitted = await call(store.try_admit("1:0", LIMITS, 30, "slot-a", NOW))
    assert admitted.admitted and admitted.remaining_tokens == 70

    await call(store.charge("1:0", 50, NOW + 1))

    refused = await call(store.try_admit("1:0", LIMITS, 30, "slot-b", NOW + 2))
    assert (refused.admitted, refused.limit) == (False, "tokens_per_minute")
    assert refused.retry_after == pytest.approx(admission.WINDOW - 2)
    later = await call(store.try_admit("1:0", LIMITS, 30, "slot-c", NOW + admission.WINDOW + 1.5))
    assert later.admitted and later.remaining_tokens == 70


async def test_a_refusal_reports_what_is_left_of_every_limit_not_only_the_one_that_refused(store: Any) -> None:
    limits = admission.Limits(tokens_per_minute=100, requests_per_minute=10)
    await call(store.try_admit("1:0", limits, 60, "slot-a", NOW))

    refused = await call(store.try_admit("1:0", limits, 50, "slot-b", NOW + 5))

    assert (refused.admitted, refused.limit) == (False, "tokens_per_minute")
    assert (refused.remaining_requests, refused.remaining_tokens) == (9, 40)
    assert refused.reset_requests == pytest.approx(admission.WINDOW - 5)
    assert refused.reset_tokens == pytest.approx(admission.WINDOW - 5)


async def test_the_limits_reset_when_the_window_is_empty_never_before_a_refusal_may_be_tried_again(store: Any) -> None:
    limits = admission.Limits(tokens_per_minute=100, requests_per_minute=10)
    await call(store.try_admit("1:0", limits, 40, "slot-a", NOW))
    await call(store.try_admit("1:0", limits, 40, "slot-b", NOW + 10))

    refused = await call(store.try_admit("1:0", limits, 50, "slot-c", NOW + 20))

    assert refused.retry_after == pytest.approx(admission.WINDOW - 20)  # once the first 40 tokens have left
    assert refused.reset_tokens == pytest.approx(admission.WINDOW - 10)  # once the second have too
    assert refused.reset_requests == pytest.approx(admission.WINDOW - 10)


async def test_a_withdrawn_request_leaves_its_count_its_slot_and_its_tokens_out_of_the_windows(store: Any) -> None:
    limits = admission.Limits(tokens_per_minute=100, requests_per_minute=2, requests_in_flight=1)
    await call(store.try_admit("1:0", limits, 30, "slot-a", NOW))

    await call(store.withdraw("1:0", "slot-a", 30, NOW))

    again = await call(store.try_admit("1:0", limits, 30, "slot-b", NOW + 1))
    assert again.admitted
    assert (again.remaining_requests, again.remaining_tokens) == (1, 70)


async def test_a_refund_dated_at_admission_leaves_the_window_with_the_charge_it_corrects(store: Any) -> None:
    await call(store.try_admit("1:0", LIMITS, 100, "slot-a", NOW))
    await call(store.charge("1:0", -90, NOW))  # settled 25 s later to 10 tokens, dated at admission

    held = await call(store.try_admit("1:0", LIMITS, 80, "slot-b", NOW + 25))
    after = await call(store.try_admit("1:0", LIMITS, 100, "slot-c", NOW + admission.WINDOW + 1))

    assert held.admitted and held.remaining_tokens == 10
    # Both left together: the window holds the 80 of slot-b and the 100 just admitted would not fit beside it,
    # where a refund dated later would have stayed behind as -90.
    assert (after.admitted, after.limit) == (False, "tokens_per_minute")
    assert after.remaining_tokens == 20


async def test_settling_below_the_estimate_refunds_at_the_admissions_time(monkeypatch: pytest.MonkeyPatch) -> None:
    store = admission.MemoryStore()
    moments = iter([NOW, NOW + 25])
    monkeypatch.setattr(admission, "clock", lambda: next(moments))
    monkeypatch.setattr(admission, "_store", lambda: store)

    async def limits_for(organization_id: int, model_pk: int | None) -> admission.Limits:
        return LIMITS

    monkeypatch.setattr(admission, "limits_for", limits_for)
    grant = await admission.admit(organization_id=1, model_pk=None, tokens=100)
    await grant.settle(10)
    grant.release()

    assert sorted(store._windows["1:0"].tokens) == [(NOW, -90), (NOW, 100)]  # both dated at admission


@pytest.mark.parametrize("store", ["redis"], indirect=True)
async def test_a_request_held_in_flight_past_its_keys_expiry_still_counts_against_the_limit(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stream runs for minutes after the admission that set its keys' expiry: shrunk here to 3 s of Redis's time.
    monkeypatch.setattr(admission, "WINDOW", 1.0)
    monkeypatch.setattr(admission, "SLOT_TTL", 1.0)
    monkeypatch.setattr(admission, "KEY_GRACE", 1)
    one_in_flight = admission.Limits(requests_in_flight=1)
    started = time.monotonic()
    assert (await store.try_admit("1:0", one_in_flight, 0, "stream", NOW)).admitted

    while (elapsed := time.monotonic() - started) < 4.5:
        await store.refresh({"1:0": {"stream"}}, NOW + elapsed)  # as its API process does while it runs
        await asyncio.sleep(0.5)
    another = await store.try_admit("1:0", one_in_flight, 0, "another", NOW + elapsed)

    assert (another.admitted, another.limit) == (False, "requests_in_flight")


async def test_a_correction_that_cannot_reach_redis_keeps_admissions_charge_and_fails_nothing(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, settings.REDIS_URL = start_redis(tmp_path)
    redis_clients._async_clients.clear()
    store = admission.RedisStore()
    monkeypatch.setattr(admission, "_store", lambda: store)

    async def limits_for(organization_id: int, model_pk: int | None) -> admission.Limits:
        return LIMITS

    monkeypatch.setattr(admission, "limits_for", limits_for)
    try:
        grant = await admission.admit(organization_id=1, model_pk=None, tokens=100)
        server.terminate()
        server.wait(timeout=10)

        # A gateway stream's last event carried the upstream's count, and the client has every byte already.
        await grant.settle(10)
        grant.release()
    finally:
        await redis_clients.async_client().aclose()
        redis_clients._async_clients.clear()
        server.terminate()

    assert grant.charged == 100


async def test_a_redis_command_under_way_when_its_request_is_cancelled_raises_the_cancellation(
    tmp_path: Path, settings: Any
) -> None:
    """redis-py sends a command through ``asyncio.wait_for``, which on Python 3.11 hands the command's answer to a task
    cancelled in the step the send completes, as if nothing had been asked (a client that hung up just then)."""
    server, settings.REDIS_URL = start_redis(tmp_path)
    redis_clients._async_clients.clear()
    try:
        client = redis_clients.async_client()
        await client.ping()  # its connection made, as a serving process's is
        outcomes = []
        for steps in (1, 2):
            command = asyncio.ensure_future(client.llen("a-queue"))
            for _ in range(steps):
                await asyncio.sleep(0)  # the command is being sent
            command.cancel()
            try:
                await command
                outcomes.append("answered")
            except asyncio.CancelledError:
                outcomes.append("cancelled")
        assert outcomes == ["cancelled", "cancelled"]
    finally:
        await redis_clients.async_client().aclose()
        redis_clients._async_clients.clear()
        server.terminate()


async def test_a_withdrawal_cancelled_while_redis_answers_still_releases_the_slot() -> None:
    # A second hang-up, or a server shutting down, while the windows are told: the slot is not held to its expiry.
    released: list[bool] = []
    told = asyncio.Event()

    async def slow_withdraw(tokens: int) -> None:
        told.set()
        await asyncio.sleep(60)

    grant = admission.Grant(headers={}, _release=lambda: released.append(True), _withdraw=slow_withdraw)
    withdrawing = asyncio.ensure_future(grant.withdraw())
    await told.wait()
    withdrawing.cancel()

    with pytest.raises(asyncio.CancelledError):
        await withdrawing
    assert grant.released and released == [True]


async def test_a_slot_redis_did_not_release_is_released_once_it_answers_again_not_left_to_expire(
    tmp_path: Path, settings: Any
) -> None:
    server, settings.REDIS_URL = start_redis(tmp_path)
    redis_clients._async_clients.clear()
    store = admission.RedisStore()
    one_in_flight = admission.Limits(requests_in_flight=1)
    try:
        assert (await store.try_admit("1:0", one_in_flight, 0, "held", time.time())).admitted
        client = redis_clients.async_client()
        await client.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))  # a failover: writes refused
        await store.release("1:0", "held")
        await client.execute_command("REPLICAOF", "NO", "ONE")  # promoted again, its data whole

        await asyncio.sleep(admission.RELEASE_RETRY_SECONDS * 2)

        again = await store.try_admit("1:0", one_in_flight, 0, "next", time.time())
        assert again.admitted, again  # well within the slot's time to live
    finally:
        await redis_clients.async_client().aclose()
        redis_clients._async_clients.clear()
        server.terminate()


@pytest.mark.django_db
async def test_an_organization_left_without_limits_has_its_counts_dropped_and_no_other(
    store: Any, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With no limit row left, organization 7 is counted no more: a limit set on it later counts from then on.
    settings.DISTRIBUTED = isinstance(store, admission.RedisStore)
    monkeypatch.setattr(admission, "memory_store", store if not settings.DISTRIBUTED else admission.memory_store)
    monkeypatch.setattr(redis_clients, "_sync_client", None)
    one_a_minute = admission.Limits(requests_per_minute=1)
    for key in ("7:0", "7:3", "17:0"):
        assert (await call(store.try_admit(key, one_a_minute, 0, "slot", NOW))).admitted

    await sync_to_async(admission.limits_changed)(7)

    assert (await call(store.try_admit("7:0", one_a_minute, 0, "slot", NOW + 1))).admitted
    assert (await call(store.try_admit("7:3", one_a_minute, 0, "slot", NOW + 1))).admitted
    assert not (await call(store.try_admit("17:0", one_a_minute, 0, "slot", NOW + 1))).admitted
    if settings.DISTRIBUTED:
        redis_clients.sync_client().close()


async def test_an_admission_whose_request_leaves_while_redis_answers_is_taken_back_out_of_the_windows(
    tmp_path: Path, settings: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Cut off at any point of its call to Redis, the request leaves no usage record: nor may it leave a charge.
    server, settings.REDIS_URL = start_redis(tmp_path)
    settings.DISTRIBUTED = True
    redis_clients._async_clients.clear()
    monkeypatch.setattr(admission, "_redis_store", None)
    limits = admission.Limits(requests_per_minute=100, tokens_per_minute=10_000)

    async def limited(organization_id: int, model_pk: int | None) -> admission.Limits:
        return limits

    monkeypatch.setattr(admission, "limits_for", limited)
    try:
        await redis_clients.async_client().ping()  # its connection made, as a serving process's is
        answered = cancelled = 0
        for steps in range(1, 12):
            admitting = asyncio.ensure_future(admission.admit(organization_id=1, model_pk=None, tokens=40))
            for _ in range(steps):
                await asyncio.sleep(0)
            admitting.cancel()
            try:
                (await admitting).release()  # answered before the cancellation came: its request goes on
                answered += 1
            except asyncio.CancelledError:
                cancelled += 1
        while admission._releasing:
            await asyncio.gather(*admission._releasing)

        after = await admission.RedisStore().try_admit("1:0", limits, 0, "probe", time.time())
        assert cancelled, "every admission was answered before its cancellation: none was cut off"
        assert (100 - after.remaining_requests - 1, 10_000 - after.remaining_tokens) == (answered, answered * 40)
    finally:
        await redis_clients.async_client().aclose()
        redis_clients._async_clients.clear()
        server.terminate()
