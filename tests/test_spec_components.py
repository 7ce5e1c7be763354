"""Speculative decoding parts: the rejection sampler keeps the target's distribution; n-gram lookup."""
from __future__ import annotations

import pytest
import torch

from engine.sampler import target_probs
from engine.sampling_params import SamplingParams
from engine.spec import NgramLookup, rejection_sample

V = 8
TARGET = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAFT = torch.tensor([0.0, 2.0, -1.0, 1.0, 0.5, 0.0, 1.5, 0.0])        # disagrees often


def _first_token_histogram(p: torch.Tensor, q: torch.Tensor | None, n: int, k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V)
    pk = p.expand(k + 1, V)
    for _ in range(n):
        if q is None:
            drafts = torch.randint(0, V, (k,), generator=g).tolist()      # an arbitrary one-hot "n-gram" draft
            qk = None
        else:
            drafts = torch.multinomial(q, k, replacement=True, generator=g).tolist()
            qk = q.expand(k, V)
        out = rejection_sample([drafts], [pk], [qk], [False], [g])[0]
        assert 1 <= len(out) <= k + 1
        counts[out[0]] += 1
    return counts / n


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_emitted_distribution_converges_to_the_target(params, one_hot):
    p = target_probs(TARGET[None], [params])[0]
    q = None if one_hot else target_probs(DRAFT[None], [params])[0]
    tv_small = sum(0.5 * (_first_token_histogram(p, q, 100, seed=10 + s) - p).abs().sum() for s in range(3)) / 3
    tv_large = 0.5 * (_first_token_histogram(p, q, 8000, seed=1) - p).abs().sum()
    assert tv_large < 0.025, f"total variation {tv_large:.3f} from the target"
    assert tv_large < tv_small                                          # distance shrinks with samples
    filtered = p == 0
    assert _first_token_histogram(p, q, 300, seed=2)[filtered].sum() == 0   # filters hold for p and q alike


def test_greedy_accepts_the_longest_matching_prefix_plus_one():
    p = torch.zeros(4, V)
    for i, t in enumerate([3, 1, 4, 5]):
        p[i, t] = 1.0
    assert rejection_sample([[3, 1, 4]], [p], [None], [True], [None]) == [[3, 1, 4, 5]]   # all + bonus
    assert rejection_sample([[3, 2, 4]], [p], [None], [True], [None]) == [[3, 1]]         # fixed at 1st miss
    assert rejection_sample([[0, 1, 4]], [p], [None], [True], [None]) == [[3]]


def test_identical_draft_is_always_accepted():
    p = target_probs(TARGET[None], [SamplingParams(temperature=1.0)])[0]
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        drafts = torch.multinomial(p, 4, replacement=True, generator=g).tolist()
        out = rejection_sample([drafts], [p.expand(5, V)], [p.expand(4, V)], [False], [g])[0]
        assert out[:4] == drafts and len(out) == 5


def test_ngram_proposes_what_followed_the_latest_match():
    prop = NgramLookup(prompt_lookup_min=1, prompt_lookup_max=3, num_speculative_tokens=3)
    assert prop.propose([1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]) == [7, 8, 1]   # newest 3-gram match
    assert prop.propose([5, 6, 7, 6]) == [7, 6]                                   # 1-gram fallback
    assert prop.propose([1, 2, 3, 4]) == []                                       # nothing repeats
    assert prop.propose([4, 4, 4, 4], k=2) == [4]
    with pytest.raises(ValueError):
        NgramLookup(prompt_lookup_min=3, prompt_lookup_max=2)
