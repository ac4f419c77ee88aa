"""The fiction behind the stand-in: a toy tokenizer and a toy in-flight-batching engine.

The model is not real: it replaces the weights and the GPU so that tests can check text, token
counts, stop strings, ``max_tokens``, guided JSON, cancellation and concurrency. The scheduling
around it follows TensorRT-LLM's PyTorch executor, each rule from the file named where it is kept:

- ``ToyTokenizer`` behaves like a Hugging Face tokenizer whose tokens are runs of non-space
  characters together with the whitespace before them, so ``decode(encode(text)) == text``. A run
  with a non-ASCII character is spelled byte by byte instead, as SentencePiece's byte fallback
  spells what is not in its vocabulary (``<0xF0>``): ``decode`` of one such token is ``"\ufffd"``.
  ``<s>`` (BOS) is added by ``encode`` when ``add_special_tokens`` is true. ``<|end_of_turn|>`` is a second
  special token that ends a turn, not the tokenizer's ``eos_token``: the toy model writes it where its prompt says
  ``{end_of_turn}``, and the engine stops there only when it is among the request's ``stop_token_ids``
  (``SamplingParams._setup`` takes the end id from the tokenizer alone). Under a guide too: xgrammar knows no end
  but the tokenizer's end of sequence (``_xgrammar_tokenizer_info``: ``stop_token_ids = [tokenizer.eos_token_id]``)
  and reads any other token by its text from the vocabulary, so inside a JSON string it admits
  ``<|end_of_turn|>`` as those characters.
- ``ToyExecutor`` runs in its own thread, like the real executor's loop. A request's output is planned
  when it is submitted: the prompt's words echoed, where a word written as a choice, ``{heads|tails}``,
  is one the toy model is unsure of. Greedy decoding (``SamplingParams._greedy_decoding``) writes the
  first alternative; sampling draws one, at the step that writes it, from the sampler's generator:
  the ``TorchSampler`` (the default) has one for the whole engine, seeded 42 when it is built, and
  reads no request's seed (``_torch/pyexecutor/sampler.py``: ``_global_seed = 42``, ``get_generator``;
  ``_request_get_sampling_params`` takes only temperature, top_p and top_k); the C++ sampler
  (``sampler_type="TRTLLMSampler"``) seeds each request with its seed, 0 when it has none (the C++
  runtime's default, ``DefaultDecodingParams::getSeed``). Under a JSON guide (a schema, or ``json_object``)
  the echo stays when the guide's grammar, compiled by the real xgrammar as TensorRT-LLM compiles it,
  admits it (a model follows its prompt wherever the mask lets it), and otherwise becomes a minimal
  instance of the schema (``"{}"`` for ``json_object``). Under an EBNF grammar the echo is kept as far as the
  grammar admits it, then the first characters that keep it admissible (quotes, closing brackets and separators
  first, then opening brackets, then digits, letters and last a backslash) are written until the grammar is done
  with it. Under a ``triggered_tags`` structural tag the output is its first tag wrapped around a minimal instance
  of the tag's schema, or what its grammar admits, written as above (the toy model "calls the first tool").
  Requests wait in a queue until one of ``max_batch_size`` places is free; each step produces one
  token for every active request and delivers a response to it.
- When the plan is written out and ``max_tokens`` is not reached, the next step generates the end of
  sequence and ends the request with ``END_ID``. The ``TorchSampler`` adds that token to the output, as
  it adds every sampled token before it checks the stop criteria (``update_requests``: ``add_token``,
  then ``finish_if_reason``), logprob included; the C++ sampling kernels do not count it in the
  sequence length ("Seq len should always contain only tokens to be outputted"), so the final
  response carries no token.
- Guides are compiled with the real ``xgrammar`` when their request is scheduled, and a guide that
  does not compile fails every active request, not just its own (``py_executor.py``).
- A request aborted while it waits is dropped without any response; one that is active ends at the
  next step with ``CANCELLED`` (``py_executor.py``, ``executor_request_queue.py``).
- Stop strings are matched on token ids by the engine, which then ends the request with
  ``STOP_WORDS`` (the C++ runtime's stop words; the result cuts them, ``executor/result.py``).
- With ``KvCacheConfig.enable_block_reuse`` (the default), a finished request's blocks stay in the
  cache: a later prompt that begins with the same tokens reuses its whole blocks, never its last
  token, and every response says how many prompt tokens that was (``cached_tokens``).
- ``STEP_SECONDS`` is the time a step takes; tests raise it to keep a request in flight.
"""

