"""Closing a JSON value within its output budget: what the text written so far still needs to be whole under its
schema (``JsonTail``), and the shortest way the grammar allows to write it (``Closing``).

A forced tool call must come back as arguments that parse. The CPU runner follows the text as the model writes it;
once the budget left is no more than closing the value may take, it stops sampling freely and closes it, and a token
that would begin more than the budget left after it can close (a list's next item, a nested object) is taken as the
first of that closing instead.
"""

from __future__ import annotations

import copy
import itertools
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from .base import JsonScan, schema_at

# Closing may take a token per open quote and bracket, CLOSING_SLACK more (a separator, a number's digit, the end),
# and for each property its schema requires that is not written yet, its name's tokens and PROPERTY_COST more (the
# colon, an empty value, a separator), with what its value requires in turn. Closing sooner cuts calls that would
# have fit; later, calls that cannot close in time.
CLOSING_SLACK = 4
PROPERTY_COST = 3
# The most alternatives (``anyOf`` and ``oneOf`` branches, across ``allOf`` parts) followed for one value, and the
# most schemas looked at to find them.
SHAPES_MOST = 64
SHAPES_VISITS = 512
# Closing weighs at most this many of the tokens it ranks first by what each leaves to write.
CLOSING_CANDIDATES = 64
# The most characters of a property's name, or of a value a ``const`` or ``enum`` may name, read to tell which.
READ_MOST = 1024

Shape = tuple[dict[str, Any], ...]


def _shapes(node: Any, root: Any) -> list[Shape]:
    """The alternatives a value of ``node`` may take, each as the schema objects it must meet together: ``$ref``s
    followed, ``allOf`` parts joined, ``anyOf`` and ``oneOf`` branches apart. A ``$ref`` back to a schema being
    followed adds no alternative (its value nests inside), and at most ``SHAPES_VISITS`` schemas are followed."""
    visits = SHAPES_VISITS

    def expanded(node: Any, path: frozenset[int]) -> list[Shape]:
        nonlocal visits
        if not isinstance(node, dict):
            return [()]
        if id(node) in path or visits <= 0:
            return []
        visits -= 1
        path |= {id(node)}
        shapes: list[Shape] = [(node,)]
        if isinstance(ref := node.get("$ref"), str):
            shapes = _joined(shapes, expanded(schema_at(root, ref), path))
        parts = node.get("allOf")
        for part in parts if isinstance(parts, list) else ():
            shapes = _joined(shapes, expanded(part, path))
        branches = node.get("anyOf") or node.get("oneOf")
        if isinstance(branches, list) and branches:
            shapes = _joined(shapes, [shape for branch in branches for shape in expanded(branch, path)])
        return shapes

    return _distinct(expanded(node, frozenset())) or [()]


def _joined(shapes: list[Shape], more: list[Shape]) -> list[Shape]:
    return list(itertools.islice(((*shape, *other) for shape in shapes for other in more), SHAPES_MOST))


def _distinct(shapes: Iterable[Shape]) -> list[Shape]:
    return list({tuple(map(id, shape)): shape for shape in shapes}.values())[:SHAPES_MOST]


def _required(shape: Shape) -> list[str]:
    names: dict[str, None] = {}
    for part in shape:
        if isinstance(listed := part.get("required"), list):
            names.update((name, None) for name in listed if isinstance(name, str))
    return list(names)


def _property(shape: Shape, name: str) -> Any:
    """The schema of an object's property ``name`` (of an unnamed one: its ``additionalProperties``)."""
    for part in shape:
        if isinstance(properties := part.get("properties"), dict) and name in properties:
            return properties[name]
    return next((extra for part in shape if isinstance(extra := part.get("additionalProperties"), dict)), None)


def _names(shape: Shape) -> set[str]:
    return {name for part in shape if isinstance(found := part.get("properties"), dict) for name in found}


def _allows(shape: Shape, name: str) -> bool:
    """Whether an object of ``shape`` may hold the property ``name``."""
    return name in _names(shape) or all(part.get("additionalProperties") is not False for part in shape)


