"""The GPU runner, on TensorRT-LLM's ``LLM`` API (PyTorch backend).

One ``LLM`` per process and settings serves every job: the engine batches requests in flight, so
worker threads submit concurrently to the same object. ``LLM.generate_async`` results can only be
iterated asynchronously when they were created inside a running event loop (the library picks its
queue type at creation), so each engine owns one asyncio loop in a background thread; each job's
request is created and iterated there, and its outputs are handed to the worker thread through a
thread-safe queue. The worker thread polls ``cancelled`` while it waits and calls ``abort()``.

``tensorrt_llm`` (GPU-only, several GB) and ``transformers`` are imported only when a runner or a
renderer is built, so the API process and CPU-only machines import this module freely.

API surface used, as read in NVIDIA/TensorRT-LLM: ``tensorrt_llm/llmapi/llm.py``,
``tensorrt_llm/sampling_params.py``, ``tensorrt_llm/executor/result.py``,
``tensorrt_llm/llmapi/tokenizer.py``, ``tensorrt_llm/serve/openai_server.py``,
``tensorrt_llm/serve/openai_protocol.py`` (how trtllm-serve builds ``SamplingParams`` for chat) and
``docs/source/features/guided-decoding.md`` (structural tags for tool calls).
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from .base import (
    TOOL_CLOSE,
    TOOL_OPEN,
    Constraint,
    Finished,
    FinishReason,
    GenerationJob,
    PromptRenderer,
    RawEvent,
    RunnerError,
    TextChunk,
    TokenLogprob,
)

logger = logging.getLogger(__name__)

# How long the worker thread waits on the engine before looking at ``cancelled`` again.
POLL_SECONDS: Final = 0.05
# After ``abort()`` the engine still sends a final output with the token count; how long to wait for it.
CANCEL_GRACE_SECONDS: Final = 2.0

# Settings that are the platform's, not ``LLM()`` keyword arguments.
_NOT_LLM_ARGS: Final = frozenset({"model", "kv_cache_free_gpu_memory_fraction", "chat_template"})

# A request that outlives its own deadline in the engine is cut short, like one that hit max_tokens:
# the client gets a truncated answer either way, and "length" is the reason that tells it so.
_FINISH_REASONS: Final[dict[str, FinishReason]] = {
    "stop": "stop",
    "length": "length",
    "timeout": "length",
    "cancelled": "cancelled",
}

# trtllm-serve's floor for a logprob, so that JSON never has to carry -inf.
_MIN_LOGPROB: Final = -9999.0


@dataclass(frozen=True, slots=True)
class _API:
    """The few names this runner takes from ``tensorrt_llm``, imported once."""

    LLM: Any
    SamplingParams: Any
    GuidedDecodingParams: Any
    KvCacheConfig: Any
    RequestError: type[BaseException]


def _import_api() -> _API:
    try:
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheConfig, RequestError
    except ImportError as exc:
        raise RunnerError(
            f"TensorRT-LLM is not available here ({exc}); it needs an NVIDIA GPU and the 'gpu' extra.",
            code="runner_unavailable",
        ) from exc
    return _API(LLM, SamplingParams, GuidedDecodingParams, KvCacheConfig, RequestError)


# -- events from the engine's loop to the worker thread ----------------------------------------------


@dataclass(frozen=True, slots=True)
class _Started:
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class _Step:
    """What one streamed output said, copied in the loop thread: the library mutates it in place."""

    text: str
    new_tokens: int
    total_tokens: int
    logprobs: tuple[TokenLogprob, ...]
    finish_reason: str | None
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException
    code: str
    # The engine itself is broken (not just this request): drop it so the next job builds a new one.
    fatal: bool = False


@dataclass(frozen=True, slots=True)
class _Ended:
    pass


_END: Final = _Ended()

_Event = _Started | _Step | _Failed | _Ended


class _Request:
    """One job's request on an engine; ``abort`` and ``events`` are for the worker thread."""

    def __init__(self, engine: _Engine) -> None:
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self.ended = False
        self._engine = engine
        # Touched only in the loop thread.
        self._output: Any = None
        self._abort_requested = False

    def abort(self) -> None:
        try:
            self._engine.loop.call_soon_threadsafe(self._abort_in_loop)
        except RuntimeError:  # the loop is closed: the engine, and with it the request, is gone
            pass

    def _abort_in_loop(self) -> None:
        self._abort_requested = True
        output = self._output
        if output is not None and not output.finished:
            try:
                output.abort()
            except Exception:
                logger.exception("TensorRT-LLM abort() failed")


