"""The step's inputs from persistent rows equal the per-token construction the runner used before.

A scheduler and KV cache manager run without a model, the way LLMEngine.step drives them: random
prompts (some sharing prefixes, so prefix hits), chunked prefills, decodes, speculative verify
steps with random acceptance and trims, a pool small enough to preempt. Every step's host buffers
must hold what the old per-token Python loops built: the model then computes the same thing.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.block_pool import BlockPool, blocks_for
from engine.config import EngineConfig
from engine.input_batch import InputBatch, SequenceRows, items_shape
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence

import torch

BS = 4
MAX_LEN = 96


def old_items(scheduled) -> list[tuple[list[int], int, list[int], int]]:
    """The runner's execute() before persistent rows: each sequence's new tokens (drafts after its own)."""
    items = []
    for seq, n in scheduled:
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start:start + n]
        if start + n > seq.num_tokens:
            tokens = tokens + seq.spec_tokens[:start + n - seq.num_tokens]
        done = start + n == seq.num_tokens + len(seq.spec_tokens)
        items.append((tokens, start, list(seq.block_table), (1 + len(seq.spec_tokens)) if done else 0))
    return items


def per_token_inputs(items, bs: int) -> dict:
    """forward_batch() before persistent buffers, a Python loop over every token: the reference."""
    ids, positions, slots, qlens, slens, logit_rows = [], [], [], [], [], []
    for tokens, start, bt, n_logits in items:
        n = len(tokens)
        ids.extend(tokens)
        positions.extend(range(start, start + n))
        slots.extend(bt[p // bs] * bs + p % bs for p in range(start, start + n))
        qlens.append(n)
        slens.append(start + n)
        logit_rows.extend(range(len(ids) - n_logits, len(ids)))
    qsl = [0]
    for n in qlens:
        qsl.append(qsl[-1] + n)
    return dict(input_ids=ids, positions=positions, slot_mapping=slots, seq_lens=slens, query_start_loc=qsl,
                logits_indices=logit_rows, tables=[bt for _, _, bt, _ in items])


def assert_staged(batch: InputBatch, ref: dict) -> None:
    t, b = len(ref["input_ids"]), len(ref["seq_lens"])
    for name, n in (("input_ids", t), ("positions", t), ("slot_mapping", t), ("seq_lens", b),
                    ("query_start_loc", b + 1), ("logits_indices", len(ref["logits_indices"]))):
        assert getattr(batch, name).np[:n].tolist() == ref[name], name
    for i, bt in enumerate(ref["tables"]):
        assert batch.block_tables.np[i, :len(bt)].tolist() == bt, f"block table row {i}"


class Driver:
    """LLMEngine.step without a model: drafts, schedule, stage the inputs, fake sampling, trims."""

    def __init__(self, seed: int, num_blocks: int = 24):
        self.rng = random.Random(seed)
        config = EngineConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=24, max_model_len=MAX_LEN)
        self.pool = BlockPool(num_blocks, BS, enable_caching=True)
        self.kv = KVCacheManager(self.pool, "m")
        self.sched = Scheduler(config, self.kv)
        self.rows = SequenceRows(config.max_num_seqs, MAX_LEN, blocks_for(MAX_LEN, BS))
        self.batch = InputBatch(config.max_num_batched_tokens, config.max_num_seqs, blocks_for(MAX_LEN, BS), BS,
                                torch.device("cpu"))
        self.seen = {"verify": 0, "preempted": 0, "prefix_hit": 0, "chunk": 0, "trim": 0}

    def add(self, rid: str, prompt: list[int], max_tokens: int) -> None:
        self.sched.add(Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens)))

    def step(self) -> None:
        drafted = [s for s in self.sched.running
                   if s.num_computed_tokens == s.num_tokens - 1 and s.num_output_tokens >= 1
                   and s.num_tokens + 4 < MAX_LEN and self.rng.random() < 0.5]
        for s in drafted:
            s.spec_tokens = [self.rng.randrange(1000) for _ in range(self.rng.randint(1, 3))]
        out = self.sched.schedule()
        for s in out.preempted:
            self.rows.release(s.request_id)
            self.seen["preempted"] += 1
        if out.scheduled:
            self.seen["prefix_hit"] += sum(s.num_cached_tokens > 0 for s, _ in out.scheduled)
            ref = per_token_inputs(old_items(out.scheduled), BS)
            shape, ids, tables, samplers, _ = self.rows.prepare(out.scheduled)
            self.batch.stage(shape, ids, tables)
            assert_staged(self.batch, ref)
            self._advance(out.scheduled, samplers)
        for s in drafted:
            s.spec_tokens = []
            if s.status.value != "finished" and s.block_table:
                before = len(s.block_table)
                self.kv.trim(s)
                self.seen["trim"] += len(s.block_table) < before

    def _advance(self, scheduled, samplers) -> None:
        for s, n in scheduled:
            if not s.spec_tokens:
                self.sched.on_computed(s, n)
                self.seen["chunk"] += s.num_computed_tokens < s.num_tokens
        for s, _ in samplers:
            k = len(s.spec_tokens)
            kept = min(1 + self.rng.randint(0, k), s.params.max_tokens - s.num_output_tokens)
            s.token_ids.extend(self.rng.randrange(1000) for _ in range(kept))
            if k:
                self.seen["verify"] += 1
                s.spec_tokens = []
                self.sched.on_computed(s, kept)
            if s.num_output_tokens >= s.params.max_tokens:
                self.sched.remove(s)
                self.kv.free(s)
                self.rows.release(s.request_id)


def run_driver(seed: int) -> dict[str, int]:
    d = Driver(seed)
    rng = random.Random(100 + seed)
    shared = [rng.randrange(1000) for _ in range(12)]
    for i in range(10):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(2, 30))]
        if i % 3 == 0:
            prompt = shared + prompt[:6]                   # a prefix other requests share
        d.add(f"r{i}", prompt, rng.randint(2, 14))
    for _ in range(400):
        if not d.sched.has_work():
            break
        d.step()
    assert not d.sched.has_work()
    assert d.pool.num_free_blocks == d.pool.num_blocks
    assert not d.rows.rows, "every finished sequence gave its row back"
    return d.seen


def test_inputs_equal_per_token_construction():
    """Over a few seeds; the random batches must exercise what they claim (verify steps, trims,
    prefill chunks, prefix hits, preemption)."""
    seen: dict[str, int] = {}
    for seed in range(8):
        for k, v in run_driver(seed).items():
            seen[k] = seen.get(k, 0) + v
    assert all(v > 0 for v in seen.values()), seen


def test_block_row_rewritten_when_blocks_are_replaced():
    """Trim then grow hands out another block at the same index: the length alone cannot tell, the
    KV cache manager's epoch does."""
    pool = BlockPool(16, BS, enable_caching=False)
    kv = KVCacheManager(pool, "m")
    rows = SequenceRows(2, MAX_LEN, blocks_for(MAX_LEN, BS))
    s = Sequence("a", list(range(6)), SamplingParams())
    kv.allocate_slots(s, 11)                               # 3 blocks: 6 tokens + 5 drafts' slots
    r = rows.sync(s)
    kv.trim(s)                                             # back to 2 blocks
    pool.allocate(1)                                       # someone else takes the freed block ...
    kv.allocate_slots(s, 11)                               # ... so the third block is another one
    rows.sync(s)
    assert rows.block_table[r, :3].tolist() == s.block_table
    kv.free(s)
    kv.allocate_slots(s, 3)
    rows.sync(s)
    assert rows.block_table[r, :1].tolist() == s.block_table


