"""JSON schemas as llama.cpp grammars (GBNF): a schema the grammar enforces as written, or a 400's reason naming
what it cannot.

llama-cpp-python's converter writes the rules; this module bounds a schema's cost before it runs, writes what
the converter leaves out or reads loosely (integer and number bounds, formats, a list of types beside other
keywords, a pattern's character sets as ECMA-262 reads them, JSON's escapes) and refuses by name what neither
can hold. The CPU runner compiles the grammar with llama.cpp; the TensorRT-LLM runner hands it to its guided
decoder.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
import re
import string
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from django.conf import settings as django_settings

from .base import (
    SCHEMA_DATA,
    SCHEMA_MAPS,
    TOOL_OPEN,
    Constraint,
    keyword_problem,
    rebased,
    schema_at,
)
from .grammar_costs import grammar_cost_problem
from .schema_ends import endless_problem

# A character of a JSON string: any but a quote, a backslash or a control character, or an escape. A character past
# U+FFFF escaped is a pair of escapes (a high surrogate's, then a low one's), one character as maxLength and minLength
# count; a surrogate escaped alone is no character.
_HEX_DIGIT = "[0-9a-fA-F]"
JSON_STRING_CHAR = (
    r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" ('
    f"[0-9a-cA-Ce-fE-F] {_HEX_DIGIT} {_HEX_DIGIT} {_HEX_DIGIT} | [dD] [0-7] {_HEX_DIGIT} {_HEX_DIGIT} | "
    rf'[dD] [89abAB] {_HEX_DIGIT} {_HEX_DIGIT} [\\] "u" [dD] [c-fC-F] {_HEX_DIGIT} {_HEX_DIGIT}))'
)


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """How large a schema the runners take, so that building and compiling its grammar stays bounded.

    The converter writes counted repetitions out in full (``maxLength: 50`` is fifty nested optional groups) and
    llama.cpp's grammar parser recurses once per group: an unbounded count builds without end, or crashes the
    process when the parser's recursion outgrows its stack. Each optional property of an object costs the
    converter a recursion, and its work grows with their square.
    """

    depth: int = 48  # JSON nesting inside the schema, and groups nested in a pattern
    repetition: int = 1000  # minLength, maxLength, minItems, maxItems, a pattern's {m,n}
    properties: int = 256  # properties of one object; four times as many in the whole schema
    grammar_bytes: int = 1 << 20
    alternatives: int = 1024  # alternatives in the whole grammar
    leads: int = 1_000_000  # ways a schema's $refs and branches lead to where a value starts (grammar_costs)
    ambiguity: int = 256  # alternatives alive at once inside a nested value (grammar_costs)

    @classmethod
    def from_settings(cls) -> SchemaLimits:
        if not django_settings.configured:  # a bare process (the preflight child) has no settings to read
            return cls()
        return cls(
            depth=django_settings.SCHEMA_MAX_DEPTH,
            repetition=django_settings.SCHEMA_MAX_REPETITION,
            properties=django_settings.SCHEMA_MAX_PROPERTIES,
            grammar_bytes=django_settings.GRAMMAR_MAX_BYTES,
            alternatives=django_settings.SCHEMA_MAX_ALTERNATIVES,
            leads=django_settings.SCHEMA_MAX_LEADS,
            ambiguity=django_settings.SCHEMA_MAX_AMBIGUITY,
        )


class SchemaTooLarge(ValueError):
    """The schema's grammar would outgrow ``SchemaLimits``."""


def _text_not_starting_with(converter: Any, literal: str) -> str:
    """The name of a rule for any text but one that begins with ``literal``: a text may open with ``<`` (a model may
    begin its answer with a tag of its own, ``<tool_response>``) as long as it does not spell a call's opening tag,
    which only the call's own alternative may write."""
    rule = ""
    for at in range(len(literal) - 1, -1, -1):
        char = f"\\x{ord(literal[at]):02X}"
        differs = f"[^{char}\\x00] [^\\x00]*"
        body = f"{differs} | [{char}] {rule}" if rule else differs
        if at:  # past the first character the text may also end here
            body = f'"" | {body}'
        rule = converter._add_rule(f"free-text-{at}" if at else "free-text", body)
    return rule


