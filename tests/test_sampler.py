"""Sampling as a user sees it: greedy, seeds, top-k / top-p / min-p distributions, logit bias, min_tokens, penalties,
logprobs, validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engine.errors import InvalidRequestError
from engine import sampler as sampler_mod
from engine.philox import SAMPLE, uniforms
from engine.sampler import Sampler, apply_filters, inverse_cdf, process_logits, target_probs, target_weights
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured import StructuredOutput
from tests.reference_sampler import ReferenceSampler

N = 20_000
# a fixed 6-token distribution, deliberately not in sorted order
PROBS = torch.tensor([0.10, 0.40, 0.05, 0.30, 0.15, 0.0])
LOGITS = torch.log(PROBS.clamp_min(1e-30))          # token 5 is (nearly) impossible
LOGITS[5] = -1e9


def seqs_for(params: list[SamplingParams], sampler: Sampler, prompt: list[int] | None = None) -> list[Sequence]:
    """One sequence per row, each with its own seed (the request's, else one from the sampler's RNG), as
    add_request gives them."""
    out, made = [], {}
    # the statistical tests' 20,000 rows: their engine seeds drawn at once, and each row a copy of its params' first
    # sequence (5x cheaper than request_seed and a new Sequence per row)
    drawn = iter(sampler._rng.integers(0, 2**64, size=sum(p.seed is None for p in params), dtype=np.uint64).tolist())
    for i, p in enumerate(params):
        if id(p) not in made:
            made[id(p)] = Sequence("r", list(prompt or [1, 2, 3]), p)
        seq = object.__new__(Sequence)
        seq.__dict__.update(made[id(p)].__dict__)
        seq.request_id = f"r{i}"
        seq.sampling_seed = sampler.request_seed(p.seed) if p.seed is not None else next(drawn)
        out.append(seq)
    return out


def device_sampler(logits: torch.Tensor, params: list[SamplingParams], seed: int) -> list[int]:
    sampler = Sampler(seed=seed)
    return sampler(logits, seqs_for(params, sampler)).token_ids


def reference_sampler(logits: torch.Tensor, params: list[SamplingParams], seed: int) -> list[int]:
    return ReferenceSampler(seed=seed)(logits, params, [None] * len(params))


def torch_sampler(logits: torch.Tensor, params: list[SamplingParams], seed: int) -> list[int]:
    """The device sampler on torch's way (the one CUDA runs) instead of the CPU kernel."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("BATON_CPU_SAMPLER", "0")
        return device_sampler(logits, params, seed)


# the statistical tests run against the device sampler (the CPU kernel, and torch's way) and the exact race it replaced
IMPLS = pytest.mark.parametrize("impl", [device_sampler, torch_sampler, reference_sampler],
                                ids=["device", "device-torch", "reference"])


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    """The filters and the draw on the CPU kernel (engine/sampler_cpu.cpp) and on torch's way (CUDA's)."""
    if request.param == "torch":
        monkeypatch.setenv("BATON_CPU_SAMPLER", "0")
        assert sampler_mod._native(torch.zeros(1, 2)) is None
    else:
        assert sampler_mod._native(torch.zeros(1, 2)) is not None, "the CPU kernels did not build"
    return request.param


def empirical(params: SamplingParams, impl=device_sampler, logits: torch.Tensor = LOGITS, n: int = N,
              seed: int = 0) -> torch.Tensor:
    """Token frequencies of n independent draws (one batch of n identical rows, unseeded)."""
    toks = impl(logits.expand(n, -1).clone(), [params] * n, seed)
    return torch.bincount(torch.tensor(toks), minlength=logits.shape[-1]).float() / n


def renormalized(keep: list[int], probs: torch.Tensor = PROBS) -> torch.Tensor:
    out = torch.zeros_like(probs)
    out[keep] = probs[keep]
    return out / out.sum()