def _item(shape: Shape, index: int) -> Any:
    """The schema of an array's item at ``index``."""
    for part in shape:
        if isinstance(prefix := part.get("prefixItems"), list) and index < len(prefix):
            return prefix[index]
    return next((items for part in shape if isinstance(items := part.get("items"), dict)), None)


def _least_items(shape: Shape) -> int:
    """The items an array of ``shape`` holds at the least: its ``minItems``, or its ``prefixItems``, which the
    grammar writes every one of."""
    least = [value for part in shape if isinstance(value := part.get("minItems"), int)]
    least += [len(prefix) for part in shape if isinstance(prefix := part.get("prefixItems"), list)]
    return max(least, default=0)


def _of_type(shape: Shape, kind: type[dict[Any, Any]] | type[list[Any]]) -> bool:
    """Whether ``shape`` lets a value be an object (``dict``) or an array (``list``): a nullable object's null
    branch does not, nor an ``enum`` of strings."""
    name = "object" if kind is dict else "array"
    for part in shape:
        named = part.get("type")
        if isinstance(named, str) and named != name or isinstance(named, list) and name not in named:
            return False
        if "const" in part and not isinstance(part["const"], kind):
            return False
        if isinstance(enum := part.get("enum"), list) and not any(isinstance(value, kind) for value in enum):
            return False
    return True


def _literals(shape: Shape) -> list[Any] | None:
    """The values a ``const`` or an ``enum`` of ``shape`` allows (None: any)."""
    for part in shape:
        if "const" in part:
            return [part["const"]]
        if isinstance(enum := part.get("enum"), list):
            return enum
    return None


@dataclass(slots=True)
class _Open:
    """An object or array open in the text, with the alternatives of its schema still possible."""

    array: bool
    shapes: list[Shape]
    keys: set[str] = field(default_factory=set)  # an object's properties named so far
    key: str | None = None  # the property named last
    awaiting: bool = True  # an object's next name, or an array's next item, is still to come
    comma: bool = False  # a comma asks for that name or item
    value_due: bool = False  # the property named last has no value begun yet
    signed: bool = False  # a number is begun with its sign alone
    count: int = 0  # an array's items begun
    string: list[str] | None = None  # the string being read, where it may tell something (a name, a const's value)
    cost: int | None = None  # what it still requires, until it changes


