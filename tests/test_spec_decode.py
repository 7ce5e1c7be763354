"""Speculative decoding through the engine: what a user notices.

Greedy output is the same with and without speculation (every method, a draft that mostly
disagrees, mixed batches with prefill chunks); an identical draft is always accepted; sampled output
has the target's distribution; stops hold inside multi-token steps; nothing leaks; adaptive depth
backs off when drafts do not pay.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from engine import LLM, ConfigError, SamplingParams
from engine.block_pool import blocks_for
from engine.sampler import target_probs
from engine.spec.adaptive import DepthController, LinearCost
from tests.conftest import make_tiny_checkpoint

CODE = '''def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)


def main():
    for i in range(10):
        print(i, fib(i))
'''
PROMPTS = ["Repeat this code exactly:\n" + CODE + "\nHere it is again:\n" + CODE[:40],
           "The capital of France is",
           "List the days of the week: Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
           "Again: Monday, Tuesday,",
           "Tell me a story about a dragon who learned to read."]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def assert_no_leak(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} target KV blocks leaked"
    drafter = llm.engine.spec.drafter if llm.engine.spec else None
    if getattr(drafter, "pool", None) is not None:
        assert drafter.pool.num_free_blocks == drafter.pool.num_blocks, "draft KV blocks leaked"
        assert not drafter.state, "draft state outlived its requests"


def smol(path, spec=None, **kw):
    kw = {"kv_cache_memory": 128 << 20, "max_model_len": 1024, **kw}
    return LLM(path, speculative_config=spec, **kw)


# seconds of a SmolLM2 step over T tokens, fp32, as the start-up profile measured them on the 2-core machine
# the project develops on, with nothing else running (2026-11-26)
QUIET_STEP_COST = [(1, 0.0164), (2, 0.0164), (4, 0.0164), (8, 0.0186), (16, 0.0213), (24, 0.0255), (32, 0.0301),
                   (40, 0.0358), (48, 0.0438)]


@pytest.fixture(scope="module")
def smol_baseline(smol_path):
    llm = smol(smol_path)
    return llm, llm.generate(PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def smol_vocab_draft(tmp_path_factory):
    """A tiny random model with SmolLM2's vocabulary: a draft that almost always disagrees."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("draft"), "llama", vocab_size=49152,
                                max_position_embeddings=2048, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2)


# -- greedy: identical to no speculation ------------------------------------------------------------

@pytest.mark.parametrize("name,spec", [
    ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}),
    # the depth rule on this machine's cost table measured when quiet, not a start-up profile of a machine busy with
    # other tests (`make test` runs the Ray tests beside these), which chooses other depths
    ("ngram-adaptive", {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3,
                        "step_costs": QUIET_STEP_COST}),
    pytest.param("layer_skip", {"method": "layer_skip", "num_layers": 10, "num_speculative_tokens": 3,
                                "adaptive": False}, marks=pytest.mark.slow),    # slow: a budget for `make test-fast`
    ("random-draft", None),
])
def test_greedy_output_is_identical_with_speculation(smol_path, smol_baseline, smol_vocab_draft, name, spec):
    if spec is None:
        spec = {"method": "draft_model", "model": smol_vocab_draft, "num_speculative_tokens": 3, "adaptive": False}
    _, ref = smol_baseline
    # a small token budget: verify steps share batches with prefill chunks and get cut to fit
    llm = smol(smol_path, spec, max_num_batched_tokens=48)
    out = llm.generate(PROMPTS, GREEDY)
    for r, o in zip(ref, out):
        assert o.token_ids == r.token_ids, f"{name}: greedy output changed under speculation"
        assert o.text == r.text
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0, "nothing was speculated"
    if name == "random-draft":
        assert stats["spec_acceptance_rate"] < 0.2            # the draft mostly disagrees
    if name.startswith("ngram"):
        assert out[0].metrics.spec_num_accepted_tokens >= 10  # the repeated code block is drafted
    assert sum(o.metrics.spec_num_draft_tokens for o in out) == stats["spec_num_draft_tokens"]
    assert_no_leak(llm)


