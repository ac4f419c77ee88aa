"""Running generation jobs on this process's runners: shared by the embedded pool and Celery workers.

A job's events cross from the runner's thread to the event loop through a queue and come out in
batches: whatever arrived while the consumer was busy is handed over at once, which coalesces deltas
exactly as much as the consumer needs, without adding delay. A runner that pushes its events
(``PushingRunner``: its scheduling thread hands each on as it comes) holds no thread per job; the
others' blocking ``stream`` is read on a pool thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import import_module
from typing import Any, TypeVar

from django.conf import settings

from core.outages import Service
from inference.engine.runners.base import (
    Finished,
    GenerationJob,
    PromptRenderer,
    PushingRunner,
    RawEvent,
    Runner,
    RunnerError,
    TextChunk,
    TokenLogprob,
)

logger = logging.getLogger("inference.engine.execution")
T = TypeVar("T")

RUNNER_MODULES = {
    "llama_cpp": "inference.engine.runners.llama_cpp",
    "tensorrt_llm": "inference.engine.runners.tensorrt_llm",
}

_runners: dict[str, Runner] = {}
_renderers: dict[str, PromptRenderer] = {}
_lock = threading.Lock()
_executor = ThreadPoolExecutor(max_workers=settings.RUNNER_JOB_THREADS, thread_name_prefix="runner")


def runner_module(runner: str, settings: object = None) -> Any:
    """The runner's module; ``RunnerError`` for a runner or settings no module reads (a row saved around the
    admin's checks: from a shell, a fixture, SQL)."""
    if settings is not None and not isinstance(settings, dict):
        raise RunnerError("the model's runner settings are not a JSON object", code="runner_unavailable")
    try:
        return import_module(RUNNER_MODULES[runner])
    except KeyError:
        raise RunnerError(f"unknown runner {runner!r}", code="runner_unavailable") from None


def _cache_key(runner: str, settings: dict[str, Any]) -> str:
    return runner + ":" + json.dumps(settings, sort_keys=True)


def _once(cache: dict[str, T], runner: str, settings: dict[str, Any], make: Callable[[], T]) -> T:
    """``cache``'s value for this model, made on first use, by one caller at a time."""
    key = _cache_key(runner, settings)
    if (made := cache.get(key)) is not None:
        return made
    with _lock:
        if key not in cache:
            cache[key] = make()
        return cache[key]


def get_runner(runner: str, settings: dict[str, Any]) -> Runner:
    """The process's loaded runner for this model, loading it on first use."""
    return _once(_runners, runner, settings, lambda: runner_module(runner, settings).load(settings))


# A catalog entry whose runner settings change gets a runner loaded with the new ones. The one loaded with the old
# ones is superseded, and closed (its memory freed) once it has run no job for ``RETIRE_AFTER_SECONDS``: long
# enough that API processes still holding the old settings in their catalog cache (``catalog.CACHE_SECONDS``)
# do not make it load and close in turns. Jobs say which entry they are for (``GenerationJob.model_id``), so two
# entries on the same weights with settings of their own keep a runner each. Looked at as jobs start and end, and
# every ``SWEEP_SECONDS`` against the catalog: an entry disabled, deleted or renamed runs no more jobs to say so.
RETIRE_AFTER_SECONDS = 30.0
SWEEP_SECONDS = 10.0
_current: dict[str, str] = {}  # model id → the cache key of its latest job
_superseded: dict[str, float] = {}  # cache key → since when no model's latest job used it
_running: dict[str, int] = {}  # cache key → the jobs running on its runner
_last_used: dict[str, float] = {}  # cache key → when a job last started or ended on its runner


def _job_started(job: GenerationJob) -> Runner:
    key = _cache_key(job.runner, job.runner_settings)
    with _lock:
        runner = _runners.get(key)
        if runner is None:
            runner = _runners[key] = runner_module(job.runner, job.runner_settings).load(job.runner_settings)
        now = time.monotonic()
        _running[key] = _running.get(key, 0) + 1
        _last_used[key] = now
        _superseded.pop(key, None)
        previous, _current[job.model_id] = _current.get(job.model_id), key
        if previous is not None and previous != key and previous not in _current.values():
            _superseded.setdefault(previous, now)
        retired = _retire_idle(now)
    _close_retired(retired)
    return runner


def _job_ended(job: GenerationJob) -> None:
    key = _cache_key(job.runner, job.runner_settings)
    with _lock:
        now = time.monotonic()
        _running[key] -= 1
        _last_used[key] = now
        retired = _retire_idle(now)
    _close_retired(retired)