class _Engine:
    """An ``LLM`` and the event loop its requests live on."""

    def __init__(self, llm: Any, api: _API) -> None:
        self.llm = llm
        self.api = api
        self.loop = asyncio.new_event_loop()
        self._active: set[_Request] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run_loop, name="tensorrt-llm-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, prompt: str, params: Any, top_logprobs: int | None) -> _Request:
        request = _Request(self)
        with self._lock:
            self._active.add(request)
        asyncio.run_coroutine_threadsafe(self._drive(request, prompt, params, top_logprobs), self.loop)
        return request

    def forget(self, request: _Request) -> None:
        with self._lock:
            self._active.discard(request)

    async def _drive(self, request: _Request, prompt: str, params: Any, top_logprobs: int | None) -> None:
        try:
            output = self.llm.generate_async(prompt, params, streaming=True)
        except (ValueError, TypeError) as exc:  # the library's checks on the request itself
            request.events.put(_Failed(exc, _refusal_code(exc)))
            return
        except Exception as exc:  # noqa: BLE001  (e.g. "LLM is shutting down": the engine is gone)
            request.events.put(_Failed(exc, "runner_unavailable", fatal=True))
            return
        request._output = output
        request.events.put(_Started(len(output.prompt_token_ids)))
        if request._abort_requested:
            request._abort_in_loop()
        try:
            async for step in output:
                request.events.put(self._snapshot(step, top_logprobs))
        except self.api.RequestError as exc:
            request.events.put(_Failed(exc, "generation_failed"))
        except Exception as exc:  # noqa: BLE001  (a background error: the library shut the executor down)
            request.events.put(_Failed(exc, "generation_failed", fatal=True))
        else:
            request.events.put(_END)

    def _snapshot(self, step: Any, top_logprobs: int | None) -> _Step:
        completion = step.outputs[0]
        new_ids = list(completion.token_ids_diff)
        logprobs: tuple[TokenLogprob, ...] = ()
        if top_logprobs is not None:
            logprobs = _token_logprobs(self.llm.tokenizer, new_ids, list(completion.logprobs_diff), top_logprobs)
        return _Step(
            text=completion.text,
            new_tokens=len(new_ids),
            total_tokens=len(completion.token_ids),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            cached_tokens=int(getattr(step, "cached_tokens", 0) or 0),
        )

    def close(self) -> None:
        with self._lock:
            stranded = list(self._active)
            self._active.clear()
        # Their coroutines stop with the loop; tell the waiting worker threads rather than leave them hanging.
        for request in stranded:
            request.events.put(_Failed(RuntimeError("the TensorRT-LLM engine was shut down"), "runner_unavailable"))
        try:
            self.llm.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
            if not self._thread.is_alive():
                self.loop.close()


def _refusal_code(exc: BaseException) -> str:
    # generate_async checks the prompt against max_num_tokens / max_seq_len before anything runs.
    message = str(exc)
    return "context_length_exceeded" if "max_num_tokens" in message or "max_seq_len" in message else "generation_failed"


def _token_logprobs(
    tokenizer: Any, token_ids: list[int], entries: list[Any], top_logprobs: int
) -> tuple[TokenLogprob, ...]:
    """Per-token logprobs as trtllm-serve reports them (``serve/postprocess_handlers.py``)."""
    result: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = tokenizer.decode([token_id])
        if isinstance(entry, dict):  # PyTorch backend: {token_id: Logprob(logprob, rank)}, top-k plus the sampled one
            chosen = entry.get(token_id)
            logprob = max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else _MIN_LOGPROB
            ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))
            top = tuple((tokenizer.decode([tid]), max(lp.logprob, _MIN_LOGPROB)) for tid, lp in ranked[:top_logprobs])
        else:  # TensorRT backend without gathered logits: one float per token, no alternatives
            logprob, top = max(float(entry), _MIN_LOGPROB), ()
        result.append(TokenLogprob(token=token, logprob=logprob, top=top))
    return tuple(result)


# -- one engine per process and settings -------------------------------------------------------------

_ENGINES: dict[str, _Engine] = {}
_ENGINES_LOCK = threading.Lock()


def _engine_key(settings: Mapping[str, Any]) -> str:
    llm_settings = {k: v for k, v in settings.items() if k != "chat_template"}
    return json.dumps(llm_settings, sort_keys=True, default=str)


def _llm_kwargs(settings: Mapping[str, Any], api: _API) -> dict[str, Any]:
    model = settings.get("model")
    if not isinstance(model, str) or not model:
        raise RunnerError(
            "tensorrt_llm settings need 'model': the path of a Hugging Face model directory.",
            code="runner_unavailable",
        )
    kwargs = {k: v for k, v in settings.items() if k not in _NOT_LLM_ARGS}
    # Without a backend, guided decoding (structured output, strict tools) has nothing to enforce it.
    kwargs.setdefault("guided_decoding_backend", "xgrammar")
    fraction = settings.get("kv_cache_free_gpu_memory_fraction")
    kv_cache = kwargs.pop("kv_cache_config", None)
    if fraction is not None or isinstance(kv_cache, dict):
        kv_cache = dict(kv_cache or {})
        if fraction is not None:
            kv_cache["free_gpu_memory_fraction"] = fraction
        kv_cache = api.KvCacheConfig(**kv_cache)
    if kv_cache is not None:
        kwargs["kv_cache_config"] = kv_cache
    return {"model": model, **kwargs}