def chi2_critical(df: int, z: float = 3.7) -> float:
    """The chi-square quantile at 1 - 1e-4 (z of the normal), Wilson-Hilferty: a failure is a real one."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_close_dist(freq: torch.Tensor, target: torch.Tensor, tol: float = 0.02, n: int = N) -> None:
    allowed = target > 0
    assert freq[~allowed].sum().item() == 0, f"filtered tokens were sampled: {freq.tolist()}"
    diff = (freq - target).abs().max().item()
    assert diff < tol, f"empirical {freq.tolist()} vs target {target.tolist()} (max diff {diff:.4f})"
    big = target * n >= 5                                      # chi-square over cells expected >= 5 times
    if big.sum() > 1:
        expected, seen = target[big] * n, freq[big] * n
        rest_e, rest_s = n - expected.sum(), n - seen.sum()
        chi2 = float(((seen - expected) ** 2 / expected).sum()) + (float((rest_s - rest_e) ** 2 / rest_e) if rest_e >= 5 else 0.0)
        df = int(big.sum()) - 1 + int(rest_e >= 5)
        assert chi2 < chi2_critical(df), f"chi-square {chi2:.1f} over {df} degrees of freedom: {freq.tolist()} vs {target.tolist()}"


def test_the_chi_square_check_can_fail():
    target = renormalized([0, 1, 2, 3, 4])
    off = target.clone()
    off[1] += 0.015                                            # inside the max-diff tolerance
    off[3] -= 0.015
    with pytest.raises(AssertionError, match="chi-square"):
        assert_close_dist(off, target)


# ---------------------------------------------------------------------------------------------
# greedy and seeds

def test_greedy_is_argmax():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000)
    sampler = Sampler(seed=123)
    res = sampler(logits, seqs_for([SamplingParams(temperature=0.0)] * 8, sampler))
    assert res.token_ids == logits.argmax(-1).tolist()
    # greedy ignores filters and seeds
    params = [SamplingParams(temperature=0.0, top_k=5, top_p=0.1, min_p=0.5, seed=7)] * 8
    assert Sampler(seed=9)(logits, seqs_for(params, sampler)).token_ids == logits.argmax(-1).tolist()


def test_greedy_accepts_low_precision_logits():
    torch.manual_seed(1)
    logits = torch.randn(3, 50).to(torch.bfloat16)
    sampler = Sampler()
    res = sampler(logits, seqs_for([SamplingParams(temperature=0.0)] * 3, sampler))
    assert res.token_ids == logits.float().argmax(-1).tolist()


def _seeded_run(seeds: list[int], logits_row: torch.Tensor, steps: int = 12, extra_rows: int = 0) -> list[list[int]]:
    """Sample `steps` tokens for rows that share logits, each appended to its sequence as the engine does."""
    params = [SamplingParams(temperature=1.0, seed=s) for s in seeds] + [SamplingParams()] * extra_rows
    sampler = Sampler(seed=0)
    seqs = seqs_for(params, sampler)
    for _ in range(steps):
        res = sampler(logits_row.expand(len(seqs), -1).clone(), seqs)
        for seq, tok in zip(seqs, res.token_ids):
            seq.token_ids.append(tok)
    return [s.output_token_ids for s in seqs[:len(seeds)]]


def test_same_seed_same_tokens_different_seeds_differ():
    logits = torch.zeros(1000)                          # uniform: every seed picks its own path
    a = _seeded_run([1, 2, 3, 1], logits)
    assert a[0] == a[3], "two requests with the same seed in one batch must get the same tokens"
    assert a[0] != a[1] and a[0] != a[2] and a[1] != a[2], "different seeds gave the same tokens"
    assert len(set(a[0])) > 6, "a seeded request must draw a new number at each position"
    b = _seeded_run([1, 2, 3, 1], logits)
    assert a == b, "same seeds must reproduce across runs"


def test_seeded_tokens_do_not_depend_on_the_batch():
    logits = torch.zeros(1000)
    alone = _seeded_run([42], logits)
    batched = _seeded_run([5, 42, 6], logits, extra_rows=4)
    assert batched[1] == alone[0], "a seeded request's tokens changed with what else was in the batch"


def test_seeded_token_depends_only_on_seed_and_position():
    """The same position samples the same token however often it is sampled (a recompute after
    preemption, a replay elsewhere); the next position draws anew."""
    logits = torch.zeros(1, 1000)
    sampler = Sampler()
    seq = seqs_for([SamplingParams(seed=9)], sampler)[0]
    first = [sampler(logits, [seq]).token_ids[0] for _ in range(3)]
    assert len(set(first)) == 1
    seq.token_ids.append(first[0])
    assert sampler(logits, [seq]).token_ids[0] != first[0]          # 1 in 1000 to collide; seed 9 does not


def test_negative_and_uint64_seeds_map_to_the_same_stream():
    sampler = Sampler()
    assert sampler.request_seed(-1) == sampler.request_seed(2**64 - 1) == 2**64 - 1
    assert sampler.request_seed(5) == 5


def test_unseeded_sampler_seed_reproduces():
    logits = torch.zeros(4, 1000)
    params = [SamplingParams()] * 4
    a, b, c = (device_sampler(logits, params, seed) for seed in (3, 3, 4))
    assert a == b and a != c
    assert len(set(a)) > 1, "unseeded requests of one batch must get their own streams"


def test_top_k_1_equals_greedy():
    torch.manual_seed(2)
    logits = torch.randn(16, 500)
    params = [SamplingParams(temperature=1.3, top_k=1, seed=i) for i in range(16)]
    sampler = Sampler()
    seqs = seqs_for(params, sampler)
    for _ in range(5):
        assert sampler(logits, seqs).token_ids == logits.argmax(-1).tolist()
        for s in seqs:
            s.token_ids.append(0)


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(3)
    logits = torch.randn(3, 100)
    params = [SamplingParams(temperature=0.0), SamplingParams(top_k=1), SamplingParams(temperature=0.0)]
    assert device_sampler(logits, params, 0) == logits.argmax(-1).tolist()


# ---------------------------------------------------------------------------------------------
# filters: sampled frequencies match the renormalized distribution

@IMPLS
def test_plain_sampling_matches_softmax(impl):
    assert_close_dist(empirical(SamplingParams(), impl), renormalized([0, 1, 2, 3, 4]))


@pytest.mark.parametrize("top_k,keep", [(1, [1]), (2, [1, 3]), (3, [1, 3, 4]), (5, [0, 1, 2, 3, 4])])
@IMPLS
def test_top_k(top_k, keep, impl):
    assert_close_dist(empirical(SamplingParams(top_k=top_k), impl), renormalized(keep))


@pytest.mark.parametrize("top_p,keep", [
    (0.3, [1]),                    # the top token alone already covers 0.3
    (0.6, [1, 3]),                 # 0.4 < 0.6, 0.4 + 0.3 >= 0.6
    (0.75, [1, 3, 4]),             # 0.7 < 0.75
    (0.9, [1, 3, 4, 0]),           # 0.85 < 0.9
    (1.0, [0, 1, 2, 3, 4]),
])
@IMPLS
def test_top_p(top_p, keep, impl):
    assert_close_dist(empirical(SamplingParams(top_p=top_p), impl), renormalized(keep))


@pytest.mark.parametrize("min_p,keep", [
    (0.2, [0, 1, 3, 4]),           # threshold 0.08: drops 0.05
    (0.3, [1, 3, 4]),              # threshold 0.12: drops 0.10 and 0.05
    (0.5, [1, 3]),                 # threshold 0.20
    (1.0, [1]),
])
@IMPLS
def test_min_p(min_p, keep, impl):
    assert_close_dist(empirical(SamplingParams(min_p=min_p), impl), renormalized(keep))


@IMPLS
def test_top_k_then_top_p_on_the_renormalized_top_k(impl):
    # top-3 renormalized: 0.4/0.85=.47, 0.3/.85=.35, .15/.85=.18 -> top_p 0.8 keeps the first two
    assert_close_dist(empirical(SamplingParams(top_k=3, top_p=0.8), impl), renormalized([1, 3]))


@IMPLS
def test_filters_per_row_in_one_batch(impl):
    """Different requests in one batch get their own filters."""
    params = [SamplingParams(top_k=1), SamplingParams(top_p=0.6), SamplingParams(min_p=0.3), SamplingParams()]
    n = 5000
    rows = [p for p in params for _ in range(n)]
    toks = torch.tensor(impl(LOGITS.expand(len(rows), -1).clone(), rows, 1)).view(len(params), n)
    assert set(toks[0].tolist()) == {1}
    assert set(toks[1].tolist()) == {1, 3}
    assert set(toks[2].tolist()) == {1, 3, 4}
    assert set(toks[3].tolist()) == {0, 1, 2, 3, 4}


@IMPLS
def test_temperature(impl):
    sharp = empirical(SamplingParams(temperature=0.5), impl)
    target = PROBS ** 2
    assert_close_dist(sharp, target / target.sum())
    flat = empirical(SamplingParams(temperature=2.0), impl)
    target = PROBS.sqrt()
    assert_close_dist(flat, target / target.sum())
    plain = empirical(SamplingParams(temperature=1.0), impl)
    assert sharp[1] > plain[1] > flat[1], "lower temperature must favour the top token more"
    # very low temperature is effectively greedy
    assert empirical(SamplingParams(temperature=1e-3), impl, n=2000)[1].item() == 1.0


def test_target_probs_matches_filters(path):
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
    sampler = Sampler()
    res = sampler(logits, seqs_for(params, sampler))
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
        sampler = Sampler(seed=seed)
        res = sampler(logits, seqs_for([p], sampler))
        tok = res.token_ids[0]
        if tok != 7:
            break
    assert tok != 7
    d = res.logprobs[0]
    assert set(d) == {7, tok}
    assert d[tok] == pytest.approx(logits[0].log_softmax(-1)[tok].item(), abs=1e-5)


def test_logprobs_20_is_allowed():
    logits = torch.randn(1, 64)
    sampler = Sampler()
    res = sampler(logits, seqs_for([SamplingParams(temperature=0.0, logprobs=20)], sampler))
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
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.1), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
    (dict(min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(min_tokens=2, structured=StructuredOutput(regex="[a-z]+")), "min_tokens"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids"),
    (dict(allowed_token_ids=[3], structured=StructuredOutput(regex="[a-z]+")), "allowed_token_ids"),
    (dict(bad_words=["ok", "  "]), "bad_words"),
    (dict(bad_words=["ok"], structured=StructuredOutput(regex="[a-z]+")), "bad_words"),
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
    SamplingParams(presence_penalty=-2.0, frequency_penalty=2.0, repetition_penalty=0.5)
    SamplingParams(min_tokens=8, max_tokens=8, logit_bias={0: -100, 7: 100.0, 9: 0.5})
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.01).greedy


def test_revalidation_catches_mutation():
    p = SamplingParams()
    p.temperature = -1.0
    with pytest.raises(InvalidRequestError, match="temperature"):
        p.validate()
    assert not math.isnan(SamplingParams().temperature)


# ---------------------------------------------------------------------------------------------
# the filters without a full sort: the same kept set as the full-sort definition

VOCAB = 49_152


def reference_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The full-sort filter (sort, top-k, top-p on the top-k renormalized distribution, then min-p
    relative to the top token), computed in float64 from the float32 temperature-scaled logits.

    The earlier float32 version of this code rounded the softmax / cumsum enough (up to ~1e-5 of
    mass) to move the top-p boundary by a token now and then, and with top_p = 1 cut the tail where
    the float32 cumsum reached 1.0; the definition is what is compared against here."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], dtype=logits.dtype)
    x = logits / temps.unsqueeze(1)
    vocab = x.shape[-1]
    xs, idx = x.sort(dim=-1, descending=True)
    x64 = xs.double()
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    drop = torch.arange(vocab).unsqueeze(0) >= k.unsqueeze(1)
    probs = x64.masked_fill(drop, float("-inf")).softmax(-1)
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else float("inf") for p in params], dtype=torch.float64)
    drop |= probs.cumsum(-1) - probs >= top_p.unsqueeze(1)
    drop[:, 0] = False
    probs = x64.masked_fill(drop, float("-inf")).softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64)
    drop |= probs < min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
    return torch.empty_like(x).scatter_(-1, idx, xs.masked_fill(drop, float("-inf")))


def _random_case(seed: int, rows: int = 6, vocab: int = VOCAB) -> tuple[torch.Tensor, list[SamplingParams]]:
    """Random rows: peaked (few tokens hold the mass), medium, and near-flat logits, with a mix of
    filters: some cut inside the first 256 candidates, some need 4096, some the full sort."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.02, 0.3, 1.0, 3.0, 6.0])[torch.randint(0, 5, (rows, 1), generator=g)]
    logits = torch.randn(rows, vocab, generator=g) * scale
    choices = [dict(top_p=0.9), dict(top_p=0.99), dict(top_p=0.999), dict(top_p=0.5), dict(top_k=50),
               dict(top_k=1), dict(top_k=300, top_p=0.8), dict(top_k=5000, top_p=0.95),
               dict(top_k=30_000, top_p=0.97), dict(top_k=vocab + 5), dict(min_p=0.1), dict(min_p=0.9),
               dict(min_p=0.05, top_p=0.97), dict(top_k=300, min_p=0.2, top_p=0.8), dict()]
    temps = [0.3, 0.7, 1.0, 1.5]
    params = []
    for _ in range(rows):
        c = choices[int(torch.randint(0, len(choices), (1,), generator=g))]
        t = temps[int(torch.randint(0, len(temps), (1,), generator=g))]
        params.append(SamplingParams(temperature=t, **c))
    return logits, params


