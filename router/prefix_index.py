"""PrefixIndex: which prefill replica caches which KV block, exactly, from the KV events replicas
publish; and PrefillRanker, the prefill pool's routing rule.

A block hash names its whole prefix (hashes are chained), so the index keys on the hash alone:
hash -> bitmask of replica slots. match() walks the prompt's hashes in order and ANDs the masks,
so a replica drops out at its first missing block. That is exactly what the replica's own
BlockPool.lookup() would reuse, even when eviction left holes (a child cached without its parent);
a binary search on the prefix length would assume prefix-closed caches and could overcount.
Cost of match: one dict lookup per prompt block until no replica matches, plus one step per
replica that drops out: independent of how many prefixes are cached.

A replica with a host tier (engine/block_pool.py) reports its host blocks as events of medium HOST; the
index keeps them in masks of their own. match() counts a block in either tier (the engine copies a
host block back instead of computing it); match_tiers() also says how many of a replica's leading
blocks are in its host tier only, for a ranker that credits them at a discount.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import msgpack
import xxhash

from engine.kv_events import HOST, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False, repr=False)     # hundreds of thousands of entries: never print or compare them
class PrefixIndex:
    """The exact set of cached block hashes of each replica, fed by numbered batches of KV events.

    A replica becomes known through load_snapshot (a fresh engine: its empty cache at batch 0);
    apply() then takes batches seq+1, seq+2, ... A missing batch makes the replica stale: its
    batches are refused (apply returns False) until the caller loads a snapshot
    (BlockPool.cached_hashes() and the batch number it reflects). A stale entry still answers
    match(): slightly old knowledge routes better than none.
    """
    masks: dict[int, int] = field(default_factory=dict)       # block hash -> bitmask of replica slots
    slots: dict[str, int] = field(default_factory=dict)       # replica -> slot (bit number)
    names: dict[int, str] = field(default_factory=dict)       # slot -> replica
    blocks: dict[str, set[int]] = field(default_factory=dict)  # replica -> its hashes (to drop them fast)
    host_masks: dict[int, int] = field(default_factory=dict)  # the same for host-tier blocks
    host_blocks: dict[str, set[int]] = field(default_factory=dict)
    seq: dict[str, int] = field(default_factory=dict)         # replica -> last applied batch
    stale: set[str] = field(default_factory=set)              # replicas that missed a batch
    live_bits: int = 0                                        # every slot's bit
    version: int = 0                                          # bumped by every change (hits()' memo)
    _memo: tuple = (None, -1, None, None)           # (hashes, version, hits, longest) of the last lookup
    _names_of: dict[int, tuple[str, ...]] = field(default_factory=dict)   # a mask's replicas, for _settle

    # -- updates ------------------------------------------------------------------------------
    def apply(self, replica: str, seq: int, events: list[KVEvent]) -> bool:
        """Apply batch `seq` of a replica's events. False, applying nothing, when the batch does not
        follow the last one (a gap, or an unknown replica): resync with load_snapshot. Batches at or
        before the last applied one are duplicates and are ignored (True)."""
        last = self.seq.get(replica)
        if last is not None and seq <= last:
            return True
        if last is None or seq != last + 1 or replica in self.stale:
            self.stale.add(replica)
            return False
        for e in events:
            if isinstance(e, BlockStored):
                self._add(replica, e.block_hashes, e.medium == HOST)
            elif isinstance(e, BlockRemoved):
                self._remove(replica, e.block_hashes, e.medium == HOST)
            elif isinstance(e, AllBlocksCleared):
                self._drop_blocks(replica)
        self.seq[replica] = seq
        return True

    def load_snapshot(self, replica: str, seq: int, hashes: list[int], host_hashes: list[int] = ()) -> None:
        """Replace a replica's entry by its full set of cached hashes (each tier's) as of batch `seq`."""
        if replica in self.slots:
            self._drop_blocks(replica)
        else:
            self._new_slot(replica)
        self.stale.discard(replica)
        self.seq[replica] = seq
        self._add(replica, hashes)
        self._add(replica, host_hashes, True)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it died); its slot is free for the next one."""
        if replica in self.slots:
            self._drop_blocks(replica)                  # (a change: bumps the version)
            slot = self.slots.pop(replica)
            self.live_bits &= ~(1 << slot)
            del self.names[slot], self.blocks[replica], self.host_blocks[replica]
        self.seq.pop(replica, None)
        self.stale.discard(replica)

    def _new_slot(self, replica: str) -> None:
        self.version += 1
        self._names_of.clear()                  # a slot's name changed
        slot = next(i for i in range(len(self.slots) + 1) if i not in self.names)
        self.slots[replica], self.names[slot], self.blocks[replica] = slot, replica, set()
        self.live_bits |= 1 << slot
        self.host_blocks[replica] = set()

    def _tier(self, replica: str, host: bool) -> tuple[dict[int, int], set[int]]:
        return (self.host_masks, self.host_blocks[replica]) if host else (self.masks, self.blocks[replica])

    def _add(self, replica: str, hashes: list[int], host: bool = False) -> None:
        self.version += 1
        bit, (masks, mine) = 1 << self.slots[replica], self._tier(replica, host)
        for h in hashes:
            if h not in mine:
                mine.add(h)
                masks[h] = masks.get(h, 0) | bit

    def _remove(self, replica: str, hashes: list[int], host: bool = False) -> None:
        self.version += 1
        bit, (masks, mine) = 1 << self.slots[replica], self._tier(replica, host)
        for h in hashes:
            if h in mine:
                mine.discard(h)
                _clear_bit(masks, h, bit)

    def _drop_blocks(self, replica: str) -> None:
        self.version += 1
        bit = 1 << self.slots[replica]
        for host in (False, True):
            masks, mine = self._tier(replica, host)
            for h in mine:
                _clear_bit(masks, h, bit)
        self.blocks[replica], self.host_blocks[replica] = set(), set()

    # -- queries ------------------------------------------------------------------------------
    def match(self, hashes: list[int]) -> dict[str, int]:
        """For every known replica, how many leading blocks of the prompt it caches, in either tier: the
        count stops at the replica's first missing block."""
        return {**dict.fromkeys(self.slots, 0), **self.hits(hashes)}

    def hits(self, hashes: list[int]) -> dict[str, int]:
        """match() for the replicas that cache at least the prompt's first block (the routers' question: in a
        pool of a hundred replicas most cache nothing of a prompt, and listing them costs more than the walk).

        The answer for the same list object, with the index unchanged since, is the last one again (the ingress
        asks about one prompt several times: where to prefill it, where its prefix is, which replica gets it).
        Callers must change neither the list they pass (block hashes are computed once per prompt) nor the
        dict it returns."""
        return self._lookup(hashes)[0]

    def longest(self, hashes: list[int]) -> tuple[int, tuple[str, ...]]:
        """The most leading blocks of the prompt any replica caches (0 when none caches its first block) and
        the replicas that cache that many: max(hits().values()) and who, without a pass over hits() (a shared
        system prompt puts most of a pool in it). The same memo and rules as hits()."""
        return self._lookup(hashes)[1]

    def _lookup(self, hashes: list[int]) -> tuple[dict[str, int], tuple[int, tuple[str, ...]]]:
        last, version, answer, longest = self._memo
        if last is hashes and version == self.version:
            return answer, longest
        counts, longest = self._hits(hashes)
        self._memo = (hashes, self.version, counts, longest)
        return counts, longest

    def _hits(self, hashes: list[int]) -> tuple[dict[str, int], tuple[int, tuple[str, ...]]]:
        """hits(), and longest(): the replicas that drop out last are the last ones settled."""
        counts: dict[str, int] = {}
        longest: tuple[int, tuple[str, ...]] = (0, ())
        alive = self.live_bits
        if not alive:                               # (no replica: no hit, whatever the prompt)
            return counts, longest
        if self.host_masks:
            dev, host = self.masks.get, self.host_masks.get

            def get(h: int, default: int) -> int:
                return dev(h, default) | host(h, default)
        else:
            get = self.masks.get
        for i, h in enumerate(hashes):
            still = get(h, 0) & alive
            if still != alive:
                if i:                               # (a replica missing the first block has no hit)
                    longest = (i, self._settle(counts, alive & ~still, i))
                if not still:
                    return counts, longest
                alive = still
        if hashes:
            longest = (len(hashes), self._settle(counts, alive, len(hashes)))
        return counts, longest

    def match_tiers(self, hashes: list[int]) -> dict[str, tuple[int, int]]:
        """hits(), with how many of each replica's leading blocks are in its host tier only:
        replica -> (leading blocks, of which host-only)."""
        out = {}
        for r, n in self.hits(hashes).items():
            mine = self.blocks[r]
            out[r] = (n, sum(h not in mine for h in hashes[:n]) if self.host_blocks[r] else 0)
        return out

    def match_credit(self, hashes: list[int], host_weight: float) -> tuple[dict[str, int], dict[str, float]]:
        """hits(), and the same counts credited for ranking: a block in a replica's host tier only counts
        `host_weight` of one in its device tier (copying it back costs a little, computing it all)."""
        if not self.host_masks or host_weight == 1:
            hits = self.hits(hashes)
            return hits, hits
        tiers = self.match_tiers(hashes)
        return ({r: n for r, (n, _) in tiers.items()},
                {r: n - (1 - host_weight) * host for r, (n, host) in tiers.items()})

    def _settle(self, counts: dict[str, int], bits: int, n: int) -> tuple[str, ...]:
        """counts[r] = n for each replica r in `bits` (the replicas of a mask, cached: a prefix every replica
        caches has the same mask request after request); those replicas."""
        names = self._names_of.get(bits)
        if names is None:
            names, rest = [], bits
            while rest:
                low = rest & -rest
                names.append(self.names[low.bit_length() - 1])
                rest ^= low
            if len(self._names_of) >= 4096:
                self._names_of.clear()
            names = self._names_of[bits] = tuple(names)
        counts.update(dict.fromkeys(names, n))
        return names

    def num_blocks(self) -> BlockCounts:
        """Cached blocks per replica (the device tier's): a live view, read per replica when asked (a router
        ranking a pool of a hundred asks once per replica; a dict of them all would be built per request)."""
        return BlockCounts(self.blocks)

    def num_distinct_blocks(self) -> int:
        return len(self.masks)

    # -- copies for other router processes (msgpack, never pickle) -----------------------------
    def snapshot(self) -> bytes:
        return msgpack.packb({r: [self.seq[r], sorted(b), r in self.stale, sorted(self.host_blocks[r])]
                              for r, b in self.blocks.items()})

    @classmethod
    def from_snapshot(cls, data: bytes) -> PrefixIndex:
        """snapshot()'s inverse; a malformed snapshot raises ValueError and builds nothing."""
        try:
            d = msgpack.unpackb(data, strict_map_key=True)
        except Exception as e:                              # noqa: BLE001
            raise ValueError(f"a prefix index snapshot is not valid msgpack: {e}") from None
        ok = isinstance(d, dict) and all(
            isinstance(r, str) and isinstance(v, list) and len(v) == 4 and isinstance(v[0], int)
            and isinstance(v[1], list) and all(isinstance(h, int) for h in v[1]) and isinstance(v[2], bool)
            and isinstance(v[3], list) and all(isinstance(h, int) for h in v[3])
            for r, v in d.items())
        if not ok:
            raise ValueError("a prefix index snapshot must map replica -> [seq, [block hashes], stale, "
                             "[host-tier block hashes]]")
        idx = cls()
        for replica, (seq, hashes, stale, host) in d.items():
            idx.load_snapshot(replica, seq, hashes, host)
            if stale:
                idx.stale.add(replica)
        return idx


