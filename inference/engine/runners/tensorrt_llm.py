"""The GPU runner, on TensorRT-LLM's ``LLM`` API (PyTorch backend).

One ``LLM`` per process and settings serves every job: the engine batches requests in flight, so
worker threads submit concurrently to the same object. ``LLM.generate_async`` results can only be
iterated asynchronously when they were created inside a running event loop (the library picks its
queue type at creation), so each engine owns one asyncio loop in a background thread; each job's
request is created and iterated there, and its outputs are handed to the worker thread through a
thread-safe queue. The worker thread polls ``cancelled`` while it waits and calls ``abort()``.

``tensorrt_llm`` (GPU-only, several GB) and ``transformers`` are imported only when a runner or a
renderer is built, so the API process and CPU-only machines import this module freely.

The engine is built when the worker process starts (``inference.tasks``), not by the first job.

API surface used, as read in NVIDIA/TensorRT-LLM: ``tensorrt_llm/llmapi/llm.py``,
``tensorrt_llm/sampling_params.py``, ``tensorrt_llm/executor/result.py``,
``tensorrt_llm/executor/base_worker.py``, ``tensorrt_llm/executor/executor.py``, ``tensorrt_llm/llmapi/tokenizer.py``,
``tensorrt_llm/_torch/pyexecutor/py_executor.py``, ``grammar_matcher.py`` and ``sampler.py`` (seeds, the end token),
``tensorrt_llm/serve/openai_server.py``, ``tensorrt_llm/serve/openai_protocol.py`` (how trtllm-serve
builds ``SamplingParams`` for chat) and ``docs/source/features/guided-decoding.md`` (structural tags).
Guides are compiled with xgrammar, the library TensorRT-LLM's guided decoder uses, before anything is
queued: in the API process (``schema_problem``) and again in the worker.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from pathlib import Path
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
    Sampling,
    TextChunk,
    TokenLogprob,
    keyword_problem,
    prompt_pieces,
    subschemas,
)
from .grammar import grammar_for
from .schema_ends import endless_problem

logger = logging.getLogger(__name__)

# How long the worker thread waits on the engine before looking at ``cancelled`` again.
POLL_SECONDS: Final = 0.05
# After ``abort()`` an active request still gets a final output with its token count; how long to
# wait for it. A request still in the engine's waiting queue gets none at all (see ``stream``).
CANCEL_GRACE_SECONDS: Final = 2.0

# The oldest release known to take structural tags in the {"type": "structural_tag", "format": {...}}
# form the runner sends: with xgrammar 0.1.25 TensorRT-LLM hands the tag string to
# ``compile_structural_tag`` as it is (``_torch/pyexecutor/grammar_matcher.py``; its change "Support
# new structural tag API"), and release 1.2 ships xgrammar 0.1.25. 1.0 parsed the older
# {"structures": [...], "triggers": [...]} form itself, which xgrammar 0.1.25 and later refuse
# ("Structural tag must have a format field").
MIN_VERSION: Final = (1, 2)

# The guided decoder the runner's guides are written and checked for.
GUIDED_DECODING_BACKEND: Final = "xgrammar"

# OpenAI's own maximum for top_logprobs, and so the default for an entry that sets none.
MAX_TOP_LOGPROBS: Final = 20

# Settings that are the platform's, not ``LLM()`` keyword arguments.
_NOT_LLM_ARGS: Final = frozenset({"model", "kv_cache_free_gpu_memory_fraction", "chat_template", "max_top_logprobs"})

# A request that outlives its own deadline in the engine is cut short, like one that hit max_tokens:
# the client gets a truncated answer either way, and "length" is the reason that tells it so.
_FINISH_REASONS: Final[dict[str, FinishReason]] = {
    "stop": "stop",
    "length": "length",
    "timeout": "length",
    "cancelled": "cancelled",
}

# The sampler that applies frequency and presence penalties: TensorRT-LLM 1.2's default, the TorchSampler, takes
# only temperature, top-p and top-k from a request (``_torch/pyexecutor/sampler.py``, ``_request_get_sampling_params``)
# and ignores the penalties ``SamplingParams`` accepts; the C++ sampler applies them.
PENALTY_SAMPLER: Final = "TRTLLMSampler"

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
        import tensorrt_llm
        from tensorrt_llm import LLM, SamplingParams
        from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheConfig, RequestError
    except (ImportError, OSError, RuntimeError) as exc:  # missing; its C++ or CUDA libraries failing to load
        raise RunnerError(
            f"TensorRT-LLM is not available here ({exc}); it needs an NVIDIA GPU and the 'gpu' extra.",
            code="runner_unavailable",
        ) from exc
    version = str(getattr(tensorrt_llm, "__version__", "0"))
    if _release(version) < MIN_VERSION:
        raise RunnerError(
            f"TensorRT-LLM {version} is installed; this runner needs {MIN_VERSION[0]}.{MIN_VERSION[1]} or later "
            "(its guided decoder takes structural tags in the form the runner sends). Install the 'gpu' extra.",
            code="runner_unavailable",
        )
    return _API(LLM, SamplingParams, GuidedDecodingParams, KvCacheConfig, RequestError)


def _release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


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
    """One job's request on an engine; ``abort``, ``stop`` and ``events`` are for the worker thread."""

    def __init__(self, engine: _Engine) -> None:
        self.events: queue.SimpleQueue[_Event] = queue.SimpleQueue()
        self.ended = False
        self._engine = engine
        # Touched only in the loop thread.
        self._driver: asyncio.Task[None] | None = None
        self._stopped = False
        self._output: Any = None
        self._abort_requested = False

    def abort(self) -> None:
        try:
            self._engine.loop.call_soon_threadsafe(self._abort_in_loop)
        except RuntimeError:  # the loop is closed: the engine, and with it the request, is gone
            pass

    def stop(self) -> None:
        """Stop reading the request's outputs: the coroutine would otherwise wait for a final one forever."""
        try:
            self._engine.loop.call_soon_threadsafe(self._stop_in_loop)
        except RuntimeError:  # the loop is closed: nothing reads the request any more
            pass

    def _stop_in_loop(self) -> None:
        self._stopped = True
        if self._driver is not None:
            self._driver.cancel()

    def _start_in_loop(self, drive: Callable[[], Coroutine[Any, Any, None]]) -> None:
        # The coroutine is made here, in the loop, only for a request still wanted: one made in the worker's thread
        # and stopped before the loop took it up would never be awaited.
        if not self._stopped:
            self._driver = self._engine.loop.create_task(drive())

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

    def __init__(self, llm: Any, api: _API, *, max_seq_len: int | None, end_ids: tuple[int, ...] = ()) -> None:
        self.llm = llm
        self.api = api
        # The model's end tokens other than its tokenizer's, which ``SamplingParams._setup`` takes as the end id and
        # the engine stops on: sent with every request as stop token ids.
        self.end_ids = end_ids
        # The PyTorch backend checks a prompt against max_seq_len only as it enqueues it: base_worker.py's
        # _deduce_max_tokens shortens max_tokens to the room left, without a word, and refuses (RequestError)
        # only a prompt that leaves no room at all; llm.py's _check_arguments checks only max_num_tokens.
        # So the runner checks the prompt and max_tokens together before submitting.
        self.max_seq_len = max_seq_len
        self.loop = asyncio.new_event_loop()
        self._active: set[_Request] = set()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run_loop, name="tensorrt-llm-loop", daemon=True)
        self._thread.start()

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, job: GenerationJob, params: Any, top_logprobs: int | None) -> _Request:
        request = _Request(self)
        with self._lock:
            self._active.add(request)
        self.loop.call_soon_threadsafe(request._start_in_loop, lambda: self._drive(request, job, params, top_logprobs))
        return request

    def forget(self, request: _Request) -> None:
        with self._lock:
            self._active.discard(request)

    async def _drive(self, request: _Request, job: GenerationJob, params: Any, top_logprobs: int | None) -> None:
        if request._abort_requested:  # cancelled before it reached the engine
            return
        try:
            # Tokenized here, on the loop's thread like the library's own calls, and submitted as ids:
            # the prompt is counted once, exactly, and checked before anything is queued.
            prompt_ids = encode_prompt(self.llm.tokenizer, job.prompt, job.literal)
        except Exception as exc:  # noqa: BLE001  (a tokenizer failure is this request's)
            request.events.put(_Failed(exc, "generation_failed"))
            return
        if not prompt_ids:
            # The executor reads the first id before anything else (executor.py, generate_async:
            # ``assert isinstance(prompt_token_ids[0], int)``): an IndexError that would pass for a broken engine.
            request.events.put(_Failed(ValueError("the prompt has no tokens"), "generation_failed"))
            return
        if self.max_seq_len is not None and len(prompt_ids) + params.max_tokens > self.max_seq_len:
            request.events.put(
                _Failed(
                    ValueError(
                        f"the prompt ({len(prompt_ids)} tokens) and max_tokens ({params.max_tokens}) exceed "
                        f"the engine's max_seq_len ({self.max_seq_len})"
                    ),
                    "context_length_exceeded",
                )
            )
            return
        try:
            output = self.llm.generate_async(prompt_ids, params, streaming=True)
        except Exception as exc:  # noqa: BLE001
            # Whatever was raised, the engine is gone only when the library says so: "LLM is shutting down", or an
            # error of the executor's own threads, which the proxy's submit raises once it has shut the executor
            # down (proxy.py, _handle_background_error), of any type. Otherwise this request alone failed: the
            # library's checks on it (max_num_tokens raises RequestError in later releases, ValueError before), or
            # anything else that went wrong with it.
            if _engine_down(self.llm):
                request.events.put(_Failed(exc, "runner_unavailable", fatal=True))
            elif isinstance(exc, ValueError | TypeError | self.api.RequestError):
                request.events.put(_Failed(exc, _refusal_code(exc)))
            else:
                request.events.put(_Failed(exc, "generation_failed"))
            return
        request._output = output
        request.events.put(_Started(len(output.prompt_token_ids)))
        if request._abort_requested:
            request._abort_in_loop()
        try:
            async for step in output:
                request.events.put(self._snapshot(step, top_logprobs, job.sampling.stop, params.end_id))
        except self.api.RequestError as exc:
            request.events.put(_Failed(exc, _refusal_code(exc)))
        except Exception as exc:  # noqa: BLE001
            # An error the executor's own threads failed with reaches a result once the library has shut the executor
            # down (executor.py, _handle_background_error); one raised as this result read its own response
            # (result.py, _handle_sequence: "Unknown finish reason", its logprobs' length) leaves it serving the others.
            fatal = _engine_down(self.llm)
            if not fatal:
                request._abort_in_loop()  # the engine may still be writing what nobody reads
            request.events.put(_Failed(exc, "generation_failed", fatal=fatal))
        else:
            request.events.put(_END)

    def _snapshot(self, step: Any, top_logprobs: int | None, stops: tuple[str, ...], end_id: int | None) -> _Step:
        completion = step.outputs[0]
        token_ids = list(completion.token_ids)
        new_ids = list(completion.token_ids_diff)
        entries = list(completion.logprobs_diff) if top_logprobs is not None else []
        if _ended_by_end_token(step, completion, token_ids, end_id):
            # The PyTorch backend's sampler adds the end-of-sequence token to the output before it ends
            # the request (sampler.py, TorchSampler.update_requests: add_token, then finish_if_reason);
            # the C++ sampler never counts it. It is no part of the answer, whose text already leaves it
            # out (skip_special_tokens): usage and logprobs leave it out too, as the llama.cpp runner's do.
            token_ids.pop()
            if new_ids:
                new_ids.pop()
                entries = entries[: len(new_ids)]
        logprobs: tuple[TokenLogprob, ...] = ()
        if top_logprobs is not None:
            logprobs = _token_logprobs(self.llm.tokenizer, new_ids, entries, top_logprobs)
        return _Step(
            text=_before_first_stop(self._settled_text(step, completion), stops),
            new_tokens=len(new_ids),
            total_tokens=len(token_ids),
            logprobs=logprobs,
            finish_reason=completion.finish_reason,
            cached_tokens=int(getattr(step, "cached_tokens", 0) or 0),
        )

    def _settled_text(self, step: Any, completion: Any) -> str:
        """The output's text, less a stop string's beginning that the library left in it.

        When the runtime stops on a stop string's token ids it cuts those ids from ``token_ids``, but a
        streamed result detokenizes incrementally and never takes text back (``executor/result.py``
        ``_handle_sequence``; ``llmapi/tokenizer.py`` ``decode_incrementally``): the text of the stop
        string's first tokens, decoded in earlier steps, stays at the end of ``text``. The ids are
        then the truth. (A stop string found in the text instead is cut from the text itself.)
        """
        text = str(completion.text)
        if not (step.finished and completion.finish_reason == "stop" and isinstance(completion.stop_reason, str)):
            return text
        decoded = str(self.llm.tokenizer.decode(list(completion.token_ids), skip_special_tokens=True))
        return decoded if text.startswith(decoded) else text

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


