from __future__ import annotations

from typing import Any

import json

from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser


class JSONBodyParser(BaseParser):
    """JSON bodies; an empty body parses as an empty object so that validation names the missing fields."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        if not raw.strip():
            return {}
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ParseError(str(exc)) from None
