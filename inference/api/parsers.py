from __future__ import annotations

from typing import Any

import orjson
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from inference.openai.errors import invalid_request


class JSONBodyParser(BaseParser):
    """Strict JSON bodies (orjson: no lone surrogates, no NaN); an empty body parses as an empty object,
    so that validation names the missing fields. Bodies nested deeper than ``MAX_JSON_DEPTH`` are refused:
    validating JSON schemas, converting them to grammars and writing responses all walk a body's nesting
    recursively, and no OpenAI request needs more than a few dozen levels."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        if not raw.strip():
            return {}
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise ParseError(str(exc)) from None
        limit = settings.MAX_JSON_DEPTH
        # A body with fewer brackets than the limit cannot nest past it: most are never walked.
        if raw.count(b"{") + raw.count(b"[") > limit and nested_deeper(data, limit):
            raise invalid_request(f"The request body nests deeper than {limit} levels.", code="invalid_json")
        return data


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests objects and arrays deeper than ``limit`` levels (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False
