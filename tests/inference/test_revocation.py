"""The answers under way for a key end when it stops being usable; the others go on."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import timedelta

import pytest
import redis.exceptions
from asgiref.sync import sync_to_async
from django.utils import timezone

from inference.api import middleware
from inference.engine import generation
from inference.engine.generation import Failed
from inference.models import UsageRecord
from inference.serving import revocation
from inference.usage import records as usage
from orgs.models import APIKey, Organization
from tests.conftest import API, MODEL_ID


@dataclass
class Answer:
    """An answer under way as the watch sees one: a key, and what ended it."""

    api_key_id: int | None = None
    ended_by: list[Failed] = field(default_factory=list)

    def interrupt(self, failure: Failed) -> None:
        self.ended_by.append(failure)


@pytest.fixture
def two_keys(organization: Organization) -> tuple[APIKey, APIKey]:
    return (
        APIKey.generate(organization=organization, name="revoked")[0],
        APIKey.generate(organization=organization, name="kept")[0],
    )


async def ended(answer: Answer) -> bool:
    for _ in range(50):
        if answer.ended_by:
            return True
        await asyncio.sleep(0.1)
    return False


async def test_an_answer_that_starts_after_its_key_was_revoked_is_ended_though_the_watch_saw_the_revocation(
    two_keys: tuple[APIKey, APIKey],
) -> None:
    revoked, kept = two_keys
    others = Answer()
    revocation.watch_stream(others, kept.pk)
    await sync_to_async(revoked.revoke)()
    await asyncio.sleep(revocation.CHECK_SECONDS * 2)  # the watch has checked the keys under way since then
    late = Answer()  # as an agent's next step, after its tools ran

    revocation.watch_stream(late, revoked.pk)

    try:
        assert await ended(late)
        assert late.ended_by == [revocation.KEY_REVOKED]
        assert others.ended_by == []
    finally:
        revocation.unwatch_stream(others)
        revocation.unwatch_stream(late)


async def test_an_answer_whose_key_expires_during_it_is_ended_within_the_round_of_its_expiry(
    two_keys: tuple[APIKey, APIKey],
) -> None:
    expiring, kept = two_keys
    expiring.expires_at = timezone.now() + timedelta(seconds=2)
    await expiring.asave()
    answer, others = Answer(), Answer()
    revocation.watch_stream(answer, expiring.pk)
    revocation.watch_stream(others, kept.pk)

    try:
        # Nothing tells the watch of an expiry (no version bump), and it asks the database again only every
        # API_KEY_CACHE_SECONDS (30).
        await asyncio.sleep(2 + revocation.CHECK_SECONDS * 2)
        assert answer.ended_by == [revocation.KEY_REVOKED]
        assert others.ended_by == []
    finally:
        revocation.unwatch_stream(answer)
        revocation.unwatch_stream(others)


async def test_a_watch_that_cannot_check_the_keys_says_so_once_and_again_once_it_can(
    two_keys: tuple[APIKey, APIKey], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    _, kept = two_keys
    away = asyncio.Event()
    away.set()
    reachable = revocation.current_version

    async def version() -> object:
        ids.add(middleware._request_id.get())
        if away.is_set():
            raise redis.exceptions.ConnectionError("Error 111 connecting to localhost:6379. Connection refused.")
        return await reachable()

    monkeypatch.setattr(revocation, "current_version", version)
    answer = Answer()
    ids: set[str] = set()
    started_by = middleware._request_id.set("req_that_started_the_watch")
    revocation.watch_stream(answer, kept.pk)
    middleware._request_id.reset(started_by)
    try:
        await asyncio.sleep(revocation.CHECK_SECONDS * 3.5)  # three rounds that fail
        away.clear()
        await asyncio.sleep(revocation.CHECK_SECONDS * 2)
    finally:
        revocation.unwatch_stream(answer)

    said = [record for record in caplog.records if record.name == revocation.logger.name]
    assert [record.getMessage() for record in said] == [
        "could not check the keys of the answers under way (redis unavailable: ConnectionError: Error 111 "
        "connecting to localhost:6379. Connection refused.); trying again each second",
        "the keys of the answers under way are checked again",
    ]
    assert said[0].exc_info is None  # an outage in one line, not a traceback
    assert ids == {"-"}  # the watch outlives the request that started it, and does not log under its id
    assert answer.ended_by == []


async def test_an_answer_in_one_body_whose_key_is_revoked_during_it_is_a_401_and_bills_nothing(
    api: API, organization: Organization
) -> None:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Write a long story about a river."}],
        "max_tokens": 600,
        "temperature": 0,
    }
    answer = asyncio.create_task(api.post("/v1/infer/chat/completions", body))
    while not any(running.completion_tokens for running in generation._running.values()):
        await asyncio.sleep(0.02)

    key = await APIKey.objects.aget(organization=organization, name="tests")
    await sync_to_async(key.revoke)()
    response = await answer

    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    usage.flush()
    record = await UsageRecord.objects.aget()
    # Tokens were written, none were sent: the record bills what was served.
    assert (record.status, record.error_code, record.input_tokens, record.output_tokens) == (
        401,
        "invalid_api_key",
        0,
        0,
    )
