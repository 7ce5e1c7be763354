"""Which producer ranks a consumer rank reads its KV heads from when the two pools differ in TP size.

Each rank's cache keeps its heads outermost in a block (engine/kv_layout.py), so a run of heads that
one producer rank holds and one consumer rank needs is one contiguous span in both caches: a pull is
one descriptor per (block, run). Runs are found per head and merged while they stay contiguous on
both sides and come from the same rank; with replicated heads (fewer KV heads than producer ranks)
the holder is picked by the consumer rank, so consumer ranks spread their reads over the replicas.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.kv_layout import KVHeadLayout


@dataclass(frozen=True, slots=True)
class HeadRun:
    src_rank: int       # the producer rank that holds the run
    src_head: int       # first head of the run in that rank's cache (an index into its heads)
    dst_head: int       # first head of the run in the consumer rank's cache
    num_heads: int


def plan_runs(producer: KVHeadLayout, consumer: KVHeadLayout, rank: int) -> list[HeadRun]:
    """The runs that fill consumer `rank`'s heads, in its head order."""
    if producer.num_kv_heads != consumer.num_kv_heads:
        raise ValueError(f"producer has {producer.num_kv_heads} KV heads, consumer {consumer.num_kv_heads}")
    runs: list[HeadRun] = []
    for dst, head in enumerate(consumer.heads_of(rank)):
        holders = producer.ranks_holding(head)
        src_rank = holders[rank % len(holders)]
        src = producer.heads_of(src_rank).index(head)
        last = runs[-1] if runs else None
        if last and last.src_rank == src_rank and last.src_head + last.num_heads == src \
                and last.dst_head + last.num_heads == dst:
            runs[-1] = HeadRun(src_rank, last.src_head, last.dst_head, last.num_heads + 1)
        else:
            runs.append(HeadRun(src_rank, src, dst, 1))
    return runs


def is_whole_block(runs: list[HeadRun], producer: KVHeadLayout, consumer: KVHeadLayout, rank: int) -> bool:
    """True when `rank` takes whole blocks from a single producer rank (the same-layout case: one
    descriptor per block, the producer's block geometry equal to ours)."""
    return (len(runs) == 1 and runs[0].src_head == 0 and runs[0].dst_head == 0
            and len(producer.heads_of(runs[0].src_rank)) == runs[0].num_heads == len(consumer.heads_of(rank)))
