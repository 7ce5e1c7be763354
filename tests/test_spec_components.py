"""Speculative decoding parts: the rejection sampler keeps the target's distribution (on the device and
in the reference loop it replaced); prompt-lookup verification emits what plain sampling would; n-gram lookup."""
from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, target_probs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.spec import NgramLookup, rejection_sample
from tests.reference_sampler import reference_rejection

V = 8
TARGET = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAFT = torch.tensor([0.0, 2.0, -1.0, 1.0, 0.5, 0.0, 1.5, 0.0])        # disagrees often


def verifying(drafts: list[int], params: SamplingParams, q: torch.Tensor | None, seed: int,
              prompt: list[int] | None = None) -> Sequence:
    seq = Sequence("r", list(prompt or [1, 2, 3]), params)
    seq.sampling_seed = seed
    seq.spec_tokens, seq.spec_probs = list(drafts), q
    return seq


def device_verify(drafts: list[list[int]], logits: list[torch.Tensor], params: SamplingParams,
                  q: list[torch.Tensor | None], seed: int) -> list[list[int]]:
    """Every sequence in one vectorised call; logits[i]: its k + 1 target rows."""
    sampler = Sampler(seed)
    seqs = [verifying(d, params, qi, sampler.request_seed(None)) for d, qi in zip(drafts, q)]
    return rejection_sample(torch.cat(logits), seqs).to_lists()


def reference_verify(drafts, logits, params, q, seed):
    g = torch.Generator().manual_seed(seed)
    probs = {id(x): target_probs(x, [params] * len(x)) for x in {id(x): x for x in logits}.values()}
    return [reference_rejection(d, probs[id(x)], qi, params.greedy, g) for d, x, qi in zip(drafts, logits, q)]


IMPLS = pytest.mark.parametrize("impl", [device_verify, reference_verify], ids=["device", "reference"])


def _first_token_histogram(impl, params: SamplingParams, one_hot: bool, n: int, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = None if one_hot else target_probs(DRAFT[None], [params])[0]
    if q is None:
        drafts = torch.randint(0, V, (n, k), generator=g).tolist()     # arbitrary one-hot "n-gram" drafts
    else:
        drafts = torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k).tolist()
    out = impl(drafts, [TARGET.expand(k + 1, V)] * n, params, [None if q is None else q.expand(k, V)] * n, seed)
    assert all(1 <= len(o) <= k + 1 for o in out)
    return torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float() / n


@IMPLS
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_distribution_converges_to_the_target(params, one_hot, impl):
    p = target_probs(TARGET[None], [params])[0]
    tv_small = sum(0.5 * (_first_token_histogram(impl, params, one_hot, 100, seed=10 + s) - p).abs().sum()
                   for s in range(3)) / 3
    tv_large = 0.5 * (_first_token_histogram(impl, params, one_hot, 8000, seed=1) - p).abs().sum()
    assert tv_large < 0.025, f"total variation {tv_large:.3f} from the target"
    assert tv_large < tv_small                                          # distance shrinks with samples
    filtered = p == 0
    assert _first_token_histogram(impl, params, one_hot, 300, seed=2)[filtered].sum() == 0   # filters hold for p and q


@IMPLS
def test_later_tokens_keep_the_target_distribution(impl):
    """The second emitted token (after an accepted first draft), over many seeds, is distributed as p."""
    params = SamplingParams(temperature=1.0)
    p = target_probs(TARGET[None], [params])[0]
    q = target_probs(DRAFT[None], [params])[0]
    g = torch.Generator().manual_seed(4)
    n = 8000
    drafts = [[1] + torch.multinomial(q, 2, replacement=True, generator=g).tolist() for _ in range(n)]
    out = impl(drafts, [TARGET.expand(4, V)] * n, params, [q.expand(3, V)] * n, 5)
    second = [o[1] for o in out if len(o) > 1 and o[0] == 1]
    freq = torch.bincount(torch.tensor(second), minlength=V).float() / len(second)
    assert len(second) > 2000 and 0.5 * (freq - p).abs().sum() < 0.04


def _one_hot_logits(targets: list[int]) -> torch.Tensor:
    x = torch.zeros(len(targets), V)
    for i, t in enumerate(targets):
        x[i, t] = 10.0
    return x


