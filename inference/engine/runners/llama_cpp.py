"""The CPU runner: llama.cpp (through llama-cpp-python's low-level API) on a GGUF model; the embedded
default is SmolLM2-135M-Instruct.

One llama.cpp context per loaded model holds ``parallel`` sequences, each with its own part of the KV
cache, and one scheduling thread owns it: every step is one ``llama_decode`` over the next token of
every sequence that is generating, plus a chunk of the prompts still being read (continuous batching).
Jobs join and leave between steps, and only that thread calls into the context. Each step lists its
sequences in slot order: llama.cpp decodes a batch in one pass only while its sequence ids rise one by one.

A job that arrives finds a free sequence slot, preferring the one whose cached tokens share the longest
prefix with its prompt: that part is not read again (``cached_tokens``). More jobs than slots wait in a
bounded queue, in arrival order; past the bound a job is refused at once as ``overloaded``.

Each sequence keeps its own sampler (temperature, top_p, penalties, seed), grammar (JSON schema, strict
and forced tools), stop sequences, logprobs and token budget. Grammar-constrained sampling checks the
freely drawn token against the grammar first and masks the vocabulary only when it is refused, as
llama.cpp's own tools do: masking 49k tokens at every step costs many times the step itself.
"""

from __future__ import annotations

import atexit
import bisect
import codecs
import collections
import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import math
import os
import queue
import re
import secrets
import string
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from importlib import machinery
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from django.conf import settings as django_settings

from .base import (
    SCHEMA_DATA,
    SCHEMA_MAPS,
    TOOL_OPEN,
    Constraint,
    Delivery,
    Finished,
    GenerationJob,
    JsonScan,
    PromptRenderer,
    RawEvent,
    RunnerError,
    Sampling,
    TextChunk,
    TokenLogprob,
    keyword_problem,
    prompt_pieces,
    rebased,
    schema_at,
)
from .grammar_costs import grammar_cost_problem
from .schema_ends import endless_problem

logger = logging.getLogger(__name__)

# A value that must be whole JSON (``Constraint.close_before_limit``) starts closing once the budget left is no more
# than what closing it may take: a token per open quote and bracket, CLOSING_SLACK more (a separator, a number's
# digit, the end), and for each property its schema requires that it has not written yet, its name's tokens and
# PROPERTY_COST more (the colon, an empty value, a separator). Closing sooner cuts calls that would have fit; later,
# calls that cannot close in time.
CLOSING_SLACK = 4
PROPERTY_COST = 3
# Sampling under a grammar checks these many likeliest tokens first, then the rest of the vocabulary in slices of
# GRAMMAR_SLICE, until a slice holds a token the grammar allows (``_Sampler._draw_allowed``).
LIKELIEST = 512
GRAMMAR_SLICE = 2048
# A grammar that takes longer than this to check for one token ends its job: every sequence waits for it.
GRAMMAR_CHECK_MAX_SECONDS = 1.0
# How many prompt tokens one step reads at most, besides the generating sequences' tokens: a longer
# prompt is read over several steps, so that the others' streams never stall for long.
PREFILL_CHUNK = 256
# A stream's text leaves at most this often (its first token at once): tokens that come faster travel
# together. Each delta costs the serving process the same CPU, whatever it holds, and on a small model
# that CPU is taken from the model's own threads; 40 ms is still smoother than a reader can tell.
STREAM_INTERVAL_MS = 40


def model_path(settings: dict[str, Any]) -> str:
    if path := settings.get("model_path"):
        return str(path)
    package, file = settings.get("package"), settings.get("file")
    if not package or not file:
        raise RunnerError("llama_cpp settings need model_path, or package and file", code="runner_unavailable")
    if not isinstance(package, str) or not _PACKAGE_NAME.match(package) or not isinstance(file, str):
        raise RunnerError(f"{package!r} and {file!r} are not a package's name and a file's", code="runner_unavailable")
    folders = _package_folders(package)
    if folders is None:
        raise RunnerError(f"the package {package!r} is not installed", code="runner_unavailable")
    for folder in folders:
        if is_file(located := folder / file):
            return str(located)
    raise RunnerError(f"{file!r} is not in the package {package!r}", code="runner_unavailable")


def is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a name no file could have (too long for the filesystem, say)."""
    try:
        return path.is_file()
    except OSError:
        return False


_PACKAGE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")


def _package_folders(name: str) -> list[Path] | None:
    """The folders of an installed package, found without importing it (an import runs its code, whatever the
    admin typed); None for a name that is no installed package (a module, say)."""
    folders: list[str] | None = None
    for part in name.split("."):
        spec = machinery.PathFinder.find_spec(part, folders)
        if spec is None or not spec.submodule_search_locations:
            return None
        folders = list(spec.submodule_search_locations)
    return [Path(folder) for folder in folders or ()]


def default_parallel() -> int:
    """Sequence slots when the catalog entry sets none: a decode step over 4 sequences costs little more
    than over one on a small model; more slots pay off with more cores to run them."""
    return min(8, max(4, os.cpu_count() or 1))


# llama.cpp's threads for every model of this process, over the catalog entry's ``n_threads``.
THREADS_VARIABLE = "CPU_RUNNER_THREADS"


def default_threads() -> int:
    return min(8, os.cpu_count() or 1)


DEFAULT_CONTEXT = 8192  # tokens per sequence

# The numbers a catalog entry's ``runner_settings`` may set, each with the least and the most it may be; one left
# out takes its default. The most: llama.cpp's own limits (256 sequences, 512 threads), a context of a million
# tokens, a queue any host's threads could hold, and deltas held back 10 s at most (past that a stream seems dead).
SETTING_RANGES = {
    "parallel": (1, 256),
    "queue": (0, 4096),
    "n_ctx": (16, 2**20),
    "n_threads": (1, 512),
    "prefill_chunk": (1, 2**20),
    "stream_interval_ms": (0, 10_000),
}
# Every setting the runner reads: where its model file is, and the numbers above.
SETTING_NAMES = frozenset({"model_path", "package", "file", *SETTING_RANGES})


def settings_problem(settings: dict[str, Any]) -> str | None:
    """What is wrong with the numbers in a catalog entry's settings, or None. The model file is checked where the
    model loads: in distributed mode that is a worker's host, not the one the admin runs on."""
    if not isinstance(settings, dict):  # saved around the admin (a shell, a fixture, SQL)
        return "they must be a JSON object."
    for name, (least, most) in SETTING_RANGES.items():
        value = settings.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most):
            return f"{name} must be a whole number from {least} to {most}, not {value!r}."
    chunk, context = settings.get("prefill_chunk"), settings.get("n_ctx") or DEFAULT_CONTEXT
    if chunk is not None and chunk > context:
        return f"prefill_chunk must be at most n_ctx ({context}): a prompt is prefilled within one sequence."
    return None


