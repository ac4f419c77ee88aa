"""The grammars built from JSON schemas, and the CPU runner sampling under them: JSON Schema features the llama.cpp
converter reads differently, made to mean what they say."""

from __future__ import annotations

import ctypes
import json
import random
import time
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import numpy as np
import pydantic
import pytest
import regex
from llama_cpp import llama_cpp as lib

from inference.engine.decoding import FunctionTool, ToolChoice, plan_decoding
from inference.engine.runners import closing, llama_cpp
from inference.engine.runners.base import Constraint
from inference.engine.runners.grammar import SchemaTooLarge, grammar_for, schema_problem
from tests.conftest import DEFAULT_MODEL


def rules(schema: dict) -> dict[str, str]:
    grammar = grammar_for(Constraint(kind="json_schema", schema=schema))
    return dict(line.split(" ::= ", 1) for line in grammar.splitlines())


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    yield llama_cpp._load_model(llama_cpp.model_path(DEFAULT_MODEL["runner_settings"]), vocab_only=True)


def accepts(vocab: Any, schema: dict[str, Any] | Constraint, text: str) -> bool:
    """Whether llama.cpp's grammar engine lets the model write ``text``, token by token, under ``schema`` (or a whole
    constraint)."""
    constraint = schema if isinstance(schema, Constraint) else Constraint(kind="json_schema", schema=schema)
    grammar = grammar_for(constraint).encode()
    sampler = lib.llama_sampler_init_grammar(vocab.vocab, grammar, b"root")
    one = (lib.llama_token_data * 1)()
    candidates = lib.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
    try:
        for token in vocab.tokenize(text.encode(), False, False):
            one[0].id, one[0].logit, one[0].p = token, 1.0, 0.0
            lib.llama_sampler_apply(sampler, ctypes.byref(candidates))
            if not np.isfinite(one[0].logit):
                return False
            lib.llama_sampler_accept(sampler, token)
        return True
    finally:
        lib.llama_sampler_free(sampler)


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def test_a_json_string_never_holds_a_raw_control_character(vocab: Any) -> None:
    assert accepts(vocab, CITY, json.dumps({"city": "Eugene,\nOregon\t"}))
    assert not accepts(vocab, CITY, '{"city": "Eugene,\nOregon"}')
    assert not accepts(vocab, CITY, '{"city": "Eugene,\tOregon"}')


@pytest.mark.parametrize(
    "escaped",
    [
        r"\ud83d\ude00x",
        r"\uD83D\uDE00\u00e9",
        r"\ud7ffx",
        r"\ue000x",
        r"\ud83d\ude00",
        r"\ud83d\ude00xy",
        r"\ud800x",
        r"\ude00x",
        r"\ud83dx",
        r"\ude00\ud83d",
    ],
)
def test_a_character_past_u_ffff_escaped_is_one_character_and_a_surrogate_escaped_alone_is_none(
    vocab: Any, escaped: str
) -> None:
    # An escaped pair counted as two characters (one emoji met minLength 2), and a lone half was written.
    schema = {"type": "object", "properties": {"v": {"type": "string", "minLength": 2, "maxLength": 2}}}
    value = json.loads(f'"{escaped}"')
    whole = all(not 0xD800 <= ord(char) <= 0xDFFF for char in value)

    assert accepts(vocab, schema, f'{{"v": "{escaped}"}}') == (whole and len(value) == 2)


def test_an_unanchored_pattern_allows_other_text_around_its_match_but_never_a_quote(vocab: Any) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "pattern": "Eugene"}}, "required": ["city"]}

    assert accepts(vocab, schema, '{"city": "in Eugene, Oregon"}')
    assert not accepts(vocab, schema, '{"city": "Portland"}')
    assert not accepts(vocab, schema, '{"city": "Eugene\n"}')


def test_a_patterns_dot_never_ends_the_json_string_nor_holds_a_control_character(vocab: Any) -> None:
    schema = {"type": "string", "pattern": "^a.c$"}

    assert accepts(vocab, schema, '"abc"')
    assert not accepts(vocab, schema, '"a"c"')
    assert not accepts(vocab, schema, '"a\tc"')


def test_an_anchored_pattern_stays_anchored() -> None:
    schema = {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"]}

    assert "[^" not in rules(schema)["zip"]


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        (r"^\d{5}$", ["97401"], ["9740a", "974011"]),
        (r"^v\d+\.\d+\.\d+$", ["v1.20.3"], ["v1x20.3", "v1.20"]),
        (r"^\w+@\w+\.com$", ["ann_1@example.com"], ["ann@example,com", "a-n@example.com"]),
        (r"^\(\d{3}\) \d{3}-\d{4}$", ["(541) 555-0199"], ["541 555-0199"]),
        (r"^\$\d+(\.\d{2})?$", ["$12", "$12.50"], ["12", "$12.5"]),
        (r"^[\w.\-]+$", ["a.b-c_d"], ["a b", "a/b"]),
        (r"^https?:\/\/\S+$", ["https://example.com/a?b=c"], ["https://example.com/a b", "ftp://x"]),
        (r"^\D\W\s$", ["a- ", "a!\u00a0"], ["1- ", "aa ", "a-x", "a-\n"]),
        (r"^[^\s,]+$", ["Eugene"], ["Eugene, Oregon", "Eu gene"]),
        (r"^a\tb$", ["a\tb"], ["a b", "atb"]),
        # Characters JSON writes escaped, standing for themselves: written as JSON escapes them, never raw.
        ('^"[a-z]+"$', ['"abc"'], ["abc", '"abc']),
        ("^a\nb\tc$", ["a\nb\tc"], ["anbtc", "a b c"]),
        ('^[^"]+$', ["abc"], ['a"c']),
    ],
)
def test_a_patterns_escapes_mean_what_json_schemas_regular_expressions_say(
    vocab: Any, pattern: str, matching: list[str], not_matching: list[str]
) -> None:
    # llama.cpp's grammars know none of these escapes: the converter copied them, and the grammar did not compile.
    assert_enforced(vocab, pattern, matching, not_matching)


def assert_enforced(vocab: Any, pattern: str, matching: list[str], not_matching: list[str]) -> None:
    """The grammar of a string with ``pattern`` lets the model write each of ``matching`` (which the pattern
    matches, as JSON Schema reads it) and none of ``not_matching``."""
    schema = {"type": "string", "pattern": pattern}

    assert schema_problem(schema, vocab=vocab) is None
    for text in matching:
        assert accepts(vocab, schema, json.dumps(text, ensure_ascii=False)), text
        assert regex.search(as_python(pattern), text), text
    for text in not_matching:
        assert not accepts(vocab, schema, json.dumps(text, ensure_ascii=False)), text


def as_python(pattern: str) -> str:
    """An ECMA-262 pattern as Python's regular expressions write it: a named group, and a character beyond the
    Basic Multilingual Plane written as a pair of escapes."""
    pair = r"\\u(d[89ab][0-9a-f]{2})\\u(d[c-f][0-9a-f]{2})"
    joined = regex.sub(pair, lambda m: chr(0x10000 + (int(m[1], 16) - 0xD800 << 10) + int(m[2], 16) - 0xDC00), pattern)
    return joined.replace("(?<", "(?P<")


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("^^a$$", ["a"], ["^a$", "aa"]),
        ("^a$|^bb$", ["a", "bb"], ["a$", "abb", "xa"]),
        ("a|^bb$", ["xa", "a", "bb"], ["bbx", "b"]),
        ("^a+?b$", ["ab", "aab"], ["b"]),
        ("^a{2,3}?$", ["aa", "aaa"], ["a"]),
        ("^(?:a|b)$", ["a", "b"], ["ab", "(?:a"]),
        ("(?:ab)", ["xaby", "ab"], ["a"]),
        ("^(?<x>a|b)c$", ["ac"], ["c"]),
        ("^\\ud83d\\ude00$", ["\U0001f600"], ["x"]),
        ("^a\\\\$", ["a\\"], ["a"]),
    ],
    ids=[
        "doubled-anchors",
        "anchored-alternatives",
        "one-alternative-anchored",
        "a-lazy-quantifier",
        "a-lazy-count",
        "a-non-capturing-group",
        "an-unanchored-non-capturing-group",
        "a-named-group",
        "a-surrogate-pair",
        "an-escaped-backslash-then-the-end",
    ],
)
def test_a_patterns_anchors_groups_and_quantifiers_mean_what_they_mean_in_json_schema(
    vocab: Any, pattern: str, matching: list[str], not_matching: list[str]
) -> None:
    # Anchors inside the pattern were read as characters, a lazy a+? as (a+)?, and (?: was refused.
    assert_enforced(vocab, pattern, matching, not_matching)