def _ended_by_end_token(step: Any, completion: Any, token_ids: list[int], end_id: int | None) -> bool:
    """Whether the request stopped at the end-of-sequence token and its ids end with it.

    A stop on a stop string or a stop token id names it in ``stop_reason``; the end id (``END_ID``) leaves
    ``stop_reason`` None (``executor/result.py``, ``_handle_sequence``).
    """
    return bool(
        step.finished
        and completion.finish_reason == "stop"
        and completion.stop_reason is None
        and token_ids
        and token_ids[-1] == end_id
    )


def _engine_down(llm: Any) -> bool:
    """Whether the library has shut the engine down: its own test before it takes a request (llm.py, generate_async:
    "LLM is shutting down"). An engine that cannot say is taken for down."""
    try:
        executor = llm._executor
        return executor is None or bool(executor.is_shutdown())
    except Exception:  # noqa: BLE001  (a release without them)
        return True


# How the library refuses a prompt with no room for its answer: longer than max_num_tokens (llm.py _check_arguments),
# or leaving nothing under max_seq_len (base_worker.py _deduce_max_tokens in later 1.2 releases; in earlier ones the
# runtime's check of the request it builds with what is left, Request::validate).
_NO_ROOM: Final = ("max_num_tokens", "max_seq_len", "mMaxNewTokens > 0")


