"""Requests beyond what a model can hold: its sequences busy and its queue full, the API answers 503 with
Retry-After before any response begins; a request waiting in the queue counts against the stream's time."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.test import override_settings

from inference.engine.execution import get_runner
from inference.engine.runners.base import GenerationJob, Sampling
from inference.models import CatalogEntry, UsageRecord
from inference.usage import records as usage
from orgs import admission
from orgs.models import Limit, Organization
from tests.conftest import API, read_stream, sse_data

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = "/v1/infer/chat/completions"
NARROW = "b3os/smollm2-one-sequence"


@pytest.fixture
def narrow_model(catalog_model: CatalogEntry) -> CatalogEntry:
    """The embedded model with one sequence and no queue: a second request finds no room."""
    return CatalogEntry.objects.create(
        public_id=NARROW,
        runner=catalog_model.runner,
        runner_settings={**catalog_model.runner_settings, "parallel": 1, "queue": 0, "n_ctx": 1024},
        context_length=1024,
        max_output_tokens=600,
    )


def ask(**overrides: Any) -> dict[str, Any]:
    return {
        "model": NARROW,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 8,
        **overrides,
    }


@contextmanager
def busy(model: CatalogEntry) -> Iterator[None]:
    """Long jobs holding the model's one sequence (one after another, should one end), until leaving."""
    runner = get_runner(model.runner, model.runner_settings)
    done = threading.Event()
    counting = "Count from 1 to 1000: 1, 2, 3, 4, 5,"
    job = GenerationJob(
        "busy",
        model.public_id,
        model.runner,
        model.runner_settings,
        counting,
        20,
        Sampling(max_tokens=600, temperature=0.0),
    )

    def hold() -> None:
        while not done.is_set():
            for _ in runner.stream(job, done.is_set):
                pass

    holder = threading.Thread(target=hold)
    holder.start()
    while runner.stats().active < 1:
        time.sleep(0.01)
    try:
        yield
    finally:
        done.set()
        holder.join(timeout=60)


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, ask()),
        (CHAT, ask(stream=True)),
        ("/v1/infer/responses", {"model": NARROW, "input": "Hi", "stream": True}),
    ],
)
async def test_a_model_with_no_room_answers_503_with_retry_after_before_any_response(
    api: API, narrow_model: CatalogEntry, path: str, body: dict[str, Any]
) -> None:
    with busy(narrow_model):
        refused = await api.post(path, body)

        assert refused.status_code == 503
        assert refused["Retry-After"] == "2"
        error = refused.json()["error"]
        assert (error["code"], error["type"]) == ("overloaded", "server_error")
    usage.flush()
    record = await UsageRecord.objects.filter(status=503).aget()
    assert (record.error_code, record.input_tokens, record.output_tokens) == ("overloaded", 0, 0)


async def test_a_503_for_a_model_with_no_room_is_logged_as_a_warning_not_an_error(
    api: API, narrow_model: CatalogEntry, caplog: pytest.LogCaptureFixture
) -> None:
    with busy(narrow_model):
        assert (await api.post(CHAT, ask())).status_code == 503

    (logged,) = [record for record in caplog.records if record.name == "django.request"]
    assert logged.levelname == "WARNING" and "Service Unavailable" in logged.getMessage()


async def test_the_503_of_a_model_with_no_room_carries_the_callers_rate_limit_headers(
    api: API, narrow_model: CatalogEntry, organization: Organization
) -> None:
    await Limit.objects.acreate(organization=organization, requests_per_minute=5)
    admission.clear_limits_cache()
    with busy(narrow_model):
        refused = await api.post(CHAT, ask())

    assert refused.status_code == 503
    # The request no model took is not counted: all five requests are left.
    assert (refused["x-ratelimit-limit-requests"], refused["x-ratelimit-remaining-requests"]) == ("5", "5")
    assert refused["Retry-After"] == "2"


async def test_requests_a_model_with_no_room_refused_leave_the_callers_limits_as_they_were(
    api: API, narrow_model: CatalogEntry, organization: Organization
) -> None:
    await Limit.objects.acreate(organization=organization, requests_per_minute=3, tokens_per_minute=100_000)
    admission.clear_limits_cache()
    with busy(narrow_model):
        for _ in range(3):
            assert (await api.post(CHAT, ask())).status_code == 503

    served = await api.post(CHAT, ask())

    # Three refusals and one request served: one request and its tokens count, the limit of three is not reached.
    assert served.status_code == 200, served.content
    assert served["x-ratelimit-remaining-requests"] == "2"
    # Its own charge at admission (its prompt and max_tokens) is all the tokens window holds.
    assert 100_000 - int(served["x-ratelimit-remaining-tokens"]) == served.json()["usage"]["prompt_tokens"] + 8


@override_settings(STREAM_MAX_SECONDS=2)
async def test_time_waiting_in_the_queue_counts_against_the_stream(api: API, narrow_model: CatalogEntry) -> None:
    narrow_model.runner_settings = {**narrow_model.runner_settings, "queue": 1}
    await narrow_model.asave()
    with busy(narrow_model):
        started = asyncio.get_running_loop().time()
        queued = await api.post(CHAT, ask(stream=True))
        data = sse_data(await read_stream(queued))

        assert asyncio.get_running_loop().time() - started < 10
    chunks = [json.loads(item) for item in data[:-1]]
    assert data[-1] == "[DONE]"
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] == [
        "length"
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_that_hangs_up_while_queued_is_recorded_with_no_tokens_streamed_or_not(
    api: API, narrow_model: CatalogEntry, stream: bool
) -> None:
    narrow_model.runner_settings = {**narrow_model.runner_settings, "queue": 1}
    await narrow_model.asave()
    with busy(narrow_model):
        if stream:  # the answer has begun (its head sent), and waits for its job's first token
            response = await api.post(CHAT, ask(stream=True))
            request = asyncio.ensure_future(read_stream(response))
        else:
            request = asyncio.ensure_future(api.post(CHAT, ask()))
        await asyncio.sleep(1.0)  # queued behind the busy sequence, no token yet
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)

    usage.flush()
    record = await UsageRecord.objects.aget()
    assert (record.status, record.error_code) == (499, "client_disconnected")
    assert (record.input_tokens, record.output_tokens) == (0, 0)


async def test_a_client_that_hangs_up_on_a_whole_answer_is_recorded_as_gone(
    api: API, catalog_model: CatalogEntry
) -> None:
    # An answer held to a long array cannot end on its own before the client leaves, once the model has begun it.
    numbers = {"type": "array", "items": {"type": "integer"}, "minItems": 300}
    long_answer = {"type": "json_schema", "json_schema": {"name": "numbers", "schema": numbers}}
    runner = await asyncio.to_thread(get_runner, catalog_model.runner, catalog_model.runner_settings)
    request = asyncio.ensure_future(
        api.post(
            CHAT,
            {**ask(max_tokens=900), "model": catalog_model.public_id, "response_format": long_answer},
        )
    )
    deadline = time.monotonic() + 60
    while runner.stats().active < 1 and time.monotonic() < deadline:  # type: ignore[attr-defined]
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)
    request.cancel()
    await asyncio.gather(request, return_exceptions=True)

    usage.flush()
    record = await UsageRecord.objects.aget()
    assert (record.status, record.error_code) == (499, "client_disconnected")
