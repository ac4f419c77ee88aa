"""The CPU runner: llama-cpp-python on a GGUF model (the embedded default is SmolLM2-135M-Instruct).

A ``Llama`` object holds one sequence and is not thread-safe, so each loaded model serves one job at
a time behind a lock; jobs waiting for it still notice cancellation. The KV cache is reset before
every job: reusing it across requests makes greedy output depend on the previous request.
"""

from __future__ import annotations

import atexit
import codecs
import ctypes
import os
import secrets
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .base import (
    Constraint,
    Finished,
    GenerationJob,
    PromptRenderer,
    RawEvent,
    RunnerError,
    Sampling,
    TextChunk,
    TokenLogprob,
)

LOCK_POLL_SECONDS = 0.1
# Tokens kept at the end of a budget to close a value that must be whole JSON (``Constraint.close_before_limit``).
CLOSING_RESERVE = 32


def model_path(settings: dict[str, Any]) -> str:
    if path := settings.get("model_path"):
        return str(path)
    package, file = settings.get("package"), settings.get("file")
    if not package or not file:
        raise RunnerError("llama_cpp settings need model_path, or package and file", code="runner_unavailable")
    try:
        located = resources.files(package).joinpath(file)
    except ModuleNotFoundError:
        raise RunnerError(f"the package {package!r} is not installed", code="runner_unavailable") from None
    if not located.is_file():
        raise RunnerError(f"{file!r} is not in the package {package!r}", code="runner_unavailable")
    return str(Path(str(located)))


_loaded: list[Any] = []


@atexit.register
def _close_all() -> None:
    # Closed while the interpreter still works; left to garbage collection at exit, llama.cpp's
    # finalizers run after their module globals are gone and print errors.
    for llm in _loaded:
        llm.close()


def _llama(settings: dict[str, Any], *, vocab_only: bool) -> Any:
    from llama_cpp import Llama

    threads = int(settings.get("n_threads") or min(4, os.cpu_count() or 1))
    try:
        llm = Llama(
            model_path=model_path(settings),
            n_ctx=int(settings.get("n_ctx", 8192)),
            n_threads=threads,
            n_threads_batch=threads,
            vocab_only=vocab_only,
            verbose=False,
        )
    except (ValueError, OSError) as exc:
        raise RunnerError(f"could not load the model: {exc}", code="runner_unavailable") from None
    _loaded.append(llm)
    return llm


JSON_STRING_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


def grammar_for(constraint: Constraint) -> str:
    """A GBNF grammar for the constraint, built from its JSON schema."""
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    if constraint.kind == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    else:
        schema = _root_ref_as_all_of(_anchored(constraint.schema or {}))
    schema = converter.resolve_refs(schema, "schema")
    if constraint.kind == "tool_calls":
        converter.visit(schema, "call")
        # Free text (not starting with a tag), or a tool call in the Hermes format.
        converter._add_rule("free-text", r'[^<\x00] [^\x00]*')
        converter._add_rule("root", r'"<tool_call>\n" call "\n</tool_call>" | free-text')
    else:
        converter.visit(schema, "")
    if "char" in converter._rules:
        # A character of a JSON string: the library's rule also lets raw control characters through, which
        # no JSON parser accepts (a raw line break inside a string), so they must be escaped as JSON says.
        converter._rules["char"] = JSON_STRING_CHAR
    if "dot" in converter._rules:
        # A pattern's "." is any character but a line break; inside a JSON string, not a quote, a backslash or
        # another control character either.
        converter._rules["dot"] = r'[^"\\\x7F\x00-\x1F]'
    return converter.format_grammar()


def schema_problem(schema: dict[str, Any]) -> str | None:
    """Why this runner cannot enforce ``schema``, or None when it can."""
    try:
        grammar_for(Constraint(kind="json_schema", schema=schema))
    except Exception as exc:  # noqa: BLE001  (the converter asserts and raises whatever the schema trips over)
        return str(exc) or type(exc).__name__
    return None


