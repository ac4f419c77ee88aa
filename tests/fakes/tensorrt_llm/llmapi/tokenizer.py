"""Mirrors ``tensorrt_llm/llmapi/tokenizer.py``: ``TransformersTokenizer`` wraps a Hugging Face tokenizer."""

from __future__ import annotations

from typing import Any


class TokenizerBase:
    """This is a protocol for the tokenizer."""


class TransformersTokenizer(TokenizerBase):
    """A wrapper for the Transformers' tokenizer. This is the default tokenizer for LLM."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @property
    def eos_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def pad_token_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def name_or_path(self) -> str:
        return self.tokenizer.name_or_path

    def encode(self, text: str, *args: Any, **kwargs: Any) -> list[int]:
        return self.tokenizer.encode(text, *args, **kwargs)

    def decode(self, token_ids: list[int], *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(token_ids, *args, **kwargs)

    def decode_incrementally(
        self,
        token_ids: list[int],
        prev_text: str | None = None,
        states: dict[str, Any] | None = None,
        *,
        flush: bool = False,
        **kwargs: Any,
    ) -> tuple[str, dict[str, Any]]:
        """The new ids' text appended to what was decoded before: text once decoded is never taken back."""
        return (prev_text or "") + self.decode(token_ids, **kwargs), states or {}

    def apply_chat_template(self, conversation: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab()