def _assert_same_filter(logits, params):
    got, ref = apply_filters(logits, params), reference_filters(logits, params)
    kept_got, kept_ref = torch.isfinite(got), torch.isfinite(ref)
    for r, p in enumerate(params):
        assert torch.equal(kept_got[r], kept_ref[r]), (
            f"row {r} {p}: kept {int(kept_got[r].sum())} tokens, the full sort keeps {int(kept_ref[r].sum())}")
    assert torch.equal(got[kept_got], ref[kept_ref]), "kept logits must be the temperature-scaled logits"


@pytest.mark.parametrize("seed", range(8))
def test_filters_equal_the_full_sort_on_random_logits(seed, path):
    logits, params = _random_case(seed)
    _assert_same_filter(logits, params)
    for r, p in enumerate(params):                   # and each row alone: nothing depends on the batch
        _assert_same_filter(logits[r:r + 1], [p])


def test_filters_cover_every_path():
    """The random cases above go through the 256 candidates, the 4096 ones, a top_k above both, and
    the full sort."""
    widths = set()
    for seed in range(8):
        logits, params = _random_case(seed)
        for rows in [list(range(len(params)))] + [[r] for r in range(len(params))]:
            ps = [params[r] for r in rows]
            scaled = sampler_mod._scale(logits[rows], ps)
            widths |= {b.ids.shape[1] for b in sampler_mod._row_groups(scaled, ps) if b.ids is not None}
    assert {256, 4096, 5000, VOCAB} <= widths, widths


