"""The CPU runner: llama.cpp (through llama-cpp-python's low-level API) on a GGUF model; the embedded
default is SmolLM2-135M-Instruct.

One llama.cpp context per loaded model holds ``parallel`` sequences, each with its own part of the KV
cache, and one scheduling thread owns it: every step is one ``llama_decode`` over the next token of
every sequence that is generating, plus a chunk of the prompts still being read (continuous batching).
Jobs join and leave between steps, and only that thread calls into the context. Each step lists its
sequences in slot order: llama.cpp decodes a batch in one pass only while its sequence ids rise one by one.

A job that arrives finds a free sequence slot, preferring the one whose cached tokens share the longest
prefix with its prompt: that part is not read again (``cached_tokens``). More jobs than slots wait in a
bounded queue, in arrival order; past the bound a job is refused at once as ``overloaded``.

Each sequence keeps its own sampler (temperature, top_p, penalties, seed), grammar (JSON schema, strict
and forced tools), stop sequences, logprobs and token budget. Grammar-constrained sampling checks the
freely drawn token against the grammar first and masks the vocabulary only when it is refused, as
llama.cpp's own tools do: masking 49k tokens at every step costs many times the step itself.
"""

from __future__ import annotations

import atexit
import bisect
import codecs
import collections
import contextlib
import ctypes
import functools
import logging
import math
import os
import queue
import re
import secrets
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import machinery
from pathlib import Path
from typing import Any

import numpy as np
from jinja2 import TemplateError

from core.threads import name_native_thread

from .base import (
    Delivery,
    Finished,
    GenerationJob,
    PromptRenderer,
    RawEvent,
    RunnerError,
    Sampling,
    TextChunk,
    TokenLogprob,
    prompt_pieces,
)
from .closing import PROPERTY_COST, Closing, ClosingVocabulary, JsonTail
from .grammar import grammar_for, schema_problem
from .huge_pages import collapse_in_background, huge_pages

logger = logging.getLogger(__name__)

# Sampling under a grammar checks these many likeliest tokens first, then the rest of the vocabulary in slices of
# GRAMMAR_SLICE, until a slice holds a token the grammar allows (``_Sampler._draw_allowed``).
LIKELIEST = 512
GRAMMAR_SLICE = 2048
# A grammar that takes longer than this to check for one token ends its job: every sequence waits for it.
GRAMMAR_CHECK_MAX_SECONDS = 1.0
# How many prompt tokens one step reads at most, besides the generating sequences' tokens: a longer
# prompt is read over several steps, so that the others' streams never stall for long.
PREFILL_CHUNK = 256
# A stream's text leaves at most this often (its first token at once): tokens that come faster travel
# together. Each delta costs the serving process the same CPU, whatever it holds, and on a small model
# that CPU is taken from the model's own threads; 40 ms is still smoother than a reader can tell.
STREAM_INTERVAL_MS = 40


def model_path(settings: dict[str, Any]) -> str:
    if path := settings.get("model_path"):
        return str(path)
    package, file = settings.get("package"), settings.get("file")
    if not package or not file:
        raise RunnerError("llama_cpp settings need model_path, or package and file", code="runner_unavailable")
    if not isinstance(package, str) or not _PACKAGE_NAME.match(package) or not isinstance(file, str):
        raise RunnerError(f"{package!r} and {file!r} are not a package's name and a file's", code="runner_unavailable")
    folders = _package_folders(package)
    if folders is None:
        raise RunnerError(f"the package {package!r} is not installed", code="runner_unavailable")
    for folder in folders:
        if is_file(located := folder / file):
            return str(located)
    raise RunnerError(f"{file!r} is not in the package {package!r}", code="runner_unavailable")


def is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a name no file could have (too long for the filesystem, say)."""
    try:
        return path.is_file()
    except OSError:
        return False


_PACKAGE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


def _package_folders(name: str) -> list[Path] | None:
    """The folders of an installed package, found without importing it (an import runs its code, whatever the
    admin typed); None for a name that is no installed package (a module, say)."""
    folders: list[str] | None = None
    for part in name.split("."):
        spec = machinery.PathFinder.find_spec(part, folders)
        if spec is None or not spec.submodule_search_locations:
            return None
        folders = list(spec.submodule_search_locations)
    return [Path(folder) for folder in folders or ()]


def default_parallel() -> int:
    """Sequence slots when the catalog entry sets none: a decode step over 4 sequences costs little more
    than over one on a small model; more slots pay off with more cores to run them."""
    return min(8, max(4, os.cpu_count() or 1))


# llama.cpp's threads for every model of this process, over the catalog entry's ``n_threads``.
THREADS_VARIABLE = "CPU_RUNNER_THREADS"


def default_threads() -> int:
    return min(8, os.cpu_count() or 1)


DEFAULT_CONTEXT = 8192  # tokens per sequence

# The numbers a catalog entry's ``runner_settings`` may set, each with the least and the most it may be; one left
# out takes its default. The most: llama.cpp's own limits (256 sequences, 512 threads), a context of a million
# tokens, a queue any host's threads could hold, and deltas held back 10 s at most (past that a stream seems dead).
SETTING_RANGES = {
    "parallel": (1, 256),
    "queue": (0, 4096),
    "n_ctx": (16, 2**20),
    "n_threads": (1, 512),
    "prefill_chunk": (1, 2**20),
    "stream_interval_ms": (0, 10_000),
}
# Every setting the runner reads: where its model file is, and the numbers above.
SETTING_NAMES = frozenset({"model_path", "package", "file", *SETTING_RANGES})


def settings_problem(settings: dict[str, Any]) -> str | None:
    """What is wrong with the numbers in a catalog entry's settings, or None. The model file is checked where the
    model loads: in distributed mode that is a worker's host, not the one the admin runs on."""
    if not isinstance(settings, dict):  # saved around the admin (a shell, a fixture, SQL)
        return "they must be a JSON object."
    for name, (least, most) in SETTING_RANGES.items():
        value = settings.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most):
            return f"{name} must be a whole number from {least} to {most}, not {value!r}."
    chunk, context = settings.get("prefill_chunk"), settings.get("n_ctx") or DEFAULT_CONTEXT
    if chunk is not None and chunk > context:
        return f"prefill_chunk must be at most n_ctx ({context}): a prompt is prefilled within one sequence."
    return None


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """A catalog entry's ``runner_settings`` for this runner, with the machine's defaults filled in."""

    path: str
    context: int  # tokens per sequence: the prompt and its output together
    parallel: int
    queue: int
    threads: int
    prefill_chunk: int
    stream_interval: float  # seconds

    @classmethod
    def of(cls, settings: dict[str, Any]) -> RunnerSettings:
        if problem := settings_problem(settings):
            raise RunnerError(f"the model's runner settings are wrong: {problem}", code="runner_unavailable")

        def number(name: str, default: int) -> int:
            value = settings.get(name)
            return default if value is None else int(value)

        parallel = number("parallel", default_parallel())
        return cls(
            path=model_path(settings),
            context=number("n_ctx", DEFAULT_CONTEXT),
            parallel=parallel,
            queue=number("queue", 4 * parallel),
            # The host's own choice first: a host that runs several model workers splits its cores among them.
            threads=int(os.environ.get(THREADS_VARIABLE) or number("n_threads", default_threads())),
            prefill_chunk=number("prefill_chunk", PREFILL_CHUNK),
            stream_interval=number("stream_interval_ms", STREAM_INTERVAL_MS) / 1000,
        )


