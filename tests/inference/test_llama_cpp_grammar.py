"""The CPU runner's grammars: JSON Schema features the llama.cpp converter reads differently, made to mean what they say."""

from __future__ import annotations

from inference.runners.base import Constraint
from inference.runners.llama_cpp import grammar_for, schema_problem


def rules(schema: dict) -> dict[str, str]:
    grammar = grammar_for(Constraint(kind="json_schema", schema=schema))
    return dict(line.split(" ::= ", 1) for line in grammar.splitlines())


def test_an_unanchored_pattern_allows_other_text_around_its_match_but_never_a_quote() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "Eugene"}}, "required": ["city"]}

    assert rules(schema)["city"] == r'"\"" [^"\\]* ("Eugene") [^"\\]* "\"" space'


def test_a_patterns_dot_never_ends_the_json_string() -> None:
    assert rules({"type": "string", "pattern": "^a.c$"})["dot"] == r'[^"\\\x0A\x0D]'


def test_an_anchored_pattern_stays_anchored() -> None:
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}

    assert "[^" not in rules(schema)["zip"]


def test_a_property_called_pattern_is_a_property_not_a_regex() -> None:
    schema = {"type": "object", "properties": {"pattern": {"type": "string"}}, "required": ["pattern"]}

    assert rules(schema)["pattern-kv"] == r'"\"pattern\"" space ":" space string'


def test_a_constant_that_holds_a_pattern_key_is_left_as_written() -> None:
    schema = {"const": {"pattern": "abc"}}

    assert "abc" in rules(schema)["root"] and "[^" not in rules(schema)["root"]


def test_a_recursive_model_as_pydantic_writes_it_compiles() -> None:
    node = {"type": "object", "properties": {"children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}
    schema = {"$defs": {"Node": node}, "$ref": "#/$defs/Node"}

    assert schema_problem(schema) is None
    assert rules(schema)["children-item"] == "Node"


def test_what_the_converter_cannot_express_is_named() -> None:
    assert "Unsupported pattern syntax" in (schema_problem({"type": "string", "pattern": "^(?=a)a$"}) or "")
    assert "Unrecognized schema" in (schema_problem({"not": {"type": "null"}}) or "")
    assert "remote" in (schema_problem({"$ref": "https://example.com/schema.json"}) or "")
