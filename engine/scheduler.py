"""Iteration-level scheduler: continuous batching, chunked prefill, prefix-cache hits, preemption.

Every step has a token budget (max_num_batched_tokens). Running sequences go first (a decode costs
one token, or 1 + k with k draft tokens to verify, cut to the budget; an unfinished prompt a chunk
of what is left); waiting ones join, highest priority then
oldest first, while budget, max_num_seqs and KV blocks allow. When blocks run out, the lowest
priority, newest running sequence is preempted by recompute: its blocks are freed (they stay in the
prefix cache until reused, so the recompute is often a cache hit) and it waits again.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.block_hash import block_hashes
from engine.block_pool import BlockPool
from engine.sequence import Sequence, Status


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, new tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, pool: BlockPool, model_key: str):
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.model_key = model_key
        self.waiting: list[Sequence] = []          # heap on (priority, seq_no)
        self.running: list[Sequence] = []

    # -- queue ------------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        heapq.heappush(self.waiting, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finished or aborted); the caller frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
            heapq.heapify(self.waiting)

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
            while not self._allocate(seq, n):
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
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            hit = self._prefix_hit(seq) if seq.num_computed_tokens == 0 else []
            n = self._chunk(seq, budget)
            if n == 0 or not self._allocate(seq, n):
                self._undo_hit(seq, hit)
                break
            heapq.heappop(self.waiting)
            if self.pool.enable_caching:
                self.pool.record_query(seq.num_tokens, len(hit) * self.block_size)
            seq.status = Status.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if seq.spec_tokens:                             # a verify step: last token + drafts, cut to budget
            del seq.spec_tokens[max(budget - 1, 0):]
            if seq.spec_probs is not None:
                seq.spec_probs = seq.spec_probs[:len(seq.spec_tokens)] if seq.spec_tokens else None
        remaining = seq.num_tokens + len(seq.spec_tokens) - seq.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        return min(remaining, budget)

    # -- blocks -----------------------------------------------------------------------------------
    def _allocate(self, seq: Sequence, n: int) -> bool:
        need = -(-(seq.num_computed_tokens + n) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _prefix_hit(self, seq: Sequence) -> list[int]:
        """Reuse cached leading blocks; the last prompt token is always computed (it gives logits)."""
        bs = self.block_size
        usable = (seq.num_tokens - 1) // bs
        if not seq.block_hashes or len(seq.block_hashes) < usable:
            seq.block_hashes = block_hashes(seq.token_ids[:usable * bs], bs, self.model_key)
        hashes = seq.block_hashes[:usable]
        hit = self.pool.match(hashes, seq.token_ids)
        self.pool.touch(hit)
        seq.block_table = list(hit)
        seq.num_computed_tokens = len(hit) * bs
        seq.num_cached_tokens = seq.num_computed_tokens
        return hit

    def _undo_hit(self, seq: Sequence, hit: list[int]) -> None:
        if hit:
            self.pool.free(hit)
        seq.block_table, seq.num_computed_tokens, seq.num_cached_tokens = [], 0, 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> int:
        """Free a running sequence's blocks and requeue it; returns budget it had been given."""
        returned = 0
        for k, (s, n) in enumerate(out.scheduled):
            if s is seq:
                returned = n
                del out.scheduled[k]
                break
        self.running.remove(seq)
        self.pool.free(seq.block_table)
        seq.block_table, seq.num_computed_tokens = [], 0
        seq.spec_tokens, seq.spec_probs = [], None
        seq.num_preemptions += 1
        out.preempted.append(seq)
        self.add(seq)
        return returned

    def on_computed(self, seq: Sequence, n: int) -> None:
        """After the model ran: advance progress and register newly full blocks in the prefix cache."""
        seq.num_computed_tokens += n
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        full, before = seq.num_computed_tokens // bs, (seq.num_computed_tokens - n) // bs
        known = len(seq.block_hashes)
        if full > known:
            parent = seq.block_hashes[-1] if known else None
            seq.block_hashes.extend(block_hashes(seq.token_ids[known * bs:full * bs], bs, self.model_key, parent))
        for j in range(before, full):
            if self.pool.blocks[seq.block_table[j]].hash is None:
                self.pool.cache_block(seq.block_table[j], seq.block_hashes[j],
                                      seq.token_ids[j * bs:(j + 1) * bs], seq.block_hashes[j - 1] if j else None)