@dataclass(frozen=True, slots=True)
class RunnerSettings:
    """A catalog entry's ``runner_settings`` for this runner, with the machine's defaults filled in."""

    path: str
    context: int  # tokens per sequence: the prompt and its output together
    parallel: int
    queue: int
    threads: int
    prefill_chunk: int
    stream_interval: float  # seconds

    @classmethod
    def of(cls, settings: dict[str, Any]) -> RunnerSettings:
        if problem := settings_problem(settings):
            raise RunnerError(f"the model's runner settings are wrong: {problem}", code="runner_unavailable")

        def number(name: str, default: int) -> int:
            value = settings.get(name)
            return default if value is None else int(value)

        parallel = number("parallel", default_parallel())
        return cls(
            path=model_path(settings),
            context=number("n_ctx", DEFAULT_CONTEXT),
            parallel=parallel,
            queue=number("queue", 4 * parallel),
            # The host's own choice first: a host that runs several model workers splits its cores among them.
            threads=int(os.environ.get(THREADS_VARIABLE) or number("n_threads", default_threads())),
            prefill_chunk=number("prefill_chunk", PREFILL_CHUNK),
            stream_interval=number("stream_interval_ms", STREAM_INTERVAL_MS) / 1000,
        )


_loaded: list[Callable[[], None]] = []
_exiting = False  # the process is exiting: a job cut now is cut by the shutdown (a worker's cold stop)


@atexit.register
def _close_all() -> None:
    # Closed while the interpreter still works; left to garbage collection at exit, llama.cpp's
    # finalizers run after their module globals are gone and print errors.
    global _exiting
    _exiting = True
    for close in reversed(_loaded):
        close()


# ggml's log levels, as the vendored llama.cpp numbers them (ggml.h); 5 continues the line before.
_GGML_LOG_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}
_native_log = logging.getLogger("llama-cpp-python")


@functools.cache
def _log_callback() -> Any:
    """llama.cpp's log, written as llama-cpp-python writes it, at or above its logger's level. The library's own
    callback reads the levels by an older numbering, under which a model's loading and its context (INFO) passed
    for warnings and were printed at every start. Installed once; the reference it returns keeps it alive."""
    from llama_cpp import llama_cpp as lib

    last = logging.DEBUG

    @lib.llama_log_callback
    def write(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        nonlocal last
        last = last if level == 5 else _GGML_LOG_LEVELS.get(level, logging.ERROR)
        if _native_log.isEnabledFor(last):
            sys.stderr.write(text.decode("utf-8", "replace"))

    lib.llama_log_set(write, ctypes.c_void_p(0))
    return write


def _load_model(path: str, *, vocab_only: bool) -> Any:
    from llama_cpp import _internals
    from llama_cpp import llama_cpp as lib

    _log_callback()
    params = lib.llama_model_default_params()
    params.vocab_only = vocab_only
    try:
        model = _internals.LlamaModel(path_model=path, params=params, verbose=False)
    except ValueError as exc:
        raise RunnerError(f"could not load the model: {exc}", code="runner_unavailable") from None
    _loaded.append(model.close)
    return model


JSON_STRING_CHAR = r'[^"\\\x7F\x00-\x1F] | [\\] (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'


@dataclass(frozen=True, slots=True)
class SchemaLimits:
    """How large a schema this runner takes, so that building and compiling its grammar stays bounded.

    The converter writes counted repetitions out in full (``maxLength: 50`` is fifty nested optional groups) and
    llama.cpp's grammar parser recurses once per group: an unbounded count builds without end, or crashes the
    process when the parser's recursion outgrows its stack. Each optional property of an object costs the
    converter a recursion, and its work grows with their square.
    """

    depth: int = 32  # JSON nesting inside the schema, and groups nested in a pattern
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


class _Sampler:
    """Samples one sequence's next tokens: its own chain (penalties, top_p, temperature, seed) and grammar.

    The token is first drawn freely and checked against the grammar alone; only when the grammar refuses
    it is the vocabulary masked and the token drawn again. Output is the same as masking first: a token
    the grammar accepts, drawn from the grammar-masked distribution when the free draw was refused.
    """

    def __init__(self, model: Any, sampling: Sampling, grammar: Any) -> None:
        from llama_cpp import _internals
        from llama_cpp import llama_cpp as lib

        self._lib = lib
        self._grammar = grammar
        self._greedy = sampling.temperature == 0
        self._chain = _internals.LlamaSampler()
        self._penalized = bool(sampling.frequency_penalty or sampling.presence_penalty)
        if self._penalized:
            self._chain.add_penalties(
                n_vocab=model.n_vocab(),
                penalty_last_n=64,
                penalty_repeat=1.0,
                penalty_freq=sampling.frequency_penalty,
                penalty_present=sampling.presence_penalty,
            )
        if self._greedy:
            self._chain.add_greedy()
        else:
            if sampling.top_p < 1.0:
                self._chain.add_top_p(sampling.top_p, 1)
            self._chain.add_temp(sampling.temperature)
            self._chain.add_dist(secrets.randbits(32) if sampling.seed is None else seed_32(sampling.seed))
        self._candidates = _internals.LlamaTokenDataArray(n_vocab=model.n_vocab())
        # Whether the last token closing took departs from the one the model would have taken (``Closing.choose``).
        self.departed = False
        self._single_data = (lib.llama_token_data * 1)()
        self._single = lib.llama_token_data_array(data=self._single_data, size=1, selected=-1, sorted=False)

    def close(self) -> None:
        if self._grammar:
            self._lib.llama_sampler_free(self._grammar)
            self._grammar = None
        self._chain.close()

    def _draw(self, logits: np.ndarray, *, masked: bool) -> int:
        if masked:
            return self._draw_allowed(logits)
        if self._greedy and not self._penalized:
            return int(np.argmax(logits))
        candidates = self._candidates
        candidates.copy_logits(logits)
        self._lib.llama_sampler_apply(self._chain.sampler, ctypes.byref(candidates.candidates))
        return int(candidates.candidates_data.id[candidates.candidates.selected])

    def _draw_allowed(self, logits: np.ndarray) -> int:
        """A token drawn among those the grammar allows, checked in slices of the vocabulary from the highest logit
        down: the first slice that holds any is drawn from. Checking a token costs as much as the grammar has live
        alternatives, so a few hundred tokens cost a small part of the whole vocabulary. Greedy decoding draws what it
        would from the whole vocabulary; sampling leaves out only the tail of the distribution, which holds next to
        nothing. A grammar too costly to check ends the job (``GRAMMAR_CHECK_MAX_SECONDS``): every sequence of the
        context waits for it at each step."""
        started = time.monotonic()
        for ids in _by_logit(logits):
            if self._allow_among(ids, logits):
                self._lib.llama_sampler_apply(self._chain.sampler, ctypes.byref(self._candidates.candidates))
                return int(self._candidates.candidates_data.id[self._candidates.candidates.selected])
            if (spent := time.monotonic() - started) > GRAMMAR_CHECK_MAX_SECONDS:
                raise RunnerError(
                    f"the output constraint is too costly to enforce: {spent * 1000:.0f} ms went on checking the "
                    f"vocabulary against it for one token (at most {GRAMMAR_CHECK_MAX_SECONDS * 1000:.0f}); "
                    "simplify its schema",
                    code="constraint_too_costly",
                )
        raise RunnerError("the output constraint allows no token here", code="invalid_constraint")

    def _allow_among(self, ids: np.ndarray, logits: np.ndarray) -> bool:
        """Puts the tokens ``ids`` in the candidates, the grammar's mask applied; whether it allows any of them."""
        candidates = self._candidates
        data, count = candidates.candidates_data, len(ids)
        data.id[:count] = ids
        data.logit[:count] = logits[ids]
        data.p[:count] = 0
        candidates.candidates.size = count
        candidates.candidates.sorted = False
        candidates.candidates.selected = -1
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        return bool(np.isfinite(data.logit[:count]).any())

    def _allowed(self, token: int) -> bool:
        self._single_data[0].id = token  # type: ignore[assignment]  # ctypes converts the int
        self._single_data[0].logit = 1.0
        self._single_data[0].p = 0.0
        self._single.size = 1
        self._single.selected = -1
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(self._single))
        return bool(np.isfinite(self._single_data[0].logit))

    def would_end(self, ends: frozenset[int]) -> bool:
        """Whether the grammar would take the end of the output now (its value is whole)."""
        return bool(self._grammar) and any(self._allowed(token) for token in ends)

    def next(self, logits: np.ndarray, *, closing: Closing | None = None) -> int:
        """The next token; with ``closing``, the shortest way to a whole JSON value the grammar allows."""
        if closing is not None and self._grammar:
            token = self._closing(logits, closing)
        else:
            token = self._draw(logits, masked=False)
            if self._grammar and not self._allowed(token):
                token = self._draw(logits, masked=True)
        if self._grammar:
            self._lib.llama_sampler_accept(self._grammar, token)
        self._lib.llama_sampler_accept(self._chain.sampler, token)
        return token

    def _closing(self, logits: np.ndarray, closing: Closing) -> int:
        candidates = self._candidates
        candidates.copy_logits(logits)
        self._lib.llama_sampler_apply(self._grammar, ctypes.byref(candidates.candidates))
        token, self.departed = closing.choose(candidates.candidates_data.logit)
        return token


