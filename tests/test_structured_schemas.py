"""JSON schemas the grammar cannot hold an output to are refused, not served with a constraint dropped
(engine/structured.py, UNENFORCED): each refused keyword is one xgrammar compiles but lets a violating output
through (checked here against xgrammar itself, so a release that starts enforcing one tells us to serve it), the
refusal names the keyword and where it is, names that merely look like keywords pass, and a one-schema allOf (a
description beside a $ref, as older pydantic writes it) is merged and served."""
from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from engine.errors import InvalidRequestError
from engine.structured import UNENFORCED, GrammarCompiler, StructuredOutput, _enforceable

INT = {"type": "integer"}
PAIR = {"type": "object", "properties": {"a": INT, "b": INT}}
# each refused keyword: a schema with it, an output that breaks it, and one that keeps it
BROKEN = {
    "not": ({"not": {"type": "string"}}, '"abc"', "1"),
    "if": ({**PAIR, "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "allOf": ({"allOf": [{**PAIR}, {"required": ["a"]}]}, "{}", '{"a": 1}'),
    "contains": ({"type": "array", "items": INT, "contains": {"const": 3}}, "[1]", "[3]"),
    "uniqueItems": ({"type": "array", "items": INT, "uniqueItems": True}, "[1, 1]", "[1, 2]"),
    "dependentRequired": ({**PAIR, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', '{"a": 1, "b": 2}'),
    "dependentSchemas": ({**PAIR, "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}', '{"a": 1, "b": 2}'),
}


@pytest.fixture(scope="module")
def grammars(smol_path):
    from engine.loader import load_tokenizer
    return GrammarCompiler(load_tokenizer(smol_path), 49152, [2])


def test_each_refused_keyword_is_one_xgrammar_lets_a_violation_through():
    assert set(BROKEN) == set(UNENFORCED)
    for keyword, (schema, broken, kept) in BROKEN.items():
        grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
        assert accepts(grammar, kept) and accepts(grammar, broken), keyword
    enforced = xgr.Grammar.from_json_schema(json.dumps({"type": "array", "items": INT, "maxItems": 1}),
                                            any_whitespace=False)
    assert not accepts(enforced, "[1, 2]")                   # what it does enforce, it refuses


@pytest.mark.parametrize("keyword", UNENFORCED)
def test_a_schema_with_one_is_refused_naming_it_and_where(grammars, keyword):
    schema = {"type": "object", "properties": {"legs": {"type": "array", "items": BROKEN[keyword][0]}}}
    with pytest.raises(InvalidRequestError, match=rf"'{keyword}' \(at \$\.properties\.legs\.items\)"):
        grammars.compile(StructuredOutput(json=schema))
    with pytest.raises(InvalidRequestError, match=f"'{keyword}'"):          # the schema as text, too
        grammars.compile(StructuredOutput(json=json.dumps(BROKEN[keyword][0])))


def test_names_and_data_that_look_like_keywords_pass(grammars):
    """Properties named not/if/allOf, an enum of objects with such keys, a $defs entry called contains."""
    schema = {"type": "object", "properties": {"not": INT, "if": {"enum": [{"allOf": 1}, "x"]}, "ref": {"$ref": "#/$defs/contains"}},
              "$defs": {"contains": {"type": "string", "description": "uniqueItems is just a word here"}}}
    assert _enforceable(schema) == schema
    grammars.compile(StructuredOutput(json=schema))


def test_a_one_schema_all_of_is_merged_and_served(grammars):
    schema = {"type": "object", "properties": {"leg": {"allOf": [{"$ref": "#/$defs/Leg"}], "description": "which"}},
              "$defs": {"Leg": {"enum": ["first", "anchor"]}}}
    merged = _enforceable(schema)
    assert merged["properties"]["leg"] == {"$ref": "#/$defs/Leg", "description": "which"}
    compiled = grammars.compile(StructuredOutput(json=schema))
    grammar = xgr.Grammar.from_json_schema(json.dumps(merged), any_whitespace=False)
    assert accepts(grammar, '{"leg": "anchor"}') and not accepts(grammar, '{"leg": "last"}')
    assert compiled is grammars.compile(StructuredOutput(json=schema))      # compiled once, cached by the spec
    clash = {"type": "object", "allOf": [{"type": "object", "required": ["a"]}]}        # its keys collide: refused
    with pytest.raises(InvalidRequestError, match="'allOf'"):
        grammars.compile(StructuredOutput(json=clash))


def test_a_schema_nested_past_the_recursion_limit_is_a_clear_refusal(grammars):
    """The offline API takes a schema as a mapping of any depth (HTTP bodies that deep are refused as JSON)."""
    deep: dict = {"type": "integer"}
    for _ in range(2000):
        deep = {"type": "array", "items": deep}
    with pytest.raises(InvalidRequestError, match="nested too deeply"):
        grammars.compile(StructuredOutput(json=deep))
