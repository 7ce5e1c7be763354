"""Block hashes and the paged KV block pool: what the router, the prefix cache and KV events rely on."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import msgpack
import pytest

from engine.block_hash import block_hashes

from engine.block_pool import BlockPool

from engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4
KEY = "model-a"
TOKENS = list(range(100, 117))          # 17 tokens: 4 full blocks + 1 leftover


# ---------------------------------------------------------------------------------------------
# block_hashes

def test_only_full_blocks_are_hashed():
    assert len(block_hashes(TOKENS, BS, KEY)) == 4
    assert len(block_hashes(TOKENS[:16], BS, KEY)) == 4
    assert len(block_hashes(TOKENS[:15], BS, KEY)) == 3
    assert block_hashes(TOKENS[:3], BS, KEY) == []
    assert block_hashes([], BS, KEY) == []
    # the leftover tokens do not influence the hashes of the full blocks
    assert block_hashes(TOKENS[:16] + [1], BS, KEY) == block_hashes(TOKENS[:16] + [2], BS, KEY)


def test_same_tokens_same_key_same_hashes():
    a = block_hashes(TOKENS, BS, KEY)
    b = block_hashes(list(TOKENS), BS, KEY)
    assert a == b
    assert all(isinstance(h, int) and 0 <= h < 2 ** 64 for h in a)
    assert len(set(a)) == len(a)
    # bytes and str model keys are the same key
    assert block_hashes(TOKENS, BS, KEY.encode()) == a


def test_different_model_key_gives_different_hashes():
    a = block_hashes(TOKENS, BS, "model-a")
    b = block_hashes(TOKENS, BS, "model-b")
    assert all(x != y for x, y in zip(a, b))


def test_hashes_are_chained():
    base = block_hashes(TOKENS, BS, KEY)
    changed = list(TOKENS)
    changed[1] += 1                               # a token in block 0
    other = block_hashes(changed, BS, KEY)
    assert all(x != y for x, y in zip(base, other)), "every later block hash must change"

    changed = list(TOKENS)
    changed[9] += 1                               # a token in block 2
    other = block_hashes(changed, BS, KEY)
    assert other[:2] == base[:2]
    assert all(x != y for x, y in zip(base[2:], other[2:]))


def test_same_block_content_at_different_positions_hashes_differently():
    ids = [7, 7, 7, 7] * 3
    hs = block_hashes(ids, BS, KEY)
    assert len(set(hs)) == 3


def test_parent_continues_a_chain():
    whole = block_hashes(TOKENS, BS, KEY)
    head = block_hashes(TOKENS[:8], BS, KEY)
    tail = block_hashes(TOKENS[8:], BS, KEY, parent=head[-1])
    assert head + tail == whole
    # one block at a time
    chain, parent = [], None
    for i in range(4):
        chain += block_hashes(TOKENS[i * BS:(i + 1) * BS], BS, KEY, parent=parent)
        parent = chain[-1]
    assert chain == whole
    # without the parent, the tail hashes are not the chained ones
    assert block_hashes(TOKENS[8:], BS, KEY) != tail


def test_hashes_stable_across_processes():
    """The router and other engines compute hashes in other processes: no dependence on hash()."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # load engine/block_hash.py by path: the same code, without importing torch via the engine package
    code = ("import importlib.util, json, sys; "
            "spec = importlib.util.spec_from_file_location('kv', sys.argv[1]); "
            "kv = sys.modules['kv'] = importlib.util.module_from_spec(spec); spec.loader.exec_module(kv); "
            f"print(json.dumps([kv.block_hashes({TOKENS!r}, {BS}, {KEY!r}), "
            f"kv.block_hashes({TOKENS!r}, 8, b'k', parent=12345), hash('baton')]))")
    here = [block_hashes(TOKENS, BS, KEY), block_hashes(TOKENS, 8, b"k", parent=12345)]
    seen_str_hashes = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        res = subprocess.run([sys.executable, "-c", code, os.path.join(root, "engine", "block_hash.py")], env=env,
                             cwd=root, capture_output=True, text=True, timeout=60, check=True)
        *theirs, str_hash = json.loads(res.stdout)
        assert theirs == here
        seen_str_hashes.add(str_hash)
    assert len(seen_str_hashes) == 2, "precondition: the subprocesses really had different hash seeds"