_64_BITS = (1 << 64) - 1


def seed_32(seed: int) -> int:
    """An OpenAI seed (64 bits) as llama.cpp's, which is 32 bits and takes 0xFFFFFFFF to ask for a random one: mixed
    (SplitMix64's finalizer) before it is folded, so that every seed repeats itself and seeds that differ only in
    their high bits (1 and 2**32, -1 and 2**32 - 2) do not draw alike."""
    mixed = (seed + 0x9E3779B97F4A7C15) & _64_BITS
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _64_BITS
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _64_BITS
    return (mixed ^ (mixed >> 31)) % 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Needed:
    """What a value of a schema must name: the properties it requires, and those its required properties require in
    turn (an optional property's own are not needed); for one of several calls, the function it calls."""

    names: frozenset[str]
    call: str | None = None


def needed(schema: Any) -> list[Needed]:
    """What a value of ``schema`` must name, as one ``Needed`` per alternative of a root ``anyOf`` (a call of one of
    several tools) or one for the whole (a bounded schema: its size is checked first)."""
    done: dict[int, frozenset[str]] = {}

    def names(node: Any) -> frozenset[str]:
        if not isinstance(node, dict) or id(node) in done:
            return done.get(id(node), frozenset())
        done[id(node)] = frozenset()  # a schema that refers to itself needs nothing more where it does
        found: set[str] = set()
        if isinstance(ref := node.get("$ref"), str):
            found |= names(schema_at(schema, ref))
        parts = node.get("allOf")
        for part in parts if isinstance(parts, list) else ():
            found |= names(part)
        branches = node.get("anyOf") or node.get("oneOf")
        if isinstance(branches, list) and branches:  # what every branch needs, whichever is written
            found |= frozenset.intersection(*(names(branch) for branch in branches))
        listed = node.get("required")
        required = [name for name in listed if isinstance(name, str)] if isinstance(listed, list) else []
        properties: dict[str, Any] = node["properties"] if isinstance(node.get("properties"), dict) else {}
        found.update(required)
        for name in required:
            found |= names(properties.get(name))
        if isinstance(least := node.get("minItems"), int) and least > 0:
            found |= names(node.get("items"))
        done[id(node)] = frozenset(found)
        return done[id(node)]

    branches = schema.get("anyOf") if isinstance(schema, dict) else None
    if isinstance(branches, list) and branches:
        return [Needed(names(branch), _called(branch)) for branch in branches]
    return [Needed(names(schema), _called(schema))]


def _called(schema: Any) -> str | None:
    """The function a call's schema (``{"name": {"const": …}, "arguments": …}``) calls, if it is one."""
    name = schema.get("properties", {}).get("name") if isinstance(schema, dict) else None
    called = name.get("const") if isinstance(name, dict) else None
    return called if isinstance(called, str) else None


# The function a call names, as its JSON string.
_CALLED = re.compile(r'"name"\s*:\s*("(?:[^"\\]|\\.)*")')


class JsonTail:
    """How far a JSON text written so far is from whole, as far as its strings and brackets go, and which of the
    properties it must hold it has not named yet."""

    def __init__(self, needs: Sequence[Needed] = (), cost: Callable[[str], int] = lambda name: 0) -> None:
        self.open: list[str] = []  # the closing bracket of each open array or object, innermost last
        self.scan = JsonScan()
        # Each alternative: the function it calls as the text writes it, and each name it needs, as the text may
        # write it (its characters as they are, or escaped), with the tokens writing it with an empty value takes
        # (``cost`` of its JSON string, spelled the longer way).
        self.alternatives = [
            (
                None if need.call is None else json.dumps(need.call, ensure_ascii=False),
                {name: self._spelled(name, cost) for name in need.names},
            )
            for need in needs
        ]
        self.text = ""

    @staticmethod
    def _spelled(name: str, cost: Callable[[str], int]) -> tuple[set[str], int]:
        spellings = {json.dumps(name, ensure_ascii=False), json.dumps(name)}
        return spellings, max(map(cost, spellings))

    def missing(self) -> int:
        """The tokens the required properties the text has not named take to write (a name met in a string counts:
        a guess, cheap): of the call the text names, or the cheapest while it names none."""
        if not self.alternatives:
            return 0
        for _, unnamed in self.alternatives:
            for name in [name for name, (spellings, _) in unnamed.items() if any(s in self.text for s in spellings)]:
                del unnamed[name]
        # The call's name comes first in it: a name met later is an argument's.
        called = found.group(1) if (found := _CALLED.search(self.text)) is not None else None
        named = [unnamed for call, unnamed in self.alternatives if call is not None and call == called]
        return min(sum(cost for _, cost in unnamed.values()) for unnamed in named or (u for _, u in self.alternatives))

    def feed(self, text: str) -> None:
        self.text += text
        for char in text:
            if (move := self.scan.read(char)) > 0:
                self.open.append("}" if char == "{" else "]")
            elif move < 0 and self.open:
                self.open.pop()

    def closers(self) -> str:
        """The quotes and brackets that close every open string, array and object, in order."""
        if self.scan.escaped:  # an escape needs its letter before the string can close
            return ""
        return ('"' if self.scan.in_string else "") + "".join(reversed(self.open))


