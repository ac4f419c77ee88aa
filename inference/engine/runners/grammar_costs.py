"""What a JSON schema costs a grammar engine that follows each of its alternatives (llama.cpp's), found from the
schema before any grammar is built: the ways its ``$ref``s and branches lead to where a value starts (each
compiled anew), the alternatives that stay alive together while a value is decoded (each checked against every
token), and patterns llama.cpp's converter cannot read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from .base import schema_at, subschemas


def grammar_cost_problem(schema: Any, *, leads: int, ambiguity: int) -> str | None:
    """Why ``schema``'s grammar would cost too much to build or to decode with, or None (``SCHEMA_MAX_LEADS``,
    ``SCHEMA_MAX_AMBIGUITY``)."""
    return schema_leads_problem(schema, most=leads) or ambiguity_problem(schema, most=ambiguity)


# SCHEMA_MAX_LEADS, the most ways a schema may lead to where a value starts: grammar compilers walk every one
# (llama.cpp's check for left recursion follows each leading rule reference anew, on every path), so a few dozen
# $defs, each an anyOf of two $refs to the next, held a core for minutes with a 2 KB schema. A schema that a person
# writes leads a few ways.
def schema_leads_problem(schema: Any, *, most: int) -> str | None:
    """Why ``schema`` is too costly to compile to a grammar, or None: the ways its subschemas lead to where a value
    starts (following ``$ref``s and ``anyOf``/``oneOf`` branches, each way as often as it is reached), in all,
    counted without following any of them twice."""
    leads: dict[int, int] = {}
    total = 0
    for node in subschemas(schema):
        if isinstance(pattern := node.get("pattern"), str) and (
            problem := _pattern_problem(pattern) or _optional_parts_problem(pattern)
        ):
            return problem
        total += _leads(node, schema, leads, most)
        if total > most:
            return (
                f"its $refs and anyOf/oneOf branches lead to where a value starts in more than the {most} ways "
                "a schema may (a grammar compiler follows every one)"
            )
    return None


# SCHEMA_MAX_AMBIGUITY, the most alternatives of a schema that may be alive at once, one inside another: a grammar
# matcher that follows each (llama.cpp's keeps a stack for every one, and compares each new one with all the others)
# slows with their square, so a 300-byte schema whose value is either of two arrays of itself took a minute a token
# past 15 levels, the model's other streams waiting on it.
def ambiguity_problem(schema: Any, *, most: int) -> str | None:
    """Why ``schema`` would keep too many of its alternatives alive at once, or None.

    Alternatives stay alive together when branches of one ``anyOf``/``oneOf`` begin alike and go on alike into a nested
    value: two arrays (their items), two objects whose first property may be the same one (its value), unless that
    property's ``const``s or ``enum``s tell them apart. Nested such unions multiply; one that holds itself (through its
    ``$ref``s) is without bound."""
    product: dict[int, int] = {}
    on_path: list[tuple[int, int]] = []  # (node id, its factor) from the root down
    where: dict[int, int] = {}  # node id: its place in on_path
    frames: list[tuple[Any, Iterator[Any]]] = []

    def enter(node: Any) -> None:
        factor = _ambiguity(node, schema) if isinstance(node, dict) else 1
        where[id(node)] = len(on_path)
        on_path.append((id(node), factor))
        frames.append((node, iter(_nested(node, schema))))

    enter(schema)
    while frames:
        node, children = frames[-1]
        child = next(children, None)
        if child is not None:
            if id(child) in product:
                continue
            if id(child) in where:
                loop = on_path[where[id(child)] :]
                if any(factor > 1 for _, factor in loop):
                    return (
                        "its alternatives that begin alike hold themselves (through their $refs), so a value can keep "
                        "ever more of them alive at once: give each anyOf/oneOf branch a different start"
                    )
                continue
            enter(child)
            continue
        frames.pop()
        _, factor = on_path.pop()
        del where[id(node)]
        below = max((product.get(id(c), 1) for c in _nested(node, schema)), default=1)
        product[id(node)] = min(most + 1, factor * below)
        if product[id(node)] > most:
            return (
                f"its anyOf/oneOf branches that begin alike, one inside another, keep more than {most} alternatives "
                "alive at once: give each branch a different start"
            )
    return None


def _nested(node: Any, root: Any) -> list[Any]:
    """The subschemas a value of ``node`` holds or is: its items, its properties' values, its ``$ref``'s target, its
    branches."""
    if not isinstance(node, dict):
        return []
    out: list[Any] = []
    if isinstance(ref := node.get("$ref"), str) and isinstance(target := schema_at(root, ref), dict):
        out.append(target)
    for keyword in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(parts := node.get(keyword), list):
            out += [part for part in parts if isinstance(part, dict)]
    for keyword in ("items", "additionalProperties"):
        if isinstance(part := node.get(keyword), dict):
            out.append(part)
    if isinstance(props := node.get("properties"), dict):
        out += [value for value in props.values() if isinstance(value, dict)]
    return out


def _ambiguity(node: dict[str, Any], root: Any) -> int:
    """How many of the branches of ``node``'s ``anyOf``/``oneOf`` (and of the unions and ``$ref``s they are) may be
    alive together inside a nested value: the most that begin alike with any one of them."""
    branches = node.get("oneOf") or node.get("anyOf")
    if not isinstance(branches, list):
        return 1
    leaves = _leaf_branches(branches, root)
    return max((sum(1 for other in leaves if _alike(leaf, other)) for leaf in leaves), default=1)


# Branches looked at for one union, nearest first: past them, its unions and $refs are left to the grammar's bounds.
_MOST_BRANCHES = 256


def _leaf_branches(branches: list[Any], root: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    pending = list(branches)
    seen: set[int] = set()
    while pending and len(seen) < _MOST_BRANCHES:
        branch = pending.pop(0)
        if not isinstance(branch, dict) or id(branch) in seen:
            continue
        seen.add(id(branch))
        if isinstance(ref := branch.get("$ref"), str):
            pending.append(schema_at(root, ref))
        elif isinstance(inner := branch.get("oneOf") or branch.get("anyOf"), list):
            pending += inner
        else:
            out.append(branch)
    return out


def _start(node: dict[str, Any]) -> str:
    """How a value of a branch that is neither a ``$ref`` nor a union begins, as far as nesting goes: ``[``, ``{``,
    ``*`` (either) or ``-`` (a value that nests nothing)."""
    kind = node.get("type")
    kinds = set(kind) if isinstance(kind, list) else {kind} if isinstance(kind, str) else set()
    if "array" in kinds or (not kinds and ("items" in node or "prefixItems" in node)):
        return "[" if kinds <= {"array", "null"} else "*"
    if "object" in kinds or (not kinds and ("properties" in node or "additionalProperties" in node or "allOf" in node)):
        return "{" if kinds <= {"object", "null"} else "*"
    if kinds or "const" in node or "enum" in node or "pattern" in node:
        return "-"
    return "*"


def _alike(one: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether values of the two branches may begin alike into a nested value."""
    first, second = _start(one), _start(other)
    if "-" in (first, second):
        return one is other
    if "*" in (first, second):
        return True
    if first != second:
        return False
    if first == "[":
        return True
    keys_one, keys_other = _first_keys(one), _first_keys(other)
    if keys_one is None or keys_other is None:
        return True
    for key in keys_one & keys_other:
        values = (one["properties"].get(key), other["properties"].get(key))
        if not all(isinstance(value, dict) and ("const" in value or "enum" in value) for value in values):
            return True
        if _constants(values[0]) & _constants(values[1]):
            return True
    return False


def _first_keys(node: dict[str, Any]) -> set[str] | None:
    """The properties an object of ``node`` may begin with (its first required one, else any), or None for any name."""
    props = node.get("properties")
    props = props if isinstance(props, dict) else {}
    required = node.get("required")
    firsts = [key for key in props if isinstance(required, list) and key in required]
    if firsts:
        return {firsts[0]}
    if node.get("additionalProperties", True) is not False:
        return None
    return set(props)


def _constants(node: dict[str, Any]) -> set[str]:
    values = [node["const"]] if "const" in node else node.get("enum") or []
    return {json.dumps(value, sort_keys=True) for value in values} if isinstance(values, list) else set()


def _pattern_problem(pattern: str) -> str | None:
    """A ``]`` or ``}`` that neither ends a character class or a count nor is escaped: ECMA-262 regular expressions
    (what JSON Schema's patterns are) refuse it, Python's read it as itself, and a grammar converter that reads the
    pattern as ECMA-262 does (llama.cpp's) got stuck on it for good, a core spinning with no answer. Classes end as
    ECMA-262 ends them, at the first ``]``: ``[^]a]`` is not "neither ``]`` nor ``a``"."""
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index += 2
            continue
        if char in "[{":
            close = "]" if char == "[" else "}"
            index += 1
            while index < len(pattern) and pattern[index] != close:
                index += 2 if pattern[index] == "\\" and char == "[" else 1
        elif char in "]}":
            return f"its pattern {pattern!r} holds a {char!r} that is not escaped (write \\{char} for the character)"
        index += 1
    return None


# The most parts of one pattern that may match nothing (``x*``, ``x?``, ``x{0,n}``): where the text may be any of them,
# llama.cpp's grammar follows every way to split it between them, and the ways grow far faster than their count. With
# ``[a-z ]*`` written 16 times, checking the whole vocabulary against it took 0.3 s, 24 times 2.5 s, 40 times 78 s,
# every stream of the model waiting on it. A pattern that a person writes has a few.
PATTERN_MAX_OPTIONAL_PARTS = 16


def _optional_parts_problem(pattern: str) -> str | None:
    """Why ``pattern`` holds too many parts that may match nothing, or None. A group repeated ``{n,m}`` times is
    written out that many times by the grammar, its parts with it."""
    count = 0
    opened: list[int] = []  # the count where each open group began
    group = 0  # the parts in the group that closed just before
    index = 0
    after_quantifier = False
    while index < len(pattern):
        char = pattern[index]
        quantifier, closed = False, 0
        if char == "\\":
            index += 1
        elif char == "[":
            index += 1
            while index < len(pattern) and pattern[index] != "]":
                index += 2 if pattern[index] == "\\" else 1
        elif char == "(":
            opened.append(count)
        elif char == ")" and opened:
            closed = count - opened.pop()
        elif char == "{":
            end = pattern.find("}", index)
            end = len(pattern) if end < 0 else end
            low, _, high = pattern[index + 1 : end].partition(",")
            times = max(int(n) if n.strip().isdigit() else 0 for n in (low, high or low))
            count += group * max(0, min(times, 1000) - 1) + (low.strip() in ("0", ""))
            index, quantifier = end, True
        elif char == "*":
            count += 1
            quantifier = True
        elif char == "?":
            # After a quantifier it makes that one lazy; after "(" it opens a group's kind ("(?:").
            count += not after_quantifier and pattern[index - 1 : index] != "("
            quantifier = True
        elif char == "+":
            quantifier = True
        after_quantifier, group = quantifier, closed
        index += 1
    if count > PATTERN_MAX_OPTIONAL_PARTS:
        return (
            f"its pattern has {count} parts that may match nothing (x*, x?, x{{0,n}}), more than the "
            f"{PATTERN_MAX_OPTIONAL_PARTS} a grammar follows at a bounded cost"
        )
    return None


def _leads(node: dict[str, Any], root: Any, leads: dict[int, int], most: int) -> int:
    """The ways ``node`` leads to where a value starts (1, and those of the subschemas it leads through), remembered
    in ``leads`` by subschema; a subschema met again on its own way counts once (a grammar refuses such a loop)."""
    open_: set[int] = set()
    stack: list[tuple[Any, bool]] = [(node, False)]
    while stack:
        current, done = stack.pop()
        key = id(current)
        if done:
            open_.discard(key)
            leads[key] = min(most + 1, 1 + sum(leads.get(id(step), 1) for step in _steps(current, root)))
        elif key not in leads and key not in open_:
            open_.add(key)
            stack.append((current, True))
            stack.extend((step, False) for step in _steps(current, root))
    return leads[id(node)]


def _steps(node: Any, root: Any) -> list[Any]:
    """The subschemas a value of ``node`` starts as: its ``$ref``'s target, or its ``anyOf``/``oneOf`` branches."""
    if not isinstance(node, dict):
        return []
    if isinstance(ref := node.get("$ref"), str):
        target = schema_at(root, ref)
        return [target] if isinstance(target, dict) else []
    branches = node.get("oneOf") or node.get("anyOf")
    return [branch for branch in branches if isinstance(branch, dict)] if isinstance(branches, list) else []
