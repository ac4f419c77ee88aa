"""The TensorRT-LLM runner, driven through the stand-in of the ``tensorrt_llm`` API in ``tests/fakes``.

The stand-in's engine echoes the prompt's words, one whitespace token per step, or writes a minimal
instance of a guided JSON schema; it compiles guides with the real xgrammar. See
``tests/fakes/tensorrt_llm/__init__.py`` for what it mirrors of TensorRT-LLM's source.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.abc
import io
import json
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jsonschema
import pytest
import xgrammar
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import DatabaseError

from inference import tasks
from inference.engine import execution
from inference.engine.exceptions import PenaltyNotApplied, SchemaNotEnforceable, TooManyTopLogprobs
from inference.engine.generation import GenerationRequest, prepare
from inference.engine.runners import tensorrt_llm as runner_module
from inference.engine.runners.base import (
    Constraint,
    Finished,
    GenerationJob,
    RawEvent,
    RunnerError,
    Sampling,
    TextChunk,
)
from inference.models import CatalogEntry
from inference.openai.errors import ParamNames, from_exception
from tests.conftest import ROOT, wait_until

FAKES = ROOT / "tests" / "fakes"
SETTINGS: dict[str, Any] = {"model": "/models/toy-chat"}


def _drop_tensorrt_llm_modules() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture
def trtllm(monkeypatch: pytest.MonkeyPatch) -> Iterator[types.ModuleType]:
    """The stand-in, importable as ``tensorrt_llm`` (shadowing a real install, if any)."""
    _drop_tensorrt_llm_modules()
    monkeypatch.syspath_prepend(str(FAKES))
    module = importlib.import_module("tensorrt_llm")
    assert Path(module.__file__ or "").is_relative_to(FAKES)
    yield module
    runner_module.shutdown_all()
    _drop_tensorrt_llm_modules()


@pytest.fixture
def toy(trtllm: types.ModuleType) -> types.ModuleType:
    return importlib.import_module("tensorrt_llm._toy")


@dataclass
class Call:
    inputs: Any
    sampling_params: Any
    streaming: bool
    output: Any
    submitted: float


@dataclass
class Seen:
    """What the stand-in LLM class saw: the instances built and every ``generate_async`` call."""

    llms: list[Any] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)


@pytest.fixture
def engine(trtllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch) -> Seen:
    seen = Seen()
    llm_class = trtllm.LLM
    original_init = llm_class.__init__
    original_generate_async = llm_class.generate_async

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        seen.llms.append(self)

    def generate_async(self: Any, inputs: Any, sampling_params: Any = None, *args: Any, **kwargs: Any) -> Any:
        output = original_generate_async(self, inputs, sampling_params, *args, **kwargs)
        seen.calls.append(Call(inputs, sampling_params, kwargs.get("streaming", False), output, time.monotonic()))
        return output

    monkeypatch.setattr(llm_class, "__init__", init)
    monkeypatch.setattr(llm_class, "generate_async", generate_async)
    return seen


def make_job(
    prompt: str,
    *,
    max_tokens: int = 64,
    stop: tuple[str, ...] = (),
    constraint: Constraint | None = None,
    settings: dict[str, Any] | None = None,
    prompt_tokens: int = 0,
    **sampling: Any,
) -> GenerationJob:
    return GenerationJob(
        job_id="job-1",
        model_id="b3os/toy-chat",
        runner="tensorrt_llm",
        runner_settings=settings or SETTINGS,
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        sampling=Sampling(max_tokens=max_tokens, stop=stop, **sampling),
        constraint=constraint,
    )


def collect(events: Iterator[RawEvent]) -> tuple[list[TextChunk], Finished]:
    chunks: list[TextChunk] = []
    finished: list[Finished] = []
    for event in events:
        assert not finished, "nothing may follow Finished"
        if isinstance(event, TextChunk):
            chunks.append(event)
        else:
            finished.append(event)
    assert len(finished) == 1
    return chunks, finished[0]


def never() -> bool:
    return False


def answer(runner: runner_module.TensorRTLLMRunner, job: GenerationJob) -> str:
    chunks, _ = collect(runner.stream(job, never))
    return "".join(c.text for c in chunks)


def words(count: int, prefix: str = "w") -> str:
    return " ".join(f"{prefix}{i}" for i in range(count))


# -- streaming, usage and finish reasons -------------------------------------------------------------


def test_it_streams_the_generated_text_and_reports_exact_usage(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    # The job's own estimate is deliberately wrong: usage comes from the engine.
    chunks, finished = collect(runner.stream(make_job("one two three four", prompt_tokens=999), never))

    assert [c.text for c in chunks] == ["one", " two", " three", " four"]
    assert [c.tokens for c in chunks] == [1, 1, 1, 1]
    assert finished == Finished(reason="stop", prompt_tokens=4, completion_tokens=4, cached_tokens=0)
    (call,) = engine.calls
    # Submitted as token ids: the runner counts the prompt itself, once, before queueing it.
    assert engine.llms[0].tokenizer.decode(call.inputs) == "one two three four"
    assert call.streaming is True
    assert finished.prompt_tokens == len(call.output.prompt_token_ids)


@pytest.mark.parametrize("sampler", ["TorchSampler", "TRTLLMSampler"])
def test_the_end_of_sequence_token_is_no_part_of_the_answer(engine: Seen, sampler: str) -> None:
    settings = {**SETTINGS, "sampler_type": sampler}
    runner = runner_module.load(settings)
    # " four" could begin the stop sequence, so it is held back and goes out with the engine's last output.
    job = make_job("one two three four", stop=("four five",), settings=settings, logprobs=True, top_logprobs=1)

    chunks, finished = collect(runner.stream(job, never))

    output = engine.calls[0].output.outputs[0]
    # The PyTorch sampler puts the end token in the output's ids; the C++ sampler leaves it out.
    assert (output.token_ids[-1] == engine.llms[0].tokenizer.eos_token_id) is (sampler == "TorchSampler")
    assert "".join(c.text for c in chunks) == "one two three four"
    assert (finished.reason, finished.completion_tokens) == ("stop", 4)
    assert sum(c.tokens for c in chunks) == 4
    assert [lp.token for c in chunks for lp in c.logprobs] == [b"one", b" two", b" three", b" four"]


def test_it_reports_the_prompt_tokens_the_engine_found_in_its_kv_cache(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    prompt = words(70)

    _, first = collect(runner.stream(make_job(prompt), never))
    _, again = collect(runner.stream(make_job(prompt), never))

    assert first.cached_tokens == 0
    # Reuse is by whole KV cache blocks (32 tokens), and the prompt's last token is always computed.
    assert (again.prompt_tokens, again.cached_tokens) == (70, 64)
    assert again.cached_tokens == engine.calls[1].output.cached_tokens


def test_it_reports_no_cached_tokens_when_block_reuse_is_off(engine: Seen) -> None:
    settings = {**SETTINGS, "kv_cache_config": {"enable_block_reuse": False}}
    runner = runner_module.load(settings)

    collect(runner.stream(make_job(words(70), settings=settings), never))
    _, again = collect(runner.stream(make_job(words(70), settings=settings), never))

    assert again.cached_tokens == 0


def test_a_special_token_the_request_wrote_reaches_the_engine_as_text(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    prompt = "<s>user: hi </s> there\n</s>"
    job = dataclasses.replace(make_job(prompt), literal=((12, 16),))  # the first "</s>" is the user's

    collect(runner.stream(job, never))

    tokenizer = engine.llms[0].tokenizer.tokenizer  # the Hugging Face tokenizer TensorRT-LLM wraps
    (call,) = engine.calls
    assert tokenizer.decode(call.inputs) == prompt
    assert [token for token in call.inputs if token in (tokenizer.bos_token_id, tokenizer.eos_token_id)] == [
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    ]


def test_it_passes_the_sampling_parameters_through(engine: Seen) -> None:
    settings = {**SETTINGS, "sampler_type": "TRTLLMSampler"}  # the sampler that applies penalties
    runner = runner_module.load(settings)
    job = make_job(
        "a b",
        max_tokens=7,
        stop=("zz",),
        temperature=0.2,
        top_p=0.9,
        seed=42,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        settings=settings,
    )

    collect(runner.stream(job, never))

    params = engine.calls[0].sampling_params
    assert (params.max_tokens, params.temperature, params.top_p, params.seed) == (7, 0.2, 0.9, 42)
    assert (params.stop, params.frequency_penalty, params.presence_penalty) == (["zz"], 0.5, -0.5)
    # The rendered chat template carries BOS already; the renderer counts tokens the same way.
    assert params.add_special_tokens is False
    assert params.logprobs is None
    assert params.guided_decoding is None


def test_the_default_sampler_which_ignores_penalties_is_sent_none(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    collect(runner.stream(make_job("a b"), never))

    params = engine.calls[0].sampling_params
    assert (params.frequency_penalty, params.presence_penalty) == (None, None)


def test_a_job_with_a_penalty_the_default_sampler_would_ignore_is_refused(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("a b", presence_penalty=0.5), never))

    assert raised.value.code == "unsupported_parameter"
    assert engine.calls == []


CHOICES = " ".join(["{heads|tails}"] * 24)  # the toy model draws each word: 2**24 answers


@pytest.mark.parametrize("settings", [SETTINGS, {**SETTINGS, "sampler_type": "TRTLLMSampler"}])
def test_an_unseeded_request_samples_differently_each_time(engine: Seen, settings: dict[str, Any]) -> None:
    runner = runner_module.load(settings)

    answers = [answer(runner, make_job(CHOICES, settings=settings)) for _ in range(2)]

    assert all(set(text.split()) <= {"heads", "tails"} for text in answers)
    assert answers[0] != answers[1]
    first, second = (call.sampling_params.seed for call in engine.calls)
    assert first is not None and second is not None and first != second


def test_a_seed_repeats_its_sample_on_an_engine_that_reads_seeds(engine: Seen) -> None:
    settings = {**SETTINGS, "sampler_type": "TRTLLMSampler"}
    runner = runner_module.load(settings)

    def seeded(seed: int) -> str:
        return answer(runner, make_job(CHOICES, settings=settings, seed=seed))

    assert seeded(7) == seeded(7) != seeded(8)


def test_the_stand_ins_default_sampler_ignores_the_seed_as_tensorrt_llm_1_2s_does(engine: Seen) -> None:
    # The TorchSampler draws every request from one generator for the engine's life, whatever its seed.
    runner = runner_module.load(SETTINGS)

    assert answer(runner, make_job(CHOICES, seed=7)) != answer(runner, make_job(CHOICES, seed=7))


def test_greedy_decoding_writes_the_likeliest_choice(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    assert answer(runner, make_job(CHOICES, temperature=0.0)) == " ".join(["heads"] * 24)
    assert engine.calls[0].sampling_params.seed is None  # nothing to draw: no seed to send


def test_it_finishes_with_length_when_max_tokens_runs_out(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(runner.stream(make_job(words(10), max_tokens=3), never))

    assert "".join(c.text for c in chunks) == "w0 w1 w2"
    assert finished.reason == "length"
    assert finished.completion_tokens == 3
    assert engine.calls[0].sampling_params.max_tokens == 3


def test_it_never_leaves_max_tokens_at_the_librarys_default_of_32(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(runner.stream(make_job(words(40), max_tokens=100), never))

    assert "".join(c.text for c in chunks) == words(40)
    assert (finished.reason, finished.completion_tokens) == ("stop", 40)


def test_it_stops_at_a_stop_sequence_without_leaking_the_start_of_it(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    job = make_job("alpha beta gamma delta epsilon", stop=("gamma delta",))
    chunks, finished = collect(runner.stream(job, never))

    # The library sends " gamma" in a text_diff before it sees " delta" complete the stop string.
    assert "".join(c.text for c in chunks) == "alpha beta "
    assert not any("gamma" in c.text for c in chunks)
    assert finished.reason == "stop"
    assert engine.calls[0].output.outputs[0].stop_reason == "gamma delta"


def test_it_sends_held_back_text_once_it_cannot_become_a_stop_sequence(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(runner.stream(make_job("alpha beta gamma epsilon", stop=("gamma delta",)), never))

    assert "".join(c.text for c in chunks) == "alpha beta gamma epsilon"
    assert sum(c.tokens for c in chunks) == finished.completion_tokens == 4
    assert finished.reason == "stop"


def test_the_output_ends_at_the_earliest_stop_sequence_when_one_token_brings_two(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    # " two.three" is one token: the library tries "three" first and cuts there, leaving the "." stop in.
    job = make_job("one two.three four", stop=("three", "."))
    chunks, finished = collect(runner.stream(job, never))

    assert engine.calls[0].output.outputs[0].text == "one two."
    assert "".join(c.text for c in chunks) == "one two"
    assert finished.reason == "stop"


def test_a_stop_string_the_engine_matches_on_token_ids_leaves_none_of_itself_in_the_text(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    # " gamma delta" encodes to the very tokens generated, so the engine itself stops on their ids and
    # cuts them from token_ids; the " gamma" it streamed a step earlier stays in the output's text.
    job = make_job("alpha beta gamma delta epsilon", stop=(" gamma delta",))
    chunks, finished = collect(runner.stream(job, never))

    output = engine.calls[0].output.outputs[0]
    assert (output.text, output.stop_reason) == ("alpha beta gamma", " gamma delta")
    assert "".join(c.text for c in chunks) == "alpha beta"
    assert finished.reason == "stop"
    assert finished.completion_tokens == len(output.token_ids) == 2


def test_it_returns_logprobs_when_asked(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(runner.stream(make_job("red green", logprobs=True, top_logprobs=2, temperature=0.0), never))

    assert engine.calls[0].sampling_params.logprobs == 2
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert [lp.token for lp in logprobs] == [b"red", b" green"]
    assert all(lp.logprob == -0.25 for lp in logprobs)
    assert [len(lp.top) for lp in logprobs] == [2, 2]
    assert logprobs[0].top[0] == (b"red", -0.25)


def test_the_stand_ins_logprobs_are_the_top_k_taken_before_sampling_as_tensorrt_llm_1_2s_are(engine: Seen) -> None:
    trtllm = sys.modules["tensorrt_llm"]
    llm = trtllm.LLM(model="/models/toy-chat")
    params = trtllm.SamplingParams(max_tokens=24, temperature=1.0, logprobs=1, seed=1)

    async def run() -> Any:
        return await llm.generate_async(llm.tokenizer.encode(CHOICES), params, streaming=True).aresult()

    completion = asyncio.run(run()).outputs[0]

    drawn = [llm.tokenizer.decode([token]) for token in completion.token_ids[:24]]
    listed = [[llm.tokenizer.decode([token]) for token in entry] for entry in completion.logprobs[:24]]
    assert " tails" in drawn  # at least once in 24 draws of two words
    # The top 1 is the likeliest word wherever the other was drawn.
    assert listed == [["heads"]] + [[" heads"]] * 23


def test_a_sampled_request_gets_its_tokens_logprobs_though_it_asks_for_one_alternative(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(runner.stream(make_job(CHOICES, logprobs=True, top_logprobs=1, temperature=1.0), never))

    # The engine's top 1 would leave out every "tails" drawn: the runner asks it for the entry's 20.
    assert engine.calls[0].sampling_params.logprobs == 20
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert {lp.token.strip() for lp in logprobs} == {b"heads", b"tails"}
    assert {(lp.token.strip(), lp.logprob) for lp in logprobs} == {(b"heads", -0.25), (b"tails", -1.25)}
    assert all(len(lp.top) == 1 and lp.top[0][0].strip() == b"heads" for lp in logprobs)


def test_the_logprobs_of_the_pieces_of_a_character_carry_its_bytes(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(runner.stream(make_job("fire 🔥", logprobs=True, top_logprobs=2), never))

    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert "".join(c.text for c in chunks) == "fire 🔥"
    assert [lp.token for lp in logprobs] == [b"fire", b" ", b"\xf0", b"\x9f", b"\x94", b"\xa5"]
    assert logprobs[2].top[0] == (b"\xf0", -0.25)


def test_each_chunk_carries_its_own_tokens_even_where_a_tokens_bytes_do_not_spell_its_text(
    engine: Seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As a SentencePiece vocabulary spells a word's leading space "\u2581": three bytes for the text's one.
    spelled = runner_module._token_bytes
    monkeypatch.setattr(
        runner_module,
        "_token_bytes",
        lambda tokenizer, token: spelled(tokenizer, token).replace(b" ", "\u2581".encode()),
    )
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(
        runner.stream(make_job("alpha beta gamma delta", logprobs=True, stop=("gamma delta",)), never)
    )

    assert [(c.text, [lp.token.decode() for lp in c.logprobs]) for c in chunks[:2]] == [
        ("alpha", ["alpha"]),
        (" beta", ["\u2581beta"]),
    ]
    assert "".join(c.text for c in chunks) == "alpha beta "
    assert sum(c.tokens for c in chunks) == finished.completion_tokens == 4
    assert [lp.token.decode() for c in chunks for lp in c.logprobs] == ["alpha", "\u2581beta", "\u2581gamma"]


def test_an_answer_cut_inside_a_character_ends_before_it_and_still_counts_its_tokens(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(runner.stream(make_job("fire 🔥", max_tokens=4, logprobs=True), never))

    # The library's detokenizer never turns the character's first two bytes into text. Their tokens still travel with
    # the last chunk, and their logprobs carry those bytes, as the llama.cpp runner sends them.
    assert "".join(c.text for c in chunks) == "fire "
    assert (finished.reason, finished.completion_tokens) == ("length", 4)
    assert sum(c.tokens for c in chunks) == 4
    assert [lp.token for c in chunks for lp in c.logprobs] == [b"fire", b" ", b"\xf0", b"\x9f"]


def test_a_stop_strings_tokens_count_and_only_those_the_text_begins_send_logprobs(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(
        runner.stream(make_job("alpha beta gamma delta", logprobs=True, stop=("gamma delta",)), never)
    )

    assert "".join(c.text for c in chunks) == "alpha beta "
    assert sum(c.tokens for c in chunks) == finished.completion_tokens == 4
    # " gamma" holds the text's last space, where the stop string begins: its logprob stays; " delta"'s goes.
    assert [lp.token for c in chunks for lp in c.logprobs] == [b"alpha", b" beta", b" gamma"]
    # No chunk's logprobs run ahead of its text.
    assert all(len(b"".join(lp.token for lp in c.logprobs)) <= len(c.text.encode()) for c in chunks[:-1])


# -- cancellation ------------------------------------------------------------------------------------


def test_it_aborts_the_request_when_cancelled(
    engine: Seen, toy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toy, "STEP_SECONDS", 0.02)  # 400 tokens would take 8 s
    runner = runner_module.load(SETTINGS)
    cancel = threading.Event()
    chunks: list[TextChunk] = []
    finished: Finished | None = None
    cancelled_at = finished_at = 0.0

    for event in runner.stream(make_job(words(400), max_tokens=400), cancel.is_set):
        if isinstance(event, TextChunk):
            chunks.append(event)
            if len(chunks) == 3:
                cancel.set()
                cancelled_at = time.monotonic()
        else:
            finished, finished_at = event, time.monotonic()

    assert finished is not None
    assert finished.reason == "cancelled"
    assert finished_at - cancelled_at < 1.0
    assert len(chunks) == 3  # nothing is sent once the client is gone
    (call,) = engine.calls
    assert call.output.aborted()
    assert call.output.outputs[0].finish_reason == "cancelled"
    # Usage still counts what the engine generated before the abort landed.
    assert 3 <= finished.completion_tokens < 400
    assert finished.completion_tokens == len(call.output.outputs[0].token_ids)
    assert finished.prompt_tokens == 400


def test_it_finishes_cancelled_when_cancelled_before_any_output(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, finished = collect(runner.stream(make_job(words(300), max_tokens=300, prompt_tokens=300), lambda: True))

    assert chunks == []
    assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == ("cancelled", 300, 0)
    # Either it never reached the engine, or it was aborted there.
    assert wait_until(lambda: all(call.output.aborted() for call in engine.calls))


def _pending_requests(engine_loop: asyncio.AbstractEventLoop) -> int:
    """Coroutines still reading a request's outputs on the runner's engine loop."""

    async def count() -> int:
        return len(asyncio.all_tasks()) - 1  # less this one

    return asyncio.run_coroutine_threadsafe(count(), engine_loop).result(timeout=2)


def test_it_ends_a_cancelled_job_that_was_still_waiting_in_the_engines_queue(
    engine: Seen, toy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toy, "STEP_SECONDS", 0.02)
    settings = {**SETTINGS, "max_batch_size": 1}
    runner = runner_module.load(settings)
    first = runner.stream(make_job(words(200), max_tokens=200, settings=settings), never)
    assert isinstance(next(first), TextChunk)  # the one place in the batch is taken
    cancel = threading.Event()
    cancelled_at = 0.0

    def cancel_soon() -> bool:
        nonlocal cancelled_at
        if not cancel.is_set() and engine.calls[-1:] and len(engine.calls) == 2:
            cancel.set()
            cancelled_at = time.monotonic()
        return cancel.is_set()

    chunks, finished = collect(runner.stream(make_job("still waiting", settings=settings), cancel_soon))

    # TensorRT-LLM drops a cancelled request from its waiting queue without any final output.
    waiting = engine.calls[1].output
    assert wait_until(waiting.aborted)
    assert not waiting.finished
    assert chunks == []
    assert (finished.reason, finished.completion_tokens) == ("cancelled", 0)
    assert time.monotonic() - cancelled_at < 1.0
    # Nothing is left waiting for that output: only the first job's request is being read.
    (engine_state,) = runner_module._ENGINES.values()
    assert _pending_requests(engine_state.loop) == 1
    first.close()


def test_it_aborts_the_request_when_the_consumer_stops_reading(
    engine: Seen, toy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toy, "STEP_SECONDS", 0.02)
    runner = runner_module.load(SETTINGS)
    events = runner.stream(make_job(words(300), max_tokens=300), never)

    assert isinstance(next(events), TextChunk)
    events.close()

    (call,) = engine.calls
    assert wait_until(lambda: call.output.aborted())


# -- guided decoding ---------------------------------------------------------------------------------

PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "age": {"type": "integer", "minimum": 18},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def test_it_sends_a_json_schema_to_guided_decoding_and_the_output_matches_it(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    job = make_job("Who is it?", constraint=Constraint(kind="json_schema", schema=PERSON_SCHEMA))

    chunks, finished = collect(runner.stream(job, never))

    # Its age's minimum goes as the grammar that spells it out (xgrammar's conversion misjudges bounds).
    assert engine.calls[0].sampling_params.guided_decoding.grammar is not None
    value = json.loads("".join(c.text for c in chunks))
    jsonschema.validate(value, PERSON_SCHEMA)
    assert finished.reason == "stop"


def test_a_json_object_constraint_asks_for_a_json_object(trtllm: types.ModuleType, engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(runner.stream(make_job("x", constraint=Constraint(kind="json_object")), never))

    assert engine.calls[0].sampling_params.guided_decoding == trtllm.llmapi.GuidedDecodingParams(
        json={"type": "object"}
    )
    assert json.loads("".join(c.text for c in chunks)) == {}


def test_a_json_object_constraint_lets_no_json_array_through(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    # The toy model keeps to its prompt wherever the guide admits it. TensorRT-LLM's json_object guide
    # is xgrammar's builtin JSON grammar, whose root is an object or an array: it would admit this one.
    chunks, finished = collect(runner.stream(make_job("[1, 2]", constraint=Constraint(kind="json_object")), never))

    assert isinstance(json.loads("".join(c.text for c in chunks)), dict)
    assert finished.reason == "stop"


def test_the_stand_ins_json_object_guide_admits_an_array_as_tensorrt_llms_does(trtllm: types.ModuleType) -> None:
    toy = importlib.import_module("tensorrt_llm._toy")
    guide = trtllm.llmapi.GuidedDecodingParams(json_object=True)

    # grammar_matcher.py: GuideType.JSON -> compile_builtin_json_grammar(); llguidance compiles {"type": "object"}.
    assert toy.admits(guide, "[1, 2]") and toy.admits(guide, '{"a": 1}')
    assert not toy.admits(guide, "[1, 2]", backend="llguidance")
    assert not toy.admits(trtllm.llmapi.GuidedDecodingParams(json={"type": "object"}), "[1, 2]")


CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def test_a_tool_calls_constraint_becomes_a_structural_tag_around_hermes_blocks(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(
        runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=CALL_SCHEMA)), never)
    )

    guide = engine.calls[0].sampling_params.guided_decoding
    assert json.loads(guide.structural_tag) == {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": [
                {
                    "type": "tag",
                    "begin": "<tool_call>\n",
                    "content": {"type": "json_schema", "json_schema": CALL_SCHEMA},
                    "end": "\n</tool_call>",
                }
            ],
        },
    }
    text = "".join(c.text for c in chunks)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>")
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "get_weather" and len(call["arguments"]["city"]) >= 1


def test_the_structural_tag_it_sends_is_one_the_real_xgrammar_compiles(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    collect(runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=CALL_SCHEMA)), never))

    guide = engine.calls[0].sampling_params.guided_decoding.structural_tag
    assert isinstance(xgrammar.Grammar.from_structural_tag(guide), xgrammar.Grammar)


def test_a_tool_whose_arguments_have_bounds_xgrammar_misjudges_is_called_within_them(
    engine: Seen, toy: types.ModuleType, trtllm: types.ModuleType
) -> None:
    degrees = {"type": "integer", "minimum": -180, "maximum": 180}
    call_schema = {
        **CALL_SCHEMA,
        "properties": {
            "name": {"const": "locate"},
            "arguments": {
                "type": "object",
                "properties": {"longitude": degrees},
                "required": ["longitude"],
                "additionalProperties": False,
            },
        },
    }
    breaking = '<tool_call>\n{"name": "locate", "arguments": {"longitude": 181}}\n</tool_call>'
    # The tag with the schema for xgrammar to convert lets the call through.
    as_schema = {
        "type": "tag",
        "begin": "<tool_call>\n",
        "content": {"type": "json_schema", "json_schema": call_schema},
    }
    tag = {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [{**as_schema, "end": "\n</tool_call>"}]}
    assert toy.admits(
        trtllm.llmapi.GuidedDecodingParams(structural_tag=json.dumps({"type": "structural_tag", "format": tag})),
        breaking,
    )
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(
        runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=call_schema)), never)
    )

    guide = engine.calls[0].sampling_params.guided_decoding
    assert not toy.admits(guide, breaking)
    # The call keeps the order the prompt teaches, its name before its arguments.
    assert toy.admits(guide, breaking.replace("181", "180"))
    text = "".join(c.text for c in chunks)
    assert text.startswith('<tool_call>\n{"name":')
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    jsonschema.validate(call, call_schema)


def test_a_schema_with_bounds_keeps_its_properties_in_the_order_it_gives_them(
    engine: Seen, toy: types.ModuleType
) -> None:
    schema = {
        "type": "object",
        "properties": {"zone": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["zone", "age"],
        "additionalProperties": False,
    }
    runner = runner_module.load(SETTINGS)

    chunks, _ = collect(runner.stream(make_job("x", constraint=Constraint(kind="json_schema", schema=schema)), never))

    guide = engine.calls[-1].sampling_params.guided_decoding
    assert guide.grammar is not None
    assert toy.admits(guide, '{"zone": "a", "age": 3}') and not toy.admits(guide, '{"age": 3, "zone": "a"}')
    assert list(json.loads("".join(c.text for c in chunks))) == ["zone", "age"]


def test_where_xgrammar_takes_no_grammar_inside_a_structural_tag_the_tool_schema_goes_as_it_is(
    engine: Seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An xgrammar older than the grammar element of structural tags refuses a tag that holds one.
    compile_tag = xgrammar.Grammar.from_structural_tag

    def older(tag: str) -> Any:
        if '"type": "grammar"' in tag:
            raise RuntimeError("Unknown format type: grammar")
        return compile_tag(tag)

    monkeypatch.setattr(xgrammar.Grammar, "from_structural_tag", staticmethod(older))
    runner_module._compile_problem.cache_clear()
    bounded = {
        **CALL_SCHEMA,
        "properties": {**CALL_SCHEMA["properties"], "arguments": {"type": "integer", "maximum": 9}},
    }
    runner = runner_module.load(SETTINGS)

    collect(runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=bounded)), never))

    tag = json.loads(engine.calls[0].sampling_params.guided_decoding.structural_tag)
    assert tag["format"]["tags"][0]["content"] == {"type": "json_schema", "json_schema": bounded}
    runner_module._compile_problem.cache_clear()


UNENFORCEABLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"id": {"type": "string", "pattern": "(?<=a)b"}},
}


def test_a_guide_the_engine_cannot_compile_is_refused_before_it_can_fail_the_whole_batch(
    engine: Seen, toy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toy, "STEP_SECONDS", 0.01)
    runner = runner_module.load(SETTINGS)
    running = runner.stream(make_job(words(60), max_tokens=100), never)
    first = next(running)
    assert isinstance(first, TextChunk)

    job = make_job("x", constraint=Constraint(kind="json_schema", schema=UNENFORCEABLE_SCHEMA))
    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(job, never))

    assert raised.value.code == "invalid_constraint"
    assert "Lookbehind is not supported" in str(raised.value)
    assert len(engine.calls) == 1  # never queued
    # The request that was being generated is unharmed.
    rest, finished = collect(running)
    assert first.text + "".join(c.text for c in rest) == words(60)
    assert finished.reason == "stop"


def test_a_tool_schema_the_engine_cannot_compile_is_refused_too(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    call_schema = {**CALL_SCHEMA, "properties": {**CALL_SCHEMA["properties"], "arguments": UNENFORCEABLE_SCHEMA}}

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=call_schema)), never))

    assert raised.value.code == "invalid_constraint"
    assert engine.calls == []


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "object", "properties": {"n": {"$ref": "#"}}, "required": ["n"]},
        {"type": "object", "properties": {"x": {"enum": []}}, "required": ["x"]},
    ],
    ids=["itself-required", "an-empty-enum"],
)
def test_a_schema_no_value_of_which_ends_is_refused_before_xgrammar_compiles_it(schema: dict[str, Any]) -> None:
    assert "no value of it can be written to its end" in (runner_module.schema_problem(schema) or "")


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "not": {"enum": ["Paris"]}}, "its 'not' cannot be enforced by this model's grammar"),
        ({"type": "string", "format": "password"}, "its 'format' of 'password' cannot be enforced"),
        ({"type": "string", "format": "email", "pattern": "^a"}, "its 'format' beside 'pattern' cannot be enforced"),
        ({"type": "string", "format": "email", "maxLength": 8}, "its 'format' beside 'maxLength' cannot be enforced"),
        ({"format": "email"}, "its 'format' can be enforced by this model's grammar where the type is 'string'"),
        (
            {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
            "its 'oneOf' cannot be enforced by this model's grammar where a value may match more than one",
        ),
    ],
    ids=["not", "unknown-format", "beside-a-pattern", "beside-a-length", "without-a-type", "oneOf"],
)
def test_a_keyword_xgrammar_compiles_as_nothing_or_as_anyof_is_refused_by_name(
    schema: dict[str, Any], says: str
) -> None:
    # xgrammar compiles each of these, and its grammar lets through a value that breaks the schema.
    assert isinstance(xgrammar.Grammar.from_json_schema(json.dumps(schema)), xgrammar.Grammar)
    assert says in (runner_module.schema_problem(schema) or "")


@pytest.mark.parametrize(
    ("schema", "breaking", "says"),
    [
        ({"type": "integer", "multipleOf": 5}, "7", "its 'multipleOf' cannot be enforced"),
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", "'uniqueItems'"),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, "[1, 2]", "'contains'"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "dependentRequired": {"a": ["b"]},
            },
            '{"a": 1}',
            "'dependentRequired'",
        ),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "if": {"required": ["a"]}, "then": False},
            '{"a": 1}',
            "its 'if' cannot be enforced",
        ),
    ],
    ids=["multipleOf", "uniqueItems", "contains", "dependentRequired", "if"],
)
def test_a_keyword_xgrammar_leaves_out_is_refused_by_name(
    toy: types.ModuleType, trtllm: types.ModuleType, schema: dict[str, Any], breaking: str, says: str
) -> None:
    # xgrammar compiles each, and lets through a value that breaks it.
    assert toy.admits(trtllm.llmapi.GuidedDecodingParams(json=schema), breaking)
    assert says in (runner_module.schema_problem(schema) or "")


@pytest.mark.parametrize(
    ("schema", "breaking"),
    [
        ({"type": "integer", "maximum": 150}, "151"),
        ({"type": "integer", "minimum": 5}, "3"),
        ({"type": "integer", "minimum": 964, "maximum": 2000}, "963"),
        ({"type": "number", "minimum": 0, "maximum": 1}, "1.5"),
        (
            {
                "type": "object",
                "properties": {"longitude": {"type": "integer", "minimum": -180, "maximum": 180}},
                "required": ["longitude"],
                "additionalProperties": False,
            },
            '{"longitude": 181}',
        ),
        # It holds a string's JSON text to a pattern, not the string: text that is not JSON passes.
        ({"type": "string", "pattern": "^.+$"}, '"a"b"'),
        ({"type": "string", "pattern": '^"[a-z]"$'}, '""a""'),
        ({"type": "string", "pattern": "^a\nb$"}, '"a\nb"'),
        ({"type": "string", "pattern": "^[ -~]+$"}, '"a"b"'),
        (
            {"type": "object", "properties": {"q": {"type": "string", "pattern": "^[^a]+$"}}, "required": ["q"]},
            '{"q": "b\tc"}',
        ),
    ],
    ids=[
        *("maximum", "minimum-alone", "range", "number-range", "in-an-object"),
        *("a-pattern-dot", "a-pattern-quote", "a-pattern-line-feed", "a-pattern-range-over-the-quote"),
        "a-pattern-negated-set-in-an-object",
    ],
)
def test_bounds_and_patterns_xgrammar_misjudges_are_held_exactly(
    engine: Seen, toy: types.ModuleType, trtllm: types.ModuleType, schema: dict[str, Any], breaking: str
) -> None:
    # xgrammar's own conversion of the schema lets the value through; the toy model writes it wherever it may.
    assert toy.admits(trtllm.llmapi.GuidedDecodingParams(json=schema), breaking)
    runner = runner_module.load(SETTINGS)

    constraint = Constraint(kind="json_schema", schema=schema)
    chunks, finished = collect(runner.stream(make_job(breaking, constraint=constraint), never))

    jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)
    guide = engine.calls[-1].sampling_params.guided_decoding
    assert guide.grammar is not None and not toy.admits(guide, breaking)
    assert runner_module.schema_problem(schema) is None


def test_a_pattern_the_grammar_cannot_hold_is_refused_not_left_to_xgrammar() -> None:
    # xgrammar compiles it, to let a raw control character into a JSON string.
    problem = runner_module.schema_problem({"type": "string", "pattern": r"^a\x01$"}) or ""

    assert "U+0001 is written escaped in JSON" in problem


def test_a_schema_without_bounds_goes_to_xgrammar_as_a_schema(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

    collect(
        runner.stream(make_job('{"city": "Salem"}', constraint=Constraint(kind="json_schema", schema=schema)), never)
    )

    guide = engine.calls[-1].sampling_params.guided_decoding
    assert (guide.json, guide.grammar) == (schema, None)


@pytest.mark.parametrize(
    "kind", [Constraint(kind="json_schema", schema={"type": "object"}), Constraint(kind="json_object")]
)
def test_a_value_that_ends_as_the_budget_does_is_finished_not_cut(engine: Seen, kind: Constraint) -> None:
    # The openai SDK's parse() refuses an answer that ended for its length: a whole value must not say so.
    runner = runner_module.load(SETTINGS)
    value = '{"city": "Salem"}'
    _, free = collect(runner.stream(make_job(value, constraint=kind), never))

    exact_chunks, exact = collect(
        runner.stream(make_job(value, constraint=kind, max_tokens=free.completion_tokens), never)
    )
    _, short = collect(runner.stream(make_job(value, constraint=kind, max_tokens=free.completion_tokens - 1), never))
    _, text = collect(runner.stream(make_job(value, max_tokens=free.completion_tokens), never))

    assert free.reason == "stop"
    assert "".join(c.text for c in exact_chunks) == value and exact.reason == "stop"
    assert short.reason == "length"
    assert text.reason == "length"  # free text that spends its budget may have gone on


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "format": "uri"},
        {"type": ["string", "null"], "format": "date-time"},
        {"oneOf": [{"type": "string"}, {"type": "integer"}]},
        {
            "oneOf": [
                {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
            ]
        },
        {
            "type": "object",
            "properties": {"if": {"type": "string"}, "contains": {"type": "integer"}},
            "required": ["if"],
            "enum": [{"if": "x", "contains": 1}, {"if": "y"}],
        },
    ],
    ids=["uri", "nullable-date-time", "oneOf-of-types", "discriminated-oneOf", "properties-named-as-keywords"],
)
def test_formats_xgrammar_enforces_and_a_oneof_of_branches_apart_are_taken(schema: dict[str, Any]) -> None:
    assert runner_module.schema_problem(schema) is None


def test_a_tool_schema_with_a_keyword_xgrammar_leaves_out_is_refused_in_the_worker_too(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)
    arguments = {"type": "object", "properties": {"city": {"type": "string", "not": {"const": "Paris"}}}}
    call_schema = {**CALL_SCHEMA, "properties": {**CALL_SCHEMA["properties"], "arguments": arguments}}

    with pytest.raises(RunnerError, match="'not' cannot be enforced") as raised:
        collect(runner.stream(make_job("x", constraint=Constraint(kind="tool_calls", schema=call_schema)), never))

    assert raised.value.code == "invalid_constraint"
    assert engine.calls == []


# -- concurrency -------------------------------------------------------------------------------------


def test_it_serves_concurrent_jobs_from_threads_on_one_engine(
    engine: Seen, toy: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(toy, "STEP_SECONDS", 0.005)  # 40 tokens: at least 0.2 s a request
    runner = runner_module.load(SETTINGS)
    prompts = [words(40, prefix=f"job{n}-") for n in range(8)]
    start = threading.Barrier(len(prompts))
    results: dict[int, tuple[str, Finished, float]] = {}
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            start.wait()
            chunks, finished = collect(runner.stream(make_job(prompts[n], max_tokens=100), never))
            results[n] = ("".join(c.text for c in chunks), finished, time.monotonic())
        except BaseException as exc:  # noqa: BLE001  (surfaced below, not lost in the thread)
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    assert errors == []
    assert len(engine.llms) == 1
    for n, prompt in enumerate(prompts):
        text, finished, _ = results[n]
        assert text == prompt
        assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == ("stop", 40, 40)
    # All eight were in the engine together: the last was submitted before the first finished.
    assert max(call.submitted for call in engine.calls) < min(done for _, _, done in results.values())


# -- settings and loading ----------------------------------------------------------------------------


def test_it_builds_one_llm_per_process_from_the_settings(trtllm: types.ModuleType, engine: Seen) -> None:
    settings = {
        "model": "/models/toy-chat",
        "tensor_parallel_size": 2,
        "max_batch_size": 64,
        "max_num_tokens": 4096,
        "max_seq_len": 8192,
        "kv_cache_free_gpu_memory_fraction": 0.75,
    }

    runner = runner_module.load(settings)
    runner_module.load(dict(settings))
    collect(runner.stream(make_job("hello there", settings=settings), never))
    collect(runner.stream(make_job("hello again", settings=settings), never))

    (llm,) = engine.llms
    args = llm.args
    assert str(args.model) == "/models/toy-chat"
    assert (args.tensor_parallel_size, args.max_batch_size, args.max_num_tokens, args.max_seq_len) == (
        2,
        64,
        4096,
        8192,
    )
    assert isinstance(args.kv_cache_config, trtllm.llmapi.KvCacheConfig)
    assert args.kv_cache_config.free_gpu_memory_fraction == 0.75
    assert args.guided_decoding_backend == "xgrammar"


@pytest.mark.parametrize("backend", ["llguidance", None])
def test_it_refuses_settings_that_choose_a_guided_decoder_other_than_xgrammar(
    engine: Seen, backend: str | None
) -> None:
    # llguidance takes no structural tags, and without a backend nothing enforces a guide.
    with pytest.raises(RunnerError) as raised:
        runner_module.load({**SETTINGS, "guided_decoding_backend": backend})

    assert raised.value.code == "runner_unavailable"
    assert "guided_decoding_backend" in str(raised.value)
    assert engine.llms == []


def test_it_accepts_xgrammar_named_as_the_guided_decoder(engine: Seen) -> None:
    runner_module.load({**SETTINGS, "guided_decoding_backend": "xgrammar"})

    assert engine.llms[0].args.guided_decoding_backend == "xgrammar"


def test_unknown_llm_settings_surface_as_a_runner_error(engine: Seen) -> None:
    with pytest.raises(RunnerError) as raised:
        runner_module.load({"model": "/models/toy-chat", "not_an_llm_argument": 1})

    assert raised.value.code == "runner_unavailable"
    assert "not_an_llm_argument" in str(raised.value)


def test_settings_without_a_model_surface_as_a_runner_error(engine: Seen) -> None:
    with pytest.raises(RunnerError) as raised:
        runner_module.load({"max_batch_size": 8})

    assert raised.value.code == "runner_unavailable"


def test_a_missing_tensorrt_llm_surfaces_as_a_runner_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorrt_llm", None)  # makes the import fail

    with pytest.raises(RunnerError) as raised:
        runner_module.load(SETTINGS)

    assert raised.value.code == "runner_unavailable"


class _Unloadable(importlib.abc.MetaPathFinder):
    """Finds ``tensorrt_llm`` and fails as its import does on a host without the GPU's libraries: loading its C++
    bindings (``_preload_python_lib``: ``cdll.LoadLibrary``) or initialising CUDA."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == "tensorrt_llm":
            raise self.failure


