"""Beam search (engine/beam_search.py), vLLM's algorithm: the search itself on a toy model whose answer is known,
the engine's rounds against transformers on a tiny random model, and on SmolLM2 a width of 1 is greedy decoding
while a wider beam finds likelier text."""
from __future__ import annotations

import math

import pytest
import torch

from bench.models import make_tiny_checkpoint
from engine import LLM, BeamSearchParams, InvalidRequestError, SamplingParams
from engine.beam_search import BeamSearch

EOS = 0


def toy(prefix: tuple[int, ...]) -> dict[int, float]:
    """A toy model over tokens 0 (EOS), 1, 2, 3: after the prompt [9], 1 is likelier than 2, but after 1 every
    token is unlikely and after 2 one token (3) is almost sure; after 3, EOS is likely (and after EOS, which only
    ignore_eos reaches, EOS or 3)."""
    last = prefix[-1]
    table = {9: {1: 0.6, 2: 0.4}, 1: {1: 0.25, 2: 0.25, 3: 0.25, EOS: 0.25}, 2: {3: 0.95, EOS: 0.05},
             3: {EOS: 0.9, 3: 0.1}, EOS: {EOS: 0.5, 3: 0.5}}
    return {t: math.log(p) for t, p in table[last].items()}


def run(params: BeamSearchParams, prompt=(9,)):
    search = BeamSearch(list(prompt), params, {EOS}, max_model_len=64)
    while not search.done:
        search.advance([toy(tuple(p)) for p in search.prompts()])
    return search.results().sequences


def test_the_search_keeps_the_likeliest_beams_not_the_greedy_path():
    greedy = run(BeamSearchParams(beam_width=1, max_tokens=2))
    assert greedy[0].tokens == [9, 1, 1]                        # greedy: 1, then a four-way tie (first kept)
    best = run(BeamSearchParams(beam_width=2, max_tokens=2))
    assert best[0].tokens == [9, 2, 3] and best[0].finish_reason == "length"
    assert best[0].cum_logprob == pytest.approx(math.log(0.4 * 0.95))
    assert len(best) == 2 and best[0].cum_logprob > best[1].cum_logprob


def test_eos_ends_a_beam_which_the_length_penalty_ranks_against_the_live_ones():
    # 9 2 3 EOS finishes in three tokens (p = 0.342); the live beams go on, less likely with every token
    out = run(BeamSearchParams(beam_width=2, max_tokens=6))
    assert out[0].tokens == [9, 2, 3, EOS] and out[0].finish_reason == "stop"
    assert out[0].cum_logprob == pytest.approx(math.log(0.4 * 0.95 * 0.9))
    # ignore_eos: EOS is a token like the others and every beam runs max_tokens
    out = run(BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert all(len(b.tokens) == 7 and b.finish_reason == "length" for b in out)


@pytest.mark.parametrize("kw, match", [(dict(beam_width=0, max_tokens=4), "beam_width"),
                                       (dict(beam_width=11, max_tokens=4), "at most 10"),
                                       (dict(beam_width=2, max_tokens=0), "max_tokens")])
def test_bad_beam_search_params_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        BeamSearchParams(**kw).validate()


def test_the_engines_rounds_give_transformers_beams(tmp_path):
    """A tiny random Llama in fp32: the engine's beams (each round one batch, beams sharing cached prefixes) are
    the ones the same search gives on transformers' own log-probabilities."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    from engine.loader import resolve_model
    llm = LLM(path, tokenizer=resolve_model(None), num_kv_blocks=96, max_model_len=256)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    prompts = [list(range(10, 30)), [5, 6, 7] * 7]
    ours = llm.beam_search(prompts, params)
    for prompt, got in zip(prompts, ours):
        search = BeamSearch(prompt, params, set(), max_model_len=256)
        while not search.done:
            with torch.no_grad():
                logits = hf(torch.tensor(search.prompts())).logits[:, -1].float()
            top = logits.log_softmax(-1).topk(2 * params.beam_width)
            search.advance([dict(zip(i.tolist(), v.tolist())) for v, i in zip(top.values, top.indices)])
        want = search.results().sequences
        assert [b.tokens for b in got.sequences] == [b.tokens for b in want]
        assert [b.cum_logprob for b in got.sequences] == pytest.approx([b.cum_logprob for b in want], abs=1e-4)


@pytest.mark.slow
def test_on_smollm2_a_width_of_one_is_greedy_and_a_wider_beam_finds_likelier_text(smol_llm):
    ids = smol_llm.apply_chat_template([{"role": "user", "content": "Name a colour."}])
    greedy = smol_llm.generate([ids], SamplingParams(temperature=0, max_tokens=16, logprobs=0))[0]
    (one,) = smol_llm.beam_search(ids, BeamSearchParams(beam_width=1, max_tokens=16))[0].sequences
    assert one.tokens[len(ids):] == greedy.token_ids and one.text == greedy.text
    assert one.cum_logprob == pytest.approx(sum(lp[t] for lp, t in zip(greedy.logprobs, greedy.token_ids)))
    wide = smol_llm.beam_search(ids, BeamSearchParams(beam_width=3, max_tokens=16))[0].sequences
    assert len(wide) == 3 and wide[0].cum_logprob > one.cum_logprob + 1.0
    assert smol_llm.engine.pool.num_used_blocks == 0 and not smol_llm.engine.has_unfinished_requests()