@dataclass(frozen=True)
class Closing:
    """One step of closing a JSON value: the closing vocabulary and the quotes and brackets still open."""

    vocabulary: ClosingVocabulary
    closers: str
    # Each token's bytes, to hold closing's choice against the model's (none: any other token departs from it).
    pieces: Sequence[bytes] = ()
    # Whether the text is inside a JSON string, where spaces are text (elsewhere they are nothing).
    in_string: bool = False

    def choose(self, allowed: np.ndarray) -> tuple[int, bool]:
        """``pick``'s token, and whether it departs from the text the model was about to write (its likeliest allowed
        token): closing then cut the value short, rather than finishing it as the model would have. Spaces between
        JSON tokens count for nothing."""
        token = self.pick(allowed)
        own = int(np.argmax(allowed))
        if token == own or not self.pieces:
            return token, token != own
        meant = self._text(own)
        if token in self.vocabulary.ends:  # the value is whole: the model meant to end it too, or to write nothing
            return token, bool(meant)
        chosen = self._text(token)
        if meant.startswith(chosen):  # less of the model's text: its rest may follow
            return token, False
        if not chosen.startswith(meant):
            return token, True
        # More of it is the model's text where the grammar admits no other (a function's name, an empty object's
        # brackets), or where what it adds closes what the model's token left open; not a value of closing's own (a
        # string the model had just opened, closed empty or filled; a comma and the next name).
        scan = JsonScan(in_string=self.in_string)
        for char in meant.decode("utf-8", errors="replace"):
            scan.read(char)
        more = chosen[len(meant) :]
        closes_only = not b"".join(more.split()).strip(b'"]}')
        return token, not self._one_text(allowed, chosen) and (scan.in_string or not closes_only)

    def _one_text(self, allowed: np.ndarray, longest: bytes) -> bool:
        """Whether every token the grammar allows spells a start of ``longest``: the text is the grammar's, not the
        model's to choose."""
        return all(longest.startswith(self._text(int(token))) for token in np.flatnonzero(np.isfinite(allowed)))

    def _text(self, token: int) -> bytes:
        piece = self.pieces[token]
        return piece if self.in_string else b"".join(piece.split())

    def pick(self, allowed: np.ndarray) -> int:
        """Of the tokens the grammar allows (finite ``allowed`` logits): an end of generation once the value is
        whole; else the longest run of the open quotes and brackets, in order; else, for what the grammar still
        requires (a property's name, a value, a digit), a token that is not only spaces and opens the fewest
        objects and arrays (``{}`` for an object that may be empty, not ``{"``: a recursive schema would never
        close), and of those the longest, to spell it in as few as it allows."""
        vocabulary = self.vocabulary
        ends = vocabulary.ends[np.isfinite(allowed[vocabulary.ends])]
        if ends.size:
            return int(ends[np.argmax(allowed[ends])])
        closers = [
            (len(text), allowed[token], token)
            for token, text in vocabulary.closers
            if self.closers.startswith(text) and np.isfinite(allowed[token])
        ]
        if closers:
            return int(max(closers)[2])
        ids = np.flatnonzero(np.isfinite(allowed))
        if (spelled := ids[~vocabulary.blank[ids]]).size:  # a space between JSON tokens takes a token for nothing
            ids = spelled
        opened = vocabulary.opened[int(self.closers.startswith('"')), ids]
        ids = ids[opened == opened.min()]
        ids = ids[vocabulary.lengths[ids] == vocabulary.lengths[ids].max()]
        return int(ids[np.argmax(allowed[ids])])


@dataclass(frozen=True)
class ClosingVocabulary:
    """What closing a JSON value takes: the tokens that end generation, the tokens made only of quotes, closing
    brackets and spaces (``"``, ``"}``, `` ]}`` …, each with its spaces taken out), and every token's length."""

    ends: np.ndarray
    closers: tuple[tuple[int, str], ...]
    lengths: np.ndarray
    # How many more objects and arrays each token leaves open than were before it (fewer: negative), written
    # outside a string (row 0) and inside one (row 1); and which tokens are spaces only.
    opened: np.ndarray
    blank: np.ndarray

    @classmethod
    def of(cls, vocabulary: Vocabulary) -> ClosingVocabulary:
        size = len(vocabulary.pieces)
        closers, lengths = [], np.zeros(size, dtype=np.intc)
        opened = np.zeros((2, size), dtype=np.intc)
        blank = np.zeros(size, dtype=bool)
        for token, piece in enumerate(vocabulary.pieces):
            text = piece.decode("utf-8", errors="replace")
            lengths[token] = len(text)
            blank[token] = not text.strip()
            opened[0, token], opened[1, token] = _opened(text, in_string=False), _opened(text, in_string=True)
            bare = "".join(text.split())  # a space is insignificant between JSON tokens and harmless in a string
            if bare and not bare.strip('"]}'):
                closers.append((token, bare))
        ends = np.array(sorted(vocabulary.ends), dtype=np.intc)
        return cls(ends=ends, closers=tuple(closers), lengths=lengths, opened=opened, blank=blank)


def _opened(text: str, *, in_string: bool) -> int:
    """How many more objects and arrays are open after ``text`` than before it, read from in or out of a string (a
    string always ends at its quote; brackets nest)."""
    scan = JsonScan(in_string=in_string)
    return sum(scan.read(char) for char in text)


def _by_logit(logits: np.ndarray) -> Iterator[np.ndarray]:
    """The vocabulary in slices, from the highest logit down: the ``LIKELIEST`` tokens, then ``GRAMMAR_SLICE`` at a
    time (sorted only when the first slice is not enough)."""
    likeliest = np.argpartition(-logits, LIKELIEST - 1)[:LIKELIEST]
    yield likeliest
    rest = np.ones(len(logits), dtype=bool)
    rest[likeliest] = False
    ids = np.flatnonzero(rest)
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    for start in range(0, len(ids), GRAMMAR_SLICE):
        yield ids[start : start + GRAMMAR_SLICE]


