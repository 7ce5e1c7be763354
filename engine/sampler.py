"""Sampling: temperature, top-k, top-p, min-p, per-request seeds, top-n logprobs; one batched pass.

`target_probs` gives the filtered distribution a request samples from; speculative decoding uses
the same function for both the draft and the target, so their filters agree.

The filters never sort the whole vocabulary when they do not have to: a row's kept set is found
inside its K largest logits (`torch.topk`), K = its top_k, or a candidate set (256, then 4096) for
top-p / min-p rows, which is enough whenever those candidates already reach top_p (or already fall
below min_p * p_max). A row the candidates do not cover takes the full sort. Both ways run the same
cut (`_cut`), so the kept set of a row does not depend on which way it went, nor on the batch.

Sampling is an exponential race, argmax w / E with E ~ Exp(1), drawn only over the tokens that can
win (w > 0), in token-id order, from the row's own generator (or the sampler's).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

# candidate-set sizes tried, in turn, for top-p / min-p rows without top-k; then the full sort
_CANDIDATES = (256, 4096)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]     # per row: {token: logprob} incl. the sampled one


@dataclass
class _RowGroup:
    """A group of logits rows filtered alike. ids None: whole rows in vocabulary order, nothing filtered (vals = the row).
    Otherwise ids [r, K]: each row's K largest logits (vals, descending), of which keep says which
    survive the filters; every token outside ids is filtered."""
    rows: list[int]
    vals: torch.Tensor
    ids: torch.Tensor | None = None
    keep: torch.Tensor | None = None


def _scale(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=logits.dtype, device=logits.device)
    return logits / temps.unsqueeze(1)


def _top_k(p: SamplingParams, vocab: int) -> int:
    return p.top_k if 0 < p.top_k < vocab else 0      # top_k >= vocab keeps everything: off


def _filters(p: SamplingParams, vocab: int) -> bool:
    return _top_k(p, vocab) > 0 or p.top_p < 1.0 or p.min_p > 0


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows] for ascending distinct rows, without a copy when that is all of t."""
    return t if len(rows) == t.shape[0] else t[rows]


def _row_groups(logits: torch.Tensor, params: list[SamplingParams]) -> list[_RowGroup]:
    """logits: temperature-scaled [R, V]. Splits the rows into groups whose kept sets are known."""
    vocab = logits.shape[-1]
    plain = [i for i, p in enumerate(params) if not _filters(p, vocab)]
    groups = [_RowGroup(plain, _take(logits, plain))] if plain else []
    pending = [i for i, p in enumerate(params) if _filters(p, vocab)]
    if not pending:
        return groups
    x, sub = _take(logits, pending), [params[i] for i in pending]
    ks = [_top_k(p, vocab) for p in sub]
    first = max(max(ks), _CANDIDATES[0]) if min(ks) == 0 else max(ks)
    sizes = [k for k in (first, *(c for c in _CANDIDATES[1:] if c > first)) if 2 * k < vocab]
    live = list(range(len(pending)))                        # rows of x not yet covered
    s_full = None
    for size in sizes + [vocab]:
        xl = _take(x, live)
        if size == vocab:                                   # the full sort: covers every row
            vals, ids = xl.sort(dim=-1, descending=True)
        else:
            vals, ids = xl.topk(size, dim=-1)
        if s_full is None:      # the normalizer of a top-p row without top-k: sum of exp(x - max), float64
            s_full = torch.zeros(len(pending), dtype=torch.float64, device=x.device)
            need = [j for j, (k, p) in enumerate(zip(ks, sub)) if k == 0 and p.top_p < 1.0]
            if need:
                s_full[need] = (_take(x, need) - vals[need, :1]).exp_().sum(-1, dtype=torch.float64)
        keep, covered = _cut(vals, [sub[j] for j in live], s_full[live], vocab)
        done = covered.nonzero().squeeze(1)
        if len(done) == len(live):
            groups.append(_RowGroup([pending[j] for j in live], vals, ids, keep))
            return groups
        if len(done):
            groups.append(_RowGroup([pending[live[j]] for j in done.tolist()], vals[done], ids[done], keep[done]))
        live = [j for j, c in zip(live, covered.tolist()) if not c]
    raise AssertionError("unreachable: the full sort covers every row")


