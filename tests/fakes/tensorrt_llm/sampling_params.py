"""Mirrors ``tensorrt_llm/sampling_params.py``: the fields the runner sets, with the real defaults.

The LLM API checks a few ranges itself when the object is built (``_validate``: 0 <= top_p <= 1,
top_k >= 0, temperature >= 0, a ``ValueError``); the rest, and top_p 0, are checked when the request
is turned into the C++ runtime's ``SamplingConfig`` (``cpp/tensorrt_llm/executor/samplingConfig.cpp``)
on the executor's side, so such a value fails the request rather than the constructor.

``seed`` None is documented as "using C++ runtime default 0"; which sampler reads the seed at all is
the executor's matter (``_toy.py``). ``_greedy_decoding`` is the real property (``params_imply_greedy_decoding``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        # The real class rejects more than one guide in ``_validate``; an empty one is accepted there
        # but guides nothing, which in this platform can only be a bug, so the stand-in refuses it too.
        count = sum(bool(getattr(self, f.name)) for f in fields(self))
        if count != 1:
            raise ValueError(f"Only one guide can be used for a request, but got {count}.")

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    _stop_word_ids: list[list[int]] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        self._validate()

    def _validate(self) -> None:
        # The LLM API's own range checks, at construction; top_p 0 passes here and is refused by the
        # runtime's SamplingConfig instead (``_sampling_config_error``).
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}")
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        # As in the real class: users may pass logprobs=True for top-1 logprobs.
        self.logprobs = self.logprobs and int(self.logprobs)
        self.prompt_logprobs = self.prompt_logprobs and int(self.prompt_logprobs)

    @staticmethod
    def params_imply_greedy_decoding(*, temperature: float | None, top_p: float | None, top_k: int | None) -> bool:
        return (
            (temperature is None and top_p is None and top_k is None) or top_k == 1 or top_p == 0.0 or temperature == 0
        )

    @property
    def _greedy_decoding(self) -> bool:
        return not self.use_beam_search and self.params_imply_greedy_decoding(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )

    def _setup(self, tokenizer: Any, add_special_tokens: bool = False) -> SamplingParams:
        if self.end_id is None:
            self.end_id = tokenizer.eos_token_id
            self.pad_id = tokenizer.pad_token_id
            if self.pad_id is None:
                self.pad_id = self.end_id
        if self.stop is not None:
            strs = [self.stop] if isinstance(self.stop, str) else self.stop
            self._stop_word_ids = [tokenizer.encode(s, add_special_tokens=add_special_tokens) for s in strs]
        return self

    def _get_stop_words(self) -> list[list[int]]:
        """The token ids the runtime stops on: each stop token id alone, then one list per stop string, as
        ``_setup`` encoded them."""
        return [[i] for i in self.stop_token_ids or []] + list(self._stop_word_ids or [])

    def _get_stop_reasons_and_words(self) -> list[tuple[str | int, list[int]]]:
        """Each stop token id and stop string with the ids the runtime stops on for it."""
        stop_reasons: list[str | int] = list(self.stop_token_ids or [])
        stop_reasons += [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return list(zip(stop_reasons, self._get_stop_words(), strict=False))

    def _sampling_config_error(self) -> str | None:
        """What ``SamplingConfig``'s checks (``samplingConfig.cpp``: checkTopK, checkTopP, checkTemperature, …) refuse.

        ``base_worker.py`` builds the config in ``_enqueue_request`` and turns the failed
        ``TLLM_CHECK`` into a ``RequestError`` for this request.
        """
        checks = [
            (self.top_k is None or self.top_k >= 0, "topK.value() >= 0"),
            (self.top_p is None or 0 < self.top_p <= 1, "topP.value() > 0.f && topP.value() <= 1.f"),
            (self.temperature is None or self.temperature >= 0, "temperature.value() >= 0.f"),
            (self.min_tokens is None or self.min_tokens >= 0, "minTokens.value() >= 0"),
            (self.repetition_penalty is None or self.repetition_penalty > 0, "repetitionpenalty.value() > 0.f"),
            # RandomSeedType is std::uint64_t: the binding takes no other integer.
            (self.seed is None or 0 <= self.seed < 2**64, "seed is an unsigned 64-bit integer"),
        ]
        for ok, condition in checks:
            if not ok:
                return f"[TensorRT-LLM][ERROR] Assertion failed: {condition} (samplingConfig.cpp)"
        return None
