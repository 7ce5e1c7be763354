"""How a check judges: tensors against a tolerance, and greedy tokens against a reference up to near-ties.

The greedy rule is vLLM's `check_logprobs_close`: where two systems' greedy tokens first differ, each side's
token must be in the other's top logprobs and neither side may prefer its own by more than a gap; the
continuations part there, so comparing stops. Until then every token's logprob must agree within the gap.
The tests (tests/greedy.py) and `baton check gpu` (check/models.py) both judge with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

TOP_K = 5                   # both tokens of a near-tie are in each other's top 5
MAX_LOGPROB_GAP = 0.01      # nats; fp32 kernels that sum in another order differ by ~1e-4, a real bug by far more


# -- tensors ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    """|out - ref| <= atol + rtol * |ref| everywhere (torch.allclose's rule)."""
    atol: float
    rtol: float = 0.0


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float
    mean_abs: float
    worst: float            # max of |out - ref| / (atol + rtol * |ref|): above 1 is outside the tolerance
    passed: bool

    def as_dict(self) -> dict:
        return {"max_abs_err": self.max_abs, "mean_abs_err": self.mean_abs, "worst_over_tolerance": self.worst,
                "passed": self.passed}


def error_stats(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> ErrorStats:
    """Errors of `out` against `ref`, both compared in fp32 on the CPU. A NaN or a shape mismatch fails."""
    out, ref = out.detach().float().cpu(), ref.detach().float().cpu()
    if out.shape != ref.shape:
        return ErrorStats(float("inf"), float("inf"), float("inf"), False)
    err = (out - ref).abs()
    worst = (err / (tol.atol + tol.rtol * ref.abs())).max().item() if err.numel() else 0.0
    max_abs, mean_abs = (err.max().item(), err.mean().item()) if err.numel() else (0.0, 0.0)
    passed = bool(torch.isfinite(out).all()) and worst <= 1.0          # NaN compares false: fails here
    return ErrorStats(max_abs, mean_abs, worst, passed)


# -- greedy tokens ----------------------------------------------------------------------------------
class GreedyMismatch(AssertionError):
    """Two greedy continuations that differ by more than a near-tie (an AssertionError, so tests may let it fail
    them as it is; raised explicitly, so `python -O` does not turn the check off)."""


@dataclass
class Greedy:
    """A greedy continuation: its tokens and, per token, the top logprobs of the distribution it came from."""
    tokens: list[int]
    logprobs: list[dict[int, float]]


def hf_greedy(model, prompts: list[list[int]], n: int, top_k: int = TOP_K) -> list[Greedy]:
    """transformers' greedy reference that never stops early (EOS disabled, like ignore_eos), for every prompt in
    one generate call: left-padded, with the attention mask (transformers then derives each row's positions from
    it), so n forwards serve the whole batch. Padding changes matmul shapes, so a logprob may move by ~1e-5: far
    inside the near-tie gap. Llama 4 runs one prompt at a time: transformers' Llama 4 takes its NoPE layers' query
    temperature from the cache's length, not from the position ids, so padding would shift it."""
    if getattr(model.config, "model_type", "") == "llama4_text" and len(prompts) > 1:
        return [hf_greedy(model, [p], n, top_k)[0] for p in prompts]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    logprobs: list[list[dict[int, float]]] = [[] for _ in prompts]
    for step in out.logits:                                   # one [batch, vocab] tensor per generated token
        top = step.float().log_softmax(-1).topk(top_k)
        for row, (idx, val) in enumerate(zip(top.indices.tolist(), top.values.tolist())):
            logprobs[row].append(dict(zip(idx, val)))
    return [Greedy(out.sequences[row, width:].tolist(), logprobs[row]) for row in range(len(prompts))]


def baton_greedy(output) -> Greedy:
    """An engine RequestOutput run with SamplingParams(temperature=0, logprobs=TOP_K)."""
    return Greedy(list(output.token_ids), list(output.logprobs))


def check_greedy_close(ours: Greedy, theirs: Greedy, max_gap: float = MAX_LOGPROB_GAP) -> int | None:
    """Equal greedy tokens, or equal up to a near-tie: at the first token that differs, each side's token is in
    the other's top logprobs and neither side prefers its own by more than `max_gap`; the continuations part
    there, so comparing stops. Until then every token's logprob agrees within `max_gap`. Returns the index of
    the near-tie, None when every token is equal; raises GreedyMismatch otherwise."""
    def require(ok: bool, why: str) -> None:
        if not ok:
            raise GreedyMismatch(why)

    require(len(ours.tokens) == len(theirs.tokens), f"lengths differ: {len(ours.tokens)} vs {len(theirs.tokens)}")
    for i, (a, b) in enumerate(zip(ours.tokens, theirs.tokens)):
        mine, other = ours.logprobs[i], theirs.logprobs[i]
        if a == b:
            require(abs(mine[a] - other[b]) <= max_gap, f"token {i} ({a}): logprob {mine[a]:.5f} vs {other[b]:.5f}")
            continue
        require(b in mine and a in other, f"token {i}: {a} vs {b}, not in each other's top {len(mine)}")
        gap = max(mine[a] - mine[b], other[b] - other[a])
        require(gap <= max_gap, f"token {i}: {a} vs {b}, a gap of {gap:.5f} nats is no near-tie")
        return i
    return None


@dataclass
class GreedyBatch:
    """A batch of greedy outputs against its references, each up to a near-tie (check_greedy_close)."""
    equal: int
    near_ties: list[int]
    errors: list[str]
    text: str                  # what the table shows

    @classmethod
    def compare(cls, ours: list, theirs: list, new_tokens: int, max_gap: float) -> "GreedyBatch":
        """ours, theirs: engine outputs (token_ids, logprobs) or Greedy references, in prompt order."""
        ties, errors = [], []
        for i, (a, b) in enumerate(zip(ours, theirs)):
            try:
                ties.append(check_greedy_close(a if isinstance(a, Greedy) else baton_greedy(a),
                                               b if isinstance(b, Greedy) else baton_greedy(b), max_gap))
            except GreedyMismatch as e:
                errors.append(f"prompt {i}: {e}")
        equal, near = sum(t is None for t in ties), [t for t in ties if t is not None]
        text = "; ".join(errors) or (f"{equal}/{len(ours)} prompts equal x {new_tokens} tokens, near-ties at "
                                     f"{near or 'none'}")
        return cls(equal, near, errors, text)