@pytest.mark.parametrize(
    ("pattern", "named"),
    [
        ("a$b", "$ anywhere but at the start or end"),
        ("(^a)", "^ anywhere but at the start or end"),
        ("^\\ud800$", "\\uD800 is half of a character"),
        ("^[\\ud800-\\udfff]$", "\\uD800 is half of a character"),
        ("^(?=a)a$", "(?=...)"),
        ("^(?i)a$", "(?...)"),
    ],
)
def test_a_pattern_no_grammar_can_enforce_as_written_is_refused_by_name(vocab: Any, pattern: str, named: str) -> None:
    # These came back as free text, or as text that does not match (bytes of no character at all).
    problem = schema_problem({"type": "string", "pattern": pattern}, vocab=vocab)

    assert problem is not None and named in problem and "/" not in problem


@pytest.mark.parametrize(
    ("pattern", "named"),
    [
        ("a{", "one of its patterns cannot be read (unbalanced curly brackets)"),
        ("a{x}", "one of its patterns cannot be read (invalid quantifier {x})"),
        ("[ab", "its pattern's [ is never closed"),
        ("[a\\]", "its pattern's [ is never closed"),
        ("(ab", "its pattern's ( is never closed"),
        ("a)|(b", "its pattern's ) at 1 closes no group"),
        ("[(]\\)x)", "its pattern's ) at 6 closes no group"),
    ],
)
def test_a_pattern_that_cannot_be_read_is_named_without_the_runners_rewrite_of_it(pattern: str, named: str) -> None:
    assert schema_problem({"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}) == named


def test_a_ref_chain_too_deep_to_convert_is_named_as_such() -> None:
    links = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(999)}

    problem = schema_problem({"$ref": "#/$defs/d0", "$defs": {**links, "d999": {"type": "integer"}}})

    assert problem == "its $ref chains or nesting go too deep to build a grammar from"


def test_a_negated_set_in_a_pattern_holds_nothing_json_writes_escaped(vocab: Any) -> None:
    schema = {"type": "string", "pattern": "^[^a]+$"}

    assert accepts(vocab, schema, '"bcd"')
    assert not accepts(vocab, schema, '"b"c"')
    assert not accepts(vocab, schema, '"b\nc"')
    assert not accepts(vocab, schema, '"b\\c"')


def test_a_range_in_a_pattern_holds_no_quote_or_backslash_json_would_write_escaped(vocab: Any) -> None:
    # Printable ASCII spans both: the model could end the string early, or begin an escape it never finished.
    schema = {"type": "string", "pattern": "^[ -~]+$"}

    assert accepts(vocab, schema, '"a b!#[]~"')
    assert not accepts(vocab, schema, '"b"c"')
    assert not accepts(vocab, schema, '"b\\c"')


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        (r"^[\w-.]+$", ["a-b.c_9"], ["a/b", "a b"]),
        (r"^[a-\d]$", ["a", "-", "5"], ["b"]),
        (r"^[\s-~]$", [" ", "-", "~"], ["a"]),
    ],
    ids=["a-class-then-a-hyphen", "a-hyphen-then-a-class", "a-space-class-then-a-hyphen"],
)
def test_a_hyphen_beside_a_class_in_a_set_is_the_character_as_ecma_262_reads_it(
    vocab: Any, pattern: str, matching: list[str], not_matching: list[str]
) -> None:
    # It was read as a range from the class's last character: out of order (refused), or spanning others.
    assert_enforced(vocab, pattern, matching, not_matching)


@pytest.mark.parametrize(
    ("pattern", "named"),
    [
        (r"^[z-a]$", "range z-a is out of order"),
        (r"^[^z-a]$", "range z-a is out of order"),
        (r"^a{,5}$", "{,5} is no count"),
        (r"^a{2, 3}$", "{2, 3} is no count"),
        (r"^\bword$", r"\b"),
        (r"^(a)\1$", r"\1"),
        (r"^\p{L}+$", r"\p"),
        (r"^[\D]$", r"\D inside [...]"),
        (r"^[\t ]$", r"\t inside [...]"),
        (r"^[a\"]$", r"\" inside [...]"),
        (r"^\x0a$", "U+000A"),
        ('^["a]$', r"\" inside [...]"),
        ("^a\x01$", "U+0001"),
    ],
)
def test_a_pattern_escape_no_grammar_can_enforce_is_named(vocab: Any, pattern: str, named: str) -> None:
    problem = schema_problem({"type": "string", "pattern": pattern}, vocab=vocab)

    assert problem is not None and named in problem and "compile" not in problem


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


def test_a_ref_to_the_whole_schema_is_a_recursive_rule(vocab: Any) -> None:
    tree = {"type": "object", "properties": {"name": {"type": "string"}, "child": {"$ref": "#"}}, "required": ["name"]}

    assert schema_problem(tree, vocab=vocab) is None
    assert accepts(vocab, tree, '{"name": "a", "child": {"name": "b", "child": {"name": "c"}}}')
    assert not accepts(vocab, tree, '{"name": "a", "child": {"child": ')


def test_refs_to_definitions_of_the_same_last_name_are_rules_of_their_own(vocab: Any) -> None:
    number = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    text = {"type": "object", "properties": {"s": {"type": "string"}}, "required": ["s"]}
    schema = {
        "$defs": {"a": {"$defs": {"Item": number}}, "Item": text},
        "type": "object",
        "properties": {"number": {"$ref": "#/$defs/a/$defs/Item"}, "text": {"$ref": "#/$defs/Item"}},
        "required": ["number", "text"],
    }

    assert accepts(vocab, schema, '{"number": {"n": 1}, "text": {"s": "x"}}')
    assert not accepts(vocab, schema, '{"number": {"n": 1}, "text": {"n"')


def test_a_definition_named_like_a_built_in_rule_keeps_its_own_meaning(vocab: Any) -> None:
    schema = {
        "$defs": {"string": {"type": "integer"}},
        "type": "object",
        "properties": {"n": {"$ref": "#/$defs/string"}, "s": {"type": "string"}},
        "required": ["n", "s"],
    }

    assert accepts(vocab, schema, '{"n": 1, "s": "x"}')
    assert not accepts(vocab, schema, '{"n": "x"')


def test_a_ref_that_points_at_nothing_is_named() -> None:
    problem = schema_problem({"type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}}) or ""

    assert "'#/$defs/Missing'" in problem and "points at nothing" in problem


@pytest.mark.parametrize(
    ("ref", "named"),
    [("#/required/0", "a string"), ("#/required", "an array"), ("#/$defs/a", "the boolean true")],
)
def test_a_ref_that_points_at_something_other_than_a_schema_object_is_named(ref: str, named: str) -> None:
    schema = {"type": "object", "properties": {"x": {"$ref": ref}}, "required": ["x"], "$defs": {"a": True}}

    problem = schema_problem(schema) or ""

    assert f"{ref!r} points at {named}, not at a schema object" in problem


@pytest.mark.parametrize("name", ['a"b', "a\\b", 'say "hi"\\n'])
def test_a_property_name_that_json_escapes_compiles_and_is_written_escaped(vocab: Any, name: str) -> None:
    schema = {
        "type": "object",
        "properties": {name: {"type": "string"}},
        "required": [name],
        "additionalProperties": False,
    }

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, json.dumps({name: "x"}))


def test_a_constant_string_with_a_backslash_is_written_as_json_escapes_it(vocab: Any) -> None:
    schema = {"enum": ["C:\\temp", 'a"b']}

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, json.dumps("C:\\temp")) and accepts(vocab, schema, json.dumps('a"b'))


# --- bounds on values: enforced where the grammar can, refused by name where it cannot --------------------------


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": -12, "maximum": 305},
        {"minimum": 7},
        {"maximum": -3},
        {"exclusiveMinimum": 0, "exclusiveMaximum": 100},
        {"minimum": 0.5, "maximum": 99.5},
        {"minimum": 120, "maximum": 130},
        {"minimum": 0, "maximum": 0},
    ],
    ids=["both", "least", "greatest-negative", "exclusive", "fractional", "narrow", "zero"],
)
def test_an_integers_bounds_are_enforced_digit_by_digit(vocab: Any, bounds: dict[str, float]) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}
    valid = jsonschema.Draft202012Validator(schema).is_valid

    for n in [*range(-150, 450), 999, 1000, 12345, -12345]:
        assert accepts(vocab, schema, json.dumps({"n": n})) == valid({"n": n}), n
    assert not accepts(vocab, schema, '{"n": -0}')
    assert not accepts(vocab, schema, '{"n": 007}')


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": 0},
        {"minimum": 0, "maximum": 1},
        {"exclusiveMinimum": 0},
        {"exclusiveMinimum": 0, "exclusiveMaximum": 1},
        {"maximum": -2},
        {"minimum": -3, "maximum": 2},
        {"minimum": -5, "exclusiveMaximum": -1},
        {"exclusiveMinimum": -1, "maximum": 10},
    ],
    ids=["non-negative", "unit", "positive", "open-unit", "negative", "across-zero", "negative-open", "open-low"],
)
def test_a_numbers_whole_bounds_are_enforced_with_any_fraction_between_them(
    vocab: Any, bounds: dict[str, float]
) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number", **bounds}}, "required": ["x"]}
    valid = jsonschema.Draft202012Validator(schema).is_valid
    numbers = [
        f"{sign}{whole}{fraction}"
        for sign in ("", "-")
        for whole in range(12)
        for fraction in ("", ".0", ".5", ".05", ".00", ".999")
        if not (sign and whole == 0 and fraction.strip(".0") == "")  # minus zero: never written
    ]

    for number in numbers:
        assert accepts(vocab, schema, f'{{"x": {number}}}') == valid({"x": json.loads(number)}), number