def test_filters_fallback_rows(path):
    """Rows torch's candidates cannot cover: flat logits with top_p near 1, min-p that keeps most of the
    vocabulary, top_k above the candidate sizes; alone and next to rows that are covered. (For the kernel: cuts
    inside the one bucket a flat row's weights all fall in.)"""
    g = torch.Generator().manual_seed(7)
    flat = torch.randn(4, VOCAB, generator=g) * 0.02
    peaked = torch.randn(2, VOCAB, generator=g) * 4
    logits = torch.cat([flat, peaked])
    params = [SamplingParams(top_p=0.999), SamplingParams(temperature=0.5, top_p=0.95),
              SamplingParams(min_p=0.97), SamplingParams(top_k=10_000, top_p=0.99, min_p=0.98),
              SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(top_k=50, min_p=0.01)]
    _assert_same_filter(logits, params)
    groups = sampler_mod._row_groups(sampler_mod._scale(logits, params), params)
    assert any(b.ids is not None and b.ids.shape[1] == VOCAB for b in groups), "no row took the full sort"
    for r in range(len(params)):
        _assert_same_filter(logits[r:r + 1], params[r:r + 1])


def test_top_p_near_the_boundary_keeps_the_token_whose_mass_before_is_below_p(path):
    # mass before each token: 0, 0.5, 0.75, 0.875, ...: top_p exactly at such a sum drops that token
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625])
    logits = torch.log(probs).unsqueeze(0)
    for top_p, n in [(0.5, 1), (0.5000001, 2), (0.75, 2), (0.76, 3), (0.875, 3), (0.9, 4), (1.0, 5)]:
        got = apply_filters(logits, [SamplingParams(top_p=top_p)])
        assert int(torch.isfinite(got).sum()) == n, (top_p, got)


