"""Admission control at the ingress: beyond capacity, a 429 with Retry-After now instead of a place in a
queue that grows without bound and answers every request late.

Two budgets, both kept here from the requests this ingress replica admitted (exact and immediate, no
stats to wait for; with several ingress replicas each holds its share of the KV budget):

  time   A request's predicted wait for its first token is the prompt tokens admitted ahead of it and
         not yet past their first token, plus its own uncached ones, over the measured prefill rate
         (prompt tokens brought to their first token per second of time with any queued: the rate the
         cluster actually delivers, which follows the prefill pool as it scales). Predicted beyond
         `ttft_slo_s`: 429, Retry-After the time the excess takes to drain. With nothing queued a request
         is always admitted: an idle cluster serves even a prompt slower than the SLO. The prediction
         covers queued prefill work only; what a first token takes beyond it (the KV hand-off, the first
         decode step, the trip back) is learnt from admitted requests, as TCP learns its retransmit
         timeout: a margin of the mean excess plus twice its mean deviation is added to every prediction.
  KV     Admitted requests' tokens (prompt plus generated so far) against the decode pool's KV cache
         times `kv_budget`: a new prompt that does not fit gets a 429.

Uncached tokens: the prompt less the longest prefix any replica caches (the router's index mirror).
"""
from __future__ import annotations

import math
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable

from prometheus_client import Counter, Gauge

from router.config import AdmissionConfig
from router.openai_protocol import OpenAIError

REJECTED = Counter("baton_admission_rejected", "Requests refused with 429 by admission control, by budget",
                   ["reason"])
ADMITTED = Counter("baton_admission_admitted", "Requests admitted by admission control")
QUEUED = Gauge("baton_admission_queued_prompt_tokens", "Admitted prompt tokens not yet past their first token "
                                                       "(this ingress replica)")
RATE = Gauge("baton_admission_prefill_tokens_per_second", "Measured rate at which admitted prompt tokens reach "
                                                          "their first token (this ingress replica)")
MARGIN = Gauge("baton_admission_first_token_margin_seconds", "Learnt time a first token takes beyond its "
                                                              "predicted queue wait (mean + 2 deviations)")
KV_TOKENS = Gauge("baton_admission_kv_tokens", "Tokens of admitted requests held in the decode pool's KV "
                                               "(prompt plus generated so far; this ingress replica)")

RATE_TAU_S = 30.0               # the prefill rate is an exponentially weighted average over about this long
MIN_BUSY_S = 0.5                # below this much measured busy time the rate is unknown (only the cap applies)
KV_RETRY_AFTER_S = 2
MARGIN_GAIN = 0.125             # weight of each new sample in the margin's mean and deviation (TCP's 1/8)


@dataclass
class Ticket:
    """One admitted request: its choices' progress, released exactly once per choice."""
    owner: "Admission"
    queued: dict[int, int]                      # choice -> prompt tokens still waiting for the first token
    kv: dict[int, int]                          # choice -> tokens it holds in the decode pool's KV
    admitted_at: float = 0.0
    predicted_s: float | None = None            # predicted queue wait of a one-prompt request: the margin's sample
    done: set[int] = field(default_factory=set)

    def progress(self, choice: int, new_tokens: int) -> None:
        """A delta of `choice` arrived (its first one ends its wait) carrying `new_tokens` tokens."""
        self.owner._progress(self, choice, new_tokens)

    def release(self, choice: int) -> None:
        """`choice` finished, failed or was abandoned: its tokens leave both budgets."""
        self.owner._release(self, choice)

    def release_all(self) -> None:
        for choice in list(self.kv):
            self.owner._release(self, choice)

    def release_with(self, body) -> None:
        """Release whatever is left when `body` (a streaming response's generator) is collected: a client that
        leaves before the server starts the body never runs the generator, nor so its own `finally`."""
        weakref.finalize(body, self.release_all).atexit = False


