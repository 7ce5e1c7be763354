"""Sampling as a user sees it: greedy, seeds, top-k / top-p / min-p distributions, logprobs, validation."""
from __future__ import annotations

import math

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sampler import Sampler, target_probs
from engine.sampling_params import SamplingParams

N = 20_000
# a fixed 6-token distribution, deliberately not in sorted order
PROBS = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))          # token 5 is (nearly) impossible
LOGITS[5] = -1e9


def empirical(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N, seed: int = 0) -> torch.Tensor:
    """Token frequencies of n independent draws (one batch of n identical rows, unseeded)."""
    sampler = Sampler(seed=seed)
    res = sampler(logits.expand(n, -1).clone(), [params] * n, [None] * n)
    counts = torch.bincount(torch.tensor(res.token_ids), minlength=logits.shape[-1]).float()
    return counts / n


def renormalized(keep: list[int], probs: torch.Tensor = PROBS) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def assert_close_dist(freq: torch.Tensor, target: torch.Tensor, tol: float = 0.02) -> None:
    allowed = target > 0
    assert freq[~allowed].sum().item() == 0, f"filtered tokens were sampled: {freq.tolist()}"
    diff = (freq - target).abs().max().item()
    assert diff < tol, f"empirical {freq.tolist()} vs target {target.tolist()} (max diff {diff:.4f})"


# ---------------------------------------------------------------------------------------------
# greedy and seeds

def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    params = [SamplingParams(temperature=0.0)] * 8
    res = Sampler(seed=123)(logits, params, [None] * 8)
    assert res.token_ids == logits.argmax(-1).tolist()
    # greedy ignores filters and seeds
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.5, seed=7)] * 8
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    assert Sampler(seed=9)(logits, params, gens).token_ids == logits.argmax(-1).tolist()


def test_greedy_accepts_low_precision_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 50).to(torch.bfloat16)
    res = Sampler()(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert res.token_ids == logits.float().argmax(-1).tolist()


def _seeded_run(seeds: list[int], logits_row: torch.Tensor, steps: int = 12, extra_rows: int = 0) -> list[list[int]]:
    """Sample `steps` tokens for rows that share logits, each with its own seeded generator."""
    gens = [torch.Generator().manual_seed(s) for s in seeds] + [None] * extra_rows
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds] + [SamplingParams()] * extra_rows
    sampler = Sampler(seed=0)
    rows = len(gens)
    out = [[] for _ in seeds]
    for _ in range(steps):
        res = sampler(logits_row.expand(rows, -1).clone(), params, gens)
        for i in range(len(seeds)):
            out[i].append(res.token_ids[i])
    return out


def test_same_seed_same_tokens_different_seeds_differ():
    logits = torch.zeros(1000)                          # uniform: every seed picks its own path
    a = _seeded_run([1, 2, 3, 1], logits)
    assert a[0] == a[3], "two requests with the same seed in one batch must get the same tokens"
    assert a[0] != a[1] and a[0] != a[2] and a[1] != a[2], "different seeds gave the same tokens"
    b = _seeded_run([1, 2, 3, 1], logits)
    assert a == b, "same seeds must reproduce across runs"


def test_seeded_tokens_do_not_depend_on_the_batch():
    logits = torch.zeros(1000)
    alone = _seeded_run([42], logits)
    batched = _seeded_run([5, 42, 6], logits, extra_rows=4)
    assert batched[1] == alone[0], "a seeded request's tokens changed with what else was in the batch"


def test_unseeded_sampler_seed_reproduces():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    a = Sampler(seed=3)(logits, params, [None] * 4).token_ids
    b = Sampler(seed=3)(logits, params, [None] * 4).token_ids
    c = Sampler(seed=4)(logits, params, [None] * 4).token_ids
    assert a == b and a != c


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 500)
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(16)]
    gens = [torch.Generator().manual_seed(i) for i in range(16)]
    for _ in range(5):
        assert Sampler()(logits, params, gens).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0)]
    res = Sampler()(logits, params, [None] * 3)
    assert res.token_ids == logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# filters: sampled frequencies match the renormalized distribution

def test_plain_sampling_matches_softmax():
    assert_close_dist(empirical(SamplingParams()), renormalized([0, 1, 2, 3, 4]))