_loaded: list[Callable[[], None]] = []
_exiting = False  # the process is exiting: a job cut now is cut by the shutdown (a worker's cold stop)


@atexit.register
def _close_all() -> None:
    # Closed while the interpreter still works; left to garbage collection at exit, llama.cpp's
    # finalizers run after their module globals are gone and print errors.
    global _exiting
    _exiting = True
    for close in reversed(_loaded):
        close()


# ggml's log levels, as the vendored llama.cpp numbers them (ggml.h); 5 continues the line before.
_GGML_LOG_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_native_log = logging.getLogger("llama-cpp-python")


@functools.cache
def _log_callback() -> Any:
    """llama.cpp's log, written as llama-cpp-python writes it, at or above its logger's level. The library's own
    callback reads the levels by an older numbering, under which a model's loading and its context (INFO) passed
    for warnings and were printed at every start. Installed once; the reference it returns keeps it alive."""
    from llama_cpp import llama_cpp as lib

    last = logging.DEBUG

    @lib.llama_log_callback
    def write(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        nonlocal last
        last = last if level == 5 else _GGML_LOG_LEVELS.get(level, logging.ERROR)
        if _native_log.isEnabledFor(last):
            sys.stderr.write(text.decode("utf-8", "replace"))

    lib.llama_log_set(write, ctypes.c_void_p(0))
    return write


def _load_model(path: str, *, vocab_only: bool) -> Any:
    from llama_cpp import _internals
    from llama_cpp import llama_cpp as lib

    _log_callback()
    params = lib.llama_model_default_params()
    params.vocab_only = vocab_only
    loading: contextlib.AbstractContextManager[object] = contextlib.nullcontext()
    if not vocab_only:
        # The weights are read into the process's own memory, not mapped from the file: only that memory can sit in
        # huge pages, where a step's reads of every weight cost the CPU fewer page-table walks (huge_pages.py).
        params.load_mode = lib.LLAMA_LOAD_MODE_NONE
        loading = huge_pages()
    try:
        with loading:
            model = _internals.LlamaModel(path_model=path, params=params, verbose=False)
    except ValueError as exc:
        raise RunnerError(f"could not load the model: {exc}", code="runner_unavailable") from None
    _loaded.append(model.close)
    return model


class _Sampler:
    """Samples one sequence's next tokens: its own chain (penalties, top_p, temperature, seed) and grammar.

    The token is first drawn freely and checked against the grammar alone; only when the grammar refuses
    it is the vocabulary masked and the token drawn again. Output is the same as masking first: a token
    the grammar accepts, drawn from the grammar-masked distribution when the free draw was refused.

    Under a grammar the output's bytes are also kept UTF-8: llama.cpp's grammars read the bytes of an encoded
    surrogate, an overlong form or a code past U+10FFFF as a character, which the text holds as U+FFFD, one or
    more of them (a string's ``maxLength`` or pattern broken). A token that would write such bytes is drawn again
    without it.
    """

    def __init__(self, model: Any, sampling: Sampling, grammar: Any, utf8: Utf8Pieces) -> None:
        from llama_cpp import _internals
        from llama_cpp import llama_cpp as lib

        self._lib = lib
        self._grammar = grammar
        self._utf8 = utf8
        self._partial = b""  # the first bytes of a character still to come
        self._greedy = sampling.temperature == 0
        self._chain = _internals.LlamaSampler()
        self._penalized = bool(sampling.frequency_penalty or sampling.presence_penalty)
        if self._penalized:
            self._chain.add_penalties(
                n_vocab=model.n_vocab(),
                penalty_last_n=64,
                penalty_repeat=1.0,
                penalty_freq=sampling.frequency_penalty,
                penalty_present=sampling.presence_penalty,
            )
        if self._greedy:
            self._chain.add_greedy()
        else:
            if sampling.top_p < 1.0:
                self._chain.add_top_p(sampling.top_p, 1)
            self._chain.add_temp(sampling.temperature)
            self._chain.add_dist(secrets.randbits(32) if sampling.seed is None else seed_32(sampling.seed))
        self._candidates = _internals.LlamaTokenDataArray(n_vocab=model.n_vocab())
        # Whether the last token closing took departs from the one the model would have taken (``Closing.choose``).
        self.departed = False
        self._single_data = (lib.llama_token_data * 1)()
        self._single = lib.llama_token_data_array(data=self._single_data, size=1, selected=-1, sorted=False)

    def close(self) -> None:
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()

    def _draw(self, logits: np.ndarray, *, masked: bool) -> int:
        if masked:
            return self._draw_allowed(logits)
        if self._greedy and not self._penalized:
            return int(np.argmax(logits))
        candidates = self._candidates
        candidates.copy_logits(logits)
        self._lib.llama_sampler_apply(self._chain.sampler, ctypes.byref(candidates.candidates))
        return int(candidates.candidates_data.id[candidates.candidates.selected])

    def _draw_allowed(self, logits: np.ndarray) -> int:
        """A token drawn among those the grammar allows, checked in slices of the vocabulary from the highest logit
        down: the first slice that holds any is drawn from. Checking a token costs as much as the grammar has live
        alternatives, so a few hundred tokens cost a small part of the whole vocabulary. Greedy decoding draws what it
        would from the whole vocabulary; sampling leaves out only the tail of the distribution, which holds next to
        nothing. A grammar too costly to check ends the job (``GRAMMAR_CHECK_MAX_SECONDS``): every sequence of the
        context waits for it at each step."""
        started = time.monotonic()
        for ids in _by_logit(logits):
            if self._allow_among(ids, logits):
                self._lib.llama_sampler_apply(self._chain.sampler, ctypes.byref(self._candidates.candidates))
                return int(self._candidates.candidates_data.id[self._candidates.candidates.selected])
            if (spent := time.monotonic() - started) > GRAMMAR_CHECK_MAX_SECONDS:
                raise RunnerError(
                    f"the output constraint is too costly to enforce: {spent * 1000:.0f} ms went on checking the "
                    f"vocabulary against it for one token (at most {GRAMMAR_CHECK_MAX_SECONDS * 1000:.0f}); "
                    "simplify its schema",
                    code="constraint_too_costly",
                )
        raise RunnerError("the output constraint allows no token here", code="invalid_constraint")

    def _allow_among(self, ids: np.ndarray, logits: np.ndarray) -> bool:
        """Puts the tokens ``ids`` in the candidates, the grammar's mask applied; whether it allows any of them."""
        candidates = self._candidates
        data, count = candidates.candidates_data, len(ids)
        data.id[:count] = ids
        data.logit[:count] = logits[ids]
        data.p[:count] = 0
        candidates.candidates.size = count
        candidates.candidates.sorted = False
        candidates.candidates.selected = -1
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        return bool(np.isfinite(data.logit[:count]).any())

    def _allowed(self, token: int) -> bool:
        self._single_data[0].id = token  # type: ignore[assignment]  # ctypes converts the int
        self._single_data[0].logit = 1.0
        self._single_data[0].p = 0.0
        self._single.size = 1
        self._single.selected = -1
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(self._single))
        return bool(np.isfinite(self._single_data[0].logit))

    def would_end(self, ends: frozenset[int]) -> bool:
        """Whether the grammar would take the end of the output now (its value is whole)."""
        return bool(self._grammar) and any(self._allowed(token) for token in ends)

    def next(
        self,
        logits: np.ndarray,
        *,
        closing: Closing | None = None,
        overreaching: Callable[[int], Closing | None] | None = None,
    ) -> int:
        """The next token; with ``closing``, the shortest way to a whole JSON value the grammar allows. A token drawn
        that ``overreaching`` answers with a ``Closing`` for (it would begin more than the budget can finish) is
        replaced by that closing's."""
        self.departed = False
        if closing is not None and self._grammar:
            token = self._closing(logits, closing)
        else:
            token = self._draw(logits, masked=False)
            if self._grammar and not self._allowed(token):
                token = self._draw(logits, masked=True)
            if self._grammar and not self._keeps_utf8(token):
                token = self._draw_utf8(logits, token)
            if self._grammar and overreaching is not None and (closing := overreaching(token)) is not None:
                token = self._closing(logits, closing)
        if self._grammar:
            self._lib.llama_sampler_accept(self._grammar, token)
            self._partial = _utf8_tail(self._partial + self._utf8.pieces[token]) or b""
        self._lib.llama_sampler_accept(self._chain.sampler, token)
        return token

    def _keeps_utf8(self, token: int) -> bool:
        """Whether the output stays UTF-8 (or the start of a character still to come) with ``token``'s bytes."""
        return _utf8_tail(self._partial + self._utf8.pieces[token]) is not None

    def _draw_utf8(self, logits: np.ndarray, refused: int) -> int:
        """A token the grammar allows that keeps the output UTF-8, drawn once among those that do: after a
        character's first bytes, the tokens that continue it as UTF-8 allows; else those whose bytes can stand
        anywhere. ``refused`` itself when there is none."""
        if self._partial:
            keeping = [token for token in self._utf8.continuing if self._keeps_utf8(int(token))]
            kept = np.full(len(logits), -np.inf, dtype=logits.dtype)
            kept[keeping] = logits[keeping]
        else:
            kept = logits.copy()
            kept[self._utf8.broken] = -np.inf
        try:
            token = self._draw(kept, masked=True)
        except RunnerError:  # the grammar allows no such token
            return refused
        return token if self._keeps_utf8(token) else refused

    def _closing(self, logits: np.ndarray, closing: Closing) -> int:
        candidates = self._candidates
        candidates.copy_logits(logits)
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        token, self.departed = closing.choose(candidates.candidates_data.logit)
        return token


