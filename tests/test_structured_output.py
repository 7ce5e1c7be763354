"""Structured output in the engine (engine/structured.py): SmolLM2 under a grammar. Every JSON-schema output
parses and validates against its schema, greedy and sampled, batched with unconstrained requests; regex,
choice and EBNF outputs match; a request resumed elsewhere rebuilds its grammar state from its tokens and
continues exactly; speculation (prompt lookup, layer skip) leaves constrained output unchanged; bad specs are
refused."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from engine import LLM, InvalidRequestError, LLMEngine, Resume, SamplingParams
from engine.structured import StructuredOutput
from tests.conftest import GRAMMAR_COMPILE_TIMEOUT_S

# SmolLM2 runs every test but the last: the slow tier (CI runs it; `make test-fast` keeps under 3 minutes)
slow = pytest.mark.slow

SCHEMAS = {
    "profile": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["runner", "coach", "fan"]},
        "splits": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1,
                   "maxItems": 4},
        "team": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                 "required": ["city"]}},
        "required": ["name", "age", "role", "splits", "team"]},
    "list": {"type": "array", "items": {"type": "object", "properties": {
        "leg": {"type": "integer", "minimum": 1, "maximum": 4}, "done": {"type": "boolean"}},
        "required": ["leg", "done"]}, "minItems": 2, "maxItems": 3},
}
PROMPTS = ["Describe a relay runner as JSON.", "Give me the legs of a 4x100 relay as JSON."]


def structured(spec: StructuredOutput, temperature: float = 0.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=11, max_tokens=160, structured=spec, **kw)


@slow
@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_json_schema_outputs_parse_and_validate_batched_with_free_requests(smol_llm, temperature):
    free = SamplingParams(temperature=temperature, seed=5, max_tokens=24)
    cases = [(p, name) for p in PROMPTS for name in SCHEMAS]
    outs = smol_llm.generate([p for p, _ in cases] + PROMPTS,
                             [structured(StructuredOutput(json=SCHEMAS[n]), temperature) for _, n in cases]
                             + [free] * len(PROMPTS))
    for (_, name), out in zip(cases, outs):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMAS[name])
    alone = smol_llm.generate(PROMPTS, free)                     # the free rows are not masked
    assert [o.token_ids for o in outs[len(cases):]] == [o.token_ids for o in alone]


@slow
def test_json_object_regex_choice_and_grammar_outputs_match(smol_llm):
    specs = [StructuredOutput(json_object=True), StructuredOutput(regex=r"[0-9]{3}-[0-9]{4}"),
             StructuredOutput(choice=["yes", "no", "maybe"]), StructuredOutput(grammar='root ::= ("a" | "b"){3,6} "!"')]
    outs = smol_llm.generate(["Reply with a JSON object about relays."] + ["Answer:"] * 3,
                             [structured(s, 0.8) for s in specs])
    obj, phone, choice, gram = (o.text for o in outs)
    assert outs[1].finish_reason == outs[2].finish_reason == outs[3].finish_reason == "stop"
    if outs[0].finish_reason == "stop":                         # any JSON object may run past max_tokens
        assert isinstance(json.loads(obj), dict)
    else:
        assert obj.lstrip().startswith("{")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", phone), phone
    assert choice in ("yes", "no", "maybe")
    assert re.fullmatch(r"[ab]{3,6}!", gram), gram


CALLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                          "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False},
         "get_time": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                      "required": ["zone"], "additionalProperties": False}}
CALL = re.compile(r"<function=(\w+)>(.*?)</function>", re.S)


def call_tags(structures: bool = False, **options) -> dict:
    """A structural tag of CALLS' tool calls, `<function=NAME>{JSON}</function>`: xgrammar's form with `options`,
    or (structures) vLLM's older one."""
    if structures:
        return {"structures": [{"begin": f"<function={n}>", "schema": s, "end": "</function>"}
                               for n, s in CALLS.items()], "triggers": ["<function="]}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<function="], "tags": [
        {"type": "tag", "begin": f"<function={n}>", "content": {"type": "json_schema", "json_schema": s},
         "end": "</function>"} for n, s in CALLS.items()], **options}}


