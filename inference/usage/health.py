"""Whether this deployment can serve: the database, Redis (when configured), and each model's workers.

Embedded mode: a model is healthy when this process has its runner loaded, or can load it (its
weights are where the catalog says). Distributed mode: when some Celery worker consumes its queue,
asked with a short broadcast. Nothing here loads a model or runs a job.

The overall status is ``down`` when the database or Redis fails, or when none of the node's own models can be
served and no gateway is configured to serve instead (nothing can be served: a load balancer takes the node out),
``degraded`` when only some models have no worker, and ``ok`` otherwise.

Load balancers and anyone else may call ``/health`` as often as they like, without a key: a result is
kept for ``HEALTH_CACHE_SECONDS`` and callers meanwhile share it (and share the one check under way; past it, the
last result answers while the next check runs, for up to ``STALE_SECONDS``), and
the checks run on threads of their own, so a burst of calls neither reaches the broker nor takes the threads
that authenticate API requests. Redis is asked over the process's own connection pool.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from celery import current_app
from django.conf import settings
from django.db import close_old_connections, connection

from core.redis import async_client
from inference.engine import execution
from inference.engine.runners.base import RunnerError
from inference.engine.runners.llama_cpp import RunnerSettings as LlamaCppSettings
from inference.engine.runners.llama_cpp import is_file
from inference.models import CatalogEntry

Status = Literal["ok", "error", "absent"]
T = TypeVar("T")

# The checks' own threads: a database that hangs or a slow broadcast holds these, never the shared pool.
_threads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="health")


async def _on_health_thread(fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(_threads, fn)


@dataclass(frozen=True, slots=True)
class Check:
    status: Status
    latency_ms: float | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ModelHealth:
    id: str
    status: Literal["ok", "error"]
    workers: str  # embedded: "loaded" / "loadable" / "unavailable"; distributed: "N worker(s)" / "none"
    queue: str
    detail: str = ""
    hosts: list[str] = field(default_factory=list)
    # What one loaded copy holds (sequences, context per sequence, queue, KV cache bytes), for runners that say.
    capacity: dict[str, int] | None = None
    # Embedded mode, once loaded: the sequences decoding and the jobs queued now.
    load: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Health:
    status: Literal["ok", "degraded", "down"]
    mode: Literal["embedded", "distributed"]
    database: Check
    redis: Check
    models: list[ModelHealth]

    @property
    def http_status(self) -> int:
        return 503 if self.status == "down" else 200

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def _timed(probe: Any, timeout: float) -> Check:
    started = time.perf_counter()
    try:
        await asyncio.wait_for(probe, timeout)
    except Exception as exc:  # noqa: BLE001  (any failure is the answer)
        return Check("error", detail=(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:300])
    return Check("ok", latency_ms=round((time.perf_counter() - started) * 1000, 2))


def _ping_database() -> None:
    close_old_connections()
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        cursor.fetchone()


async def check_database(timeout: float = 3.0) -> Check:
    return await _timed(_on_health_thread(_ping_database), timeout)


async def check_redis(timeout: float = 2.0) -> Check:
    if not settings.REDIS_URL:
        return Check("absent", detail="REDIS_URL is not set (embedded mode)")
    return await _timed(async_client().ping(), timeout)


def _runner_available(entry: CatalogEntry) -> None:
    """Raise ``RunnerError`` unless this process could load the entry's runner, without loading it."""
    execution.runner_module(entry.runner, entry.runner_settings)  # a runner and settings it reads
    if entry.runner == "llama_cpp":
        if importlib.util.find_spec("llama_cpp") is None:
            raise RunnerError("llama-cpp-python is not installed", code="runner_unavailable")
        path = Path(LlamaCppSettings.of(entry.runner_settings).path)
        if not is_file(path):
            raise RunnerError(f"no model file at {path}", code="runner_unavailable")
    elif entry.runner == "tensorrt_llm" and importlib.util.find_spec("tensorrt_llm") is None:
        raise RunnerError("TensorRT-LLM is not installed here", code="runner_unavailable")


def _capacity(entry: CatalogEntry) -> dict[str, int] | None:
    capacity = execution.get_capacity(entry.runner, entry.runner_settings)
    return asdict(capacity) if capacity is not None else None


def embedded_model(entry: CatalogEntry) -> ModelHealth:
    def health(status: Literal["ok", "error"], workers: str, detail: str, **more: Any) -> ModelHealth:
        return ModelHealth(id=entry.public_id, status=status, workers=workers, queue=entry.queue, detail=detail, **more)

    if problem := entry.defaults_problem():
        return health("error", "unavailable", problem)
    # The runner cache is the process's own record of what it has loaded.
    if (runner := execution.loaded_runner(entry.runner, entry.runner_settings)) is not None:
        stats = runner.stats() if hasattr(runner, "stats") else None
        load = {"active": stats.active, "queued": stats.queued} if stats is not None else None
        return health("ok", "loaded", "the runner is loaded in this process", capacity=_capacity(entry), load=load)
    try:
        _runner_available(entry)
    except RunnerError as exc:
        return health("error", "unavailable", str(exc))
    return health("ok", "loadable", "the runner is not loaded yet; it loads on first use", capacity=_capacity(entry))