from __future__ import annotations

import json
import queue
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from .executor.result import CANCELLED, END_ID, LENGTH, STOP_WORDS, Logprob
from .executor.utils import RequestError
from .sampling_params import GuidedDecodingParams, SamplingParams

STEP_SECONDS = 0.001
# KV cache blocks are reused whole; 32 tokens is TensorRT-LLM's default block size.
TOKENS_PER_BLOCK = 32
# The toy model's config.json: what TensorRT-LLM falls back to when LLM() is given no max_seq_len.
MAX_POSITION_EMBEDDINGS = 4096

# Tokens the toy model ranks after its likeliest ones, as top logprobs.
_ALTERNATIVES = ("the", "a", "of", "and", "to")
# A prompt word the toy model is unsure how to echo: "{heads|tails}".
_CHOICE = re.compile(r"\{(\w+(?:\|\w+)+)\}")
# Where a prompt says this word, the toy model writes its end-of-turn token (``ToyTokenizer.end_of_turn``).
END_OF_TURN_WORD = "{end_of_turn}"
END_OF_TURN_ID = 3
# TorchSampler._global_seed: the seed of the one generator every request of the engine draws from.
TORCH_SAMPLER_SEED = 42


class ToyTokenizer:
    pad_token = "<pad>"
    bos_token = "<s>"
    eos_token = "</s>"
    # A special token that ends a turn without being the tokenizer's end of sequence (as Gemma's <end_of_turn>):
    # the model's generation_config.json lists both as end tokens.
    end_of_turn = "<|end_of_turn|>"
    _PIECE = re.compile(r"\s*\S+|\s+")
    _BYTE = re.compile(r"<0x([0-9A-F]{2})>")
    _SPECIAL = re.compile(r"(<pad>|<s>|</s>|<\|end_of_turn\|>)")

    def __init__(self, name_or_path: str = "toy") -> None:
        self.name_or_path = name_or_path
        self._lock = threading.Lock()
        self._pieces: list[str] = [self.pad_token, self.bos_token, self.eos_token, self.end_of_turn]
        self._ids: dict[str, int] = {piece: i for i, piece in enumerate(self._pieces)}

    @property
    def pad_token_id(self) -> int:
        return 0

    @property
    def bos_token_id(self) -> int:
        return 1

    @property
    def eos_token_id(self) -> int:
        return 2

    @property
    def all_special_ids(self) -> list[int]:
        return [0, 1, 2, 3]

    def _id(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    @property
    def all_special_tokens(self) -> list[str]:
        return [self.pad_token, self.bos_token, self.eos_token, self.end_of_turn]

    def encode(
        self, text: str, add_special_tokens: bool = True, *, split_special_tokens: bool = False, **_: Any
    ) -> list[int]:
        """As a Hugging Face tokenizer encodes: the special tokens written in ``text`` are split out as themselves,
        unless ``split_special_tokens``, and the rest is split into pieces."""
        ids: list[int] = []
        for part in [text] if split_special_tokens else self._SPECIAL.split(text):
            if part in self.all_special_tokens and not split_special_tokens:
                ids.append(self._ids[part])
                continue
            for piece in self._PIECE.findall(part):
                # A special token's text read as text is spelled in bytes, never the special token's id.
                plain = piece.isascii() and piece not in self.all_special_tokens
                tokens = [piece] if plain else [f"<0x{b:02X}>" for b in piece.encode()]
                ids += [self._id(token) for token in tokens]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        pieces = self.convert_ids_to_tokens(token_ids, skip_special_tokens=skip_special_tokens)
        data = b"".join(
            bytes([int(byte[1], 16)]) if (byte := self._BYTE.fullmatch(piece)) else piece.encode() for piece in pieces
        )
        return data.decode(errors="replace")

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> list[str]:
        ids = [ids] if isinstance(ids, int) else list(ids)
        with self._lock:
            return [self._pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)]

    def get_vocab(self) -> dict[str, int]:
        with self._lock:
            return dict(self._ids)