@pytest.mark.parametrize("bounds", [{"minimum": 0, "maximum": 1}, {"exclusiveMinimum": 0}, {"maximum": -2}])
def test_a_bounded_numbers_fraction_holds_at_most_sixteen_digits_as_llama_cpps_own_number_does(
    vocab: Any, bounds: dict[str, float]
) -> None:
    # Without a bound, the small model wrote "1.000…" until its budget ended.
    schema = {"type": "object", "properties": {"x": {"type": "number", **bounds}}, "required": ["x"]}
    within = {"minimum": "0.", "exclusiveMinimum": "3.", "maximum": "-2."}[next(iter(bounds))]

    assert accepts(vocab, schema, f'{{"x": {within}{"5" * 16}}}')
    assert not accepts(vocab, schema, f'{{"x": {within}{"5" * 17}}}')
    assert accepts(vocab, {"type": "object", "properties": {"x": {"type": "number"}}}, f'{{"x": 0.{"5" * 16}}}')
    assert not accepts(vocab, {"type": "object", "properties": {"x": {"type": "number"}}}, f'{{"x": 0.{"5" * 17}}}')


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (
            {"type": "number", "minimum": 0.5},
            "'minimum' of 0.5 can be enforced by this model's grammar only as a whole",
        ),
        ({"type": ["string", "null"], "minimum": 0}, "where the type is integer or number"),
        ({"type": "integer", "multipleOf": 5}, "'multipleOf' cannot be enforced"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "'uniqueItems' cannot be enforced"),
        ({"type": "array", "contains": {"const": 5}}, "'contains' cannot be enforced"),
        ({"type": "object", "minProperties": 2}, "'minProperties' cannot be enforced"),
        ({"type": "integer", "minimum": 1e30}, "past what this model's grammar enforces"),
        ({"type": "integer", "minimum": 5, "maximum": 4}, "allow no integer"),
        ({"type": "integer", "minimum": -(10**30)}, "integer exceeds 64-bit range"),
        ({"type": "object", "unevaluatedProperties": False}, "'unevaluatedProperties' cannot be enforced"),
        ({"type": "string", "minLength": 5, "maxLength": 2}, "'minLength' of 5 is past its 'maxLength' of 2"),
        ({"type": "array", "minItems": 3, "maxItems": 1}, "it allows no array"),
        ({"type": "string", "minLength": 2.0}, "'minLength' must be a whole number"),
        ({"type": "object", "properties": {"": {"type": "string"}}}, "property named '' cannot be enforced"),
        ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"]}, "'zz' is not among"),
        ({"type": "array", "prefixItems": [{"type": "integer"}], "items": {"type": "string"}}, "'prefixItems' beside"),
        ({"type": "array", "items": False}, "a schema of true or false"),
        ({"type": "object", "properties": {"a": True}}, "a schema of true or false"),
        ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "'allOf' can be enforced by this model's grammar only"),
        ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}, "'maxLength' beside 'pattern'"),
        ({"const": "abcdef", "maxLength": 2}, "'maxLength' beside 'const'"),
        ({"type": "string", "enum": ["abcdef", "x"], "maxLength": 2}, "'maxLength' beside 'enum'"),
        ({"$ref": "#", "maxLength": 2}, "'maxLength' beside '$ref'"),
        ({"anyOf": [{"type": "string"}], "minLength": 8}, "'minLength' beside 'anyOf'"),
        ({"oneOf": [{"type": "string"}], "anyOf": [{"type": "integer"}]}, "'anyOf' beside 'oneOf'"),
        (
            {"properties": {"a": {"type": "string"}}, "required": ["a"], "anyOf": [{"required": ["b"]}]},
            "beside 'anyOf'",
        ),
        ({"properties": {"a": {"type": "string"}}, "allOf": [{"required": ["a"]}]}, "'allOf' beside 'properties'"),
    ],
    ids=[
        "fractional-number-bound",
        "bound-of-two-types",
        "multipleOf",
        "uniqueItems",
        "contains",
        "minProperties",
        "huge-bound",
        "empty-range",
        "integer-past-64-bits",
        "unevaluatedProperties",
        "no-string",
        "no-array",
        "fractional-length",
        "empty-name",
        "required-not-a-property",
        "prefixItems-and-items",
        "items-false",
        "property-true",
        "allOf-of-strings",
        "length-beside-a-pattern",
        "length-beside-a-const",
        "length-beside-an-enum",
        "length-beside-a-ref",
        "length-beside-anyOf",
        "anyOf-beside-oneOf",
        "properties-beside-anyOf",
        "allOf-beside-properties",
    ],
)
def test_a_keyword_the_grammar_cannot_enforce_is_named_rather_than_left_out(schema: dict[str, Any], says: str) -> None:
    assert says in (schema_problem({"type": "object", "properties": {"v": schema}}) or "")


@pytest.mark.parametrize(
    "schema",
    [
        {"type": ["string", "null"], "maxLength": 2},
        {"type": ["string", "null"], "enum": ["ab", None]},
        {"type": ["integer", "string"], "const": 3},
        {"type": ["integer", "null"], "minimum": 3, "maximum": 4},
        {"type": ["number", "null"], "exclusiveMaximum": 4},
        {"type": ["string", "integer"], "maxLength": 2, "minimum": 4},
    ],
    ids=["maxLength", "enum", "const", "nullable-integer-bounds", "nullable-number-bound", "bounds-of-one-type"],
)
def test_a_list_of_types_keeps_its_other_keywords(vocab: Any, schema: dict[str, Any]) -> None:
    # The converter read the types alone: a maxLength, an enum or a const beside them was left out. A bound holds
    # nothing on a value of another type (null), and was refused where the type was a list.
    wrapped = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    valid = jsonschema.Draft202012Validator(wrapped).is_valid

    for value in ["ab", "abc", None, 3, 4, 5, 3.5, "x"]:
        assert accepts(vocab, wrapped, json.dumps({"v": value})) == valid({"v": value}), value


STRING_DEFINED = {"$defs": {"s": {"type": "string", "maxLength": 3}, "o": CITY}}


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "enum": ["1", 1]},
        {"type": ["integer", "null"], "enum": ["x", None, 2]},
        {"type": "object", "enum": [[1], {"a": 1}]},
        {"type": ["integer", "string"], "const": 3},
        {"type": "number", "anyOf": [{"type": "integer"}, {"const": 1.5}]},
        {"type": ["string", "integer"], "oneOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}]},
        {"type": "object", "$ref": "#/$defs/o"},
    ],
    ids=["enum", "enum-of-two-types", "enum-of-objects", "const", "anyOf", "oneOf", "ref"],
)
def test_a_type_beside_the_keyword_the_converter_reads_still_holds(vocab: Any, schema: dict[str, Any]) -> None:
    # The converter read an enum, a const or the branches alone, and the type beside them was left out.
    wrapped = {"type": "object", "properties": {"v": schema}, "required": ["v"], **STRING_DEFINED}
    valid = jsonschema.Draft202012Validator(wrapped).is_valid

    for value in ["1", 1, "x", None, 2, 3, 1.5, [1], {"a": 1}, {"city": "Oslo"}, {"x": 4}]:
        assert accepts(vocab, wrapped, json.dumps({"v": value})) == valid({"v": value}), value


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "enum": [5, 6]}, "its 'enum' holds no value of its 'type' 'string': it allows no value"),
        ({"type": "integer", "const": "x"}, "its 'const' is a string, not of its 'type' 'integer'"),
        ({"type": "string", "const": {"a": 1}}, "its 'const' is an object, not of its 'type' 'string'"),
        (
            {"type": "integer", "anyOf": [{"type": "string"}, {"type": "boolean"}]},
            "its 'type' 'integer' beside 'anyOf' cannot be enforced by this model's grammar: write it in each branch",
        ),
        ({"type": "integer", "oneOf": [{"type": "string"}, {"type": "boolean"}]}, "'integer' beside 'oneOf'"),
        ({"type": "object", "anyOf": [{"required": ["a"]}]}, "its 'type' 'object' beside 'anyOf'"),
        ({"type": "integer", "$ref": "#/$defs/s"}, "its 'type' 'integer' beside '$ref' cannot be enforced"),
    ],
    ids=["enum", "const", "const-object", "anyOf", "oneOf", "a-branch-of-any-type", "ref"],
)
def test_a_type_beside_the_keyword_the_converter_reads_that_it_cannot_hold_is_named(
    schema: dict[str, Any], says: str
) -> None:
    assert says in (schema_problem({"type": "object", "properties": {"v": schema}, **STRING_DEFINED}) or "")