def piece(model: Any, token: int, *, special: bool = False) -> bytes:
    """A token's bytes (the library's own ``token_to_piece`` returns its whole buffer, NULs and all)."""
    from llama_cpp import llama_cpp as lib

    buffer = ctypes.create_string_buffer(64)
    size = lib.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, special)
    if size < 0:  # longer than the buffer: -size is what it needs
        buffer = ctypes.create_string_buffer(-size)
        size = lib.llama_token_to_piece(model.vocab, token, buffer, len(buffer), 0, special)
    return buffer.raw[:size]


def tokenize(model: Any, prompt: str, literal: tuple[tuple[int, int], ...] = ()) -> list[int]:
    """A prompt's tokens: the chat template's special tokens as themselves, its ``literal`` spans as text."""
    tokens: list[int] = []
    for text, as_text in prompt_pieces(prompt, literal):
        tokens += model.tokenize(text.encode("utf-8"), False, not as_text)
    return tokens


class Vocabulary:
    """A model's tokens as text, looked up without a call into llama.cpp per token."""

    def __init__(self, model: Any) -> None:
        from llama_cpp import llama_cpp as lib

        self.model = model
        self.pieces = [piece(model, token) for token in range(model.n_vocab())]
        # For logprobs' alternatives: a control token (the end of a turn) by its name, as its text (none) cannot.
        self.names = [text or piece(model, token, special=True) for token, text in enumerate(self.pieces)]
        self.ends = frozenset(token for token in range(model.n_vocab()) if lib.llama_vocab_is_eog(model.vocab, token))
        self._closing: ClosingVocabulary | None = None

    def is_end(self, token: int) -> bool:
        return token in self.ends

    def tokenize(self, text: str, literal: tuple[tuple[int, int], ...] = ()) -> list[int]:
        return tokenize(self.model, text, literal)

    @property
    def closing(self) -> ClosingVocabulary:
        if self._closing is None:
            self._closing = ClosingVocabulary.of(self)
        return self._closing


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


_END = object()


class _Sequence:
    """One job on its way through the context: its prompt, its sampler, what it has produced and sent."""

    def __init__(
        self,
        job: GenerationJob,
        cancelled: Callable[[], bool],
        prompt: list[int],
        max_tokens: int,
        sampler: _Sampler,
        vocabulary: Vocabulary,
        stream_interval: float,
        deliver: Delivery,
    ) -> None:
        self.deliver = deliver
        self.job = job
        self.cancelled = cancelled
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.vocabulary = vocabulary
        self.abandoned = False  # the consumer stopped reading
        self.slot: _Slot | None = None
        self.read = 0  # prompt tokens in the KV cache (reused ones included)
        self.cached = 0
        self.next_token: int | None = None  # sampled, not yet in the KV cache
        self.produced = 0
        sampling = job.sampling
        self.stops = sampling.stop
        self.holdback = max((len(s) for s in self.stops), default=1) - 1
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # Text generated and not sent yet, where each of its tokens ends in it, whether its bytes end a character
        # there (a token may end with the first bytes of the next one), and their logprobs.
        self.pending = ""
        self.pending_ends: list[int] = []
        self.pending_whole: list[bool] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.stream_interval = stream_interval
        self.sent_at = -math.inf
        # A value that must be whole: how far it is from closed, followed as it is written.
        constraint = job.constraint
        self.tail = None
        if constraint and constraint.close_before_limit:
            self.tail = JsonTail(needed(constraint.schema), lambda name: len(vocabulary.tokenize(name)) + PROPERTY_COST)
        # Whether closing it changed what the model wrote (then it was cut short, not finished).
        self.steered = False
        # Whether the output is one JSON value (a schema's, an object, a forced call), not text that may hold one.
        self.whole_value = constraint is not None and constraint.kind in ("json_schema", "json_object")

    @property
    def gone(self) -> bool:
        return self.abandoned or self.cancelled()

    @property
    def reading(self) -> bool:
        return self.read < len(self.prompt)

    def advance(self, logits: np.ndarray, now: float) -> bool:
        """Takes the next token from ``logits`` at time ``now``; true when the sequence is finished."""
        closing = None
        if self.tail is not None:
            closers = self.tail.closers()
            if self.max_tokens - self.produced <= len(closers) + CLOSING_SLACK + self.tail.missing():
                in_string = self.tail.scan.in_string
                closing = Closing(self.vocabulary.closing, closers, self.vocabulary.pieces, in_string)
        token = self.sampler.next(logits, closing=closing)
        self.steered = self.steered or (closing is not None and self.sampler.departed)
        if self.vocabulary.is_end(token):
            # A value closed early is cut short, unless the model would have written it so anyway.
            return self.finish("length" if self.steered else "stop")
        self.produced += 1
        sampling = self.job.sampling
        if sampling.logprobs:
            self.pending_logprobs.append(self._logprob(logits, token, sampling.top_logprobs))
        text = self.decoder.decode(self.vocabulary.pieces[token])
        if self.tail is not None:
            self.tail.feed(text)
        self.pending += text
        self.pending_ends.append(len(self.pending))
        self.pending_whole.append(not self.decoder.getstate()[0])
        ready = len(self.pending)
        if self.stops:
            hit = min((i for s in self.stops if (i := self.pending.find(s)) >= 0), default=-1)
            if hit >= 0:
                # The tokens of the stop sequence leave the logprobs as their text leaves the output.
                del self.pending_logprobs[bisect.bisect_left([0, *self.pending_ends], hit) :]
                self.pending = self.pending[:hit]
                return self.finish("stop")
            ready = max(0, len(self.pending) - self.holdback)
        if ready and now - self.sent_at >= self.stream_interval:
            self._send_through(ready)
            self.sent_at = now
        if self.produced >= self.max_tokens:
            # A JSON value the grammar holds whole as the budget runs out is finished, as it would have been one
            # token later (OpenAI's SDKs refuse to parse an answer that ended for its length).
            whole = self.whole_value and not self.steered and self.sampler.would_end(self.vocabulary.ends)
            return self.finish("stop" if whole else "length")
        self.next_token = token
        return False

    def _send_through(self, ready: int) -> None:
        """Sends the pending tokens whose text ends within its first ``ready`` characters (the rest may still
        become a stop sequence), each chunk's logprobs those of its own text."""
        count = bisect.bisect_right(self.pending_ends, ready)
        while count and not self.pending_whole[count - 1]:
            count -= 1  # its last bytes begin a character still to come: the token leaves with that character
        if not count or not (cut := self.pending_ends[count - 1]):
            return
        logprobs, self.pending_logprobs = self.pending_logprobs[:count], self.pending_logprobs[count:]
        self.deliver(TextChunk(self.pending[:cut], count, tuple(logprobs), self.cached))
        self.pending = self.pending[cut:]
        self.pending_ends = [end - cut for end in self.pending_ends[count:]]
        self.pending_whole = self.pending_whole[count:]

    def finish(self, reason: str) -> bool:
        # The first bytes of a character the output never finished (cut by the budget) are no text: dropped, not sent
        # as U+FFFD (the tokens still count, and their logprobs carry those bytes).
        if reason != "cancelled" and (self.pending or self.pending_ends):
            self.deliver(TextChunk(self.pending, len(self.pending_ends), tuple(self.pending_logprobs), self.cached))
        self.deliver(Finished(reason, len(self.prompt), self.produced, self.cached))  # type: ignore[arg-type]
        return True

    def fail(self, error: RunnerError) -> None:
        self.deliver(error)

    def close(self) -> None:
        self.sampler.close()

    def events(self, out: queue.SimpleQueue[RawEvent | RunnerError]) -> Iterator[RawEvent]:
        try:
            while True:
                item = out.get()
                if isinstance(item, RunnerError):
                    raise item
                yield item
                if isinstance(item, Finished):
                    return
        finally:
            self.abandoned = True

    def _logprob(self, logits: np.ndarray, token: int, top: int) -> TokenLogprob:
        logprobs = _log_softmax(logits)
        # Bytes, not text: a token can be a piece of a character. The token taken is its text, as the output holds
        # it; an alternative that is a control token (the end of the turn) is named, which its text would not.
        names = self.vocabulary.names
        best: tuple[tuple[bytes, float], ...] = ()
        if top:
            ids = np.argpartition(-logprobs, top)[:top]
            ids = ids[np.argsort(-logprobs[ids])]
            best = tuple((names[int(i)], float(logprobs[i])) for i in ids)
        return TokenLogprob(self.vocabulary.pieces[token], float(logprobs[token]), best)