def _engine_for(settings: Mapping[str, Any], api: _API) -> _Engine:
    key = _engine_key(settings)
    with _ENGINES_LOCK:
        engine = _ENGINES.get(key)
        if engine is None:
            try:
                llm = api.LLM(**_llm_kwargs(settings, api))
            except RunnerError:
                raise
            except (ValueError, TypeError) as exc:  # unknown or invalid LLM() arguments
                raise RunnerError(f"invalid tensorrt_llm settings: {exc}", code="runner_unavailable") from exc
            except Exception as exc:
                raise RunnerError(f"TensorRT-LLM could not load the model: {exc}", code="runner_unavailable") from exc
            engine = _ENGINES[key] = _Engine(llm, api)
        return engine


def _discard(engine: _Engine) -> None:
    with _ENGINES_LOCK:
        keys = [key for key, known in _ENGINES.items() if known is engine]
        for key in keys:
            del _ENGINES[key]
    if not keys:  # another job that saw the same failure got here first
        return
    try:
        engine.close()
    except Exception:
        logger.exception("Closing a failed TensorRT-LLM engine failed")


def shutdown_all() -> None:
    """Shut every engine of this process down (worker shutdown, tests)."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
    for engine in engines:
        engine.close()


# -- the runner --------------------------------------------------------------------------------------


def _tool_calls_tag(call_schema: dict[str, Any]) -> str:
    """An xgrammar structural tag: free text, in which every ``<tool_call>`` block holds a valid call.

    The form is the one TensorRT-LLM documents for tool calls (``docs/source/features/guided-decoding.md``):
    text is unconstrained until the trigger appears, then the tag's JSON schema and end are enforced,
    and free text may follow, so one or several calls fit.
    """
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [TOOL_OPEN],
            "tags": [
                {
                    "type": "tag",
                    "begin": TOOL_OPEN + "\n",
                    "content": {"type": "json_schema", "json_schema": call_schema},
                    "end": "\n" + TOOL_CLOSE,
                }
            ],
        },
    }
    return json.dumps(tag)


def _guide(constraint: Constraint | None, api: _API) -> Any:
    if constraint is None:
        return None
    if constraint.kind == "json_object":
        return api.GuidedDecodingParams(json_object=True)
    if constraint.schema is None:
        raise RunnerError(f"a {constraint.kind} constraint came without its schema", code="generation_failed")
    if constraint.kind == "tool_calls":
        return api.GuidedDecodingParams(structural_tag=_tool_calls_tag(constraint.schema))
    return api.GuidedDecodingParams(json=constraint.schema)


def _sampling_params(job: GenerationJob, api: _API) -> Any:
    sampling = job.sampling
    kwargs: dict[str, Any] = {
        # SamplingParams defaults max_tokens to 32: never leave it to the default.
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": sampling.seed,
        "stop": list(sampling.stop) or None,
        "frequency_penalty": sampling.frequency_penalty,
        "presence_penalty": sampling.presence_penalty,
        # The prompt is a rendered chat template, which places BOS itself (trtllm-serve's chat default);
        # the renderer counted the prompt's tokens the same way.
        "add_special_tokens": False,
    }
    if sampling.logprobs:
        kwargs["logprobs"] = max(1, sampling.top_logprobs)
    guide = _guide(job.constraint, api)
    if guide is not None:
        kwargs["guided_decoding"] = guide
    try:
        return api.SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RunnerError(f"TensorRT-LLM rejected the sampling parameters: {exc}", code="generation_failed") from exc


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """How many trailing characters could still become a stop sequence, and so must not be sent yet.

    The library finds stop strings in the detokenized text and cuts them out, but only once complete:
    the part of one that arrived in earlier steps has already gone out in ``text_diff``.
    """
    held = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:size]):
                held = size
                break
    return held


class TensorRTLLMRunner:
    def __init__(self, settings: Mapping[str, Any] | None = None) -> None:
        self._api = _import_api()
        if settings is not None:  # load the model now, not on the first job
            _engine_for(settings, self._api)

    # A generator, so that a consumer that stops reading early (close()) still aborts the request.
    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Generator[RawEvent, None, None]:
        engine = _engine_for(job.runner_settings, self._api)
        params = _sampling_params(job, self._api)
        request = engine.submit(job.prompt, params, job.sampling.top_logprobs if job.sampling.logprobs else None)
        stops = job.sampling.stop
        prompt_tokens = job.prompt_tokens
        last: _Step | None = None
        sent = 0  # characters of the output text already yielded
        owed_tokens = 0  # tokens whose text is held back or not yet detokenized
        owed_logprobs: list[TokenLogprob] = []
        cancel_deadline: float | None = None
        try:
            while True:
                if cancel_deadline is None and cancelled():
                    request.abort()
                    cancel_deadline = time.monotonic() + CANCEL_GRACE_SECONDS
                wait = POLL_SECONDS
                if cancel_deadline is not None:
                    wait = max(0.0, min(POLL_SECONDS, cancel_deadline - time.monotonic()))
                try:
                    event = request.events.get(timeout=wait)
                except queue.Empty:
                    if cancel_deadline is not None and time.monotonic() >= cancel_deadline:
                        break
                    continue
                if isinstance(event, _Started):
                    prompt_tokens = event.prompt_tokens
                elif isinstance(event, _Failed):
                    request.ended = True
                    if cancel_deadline is not None:  # the client is gone; how the request died is moot
                        break
                    if event.fatal:
                        _discard(engine)
                    raise RunnerError(f"TensorRT-LLM: {event.error}", code=event.code) from event.error
                elif isinstance(event, _Ended):
                    request.ended = True
                    break
                else:
                    last = event
                    if cancel_deadline is not None:
                        continue
                    owed_tokens += event.new_tokens
                    owed_logprobs.extend(event.logprobs)
                    ready = len(event.text) - _held_back(event.text, stops)
                    if ready > sent:
                        yield TextChunk(text=event.text[sent:ready], tokens=owed_tokens, logprobs=tuple(owed_logprobs))
                        sent, owed_tokens, owed_logprobs = ready, 0, []

            if cancel_deadline is not None:
                reason: FinishReason = "cancelled"
            else:
                # The final text is settled (stop strings already cut): send what was held back.
                if last is not None and len(last.text) > sent:
                    yield TextChunk(text=last.text[sent:], tokens=owed_tokens, logprobs=tuple(owed_logprobs))
                reason = _FINISH_REASONS.get(last.finish_reason or "stop", "stop") if last else "stop"
            yield Finished(
                reason=reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=last.total_tokens if last else 0,
                cached_tokens=last.cached_tokens if last else 0,
            )
        finally:
            if not request.ended:  # cancelled, or the consumer stopped reading: free the engine's slot
                request.abort()
            engine.forget(request)


def load(settings: dict[str, Any]) -> TensorRTLLMRunner:
    return TensorRTLLMRunner(settings)


# -- prompt rendering, in the API process ------------------------------------------------------------


def _hf_tokenizer(source: str, trust_remote_code: bool) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RunnerError(
            "rendering prompts for tensorrt_llm models needs transformers (the 'gpu' extra)", code="runner_unavailable"
        ) from exc
    try:
        # local_files_only: a serving process never downloads; the model directory must be there.
        return AutoTokenizer.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise RunnerError(f"cannot load the tokenizer from {source!r}: {exc}", code="runner_unavailable") from exc


def _knows_tools(template: Any) -> bool:
    """Whether a chat template (a string, or Hugging Face's named templates) renders tool definitions."""
    if isinstance(template, str):
        sources = [template]
    elif isinstance(template, dict):
        sources = [t for t in template.values() if isinstance(t, str)]
    elif isinstance(template, list):  # the older serialized form: [{"name": ..., "template": ...}]
        sources = [t.get("template", "") for t in template if isinstance(t, dict)]
    else:
        sources = []
    return any(re.search(r"\btools\b", source) for source in sources)


def renderer(settings: dict[str, Any]) -> PromptRenderer:
    source = settings.get("tokenizer") or settings.get("model")
    if not source:
        raise RunnerError(
            "tensorrt_llm settings need 'model' (or 'tokenizer') to render prompts", code="runner_unavailable"
        )
    tokenizer = _hf_tokenizer(str(source), bool(settings.get("trust_remote_code", False)))
    override: str | None = settings.get("chat_template")
    template = override if override is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise RunnerError(
            f"the tokenizer at {source!r} has no chat template; set 'chat_template'", code="runner_unavailable"
        )
    extra: dict[str, Any] = {"chat_template": override} if override is not None else {}

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True, **extra)
        return str(text)

    def count_tokens(text: str) -> int:
        # As the runner tokenizes the prompt: the template placed the special tokens already.
        return len(tokenizer.encode(text, add_special_tokens=False))

    return PromptRenderer(render=render, count_tokens=count_tokens, native_tools=_knows_tools(template))
