"""The CPU runner serves several sequences at once from one llama.cpp context (continuous batching):
each keeps its own parameters, jobs join and leave between steps, and prompts reuse what a slot cached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest

from inference import tasks
from inference.engine.runners import llama_cpp
from inference.engine.runners.base import Constraint, Finished, GenerationJob, RunnerError, Sampling, TextChunk
from inference.models import CatalogEntry
from tests.conftest import DEFAULT_MODEL, ROOT

SETTINGS = {**DEFAULT_MODEL["runner_settings"], "parallel": 4, "queue": 2, "n_ctx": 1024}
QUESTIONS = [
    "Name one river in Oregon.",
    "Write a haiku about rain.",
    "What is the capital of France?",
    "Tell me about the moon.",
]
CITY = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "state": {"type": "string"}},
    "required": ["name", "state"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def runner() -> Iterator[llama_cpp.LlamaCppRunner]:
    loaded = llama_cpp.LlamaCppRunner(SETTINGS)
    yield loaded
    loaded.close()


@pytest.fixture(scope="module")
def render() -> Callable[[str], str]:
    renderer = llama_cpp.renderer(SETTINGS)
    return lambda question: renderer.render([{"role": "user", "content": question}], None)


def job(
    prompt: str, *, max_tokens: int = 32, constraint: Constraint | None = None, **sampling: object
) -> GenerationJob:
    return GenerationJob(
        job_id="batching",
        model_id="batching/model",
        runner="llama_cpp",
        runner_settings=SETTINGS,
        prompt=prompt,
        prompt_tokens=0,
        sampling=Sampling(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}),  # type: ignore[arg-type]
        constraint=constraint,
    )


@dataclass
class Run:
    chunks: list[TextChunk] = field(default_factory=list)
    finished: Finished | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(chunk.text for chunk in self.chunks)


def run(
    runner: llama_cpp.LlamaCppRunner, work: GenerationJob, cancelled: Callable[[Run], bool] = lambda _: False
) -> Run:
    result = Run()
    for event in runner.stream(work, lambda: cancelled(result)):
        if isinstance(event, TextChunk):
            result.first_token_at = result.first_token_at or time.monotonic()
            result.chunks.append(event)
        else:
            result.finished, result.finished_at = event, time.monotonic()
    return result


def together(runner: llama_cpp.LlamaCppRunner, jobs: list[GenerationJob]) -> list[Run]:
    results: list[Run | None] = [None] * len(jobs)

    def one(index: int) -> None:
        results[index] = run(runner, jobs[index])

    threads = [threading.Thread(target=one, args=(index,)) for index in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert all(result is not None for result in results)
    return results  # type: ignore[return-value]


def numbers(answer: Run) -> list[tuple[bytes, float, tuple[tuple[bytes, float], ...]]]:
    """Every token of an answer with its logprob and alternatives, to the last bit."""
    return [(each.token, each.logprob, each.top) for chunk in answer.chunks for each in chunk.logprobs]


def test_greedy_output_has_the_same_numbers_alone_and_in_a_batch_of_four(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    """Prompts read together and apart, sequences decoded beside others or alone: llama.cpp's flash attention and
    llamafile's matrix kernels each sum otherwise by how many rows a step holds, and the runner uses neither."""
    jobs = [job(render(question), logprobs=True, top_logprobs=2) for question in QUESTIONS]
    alone = [run(runner, each) for each in jobs]

    batched = together(runner, jobs)

    assert [numbers(r) for r in batched] == [numbers(r) for r in alone]
    assert [r.text for r in batched] == [r.text for r in alone]
    assert all(r.finished is not None and r.finished.completion_tokens > 0 for r in batched)


