"""Speculation counters, per request (SpecStats) and per engine (SpecMetrics), vLLM's names.

acceptance rate = accepted drafts / proposed drafts; mean accepted length = accepted drafts per
verify step that had drafts (so a verify step emits 1 + that many tokens on average).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    """One request's speculation: counters it reports, and the running estimate adaptive depth uses."""
    num_drafts: int = 0                 # verify steps in which it had at least one draft
    num_draft_tokens: int = 0           # drafts proposed (and verified)
    num_accepted_tokens: int = 0        # drafts the target accepted
    draft_time: float = 0.0             # seconds of draft steps it took part in
    verify_time: float = 0.0            # seconds of target steps in which it verified drafts
    acc: float = 0.0                    # decayed accepted positions (adaptive depth's estimate)
    trials: float = 0.0                 # decayed tested positions
    idle_steps: int = 0                 # consecutive decode steps at k = 0 (a probe follows)
    shadow: int | None = None           # ngram at k = 0: the draft it would have proposed

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


@dataclass
class SpecMetrics:
    """Engine-wide totals; `accepted_per_position[i]` counts drafts accepted at depth i + 1."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    draft_time: float = 0.0
    verify_time: float = 0.0
    num_steps_k: dict[int, int] = field(default_factory=dict)        # chosen depth -> request-steps
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, k: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += k
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < k:
            self.accepted_per_position.extend([0] * (k - len(self.accepted_per_position)))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None
        mean = self.num_accepted_tokens / self.num_drafts if self.num_drafts else None
        return {"spec_num_drafts": self.num_drafts, "spec_num_draft_tokens": self.num_draft_tokens,
                "spec_num_accepted_tokens": self.num_accepted_tokens, "spec_acceptance_rate": rate,
                "spec_mean_accepted_length": mean, "spec_draft_time_s": self.draft_time,
                "spec_verify_time_s": self.verify_time,
                "spec_accepted_per_position": list(self.accepted_per_position),
                "spec_depth_histogram": dict(sorted(self.num_steps_k.items()))}