@dataclass
class _Slot:
    """A sequence id of the context, and the tokens its part of the KV cache holds."""

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    last_used: float = 0.0
    sequence: _Sequence | None = None


def _seq_id(sequence: _Sequence) -> int:
    return sequence.slot.seq_id if sequence.slot is not None else -1


def _kv_cache_bytes(metadata: dict[str, str], cells: int) -> int:
    """The KV cache's size from the GGUF's description of the model: a key and a value (16-bit floats) per
    layer, KV head and cell. Read from the metadata, so that it is known without loading the weights."""
    arch = metadata.get("general.architecture", "llama")

    def number(key: str, default: int | None = None) -> int:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            if default is None:
                raise KeyError(key)
            return default
        return int(value)

    heads = number("attention.head_count")
    head_size = number("embedding_length") // heads
    per_cell = number("attention.head_count_kv", heads) * (
        number("attention.key_length", head_size) + number("attention.value_length", head_size)
    )
    return cells * number("block_count") * per_cell * 2


@dataclass(frozen=True, slots=True)
class Capacity:
    """What one loaded model holds: its sequences, their context, its queue, and the KV cache they take."""

    sequences: int
    context_per_sequence: int
    queue: int
    kv_cache_bytes: int


def capacity(settings: dict[str, Any]) -> Capacity:
    """The capacity a catalog entry's settings give, without loading the weights."""
    config = RunnerSettings.of(settings)
    model = _load_model(config.path, vocab_only=True)
    try:
        kv = _kv_cache_bytes(model.metadata(), config.context * config.parallel)
    finally:
        model.close()
    return Capacity(config.parallel, config.context, config.queue, kv)