@pytest.mark.parametrize(
    "failure",
    [OSError("libnvinfer.so.10: cannot open shared object file"), RuntimeError("CUDA driver initialization failed")],
    ids=["a-library-missing", "cuda-failing"],
)
def test_a_tensorrt_llm_that_fails_to_load_surfaces_as_a_runner_error(
    monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    _drop_tensorrt_llm_modules()
    monkeypatch.setattr(sys, "meta_path", [_Unloadable(failure), *sys.meta_path])

    with pytest.raises(RunnerError) as raised:
        runner_module.load(SETTINGS)

    assert raised.value.code == "runner_unavailable"
    assert str(failure) in str(raised.value)


# -- failures ----------------------------------------------------------------------------------------


def test_a_prompt_the_engine_refuses_as_too_long_surfaces_as_a_runner_error(engine: Seen) -> None:
    settings = {"model": "/models/toy-chat", "max_num_tokens": 4}
    runner = runner_module.load(settings)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job(words(10), settings=settings), never))

    assert raised.value.code == "context_length_exceeded"
    assert "max_num_tokens" in str(raised.value)
    # A refused request is not a broken engine: the same LLM serves the next job.
    chunks, _ = collect(runner.stream(make_job("a b", settings=settings), never))
    assert "".join(c.text for c in chunks) == "a b"
    assert len(engine.llms) == 1