def _cut(vals: torch.Tensor, params: list[SamplingParams], s_full: torch.Tensor,
         vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The filters on each row's K largest temperature-scaled logits `vals` [R, K] (descending).

    top-k keeps the first top_k; top-p then keeps a token while the mass before it, in the top-k
    renormalized distribution (the full one without top-k), is < top_p; min-p drops tokens with
    p < min_p * p_max. With w = exp(x - max): p_max = 1 / s, so min-p is w < min_p, and top-p is
    (w's prefix sum before the token) / s >= top_p, s = sum of w over the top-k (or the row, s_full).
    Returns keep [R, K] and covered [R]: whether every token after the K is filtered too.
    """
    rows, size = vals.shape
    dev = vals.device
    w = (vals - vals[:, :1]).exp().double()
    csum = w.cumsum(-1)
    before = torch.cat([torch.zeros(rows, 1, dtype=csum.dtype, device=dev), csum[:, :-1]], dim=1)
    ks = torch.tensor([_top_k(p, vocab) for p in params], device=dev)
    has_k = ks > 0
    s = torch.where(has_k, csum.gather(1, (ks - 1).clamp(0, size - 1).unsqueeze(1)).squeeze(1), s_full)
    has_p = torch.tensor([p.top_p < 1.0 for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float64, device=dev)
    ranks = torch.arange(size, device=dev)
    drop = has_k.unsqueeze(1) & (ranks >= ks.unsqueeze(1))
    drop |= has_p.unsqueeze(1) & (before / s.unsqueeze(1) >= top_p.unsqueeze(1))
    drop |= w < min_p.unsqueeze(1)
    drop[:, 0] = False
    covered = has_k | (size == vocab)
    covered |= has_p & (csum[:, -1] / s >= top_p)            # the token after the K is cut by top-p
    covered |= w[:, -1] < min_p                              # ... or by min-p, as are all after it
    return ~drop, covered


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p applied (filtered entries at -inf)."""
    logits = _scale(logits, params)
    out = torch.full_like(logits, float("-inf"))
    for g in _row_groups(logits, params):
        if g.ids is None:
            out[g.rows] = g.vals
        else:
            out[g.rows] = out[g.rows].scatter_(-1, g.ids, g.vals.masked_fill(~g.keep, float("-inf")))
    return out


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return apply_filters(logits, params).softmax(-1)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator | None = None) -> torch.Tensor:
    """Exponential race (argmax p/E, E ~ Exp(1)) per row, with draws only where p > 0, in token
    order, from the row's generator (`default` for None)."""
    return _race(probs, generators, default)


def _race(weights: torch.Tensor, generators: list[torch.Generator | None],
          default: torch.Generator | None) -> torch.Tensor:
    """argmax over columns of weights / E (weights >= 0, not necessarily normalized); a row's draws,
    one per positive weight, in column order, come from its own generator (`default` for None), so
    a seeded row's result depends on that row alone."""
    support = weights > 0
    e = torch.empty_like(weights)
    unseeded = [r for r, g in enumerate(generators) if g is None]
    if unseeded:                                            # one block from `default`, in row order
        mask = _take(support, unseeded)
        block = torch.full_like(mask, float("inf"), dtype=weights.dtype)
        block[mask] = torch.empty(int(mask.sum()), dtype=weights.dtype,
                                  device=weights.device).exponential_(generator=default)
        e[unseeded] = block
    for r, g in enumerate(generators):
        if g is None:
            continue
        n = int(support[r].sum())
        if n == weights.shape[1]:
            e[r].exponential_(generator=g)
        else:
            e[r].fill_(float("inf"))
            e[r, support[r]] = torch.empty(n, dtype=e.dtype, device=e.device).exponential_(generator=g)
    return (weights / e).argmax(-1)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SampleResult:
        logits = logits.float().cpu()
        tokens = torch.empty(len(params), dtype=torch.long)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        greedy = [i for i, p in enumerate(params) if p.greedy]
        if greedy:
            tokens[greedy] = _take(logits, greedy).argmax(-1)
        if sampled:
            tokens[sampled] = self._sample(_take(logits, sampled), [params[i] for i in sampled],
                                           [generators[i] for i in sampled])
        token_list = tokens.tolist()
        return SampleResult(token_list, logprobs(logits, params, token_list))

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams],
                generators: list[torch.Generator | None]) -> torch.Tensor:
        """sample_from_probs(target_probs(logits, params)) without the dense [R, V] distribution: the
        race runs over each row's kept tokens (in token order), weights exp(x - max) (the softmax for
        rows without filters, exactly as the dense path)."""
        out = torch.empty(len(params), dtype=torch.long)
        for g in _row_groups(_scale(logits, params), params):
            gens = [generators[i] for i in g.rows]
            if g.ids is None:                               # as target_probs + sample_from_probs
                out[g.rows] = _race(g.vals.softmax(-1), gens, self.generator)
                continue
            w = (g.vals - g.vals[:, :1]).exp_().masked_fill_(~g.keep, 0.0)
            if g.ids.shape[1] == logits.shape[1]:           # the full sort: back to token order
                out[g.rows] = _race(torch.zeros_like(w).scatter_(-1, g.ids, w), gens, self.generator)
            else:
                ids, order = g.ids.sort(-1)
                pick = _race(w.gather(-1, order), gens, self.generator)
                out[g.rows] = ids.gather(-1, pick.unsqueeze(1)).squeeze(1)
        return out


def logprobs(logits: torch.Tensor, params: list[SamplingParams], tokens: list[int]) -> list[dict[int, float] | None]:
    """Logprobs of the model's raw distribution (before temperature and filters), as vLLM does."""
    out: list[dict[int, float] | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return out
    lp = logits[rows].log_softmax(-1)
    n = max(params[i].logprobs for i in rows)
    top_v, top_i = lp.topk(max(n, 1), dim=-1)
    for r, i in enumerate(rows):
        k = params[i].logprobs
        d = {int(t): float(v) for t, v in zip(top_i[r, :k].tolist(), top_v[r, :k].tolist())}
        d[tokens[i]] = float(lp[r, tokens[i]])
        out[i] = d
    return out
