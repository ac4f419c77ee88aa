"""The generation workflow both API families share: prepare a job for a catalog model, run it, read it back.

``prepare`` renders the conversation with the model's template, checks the context, and plans the
output constraint; ``Generation.run`` dispatches the job and yields decoded pieces (text, reasoning,
tool calls) and one terminal ``Done`` or ``Failed``, cancelling the job if the consumer stops early.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from asgiref.sync import sync_to_async
from django.conf import settings
from jinja2 import TemplateError

from inference.models import CatalogEntry

from .decoding import (
    DecodePlan,
    FunctionTool,
    Piece,
    ReasoningPiece,
    StreamDecoder,
    ToolChoice,
    plan_decoding,
)
from .dispatch import Job, start_job
from .exceptions import (
    ChatTemplateRefused,
    ContextLengthExceeded,
    ModelUnavailable,
    NotStarted,
    Overloaded,
    PenaltyNotApplied,
    SchemaNotEnforceable,
    TooManyTopLogprobs,
)
from .execution import Accepted, JobEvent, JobFailed, get_renderer
from .prompting import Message, RenderedPrompt, check_context, render_prompt
from .runners.base import Finished, GenerationJob, PromptRenderer, RunnerError, Sampling, TextChunk, TokenLogprob

logger = logging.getLogger("inference.engine.generation")

# A job's first answer that says no runner could take it (no worker consumes its queue, Redis away as it was queued):
# the deployment's state, refused before any response begins, as a full queue is.
NOT_STARTED_CODES = frozenset({"no_worker", "service_unavailable"})


@dataclass(frozen=True, slots=True)
class Done:
    finish_reason: Literal["stop", "length", "tool_calls"]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int


@dataclass(frozen=True, slots=True)
class Failed:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Logprobs:
    items: tuple[TokenLogprob, ...]


GenerationEvent = Piece | Logprobs | Done | Failed


@dataclass
class Generation:
    entry: CatalogEntry
    job: GenerationJob
    plan: DecodePlan
    started: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    finished: bool = False
    api_key_id: int | None = None  # the key it answers, when the serving layer watches it (``serving.revocation``)
    loop: asyncio.AbstractEventLoop | None = field(default=None, repr=False)  # the event loop running it
    _job: Job | None = field(default=None, repr=False)
    _events: AsyncIterator[list[JobEvent]] | None = field(default=None, repr=False)
    _first: list[JobEvent] = field(default_factory=list, repr=False)
    _accepted: bool = field(default=False, repr=False)
    _interrupted: Failed | None = field(default=None, repr=False)
    _wait: asyncio.Timeout | None = field(default=None, repr=False)  # the wait for the next batch, while it lasts

    @property
    def prompt_tokens(self) -> int:
        return self.job.prompt_tokens

    @property
    def accepted(self) -> bool:
        """Whether a runner took the job (to generate now, or to queue)."""
        return self._accepted

    @property
    def time_to_first_token_ms(self) -> int | None:
        return None if self.first_token_at is None else int((self.first_token_at - self.started) * 1000)

    async def start(self) -> None:
        """Hands the job to its runner and waits until the runner has taken it (to generate now, or to queue),
        so that a refusal is an error before any response begins: raises ``Overloaded``, or ``NotStarted`` when no
        runner could take it at all."""
        if self._job is not None:
            return
        if (refusing := _refusing) is not None:
            self.finished = True
            raise NotStarted(refusing.code, refusing.message, retry_after=settings.OUTAGE_RETRY_AFTER_SECONDS)
        self._job = job = start_job(self.job, queue=self.entry.queue)
        self._events = aiter(job.events())
        _starting[id(self)] = self
        try:
            # A wait without end (a job queued for a worker waits up to JOB_START_TIMEOUT_SECONDS), which
            # ``interrupt`` ends at once.
            async with asyncio.timeout(None) as self._wait:
                first = await anext(self._events)
        except StopAsyncIteration:
            first = []
        except TimeoutError:
            if self._interrupted is None:  # not the interrupt's: the job's own
                await job.cancel()
                raise
            first = []  # interrupted (the server shutting down) before any runner took the job
        except BaseException:
            await job.cancel()
            raise
        finally:
            self._wait = None
            del _starting[id(self)]
        self._accepted = any(isinstance(event, Accepted) for event in first)
        if not self._accepted and self._interrupted is not None:
            await job.cancel()
            self.finished = True
            failure = self._interrupted
            raise NotStarted(failure.code, failure.message, retry_after=settings.OUTAGE_RETRY_AFTER_SECONDS)
        if not self._accepted and first and isinstance(refused := first[0], JobFailed):
            if refused.code == "overloaded":
                self.finished = True
                raise Overloaded(self.entry.public_id, retry_after=settings.OVERLOADED_RETRY_AFTER_SECONDS)
            if refused.code in NOT_STARTED_CODES:
                self.finished = True
                logger.warning("job %s did not start: %s: %s", self.job.job_id, refused.code, refused.message)
                raise NotStarted(
                    refused.code,
                    refused.message,
                    retry_after=settings.OUTAGE_RETRY_AFTER_SECONDS,
                    outage=refused.outage,
                )
        self._first = [event for event in first if not isinstance(event, Accepted)]

    async def _batches(self) -> AsyncGenerator[list[JobEvent], None]:
        """The job's events in batches; an empty batch when the stream's time is up while nothing arrives
        (a job waiting in its runner's queue counts against it too)."""
        assert self._events is not None
        if self._first:
            yield self._first
        deadline = self.started + settings.STREAM_MAX_SECONDS
        while True:
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())) as self._wait:
                    batch = await anext(self._events)
            except StopAsyncIteration:
                return
            except TimeoutError:
                yield []
                return
            finally:
                self._wait = None
            yield [event for event in batch if not isinstance(event, Accepted)]

    async def run(self) -> AsyncGenerator[GenerationEvent, None]:
        await self.start()
        job = self._job
        assert job is not None
        decoder = StreamDecoder(self.plan)
        reasoning_chars = 0
        deadline = self.started + settings.STREAM_MAX_SECONDS
        _running[id(self)] = self
        self.loop = asyncio.get_running_loop()
        try:
            async for batch in self._batches():
                if self._interrupted is not None:
                    await job.cancel()
                    self.finished = True
                    yield self._interrupted
                    return
                for event in _coalesce(batch):
                    if isinstance(event, TextChunk):
                        if self.first_token_at is None:
                            self.first_token_at = time.monotonic()
                        self.completion_tokens += event.tokens
                        self.cached_tokens = event.cached_tokens
                        for piece in _read(decoder, event):
                            reasoning_chars += len(piece.text) if isinstance(piece, ReasoningPiece) else 0
                            yield piece
                        if decoder.ended:
                            # The one call the request allows is written: nothing after it could be sent.
                            await job.cancel()
                            self.finished = True
                            yield Done(
                                finish_reason=self.plan.calls_end_as,
                                prompt_tokens=self.prompt_tokens,
                                completion_tokens=self.completion_tokens,
                                cached_tokens=self.cached_tokens,
                                reasoning_tokens=_reasoning_tokens(reasoning_chars, decoder, self.completion_tokens),
                            )
                            return
                    elif isinstance(event, Finished):
                        for piece in decoder.finish(ran_out=event.reason == "length"):
                            reasoning_chars += len(piece.text) if isinstance(piece, ReasoningPiece) else 0
                            yield piece
                        self.finished = True
                        self.completion_tokens = event.completion_tokens
                        yield Done(
                            finish_reason=_finish_reason(event.reason, decoder),
                            prompt_tokens=event.prompt_tokens,
                            completion_tokens=event.completion_tokens,
                            cached_tokens=event.cached_tokens,
                            reasoning_tokens=_reasoning_tokens(reasoning_chars, decoder, event.completion_tokens),
                        )
                        return
                    elif isinstance(event, JobFailed):
                        self.finished = True
                        yield Failed(event.code, event.message)
                        return
                if time.monotonic() >= deadline:
                    # The stream's time is up: end it cleanly as a length stop.
                    await job.cancel()
                    for piece in decoder.finish(ran_out=True):
                        yield piece
                    self.finished = True
                    reasoning = _reasoning_tokens(reasoning_chars, decoder, self.completion_tokens)
                    yield Done("length", self.prompt_tokens, self.completion_tokens, self.cached_tokens, reasoning)
                    return
        finally:
            _running.pop(id(self), None)
            if not self.finished:
                await job.cancel()

    def interrupt(self, failure: Failed) -> None:
        """Ends the generation with ``failure``: at once if it waits for its job's next events (or, starting, for a
        runner to take its job), else when they come. Its job is cancelled."""
        self._interrupted = failure
        if self._wait is not None:
            self._wait.reschedule(asyncio.get_running_loop().time())


