"""Adaptive speculation depth: choose k per request, each step, to maximise the batch's tokens/second.

The rule (what `DepthController.choose` does):
  A request whose drafts are accepted with probability a per position emits
  E(k) = 1 + a + a^2 + ... + a^k tokens from a verify step with k drafts. The step costs
      t = (A + B * T) + sum over draft depths j of (C + D * n_j)
  with T the batch's tokens (each speculating request adds k), n_j the requests drafting a j-th
  token, and A + B*T (target step; really a measured table, as GEMM cost steps at tile
  boundaries, so B is the local slope) and C, D (one draft pass) measured at start-up, then
  corrected online from every step. The batch emits R = sum E / t tokens per second. Raising one
  request from k to k+1 adds a^(k+1) tokens for B + D seconds (plus C if it opens depth k+1); an increment
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

    def marginal(self, x: float) -> float:
        return self.b


class StepCost:
    """Seconds of a target step over T tokens: a table measured at start-up, interpolated, scaled
    online by observed/predicted. Not a line, because it is not one: on a CPU, GEMM time jumps when
    T crosses a register-tile boundary (32 -> 33 rows costs far more than 1/32 of a step)."""

    def __init__(self, points: list[tuple[int, float]]):
        self.xs = [float(x) for x, _ in points]
        self.ys = [max(y, 0.0) for _, y in points]
        self.scale = 1.0

    def _table(self, x: float) -> float:
        xs, ys = self.xs, self.ys
        if x <= xs[0]:
            return ys[0]
        for i in range(1, len(xs)):
            if x <= xs[i]:
                return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
        return ys[-1] + slope * (x - xs[-1])

    def __call__(self, x: float) -> float:
        return self.scale * self._table(x)

    def marginal(self, x: float) -> float:
        """Seconds per extra token near x, averaged over the next 8 (a tile's worth)."""
        return max(self(x + 8) - self(x), 0.0) / 8

    def observe(self, x: float, y: float) -> None:
        pred = self._table(x)
        if pred > 0 and math.isfinite(y) and y > 0:
            self.scale = min(max(0.9 * self.scale + 0.1 * (y / pred), 0.25), 4.0)


class DepthController:
    def __init__(self, max_k: int, adaptive: bool, verify: "StepCost | LinearCost", draft: LinearCost):
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
        added = 0
        depth_users: list[int] = [0] * (self.max_k + 1)      # requests drafting at each depth
        heap = [(-a, i) for i, (a, m) in enumerate(zip(alphas, limits)) if m > 0 and a > 0]
        heapq.heapify(heap)
        while heap:
            neg_gain, i = heapq.heappop(heap)
            j = ks[i] + 1                                    # the depth this increment opens
            cost = (self.verify.marginal(base_tokens + added) + self.draft.b
                    + (self.draft.a if depth_users[j] == 0 else 0.0))
            if -neg_gain * time_ <= tokens * cost:           # gain / cost <= R: no longer pays
                break
            ks[i] = j
            added += 1
            depth_users[j] += 1
            tokens += -neg_gain
            time_ += cost
            if j < min(limits[i], self.max_k):
                heapq.heappush(heap, (neg_gain * alphas[i], i))
        return ks