def minimal_instance(schema: Any, root: Any = None) -> Any:
    """The smallest JSON value a JSON schema accepts, for the schemas the platform sends."""
    root = schema if root is None else root
    if not isinstance(schema, dict):
        return None
    if "$ref" in schema:
        if not schema["$ref"].startswith("#"):
            raise ValueError(f"cannot resolve $ref {schema['$ref']!r}: only local references are supported")
        target: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            if part:
                target = target[part]
        return minimal_instance(target, root)
    if "const" in schema:
        return schema["const"]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf"):
        if schema.get(key):
            return minimal_instance(schema[key][0], root)
    if schema.get("allOf"):
        merged: dict[str, Any] = {}
        for part in schema["allOf"]:
            merged.update(part)
        return minimal_instance({**merged, **{k: v for k, v in schema.items() if k != "allOf"}}, root)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind is None:
        kind = "object" if "properties" in schema else "array" if "items" in schema else "null"
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: minimal_instance(properties.get(name, {}), root) for name in schema.get("required", [])}
    if kind == "array":
        return [minimal_instance(schema.get("items", {}), root) for _ in range(schema.get("minItems", 0))]
    if kind == "string":
        return "a" * schema.get("minLength", 0)
    if kind in ("integer", "number"):
        low = schema.get("minimum")
        if low is None and "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        if low is None:
            high = schema.get("maximum", schema.get("exclusiveMaximum", 1) - 1)
            low = min(0, high)
        return int(low) if kind == "integer" else low
    if kind == "boolean":
        return False
    return None


def _first_tag_instance(structural_tag: dict[str, Any]) -> str:
    """What the toy model writes under a ``triggered_tags`` structural tag: its first tag, filled in."""
    first = structural_tag["format"]["tags"][0]
    content = first["content"]
    if content["type"] == "grammar":
        return first["begin"] + grammar_instance(xgrammar.Grammar.from_ebnf(content["grammar"])) + first["end"]
    return first["begin"] + json.dumps(minimal_instance(content["json_schema"])) + first["end"]


def compile_guide(guide: GuidedDecodingParams, backend: str = "xgrammar") -> xgrammar.Grammar:
    """Compile a guide as ``XGrammarMatcherFactory.create`` does (``_torch/pyexecutor/grammar_matcher.py``).

    The guide types are checked in the order ``SamplingParams._get_guided_decoding_params`` checks
    them (``json_object`` first). ``json_object`` is ``GuideType.JSON``, for which xgrammar compiles its
    builtin JSON grammar (``compile_builtin_json_grammar``), whose root is an object *or an array*; the
    llguidance factory compiles ``'{"type": "object"}'`` instead.

    With the ``llguidance`` backend, ``LLGuidanceMatcherFactory.create`` has no case for a structural
    tag and raises ``ValueError("Unsupported guide type: ...")``; its other guides are compiled here
    with xgrammar all the same (llguidance is not installed for the tests).

    The real factory calls ``compile_json_schema`` / ``compile_builtin_json_grammar`` /
    ``compile_structural_tag`` on the guide string; those convert it to a grammar (what is done
    here) and then build the token mask cache for the tokenizer, which the toy has no use for.
    Since xgrammar 0.1.25 the structural tag string is handed over as it is, so only the
    ``{"type": "structural_tag", "format": ...}`` form compiles.
    """
    if backend == "llguidance" and guide.structural_tag is not None:
        raise ValueError("Unsupported guide type: GuideType.STRUCTURAL_TAG.")
    if guide.json_object:
        if backend == "llguidance":
            return xgrammar.Grammar.from_json_schema('{"type": "object"}')
        return xgrammar.Grammar.builtin_json_grammar()
    if guide.json is not None:
        return xgrammar.Grammar.from_json_schema(guide.json if isinstance(guide.json, str) else json.dumps(guide.json))
    if guide.regex is not None:
        return xgrammar.Grammar.from_regex(guide.regex)
    if guide.grammar is not None:
        return xgrammar.Grammar.from_ebnf(guide.grammar)
    if guide.structural_tag is not None:
        return xgrammar.Grammar.from_structural_tag(guide.structural_tag)
    raise ValueError(f"Unsupported guide type: {guide}.")


# The characters the toy model tries, in order, to finish what an EBNF guide cut short.
_FINISHING: Final = '"}],:{[0123456789 .-abcdefghijklmnopqrstuvwxyz\\'


