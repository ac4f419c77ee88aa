"""Schemas a model can write a value of to its end, told from those it never could."""

from __future__ import annotations

from typing import Any

import pytest

from inference.engine.runners.schema_ends import endless_problem

NODE = {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}


def required(name: str, schema: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {name: schema}, "required": [name]}


ENDS = {
    "a-string": {"type": "string"},
    "itself-where-it-may-be-left-out": {"type": "object", "properties": {"n": {"$ref": "#"}}},
    "itself-in-a-list-that-may-be-empty": required("kids", {"type": "array", "items": {"$ref": "#"}}),
    "itself-or-null": required("next", {"anyOf": [{"$ref": "#"}, {"type": "null"}]}),
    "a-loop-through-defs-with-a-way-out": {
        "$defs": {"a": {"anyOf": [{"$ref": "#/$defs/b"}, {"type": "null"}]}, "b": required("a", {"$ref": "#/$defs/a"})},
        "$ref": "#/$defs/b",
    },
    "open-objects-joined": {"allOf": [NODE, required("w", {"type": "string"})]},
    "one-closed-object-through-a-ref": {
        "$defs": {"A": {**NODE, "additionalProperties": False}},
        **required("x", {"allOf": [{"$ref": "#/$defs/A"}], "description": "an A"}),
    },
    "a-const-beside-anything": required("x", {"const": {"deep": [1]}, "$ref": "#"}),
    "closed-objects-joined-only-in-a-branch-it-need-not-take": required(
        "x",
        {
            "anyOf": [
                {"allOf": [{**NODE, "additionalProperties": False}, required("w", {"type": "string"})]},
                {"type": "null"},
            ]
        },
    ),
    "closed-objects-joined-only-in-a-definition-nothing-uses": {
        "type": "string",
        "$defs": {"Unused": {"allOf": [{**NODE, "additionalProperties": False}, required("w", {"type": "string"})]}},
    },
}

ENDLESS = {
    "itself-required": required("n", {"$ref": "#"}),
    "only-a-ref-to-itself": {"$ref": "#"},
    "each-requires-the-other": {
        "$defs": {"a": required("b", {"$ref": "#/$defs/b"}), "b": required("a", {"$ref": "#/$defs/a"})},
        "$ref": "#/$defs/a",
    },
    "itself-in-a-list-of-at-least-one": required("kids", {"type": "array", "items": {"$ref": "#"}, "minItems": 1}),
    "an-empty-enum": required("x", {"enum": []}),
    "an-empty-anyof": required("x", {"anyOf": []}),
    "false": required("x", False),
    "a-required-property-the-object-forbids": {
        **required("x", {"type": "string"}),
        "properties": {},
        "additionalProperties": False,
    },
}


@pytest.mark.parametrize("schema", ENDS.values(), ids=ENDS.keys())
def test_a_schema_with_a_value_that_ends_passes(schema: dict[str, Any]) -> None:
    assert endless_problem(schema) is None


@pytest.mark.parametrize("schema", ENDLESS.values(), ids=ENDLESS.keys())
def test_a_schema_no_value_of_which_ends_is_named(schema: dict[str, Any]) -> None:
    assert (endless_problem(schema) or "").startswith("no value of it can be written to its end")


def test_closed_objects_joined_by_allof_are_named_by_the_property_one_forbids() -> None:
    closed = {"additionalProperties": False}
    schema = {"allOf": [{**NODE, **closed}, {**required("w", {"type": "string"}), **closed}]}

    assert endless_problem(schema) == (
        "no value matches its allOf: one of the objects it joins allows no property 'w', which another requires"
    )


def chain(links: int) -> dict[str, Any]:
    """``links`` definitions each requiring the next, the last of which may be null."""
    defs = {f"d{i}": required("next", {"$ref": f"#/$defs/d{i + 1}"}) for i in range(links)}
    defs[f"d{links}"] = {"anyOf": [{"$ref": "#/$defs/d0"}, {"type": "null"}]}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def test_a_chain_of_refs_with_a_way_out_only_at_its_end_is_found_to_end() -> None:
    assert endless_problem(chain(30)) is None


def test_a_chain_of_refs_too_long_to_follow_is_named_not_raised() -> None:
    assert endless_problem(chain(5000)) == "its $ref chains or nesting go too deep to build a grammar from"