@dataclass(frozen=True)
class Utf8Pieces:
    """A vocabulary's tokens as bytes, with those that cannot keep a text UTF-8 where they stand: the ones whose first
    byte continues a character (the only ones that may follow a character's first bytes), and those whose bytes
    are no UTF-8 wherever they stand (a byte C0, an encoded surrogate)."""

    pieces: Sequence[bytes]
    continuing: np.ndarray
    broken: np.ndarray

    @classmethod
    def of(cls, pieces: Sequence[bytes]) -> Utf8Pieces:
        continuing = [token for token, piece in enumerate(pieces) if piece and 0x80 <= piece[0] < 0xC0]
        broken = [token for token, piece in enumerate(pieces) if _utf8_tail(piece) is None]
        return cls(pieces, np.array(continuing, dtype=np.intc), np.array(broken, dtype=np.intc))


def _utf8_tail(data: bytes) -> bytes | None:
    """The first bytes of a character that ``data`` ends with (none when it ends whole), or None when ``data`` is not
    UTF-8 (Python's decoder holds each byte to the ranges of Unicode's table of well-formed sequences)."""
    try:
        data.decode()
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data" and exc.end == len(data):
            return data[exc.start :]
        return None
    return b""


_64_BITS = (1 << 64) - 1


def seed_32(seed: int) -> int:
    """An OpenAI seed (64 bits) as llama.cpp's, which is 32 bits and takes 0xFFFFFFFF to ask for a random one: mixed
    (SplitMix64's finalizer) before it is folded, so that every seed repeats itself and seeds that differ only in
    their high bits (1 and 2**32, -1 and 2**32 - 2) do not draw alike."""
    mixed = (seed + 0x9E3779B97F4A7C15) & _64_BITS
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _64_BITS
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _64_BITS
    return (mixed ^ (mixed >> 31)) % 0xFFFFFFFF


