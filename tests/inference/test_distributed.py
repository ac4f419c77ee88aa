"""The distributed path end to end: a real redis-server, a real Celery worker process, the API in another process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from channels.layers import get_channel_layer
from django.test import override_settings

from inference.engine import dispatch, generation
from inference.engine.dispatch import PRESENCE_TTL_SECONDS, ChannelJob, presence_key
from inference.engine.exceptions import NotStarted
from inference.engine.execution import Accepted, JobFailed
from inference.engine.generation import GenerationRequest
from inference.engine.replies import MESSAGE_TYPE
from inference.engine.runners.base import Finished, GenerationJob, Sampling, TextChunk
from inference.models import CatalogEntry
from tests.conftest import (
    DEFAULT_MODEL,
    MODEL_ID,
    ROOT,
    LiveServer,
    free_port,
    start_server,
    stop_server,
    wait_for_http,
    wait_until,
)
from tests.services import Redis

pytestmark = pytest.mark.distributed

QUEUE = "model." + MODEL_ID.replace("/", ".")


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()


def start_redis(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: `make test` installs it")
    port = free_port()
    process = subprocess.Popen(
        [
            "redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        probe = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        if probe.stdout.strip() == "PONG":
            return process, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.1)
    raise RuntimeError("redis-server did not start")


def start_worker(env: dict[str, str], log: Path, concurrency: int = 1) -> Worker:
    handle = open(log, "wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "config",
            "worker",
            "-Q",
            QUEUE,
            "--pool",
            "threads",
            "--concurrency",
            str(concurrency),
            "--without-gossip",
            "--without-mingle",
            "-l",
            "info",
        ],
        cwd=ROOT,
        env=env,
        stdout=handle,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if b"ready." in log.read_bytes():
            return Worker(process, log)
        if process.poll() is not None:
            raise RuntimeError(f"the worker exited:\n{log.read_text()}")
        time.sleep(0.2)
    raise RuntimeError("the worker did not become ready")


@dataclass
class Cluster:
    redis: Redis
    server: LiveServer
    worker: Worker
    env: dict[str, str]
    var_dir: Path

    def restart_worker(self) -> None:
        self.worker.stop()
        self.worker = start_worker(self.env, self.var_dir / f"worker-{time.monotonic_ns()}.log")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    var_dir = tmp_path_factory.mktemp("distributed")
    redis = Redis(var_dir).start()  # on a port it can be started again on
    extra = {"REDIS_URL": redis.url, "WORKER_SILENCE_TIMEOUT_SECONDS": "3", "JOB_START_TIMEOUT_SECONDS": "15"}
    server = start_server(var_dir, extra_env=extra, org="dist")
    env = {**server.env}
    worker = start_worker(env, var_dir / "worker.log")
    cluster = Cluster(redis=redis, server=server, worker=worker, env=env, var_dir=var_dir)
    yield cluster
    cluster.worker.stop()
    stop_server(server)
    redis.stop()


def post(cluster: Cluster, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(
        cluster.server.url + "/v1/infer/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {cluster.server.key}"},
        timeout=60,
        **kwargs,
    )


def stream_lines(cluster: Cluster, body: dict) -> Iterator[str]:
    with httpx.stream(
        "POST",
        cluster.server.url + "/v1/infer/chat/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {cluster.server.key}"},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        yield from response.iter_lines()


QUESTION = {
    "model": MODEL_ID,
    "messages": [{"role": "user", "content": "Name one river in Oregon."}],
    "max_tokens": 24,
    "temperature": 0,
}


def test_a_streamed_request_runs_on_the_worker_and_matches_the_whole_answer(cluster: Cluster) -> None:
    whole = post(cluster, QUESTION)
    assert whole.status_code == 200, whole.text
    lines = [line[6:] for line in stream_lines(cluster, QUESTION) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == whole.json()["choices"][0]["message"]["content"]
    assert "inference.generate" in cluster.worker.log.read_text()


def streamed_text(cluster: Cluster, body: dict) -> str:
    lines = [line[6:] for line in stream_lines(cluster, body) if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines[:-1])


def test_streams_running_at_once_on_one_worker_each_get_their_own_whole_answer(cluster: Cluster) -> None:
    # The worker's one publisher sends every job's events, a decode step's together: none may land on another
    # stream, or be lost, or come out of order.
    questions = ["Name one river in Oregon.", "Write a haiku about rain.", "What is 2 + 2?", "Tell me about the moon."]
    bodies = [{**QUESTION, "messages": [{"role": "user", "content": q}], "max_tokens": 32} for q in questions]
    alone = [post(cluster, body).json()["choices"][0]["message"]["content"] for body in bodies]
    cluster.worker.stop()
    cluster.worker = start_worker(cluster.env, cluster.var_dir / "worker-4-threads.log", concurrency=4)
    try:
        with ThreadPoolExecutor(4) as clients:
            together = list(clients.map(lambda body: streamed_text(cluster, body), bodies))
    finally:
        cluster.restart_worker()

    assert together == alone
    assert len(set(alone)) == 4


def test_a_forced_tool_call_works_across_the_wire(cluster: Cluster) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    response = post(
        cluster,
        {
            **QUESTION,
            "max_tokens": 60,
            "tools": [tool],
            "tool_choice": "required",
            "messages": [{"role": "user", "content": "Weather in Eugene?"}],
        },
    )
    call = response.json()["choices"][0]["message"]["tool_calls"][0]
    assert "city" in json.loads(call["function"]["arguments"])


def test_a_client_that_hangs_up_cancels_the_job_on_the_worker(cluster: Cluster) -> None:
    body = {
        **QUESTION,
        "max_tokens": 2000,
        "temperature": 0.9,
        "messages": [{"role": "user", "content": "Tell a long story."}],
    }
    seen = 0
    for line in stream_lines(cluster, body):
        seen += line.startswith("data: ")
        if seen >= 5:
            break
    # The worker has one thread: it can take the next job only once the abandoned one stopped.
    started = time.monotonic()
    quick = post(cluster, {**QUESTION, "max_tokens": 4})
    assert quick.status_code == 200
    assert time.monotonic() - started < 15


@contextlib.contextmanager
def queued_behind_an_endless_job(cluster: Cluster) -> Iterator[Future[httpx.Response]]:
    """A short request, sent while the worker's one thread runs an endless one: its job waits on the queue. The
    endless one ends on leaving, and the short one's answer is in."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        lines = stream_lines(cluster, ENDLESS)
        next(line for line in lines if line.startswith("data: "))
        try:
            yield pool.submit(post, cluster, {**QUESTION, "max_tokens": 4})
        finally:
            lines.close()


