"""Exact rejection sampling for speculative decoding (Leviathan et al.; gpt-fast, vLLM).

For each speculating sequence: accept draft token x_i with probability min(1, p_i(x) / q_i(x));
at the first rejection emit a token from normalize(max(p_i - q_i, 0)) and stop; if all k are
accepted emit a bonus token from p_k. The emitted tokens are distributed exactly as sampling the
target one token at a time. Greedy rows accept the longest prefix matching the target's argmax.
p and q are the *filtered* distributions (engine.sampler.target_probs) so temperature, top-k,
top-p and min-p apply to both alike. A one-hot q (n-gram drafts) is passed as draft_probs=None.
"""
from __future__ import annotations

import torch


def rejection_sample(draft_tokens: list[list[int]], target_probs: list[torch.Tensor],
                     draft_probs: list[torch.Tensor | None], greedy: list[bool],
                     generators: list[torch.Generator | None]) -> list[list[int]]:
    """Per sequence: draft_tokens [k], target_probs [k+1, V], draft_probs [k, V] or None (one-hot).

    Returns the emitted tokens: the accepted drafts plus one corrected or bonus token (1..k+1).
    """
    return [_one(d, p, q, g, gen) for d, p, q, g, gen in zip(draft_tokens, target_probs, draft_probs,
                                                               greedy, generators)]


def _one(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, greedy: bool,
         gen: torch.Generator | None) -> list[int]:
    out: list[int] = []
    if greedy:
        target = p.argmax(-1).tolist()
        for i, x in enumerate(draft):
            if x != target[i]:
                return out + [target[i]]
            out.append(x)
        return out + [target[len(draft)]]
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=gen))
        if qx > 0 and u * qx < px:                      # u < min(1, p/q) without dividing
            out.append(x)
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0                           # max(p - onehot(x), 0) keeps p elsewhere
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:                                # p == q: any rejection is measure-zero; use p
            residual, total = p[i], float(p[i].sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=gen)))
        return out
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]