def grammar_for(constraint: Constraint, limits: SchemaLimits | None = None) -> str:
    """A GBNF grammar for the constraint, built from its JSON schema; ``SchemaTooLarge`` past ``limits``."""
    limits = limits or SchemaLimits.from_settings()
    converter = _converter_class()(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    if constraint.kind == "json_object":
        converter.visit(converter.resolve_refs({"type": "object"}, "schema"), "")
    elif constraint.kind == "json_schema":
        converter.visit(converter.resolve_refs(_prepared(constraint.schema or {}, limits), "schema"), "")
    else:
        # One document holds the call's schema and the answer's, each under its own name, so that the $refs of
        # one never meet the other's definitions.
        parts = {"call": constraint.schema or {}}
        if constraint.text_schema is not None:
            parts["answer"] = constraint.text_schema
        whole = {"$defs": {name: rebased(_prepared(part, limits), f"#/$defs/{name}") for name, part in parts.items()}}
        converter.resolve_refs(whole, "schema")
        # The names the rules got: a definition of the schema may have taken "call" first.
        call = converter.visit(whole["$defs"]["call"], "call")
        if "answer" in parts:
            answer = converter.visit(whole["$defs"]["answer"], "answer")
        else:  # free text, not starting with a tool call
            answer = _text_not_starting_with(converter, TOOL_OPEN)
        # A tool call in the Hermes format, or the answer.
        converter._add_rule("root", rf'"<tool_call>\n" {call} "\n</tool_call>" | {answer}')
    if "char" in converter._rules:
        # A character of a JSON string: the library's rule also lets raw control characters through, which
        # no JSON parser accepts (a raw line break inside a string), so they must be escaped as JSON says.
        converter._rules["char"] = JSON_STRING_CHAR
    if "dot" in converter._rules:
        # A pattern's "." is any character but a line break; inside a JSON string, not a quote, a backslash or
        # another control character either.
        converter._rules["dot"] = r'[^"\\\x7F\x00-\x1F]'
    grammar = converter.format_grammar()
    if len(grammar) > limits.grammar_bytes:
        raise SchemaTooLarge(f"its grammar would be {len(grammar)} bytes, more than the {limits.grammar_bytes} allowed")
    # A repetition writes one group per count, and a few more wrap it where it sits.
    if (nested := _group_depth(grammar)) > limits.repetition + limits.depth:
        raise SchemaTooLarge(f"its grammar nests {nested} groups, more than the {limits.repetition} allowed")
    # Checking a token against the grammar costs as much as it has alternatives alive, at every step of every
    # sequence of the context: an enum of 50,000 values held every stream for seconds a token.
    if (alternatives := grammar.count("|")) > limits.alternatives:
        raise SchemaTooLarge(
            f"its grammar holds {alternatives} alternatives (enum values, anyOf branches, optional properties, "
            f"a pattern's |), more than the {limits.alternatives} allowed"
        )
    return grammar


def _prepared(schema: dict[str, Any], limits: SchemaLimits) -> dict[str, Any]:
    """The schema as the converter reads it; ``SchemaTooLarge`` before any work, since the converter's own work is
    what an unbounded schema runs away with."""
    if problem := size_problem(schema, limits) or grammar_cost_problem(
        schema, leads=limits.leads, ambiguity=limits.ambiguity
    ):
        raise SchemaTooLarge(problem)
    if problem := keyword_problem(schema, formats=frozenset(_FORMAT_PATTERNS)) or endless_problem(schema):
        raise ValueError(problem)
    return _root_ref_as_all_of(_anchored(schema))


def schema_problem(schema: dict[str, Any], *, vocab: Any = None) -> str | None:
    """Why this runner cannot enforce ``schema``, or None when it can: the grammar is built and, given the model's
    ``vocab``, compiled as the runner will. Answers are remembered (clients send the same tools every turn)."""
    limits = SchemaLimits.from_settings()
    try:
        text = orjson.dumps(schema, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError as exc:  # nested too deep, an integer past 64 bits, a lone surrogate
        return size_problem(schema, limits) or f"it cannot be written as JSON ({str(exc).lower()})"
    key = hashlib.blake2b(repr((limits, vocab is not None)).encode() + text, digest_size=16).digest()
    with _problems_lock:
        if key in _problems:
            _problems.move_to_end(key)
            return _problems[key]
    if b"\\u0000" in text:
        # llama.cpp reads a grammar as a C string: it would end at the NUL and fail, printing the whole grammar.
        problem: str | None = "it holds a NUL character, which this model's grammars cannot"
    else:
        problem = _find_problem(schema, vocab, limits)
    with _problems_lock:
        _problems[key] = problem
        while len(_problems) > PROBLEMS_REMEMBERED:
            _problems.popitem(last=False)
    return problem


PROBLEMS_REMEMBERED = 512
_problems: collections.OrderedDict[bytes, str | None] = collections.OrderedDict()
_problems_lock = threading.Lock()


def _find_problem(schema: dict[str, Any], vocab: Any, limits: SchemaLimits) -> str | None:
    try:
        grammar = grammar_for(Constraint(kind="json_schema", schema=schema), limits)
    except Exception as exc:  # noqa: BLE001  (the converter asserts and raises whatever the schema trips over)
        return _converter_problem(exc)
    if vocab is not None:
        from llama_cpp import llama_cpp as lib

        compiled = lib.llama_sampler_init_grammar(vocab.vocab, grammar.encode("utf-8"), b"root")
        if not compiled:
            return "llama.cpp cannot compile its grammar"
        lib.llama_sampler_free(compiled)
    return None


# What the grammar converter says of a pattern it cannot read, before the details it adds: positions in, and the text
# of, the pattern as the runner rewrote it (anchored), not as the client wrote it.
_PATTERN_ERRORS = ("Unbalanced", "Invalid quantifier", "Unsupported pattern syntax", "Pattern must start")


def _converter_problem(exc: Exception) -> str:
    """What the grammar converter's failure says to a client: its own words, less the runner's rewrite of a pattern,
    and a named cause where Python's would mean nothing to it."""
    if isinstance(exc, RecursionError):
        return "its $ref chains or nesting go too deep to build a grammar from"
    message = str(exc) or type(exc).__name__
    if message.startswith("Unrecognized schema: "):  # followed by the subschema as a Python dict
        return (
            "one of its subschemas holds no keyword this model's grammar reads (such as a $dynamicRef or "
            "$recursiveRef): give it a type, or a $ref to a definition"
        )
    if message.startswith(_PATTERN_ERRORS):
        head = re.split(r";| in /| at index ", message, maxsplit=1)[0].strip()
        return f"one of its patterns cannot be read ({head.lower()})"
    return message


_REPETITIONS = ("minLength", "maxLength", "minItems", "maxItems")
# What one repetition of an item adds to the grammar at most, besides the item itself (separators, parentheses).
_REPETITION_BYTES = 24


def size_problem(schema: Any, limits: SchemaLimits) -> str | None:
    """What in ``schema`` would make its grammar outgrow ``limits``, found without building it: nesting, counted
    repetitions, properties, and an estimate of the grammar's size (a budget of four times the grammar's bound,
    so that the estimate can be generous and the built grammar is measured exactly after)."""
    properties_in_all = 0
    estimate = 0
    # node, its JSON depth, its role ("schema", "map" of names to schemas, or "data"), its rule name's length
    stack: list[tuple[Any, int, str, int]] = [(schema, 1, "schema", 0)]
    while stack:
        node, depth, role, name = stack.pop()
        if depth > limits.depth:
            return f"it is nested deeper than {limits.depth} levels"
        if isinstance(node, list):
            stack.extend((item, depth + 1, role, name) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if role == "schema":
            for keyword in _REPETITIONS:
                count = node.get(keyword)
                if isinstance(count, int | float) and not isinstance(count, bool):
                    if count != int(count):
                        return f"{keyword} {count:g} is not a whole number"
                    if count > limits.repetition:
                        return f"{keyword} {count:g} is more than the {limits.repetition} this model enforces"
                    estimate += int(count) * (name + _REPETITION_BYTES)
            if isinstance(pattern := node.get("pattern"), str):
                problem, cost = _pattern_size(pattern, limits)
                if problem:
                    return problem
                estimate += cost
            if (count := _property_count(node, schema)) > limits.properties:
                return f"an object has {count} properties, more than the {limits.properties} this model enforces"
            properties_in_all += count
            if isinstance(props := node.get("properties"), dict):
                names = sum(len(str(key)) + name + _REPETITION_BYTES for key in props)
                estimate += names * max(1, len(props) - len(node.get("required") or ()))
        for key, value in node.items():
            if not isinstance(value, dict | list):
                continue
            if role == "data" or (role == "schema" and key in SCHEMA_DATA):
                stack.append((value, depth + 1, "data", name))
            elif role == "map":
                stack.append((value, depth + 1, "schema", name + len(str(key)) + 1))
            else:
                stack.append((value, depth + 1, "map" if key in SCHEMA_MAPS else "schema", name + len(key) + 1))
    if properties_in_all > 4 * limits.properties:
        most = 4 * limits.properties
        return f"it has {properties_in_all} properties in all, more than the {most} this model enforces"
    if estimate > 4 * limits.grammar_bytes:
        return f"its grammar would be larger than the {limits.grammar_bytes} bytes allowed"
    return None


def _property_count(node: dict[str, Any], root: Any) -> int:
    """The properties the converter gives one object rule: its own, and those of the schemas its ``allOf`` joins
    (local ``$ref``s included, as the converter resolves them)."""
    count = len(props) if isinstance(props := node.get("properties"), dict) else 0
    parts = node.get("allOf")
    for part in parts if isinstance(parts, list) else ():
        for component in part.get("anyOf", [part]) if isinstance(part, dict) else ():
            if isinstance(component, dict) and isinstance(ref := component.get("$ref"), str):
                component = schema_at(root, ref)
            if isinstance(component, dict) and isinstance(props := component.get("properties"), dict):
                count += len(props)
    return count


_COUNTED = re.compile(r"\{\s*(\d*)\s*(,?)\s*(\d*)\s*\}")
# A count as ECMA-262 writes one; it reads other braces ({,5}, {2, 3}) as the characters, where the grammar's
# converter would take them for counts.
_ECMA_COUNT = re.compile(r"\{\d+(,\d*)?\}")


def _pattern_size(pattern: str, limits: SchemaLimits) -> tuple[str | None, int]:
    """A pattern's problem (a count or group nesting past ``limits``), and what its counted repetitions add to the
    grammar at most: each writes its item out once per count."""
    cost, depth, index = len(pattern), 0, 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char == "[":
            end = index + 1
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            index = end + 1
            continue
        if char == "(":
            depth += 1
            if depth > limits.depth:
                return f"its pattern nests groups deeper than {limits.depth} levels", 0
        elif char == ")":
            depth -= 1
        elif char == "{" and (counted := _COUNTED.match(pattern, index)):
            low, comma, high = counted.groups()
            count = int(high) if high else int(low or 0)
            if count > limits.repetition or int(low or 0) > limits.repetition:
                most = limits.repetition
                return f"its pattern repeats {counted.group()}, more than the {most} this model enforces", 0
            cost += count * (len(pattern) + _REPETITION_BYTES)
            index = counted.end()
            continue
        index += 1
    return None, cost


# A pattern's escapes, written as what the converter reads: it copies "\d" or "\." into the grammar as they are,
# and llama.cpp's grammars know no such escape (a pattern of "^\d{5}$" did not compile). Inside a JSON string, so
# that output stays JSON: sets hold no quote, backslash or control character, and a control character written as an
# escape is JSON's escape of it. A set of ASCII digits, word characters or spaces is what JSON Schema's regular
# expressions (ECMA-262) mean by \d and \w, and holds the spaces that need no escape of its \s.
_JSON_UNSAFE = r'"\\\x7F\x00-\x1F'
_ESCAPED_SETS = {
    "d": "0-9",
    "w": "0-9A-Za-z_",
    "s": r" \u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF",
}
_JSON_ESCAPES = {"t": "t", "n": "n", "r": "r", "f": "f", '"': r"\x22", "\\": r"\x5C"}


# A character JSON writes escaped, standing for itself in a pattern (a quote, a tab, a line feed): read as the
# pattern's escape of it, which the grammar writes as JSON does (or refuses by name), never as the raw character.
_UNSAFE_AS_ITSELF = re.compile(r'\\.|["\x00-\x1F\x7F]', re.DOTALL)
_UNSAFE_ESCAPES = {'"': '\\"', "\t": "\\t", "\n": "\\n", "\r": "\\r", "\f": "\\f"}


def _unsafe_as_escapes(pattern: str) -> str:
    def escape(match: re.Match[str]) -> str:
        text = match.group()
        return text if text.startswith("\\") else _UNSAFE_ESCAPES.get(text, f"\\x{ord(text):02X}")

    return _UNSAFE_AS_ITSELF.sub(escape, pattern)


def _readable_pattern(pattern: str) -> str:
    """``pattern`` with every escape the converter would copy as it is written as a set, a code or JSON's escape;
    ``ValueError`` naming one that no grammar of this model can enforce (a word boundary, a back-reference)."""
    pattern = _unsafe_as_escapes(pattern)
    written: list[str] = []
    in_set = negated = False
    set_start = index = 0
    while index < len(pattern):
        char = pattern[index]
        if char != "\\" and not in_set and (group := _GROUP_OPENING.match(pattern, index)):
            # A non-capturing or named group is a group: a grammar captures nothing. Lookaround is no grammar's.
            if group.group() in ("(?=", "(?!", "(?<=", "(?<!") or group.group() == "(?":
                raise ValueError(f"its pattern's {group.group()}...) cannot be enforced by this model's grammar")
            written.append("(")
            index = group.end()
            continue
        if char != "\\" and not in_set and (counted := _COUNTED.match(pattern, index)):
            if not _ECMA_COUNT.fullmatch(counted.group()):
                raise ValueError(
                    f"its pattern's {counted.group()} is no count in JSON Schema's regular expressions (ECMA-262): "
                    "write {m}, {m,} or {m,n}, or \\{ for the character"
                )
            written.append(counted.group())
            index = counted.end() + (pattern.startswith("?", counted.end()))  # lazy or not, the same strings
            continue
        if char in "*+?" and not in_set:
            written.append(char)
            index += 2 if pattern.startswith("?", index + 1) else 1  # lazy or not, the same strings
            continue
        if (
            char in "^$"
            and not in_set
            and not (char == "^" and index == 0 or char == "$" and index == len(pattern) - 1)
        ):
            raise ValueError(
                f"its pattern's {char} anywhere but at the start or end of the pattern or of one of its alternatives "
                "cannot be enforced by this model's grammar"
            )
        if char != "\\":
            if char == "[" and not in_set:
                in_set, negated = True, pattern.startswith("^", index + 1)
                written.append("[^" if negated else "[")
                set_start = len(written)
                index += 2 if negated else 1
                continue
            if char == "]" and in_set:
                in_set = False
                written[set_start:] = [_set_members(written[set_start:], negated=negated)]
                if negated:  # what JSON writes escaped is no member of a string's set
                    written.append(_JSON_UNSAFE)
            written.append(char)
            index += 1
            continue
        escaped = pattern[index + 1 : index + 2]
        index += 2
        if not escaped:
            raise ValueError("its pattern ends with a lone backslash")
        if (members := _ESCAPED_SETS.get(escaped.lower())) is not None:
            if escaped.islower():
                written.append(members if in_set else f"[{members}]")
            elif in_set:
                raise ValueError(f"its pattern's \\{escaped} inside [...] cannot be enforced by this model's grammar")
            else:
                written.append(f"[^{members}{_JSON_UNSAFE}]")
        elif escaped in _JSON_ESCAPES:
            if in_set and not negated:
                raise ValueError(f"its pattern's \\{escaped} inside [...] cannot be enforced by this model's grammar")
            # Left out of a negated set, as every character JSON writes escaped is.
            written.append("" if in_set else f"([\\x5C][{_JSON_ESCAPES[escaped]}])")
        elif escaped in "xu" and (code := _escaped_code(pattern, index, 2 if escaped == "x" else 4)) is not None:
            index += 2 if escaped == "x" else 4
            if 0xD800 <= code < 0xDC00 and pattern.startswith("\\u", index):
                low = _escaped_code(pattern, index + 2, 4)
                if low is not None and 0xDC00 <= low < 0xE000:  # a pair of escapes: the one character it writes
                    code, index = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00), index + 6
            if 0xD800 <= code < 0xE000:
                raise ValueError(f"its pattern's \\u{code:04X} is half of a character (a lone surrogate), no text")
            if (code < 0x20 or code in (0x22, 0x5C, 0x7F)) and not (in_set and negated):
                raise ValueError(
                    f"its pattern's character U+{code:04X} is written escaped in JSON: this model's grammar cannot "
                    "enforce it"
                )
            written.append(_code(code) if in_set else f"[{_code(code)}]")
        elif escaped.isalnum() or escaped.isspace() and escaped != " " or not escaped.isprintable():
            raise ValueError(f"its pattern's \\{escaped} cannot be enforced by this model's grammar")
        else:  # a character that would mean something else unescaped: itself
            written.append(_code(ord(escaped)) if in_set else f"[{_code(ord(escaped))}]")
    return "".join(written)


# A character of a set as the grammar writes it: its code, or itself.
_CHARACTER = re.compile(r"\\x[0-9A-F]{2}|\\u[0-9A-F]{4}|\\U[0-9A-F]{8}|.", re.DOTALL)
_CLASSES = frozenset(_ESCAPED_SETS.values())
# What JSON writes escaped, as ranges of codes.
_JSON_UNSAFE_CODES = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))