def test_a_worker_takes_no_job_it_has_no_thread_for_so_none_is_lost_with_it(cluster: Cluster) -> None:
    # Taken off the queue's list, a job would wait in the worker's memory for a thread: lost if the worker died, its
    # client waiting for the start timeout with another worker serving the queue.
    queued = redis.Redis.from_url(cluster.redis.url)
    with queued_behind_an_endless_job(cluster) as waiting:
        assert wait_until(lambda: queued.llen(QUEUE) == 1), "the next job should wait in Redis, not in the worker"
        time.sleep(1)  # and stay there while the worker has no thread for it
        assert queued.llen(QUEUE) == 1

    assert waiting.result().status_code == 200  # taken by the thread the endless job left


def test_a_queued_job_redis_lost_fails_soon_with_a_503_not_at_the_start_timeout(cluster: Cluster) -> None:
    # As a Redis restart without persistence loses it, between two of the API process's looks at Redis.
    store = redis.Redis.from_url(cluster.redis.url)
    with queued_behind_an_endless_job(cluster) as waiting:
        assert wait_until(lambda: store.llen(QUEUE) == 1)
        store.delete(QUEUE, *store.keys(dispatch.queued_key("*")))
        lost_at = time.monotonic()

        refused = waiting.result(timeout=30)

        # Within dispatch.LOST_AFTER_SECONDS and a look, not at JOB_START_TIMEOUT_SECONDS (15 here) as a 503 overloaded.
        assert time.monotonic() - lost_at < 10
    assert refused.status_code == 503 and refused.headers["Retry-After"]
    assert refused.json()["error"]["code"] == "service_unavailable"


def test_a_worker_that_dies_mid_stream_ends_the_stream_with_an_error(cluster: Cluster) -> None:
    body = {
        **QUESTION,
        "max_tokens": 2000,
        "temperature": 0.9,
        "messages": [{"role": "user", "content": "Tell a long story."}],
    }
    events: list[str] = []
    killed_at = None
    try:
        for line in stream_lines(cluster, body):
            if line.startswith("data: "):
                events.append(line[6:])
            if len(events) == 3 and killed_at is None:
                os.kill(cluster.worker.process.pid, signal.SIGKILL)
                killed_at = time.monotonic()
        assert killed_at is not None
        assert time.monotonic() - killed_at < 10
        last = json.loads(events[-1])
        assert last["error"]["code"] == "worker_lost"
    finally:
        cluster.restart_worker()
    assert post(cluster, {**QUESTION, "max_tokens": 4}).status_code == 200


