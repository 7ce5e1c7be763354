"""Iteration-level scheduler: continuous batching, chunked prefill, prefix-cache hits, preemption.

Every step has a token budget (max_num_batched_tokens). Running sequences go first (a decode costs
one token, or 1 + k with k draft tokens to verify, cut to the budget; an unfinished prompt a chunk
of what is left); waiting ones join, highest priority then
oldest first, while budget, max_num_seqs and KV blocks allow. When blocks run out, the lowest
priority, newest running sequence is preempted by recompute: its blocks are freed (they stay in the
prefix cache until reused, so the recompute is often a cache hit) and it waits again.

A request whose prompt K/V come from another engine (decode role, `seq.remote`) waits in the same
queue, in the same order, but needs no token budget: once a step's budget is spent, imports further back
start their loads too. Admitted, it takes a slot (max_num_seqs) and blocks for its whole prompt,
and waits WAITING_FOR_REMOTE_KVS while the connector fills them; then it runs (and may be preempted)
like any other. If its deadline passes before it is admitted, or the load fails, it is prefilled here.
A prefix pull (`seq.remote.num_tokens`) reserves and fills only the leading blocks another engine caches;
then the sequence runs as a prefill with those tokens computed.
"""
from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from engine.config import EngineConfig
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector
from engine.sequence import Sequence, Status

log = logging.getLogger(__name__)