# ---------------------------------------------------------------------------------------------
# BlockPool: allocation and ref counts

def _fill(pool: BlockPool, block_ids: list[int], tokens: list[int], key: str = KEY) -> list[int]:
    """Register `block_ids` as holding the full blocks of `tokens`; returns their hashes."""
    hs = block_hashes(tokens, pool.block_size, key)
    for j, (bid, h) in enumerate(zip(block_ids, hs)):
        pool.cache_block(bid, h, tokens[j * pool.block_size:(j + 1) * pool.block_size], hs[j - 1] if j else None)
    return hs


def _blocks(tokens: list[int], bs: int = BS) -> list[list[int]]:
    return [tokens[j * bs:(j + 1) * bs] for j in range(len(tokens) // bs)]


def test_allocate_and_free_restore_free_count():
    pool = BlockPool(8, BS)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    a = pool.allocate(3)
    b = pool.allocate(2)
    assert len(set(a + b)) == 5
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 5
    pool.free(a)
    assert pool.num_free_blocks == 6
    pool.free(b)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0


def test_allocate_more_than_free_raises_memory_error():
    pool = BlockPool(4, BS)
    pool.allocate(3)
    assert not pool.can_allocate(2)
    with pytest.raises(MemoryError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1       # a failed allocation takes nothing
    assert pool.can_allocate(1)


def test_zero_blocks_is_rejected():
    with pytest.raises(ValueError):
        BlockPool(0, BS)


def test_double_free_raises():
    pool = BlockPool(4, BS)
    a = pool.allocate(2)
    pool.free(a)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a[:1])
    assert pool.num_free_blocks == 4


def test_shared_prefix_ref_counts():
    pool = BlockPool(8, BS)
    owner1 = pool.allocate(2)
    hs = _fill(pool, owner1, TOKENS[:8])
    hit = pool.lookup(hs, _blocks(TOKENS[:8]))
    assert hit == owner1
    pool.touch(hit)                                   # second owner shares the prefix
    assert [pool.blocks[b].ref_count for b in owner1] == [2, 2]
    assert pool.num_free_blocks == 6
    pool.free(owner1)                                 # first owner finishes
    assert [pool.blocks[b].ref_count for b in owner1] == [1, 1]
    assert pool.num_free_blocks == 6, "a block still referenced must stay allocated"
    # still referenced: it cannot be handed out
    others = pool.allocate(6)
    assert not set(others) & set(owner1)
    pool.free(hit)
    assert pool.num_free_blocks == 2


def test_touch_of_a_free_cached_block_takes_it_off_the_free_list():
    pool = BlockPool(4, BS)
    a = pool.allocate(1)
    hs = _fill(pool, a, TOKENS[:4])
    pool.free(a)
    assert pool.num_free_blocks == 4
    hit = pool.lookup(hs, _blocks(TOKENS[:4]))
    pool.touch(hit)
    assert pool.num_free_blocks == 3
    assert a[0] not in pool.allocate(3)


# ---------------------------------------------------------------------------------------------
# prefix cache: lazy eviction, LRU order, lookup

def test_cached_block_stays_a_hit_after_free_until_reused():
    pool = BlockPool(3, BS)
    a = pool.allocate(2)
    hs = _fill(pool, a, TOKENS[:8])
    pool.free(a)
    assert pool.num_free_blocks == 3
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == a           # lazy: still a hit
    pool.allocate(1)                                           # the never-hashed block goes first
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == a
    pool.allocate(2)                                           # now the cached ones are reused
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == []


def test_never_hashed_free_blocks_are_handed_out_before_cached_ones():
    pool = BlockPool(6, BS)
    cached = pool.allocate(2)
    plain = pool.allocate(2)
    hs = _fill(pool, cached, TOKENS[:8])
    pool.free(cached)                # freed first, but they hold a prefix
    pool.free(plain)                 # freed later, nothing worth keeping
    got = pool.allocate(4)
    assert set(plain) <= set(got[:4])
    assert not set(cached) & set(got), "cached blocks must be the last to be evicted"
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == cached


def test_lru_blocks_freed_earlier_are_evicted_first():
    pool = BlockPool(4, BS)
    a = pool.allocate(1)
    b = pool.allocate(1)
    c = pool.allocate(1)
    ha = _fill(pool, a, [1, 1, 1, 1])
    hb = _fill(pool, b, [2, 2, 2, 2])
    hc = _fill(pool, c, [3, 3, 3, 3])
    pool.free(b)
    pool.free(a)
    pool.free(c)
    pool.allocate(1)                                   # the never-used block
    assert pool.allocate(1) == b                       # least recently freed cached block
    assert pool.lookup(hb, [[2, 2, 2, 2]]) == []
    assert pool.lookup(ha, [[1, 1, 1, 1]]) == a
    assert pool.allocate(1) == a
    assert pool.lookup(hc, [[3, 3, 3, 3]]) == c


def test_free_of_a_sequence_evicts_its_tail_before_its_prefix():
    pool = BlockPool(3, BS)
    seq = pool.allocate(3)
    hs = _fill(pool, seq, TOKENS[:12])
    pool.free(seq)
    pool.allocate(1)
    # the last block went first: the remaining hit is still a usable leading run
    assert pool.lookup(hs, _blocks(TOKENS[:12])) == seq[:2]


def test_a_touched_then_freed_block_becomes_most_recently_used():
    pool = BlockPool(2, BS)
    a = pool.allocate(1)
    b = pool.allocate(1)
    ha = _fill(pool, a, [1, 1, 1, 1])
    hb = _fill(pool, b, [2, 2, 2, 2])
    pool.free(a)
    pool.free(b)
    pool.touch(pool.lookup(ha, [[1, 1, 1, 1]]))        # a is used again
    pool.free(a)
    assert pool.allocate(1) == b
    assert pool.lookup(ha, [[1, 1, 1, 1]]) == a
    assert pool.lookup(hb, [[2, 2, 2, 2]]) == []


def test_lookup_stops_at_first_missing_hash():
    pool = BlockPool(8, BS)
    a = pool.allocate(4)
    hs = _fill(pool, a, TOKENS[:16])
    blocks = _blocks(TOKENS[:16])
    assert pool.lookup(hs, blocks) == a
    # block 1 missing: blocks 2 and 3 are not usable even though they are cached
    assert pool.lookup([hs[0], 999, hs[2], hs[3]], blocks) == a[:1]
    assert pool.lookup([999] + hs[1:], blocks) == []
    assert pool.lookup([], []) == []


def test_lookup_checks_token_ids_against_hash_collisions():
    pool = BlockPool(4, BS)
    a = pool.allocate(1)
    forced = 0xDEADBEEF
    pool.cache_block(a[0], forced, [1, 2, 3, 4], None)
    assert pool.lookup([forced], [[1, 2, 3, 4]]) == a
    assert pool.lookup([forced], [[1, 2, 3, 5]]) == [], "same hash with other tokens must be a miss"
    assert pool.lookup([forced], [(1, 2, 3, 4)]) == a


def test_first_writer_wins():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    h = block_hashes([1, 2, 3, 4], BS, KEY)[0]
    pool.cache_block(a, h, [1, 2, 3, 4], None)
    pool.cache_block(b, h, [1, 2, 3, 4], None)
    assert pool.lookup([h], [[1, 2, 3, 4]]) == [a]
    assert pool.blocks[b].hash is None


def test_caching_disabled_never_hits():
    events = []
    pool = BlockPool(4, BS, enable_caching=False, on_event=events.append)
    a = pool.allocate(1)
    hs = _fill(pool, a, TOKENS[:4])
    assert pool.lookup(hs, _blocks(TOKENS[:4])) == []
    assert events == []


# ---------------------------------------------------------------------------------------------
# KV events

def test_cache_block_emits_block_stored_with_parent():
    events = []
    pool = BlockPool(4, BS, on_event=events.append)
    a = pool.allocate(3)
    hs = _fill(pool, a, TOKENS[:12])
    assert events == [BlockStored([hs[0]], None), BlockStored([hs[1]], hs[0]), BlockStored([hs[2]], hs[1])]


def test_eviction_on_reuse_emits_block_removed():
    events = []
    pool = BlockPool(2, BS, on_event=events.append)
    a = pool.allocate(2)
    hs = _fill(pool, a, TOKENS[:8])
    events.clear()
    pool.free(a)
    assert events == [], "freeing keeps the blocks cached: nothing is removed yet"
    pool.allocate(1)
    assert events == [BlockRemoved([hs[1]])]           # tail first
    pool.allocate(1)
    assert events == [BlockRemoved([hs[1]]), BlockRemoved([hs[0]])]


def test_reset_prefix_cache_emits_all_blocks_cleared():
    events = []
    pool = BlockPool(4, BS, on_event=events.append)
    a = pool.allocate(2)
    hs = _fill(pool, a, TOKENS[:8])
    pool.free(a)
    events.clear()
    assert pool.reset_prefix_cache() is True
    assert events == [AllBlocksCleared()]
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == []
    assert pool.num_free_blocks == 4
    # reusing a cleared block emits no BlockRemoved
    pool.allocate(4)
    assert events == [AllBlocksCleared()]


def test_reset_prefix_cache_refuses_while_a_cached_block_is_referenced():
    events = []
    pool = BlockPool(4, BS, on_event=events.append)
    a = pool.allocate(2)
    hs = _fill(pool, a, TOKENS[:8])
    events.clear()
    assert pool.reset_prefix_cache() is False
    assert events == []
    assert pool.lookup(hs, _blocks(TOKENS[:8])) == a, "a refused reset must not drop the cache"
    pool.free(a)
    assert pool.reset_prefix_cache() is True
    assert events == [AllBlocksCleared()]


def test_reset_with_only_uncached_blocks_in_use_is_allowed():
    pool = BlockPool(4, BS)
    pool.allocate(2)                                   # in use but never hashed
    assert pool.reset_prefix_cache() is True


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "not valid msgpack"),
    (msgpack.packb({"stored": 1}), "must be a list of events"),
    (msgpack.packb([["stored", [1, 2]]]), "unknown kind or shape"),
    (msgpack.packb([["stored", [1, "x"], None, "device"]]), "block hashes must be a list of integers"),
    (msgpack.packb([["stored", [1], "p", "device"]]), "parent block hash"),
    (msgpack.packb([["stored", [1], None, "disk"]]), "medium must be one of device, host"),
    (msgpack.packb([["removed", 5, "host"]]), "block hashes must be a list"),
    (msgpack.packb([["removed", [5]]]), "unknown kind or shape"),
    (msgpack.packb([["exec", "rm -rf /"]]), "unknown kind"),
    ("not bytes", "msgpack bytes"),
])
def test_kv_event_batches_are_checked_on_receipt(data, message):
    from engine.kv_events import decode_events
    with pytest.raises(ValueError, match=message):
        decode_events(data)


