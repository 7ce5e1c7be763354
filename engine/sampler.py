"""Sampling: temperature, top-k, top-p, min-p, per-request seeds, top-n logprobs; one batched pass.

`target_probs` gives the filtered distribution a request samples from; speculative decoding uses
the same function for both the draft and the target, so their filters agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]     # per row: {token: logprob} incl. the sampled one


def apply_filters(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature-scaled logits with top-k / top-p / min-p applied (filtered entries at -inf)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         dtype=logits.dtype, device=logits.device)
    logits = logits / temps.unsqueeze(1)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(-1)
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=probs.device)
        cut = probs < min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(cut, float("-inf"))
    return logits


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    return apply_filters(logits, params).softmax(-1)


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= k.unsqueeze(1)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=logits.device)
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = probs.cumsum(-1) - probs                  # keep a token while the mass before it < p
    drop |= mass_before >= top_p.unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def sample_from_probs(probs: torch.Tensor, generators: list[torch.Generator | None],
                      default: torch.Generator | None = None) -> torch.Tensor:
    """Exponential race (argmax p/E, E ~ Exp(1)): one draw per row, per-row generators honoured."""
    q = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        q[unseeded] = torch.empty((len(unseeded), probs.shape[1]), dtype=probs.dtype,
                                  device=probs.device).exponential_(generator=default)
    for i, g in enumerate(generators):
        if g is not None:
            q[i].exponential_(generator=g)
    return (probs / q).argmax(-1)


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> SampleResult:
        logits = logits.float().cpu()
        tokens = logits.argmax(-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            probs = target_probs(logits[sampled], [params[i] for i in sampled])
            tokens[sampled] = sample_from_probs(probs, [generators[i] for i in sampled], self.generator)
        token_list = tokens.tolist()
        return SampleResult(token_list, self._logprobs(logits, params, token_list))

    @staticmethod
    def _logprobs(logits, params, tokens) -> list[dict[int, float] | None]:
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