def _by_logit(logits: np.ndarray) -> Iterator[np.ndarray]:
    """The vocabulary in slices, from the highest logit down: the ``LIKELIEST`` tokens, then ``GRAMMAR_SLICE`` at a
    time (sorted only when the first slice is not enough)."""
    likeliest = np.argpartition(-logits, LIKELIEST - 1)[:LIKELIEST]
    yield likeliest
    rest = np.ones(len(logits), dtype=bool)
    rest[likeliest] = False
    ids = np.flatnonzero(rest)
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    for start in range(0, len(ids), GRAMMAR_SLICE):
        yield ids[start : start + GRAMMAR_SLICE]


def piece(model: Any, token: int, *, special: bool = False) -> bytes:
    """A token's bytes (the library's own ``token_to_piece`` returns its whole buffer, NULs and all)."""
    from llama_cpp import llama_cpp as lib

    buffer = ctypes.create_string_buffer(64)
    size = lib.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, special)
    if size < 0:  # longer than the buffer: -size is what it needs
        buffer = ctypes.create_string_buffer(-size)
        size = lib.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, special)
    return buffer.raw[:size]


def tokenize(model: Any, prompt: str, literal: tuple[tuple[int, int], ...] = ()) -> list[int]:
    """A prompt's tokens: the chat template's special tokens as themselves, its ``literal`` spans as text."""
    tokens: list[int] = []
    for text, as_text in prompt_pieces(prompt, literal):
        tokens += model.tokenize(text.encode("utf-8"), False, not as_text)
    return tokens


class Vocabulary:
    """A model's tokens as text, looked up without a call into llama.cpp per token."""

    def __init__(self, model: Any) -> None:
        from llama_cpp import llama_cpp as lib

        self.model = model
        self.pieces = [piece(model, token) for token in range(model.n_vocab())]
        # For logprobs' alternatives: a control token (the end of a turn) by its name, as its text (none) cannot.
        self.names = [text or piece(model, token, special=True) for token, text in enumerate(self.pieces)]
        self.ends = frozenset(token for token in range(model.n_vocab()) if lib.llama_vocab_is_eog(model.vocab, token))
        self.utf8 = Utf8Pieces.of(self.pieces)
        self._closing: ClosingVocabulary | None = None

    def is_end(self, token: int) -> bool:
        return token in self.ends

    def tokenize(self, text: str, literal: tuple[tuple[int, int], ...] = ()) -> list[int]:
        return tokenize(self.model, text, literal)

    @property
    def closing(self) -> ClosingVocabulary:
        if self._closing is None:
            self._closing = ClosingVocabulary.of(self.pieces, self.ends)
        return self._closing


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


_END = object()