class JsonTail:
    """How far a JSON text written so far is from whole: its open strings and brackets, and what its schema still
    requires it to write, followed as the text is written (the properties each open object must still name, with
    what their values must name in turn; an array's items short of its ``minItems`` or ``prefixItems``, or the one a
    comma asks for).

    ``cost`` is what writing a property's name takes (its JSON string), with an empty value; ``value_cost`` what
    writing a value of a ``const`` or an ``enum`` takes."""

    def __init__(
        self,
        schema: Any = None,
        cost: Callable[[str], int] = lambda name: 0,
        value_cost: Callable[[str], int] = lambda value: 0,
    ) -> None:
        self.open: list[str] = []  # the closing bracket of each open array or object, innermost last
        self.scan = JsonScan()
        self._root = schema
        self._cost = cost
        self._literal_cost = value_cost
        self._opened: list[_Open] = []
        self._name_costs: dict[str, int] = {}
        self._costs: dict[int, int] = {}
        self._shape_cache: dict[int, list[Shape]] = {}

    def feed(self, text: str) -> None:
        for char in text:
            inside = self.scan.in_string
            move = self.scan.read(char)
            current = self._opened[-1] if self._opened else None
            if current is None:
                if move > 0:
                    self._begin(None, char)
                continue
            if inside:
                if self.scan.in_string:
                    if current.string is not None and len(current.string) < READ_MOST:
                        current.string.append(char)
                        current.cost = None
                else:
                    self._string_read(current)
                continue
            if char.isspace() or char == ":":
                continue
            if current.signed != (char == "-"):
                current.signed, current.cost = char == "-", None
            if move < 0:
                self.open.pop()
                self._opened.pop()
            elif char == ",":
                current.awaiting = current.comma = True
                current.cost = None
            elif current.array:
                if current.awaiting:  # an item begins
                    current.count, current.awaiting, current.comma, current.cost = current.count + 1, False, False, None
                if move > 0:
                    self._begin(current, char)
            elif current.awaiting:  # a property's name begins
                current.string, current.cost = ([] if char == '"' else None), None
            elif current.value_due:  # its value begins
                current.value_due, current.cost = False, None
                if move > 0:
                    self._begin(current, char)
                elif char == '"':
                    literal = any(_literals(shape) is not None for shape in self._value_shapes(current))
                    current.string, current.cost = ([] if literal else None), None

    def _begin(self, parent: _Open | None, char: str) -> None:
        """An object or array opens: it may be what the alternatives of the value it is allow."""
        kind = list if char == "[" else dict
        shapes = self._value_shapes(parent)
        self.open.append("]" if kind is list else "}")
        self._opened.append(_Open(kind is list, [shape for shape in shapes if _of_type(shape, kind)] or shapes))

    def _value_shapes(self, parent: _Open | None) -> list[Shape]:
        """The alternatives of the value ``parent`` is writing (the whole value's, outside any)."""
        if parent is None:
            return self._shapes_of(self._root)
        nodes = {}
        for shape in parent.shapes:
            node = _item(shape, parent.count - 1) if parent.array else _property(shape, parent.key or "")
            nodes[id(node)] = node
        return _distinct(shape for node in nodes.values() for shape in self._shapes_of(node))

    def _shapes_of(self, node: Any) -> list[Shape]:
        if id(node) not in self._shape_cache:
            self._shape_cache[id(node)] = _shapes(node, self._root)
        return self._shape_cache[id(node)]

    def _string_read(self, current: _Open) -> None:
        read, current.string = current.string, None
        if current.array:
            return
        text = "".join(read) if read is not None and len(read) < READ_MOST else None
        try:
            value = json.loads(f'"{text}"') if text is not None else None
        except ValueError:
            value = None
        if current.awaiting:  # a property's name
            current.key, current.awaiting, current.comma, current.value_due = value, False, False, True
            if value is not None:
                current.keys.add(value)
                current.shapes = [shape for shape in current.shapes if _allows(shape, value)] or current.shapes
        elif value is not None and current.key is not None:  # a value a const or an enum may name: its alternatives
            key = current.key
            admitting = [shape for shape in current.shapes if self._admits(_property(shape, key), value)]
            current.shapes = admitting or current.shapes
        current.cost = None

    def _admits_start(self, node: Any, written: str) -> bool:
        """Whether a value of ``node`` may be a string that begins with ``written`` (as written, escapes and all)."""
        for shape in self._shapes_of(node):
            literals = _literals(shape)
            if literals is None or any(
                isinstance(value, str) and json.dumps(value, ensure_ascii=False)[1:].startswith(written)
                for value in literals
            ):
                return True
        return False

    def _admits(self, node: Any, value: Any) -> bool:
        """Whether a value of ``node`` may be ``value`` (a call's ``name``: which function it calls)."""
        return any((literals := _literals(shape)) is None or value in literals for shape in self._shapes_of(node))

    def missing(self) -> int:
        """The tokens what the schema still requires takes to write at the least: each property an open object
        must still name, with an empty value, and in turn what that value must name (a value not begun yet
        included); an array's items short of its ``minItems`` or ``prefixItems``, or asked for by a comma; and what
        the value still to be opened must name (a text that has not begun its value)."""
        if self._root is None:
            return 0
        if not self._opened:
            return self._value_cost(self._root)
        total = 0
        for opened in self._opened:
            if opened.cost is None:
                costs = [cost for shape in opened.shapes if (cost := self._still(opened, shape)) is not None]
                opened.cost = min(costs, default=0)
            total += opened.cost
        return total

    def _still(self, opened: _Open, shape: Shape) -> int | None:
        """What ``opened`` still requires if it is of ``shape``; None where the text rules ``shape`` out."""
        written = "".join(opened.string) if opened.string is not None else None
        value = written is not None and not opened.array and not opened.awaiting and opened.key is not None
        if value and not self._admits_start(_property(shape, opened.key or ""), written or ""):
            return None  # a const's or an enum's value being written that this alternative's cannot begin
        if opened.array:
            least = max(_least_items(shape), opened.count + int(opened.comma))
            items = sum(self._item_cost(shape, index) for index in range(opened.count, least))
            return items + int(opened.signed)
        missing = [name for name in _required(shape) if name not in opened.keys]
        required = sum(self._property_cost(shape, name) for name in missing) + int(opened.signed)
        if opened.value_due and opened.key is not None:  # at least a token of it
            required += 1 + self._value_cost(_property(shape, opened.key))
        if written is not None and opened.awaiting and not any(name.startswith(written) for name in missing):
            # A name being written that no required property's begins with: the cheapest it may still become.
            required += self._cheapest_more(shape, opened, written)
        elif opened.comma and not required:
            # A comma after the last required property asks for one more.
            required += self._cheapest_more(shape, opened, "")
        return required

    def _cheapest_more(self, shape: Shape, opened: _Open, begun: str) -> int:
        """The least a property not written yet whose name begins with ``begun`` takes: one the schema names, or
        one of its ``additionalProperties`` (a map's entry), with what its value requires."""
        costs = [self._property_cost(shape, name) for name in _names(shape) - opened.keys if name.startswith(begun)]
        extra = next((extra for part in shape if isinstance(extra := part.get("additionalProperties"), dict)), None)
        if extra is not None or all(part.get("additionalProperties") is not False for part in shape):
            costs.append(PROPERTY_COST + self._value_cost(extra))
        return min(costs, default=0)

    def _property_cost(self, shape: Shape, name: str) -> int:
        """The tokens the property ``name`` takes at the least: its name with an empty value, and what its value
        must name in turn."""
        return self._name_cost(name) + self._value_cost(_property(shape, name))

    def _name_cost(self, name: str) -> int:
        """The tokens writing the property ``name`` with an empty value takes, spelled the longer way (its characters
        as they are, or escaped)."""
        if name not in self._name_costs:
            spellings = {json.dumps(name, ensure_ascii=False), json.dumps(name)}
            self._name_costs[name] = max(map(self._cost, spellings))
        return self._name_costs[name]

    def _value_cost(self, node: Any) -> int:
        """What a value of ``node`` takes at the least, wherever it is written: its ``const`` or cheapest ``enum``
        value, the properties it requires and what their values require in turn (an optional property's own are not
        needed), its least items; of alternatives, the cheapest."""
        if not isinstance(node, dict):
            return 0
        if id(node) not in self._costs:
            self._costs[id(node)] = 0  # a schema that refers to itself needs nothing more where it does
            self._costs[id(node)] = min(map(self._shape_cost, self._shapes_of(node)))
        return self._costs[id(node)]

    def _shape_cost(self, shape: Shape) -> int:
        if (literals := _literals(shape)) is not None:
            return min((self._literal_cost(json.dumps(value, ensure_ascii=False)) for value in literals), default=0)
        required = sum(self._property_cost(shape, name) for name in _required(shape))
        return required + sum(self._item_cost(shape, index) for index in range(_least_items(shape)))

    def _item_cost(self, shape: Shape, index: int) -> int:
        """The tokens an item not begun yet takes at the least: a token of its own (an empty string, a digit), and
        what its value must name in turn. Counted as nothing, a comma's item cost closing nothing to promise, and
        closing that took `` "",`` (an item and the next comma) kept a list open until the budget ran out."""
        return 1 + self._value_cost(_item(shape, index))

    def closers(self) -> str:
        """The quotes and brackets that close every open string, array and object, in order."""
        if self.scan.escaped:  # an escape needs its letter before the string can close
            return ""
        return ('"' if self.scan.in_string else "") + "".join(reversed(self.open))

    def needs(self, after: str = "") -> int:
        """The tokens closing the text takes at the most (``after`` more of it): one per closing quote and bracket,
        ``CLOSING_SLACK`` more, and what the schema still requires."""
        tail = self
        if after:
            # Only the objects ``after`` closes, and the one it then writes in, can change: the others are shared.
            changed = min(len(self._opened), sum(after.count(bracket) for bracket in "}]") + 1)
            kept = len(self._opened) - changed
            tail = copy.copy(self)
            tail.open, tail.scan = list(self.open), replace(self.scan)
            tail._opened = self._opened[:kept] + [
                replace(opened, keys=set(opened.keys), string=None if opened.string is None else list(opened.string))
                for opened in self._opened[kept:]
            ]
            tail.feed(after)
        closers = len(tail.open) + 2 if tail.scan.escaped else len(tail.closers())  # an escape's letter, a quote
        innermost = tail._opened[-1] if tail._opened else None
        if innermost is not None and innermost.awaiting and innermost.string is not None and tail.scan.in_string:
            closers -= 1  # a property's name being written: its quote is in what the name takes
        return closers + CLOSING_SLACK + tail.missing()