def test_each_sequence_keeps_its_own_constraint_and_sampling(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    # Strings of bounded length: a hot sample may ramble, and the whole value still fits the budget.
    bounded = {**CITY, "properties": {name: {"type": "string", "maxLength": 30} for name in CITY["properties"]}}
    structured = job(
        render("Describe a city."),
        max_tokens=100,
        constraint=Constraint("json_schema", bounded),
        temperature=0.9,
        seed=3,
    )
    free = job(render(QUESTIONS[0]), max_tokens=24)
    sampled = job(render(QUESTIONS[1]), max_tokens=24, temperature=1.0, seed=11)

    city, text, first_draw = together(runner, [structured, free, sampled])
    second_draw = run(runner, sampled)

    jsonschema.validate(json.loads(city.text), bounded)
    assert not text.text.lstrip().startswith("{")
    assert first_draw.text == second_draw.text  # a seed gives the same draw, whoever else is in the batch


def test_stop_sequences_and_logprobs_apply_per_sequence(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    free = run(runner, job(render(QUESTIONS[3]), max_tokens=24)).text
    stop = free.split()[3]

    stopped, with_logprobs = together(
        runner,
        [
            job(render(QUESTIONS[3]), max_tokens=24, stop=(stop,)),
            job(render(QUESTIONS[0]), max_tokens=8, logprobs=True, top_logprobs=3),
        ],
    )

    assert stop not in stopped.text and free.startswith(stopped.text)
    assert stopped.finished is not None and stopped.finished.reason == "stop"
    assert not any(chunk.logprobs for chunk in stopped.chunks)
    logprobs = [lp for chunk in with_logprobs.chunks for lp in chunk.logprobs]
    assert len(logprobs) == 8 and all(len(lp.top) == 3 and lp.logprob <= 0 for lp in logprobs)


def test_an_end_of_turn_among_the_alternatives_is_named_not_an_empty_token(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    answered = run(runner, job(render("Say yes."), max_tokens=20, logprobs=True, top_logprobs=20))

    alternatives = [token for chunk in answered.chunks for lp in chunk.logprobs for token, _ in lp.top]
    assert b"<|im_end|>" in alternatives
    assert b"" not in alternatives


def test_a_cancelled_sequence_stops_and_frees_its_slot_while_the_others_finish(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    results: dict[str, Run] = {}

    def keep(name: str, work: GenerationJob, cancelled: Callable[[Run], bool] = lambda _: False) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.__setitem__(name, run(runner, work, cancelled)))
        thread.start()
        return thread

    threads = [
        keep(
            "cancelled",
            job(render(QUESTIONS[3]), max_tokens=400, temperature=0.8, seed=1),
            lambda r: len(r.chunks) >= 3,
        ),
        keep("first", job(render(QUESTIONS[0]), max_tokens=40)),
        keep("second", job(render(QUESTIONS[1]), max_tokens=40)),
    ]
    for thread in threads:
        thread.join(timeout=300)

    cancelled = results["cancelled"].finished
    assert cancelled is not None and cancelled.reason == "cancelled" and cancelled.completion_tokens < 40
    assert all(results[name].finished.reason in ("stop", "length") for name in ("first", "second"))  # type: ignore[union-attr]
    assert runner.stats().active == 0


def test_a_new_job_gets_its_first_token_while_the_others_are_still_generating(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    long_runs: list[Run] = []
    threads = [
        threading.Thread(
            target=lambda q=q: long_runs.append(run(runner, job(render(q), max_tokens=160, temperature=0.8, seed=2)))
        )
        for q in QUESTIONS[:3]
    ]
    for thread in threads:
        thread.start()
    while runner.stats().active < 3:
        time.sleep(0.01)

    newcomer = run(runner, job(render("Say hello."), max_tokens=4))
    for thread in threads:
        thread.join(timeout=300)

    assert newcomer.first_token_at is not None
    assert any(r.finished_at is not None and r.finished_at > newcomer.first_token_at for r in long_runs)


def test_a_short_prompt_is_read_before_the_rest_of_a_long_one_that_came_first(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    long_prompt = render("Sum this up: " + "The river runs past the old mill by the bridge. " * 80)  # some 900 tokens
    long_runs: list[Run] = []
    reader = threading.Thread(target=lambda: long_runs.append(run(runner, job(long_prompt, max_tokens=4))))
    reader.start()
    while runner.stats().active < 1:
        time.sleep(0.005)

    short = run(runner, job(render("Say hello."), max_tokens=4))
    reader.join(timeout=300)

    [long_run] = long_runs
    assert long_run.finished is not None and long_run.finished.prompt_tokens > 3 * llama_cpp.PREFILL_CHUNK
    assert short.first_token_at is not None and long_run.first_token_at is not None
    assert short.first_token_at < long_run.first_token_at


def test_a_repeated_prompt_reuses_its_cache_and_answers_the_same(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    prompt = render("Give me three tips for a rainy day in Oregon.")
    first = run(runner, job(prompt, max_tokens=24))
    again = run(runner, job(prompt, max_tokens=24))
    assert first.finished is not None and again.finished is not None

    assert again.finished.cached_tokens == again.finished.prompt_tokens - 1
    assert again.text == first.text
    # The next turn of the conversation starts with the whole first one.
    follow_up = prompt + first.text + "<|im_end|>\n<|im_start|>user\nAnd one more?<|im_end|>\n<|im_start|>assistant\n"
    turn = run(runner, job(follow_up, max_tokens=8))
    assert turn.finished is not None and turn.finished.cached_tokens >= first.finished.prompt_tokens


def test_a_prompt_sent_as_its_last_run_is_cancelled_takes_that_runs_slot_and_its_cache(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    # As an answer ended at its one tool call: the client cancels it and at once sends the next request.
    prompt = render("List five things to pack for a hike on Mount Hood.")
    cancelled = threading.Event()
    last = runner.stream(job(prompt, max_tokens=400, temperature=0.8, seed=3), cancelled.is_set)
    assert isinstance(next(last), TextChunk)
    cancelled.set()

    again = run(runner, job(prompt, max_tokens=4))

    assert again.finished is not None
    assert again.finished.cached_tokens == again.finished.prompt_tokens - 1
    assert [type(event) for event in last][-1] is Finished


def test_a_greedy_answer_has_the_same_numbers_however_much_of_its_prompt_was_cached_and_by_what() -> None:
    """Read cold; again, all but its last token cached; from a prefix cached by a longer prompt (read in a long
    chunk) and by a shorter one."""
    renderer = llama_cpp.renderer(SETTINGS)
    system = {"role": "system", "content": "You answer travellers' questions briefly, with one fact about the place."}
    question = [system, {"role": "user", "content": "Tell me about the moon."}]
    longer = [system, {"role": "user", "content": "Plan a week in Oregon. " * 12}]
    shorter = [system, {"role": "user", "content": "Hi."}]
    asked = job(renderer.render(question, None), max_tokens=24, logprobs=True, top_logprobs=2)

    def answer(*before: list[dict[str, str]]) -> Run:
        own = llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": 1})
        try:
            for messages in before:
                run(own, job(renderer.render(messages, None), max_tokens=1))
            return run(own, asked)
        finally:
            own.close()

    cold, again = answer(), answer(question)
    after_longer, after_shorter = answer(longer), answer(shorter)

    assert cold.finished is not None and cold.finished.cached_tokens == 0
    assert again.finished is not None and again.finished.cached_tokens == again.finished.prompt_tokens - 1
    assert after_longer.finished is not None and after_longer.finished.cached_tokens > 0
    assert after_shorter.finished is not None and after_shorter.finished.cached_tokens > 0
    assert len(numbers(cold)) == 24
    assert numbers(again) == numbers(cold)
    assert numbers(after_longer) == numbers(cold)
    assert numbers(after_shorter) == numbers(cold)


def test_jobs_beyond_the_slots_wait_in_arrival_order_and_beyond_the_queue_are_refused(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    done = [threading.Event() for _ in range(6)]
    started = [threading.Event() for _ in range(6)]

    def one(index: int) -> None:
        work = job(render(QUESTIONS[index % 4]), max_tokens=300, temperature=0.8, seed=index)
        for event in runner.stream(work, done[index].is_set):
            if isinstance(event, TextChunk):
                started[index].set()

    threads = [threading.Thread(target=one, args=(index,)) for index in range(6)]
    for index, thread in enumerate(threads):
        thread.start()
        if index < 4:
            started[index].wait(timeout=120)
        else:  # the slots are taken: the job waits in the queue, in the order it came
            while runner.stats().queued < index - 3:
                time.sleep(0.01)

    with pytest.raises(RunnerError) as refused:
        runner.stream(job(render(QUESTIONS[0])), lambda: False)
    assert refused.value.code == "overloaded"

    # One slot frees up: the job that came first takes it, the other keeps waiting.
    done[0].set()
    assert started[4].wait(timeout=120)
    assert not started[5].is_set() and runner.stats().queued == 1

    for event in done:
        event.set()
    for thread in threads:
        thread.join(timeout=60)
    assert runner.stats().active == runner.stats().queued == 0


def test_a_burst_that_comes_while_the_scheduler_reads_a_prompt_is_held_to_the_slots_and_the_queue(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    # A long prompt keeps the scheduler reading for a step, the other slots free, while ten more jobs come.
    stop = threading.Event()
    first = job(render("The river runs past the old mill by the bridge. " * 20), max_tokens=200)
    accepted = [runner.start(first, stop.is_set, lambda _: None)]
    while runner.stats().active < 1:
        time.sleep(0.001)
    refused = []
    try:
        for n in range(10):
            burst = job(render(QUESTIONS[n % 4]), max_tokens=200)
            try:
                accepted.append(runner.start(burst, stop.is_set, lambda _: None))
            except RunnerError as error:
                refused.append(error.code)
        held = runner.stats()
    finally:
        stop.set()
        while runner.stats().active or runner.stats().queued:
            time.sleep(0.01)

    # Four slots and a queue of two: six jobs at once, the rest refused.
    assert (len(accepted), refused) == (6, ["overloaded"] * 5)
    assert held.active + held.queued == 6


def test_a_waiting_job_whose_client_left_holds_no_place_in_the_queue(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    # Four long prompts keep every slot reading for seconds, a step of it at a time; two jobs wait behind them.
    stop, left = threading.Event(), threading.Event()
    busy = [
        job(render(f"Text {n}: " + "The river runs past the old mill by the bridge. " * 80), max_tokens=4)
        for n in range(4)
    ]
    threads = [threading.Thread(target=run, args=(runner, each, lambda _: stop.is_set())) for each in busy]
    waiting = [job(render(QUESTIONS[n]), max_tokens=4) for n in range(2)]
    threads += [threading.Thread(target=run, args=(runner, each, lambda _: left.is_set())) for each in waiting]
    for thread in threads[:4]:
        thread.start()
    while runner.stats().active < 4:
        time.sleep(0.005)
    for thread in threads[4:]:
        thread.start()
    while runner.stats().queued < 2:
        time.sleep(0.005)

    try:
        left.set()  # both waiting clients hang up; the scheduler is busy reading prompts
        runner.stream(job(render("Say hello.")), stop.is_set)  # takes a place of theirs at once
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
    assert runner.stats().active == runner.stats().queued == 0


def start_worker_of_the_batching_model(concurrency: int) -> CatalogEntry:
    """A threads worker of ``concurrency`` starting on the queue of a batching model's entry; the entry."""
    entry = CatalogEntry.objects.create(public_id="b3os/batching", runner="llama_cpp", runner_settings=SETTINGS)
    queues = SimpleNamespace(consume_from={entry.queue: None})
    worker = SimpleNamespace(
        pool_cls="threads", concurrency=concurrency, app=SimpleNamespace(amqp=SimpleNamespace(queues=queues))
    )
    tasks._load_models_at_worker_init(sender=worker)
    return entry


@pytest.mark.django_db
def test_a_worker_with_fewer_threads_than_its_models_hold_says_how_many_to_give_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entry = start_worker_of_the_batching_model(concurrency=2)

    assert tasks.jobs_held({entry.queue}) == 6  # 4 sequences and 2 queued, as SETTINGS say
    assert "start it with --concurrency 6" in caplog.text


@pytest.mark.django_db
def test_a_worker_of_batching_models_only_takes_more_jobs_than_runner_threads_without_a_word_of_them(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The batched runner pushes its events from its one scheduling thread: it holds no thread per job.
    start_worker_of_the_batching_model(concurrency=500)

    assert "RUNNER_JOB_THREADS" not in caplog.text


def test_a_fault_in_the_scheduler_ends_the_jobs_it_touched_and_the_runner_goes_on(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    step = runner._step
    faults = iter([True])

    def faulty_step() -> None:
        if next(faults, False):
            raise RuntimeError("a fault in a step")
        step()

    monkeypatch.setattr(runner, "_step", faulty_step)

    with pytest.raises(RunnerError) as failed:
        run(runner, job(render(QUESTIONS[0])))
    after = run(runner, job(render(QUESTIONS[0]), max_tokens=4))

    assert failed.value.code == "generation_failed"
    assert after.finished is not None and after.finished.completion_tokens == 4


def test_tokens_that_come_faster_than_the_stream_interval_travel_together_and_the_first_comes_alone(
    render: Callable[[str], str],
) -> None:
    assert llama_cpp.RunnerSettings.of(SETTINGS).stream_interval == llama_cpp.STREAM_INTERVAL_MS / 1000
    every_token = llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": 1, "stream_interval_ms": 0})
    held = llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": 1, "stream_interval_ms": 10_000})
    try:
        one_by_one = run(every_token, job(render(QUESTIONS[2]), max_tokens=16))
        grouped = run(held, job(render(QUESTIONS[2]), max_tokens=16))
    finally:
        every_token.close()
        held.close()

    assert grouped.text == one_by_one.text
    assert grouped.finished == one_by_one.finished and one_by_one.finished is not None
    produced = one_by_one.finished.completion_tokens
    assert [chunk.tokens for chunk in one_by_one.chunks] == [1] * produced
    assert [chunk.tokens for chunk in grouped.chunks] == [1, produced - 1]


def test_a_token_ending_with_the_first_bytes_of_a_character_leaves_with_that_character_and_its_logprob(
    render: Callable[[str], str],
) -> None:
    # An emoji is two tokens here, the second ending with the first bytes of the next emoji. A stop sequence of
    # three characters holds the last two back, so a chunk is cut behind such a token, as deltas that travel
    # together are.
    every_token = llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": 1, "stream_interval_ms": 0})
    try:
        globes = run(
            every_token,
            job(render("Reply with three globe emojis."), max_tokens=16, stop=("\n\n\n",), logprobs=True),
        )
    finally:
        every_token.close()

    assert "\N{EARTH GLOBE EUROPE-AFRICA}" * 2 in globes.text and len(globes.chunks) > 1
    for chunk in globes.chunks[:-1]:
        assert b"".join(logprob.token for logprob in chunk.logprobs) == chunk.text.encode()


def test_an_answer_the_budget_cuts_inside_a_character_ends_before_it(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str]
) -> None:
    cut = []
    for budget in range(2, 10):
        globes = run(runner, job(render("Reply with three globe emojis."), max_tokens=budget, logprobs=True))
        written = b"".join(logprob.token for chunk in globes.chunks for logprob in chunk.logprobs)
        try:
            written.decode()
        except UnicodeDecodeError:  # its last token holds the first bytes of a character
            cut.append(budget)
            assert "\N{REPLACEMENT CHARACTER}" not in globes.text
            assert written.startswith(globes.text.encode()) and len(written) > len(globes.text.encode())
            assert globes.finished is not None and globes.finished.completion_tokens == budget

    assert cut, "no budget ended inside a character"


def test_a_wrong_number_in_the_settings_is_refused_by_name_before_anything_loads() -> None:
    with pytest.raises(RunnerError) as refused:
        llama_cpp.RunnerSettings.of({**SETTINGS, "prefill_chunk": 2.5})

    assert refused.value.code == "runner_unavailable"
    assert "prefill_chunk must be a whole number from 1 to 1048576, not 2.5." in str(refused.value)
    assert llama_cpp.RunnerSettings.of({**SETTINGS, "n_threads": None}).threads >= 1


def test_the_hosts_thread_count_comes_before_the_catalog_entrys(monkeypatch: pytest.MonkeyPatch) -> None:
    settings = {**SETTINGS, "n_threads": 4}
    monkeypatch.delenv("CPU_RUNNER_THREADS", raising=False)
    assert llama_cpp.RunnerSettings.of(settings).threads == 4

    monkeypatch.setenv("CPU_RUNNER_THREADS", "1")
    assert llama_cpp.RunnerSettings.of(settings).threads == 1

    monkeypatch.setenv("CPU_RUNNER_THREADS", "")
    assert llama_cpp.RunnerSettings.of({**SETTINGS}).threads == llama_cpp.default_threads()


def test_each_decode_lists_its_sequences_in_slot_order_so_llama_cpp_runs_them_in_one_pass(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # With a cache per sequence, llama.cpp splits a batch whose sequence ids do not rise through it into several
    # passes. The second round reuses the first one's slots in the reverse order of arrival.
    seen: list[list[int]] = []
    decode = runner._lib.llama_decode

    def spy(ctx: object, batch: object) -> int:
        seen.append([batch.seq_id[i][0] for i in range(batch.n_tokens)])  # type: ignore[attr-defined]
        return int(decode(ctx, batch))

    monkeypatch.setattr(runner._lib, "llama_decode", spy)
    first = together(runner, [job(render(question), max_tokens=8) for question in QUESTIONS])
    again = together(runner, [job(render(question), max_tokens=8) for question in reversed(QUESTIONS)])

    assert [run.text for run in again] == [run.text for run in reversed(first)]
    assert all(run.finished and run.finished.cached_tokens > 0 for run in again)
    assert seen and all(ids == sorted(ids) for ids in seen)


def test_a_steps_events_are_handed_on_together_once_every_sequence_has_taken_its_token(
    runner: llama_cpp.LlamaCppRunner, render: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whoever reads them (the event loop, a worker's publisher) then wakes once a step, not between the sequences.
    log: list[tuple[str, int]] = []
    decode, logits = runner._lib.llama_decode, runner._lib.llama_get_logits_ith
    monkeypatch.setattr(runner._lib, "llama_decode", lambda ctx, batch: log.append(("decode", 0)) or decode(ctx, batch))
    monkeypatch.setattr(runner._lib, "llama_get_logits_ith", lambda ctx, i: log.append(("sample", i)) or logits(ctx, i))
    ended = [threading.Event() for _ in QUESTIONS]

    def delivery(index: int) -> Callable[[object], None]:
        def deliver(item: object) -> None:
            log.append(("event", index))
            if isinstance(item, Finished | RunnerError):
                ended[index].set()

        return deliver

    for index, question in enumerate(QUESTIONS):
        runner.start(job(render(question), max_tokens=16), lambda: False, delivery(index))
    assert all(end.wait(120) for end in ended)

    steps: list[list[tuple[str, int]]] = []
    for entry in log:
        if entry[0] == "decode":
            steps.append([])
        elif steps:
            steps[-1].append(entry)
    kinds = ["".join(kind[0] for kind, _ in step) for step in steps]
    assert all("es" not in step for step in kinds), kinds  # no sequence samples after an event of its step
    assert any(len({index for kind, index in step if kind == "event"}) > 1 for step in steps)


@pytest.mark.parametrize(("exiting", "code"), [(True, "server_shutting_down"), (False, "runner_unavailable")])
def test_a_job_its_runner_closes_under_it_is_told_why(
    render: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, exiting: bool, code: str
) -> None:
    """Closed as its process exits (a worker's cold stop), or as its model is unloaded (its settings changed)."""
    monkeypatch.setattr(llama_cpp, "_exiting", exiting)
    own = llama_cpp.LlamaCppRunner({**SETTINGS, "parallel": 1})
    events = own.stream(job(render("Count from 1 to 100 in words."), max_tokens=512), lambda: False)
    next(events)  # under way
    own.close()

    with pytest.raises(RunnerError) as cut:
        for _ in events:
            pass
    assert cut.value.code == code


def test_a_context_smaller_than_the_prefill_chunk_is_prefilled_in_steps_llama_cpp_takes(tmp_path: Path) -> None:
    # llama.cpp holds a batch to the context asked for (64 here, rounded up to 256 for the cache), and a step of more
    # tokens than that aborts the whole process: so in a child.
    small = {**DEFAULT_MODEL["runner_settings"], "parallel": 1, "n_ctx": 64}
    code = (
        "import django; django.setup()\n"
        "from inference.engine.runners import llama_cpp\n"
        "from inference.engine.runners.base import Finished, GenerationJob, Sampling\n"
        f"settings = {small!r}\n"
        "job = GenerationJob('small', 'm', 'llama_cpp', settings, 'word ' * 100, 0, Sampling(max_tokens=4))\n"
        "events = list(llama_cpp.LlamaCppRunner(settings).stream(job, lambda: False))\n"
        "print(type(events[-1]).__name__, events[-1].prompt_tokens)\n"
    )
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "B3OS_VAR_DIR": str(tmp_path)}

    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["Finished", "101"]