def _retire_idle(now: float) -> list[Runner]:
    """Out of the cache: the superseded runners idle long enough (with ``_lock`` held, so no job takes one)."""
    retired = []
    for key, since in list(_superseded.items()):
        if not _running.get(key) and now - _last_used.get(key, since) >= RETIRE_AFTER_SECONDS:
            del _superseded[key]
            _running.pop(key, None)
            _last_used.pop(key, None)
            _renderers.pop(key, None)
            if (runner := _runners.pop(key, None)) is not None:
                retired.append(runner)
    return retired


def sweep(served: dict[str, str]) -> None:
    """``served``: each enabled catalog entry's cache key, by model id. A loaded runner no served entry names (its
    entry was disabled, deleted or given new settings; loaded at start and never used, or used) is superseded, and
    closed once idle; one an entry names again (a rename, a catalog read older than a job's) is kept."""
    wanted = set(served.values())
    with _lock:
        now = time.monotonic()
        for model_id, key in list(_current.items()):
            if served.get(model_id) != key:
                del _current[model_id]
        for key in _runners:
            if key in wanted:
                _superseded.pop(key, None)
            else:
                _superseded.setdefault(key, now)
        retired = _retire_idle(now)
    _close_retired(retired)


def _served() -> dict[str, str]:
    from django.db import close_old_connections, connection

    from inference.models import CatalogEntry

    close_old_connections()
    try:
        entries = CatalogEntry.objects.enabled().values_list("public_id", "runner", "runner_settings")
        return {model_id: _cache_key(runner, settings) for model_id, runner, settings in entries}
    finally:
        connection.close()


_sweeping = threading.Event()


def start_sweeping() -> None:
    """In a process that serves models (``serve`` in embedded mode, a model worker): ``sweep`` every
    ``SWEEP_SECONDS`` against the catalog, on a thread of its own."""
    with _lock:
        if _sweeping.is_set():
            return
        _sweeping.set()

    def sweep_forever() -> None:
        while True:
            time.sleep(SWEEP_SECONDS)
            try:
                sweep(_served())
            except Exception as exc:  # noqa: BLE001  (the database away: the next sweep looks again)
                logger.debug("could not close the runners the catalog no longer serves: %s", exc)

    threading.Thread(target=sweep_forever, name="runner-sweep", daemon=True).start()


def _close_retired(runners: list[Runner]) -> None:
    for runner in runners:
        logger.info("closing a runner whose model's settings changed or that is no longer served")
        try:
            runner.close()
        except Exception:
            logger.exception("could not close a retired runner")


def loaded_runner(runner: str, settings: dict[str, Any]) -> Runner | None:
    """The process's runner for this model if it has loaded it; never loads it."""
    return _runners.get(_cache_key(runner, settings))


_capacities: dict[str, Any] = {}


def get_capacity(runner: str, settings: dict[str, Any]) -> Any | None:
    """What a model's settings let one loaded copy hold (sequences, queue, KV cache), for runners that say;
    None for the others, and for settings that do not load."""
    key = _cache_key(runner, settings)
    if key not in _capacities:
        try:
            estimate = getattr(runner_module(runner, settings), "capacity", None)
            _capacities[key] = estimate(settings) if estimate is not None else None
        except RunnerError:
            return None
    return _capacities[key]


def get_renderer(runner: str, settings: dict[str, Any]) -> PromptRenderer:
    return _once(_renderers, runner, settings, lambda: runner_module(runner, settings).renderer(settings))


@dataclass(frozen=True, slots=True)
class JobFailed:
    """Terminal event of a job that failed (the runner raised, or the worker was lost)."""

    code: str
    message: str
    # The service whose outage failed it, when one did (Redis, for a job that could not be queued or whose events
    # could not be read): said by the API process's side of the dispatch, never sent by a worker.
    outage: Service | None = None


@dataclass(frozen=True, slots=True)
class Accepted:
    """First event of every job the runner took: it is generating or waiting in the runner's queue. A runner
    refuses a job it cannot hold (its queue is full) before this, with ``JobFailed`` code ``overloaded``."""


JobEvent = RawEvent | JobFailed | Accepted
_DONE = object()