@dataclass(frozen=True)
class Closing:
    """One step of closing a JSON value: the closing vocabulary and the quotes and brackets still open."""

    vocabulary: ClosingVocabulary
    closers: str
    # Each token's bytes, to hold closing's choice against the model's (none: any other token departs from it).
    pieces: Sequence[bytes] = ()
    # Whether the text is inside a JSON string, where spaces are text (elsewhere they are nothing).
    in_string: bool = False
    # What closing takes after a token's text (``JsonTail.needs``): of the tokens ``pick`` ranks first, the one
    # that leaves the least to write is taken.
    needs: Callable[[str], int] | None = None

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
        whole. Else, ranked: the longest runs of the open quotes and brackets, in order; then, for what the grammar
        still requires (a property's name, a value, a digit), tokens that are not only spaces, those that open the
        fewest objects and arrays first (``{}`` for an object that may be empty, not ``{"``: a recursive schema
        would never close), the longest first, to spell it in as few as it allows. Of the first
        ``CLOSING_CANDIDATES`` of them, the one after which ``needs`` is least (the cheaper branch of a union, the
        required property rather than an optional one), the first of those ranked alike."""
        vocabulary = self.vocabulary
        ends = vocabulary.ends[np.isfinite(allowed[vocabulary.ends])]
        if ends.size:
            return int(ends[np.argmax(allowed[ends])])
        closers = sorted(
            (
                (len(text), allowed[token], token)
                for token, text in vocabulary.closers
                if self.closers.startswith(text) and np.isfinite(allowed[token])
            ),
            reverse=True,
        )
        ranked = [token for _, _, token in closers]
        ids = np.flatnonzero(np.isfinite(allowed))
        if (spelled := ids[~vocabulary.blank[ids]]).size:  # a space between JSON tokens takes a token for nothing
            ids = spelled
        opened = vocabulary.opened[int(self.closers.startswith('"')), ids]
        ids = ids[np.lexsort((-allowed[ids], -vocabulary.lengths[ids], opened))]
        ranked += [int(token) for token in ids[:CLOSING_CANDIDATES] if token not in ranked]
        if self.needs is None or not self.pieces or len(ranked) == 1:
            return ranked[0]
        candidates = ranked[:CLOSING_CANDIDATES]
        left = [self.needs(self.pieces[token].decode("utf-8", errors="ignore")) for token in candidates]
        return candidates[left.index(min(left))]


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
    def of(cls, pieces: Sequence[bytes], ends: Iterable[int]) -> ClosingVocabulary:
        size = len(pieces)
        closers, lengths = [], np.zeros(size, dtype=np.intc)
        opened = np.zeros((2, size), dtype=np.intc)
        blank = np.zeros(size, dtype=bool)
        for token, piece in enumerate(pieces):
            text = piece.decode("utf-8", errors="replace")
            lengths[token] = len(text)
            blank[token] = not text.strip()
            opened[0, token], opened[1, token] = _opened(text, in_string=False), _opened(text, in_string=True)
            bare = "".join(text.split())  # a space is insignificant between JSON tokens and harmless in a string
            if bare and not bare.strip('"]}'):
                closers.append((token, bare))
        return cls(
            ends=np.array(sorted(ends), dtype=np.intc),
            closers=tuple(closers),
            lengths=lengths,
            opened=opened,
            blank=blank,
        )


def _opened(text: str, *, in_string: bool) -> int:
    """How many more objects and arrays are open after ``text`` than before it, read from in or out of a string (a
    string always ends at its quote; brackets nest)."""
    scan = JsonScan(in_string=in_string)
    return sum(scan.read(char) for char in text)