def _set_members(entries: list[str], *, negated: bool) -> str:
    """A set's members as the grammar writes them, from the entries the pattern's reading wrote for it (each a
    character, its code, a class's members, or nothing for a character left out): a range between two characters is
    held to its order and, in a set that is not negated, cut around what JSON writes escaped, which it may span
    (``[ -~]`` holds a quote and a backslash); a ``-`` that joins no two characters (beside a class: ``[\\w-.]``) is
    the character, as ECMA-262 reads it."""
    entries = [entry for entry in entries if entry]
    written: list[str] = []
    index = 0
    while index < len(entries):
        ranged = index + 2 < len(entries) and entries[index + 1] == "-"
        if ranged and _is_character(entries[index], entries[index + 2]):
            low, high = _member_code(entries[index]), _member_code(entries[index + 2])
            if low > high:
                raise ValueError(f"its pattern's range {chr(low)}-{chr(high)} is out of order")
            pieces = [(low, high)] if negated else list(_cut(low, high))
            if pieces == [(low, high)]:
                written.extend(entries[index : index + 3])
            else:
                written.extend(_range(*piece) for piece in pieces)
            index += 3
            continue
        entry = entries[index]
        written.append("\\x2D" if entry == "-" and 0 < index < len(entries) - 1 else entry)
        index += 1
    return "".join(written)