# The generations running in this process (``Generation.run``), to end when it shuts down; and those waiting for a
# runner to take their jobs (``Generation.start``), which end before any response begins.
_running: dict[int, Generation] = {}
_starting: dict[int, Generation] = {}

SHUTTING_DOWN = Failed("server_shutting_down", "the server shut down before the answer was complete")


def running() -> list[Generation]:
    """The generations running in this process."""
    return list(_running.values())


_refusing: Failed | None = None


def refuse_new(failure: Failed | None = SHUTTING_DOWN) -> None:
    """From now on a generation is refused with ``failure`` before it starts (503, before any response begins); with
    ``None``, accepted again. A server past its grace period refuses the requests its clients still send on
    connections they kept open: nothing waits for them any more, and they would be cut without a word."""
    global _refusing
    _refusing = failure


def interrupt_all(failure: Failed = SHUTTING_DOWN) -> int:
    """Ends every generation running in this process with ``failure`` (each stream then ends as any failed one
    does: an error event, and its usage recorded), and refuses those still waiting for a runner (503, before any
    response begins); returns how many."""
    running = [*_running.values(), *_starting.values()]
    for generation in running:
        generation.interrupt(failure)
    return len(running)


def _coalesce(batch: list[Any]) -> list[Any]:
    """Text that arrived together leaves together: one delta per batch, not one per token."""
    out: list[Any] = []
    for event in batch:
        if isinstance(event, TextChunk) and out and isinstance(out[-1], TextChunk):
            last = out[-1]
            out[-1] = TextChunk(
                last.text + event.text, last.tokens + event.tokens, last.logprobs + event.logprobs, event.cached_tokens
            )
        else:
            out.append(event)
    return out