@IMPLS
def test_greedy_accepts_the_longest_matching_prefix_plus_one(impl):
    x = _one_hot_logits([3, 1, 4, 5])
    greedy = SamplingParams(temperature=0)
    cases = [([3, 1, 4], [3, 1, 4, 5]), ([3, 2, 4], [3, 1]), ([0, 1, 4], [3])]     # all + bonus; fixed at a miss
    got = impl([d for d, _ in cases], [x] * 3, greedy, [None] * 3, 0)
    assert got == [want for _, want in cases]


@IMPLS
def test_identical_draft_is_always_accepted(impl):
    params = SamplingParams(temperature=1.0)
    p = target_probs(TARGET[None], [params])[0]
    g = torch.Generator().manual_seed(3)
    drafts = [torch.multinomial(p, 4, replacement=True, generator=g).tolist() for _ in range(200)]
    out = impl(drafts, [TARGET.expand(5, V)] * 200, params, [p.expand(4, V)] * 200, 3)
    assert all(o[:4] == d and len(o) == 5 for o, d in zip(out, drafts))


def test_prompt_lookup_verification_emits_what_plain_sampling_would():
    """One-hot drafts: the emitted tokens are the seeded request's plain samples at those positions,
    whatever the drafts were (accepted while they match)."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    sampler = Sampler()
    plain_seq = verifying([], params, None, 11)
    plain = []
    for row in logits:
        plain.append(sampler(row[None], [plain_seq]).token_ids[0])
        plain_seq.token_ids.append(plain[-1])
    for drafts, n in [(plain[:3], 4), (plain[:2] + [(plain[2] + 1) % 50], 3), ([(plain[0] + 1) % 50] * 3, 1)]:
        assert rejection_sample(logits, [verifying(drafts, params, None, 11)]).to_lists() == [plain[:n]]


def test_a_batch_verifies_each_sequence_as_it_would_alone():
    """Mixed depths, greedy and sampled, one-hot and model drafts, in one call: each row's result is its
    result alone (the padding to the longest draft changes nothing)."""
    g = torch.Generator().manual_seed(2)
    specs = []
    for i, (k, greedy, model) in enumerate([(1, False, True), (4, False, False), (2, True, False), (3, False, True),
                                            (4, False, True), (2, False, False)]):
        params = SamplingParams(temperature=0 if greedy else 0.9, top_k=6)
        q = target_probs(DRAFT[None], [params])[0].expand(k, V) if model else None
        drafts = torch.randint(0, V, (k,), generator=g).tolist()
        logits = TARGET + torch.randn(k + 1, V, generator=g)
        specs.append((drafts, params, q, 100 + i, logits))
    alone = [rejection_sample(x, [verifying(d, p, q, s)]).to_lists()[0] for d, p, q, s, x in specs]
    batch = rejection_sample(torch.cat([x for *_, x in specs]),
                             [verifying(d, p, q, s) for d, p, q, s, _ in specs]).to_lists()
    assert batch == alone


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramLookup(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=3)
    assert prop.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]   # newest 3-gram match
    assert prop.propose([5, 6, 7, 6]) == [7, 6]                                   # 1-gram fallback
    assert prop.propose([1, 2, 3, 4]) == []                                       # nothing repeats
    assert prop.propose([4, 4, 4, 4], k=2) == [4]
    with pytest.raises(ValueError):
        NgramLookup(prompt_lookup_min=3, prompt_lookup_max=2)


# -- with a grammar: drafts it refuses are cut, verify rows are masked, the output is the masked target's ---------
TOY_VOCAB = ["a", "b", "c", "d", "e", "f", "g", "</s>"]      # ids 0..7, as V and TARGET/DRAFT above
TOY_REGEX = "[a-c][d-g][d-g]"                               # after a first letter in a-c, two in d-g


def _toy_guides(n: int) -> list:
    import xgrammar as xgr
    from engine.structured import Guide
    info = xgr.TokenizerInfo(TOY_VOCAB, vocab_size=V, stop_token_ids=[7])
    compiled = xgr.GrammarCompiler(info).compile_regex(TOY_REGEX)
    return [Guide(xgr.GrammarMatcher(compiled)) for _ in range(n)]


def _constrained_verify(drafts: list[list[int]], q: torch.Tensor | None, params: SamplingParams,
                        seed: int) -> list[list[int]]:
    """What the speculative decoder does with a constrained batch: cut each sequence's drafts by its grammar
    (engine/structured.py: cut_drafts), mask the verify rows by the grammar state after the drafts before
    them, rejection-sample. Every row's target logits are TARGET."""
    from engine.structured import cut_drafts, mask_verify_rows
    from engine.spec.rejection import VerifyRows
    sampler = Sampler(seed)
    seqs = []
    for d, guide in zip(drafts, _toy_guides(len(drafts))):
        tokens, probs = cut_drafts(guide, d, None if q is None else q.expand(len(d), V))
        seq = verifying(tokens, params, probs if tokens else None, sampler.request_seed(None))
        seq.guide = guide
        seqs.append(seq)
    rows = VerifyRows.of(seqs)
    logits = mask_verify_rows(TARGET.expand(len(rows.seq), V).clone(), seqs, rows.seq.tolist(), rows.offset.tolist())
    return rejection_sample(logits, seqs).to_lists()