def _root_ref_as_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """``{"$ref": …, "$defs": …}`` (a recursive Pydantic model) as ``allOf``: the converter skips a $ref's siblings."""
    if not isinstance(schema.get("$ref"), str) or len(schema) == 1:
        return schema
    rest = {key: value for key, value in schema.items() if key != "$ref"}
    return {**rest, "allOf": [{"$ref": schema["$ref"]}, *rest.get("allOf", [])]}


# Keywords whose value maps names to subschemas: there, a key called "pattern" is a property's name.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
# Keywords whose value is data, not a schema: left exactly as written.
_DATA = frozenset({"const", "enum", "default", "examples"})


# Any run of characters that needs no escape in a JSON string: what an unanchored side of a pattern allows.
_STRING_CHARS = '[^"\\\\\\x7F\\x00-\\x1F]*'


def _anchored(schema: Any, *, in_map: bool = False) -> Any:
    """The schema with every ``pattern`` anchored at both ends, as the grammar converter needs.

    JSON Schema patterns match anywhere in the string, so an unanchored side allows other text.
    """
    if isinstance(schema, list):
        return [_anchored(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if in_map:
            out[key] = _anchored(value)
        elif key in _DATA:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            head = "" if value.startswith("^") else _STRING_CHARS
            tail = "" if value.endswith("$") and not value.endswith("\\$") else _STRING_CHARS
            core = value[1 if not head else 0 : len(value) - (1 if not tail else 0)]
            out[key] = f"^{head}({core}){tail}$"
        else:
            out[key] = _anchored(value, in_map=key in _SCHEMA_MAPS)
    return out


class _Sampler:
    """Samples the next token, under a grammar when there is one, by rejection.

    Masking the whole vocabulary with the grammar at every step is what llama-cpp-python's own
    sampler does, and it costs ~15x the step itself on a 49k vocabulary. As llama.cpp's own tools do,
    the token is first sampled freely and checked against the grammar alone; only when the grammar
    refuses it is the vocabulary masked and the token sampled again. Output is the same: a token the
    grammar accepts, drawn from the grammar-masked distribution when the free draw was refused.
    """

    def __init__(self, llm: Any, sampling: Sampling, grammar: str | None) -> None:
        from llama_cpp import llama_cpp as lib
        from llama_cpp._internals import LlamaTokenDataArray

        self._lib = lib
        self._llm = llm
        self._chain = llm._init_sampler(
            top_k=0,
            top_p=sampling.top_p,
            min_p=0.0,
            temp=sampling.temperature,
            repeat_penalty=1.0,
            frequency_penalty=sampling.frequency_penalty,
            presence_penalty=sampling.presence_penalty,
            grammar=None,
        )
        self._grammar = (
            lib.llama_sampler_init_grammar(llm._model.vocab, grammar.encode("utf-8"), b"root") if grammar else None
        )
        if grammar and not self._grammar:
            raise RunnerError("the output constraint could not be compiled to a grammar", code="invalid_constraint")
        self._candidates = LlamaTokenDataArray(n_vocab=llm.n_vocab())
        self._single_data = (lib.llama_token_data * 1)()
        self._single = lib.llama_token_data_array(data=self._single_data, size=1, selected=-1, sorted=False)

    def close(self) -> None:
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()

    def _draw(self, logits: np.ndarray, *, masked: bool) -> int:
        candidates = self._candidates
        candidates.copy_logits(logits)
        if masked:
            self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        self._lib.llama_sampler_apply(self._chain.sampler, ctypes.byref(candidates.candidates))
        return int(candidates.candidates_data.id[candidates.candidates.selected])

    def _allowed(self, token: int) -> bool:
        self._single_data[0].id = token  # type: ignore[assignment]  # ctypes converts the int
        self._single_data[0].logit = 1.0
        self._single_data[0].p = 0.0
        self._single.size = 1
        self._single.selected = -1
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(self._single))
        return bool(np.isfinite(self._single_data[0].logit))

    def next(self, *, closing: ClosingVocabulary | None = None) -> int:
        """The next token; with ``closing``, the shortest way to a whole JSON value the grammar allows."""
        llm = self._llm
        logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        if closing is not None and self._grammar:
            token = self._closing(logits, closing)
        else:
            token = self._draw(logits, masked=False)
            if self._grammar and not self._allowed(token):
                token = self._draw(logits, masked=True)
        if self._grammar:
            self._lib.llama_sampler_accept(self._grammar, token)
        self._lib.llama_sampler_accept(self._chain.sampler, token)
        return token


    def _closing(self, logits: np.ndarray, closing: ClosingVocabulary) -> int:
        candidates = self._candidates
        candidates.copy_logits(logits)
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        allowed = candidates.candidates_data.logit
        closers = closing.closers
        if np.isfinite(allowed[closers]).any():
            return int(closers[np.argmax(allowed[closers])])
        # What the grammar still requires (a property's name, say) is spelled in as few tokens as it allows.
        ids = np.flatnonzero(np.isfinite(allowed))
        ids = ids[closing.lengths[ids] == closing.lengths[ids].max()]
        return int(ids[np.argmax(allowed[ids])])


@dataclass(frozen=True)
class ClosingVocabulary:
    """What closing a JSON value takes: tokens that are only closing quotes and brackets (``"``, ``"}``,
    ``]}`` …) or end generation, and every token's length, to spell what the grammar still requires."""

    closers: np.ndarray
    lengths: np.ndarray

    @classmethod
    def of(cls, llm: Any) -> ClosingVocabulary:
        from llama_cpp import llama_cpp as lib

        vocab = llm._model.vocab
        closers, lengths = [], np.zeros(llm.n_vocab(), dtype=np.intc)
        for token in range(llm.n_vocab()):
            text = llm.detokenize([token], special=False).decode("utf-8", errors="replace")
            lengths[token] = len(text)
            if (text.strip() and not text.strip().strip('"]}')) or lib.llama_vocab_is_eog(vocab, token):
                closers.append(token)
        return cls(closers=np.array(closers, dtype=np.intc), lengths=lengths)


def _end_of_generation(llm: Any) -> Callable[[int], bool]:
    from llama_cpp import llama_cpp as lib

    vocab = llm._model.vocab
    return lambda token: bool(lib.llama_vocab_is_eog(vocab, token))


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


class LlamaCppRunner:
    def __init__(self, settings: dict[str, Any]) -> None:
        self._llm = _llama(settings, vocab_only=False)
        self._lock = threading.Lock()
        self._closing: ClosingVocabulary | None = None

    def _closing_vocabulary(self) -> ClosingVocabulary:
        if self._closing is None:
            self._closing = ClosingVocabulary.of(self._llm)
        return self._closing

    def _acquire(self, cancelled: Callable[[], bool]) -> bool:
        while not self._lock.acquire(timeout=LOCK_POLL_SECONDS):
            if cancelled():
                return False
        return True

    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]:
        if not self._acquire(cancelled):
            yield Finished("cancelled", job.prompt_tokens, 0)
            return
        try:
            yield from self._generate(job, cancelled)
        finally:
            self._lock.release()

    def _generate(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]:
        llm = self._llm
        sampling = job.sampling
        prompt = llm.tokenize(job.prompt.encode("utf-8"), add_bos=False, special=True)
        # llama.cpp may round its context up; the library's own token buffer keeps the size asked for.
        context = min(llm.n_ctx(), len(llm.input_ids))
        if len(prompt) + 1 > context:
            raise RunnerError("the prompt does not fit the model's context", code="context_length_exceeded")
        max_tokens = min(sampling.max_tokens, context - len(prompt))
        llm.reset()
        if sampling.seed is not None:
            llm.set_seed(sampling.seed)
        else:
            llm.set_seed(secrets.randbits(32))
        try:
            grammar = grammar_for(job.constraint) if job.constraint else None
        except Exception as exc:  # noqa: BLE001  (see schema_problem: the API process checks schemas before dispatch)
            raise RunnerError(f"the output constraint cannot be enforced: {exc}", code="invalid_constraint") from None
        sampler = _Sampler(llm, sampling, grammar)
        try:
            yield from self._decode(job, prompt, max_tokens, sampler, cancelled)
        finally:
            sampler.close()

    def _decode(
        self, job: GenerationJob, prompt: list[int], max_tokens: int, sampler: _Sampler, cancelled: Callable[[], bool]
    ) -> Iterator[RawEvent]:
        llm = self._llm
        sampling = job.sampling
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stops = sampling.stop
        holdback = max((len(s) for s in stops), default=1) - 1
        # Decoded text not yet sent (it may be the start of a stop sequence), with its tokens.
        pending = ""
        pending_tokens = 0
        pending_logprobs: list[TokenLogprob] = []
        produced = 0
        reason = "length"
        is_end = _end_of_generation(llm)
        closing_from = max_tokens - min(CLOSING_RESERVE, max(12, max_tokens // 3))
        must_close = job.constraint is not None and job.constraint.close_before_limit
        llm.eval(prompt)
        while True:
            closing = must_close and produced >= closing_from
            token = sampler.next(closing=self._closing_vocabulary() if closing else None)
            if cancelled():
                reason = "cancelled"
                break
            if is_end(token):
                reason = "length" if closing else "stop"
                break
            produced += 1
            pending_tokens += 1
            if sampling.logprobs:
                pending_logprobs.append(self._logprob(token, sampling.top_logprobs))
            pending += decoder.decode(llm.detokenize([token], special=False))
            cut = len(pending)
            if stops:
                hit = min((i for s in stops if (i := pending.find(s)) >= 0), default=-1)
                if hit >= 0:
                    pending = pending[:hit]
                    reason = "stop"
                    break
                cut = max(0, len(pending) - holdback)
            if cut:
                yield TextChunk(pending[:cut], pending_tokens, tuple(pending_logprobs))
                pending, pending_tokens, pending_logprobs = pending[cut:], 0, []
            if produced >= max_tokens:
                break
            llm.eval([token])
        if reason != "cancelled":
            pending += decoder.decode(b"", final=True)
            if pending or pending_tokens:
                yield TextChunk(pending, pending_tokens, tuple(pending_logprobs))
        yield Finished(reason, len(prompt), produced)  # type: ignore[arg-type]

    def _logprob(self, token: int, top: int) -> TokenLogprob:
        llm = self._llm
        logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        logprobs = _log_softmax(logits.astype(np.float64))
        text = lambda t: llm.detokenize([t], special=False).decode("utf-8", errors="replace")  # noqa: E731
        best: tuple[tuple[str, float], ...] = ()
        if top:
            ids = np.argpartition(-logprobs, top)[:top]
            ids = ids[np.argsort(-logprobs[ids])]
            best = tuple((text(int(i)), float(logprobs[i])) for i in ids)
        return TokenLogprob(text(token), float(logprobs[token]), best)


def load(settings: dict[str, Any]) -> LlamaCppRunner:
    return LlamaCppRunner(settings)


def renderer(settings: dict[str, Any]) -> PromptRenderer:
    """The GGUF's own chat template, and its tokenizer (loaded without weights) to count."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = _llama(settings, vocab_only=True)
    template = vocab.metadata.get("tokenizer.chat_template")
    if not template:
        raise RunnerError("the GGUF has no chat template", code="runner_unavailable")
    eos = vocab.detokenize([vocab.token_eos()], special=True).decode("utf-8", errors="replace")
    bos_id = vocab.token_bos()
    bos = vocab.detokenize([bos_id], special=True).decode("utf-8", errors="replace") if bos_id >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    native_tools = "tools" in template

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return formatter(messages=messages, tools=tools).prompt  # type: ignore[arg-type]  # plain dicts of that shape

    def count_tokens(text: str) -> int:
        return len(vocab.tokenize(text.encode("utf-8"), add_bos=False, special=True))

    return PromptRenderer(
        render=render, count_tokens=count_tokens, native_tools=native_tools, schema_problem=schema_problem
    )



def self_test(settings: dict[str, Any]) -> None:
    """One short generation: what a native library built for another CPU crashes on (see ``engine.preflight``)."""
    runner = LlamaCppRunner(settings)
    prompt = "The three largest rivers of Oregon are the Columbia, the Snake and the"
    job = GenerationJob(
        job_id="self-test",
        model_id="self-test",
        runner="llama_cpp",
        runner_settings=settings,
        prompt=prompt,
        prompt_tokens=0,
        sampling=Sampling(max_tokens=4, temperature=0.0),
    )
    for _ in runner.stream(job, lambda: False):
        pass
