"""Sequence: one request's tokens, blocks, progress and timings as it moves through the engine."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from engine.kv_connector import ImportStats, RemotePrefill
from engine.sampling_params import SamplingParams
from engine.spec.metrics import SpecStats

if TYPE_CHECKING:
    import torch

_counter = itertools.count()


class Status(Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"     # blocks reserved, its prompt's K/V arriving
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]                  # prompt, then generated tokens
    params: SamplingParams
    priority: int = 0                     # lower runs first (vLLM's convention)
    prefill_only: bool = False            # prefill role: stop after the first token, keep blocks pinned
    num_prompt_tokens: int = 0
    seq_no: int = field(default_factory=lambda: next(_counter))    # FCFS order
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    block_table_epoch: int = 0            # bumped by the KVCacheManager when blocks leave or are replaced
    block_hashes: list[int] = field(default_factory=list)   # hashes of this sequence's full blocks
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_cached_tokens: int = 0            # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    finish_reason: str | None = None      # "stop" | "length" | "abort" | "migrated"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)   # by position; [0] is None
    sampling_seed: int = 0                # uint64 key of its random streams (engine.philox), set at add_request
    detok: object = None                  # engine.detokenizer.Detokenizer
    lora: object = None                   # engine.lora.LoRARequest: the adapter it runs under (None: the base)
    lora_key: str | None = None           # that adapter's key (engine.block_hash.namespace_key of its blocks)
    lora_held: bool = False               # it holds its adapter in the runner's host cache (until it ends)
    guide: object = None                  # engine.structured.Guide: its grammar state (structured output)
    pooling: object = None                # engine.pooling.PoolingParams: an embedding request (no token is sampled)
    pool_kind: str | None = None          # its pooling type (engine/pooling.py)
    pool_sum: torch.Tensor | None = None  # the sum of the hidden rows it pooled so far (fp32), and their count
    pool_rows: int = 0
    embedding: object = None              # np.ndarray: its embedding, once its prompt is computed
    min_stops: tuple[int, ...] = ()       # tokens kept from sampling while it has < params.min_tokens outputs
    allowed_ids: object = None            # np.ndarray of params.allowed_token_ids (the only tokens it samples)
    bad_word_ids: tuple[tuple[int, ...], ...] = ()   # params.bad_words as token ids, with and without a space
    num_streamed: int = 0                 # output tokens already reported in a RequestOutput
    spec_tokens: list[int] = field(default_factory=list)    # drafts to verify in the coming step
    spec_probs: torch.Tensor | None = None                    # their draft distributions q [k, V] (None: one-hot)
    spec: SpecStats = field(default_factory=SpecStats)
    remote: RemotePrefill | None = None   # decode role: prompt K/V to import (None once loaded or fallen back)
    pending_token: int | None = None      # a resumed import's last output (sent already): its K/V come after
                                          # the import's, so it joins token_ids once the load ends or fails
    kv_import: ImportStats = field(default_factory=ImportStats)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt positions have none yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """None of its prompt may come from the prefix cache: it reads every prompt position's logits or hidden
        state (prompt logprobs, mean or cls pooling)."""
        return self.wants_prompt_logprobs or self.pool_kind in ("mean", "cls")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def restore_pending(self) -> None:
        """The import ended (or fell back): the resumed last output token rejoins the sequence."""
        if self.pending_token is not None:
            self.token_ids.append(self.pending_token)
            self.pending_token = None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.seq_no)

    def __lt__(self, other: "Sequence") -> bool:      # for the waiting heap
        return self.sort_key < other.sort_key