# --- not, format and oneOf: enforced where the grammar can, refused by name where it cannot ---------------------


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "not": {"enum": ["Paris"]}},
        {"not": {"pattern": "^P"}},
        # the converter reads an allOf's parts for their properties alone, never their other keywords
        {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "not": {"required": ["a"]}}]},
    ],
    ids=["beside-a-type", "alone", "in-an-allOf-part"],
)
def test_a_not_is_refused_rather_than_left_out(schema: dict[str, Any]) -> None:
    assert "its 'not' cannot be enforced by this model's grammar" in (schema_problem(schema) or "")


# Each format OpenAI's structured outputs enforce: values it holds, and values it does not (the first a word, which
# the converter let through for every format but date, time, date-time and uuid).
FORMATS = {
    "date": (
        ["2024-02-29", "2000-02-29", "2023-12-31", "0001-01-01"],
        ["Paris", "2023-02-29", "1900-02-29", "2023-04-31", "2023-13-01", "2023-1-01", "0000-01-01"],
    ),
    "time": (
        ["12:00:00Z", "23:59:59+05:30", "08:15:00.5-00:00"],
        ["Paris", "24:00:00Z", "12:00:00", "12:00:00.Z", "12:60:00Z", "12:00:00+01:60"],
    ),
    "date-time": (
        ["2024-02-29T12:00:00Z", "1999-12-31T23:59:59.123+01:00"],
        ["Paris", "2023-02-29T12:00:00Z", "2024-01-01 12:00:00Z", "2024-01-01T12:00:00"],
    ),
    "duration": (
        ["P1D", "P1Y2M3DT4H5M6S", "PT1H", "PT30M", "PT5S", "P2W", "P1M"],
        ["Paris", "P", "PT", "P1H", "P1DT", "P1S", "P1.5D", "P1W1D"],
    ),
    "email": (
        ["a@b.co", "first.last+tag@mail.example.com"],
        ["Paris", "a@localhost", "a..b@x.com", ".a@x.com", "a@-x.com", "a b@x.com", "a@x.1com"],
    ),
    "hostname": (
        ["localhost", "example.com", "a.b.c.d.example.co.uk", "xn--bcher-kva.example"],
        ["-x", "x-", "a..b", "a_b.com", "1.2.3.4", "a" * 64 + ".com"],
    ),
    "ipv4": (["1.2.3.4", "255.255.255.255", "0.0.0.0"], ["Paris", "256.1.1.1", "01.1.1.1", "1.2.3", "1.2.3.4.5"]),
    "ipv6": (
        ["::", "::1", "1::", "2001:db8::1", "1:2:3:4:5:6:7:8", "ABCD:EF01::"],
        ["Paris", "1:2:3:4:5:6:7:8:9", "1::2::3", ":1", "1:", "12345::", "fe80::1%eth0"],
    ),
    "uuid": (
        ["123e4567-e89b-12d3-a456-426614174000"],
        ["Paris", "123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456-42661417400g"],
    ),
}


@pytest.mark.parametrize(("fmt", "valid", "invalid"), [(fmt, *values) for fmt, values in FORMATS.items()], ids=FORMATS)
def test_each_format_openai_enforces_lets_its_values_through_and_no_others(
    vocab: Any, fmt: str, valid: list[str], invalid: list[str]
) -> None:
    schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}}, "required": ["v"]}

    assert schema_problem(schema, vocab=vocab) is None
    for value in valid:
        assert accepts(vocab, schema, json.dumps({"v": value})), value
    for value in invalid:
        assert not accepts(vocab, schema, json.dumps({"v": value})), value


@pytest.mark.parametrize("types", [["string", "null"], ["string"]], ids=["string-or-null", "string-alone"])
def test_a_format_in_a_list_of_types_is_enforced_on_the_string(vocab: Any, types: list[str]) -> None:
    schema = {"type": "object", "properties": {"v": {"type": types, "format": "ipv4"}}, "required": ["v"]}

    assert accepts(vocab, schema, '{"v": "1.2.3.4"}')
    assert accepts(vocab, schema, '{"v": null}') == ("null" in types)
    assert not accepts(vocab, schema, '{"v": "Paris"}')


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "format": "uri"}, "its 'format' of 'uri' cannot be enforced by this model's grammar"),
        ({"type": "string", "format": "password"}, "its 'format' of 'password' cannot be enforced"),
        ({"type": "string", "format": "email", "pattern": "^a"}, "its 'format' beside 'pattern' cannot be enforced"),
        ({"type": "string", "format": "email", "maxLength": 8}, "its 'format' beside 'maxLength' cannot be enforced"),
        ({"format": "date"}, "its 'format' can be enforced by this model's grammar where the type is 'string'"),
    ],
    ids=["uri", "password", "beside-a-pattern", "beside-a-length", "without-a-type"],
)
def test_a_format_the_grammar_would_leave_out_is_refused_by_name(schema: dict[str, Any], says: str) -> None:
    assert says in (schema_problem({"type": "object", "properties": {"v": schema}}) or "")


def test_a_format_of_another_type_than_string_holds_nothing_and_is_let_be() -> None:
    assert schema_problem({"type": "integer", "format": "int32"}) is None


CAT = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}, "required": ["kind"]}
DOG = {"type": "object", "properties": {"kind": {"enum": ["dog", "puppy"]}, "barks": {"type": "boolean"}}}


@pytest.mark.parametrize(
    "one_of",
    [
        [{"type": "integer"}, {"type": "number", "minimum": 0}],
        [{"type": "string"}, {"type": "string", "maxLength": 3}],
        [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}],
        [{**CAT, "required": []}, DOG],  # a value without a kind matches both
        [CAT, {**DOG, "properties": {"kind": {"enum": ["dog", "cat"]}}}],
        [{"type": "object"}, {}],
    ],
    ids=["integer-and-number", "two-strings", "two-objects", "kind-required-by-neither", "a-kind-in-both", "any"],
)
def test_a_oneof_whose_branches_may_overlap_is_refused_naming_anyof(one_of: list[dict[str, Any]]) -> None:
    problem = schema_problem({"type": "object", "properties": {"v": {"oneOf": one_of}}}) or ""

    assert "its 'oneOf' cannot be enforced by this model's grammar where a value may match more than one" in problem
    assert "write 'anyOf'" in problem


class Cat(pydantic.BaseModel):
    kind: Literal["cat"]
    lives: int


class Dog(pydantic.BaseModel):
    kind: Literal["dog", "puppy"] = "dog"  # not required: Cat's kind is
    barks: bool


class Pet(pydantic.BaseModel):
    pet: Cat | Dog = pydantic.Field(discriminator="kind")


@pytest.mark.parametrize(
    ("schema", "valid", "invalid"),
    [
        (Pet.model_json_schema(), '{"pet": {"barks": true, "kind": "dog"}}', '{"pet": {"kind": "cat", "barks"'),
        ({"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}, "3", "3.5"),
        ({"oneOf": [{"const": 1}, {"enum": [2, 3]}, {"const": True}]}, "true", "4"),
        ({"oneOf": [{"$ref": "#/$defs/cat"}, DOG], "$defs": {"cat": CAT}}, '{"barks": false}', '{"lives": 9}'),
    ],
    ids=["discriminated-union", "types", "values", "kind-required-by-one"],
)
def test_a_oneof_whose_branches_cannot_overlap_is_enforced(
    vocab: Any, schema: dict[str, Any], valid: str, invalid: str
) -> None:
    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, valid)
    assert not accepts(vocab, schema, invalid)


# --- tool calls: every enforced tool's parameters in one call schema ----------------------------------------

ADDRESS = {
    "type": "object",
    "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
    "required": ["street", "city"],
    "additionalProperties": False,
}


def person(address: dict[str, Any]) -> dict[str, Any]:
    """Parameters as ``openai.pydantic_function_tool`` writes a model with a nested one."""
    return {
        "$defs": {"Address": address},
        "type": "object",
        "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"}},
        "required": ["name", "home"],
        "additionalProperties": False,
    }


def call_schema(*tools: FunctionTool, tool_choice: ToolChoice = "required") -> dict[str, Any]:
    plan = plan_decoding(tools=tools, tool_choice=tool_choice, parallel_tool_calls=True, reasoning=False)
    assert plan.constraint is not None and plan.constraint.schema is not None
    return plan.constraint.schema


def test_a_forced_call_of_a_tool_with_definitions_compiles_and_is_enforced(vocab: Any) -> None:
    schema = call_schema(FunctionTool("Person", None, person(ADDRESS), True))
    home = {"street": "1 Main St", "city": "Eugene"}

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, json.dumps({"name": "Person", "arguments": {"name": "Ann", "home": home}}))
    assert not accepts(vocab, schema, '{"name": "Person", "arguments": {"name": "Ann", "home": {"zip"')


