"""Structured output after a reasoning model's thinking (`after_thinking`, engine/structured.py): the grammar waits for
the </think> token and shapes only the answer, as vLLM runs structured outputs under a reasoning parser.

The model is SmolLM2 with a reasoning tokenizer (tests/conftest.py's thinking_model: two unused special tokens renamed
<think> and </think>). SmolLM2 never closes a thinking by itself; a logit_bias on </think> makes it close it after
its first sentence (conftest's THINK_CLOSE_BIAS)."""
from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from engine import LLM, InvalidRequestError, LLMEngine, Resume, SamplingParams
from engine.structured import StructuredOutput
from tests.conftest import (GRAMMAR_COMPILE_TIMEOUT_S, THINK_ASK as MESSAGES, THINK_CLOSE_BIAS, THINK_END as END,
                            THINK_SCHEMA as SCHEMA)


@pytest.fixture(scope="module")
def model(thinking_model_dir):
    return thinking_model_dir


@pytest.fixture(scope="module")
def llm(model):
    return LLM(model, kv_cache_memory=128 << 20, max_model_len=1024, grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S)


def params(after_thinking: bool = True, bias: float | None = THINK_CLOSE_BIAS, structured: bool = True, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=60, logit_bias={END: bias} if bias else None,
                          structured=StructuredOutput(json=SCHEMA, after_thinking=after_thinking) if structured
                          else None, **kw)


def answer(text: str) -> dict:
    thinking, tag, rest = text.partition("</think>")
    assert tag, f"the thinking never closed: {text!r}"
    out = json.loads(rest)
    jsonschema.validate(out, SCHEMA)
    return out


def test_the_grammar_shapes_the_answer_and_leaves_the_thinking_free(llm):
    """The thinking is the same text as without a grammar (token for token, up to and with </think>), and the answer
    after it follows the schema. The same grammar without after_thinking forbids the thinking from the first
    token: its output is the JSON alone. (One batch: the three requests run side by side.)"""
    prompt = llm.apply_chat_template(MESSAGES)
    free, gated, whole = llm.generate([prompt] * 3, [params(structured=False), params(), params(after_thinking=False)])
    cut = free.token_ids.index(END) + 1
    assert cut > 5 and gated.token_ids[:cut] == free.token_ids[:cut]     # a sentence of thinking, untouched
    assert gated.text.startswith(free.text[:free.text.index("</think>")])
    answer(gated.text)
    assert gated.finish_reason == "stop"
    assert END not in whole.token_ids
    jsonschema.validate(json.loads(whole.text), SCHEMA)


def test_a_prompt_that_closed_its_thinking_gets_the_grammar_from_the_first_token(llm):
    """Qwen3's template with thinking off ends the prompt with an empty <think></think>: the grammar applies from
    the first token. A prompt that opens a thinking (DeepSeek-R1's template ends with <think>) leaves it free
    until </think>; so does one with no tags at all."""
    base = llm.apply_chat_template(MESSAGES)

    def enc(text: str) -> list[int]:
        return llm.tokenizer.encode(text, add_special_tokens=False)
    opened = [base + enc("<think>\n"), base + enc("<think>\n\n</think>\n\n<think>\n"), base]
    closed, *got = llm.generate([base + enc("<think>\n\n</think>\n\n")] + opened, [params(bias=None)] + [params()] * 3)
    assert "</think>" not in closed.text
    jsonschema.validate(json.loads(closed.text), SCHEMA)
    free = llm.generate(opened, params(structured=False))
    for prompt, g, f in zip(opened, got, free):
        cut = f.token_ids.index(END) + 1
        assert g.token_ids[:cut] == f.token_ids[:cut], prompt[-8:]
        answer(g.text)


