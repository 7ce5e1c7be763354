"""The paged KV block pool: fixed-size blocks with ref counts and an LRU prefix cache that reports KV events.

The cache is one tensor whose first dimension is the block id (engine/kv_layout.py has its layout):
block b's K and V for every layer and head are one contiguous span of `block_bytes`, so moving n
blocks between engines of the same layout takes n descriptors.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks that hold `num_tokens` slots (ceiling division)."""
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()   # kept to guard against hash collisions
    parent_hash: int | None = None


@dataclass
class BlockPool:
    """Fixed-size KV blocks with ref counts and a prefix cache evicted lazily in LRU order.

    A freed block keeps its hash (still a cache hit) until it is taken for reuse. Free blocks
    without a hash are handed out first, then cached ones, least recently freed first.
    """
    num_blocks: int
    block_size: int
    enable_caching: bool = True
    on_event: Callable[[KVEvent], None] | None = None
    blocks: list[Block] = field(init=False)
    _free: OrderedDict = field(init=False)          # block_id -> None, eviction order
    _cached: dict[int, int] = field(init=False)     # hash -> block_id
    query_tokens: int = field(default=0, init=False)  # prompt tokens looked up
    hit_tokens: int = field(default=0, init=False)    # prompt tokens found

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Allocatable blocks: never used, or cached but unreferenced."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def lookup(self, hashes: Sequence[int], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Block ids caching the longest leading run of `hashes` (token ids checked)."""
        if not self.enable_caching:
            return []
        found = []
        for h, toks in zip(hashes, token_blocks):
            bid = self._cached.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(toks):
                break
            found.append(bid)
        return found

    def cached_hashes(self) -> list[int]:
        """Every hash the prefix cache holds, referenced or not: a replica's snapshot for the router's index."""
        return list(self._cached)

    def match(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[int]:
        """lookup() for a flat token list: block i of `token_ids` is checked against hashes[i]."""
        bs = self.block_size
        return self.lookup(hashes, [token_ids[j * bs:(j + 1) * bs] for j in range(len(hashes))])

    # -- ref counting -------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            blk = self.blocks[bid]
            self._evict(blk)
            blk.ref_count = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                self._free.pop(bid)
            blk.ref_count += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block; tail blocks first so they are evicted before the prefix."""
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            if blk.ref_count <= 0:
                raise RuntimeError(f"double free of KV block {bid}")
            blk.ref_count -= 1
            if blk.ref_count == 0:
                self._free[bid] = None
                if blk.hash is None:          # nothing worth keeping: hand it out first
                    self._free.move_to_end(bid, last=False)

    # -- prefix cache -------------------------------------------------------------------------
    def cache_block(self, block_id: int, block_hash: int, token_ids: Sequence[int],
                    parent_hash: int | None) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching:
            return
        blk = self.blocks[block_id]
        if blk.hash is not None or block_hash in self._cached:
            return
        blk.hash, blk.token_ids, blk.parent_hash = block_hash, tuple(token_ids), parent_hash
        self._cached[block_hash] = block_id
        self._emit(BlockStored([block_hash], parent_hash))

    def reset_prefix_cache(self) -> bool:
        """Forget every unreferenced cached block. False if some cached block is still in use."""
        if any(self.blocks[bid].ref_count > 0 for bid in self._cached.values()):
            return False
        for blk in self.blocks:
            blk.hash, blk.token_ids, blk.parent_hash = None, (), None
        self._cached.clear()
        self._emit(AllBlocksCleared())
        return True

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit

    def _evict(self, blk: Block) -> None:
        if blk.hash is None:
            return
        if self._cached.get(blk.hash) == blk.block_id:
            del self._cached[blk.hash]
            self._emit(BlockRemoved([blk.hash]))
        blk.hash, blk.token_ids, blk.parent_hash = None, (), None

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