class _Sequence:
    """One job on its way through the context: its prompt, its sampler, what it has produced and sent."""

    def __init__(
        self,
        job: GenerationJob,
        cancelled: Callable[[], bool],
        prompt: list[int],
        max_tokens: int,
        sampler: _Sampler,
        vocabulary: Vocabulary,
        stream_interval: float,
        deliver: Delivery,
    ) -> None:
        self.deliver = deliver
        self.job = job
        self.cancelled = cancelled
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.vocabulary = vocabulary
        self.abandoned = False  # the consumer stopped reading
        self.slot: _Slot | None = None
        self.read = 0  # prompt tokens in the KV cache (reused ones included)
        self.cached = 0
        self.next_token: int | None = None  # sampled, not yet in the KV cache
        self.produced = 0
        sampling = job.sampling
        self.stops = sampling.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Text generated and not sent yet, where each of its tokens ends in it, whether its bytes end a character
        # there (a token may end with the first bytes of the next one), and their logprobs.
        self.pending = ""
        self.pending_ends: list[int] = []
        self.pending_whole: list[bool] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.stream_interval = stream_interval
        self.sent_at = -math.inf
        # A value that must be whole: how far it is from closed, followed as it is written.
        constraint = job.constraint
        self.tail = None
        if constraint and constraint.close_before_limit:
            self.tail = JsonTail(
                constraint.schema,
                cost=lambda name: len(vocabulary.tokenize(name)) + PROPERTY_COST,
                value_cost=lambda value: len(vocabulary.tokenize(value)),
            )
        # Whether closing it changed what the model wrote (then it was cut short, not finished).
        self.steered = False
        # Whether the output is one JSON value (a schema's, an object, a forced call), not text that may hold one.
        self.whole_value = constraint is not None and constraint.kind in ("json_schema", "json_object")

    @property
    def gone(self) -> bool:
        return self.abandoned or self.cancelled()

    @property
    def reading(self) -> bool:
        return self.read < len(self.prompt)

    def advance(self, logits: np.ndarray, now: float) -> bool:
        """Takes the next token from ``logits`` at time ``now``; true when the sequence is finished."""
        closing = overreaching = None
        if self.tail is not None:
            if self.max_tokens - self.produced <= self.tail.needs():
                closing = self._closing()
            else:
                overreaching = self._overreaching
        token = self.sampler.next(logits, closing=closing, overreaching=overreaching)
        self.steered = self.steered or self.sampler.departed
        if self.vocabulary.is_end(token):
            # A value closed early is cut short, unless the model would have written it so anyway.
            return self.finish("length" if self.steered else "stop")
        self.produced += 1
        sampling = self.job.sampling
        if sampling.logprobs:
            self.pending_logprobs.append(self._logprob(logits, token, sampling.top_logprobs))
        text = self.decoder.decode(self.vocabulary.pieces[token])
        if self.tail is not None:
            self.tail.feed(text)
        self.pending += text
        self.pending_ends.append(len(self.pending))
        self.pending_whole.append(not self.decoder.getstate()[0])
        ready = len(self.pending)
        if self.stops:
            hit = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
            if hit >= 0:
                # The tokens of the stop sequence leave the logprobs as their text leaves the output.
                del self.pending_logprobs[bisect.bisect_left([0, *self.pending_ends], hit) :]
                self.pending = self.pending[:hit]
                return self.finish("stop")
            ready = max(0, len(self.pending) - self.holdback)
        if ready and now - self.sent_at >= self.stream_interval:
            self._send_through(ready)
            self.sent_at = now
        if self.produced >= self.max_tokens:
            # A JSON value the grammar holds whole as the budget runs out is finished, as it would have been one
            # token later (OpenAI's SDKs refuse to parse an answer that ended for its length).
            whole = self.whole_value and not self.steered and self.sampler.would_end(self.vocabulary.ends)
            return self.finish("stop" if whole else "length")
        self.next_token = token
        return False

    def _closing(self) -> Closing:
        assert self.tail is not None
        vocabulary = self.vocabulary
        tail = self.tail
        return Closing(vocabulary.closing, tail.closers(), vocabulary.pieces, tail.scan.in_string, needs=tail.needs)

    def _overreaching(self, token: int) -> Closing | None:
        """Closing instead of ``token`` when the token begins what the budget left after it cannot finish (an item of
        a list, or an object, whose required properties take more tokens than are left)."""
        assert self.tail is not None
        text = self.vocabulary.pieces[token].decode("utf-8", errors="ignore")
        if self.max_tokens - self.produced - 1 < self.tail.needs(after=text):
            return self._closing()
        return None

    def _send_through(self, ready: int) -> None:
        """Sends the pending tokens whose text ends within its first ``ready`` characters (the rest may still
        become a stop sequence), each chunk's logprobs those of its own text."""
        count = bisect.bisect_right(self.pending_ends, ready)
        while count and not self.pending_whole[count - 1]:
            count -= 1  # its last bytes begin a character still to come: the token leaves with that character
        if not count or not (cut := self.pending_ends[count - 1]):
            return
        logprobs, self.pending_logprobs = self.pending_logprobs[:count], self.pending_logprobs[count:]
        self.deliver(TextChunk(self.pending[:cut], count, tuple(logprobs), self.cached))
        self.pending = self.pending[cut:]
        self.pending_ends = [end - cut for end in self.pending_ends[count:]]
        self.pending_whole = self.pending_whole[count:]

    def finish(self, reason: str) -> bool:
        # The first bytes of a character the output never finished (cut by the budget) are no text: dropped, not sent
        # as U+FFFD (the tokens still count, and their logprobs carry those bytes).
        if reason != "cancelled" and (self.pending or self.pending_ends):
            self.deliver(TextChunk(self.pending, len(self.pending_ends), tuple(self.pending_logprobs), self.cached))
        self.deliver(Finished(reason, len(self.prompt), self.produced, self.cached))  # type: ignore[arg-type]
        return True

    def fail(self, error: RunnerError) -> None:
        self.deliver(error)

    def close(self) -> None:
        self.sampler.close()

    def events(self, out: queue.SimpleQueue[RawEvent | RunnerError]) -> Iterator[RawEvent]:
        try:
            while True:
                item = out.get()
                if isinstance(item, RunnerError):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            self.abandoned = True

    def _logprob(self, logits: np.ndarray, token: int, top: int) -> TokenLogprob:
        logprobs = _log_softmax(logits)
        # Bytes, not text: a token can be a piece of a character. The token taken is its text, as the output holds
        # it; an alternative that is a control token (the end of the turn) is named, which its text would not.
        names = self.vocabulary.names
        best: tuple[tuple[bytes, float], ...] = ()
        if top:
            ids = np.argpartition(-logprobs, top)[:top]
            ids = ids[np.argsort(-logprobs[ids])]
            best = tuple((names[int(i)], float(logprobs[i])) for i in ids)
        return TokenLogprob(self.vocabulary.pieces[token], float(logprobs[token]), best)


class _StepEvents:
    """The events of one decode step, handed on together once every sequence has taken its token: whoever reads
    them (the event loop, a worker's publisher) wakes once a step, not once a sequence between the sampler's calls."""

    def __init__(self) -> None:
        self._held: list[tuple[Delivery, RawEvent | RunnerError]] | None = None
        self._holder: int | None = None  # the thread stepping; another (a caller refusing a job) hands on at once

    def hand_on(self, deliver: Delivery, item: RawEvent | RunnerError) -> None:
        if self._held is None or threading.get_ident() != self._holder:
            deliver(item)
        else:
            self._held.append((deliver, item))

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        self._held, self._holder = [], threading.get_ident()
        try:
            yield
        finally:
            held, self._held = self._held, None
            for deliver, item in held:
                try:
                    deliver(item)
                except Exception:  # one reader's fault must not keep the others' events
                    logger.exception("could not hand on an event of a job")


