from __future__ import annotations

from typing import Any

import orjson
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser


class JSONBodyParser(BaseParser):
    """Strict JSON bodies (orjson: no lone surrogates, no NaN); an empty body parses as an empty object,
    so that validation names the missing fields."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        if not raw.strip():
            return {}
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ParseError(str(exc)) from None