def distributed_models(
    entries: list[CatalogEntry], active_queues: Mapping[str, list[dict[str, Any]]] | None
) -> list[ModelHealth]:
    """Each model's workers, from Celery's ``inspect().active_queues()`` reply (None: no worker answered)."""
    consumers: dict[str, list[str]] = {}
    for host, queues in (active_queues or {}).items():
        for queue in queues or []:
            consumers.setdefault(queue.get("name", ""), []).append(host)
    models = []
    for entry in entries:
        hosts = sorted(consumers.get(entry.queue, []))
        capacity = _capacity(entry)
        if problem := entry.defaults_problem():
            models.append(ModelHealth(entry.public_id, "error", "unavailable", entry.queue, problem, capacity=capacity))
        elif hosts:
            workers = f"{len(hosts)} worker(s)"
            models.append(ModelHealth(entry.public_id, "ok", workers, entry.queue, "", hosts, capacity=capacity))
        else:
            detail = f"no worker consumes the queue {entry.queue}"
            models.append(ModelHealth(entry.public_id, "error", "none", entry.queue, detail, capacity=capacity))
    return models


def _active_queues(timeout: float) -> Mapping[str, list[dict[str, Any]]] | None:
    return current_app.control.inspect(timeout=timeout).active_queues()


async def check_models(*, broker_answers: bool) -> list[ModelHealth]:
    entries = [entry async for entry in CatalogEntry.objects.served_here()]
    if not settings.DISTRIBUTED:
        return await _on_health_thread(lambda: [embedded_model(entry) for entry in entries])
    replies = None
    if broker_answers:
        timeout = float(settings.HEALTH_WORKER_TIMEOUT_SECONDS)
        try:
            replies = await asyncio.wait_for(_on_health_thread(lambda: _active_queues(timeout)), timeout + 2)
        except Exception:  # noqa: BLE001  (a broker that does not answer means no worker is known)
            replies = None
    return await _on_health_thread(lambda: distributed_models(entries, replies))


async def check() -> Health:
    database, redis = await asyncio.gather(check_database(), check_redis())
    models = await check_models(broker_answers=redis.status == "ok") if database.status == "ok" else []
    if database.status == "error" or redis.status == "error":
        status: Literal["ok", "degraded", "down"] = "down"
    elif models and all(model.status != "ok" for model in models) and not settings.GATEWAY_BASE_URL:
        status = "down"
    elif any(model.status != "ok" for model in models):
        status = "degraded"
    else:
        status = "ok"
    return Health(
        status=status,
        mode="distributed" if settings.DISTRIBUTED else "embedded",
        database=database,
        redis=redis,
        models=models,
    )


_cached: tuple[float, Health] | None = None
_pending: tuple[asyncio.AbstractEventLoop, asyncio.Task[Health]] | None = None
# A check this old is still answered from while the next one runs, so that a caller with a short timeout (a
# Kubernetes probe's is one second) is not held for the workers' answer; past it, callers wait for the next check.
STALE_SECONDS = 60.0


async def current() -> Health:
    """The deployment's health as last checked: within ``HEALTH_CACHE_SECONDS``, else (no older than
    ``STALE_SECONDS``) while a new check runs; one check at a time, kept when it ends whether or not anyone still
    waits for it."""
    global _pending
    age = time.monotonic() - _cached[0] if _cached is not None else None
    if _cached is not None and age is not None and age < settings.HEALTH_CACHE_SECONDS:
        return _cached[1]
    loop = asyncio.get_running_loop()
    if _pending is None or _pending[0] is not loop or _pending[1].done():
        task = loop.create_task(check())
        task.add_done_callback(_keep)
        _pending = (loop, task)
    if _cached is not None and age is not None and settings.HEALTH_CACHE_SECONDS and age < STALE_SECONDS:
        return _cached[1]
    # Shielded: a caller that hangs up does not cancel the check the others are waiting for.
    return await asyncio.shield(_pending[1])


def _keep(task: asyncio.Task[Health]) -> None:
    global _cached, _pending
    failed = task.cancelled() or task.exception() is not None  # asked first: a failure is never left unread
    if _pending is None or _pending[1] is not task:
        return  # cleared meanwhile
    _pending = None
    if not failed:
        _cached = (time.monotonic(), task.result())


def clear_cache() -> None:
    global _cached, _pending
    _cached = _pending = None
