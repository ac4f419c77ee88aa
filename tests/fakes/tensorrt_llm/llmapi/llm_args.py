"""Mirrors ``tensorrt_llm/llmapi/llm_args.py``: ``KvCacheConfig`` and the ``BaseLlmArgs`` fields.

The real classes are strict pydantic models (``extra="forbid"``): unknown fields raise a
``ValidationError``, which is a ``ValueError``. The PyTorch backend's ``TorchLlmArgs`` adds more
fields than are listed here; the stand-in rejects those, which only makes it stricter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_KV_CACHE_FIELDS: dict[str, Any] = {
    "enable_block_reuse": True,
    "max_tokens": None,
    "max_attention_window": None,
    "sink_token_length": None,
    "free_gpu_memory_fraction": 0.9,
    "host_cache_size": None,
    "onboard_blocks": True,
    "enable_partial_reuse": True,
    "dtype": "auto",
}


class KvCacheConfig:
    # Every _KV_CACHE_FIELDS name is set as an attribute; these are the ones the stand-in reads.
    enable_block_reuse: bool
    free_gpu_memory_fraction: float | None

    def __init__(self, **kwargs: Any) -> None:
        for key in kwargs:
            if key not in _KV_CACHE_FIELDS:
                raise ValueError(f"1 validation error for KvCacheConfig\n{key}\n  Extra inputs are not permitted")
        fraction = kwargs.get("free_gpu_memory_fraction", _KV_CACHE_FIELDS["free_gpu_memory_fraction"])
        if fraction is not None and not 0 <= fraction <= 1:
            raise ValueError("1 validation error for KvCacheConfig\nfree_gpu_memory_fraction\n  must be in [0, 1]")
        for key, default in _KV_CACHE_FIELDS.items():
            setattr(self, key, kwargs.get(key, default))

    def __repr__(self) -> str:
        return "KvCacheConfig(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in _KV_CACHE_FIELDS) + ")"


# BaseLlmArgs.model_fields, with their defaults.
MODEL_FIELDS: dict[str, Any] = {
    "model": None,
    "tokenizer": None,
    "tokenizer_mode": "auto",
    "custom_tokenizer": None,
    "skip_tokenizer_init": False,
    "trust_remote_code": False,
    "tensor_parallel_size": 1,
    "dtype": "auto",
    "revision": None,
    "tokenizer_revision": None,
    "model_kwargs": None,
    "pipeline_parallel_size": 1,
    "context_parallel_size": 1,
    "gpus_per_node": None,
    "moe_cluster_parallel_size": None,
    "moe_tensor_parallel_size": None,
    "moe_expert_parallel_size": None,
    "enable_attention_dp": False,
    "enable_lm_head_tp_in_adp": False,
    "pp_partition": None,
    "cp_config": None,
    "load_format": "auto",
    "enable_lora": False,
    "lora_config": None,
    "kv_cache_config": None,
    "enable_chunked_prefill": False,
    "guided_decoding_backend": None,
    "batched_logits_processor": None,
    "iter_stats_max_iterations": None,
    "request_stats_max_iterations": None,
    "peft_cache_config": None,
    "scheduler_config": None,
    "cache_transceiver_config": None,
    "sparse_attention_config": None,
    "speculative_config": None,
    "max_batch_size": 2048,
    "max_input_len": 1024,
    "max_seq_len": None,
    "max_beam_width": 1,
    "max_num_tokens": 8192,
    "gather_generation_logits": False,
    "num_postprocess_workers": 0,
    "postprocess_tokenizer_dir": None,
    "reasoning_parser": None,
    "decoding_config": None,
    "otlp_traces_endpoint": None,
    "backend": None,
    "return_perf_metrics": False,
    "perf_metrics_max_requests": 0,
    "orchestrator_type": None,
    "env_overrides": None,
}


# Fields the PyTorch backend's ``TorchLlmArgs`` adds, of those the stand-in models. ``sampler_type`` is a
# ``SamplerType``: "auto" takes the ``TorchSampler`` unless beam search is requested (``_torch/pyexecutor/_util.py``).
TORCH_FIELDS: dict[str, Any] = {
    "sampler_type": "auto",
}
SAMPLER_TYPES = ("TRTLLMSampler", "TorchSampler", "auto")


class TorchLlmArgs:
    model_fields = MODEL_FIELDS | TORCH_FIELDS
    # Every MODEL_FIELDS name is set as an attribute; these are the ones the stand-in reads.
    model: str | Path
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int | None
    enable_chunked_prefill: bool
    guided_decoding_backend: str | None
    kv_cache_config: KvCacheConfig
    sampler_type: str

    def __init__(self, **kwargs: Any) -> None:
        for key, default in self.model_fields.items():
            setattr(self, key, kwargs.get(key, default))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> TorchLlmArgs:
        model = kwargs.get("model")
        if not model:
            raise ValueError("model should be provided.")
        if not isinstance(model, (str, Path)):  # the real check is an assertion in _ModelWrapper
            raise TypeError(f"Invalid model: {model}")
        if kwargs.get("guided_decoding_backend") not in (None, "xgrammar", "llguidance"):
            raise ValueError(
                "1 validation error for TorchLlmArgs\nguided_decoding_backend\n"
                "  Input should be 'xgrammar' or 'llguidance'"
            )
        if kwargs.get("sampler_type", "auto") not in SAMPLER_TYPES:
            raise ValueError(
                "1 validation error for TorchLlmArgs\nsampler_type\n"
                "  Input should be 'TRTLLMSampler', 'TorchSampler' or 'auto'"
            )
        kv_cache_config = kwargs.get("kv_cache_config")
        if kv_cache_config is None:
            kwargs["kv_cache_config"] = KvCacheConfig()
        elif isinstance(kv_cache_config, dict):
            kwargs["kv_cache_config"] = KvCacheConfig(**kv_cache_config)
        elif not isinstance(kv_cache_config, KvCacheConfig):
            raise ValueError("1 validation error for TorchLlmArgs\nkv_cache_config\n  Input should be a KvCacheConfig")
        for key in ("max_batch_size", "max_input_len", "max_beam_width", "max_num_tokens"):
            if kwargs.get(key) is None:
                kwargs.pop(key, None)
        return cls(**kwargs)
