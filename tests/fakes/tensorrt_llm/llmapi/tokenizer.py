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
        """The new ids' text appended to what was decoded before: text once decoded is never taken back, and
        ids that end in a piece of a character wait in ``states`` for the rest. As with the default Hugging Face
        backend (``hf_decode_incrementally``, over ``tokenizers``' ``DecodeStream``), ``flush`` changes nothing: a
        piece of a character the output ends with never becomes text."""
        pending = [*(states or {}).get("pending", []), *token_ids]
        text = self.decode(pending, **kwargs)
        if text.endswith("\ufffd"):
            return prev_text or "", {"pending": pending}
        return (prev_text or "") + text, {}

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False) -> str | list[str]:
        tokens = self.tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)
        return tokens[0] if isinstance(ids, int) else tokens

    def apply_chat_template(self, conversation: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(conversation, *args, **kwargs)

    def get_vocab(self) -> dict[str, int]:
        return self.tokenizer.get_vocab()