def _is_character(*entries: str) -> bool:
    return all(entry not in _CLASSES and _CHARACTER.fullmatch(entry) for entry in entries)


def _member_code(token: str) -> int:
    return int(token[2:], 16) if len(token) > 1 else ord(token)


def _cut(low: int, high: int) -> Iterator[tuple[int, int]]:
    """``low``-``high`` less what JSON writes escaped, as ranges."""
    for unsafe_low, unsafe_high in _JSON_UNSAFE_CODES:
        if low <= unsafe_high and unsafe_low <= high:
            if low < unsafe_low:
                yield low, unsafe_low - 1
            low = unsafe_high + 1
    if low <= high:
        yield low, high


def _range(low: int, high: int) -> str:
    return _code(low) if low == high else f"{_code(low)}-{_code(high)}"


# The openings of groups other than plain ones: non-capturing, named, lookaround (a lone "(?" is none of them).
_GROUP_OPENING = re.compile(r"\(\?(?::|=|!|<=|<!|<[A-Za-z][A-Za-z0-9_]*>)?")


def _escaped_code(pattern: str, start: int, digits: int) -> int | None:
    hexits = pattern[start : start + digits]
    if len(hexits) != digits or not all(char in string.hexdigits for char in hexits):
        return None
    return int(hexits, 16)


def _code(code: int) -> str:
    """A character as llama.cpp's grammars write its code."""
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 else f"\\U{code:08X}"


def _group_depth(grammar: str) -> int:
    """How deeply the grammar's groups nest (outside its literals and character classes): llama.cpp's parser
    recurses once per level."""
    deepest = depth = 0
    for token in _GRAMMAR_TOKENS.findall(grammar):
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
        elif token == "\n":
            depth = 0
    return deepest


_GRAMMAR_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()\n]')


def _root_ref_as_all_of(schema: dict[str, Any]) -> dict[str, Any]:
    """``{"$ref": …, "$defs": …}`` (a recursive Pydantic model) as ``allOf``: the converter skips a $ref's siblings.
    The converter takes every ``allOf`` for an object of its parts' properties, so a ``$ref`` to a schema with no
    properties of its own (a string, an enum, an array, a union of objects) is ``anyOf`` that one ``$ref`` instead,
    the same values: as ``allOf`` it came out as ``{}``."""
    ref = schema.get("$ref")
    if not isinstance(ref, str) or len(schema) == 1:
        return schema
    rest = {key: value for key, value in schema.items() if key != "$ref"}
    target = schema_at(schema, ref)
    if isinstance(target, dict) and "properties" not in target and "anyOf" not in rest and "oneOf" not in rest:
        return {**rest, "anyOf": [{"$ref": ref}]}
    return {**rest, "allOf": [{"$ref": ref}, *rest.get("allOf", [])]}


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if value is None:
        return "null"
    return {str: "a string", int: "a number", float: "a number", list: "an array", dict: "an object"}.get(
        type(value), "a value"
    )


def _refs(schema: Any, *, in_map: bool = False) -> Iterator[str]:
    """Every ``$ref`` in the schema, outside its data."""
    if isinstance(schema, list):
        for item in schema:
            yield from _refs(item)
    elif isinstance(schema, dict):
        for key, value in schema.items():
            if in_map:
                yield from _refs(value)
            elif key == "$ref" and isinstance(value, str):
                yield value
            elif key not in SCHEMA_DATA:
                yield from _refs(value, in_map=key in SCHEMA_MAPS)


# What a rule being built holds until it is: nothing else ever equals it, so no other rule takes its name.
_BUILDING = "<being built>"