class BlockCounts(Mapping[str, int]):
    """replica -> how many blocks it caches, read from the index's sets when asked (PrefixIndex.num_blocks)."""
    __slots__ = ("_blocks",)

    def __init__(self, blocks: dict[str, set[int]]):
        self._blocks = blocks

    def __getitem__(self, replica: str) -> int:
        return len(self._blocks[replica])

    def get(self, replica: str, default: int = 0) -> int:       # (Mapping's would go through a KeyError)
        b = self._blocks.get(replica)
        return default if b is None else len(b)

    def __iter__(self) -> Iterator[str]:
        return iter(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)


def _clear_bit(masks: dict[int, int], h: int, bit: int) -> None:
    m = masks[h] & ~bit
    if m:
        masks[h] = m
    else:
        del masks[h]          # no empty masks: the index's size follows what is cached


@dataclass(slots=True)
class PrefillRanker:
    """The prefill pool's rule: rank replicas by an estimate of the prompt's time to first token,
    counted in tokens of work:

        cost(r) = uncached prompt tokens on r + load_weight * queued prefill tokens on r + extra(r)
                = (num_tokens - leading_hit_blocks(r) * block_size) + load_weight * load(r) + extra(r)

    where extra(r) is other work r must do first, in tokens (loading a LoRA adapter it lacks). The decode
    pool ranks a local prefill by the same rule, its KV pressure breaking ties first (`tie`).

    cheapest first (reason "prefix_hit" when the first has a hit, else "no_hit_least_cost").
    Ties go to the lower `tie` value (when given), then to the replica caching fewer blocks (room for a
    new prefix, so new prefixes spread over the pool), then to a stable hash of (prompt's first block, replica): identical prompts stick to
    one replica, different ones spread, and a replica joining or leaving moves few of them.

    Fallback: when max(load) - min(load) > imbalance_threshold tokens, a hot prefix would pile onto
    its replica while others idle, so the order is least-loaded first (the cost above only breaks
    equal loads), reason "imbalanced_least_loaded".

    The replicas ranked are those in `loads` or `matches`; one with no load report counts as load 0.
    """
    load_weight: float              # RouterConfig.load_weight
    imbalance_threshold: int        # RouterConfig.imbalance_threshold_tokens

    def rank(self, hashes: list[int], num_tokens: int, block_size: int, matches: dict[str, int],
             loads: dict[str, int], cached: Mapping[str, int] | None = None,
             extra: dict[str, int] | None = None, tie: dict[str, float] | None = None,
             first_only: bool = False) -> tuple[list[list[str]], str]:
        """Tiers of replica ids, best first (one replica per tier), and the reason for the first; with
        `first_only`, the first tier alone (the planning simulator's routers: no sort of the pool)."""
        # (the routers' matches are replicas they have loads for: no set of the pool to build)
        replicas = loads.keys() if matches.keys() <= loads.keys() else loads.keys() | matches.keys()
        if not replicas:
            return [], "no_replica"
        load = loads if len(replicas) == len(loads) else {r: loads.get(r, 0) for r in replicas}
        salt = hashes[0] if hashes else num_tokens
        # ([load,] cost, tie, cached blocks, hash, name): a total order, so the result never depends on set order.
        # The later keys are only read where the earlier ones tie (ranking a pool of a hundred replicas per
        # request is the planning simulator's largest cost): `key` holds the first ones.
        c, w = (cached or {}).get, self.load_weight
        key = {r: (num_tokens + w * load[r], 0) for r in replicas}
        for r, n in matches.items():                # (most replicas match nothing)
            if n and r in key:
                key[r] = (max(num_tokens - n * block_size, 0) + w * load[r], 0)
        if extra or tie:
            e, t = (extra or {}).get, (tie or {}).get
            key = {r: (k[0] + e(r, 0), t(r, 0)) for r, k in key.items()}
        imbalanced = max(load.values()) - min(load.values()) > self.imbalance_threshold
        if imbalanced:
            key = {r: (load[r], *k) for r, k in key.items()}
        if first_only:
            low = min(key.values())
            tied = [r for r, k in key.items() if k == low]
            if len(tied) > 1:
                blocks = {r: c(r, 0) for r in tied}
                fewest = min(blocks.values())
                tied = [r for r, n in blocks.items() if n == fewest]
            order = [tied[0] if len(tied) == 1 else
                     min(tied, key=lambda r: (xxhash.xxh3_64_intdigest(r.encode(), seed=salt), r))]
        else:
            key = {r: (*k, c(r, 0)) for r, k in key.items()}
            order = sorted(replicas, key=key.__getitem__)
        if not first_only and len(set(key.values())) < len(key):      # runs of equal keys: by the hash, the name
            i = 0
            while i < len(order) - 1:
                j = i + 1
                while j < len(order) and key[order[j]] == key[order[i]]:
                    j += 1
                if j - i > 1:
                    order[i:j] = sorted(order[i:j],
                                        key=lambda r: (xxhash.xxh3_64_intdigest(r.encode(), seed=salt), r))
                i = j
        if imbalanced:
            return [[r] for r in order], "imbalanced_least_loaded"
        reason = "prefix_hit" if matches.get(order[0], 0) > 0 else "no_hit_least_cost"
        return [[r] for r in order], reason
