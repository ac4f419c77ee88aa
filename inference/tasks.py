"""Celery tasks: thin interfaces over the dispatch services, and the worker's hooks: its models loaded at start,
its queues announced while it serves, its jobs ended on a stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Collection
from typing import Any

from celery import shared_task
from celery.signals import beat_init, worker_init, worker_process_init, worker_ready, worker_shutting_down
from django.conf import settings
from django.core import checks
from django.db import DatabaseError

from inference.engine.dispatch import GENERATE_TASK, WorkerPresence, end_served_jobs, serve_job
from inference.engine.execution import get_capacity, get_runner, loaded_runner, start_sweeping
from inference.engine.runners.base import GenerationJob, PushingRunner
from inference.models import CatalogEntry
from inference.usage.reports import roll_up_and_prune

logger = logging.getLogger(__name__)

_local = threading.local()


def _loop() -> asyncio.AbstractEventLoop:
    """One event loop per worker thread, kept for the thread's life: the Channels layer and the Redis
    client pool connections per loop, so a new loop per task would reconnect every time."""
    loop = getattr(_local, "loop", None)
    if loop is None:
        loop = _local.loop = asyncio.new_event_loop()
    return loop


@shared_task(name=GENERATE_TASK, ignore_result=True, acks_late=False)
def generate(job: dict[str, Any], reply_channel: str) -> None:
    _loop().run_until_complete(serve_job(GenerationJob.from_dict(job), reply_channel))


@shared_task(name="inference.rollup_usage", ignore_result=True)
def rollup_usage() -> None:
    """Roll usage up into daily rollups and prune old raw records (scheduled by Celery beat)."""
    roll_up_and_prune()


# -- loading the models when the worker starts ---------------------------------------------------------
#
# A model is loaded in the process that runs its jobs, before the first job, in the main thread: a
# TensorRT-LLM engine starts its executor (an MPI worker process, or threads in this process with
# TLLM_WORKER_USE_SINGLE_PROCESS=1) and takes the GPU, which is not something to do on the first job's
# pool thread while other jobs wait on a lock. With ``--pool threads`` (the model hosts' pool) jobs run
# in the worker's main process, which gets ``worker_init``; a prefork child or the solo pool gets
# ``worker_process_init``.

# The queues this worker consumes, noted at worker_init; prefork children inherit it.
_served_queues: frozenset[str] = frozenset()


def load_served_models(queues: Collection[str]) -> list[str]:
    """Load every enabled catalog model whose queue is in ``queues``; the ids loaded."""
    if not queues:
        return []
    try:
        entries = [entry for entry in CatalogEntry.objects.served_here() if entry.queue in queues]
    except DatabaseError:
        # The worker still starts; each model then loads with its first job.
        logger.exception("could not read the catalog to load this worker's models")
        return []
    loaded = []
    for entry in entries:
        try:
            get_runner(entry.runner, entry.runner_settings)
        except Exception:
            logger.exception("could not load model %s", entry.public_id)
        else:
            loaded.append(entry.public_id)
    return loaded


def threaded_models(queues: Collection[str]) -> list[str]:
    """The models of ``queues`` whose loaded runner reads each job on a thread of its own (one that pushes none)."""
    try:
        entries = [entry for entry in CatalogEntry.objects.served_here() if entry.queue in queues]
    except DatabaseError:
        return []
    runners = {entry.public_id: loaded_runner(entry.runner, entry.runner_settings) for entry in entries}
    return [model for model, runner in runners.items() if runner is not None and not isinstance(runner, PushingRunner)]


def _runs_jobs_in_main_process(worker: Any) -> bool:
    pool = getattr(worker, "pool_cls", "")
    name = pool if isinstance(pool, str) else f"{getattr(pool, '__module__', '')}.{getattr(pool, '__name__', '')}"
    return any(kind in name.lower() for kind in ("thread", "gevent", "eventlet"))


def jobs_held(queues: Collection[str]) -> int:
    """How many jobs the models of ``queues`` hold at once, generating and queued, for runners that say: a
    worker needs a thread for each, or jobs wait in the broker while its models have room."""
    try:
        entries = [entry for entry in CatalogEntry.objects.enabled() if entry.queue in queues]
    except DatabaseError:
        return 0
    held = (get_capacity(entry.runner, entry.runner_settings) for entry in entries)
    return sum(capacity.sequences + capacity.queue for capacity in held if capacity is not None)


def worker_configuration_problems() -> list[str]:
    """What keeps this process from serving as a worker or as Celery beat: the settings' errors, as ``manage.py
    check`` reports them (an API process refuses to start on them too), and no broker an API process reaches."""
    serious = [message for message in checks.run_checks() if message.is_serious()]
    problems = [f"{message.id}: {message.msg} {message.hint or ''}".strip() for message in serious]
    if not settings.DISTRIBUTED:
        problems.append(
            "REDIS_URL is not set: the process would use a broker in its own memory, which no API process or worker "
            "reaches. Set REDIS_URL (and DATABASE_URL, SECRET_KEY) as the API processes have them."
        )
    return problems


def _refuse_to_start_misconfigured(program: str) -> None:
    if problems := worker_configuration_problems():
        raise SystemExit(f"{program} cannot start:\n" + "\n".join(f"  {problem}" for problem in problems))


@worker_init.connect
def _refuse_to_work_misconfigured(**_: Any) -> None:
    """A worker whose settings are wrong exits at once, saying why, rather than taking jobs it can only fail."""
    _refuse_to_start_misconfigured("The worker")


@beat_init.connect
def _refuse_to_schedule_misconfigured(**_: Any) -> None:
    """So does Celery beat, rather than schedule the usage rollup and the pruning where no worker ever runs them."""
    _refuse_to_start_misconfigured("Celery beat")


@worker_init.connect
def _load_models_at_worker_init(sender: Any = None, **_: Any) -> None:
    global _served_queues
    app = getattr(sender, "app", None)
    queues = getattr(getattr(getattr(app, "amqp", None), "queues", None), "consume_from", None)
    _served_queues = frozenset(queues or ())
    if _runs_jobs_in_main_process(sender):
        logger.info("loaded %s", load_served_models(_served_queues))
        start_sweeping()  # a model taken out of the catalog has its memory freed
        concurrency = getattr(sender, "concurrency", None)
        if isinstance(concurrency, int) and concurrency < (needed := jobs_held(_served_queues)):
            logger.warning(
                "this worker runs %d jobs at a time, but its models hold %d (sequences and queues): "
                "start it with --concurrency %d",
                concurrency,
                needed,
                needed,
            )
        # Only past the threads: whether a model reads each job on a thread of its own asks the catalog.
        if (
            isinstance(concurrency, int)
            and concurrency > settings.RUNNER_JOB_THREADS
            and (threaded := threaded_models(_served_queues))
        ):
            logger.warning(
                "this worker takes %d jobs at a time, but its models that read each job on a thread of its own (%s) "
                "have RUNNER_JOB_THREADS (%d) threads in a process: the others wait for one; set "
                "RUNNER_JOB_THREADS=%d",
                concurrency,
                ", ".join(threaded),
                settings.RUNNER_JOB_THREADS,
                concurrency,
            )


_presence: WorkerPresence | None = None


@worker_ready.connect
def _end_the_jobs_first_on_a_cold_stop(**_: Any) -> None:
    """A cold stop (SIGQUIT) ends the worker's jobs at once. Celery's own handler cannot: its threads pool does not
    stop a running job (it logs ``does not implement kill_job`` and waits for them to end on their own)."""
    if threading.current_thread() is not threading.main_thread():
        return
    celerys = signal.getsignal(signal.SIGQUIT)

    def end() -> None:
        logger.warning("cold stop: ended %d jobs", end_served_jobs())

    def cold_stop(signum: int, frame: Any) -> None:
        threading.Thread(target=end, name="cold-stop").start()  # not in a signal handler, which may hold a lock
        if callable(celerys):
            celerys(signum, frame)

    signal.signal(signal.SIGQUIT, cold_stop)


@worker_ready.connect
def _say_which_queues_are_served(**_: Any) -> None:
    """Once the worker consumes its queues (its models loaded), jobs sent to them are told a worker is there."""
    global _presence
    if settings.DISTRIBUTED and _served_queues and _presence is None:
        _presence = WorkerPresence(_served_queues).start()


@worker_shutting_down.connect
def _stop_saying_which_queues_are_served(**_: Any) -> None:
    if _presence is not None:
        _presence.stop()


@worker_shutting_down.connect
def _end_the_jobs_left_after_the_grace_period(**_: Any) -> None:
    """A worker told to stop (Celery's warm shutdown) takes no new jobs and waits for those it runs; past
    ``SHUTDOWN_GRACE_SECONDS`` it ends those still running, as ``serve`` does, rather than hold them up to
    ``STREAM_MAX_SECONDS`` while whoever stopped it waits, or kills it and cuts them with no word to their clients."""

    def end() -> None:
        if ended := end_served_jobs():
            logger.warning("ended %d jobs still running after the %ss grace period", ended, grace)

    grace = settings.SHUTDOWN_GRACE_SECONDS
    timer = threading.Timer(grace, end)
    timer.daemon = True  # the worker exits once its jobs are done, without waiting for it
    timer.start()


@worker_process_init.connect
def _load_models_at_worker_process_init(**_: Any) -> None:
    logger.info("loaded %s", load_served_models(_served_queues))
    start_sweeping()