def stream_while_the_worker_stops(cluster: Cluster, sig: signal.Signals) -> tuple[list[dict[str, Any]], float, int]:
    """Streams a long answer, sends the worker ``sig`` after its third event: the stream's events, how long it went
    on after the signal, and the worker's exit status. The worker is started again after."""
    events: list[dict[str, Any]] = []
    stopped_at = None
    try:
        for line in stream_lines(cluster, ENDLESS):
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
            if len(events) == 3 and stopped_at is None:
                cluster.worker.process.send_signal(sig)
                stopped_at = time.monotonic()
        assert stopped_at is not None
        ended_after = time.monotonic() - stopped_at
        status = cluster.worker.process.wait(timeout=15)
    finally:
        cluster.restart_worker()
    return events, ended_after, status


def test_a_worker_told_to_stop_lets_its_job_run_for_the_grace_period_then_ends_it_with_server_shutting_down(
    cluster: Cluster,
) -> None:
    cluster.worker.stop()
    cluster.worker = start_worker({**cluster.env, "SHUTDOWN_GRACE_SECONDS": "3"}, cluster.var_dir / "worker-grace.log")

    events, ended_after, status = stream_while_the_worker_stops(cluster, signal.SIGTERM)  # as systemd or Ctrl-C do

    # The stream went on through the grace period (the job was not cut at once), then ended with an error a client
    # retries, and the worker exited cleanly instead of holding the job up to STREAM_MAX_SECONDS.
    assert ended_after >= 3 and status == 0
    text = [event for event in events if "choices" in event and event["choices"][0]["delta"].get("content")]
    assert len(text) > 10
    assert events[-1]["error"]["code"] == "server_shutting_down"
    assert "ended 1 jobs still running after the 3s grace period" in (cluster.var_dir / "worker-grace.log").read_text()
    assert post(cluster, {**QUESTION, "max_tokens": 4}).status_code == 200


def test_a_worker_stopped_cold_ends_its_job_at_once_with_server_shutting_down(cluster: Cluster) -> None:
    events, ended_after, _ = stream_while_the_worker_stops(cluster, signal.SIGQUIT)

    assert events[-1]["error"]["code"] == "server_shutting_down"
    assert ended_after < 3  # SHUTDOWN_GRACE_SECONDS (25) is a warm stop's, not a cold one's


def queue_served(cluster: Cluster) -> bool:
    return bool(redis.Redis.from_url(cluster.env["REDIS_URL"]).exists(presence_key(QUEUE)))


def test_a_running_worker_says_it_consumes_its_queue(cluster: Cluster) -> None:
    assert queue_served(cluster)


def test_no_worker_for_the_model_is_a_clear_error_before_the_start_timeout(cluster: Cluster) -> None:
    cluster.worker.stop()
    try:
        assert wait_until(lambda: not queue_served(cluster), timeout=PRESENCE_TTL_SECONDS + 5)
        response = post(cluster, {**QUESTION, "max_tokens": 4})
        # Streamed too, it is refused before any response begins, not a 200 stream ending in an error.
        streamed = post(cluster, {**QUESTION, "max_tokens": 4, "stream": True})

        for refused in (response, streamed):
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            error = refused.json()["error"]
            assert error["code"] == "no_worker"
            assert "no model worker is serving this model" in error["message"]
        # Told by the queue's lapsed presence, not by the start timeout (``JOB_START_TIMEOUT_SECONDS``).
        assert f"no_worker: no worker consumes the queue {QUEUE}" in (cluster.var_dir / "server.log").read_text()
    finally:
        cluster.restart_worker()
    assert post(cluster, {**QUESTION, "max_tokens": 4}).status_code == 200


def reply_channels(cluster: Cluster) -> list[str]:
    """The reply channels some API process listens on."""
    client = redis.Redis.from_url(cluster.env["REDIS_URL"], decode_responses=True)
    return [str(channel) for channel in client.pubsub_channels("asgijob.*")]