def _name_native_thread(name: str) -> None:
    """Names the OS thread (what ``top -H`` shows); the OpenMP threads llama.cpp starts from it inherit the name."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


@dataclass(frozen=True, slots=True)
class RunnerStats:
    parallel: int
    active: int
    queued: int
    queue_limit: int
    context_per_sequence: int
    kv_cache_bytes: int


class LlamaCppRunner:
    """A loaded model: one llama.cpp context with ``parallel`` sequences, driven by one scheduling thread."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from llama_cpp import _internals
        from llama_cpp import llama_cpp as lib

        self._lib = lib
        self.settings = config = RunnerSettings.of(settings)
        self._model = _load_model(config.path, vocab_only=False)
        self.vocabulary = Vocabulary(self._model)
        params = lib.llama_context_default_params()
        params.n_ctx = config.context * config.parallel
        params.n_batch = params.n_ubatch = max(config.prefill_chunk + config.parallel, 64)
        params.n_seq_max = config.parallel
        params.kv_unified = False  # each sequence has its own part of the cache: one never crowds out another
        # Without flash attention. On the CPU, ggml's takes one of two kernels by how many of a sequence's tokens a
        # step reads (64 or more: f32 tiles; fewer: f16 sums), and the keys and values they write differ by enough
        # to move a logprob by a tenth: a prompt's answer would depend on how its cached prefix was once read (in a
        # long prompt's chunk, or a short one's). The plain path, in a build without llamafile's kernels
        # (scripts/build-cpu-runner), gives a sequence the same numbers however its step was made up.
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        params.n_threads = params.n_threads_batch = config.threads
        params.no_perf = True
        try:
            self._context = _internals.LlamaContext(model=self._model, params=params, verbose=False)
        except ValueError as exc:
            raise RunnerError(f"could not create the model's context: {exc}", code="runner_unavailable") from None
        self._ctx = self._context.ctx
        self._memory = lib.llama_get_memory(self._ctx)
        self.context_per_sequence = int(lib.llama_n_ctx_seq(self._ctx))
        self.kv_cache_bytes = _kv_cache_bytes(self._model.metadata(), int(lib.llama_n_ctx(self._ctx)))
        # What llama.cpp made of it: it holds a batch to the context it was asked for (before rounding that up), and a
        # step of more tokens than it holds aborts the process.
        self._batch_size = min(int(lib.llama_n_batch(self._ctx)), int(lib.llama_n_ubatch(self._ctx)))
        self._batch = lib.llama_batch_init(self._batch_size, 0, 1)
        self._slots = [_Slot(seq_id) for seq_id in range(config.parallel)]
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="llama-cpp-scheduler", daemon=True)
        self._thread.start()
        _loaded.append(self.close)

    # --- the caller's side (any thread)

    def stream(self, job: GenerationJob, cancelled: Callable[[], bool]) -> Iterator[RawEvent]:
        """Queues ``job`` (or refuses it: the context check, the queue bound) and returns its events."""
        out: queue.SimpleQueue[RawEvent | RunnerError] = queue.SimpleQueue()
        return self.start(job, cancelled, out.put).events(out)

    def start(self, job: GenerationJob, cancelled: Callable[[], bool], deliver: Delivery) -> _Sequence:
        """Queues ``job`` (or refuses it, as ``stream``); the scheduling thread hands each of its events to
        ``deliver`` as it comes, the last a ``Finished`` or a ``RunnerError``. No thread waits on the job."""
        if self._closed:  # its weights are freed: not even the prompt can be read
            raise RunnerError("the model is shutting down", code="runner_unavailable")
        sequence = self._prepare(job, cancelled, deliver)
        with self._cond:
            if self._closed:
                sequence.close()
                raise RunnerError("the model is shutting down", code="runner_unavailable")
            if self._queue_full():
                self._drop_gone_waiting()  # a client that left holds no place, though the scheduler has not looked yet
            if self._queue_full():
                sequence.close()
                raise RunnerError(
                    f"all {self.settings.parallel} sequences of the model are busy and {len(self._waiting)} "
                    "requests are waiting",
                    code="overloaded",
                )
            self._waiting.append(sequence)
            self._cond.notify()
        return sequence

    def _prepare(self, job: GenerationJob, cancelled: Callable[[], bool], deliver: Delivery) -> _Sequence:
        """Tokenizing and compiling the grammar happen on the caller's thread, never in the scheduler's way."""
        prompt = self.vocabulary.tokenize(job.prompt, job.literal)
        context = self.context_per_sequence
        if len(prompt) + 1 > context:
            raise RunnerError("the prompt does not fit the model's context", code="context_length_exceeded")
        grammar = None
        if job.constraint is not None:
            try:
                text = grammar_for(job.constraint)
            except Exception as exc:  # noqa: BLE001  (see schema_problem: the API checks schemas before dispatch)
                raise RunnerError(
                    f"the output constraint cannot be enforced: {exc}", code="invalid_constraint"
                ) from None
            grammar = self._lib.llama_sampler_init_grammar(self._model.vocab, text.encode("utf-8"), b"root")
            if not grammar:
                raise RunnerError("the output constraint could not be compiled to a grammar", code="invalid_constraint")
        sampler = _Sampler(self._model, job.sampling, grammar)
        max_tokens = min(job.sampling.max_tokens, context - len(prompt))
        interval = self.settings.stream_interval
        return _Sequence(job, cancelled, prompt, max_tokens, sampler, self.vocabulary, interval, deliver)

    def stats(self) -> RunnerStats:
        with self._cond:
            return RunnerStats(
                parallel=self.settings.parallel,
                active=len(self._active),
                queued=len(self._waiting),
                queue_limit=self.settings.queue,
                context_per_sequence=self.context_per_sequence,
                kv_cache_bytes=self.kv_cache_bytes,
            )

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        self._thread.join(timeout=30)
        if _exiting:
            why, code = "the process serving the model shut down", "server_shutting_down"
        else:
            why, code = "the model was unloaded", "runner_unavailable"
        for sequence in [*self._waiting, *self._active]:
            sequence.fail(RunnerError(why, code=code))  # one each: each is raised on its own caller's thread
            sequence.close()
        self._waiting.clear()
        self._active.clear()
        self._lib.llama_batch_free(self._batch)
        self._context.close()
        self._model.close()  # the weights too: a runner closed before exit is one replaced by another
        for close in (self.close, self._model.close):
            if close in _loaded:
                _loaded.remove(close)

    # --- the scheduler's side (its own thread, the only one that touches the context)

    def _free_slot(self) -> bool:
        return any(slot.sequence is None for slot in self._slots)

    def _queue_full(self) -> bool:
        """Whether a job would wait beyond the queue (with the lock held). The jobs waiting for the slots that are
        free are not in the queue: the scheduler gives them their slots once its step is done, and a burst that
        comes meanwhile is held to the slots and the queue all the same."""
        free = sum(slot.sequence is None for slot in self._slots)
        return len(self._waiting) >= self.settings.queue + free

    def _loop(self) -> None:
        _name_native_thread("llama-scheduler")
        while True:
            try:
                with self._cond:
                    while not self._closed and not self._waiting and not self._active:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._drop_gone_waiting()
                    self._release_gone_active()
                    self._admit()
                if self._active:
                    self._step()
            except Exception as exc:  # a fault here must end the jobs it touched, not leave them waiting forever
                logger.exception("the scheduler of %s failed", self.settings.path)
                self._fail_active(RunnerError(f"generation failed: {type(exc).__name__}"))

    def _drop_gone_waiting(self) -> None:
        """Ends the waiting jobs whose clients left (with the lock held)."""
        if any(sequence.gone for sequence in self._waiting):
            for sequence in [s for s in self._waiting if s.gone]:
                self._waiting.remove(sequence)
                sequence.finish("cancelled")
                sequence.close()

    def _release_gone_active(self) -> None:
        """Frees the slots of the running jobs whose clients left (with the lock held), before the waiting jobs
        are given slots: the next turn of a conversation that comes as its client ends the last one (an answer
        ended at its one tool call) finds that slot's cache."""
        for sequence in [s for s in self._active if s.gone]:
            self._release(sequence, "cancelled")

    def _admit(self) -> None:
        """Free slots go to waiting jobs in arrival order. A job takes the free slot that has cached the most
        of its prompt when that is at least half of it (a conversation's next turn, a shared system prompt);
        otherwise the slot used longest ago, so that one short shared opening does not evict a whole cache."""
        while self._waiting and self._free_slot():
            sequence = self._waiting.popleft()
            free = [slot for slot in self._slots if slot.sequence is None]
            shared = {slot.seq_id: _common_prefix(slot.tokens, sequence.prompt) for slot in free}
            best = max(free, key=lambda s: (shared[s.seq_id], -s.last_used))
            slot = best if 2 * shared[best.seq_id] >= len(sequence.prompt) else min(free, key=lambda s: s.last_used)
            # At least the prompt's last token is read again: its logits start the answer.
            keep = min(shared[slot.seq_id], len(sequence.prompt) - 1)
            self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, keep, -1)
            del slot.tokens[keep:]
            slot.sequence = sequence
            sequence.slot = slot
            sequence.read = sequence.cached = keep
            self._active.append(sequence)

    def _step(self) -> None:
        """One ``llama_decode``: a token of each generating sequence, then prompt tokens up to the chunk size."""
        batch = self._batch
        entries: list[tuple[_Sequence, bool]] = []  # per batch position: whose token, and whether to sample after it

        def add(sequence: _Sequence, token: int, *, sample: bool) -> None:
            slot = sequence.slot
            assert slot is not None
            i = len(entries)
            batch.token[i] = token
            batch.pos[i] = len(slot.tokens)
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = slot.seq_id
            batch.logits[i] = sample
            slot.tokens.append(token)
            entries.append((sequence, sample))

        # What each sequence reads this step: its last token, or the next chunk of its prompt, up to the chunk size in
        # all. The prompt with the least left to read goes first (in arrival order among equals): a short prompt that
        # comes while a long one is read gets its first token after a step or two, not after the whole long prompt.
        planned: dict[_Sequence, list[int]] = {}
        for sequence in self._active:
            if sequence.next_token is not None:
                planned[sequence] = [sequence.next_token]
                sequence.next_token = None
        room = min(self.settings.prefill_chunk, self._batch_size - len(planned))
        for sequence in sorted((s for s in self._active if s.reading), key=lambda s: len(s.prompt) - s.read):
            if room <= 0:
                break
            take = min(room, len(sequence.prompt) - sequence.read)
            planned[sequence] = sequence.prompt[sequence.read : sequence.read + take]
            sequence.read += take
            room -= take
        # In slot order: with a cache per sequence, llama.cpp decodes sequences together in one pass only while their
        # ids rise one by one through the batch, and splits it into a pass per such run otherwise.
        for sequence in sorted(planned, key=_seq_id):
            tokens = planned[sequence]
            for offset, token in enumerate(tokens):
                # Logits where a token comes next: after a generated token, or after the prompt's last.
                add(sequence, token, sample=offset == len(tokens) - 1 and not sequence.reading)
        if not entries:
            return
        batch.n_tokens = len(entries)
        result = self._lib.llama_decode(self._ctx, batch)
        if result != 0:
            self._fail_batch(entries, result)
            return
        n_vocab = len(self.vocabulary.pieces)
        now = time.monotonic()
        for index, (sequence, sample) in enumerate(entries):
            if not sample or sequence.slot is None:
                continue
            logits = np.ctypeslib.as_array(self._lib.llama_get_logits_ith(self._ctx, index), shape=(n_vocab,))
            try:
                finished = sequence.advance(logits, now)
            except RunnerError as exc:
                sequence.fail(exc)
                self._release(sequence, None)
                continue
            except Exception as exc:  # noqa: BLE001  (one sequence's fault must not stop the others)
                sequence.fail(RunnerError(f"generation failed: {type(exc).__name__}: {exc}"))
                finished = True
                self._release(sequence, None)
                continue
            if finished:
                self._release(sequence, None)

    def _release(self, sequence: _Sequence, reason: str | None) -> None:
        """Frees the slot; its tokens stay cached for a later prompt that starts the same way."""
        if reason is not None:
            sequence.finish(reason)
        slot = sequence.slot
        if slot is not None:
            slot.sequence = None
            slot.last_used = time.monotonic()
            sequence.slot = None
        if sequence in self._active:
            self._active.remove(sequence)
        sequence.close()

    def _fail_active(self, error: RunnerError) -> None:
        for sequence in list(self._active):
            if sequence.slot is not None:
                self._lib.llama_memory_seq_rm(self._memory, sequence.slot.seq_id, 0, -1)
                sequence.slot.tokens.clear()
            sequence.fail(error)
            self._release(sequence, None)

    def _fail_batch(self, entries: list[tuple[_Sequence, bool]], result: int) -> None:
        for sequence in dict.fromkeys(sequence for sequence, _ in entries):
            slot = sequence.slot
            if slot is not None:
                self._lib.llama_memory_seq_rm(self._memory, slot.seq_id, 0, -1)
                slot.tokens.clear()
            sequence.fail(RunnerError(f"llama_decode failed with status {result}"))
            self._release(sequence, None)