def _masked(allowed: list[int], params: SamplingParams) -> torch.Tensor:
    x = torch.full((V,), float("-inf"))
    x[allowed] = TARGET[allowed]
    return target_probs(x[None], [params])[0]


@pytest.mark.parametrize("one_hot", [False, True], ids=["model drafts", "prompt-lookup drafts"])
def test_speculation_under_a_grammar_keeps_the_masked_target_distribution(one_hot):
    """First token: the target masked to a-c; second, after an accepted 'b': masked to d-g. Drafts are drawn
    over the whole vocabulary (q favours tokens the grammar refuses), so most are cut."""
    params = SamplingParams(temperature=1.0)
    q = None if one_hot else target_probs(DRAFT[None], [params])[0]
    g = torch.Generator().manual_seed(7)
    n = 6000

    def draw(k: int) -> list[list[int]]:
        if q is None:
            return torch.randint(0, V, (n, k), generator=g).tolist()
        return torch.multinomial(q, n * k, replacement=True, generator=g).view(n, k).tolist()
    out = _constrained_verify(draw(3), q, params, seed=11)
    assert all(o[0] in (0, 1, 2) and all(t in (3, 4, 5, 6) for t in o[1:3]) and o[3:] in ([], [7]) for o in out)
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float() / n
    tv_first = 0.5 * (first - _masked([0, 1, 2], params)).abs().sum()
    out = _constrained_verify([[1] + d for d in draw(2)], q, params, seed=12)     # 'b' then drafts
    second = [o[1] for o in out if len(o) > 1 and o[0] == 1]
    freq = torch.bincount(torch.tensor(second), minlength=V).float() / len(second)
    tv_second = 0.5 * (freq - _masked([3, 4, 5, 6], params)).abs().sum()
    assert len(second) > 1500
    assert tv_first < 0.03 and tv_second < 0.04, (tv_first, tv_second)


def test_masks_filled_while_the_model_runs_equal_masks_filled_at_sampling():
    """engine.structured.StepMasks (filled on a thread during the forward) masks each constrained row as
    mask_logits does, leaves free rows alone, and fills a row it was not started with on the spot."""
    from engine.structured import StepMasks, mask_logits
    guides = _toy_guides(3)
    guides[1].accept(0)                                   # 'a': now d-g
    seqs = [verifying([], SamplingParams(), None, 0) for _ in range(4)]
    for s, g in zip(seqs, [guides[0], None, guides[1], guides[2]]):
        s.guide = g
    logits = torch.randn(4, V)
    want = mask_logits(logits, [s.guide for s in seqs])
    masks = StepMasks.start(seqs[:3], V)                  # the last was not scheduled with the others
    got = masks.apply(logits[:3], seqs[:3])
    assert torch.equal(got, want[:3]) and torch.equal(got[1], logits[1])
    assert torch.equal(StepMasks.start(seqs[:3], V).apply(logits, seqs), want)
    assert StepMasks.start([seqs[1]], V) is None          # nothing constrained: nothing to fill


def test_the_cpu_bitmask_applies_equal_xgrammars():
    """The C++ kernel (engine/cpu_attention.cpp) and the fallback without a compiler."""
    import xgrammar as xgr
    from engine import cpu_attention
    from engine.structured import _apply_by_bytes, apply_bitmask
    assert cpu_attention.available()
    g = torch.Generator().manual_seed(3)
    for vocab in (70, 4096):                                 # 70: the last word only partly used
        logits = torch.randn(5, vocab, generator=g)
        bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), dtype=torch.int32, generator=g)
        want = logits.clone()
        xgr.apply_token_bitmask_inplace(want, bitmask, indices=[0, 2, 3])
        for apply in (apply_bitmask, _apply_by_bytes):
            got = apply(logits, bitmask, [0, 2, 3])
            assert torch.equal(got, want) and torch.isinf(got).any()
            assert torch.equal(got[[1, 4]], logits[[1, 4]])   # rows not named are untouched