def _read(decoder: StreamDecoder, chunk: TextChunk) -> Iterator[Logprobs | Piece]:
    """A chunk's pieces, each token's logprobs just before the pieces it ends. The reasoning's tokens, its tags
    among them, have none, nor have a call's (its markup too, and the whitespace left out after it): the answer's
    logprobs are those of the answer's tokens (whose text a tag may hold back and let go with a later one)."""
    for text, logprobs in _by_token(chunk):
        elsewhere = decoder.thinking or decoder.calling
        pieces = decoder.feed(text)
        if logprobs and not (elsewhere or decoder.thinking or decoder.calling or decoder.after_call):
            yield Logprobs(logprobs)
        yield from pieces


def _by_token(chunk: TextChunk) -> list[tuple[str, tuple[TokenLogprob, ...]]]:
    """A chunk's text a token at a time, each after its own logprob, when its logprobs spell it out: the decoder
    then tells the reasoning's, a call's and the answer's tokens apart however many of them arrived together.
    Otherwise (a token cut by a stop sequence, a character split across chunks) the chunk as it is."""
    whole = [(chunk.text, chunk.logprobs)]
    if len(chunk.logprobs) < 2:
        return whole
    decode = codecs.getincrementaldecoder("utf-8")().decode
    try:
        texts = [decode(item.token) for item in chunk.logprobs]
        rest = decode(b"", final=True)
    except UnicodeDecodeError:
        return whole
    if rest or "".join(texts) != chunk.text:
        return whole
    return [(text, (item,)) for text, item in zip(texts, chunk.logprobs, strict=True)]