def load(settings: dict[str, Any]) -> LlamaCppRunner:
    return LlamaCppRunner(settings)


def renderer(settings: dict[str, Any]) -> PromptRenderer:
    """The GGUF's own chat template, and its tokenizer (loaded without weights) to count."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    vocab = _load_model(RunnerSettings.of(settings).path, vocab_only=True)  # the settings' numbers checked too
    template = vocab.metadata().get("tokenizer.chat_template")
    if not template:
        raise RunnerError("the GGUF has no chat template", code="runner_unavailable")
    eos = piece(vocab, vocab.token_eos(), special=True).decode("utf-8", errors="replace")
    bos_id = vocab.token_bos()
    bos = piece(vocab, bos_id, special=True).decode("utf-8", errors="replace") if bos_id >= 0 else ""
    formatter = Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    native_tools = "tools" in template

    def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
        return formatter(messages=messages, tools=tools).prompt  # type: ignore[arg-type]  # plain dicts of that shape

    def count_tokens(text: str, literal: tuple[tuple[int, int], ...]) -> int:
        return len(tokenize(vocab, text, literal))

    longest, specials = _vocabulary_facts(vocab)
    return PromptRenderer(
        render=render,
        count_tokens=count_tokens,
        least_tokens=_token_floor(longest, specials),
        native_tools=native_tools,
        schema_problem=functools.partial(schema_problem, vocab=vocab),
        special_tokens=specials,
    )


def _vocabulary_facts(vocab: Any) -> tuple[int, tuple[str, ...]]:
    """In one pass over the vocabulary: the longest token's bytes, and the text of the tokens llama.cpp reads as
    special where a prompt spells them, longest first (as it splits them out)."""
    from llama_cpp import llama_cpp as lib

    special_kinds = lib.LLAMA_TOKEN_ATTR_CONTROL | lib.LLAMA_TOKEN_ATTR_USER_DEFINED
    longest, specials = 1, set()
    for token in range(vocab.n_vocab()):
        longest = max(longest, len(piece(vocab, token)))
        if vocab.token_get_attr(token) & special_kinds and (text := piece(vocab, token, special=True)):
            specials.add(text.decode("utf-8", errors="replace"))
    return longest, tuple(sorted(specials, key=len, reverse=True))


def _token_floor(longest: int, specials: tuple[str, ...]) -> Callable[[str], int]:
    """A lower bound on a text's token count: every token holds at most ``longest`` bytes, and each special token
    written in the text (the chat template's markers, or a request's own, read as text) takes at least a token of
    its own."""
    marker = re.compile("|".join(map(re.escape, specials))) if specials else None

    def floor(text: str) -> int:
        by_size = -(-len(text.encode("utf-8")) // longest)
        return max(by_size, sum(1 for _ in marker.finditer(text)) if marker else 0)

    return floor


def self_test(settings: dict[str, Any]) -> None:
    """One short generation: what a native library built for another CPU crashes on (see ``engine.preflight``)."""
    RunnerSettings.of(settings)  # the settings' own faults are the entry's, told as such, not the library's
    context = 256  # a prefill chunk is at most a sequence
    chunk = min(settings.get("prefill_chunk") or PREFILL_CHUNK, context)
    runner = LlamaCppRunner({**settings, "parallel": 1, "n_ctx": context, "prefill_chunk": chunk})
    job = GenerationJob(
        job_id="self-test",
        model_id="self-test",
        runner="llama_cpp",
        runner_settings=settings,
        prompt="The three largest rivers of Oregon are the Columbia, the Snake and the",
        prompt_tokens=0,
        sampling=Sampling(max_tokens=4, temperature=0.0),
    )
    try:
        for _ in runner.stream(job, lambda: False):
            pass
    finally:
        runner.close()