def start_on_runner(
    job: GenerationJob,
    cancelled: threading.Event,
    put: Callable[[JobEvent], object],
    end: Callable[[JobEvent], object],
) -> None:
    """Starts ``job`` on its runner without waiting for it: its events go to ``put`` as they come (``Accepted``
    first), from the runner's thread or a pool thread, and the last one (``Finished`` or ``JobFailed``) to ``end``,
    from a pool thread, once the job no longer counts as running."""

    def ended(item: JobEvent, runner_started: bool) -> None:
        if runner_started:
            _job_ended(job)
        end(item)

    def handed_on(item: RawEvent | RunnerError) -> JobEvent:
        return JobFailed(item.code, str(item)) if isinstance(item, RunnerError) else item

    def end_pushed(item: RawEvent | RunnerError) -> None:
        try:
            _executor.submit(ended, handed_on(item), True)
        except RuntimeError:  # the interpreter is exiting (its runners closing, on its own thread): end it here
            ended(handed_on(item), True)

    def work() -> None:
        runner = None
        try:
            runner = _job_started(job)
            if isinstance(runner, PushingRunner):
                # Its end comes through this pool: ending a job may close a retired runner, not for a runner's thread.
                _start_pushing(runner, job, cancelled, put, end=end_pushed)
                return
            events = runner.stream(job, cancelled.is_set)
            put(Accepted())
            for event in events:
                if isinstance(event, Finished):
                    ended(event, True)
                    return
                put(event)
            raise RunnerError("the runner ended the job without finishing it")
        except RunnerError as exc:
            ended(JobFailed(exc.code, str(exc)), runner is not None)
        except Exception as exc:
            logger.exception("runner failed on job %s", job.job_id)
            ended(JobFailed("generation_failed", f"generation failed: {type(exc).__name__}"), runner is not None)

    _executor.submit(work)


async def run_job(job: GenerationJob, cancelled: threading.Event) -> AsyncIterator[list[JobEvent]]:
    """Run ``job`` on its runner; yield its events in batches, ending with ``Finished`` or ``JobFailed``."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the reader's event loop is gone: nobody will read the rest
            cancelled.set()

    def end(item: JobEvent) -> None:
        put(item)
        put(_DONE)

    start_on_runner(job, cancelled, put, end)
    try:
        while True:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            done = batch[-1] is _DONE
            events = [e for e in batch if e is not _DONE]
            if events:
                yield events
            if done:
                return
    finally:
        cancelled.set()


def _start_pushing(
    runner: PushingRunner,
    job: GenerationJob,
    cancelled: threading.Event,
    put: Callable[[JobEvent], object],
    end: Callable[[RawEvent | RunnerError], object],
) -> None:
    """Starts ``job`` on a runner that pushes its events: they go to ``put`` from the runner's thread, after
    ``Accepted`` (held back until ``start`` has returned, should the first come sooner), the last to ``end``."""
    lock = threading.Lock()
    held: list[RawEvent | RunnerError] = []
    accepted = False

    def deliver(item: RawEvent | RunnerError) -> None:
        with lock:
            if not accepted:
                held.append(item)
                return
        forward(item)

    def forward(item: RawEvent | RunnerError) -> None:
        if isinstance(item, (Finished, RunnerError)):
            end(item)
        else:
            put(item)

    runner.start(job, cancelled.is_set, deliver)
    with lock:
        put(Accepted())
        for item in held:
            forward(item)
        accepted = True


# --- the wire form of events (Celery workers → Channels layer → API process) ----------------------


def encode(events: list[JobEvent]) -> list[list[Any]]:
    out: list[list[Any]] = []
    for event in events:
        if isinstance(event, TextChunk):
            logprobs = [[lp.token, lp.logprob, [list(t) for t in lp.top]] for lp in event.logprobs]
            out.append(["t", event.text, event.tokens, logprobs, event.cached_tokens])
        elif isinstance(event, Finished):
            out.append(["f", event.reason, event.prompt_tokens, event.completion_tokens, event.cached_tokens])
        elif isinstance(event, Accepted):
            out.append(["a"])
        else:
            out.append(["e", event.code, event.message])
    return out


def decode(wire: list[list[Any]]) -> list[JobEvent]:
    out: list[JobEvent] = []
    for item in wire:
        kind = item[0]
        if kind == "t":
            logprobs = tuple(TokenLogprob(t, lp, tuple((a, b) for a, b in top)) for t, lp, top in item[3])
            # A worker of the release before tells no cached tokens with its chunks.
            out.append(TextChunk(item[1], item[2], logprobs, item[4] if len(item) > 4 else 0))
        elif kind == "f":
            out.append(Finished(item[1], item[2], item[3], item[4]))
        elif kind == "a":
            out.append(Accepted())
        else:
            out.append(JobFailed(item[1], item[2]))
    return out