def test_a_malformed_batch_marks_the_replica_stale_and_the_state_actor_goes_on():
    from engine.kv_events import BlockStored, encode_events
    from router.cluster_state import ClusterState
    state = ClusterState()
    state.register("decode", "r1", 0)
    state.publish("decode", "r1", 1, encode_events([BlockStored([11, 12], None)]))
    assert "r1" not in state.index["decode"].stale
    state.publish("decode", "r1", 2, b"\x93garbage")              # refused, not raised
    assert "r1" in state.index["decode"].stale
    state.publish("decode", "r2", 1, msgpack.packb([["cleared"]]))  # other replicas unaffected


# -- KVCacheManager: the one writer of block tables ------------------------------------------------

@pytest.mark.parametrize("host_blocks", [0, 10], ids=["device-only", "host-tier"])
@pytest.mark.parametrize("seed", range(4))
def test_kv_cache_manager_keeps_ref_counts_consistent_through_a_random_workload(seed, host_blocks):
    """Allocate, cache, trim, prefix hits and undo, imports, pins and unpins, frees, in random order:
    every block's ref count equals the tables (sequences' and pinned) that hold it. With a host tier,
    the tier copies (run in the order the pool gives them, before the blocks are written) leave every
    cached block of either tier holding its own K/V: a block's content is modelled as the hash of the
    tokens it was computed for, written only when they are computed or transferred."""
    import random

    from engine.block_pool import blocks_for
    from engine.kv_cache_manager import KVCacheManager
    from engine.sampling_params import SamplingParams
    from engine.sequence import Sequence
    rng = random.Random(seed)
    bs, pool = 4, BlockPool(40, 4, host_blocks=host_blocks)
    device, host = [None] * pool.num_blocks, [None] * host_blocks

    def run_copies(copies):
        for kind, src, dst in copies:
            if kind == "out":
                host[dst] = device[src]
            else:
                device[dst] = host[src]

    def computed(s, n):
        """The model (or a transfer) wrote blocks [before, after) of s: flush first, as the engine does."""
        kv.flush_copies()
        for j in range((s.num_computed_tokens - n) // bs, blocks_for(s.num_computed_tokens, bs)):
            device[s.block_table[j]] = ("tokens", tuple(s.token_ids[:(j + 1) * bs]))

    kv = KVCacheManager(pool, "k", run_copies)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(10 if host_blocks else 3)]   # outgrow the device
    live: list[Sequence] = []
    chains = {}                                   # block hash -> the K/V it names (hashes are a function)

    def check():
        holders: dict[int, int] = {}
        for table in [s.block_table for s in live] + list(kv.pinned.values()):
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        assert [b.ref_count for b in pool.blocks] == [holders.get(i, 0) for i in range(pool.num_blocks)]
        for s in live:
            assert len(s.block_table) >= blocks_for(s.num_computed_tokens, bs)
        kv.flush_copies()
        for s in live:
            for j, h in enumerate(s.block_hashes):
                chains[h] = ("tokens", tuple(s.token_ids[:(j + 1) * bs]))
        for blk in pool.blocks:
            if blk.hash is not None and blk.hash in chains:
                assert device[blk.block_id] == chains[blk.hash], "a cached device block holds other K/V"
        if pool.host is not None:
            for h, hid in pool.host.lru.items():
                if h in chains:
                    assert host[hid] == chains[h], "a host-tier block holds other K/V"

    for i in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            s = Sequence(f"r{i}", rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))],
                         SamplingParams())
            if rng.random() < 0.3:
                local = kv.reserve_prompt(s)
                if local is not None:                                 # an import: the whole prompt
                    s.num_computed_tokens = s.num_tokens
                    computed(s, s.num_tokens - local * bs)            # the transfer writes the rest
                    kv.cache_full_blocks(s, s.num_tokens)
                    live.append(s)
            else:
                kv.match_prefix(s)
                if rng.random() < 0.2 or not kv.allocate_slots(s, s.num_tokens - s.num_computed_tokens):
                    kv.undo_prefix(s)
                else:
                    n = s.num_tokens - s.num_computed_tokens
                    s.num_computed_tokens += n
                    computed(s, n)
                    kv.cache_full_blocks(s, n)
                    live.append(s)
        elif op < 0.6:
            s = rng.choice(live)
            k = rng.randrange(1, 6)                                  # decode with k drafts, accept some
            if kv.allocate_slots(s, k):
                accepted = rng.randrange(k)
                s.token_ids += [rng.randrange(50) for _ in range(accepted + 1)]
                s.num_computed_tokens += accepted + 1
                computed(s, accepted + 1)
                kv.cache_full_blocks(s, accepted + 1)
                kv.trim(s)
                assert len(s.block_table) == blocks_for(s.num_tokens, bs)
        elif op < 0.75:
            s = live.pop(rng.randrange(len(live)))
            kv.pin(s)
            assert s.block_table == []
        elif op < 0.85 and kv.pinned:
            assert kv.unpin(rng.choice(list(kv.pinned)))
        else:
            kv.free(live.pop(rng.randrange(len(live))))
        check()
    for s in live:
        kv.free(s)
    for rid in list(kv.pinned):
        kv.unpin(rid)
    assert pool.num_free_blocks == pool.num_blocks and not kv.unpin("r0")
    if host_blocks:
        assert pool.onloaded_blocks > 0, "the workload never hit the host tier"