def test_a_prompt_and_max_tokens_beyond_max_seq_len_are_refused_before_anything_is_queued(engine: Seen) -> None:
    settings = {"model": "/models/toy-chat", "max_seq_len": 8}
    runner = runner_module.load(settings)

    # The engine itself would only clamp max_tokens to the 2 tokens left and stop with "length".
    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job(words(6), max_tokens=5, settings=settings), never))

    assert raised.value.code == "context_length_exceeded"
    assert "max_seq_len (8)" in str(raised.value)
    assert engine.calls == []


@pytest.mark.parametrize("single_process", [False, True], ids=["executor process", "single process"])
@pytest.mark.parametrize("deduce_refuses", [True, False], ids=["later 1.2", "earlier 1.2"])
def test_a_prompt_that_leaves_no_room_under_the_models_own_max_seq_len_is_refused_as_too_long(
    engine: Seen, monkeypatch: pytest.MonkeyPatch, single_process: bool, deduce_refuses: bool
) -> None:
    # No max_seq_len in the settings: the runner cannot check, and the executor refuses the prompt as it enqueues it
    # (in generate_async itself when it runs in this process, in the result's iteration otherwise), in later
    # releases' words or, in earlier ones, the runtime's.
    monkeypatch.setenv("TLLM_WORKER_USE_SINGLE_PROCESS", "1" if single_process else "0")
    monkeypatch.setattr(sys.modules["tensorrt_llm.llmapi.llm"], "DEDUCE_MAX_TOKENS_REFUSES", deduce_refuses)
    monkeypatch.setattr(sys.modules["tensorrt_llm._toy"], "MAX_POSITION_EMBEDDINGS", 8)
    monkeypatch.setattr(sys.modules["tensorrt_llm.llmapi.llm"], "MAX_POSITION_EMBEDDINGS", 8)
    runner = runner_module.load(SETTINGS)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job(words(9), max_tokens=5), never))

    assert raised.value.code == "context_length_exceeded"
    # One with room for fewer tokens than it asks for is shortened, as the library does.
    chunks, finished = collect(runner.stream(make_job(words(6), max_tokens=5), never))
    assert (finished.reason, finished.completion_tokens) == ("length", 2)