def test_released_row_is_rewritten_for_its_next_owner():
    rows = SequenceRows(1, MAX_LEN, blocks_for(MAX_LEN, BS))
    a = Sequence("a", [5, 6, 7, 8, 9], SamplingParams(), block_table=[3, 4])
    rows.sync(a)
    rows.release("a")
    b = Sequence("b", [1, 2], SamplingParams(), block_table=[7])
    r = rows.sync(b)
    assert rows.token_ids[r, :2].tolist() == [1, 2] and rows.block_table[r, :1].tolist() == [7]
    c = Sequence("c", [1], SamplingParams())
    rows.sync(c)                                           # more live sequences than rows: the tables grow
    assert rows.block_table.shape[0] == 2 and rows.token_ids[r, :2].tolist() == [1, 2]


def test_ad_hoc_items_equal_per_token_construction():
    """forward_batch(items), as the spec proposers and profiling call it, shares the vectorised build."""
    rng = np.random.default_rng(0)
    items = []
    for _ in range(7):
        start, n = int(rng.integers(0, 20)), int(rng.integers(1, 6))
        bt = rng.permutation(40)[:blocks_for(start + n, BS) + int(rng.integers(0, 2))].tolist()
        items.append((rng.integers(0, 500, n).tolist(), start, bt, int(rng.integers(0, n + 1))))
    shape, ids, tables = items_shape(items, BS)
    batch = InputBatch(64, 8, 16, BS, torch.device("cpu"))
    batch.stage(shape, ids, tables)
    assert_staged(batch, per_token_inputs(items, BS))
