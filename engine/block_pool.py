"""The paged KV block pool: fixed-size blocks with ref counts and an LRU prefix cache that reports KV events,
and its host tier.

The cache is one tensor whose first dimension is the block id (engine/kv_layout.py has its layout):
block b's K and V for every layer and head are one contiguous span of `block_bytes`, so moving n
blocks between engines of the same layout takes n descriptors.

The host tier (`host_blocks` > 0, EngineConfig.kv_offloading_size) is a second cache of the same
layout in host memory (pinned on CUDA; on CPU a tensor of its own). A cached block the device pool
evicts (taken for reuse) is copied there under its hash instead of being forgotten; a prefix that
runs on into the host tier is copied back into fresh device blocks instead of being recomputed. LRU
runs across both: device blocks age into the host tier, host blocks age out of it. The pool only
decides; the copies it orders (`take_copies`, in order: "out" device -> host, "in" host -> device)
are run by the engine on every rank before anything writes the device blocks involved (the next
forward, or a KV import).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from engine.kv_events import DEVICE, HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# A tier copy: ("out", device block, host block) or ("in", host block, device block).
Copy = tuple[str, int, int]

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


@dataclass(eq=False)
class HostTier:
    """Host-memory blocks keyed by hash, least recently used first. A block here is unreferenced: it is
    only ever copied back into a device block, never read in place."""
    num_blocks: int
    lru: OrderedDict = field(default_factory=OrderedDict)   # hash -> host block id
    meta: dict[int, tuple[int, tuple[int, ...], int | None]] = field(default_factory=dict)  # id -> (hash, tokens, parent)
    free: list[int] = field(init=False)
    busy: set[int] = field(default_factory=set)             # being copied back by this call: not evicted

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks - 1, -1, -1))

    def find(self, h: int, toks: Sequence[int]) -> int | None:
        hid = self.lru.get(h)
        return hid if hid is not None and self.meta[hid][1] == tuple(toks) else None


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
    host_blocks: int = 0                            # the host tier's size (0: off)
    blocks: list[Block] = field(init=False)
    _free: OrderedDict = field(init=False)          # block_id -> None, eviction order
    _cached: dict[int, int] = field(init=False)     # hash -> block_id
    query_tokens: int = field(default=0, init=False)  # prompt tokens looked up
    hit_tokens: int = field(default=0, init=False)    # prompt tokens found (either tier)
    host_hit_tokens: int = field(default=0, init=False)   # of those, found in the host tier
    offloaded_blocks: int = field(default=0, init=False)  # copies device -> host
    onloaded_blocks: int = field(default=0, init=False)   # copies host -> device

    def __post_init__(self) -> None:
        if self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.host_blocks < 0:
            raise ValueError(f"host_blocks must be >= 0, got {self.host_blocks}")
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self._free = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached = {}
        self.host = HostTier(self.host_blocks) if self.host_blocks and self.enable_caching else None
        self._copies: list[Copy] = []

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
        """Every hash the device tier holds, referenced or not."""
        return list(self._cached)

    def snapshot_events(self) -> list[KVEvent]:
        """The whole cache, both tiers, as events: a replica's snapshot for the router's index."""
        events: list[KVEvent] = [AllBlocksCleared(), BlockStored(list(self._cached), None)]
        if self.host is not None:
            events.append(BlockStored(list(self.host.lru), None, HOST))
        return events

    @property
    def num_host_blocks_used(self) -> int:
        return 0 if self.host is None else len(self.host.lru)

    def find(self, hashes: Sequence[int], token_ids: Sequence[int]) -> list[tuple[str, int]]:
        """The longest leading run of `hashes` cached in either tier (token ids checked), as (tier, block
        id) pairs: the device block when it has one, else the host block. acquire() takes them."""
        if not self.enable_caching:
            return []
        bs, found = self.block_size, []
        for j, h in enumerate(hashes):
            toks = tuple(token_ids[j * bs:(j + 1) * bs])
            bid = self._cached.get(h)
            if bid is not None and self.blocks[bid].token_ids == toks:
                found.append((DEVICE, bid))
                continue
            hid = self.host.find(h, toks) if self.host is not None else None
            if hid is None:
                break
            found.append((HOST, hid))
        return found

    def acquire(self, found: list[tuple[str, int]]) -> tuple[list[int], int]:
        """Take what find() found: a reference on each device block, and each host block copied back into
        a fresh device block, cached under its hash (the copies are ordered, see take_copies). The run
        stops early if the device pool runs out of blocks. Returns the device block ids, in prompt
        order, and how many of them came from the host tier."""
        device = [bid for tier, bid in found if tier == DEVICE]
        self.touch(device)                          # first, so that copying back cannot evict them
        if len(device) == len(found):
            return device, 0
        host = self.host
        host.busy = {hid for tier, hid in found if tier == HOST}
        out, onloaded = [], 0
        try:
            for k, (tier, bid) in enumerate(found):
                if tier == DEVICE:
                    out.append(bid)
                    continue
                if not self.can_allocate(1):
                    self.free([b for t, b in found[k:] if t == DEVICE])   # the rest of the run is not used
                    break
                new = self.allocate(1)[0]
                self._copies.append(("in", bid, new))
                h, toks, parent = host.meta[bid]
                blk = self.blocks[new]
                blk.hash, blk.token_ids, blk.parent_hash = h, toks, parent
                self._cached[h] = new
                self._emit(BlockStored([h], parent))
                host.lru.move_to_end(h)
                out.append(new)
                onloaded += 1
        finally:
            host.busy = set()
        self.onloaded_blocks += onloaded
        return out, onloaded

    def take_copies(self) -> list[Copy]:
        """The tier copies ordered since the last call, to run in this order before the next forward."""
        copies, self._copies = self._copies, []
        return copies

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
        """Forget every unreferenced cached block, in both tiers. False if some cached block is still in use."""
        if any(self.blocks[bid].ref_count > 0 for bid in self._cached.values()):
            return False
        for blk in self.blocks:
            blk.hash, blk.token_ids, blk.parent_hash = None, (), None
        self._cached.clear()
        if self.host is not None:
            self.host = HostTier(self.host_blocks)
        self._emit(AllBlocksCleared())
        return True

    def record_query(self, num_tokens: int, num_hit: int, num_host_hit: int = 0) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit
        self.host_hit_tokens += num_host_hit

    def _evict(self, blk: Block) -> None:
        if blk.hash is None:
            return
        if self._cached.get(blk.hash) == blk.block_id:
            del self._cached[blk.hash]
            self._emit(BlockRemoved([blk.hash]))
            self._offload(blk)
        blk.hash, blk.token_ids, blk.parent_hash = None, (), None

    def _offload(self, blk: Block) -> None:
        """A cached block leaves the device: keep it in the host tier (its least recently used block
        makes room). One already there (copied back earlier, same bytes) is only refreshed."""
        host = self.host
        if host is None:
            return
        if blk.hash in host.lru:
            host.lru.move_to_end(blk.hash)
            return
        if host.free:
            hid = host.free.pop()
        else:
            victim = next((h for h, i in host.lru.items() if i not in host.busy), None)
            if victim is None:
                return
            hid = host.lru.pop(victim)
            self._emit(BlockRemoved([victim], HOST))
        host.lru[blk.hash] = hid
        host.meta[hid] = (blk.hash, blk.token_ids, blk.parent_hash)
        self._copies.append(("out", blk.block_id, hid))
        self.offloaded_blocks += 1
        self._emit(BlockStored([blk.hash], blk.parent_hash, HOST))

    def _emit(self, event: KVEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)
