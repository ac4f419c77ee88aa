from __future__ import annotations

import json
import math
import re
import sys
from typing import Any

import orjson
from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import BaseParser

from inference.openai.errors import body_too_complex, invalid_request


class JSONBodyParser(BaseParser):
    """Strict JSON bodies (orjson: no lone surrogates, no NaN); an empty body parses as an empty object,
    so that validation names the missing fields. Bodies nested deeper than ``MAX_JSON_DEPTH`` are refused:
    validating JSON schemas, converting them to grammars and writing responses all walk a body's nesting
    recursively, and no OpenAI request needs more than a few dozen levels. So are bodies of more than
    ``MAX_JSON_CONTAINERS`` objects and arrays: each becomes a validated model and a rendered message, some
    1.5 KB of memory and 25 µs of CPU, so that 8 MiB of ``{}`` would cost half a gigabyte and seconds before
    anything could refuse it (a long agent session holds a few thousand). And so are bodies of more than
    ``MAX_JSON_VALUES`` values (an array's items, an object's members): validation holds the GIL throughout, and
    each value a model refuses (an unknown key, a number where a message goes) costs it 5 µs, so that a million of
    them froze every request of the process for five seconds."""

    media_type = "application/json"

    def parse(self, stream: Any, media_type: str | None = None, parser_context: dict[str, Any] | None = None) -> Any:
        raw = stream.read() if stream is not None else b""
        if not raw.strip():
            return {}
        depth, containers, values = settings.MAX_JSON_DEPTH, settings.MAX_JSON_CONTAINERS, settings.MAX_JSON_VALUES
        brackets = raw.count(b"{") + raw.count(b"[")
        # Counted before parsing, which would build them all: brackets and commas in strings are neither.
        if brackets > containers or brackets + raw.count(b",") >= values:
            bare = _STRING.sub(b"", raw)
            if (bare_brackets := bare.count(b"{") + bare.count(b"[")) > containers:
                raise body_too_complex(containers, "objects and arrays")
            # Each value but the first of an object or array follows a comma: at most one more value than these.
            if bare_brackets + bare.count(b",") >= values:
                raise body_too_complex(values, "values")
        exact = _LONG_INTEGER.search(raw) is not None
        try:
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                if not exact:  # orjson refuses an integer of hundreds of digits: one Python reads is refused below
                    raise
            if exact:
                # orjson reads an integer past 64 bits as a float; read exactly, it is refused as the number it is.
                # Python's reader takes what orjson refuses, so those are refused here: a number past a double's
                # range (read as infinity) and, below, a lone surrogate in a string.
                data = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
        except ValueError as exc:  # orjson's error among them; past Python's 4,300 digits too
            if "integer string conversion" in (message := str(exc)):  # Python's words name its own setting
                message = f"an integer has more than {sys.get_int_max_str_digits()} digits"
            elif "not valid UTF-8" in message or isinstance(exc, UnicodeDecodeError):  # orjson's, Python's words
                message = _not_utf8(raw) or message
            raise ParseError(message) from None
        if exact and (surrogate := _lone_surrogate(data)) is not None:
            raise ParseError(f"no low surrogate in string at '{surrogate}'")
        if exact and isinstance(data, dict | list) and (found := _past_64_bits(data)) is not None:
            # No parameter takes one, and nothing could write it back out (orjson, the upstream): refused by name.
            where, value = found
            side = ("above", "maximum") if value > 0 else ("below", "minimum")
            raise invalid_request(
                f"Invalid '{where}': integer {side[0]} {side[1]} value. No parameter takes an integer past 64 bits, "
                f"but got {value} instead.",
                param=where,
                code=f"integer_{side[0]}_{side[1][:3]}_value",
            )
        # A body with fewer brackets than the limit cannot nest past it: most are never walked.
        if brackets > depth and nested_deeper(data, depth):
            raise invalid_request(f"The request body nests deeper than {depth} levels.", code="invalid_json")
        return data


# Twenty digits or more, not in a fraction or an exponent: an integer orjson may not hold in 64 bits (or digits in a
# string, read again for nothing).
# An integer orjson may not read as one: 20 digits or more, or 19 with a minus (below -2**63).
_LONG_INTEGER = re.compile(rb"(?<![\d.eE])\d{19,}(?![\d.eE])")


def _not_utf8(raw: bytes) -> str | None:
    """Where a body stops being UTF-8, the only encoding JSON is sent in (RFC 8259), if it does."""
    try:
        raw.decode()
    except UnicodeDecodeError as exc:
        return f"it is not UTF-8, as JSON must be: byte {exc.start} (0x{raw[exc.start]:02x}): {exc.reason}"
    return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    if math.isinf(value := float(text)):
        raise ValueError(f"number is infinity when parsed as double: {text[:40]}")
    return value


def _lone_surrogate(data: Any) -> str | None:
    """Where the first string (or key) holding half of a surrogate pair is, dotted: no text can hold one."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        if isinstance(node, str):
            if not node.isascii() and _SURROGATE.search(node):
                return where or "body"
            continue
        if not isinstance(node, dict | list):
            continue
        for key, value in node.items() if isinstance(node, dict) else enumerate(node):
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str) and not key.isascii() and _SURROGATE.search(key):
                return path
            stack.append((path, value))
    return None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _past_64_bits(data: dict[str, Any] | list[Any]) -> tuple[str, int] | None:
    """Where the first integer past what 64 bits hold (signed below, unsigned above) is, dotted, and the integer."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, node = stack.pop()
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
                return path, value
            if isinstance(value, dict | list):
                stack.append((path, value))
    return None


# A JSON string; its closing quote optional, so that a body whose last string never ends is matched once, not
# tried again from each quote in it (which would take time with the square of its length).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?')


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
