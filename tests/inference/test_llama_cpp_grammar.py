"""The CPU runner's grammars: JSON Schema features the llama.cpp converter reads differently, made to mean what
they say."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from llama_cpp import llama_cpp as lib

from inference.engine.runners import llama_cpp
from inference.engine.runners.base import Constraint
from inference.engine.runners.llama_cpp import grammar_for, schema_problem

from ..conftest import DEFAULT_MODEL


def rules(schema: dict) -> dict[str, str]:
    grammar = grammar_for(Constraint(kind="json_schema", schema=schema))
    return dict(line.split(" ::= ", 1) for line in grammar.splitlines())


@pytest.fixture(scope="module")
def vocab() -> Iterator[Any]:
    yield llama_cpp._load_model(llama_cpp.model_path(DEFAULT_MODEL["runner_settings"]), vocab_only=True)


def accepts(vocab: Any, schema: dict[str, Any], text: str) -> bool:
    """Whether llama.cpp's grammar engine lets the model write ``text``, token by token, under ``schema``."""
    grammar = grammar_for(Constraint(kind="json_schema", schema=schema)).encode()
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