def grammar_instance(grammar: xgrammar.Grammar, text: str = "") -> str:
    """What the toy model writes under an EBNF grammar: ``text`` as far as the grammar admits it, then, a character
    at a time, the first of ``_FINISHING`` that the grammar admits, until it accepts the whole (at most 256 more)."""

    def viable(prefix: str) -> bool:
        return bool(_is_grammar_accept_string(grammar, prefix, require_termination=False))

    written = ""
    for character in text:
        if not viable(written + character):
            break
        written += character
    for _ in range(256):
        if _is_grammar_accept_string(grammar, written):
            break
        following = next((c for c in _FINISHING if viable(written + c)), None)
        if following is None:
            break
        written += following
    return written


def admits(guide: GuidedDecodingParams, text: str, backend: str = "xgrammar") -> bool:
    """Whether the guide's grammar, as the real xgrammar compiles it, accepts ``text`` as a whole output."""
    try:
        grammar = compile_guide(guide, backend)
    except Exception:  # noqa: BLE001  (a guide that does not compile fails the batch when it is scheduled)
        return False
    # xgrammar's own test helper: a matcher over the grammar, fed the text byte by byte.
    return bool(_is_grammar_accept_string(grammar, text))


@dataclass(slots=True)
class EngineResponse:
    request_id: int
    token_ids: list[int]
    finish_reason: str | None
    is_final: bool
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None
    # Prompt tokens whose KV cache blocks were reused (``LlmResult.cached_tokens``), sent with every response.
    cached_tokens: int = 0


@dataclass(slots=True)
class _Slot:
    request_id: int
    plan: list[int]
    max_tokens: int
    top_logprobs: int | None
    deliver: Callable[[EngineResponse], None]
    guide: GuidedDecodingParams | None = None
    stop_words: list[list[int]] = field(default_factory=list)
    error: str | None = None
    aborted: bool = False
    alternatives: list[int] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    # Plan positions where the toy model is unsure: the alternatives' token ids, the first the likeliest.
    choices: dict[int, list[int]] = field(default_factory=dict)
    # What sampling draws from; None under greedy decoding.
    generator: random.Random | None = None
    end_id: int = 0
    # Whether the end-of-sequence token joins the output (TorchSampler) or not (the C++ sampler).
    outputs_end_id: bool = True
    # Whether logprobs are the sampled token's alone, ranked 1 whatever its rank (the C++ sampler), or the top k.
    sampled_logprob_only: bool = False
    # The tokens generated so far.
    output: list[int] = field(default_factory=list)

    def step(self) -> EngineResponse:
        response = self._step()
        if response.error is None:
            response.cached_tokens = self.cached_tokens
        return response

    def _step(self) -> EngineResponse:
        if self.error is not None:
            return EngineResponse(self.request_id, [], None, True, error=self.error)
        if self.aborted:
            return EngineResponse(self.request_id, [], CANCELLED, True)
        if self.max_tokens <= 0:
            return EngineResponse(self.request_id, [], LENGTH, True)
        if len(self.output) == len(self.plan):
            if not self.outputs_end_id:
                return EngineResponse(self.request_id, [], END_ID, True)
            logprobs = self._logprobs(self.end_id, self.end_id)
            self.output.append(self.end_id)
            return EngineResponse(self.request_id, [self.end_id], END_ID, True, logprobs=logprobs)
        likeliest = self.plan[len(self.output)]
        token = self._next_token()
        logprobs = self._logprobs(likeliest, token)
        self.output.append(token)
        finish = LENGTH if len(self.output) >= self.max_tokens else None
        # The runtime looks for stop words in the generated ids after every token.
        if any(words and self.output[-len(words) :] == words for words in self.stop_words):
            finish = STOP_WORDS
        return EngineResponse(self.request_id, [token], finish, finish is not None, logprobs=logprobs)

    def _next_token(self) -> int:
        at = len(self.output)
        alternatives = self.choices.get(at)
        if not alternatives:
            return self.plan[at]
        if self.generator is None:
            return alternatives[0]
        return self.generator.choice(alternatives)

    def _logprobs(self, likeliest: int, sampled: int) -> list[dict[int, Logprob]] | None:
        """The next position's top ``top_logprobs`` tokens, taken before sampling (1.2's ``TorchSampler``:
        ``torch.topk`` over the log-softmax, then ``handle_logprobs``): its likeliest token first (the plan's, or the
        first of a choice), then a choice's other words, then the alternatives. A token sampled outside them is not
        among them. The C++ sampler gives the sampled token's logprob alone, as rank 1, however many were asked for
        (``TRTLLMSampler.update_requests_single_beam_single_step``)."""
        if not self.top_logprobs:
            return None
        ranked = dict.fromkeys([*(self.choices.get(len(self.output)) or [likeliest]), *self.alternatives])
        entry = {token: Logprob(logprob=-0.25 - rank, rank=rank + 1) for rank, token in enumerate(ranked)}
        if self.sampled_logprob_only:
            return [{sampled: Logprob(logprob=entry[sampled].logprob if sampled in entry else -9.0, rank=1)}]
        return [dict(list(entry.items())[: self.top_logprobs])]