def attention_pairs(new: int, cached: int) -> float:
    """A chunk of `new` tokens after `cached` ones attends to cached + its own earlier tokens (causal)."""
    return new * cached + new * (new + 1) / 2


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def shape(self) -> tuple[int, float, int, int]:
        """The step's shape before it runs, as the planner's cost models read it (plan/cost.py Batch): new
        tokens, attention pairs, sequences, and the KV tokens it reads (each sequence's cached + new)."""
        tokens, pairs, context = 0, 0.0, 0
        for seq, n in self.scheduled:
            done = seq.num_computed_tokens
            tokens += n
            pairs += attention_pairs(n, done)
            context += done + n
        return tokens, pairs, len(self.scheduled), context


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, clock: Callable[[], float] = time.time):
        self.config = config
        self.kv = kv
        self.clock = clock                         # unix time, for import deadlines
        self.connector: KVConnector | None = None  # decode role: what fills imported requests' blocks
        self.waiting: list[Sequence] = []          # heap on (priority, seq_no)
        self.running: list[Sequence] = []
        self.loading: dict[str, Sequence] = {}     # WAITING_FOR_REMOTE_KVS, and aborted ones whose load is in flight
        self.num_preemptions_total = 0

    # -- queue ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    @property
    def num_seqs(self) -> int:
        """Sequences holding a slot (max_num_seqs): running, and imports whose K/V are arriving."""
        return len(self.running) + sum(not s.is_finished for s in self.loading.values())

    @property
    def num_awaiting_room(self) -> int:
        """Imports still waiting for blocks."""
        return sum(s.remote is not None for s in self.waiting)

    def remove(self, seq: Sequence) -> bool:
        """Take a sequence out of the queues (finished or aborted). False if it still holds its blocks
        because a transfer may write into them (freed when the load ends); else the caller frees them."""
        if seq.request_id in self.loading:
            self.connector.cancel_load(seq.request_id)
            return False
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            heapq.heapify(self.waiting)
        return True

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(seq, n):
                victim = max(self.running, key=lambda s: s.sort_key)
                budget += self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING:       # it preempted itself
                continue
            out.scheduled.append((seq, n))
            budget -= n
            i = self.running.index(seq) + 1            # victims before it may have left the list
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        adapters = self._adapters() if self.config.enable_lora else set()
        deferred = []                               # LoRA requests over max_loras: they wait, others go on
        while self.waiting and budget > 0 and self.num_seqs < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.lora_key is not None and seq.lora_key not in adapters \
                    and len(adapters) >= self.config.max_loras:
                deferred.append(heapq.heappop(self.waiting))
                continue
            if seq.remote is not None:
                if not self._start_load(seq):
                    break
                if seq.lora_key is not None:
                    adapters.add(seq.lora_key)
                continue
            hit, from_host = self.kv.match_prefix(seq)
            n = self._chunk(seq, budget)
            if n == 0 or not self.kv.allocate_slots(seq, n):
                self.kv.undo_prefix(seq)
                break
            heapq.heappop(self.waiting)
            if seq.lora_key is not None:
                adapters.add(seq.lora_key)
            if self.kv.pool.enable_caching:
                self.kv.pool.record_query(seq.num_tokens, hit * self.kv.block_size, from_host * self.kv.block_size)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
        for seq in deferred:
            heapq.heappush(self.waiting, seq)
        if budget <= 0:
            self._start_loads_behind(adapters)

    def _start_loads_behind(self, adapters: set[str]) -> None:
        """The step's token budget is spent, but an import further back in the queue needs none of it: its K/V
        arrive over the network while steps compute. Start those loads now, in queue order while slots and
        blocks allow, instead of holding them behind prompts that take whole steps: a hand-off's lease ends
        transfer.ttl_s after it was made, and behind a few long prefills on a slow device a prefix pull's
        lease ran out and its prefix was computed after all (docs/benchmarks.md, issue 22's pow2 case). Only
        imports of the head's priority go: a lower one would hold blocks a higher one waits for."""
        head = self.waiting[0].priority if self.waiting else 0
        for seq in sorted(s for s in self.waiting if s.remote is not None and s.priority <= head):
            if self.num_seqs >= self.config.max_num_seqs:
                break
            if seq.lora_key is not None and seq.lora_key not in adapters and len(adapters) >= self.config.max_loras:
                continue
            if not self._start_load(seq):
                break
            if seq.lora_key is not None and seq.remote is not None:
                adapters.add(seq.lora_key)

    def _adapters(self) -> set[str]:
        """The LoRA adapters of the sequences holding a slot (a step holds at most max_loras of them)."""
        live = [*self.running, *(s for s in self.loading.values() if not s.is_finished)]
        return {s.lora_key for s in live if s.lora_key is not None}

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if seq.spec_tokens:                             # a verify step: last token + drafts, cut to budget
            del seq.spec_tokens[max(budget - 1, 0):]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:len(seq.spec_tokens)] if seq.spec_tokens else None
        remaining = seq.num_tokens + len(seq.spec_tokens) - seq.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    # -- imports ----------------------------------------------------------------------------------
    def _start_load(self, seq: Sequence) -> bool:
        """Reserve blocks for a waiting import and start its load; False: no room yet. Past its deadline, or
        if the load cannot start, it stays in the queue, in its place, as a local prefill."""
        if self.clock() >= seq.remote.deadline:
            self._fall_back(seq, "no KV room before the source's deadline")
            return True
        covered = seq.remote.num_tokens or seq.num_tokens       # a prefix pull covers its leading blocks only
        num_local = self.kv.reserve_prompt(seq, covered)
        if num_local is None:
            return False
        if num_local * self.kv.block_size >= covered < seq.num_tokens:  # a prefix cached here meanwhile
            self.kv.free(seq)
            seq.remote = None                           # nothing to pull: the admission loop prefills it
            return True
        try:
            if self.connector is None:
                raise RuntimeError("this engine has no KV connector")
            self.connector.start_load(seq.request_id, seq.remote.source, list(seq.block_table),
                                      seq.block_hashes[:covered // self.kv.block_size], covered, num_local)
        except Exception as e:                          # noqa: BLE001 - any failure means: compute it here
            self.kv.free(seq)
            self._fall_back(seq, f"{type(e).__name__}: {e}")
            return True
        if self.waiting[0] is seq:
            heapq.heappop(self.waiting)
        else:                                           # started from behind the head (_start_loads_behind)
            self.waiting.remove(seq)
            heapq.heapify(self.waiting)
        seq.status = Status.WAITING_FOR_REMOTE_KVS
        seq.num_cached_tokens = num_local * self.kv.block_size
        seq.kv_import.blocks, seq.kv_import.started = len(seq.block_table) - num_local, time.monotonic()
        self.loading[seq.request_id] = seq
        return True

    def finish_loads(self) -> list[Sequence]:
        """Take the ended loads: imports whose K/V arrived join the running sequences (returned, every
        prompt token computed and `remote` still set, for the engine to finish); failed ones wait again
        for a local prefill; aborted ones free their blocks now that nothing writes into them."""
        if not self.loading:
            return []
        done, failed = self.connector.finished_loads()
        loaded = []
        for rid in [*done, *failed]:
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            if seq.is_finished or rid in failed:
                self.kv.free(seq)
                if not seq.is_finished:
                    seq.num_cached_tokens = 0
                    self._fall_back(seq, failed[rid])
                    self.add(seq)
                continue
            seq.kv_import.transferred = True
            seq.kv_import.seconds = time.monotonic() - seq.kv_import.started
            self.on_computed(seq, seq.remote.num_tokens or seq.num_tokens)   # registers the transferred full blocks
            seq.status = Status.RUNNING
            self.running.append(seq)
            loaded.append(seq)
        return loaded

    @staticmethod
    def _fall_back(seq: Sequence, error: str) -> None:
        log.warning("request %s: KV import failed (%s); prefilling locally", seq.request_id, error)
        seq.remote, seq.kv_import.error = None, error
        seq.restore_pending()                       # a local prefill computes it with the rest

    # -- blocks ----------------------------------------------------------------------------------
    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free a running sequence's blocks and requeue it; returns budget it had been given."""
        returned = 0
        for k, (s, n) in enumerate(out.scheduled):
            if s is seq:
                returned = n
                del out.scheduled[k]
                break
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.spec_tokens, seq.spec_probs = [], None
        seq.num_preemptions += 1
        self.num_preemptions_total += 1
        out.preempted.append(seq)
        self.add(seq)
        return returned

    def on_computed(self, seq: Sequence, n: int) -> None:
        """After the model ran: advance progress and register newly full blocks in the prefix cache."""
        seq.num_computed_tokens += n
        self.kv.cache_full_blocks(seq, n)