@pytest.mark.slow                        # a second SmolLM2 as the draft: seven seconds of `make test-fast`
def test_identical_draft_is_accepted_every_time(smol_path, smol_baseline):
    _, ref = smol_baseline
    llm = smol(smol_path, {"method": "draft_model", "model": smol_path, "num_speculative_tokens": 4,
                           "adaptive": False})
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    sampled = llm.generate(PROMPTS, [SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=i, max_tokens=24,
                                                    ignore_eos=True) for i in range(len(PROMPTS))])
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 100
    assert stats["spec_acceptance_rate"] == 1.0
    assert stats["spec_mean_accepted_length"] > 3.0           # of 4: only the max_tokens edge is shorter
    assert all(o.metrics.spec_acceptance_rate == 1.0 for o in out + sampled)
    assert_no_leak(llm)


# -- sampled: the target's distribution --------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A tiny target with a 32-token vocabulary, and a draft that is the target with noisy weights:
    it agrees often but not always, so verification both accepts and rejects."""
    from transformers import AutoModelForCausalLM
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), "llama", vocab_size=32,
                                  max_position_embeddings=256, initializer_range=0.5)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * NOISE * p.std())
    draft = tmp_path_factory.mktemp("draft")
    model.save_pretrained(draft)
    return target, str(draft)


NOISE = 0.03


def _exact_joint(target_path: str, prompt: list[int], params: SamplingParams, n: int) -> dict[tuple, float]:
    """P(first n tokens) under the target with the request's filters, from transformers' logits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        ctxs = list(joint)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(c) for c in ctxs])).logits[:, -1]
        probs = target_probs(logits, [params] * len(ctxs))
        for c, p in zip(ctxs, probs):
            for t in torch.nonzero(p).flatten().tolist():
                nxt[c + (t,)] = joint[c] * float(p[t])
        joint = nxt
    return joint


def _tv(counts: dict, n: int, exact: dict) -> float:
    keys = set(counts) | set(exact)
    return 0.5 * sum(abs(counts.get(k, 0) / n - exact.get(k, 0.0)) for k in keys)


@pytest.mark.slow
@pytest.mark.parametrize("filters", [dict(temperature=0.9, top_k=4), dict(temperature=1.0, top_p=0.9, min_p=0.05)])
def test_sampled_output_has_the_target_distribution(tiny_pair, filters):
    """Three tokens per request, thousands of seeds; a one-token draft is verified after the first.
    The empirical joint converges to the target's exact joint (total variation shrinks with samples)
    and is far from the draft's own distribution, which would show if drafts leaked through."""
    target, draft = tiny_pair
    prompt = [3, 17, 5, 9]
    params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=i, **filters) for i in range(4000)]
    llm = LLM(target, max_num_seqs=512, max_num_batched_tokens=4096, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 2, "adaptive": False})
    outs = llm.generate([prompt] * len(params), params)
    samples = [tuple(o.token_ids) for o in outs]
    stats = llm.engine.stats()
    assert 0.2 < stats["spec_acceptance_rate"] < 0.9, "the test needs both acceptances and rejections"
    exact = _exact_joint(target, prompt, params[0], 3)
    wrong = _exact_joint(draft, prompt, params[0], 3)
    tvs = [_tv_all(samples[:n], exact) for n in (250, 1000, 4000)]
    # what exact sampling gives at this sample size: the engine's distance must be no worse
    keys, p = list(exact), torch.tensor(list(exact.values()))
    g = torch.Generator().manual_seed(0)
    ideal = [_tv_all([keys[i] for i in torch.multinomial(p, 4000, True, generator=g).tolist()], exact)
             for _ in range(20)]
    print("TV", tvs, "ideal", max(ideal), "acceptance", stats["spec_acceptance_rate"], "vs draft", _tv_all(samples, wrong))
    assert tvs[0] > tvs[2] and tvs[1] > tvs[2], f"distance does not shrink with samples: {tvs}"
    assert tvs[2] < 1.25 * max(ideal), f"emitted distribution is off the target's: TV {tvs[2]:.3f}, exact sampling {max(ideal):.3f}"
    assert _tv_all(samples, wrong) > 3 * tvs[2]
    assert_no_leak(llm)