@functools.cache
def _converter_class() -> type[Any]:
    """llama.cpp's JSON-schema-to-grammar converter, with its ``$ref``s and literals made to mean what they say."""
    from llama_cpp.llama_grammar import INVALID_RULE_CHARS_RE, RESERVED_NAMES, SchemaConverter

    class Converter(SchemaConverter):  # the library is untyped
        def __init__(self, **options: Any) -> None:
            super().__init__(**options)
            self._ref_rules: dict[str, str] = {}

        def resolve_refs(self, schema: dict[str, Any], url: str) -> dict[str, Any]:
            """Finds every local ``$ref``'s target (``#`` too), or says which one points at nothing. The
            library's own fetches remote ones (refused here), names no ``#``, and reads refs inside ``const``."""
            for ref in _refs(schema):
                if ref in self._refs:
                    continue
                if not ref.startswith("#"):
                    raise ValueError(f"its $ref {ref!r} is not local to the schema, and remote schemas are not fetched")
                if (target := schema_at(schema, ref)) is None:
                    raise ValueError(f"its $ref {ref!r} points at nothing in the schema")
                if not isinstance(target, dict):
                    raise ValueError(f"its $ref {ref!r} points at {_json_kind(target)}, not at a schema object")
                self._refs[ref] = target
            return schema

        def _resolve_ref(self, ref: str) -> str:
            """One rule per ``$ref``. The library names a ref's rule by its last part alone, so that
            ``#/$defs/a/$defs/Item`` and ``#/$defs/Item`` shared one rule (or a property's of that name)."""
            if (name := self._ref_rules.get(ref)) is None:
                base = INVALID_RULE_CHARS_RE.sub("-", ref.rsplit("/", 1)[-1]).strip("-") or "ref"
                name, count = base, 0
                while name in self._rules or name in RESERVED_NAMES:
                    name, count = f"{base}{count}", count + 1
                self._ref_rules[ref] = name
                # Reserved before its rule is built, as a recursive schema names it from inside that rule.
                self._rules[name] = _BUILDING
                self._rules[name] = self.visit(self._refs[ref], name)
            return name

        def visit(self, schema: Any, name: str) -> str:
            """The library's rules, with an integer's bounds enforced, and a 400's reason for what the grammar cannot
            enforce (the library leaves such keywords out, and output that breaks them would pass as valid)."""
            if isinstance(schema, dict):
                if problem := _unenforceable(schema):
                    raise ValueError(problem)
                if _types(schema) and (reader := next((k for k in _READ_ALONE if k in schema), None)):
                    schema = _typed(schema, reader, self._refs.get)
                kind = schema.get("type")
                if isinstance(kind, list) and kind and schema.keys() - _ANNOTATIONS - {"type"}:
                    # The converter reads a list of types (of one too) as those types alone, its other keywords (an
                    # enum, a maxLength, a format) left out: one branch a type, each with them all (a keyword of
                    # another type's holds nothing there).
                    rest = {key: value for key, value in schema.items() if key != "type"}
                    branches = [{**rest, "type": one} for one in kind]
                    for branch in branches:
                        if branch["type"] not in ("integer", "number"):
                            for bound in _BOUNDS & branch.keys():  # a null's minimum
                                del branch[bound]
                    return str(super().visit({"anyOf": branches}, name))
                if kind == "string" and isinstance(fmt := schema.get("format"), str) and fmt in _FORMAT_PATTERNS:
                    # The converter writes a few formats loosely (a 31st of February) and leaves the others out: each
                    # is its pattern instead (keyword_problem refused what it stands beside).
                    rest = {key: value for key, value in schema.items() if key != "format"}
                    return str(super().visit({**rest, "pattern": _FORMAT_PATTERNS[fmt]}, name))
                if kind in ("integer", "number") and _BOUNDS & schema.keys() and not _COMPOSED & schema.keys():
                    rule_name = name + "-" if name in RESERVED_NAMES else name or "root"
                    if kind == "integer":
                        rule = integer_range(*_integer_bounds(schema))
                    else:
                        rule = number_range(*_number_bounds(schema))
                    return str(self._add_rule(rule_name, f"{rule} space"))
            return str(super().visit(schema, name))

        def _visit_pattern(self, pattern: str, name: str) -> str:
            return str(super()._visit_pattern(_readable_pattern(pattern), name))

        def _format_literal(self, literal: str) -> str:
            """A GBNF literal. The library escapes quotes but not backslashes, so the escaped quote of a JSON string
            (a property called ``a"b``) ended the literal early and the grammar did not compile."""
            escaped = literal.replace("\\", "\\\\").replace('"', '\\"').replace("\r", "\\r").replace("\n", "\\n")
            return f'"{escaped}"'

    return Converter


_BOUNDS = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"})
_COMPOSED = frozenset({"$ref", "anyOf", "oneOf", "allOf", "enum", "const"})
# Keywords that constrain a value and that the grammar converter leaves out.
_UNENFORCEABLE = (
    "multipleOf",
    "contains",
    "minContains",
    "maxContains",
    "minProperties",
    "maxProperties",
    "propertyNames",
    "patternProperties",
    "dependentRequired",
    "dependentSchemas",
    "if",
    "unevaluatedProperties",
    "unevaluatedItems",
)


def _label(first: str, most: int) -> str:
    """A pattern for a hostname's label of 1 to ``most`` letters, digits and hyphens, starting with ``first``, not
    ending with a hyphen."""
    return f"{first}([A-Za-z0-9-]{{0,{most - 2}}}[A-Za-z0-9])?"


# The formats OpenAI's structured outputs enforce, as patterns in what the converter reads of regular expressions
# (no lookaround; "[.]", as it cannot write "\." in a grammar). Each admits only valid values, not every one: no
# leap second nor year 0000, at most nine digits of a second's fraction, an address's local part and a hostname's
# labels short enough that no value is past RFC 5321's or RFC 1123's lengths, a hostname's last label starting with
# a letter and an email's domain holding a dot, an IPv6 address without an IPv4 one inside.
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][48]|[13579][26]|[2468]0)00)"
_DATE = (
    f"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
    f"|{_LEAP_YEAR}-02-29)"
)
_HOUR_MINUTE = "([01][0-9]|2[0-3]):[0-5][0-9]"
_TIME = f"{_HOUR_MINUTE}:[0-5][0-9]([.][0-9]{{1,9}})?(Z|[+-]{_HOUR_MINUTE})"
_DURATION_TIME = "T([0-9]+H([0-9]+M([0-9]+S)?)?|[0-9]+M([0-9]+S)?|[0-9]+S)"
_LABEL, _LAST_LABEL = _label("[A-Za-z0-9]", 30), _label("[A-Za-z]", 30)
_HEX = "[0-9a-fA-F]{1,4}"
_BYTE = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "duration": (
        f"^P(([0-9]+D|[0-9]+M([0-9]+D)?|[0-9]+Y([0-9]+M([0-9]+D)?)?)({_DURATION_TIME})?|{_DURATION_TIME}|[0-9]+W)$"
    ),
    # at most 64 characters before the @ and 154 after it
    "email": f"^[A-Za-z0-9_%+-]{{1,32}}([.][A-Za-z0-9_%+-]{{1,15}}){{0,2}}@({_LABEL}[.]){{1,4}}{_LAST_LABEL}$",
    # at most 249 characters
    "hostname": f"^({_label('[A-Za-z0-9]', 63)}[.])?({_LABEL}[.]){{0,5}}{_LAST_LABEL}$",
    "ipv4": f"^{_BYTE}([.]{_BYTE}){{3}}$",
    "ipv6": (
        f"^(({_HEX}:){{7}}{_HEX}|({_HEX}:){{1,7}}:|({_HEX}:){{1,6}}:{_HEX}|({_HEX}:){{1,5}}(:{_HEX}){{1,2}}"
        f"|({_HEX}:){{1,4}}(:{_HEX}){{1,3}}|({_HEX}:){{1,3}}(:{_HEX}){{1,4}}|({_HEX}:){{1,2}}(:{_HEX}){{1,5}}"
        f"|{_HEX}:(:{_HEX}){{1,6}}|:((:{_HEX}){{1,7}}|:))$"
    ),
    "uuid": "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
}
# Keywords that say what a value is about, not what it may be.
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly"})
_LENGTHS = (("minLength", "maxLength", "string"), ("minItems", "maxItems", "array"))
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_TRUE_OR_FALSE = "a schema of true or false cannot be enforced by this model's grammar: write {} for any value"
# Integer bounds enforced digit by digit; past this many digits a bound is refused (no model writes such a number).
_MOST_DIGITS = 18