# ---------------------------------------------------------------------------------------------
# sampling over the kept tokens only

def _tv(freq: torch.Tensor, target: torch.Tensor) -> float:
    return 0.5 * float((freq - target).abs().sum())


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_p=0.9),          # the strong tokens only
    SamplingParams(temperature=1.0, top_p=0.7),          # ~200 tokens: inside the first 256 candidates
    SamplingParams(temperature=1.0, top_p=0.95),         # ~1570 tokens: the full sort (vocab 2000)
    SamplingParams(temperature=0.8, top_k=40, min_p=0.05),
])
@IMPLS
def test_sampled_frequencies_match_the_filtered_distribution(params, impl):
    g = torch.Generator().manual_seed(11)
    # 12 strong tokens holding about half the mass, then a long, slowly decreasing (tie-free) tail
    row = torch.linspace(0.0, -1.0, 2000)
    row[torch.randperm(2000, generator=g)[:12]] += 5.0 + torch.rand(12, generator=g)
    target = target_probs(row.unsqueeze(0), [params])[0]
    n = 8000
    freq = torch.bincount(torch.tensor(impl(row.expand(n, -1).clone(), [params] * n, 2)), minlength=2000).float() / n
    assert freq[target == 0].sum() == 0, "a filtered token was sampled"
    strong = target.topk(12).indices
    assert (freq[strong] - target[strong]).abs().max() < 0.015
    # the tail, in 10 bins of kept tokens: each bin's mass matches
    kept = (target > 0).nonzero().squeeze(1)
    kept = kept[~torch.isin(kept, strong)]
    for chunk in kept.chunk(10):
        assert abs(float(freq[chunk].sum() - target[chunk].sum())) < 0.02


