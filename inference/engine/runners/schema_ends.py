"""Whether a schema admits a value a model can write to its end.

A grammar built from a schema no finite value matches never lets its output close: a required property whose
schema is the whole schema again (``{"properties": {"n": {"$ref": "#"}}, "required": ["n"]}``) is written
``{"n": {"n": {"n": …`` until the output limit, and a forced call's arguments would never parse. ``$ref`` loops
with nothing between, an empty ``enum`` or ``anyOf``, and an ``allOf`` whose objects each forbid the properties
another requires admit no value either. Such a schema is refused before any grammar is built from it.

Which subschemas end is found as a least fixed point: a ``$ref``'s target is taken not to end until a pass over
the schema shows that it does, and passes repeat until none shows more (a target at a time, in the worst case).
"""

from __future__ import annotations

from typing import Any

from .base import schema_at

_PRIMITIVES = frozenset({"string", "number", "integer", "boolean", "null"})
# Keywords that make a schema without a ``type`` an object's or an array's, as the runners' grammars read them.
_OBJECT_KEYWORDS = ("properties", "required", "additionalProperties")
_ARRAY_KEYWORDS = ("items", "prefixItems", "minItems")


def endless_problem(schema: Any) -> str | None:
    """Why no value of ``schema`` can be written to its end, or None when one can."""
    walk = _Ends(schema)
    try:
        ends = walk.of_root()
    except RecursionError:  # each $ref followed is a call: a chain of them as long as a client likes
        return "its $ref chains or nesting go too deep to build a grammar from"
    return None if ends else walk.contradiction or _ENDLESS


_ENDLESS = (
    "no value of it can be written to its end: a required property or item leads back to where it is (through a "
    "$ref), or to an empty enum or anyOf"
)


class _Ends:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.known: set[int] = set()  # $ref targets shown to end
        self.seen: dict[int, bool] = {}  # this pass's verdicts on $ref targets
        self.open: set[int] = set()  # $ref targets being looked at (met again, they are taken not to end)
        self.contradiction: str | None = None  # an allOf met whose objects forbid what another requires

    def of_root(self) -> bool:
        while True:
            self.seen, self.open = {}, set()
            ends = self.ends(self.root)
            shown = {target for target, verdict in self.seen.items() if verdict} - self.known
            if ends or not shown:
                return ends
            self.known |= shown

    def ref(self, target: Any) -> bool:
        key = id(target)
        if key in self.known:
            return True
        if key in self.seen:
            return self.seen[key]
        if key in self.open:
            return False
        self.open.add(key)
        verdict = self.seen[key] = self.ends(target)
        self.open.discard(key)
        return verdict

    def ends(self, schema: Any) -> bool:
        if schema is False:
            return False
        if not isinstance(schema, dict):
            return True  # ``true``, or what other checks refuse
        if "const" in schema:
            return True
        if isinstance(values := schema.get("enum"), list):
            return bool(values)
        if isinstance(ref := schema.get("$ref"), str):
            target = schema_at(self.root, ref)
            if target is not None and not self.ref(target):
                return False
        for union in ("anyOf", "oneOf"):
            if isinstance(branches := schema.get(union), list) and not any(self.ends(one) for one in branches):
                return False
        if isinstance(parts := schema.get("allOf"), list):
            if not all(self.ends(part) for part in parts):
                return False
            if contradiction := _contradiction(schema, parts, self.root):
                self.contradiction = contradiction
                return False
        return any(self._kind_ends(schema, kind) for kind in _kinds(schema))

    def _kind_ends(self, schema: dict[str, Any], kind: str) -> bool:
        if kind == "object":
            properties = schema.get("properties")
            properties = properties if isinstance(properties, dict) else {}
            required = schema.get("required")
            extra = schema.get("additionalProperties", True)
            names = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
            return all(self.ends(properties.get(name, extra)) for name in names)
        if kind == "array":
            least = schema.get("minItems")
            least = least if isinstance(least, int) and not isinstance(least, bool) else 0
            prefix = schema.get("prefixItems")
            prefix = prefix if isinstance(prefix, list) else []
            if not all(self.ends(item) for item in prefix[:least]):
                return False
            return least <= len(prefix) or self.ends(schema.get("items", True))
        return True


def _kinds(schema: dict[str, Any]) -> list[str]:
    """The JSON types a value of ``schema`` may have, as the grammar reads it."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list) and kind:
        return [one for one in kind if isinstance(one, str)]
    if any(keyword in schema for keyword in _OBJECT_KEYWORDS):
        return ["object"]
    if any(keyword in schema for keyword in _ARRAY_KEYWORDS):
        return ["array"]
    return sorted(_PRIMITIVES)


def _contradiction(schema: dict[str, Any], parts: list[Any], root: Any) -> str | None:
    """Why the objects ``schema`` joins by ``allOf`` (and ``schema`` itself) admit no value, one of them forbidding
    (``additionalProperties: false``) a property another requires: OpenAI's strict style closes every object so,
    and the grammar would join their properties into output no branch allows. None when they do not."""
    objects = [one for one in (schema, *(_resolved(part, root) for part in parts)) if isinstance(one, dict)]
    for closed in objects:
        if closed.get("additionalProperties") is not False:
            continue
        allowed = closed.get("properties")
        allowed = set(allowed) if isinstance(allowed, dict) else set()
        for other in objects:
            required = other.get("required")
            names = [name for name in required if isinstance(name, str)] if isinstance(required, list) else []
            if other is not closed and (missing := [name for name in names if name not in allowed]):
                return (
                    f"no value matches its allOf: one of the objects it joins allows no property {missing[0]!r}, "
                    "which another requires"
                )
    return None


def _resolved(schema: Any, root: Any, hops: int = 8) -> Any:
    """The schema a chain of ``$ref``s leads to."""
    while hops and isinstance(schema, dict) and isinstance(ref := schema.get("$ref"), str):
        schema, hops = schema_at(root, ref), hops - 1
    return schema