# -- stops inside multi-token steps -------------------------------------------------------------------

def test_stops_hold_when_several_tokens_arrive_in_one_step(smol_path, smol_baseline):
    base, ref = smol_baseline
    full = ref[0]                                              # the repeated code block: long accepted runs
    llm = smol(smol_path, {"method": "ngram", "num_speculative_tokens": 6, "adaptive": False})
    # max_tokens: exact count even when a step could emit past it
    for n in (3, 7, 13):
        out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        assert out.token_ids == full.token_ids[:n] and out.finish_reason == "length"
    # a stop token in the middle of an accepted run ends the output at it
    stop_tok = full.token_ids[11]
    cut = full.token_ids.index(stop_tok) + 1
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == full.token_ids[:cut] and out.stop_reason == stop_tok
    # a stop string: the text ends before it, as without speculation
    stop_str = full.text[25:33]
    sp = SamplingParams(temperature=0, max_tokens=40, stop=[stop_str], ignore_eos=True)
    want = base.generate([PROMPTS[0]], sp)[0]
    got = llm.generate([PROMPTS[0]], sp)[0]
    assert got.text == want.text == full.text[:full.text.index(stop_str)] and got.finish_reason == "stop"
    assert got.token_ids == want.token_ids
    # streaming: one output per step carries every token that step emitted
    engine = llm.engine
    rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1))
    deltas, texts, sizes = [], [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id == rid
            deltas += o.new_token_ids
            texts.append(o.new_text)
            sizes.append(len(o.new_token_ids))
    assert deltas == o.token_ids == full.token_ids and "".join(texts) == o.text
    assert max(sizes) > 1, "no step emitted several tokens"
    assert len(o.logprobs) == 40 and all(t in lp for t, lp in zip(o.token_ids, o.logprobs))
    assert engine.stats()["spec_num_accepted_tokens"] > 0
    assert_no_leak(llm)


# -- no leaks ------------------------------------------------------------------------------------------

def test_no_block_leaks_after_rejections_aborts_and_preemption(tiny_pair):
    target, draft = tiny_pair
    llm = LLM(target, num_kv_blocks=24, max_num_seqs=16, max_num_batched_tokens=64, speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False,
        "draft_kv_blocks": 20})
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    rids = []
    for i in range(24):
        prompt = torch.randint(0, 32, (int(torch.randint(5, 40, (1,), generator=gen)),), generator=gen).tolist()
        sp = SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=30, ignore_eos=True, seed=i)
        rids.append(engine.add_request(prompt, sp))
    steps, preempted = 0, 0
    while engine.has_unfinished_requests():
        preempted += sum(o.metrics.num_preemptions for o in engine.step() if o.finished)
        steps += 1
        for seq in engine.scheduler.running:              # rollback: nothing held past the next token
            assert len(seq.block_table) <= blocks_for(seq.num_tokens, 16)
            st = engine.spec.drafter.state.get(seq.request_id)
            if st is not None:
                assert st.fed == seq.token_ids[:len(st.fed)] and len(st.blocks) <= blocks_for(len(st.fed) + 1, 16)
        if steps % 5 == 0:                                     # abort one mid-flight now and then
            live = [r for r in rids if r in engine.requests]
            if live:
                engine.abort_request(live[len(live) // 2])
    stats = engine.stats()
    assert stats["spec_num_draft_tokens"] > 50 and stats["spec_acceptance_rate"] < 0.9
    assert preempted > 0, "the test meant to preempt"
    assert_no_leak(llm)
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.token_ids) == 8                              # and it keeps serving
    assert_no_leak(llm)


# -- adaptive depth ------------------------------------------------------------------------------------

def test_depth_rule():
    batch1 = DepthController(6, True, LinearCost(0.030, 0.006), LinearCost(0.0, 0.0))
    assert batch1.choose([0.9], [6], 1) == [6]                 # cheap verify tokens, good drafts: go deep
    assert batch1.choose([0.8], [6], 1)[0] >= 3
    assert batch1.choose([0.05], [6], 1) == [0]                # drafts that fail do not pay
    assert batch1.choose([0.9], [2], 1) == [2]                 # never beyond what is available
    # batch 32 on a machine where a verify token costs nearly a decode step's share: k = 0
    big = DepthController(6, True, LinearCost(0.030, 0.006), LinearCost(0.0, 0.0))
    assert big.choose([0.4] * 32, [6] * 32, 32) == [0] * 32
    # an expensive draft pass (a draft model) needs better acceptance than a free one
    costly = DepthController(6, True, LinearCost(0.030, 0.001), LinearCost(0.020, 0.001))
    assert costly.choose([0.5], [6], 1) == [0] and costly.choose([0.95], [6], 1)[0] > 0
    fixed = DepthController(4, False, LinearCost(0.03, 0.006), LinearCost(0.0, 0.0))
    assert fixed.choose([0.0, 0.9], [4, 2], 1) == [4, 2]


def test_cost_line_is_refitted_from_observations():
    c = LinearCost(0.010, 0.010)
    for x in itertools.islice(itertools.cycle([1, 4, 9, 16]), 400):
        c.observe(x, 0.030 + 0.002 * x)
    assert c.a == pytest.approx(0.030, rel=0.05) and c.b == pytest.approx(0.002, rel=0.05)


@pytest.mark.slow                        # two draft-model engines over every prompt
def test_adaptive_depth_backs_off_a_draft_that_disagrees(smol_path, smol_baseline, smol_vocab_draft):
    _, ref = smol_baseline
    spec = {"method": "draft_model", "model": smol_vocab_draft, "num_speculative_tokens": 4}
    fixed = smol(smol_path, {**spec, "adaptive": False})
    adaptive = smol(smol_path, spec)
    for llm in (fixed, adaptive):
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [r.token_ids for r in ref]
    f, a = fixed.engine.stats(), adaptive.engine.stats()
    assert a["spec_num_draft_tokens"] < 0.25 * f["spec_num_draft_tokens"]
    assert a["spec_depth_histogram"].get(0, 0) > sum(v for k, v in a["spec_depth_histogram"].items() if k > 0)
    assert_no_leak(adaptive)


# -- configuration errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,words", [
    ({"method": "medusa"}, "method must be one of"),
    ({"method": "draft_model"}, 'needs "model"'),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"method": "layer_skip"}, 'needs "num_layers"'),
    ({"method": "ngram", "lookahead": 3}, "unknown speculative_config key"),
    ({"method": "ngram", "step_costs": [[4, 0.02], [2, 0.01]]}, "step_costs"),
    ({"method": "ngram", "step_costs": [[1, 0.0]]}, "step_costs"),
    ({"method": "ngram", "step_costs": [[1.5, 0.01]]}, "step_costs"),
    ({"method": "ngram", "step_costs": "fast"}, "step_costs"),
    ("ngram", "must be a dict"),
])
def test_bad_speculative_config_is_a_clear_error(spec, words):
    from engine.config import EngineConfig
    with pytest.raises(ConfigError, match=words):
        EngineConfig.from_kwargs(None, speculative_config=spec)


def test_draft_model_must_fit_the_target(smol_path, tiny_pair):
    _, draft = tiny_pair
    with pytest.raises(ConfigError, match="vocabulary"):
        smol(smol_path, {"method": "draft_model", "model": draft})
    with pytest.raises(ConfigError, match="num_layers must be below"):
        smol(smol_path, {"method": "layer_skip", "num_layers": 30})


def _tv_all(samples, exact):
    counts: dict[tuple, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return _tv(counts, len(samples), exact)


@pytest.mark.slow                        # a fresh engine with a draft model, from the command line
def test_cli_generate_takes_a_speculative_config(capsys):
    from cli.main import main
    assert main(["generate", "--temperature", "0", "--max-tokens", "24", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 4}', "Repeat after me: one two three, one two three"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "24 tokens" in out.err
    assert main(["generate", "--speculative-config", "{method: ngram", "hi"]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "--speculative-config", '{"method": "medusa"}', "hi"]) == 2
    assert "method must be one of" in capsys.readouterr().err
