"""Mirrors ``tensorrt_llm/llmapi/llm.py``: ``LLM`` (PyTorch backend, the default) and ``RequestOutput``.

What the executor refuses as it enqueues a request (``base_worker.py``, ``_enqueue_request``: ``max_tokens`` with no
room left under ``max_seq_len``, a sampling config the runtime refuses) becomes a ``RequestError``: raised by
``generate_async`` itself when the executor runs in this process (``TLLM_WORKER_USE_SINGLE_PROCESS=1``), and by the
result's iteration when it runs in its own MPI process (the default), which sends the error back as a response.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Self

from .._toy import MAX_POSITION_EMBEDDINGS, ToyExecutor, ToyTokenizer
from ..executor.result import GenerationResult
from ..executor.utils import RequestError
from ..sampling_params import SamplingParams
from .llm_args import TorchLlmArgs
from .tokenizer import TransformersTokenizer

# Later 1.2 sources refuse a prompt that leaves no room under ``max_seq_len`` in ``_deduce_max_tokens`` itself, naming
# ``max_seq_len``; earlier ones leave it to the runtime, whose message names neither. Tests set this to False for those.
DEDUCE_MAX_TOKENS_REFUSES = True


class RequestOutput(GenerationResult):
    """The output data of a completion request to the LLM."""

    _prompt: str | None

    def __init__(self) -> None:
        raise RuntimeError(
            f"{self.__class__.__name__} is designed to be instantiated using "
            f"{self.__class__.__name__}._from_generation_result by GenerationExecutor. "
            f"Users are not expected to create {self.__class__.__name__} directly."
        )

    @property
    def prompt(self) -> str | None:
        return self._prompt


class LLM:
    def __init__(
        self,
        model: str | Path,
        tokenizer: Any = None,
        tokenizer_mode: Literal["auto", "slow"] = "auto",
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        revision: str | None = None,
        tokenizer_revision: str | None = None,
        **kwargs: Any,
    ) -> None:
        backend = kwargs.pop("backend", "pytorch")
        valid_keys = set(TorchLlmArgs.model_fields) | {"_mpi_session", "backend"}
        for key in kwargs:
            if key not in valid_keys:
                raise ValueError(f"{self.__class__.__name__} got invalid argument: {key}")
        self.args = TorchLlmArgs.from_kwargs(
            model=model,
            tokenizer=tokenizer,
            tokenizer_mode=tokenizer_mode,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            revision=revision,
            tokenizer_revision=tokenizer_revision,
            backend=backend,
            **kwargs,
        )
        self._tokenizer = TransformersTokenizer(ToyTokenizer(str(tokenizer or model)))
        # executor.py, GenerationExecutor.create: the worker in this process for tensor parallel size 1 when asked.
        single_process = os.environ.get("TLLM_WORKER_USE_SINGLE_PROCESS", "0") == "1"
        self._single_process = single_process and tensor_parallel_size == 1
        self._executor: ToyExecutor | None = ToyExecutor(
            self._tokenizer.tokenizer,
            max_batch_size=self.args.max_batch_size,
            guided_decoding_backend=self.args.guided_decoding_backend,
            enable_block_reuse=self.args.kv_cache_config.enable_block_reuse,
            # _torch/pyexecutor/_util.py: the C++ sampler only when asked for (or for beam search, which
            # the stand-in has not), the TorchSampler otherwise.
            sampler="TRTLLMSampler" if self.args.sampler_type == "TRTLLMSampler" else "TorchSampler",
        )

    @property
    def tokenizer(self) -> TransformersTokenizer:
        return self._tokenizer

    def generate_async(
        self,
        inputs: str | list[int],
        sampling_params: SamplingParams | None = None,
        lora_request: Any = None,
        prompt_adapter_request: Any = None,
        streaming: bool = False,
        kv_cache_retention_config: Any = None,
        disaggregated_params: Any = None,
        _postproc_params: Any = None,
        scheduling_params: Any = None,
        cache_salt: str | None = None,
    ) -> RequestOutput:
        if self._executor is None or self._executor.is_shutdown():
            raise RuntimeError("LLM is shutting down")
        sampling_params = self._prepare_sampling_params(sampling_params)
        if isinstance(inputs, str):
            prompt: str | None = inputs
            prompt_token_ids = self._tokenizer.encode(inputs, add_special_tokens=sampling_params.add_special_tokens)
        elif isinstance(inputs, list) and all(isinstance(i, int) for i in inputs):
            prompt, prompt_token_ids = None, list(inputs)
        else:
            raise TypeError(f"The inputs must be type str or list of int, but got {type(inputs)}")
        self._check_arguments(len(prompt_token_ids), 0, sampling_params, is_gen_only=False)
        # GenerationExecutor.generate_async (executor/executor.py) reads the first id before anything else.
        assert isinstance(prompt_token_ids[0], int)

        output = RequestOutput.__new__(RequestOutput)
        GenerationResult.__init__(
            output,
            prompt_token_ids,
            sampling_params,
            streaming=streaming,
            executor=self._executor,
            tokenizer=self._tokenizer,
        )
        output._prompt = prompt
        max_tokens = 0
        try:
            max_tokens = self._deduce_max_tokens(len(prompt_token_ids), sampling_params)
            if (refused := sampling_params._sampling_config_error()) is not None:
                raise ValueError(refused)
        except ValueError as exc:
            if self._single_process:
                raise RequestError(str(exc)) from exc
            error: str | None = str(exc)
        else:
            error = None
        output.id = self._executor.submit(prompt_token_ids, sampling_params, max_tokens, output._deliver, error=error)
        # As the proxy's submit (executor/proxy.py): an error the executor's threads failed with is raised here, once
        # the executor is shut down, whatever its type.
        self._executor._handle_background_error()
        return output

    def _deduce_max_tokens(self, prompt_len: int, sampling_params: SamplingParams) -> int:
        """``_deduce_max_tokens`` in ``executor/base_worker.py``, for a request that sets ``max_tokens``: shortened to
        the room left under ``max_seq_len`` with only a logged warning, refused when no room is left."""
        max_seq_len = self.args.max_seq_len or MAX_POSITION_EMBEDDINGS
        default_max_tokens = max_seq_len - prompt_len
        if default_max_tokens <= 0 and not DEDUCE_MAX_TOKENS_REFUSES:
            # Earlier 1.2 sources only log a warning here and build the request with the count left, which the
            # runtime's own check of the request refuses (``Request::validate``: ``TLLM_CHECK(mMaxNewTokens > 0)``).
            raise ValueError(
                "[TensorRT-LLM][ERROR] Assertion failed: mMaxNewTokens > 0 "
                "(/src/tensorrt_llm/cpp/tensorrt_llm/executor/requestImpl.h:96)"
            )
        if default_max_tokens <= 0:
            raise ValueError(
                f"`default_max_tokens` ({default_max_tokens}) must be greater than 0, "
                f"`default_max_tokens` ({default_max_tokens}) = max_seq_len ({max_seq_len})"
                f" - `splited_prompt_len` ({prompt_len}) - `query_token_len` (0)"
            )
        max_tokens = sampling_params.max_tokens
        if max_tokens > default_max_tokens:
            return default_max_tokens
        if max_tokens <= 0:
            raise ValueError(f"`max_tokens` ({max_tokens}) must be greater than 0")
        return max_tokens

    def _prepare_sampling_params(self, sampling_params: SamplingParams | None = None) -> SamplingParams:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if not isinstance(sampling_params, SamplingParams):
            raise TypeError(f"The sampling_params must be type SamplingParams or None, but got {type(sampling_params)}")
        if sampling_params.end_id is None:
            sampling_params._setup(self._tokenizer)
        return sampling_params

    def _check_arguments(
        self, prompt_len: int, query_len: int, sampling_params: SamplingParams, is_gen_only: bool
    ) -> None:
        max_num_tokens = self.args.max_num_tokens
        if (
            not self.args.enable_chunked_prefill
            and not is_gen_only
            and max_num_tokens
            and prompt_len + query_len > max_num_tokens
        ):
            # The PyTorch backend checks only max_num_tokens here, never max_seq_len. Later sources
            # raise RequestError from generate_async itself, earlier ones ValueError. The prompt's length is
            # divided by the context-parallel size first, so it reads as a float ("(72417.0)").
            raise RequestError(
                f"The sum of prompt length ({prompt_len / 1}), query length ({query_len}) should not exceed "
                f"max_num_tokens ({max_num_tokens})"
            )

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: object, exc_value: object, traceback: object) -> Literal[False]:
        self.shutdown()
        return False