def test_two_tools_each_call_under_their_own_definition_of_the_same_name(vocab: Any) -> None:
    postcode = {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}
    schema = call_schema(
        FunctionTool("Person", None, person(ADDRESS), True), FunctionTool("Letter", None, person(postcode), True)
    )

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, '{"name": "Letter", "arguments": {"name": "Ann", "home": {"zip": 97401}}}')
    assert not accepts(vocab, schema, '{"name": "Letter", "arguments": {"name": "Ann", "home": {"street"')
    assert not accepts(vocab, schema, '{"name": "Person", "arguments": {"name": "Ann", "home": {"zip"')


def test_beside_a_strict_tool_an_answer_may_open_with_a_tag_of_its_own_but_never_with_a_calls(vocab: Any) -> None:
    plan = plan_decoding(
        tools=[FunctionTool("get_weather", None, CITY, True)],
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning=False,
    )

    assert accepts(vocab, plan.constraint, "<tool_response>52F and raining</tool_response> It rains in Eugene.")
    assert accepts(vocab, plan.constraint, "<")
    assert accepts(vocab, plan.constraint, "It rains.")
    assert accepts(vocab, plan.constraint, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Eugene"}}')
    # "<tool_call>" opens a call, which holds to its schema: no other text can begin so.
    assert not accepts(vocab, plan.constraint, '<tool_call>\n{"name": "lookup"')
    assert not accepts(vocab, plan.constraint, "<tool_call> It rains.")


def test_a_strict_recursive_tool_compiles_under_auto(vocab: Any) -> None:
    node = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
        "required": ["name", "children"],
        "additionalProperties": False,
    }
    schema = call_schema(FunctionTool("Node", None, {"$defs": {"Node": node}, **node}, True), tool_choice="auto")

    assert schema_problem(schema, vocab=vocab) is None


def test_beside_tools_it_may_call_an_answer_in_a_json_format_holds_to_its_schema_and_a_call_to_its_own(
    vocab: Any,
) -> None:
    postcode = {"type": "object", "properties": {"zip": {"type": "integer"}}, "required": ["zip"]}
    tools = (FunctionTool("Letter", None, person(postcode), True), FunctionTool("lookup", None, None, False))
    plan = plan_decoding(
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=True,
        reasoning=False,
        response_format="json_schema",
        json_schema=person(ADDRESS),  # its own "Address", not the tool's
    )
    assert plan.constraint is not None
    call = '<tool_call>\n{"name": "Letter", "arguments": {"name": "Ann", "home": {"zip": 97401}}}\n</tool_call>'

    assert accepts(vocab, plan.constraint, json.dumps({"name": "Ann", "home": {"street": "1 Main", "city": "Eugene"}}))
    assert accepts(vocab, plan.constraint, call)
    assert accepts(vocab, plan.constraint, '<tool_call>\n{"name": "lookup", "arguments": {"any": [1]}}\n</tool_call>')
    assert not accepts(vocab, plan.constraint, "Ann lives in Eugene.")
    assert not accepts(vocab, plan.constraint, '{"name": "Ann", "home": {"zip"')
    assert not accepts(
        vocab, plan.constraint, '<tool_call>\n{"name": "Letter", "arguments": {"name": "Ann", "home": {"street"'
    )
    assert (None, person(ADDRESS)) in plan.enforced_schemas()


def test_beside_tools_it_may_call_an_answer_in_json_object_format_is_an_object() -> None:
    tools = (FunctionTool("lookup", None, None, True),)
    plan = plan_decoding(
        tools=tools, tool_choice="auto", parallel_tool_calls=True, reasoning=False, response_format="json_object"
    )

    assert plan.constraint is not None and plan.constraint.text_schema == {"type": "object"}
    assert not plan.constraint.free_text


def test_what_the_converter_cannot_express_is_named() -> None:
    assert "(?=...) cannot be enforced" in (schema_problem({"type": "string", "pattern": "^(?=a)a$"}) or "")
    assert "'not' cannot be enforced" in (schema_problem({"not": {"type": "null"}}) or "")
    assert "remote" in (schema_problem({"$ref": "https://example.com/schema.json"}) or "")


# --- closing a forced call before its budget runs out -------------------------------------------------------

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHOICES = {
    "type": "object",
    "properties": {"question": {"type": "string"}, "options": {"type": "array", "items": {"type": "string"}}},
    "required": ["question", "options"],
}
TEMPERATURE = {"type": "object", "properties": {"celsius": {"type": "number"}}, "required": ["celsius"]}
TREE = {
    "type": "object",
    "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}}},
    "properties": {"root": {"$ref": "#/$defs/node"}},
}
NESTED = {
    "type": "object",
    "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "object", "properties": {"c": {"type": "string"}}}}}
    },
}


@pytest.fixture(scope="module")
def vocabulary(vocab: Any) -> llama_cpp.Vocabulary:
    return llama_cpp.Vocabulary(vocab)


def closed(vocabulary: llama_cpp.Vocabulary, parameters: dict[str, Any], written: str) -> tuple[str, int]:
    """A forced call of ``get_weather`` written as far as ``written``, then closed by the runner; the text and the
    tokens closing took. The model's logits favour closing brackets and braces, which inside a string are text, and
    after them opening an object with a property, which a recursive schema would take for ever."""
    schema = call_schema(FunctionTool("get_weather", None, parameters, False))
    grammar = lib.llama_sampler_init_grammar(
        vocabulary.model.vocab, grammar_for(Constraint("json_schema", schema)).encode(), b"root"
    )
    sampler = llama_cpp._Sampler(
        vocabulary.model, llama_cpp.Sampling(max_tokens=64, temperature=0), grammar, vocabulary.utf8
    )
    tail = closing.JsonTail()
    bracey = np.array(
        [float(bool(p.strip()) and not p.strip().strip(b"}]")) * 50 + float(b'{"' in p) * 25 for p in vocabulary.pieces]
    )
    text = ""
    try:
        for token in vocabulary.tokenize(written):
            logits = np.zeros(len(vocabulary.pieces), dtype=np.float32)
            logits[token] = 100
            assert sampler.next(logits) == token
            tail.feed(vocabulary.pieces[token].decode())
            text += vocabulary.pieces[token].decode()
        for steps in range(32):
            closer = closing.Closing(vocabulary.closing, tail.closers())
            token = sampler.next(bracey.astype(np.float32), closing=closer)
            if vocabulary.is_end(token):
                return text, steps
            tail.feed(vocabulary.pieces[token].decode())
            text += vocabulary.pieces[token].decode()
        return text, 32
    finally:
        sampler.close()


@pytest.mark.parametrize(
    ("parameters", "arguments"),
    [
        (WEATHER, '{"city": "Eu'),
        (WEATHER, '{"city": "}} ]'),
        (WEATHER, '{"city": "a\\'),
        (WEATHER, '{"ci'),
        (CHOICES, '{"question": "Which {colour'),
        (CHOICES, '{"question": "Which?", "options": ["red", "gr'),
        (TEMPERATURE, '{"celsius": 21.'),
        (WEATHER, ""),
        (TREE, '{"root": {"child": {"child": {"child": '),
        (NESTED, '{"a": {"b": '),
    ],
    ids=[
        "in-a-string",
        "brackets-in-a-string",
        "in-an-escape",
        "in-a-name",
        "a-property-missing",
        "in-a-list",
        "in-a-number",
        "arguments-to-write",
        "a-recursive-value-to-write",
        "a-nested-value-to-write",
    ],
)
def test_a_forced_call_is_closed_in_a_few_tokens_from_wherever_its_budget_ran_low(
    vocabulary: llama_cpp.Vocabulary, parameters: dict[str, Any], arguments: str
) -> None:
    text, steps = closed(vocabulary, parameters, '{"name": "get_weather", "arguments": ' + arguments)

    call = json.loads(text)
    jsonschema.validate(call["arguments"], parameters)
    assert steps <= 12, text


# --- what checking the vocabulary against a grammar costs -------------------------------------------------------


def sampler_for(
    vocabulary: llama_cpp.Vocabulary, schema: dict[str, Any], temperature: float = 0.7, seed: int = 1
) -> llama_cpp._Sampler:
    grammar = grammar_for(Constraint("json_schema", schema)).encode()
    compiled = lib.llama_sampler_init_grammar(vocabulary.model.vocab, grammar, b"root")
    sampling = llama_cpp.Sampling(max_tokens=8, temperature=temperature, seed=seed)
    return llama_cpp._Sampler(vocabulary.model, sampling, compiled, vocabulary.utf8)


def quotes_least_likely(vocabulary: llama_cpp.Vocabulary) -> np.ndarray:
    """Logits that put every token a JSON string can open with (a quote) below all the others."""
    return np.array([-10.0 if p.lstrip().startswith(b'"') else 1.0 for p in vocabulary.pieces], dtype=np.float32)


def test_sampling_under_a_grammar_finds_an_allowed_token_far_down_the_vocabulary(
    vocabulary: llama_cpp.Vocabulary,
) -> None:
    sampler = sampler_for(vocabulary, {"type": "string", "enum": ["Eugene", "Salem"]})
    try:
        token = sampler.next(quotes_least_likely(vocabulary))
    finally:
        sampler.close()

    assert vocabulary.pieces[token].lstrip().startswith(b'"')