class Admission:
    def __init__(self, config: AdmissionConfig, kv_capacity_tokens: Callable[[], int] = lambda: 0,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.kv_capacity = kv_capacity_tokens          # this ingress replica's share of the decode pool's KV, now
        self.clock = clock
        self._lock = threading.Lock()
        self.queued = 0
        self.kv_tokens = 0
        self._tokens_acc = 0.0                         # decayed prompt tokens that reached a first token
        self._busy_acc = 0.0                           # decayed seconds with something queued
        self._mark = clock()
        self._excess, self._excess_dev = 0.0, 0.0      # first token beyond the prediction: mean, mean deviation

    # -- the rate ---------------------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.clock()
        dt = max(now - self._mark, 0.0)
        if dt:
            decay = math.exp(-dt / RATE_TAU_S)
            self._tokens_acc *= decay
            self._busy_acc = self._busy_acc * decay + (RATE_TAU_S * (1 - decay) if self.queued else 0.0)
            self._mark = now

    def rate(self) -> float | None:
        """Prompt tokens per second brought to their first token while busy; None until measured."""
        with self._lock:
            self._advance()
            return self._rate()

    def _rate(self) -> float | None:
        return self._tokens_acc / self._busy_acc if self._busy_acc >= MIN_BUSY_S and self._tokens_acc > 0 else None

    def margin(self) -> float:
        """Seconds a first token takes beyond its predicted queue wait, with room for its spread (below zero
        where predictions run long: requests queued behind a prefill that already finished)."""
        return self._excess + 2 * self._excess_dev

    def _learn(self, t: Ticket) -> None:
        if t.predicted_s is None:
            return
        err = (self.clock() - t.admitted_at - t.predicted_s) - self._excess
        self._excess += MARGIN_GAIN * err
        self._excess_dev += MARGIN_GAIN * (abs(err) - self._excess_dev)
        t.predicted_s = None

    # -- admission --------------------------------------------------------------------------------
    def admit(self, uncached: list[int], prompt_tokens: list[int], n: int) -> Ticket:
        """A request of len(uncached) prompts (tokens to compute, tokens in all) with n choices each, or an
        OpenAIError(429) carrying Retry-After."""
        need = sum(uncached)
        kv_need = sum(prompt_tokens) * n
        with self._lock:
            self._advance()
            rate = self._rate()
            predicted = (self.queued + need) / rate if rate is not None else None
            slo, cap = self.config.ttft_slo_s, self.config.max_queued_prompt_tokens
            if self.config.enabled and self.queued > 0:
                if predicted is not None and predicted + self.margin() > slo:
                    wait = predicted + self.margin()
                    self._reject("ttft", wait - slo, f"the predicted wait for a first token ({wait:.1f} s) "
                                                     f"exceeds the {slo:g} s objective")
                if cap is not None and self.queued + need > cap:
                    drain = (self.queued + need - cap) / rate if rate else 1.0
                    self._reject("queue", drain, f"{self.queued} prompt tokens are queued (cap {cap})")
            if self.config.enabled and self.kv_tokens > 0 and \
                    self.kv_tokens + kv_need > (self.kv_capacity() or float("inf")) * self.config.kv_budget:
                self._reject("kv", KV_RETRY_AFTER_S, "the decode pool's KV cache is full")
            t = Ticket(self, {}, {}, admitted_at=self.clock(),
                       predicted_s=predicted if len(uncached) == 1 else None)
            for p, (u, tokens) in enumerate(zip(uncached, prompt_tokens)):
                for j in range(n):
                    c = p * n + j
                    t.queued[c] = u if j == 0 else 0          # the n choices of a prompt share its prefix
                    t.kv[c] = tokens
            self.queued += need
            self.kv_tokens += kv_need
            ADMITTED.inc()
            self._export()
            return t

    def _reject(self, reason: str, retry_after_s: float, why: str) -> None:
        REJECTED.labels(reason).inc()
        retry = min(max(math.ceil(retry_after_s), 1), self.config.max_retry_after_s)
        raise OpenAIError(429, f"The server is at capacity: {why}. Retry after {retry} s.", "RateLimitError",
                          code="rate_limit_exceeded", headers={"Retry-After": str(retry)})

    def _progress(self, t: Ticket, choice: int, new_tokens: int) -> None:
        with self._lock:
            if choice in t.done:
                return
            self._advance()
            q = t.queued.pop(choice, 0)
            if choice not in t.kv:
                return
            if q:
                self.queued -= q
                self._tokens_acc += q
                self._learn(t)
            t.kv[choice] += new_tokens
            self.kv_tokens += new_tokens
            self._export()

    def _release(self, t: Ticket, choice: int) -> None:
        with self._lock:
            if choice in t.done:
                return
            t.done.add(choice)
            self._advance()
            self.queued -= t.queued.pop(choice, 0)              # never reached a first token: no rate sample
            self.kv_tokens -= t.kv.pop(choice, 0)
            self._export()

    def _export(self) -> None:
        QUEUED.set(self.queued)
        KV_TOKENS.set(self.kv_tokens)
        r = self._rate()
        RATE.set(r or 0.0)
        MARGIN.set(self.margin())
