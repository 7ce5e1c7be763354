"""Adaptive speculation depth: choose k per request, each step, to maximise the batch's tokens/second.

The rule (what `DepthController.choose` does):
  A request whose drafts are accepted with probability a per position emits
  E(k) = 1 + a + a^2 + ... + a^k tokens from a verify step with k drafts. The step costs
      t = (A + B * T) + sum over draft depths j of (C + D * n_j)
  with T the batch's tokens (each speculating request adds k), n_j the requests drafting a j-th
  token, and A, B (target step) and C, D (one draft pass) measured: at start-up, then refitted
  online from every step. The batch emits R = sum E / t tokens per second. Raising one request
  from k to k+1 adds a^(k+1) tokens for B + D seconds (plus C if it opens depth k+1); an increment
  whose gain/cost beats the current R raises R. So take increments, largest gain first, while
  they beat R. k = 0 is what is left when no draft pays for itself: for requests whose drafts are
  mostly rejected, and at large batches, where B * T dominates and a verify token costs as much
  as a decoded one.
`a` is each request's running estimate (decayed counts, shrunk towards the engine-wide rate).
"""
from __future__ import annotations

import heapq
import math

DECAY = 0.9                  # a request's acceptance counts fade: it tracks the text as it changes
PRIOR_WEIGHT = 2.0           # pseudo-trials of the engine-wide rate in each request's estimate
PROBE_EVERY = 16             # a request left at k = 0 this many steps tries one draft again


class LinearCost:
    """y = a + b * x, fitted by exponentially weighted least squares, seeded with a prior line."""

    def __init__(self, a: float, b: float, decay: float = 0.98):
        self.a, self.b, self.decay = max(a, 0.0), max(b, 0.0), decay
        self.s = [0.0] * 5                                   # w, wx, wy, wxx, wxy
        for x in (1.0, 16.0):                                 # the prior as two weighted points
            self._add(x, self.a + self.b * x, 4.0)

    def _add(self, x: float, y: float, w: float) -> None:
        for i, v in enumerate((w, w * x, w * y, w * x * x, w * x * y)):
            self.s[i] += v

    def observe(self, x: float, y: float) -> None:
        if not (math.isfinite(y) and y >= 0):
            return
        self.s = [v * self.decay for v in self.s]
        self._add(float(x), float(y), 1.0)
        w, wx, wy, wxx, wxy = self.s
        mx, my = wx / w, wy / w
        var = wxx / w - mx * mx
        if var > 1e-6 * max(mx * mx, 1.0):                   # x varied enough to fit a slope
            self.b = max((wxy / w - mx * my) / var, 0.0)
        self.a = max(my - self.b * mx, 0.0)

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class DepthController:
    def __init__(self, max_k: int, adaptive: bool, verify: LinearCost, draft: LinearCost):
        self.max_k, self.adaptive = max_k, adaptive
        self.verify, self.draft = verify, draft
        self.global_acc, self.global_trials = 1.0, 2.0       # engine-wide prior: a = 0.5

    # -- acceptance estimates ---------------------------------------------------------------------
    def alpha(self, acc: float, trials: float) -> float:
        prior = self.global_acc / self.global_trials
        return (acc + PRIOR_WEIGHT * prior) / (trials + PRIOR_WEIGHT)

    def observe(self, stats, k: int, accepted: int) -> None:
        """A verify step with k drafts accepted `accepted`: positions tested = accepted, plus the
        rejected one if any (positions after a rejection were never tested)."""
        tested = accepted + (accepted < k)
        stats.acc = stats.acc * DECAY + accepted
        stats.trials = stats.trials * DECAY + tested
        self.global_acc = self.global_acc * 0.995 + accepted
        self.global_trials = self.global_trials * 0.995 + tested

    # -- the rule ---------------------------------------------------------------------------------
    def choose(self, alphas: list[float], limits: list[int], base_tokens: int) -> list[int]:
        """Depths for requests with acceptance estimates `alphas`, each capped by `limits` (drafts
        available or room left); `base_tokens` is the step's size without drafts."""
        if not self.adaptive:
            return [min(self.max_k, m) for m in limits]
        ks = [0] * len(alphas)
        tokens = float(len(alphas))                          # E(0) = 1 per request
        time_ = self.verify(base_tokens)
        depth_users: list[int] = [0] * (self.max_k + 1)      # requests drafting at each depth
        heap = [(-a, i) for i, (a, m) in enumerate(zip(alphas, limits)) if m > 0 and a > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            j = ks[i] + 1                                    # the depth this increment opens
            cost = self.verify.b + self.draft.b + (self.draft.a if depth_users[j] == 0 else 0.0)
            if -neg_gain * time_ <= tokens * cost:           # gain / cost <= R: no longer pays
                break
            ks[i] = j
            depth_users[j] += 1
            tokens += -neg_gain
            time_ += cost
            if j < min(limits[i], self.max_k):
                heapq.heappush(heap, (neg_gain * alphas[i], i))
        return ks