@dataclass
class _Slot:
    """A sequence id of the context, and the tokens its part of the KV cache holds."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    sequence: _Sequence | None = None


def _seq_id(sequence: _Sequence) -> int:
    return sequence.slot.seq_id if sequence.slot is not None else -1


def _kv_cache_bytes(metadata: dict[str, str], cells: int) -> int:
    """The KV cache's size from the GGUF's description of the model: a key and a value (16-bit floats) per
    layer, KV head and cell. Read from the metadata, so that it is known without loading the weights."""
    arch = metadata.get("general.architecture", "llama")

    def number(key: str, default: int | None = None) -> int:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise KeyError(key)
            return default
        return int(value)

    heads = number("attention.head_count")
    head_size = number("embedding_length") // heads
    per_cell = number("attention.head_count_kv", heads) * (
        number("attention.key_length", head_size) + number("attention.value_length", head_size)
    )
    return cells * number("block_count") * per_cell * 2


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one loaded model holds: its sequences, their context, its queue, and the KV cache they take."""

    sequences: int
    context_per_sequence: int
    queue: int
    kv_cache_bytes: int


def capacity(settings: dict[str, Any]) -> Capacity:
    """The capacity a catalog entry's settings give, without loading the weights."""
    config = RunnerSettings.of(settings)
    model = _load_model(config.path, vocab_only=True)
    try:
        kv = _kv_cache_bytes(model.metadata(), config.context * config.parallel)
    finally:
        model.close()
    return Capacity(config.parallel, config.context, config.queue, kv)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True, slots=True)
class RunnerStats:
    parallel: int
    active: int
    queued: int
    queue_limit: int
    context_per_sequence: int
    kv_cache_bytes: int