@pytest.mark.parametrize("top_k,keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 4]), (5, [0, 1, 2, 3, 4])])
def test_top_k(top_k, keep):
    assert_close_dist(empirical(SamplingParams(top_k=top_k)), renormalized(keep))


@pytest.mark.parametrize("top_p,keep", [
    (0.3, [1]),                    # the top token alone already covers 0.3
    (0.6, [1, 3]),                 # 0.4 < 0.6, 0.4 + 0.3 >= 0.6
    (0.75, [1, 3, 4]),             # 0.7 < 0.75
    (0.9, [1, 3, 4, 0]),           # 0.85 < 0.9
    (1.0, [0, 1, 2, 3, 4]),
])
def test_top_p(top_p, keep):
    assert_close_dist(empirical(SamplingParams(top_p=top_p)), renormalized(keep))


@pytest.mark.parametrize("min_p,keep", [
    (0.2, [0, 1, 3, 4]),           # threshold 0.08: drops 0.05
    (0.3, [1, 3, 4]),              # threshold 0.12: drops 0.10 and 0.05
    (0.5, [1, 3]),                 # threshold 0.20
    (1.0, [1]),
])
def test_min_p(min_p, keep):
    assert_close_dist(empirical(SamplingParams(min_p=min_p)), renormalized(keep))


def test_top_k_then_top_p_on_the_renormalized_top_k():
    # top-3 renormalized: 0.4/0.85=.47, 0.3/.85=.35, .15/.85=.18 -> top_p 0.8 keeps the first two
    assert_close_dist(empirical(SamplingParams(top_k=3, top_p=0.8)), renormalized([1, 3]))


def test_filters_per_row_in_one_batch():
    """Different requests in one batch get their own filters."""
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3), SamplingParams()]
    n = 5000
    rows = [p for p in params for _ in range(n)]
    res = Sampler(seed=1)(LOGITS.expand(len(rows), -1).clone(), rows, [None] * len(rows))
    toks = torch.tensor(res.token_ids).view(len(params), n)
    assert set(toks[0].tolist()) == {1}
    assert set(toks[1].tolist()) == {1, 3}
    assert set(toks[2].tolist()) == {1, 3, 4}
    assert set(toks[3].tolist()) == {0, 1, 2, 3, 4}


def test_temperature():
    sharp = empirical(SamplingParams(temperature=0.5))
    target = PROBS ** 2
    assert_close_dist(sharp, target / target.sum())
    flat = empirical(SamplingParams(temperature=2.0))
    target = PROBS.sqrt()
    assert_close_dist(flat, target / target.sum())
    plain = empirical(SamplingParams(temperature=1.0))
    assert sharp[1] > plain[1] > flat[1], "lower temperature must favour the top token more"
    # very low temperature is effectively greedy
    assert empirical(SamplingParams(temperature=1e-3), n=2000)[1].item() == 1.0


def test_target_probs_matches_filters():
    p = target_probs(LOGITS.unsqueeze(0), [SamplingParams(top_k=3, temperature=1.0)])[0]
    assert torch.allclose(p, renormalized([1, 3, 4]), atol=1e-6)


# ---------------------------------------------------------------------------------------------
# logprobs

def test_logprobs_top_n_and_sampled_token_from_raw_logits():
    torch.manual_seed(4)
    logits = torch.randn(3, 200)
    params = [SamplingParams(temperature=0.7, top_k=50, logprobs=3, seed=11),
              SamplingParams(temperature=0.0, logprobs=0),
              SamplingParams(temperature=1.0)]
    gens = [torch.Generator().manual_seed(11), None, None]
    res = Sampler()(logits, params, gens)
    ref = logits.log_softmax(-1)

    d0 = res.logprobs[0]
    top3 = ref[0].topk(3).indices.tolist()
    tok = res.token_ids[0]
    assert set(d0) == set(top3) | {tok}
    for t, v in d0.items():
        assert v == pytest.approx(ref[0, t].item(), abs=1e-5), "logprobs must be of the raw distribution"
    assert all(v <= 0 for v in d0.values())

    assert res.logprobs[1] == {res.token_ids[1]: pytest.approx(ref[1, res.token_ids[1]].item(), abs=1e-5)}
    assert res.logprobs[2] is None


def test_logprobs_include_a_sampled_token_outside_the_top_n():
    logits = torch.zeros(1, 50)
    logits[0, 7] = 5.0
    p = SamplingParams(temperature=1.0, logprobs=1)
    for seed in range(200):                          # p(7) is about 0.75: some seed picks another token
        res = Sampler(seed=seed)(logits, [p], [None])
        tok = res.token_ids[0]
        if tok != 7:
            break
    assert tok != 7
    d = res.logprobs[0]
    assert set(d) == {7, tok}
    assert d[tok] == pytest.approx(logits[0].log_softmax(-1)[tok].item(), abs=1e-5)


def test_logprobs_20_is_allowed():
    logits = torch.randn(1, 64)
    res = Sampler()(logits, [SamplingParams(temperature=0.0, logprobs=20)], [None])
    assert len(res.logprobs[0]) == 20


# ---------------------------------------------------------------------------------------------
# validation

@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=2.5), "max_tokens"),
    (dict(min_p=2.0), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=1.5), "top_k"),
    (dict(logprobs=50), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop=""), "stop"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="abc"), "seed"),
])
def test_invalid_sampling_params_raise(kwargs, field):
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**kwargs)


def test_invalid_request_error_is_a_value_error():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)


def test_valid_edge_values_are_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, min_p=0.0, max_tokens=1, logprobs=0)
    SamplingParams(min_p=1.0, logprobs=20, max_tokens=None, top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.01).greedy


def test_revalidation_catches_mutation():
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(InvalidRequestError, match="temperature"):
        p.validate()
    assert not math.isnan(SamplingParams().temperature)
