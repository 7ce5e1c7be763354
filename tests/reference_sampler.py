"""The exact samplers Baton used before sampling moved to the device, kept as references for the
statistical tests: an exponential race (argmax w / E, E ~ Exp(1)) from torch generators, and the
per-draft rejection loop on host tensors. Both share the engine's filters (engine.sampler)."""
from __future__ import annotations

import torch

from engine.sampler import _row_groups, _scale, _take
from engine.sampling_params import SamplingParams


def race(weights: torch.Tensor, generators: list[torch.Generator | None],
         default: torch.Generator | None) -> torch.Tensor:
    """argmax over columns of weights / E (weights >= 0); a row's draws, one per positive weight, in
    column order, come from its own generator (`default` for None)."""
    support = weights > 0
    e = torch.empty_like(weights)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if unseeded:
        mask = _take(support, unseeded)
        block = torch.full_like(mask, float("inf"), dtype=weights.dtype)
        block[mask] = torch.empty(int(mask.sum()), dtype=weights.dtype).exponential_(generator=default)
        e[unseeded] = block
    for r, g in enumerate(generators):
        if g is None:
            continue
        e[r].fill_(float("inf"))
        e[r, support[r]] = torch.empty(int(support[r].sum()), dtype=e.dtype).exponential_(generator=g)
    return (weights / e).argmax(-1)


class ReferenceSampler:
    """The old Sampler: race over each row's kept tokens, in token order."""

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        logits = logits.float()
        out = torch.empty(len(params), dtype=torch.long)
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            out[greedy] = logits[greedy].argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            out[sampled] = self._sample(_take(logits, sampled), [params[i] for i in sampled],
                                        [generators[i] for i in sampled])
        return out.tolist()

    def _sample(self, logits, params, generators) -> torch.Tensor:
        out = torch.empty(len(params), dtype=torch.long)
        for g in _row_groups(_scale(logits, params), params):
            gens = [generators[i] for i in g.rows]
            if g.ids is None:
                out[g.rows] = race(g.vals.softmax(-1), gens, self.generator)
                continue
            w = (g.vals - g.vals[:, :1]).exp_().masked_fill_(~g.keep, 0.0)
            if g.ids.shape[1] == logits.shape[1]:
                out[g.rows] = race(torch.zeros_like(w).scatter_(-1, g.ids, w), gens, self.generator)
            else:
                ids, order = g.ids.sort(-1)
                pick = race(w.gather(-1, order), gens, self.generator)
                out[g.rows] = ids.gather(-1, pick.unsqueeze(1)).squeeze(1)
        return out


def reference_rejection(draft: list[int], p: torch.Tensor, q: torch.Tensor | None, greedy: bool,
                        gen: torch.Generator) -> list[int]:
    """One sequence: draft [k], p [k+1, V] target probabilities, q [k, V] or None (one-hot)."""
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
        if qx > 0 and u * qx < px:
            out.append(x)
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_(min=0.0)
        total = float(residual.sum())
        if total <= 0.0:
            residual, total = p[i], float(p[i].sum())
        out.append(int(torch.multinomial(residual / total, 1, generator=gen)))
        return out
    return out + [int(torch.multinomial(p[len(draft)], 1, generator=gen))]