def _unenforceable(schema: dict[str, Any]) -> str | None:
    for keyword in _UNENFORCEABLE:
        if keyword in schema:
            return f"its {keyword!r} cannot be enforced by this model's grammar"
    if schema.get("uniqueItems") is True:
        return "its 'uniqueItems' cannot be enforced by this model's grammar"
    if _BOUNDS & schema.keys() and not _types(schema) & {"integer", "number"}:
        bound = sorted(_BOUNDS & schema.keys())[0]
        return f"its {bound!r} can be enforced by this model's grammar where the type is integer or number"
    return _misread(schema)


# Keywords that hold a value to something: left out beside the keyword the converter reads a schema by, output
# breaking them would pass as valid.
_ASSERTIONS = frozenset(
    {
        *("properties", "required", "additionalProperties", "minProperties", "maxProperties"),
        *("items", "prefixItems", "minItems", "maxItems"),
        *("pattern", "minLength", "maxLength", "format"),
        *("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
        *("const", "enum", "allOf", "anyOf", "oneOf", "$ref"),
    }
)
# What the converter reads a schema by, first to last, when it holds one: it then leaves every other keyword out.
_READ_ALONE = ("$ref", "oneOf", "anyOf", "const", "enum")


def _left_out(schema: dict[str, Any]) -> str | None:
    """A keyword the converter would leave out beside the one it reads ``schema`` by: the 400's reason, or None."""
    if reader := next((keyword for keyword in _READ_ALONE if keyword in schema), None):
        beside = sorted(schema.keys() & _ASSERTIONS - {reader})
    elif "properties" in schema or schema.get("additionalProperties", True) is not True:
        reader, beside = "properties", ["allOf"] if "allOf" in schema else []
    elif "pattern" in schema:
        reader, beside = "pattern", sorted(schema.keys() & {"minLength", "maxLength"})
    else:
        return None
    if not beside:
        return None
    return f"its {beside[0]!r} beside {reader!r} cannot be enforced by this model's grammar: {_WRITE_INSTEAD[reader]}"


def _typed(schema: dict[str, Any], reader: str, target: Callable[[str], Any]) -> dict[str, Any]:
    """``schema`` without its ``type``, which the converter leaves out beside the keyword it reads it by (``reader``):
    an ``enum`` keeps only the values of that type, a ``const`` must be one, and every branch of an ``anyOf`` or
    ``oneOf`` (the target of a ``$ref``) must be of it. Raises ``ValueError`` (the 400's reason) where the schema
    then allows no value, or where its branches' types are not known to be of it."""
    types = _types(schema)
    rest = {key: value for key, value in schema.items() if key != "type"}
    named = f"its 'type' {schema['type']!r}"
    if reader == "const":
        if not _of_types({_kind_of(rest["const"])}, types):
            raise ValueError(f"its 'const' is {_json_kind(rest['const'])}, not of {named}: it allows no value")
        return rest
    if reader == "enum" and isinstance(rest["enum"], list):
        kept = [value for value in rest["enum"] if _of_types({_kind_of(value)}, types)]
        if not kept:
            raise ValueError(f"its 'enum' holds no value of {named}: it allows no value")
        return {**rest, "enum": kept}
    kinds = _kinds(rest, target, frozenset())
    if kinds is None or not _of_types(kinds, types):
        raise ValueError(
            f"{named} beside {reader!r} cannot be enforced by this model's grammar: {_WRITE_INSTEAD[reader]}"
        )
    return rest


def _types(schema: dict[str, Any]) -> set[str]:
    """The types ``schema`` names (none where its ``type`` is not a name or a list of names)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    return set(kind) if isinstance(kind, list) and all(isinstance(one, str) for one in kind) else set()


def _kinds(schema: Any, target: Callable[[str], Any], seen: frozenset[str]) -> frozenset[str] | None:
    """The JSON types the converter may write for ``schema`` (``target`` finds a ``$ref``'s schema), or None where
    any value may come, or it is not known."""
    if not isinstance(schema, dict):
        return None
    if types := _types(schema):
        return frozenset(types)
    if "const" in schema:
        return frozenset({_kind_of(schema["const"])})
    if isinstance(values := schema.get("enum"), list):
        return frozenset(_kind_of(value) for value in values)
    for keyword in ("anyOf", "oneOf"):
        if isinstance(branches := schema.get(keyword), list):
            kinds: frozenset[str] = frozenset()
            for branch in branches:
                if (found := _kinds(branch, target, seen)) is None:
                    return None
                kinds |= found
            return kinds
    if isinstance(ref := schema.get("$ref"), str):
        return None if ref in seen else _kinds(target(ref), target, seen | {ref})
    if "properties" in schema or "allOf" in schema or schema.get("additionalProperties", True) is not True:
        return frozenset({"object"})
    if "items" in schema or "prefixItems" in schema:
        return frozenset({"array"})
    return frozenset({"string"}) if "pattern" in schema else None


def _kind_of(value: Any) -> str:
    """A JSON value's type, as JSON Schema names it (a number with no fraction is an integer)."""
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return "integer"
    kinds = {type(None): "null", float: "number", str: "string", list: "array", dict: "object"}
    return kinds.get(type(value), "value")


def _of_types(kinds: frozenset[str] | set[str], types: set[str]) -> bool:
    return all(kind in types or (kind == "integer" and "number" in types) for kind in kinds)


_WRITE_INSTEAD = {
    "$ref": "write it in the schema the '$ref' points to",
    "oneOf": "write it in each branch",
    "anyOf": "write it in each branch",
    "const": "write the constant alone",
    "enum": "list only the values it allows",
    "properties": "write the properties in one place",
    "pattern": "write the length into the pattern",
}


def _misread(schema: dict[str, Any]) -> str | None:
    """What the converter would read otherwise than JSON Schema means it, so that output breaking the schema would
    pass as valid: the 400's reason, or None."""
    if problem := _left_out(schema):
        return problem
    for low, high, what in _LENGTHS:
        least, most = schema.get(low), schema.get(high)
        for keyword, value in ((low, least), (high, most)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                return f"its {keyword!r} must be a whole number of 0 or more, not {value!r}"
        if isinstance(least, int) and isinstance(most, int) and least > most:
            return f"its {low!r} of {least} is past its {high!r} of {most}: it allows no {what}"
    properties = schema.get("properties")
    if isinstance(properties, dict):
        if "" in properties:
            return "its property named '' cannot be enforced by this model's grammar"
        if any(isinstance(value, bool) for value in properties.values()):
            return _TRUE_OR_FALSE
        required = schema.get("required")
        composed = schema.keys() & {"allOf", "anyOf", "oneOf", "$ref"}  # properties may come from its parts
        absent = [name for name in required if name not in properties] if isinstance(required, list) else []
        if absent and not composed:
            return f"its required property {absent[0]!r} is not among its properties"
    # A closed tuple (prefixItems and no other item) is what the grammar writes of prefixItems alone.
    closed_tuple = "prefixItems" in schema and schema.get("items") is False
    if (isinstance(schema.get("items"), bool) and not closed_tuple) or any(
        isinstance(parts, list) and any(isinstance(part, bool) for part in parts)
        for parts in (schema.get(keyword) for keyword in _SUBSCHEMA_LISTS)
    ):
        return _TRUE_OR_FALSE
    if "prefixItems" in schema and "items" in schema and not closed_tuple:
        return "its 'prefixItems' beside 'items' cannot be enforced by this model's grammar: write one of them"
    if isinstance(prefix := schema.get("prefixItems"), list):  # the grammar writes them all, and no more
        for keyword, outside in (("minItems", lambda n: n > len(prefix)), ("maxItems", lambda n: n < len(prefix))):
            if isinstance(count := schema.get(keyword), int) and outside(count):
                return (
                    f"its {keyword!r} of {count} beside its {len(prefix)} 'prefixItems' cannot be enforced by this "
                    "model's grammar, which writes every prefix item and no other"
                )
    extra = schema.get("additionalProperties")
    if isinstance(properties, dict) and extra not in (None, False):
        listed = schema.get("required")
        if any(name not in (listed if isinstance(listed, list) else ()) for name in properties):
            return (
                "its 'additionalProperties' beside optional properties cannot be enforced by this model's grammar: "
                "make every property required, or additionalProperties false"
            )
    parts = schema.get("allOf")
    if isinstance(parts, list) and not all(isinstance(part, dict) and _an_object(part) for part in parts):
        return "its 'allOf' can be enforced by this model's grammar only of objects"
    if isinstance(parts, list) and (problem := _merge_problem(parts)):
        return problem
    return None


def _merge_problem(parts: list[Any]) -> str | None:
    """Why the converter's merge of an ``allOf``'s objects (every property of every part, each required, and no
    other) would not be what the parts say together, or None."""
    named: set[str] = set()
    for part in parts:
        if part.get("additionalProperties") not in (None, True):
            return "its 'allOf' of objects with 'additionalProperties' cannot be enforced by this model's grammar"
        properties = part.get("properties") if isinstance(part.get("properties"), dict) else {}
        if shared := sorted(named & properties.keys()):
            return (
                f"its 'allOf' names the property {shared[0]!r} in two of its parts, which this model's grammar "
                "cannot hold to both: write it in one"
            )
        named |= properties.keys()
    return None


def _an_object(schema: dict[str, Any]) -> bool:
    """Whether ``schema`` is an object's (what the converter merges the parts of an ``allOf`` as)."""
    kind = schema.get("type")
    if kind is not None:
        return kind == "object"
    return bool(schema.keys() & {"properties", "additionalProperties", "required", "$ref", "allOf", "anyOf", "oneOf"})


def _integer_bounds(schema: dict[str, Any]) -> tuple[int | None, int | None]:
    """An integer schema's least and greatest values, inclusive (None: unbounded)."""
    least = greatest = None
    for keyword, value in schema.items():
        if keyword not in _BOUNDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"its {keyword!r} must be a number")
        if abs(value) >= 10**_MOST_DIGITS:
            raise ValueError(f"its {keyword!r} of {value} is past what this model's grammar enforces")
        if keyword in ("minimum", "exclusiveMinimum"):
            bound = math.floor(value) + 1 if keyword == "exclusiveMinimum" else math.ceil(value)
            least = bound if least is None else max(least, bound)
        else:
            bound = math.ceil(value) - 1 if keyword == "exclusiveMaximum" else math.floor(value)
            greatest = bound if greatest is None else min(greatest, bound)
    if least is not None and greatest is not None and least > greatest:
        raise ValueError(f"its bounds allow no integer (from {least} to {greatest})")
    return least, greatest


@dataclass(frozen=True)
class _Bound:
    value: int
    inclusive: bool


def _number_bounds(schema: dict[str, Any]) -> tuple[_Bound | None, _Bound | None]:
    """A number schema's bounds, each a whole number (the grammar writes a fraction's digits freely only between
    whole numbers)."""
    low: _Bound | None = None
    high: _Bound | None = None
    for keyword, value in schema.items():
        if keyword not in _BOUNDS:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"its {keyword!r} must be a number")
        if value != int(value):
            raise ValueError(
                f"its {keyword!r} of {value} can be enforced by this model's grammar only as a whole number"
            )
        if abs(value) >= 10**_MOST_DIGITS:
            raise ValueError(f"its {keyword!r} of {value} is past what this model's grammar enforces")
        bound = _Bound(int(value), not keyword.startswith("exclusive"))
        if keyword in ("minimum", "exclusiveMinimum"):
            if low is None or (bound.value, not bound.inclusive) > (low.value, not low.inclusive):
                low = bound
        elif high is None or (bound.value, bound.inclusive) < (high.value, high.inclusive):
            high = bound
    if (
        low
        and high
        and (low.value > high.value or (low.value == high.value and not (low.inclusive and high.inclusive)))
    ):
        raise ValueError("its bounds allow no number")
    return low, high


def number_range(low: _Bound | None, high: _Bound | None) -> str:
    """A GBNF expression for the JSON numbers within ``low`` and ``high`` (None: unbounded), written with a fraction
    or none, never an exponent."""
    alternatives = []
    if low is None or low.value < 0:  # the negatives: a minus, then their magnitudes (never a zero one)
        nearest = _Bound(-high.value, high.inclusive) if high is not None and high.value < 0 else _Bound(0, False)
        farthest = None if low is None else _Bound(-low.value, low.inclusive)
        alternatives += [f'"-" {digits}' for digits in _nonnegative_numbers(nearest, farthest)]
    if high is None or high.value > 0 or (high.value == 0 and high.inclusive):
        nearest = low if low is not None and low.value >= 0 else _Bound(0, True)
        alternatives += _nonnegative_numbers(nearest, high)
    return "(" + " | ".join(alternatives) + ")"


def _nonnegative_numbers(low: _Bound, high: _Bound | None) -> list[str]:
    """Alternatives for the numbers from ``low`` up to ``high`` (None: unbounded), zero or more: a whole part in
    range with any fraction below ``high``, ``low`` itself with a fraction that is not zero when ``low`` is
    exclusive, and ``high`` itself with a zero fraction when it is inclusive."""
    # At most 16 digits after the point, as llama.cpp's own number rule (``decimal-part``): a double holds no more,
    # and without a bound a small model writes "1.000…" until its budget ends.
    fraction, zeros, not_zero = '("." [0-9]{1,16})?', '("." "0"{1,16})?', '"." [0-9]{0,15} [1-9] [0-9]{0,15}'
    out = []
    first = low.value if low.inclusive else low.value + 1
    if not low.inclusive and (high is None or high.value > low.value):
        out.append(f"{_spelled(low.value)} {not_zero}")
    last = None if high is None else high.value - 1
    if last is None or last >= first:
        out += [f"({digits}) {fraction}" for digits in _magnitudes(first, last)]
    if high is not None and high.inclusive and high.value >= first:
        out.append(f"{_spelled(high.value)} {zeros}")
    return out


def _spelled(number: int) -> str:
    return " ".join(f'"{digit}"' for digit in str(number))


def integer_range(least: int | None, greatest: int | None) -> str:
    """A GBNF expression for the JSON integers from ``least`` to ``greatest`` (None: unbounded), written as JSON
    writes them: no leading zero, no ``-0``."""
    alternatives = []
    if least is None or least < 0:  # the negatives: a minus, then their magnitudes
        nearest = 1 if greatest is None or greatest >= 0 else -greatest
        alternatives += [f'"-" {digits}' for digits in _magnitudes(nearest, None if least is None else -least)]
    if greatest is None or greatest >= 0:
        alternatives += _magnitudes(0 if least is None or least < 0 else least, greatest)
    return "(" + " | ".join(alternatives) + ")"


def _magnitudes(least: int, greatest: int | None) -> list[str]:
    """Digit sequences for the whole numbers from ``least`` to ``greatest`` (None: unbounded), one or more per
    length."""
    out: list[str] = []
    longest = len(str(greatest)) if greatest is not None else len(str(least))
    for length in range(len(str(least)), longest + 1):
        low = str(least) if length == len(str(least)) else "1" + "0" * (length - 1)
        high = str(greatest) if greatest is not None and length == longest else "9" * length
        out += _same_length(low, high)
    if greatest is None:  # and every longer number
        out.append(" ".join(["[1-9]", *["[0-9]"] * len(str(least)), "[0-9]*"]))
    return out


def _same_length(low: str, high: str) -> list[str]:
    """Digit sequences for the numbers from ``low`` to ``high``, written with as many digits as each other."""
    if low == high:
        return [" ".join(f'"{d}"' for d in low)]
    if len(low) == 1:
        return [f"[{low}-{high}]"]
    if set(low[1:]) == {"0"} and set(high[1:]) == {"9"}:  # every number of the span: one alternative, not 2**digits
        return [" ".join([f"[{low[0]}-{high[0]}]", *["[0-9]"] * (len(low) - 1)])]
    if low[0] == high[0]:
        return [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], high[1:])]
    width = len(low) - 1
    out = [f'"{low[0]}" {rest}' for rest in _same_length(low[1:], "9" * width)]
    if int(high[0]) - int(low[0]) > 1:
        out.append(" ".join([f"[{int(low[0]) + 1}-{int(high[0]) - 1}]", *["[0-9]"] * width]))
    out += [f'"{high[0]}" {rest}' for rest in _same_length("0" * width, high[1:])]
    return out