def _refusal_code(exc: BaseException) -> str:
    message = str(exc)
    return "context_length_exceeded" if any(words in message for words in _NO_ROOM) else "generation_failed"


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character (``bytes_to_unicode`` in
    ``transformers``' GPT-2 tokenizer): printable Latin-1 bytes as themselves, the others from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + n): b for n, b in enumerate(moved)}


_BYTE_LEVEL: Final = _byte_level_alphabet()
_BYTE_FALLBACK: Final = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's spelling of a byte


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's bytes. Decoding a piece of a character gives U+FFFD, so its bytes are read from the way the
    vocabulary spells it: a SentencePiece byte-fallback token (``<0xF0>``) or a byte-level BPE token."""
    text = str(tokenizer.decode([token_id]))
    if "\ufffd" not in text:
        return text.encode()
    spelled = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(spelled, str):
        return text.encode()
    if byte := _BYTE_FALLBACK.fullmatch(spelled):
        return bytes([int(byte[1], 16)])
    if spelled and all(char in _BYTE_LEVEL for char in spelled):
        return bytes(_BYTE_LEVEL[char] for char in spelled)
    return text.encode()


def _token_logprobs(
    tokenizer: Any, token_ids: list[int], entries: list[Any], top_logprobs: int
) -> tuple[TokenLogprob, ...]:
    """Per-token logprobs as trtllm-serve reports them (``serve/postprocess_handlers.py``), with each token's
    bytes rather than its decoded text (which is U+FFFD for a piece of a character)."""
    result: list[TokenLogprob] = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = _token_bytes(tokenizer, token_id)
        if isinstance(entry, dict):  # PyTorch backend: {token_id: Logprob(logprob, rank)}, the top k
            chosen = entry.get(token_id)
            logprob = max(chosen.logprob, _MIN_LOGPROB) if chosen is not None else _MIN_LOGPROB
            ranked = sorted(entry.items(), key=lambda item: (item[1].rank is None, item[1].rank or 0))
            top = tuple(
                (_token_bytes(tokenizer, tid), max(lp.logprob, _MIN_LOGPROB)) for tid, lp in ranked[:top_logprobs]
            )
        else:  # the TensorRT engine backend's legacy format: one float per token, no alternatives
            logprob, top = max(float(entry), _MIN_LOGPROB), ()
        result.append(TokenLogprob(token=token, logprob=logprob, top=top))
    return tuple(result)


# -- one engine per process and settings -------------------------------------------------------------

_ENGINES: dict[str, _Engine] = {}
_ENGINES_LOCK = threading.Lock()
# How many open runners use each engine: entries that differ only in what the engine never sees (a chat template)
# share one, which is shut down when the last of them closes.
_HOLDERS: dict[str, int] = {}


def _engine_key(settings: Mapping[str, Any]) -> str:
    llm_settings = {k: v for k, v in settings.items() if k not in ("chat_template", "max_top_logprobs")}
    return json.dumps(llm_settings, sort_keys=True, default=str)


def _llm_kwargs(settings: Mapping[str, Any], api: _API) -> dict[str, Any]:
    model = settings.get("model")
    if not isinstance(model, str) or not model:
        raise RunnerError(
            "tensorrt_llm settings need 'model': the path of a Hugging Face model directory.",
            code="runner_unavailable",
        )
    kwargs = {k: v for k, v in settings.items() if k not in _NOT_LLM_ARGS}
    if (backend_name := kwargs.get("backend", "pytorch")) != "pytorch":
        # Any other value builds another backend (the TensorRT engine's, or AutoDeploy), with other checks, other
        # logprobs and no structural tags, which tool calls are decoded under.
        raise RunnerError(
            f"tensorrt_llm setting backend must be 'pytorch' (or left out), not {backend_name!r}: the runner is "
            "written for TensorRT-LLM's PyTorch backend",
            code="runner_unavailable",
        )
    # Without a backend, guided decoding (structured output, strict tools) has nothing to enforce it.
    # It must be xgrammar: the runner checks every guide with xgrammar before queueing it, and
    # llguidance takes no structural tags at all (grammar_matcher.py, LLGuidanceMatcherFactory.create:
    # "Unsupported guide type"), a failure the executor spreads to every request of the batch.
    backend = kwargs.setdefault("guided_decoding_backend", GUIDED_DECODING_BACKEND)
    if backend != GUIDED_DECODING_BACKEND:
        raise RunnerError(
            f"tensorrt_llm setting guided_decoding_backend must be {GUIDED_DECODING_BACKEND!r} (or left out), "
            f"not {backend!r}: the runner's guides (structural tags for tool calls) and its checks of them are "
            "xgrammar's",
            code="runner_unavailable",
        )
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
            max_seq_len = settings.get("max_seq_len") or getattr(getattr(llm, "args", None), "max_seq_len", None)
            if not max_seq_len:
                logger.warning(
                    "tensorrt_llm settings for %s set no max_seq_len: prompts are not checked against the engine's",
                    settings.get("model"),
                )
            engine = _ENGINES[key] = _Engine(
                llm,
                api,
                max_seq_len=int(max_seq_len) if max_seq_len else None,
                end_ids=_other_end_ids(settings.get("model"), getattr(llm.tokenizer, "eos_token_id", None)),
            )
        return engine


def _other_end_ids(model: Any, eos_token_id: int | None) -> tuple[int, ...]:
    """The end tokens the model's ``generation_config.json`` lists beside its tokenizer's (Gemma's
    ``<end_of_turn>``, Llama 3's ``<|eom_id|>``): without them as stop token ids, the engine writes on past the end
    of the turn. ``SamplingParams._setup`` reads the generation config only for Kimi K2's end id."""
    path = Path(model) / "generation_config.json" if isinstance(model, str) and model else None
    try:
        listed = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id") if path else None
    except (OSError, ValueError, AttributeError):
        return ()
    ids = listed if isinstance(listed, list) else [listed]
    return tuple(sorted({i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i != eos_token_id}))


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
    """Shut every engine of this process down, so that the next load builds a new one (the library shuts its
    engines down itself at exit)."""
    with _ENGINES_LOCK:
        engines = list(_ENGINES.values())
        _ENGINES.clear()
        _HOLDERS.clear()
    for engine in engines:
        engine.close()


# -- the runner --------------------------------------------------------------------------------------


def _tool_calls_tag(call_schema: dict[str, Any], text_schema: dict[str, Any] | None = None) -> str:
    """An xgrammar structural tag: free text, in which every ``<tool_call>`` block holds a valid call; with
    ``text_schema``, one such block or else one JSON value matching it (an answer in the format asked for).

    The form is the one TensorRT-LLM documents for tool calls (``docs/source/features/guided-decoding.md``):
    text is unconstrained until the trigger appears, then the tag's JSON schema and end are enforced,
    and free text may follow, so one or several calls fit. A schema with numeric bounds is enforced as its grammar
    (``_schema_format``), where this xgrammar compiles a structural tag holding one.
    """

    def tag(grammars: bool) -> str:
        content = _schema_format(call_schema, grammars)
        call = {"type": "tag", "begin": TOOL_OPEN + "\n", "content": content, "end": "\n" + TOOL_CLOSE}
        if text_schema is None:
            form: dict[str, Any] = {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": [call]}
        else:
            form = {"type": "or", "elements": [call, _schema_format(text_schema, grammars)]}
        return json.dumps({"type": "structural_tag", "format": form})

    # Compiled once per tag (cached), as the check before the job is queued compiles it anyway.
    with_grammars = tag(grammars=True)
    return with_grammars if _compile_problem("structural_tag", with_grammars) is None else tag(grammars=False)


def _schema_format(schema: dict[str, Any], grammars: bool) -> dict[str, Any]:
    """A structural tag's format for one JSON value matching ``schema``: the schema, or with ``grammars`` its grammar
    when it has numeric bounds or a pattern (``_exact_grammar``)."""
    if grammars and (grammar := _exact_grammar(json.dumps(schema))) is not None:
        return {"type": "grammar", "grammar": grammar}
    return {"type": "json_schema", "json_schema": schema}


def _xgrammar() -> Any:
    try:
        import xgrammar
    except ImportError as exc:
        raise RunnerError(
            f"checking output constraints for tensorrt_llm models needs xgrammar ({exc}); "
            "install the 'gpu-api' extra (API processes) or the 'gpu' extra (GPU workers)",
            code="runner_unavailable",
        ) from exc
    return xgrammar


# xgrammar's C++ errors start with a time and a source position: "[09:50:42] /project/cpp/x.cc:75: ".
_XGRAMMAR_PREFIX: Final = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


@functools.lru_cache(maxsize=1024)
def _compile_problem(kind: str, guide: str) -> str | None:
    """Why xgrammar cannot compile a guide (a JSON schema or a structural tag, as JSON), or None.

    TensorRT-LLM compiles each guide inside the executor loop (``grammar_matcher.py``:
    ``compile_json_schema`` / ``compile_structural_tag``) for the whole scheduled batch, with no guard
    around one request: a guide that fails there fails every active request (``py_executor.py``,
    ``_handle_errors``). The same conversion is run here first, so a bad guide is refused alone.
    The same tools come with every request of a conversation, hence the cache.
    """
    xgrammar = _xgrammar()
    try:
        if kind == "structural_tag":
            xgrammar.Grammar.from_structural_tag(guide)
        elif kind == "grammar":
            xgrammar.Grammar.from_ebnf(guide)
        else:
            xgrammar.Grammar.from_json_schema(guide)
    except Exception as exc:  # noqa: BLE001  (xgrammar raises RuntimeError, ValueError and its own errors)
        return _XGRAMMAR_PREFIX.sub("", str(exc).strip()) or type(exc).__name__
    return None


# The string formats xgrammar enforces: it compiles any other as a string of any text.
_XGRAMMAR_FORMATS: Final = frozenset(
    {
        "date",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "json-pointer",
        "relative-json-pointer",
        "time",
        "uri",
        "uri-reference",
        "uri-template",
        "uuid",
    }
)


# Keywords xgrammar compiles as nothing, so that output breaking them passes as valid (its grammar for each lets such
# output through: tests/inference/engine/runners/test_tensorrt_llm_runner.py); with them, "uniqueItems": true.
_XGRAMMAR_LEAVES_OUT: Final = (
    "multipleOf",
    "contains",
    "minContains",
    "maxContains",
    "dependentRequired",
    "dependentSchemas",
    "if",
)


def _xgrammar_problem(schema: Any) -> str | None:
    for node in subschemas(schema):
        for keyword in _XGRAMMAR_LEAVES_OUT:
            if keyword in node:
                return f"its {keyword!r} cannot be enforced by this model's guided decoding"
        if node.get("uniqueItems") is True:
            return "its 'uniqueItems' cannot be enforced by this model's guided decoding"
    return None


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why TensorRT-LLM's guided decoder (xgrammar) cannot enforce ``schema``, or None when it can. xgrammar compiles
    a ``not``, an unknown format, a ``multipleOf`` and the like as nothing, and a ``oneOf`` as an ``anyOf``: such
    schemas are refused first."""
    return (
        keyword_problem(schema, formats=_XGRAMMAR_FORMATS)
        or _xgrammar_problem(schema)
        or endless_problem(schema)
        or _compile_problem("json_schema", json.dumps(schema, sort_keys=True))
        or _pattern_problem(schema)
    )


def _pattern_problem(schema: dict[str, Any]) -> str | None:
    """Why a schema with a pattern cannot go as the grammar that holds a string's value to it (see ``_exact_grammar``);
    xgrammar's own conversion would let output through that is not JSON."""
    if not any("pattern" in node for node in subschemas(schema)) or _exact_grammar(json.dumps(schema)) is not None:
        return None
    try:
        grammar_for(Constraint(kind="json_schema", schema=schema))
    except Exception as exc:  # noqa: BLE001  (the converter raises what it trips on)
        return str(exc) if isinstance(exc, ValueError) else f"its pattern cannot be enforced ({type(exc).__name__})"
    return "its pattern cannot be enforced by this model's guided decoding"


def _constraint_problem(constraint: Constraint | None) -> str | None:
    if constraint is None or constraint.kind == "json_object" or constraint.schema is None:
        return None
    if constraint.kind == "tool_calls":
        for schema in (constraint.schema, constraint.text_schema):
            if schema is None:
                continue
            if problem := (
                keyword_problem(schema, formats=_XGRAMMAR_FORMATS)
                or _xgrammar_problem(schema)
                or endless_problem(schema)
                or _pattern_problem(schema)
            ):
                return problem
        return _compile_problem("structural_tag", _tool_calls_tag(constraint.schema, constraint.text_schema))
    return schema_problem(constraint.schema)


# xgrammar's JSON-schema conversion misjudges numeric bounds (0.1.34): a maximum of 150 admits 151 to 159, -180 to 180
# admits 181, a minimum of 5 alone admits 3, a number from 0 to 1 admits 1.5, and a minimum of -12 refuses -1. And it
# holds a string's JSON text to its pattern, not the string: a "." or a negated set admits a raw quote or tab (output
# that is not JSON), as does a range over the quote ([ -~]), and a quote or line feed the pattern asks for comes raw,
# unescaped.
_EXACT: Final = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "pattern")


@functools.lru_cache(maxsize=256)
def _exact_grammar(schema: str) -> str | None:
    """For a JSON schema (as JSON) with numeric bounds or a pattern, the grammar the CPU runner builds for it, which
    spells each bounded number out digit by digit and holds it exactly, and holds a string's value to its pattern
    with what JSON escapes escaped, for xgrammar to compile as EBNF (its dialect is llama.cpp's); None for a schema
    without either, or one that grammar cannot express (then xgrammar converts the schema itself; a schema with a
    pattern it cannot hold is refused first, ``_pattern_problem``). The same tools and formats come with every
    request of a conversation, hence the cache."""
    parsed = json.loads(schema)
    if not any(keyword in node for node in subschemas(parsed) for keyword in _EXACT):
        return None
    try:
        grammar = grammar_for(Constraint(kind="json_schema", schema=parsed))
    except Exception:  # noqa: BLE001  (too large for it, or a keyword it refuses: the converter raises what it trips on)
        return None
    return grammar if _compile_problem("grammar", grammar) is None else None


def _guide(constraint: Constraint | None, api: _API) -> Any:
    if constraint is None:
        return None
    if constraint.kind == "json_object":
        # Not json_object=True: with xgrammar that is GuideType.JSON, compiled as xgrammar's builtin JSON
        # grammar (grammar_matcher.py, compile_builtin_json_grammar), whose root is an object or an array.
        # This schema admits any object and nothing else, as the llama.cpp runner's grammar does.
        return api.GuidedDecodingParams(json={"type": "object"})
    if constraint.schema is None:
        raise RunnerError(f"a {constraint.kind} constraint came without its schema", code="generation_failed")
    if constraint.kind == "tool_calls":
        return api.GuidedDecodingParams(structural_tag=_tool_calls_tag(constraint.schema, constraint.text_schema))
    if (grammar := _exact_grammar(json.dumps(constraint.schema))) is not None:
        return api.GuidedDecodingParams(grammar=grammar)
    return api.GuidedDecodingParams(json=constraint.schema)


def _stop_token_ids(constraint: Constraint | None, end_ids: tuple[int, ...]) -> list[int] | None:
    """The turn's end tokens besides the tokenizer's end of sequence, as stops: cut from token_ids, named in
    stop_reason (executor/result.py, _handle_sequence), and special, so never in the text.

    Not where a guide holds the whole output (JSON, or a call or JSON): the guide ends it with the tokenizer's end of
    sequence, the only end xgrammar knows (``_xgrammar_tokenizer_info``), and reads the other end tokens as their
    text, which it admits inside a JSON string; stopping there would cut the JSON short. Free text beside calls
    (``triggered_tags``) keeps them, or the model would write on past the end of its turn."""
    if constraint is not None and (constraint.kind != "tool_calls" or constraint.text_schema is not None):
        return None
    return list(end_ids) or None


def _sampling_params(job: GenerationJob, api: _API, end_ids: tuple[int, ...]) -> Any:
    sampling = job.sampling
    kwargs: dict[str, Any] = {
        # SamplingParams defaults max_tokens to 32: never leave it to the default.
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "seed": _seed(sampling),
        "stop": list(sampling.stop) or None,
        "stop_token_ids": _stop_token_ids(job.constraint, end_ids),
        # The prompt is a rendered chat template, which places BOS itself (trtllm-serve's chat default);
        # the renderer counted the prompt's tokens the same way.
        "add_special_tokens": False,
    }
    if sampling.top_p <= 0:
        # OpenAI allows top_p 0 (only the most likely token); the runtime's SamplingConfig requires
        # 0 < top_p <= 1 (samplingConfig.cpp, checkTopP) and would fail the request. top_k 1 is the
        # same choice, and what the LLM API itself counts as greedy (SamplingParams._greedy_decoding).
        kwargs["top_p"] = None
        kwargs["top_k"] = 1
    # The C++ sampler applies penalties; the default TorchSampler neither applies them nor reports a sampled token
    # outside the top k of its logprobs.
    torch_sampler = not applies_penalties(job.runner_settings)
    if not torch_sampler:
        kwargs["frequency_penalty"] = sampling.frequency_penalty
        kwargs["presence_penalty"] = sampling.presence_penalty
    elif sampling.frequency_penalty or sampling.presence_penalty:
        # The API process refuses such a request (PromptRenderer.penalties); one from an API process that did not
        # would get an answer as if the penalties were 0.
        raise RunnerError(
            "this model's sampler applies no frequency or presence penalties", code="unsupported_parameter"
        )
    if sampling.logprobs:
        limit = _max_top_logprobs(job.runner_settings)
        asked = max(1, min(sampling.top_logprobs, limit))
        # The TorchSampler returns each token's top k (sampler.py, handle_logprobs), taken before it samples: a
        # sampled token outside them has no logprob to report. Asking for as many as the entry returns makes
        # that rare; the answer still lists only the alternatives the request asked for.
        sampled = sampling.temperature > 0 and sampling.top_p > 0
        kwargs["logprobs"] = max(asked, limit) if sampled and torch_sampler else asked
    guide = _guide(job.constraint, api)
    if guide is not None:
        kwargs["guided_decoding"] = guide
    try:
        return api.SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise RunnerError(f"TensorRT-LLM rejected the sampling parameters: {exc}", code="generation_failed") from exc


def applies_penalties(settings: Mapping[str, Any]) -> bool:
    """Whether the entry's sampler applies frequency and presence penalties (``PENALTY_SAMPLER``)."""
    return settings.get("sampler_type") == PENALTY_SAMPLER


def _seed(sampling: Sampling) -> int | None:
    """The request's seed for the executor: the client's, a fresh one when a sampled request names none, and none for
    greedy decoding, which draws nothing (and on releases with per-request seeds, stays off their slower path)."""
    if sampling.seed is not None:
        # The executor's seed is an unsigned 64-bit integer (SamplingConfig's RandomSeedType); OpenAI's is signed.
        return sampling.seed % 2**64
    return None if sampling.temperature == 0 else _unseeded()


def _unseeded() -> int:
    """A fresh seed for a request that names none, so that its sampling differs from any other's, as OpenAI's does.

    Without one TensorRT-LLM samples from fixed seeds: the C++ sampler gives every such request the
    runtime's default 0 (``sampling_params.py``: "None means using C++ runtime default 0"), so identical
    requests get identical answers; the PyTorch sampler draws from one generator seeded 42 at every start
    (``sampler.py``, ``_global_seed``), and since it reads per-request seeds (``sampler/seed_manager.py``)
    an unseeded request sampled beside seeded ones takes that seed for its slot. trtllm-serve passes a
    missing seed on as None.
    """
    return secrets.randbits(64)


def _before_first_stop(text: str, stops: tuple[str, ...]) -> str:
    """``text`` up to the first stop string in it, as OpenAI ends output at the first stop sequence.

    The library tries the stop strings in the order they were given and cuts the text at the first
    one it finds in it (``executor/result.py``, ``DetokenizedGenerationResultBase._handle_response``),
    not at the earliest: when one step brings two (a token such as ".\n\n" with stops "\n\n" and "."),
    the text it leaves can still hold the other.
    """
    found = [at for stop in stops if stop and (at := text.find(stop)) >= 0]
    return text[: min(found)] if found else text


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
        self._holds: str | None = None  # the key of the engine this runner keeps loaded
        self._closed = False
        if settings is not None:  # load the model now, not on the first job
            _engine_for(settings, self._api)
            self._holds = _engine_key(settings)
            with _ENGINES_LOCK:
                _HOLDERS[self._holds] = _HOLDERS.get(self._holds, 0) + 1

    def close(self) -> None:
        """Takes no job after it, and shuts its engine down (freeing the GPU memory its KV cache holds) unless
        another open runner uses it."""
        self._closed = True
        key, self._holds = self._holds, None
        if key is None:
            return
        with _ENGINES_LOCK:
            if (held := _HOLDERS.pop(key, 1) - 1) > 0:
                _HOLDERS[key] = held
                return
            engine = _ENGINES.pop(key, None)
        if engine is not None:
            engine.close()

    # A generator, so that a consumer that stops reading early (close()) still aborts the request.
    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Generator[RawEvent, None, None]:
        if self._closed:
            raise RunnerError("this TensorRT-LLM runner was closed", code="runner_unavailable")
        engine = _engine_for(job.runner_settings, self._api)
        # The API process refused such a guide already (schema_problem); a job can still come from an
        # API process with another xgrammar, and one bad guide would fail the engine's whole batch.
        if problem := _constraint_problem(job.constraint):
            raise RunnerError(f"the output constraint cannot be enforced: {problem}", code="invalid_constraint")
        params = _sampling_params(job, self._api, engine.end_ids)
        request = engine.submit(job, params, job.sampling.top_logprobs if job.sampling.logprobs else None)
        stops = job.sampling.stop
        prompt_tokens = job.prompt_tokens
        last: _Step | None = None
        sent = 0  # characters of the output text already yielded
        # The steps whose text is held back (it may become a stop string) or not yet detokenized: where the output's
        # text ended once each step's tokens were read, with their count and logprobs.
        owed: list[tuple[int, int, tuple[TokenLogprob, ...]]] = []
        reached = spelled = 0  # where the text of the steps read so far, and of those sent, ends
        was_cancelled = False
        cancel_deadline: float | None = None
        try:
            while True:
                if not was_cancelled and cancelled():
                    was_cancelled = True
                    request.abort()
                    if last is None:
                        # Nothing came out yet, so the request may still wait in the engine's queue, from
                        # which TensorRT-LLM drops a cancelled request without any final output
                        # (py_executor.py _handle_canceled_requests -> update_waiting_queue). End it here.
                        break
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
                    if was_cancelled:  # the client is gone; how the request died is moot
                        break
                    if event.fatal:
                        _discard(engine)
                    raise RunnerError(f"TensorRT-LLM: {event.error}", code=event.code) from event.error
                elif isinstance(event, _Ended):
                    request.ended = True
                    break
                else:
                    last = event
                    if was_cancelled:
                        continue
                    # Past any text a stop string since cut: a step's tokens end no earlier than those before.
                    reached = max(reached, len(event.text))
                    owed.append((reached, event.new_tokens, event.logprobs))
                    ready = len(event.text) - _held_back(event.text, stops)
                    if ready > sent:
                        # A chunk takes the tokens of the steps whose text it ends.
                        count = next((n for n, (end, _, _) in enumerate(owed) if end > ready), len(owed))
                        taken, owed = owed[:count], owed[count:]
                        yield TextChunk(event.text[sent:ready], *_of_steps(taken), event.cached_tokens)
                        sent, spelled = ready, taken[-1][0] if taken else spelled

            if was_cancelled:
                reason: FinishReason = "cancelled"
            else:
                # The final text is settled (stop strings cut, see _settled_text): send what was held back, and the
                # tokens still owed though no text came of them.
                tokens, logprobs = _of_steps(owed, text_end=len(last.text), after=spelled) if last else (0, ())
                if last is not None and (len(last.text) > sent or tokens):
                    yield TextChunk(last.text[sent:], tokens, logprobs, last.cached_tokens)
                reason = _FINISH_REASONS.get(last.finish_reason or "stop", "stop") if last else "stop"
                if reason == "length" and last is not None and _whole_value(job.constraint, last.text):
                    reason = "stop"  # as it would have been one token later: the guide allowed nothing but the end
            yield Finished(
                reason=reason,
                prompt_tokens=prompt_tokens,
                completion_tokens=last.total_tokens if last else 0,
                cached_tokens=last.cached_tokens if last else 0,
            )
        finally:
            if not request.ended:
                # Cancelled, or the consumer stopped reading: free the engine's place, and stop waiting
                # for a final output that a request dropped from the waiting queue never gets.
                request.abort()
                request.stop()
            engine.forget(request)


def _whole_value(constraint: Constraint | None, text: str) -> bool:
    """Whether ``text`` is the whole JSON value a schema or ``json_object`` output asks for, which its guide ends
    there (an object, an array, a string or a literal closed; not a number, which may go on)."""
    if constraint is None or constraint.kind not in ("json_schema", "json_object"):
        return False
    value = text.strip()
    if not value or value[-1].isdigit():
        return False
    try:
        json.loads(value)
    except (ValueError, RecursionError):  # not JSON, or nested past what Python's parser reads
        return False
    return True


def _of_steps(
    steps: list[tuple[int, int, tuple[TokenLogprob, ...]]], *, text_end: int | None = None, after: int = 0
) -> tuple[int, tuple[TokenLogprob, ...]]:
    """The tokens of ``steps`` and their logprobs. With ``text_end``, where the answer's text ends (cut at a stop
    string), only the logprobs of the steps whose text it holds, and of the one it ends inside of (a stop string may
    begin inside a token: that token's logprob stays, as the llama.cpp runner's does); the others' text is no part
    of the answer. Tokens that left no text (the first bytes of a character never finished) end where it does."""
    logprobs: list[TokenLogprob] = []
    start = after
    for end, _, step_logprobs in steps:
        if text_end is None or start < text_end or end <= text_end:
            logprobs.extend(step_logprobs)
        start = end
    return sum(tokens for _, tokens, _ in steps), tuple(logprobs)


def load(settings: dict[str, Any]) -> TensorRTLLMRunner:
    return TensorRTLLMRunner(settings)


# -- prompt rendering, in the API process ------------------------------------------------------------


def encode_prompt(tokenizer: Any, prompt: str, literal: tuple[tuple[int, int], ...]) -> list[int]:
    """A prompt's ids: the special tokens the chat template wrote (BOS included) as themselves, the ``literal``
    spans as text (Hugging Face's ``split_special_tokens``)."""
    ids: list[int] = []
    for text, as_text in prompt_pieces(prompt, literal):
        options = {"split_special_tokens": True} if as_text else {}
        ids += tokenizer.encode(text, add_special_tokens=False, **options)
    return ids


def _special_tokens(tokenizer: Any) -> tuple[str, ...]:
    """The text of the tokenizer's special tokens, longest first."""
    texts = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return tuple(sorted(filter(None, texts), key=len, reverse=True))


def _hf_tokenizer(source: str, settings: dict[str, Any]) -> Any:
    """The tokenizer as the engine loads it (``ModelLoader.load_hf_tokenizer``: not SentencePiece's legacy
    reading, the slow tokenizer only with ``tokenizer_mode: "slow"``), so that a prompt counts here as it does there."""
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise RunnerError(
            "rendering prompts for tensorrt_llm models needs transformers (the 'gpu' extra)", code="runner_unavailable"
        ) from exc
    try:
        # local_files_only: a serving process never downloads; the model directory must be there.
        return AutoTokenizer.from_pretrained(
            source,
            local_files_only=True,
            trust_remote_code=bool(settings.get("trust_remote_code", False)),
            legacy=False,
            padding_side="left",
            truncation_side="left",
            use_fast=settings.get("tokenizer_mode", "auto") != "slow",
        )
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
    tokenizer = _hf_tokenizer(str(source), settings)
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

    def count_tokens(text: str, literal: tuple[tuple[int, int], ...]) -> int:
        return len(encode_prompt(tokenizer, text, literal))  # as the runner tokenizes it

    _check_structural_tags()
    return PromptRenderer(
        render=render,
        count_tokens=count_tokens,
        native_tools=_knows_tools(template),
        schema_problem=schema_problem,
        max_top_logprobs=_max_top_logprobs(settings),
        special_tokens=_special_tokens(tokenizer),
        penalties=applies_penalties(settings),
    )


def _max_top_logprobs(settings: Mapping[str, Any]) -> int:
    """How many alternatives per token this entry returns with logprobs (its ``max_top_logprobs`` setting).

    The PyTorch backend (``tensorrt_llm.LLM``, the one this runner builds) returns each token's top-k
    as {token id: Logprob} (``executor/result.py``). A plain float per token, the sampled token's
    alone, comes only from the TensorRT engine backend's legacy ``_return_log_probs`` path (that
    backend refuses ``logprobs`` without ``gather_generation_logits``: ``llm.py``, ``_check_arguments``);
    an entry whose engine gives no alternatives sets 0, and asks for more are refused up front. The C++ sampler
    (``PENALTY_SAMPLER``) is one: it gives the sampled token's logprob alone, as rank 1, however many are asked for
    (``sampler.py``, ``TRTLLMSampler.update_requests_single_beam_single_step``).
    """
    sampled_only = applies_penalties(settings)
    value = settings.get("max_top_logprobs", 0 if sampled_only else MAX_TOP_LOGPROBS)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RunnerError(
            f"tensorrt_llm setting max_top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}",
            code="runner_unavailable",
        )
    if sampled_only and value:
        raise RunnerError(
            f"tensorrt_llm setting max_top_logprobs must be 0 with sampler_type {PENALTY_SAMPLER!r}: that sampler "
            "reports the sampled token's logprob alone, no alternatives",
            code="runner_unavailable",
        )
    return value


def _check_structural_tags() -> None:
    """Refuse to serve when the installed xgrammar cannot read the structural tags the runner sends."""
    probe = {"type": "object", "properties": {"name": {"const": "f"}}, "required": ["name"]}
    if problem := _compile_problem("structural_tag", _tool_calls_tag(probe)):
        raise RunnerError(
            f"the installed xgrammar cannot compile the runner's structural tags ({problem}); it needs 0.1.25 or later",
            code="runner_unavailable",
        )
