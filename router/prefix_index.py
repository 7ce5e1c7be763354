"""PrefixIndex: which replica caches which KV block, exactly, from the KV events replicas publish; and
PrefillRanker, the prefill pool's routing rule.

A block hash names its whole prefix (hashes are chained), so the index maps hash -> bitmask of replica
slots. match() walks the prompt's hashes in order, AND-ing masks: a replica's count stops at its first
missing block, which is exactly "leading blocks cached" even when eviction left holes. Cost: one dict
lookup per prompt block until no replica matches, independent of the number of cached prefixes.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import msgpack

from engine.kv import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class PrefixIndex:
    def __init__(self):
        self.masks: dict[int, int] = {}          # block hash -> bitmask of replica slots
        self.slots: dict[str, int] = {}          # replica -> slot
        self.blocks: dict[str, set[int]] = {}    # replica -> its hashes
        self.seq: dict[str, int] = {}            # replica -> last applied batch
        self.stale: set[str] = set()             # replicas with a missing batch, until a snapshot

    # -- updates ----------------------------------------------------------------------------------
    def _slot(self, replica: str) -> int:
        if replica not in self.slots:
            used = set(self.slots.values())
            self.slots[replica] = next(i for i in range(len(used) + 1) if i not in used)
            self.blocks[replica] = set()
        return self.slots[replica]

    def apply(self, replica: str, seq: int, events: list[KVEvent]) -> bool:
        """Apply batch `seq` of a replica's events. A batch after a gap is refused (False): the replica's
        entry is then stale until load_snapshot. Old or repeated batches are ignored."""
        last = self.seq.get(replica)
        if last is not None and seq <= last:
            return True
        if last is None or seq != last + 1 or replica in self.stale:
            self.stale.add(replica)
            return False
        bit = 1 << self._slot(replica)
        mine = self.blocks[replica]
        for e in events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    if h not in mine:
                        mine.add(h)
                        self.masks[h] = self.masks.get(h, 0) | bit
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    if h in mine:
                        mine.discard(h)
                        self._clear_bit(h, bit)
            elif isinstance(e, AllBlocksCleared):
                self._drop_blocks(replica)
        self.seq[replica] = seq
        return True

    def load_snapshot(self, replica: str, seq: int, hashes: list[int]) -> None:
        """Replace a replica's entry by its full set of cached hashes as of batch `seq`."""
        self._drop_blocks(replica) if replica in self.slots else self._slot(replica)
        self.stale.discard(replica)
        self.seq[replica] = seq
        bit = 1 << self.slots[replica]
        self.blocks[replica] = set(hashes)
        for h in hashes:
            self.masks[h] = self.masks.get(h, 0) | bit

    def remove_replica(self, replica: str) -> None:
        if replica in self.slots:
            self._drop_blocks(replica)
            del self.slots[replica], self.blocks[replica]
        self.seq.pop(replica, None)
        self.stale.discard(replica)

    def _drop_blocks(self, replica: str) -> None:
        bit = 1 << self.slots[replica]
        for h in self.blocks[replica]:
            self._clear_bit(h, bit)
        self.blocks[replica] = set()

    def _clear_bit(self, h: int, bit: int) -> None:
        m = self.masks.get(h, 0) & ~bit
        if m:
            self.masks[h] = m
        else:
            self.masks.pop(h, None)

    # -- queries ----------------------------------------------------------------------------------
    def match(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks of the prompt each known replica caches (0 for none)."""
        counts = dict.fromkeys(self.slots, 0)
        alive = 0
        for s in self.slots.values():
            alive |= 1 << s
        for i, h in enumerate(hashes):
            m = self.masks.get(h, 0) & alive
            lost = alive & ~m
            if lost:
                for r, s in self.slots.items():
                    if lost >> s & 1:
                        counts[r] = i
            alive = m
            if not alive:
                return counts
        for r, s in self.slots.items():
            if alive >> s & 1:
                counts[r] = len(hashes)
        return counts

    def num_blocks(self) -> dict[str, int]:
        return {r: len(b) for r, b in self.blocks.items()}

    # -- copies for other processes (msgpack, never pickle) ----------------------------------------------
    def snapshot(self) -> bytes:
        return msgpack.packb({r: [self.seq.get(r, 0), sorted(b), r in self.stale] for r, b in self.blocks.items()})

    @classmethod
    def from_snapshot(cls, data: bytes) -> PrefixIndex:
        idx = cls()
        for r, (seq, hashes, stale) in msgpack.unpackb(data).items():
            idx.load_snapshot(r, seq, hashes)
            if stale:
                idx.stale.add(r)
        return idx


@dataclass
class PrefillRanker:
    """The prefill pool's rule. A replica's cost is an estimate of the prompt's time to first token in
    tokens of work: cost = uncached prompt tokens there + load_weight * its queued prefill tokens.
    Cheapest first; ties go to the replica caching fewer blocks (it has room: new prefixes spread over
    the pool instead of piling onto one), then to a stable hash of the prompt's first block.
    When the queued tokens of the replicas differ by more than imbalance_threshold, a hot prefix would
    pile onto one replica: the rule is then least-loaded first, whatever the hits."""
    load_weight: float = 1.0
    imbalance_threshold: int = 8192

    def rank(self, hashes: list[int], num_tokens: int, block_size: int, matches: dict[str, int],
             loads: dict[str, int], cached: dict[str, int] | None = None) -> tuple[list[list[str]], str]:
        replicas = list(loads)
        if not replicas:
            return [], "no_replica"
        salt = hashes[0] if hashes else num_tokens

        def tie(r: str) -> int:
            return zlib.crc32(f"{salt}:{r}".encode())

        if max(loads.values()) - min(loads.values()) > self.imbalance_threshold:
            return [[r] for r in sorted(replicas, key=lambda r: (loads[r], tie(r)))], "imbalanced_least_loaded"

        def cost(r: str) -> float:
            return max(num_tokens - matches.get(r, 0) * block_size, 0) + self.load_weight * loads[r]

        cached = cached or {}
        order = sorted(replicas, key=lambda r: (cost(r), cached.get(r, 0), tie(r)))
        reason = "prefix_hit" if matches.get(order[0], 0) > 0 else "no_hit_least_cost"
        return [[r] for r in order], reason
