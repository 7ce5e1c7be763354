"""Exact rejection sampling for speculative decoding (Leviathan et al.; gpt-fast, vLLM), on the device,
vectorised over every verifying sequence (drafts padded to the longest).

A sequence with drafts x_0..x_{k-1} has k + 1 target rows: p_i after its last token and i drafts.
- Drafts of a model (q given): accept x_i iff u_i * q_i(x_i) < p_i(x_i), u_i = Philox(seed, position
  of x_i, ACCEPT); at the first rejection emit a token from normalize(max(p_i - q_i, 0)) by inverse
  CDF with Philox(seed, position, RESIDUAL); if all k are accepted, the bonus token is p_k's plain
  sample. The emitted tokens are distributed exactly as sampling the target one token at a time.
- One-hot drafts (prompt lookup, q None) and greedy rows: every row takes the token plain sampling
  would (argmax, or the inverse-CDF draw with Philox(seed, position, SAMPLE)); drafts are accepted
  while they equal it, and the first that differs is replaced by it. For a one-hot draft that is
  the rejection rule above with a coupling: x is accepted with probability p(x) = min(1, p(x) / 1),
  and the replacement, given it is not x, is distributed as normalize(max(p - onehot(x), 0)). So a
  seeded request emits the very tokens it would emit without speculation.
p and q are the *filtered* distributions (engine.sampler.target_weights), so temperature, top-k,
top-p, min-p and penalties apply to both alike. Only the emitted ids leave the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.philox import ACCEPT, RESIDUAL, SAMPLE, uniforms
from engine.sampler import inverse_cdf, sample, target_weights, to_device, to_host

if TYPE_CHECKING:
    from engine.sequence import Sequence


@dataclass
class VerifyRows:
    """Where each target row of a verify batch belongs: sequence index and draft offset."""
    seq: np.ndarray          # [N]
    offset: np.ndarray       # [N]: the row samples position num_tokens + offset
    start: np.ndarray        # [S]: each sequence's first row

    @classmethod
    def of(cls, seqs: list[Sequence]) -> VerifyRows:
        sizes = np.fromiter((1 + len(s.spec_tokens) for s in seqs), dtype=np.int64, count=len(seqs))
        start = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        seq = np.repeat(np.arange(len(seqs)), sizes)
        return cls(seq, np.arange(len(seq)) - start[seq], start)

    def ahead(self, seqs: list[Sequence]) -> list[list[int]]:
        """Per row, the drafts before its position (their penalties count)."""
        return [seqs[s].spec_tokens[:o] for s, o in zip(self.seq.tolist(), self.offset.tolist())]


@dataclass
class Verified:
    tokens: torch.Tensor     # [S, K + 1] on the device: row s's first counts[s] entries are what it emits
    counts: torch.Tensor     # [S]: accepted drafts + 1

    def to_lists(self) -> list[list[int]]:
        tokens, counts = to_host(self.tokens, self.counts)
        return [tokens[s, :int(c)].astype(np.int64).tolist() for s, c in enumerate(counts)]


def rejection_sample(logits: torch.Tensor, seqs: list[Sequence]) -> Verified:
    """logits [sum(k + 1), V]: each sequence's target rows (penalties applied), in order. A sequence's
    drafts are seq.spec_tokens, q its seq.spec_probs [k, V] (None: one-hot)."""
    dev = logits.device
    rows = VerifyRows.of(seqs)
    ks = np.fromiter((len(s.spec_tokens) for s in seqs), dtype=np.int64, count=len(seqs))
    width = int(ks.max())
    seeds = np.fromiter((s.sampling_seed for s in seqs), dtype=np.uint64, count=len(seqs))
    first = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))   # first draft's position
    drafts = np.zeros((len(seqs), width), dtype=np.int64)
    for s, seq in enumerate(seqs):
        drafts[s, :ks[s]] = seq.spec_tokens
    valid = np.arange(width) < ks[:, None]
    draft_rows = np.minimum(rows.start[:, None] + np.arange(width), len(rows.seq) - 1)
    d, valid_t = to_device(drafts, dev), to_device(valid, dev)
    params = [seqs[s].params for s in rows.seq.tolist()]
    u = to_device(uniforms(seeds[rows.seq], first[rows.seq] + rows.offset, SAMPLE), dev)
    plain = sample(logits, params, u)                        # every row's plain sample (argmax if greedy)
    accept = (d == plain[to_device(draft_rows, dev)]) & valid_t
    model = [s for s, seq in enumerate(seqs) if seq.spec_probs is not None and not seq.params.greedy]
    if model:
        md = _ModelDrafts.of(logits, [seqs[s] for s in model], draft_rows[model], seeds[model], first[model])
        accept[model] = md.accept(d[model]) & valid_t[model]
    rejected = torch.cat([~accept, torch.ones(len(seqs), 1, dtype=torch.bool, device=dev)], dim=1)
    j = rejected.int().argmax(1)                             # the first rejection, or k: the bonus row
    final = plain[to_device(rows.start, dev) + j]
    if model:
        m = torch.tensor(model, device=dev)
        final[m] = torch.where(j[m] < to_device(ks[model], dev), md.residual(j[m]), final[m])
    tokens = torch.cat([d, d.new_zeros(len(seqs), 1)], dim=1).scatter_(1, j.unsqueeze(1), final.unsqueeze(1))
    return Verified(tokens, j + 1)


@dataclass
class _ModelDrafts:
    """The sequences whose drafts came from a model: p and q at each draft position [S, K, V]
    (padding repeats a real row) and their ACCEPT / RESIDUAL uniforms [S, K]."""
    p: torch.Tensor
    q: torch.Tensor
    u_accept: torch.Tensor
    u_residual: torch.Tensor

    @classmethod
    def of(cls, logits: torch.Tensor, seqs: list[Sequence], draft_rows: np.ndarray, seeds: np.ndarray,
           first: np.ndarray) -> _ModelDrafts:
        dev, (n, width) = logits.device, draft_rows.shape
        params = [s.params for s in seqs for _ in range(width)]
        w = target_weights(logits.index_select(0, to_device(draft_rows.reshape(-1), dev)), params)
        p = (w / w.sum(-1, keepdim=True)).view(n, width, -1)
        ks = np.fromiter((len(s.spec_tokens) for s in seqs), dtype=np.int64, count=n)
        q_idx = np.concatenate([[0], np.cumsum(ks)[:-1]])[:, None] + np.minimum(np.arange(width), ks[:, None] - 1)
        q = torch.cat([s.spec_probs for s in seqs]).index_select(0, to_device(q_idx.reshape(-1), dev))
        seeds, pos = np.repeat(seeds, width), (first[:, None] + np.arange(width)).reshape(-1)
        u = [to_device(uniforms(seeds, pos, purpose).reshape(n, width), dev) for purpose in (ACCEPT, RESIDUAL)]
        return cls(p, q.view(n, width, -1).to(p.dtype), *u)

    def accept(self, drafts: torch.Tensor) -> torch.Tensor:
        px = self.p.gather(2, drafts.unsqueeze(2)).squeeze(2).double()
        qx = self.q.gather(2, drafts.unsqueeze(2)).squeeze(2).double()
        return (qx > 0) & (self.u_accept * qx < px)          # u < min(1, p / q) without dividing

    def residual(self, j: torch.Tensor) -> torch.Tensor:
        """A token from normalize(max(p_j - q_j, 0)) at each sequence's first rejection j (from p_j where
        that is all zero: p == q, where a rejection has probability zero)."""
        at = j.clamp(max=self.p.shape[1] - 1)
        ar = torch.arange(len(j), device=j.device)
        pj, qj = self.p[ar, at], self.q[ar, at]
        r = (pj - qj).clamp_(min=0.0)
        r = torch.where(r.sum(-1, keepdim=True) > 0, r, pj)
        return inverse_cdf(r, self.u_residual[ar, at])