# Any run of characters that needs no escape in a JSON string: what an unanchored side of a pattern allows.
_STRING_CHARS = '[^"\\\\\\x7F\\x00-\\x1F]*'


def _anchored(schema: Any, *, in_map: bool = False) -> Any:
    """The schema with every ``pattern`` anchored at both ends, as the grammar converter needs.

    JSON Schema patterns match anywhere in the string, so an unanchored side allows other text.
    """
    if isinstance(schema, list):
        return [_anchored(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if in_map:
            out[key] = _anchored(value)
        elif key in SCHEMA_DATA:
            out[key] = value
        elif key == "pattern" and isinstance(value, str):
            if unbalanced := _unbalanced(value):  # anchored, it would run on into the anchoring's own
                raise ValueError(f"its pattern's {unbalanced}")
            alternatives = _alternatives(value)
            if len(alternatives) == 1:
                out[key] = f"^{_anchored_alternative(value)}$"
            else:
                out[key] = f"^({'|'.join(_anchored_alternative(one) for one in alternatives)})$"
        else:
            out[key] = _anchored(value, in_map=key in SCHEMA_MAPS)
    return out


def _unbalanced(pattern: str) -> str | None:
    """What is unbalanced in ``pattern`` (a set or a group never closed, a group closed that never opened), as a
    regular expression's syntax error says it, or None."""
    in_set, depth, index = False, 0, 0
    while index < len(pattern):
        char = pattern[index]
        index += 2 if char == "\\" else 1
        if char == "[" and not in_set:
            in_set = True
        elif char == "]" and in_set:
            in_set = False
        elif char == "(" and not in_set:
            depth += 1
        elif char == ")" and not in_set:
            if not depth:
                return f") at {index - 1} closes no group"
            depth -= 1
    if in_set:
        return "[ is never closed"
    return "( is never closed" if depth else None


def _anchored_alternative(alternative: str) -> str:
    """One alternative of a pattern, anchored at both ends: an anchor it has (or several, ``^^a$$``) is dropped,
    and a side without one allows any other text."""
    core = alternative.lstrip("^")
    head = "" if core != alternative else _STRING_CHARS
    end = len(core)
    while end and core[end - 1] == "$" and (end - 1 - len(core[: end - 1].rstrip("\\"))) % 2 == 0:
        end -= 1  # an anchor, not an escaped dollar (an even run of backslashes before it)
    tail = "" if end < len(core) else _STRING_CHARS
    return f"{head}({core[:end]}){tail}"


def _alternatives(pattern: str) -> list[str]:
    """``pattern`` split at its top-level ``|`` (outside groups and sets)."""
    parts, depth, start, index, in_set = [], 0, 0, 0, False
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if in_set:
            in_set = char != "]"
        elif char == "[":
            in_set = True
            index += 2 if pattern.startswith("]", index + 1) or pattern.startswith("^]", index + 1) else 1
            continue
        elif char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "|" and depth == 0:
            parts.append(pattern[start:index])
            start = index + 1
        index += 1
    return [*parts, pattern[start:]]
