"""The fiction behind the stand-in: a toy tokenizer and a toy in-flight-batching engine.

Nothing here exists in TensorRT-LLM. It replaces the model and the C++ executor so that tests can
check text, token counts, stop strings, ``max_tokens``, guided JSON, cancellation and concurrency:

- ``ToyTokenizer`` behaves like a Hugging Face tokenizer whose tokens are runs of non-space
  characters together with the whitespace before them, so ``decode(encode(text)) == text``.
  ``<s>`` (BOS) is added by ``encode`` when ``add_special_tokens`` is true.
- ``ToyExecutor`` runs in its own thread, like the real executor's worker. Each step it produces one
  token for every request in flight (up to ``max_batch_size``) and delivers a response to that
  request's result object. A request's output is fixed when it is submitted: the prompt's words
  echoed, or, under guided decoding, a minimal instance of the JSON schema (``"{}"`` for a JSON
  object), or for a ``triggered_tags`` structural tag its first tag wrapped around a minimal
  instance of the tag's schema (the toy model "calls the first tool"). A schema xgrammar could not
  compile (a remote ``$ref``) or a malformed structural tag fails the request, as xgrammar would.
  Regex and EBNF guides are accepted but not enforced. ``abort_request`` ends a request at the
  next step with ``CANCELLED``.
- ``STEP_SECONDS`` is the time a step takes; tests raise it to keep a request in flight.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .executor.result import CANCELLED, END_ID, LENGTH, Logprob
from .sampling_params import SamplingParams

STEP_SECONDS = 0.001

# Alternatives offered as top logprobs besides the token that was "sampled".
_ALTERNATIVES = ("the", "a", "of", "and", "to")


class ToyTokenizer:
    pad_token = "<pad>"
    bos_token = "<s>"
    eos_token = "</s>"
    _PIECE = re.compile(r"\s*\S+|\s+")

    def __init__(self, name_or_path: str = "toy") -> None:
        self.name_or_path = name_or_path
        self._lock = threading.Lock()
        self._pieces: list[str] = [self.pad_token, self.bos_token, self.eos_token]
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
        return [0, 1, 2]

    def _id(self, piece: str) -> int:
        with self._lock:
            if piece not in self._ids:
                self._ids[piece] = len(self._pieces)
                self._pieces.append(piece)
            return self._ids[piece]

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        ids = [self._id(piece) for piece in self._PIECE.findall(text)]
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, token_ids: int | list[int], skip_special_tokens: bool = False, **_: Any) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)
        with self._lock:
            pieces = [self._pieces[i] for i in ids if not (skip_special_tokens and i in self.all_special_ids)]
        return "".join(pieces)

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
    if structural_tag["type"] != "structural_tag" or structural_tag["format"]["type"] != "triggered_tags":
        raise ValueError("the stand-in knows only a structural_tag of triggered_tags")
    triggers, tags = structural_tag["format"]["triggers"], structural_tag["format"]["tags"]
    for tag in tags:
        if not any(tag["begin"].startswith(trigger) for trigger in triggers):
            raise ValueError(f"tag begin {tag['begin']!r} does not start with a trigger")
        if tag["content"]["type"] != "json_schema":
            raise ValueError("the stand-in knows only json_schema tag content")
    first = tags[0]
    return first["begin"] + json.dumps(minimal_instance(first["content"]["json_schema"])) + first["end"]


@dataclass(slots=True)
class EngineResponse:
    request_id: int
    token_ids: list[int]
    finish_reason: str | None
    is_final: bool
    logprobs: list[dict[int, Logprob]] | None = None
    error: str | None = None


@dataclass(slots=True)
class _Slot:
    request_id: int
    plan: list[int]
    max_tokens: int
    top_logprobs: int | None
    deliver: Callable[[EngineResponse], None]
    error: str | None = None
    aborted: bool = False
    produced: int = 0
    alternatives: list[int] = field(default_factory=list)

    def step(self) -> EngineResponse:
        if self.error is not None:
            return EngineResponse(self.request_id, [], None, True, error=self.error)
        if self.aborted:
            return EngineResponse(self.request_id, [], CANCELLED, True)
        if self.produced >= len(self.plan):
            return EngineResponse(self.request_id, [], END_ID, True)
        token = self.plan[self.produced]
        self.produced += 1
        finish = LENGTH if self.produced >= self.max_tokens else END_ID if self.produced == len(self.plan) else None
        logprobs = None
        if self.top_logprobs:
            entry = {token: Logprob(logprob=-0.25, rank=1)}
            for rank, alternative in enumerate((a for a in self.alternatives if a != token), start=2):
                if rank > self.top_logprobs:
                    break
                entry[alternative] = Logprob(logprob=-0.25 - rank, rank=rank)
            logprobs = [entry]
        return EngineResponse(self.request_id, [token], finish, finish is not None, logprobs=logprobs)


class ToyExecutor:
    def __init__(self, tokenizer: ToyTokenizer, *, max_batch_size: int, guided_decoding_backend: str | None) -> None:
        self._tokenizer = tokenizer
        self._max_batch_size = max_batch_size
        self._guided_decoding_backend = guided_decoding_backend
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}
        self._last_id = 0
        self._shutdown = False
        self._thread = threading.Thread(target=self._run, name="toy-tensorrt-llm-engine", daemon=True)
        self._thread.start()

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, deliver: Callable[[EngineResponse], None]
    ) -> int:
        plan, error = self._plan(prompt_token_ids, params)
        with self._cond:
            self._last_id += 1
            slot = _Slot(self._last_id, plan, params.max_tokens, params.logprobs, deliver, error=error)
            slot.alternatives = [self._tokenizer._id(" " + word) for word in _ALTERNATIVES]
            self._slots[slot.request_id] = slot
            self._cond.notify_all()
            return slot.request_id

    def abort_request(self, request_id: int) -> None:
        with self._cond:
            slot = self._slots.get(request_id)
            if slot is not None:
                slot.aborted = True

    def is_shutdown(self) -> bool:
        return self._shutdown

    def shutdown(self) -> None:
        with self._cond:
            self._shutdown = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=5)

    def _plan(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
        words = self._tokenizer.decode(prompt_token_ids, skip_special_tokens=True).split()
        text = " ".join(words)
        guide = params.guided_decoding
        if guide is not None:
            if self._guided_decoding_backend is None:
                return [], "Guided decoding requested, but the LLM was built without guided_decoding_backend."
            try:
                if guide.json is not None:
                    schema = json.loads(guide.json) if isinstance(guide.json, str) else guide.json
                    text = json.dumps(minimal_instance(schema))
                elif guide.json_object:
                    text = "{}"
                elif guide.structural_tag is not None:
                    text = _first_tag_instance(json.loads(guide.structural_tag))
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                return [], f"xgrammar: cannot compile the guide: {exc}"
        return self._tokenizer.encode(text, add_special_tokens=False), None

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._slots and not self._shutdown:
                    self._cond.wait()
                if self._shutdown:
                    return
                batch = list(self._slots.values())[: self._max_batch_size]
            for slot in batch:
                response = slot.step()
                if response.is_final:
                    with self._cond:
                        self._slots.pop(slot.request_id, None)
                slot.deliver(response)
            time.sleep(STEP_SECONDS)