def test_seeded_rows_sample_the_same_whatever_the_batch_and_path(path):
    """A seeded filtered row gets the same tokens alone and next to rows that change the candidate
    size (a big top_k) or force other rows through the full sort."""
    g = torch.Generator().manual_seed(5)
    row = torch.randn(VOCAB, generator=g) * 3.0           # top_p 0.9 keeps ~1300 tokens: 4096 candidates
    others = torch.randn(3, VOCAB, generator=g) * 0.02
    p = SamplingParams(temperature=0.9, top_p=0.9, seed=3)
    scaled = sampler_mod._scale(row.unsqueeze(0), [p])
    assert sampler_mod._row_groups(scaled, [p])[0].ids.shape[1] == 4096

    def run(extra_params):
        logits = torch.cat([others[:len(extra_params)], row.unsqueeze(0)])
        sampler = Sampler(seed=0)
        seqs = seqs_for(extra_params + [p], sampler)
        out = []
        for _ in range(10):
            out.append(sampler(logits, seqs).token_ids[-1])
            for s in seqs:
                s.token_ids.append(out[-1])
        return out

    alone = run([])
    assert len(set(alone)) > 3
    assert run([SamplingParams(top_k=8000)]) == alone
    assert run([SamplingParams(top_p=0.999), SamplingParams(), SamplingParams(min_p=0.5)]) == alone
    assert run([SamplingParams(temperature=0.0)]) == alone


def test_sparse_draw_equals_the_dense_inverse_cdf(path):
    """The Sampler's draw over kept tokens and the dense path speculative decoding uses
    (target_weights + inverse_cdf) pick the same token from the same uniform, on every filter path."""
    logits, params = _random_case(3, rows=10)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        u = torch.rand(len(params), generator=g, dtype=torch.float64)
        fast = sampler_mod.draw(logits, params, u)
        dense = inverse_cdf(target_weights(logits, params), u)
        assert fast.tolist() == dense.tolist()
        logits = logits + torch.randn_like(logits) * 0.1


def test_the_kernel_and_torchs_way_draw_the_same_tokens(monkeypatch):
    """The CPU kernel and torch's way (CUDA's) implement one definition: on random rows of every kind (peaked to
    flat, each filter) they keep the same tokens and pick the same one from the same uniform."""
    g = torch.Generator().manual_seed(1)
    for seed in range(6):
        logits, params = _random_case(seed, rows=10)
        u = torch.rand(len(params), generator=g, dtype=torch.float64)
        kernel = sampler_mod.draw(logits, params, u).tolist()
        kept = torch.isfinite(apply_filters(logits, params))
        with monkeypatch.context() as m:
            m.setenv("BATON_CPU_SAMPLER", "0")
            assert sampler_mod.draw(logits, params, u).tolist() == kernel
            assert torch.equal(torch.isfinite(apply_filters(logits, params)), kept)


def test_the_kernel_ranks_equal_logits_by_token_id():
    x = torch.zeros(1, 8)
    x[0, 6] = -1.0
    for params, kept in [(SamplingParams(top_k=2), [0, 1]), (SamplingParams(top_k=7), [0, 1, 2, 3, 4, 5, 7]),
                         (SamplingParams(top_p=0.3), [0, 1, 2]),     # 7 tokens of mass 1/7.x each: 2 before is < 0.3
                         (SamplingParams(min_p=0.5), [0, 1, 2, 3, 4, 5, 7])]:
        got = torch.isfinite(apply_filters(x, [params]))[0].nonzero().squeeze(1).tolist()
        assert got == kept, (params, got)