def test_a_prompt_and_max_tokens_that_fit_max_seq_len_are_served(engine: Seen) -> None:
    settings = {"model": "/models/toy-chat", "max_seq_len": 8}
    runner = runner_module.load(settings)

    chunks, finished = collect(runner.stream(make_job(words(6), max_tokens=2, settings=settings), never))

    assert "".join(c.text for c in chunks) == "w0 w1"
    assert (finished.reason, finished.prompt_tokens, finished.completion_tokens) == ("length", 6, 2)


def engines_after_the_next_answer(runner: Any, engine: Seen) -> int:
    """How many engines were built once the runner has answered the next request whole: one while the engine that
    served before still serves, more once it was taken down and built again."""
    chunks, _ = collect(runner.stream(make_job("still here"), never))
    assert "".join(c.text for c in chunks) == "still here"
    return len(engine.llms)


def test_a_failure_during_generation_surfaces_as_a_runner_error(
    trtllm: types.ModuleType, engine: Seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_module.load(SETTINGS)
    # The executor fails this one request (as it does a request whose SamplingConfig it refuses).
    monkeypatch.setattr(trtllm.SamplingParams, "_sampling_config_error", lambda self: "the engine failed it")

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("x"), never))

    assert raised.value.code == "generation_failed"
    assert "the engine failed it" in str(raised.value)
    # A per-request failure leaves the engine serving.
    monkeypatch.undo()
    assert engines_after_the_next_answer(runner, engine) == 1


