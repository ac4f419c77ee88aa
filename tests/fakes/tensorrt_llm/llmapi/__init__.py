"""Mirrors the exports of ``tensorrt_llm/llmapi/__init__.py`` that the runner uses."""

from ..executor import CompletionOutput, RequestError
from ..sampling_params import GuidedDecodingParams, SamplingParams
from .llm import LLM, RequestOutput
from .llm_args import KvCacheConfig, TorchLlmArgs

__all__ = [
    "LLM",
    "CompletionOutput",
    "GuidedDecodingParams",
    "KvCacheConfig",
    "RequestError",
    "RequestOutput",
    "SamplingParams",
    "TorchLlmArgs",
]