def test_the_kernel_cuts_inside_the_top_bucket_and_the_smallest():
    """Ties at the max (the top bucket holds w = 1 alone; equal logits rank by token id), tokens whose weights
    underflow below 2**-47 (the last bucket, sorted when a cut falls there) and masked ones (-inf)."""
    ties = torch.tensor([[2.0, 0.0, 2.0, 2.0, -1.0, 2.0, 1.0, -50.0]])     # rank: 0 2 3 5, 6, 1, 4, 7
    for params, kept in [(SamplingParams(top_k=2), [0, 2]),
                         (SamplingParams(top_k=5, top_p=0.9), [0, 2, 3, 5]),  # mass before 6: 4 / 4.37 >= 0.9
                         (SamplingParams(top_p=0.6), [0, 2, 3])]:              # before 5: 3 / 4.55 >= 0.6
        assert torch.isfinite(apply_filters(ties, [params]))[0].nonzero().squeeze(1).tolist() == kept, params
    tiny = torch.cat([torch.tensor([0.0, -1.0]), -40.0 - torch.arange(60.0) * 0.25]).unsqueeze(0)
    masked = torch.tensor([[0.0, float("-inf"), -0.5, float("-inf"), -3.0, -60.0]])
    for logits, params, n in [(tiny, SamplingParams(top_k=7), 7), (tiny, SamplingParams(min_p=1e-19), 17),
                              (tiny, SamplingParams(top_k=40, min_p=1e-20), 27),
                              (masked, SamplingParams(top_k=3), 3), (masked, SamplingParams(min_p=0.01), 3)]:
        kept = torch.isfinite(apply_filters(logits, [params]))
        assert int(kept.sum()) == n and torch.equal(kept, torch.isfinite(reference_filters(logits, [params]))), params


def test_a_row_samples_by_inverse_cdf_with_its_philox_uniform():
    """The definition a replay elsewhere relies on: the first token (in id order) whose softmax prefix
    sum exceeds u, u = Philox(seed, position of the token, SAMPLE)."""
    torch.manual_seed(6)
    logits = torch.randn(4, 500)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(4)]
    sampler = Sampler()
    seqs = seqs_for(params, sampler, prompt=list(range(7)))
    got = sampler(logits, seqs).token_ids
    u = uniforms(np.arange(4, dtype=np.uint64), np.full(4, 7), SAMPLE)
    probs = (logits / 0.8).double().softmax(-1).cumsum(-1)
    expect = [int((probs[i] > u[i]).nonzero()[0]) for i in range(4)]
    assert got == expect


def test_inverse_cdf_never_picks_a_zero_weight():
    w = torch.tensor([[0.0, 1.0, 0.0, 0.0, 2.0, 0.0]]).expand(4, -1)
    u = torch.tensor([0.0, 1 / 3 - 1e-12, 1 / 3 + 1e-12, 1 - 2**-53], dtype=torch.float64)
    assert inverse_cdf(w, u).tolist() == [1, 1, 4, 4]


# ---------------------------------------------------------------------------------------------
# penalties

def _penalized(params: SamplingParams, logits: torch.Tensor, prompt: list[int], output: list[int]) -> torch.Tensor:
    seq = Sequence("r", prompt + output, params, num_prompt_tokens=len(prompt))
    return process_logits(logits.unsqueeze(0), [seq])[0]


def test_penalties_follow_vllm_semantics():
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 1.0])
    prompt, output = [0, 1], [2, 2, 3]                 # 4 and 5 never appeared
    got = _penalized(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), logits, prompt, output)
    # output counts: token 2 twice, token 3 once; the prompt does not count for these two
    assert got.tolist() == pytest.approx([2.0, -1.0, 0.5 - 0.5 - 0.5, 3.0 - 0.5 - 0.25, -2.0, 1.0])
    got = _penalized(SamplingParams(repetition_penalty=2.0), logits, prompt, output)
    # prompt and output tokens: positive logits halved, negative doubled
    assert got.tolist() == pytest.approx([1.0, -2.0, 0.25, 1.5, -2.0, 1.0])
    got = _penalized(SamplingParams(presence_penalty=-1.0), logits, prompt, output)
    assert got.tolist() == pytest.approx([2.0, -1.0, 1.5, 4.0, -2.0, 1.0])   # negative: encourages repeats
    assert torch.equal(_penalized(SamplingParams(), logits, prompt, output), logits)


def test_penalties_apply_per_row_and_to_drafts_ahead():
    logits = torch.zeros(3, 5)
    a = Sequence("a", [0, 1, 1], SamplingParams(frequency_penalty=1.0), num_prompt_tokens=1)
    b = Sequence("b", [2, 3], SamplingParams(), num_prompt_tokens=1)
    got = process_logits(logits, [a, b, a], [[], [], [4, 4, 1]])
    assert got[0].tolist() == [0.0, -2.0, 0.0, 0.0, 0.0]
    assert got[1].tolist() == [0.0] * 5
    assert got[2].tolist() == [0.0, -3.0, 0.0, 0.0, -2.0]
    assert logits.eq(0).all(), "the raw logits stay as they were (logprobs come from them)"