def test_an_error_handling_one_requests_result_leaves_the_engine_serving(
    trtllm: types.ModuleType, engine: Seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_module.load(SETTINGS)
    result_class = sys.modules["tensorrt_llm.executor.result"].GenerationResult
    handle_response = result_class._handle_response

    def odd(self: Any, response: Any) -> None:
        # As result.py's _handle_sequence raises for what it cannot read (a finish reason it does not know, logprobs
        # of another length than the output): this request's failure, with the executor still running.
        if "odd" in self.tokenizer.decode(self.prompt_token_ids):
            raise ValueError("Unknown finish reason: 9")
        handle_response(self, response)

    monkeypatch.setattr(result_class, "_handle_response", odd)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("odd one"), never))

    assert raised.value.code == "generation_failed"
    assert engine.calls[0].output.aborted()  # not left writing an answer nobody reads
    assert engines_after_the_next_answer(runner, engine) == 1


@pytest.mark.parametrize(
    "failure",
    [RuntimeError("CUDA error: an illegal memory access was encountered"), ValueError("a worker thread's own fault")],
    ids=["an-engine-error", "one-of-a-refusals-type"],
)
def test_an_error_the_executor_fails_with_takes_the_engine_down_and_the_next_request_loads_it_again(
    engine: Seen, failure: Exception
) -> None:
    runner = runner_module.load(SETTINGS)
    collect(runner.stream(make_job("first"), never))
    # What the executor's own threads fail with is raised by the next request's submit, once the executor has shut
    # down (proxy.py, _handle_background_error), whatever its type: a ValueError there is no refusal of the request.
    engine.llms[0]._executor._error_queue.put(failure)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("second"), never))

    assert raised.value.code == "runner_unavailable"
    assert engines_after_the_next_answer(runner, engine) == 2