def greedy_bytes(vocabulary: llama_cpp.Vocabulary, schema: dict[str, Any], steps: list[list[int]]) -> list[bytes]:
    """What greedy sampling under ``schema`` writes when each step's logits favour its bytes, the first most."""
    byte = {piece[0]: token for token, piece in enumerate(vocabulary.pieces) if len(piece) == 1}
    sampler = sampler_for(vocabulary, schema, temperature=0)
    written = []
    try:
        for favoured in steps:
            logits = np.zeros(len(vocabulary.pieces), dtype=np.float32)
            for rank, value in enumerate(favoured):
                logits[byte[value]] = 100.0 - rank
            written.append(vocabulary.pieces[sampler.next(logits)])
    finally:
        sampler.close()
    return written


def test_under_a_grammar_a_token_that_would_write_no_character_utf8_allows_is_drawn_again(
    vocabulary: llama_cpp.Vocabulary,
) -> None:
    # The grammar reads ED A0 as the start of U+D800, a surrogate: the text held U+FFFD in its place.
    written = greedy_bytes(vocabulary, {"type": "string", "maxLength": 1}, [[ord('"')], [0xED], [0xA0, 0x9F], [0x80]])

    assert written == [b'"', b"\xed", b"\x9f", b"\x80"]
    assert b"".join(written).decode() == '"\ud7c0'


def test_under_a_grammar_the_output_stays_utf8_when_every_likely_token_would_break_it(
    vocabulary: llama_cpp.Vocabulary,
) -> None:
    # After ED, every byte from A0 up begins a surrogate: the tokens drawn again were the next likeliest of them.
    written = greedy_bytes(vocabulary, {"type": "string"}, [[ord('"')], [0xED], [*range(0xBF, 0x9F, -1), 0x85]])

    assert written == [b'"', b"\xed", b"\x85"]


def test_under_a_grammar_the_output_stays_utf8_whatever_bytes_the_model_favours(
    vocabulary: llama_cpp.Vocabulary,
) -> None:
    # Overlong forms (E0 80 80), surrogates (ED A0 80) and codes past U+10FFFF (F4 90 80 80) each passed as a
    # character: a model that favours the first bytes they start with, then any byte that may follow a first one.
    byte = {piece[0]: token for token, piece in enumerate(vocabulary.pieces) if len(piece) == 1}
    firsts = [byte[value] for value in (0xE0, 0xED, 0xF0, 0xF4)]
    following = [byte[value] for value in range(0x80, 0xC0)]
    quote = byte[ord('"')]
    for seed in range(8):
        draw = np.random.default_rng(seed)
        sampler = sampler_for(vocabulary, {"type": "string", "maxLength": 3}, seed=seed)
        text = b""
        try:
            for step in range(16):
                logits = np.zeros(len(vocabulary.pieces), dtype=np.float32)
                logits[firsts] = draw.normal(12.0, 1.0, len(firsts))
                logits[following] = draw.normal(10.0, 1.0, len(following))
                logits[quote] = 30.0 if step == 0 else 0.0
                token = sampler.next(logits)
                if vocabulary.is_end(token):
                    break
                text += vocabulary.pieces[token]
        finally:
            sampler.close()

        value = json.loads(text.decode())  # no U+FFFD in place of bytes that are no character
        assert isinstance(value, str) and len(value) <= 3, text


def test_a_grammar_too_costly_to_check_ends_its_job_instead_of_holding_every_stream(
    vocabulary: llama_cpp.Vocabulary, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(llama_cpp, "GRAMMAR_CHECK_MAX_SECONDS", 0.0)
    sampler = sampler_for(vocabulary, {"type": "string", "enum": ["Eugene", "Salem"]})
    try:
        with pytest.raises(llama_cpp.RunnerError, match="too costly to enforce") as raised:
            sampler.next(quotes_least_likely(vocabulary))
    finally:
        sampler.close()

    assert raised.value.code == "constraint_too_costly"


# --- bounds: what the converter writes out in full, and llama.cpp's parser recurses through -----------------


def string_of_at_most(length: int) -> dict[str, Any]:
    return {"type": "object", "properties": {"a": {"type": "string", "maxLength": length}}, "required": ["a"]}


def nullable_nested(levels: int) -> dict[str, Any]:
    """Objects each holding the next or null, as zod and hand-written schemas nest them (four levels of JSON each)."""
    schema: dict[str, Any] = {"type": "object", "properties": {"leaf": {"type": "string"}}, "required": ["leaf"]}
    for _ in range(levels):
        child = {"anyOf": [schema, {"type": "null"}]}
        schema = {"type": "object", "properties": {"name": {"type": "string"}, "child": child}, "required": ["child"]}
    return schema


def nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (string_of_at_most(20_000), "maxLength 20000 is more than the 1000"),
        ({"type": "array", "items": {"type": "integer"}, "minItems": 5000}, "minItems 5000"),
        ({"type": "array", "items": {"type": "integer"}, "maxItems": 1e9}, "maxItems 1e+09"),
        ({"type": "string", "pattern": "^[a-z]{1,20000}$"}, "its pattern repeats {1,20000}"),
        ({"type": "string", "pattern": "^" + "(" * 50 + "a" + ")" * 50 + "$"}, "nests groups deeper than 48"),
        (nested(25), "nested deeper than 48 levels"),
        ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(300)}}, "300 properties"),
        ({"enum": ["x" * 1000] * 2000}, "more than the 1048576 allowed"),
        ({"enum": [f"v{i}" for i in range(2000)]}, "holds 1999 alternatives"),
        ({"type": "string", "pattern": "^(" + "|".join(f"abc{i}" for i in range(5000)) + ")$"}, "4999 alternatives"),
        ({"type": "string", "pattern": "^" + ".*" * 200 + "$"}, "200 parts that may match nothing"),
        ({"type": "string", "pattern": "^(a{0,999}){0,999}$"}, "1000 parts that may match nothing"),
    ],
    ids=[
        "maxLength",
        "minItems",
        "maxItems-float",
        "pattern-count",
        "pattern-groups",
        "depth",
        "properties",
        "size",
        "enum-values",
        "pattern-alternatives",
        "pattern-optional-parts",
        "pattern-optional-parts-repeated",
    ],
)
def test_a_schema_past_the_bounds_is_refused_with_what_is_too_large(schema: dict[str, Any], says: str) -> None:
    assert says in (schema_problem(schema) or "")


def test_the_worker_refuses_to_build_a_grammar_past_the_bounds_too() -> None:
    with pytest.raises(SchemaTooLarge, match="maxLength 20000"):
        grammar_for(Constraint(kind="json_schema", schema=string_of_at_most(20_000)))


def test_the_bounds_are_settings(settings: Any) -> None:
    settings.SCHEMA_MAX_REPETITION = 50

    assert "maxLength 100 is more than the 50" in (schema_problem(string_of_at_most(100)) or "")
    assert schema_problem(string_of_at_most(50)) is None


@pytest.mark.parametrize(
    "schema",
    [
        string_of_at_most(1000),
        {"type": "string", "pattern": "^a{0,1000}$"},
        {"type": "string", "pattern": "^(a{0,999}){1,16}$"},
        {"type": "array", "items": {"type": "string", "maxLength": 1000}, "minItems": 1000, "maxItems": 1000},
        {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(256)}},
        nested(23),
        nullable_nested(11),
    ],
    ids=["maxLength", "pattern", "nested-pattern", "array-of-strings", "properties", "depth", "nullable-depth"],
)
def test_the_largest_schemas_within_the_bounds_compile_in_llama_cpp_quickly(vocab: Any, schema: dict[str, Any]) -> None:
    started = time.monotonic()

    assert schema_problem(schema, vocab=vocab) is None
    assert time.monotonic() - started < 5


def test_a_checked_schema_is_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    # Building this grammar takes about a fifth of a second: clients send the same tools on every turn.
    schema = {"type": "object", "properties": {f"remembered{i}": {"type": "string"} for i in range(256)}}
    built: list[Constraint] = []

    def build(constraint: Constraint, *args: Any) -> str:
        built.append(constraint)
        return grammar_for(constraint, *args)

    monkeypatch.setattr("inference.engine.runners.grammar.grammar_for", build)
    for _ in range(21):
        assert schema_problem(schema) is None

    assert len(built) == 1


@pytest.mark.parametrize("subschema", [{"$dynamicRef": "#meta"}, {"$recursiveRef": "#"}, {"foo": 1}])
def test_a_subschema_without_a_keyword_the_grammar_reads_is_named_in_plain_words(subschema: dict[str, Any]) -> None:
    problem = schema_problem({"type": "object", "properties": {"a": subschema}, "required": ["a"]}) or ""

    assert problem.startswith("one of its subschemas holds no keyword this model's grammar reads")
    assert "{" not in problem


PIECES = [b'"', b'", "', b'"}', b'""', b"}", b"<end>", b'"Eug', b"Eug", b"{", b"{}", b"E", b'" }', b'"\n}']