class LlamaCppRunner:
    """A loaded model: one llama.cpp context with ``parallel`` sequences, driven by one scheduling thread."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from llama_cpp import _internals
        from llama_cpp import llama_cpp as lib

        self._lib = lib
        self.settings = config = RunnerSettings.of(settings)
        self._model = _load_model(config.path, vocab_only=False)
        self.vocabulary = Vocabulary(self._model)
        params = lib.llama_context_default_params()
        params.n_ctx = config.context * config.parallel
        params.n_batch = params.n_ubatch = max(config.prefill_chunk + config.parallel, 64)
        params.n_seq_max = config.parallel
        params.kv_unified = False  # each sequence has its own part of the cache: one never crowds out another
        # Without flash attention. On the CPU, ggml's takes one of two kernels by how many of a sequence's tokens a
        # step reads (64 or more: f32 tiles; fewer: f16 sums), and the keys and values they write differ by enough
        # to move a logprob by a tenth: a prompt's answer would depend on how its cached prefix was once read (in a
        # long prompt's chunk, or a short one's). The plain path, in a build without llamafile's kernels
        # (scripts/build-cpu-runner), gives a sequence the same numbers however its step was made up.
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = config.threads
        params.no_perf = True
        try:
            with huge_pages(collapse=False) as buffers:  # the KV cache and the compute buffers: see huge_pages.py
                self._context = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        except ValueError as exc:
            raise RunnerError(f"could not create the model's context: {exc}", code="runner_unavailable") from None
        self._ctx = self._context.ctx
        self._memory = lib.llama_get_memory(self._ctx)
        self.context_per_sequence = int(lib.llama_n_ctx_seq(self._ctx))
        self.kv_cache_bytes = _kv_cache_bytes(self._model.metadata(), int(lib.llama_n_ctx(self._ctx)))
        # What llama.cpp made of it: it holds a batch to the context it was asked for (before rounding that up), and a
        # step of more tokens than it holds aborts the process.
        self._batch_size = min(int(lib.llama_n_batch(self._ctx)), int(lib.llama_n_ubatch(self._ctx)))
        self._batch = lib.llama_batch_init(self._batch_size, 0, 1)
        self._slots = [_Slot(seq_id) for seq_id in range(config.parallel)]
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self._step_events = _StepEvents()
        self._thread = threading.Thread(target=self._loop, name="llama-cpp-scheduler", daemon=True)
        self._thread.start()
        collapse_in_background(buffers, lambda: self._closed)
        _loaded.append(self.close)

    # --- the caller's side (any thread)

    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]:
        """Queues ``job`` (or refuses it: the context check, the queue bound) and returns its events."""
        out: queue.SimpleQueue[RawEvent | RunnerError] = queue.SimpleQueue()
        return self.start(job, cancelled, out.put).events(out)

    def start(self, job: GenerationJob, cancelled: Callable[[], bool], deliver: Delivery) -> _Sequence:
        """Queues ``job`` (or refuses it, as ``stream``); the scheduling thread hands each of its events to
        ``deliver`` as it comes, the last a ``Finished`` or a ``RunnerError``. No thread waits on the job."""
        if self._closed:  # its weights are freed: not even the prompt can be read
            raise RunnerError("the model is shutting down", code="runner_unavailable")
        sequence = self._prepare(job, cancelled, deliver)
        with self._cond:
            if self._closed:
                sequence.close()
                raise RunnerError("the model is shutting down", code="runner_unavailable")
            if self._queue_full():
                self._drop_gone_waiting()  # a client that left holds no place, though the scheduler has not looked yet
            if self._queue_full():
                sequence.close()
                raise RunnerError(
                    f"all {self.settings.parallel} sequences of the model are busy and {len(self._waiting)} "
                    "requests are waiting",
                    code="overloaded",
                )
            self._waiting.append(sequence)
            self._cond.notify()
        return sequence

    def _prepare(self, job: GenerationJob, cancelled: Callable[[], bool], deliver: Delivery) -> _Sequence:
        """Tokenizing and compiling the grammar happen on the caller's thread, never in the scheduler's way."""
        prompt = self.vocabulary.tokenize(job.prompt, job.literal)
        context = self.context_per_sequence
        if len(prompt) + 1 > context:
            raise RunnerError("the prompt does not fit the model's context", code="context_length_exceeded")
        grammar = None
        if job.constraint is not None:
            try:
                text = grammar_for(job.constraint)
            except Exception as exc:  # noqa: BLE001  (see schema_problem: the API checks schemas before dispatch)
                raise RunnerError(
                    f"the output constraint cannot be enforced: {exc}", code="invalid_constraint"
                ) from None
            grammar = self._lib.llama_sampler_init_grammar(self._model.vocab, text.encode("utf-8"), b"root")
            if not grammar:
                raise RunnerError("the output constraint could not be compiled to a grammar", code="invalid_constraint")
        sampler = _Sampler(self._model, job.sampling, grammar, self.vocabulary.utf8)
        max_tokens = min(job.sampling.max_tokens, context - len(prompt))
        interval = self.settings.stream_interval
        handed_on = functools.partial(self._step_events.hand_on, deliver)
        return _Sequence(job, cancelled, prompt, max_tokens, sampler, self.vocabulary, interval, handed_on)

    def stats(self) -> RunnerStats:
        with self._cond:
            return RunnerStats(
                parallel=self.settings.parallel,
                active=len(self._active),
                queued=len(self._waiting),
                queue_limit=self.settings.queue,
                context_per_sequence=self.context_per_sequence,
                kv_cache_bytes=self.kv_cache_bytes,
            )

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        if _exiting:
            why, code = "the process serving the model shut down", "server_shutting_down"
        else:
            why, code = "the model was unloaded", "runner_unavailable"
        for sequence in [*self._waiting, *self._active]:
            sequence.fail(RunnerError(why, code=code))  # one each: each is raised on its own caller's thread
            sequence.close()
        self._waiting.clear()
        self._active.clear()
        self._lib.llama_batch_free(self._batch)
        self._context.close()
        self._model.close()  # the weights too: a runner closed before exit is one replaced by another
        for close in (self.close, self._model.close):
            if close in _loaded:
                _loaded.remove(close)

    # --- the scheduler's side (its own thread, the only one that touches the context)

    def _free_slot(self) -> bool:
        return any(slot.sequence is None for slot in self._slots)

    def _queue_full(self) -> bool:
        """Whether a job would wait beyond the queue (with the lock held). The jobs waiting for the slots that are
        free are not in the queue: the scheduler gives them their slots once its step is done, and a burst that
        comes meanwhile is held to the slots and the queue all the same."""
        free = sum(slot.sequence is None for slot in self._slots)
        return len(self._waiting) >= self.settings.queue + free

    def _loop(self) -> None:
        name_native_thread("llama-scheduler")  # its OpenMP threads inherit the name
        while True:
            try:
                with self._cond:
                    while not self._closed and not self._waiting and not self._active:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._drop_gone_waiting()
                    self._release_gone_active()
                    self._admit()
                if self._active:
                    with self._step_events.holding():
                        self._step()
            except Exception as exc:  # a fault here must end the jobs it touched, not leave them waiting forever
                logger.exception("the scheduler of %s failed", self.settings.path)
                self._fail_active(RunnerError(f"generation failed: {type(exc).__name__}"))

    def _drop_gone_waiting(self) -> None:
        """Ends the waiting jobs whose clients left (with the lock held)."""
        if any(sequence.gone for sequence in self._waiting):
            for sequence in [s for s in self._waiting if s.gone]:
                self._waiting.remove(sequence)
                sequence.finish("cancelled")
                sequence.close()

    def _release_gone_active(self) -> None:
        """Frees the slots of the running jobs whose clients left (with the lock held), before the waiting jobs
        are given slots: the next turn of a conversation that comes as its client ends the last one (an answer
        ended at its one tool call) finds that slot's cache."""
        for sequence in [s for s in self._active if s.gone]:
            self._release(sequence, "cancelled")

    def _admit(self) -> None:
        """Free slots go to waiting jobs in arrival order. A job takes the free slot that has cached the most
        of its prompt when that is at least half of it (a conversation's next turn, a shared system prompt);
        otherwise the slot used longest ago, so that one short shared opening does not evict a whole cache."""
        while self._waiting and self._free_slot():
            sequence = self._waiting.popleft()
            free = [slot for slot in self._slots if slot.sequence is None]
            shared = {slot.seq_id: _common_prefix(slot.tokens, sequence.prompt) for slot in free}
            best = max(free, key=lambda s: (shared[s.seq_id], -s.last_used))
            slot = best if 2 * shared[best.seq_id] >= len(sequence.prompt) else min(free, key=lambda s: s.last_used)
            # At least the prompt's last token is read again: its logits start the answer.
            keep = min(shared[slot.seq_id], len(sequence.prompt) - 1)
            self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, keep, -1)
            del slot.tokens[keep:]
            slot.sequence = sequence
            sequence.slot = slot
            sequence.read = sequence.cached = keep
            self._active.append(sequence)

    def _step(self) -> None:
        """One ``llama_decode``: a token of each generating sequence, then prompt tokens up to the chunk size."""
        batch = self._batch
        entries: list[tuple[_Sequence, bool]] = []  # per batch position: whose token, and whether to sample after it

        def add(sequence: _Sequence, token: int, *, sample: bool) -> None:
            slot = sequence.slot
            assert slot is not None
            i = len(entries)
            batch.token[i] = token
            batch.pos[i] = len(slot.tokens)
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot.seq_id
            batch.logits[i] = sample
            slot.tokens.append(token)
            entries.append((sequence, sample))

        # What each sequence reads this step: its last token, or the next chunk of its prompt, up to the chunk size in
        # all. The prompt with the least left to read goes first (in arrival order among equals): a short prompt that
        # comes while a long one is read gets its first token after a step or two, not after the whole long prompt.
        planned: dict[_Sequence, list[int]] = {}
        for sequence in self._active:
            if sequence.next_token is not None:
                planned[sequence] = [sequence.next_token]
                sequence.next_token = None
        room = min(self.settings.prefill_chunk, self._batch_size - len(planned))
        for sequence in sorted((s for s in self._active if s.reading), key=lambda s: len(s.prompt) - s.read):
            if room <= 0:
                break
            take = min(room, len(sequence.prompt) - sequence.read)
            planned[sequence] = sequence.prompt[sequence.read : sequence.read + take]
            sequence.read += take
            room -= take
        # In slot order: with a cache per sequence, llama.cpp decodes sequences together in one pass only while their
        # ids rise one by one through the batch, and splits it into a pass per such run otherwise.
        for sequence in sorted(planned, key=_seq_id):
            tokens = planned[sequence]
            for offset, token in enumerate(tokens):
                # Logits where a token comes next: after a generated token, or after the prompt's last.
                add(sequence, token, sample=offset == len(tokens) - 1 and not sequence.reading)
        if not entries:
            return
        batch.n_tokens = len(entries)
        result = self._lib.llama_decode(self._ctx, batch)
        if result != 0:
            self._fail_batch(entries, result)
            return
        n_vocab = len(self.vocabulary.pieces)
        now = time.monotonic()
        for index, (sequence, sample) in enumerate(entries):
            if not sample or sequence.slot is None:
                continue
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, index), shape=(n_vocab,))
            try:
                finished = sequence.advance(logits, now)
            except RunnerError as exc:
                sequence.fail(exc)
                self._release(sequence, None)
                continue
            except Exception as exc:  # noqa: BLE001  (one sequence's fault must not stop the others)
                sequence.fail(RunnerError(f"generation failed: {type(exc).__name__}: {exc}"))
                finished = True
                self._release(sequence, None)
                continue
            if finished:
                self._release(sequence, None)

    def _release(self, sequence: _Sequence, reason: str | None) -> None:
        """Frees the slot; its tokens stay cached for a later prompt that starts the same way."""
        if reason is not None:
            sequence.finish(reason)
        slot = sequence.slot
        if slot is not None:
            slot.sequence = None
            slot.last_used = time.monotonic()
            sequence.slot = None
        if sequence in self._active:
            self._active.remove(sequence)
        sequence.close()

    def _fail_active(self, error: RunnerError) -> None:
        for sequence in list(self._active):
            if sequence.slot is not None:
                self._lib.llama_memory_seq_rm(self._memory, sequence.slot.seq_id, 0, -1)
                sequence.slot.tokens.clear()
            sequence.fail(error)
            self._release(sequence, None)

    def _fail_batch(self, entries: list[tuple[_Sequence, bool]], result: int) -> None:
        for sequence in dict.fromkeys(sequence for sequence, _ in entries):
            slot = sequence.slot
            if slot is not None:
                self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, 0, -1)
                slot.tokens.clear()
            sequence.fail(RunnerError(f"llama_decode failed with status {result}"))
            self._release(sequence, None)


