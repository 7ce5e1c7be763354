"""Seeded sampling through the engine, as a user sees it: a seeded request gets the same tokens alone, in
any batch, after preemption, replayed on another engine, and with or without prompt-lookup speculation;
penalties, logit bias and min_tokens change what comes out, and only for their own request."""
from __future__ import annotations

from collections import Counter

import pytest

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_checkpoint

PROMPT = [3, 17, 5, 9]
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=40, ignore_eos=True)
OTHERS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=1.2, top_k=5, seed=1, max_tokens=50, ignore_eos=True),
          SamplingParams(temperature=0.7, min_p=0.1, max_tokens=45, ignore_eos=True),
          SamplingParams(temperature=1.0, presence_penalty=1.5, frequency_penalty=0.5, max_tokens=35, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random model with peaked logits (32 tokens): loops often enough for prompt lookup."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny"), "llama", vocab_size=32, max_position_embeddings=512,
                                initializer_range=1.0)


def _prompts(n: int) -> list[list[int]]:
    return [[(7 * i + j) % 32 for j in range(30 + 11 * i)] for i in range(n)]


def test_a_seeded_request_samples_the_same_alone_batched_preempted_and_replayed(tiny):
    roomy = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    alone = roomy.generate([PROMPT], SEEDED)[0].token_ids
    assert len(set(alone)) > 5
    batched = roomy.generate(_prompts(4) + [PROMPT], OTHERS + [SEEDED])
    assert batched[-1].token_ids == alone, "the batch changed a seeded request's tokens"
    # a KV cache too small for the batch: requests are preempted and recomputed mid-generation
    tight = LLM(tiny, num_kv_blocks=10, max_model_len=160)      # 160 tokens for ~370
    preempted = tight.generate(_prompts(4) + [PROMPT], OTHERS + [SEEDED])
    assert sum(o.metrics.num_preemptions for o in preempted) > 0, "the test meant to preempt"
    assert preempted[-1].metrics.num_preemptions > 0
    assert [o.token_ids for o in preempted] == [o.token_ids for o in batched[:4]] + [alone]
    # a second engine built the same way replays every request, the unseeded ones too (the engine's seed)
    replay = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    again = replay.generate(_prompts(4) + [PROMPT], OTHERS + [SEEDED])
    assert [o.token_ids for o in again] == [o.token_ids for o in batched]
    other = LLM(tiny, num_kv_blocks=64, max_model_len=256, seed=1)
    differ = other.generate(_prompts(4) + [PROMPT], OTHERS + [SEEDED])
    assert differ[-1].token_ids == alone and differ[1].token_ids == batched[1].token_ids      # seeded
    assert differ[2].token_ids != batched[2].token_ids                                      # unseeded