# An answer held to a long array: the model cannot end it early on its own.
ENDLESS = {
    **QUESTION,
    "max_tokens": 2048,  # the model's most
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "numbers", "schema": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},
    },
}


def test_a_reply_channel_is_closed_when_its_job_ends_or_its_client_hangs_up(cluster: Cluster) -> None:
    assert post(cluster, QUESTION).status_code == 200
    assert wait_until(lambda: reply_channels(cluster) == [])
    for seen, _ in enumerate(stream_lines(cluster, ENDLESS)):
        if seen == 5:
            assert len(reply_channels(cluster)) == 1
            break
    assert wait_until(lambda: reply_channels(cluster) == [])
    assert wait_until(lambda: "nobody listens on its reply channel" in cluster.worker.log.read_text())


def test_a_job_whose_api_process_died_stops_on_the_worker(cluster: Cluster) -> None:
    port = free_port()
    with open(cluster.var_dir / "doomed-server.log", "wb") as log:
        doomed = subprocess.Popen(
            [sys.executable, "manage.py", "serve", "--port", str(port)],
            cwd=ROOT,
            env=cluster.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_http(f"http://127.0.0.1:{port}/v1/infer/models", process=doomed)
        with httpx.stream(
            "POST",
            f"http://127.0.0.1:{port}/v1/infer/chat/completions",
            json={**ENDLESS, "stream": True},
            headers={"Authorization": f"Bearer {cluster.server.key}"},
            timeout=60,
        ) as response:
            for seen, _ in enumerate(response.iter_lines()):
                if seen == 5:
                    doomed.kill()  # no cancel, no unsubscribe: the process is simply gone
                    break
    finally:
        doomed.kill()
        doomed.wait()
    # The worker has one thread: the next job runs once the orphaned one stopped, not 3,000 tokens later.
    assert wait_until(lambda: "nobody listens on its reply channel" in cluster.worker.log.read_text())
    assert post(cluster, {**QUESTION, "max_tokens": 4}).status_code == 200


Publish = Callable[[int, list[list[Any]]], Awaitable[None]]


@contextlib.asynccontextmanager
async def worker_played_by_the_test(cluster: Cluster) -> AsyncIterator[tuple[AsyncIterator[list[Any]], Publish]]:
    """A job's events as this process reads them, and a way to publish its worker's messages by hand: the first
    message is published once the job's reply channel is listened on."""
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    job = GenerationJob("by-hand", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
        events = ChannelJob(job, queue="model.nobody-consumes-this").events()
        first = asyncio.ensure_future(anext(events))
        assert await asyncio.to_thread(wait_until, lambda: len(reply_channels(cluster)) == 1)
        [reply] = reply_channels(cluster)

        async def publish(seq: int, events: list[list[Any]]) -> None:
            await get_channel_layer().send(reply, {"type": MESSAGE_TYPE, "seq": seq, "events": events})

        async def read() -> AsyncIterator[list[Any]]:
            yield await first
            async for batch in events:
                yield batch

        yield read(), publish


@pytest.mark.parametrize(("served", "code"), [(True, "overloaded"), (False, "no_worker")])
async def test_a_queue_whose_backlog_is_full_refuses_a_job_at_once_as_overloaded_or_unserved(
    cluster: Cluster, served: bool, code: str
) -> None:
    queue = "model.played-by-the-test"
    url = cluster.env["REDIS_URL"]
    client = redis.Redis.from_url(url)
    client.lpush(queue, *[b"a job waiting for a worker"] * 4)  # JOB_BACKLOG_MAX's default
    if served:  # a worker says it consumes the queue, and has no room
        client.set(presence_key(queue), 1, ex=PRESENCE_TTL_SECONDS)
    job = GenerationJob("refused", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    try:
        with override_settings(REDIS_URL=url):
            batches = [batch async for batch in ChannelJob(job, queue=queue).events()]
    finally:
        client.delete(queue, presence_key(queue))

    # Without a worker, the list holds jobs left by callers that gave up on them: it is no worker, not no room.
    [[refused]] = batches
    assert isinstance(refused, JobFailed) and refused.code == code
    assert reply_channels(cluster) == []  # refused before any reply channel was opened


@pytest.mark.parametrize(("served", "code"), [(True, "overloaded"), (False, "no_worker")])
async def test_a_job_no_worker_starts_in_time_is_overloaded_when_its_queue_is_served_else_unserved(
    cluster: Cluster, served: bool, code: str
) -> None:
    """A worker run with fewer threads than its model holds takes jobs it cannot start yet: its queue is served,
    and it had no room."""
    queue = "model.no-room-in-time"
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    client = redis.Redis.from_url(url)
    if served:
        client.set(presence_key(queue), 1, ex=60)
    job = GenerationJob("no-room", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    try:
        # Shorter than the presence key's lapse: the start timeout ends the wait either way.
        with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}, JOB_START_TIMEOUT_SECONDS=2.5):
            batches = [batch async for batch in ChannelJob(job, queue=queue).events()]
    finally:
        client.delete(queue, presence_key(queue))

    [[refused]] = batches
    assert isinstance(refused, JobFailed) and refused.code == code


@pytest.mark.parametrize("breaks", [1, 2])
async def test_a_subscribe_broken_by_a_reconnect_race_is_tried_again_then_a_503_never_a_500(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, breaks: int
) -> None:
    """After a Redis restart, channels_redis's receive task and a subscribe both reconnect its one pub/sub connection,
    and redis-py fails with errors that are not its ConnectionError."""
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    job = GenerationJob(
        "raced", MODEL_ID, "llama_cpp", DEFAULT_MODEL["runner_settings"], "Hello", 1, Sampling(max_tokens=2)
    )
    with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
        channel_job = ChannelJob(job, queue=QUEUE)
        new_channel = channel_job._layer.new_channel
        failures = [
            RuntimeError("read() called while another coroutine is already waiting for incoming data"),
            AttributeError("'NoneType' object has no attribute 'writelines'"),
        ][:breaks]

        async def racing(*args: Any, **kwargs: Any) -> str:
            if failures:
                raise failures.pop(0)
            return str(await new_channel(*args, **kwargs))

        monkeypatch.setattr(channel_job._layer, "new_channel", racing)
        if breaks == 1:  # tried again on the reconnected connection: subscribed
            await channel_job._open_reply()
            assert await asyncio.to_thread(reply_channels, cluster) != []
            await channel_job._close()
            return
        batches = [batch async for batch in channel_job.events()]

    [[failed]] = batches
    assert isinstance(failed, JobFailed) and (failed.code, failed.outage) == ("service_unavailable", "redis")


async def test_an_unsubscribe_broken_by_a_reconnect_race_is_tried_again(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The layer's own unsubscribe failed (Redis away); the one sent after it meets the same race as a subscribe."""
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    job = GenerationJob("raced-close", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=2))
    with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
        channel_job = ChannelJob(job, queue=QUEUE)
        reply = await channel_job._open_reply()
        shard = channel_job._layer._get_layer()._get_shard(reply)
        pubsub = shard._pubsub
        execute = pubsub.execute_command
        races = [RuntimeError("read() called while another coroutine is already waiting for incoming data")]

        async def unsubscribe_in_an_outage(channel: str) -> None:
            raise redis.exceptions.ConnectionError("Connection closed by server.")

        async def racing(*args: Any) -> Any:
            if races:
                raise races.pop()
            return await execute(*args)

        monkeypatch.setattr(shard, "unsubscribe", unsubscribe_in_an_outage)
        monkeypatch.setattr(pubsub, "execute_command", racing)
        await channel_job._close()

        assert await asyncio.to_thread(wait_until, lambda: reply not in reply_channels(cluster), timeout=10)
        assert races == []


@pytest.mark.parametrize("connection", ["warm", "cold"])
@pytest.mark.parametrize("steps", range(10))
async def test_a_job_cancelled_as_its_reply_channel_is_opened_leaves_no_channel_and_is_queued_only_once_open(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch, steps: int, connection: str
) -> None:
    """The client hangs up ``steps`` event-loop steps into its job's start: inside channels_redis's subscribe (which
    swallows a cancellation at some steps, and on a connection still being made leaves the channel subscribed at
    others) or while the job is handed to Celery (which goes on in its thread: the worker finds nobody listening)."""
    queue = "model.nobody-consumes-this"
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    job = GenerationJob("hung-up", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    sent: list[object] = []
    opened: list[str] = []

    async def no_backlog() -> int:
        return 0

    monkeypatch.setattr(dispatch.current_app, "send_task", lambda *args, **kwargs: sent.append(args))
    with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
        channel_layer = get_channel_layer()
        if connection == "warm":
            await channel_layer.new_channel(prefix="warm.")  # its connection made, as a serving process's is
        new_channel = channel_layer.new_channel

        async def noted_new_channel(prefix: str) -> str:
            opened.append(channel := await new_channel(prefix))
            return channel

        monkeypatch.setattr(channel_layer, "new_channel", noted_new_channel)
        channel_job = ChannelJob(job, queue=queue)
        monkeypatch.setattr(channel_job, "_backlog", no_backlog)  # the subscribe is the first thing it waits for
        first = asyncio.ensure_future(anext(channel_job.events()))
        for _ in range(steps):
            await asyncio.sleep(0)
        open_before_the_hang_up = bool(opened)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        async with asyncio.timeout(10):  # the subscribe, and the unsubscribe after it, go on past the request
            while dispatch._background:
                await asyncio.sleep(0.01)
        assert await asyncio.to_thread(wait_until, lambda: reply_channels(cluster) == [])
        assert [channel for channel in channel_layer.channels if channel.startswith("asgijob.")] == []
    assert sent == [] or open_before_the_hang_up


async def test_a_job_cancelled_again_while_it_closes_its_reply_channel_still_closes_it(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client hangs up, and a second cancellation (the server shutting down) lands while the job closes its reply
    channel: the channel is closed all the same, which is what tells the worker to stop."""
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    job = GenerationJob("hung-up-twice", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    monkeypatch.setattr(dispatch.current_app, "send_task", lambda *args, **kwargs: None)
    with override_settings(REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
        first = asyncio.ensure_future(anext(ChannelJob(job, queue="model.nobody-consumes-this").events()))
        assert await asyncio.to_thread(wait_until, lambda: len(reply_channels(cluster)) == 1)
        first.cancel()
        await asyncio.sleep(0)  # the job starts closing its reply channel
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert await asyncio.to_thread(wait_until, lambda: reply_channels(cluster) == [])


async def test_a_job_still_waiting_for_a_worker_when_the_server_shuts_down_is_refused_and_never_left_running(
    cluster: Cluster,
) -> None:
    """The worker's threads are all busy: the job waits in the queue, and the request for its first event, when the
    grace period ends; it ends before any response begins (503), its job cancelled."""
    url = cluster.env["REDIS_URL"]
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [url]}}
    entry = CatalogEntry(**{**DEFAULT_MODEL, "public_id": "b3os/every-worker-busy"})
    client = redis.Redis.from_url(url)
    client.set(presence_key(entry.queue), "1", ex=60)  # a worker consumes the queue, with no thread free
    try:
        with override_settings(DISTRIBUTED=True, REDIS_URL=url, CHANNEL_LAYERS={"default": layer}):
            waiting = await generation.prepare(
                entry=entry, request=GenerationRequest(messages=[{"role": "user", "content": "Hello"}])
            )
            starting = asyncio.ensure_future(waiting.start())
            assert await asyncio.to_thread(wait_until, lambda: len(reply_channels(cluster)) == 1)

            assert generation.interrupt_all() == 1
            with pytest.raises(NotStarted) as refused:
                await starting
            assert refused.value.code == "server_shutting_down"
            assert await asyncio.to_thread(wait_until, lambda: reply_channels(cluster) == [])
    finally:
        client.delete(presence_key(entry.queue), entry.queue)


async def test_a_reply_channel_closed_while_redis_is_away_is_not_subscribed_again_once_redis_is_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client hangs up while Redis restarts: channels_redis's unsubscribe fails then, and its connection would
    subscribe to the channel again once Redis is back."""
    server = Redis(tmp_path).start()
    layer = {"BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer", "CONFIG": {"hosts": [server.url]}}
    job = GenerationJob("hung-up-in-an-outage", MODEL_ID, "llama_cpp", {}, "Hello", 1, Sampling(max_tokens=4))
    monkeypatch.setattr(dispatch.current_app, "send_task", lambda *args, **kwargs: None)

    def channels() -> list[str]:
        return sorted(server.cli("pubsub", "channels", "asgi*").split())

    try:
        with override_settings(REDIS_URL=server.url, CHANNEL_LAYERS={"default": layer}):
            kept = await get_channel_layer().new_channel(prefix="kept.")  # another request's, open throughout
            first = asyncio.ensure_future(anext(ChannelJob(job, queue="model.nobody-consumes-this").events()))
            assert await asyncio.to_thread(wait_until, lambda: len(channels()) == 2)
            server.stop()
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            server.start()
            # Once the layer's connection is back (the open channel subscribed again), the closed one is not. The layer
            # reconnects with redis-py's default back-off, up to 10 s between tries.
            assert await asyncio.to_thread(wait_until, lambda: channels() == [kept], timeout=40), channels()
    finally:
        server.stop()


async def test_a_message_lost_on_the_way_ends_the_stream_with_an_error(cluster: Cluster) -> None:
    async with worker_played_by_the_test(cluster) as (events, publish):
        # A worker's messages 0 and 2: 1 never arrived.
        await publish(0, [["a"]])
        await publish(2, [["t", "x", 1, []]])
        assert len(await anext(events)) == 1
        [failed] = await anext(events)
        assert failed == JobFailed("service_unavailable", "the model's events were lost on the way")
        assert await asyncio.to_thread(wait_until, lambda: reply_channels(cluster) == [])


async def test_a_message_that_arrives_twice_is_read_once(cluster: Cluster) -> None:
    async with worker_played_by_the_test(cluster) as (events, publish):
        # A worker sends a message again when sending it failed on a closed connection; the first may have arrived.
        await publish(0, [["a"]])
        await publish(1, [["t", "x", 1, []]])
        await publish(1, [["t", "x", 1, []]])
        await publish(2, [["f", "length", 3, 1, 0]])
        assert [await anext(events) for _ in range(3)] == [[Accepted()], [TextChunk("x")], [Finished("length", 3, 1)]]


async def test_the_first_batch_is_the_runners_answer_not_the_workers_start_or_heartbeat(cluster: Cluster) -> None:
    async with worker_played_by_the_test(cluster) as (events, publish):
        # Started, a heartbeat, then the runner's refusal: what decides between a 503 and a stream.
        await publish(0, [])
        await publish(1, [])
        await publish(2, [["e", "overloaded", "the queue is full"]])
        assert await anext(events) == [JobFailed("overloaded", "the queue is full")]


def test_after_a_redis_restart_the_next_jobs_on_the_same_worker_all_succeed(cluster: Cluster) -> None:
    # The worker's one thread keeps its event loop, and the Redis connections made on it, from job to job, and the
    # API process keeps its subscriber to reply channels, idle between requests: the restart closes them all, which
    # goes unnoticed until the next jobs use them.
    short = {**QUESTION, "max_tokens": 4}
    answer = post(cluster, short)
    assert answer.status_code == 200, answer.text
    assert wait_until(lambda: reply_channels(cluster) == [])
    time.sleep(0.2)  # the API process has read that its last reply channel is closed: its subscriber idles
    log = cluster.worker.log.read_text()
    cluster.redis.stop()
    time.sleep(0.5)
    cluster.redis.start()
    # The jobs go out once the worker takes jobs again, so that they meet the API process's idle subscriber first.
    assert wait_until(
        lambda: cluster.worker.log.read_text().count("Connected to redis") > log.count("Connected to redis")
    )

    with ThreadPoolExecutor(2) as clients:  # two requests at once: both subscribe on the closed connection
        after = list(clients.map(lambda _: post(cluster, short), range(2)))
    after += [post(cluster, short) for _ in range(2)]

    assert [response.status_code for response in after] == [200] * 4, [response.text for response in after]
    # Every event arrived, in order: the same answer as before the restart (temperature 0).
    expected = answer.json()["choices"][0]["message"]
    assert [response.json()["choices"][0]["message"] for response in after] == [expected] * 4
    assert "Redis is unavailable" not in cluster.worker.log.read_text()[len(log) :]


def test_a_worker_outlives_redis_changing_role_under_it_and_serves_once_a_master_is_back(cluster: Cluster) -> None:
    # A failover: the master made a replica ends the worker's blocked read (UNBLOCKED), and until the name reaches a
    # master again each reconnection's queue declaration is refused (READONLY). Either used to kill the worker.
    worker = cluster.worker.process
    log = cluster.worker.log.read_text()
    cluster.redis.cli("replicaof", "127.0.0.1", str(free_port()))  # a master never reached: the data stays
    try:
        assert wait_until(lambda: "ReadOnlyError" in cluster.worker.log.read_text()[len(log) :])
        time.sleep(1)
    finally:
        cluster.redis.cli("replicaof", "no", "one")

    assert wait_until(lambda: post(cluster, {**QUESTION, "max_tokens": 4}).status_code == 200, timeout=30, step=0.5)
    assert worker.poll() is None