def load(settings: dict[str, Any]) -> LlamaCppRunner:
    return LlamaCppRunner(settings)


def renderer(settings: dict[str, Any]) -> PromptRenderer:
    """The GGUF's own chat template, and its tokenizer (loaded without weights) to count."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = _load_model(RunnerSettings.of(settings).path, vocab_only=True)  # the settings' numbers checked too
    template = vocab.metadata().get("tokenizer.chat_template")
    if not template:
        raise RunnerError("the GGUF has no chat template", code="runner_unavailable")
    eos = piece(vocab, vocab.token_eos(), special=True).decode("utf-8", errors="replace")
    bos_id = vocab.token_bos()
    bos = piece(vocab, bos_id, special=True).decode("utf-8", errors="replace") if bos_id >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    native_tools = "tools" in template

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        try:
            return formatter(messages=messages, tools=tools).prompt  # type: ignore[arg-type]  # plain dicts of that shape
        except ValueError as exc:  # the template's raise_exception ("System role not supported")
            raise TemplateError(str(exc)) from None

    def count_tokens(text: str, literal: tuple[tuple[int, int], ...]) -> int:
        return len(tokenize(vocab, text, literal))

    longest, specials = _vocabulary_facts(vocab)
    return PromptRenderer(
        render=render,
        count_tokens=count_tokens,
        least_tokens=_token_floor(longest, specials),
        native_tools=native_tools,
        schema_problem=functools.partial(schema_problem, vocab=vocab),
        special_tokens=specials,
    )


def _vocabulary_facts(vocab: Any) -> tuple[int, tuple[str, ...]]:
    """In one pass over the vocabulary: the longest token's bytes, and the text of the tokens llama.cpp reads as
    special where a prompt spells them, longest first (as it splits them out)."""
    from llama_cpp import llama_cpp as lib

    special_kinds = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
    longest, specials = 1, set()
    for token in range(vocab.n_vocab()):
        longest = max(longest, len(piece(vocab, token)))
        if vocab.token_get_attr(token) & special_kinds and (text := piece(vocab, token, special=True)):
            specials.add(text.decode("utf-8", errors="replace"))
    return longest, tuple(sorted(specials, key=len, reverse=True))


def _token_floor(longest: int, specials: tuple[str, ...]) -> Callable[[str], int]:
    """A lower bound on a text's token count: every token holds at most ``longest`` bytes, and each special token
    written in the text (the chat template's markers, or a request's own, read as text) takes at least a token of
    its own."""
    marker = re.compile("|".join(map(re.escape, specials))) if specials else None

    def floor(text: str) -> int:
        by_size = -(-len(text.encode("utf-8")) // longest)
        return max(by_size, sum(1 for _ in marker.finditer(text)) if marker else 0)

    return floor


def self_test(settings: dict[str, Any]) -> None:
    """One short generation: what a native library built for another CPU crashes on (see ``engine.preflight``)."""
    RunnerSettings.of(settings)  # the settings' own faults are the entry's, told as such, not the library's
    context = 256  # a prefill chunk is at most a sequence
    chunk = min(settings.get("prefill_chunk") or PREFILL_CHUNK, context)
    runner = LlamaCppRunner({**settings, "parallel": 1, "n_ctx": context, "prefill_chunk": chunk})
    job = GenerationJob(
        job_id="self-test",
        model_id="self-test",
        runner="llama_cpp",
        runner_settings=settings,
        prompt="The three largest rivers of Oregon are the Columbia, the Snake and the",
        prompt_tokens=0,
        sampling=Sampling(max_tokens=4, temperature=0.0),
    )
    try:
        for _ in runner.stream(job, lambda: False):
            pass
    finally:
        runner.close()