def test_prompt_lookup_speculation_emits_the_tokens_of_plain_sampling(tiny):
    """Verifying one-hot drafts takes each position's plain sample (rejection.py), so a seeded request
    gets the very tokens it gets without speculation, hence the same distribution; replays are exact."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    plain = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    params = [SamplingParams(temperature=0.8, top_k=20, seed=i, max_tokens=32, ignore_eos=True) for i in range(16)]
    want = [o.token_ids for o in plain.generate([PROMPT] * 16, params)]
    assert len({tuple(w) for w in want}) == 16
    for _ in range(2):                                        # and a second engine replays it
        llm = LLM(tiny, num_kv_blocks=64, max_model_len=256, speculative_config=spec)
        assert [o.token_ids for o in llm.generate([PROMPT] * 16, params)] == want
        assert llm.engine.stats()["spec_num_accepted_tokens"] > 10, "no draft was accepted: nothing was tested"


def test_draft_model_speculation_replays_exactly(tiny, tmp_path):
    """Drafts, acceptance and residuals all come from the request's streams: the same seeds give the same
    tokens on another engine, alone or batched."""
    draft = make_tiny_checkpoint(tmp_path, "llama", vocab_size=32, max_position_embeddings=512,
                                 initializer_range=1.0, num_hidden_layers=2)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True) for i in range(6)]
    a = LLM(tiny, num_kv_blocks=64, max_model_len=256, speculative_config=spec)
    first = [o.token_ids for o in a.generate([PROMPT] * 6, params)]
    stats = a.engine.stats()
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], "needs acceptances and rejections"
    b = LLM(tiny, num_kv_blocks=64, max_model_len=256, speculative_config=spec)
    assert [o.token_ids for o in b.generate([PROMPT] * 6, params)] == first
    assert b.generate([PROMPT], params[3])[0].token_ids == first[3]


@pytest.mark.slow                        # SmolLM2: a real model's loop
def test_frequency_penalty_breaks_a_repeating_greedy_loop(smol_llm):
    prompt = "Say it again and again: the cat, the cat, the cat, the cat,"
    loop = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert "the cat, the cat, the cat" in loop.text and max(Counter(loop.token_ids).values()) >= 6
    out = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                     frequency_penalty=2.0))[0]
    assert max(Counter(out.token_ids).values()) <= 2, out.text


def test_penalized_greedy_is_the_same_with_speculation(tiny):
    """Verify rows are penalized with the drafts before them counted, as plain decoding would."""
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.2)
    plain = LLM(tiny, num_kv_blocks=64, max_model_len=256).generate([PROMPT, [1, 2, 1, 2, 1]], params)
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    spec = llm.generate([PROMPT, [1, 2, 1, 2, 1]], params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    unpenalized = LLM(tiny, num_kv_blocks=64, max_model_len=256).generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
    assert unpenalized.token_ids != plain[0].token_ids


EOS = 2                                                   # LlamaConfig's eos_token_id, the tiny model's


def test_logit_bias_bans_and_forces_tokens_for_its_request_alone(tiny):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True)
    plain = [o.token_ids for o in llm.generate([PROMPT, PROMPT], [greedy, seeded])]
    banned = sorted(set(plain[1]))[:4] + [plain[0][0]]
    ban = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logit_bias={plain[0][0]: -100}),
           SamplingParams(temperature=1.0, seed=5, max_tokens=40, ignore_eos=True, logit_bias={t: -100 for t in banned})]
    force = SamplingParams(temperature=1.0, seed=9, max_tokens=12, ignore_eos=True, logit_bias={7: 100})
    outs = [o.token_ids for o in llm.generate([PROMPT] * 5, [greedy, seeded, *ban, force])]
    assert outs[:2] == plain, "a request with a bias changed the tokens of the others in its batch"
    assert outs[2][0] != plain[0][0] and plain[0][0] not in outs[2]
    assert not set(outs[3]) & set(banned) and len(outs[3]) == 40
    assert outs[4] == [7] * 12


def test_min_tokens_holds_off_eos_and_stop_tokens(tiny):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    eager = {EOS: 100}                                    # the model would end at once
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=1, max_tokens=20, logit_bias=eager))[0]
    assert out.token_ids == [EOS] and out.finish_reason == "stop"
    out = llm.generate([PROMPT], SamplingParams(temperature=0.8, seed=1, max_tokens=20, min_tokens=5,
                                                logit_bias=eager))[0]
    assert len(out.token_ids) == 6 and EOS not in out.token_ids[:5] and out.token_ids[5] == EOS
    assert out.finish_reason == "stop"
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, min_tokens=3, stop_token_ids=[9],
                                                logit_bias={9: 100}, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and out.token_ids[3] == 9 and 9 not in out.token_ids[:3]
    assert out.stop_reason == 9
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6, min_tokens=6, logit_bias=eager))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length" and EOS not in out.token_ids


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_logit_bias_and_min_tokens_hold_with_speculation(tiny, tmp_path, method):
    """Verify rows and draft rows take the bias, and min_tokens counts the drafts before them. Prompt lookup
    gives the very tokens of plain decoding; a draft model the same greedy tokens, and seeded ones from the
    same distribution that a second engine replays exactly."""
    params = [SamplingParams(temperature=0, max_tokens=24, min_tokens=10, logit_bias={EOS: 8.0, 4: -3.0}),
              SamplingParams(temperature=0.9, seed=3, max_tokens=24, min_tokens=12, logit_bias={EOS: 10.0, 11: 2.5}),
              SamplingParams(temperature=0.8, top_k=20, seed=4, max_tokens=24, logit_bias={15: -100, 26: 1.5})]
    prompts = [PROMPT, [1, 2, 1, 2, 1], PROMPT]
    want = [o.token_ids for o in LLM(tiny, num_kv_blocks=64, max_model_len=256).generate(prompts, params)]
    assert 10 < len(want[0]) < 24 and want[0][-1] == EOS, "the bias on EOS should end it soon after min_tokens"
    assert 12 < len(want[1]) < 24 and want[1][-1] == EOS
    assert 15 not in want[2]
    if method == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    else:
        draft = make_tiny_checkpoint(tmp_path, "llama", vocab_size=32, max_position_embeddings=512,
                                     initializer_range=1.0, num_hidden_layers=2)
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256, speculative_config=spec)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats()["spec_num_accepted_tokens"] > 0, "no draft was accepted: nothing was tested"
    if method == "ngram":
        assert got == want
        return
    assert got[0] == want[0]
    assert EOS not in got[1][:12] and (len(got[1]) == 24 or got[1][-1] == EOS) and 15 not in got[2]
    again = LLM(tiny, num_kv_blocks=64, max_model_len=256, speculative_config=spec)
    assert [o.token_ids for o in again.generate(prompts, params)] == got


def test_a_logit_bias_past_the_vocabulary_is_refused(tiny):
    from engine.errors import InvalidRequestError
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids must be in \[0, 32\)"):
        llm.generate([PROMPT], SamplingParams(max_tokens=4, logit_bias={32: 1.0}))
    assert llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].token_ids