def _finish_reason(reason: str, decoder: StreamDecoder) -> Literal["stop", "length", "tool_calls"]:
    """OpenAI's: ``length`` whenever the token budget ended the output, the calls it holds included."""
    if reason == "length" or decoder.cut_call:
        return "length"
    return decoder.plan.calls_end_as if decoder.tool_calls else "stop"


def _reasoning_tokens(reasoning_chars: int, decoder: StreamDecoder, completion_tokens: int) -> int:
    if not reasoning_chars:
        return 0
    # Runners count tokens, not which of them were reasoning: apportion by characters.
    total_chars = sum(len(t) for t in decoder.raw) or 1
    return min(completion_tokens, round(completion_tokens * reasoning_chars / total_chars))


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What either API asks of a model, in the platform's own terms."""

    messages: list[Message]
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    reasoning: bool = False
    response_format: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    # ``max_output_tokens`` is a ceiling the client did not ask for (an agent instance's own): fitted to the room the
    # prompt leaves, as an unset one is, never refused for not fitting.
    fit_output: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # Responses' ``truncation: auto``: a conversation past the context loses its oldest turns instead of a 400.
    truncate: bool = False


async def prepare(*, entry: CatalogEntry, request: GenerationRequest) -> Generation:
    """Render, count and plan, before anything runs: raises ``ModelUnavailable``, ``ChatTemplateRefused``,
    ``ContextLengthExceeded``, ``SchemaNotEnforceable`` or ``TooManyTopLogprobs``.

    Rendering, tokenizing and building grammars are CPU work that grows with the request: done on a thread, never
    on the event loop that serves every other request."""
    if problem := entry.defaults_problem():  # not served on them, as on runner settings it cannot load
        logger.warning("the model %s cannot be served here: %s", entry.public_id, problem)
        raise ModelUnavailable(entry.public_id, problem)
    renderer = await renderer_for(entry)
    return await sync_to_async(_prepare, thread_sensitive=False)(entry=entry, request=request, renderer=renderer)


async def renderer_for(entry: CatalogEntry) -> PromptRenderer:
    """The model's prompt renderer, made on a thread; ``ModelUnavailable`` when its runner cannot serve here (settings
    saved around the admin's checks, a model file gone)."""
    try:
        return await sync_to_async(get_renderer, thread_sensitive=False)(entry.runner, entry.runner_settings)
    except RunnerError as exc:
        logger.warning("the model %s cannot be served here: %s", entry.public_id, exc)
        raise ModelUnavailable(entry.public_id, str(exc)) from None


def truncated(
    messages: list[Message], fitting: Callable[[list[Message]], tuple[RenderedPrompt, int]]
) -> tuple[RenderedPrompt, int]:
    """What ``fitting`` makes of ``messages``, or of the fewest of their oldest turns left out that fit (OpenAI's
    ``truncation: auto``). The instructions before the conversation stay, and a cut comes only before a user
    message, so that no call loses its output; ``ContextLengthExceeded`` when even the last turn alone is too long."""
    try:
        return fitting(messages)
    except ContextLengthExceeded as exc:
        overflow = exc
    head = 0
    while head < len(messages) and messages[head]["role"] in ("system", "developer"):
        head += 1
    cuts = [index for index in range(head + 1, len(messages)) if messages[index]["role"] == "user"]
    # The fewer turns left out, the longer the prompt: the first cut that fits, found by halving.
    low, high, found = 0, len(cuts) - 1, None
    while low <= high:
        middle = (low + high) // 2
        try:
            found = fitting(messages[:head] + messages[cuts[middle] :])
            high = middle - 1
        except ContextLengthExceeded as exc:
            overflow = exc
            low = middle + 1
    if found is None:
        raise overflow
    return found