def test_an_unexpected_error_taking_one_request_leaves_the_engine_serving(
    trtllm: types.ModuleType, engine: Seen, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = runner_module.load(SETTINGS)
    generate_async = trtllm.LLM.generate_async

    def odd(self: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if "odd" in self.tokenizer.decode(inputs):
            raise KeyError("a stop string the tokenizer could not encode")
        return generate_async(self, inputs, *args, **kwargs)

    monkeypatch.setattr(trtllm.LLM, "generate_async", odd)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("odd one"), never))

    assert raised.value.code == "generation_failed"
    assert engines_after_the_next_answer(runner, engine) == 1


def test_an_empty_prompt_is_refused_without_taking_the_engine_down(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job(""), never))

    assert raised.value.code == "generation_failed"
    assert engine.calls == []
    assert engines_after_the_next_answer(runner, engine) == 1


def test_sampling_parameters_the_library_refuses_surface_as_a_runner_error(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    with pytest.raises(RunnerError) as raised:
        collect(runner.stream(make_job("x", temperature=-0.5), never))

    assert raised.value.code == "generation_failed"
    assert "temperature" in str(raised.value)
    assert engine.calls == []


def test_top_p_zero_asks_for_the_single_most_likely_token(engine: Seen) -> None:
    runner = runner_module.load(SETTINGS)

    # OpenAI allows top_p 0; the runtime's SamplingConfig allows only 0 < top_p <= 1.
    chunks, finished = collect(runner.stream(make_job("a b c", top_p=0.0, temperature=0.0), never))

    params = engine.calls[0].sampling_params
    assert (params.top_p, params.top_k) == (None, 1)
    assert ("".join(c.text for c in chunks), finished.reason) == ("a b c", "stop")


def test_it_refuses_a_tensorrt_llm_older_than_the_structural_tag_form_it_sends(
    trtllm: types.ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trtllm, "__version__", "1.0.0")

    with pytest.raises(RunnerError) as raised:
        runner_module.load(SETTINGS)

    assert raised.value.code == "runner_unavailable"
    assert "TensorRT-LLM 1.0.0 is installed" in str(raised.value) and "1.2" in str(raised.value)


# -- imports -----------------------------------------------------------------------------------------


def test_importing_the_runner_module_does_not_import_tensorrt_llm() -> None:
    # The stand-in is importable in the child, so an eager import would show.
    code = (
        f"import sys; sys.path.insert(0, {str(FAKES)!r}); import inference.engine.runners.tensorrt_llm; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt_llm', 'transformers', 'torch')))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True
    )

    assert result.stdout.strip() == "[]"


# -- the prompt renderer -----------------------------------------------------------------------------

TOOLS_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>You can call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PLAIN_TEMPLATE = (
    "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


class StandInTokenizer:
    """What the renderer uses of a transformers tokenizer: a Jinja chat template and ``encode``."""

    def __init__(self, chat_template: str) -> None:
        self.chat_template = chat_template

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
    ) -> str:
        assert tokenize is False
        environment = jinja2.Environment()
        environment.filters["tojson"] = lambda value: json.dumps(value)
        template = environment.from_string(chat_template or self.chat_template)
        return template.render(
            messages=conversation, tools=tools, add_generation_prompt=add_generation_prompt, bos_token="<s>"
        )

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids = list(range(len(text.split())))
        return [-1, *ids] if add_special_tokens else ids


@dataclass
class Loads:
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    template: str = TOOLS_TEMPLATE


@pytest.fixture
def hf(monkeypatch: pytest.MonkeyPatch) -> Loads:
    """A stand-in ``transformers`` whose ``AutoTokenizer`` records how it was asked to load."""
    loads = Loads()

    class AutoTokenizer:
        @staticmethod
        def from_pretrained(path: str, **kwargs: Any) -> StandInTokenizer:
            loads.calls.append((path, kwargs))
            return StandInTokenizer(loads.template)

    module = types.ModuleType("transformers")
    module.AutoTokenizer = AutoTokenizer  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers", module)
    return loads


def test_the_renderer_renders_tools_with_the_models_own_chat_template(hf: Loads) -> None:
    render = runner_module.renderer({"model": "/models/toy-chat", "tokenizer": "/models/toy-tokenizer"})
    messages = [{"role": "user", "content": "Weather in Oslo?"}]

    text = render.render(messages, [WEATHER_TOOL])

    assert render.native_tools is True
    # Loaded as the engine loads it (ModelLoader.load_hf_tokenizer), so that prompts count the same on both sides.
    assert hf.calls == [
        (
            "/models/toy-tokenizer",
            {
                "local_files_only": True,
                "trust_remote_code": False,
                "legacy": False,
                "padding_side": "left",
                "truncation_side": "left",
                "use_fast": True,
            },
        )
    ]
    assert text.startswith("<s><|system|>You can call these tools:\n")
    assert json.dumps(WEATHER_TOOL) in text
    assert text.endswith("<|user|>Weather in Oslo?\n<|assistant|>")
    assert render.count_tokens(text, ()) == len(text.split())  # no BOS added on top of the template's


def test_the_renderer_loads_the_slow_tokenizer_when_the_engine_does(hf: Loads) -> None:
    runner_module.renderer({**SETTINGS, "tokenizer_mode": "slow"})

    [(_, options)] = hf.calls
    assert options["use_fast"] is False


def test_the_renderer_renders_without_tools_when_there_are_none(hf: Loads) -> None:
    render = runner_module.renderer(SETTINGS)

    text = render.render([{"role": "user", "content": "Hi"}], None)

    assert text == "<s><|user|>Hi\n<|assistant|>"
    assert hf.calls[0][0] == "/models/toy-chat"


def test_the_renderer_leaves_tools_to_the_decoding_layer_when_the_template_knows_none(hf: Loads) -> None:
    hf.template = PLAIN_TEMPLATE

    render = runner_module.renderer(SETTINGS)

    assert render.native_tools is False


def test_a_chat_template_setting_overrides_the_tokenizers(hf: Loads) -> None:
    render = runner_module.renderer({**SETTINGS, "chat_template": PLAIN_TEMPLATE})

    assert render.native_tools is False
    assert render.render([{"role": "user", "content": "Hi"}], None) == "<|user|>Hi\n<|assistant|>"


def test_the_renderer_finds_a_schema_xgrammar_cannot_compile_and_names_why(hf: Loads) -> None:
    render = runner_module.renderer(SETTINGS)

    assert render.schema_problem(PERSON_SCHEMA) is None
    problem = render.schema_problem(UNENFORCEABLE_SCHEMA)
    assert problem is not None and problem.startswith("Regex parsing error")
    unsatisfiable = {"type": "integer", "minimum": 5, "maximum": 1}
    assert "minimum greater than maximum" in (render.schema_problem(unsatisfiable) or "")


def test_the_renderer_says_how_many_top_logprobs_the_entry_returns(hf: Loads) -> None:
    assert runner_module.renderer(SETTINGS).max_top_logprobs == 20
    assert runner_module.renderer({**SETTINGS, "max_top_logprobs": 0}).max_top_logprobs == 0
    with pytest.raises(RunnerError):
        runner_module.renderer({**SETTINGS, "max_top_logprobs": 21})


def test_an_entry_on_the_cpp_sampler_returns_no_top_logprobs_for_that_sampler_reports_none(hf: Loads) -> None:
    settings = {**SETTINGS, "sampler_type": "TRTLLMSampler"}

    assert runner_module.renderer(settings).max_top_logprobs == 0
    with pytest.raises(RunnerError, match="max_top_logprobs must be 0"):
        runner_module.renderer({**settings, "max_top_logprobs": 5})


def test_on_the_cpp_sampler_each_sampled_token_has_its_own_logprob_and_no_alternatives(engine: Seen) -> None:
    settings = {**SETTINGS, "sampler_type": "TRTLLMSampler"}
    runner = runner_module.load(settings)

    chunks, _ = collect(runner.stream(make_job(CHOICES, settings=settings, seed=3, logprobs=True), never))

    logprobs = [lp for chunk in chunks for lp in chunk.logprobs]
    assert b"".join(lp.token for lp in logprobs).decode() == "".join(chunk.text for chunk in chunks)
    assert all(lp.top == () for lp in logprobs)
    # The toy model finds "tails" less likely than "heads": the C++ sampler's rank 1 is not taken for "the likeliest".
    assert {lp.logprob for lp in logprobs if lp.token.strip() == b"tails"} == {-1.25}


# -- the API process: guides and logprobs are checked before anything is queued ---------------------


@pytest.fixture
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(execution, "_runners", {})
    monkeypatch.setattr(execution, "_renderers", {})


def toy_entry(**settings: Any) -> CatalogEntry:
    return CatalogEntry(
        public_id="b3os/toy-chat",
        runner="tensorrt_llm",
        runner_settings={**SETTINGS, **settings},
        context_length=4096,
        max_output_tokens=256,
    )


USER = [{"role": "user", "content": "Who is it?"}]


async def test_a_response_schema_the_gpu_cannot_enforce_is_a_400_naming_the_parameter(
    hf: Loads, fresh_caches: None
) -> None:
    request = GenerationRequest(messages=USER, response_format="json_schema", json_schema=UNENFORCEABLE_SCHEMA)

    with pytest.raises(SchemaNotEnforceable) as raised:
        await prepare(entry=toy_entry(), request=request)

    error = from_exception(raised.value, ParamNames())
    assert error is not None and (error.status, error.code) == (400, "invalid_value")
    assert error.param == "response_format.json_schema.schema"
    assert "Lookbehind" in error.message


async def test_top_logprobs_beyond_what_the_entry_returns_are_a_400(hf: Loads, fresh_caches: None) -> None:
    request = GenerationRequest(messages=USER, logprobs=True, top_logprobs=2)

    with pytest.raises(TooManyTopLogprobs) as raised:
        await prepare(entry=toy_entry(max_top_logprobs=0), request=request)

    error = from_exception(raised.value, ParamNames())
    assert error is not None and (error.status, error.code, error.param) == (400, "invalid_value", "top_logprobs")
    plain = GenerationRequest(messages=USER, logprobs=True)
    generation = await prepare(entry=toy_entry(max_top_logprobs=0), request=plain)
    assert generation.job.sampling.logprobs is True


async def test_a_penalty_the_entrys_sampler_would_ignore_is_a_400_naming_it(hf: Loads, fresh_caches: None) -> None:
    request = GenerationRequest(messages=USER, frequency_penalty=0.5)

    with pytest.raises(PenaltyNotApplied) as raised:
        await prepare(entry=toy_entry(), request=request)

    error = from_exception(raised.value, ParamNames())
    assert error is not None and (error.status, error.code) == (400, "unsupported_parameter")
    assert error.param == "frequency_penalty"
    zero = await prepare(entry=toy_entry(), request=GenerationRequest(messages=USER, frequency_penalty=0))
    assert zero.job.sampling.frequency_penalty == 0
    applied = await prepare(entry=toy_entry(sampler_type="TRTLLMSampler"), request=request)
    assert applied.job.sampling.frequency_penalty == 0.5


# -- the worker process: models are loaded when it starts --------------------------------------------


@dataclass
class StartingWorker:
    """What the start-up hook reads of Celery's WorkController."""

    queues: list[str]
    pool_cls: str = "threads"
    concurrency: int = 8

    @property
    def app(self) -> Any:
        queues = types.SimpleNamespace(consume_from=dict.fromkeys(self.queues))
        return types.SimpleNamespace(amqp=types.SimpleNamespace(queues=queues))


@pytest.mark.django_db
def test_a_worker_builds_the_models_of_its_queues_when_it_starts(
    engine: Seen, fresh_caches: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = CatalogEntry.objects.create(public_id="b3os/toy-chat", runner="tensorrt_llm", runner_settings=SETTINGS)
    CatalogEntry.objects.create(
        public_id="b3os/other", runner="tensorrt_llm", runner_settings={"model": "/models/other"}
    )
    monkeypatch.setattr(tasks, "_served_queues", frozenset())

    tasks._load_models_at_worker_init(sender=StartingWorker(queues=[served.queue]))

    assert [str(llm.args.model) for llm in engine.llms] == ["/models/toy-chat"]
    # The first job finds the engine ready.
    runner = execution.get_runner(served.runner, served.runner_settings)
    collect(runner.stream(make_job("ready"), never))
    assert len(engine.llms) == 1


@pytest.mark.django_db
def test_a_worker_taking_more_jobs_than_threads_read_them_says_so_when_it_starts(
    engine: Seen, fresh_caches: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, settings: Any
) -> None:
    served = CatalogEntry.objects.create(public_id="b3os/toy-chat", runner="tensorrt_llm", runner_settings=SETTINGS)
    monkeypatch.setattr(tasks, "_served_queues", frozenset())
    settings.RUNNER_JOB_THREADS = 64

    tasks._load_models_at_worker_init(sender=StartingWorker(queues=[served.queue], concurrency=256))

    assert "its models that read each job on a thread of its own (b3os/toy-chat)" in caplog.text
    assert "RUNNER_JOB_THREADS (64)" in caplog.text and "set RUNNER_JOB_THREADS=256" in caplog.text


def test_the_threads_that_read_jobs_are_as_many_as_the_setting_says() -> None:
    code = (
        "import django; django.setup(); from inference.engine import execution; print(execution._executor._max_workers)"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "RUNNER_JOB_THREADS": "256"}

    ran = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)

    assert ran.stdout.split()[-1] == "256"


@pytest.mark.django_db
def test_a_prefork_worker_builds_them_in_each_child_process_not_in_the_parent(
    engine: Seen, fresh_caches: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = CatalogEntry.objects.create(public_id="b3os/toy-chat", runner="tensorrt_llm", runner_settings=SETTINGS)
    monkeypatch.setattr(tasks, "_served_queues", frozenset())

    tasks._load_models_at_worker_init(sender=StartingWorker(queues=[served.queue], pool_cls="prefork"))
    assert engine.llms == []  # a GPU engine must not be forked

    tasks._load_models_at_worker_process_init()
    assert len(engine.llms) == 1


def test_a_worker_that_cannot_read_the_catalog_still_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    def unreachable() -> Any:
        raise DatabaseError("could not connect to server")

    monkeypatch.setattr(CatalogEntry.objects, "served_here", unreachable)

    assert tasks.load_served_models({"model.b3os.toy-chat"}) == []


# -- the smoke test a GPU host runs ------------------------------------------------------------------


@pytest.mark.django_db
def test_the_smoke_test_command_loads_the_entry_and_streams_one_completion(
    hf: Loads, engine: Seen, fresh_caches: None
) -> None:
    CatalogEntry.objects.create(public_id="b3os/toy-chat", runner="tensorrt_llm", runner_settings=SETTINGS)
    out = io.StringIO()

    call_command("smoke_test_model", "b3os/toy-chat", "--prompt", "Say hi", "--max-tokens", "8", stdout=out)

    lines = out.getvalue().splitlines()
    assert lines[0].startswith("b3os/toy-chat: tensorrt_llm loaded in ")
    # The toy model echoes the rendered prompt's words; BOS is a special token, which the text leaves out.
    assert lines[1] == "<|user|>Say hi <|assistant|>"
    assert lines[2].startswith("finish_reason=stop prompt_tokens=4 completion_tokens=3 first_token=")
    assert engine.calls[0].sampling_params.max_tokens == 8


@pytest.mark.django_db
def test_the_smoke_test_command_fails_loudly_when_the_model_cannot_load(fresh_caches: None) -> None:
    CatalogEntry.objects.create(public_id="b3os/toy-chat", runner="tensorrt_llm", runner_settings=SETTINGS)

    with pytest.raises(CommandError, match="did not load"):
        call_command("smoke_test_model", "b3os/toy-chat", stdout=io.StringIO())


@pytest.mark.parametrize("count", ["0", "-1", "many"])
def test_the_smoke_test_command_takes_only_a_token_count_of_one_or_more(count: str) -> None:
    with pytest.raises(CommandError, match=f"a token count is a whole number of 1 or more, not '{count}'"):
        call_command("smoke_test_model", "b3os/toy-chat", "--max-tokens", count, stdout=io.StringIO())


@pytest.mark.django_db
def test_the_smoke_test_command_says_a_gateway_entry_has_no_runner_to_test() -> None:
    CatalogEntry.objects.create(public_id="openai/gpt-x", runner="gateway", runner_settings={})

    with pytest.raises(CommandError, match="served only through the gateway"):
        call_command("smoke_test_model", "openai/gpt-x", stdout=io.StringIO())


def test_a_closed_runner_shuts_its_engine_down_once_no_other_runner_uses_it(engine: Seen) -> None:
    # Two entries that differ only in their chat template share one engine.
    first = runner_module.load(SETTINGS)
    second = runner_module.load({**SETTINGS, "chat_template": "{{ messages }}"})
    (llm,) = engine.llms

    first.close()
    assert llm._executor is not None
    assert answer(second, make_job("still served")) == "still served"

    second.close()
    assert llm._executor is None  # shut down: its GPU memory is free for the settings that replace it
    with pytest.raises(RunnerError) as raised:
        answer(second, make_job("no more"))
    assert raised.value.code == "runner_unavailable"
    assert len(engine.llms) == 1


def test_the_turn_ends_at_any_end_token_the_models_generation_config_lists(engine: Seen, tmp_path: Path) -> None:
    # Its tokenizer's end of sequence is </s>; its generation config lists <|end_of_turn|> too (as Gemma's does).
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    settings = {**SETTINGS, "model": str(tmp_path)}
    prompt = "one two {end_of_turn} three four"

    job = make_job(prompt, settings=settings, logprobs=True)

    chunks, finished = collect(runner_module.load(settings).stream(job, never))

    assert "".join(c.text for c in chunks) == "one two"
    assert (finished.reason, finished.completion_tokens) == ("stop", 2)
    assert [lp.token for c in chunks for lp in c.logprobs] == [b"one", b" two"]
    assert engine.calls[-1].sampling_params.stop_token_ids == [3]


@pytest.mark.parametrize(
    ("schema", "prompt"),
    [
        ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}, '{"a": "x {end_of_turn} y"}'),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "string"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a", "n"],
            },
            '{"a": "x {end_of_turn} y", "n": 3}',
        ),
    ],
    ids=["schema", "bounded-grammar"],
)
def test_a_json_output_is_not_cut_where_its_guide_admits_an_end_of_turn_token_as_text(
    engine: Seen, tmp_path: Path, schema: dict[str, Any], prompt: str
) -> None:
    # The guide ends the output with the tokenizer's end of sequence, the one end xgrammar knows; to it the
    # generation config's other end tokens are text, which a JSON string may hold.
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3]}))
    settings = {**SETTINGS, "model": str(tmp_path)}
    job = make_job(prompt, settings=settings, constraint=Constraint(kind="json_schema", schema=schema))

    chunks, finished = collect(runner_module.load(settings).stream(job, never))

    jsonschema.validate(json.loads("".join(c.text for c in chunks)), schema)
    assert finished.reason == "stop"


def test_without_the_generation_config_the_engine_writes_on_past_the_end_of_the_turn(engine: Seen) -> None:
    chunks, finished = collect(runner_module.load(SETTINGS).stream(make_job("one two {end_of_turn} three"), never))

    assert "".join(c.text for c in chunks) == "one two three"
    assert finished.completion_tokens == 4