class ToyExecutor:
    def __init__(
        self,
        tokenizer: ToyTokenizer,
        *,
        max_batch_size: int,
        guided_decoding_backend: str | None,
        enable_block_reuse: bool = True,
        sampler: str = "TorchSampler",
    ) -> None:
        self._tokenizer = tokenizer
        self._sampler = sampler
        # The TorchSampler's generator lives as long as the engine and serves every request in turn.
        self._torch_generator = random.Random(TORCH_SAMPLER_SEED)
        self._max_batch_size = max_batch_size
        self._guided_decoding_backend = guided_decoding_backend
        self._enable_block_reuse = enable_block_reuse
        # The token sequences of finished requests whose KV cache blocks stay around for reuse.
        self._reusable: deque[list[int]] = deque(maxlen=64)
        self._cond = threading.Condition()
        self._waiting: deque[_Slot] = deque()
        self._active: dict[int, _Slot] = {}
        self._last_id = 0
        self._shutdown = False
        # What the executor's background threads fail with (the engine's loop, CUDA): executor.py's ``_error_queue``.
        self._error_queue: queue.Queue[Exception] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="toy-tensorrt-llm-engine", daemon=True)
        self._thread.start()

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        deliver: Callable[[EngineResponse], None],
        *,
        error: str | None = None,
    ) -> int:
        """Queues a request; ``error`` is what the executor refused it for as it enqueued it, sent as its response."""
        plan, choices, guide_error = self._plan(prompt_token_ids, params)
        error = error or guide_error
        generator: random.Random | None
        if params._greedy_decoding:
            generator = None
        elif self._sampler == "TRTLLMSampler":
            generator = random.Random(params.seed if params.seed is not None else 0)
        else:
            generator = self._torch_generator
        with self._cond:
            self._last_id += 1
            slot = _Slot(
                self._last_id,
                plan,
                max_tokens,
                params.logprobs,
                deliver,
                guide=params.guided_decoding,
                stop_words=params._get_stop_words(),
                error=error,
                prompt=list(prompt_token_ids),
                choices=choices,
                generator=generator,
                end_id=params.end_id if params.end_id is not None else self._tokenizer.eos_token_id,
                outputs_end_id=self._sampler == "TorchSampler",
                sampled_logprob_only=self._sampler == "TRTLLMSampler",
            )
            slot.alternatives = [self._tokenizer._id(" " + word) for word in _ALTERNATIVES]
            self._waiting.append(slot)
            self._cond.notify_all()
            return slot.request_id

    def abort_request(self, request_id: int) -> None:
        with self._cond:
            slot = self._active.get(request_id)
            if slot is not None:
                slot.aborted = True
                return
            # ExecutorRequestQueue.update_waiting_queue: a cancelled request that is still waiting is
            # removed from the queue, and nothing is ever sent for it.
            self._waiting = deque(s for s in self._waiting if s.request_id != request_id)

    def is_shutdown(self) -> bool:
        return self._shutdown

    def _handle_background_error(self, error: str | None = None) -> None:
        """``executor.py``'s, which every result calls as it handles a response: a request's own error string is
        raised as ``RequestError``; an error a background thread queued shuts the executor down first, and is then
        raised to whichever result handles a response next."""
        if error is not None:
            raise RequestError(error)
        if not self._error_queue.empty():
            exc = self._error_queue.get()
            self.shutdown()
            raise exc

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _plan(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], dict[int, list[int]], str | None]:
        """The tokens the toy model writes, the positions where it is unsure (their alternatives), and
        the request's error."""
        words = self._tokenizer.decode(prompt_token_ids, skip_special_tokens=True).split()
        guide = params.guided_decoding
        if guide is None:
            plan, choices = self._echo(words)
            return plan, choices, None
        # To the grammar the end-of-turn token is its text; where the guide admits that, the toy model writes it.
        text = " ".join(words).replace(END_OF_TURN_WORD, self._tokenizer.end_of_turn)
        if self._guided_decoding_backend is None:
            return [], {}, "Guided decoding requested, but the LLM was built without guided_decoding_backend."
        if guide.json_object or guide.json is not None:
            if not admits(guide, text, self._guided_decoding_backend):
                text = "{}"
                if not guide.json_object and guide.json is not None:
                    schema = json.loads(guide.json) if isinstance(guide.json, str) else guide.json
                    try:
                        text = json.dumps(minimal_instance(schema))
                    except (ValueError, KeyError, TypeError, IndexError):
                        pass  # xgrammar decides whether the schema compiles, when it is scheduled
        elif guide.grammar is not None:
            text = grammar_instance(compile_guide(guide, self._guided_decoding_backend), text)
        elif guide.structural_tag is not None:
            try:
                text = _first_tag_instance(json.loads(guide.structural_tag))
            except (ValueError, KeyError, TypeError, IndexError):
                text = ""
        return self._tokenizer.encode(text, add_special_tokens=False), {}, None

    def _echo(self, words: list[str]) -> tuple[list[int], dict[int, list[int]]]:
        plan: list[int] = []
        choices: dict[int, list[int]] = {}
        for n, word in enumerate(words):
            space = " " if n else ""
            if word == END_OF_TURN_WORD:
                plan.append(END_OF_TURN_ID)
            elif choice := _CHOICE.fullmatch(word):
                alternatives = [self._tokenizer._id(space + alternative) for alternative in choice[1].split("|")]
                choices[len(plan)] = alternatives
                plan.append(alternatives[0])
            else:
                plan += self._tokenizer.encode(space + word, add_special_tokens=False)
        return plan, choices

    def _schedule(self) -> str | None:
        """Move waiting requests into free places; the error of a guide that fails to compile, if any."""
        error: str | None = None
        while self._waiting and len(self._active) < self._max_batch_size:
            slot = self._waiting.popleft()
            self._active[slot.request_id] = slot
            slot.cached_tokens = self._reused_tokens(slot.prompt)
            if slot.guide is not None and slot.error is None and error is None:
                try:
                    compile_guide(slot.guide, self._guided_decoding_backend or "xgrammar")
                except Exception as exc:  # noqa: BLE001  (xgrammar raises whatever the guide trips over)
                    error = str(exc)
        return error

    def _reused_tokens(self, prompt: list[int]) -> int:
        """How many of a prompt's tokens the KV cache already holds: the whole blocks of its longest prefix
        shared with a finished request, less at least the last prompt token, which must be computed."""
        if not self._enable_block_reuse:
            return 0
        shared = 0
        for tokens in self._reusable:
            same = 0
            for a, b in zip(prompt, tokens, strict=False):
                if a != b:
                    break
                same += 1
            shared = max(shared, same)
        return min(shared, len(prompt) - 1) // TOKENS_PER_BLOCK * TOKENS_PER_BLOCK

    def _handle_errors(self, error_msg: str) -> list[tuple[_Slot, EngineResponse]]:
        """PyExecutor._handle_errors: every active request is failed with the same message."""
        failed = [
            (slot, EngineResponse(slot.request_id, [], None, True, error=error_msg)) for slot in self._active.values()
        ]
        self._active.clear()
        return failed

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._active and not self._shutdown:
                    self._cond.wait()
                if self._shutdown:
                    return
                error = self._schedule()
                if error is not None:
                    # The guided decoder runs for the whole batch, with no guard around one request.
                    results = self._handle_errors(error)
                else:
                    results = [(slot, slot.step()) for slot in list(self._active.values())]
                    for slot, response in results:
                        if response.is_final:
                            self._active.pop(slot.request_id, None)
                            if response.error is None and self._enable_block_reuse:
                                self._reusable.append(slot.prompt + slot.output)
            for slot, response in results:
                slot.deliver(response)
            time.sleep(STEP_SECONDS)