def closing_choice(own: bytes, allowed: list[bytes], closers: str, *, in_string: bool) -> tuple[bytes, bool]:
    """What closing writes when the model's likeliest token is ``own`` and the grammar allows ``allowed``, and
    whether it departs from the model's text."""
    vocabulary = closing.ClosingVocabulary.of(PIECES, {5})
    logits = np.full(len(PIECES), -np.inf)
    for piece in allowed:
        logits[PIECES.index(piece)] = 1.0
    logits[PIECES.index(own)] = 2.0
    closer = closing.Closing(vocabulary, closers, pieces=PIECES, in_string=in_string)
    token, departed = closer.choose(logits)
    return PIECES[token], departed


@pytest.mark.parametrize(
    ("allowed", "chosen"),
    [([b'", "', b'"Eug'], b'", "'), ([b'""', b"E"], b'""')],
    ids=["an-empty-value-and-the-next-name", "an-empty-value"],
)
def test_closing_a_string_the_model_had_just_opened_departs_from_its_text(allowed: list[bytes], chosen: bytes) -> None:
    # The model meant to open the city's value; closing wrote one of its own: the call was cut, not finished.
    assert closing_choice(b'"', allowed, "}", in_string=False) == (chosen, True)


def test_closing_after_the_string_the_model_was_ending_keeps_to_its_text() -> None:
    # The model meant to end the value; closing also ends the object it is in, as the model would have.
    assert closing_choice(b'"', [b'"}', b"Eug"], '"}', in_string=True) == (b'"}', False)


@pytest.mark.parametrize("spaced", [b'" }', b'"\n}'], ids=["a-space", "a-line-break"])
def test_closing_after_the_string_the_model_was_ending_keeps_to_its_text_however_it_is_spaced(spaced: bytes) -> None:
    assert closing_choice(b'"', [spaced, b"Eug"], '"}', in_string=True) == (spaced, False)


def test_closing_that_spells_in_one_token_what_the_grammar_admits_alone_keeps_to_the_models_text() -> None:
    # A tool without parameters: the model meant "{" and closing wrote "{}", the only object the grammar admits.
    assert closing_choice(b"{", [b"{}"], "", in_string=False) == (b"{}", False)


def test_seeds_that_differ_only_in_their_high_bits_draw_apart() -> None:
    pairs = [(1, 2**32), (0, 2**32 - 1), (-1, 2**32 - 2), (2**63 - 1, -(2**63))]

    assert all(llama_cpp.seed_32(one) != llama_cpp.seed_32(other) for one, other in pairs)
    assert all(0 <= llama_cpp.seed_32(seed) < 0xFFFFFFFF for pair in pairs for seed in pair)


@pytest.fixture(scope="module")
def pieces(vocab: Any) -> list[bytes]:
    return [llama_cpp.piece(vocab, token) for token in range(lib.llama_vocab_n_tokens(vocab.vocab))]


def wander(vocab: Any, pieces: list[bytes], schema: dict[str, Any], seed: int, most: int = 160) -> bytes | None:
    """Text written by a model that picks any token the schema's grammar allows, at random, leaning towards a quote
    or a closing bracket after a while so that most walks end: what the grammar lets through, or None for a walk
    that did not end within ``most`` tokens."""
    size, end = len(pieces), lib.llama_vocab_eos(vocab.vocab)
    grammar = grammar_for(Constraint(kind="json_schema", schema=schema)).encode()
    sampler = lib.llama_sampler_init_grammar(vocab.vocab, grammar, b"root")
    data = (lib.llama_token_data * size)()
    view = np.ctypeslib.as_array(data)
    candidates = lib.llama_token_data_array(data=data, size=size, selected=-1, sorted=False)
    draw = random.Random(seed)
    text = b""
    try:
        for step in range(most):
            view["id"], view["logit"], view["p"] = np.arange(size), 0.0, 0.0
            lib.llama_sampler_apply(sampler, ctypes.byref(candidates))
            allowed = view["id"][np.isfinite(view["logit"])].tolist()
            assert allowed, f"the grammar allows nothing after {text!r}"
            if end in allowed and (step > 20 or draw.random() < 0.3):
                return text
            closing = [token for token in allowed if token != end and any(c in pieces[token] for c in b'"}]')]
            if step > 40 and closing and draw.random() < 0.7:
                allowed = closing
            token = draw.choice([token for token in allowed if token != end] or allowed)
            if token == end:
                return text
            text += pieces[token]
            lib.llama_sampler_accept(sampler, token)
        return None
    finally:
        lib.llama_sampler_free(sampler)


SCHEMAS_TO_WANDER = [
    {"type": "string", "pattern": "^[ -~]+$"},
    {"type": "string", "pattern": "^[^a]{2,5}$"},
    {"type": "string", "pattern": "^.{1,8}$"},
    {"type": "string", "pattern": "^(a|b\\\\c)+$"},
    {"type": "string", "pattern": '^a"b$'},
    {"type": "string", "pattern": "^x\\.y\\/z$"},
    {"type": "string", "pattern": "ab"},
    {"type": "string", "pattern": "^\\d+(\\.\\d+)?$"},
    {"type": "string", "pattern": "^(?:\\+?1[-. ]?)?\\(?\\d{3}\\)?[-. ]?\\d{3}[-. ]?\\d{4}$"},
    {"type": "string", "pattern": "^[\\]\\[]+$"},
    *({"type": "string", "format": fmt} for fmt in ("date-time", "date", "time", "duration", "email", "ipv4", "uuid")),
    {"type": "string", "minLength": 3, "maxLength": 5},
    {"enum": ['a"b', "c\\d", "é\n"]},
    {"const": "x\ty\u2028"},
    {"type": "integer", "minimum": -180, "maximum": 180},
    {"type": "integer", "exclusiveMinimum": 5, "exclusiveMaximum": 100},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": ["string", "null"], "maxLength": 4},
    {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
    {
        "type": "object",
        "properties": {'a"b': {"type": "string", "maxLength": 3}, "é": {"type": "integer"}},
        "required": ['a"b'],
        "additionalProperties": False,
    },
    {"anyOf": [{"type": "string", "pattern": "^[ -~]$"}, {"type": "integer", "minimum": 10}]},
    {
        "$defs": {
            "N": {
                "type": "object",
                "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/N"}, "maxItems": 2}},
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/N",
    },
]


@pytest.mark.parametrize("schema", SCHEMAS_TO_WANDER, ids=lambda schema: json.dumps(schema)[:60])
def test_whatever_a_grammar_lets_a_model_write_is_json_that_holds_to_the_schema(
    vocab: Any, pieces: list[bytes], schema: dict
) -> None:
    # The model is a random walk through what the grammar allows, so every corner of it gets its turn.
    written = [text for seed in range(3) if (text := wander(vocab, pieces, schema, seed)) is not None]

    assert written, "no walk ended"
    for text in written:
        value = json.loads(text.decode(errors="replace"))
        jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


LOOKUP = {
    "type": "object",
    "properties": {name: {"type": "string"} for name in "qrs"},
    "required": ["q", "r", "s"],
}
GET = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}


@pytest.mark.parametrize(
    ("written", "missing"),
    [
        ("", {"name", "arguments", "a"}),  # no function named yet: the cheapest call's
        ('{"name": "lookup", "arguments": {"q": "get"', {"r", "s"}),  # "get" is an argument, not the call's name
        ('{"name": "get", "arguments": {', {"a"}),
    ],
    ids=["none-named", "a-function-named-as-an-argument", "the-other-function"],
)
def test_closing_a_call_in_time_counts_the_names_the_function_it_calls_needs(written: str, missing: set[str]) -> None:
    tail = closing.JsonTail(
        call_schema(FunctionTool("lookup", None, LOOKUP, False), FunctionTool("get", None, GET, False)),
        cost=lambda spelled: 1,
    )
    tail.feed("<tool_call>\n" + written)

    assert tail.missing() == len(missing)


def missing_after(schema: dict[str, Any], written: str) -> int:
    """What the schema still requires after ``written``, each property's name counted as one token."""
    tail = closing.JsonTail(schema, cost=lambda spelled: 1)
    tail.feed(written)
    return tail.missing()


ORDER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "extra": {"type": "object", "properties": {"units": {"type": "string"}}, "required": ["units"]},
        "list": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/Item"}},
        "more": {"type": "array", "items": {"$ref": "#/$defs/Item"}},
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
    },
    "required": ["city", "list", "more", "next"],
    "$defs": {
        "Item": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "qty": {"type": "integer"}},
            "required": ["id", "qty"],
        }
    },
}