def test_structural_tags_hold_tool_calls_in_the_models_own_format(smol_llm):
    """vLLM's structural_tag: text, then after a trigger a tag whose JSON its schema holds. With xgrammar's
    at_least_one the greedy and the sampled answers call a tool in that format with arguments their schema
    accepts; vLLM's older form is the same language: its guide takes calls with text around them and refuses
    arguments the schema does not."""
    prompt = smol_llm.apply_chat_template([{"role": "user", "content": "What is the weather in Paris? Call a tool."}])
    spec = StructuredOutput(structural_tag=call_tags(at_least_one=True, stop_after_first=True))
    outs = smol_llm.generate([prompt] * 2, [structured(spec, 0.0), structured(spec, 0.9)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        (name, args), = CALL.findall(out.text)
        jsonschema.validate(json.loads(args), CALLS[name])
    tok = smol_llm.engine.tokenizer

    def takes(text: str) -> bool:
        g = smol_llm.engine.grammars().matcher(StructuredOutput(structural_tag=call_tags(structures=True)))
        return all(g.accept(t) for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id])

    assert takes('Checking. <function=get_weather>{"city": "Paris", "unit": "c"}</function> Then '
                 '<function=get_time>{"zone": "CET"}</function>')
    assert takes("No tool needed.")
    assert not takes('<function=get_weather>{"city": "Paris", "unit": "kelvin"}</function>')
    assert not takes('<function=get_weather>{"city": "Paris"}</function>')
    assert not takes('<function=get_news>{}</function>')


@pytest.mark.parametrize("tag, match", [
    ({"type": "structural_tag"}, "needs a format object"),
    ({"structures": [{"begin": "<f>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": []}, "triggers"),
    ({"structures": [{"begin": "<f>", "end": "</f>"}], "triggers": ["<f"]}, r"structures\[0\] needs"),
    (call_tags(structures=True) | {"structures": [{"begin": "<f>", "schema": {"type": "array", "uniqueItems": True},
                                                   "end": "</f>"}]}, "'uniqueItems'"),
    ("{nope", "not JSON"),
], ids=["no-format", "no-triggers", "no-schema", "unenforced-schema", "not-json"])
def test_malformed_structural_tags_are_refused_by_what_is_wrong(tag, match):
    with pytest.raises(InvalidRequestError, match=match):
        StructuredOutput(structural_tag=tag)


def test_a_structural_tag_xgrammar_refuses_is_refused_and_the_engine_keeps_serving(smol_llm):
    bad = {"type": "structural_tag", "format": {"type": "no_such_format"}}
    with pytest.raises(InvalidRequestError, match="invalid structural_tag.*not recognized"):
        smol_llm.generate(["x"], structured(StructuredOutput(structural_tag=bad)))
    assert not smol_llm.engine.has_unfinished_requests() and smol_llm.engine.pool.num_used_blocks == 0


@slow
def test_a_resumed_request_rebuilds_its_grammar_state_and_continues_exactly(smol_llm):
    engine: LLMEngine = smol_llm.engine
    params = structured(StructuredOutput(json=SCHEMAS["profile"]))
    whole = smol_llm.generate([PROMPTS[0]], params)[0]
    cut = len(whole.token_ids) // 2
    rid = engine.add_request(PROMPTS[0], params, "resumed", resume=Resume(whole.token_ids[:cut], 0))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                tokens = out.token_ids
    assert tokens == whole.token_ids
    with pytest.raises(InvalidRequestError, match="grammar"):   # outputs its grammar forbids are refused
        engine.add_request(PROMPTS[0], params, "bad", resume=Resume(engine.tokenize("hello")[-1:], 0))
    assert "bad" not in engine.requests


@slow
@pytest.mark.parametrize("method, temperature", [("ngram", 0.8), ("layer_skip", 0.0)],
                         ids=["ngram-seeded", "layer_skip-greedy"])
def test_speculation_keeps_constrained_output_token_for_token(smol_path, smol_llm, method, temperature):
    """Drafts the grammar refuses are cut, and each verify row is masked by the grammar state after the drafts
    before it: a seeded sampled request's output with prompt lookup equals plain constrained decoding's
    (verification takes each position's plain sample), and greedy output does with layer-skip drafts (which
    carry their distributions). Drafts were proposed and accepted."""
    cfg = ({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False} if method == "ngram" else
           {"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 3, "adaptive": False})
    spec = LLM(smol_path, kv_cache_memory=256 << 20, max_model_len=2048, speculative_config=cfg,   # as smol_llm
               grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S)
    params = [structured(StructuredOutput(json=SCHEMAS[n]), temperature) for n in SCHEMAS] + \
        [structured(StructuredOutput(regex=r"(ab|cd){4,8}"), temperature)]
    prompts = PROMPTS + ["Repeat: abababab"]
    want = smol_llm.generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for o, name in zip(got, SCHEMAS):
        jsonschema.validate(json.loads(o.text), SCHEMAS[name])
    assert re.fullmatch(r"(ab|cd){4,8}", got[-1].text)
    stats = spec.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0, stats


@slow
@pytest.mark.parametrize("spec, match", [
    (dict(json='{"type": "object"'), "invalid json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "invalid json"),
    (dict(regex="(unclosed"), "invalid regex"),
    (dict(grammar="root ::= undefined_rule"), "invalid grammar"),
    (dict(json={"type": "string", "enum": ["x" * 70000]}), "over the limit"),
], ids=["truncated-schema", "dangling-ref", "bad-regex", "bad-grammar", "too-large"])
def test_bad_specs_are_refused_and_the_engine_keeps_serving(smol_llm, spec, match):
    with pytest.raises(InvalidRequestError, match=match):
        smol_llm.generate(["x"], structured(StructuredOutput(**spec)))
    assert not smol_llm.engine.has_unfinished_requests()
    assert smol_llm.engine.pool.num_used_blocks == 0
    out = smol_llm.generate(["Answer:"], structured(StructuredOutput(choice=["yes", "no"])))[0]
    assert out.text in ("yes", "no")


def test_a_spec_slower_than_the_compile_timeout_is_refused_and_compiles_for_a_later_request(smol_llm):
    """grammar_compile_timeout_s bounds how long a request waits for its grammar (an error, not a stalled
    request); the compile goes on meanwhile, so the same spec later is served from the cache. The compiler's
    threads are held busy first, so that this compile waits past the timeout whatever the machine's speed."""
    schema = {"type": "object", "properties": {"relay_split_seconds": {"type": "number"}},
              "required": ["relay_split_seconds"]}                # in no other test: not compiled yet
    grammars = smol_llm.engine.grammars()
    compiled, timeout = grammars.num_compiled, grammars.timeout_s
    release = threading.Event()
    busy = [grammars._pool.submit(release.wait) for _ in range(grammars._pool._max_workers)]
    grammars.timeout_s = 0.2
    try:
        with pytest.raises(InvalidRequestError, match=r"the json spec did not compile within 0.2 s"):
            smol_llm.generate(["x"], structured(StructuredOutput(json=schema)))
    finally:
        grammars.timeout_s = timeout
        release.set()
    assert all(b.result(timeout=10) for b in busy)
    assert not smol_llm.engine.has_unfinished_requests() and smol_llm.engine.pool.num_used_blocks == 0
    out = smol_llm.generate(["The split as JSON:"], structured(StructuredOutput(json=schema), 0.0))[0]
    assert isinstance(json.loads(out.text)["relay_split_seconds"], (int, float))
    assert grammars.num_compiled == compiled + 1          # one compile, finished after the refusal


@pytest.mark.parametrize("kw", [{}, dict(regex="a", choice=["a"]), dict(choice=[]), dict(regex=""),
                                dict(json=3)], ids=["none", "two", "empty-choice", "empty-regex", "bad-json-type"])
def test_a_spec_must_name_exactly_one_well_formed_kind(kw):
    with pytest.raises(InvalidRequestError):
        StructuredOutput(**kw)