def test_greedy_takes_the_argmax_of_the_penalized_logits_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    sampler = Sampler()
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=1)
    seq = seqs_for([params], sampler, prompt=[0])[0]
    seq.token_ids.append(0)                           # token 0 generated once: 5 - 2 < 4
    res = sampler(logits, [seq])
    assert res.token_ids == [1]
    raw = logits[0].log_softmax(-1)
    assert res.logprobs[0][1] == pytest.approx(raw[1].item()) and res.logprobs[0][0] == pytest.approx(raw[0].item())




# ---------------------------------------------------------------------------------------------
# logit bias and min_tokens

def test_logit_bias_and_min_tokens_come_before_the_penalties_and_leave_the_raw_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    raw = logits.clone()
    # the bias first, then the repetition penalty divides the biased positive logit (vLLM's order)
    seq = Sequence("r", [0, 1, 3], SamplingParams(logit_bias={3: 1.0, 4: -100}, repetition_penalty=2.0),
                   num_prompt_tokens=2)
    got = process_logits(logits, [seq])[0]
    assert got.tolist() == pytest.approx([1.0, -2.0, 0.5, 2.0, -102.0, 1.0])
    assert torch.equal(logits, raw), "the raw logits stay as they were (logprobs come from them)"


def test_min_tokens_masks_the_stop_tokens_until_the_outputs_and_drafts_ahead_reach_it():
    logits = torch.zeros(4, 6)
    a = Sequence("a", [0, 1, 1], SamplingParams(min_tokens=3), num_prompt_tokens=1)      # 2 outputs so far
    a.min_stops = (2, 5)
    b = Sequence("b", [0], SamplingParams(logit_bias={1: 2.0}), num_prompt_tokens=1)
    got = process_logits(logits, [a, b, a, a], [[], [], [4], [4, 4]])
    inf = float("-inf")
    assert got[0].tolist() == [0.0, 0.0, inf, 0.0, 0.0, inf]         # 2 < 3: EOS and stop ids out
    assert got[1].tolist() == [0.0, 2.0, 0.0, 0.0, 0.0, 0.0]          # another row: only its own bias
    assert got[2].tolist() == [0.0] * 6                                # one draft ahead: 3 outputs, free
    assert got[3].tolist() == [0.0] * 6
    assert logits.eq(0).all()


def test_logit_bias_steers_greedy_and_sampled_rows_alike():
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    sampler = Sampler()
    params = [SamplingParams(temperature=0.0, logit_bias={1: -100, 3: 6.0}, logprobs=1),
              SamplingParams(temperature=1.0, seed=3, logit_bias={0: -100, 1: -100, 3: -100})]
    res = sampler(logits, seqs_for(params, sampler))
    assert res.token_ids == [3, 2]
    raw = logits[0].log_softmax(-1)
    assert res.logprobs[0][3] == pytest.approx(raw[3].item()), "logprobs are the raw distribution's"


def test_allowed_ids_and_bad_words_mask_per_row_with_the_drafts_ahead():
    logits = torch.arange(8, dtype=torch.float32).repeat(4, 1)
    a = Sequence("a", [0, 5, 6], SamplingParams(), num_prompt_tokens=1)                    # outputs 5, 6
    a.allowed_ids = np.array([1, 4, 7])
    b = Sequence("b", [0, 5, 6], SamplingParams(logit_bias={7: 1.0}), num_prompt_tokens=1)
    b.bad_word_ids = ((3,), (6, 2), (5, 6, 7), (1, 1))                                      # "words" as ids
    got = process_logits(logits, [a, b, b, b], [[], [], [1], [6]])
    inf = float("-inf")
    assert got[0].tolist() == [inf, 1.0, inf, inf, 4.0, inf, inf, 7.0]
    assert got[1].tolist() == [0.0, 1.0, inf, inf, 4.0, 5.0, 6.0, inf]   # 3 always; ...6 -> not 2; ...5, 6 -> not 7
    assert got[2].tolist() == [0.0, inf, 2.0, inf, 4.0, 5.0, 6.0, 8.0]   # a draft 1 ahead: (1, 1) bans 1
    assert got[3].tolist() == [0.0, 1.0, inf, inf, 4.0, 5.0, 6.0, 8.0]   # a draft 6 ahead: (6, 2) bans 2
    assert torch.equal(logits, torch.arange(8, dtype=torch.float32).repeat(4, 1))