@pytest.mark.parametrize(
    ("written", "missing"),
    [
        ("", {"city", "list", "an item", "id", "qty", "more", "next"}),  # an optional object's own are not needed
        ('{"city": "x", "extra": {', {"units", "list", "an item", "id", "qty", "more", "next"}),  # until it is opened
        ('{"city": "x", "list": [{"id": 1, "qty": 2}], "more": [{"id": 1, "qty": 2}, {', {"id", "qty", "next"}),
        (
            '{"city": "x", "list": [{"id": 1, "qty": 2}], "more": [{"id": 1, "qty": 2}], "next": {',
            {*ORDER["required"], "an item", "id", "qty"},
        ),
        (
            '{"city": "x", "list": [], "more": [], "next": {"city": "y", "list": [{"id": 1, "qty"',
            {"qty's value", "more", "next"},
        ),
        (
            '{"city": "x", "list": [], "more": [], "next": {"city": "y", "list": [',
            {"an item", "id", "qty", "more", "next"},
        ),
        ('{"city": "x", "list": [{"id": 1, "qty": 2},', {"an item", "id", "qty", "more", "next"}),
        ('{"city": "x", "list": [], "more": [], "next": null,', {"extra", "units"}),
    ],
    ids=[
        "none-written",
        "an-optional-object-opened",
        "an-item-past-minitems",
        "recursion",
        "an-item-inside-a-nested-model",
        "minitems",
        "a-comma-asks-for-an-item",
        "a-comma-asks-for-a-property",
    ],
)
def test_what_is_still_needed_is_what_the_open_objects_of_the_text_require(written: str, missing: set[str]) -> None:
    # An item past minItems, or a nested model, opened late needed nothing, a name written by an earlier object
    # counted as written in every later one, and a comma asked for nothing: a forced call began closing too late.
    # An item not begun takes a token of its own besides the names it needs.
    assert missing_after(ORDER, written) == len(missing)


XYZ = {"type": "object", "properties": {name: {"type": "integer"} for name in "xyz"}, "required": ["x", "y", "z"]}
PAIR = {"type": "array", "prefixItems": [XYZ, XYZ], "items": False}


@pytest.mark.parametrize(
    ("schema", "written", "missing"),
    [
        ({"type": "object", "properties": {"a": XYZ}, "required": ["a"]}, '{"a"', 1 + 3),  # a token of its own
        ({"type": "object", "properties": {"a": XYZ}, "required": ["a"]}, '{"a": ', 1 + 3),
        ({"type": "object", "properties": {"pair": PAIR}, "required": ["pair"]}, '{"pair": [', 2 * (1 + 3)),
        (
            {"type": "object", "properties": {"pair": PAIR}, "required": ["pair"]},
            '{"pair": [{"x": 1, "y": 2, "z": 3}, ',
            1 + 3,
        ),
        ({"anyOf": [{"enum": ["x", "y"]}, XYZ]}, "{", 3),
        ({"anyOf": [XYZ, {"type": "object", "properties": {"a": {}}, "additionalProperties": False}]}, '{"x": 1', 2),
    ],
    ids=["a-value-not-begun", "after-its-colon", "a-tuple", "a-tuples-second-item", "an-enum-beside", "a-branch-left"],
)
def test_what_is_still_needed_counts_every_value_the_text_has_committed_to(
    schema: dict[str, Any], written: str, missing: int
) -> None:
    # A named property's value counted nothing until its bracket came, prefixItems nothing at all, and an enum of
    # strings was an alternative of an object already open.
    assert missing_after(schema, written) == missing


USERS = {
    "type": "object",
    "additionalProperties": {"type": "object", "properties": {"age": {}, "email": {}}, "required": ["age", "email"]},
}
SHAPE_LIST = {
    "type": "array",
    "items": {
        "anyOf": [
            {"type": "object", "properties": {"kind": {"const": "circle"}, "r": {}}, "required": ["kind", "r"]},
            {
                "type": "object",
                "properties": {"kind": {"const": "rect"}, **XYZ["properties"]},
                "required": ["kind", *"xyz"],
            },
        ]
    },
}
MORE = {"type": "object", "properties": {"a": {}, "bb": XYZ}, "required": ["a"], "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "written", "missing"),
    [
        (USERS, "{", 0),
        (USERS, '{ "', 3 + 2),  # a map's key begun: its value's properties too
        (USERS, '{"ann": {"age": 1, "email": ""},', 3 + 2),
        (SHAPE_LIST, '[{"kind": "', 1),  # the cheapest branch, while the value may be either
        (SHAPE_LIST, '[{"kind": "re', 3),
        (SHAPE_LIST, '[{"kind": "ci', 1),
        (MORE, '{"a": 1, "b', 1 + 3),  # no required name begins so: the optional one it may become
    ],
    ids=["a-map", "a-maps-key-begun", "a-comma-in-a-map", "a-tag-begun", "the-dearer-tag", "the-cheaper-tag", "a-name"],
)
def test_what_is_still_needed_follows_the_string_being_written(
    schema: dict[str, Any], written: str, missing: int
) -> None:
    # A union's tag, a map's key or an optional property's name cost nothing until its string ended: by then the
    # grammar allowed only its quote, and closing could not keep the call within its budget.
    assert missing_after(schema, written) == missing


def test_a_const_or_an_enums_value_counts_its_own_tokens() -> None:
    schema = {"type": "object", "properties": {"kind": {"const": "a-rather-long-name"}}, "required": ["kind"]}
    tail = closing.JsonTail(schema, cost=lambda spelled: 1, value_cost=lambda value: len(value))

    assert tail.missing() == 1 + len('"a-rather-long-name"')


def test_following_a_schemas_alternatives_stays_bounded_however_its_refs_branch_and_loop() -> None:
    # Each definition two ways to the next: 2**40 paths to the object at the end, followed for every token.
    definitions = {f"D{i}": {"anyOf": [{"$ref": f"#/$defs/D{i + 1}"}] * 2} for i in range(40)}
    definitions["D40"] = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    schema = {"$defs": definitions, "anyOf": [{"$ref": "#/$defs/D0"}, {"$ref": "#"}]}
    tail = closing.JsonTail(schema, cost=lambda spelled: 1)

    assert tail.missing() == 1
    tail.feed('{"a": 1')
    assert tail.missing() == 0


OPTIONAL_AND_MORE = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "additionalProperties": {"type": "string"},
}


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        (OPTIONAL_AND_MORE, "its 'additionalProperties' beside optional properties"),
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "string"}}},
                    {"type": "object", "properties": {"b": {"type": "string"}}, "additionalProperties": False},
                ]
            },
            "its 'allOf' of objects with 'additionalProperties'",
        ),
        (
            {
                "allOf": [
                    {"type": "object", "properties": {"a": {"type": "string"}}},
                    {"type": "object", "properties": {"a": {"type": "integer"}}},
                ]
            },
            "names the property 'a' in two of its parts",
        ),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}], "minItems": 4},
            "its 'minItems' of 4 beside its 2 'prefixItems'",
        ),
    ],
    ids=["optional-properties-and-more", "allOf-closing-a-part", "allOf-naming-one-twice", "prefixItems-and-more"],
)
def test_what_the_converter_would_write_as_other_than_json_or_the_schema_is_refused_by_name(
    vocab: Any, schema: dict[str, Any], says: str
) -> None:
    # The converter wrote {"a":1"b":"x"} (no comma) for the first; the others let values through that break them.
    assert says in (schema_problem(schema, vocab=vocab) or "")


@pytest.mark.parametrize(
    "bounds",
    [
        {"minimum": 0, "maximum": 2**31 - 1},
        {"minimum": -(2**31), "maximum": 2**31 - 1},
        {"minimum": 0, "maximum": 2**53 - 1},
    ],
    ids=["int32-positive", "int32", "js-safe"],
)
def test_an_integer_between_common_machine_bounds_is_enforced_not_refused_for_its_size(
    vocab: Any, bounds: dict[str, int]
) -> None:
    # Every digit of the span was split in two: 2,047 alternatives for ten digits, past the bound, and refused.
    schema = {"type": "integer", **bounds}

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, str(bounds["maximum"])) and accepts(vocab, schema, str(bounds["minimum"]))
    assert not accepts(vocab, schema, str(bounds["maximum"] + 1))


def test_a_closed_tuple_is_enforced_as_its_prefix_items_and_no_other(vocab: Any) -> None:
    # "items": false beside prefixItems was refused, with a hint ("write {}") that meant the opposite.
    schema = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False}

    assert schema_problem(schema, vocab=vocab) is None
    assert accepts(vocab, schema, '[1, "a"]')
    assert not accepts(vocab, schema, '[1, "a", 2]') and not accepts(vocab, schema, "[1]")


def test_closing_a_list_after_its_comma_writes_the_item_the_comma_asks_for_and_no_further_comma() -> None:
    # Counted as nothing, the item a comma asks for made `` "",`` (an empty item and the next comma) as cheap to close
    # as `` ""``, and closing, taking the longer, wrote empty items until the budget ran out: a forced call's
    # arguments ended as `"options": ["red", "", "", "",` and were not sent.
    schema = {"type": "object", "properties": {"options": {"type": "array", "items": {"type": "string"}}}}
    tail = closing.JsonTail(schema, cost=lambda spelled: 1)
    tail.feed('{"options": ["red",')

    assert tail.needs(after=' ""') < tail.needs(after=' "",') == tail.needs()
