"""Mirrors the exports of ``tensorrt_llm/executor/__init__.py`` that the LLM API re-exports."""

from .result import CompletionOutput, GenerationResult, Logprob
from .utils import RequestError

__all__ = ["CompletionOutput", "GenerationResult", "Logprob", "RequestError"]
