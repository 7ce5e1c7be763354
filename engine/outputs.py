"""What the engine hands back: per-request outputs with streaming deltas and timings."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_prompt_tokens: int
    num_cached_tokens: int                 # prompt tokens served from the prefix cache
    num_output_tokens: int
    num_preemptions: int
    spec_num_drafts: int = 0               # verify steps with drafts (speculative decoding)
    spec_num_draft_tokens: int = 0         # drafts proposed
    spec_num_accepted_tokens: int = 0      # drafts accepted
    spec_draft_time: float = 0.0           # seconds of draft passes it took part in
    spec_verify_time: float = 0.0          # seconds of target steps that verified its drafts
    kv_transferred: bool = False           # its prompt's K/V came from another engine
    kv_transfer_blocks: int = 0            # blocks pulled (leading blocks cached here are not)
    kv_transfer_seconds: float = 0.0       # blocks reserved to K/V in place
    kv_transfer_error: str | None = None   # why an import fell back to a local prefill

    @property
    def spec_acceptance_rate(self) -> float | None:
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """Accepted drafts per verify step (a verify step emits one more token than this)."""
        return self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else None

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between generated tokens after the first (inter-token latency)."""
        if self.num_output_tokens < 2 or self.last_token_time is None or self.first_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                   # generated so far
    text: str                              # generated text so far (stop string cut off)
    new_token_ids: list[int]               # delta since the last output of this request
    new_text: str                          # text delta since the last output
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None   # per generated token: {token_id: logprob}
    prompt_logprobs: list[dict[int, float] | None] | None = None   # per prompt token (the first: None), vLLM's
    kv_blocks: list[int] = field(default_factory=list)   # prefill role: the pinned block ids
    embedding: np.ndarray | None = None    # an embedding request's vector (float32), once finished (engine/pooling.py)


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's answer for one prompt, in vLLM's shape (`out.outputs.embedding`)."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    metrics: RequestMetrics | None = None
