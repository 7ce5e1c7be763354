"""Greedy comparisons with transformers: its reference tokens with their top logprobs, and the rule that reads
an fp32 near-tie as agreement (vLLM's check_logprobs_close). Baton against itself compares with `==`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K = 5                   # both tokens of a near-tie are in each other's top 5
MAX_LOGPROB_GAP = 0.01      # nats; fp32 kernels that sum in another order differ by ~1e-4, a real bug by far more


@dataclass
class Greedy:
    """A greedy continuation: its tokens and, per token, the top logprobs of the distribution it came from."""
    tokens: list[int]
    logprobs: list[dict[int, float]]


def hf_greedy(model, prompt_ids: list[int], n: int, top_k: int = TOP_K) -> Greedy:
    """transformers' greedy reference that never stops early (EOS disabled, like ignore_eos)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logprobs = []
    for step in out.logits:                                   # one [1, vocab] tensor per generated token
        top = step[0].float().log_softmax(-1).topk(top_k)
        logprobs.append(dict(zip(top.indices.tolist(), top.values.tolist())))
    return Greedy(out.sequences[0, ids.shape[1]:].tolist(), logprobs)


def baton_greedy(output) -> Greedy:
    """An engine RequestOutput run with SamplingParams(temperature=0, logprobs=TOP_K)."""
    return Greedy(list(output.token_ids), list(output.logprobs))


def check_greedy_close(ours: Greedy, theirs: Greedy, max_gap: float = MAX_LOGPROB_GAP) -> int | None:
    """Equal greedy tokens, or equal up to a near-tie: at the first token that differs, each side's token is in
    the other's top logprobs and neither side prefers its own by more than `max_gap`; the continuations part
    there, so comparing stops. Until then every token's logprob agrees within `max_gap`. Returns the index of
    the near-tie, None when every token is equal."""
    assert len(ours.tokens) == len(theirs.tokens), (len(ours.tokens), len(theirs.tokens))
    for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)):
        mine, other = ours.logprobs[i], theirs.logprobs[i]
        if a == b:
            assert abs(mine[a] - other[b]) <= max_gap, f"token {i} ({a}): logprob {mine[a]:.5f} vs {other[b]:.5f}"
            continue
        assert b in mine and a in other, f"token {i}: {a} vs {b}, not in each other's top {len(mine)}"
        gap = max(mine[a] - mine[b], other[b] - other[a])
        assert gap <= max_gap, f"token {i}: {a} vs {b}, a gap of {gap:.5f} nats is no near-tie"
        return i
    return None
