"""A worker's publisher puts every job's events on the reply channels of a real Redis: what was posted since it last
looked leaves as one message per channel, numbered in order, and nothing after a job's last event."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.test import override_settings

import core.redis as redis_clients
from inference.engine.execution import Accepted
from inference.engine.replies import MESSAGE_TYPE, Publisher, Reply
from inference.engine.runners.base import Finished, TextChunk
from tests.services import Redis

pytestmark = pytest.mark.distributed


@pytest.fixture
def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Redis]:
    started = Redis(tmp_path).start()
    monkeypatch.setattr(redis_clients, "_sync_client", None)
    with override_settings(REDIS_URL=started.url):
        yield started
    started.stop()


def publisher() -> Publisher:
    return Publisher(lambda message: json.dumps(message).encode())


def reply(channel: str) -> Reply:
    return Reply(channel, f"job-{channel}", threading.Event())


class Listener:
    """A subscriber to the reply channels, as an API process is."""

    def __init__(self, server: Redis, *channels: str) -> None:
        self._pubsub = redis.Redis.from_url(server.url).pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(*channels)

    def messages(self, count: int, timeout: float = 10) -> list[tuple[str, dict[str, Any]]]:
        received: list[tuple[str, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout
        while len(received) < count and time.monotonic() < deadline:
            if message := self._pubsub.get_message(timeout=0.1):
                received.append((message["channel"].decode(), json.loads(message["data"])))
        return received


def test_what_is_posted_while_the_publisher_is_busy_leaves_as_one_message_per_channel_numbered_in_order(
    server: Redis,
) -> None:
    listener = Listener(server, "a", "b")
    sending, a, b = publisher(), reply("a"), reply("b")
    busy = threading.Event()
    sending.post(a, [], then=busy.wait)
    assert listener.messages(1) == [("a", {"type": MESSAGE_TYPE, "seq": 0, "events": []})]  # out, its thread held
    sending.post(a, [Accepted()])
    sending.post(b, [Accepted()])
    sending.post(a, [TextChunk("x", 1)])
    busy.set()

    assert listener.messages(2) == [
        ("a", {"type": MESSAGE_TYPE, "seq": 1, "events": [["a"], ["t", "x", 1, [], 0]]}),
        ("b", {"type": MESSAGE_TYPE, "seq": 0, "events": [["a"]]}),
    ]
    assert not a.cancelled.is_set() and not b.cancelled.is_set()


def test_nothing_posted_after_a_jobs_last_event_is_sent_and_its_poster_still_hears_back(server: Redis) -> None:
    listener = Listener(server, "a")
    sending, a = publisher(), reply("a")
    heard = threading.Event()
    sending.post(a, [Finished("stop", 3, 1)], last=True)
    sending.post(a, [TextChunk("late", 1)], then=heard.set)

    assert heard.wait(10)
    last = {"type": MESSAGE_TYPE, "seq": 0, "events": [["f", "stop", 3, 1, 0]]}
    assert listener.messages(2, timeout=1) == [("a", last)]


def test_events_redis_cannot_take_stop_their_job_and_the_publisher_serves_the_next_once_redis_is_back(
    server: Redis,
) -> None:
    sending, a, b = publisher(), reply("a"), reply("b")
    server.stop()
    heard = threading.Event()
    sending.post(a, [Accepted()], then=heard.set)
    assert heard.wait(30)
    assert a.cancelled.is_set()

    server.start()
    listener = Listener(server, "b")
    sending.post(b, [Accepted()])
    assert listener.messages(1) == [("b", {"type": MESSAGE_TYPE, "seq": 0, "events": [["a"]]})]
    assert not b.cancelled.is_set()