def test_the_gate_rolls_back_with_the_drafts_across_its_tag(llm):
    """What speculative decoding does to a guide (accept drafts, roll them back) moves the gate with it: drafts
    that run through </think> into the answer are checked against the grammar after the tag, and rolling them
    back closes the gate again (every token allowed), with the grammar where it was."""
    grammars = llm.engine.grammars()
    guide = grammars.matcher(StructuredOutput(json=SCHEMA, after_thinking=True), [1, 2])
    tok = llm.tokenizer
    vocab = llm.engine.hf_config.vocab_size

    def allowed() -> int:
        import xgrammar as xgr
        mask = xgr.allocate_token_bitmask(1, vocab)
        guide.fill(mask, 0)
        bits = (mask[0].view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        return int(bits.flatten()[:vocab].sum())
    thought = tok.encode("The anchor leg.", add_special_tokens=False)
    opening = tok.encode('{"', add_special_tokens=False)
    assert allowed() == vocab and not guide.terminated
    assert guide.valid_prefix(thought + [END] + opening) == len(thought) + 1 + len(opening)
    assert allowed() == vocab                                      # left as it was: still thinking
    assert guide.valid_prefix(thought + [END] + tok.encode("hello", add_special_tokens=False)) == len(thought) + 1
    for t in thought + [END]:
        assert guide.accept(t)
    assert 0 < allowed() < 100                                    # the answer: the schema's opening only
    assert not guide.accept(tok.encode("hello", add_special_tokens=False)[0])
    guide.rollback(1)                                             # the </think> undone: thinking again
    assert allowed() == vocab
    assert guide.accept(END) and all(guide.accept(t) for t in opening)
    guide.rollback(len(opening))
    assert 0 < allowed() < 100 and guide.accept(opening[0])


def test_a_resumed_request_replays_its_thinking_and_answer(llm):
    """A request moved to another replica (resume=, as migration resends it) mid-thinking or mid-answer rebuilds
    the gate from the tokens the client has and continues exactly; a resumed answer its grammar forbids is
    refused."""
    engine: LLMEngine = llm.engine
    prompt = llm.apply_chat_template(MESSAGES)
    whole = llm.generate([prompt], params())[0]
    end = whole.token_ids.index(END)
    cuts = (end // 2, end + 1, end + 4)
    for cut in cuts:                                       # side by side, as a replica would run them
        engine.add_request(prompt, params(), f"resumed-{cut}", resume=Resume(whole.token_ids[:cut], 0))
    tokens = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.token_ids
    assert tokens == {f"resumed-{cut}": whole.token_ids for cut in cuts}
    bad = whole.token_ids[:end + 1] + llm.tokenizer.encode("hello", add_special_tokens=False)[:1]
    with pytest.raises(InvalidRequestError, match="grammar"):
        engine.add_request(prompt, params(), "bad", resume=Resume(bad, 0))
    thinking = whole.token_ids[:end] + llm.tokenizer.encode(" hello", add_special_tokens=False)[:1]
    engine.abort_request(engine.add_request(prompt, params(), "free", resume=Resume(thinking, 0)))
    assert not engine.has_unfinished_requests() and engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.slow
def test_speculation_across_the_tag_keeps_the_text_token_for_token(model, llm):
    """Layer-skip drafts run through the thinking, the </think> and the answer: the output equals plain decoding's,
    and drafts were accepted."""
    spec = LLM(model, kv_cache_memory=128 << 20, max_model_len=1024, grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S,
               speculative_config={"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 3,
                                   "adaptive": False})
    want = llm.chat(MESSAGES, params())
    got = spec.chat(MESSAGES, params())
    assert got.token_ids == want.token_ids
    answer(got.text)
    stats = spec.engine.stats()
    assert stats["spec_num_accepted_tokens"] > 0, stats


def test_a_tokenizer_without_the_tags_as_tokens_is_refused_by_name(smol_llm):
    """SmolLM2's own tokenizer splits </think> into pieces, as vLLM's parsers refuse: a clear error, no request."""
    with pytest.raises(InvalidRequestError, match="</think>.*single tokens"):
        smol_llm.chat(MESSAGES, params(bias=None))
    assert not smol_llm.engine.has_unfinished_requests()


class _Matcher:
    """A grammar that takes anything and counts what reached it (Guide's gate is what is tested)."""

    def __init__(self):
        self.seen = []

    def accept_token(self, t):
        self.seen.append(t)
        return True

    def rollback(self, n):
        del self.seen[len(self.seen) - n:]

    def is_terminated(self):
        return False


def test_harmonys_gate_opens_after_its_whole_final_channel_sequence_and_rolls_back():
    """gpt-oss's gate is a sequence (<|channel|>, final, <|message|>): the grammar sees nothing of the analysis
    channel, nor of another channel's <|message|>, and everything after the sequence; a rollback through it closes
    the gate again (speculative decoding's drafts)."""
    from engine.structured import Guide
    gate = (200005, 17196, 200008)
    m = _Matcher()
    g = Guide(m, gate, opened=False)
    for t in (200005, 35644, 200008, 11, 12, 200007, 200006, 200005, 17196, 200008, 5, 6):
        assert g.accept(t)
    assert m.seen == [5, 6]
    g.rollback(3)                                       # back past <|message|>: closed again
    assert m.seen == [] and g.accept(200008) and g.accept(7) and m.seen == [7]
    assert Guide(_Matcher(), gate, opened=True).accept(1)


def test_structured_output_under_harmony_starts_in_the_final_channel(smol_path, tmp_path):
    """A tokenizer with harmony's markers as single tokens (SmolLM2's, two unused special tokens renamed): a prompt
    that opens the final channel gets the grammar from its first token; one that does not leaves the output free
    (SmolLM2 never writes the sequence by itself), where the same grammar without after_thinking holds."""
    from tests.conftest import renamed_tokens_model
    path = renamed_tokens_model(tmp_path / "harmony", smol_path, {13: "<|channel|>", 14: "<|message|>"})
    llm = LLM(path, kv_cache_memory=64 << 20, max_model_len=512, grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S)
    assert llm.engine.grammars().harmony == (13, *llm.tokenizer.encode("final", add_special_tokens=False), 14)
    prompt = llm.apply_chat_template(MESSAGES)
    final = prompt + llm.tokenizer.encode("<|channel|>final<|message|>", add_special_tokens=False)
    opened, free, whole = llm.generate([final, prompt, prompt], [params(bias=None), params(bias=None),
                                                                 params(bias=None, after_thinking=False)])
    jsonschema.validate(json.loads(opened.text), SCHEMA)
    jsonschema.validate(json.loads(whole.text), SCHEMA)
    with pytest.raises((ValueError, jsonschema.ValidationError)):      # not JSON, or not the schema's
        jsonschema.validate(json.loads(free.text), SCHEMA)