def _prepare(*, entry: CatalogEntry, request: GenerationRequest, renderer: PromptRenderer) -> Generation:
    describe_tools = bool(request.tools) and request.tool_choice != "none"

    def fitting(messages: list[Message]) -> tuple[RenderedPrompt, int]:
        """The prompt of ``messages`` and the room it leaves for output; ``ContextLengthExceeded`` when none."""
        try:
            prompt = render_prompt(
                renderer=renderer,
                messages=messages,
                tools=request.tools,
                describe_tools=describe_tools,
                context_length=entry.context_length,
            )
        except TemplateError as exc:
            raise ChatTemplateRefused(str(exc)) from None
        asked = None if request.fit_output else request.max_output_tokens
        room = check_context(
            prompt_tokens=prompt.tokens,
            max_output=asked,
            context_length=entry.context_length,
            tools_in_prompt=describe_tools,
        )
        return prompt, room

    prompt, room = truncated(request.messages, fitting) if request.truncate else fitting(request.messages)
    max_tokens = min(request.max_output_tokens or entry.max_output_tokens, entry.max_output_tokens, room)
    plan = plan_decoding(
        tools=request.tools,
        tool_choice=request.tool_choice,
        parallel_tool_calls=request.parallel_tool_calls,
        reasoning=request.reasoning,
        response_format=request.response_format,
        json_schema=request.json_schema,
    )
    enforced = plan.enforced_schemas()
    for tool, schema in enforced:
        if problem := renderer.schema_problem(schema):
            raise SchemaNotEnforceable(model_id=entry.public_id, tool=tool, problem=problem)
    compiled = plan.constraint.schema if plan.constraint is not None else None
    # Tool calls are decoded under one grammar that holds every enforced tool's schema: it must fit too.
    wraps_tools = compiled is not None and all(schema is not compiled for _, schema in enforced)
    if wraps_tools and compiled is not None and (problem := renderer.schema_problem(compiled)):
        only = enforced[0][0] if len(enforced) == 1 else None
        raise SchemaNotEnforceable(model_id=entry.public_id, tool=only, problem=problem, all_tools=only is None)
    if request.logprobs and request.top_logprobs > renderer.max_top_logprobs:
        raise TooManyTopLogprobs(model_id=entry.public_id, most=renderer.max_top_logprobs)
    if not renderer.penalties:
        for parameter in ("frequency_penalty", "presence_penalty"):
            if getattr(request, parameter):
                raise PenaltyNotApplied(model_id=entry.public_id, parameter=parameter)
    job = GenerationJob(
        job_id=secrets.token_hex(12),
        model_id=entry.public_id,
        runner=entry.runner,
        runner_settings=dict(entry.runner_settings),
        prompt=prompt.text,
        prompt_tokens=prompt.tokens,
        literal=prompt.literal,
        sampling=Sampling(
            max_tokens=max_tokens,
            temperature=_or_default(request.temperature, entry, "temperature", 1.0),
            top_p=_or_default(request.top_p, entry, "top_p", 1.0),
            seed=request.seed,
            # Output that must be one whole JSON value (a schema, a JSON object, a forced call) ends where its
            # grammar ends it: a stop sequence would cut it into something that does not parse.
            stop=request.stop if plan.constraint is None or plan.constraint.free_text else (),
            frequency_penalty=_or_default(request.frequency_penalty, entry, "frequency_penalty", 0.0),
            presence_penalty=_or_default(request.presence_penalty, entry, "presence_penalty", 0.0),
            logprobs=request.logprobs,
            top_logprobs=request.top_logprobs,
        ),
        constraint=plan.constraint,
    )
    return Generation(entry=entry, job=job, plan=plan)


def _or_default(asked: float | None, entry: CatalogEntry, name: str, openai_default: float) -> float:
    """What the request asked; else the catalog entry's default for the model; else OpenAI's."""
    if asked is not None:
        return asked
    return float(entry.sampling_defaults.get(name, openai_default))
