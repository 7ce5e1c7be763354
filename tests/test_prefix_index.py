"""The router's prefix index is exact: fed only by real BlockPools' KV events (through the msgpack
codec), it agrees with a brute-force recount of every pool's cache, holes left by eviction included;
gaps force a resync; the prefill ranking prefers hits, sticks, and falls back to least-loaded when
loads are uneven; the router benchmark reports what it claims."""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import msgpack
import pytest

from engine.block_hash import block_hashes

from engine.block_pool import BlockPool

from engine.kv_events import decode_events, encode_events
from router.cluster_state import ClusterState, IndexMirror, apply_entry
from router.prefix_index import PrefillRanker, PrefixIndex

BS, KEY = 4, "test-model"


def leading(cached: set[int], hashes: list[int]) -> int:
    """The definition match() must meet: blocks from the start up to the first one not cached."""
    n = 0
    while n < len(hashes) and hashes[n] in cached:
        n += 1
    return n


@dataclass
class Request:
    tokens: list[int]
    hashes: list[int]
    blocks: list[int] = field(default_factory=list)


class Replica:
    """A BlockPool driven like a prefill engine: requests run concurrently, one block per step
    (chunked prefill), share cached prefixes, get preempted when the pool is full, then free."""

    def __init__(self, name: str, num_blocks: int):
        self.name, self.events, self.seq = name, [], 0
        self.pool = BlockPool(num_blocks, BS, True, self.events.append)
        self.running: list[Request] = []

    def start(self, tokens: list[int]) -> None:
        req = Request(tokens, block_hashes(tokens, BS, KEY))
        req.blocks = self.pool.match(req.hashes, tokens)
        self.pool.touch(req.blocks)
        self.running.append(req)

    def step(self, req: Request) -> None:
        i = len(req.blocks)
        if i == len(req.hashes) or not self.pool.can_allocate(1):   # finished, or preempted
            self.pool.free(req.blocks)
            self.running.remove(req)
            return
        bid = self.pool.allocate(1)[0]
        self.pool.cache_block(bid, req.hashes[i], req.tokens[i * BS:(i + 1) * BS], req.hashes[i - 1] if i else None)
        req.blocks.append(bid)

    def run_prompt(self, tokens: list[int]) -> None:
        self.start(tokens)
        req = self.running[-1]
        while req in self.running:
            self.step(req)

    def batch(self) -> tuple[int, bytes]:
        self.seq += 1
        events, self.events[:] = list(self.events), []
        return self.seq, encode_events(events)

    def holes(self) -> int:
        """Cached blocks whose parent is not cached: a leading count must stop before them."""
        cached = set(self.pool.cached_hashes())
        return sum(1 for b in self.pool.blocks if b.hash is not None and b.parent_hash is not None
                   and b.parent_hash not in cached)


def sync(index: PrefixIndex, replicas: list[Replica]) -> None:
    for x in replicas:
        seq, data = x.batch()
        assert index.apply(x.name, seq, decode_events(data))


def assert_exact(index: PrefixIndex, replicas: list[Replica], prompts: list[list[int]]) -> None:
    cached = {x.name: set(x.pool.cached_hashes()) for x in replicas}
    assert index.num_blocks() == {n: len(c) for n, c in cached.items()}
    for q in prompts:
        h = block_hashes(q, BS, KEY)
        assert index.match(h) == {n: leading(c, h) for n, c in cached.items()}


def test_index_matches_a_brute_force_recount_through_churn():
    rng = random.Random(0)
    systems = [[rng.randrange(1000) for _ in range(4 * rng.randrange(2, 5))] for _ in range(5)]
    replicas = [Replica(f"r{i}", 20) for i in range(3)]
    index = PrefixIndex()
    for r in replicas:
        index.load_snapshot(r.name, 0, [])
    prompts, holes, resets = [], 0, 0
    for step in range(3000):
        r = rng.choice(replicas)
        if len(r.running) < 3 and rng.random() < 0.3:
            p = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 12))]
            prompts.append(p)
            r.start(p)
        elif r.running:
            r.step(rng.choice(r.running))
        elif rng.random() < 0.02:
            resets += r.pool.reset_prefix_cache()         # AllBlocksCleared
        holes += r.holes()
        if step % 11 == 0:
            sync(index, replicas)
            assert_exact(index, replicas, prompts[-20:] + systems)
    sync(index, replicas)
    assert_exact(index, replicas, prompts + systems)
    assert holes > 0 and resets > 0, (holes, resets)     # the hard cases did happen


def test_a_hole_left_by_eviction_ends_the_leading_count():
    # Two requests prefill the same prompt on replica a: one caches block 0, the other gets ahead and
    # caches block 1 (first writer wins); the first goes away and block 0 is evicted while the other
    # still holds block 1. Replica b holds the whole prompt.
    a, b, index = Replica("a", 3), Replica("b", 8), PrefixIndex()
    for r in (a, b):
        index.load_snapshot(r.name, 0, [])
    toks = list(range(3 * BS))
    h = block_hashes(toks, BS, KEY)
    first = a.pool.allocate(1)
    a.pool.cache_block(first[0], h[0], toks[:BS], None)
    ahead = a.pool.allocate(2)
    a.pool.cache_block(ahead[1], h[1], toks[BS:2 * BS], h[0])
    a.pool.free(first)
    a.pool.allocate(1)                                     # evicts block 0
    assert set(a.pool.cached_hashes()) == {h[1]}
    b.run_prompt(toks)
    sync(index, [a, b])
    assert index.match(h) == {"a": 0, "b": 3}              # holding h[1] is no use to a without h[0]
    assert index.match(h[1:]) == {"a": 1, "b": 2}
    assert index.num_blocks() == {"a": 1, "b": 3}


def test_a_missing_batch_is_refused_whole_until_a_snapshot():
    r, index = Replica("a", 16), PrefixIndex()
    index.load_snapshot("a", 0, [])
    first, second = list(range(8)), list(range(100, 108))
    r.run_prompt(first)
    r.batch()                                              # batch 1 is lost
    r.run_prompt(second)
    seq, data = r.batch()
    assert not index.apply("a", seq, decode_events(data))
    assert "a" in index.stale
    assert index.match(block_hashes(second, BS, KEY)) == {"a": 0}    # nothing of batch 2 applied
    r.run_prompt(list(range(200, 208)))
    seq, data = r.batch()
    assert not index.apply("a", seq, decode_events(data))           # still stale: refused too
    index.load_snapshot("a", seq, r.pool.cached_hashes())
    assert "a" not in index.stale
    assert index.match(block_hashes(first, BS, KEY)) == index.match(block_hashes(second, BS, KEY)) == {"a": 2}
    r.run_prompt(list(range(300, 308)))
    seq, data = r.batch()
    assert index.apply("a", seq, decode_events(data))               # the batch after the snapshot
    assert index.match(block_hashes(list(range(300, 308)), BS, KEY)) == {"a": 2}


def test_old_and_repeated_batches_are_ignored():
    r, index = Replica("a", 2), PrefixIndex()
    index.load_snapshot("a", 0, [])
    first = list(range(8))
    r.run_prompt(first)
    one = r.batch()
    r.run_prompt(list(range(50, 58)))                      # evicts both blocks of `first`
    two = r.batch()
    for seq, data in (one, two, one, two):
        assert index.apply("a", seq, decode_events(data))
    assert index.match(block_hashes(first, BS, KEY)) == {"a": 0}
    assert index.num_blocks() == {"a": len(r.pool.cached_hashes())} == {"a": 2}


def test_an_unknown_replica_must_register_first():
    r, index = Replica("new", 8), PrefixIndex()
    r.run_prompt(list(range(8)))
    seq, data = r.batch()
    assert not index.apply("new", seq, decode_events(data))
    assert index.match(block_hashes(list(range(8)), BS, KEY)) == {}


def three_replicas_caching_one_prompt() -> tuple[list[Replica], PrefixIndex, list[int]]:
    """Replicas r0-r2, each caching the same 2-block prompt, an index synced with them, and the prompt's hashes."""
    reps, index = [Replica(f"r{i}", 8) for i in range(3)], PrefixIndex()
    for r in reps:
        index.load_snapshot(r.name, 0, [])
        r.run_prompt(list(range(8)))
    sync(index, reps)
    return reps, index, block_hashes(list(range(8)), BS, KEY)


def test_a_removed_replica_is_forgotten_and_its_slot_reused_clean():
    reps, index, h = three_replicas_caching_one_prompt()
    assert index.match(h) == {"r0": 2, "r1": 2, "r2": 2}
    index.remove_replica("r1")
    assert index.match(h) == {"r0": 2, "r2": 2}
    index.load_snapshot("r3", 0, [])                       # takes r1's slot, inherits none of its blocks
    assert index.match(h) == {"r0": 2, "r2": 2, "r3": 0}
    assert index.num_blocks() == {"r0": 2, "r2": 2, "r3": 0}
    for r in (reps[0], reps[2]):
        index.remove_replica(r.name)
    assert index.num_distinct_blocks() == 0                # no hash outlives its last replica
    index.remove_replica("r3")
    assert index.hits(h) == {} and index.longest(h) == (0, ())   # an empty pool holds nothing of any prompt
    assert PrefixIndex().longest(h) == (0, ())


def longest_of_hits(index: PrefixIndex, hashes: list[int]) -> tuple[int, set[str]]:
    """What longest() must say, from hits(): the most leading blocks any replica caches, and who caches them."""
    hits = index.hits(hashes)
    most = max(hits.values(), default=0)
    return most, {r for r, n in hits.items() if n == most and most}


def test_hits_names_only_replicas_with_a_hit_and_follows_every_change_to_the_index():
    """The routers ask hits() (and longest()) about one prompt's hash list several times; the answer for the same
    list is reused only while the index is unchanged, and a slot taken over by a new replica answers with its
    name."""
    reps, index, h = three_replicas_caching_one_prompt()
    assert index.hits(h) == index.hits(list(h)) == {"r0": 2, "r1": 2, "r2": 2}
    assert reps[0].pool.reset_prefix_cache()
    sync(index, reps)
    assert index.hits(h) == {"r1": 2, "r2": 2}              # the same list, asked again after r0's events
    assert index.match(h) == {"r0": 0, "r1": 2, "r2": 2}    # match() still lists every known replica
    index.remove_replica("r1")
    assert index.hits(h) == {"r2": 2} and index.longest(h) == (2, ("r2",))
    new = Replica("r3", 8)
    index.load_snapshot("r3", 0, [])                        # r1's slot, so the mask of r1 and r2 is reused
    new.run_prompt(list(range(8)))
    sync(index, [new])
    assert index.hits(h) == {"r2": 2, "r3": 2} and sorted(index.longest(h)[1]) == ["r2", "r3"]
    assert index.hits(h[:1] + [12345]) == {"r2": 1, "r3": 1} and index.hits([12345]) == {} and index.hits([]) == {}
    assert index.longest([12345]) == index.longest([]) == (0, ())
    new.run_prompt(list(range(8)) + [77] * 8)               # r3 alone caches a longer prefix of this prompt
    sync(index, [new])
    longer = block_hashes(list(range(8)) + [77] * 8, BS, KEY)
    assert index.longest(longer) == (4, ("r3",)) and index.hits(longer) == {"r2": 2, "r3": 4}


def test_all_blocks_cleared_empties_only_that_replica():
    reps, index = [Replica("a", 8), Replica("b", 8)], PrefixIndex()
    for r in reps:
        index.load_snapshot(r.name, 0, [])
        r.run_prompt(list(range(8)))
    assert reps[0].pool.reset_prefix_cache()
    reps[0].run_prompt(list(range(4)))                     # stored again after the clear, same batch
    sync(index, reps)
    assert index.match(block_hashes(list(range(8)), BS, KEY)) == {"a": 1, "b": 2}


def test_snapshot_round_trip_is_msgpack_and_keeps_seq_and_staleness():
    rng = random.Random(1)
    reps, index = [Replica(f"r{i}", 12) for i in range(3)], PrefixIndex()
    for r in reps:
        index.load_snapshot(r.name, 0, [])
    prompts = [[rng.randrange(50) for _ in range(4 * rng.randrange(1, 6))] for _ in range(40)]
    for p in prompts:
        rng.choice(reps).run_prompt(p)
    sync(index, reps)
    index.remove_replica("r0")
    index.load_snapshot("r0", 0, [])                       # slot order differs from a fresh build
    reps[2].batch()
    seq, data = reps[2].batch()
    assert not index.apply("r2", seq, decode_events(data))           # r2 goes stale
    blob = index.snapshot()
    assert set(msgpack.unpackb(blob)) == {"r0", "r1", "r2"}          # plain msgpack, no pickle
    copy = PrefixIndex.from_snapshot(blob)
    assert copy.num_blocks() == index.num_blocks() and copy.stale == {"r2"}
    for p in prompts:
        h = block_hashes(p, BS, KEY)
        assert copy.match(h) == index.match(h)
        n, names = copy.longest(h)
        assert (n, set(names)) == longest_of_hits(copy, h) == longest_of_hits(index, h)
    reps[1].run_prompt(list(range(900, 908)))
    seq, data = reps[1].batch()
    assert copy.apply("r1", seq, decode_events(data))                # it continues from the same batch


def test_state_actor_log_and_snapshots_give_mirrors_the_same_index():
    state, reps = ClusterState(), [Replica("p0", 16), Replica("p1", 16)]
    for r in reps:
        state.register("prefill", r.name, 0)
    reps[0].run_prompt(list(range(12)))
    reps[1].run_prompt(list(range(8)) + [9, 9, 9, 9])
    for r in reps:
        state.publish("prefill", r.name, *r.batch())
    mirror = IndexMirror("unused", interval_s=0.01)
    version, entries, snap = state.changes(0)
    assert snap is None
    for _, pool, rep, seq, events in entries:
        apply_entry(mirror.index[pool], rep, seq, events)
    h = block_hashes(list(range(12)), BS, KEY)
    assert mirror.index["prefill"].match(h) == state.index["prefill"].match(h) == {"p0": 3, "p1": 2}
    fresh = PrefixIndex.from_snapshot(state.index["prefill"].snapshot())
    assert fresh.match(h) == {"p0": 3, "p1": 2}
    state.forget("prefill", "p0")
    _, entries, _ = state.changes(version)
    for _, pool, rep, seq, events in entries:
        apply_entry(mirror.index[pool], rep, seq, events)
    assert mirror.index["prefill"].match(h) == {"p1": 2}


def test_a_mirror_long_polls_the_state_actor():
    """wait_changes answers as soon as a batch lands (not after a poll interval), and after its timeout when
    nothing changed: an idle cluster's mirrors cost no polling."""
    import asyncio
    import time as _time
    state, rep = ClusterState(), Replica("p0", 16)
    state.register("prefill", "p0", 0)

    async def scenario():
        version = state.version
        t0 = _time.monotonic()
        idle = await state.wait_changes(version, timeout_s=0.2)
        waited_idle = _time.monotonic() - t0
        rep.run_prompt(list(range(8)))

        async def publish_later():
            await asyncio.sleep(0.05)
            state.publish("prefill", "p0", *rep.batch())
        t0 = _time.monotonic()
        _, got = await asyncio.gather(publish_later(), state.wait_changes(version, timeout_s=60.0))
        return idle, waited_idle, got, _time.monotonic() - t0
    idle, waited_idle, got, waited = asyncio.run(scenario())
    assert idle == (state.version - 1, [], None) and waited_idle >= 0.19
    version, entries, snap = got
    assert snap is None and [e[2] for e in entries] == ["p0"] and version == state.version
    assert waited < 30.0, waited                  # woken by the batch, not by the 60 s timeout (a margin for a loaded machine)


def test_a_prefill_that_finished_since_the_stats_no_longer_holds_its_replicas_queue():
    """Serve's stats snapshot of a replica can be taken while it prefills a long prompt. The requests that
    follow with the same prefix must still go to it once that prefill has answered: the router takes the
    finished prefill off the stale queue (and so does the planning simulator, which shares the code)."""
    from router.config import RouterConfig
    from router.request_routers import PrefixAwareRouter, _live, prefill_finished
    from replica.messages import PoolRequest
    from engine import SamplingParams
    now = [100.0]
    state, reps = ClusterState(), [Replica("p0", 64), Replica("p1", 64)]
    prefix = list(range(1000, 1064))                            # 16 blocks of 4
    for r in reps:
        state.register("prefill", r.name, 0)
    reps[0].run_prompt(prefix)
    state.publish("prefill", "p0", *reps[0].batch())
    mirror = IndexMirror("unused", interval_s=0.01)
    for _, pool, rep, seq, events in state.changes(0)[1]:
        apply_entry(mirror.index[pool], rep, seq, events)
    router = PrefixAwareRouter.offline(block_size=BS, router=RouterConfig().model_dump(mode="json"),
                                       mirror=mirror, clock=lambda: now[0])

    @dataclass
    class Stats:
        routing_stats: dict

    # p0 was snapshotted at t=99.5 with the first full prompt (68 tokens) still queued; p1 is idle
    by_id = {"p0": Stats({"queued_prefill_tokens": 68, "time": 99.5}), "p1": Stats({"queued_prefill_tokens": 0,
                                                                                       "time": 99.5})}
    router.inflight.add("p0", 68, "first")
    router.inflight.sent["p0"][-1] = (99.0, 68)                # it was sent before the snapshot
    prompt = prefix + [7, 7, 7, 7]
    req = PoolRequest("second", prompt, block_hashes(prompt, BS, KEY), SamplingParams(max_tokens=1))
    assert router.route(req, by_id)[0] == "p1"                  # 4 uncached + 68 queued > 68 uncached on p1
    router.inflight.finish("first")                             # answered at t=100, after the snapshot
    req2 = PoolRequest("third", prompt, req.block_hashes, SamplingParams(max_tokens=1))
    router.inflight.finish("second")                            # p1 answered "second" too
    assert router.route(req2, by_id) == ("p0", "prefix_hit")
    # in Serve the routers of a process share one account, which the orchestrator tells of finished prefills
    shared = _live()._prefill_inflight
    shared.add("pX", 50, "r1")
    prefill_finished("r1")
    assert shared.extra("pX", 0.0) == 0 and "r1" not in shared.open


def test_a_replica_that_stops_reporting_is_forgotten(caplog):
    now = [0.0]
    state, r = ClusterState(clock=lambda: now[0], dead_after_s=15.0), Replica("dead", 16)
    state.register("prefill", "dead", 0)
    r.run_prompt(list(range(8)))
    state.publish("prefill", "dead", *r.batch())
    state.report("prefill", "dead", b"# metrics\n")
    h = block_hashes(list(range(8)), BS, KEY)
    assert state.index["prefill"].match(h) == {"dead": 2} and state.metrics_texts() == [b"# metrics\n"]
    now[0] = 15.0
    state.changes(0)
    assert state.metrics_texts() == [b"# metrics\n"]   # silent for exactly the limit: still there
    now[0] = 15.1
    version, entries, _ = state.changes(0)             # readers trigger the reaping
    assert state.index["prefill"].match(h) == {} and state.metrics_texts() == []
    assert entries[-1][2] == "dead" and entries[-1][4] == b"forget"     # mirrors hear it too
    # it was only quiet: its next report is told to resync, and the state actor says why it had been forgotten
    with caplog.at_level(logging.WARNING, logger="router.cluster_state"):
        assert state.report("prefill", "dead", b"# metrics\n", seq=1) is True
    assert "forgotten (silent for 15 s)" in caplog.text


# -- ranking ----------------------------------------------------------------------------------------
H = list(range(1, 9))                                      # 8 blocks of 16 = 128 tokens


def first(tiers_reason) -> tuple[str, str]:
    tiers, reason = tiers_reason
    return tiers[0][0], reason


def test_ranker_prefers_the_longer_hit_unless_its_queue_costs_more():
    ranker = PrefillRanker(load_weight=1.0, imbalance_threshold=1000)
    assert first(ranker.rank(H, 128, 16, {"a": 3, "b": 6, "c": 0}, {"a": 0, "b": 0, "c": 0})) == ("b", "prefix_hit")
    # b saves 96 tokens over c but has 120 queued: c is cheaper
    assert first(ranker.rank(H, 128, 16, {"b": 6, "c": 0}, {"b": 120, "c": 0})) == ("c", "no_hit_least_cost")
    assert first(ranker.rank(H, 128, 16, {"b": 6, "c": 0}, {"b": 80, "c": 0})) == ("b", "prefix_hit")
    tiers, _ = ranker.rank(H, 128, 16, {"a": 3, "b": 6, "c": 0}, {"a": 0, "b": 0, "c": 0})
    assert tiers == [["b"], ["a"], ["c"]]                  # every replica ranked, one per tier


def test_ranker_adds_other_work_a_replica_must_do_first():
    """`extra`: tokens of work before the prompt (loading a LoRA adapter the replica lacks) count like queued ones."""
    ranker = PrefillRanker(load_weight=1.0, imbalance_threshold=1000)
    assert first(ranker.rank(H, 128, 16, {"a": 6, "b": 6}, {"a": 0, "b": 0}, extra={"a": 256})) == ("b", "prefix_hit")
    # a's 96 cached tokens are worth less than the 256-token load: b computes the whole prompt sooner
    assert first(ranker.rank(H, 128, 16, {"a": 6, "b": 0}, {"a": 0, "b": 0}, extra={"a": 256}))[0] == "b"
    assert first(ranker.rank(H, 128, 16, {"a": 6, "b": 0}, {"a": 0, "b": 0}, extra={"a": 64}))[0] == "a"


def test_ranker_falls_back_to_least_loaded_when_imbalanced():
    ranker = PrefillRanker(load_weight=0.001, imbalance_threshold=1000)   # load alone would not outweigh the hit
    loads = {"a": 5000, "b": 0, "c": 0}
    tiers, reason = ranker.rank(H, 128, 16, {"a": 8, "b": 0, "c": 2}, loads)
    assert reason == "imbalanced_least_loaded"
    assert tiers == [["c"], ["b"], ["a"]]                  # equal loads: the hit decides
    assert first(ranker.rank(H, 128, 16, {"a": 8}, {"a": 1000, "b": 0})) == ("a", "prefix_hit")  # at the threshold


def test_ranking_only_the_best_picks_what_the_full_order_puts_first():
    """first_only (the simulator's routers): the same replica and reason as the full ranking's first, over pools
    with tied keys (broken by the prompt's hash), imbalanced loads, extra work and tie values."""
    rng = random.Random(5)
    for trial in range(300):
        ranker = PrefillRanker(load_weight=rng.choice([0.0, 0.5, 1.0]), imbalance_threshold=rng.choice([50, 10**9]))
        names = [f"r{i}" for i in range(rng.randrange(1, 12))]
        loads = {r: rng.choice([0, 0, 16, 40, 100]) for r in names}
        matches = {r: rng.choice([0, 0, 2, 4]) for r in names if rng.random() < 0.5}
        cached = {r: rng.choice([0, 5]) for r in names}
        extra = {r: rng.choice([0, 32]) for r in names} if trial % 3 == 0 else None
        tie = {r: rng.choice([0.0, 0.5]) for r in names} if trial % 4 == 0 else None
        hashes = [rng.randrange(1 << 60)]
        full = ranker.rank(hashes, 96, 16, matches, loads, cached, extra, tie)
        best = ranker.rank(hashes, 96, 16, matches, loads, cached, extra, tie, first_only=True)
        assert best == (full[0][:1], full[1]), (trial, full, best)


def test_a_replica_without_a_load_report_counts_as_idle():
    ranker = PrefillRanker(load_weight=1.0, imbalance_threshold=10_000)
    tiers, reason = ranker.rank(H, 128, 16, {"a": 4, "quiet": 4}, {"a": 50})
    assert tiers == [["quiet"], ["a"]] and reason == "prefix_hit"
    assert ranker.rank(H, 128, 16, {}, {}) == ([], "no_replica")


def test_ranker_ties_stick_per_prompt_and_spread_across_prompts():
    ranker = PrefillRanker(load_weight=1.0, imbalance_threshold=8192)
    idle = dict.fromkeys("abcdefgh", 0)
    picks = [first(ranker.rank([k * 7919, 1], 32, 16, {}, idle))[0] for k in range(400)]
    assert len(set(picks)) == 8 and max(picks.count(r) for r in idle) < 100   # spread, not one hot spot
    again = [first(ranker.rank([k * 7919, 2], 32, 16, {}, dict(reversed(idle.items()))))[0] for k in range(400)]
    assert again == picks                                  # the first block decides, not dict order
    # equal cost: the replica caching fewer blocks takes the new prefix, whatever the prompt
    assert {first(ranker.rank([k, 2], 32, 16, {}, {"a": 0, "b": 0}, {"a": 64, "b": 3}))[0] for k in range(20)} == {"b"}


def _rank_by_definition(ranker, hashes, num_tokens, bs, matches, loads, cached=None, extra=None, tie=None):
    """PrefillRanker.rank as its docstring defines it, written plainly: one sort on the whole key."""
    import xxhash
    replicas = set(loads) | set(matches)
    if not replicas:
        return [], "no_replica"
    load = {r: loads.get(r, 0) for r in replicas}
    cached, extra, tie = cached or {}, extra or {}, tie or {}
    salt = hashes[0] if hashes else num_tokens
    key = {r: (max(num_tokens - matches.get(r, 0) * bs, 0) + ranker.load_weight * load[r] + extra.get(r, 0),
               tie.get(r, 0), cached.get(r, 0), xxhash.xxh3_64_intdigest(r.encode(), seed=salt), r) for r in replicas}
    if max(load.values()) - min(load.values()) > ranker.imbalance_threshold:
        return [[r] for r in sorted(replicas, key=lambda r: (load[r], key[r]))], "imbalanced_least_loaded"
    order = sorted(replicas, key=key.__getitem__)
    return [[r] for r in order], "prefix_hit" if matches.get(order[0], 0) > 0 else "no_hit_least_cost"


def test_ranker_orders_a_large_pool_exactly_as_its_definition():
    """The ranker computes the tie-breaking hash only where cheaper keys tie (the planning simulator ranks a
    hundred replicas per request): its order is still the definition's, ties and all."""
    rng = random.Random(7)
    for trial in range(300):
        names = [f"prefill-{i}" for i in range(rng.choice([1, 2, 5, 40, 120]))]
        pick = lambda hi: {n: rng.choice([0, 0, 0, rng.randint(0, hi)]) for n in names}   # many ties
        loads = {n: v for n, v in pick(3000).items() if rng.random() < 0.95}            # some without a report
        matches = {n: v for n, v in pick(8).items() if v or rng.random() < 0.5}
        args = (rng.randrange(1 << 30), rng.randint(1, 3)), rng.randint(1, 200), 16, matches, loads
        kw = {"cached": pick(50) if trial % 2 else None, "extra": pick(300) if trial % 3 == 0 else None,
              "tie": {n: rng.choice([0.0, 0.5]) for n in names} if trial % 5 == 0 else None}
        ranker = PrefillRanker(load_weight=rng.choice([1.0, 0.25]), imbalance_threshold=rng.choice([500, 10**9]))
        assert ranker.rank(*args, **kw) == _rank_by_definition(ranker, *args, **kw)


# -- benchmark ----------------------------------------------------------------------------------------
@pytest.mark.bench
def test_router_bench_runs_small_and_reports_percentiles(tmp_path):
    import argparse
    import json

    from bench import router_bench
    p = argparse.ArgumentParser()
    router_bench.add_arguments(p)
    args = p.parse_args(["--prefixes", "300", "--replicas", "4", "--tenants", "5", "--decisions", "400",
                         "--tokens", "512", "--out", str(tmp_path)])
    r = router_bench.run(args)
    d = r["decision_us"]
    assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
    assert r["match_us"]["p50"] < d["p50"] and r["rank_us"]["p50"] < d["p50"]
    assert 0.70 <= r["prefix_hit_decisions"] <= 0.75 + 1e-9     # a quarter of the queries share nothing
    assert r["events"] == r["replica_blocks"] >= r["distinct_blocks"] > 0 and r["index_bytes"] > 0
    assert r["build_s"] > 0 and r["goals"]["p99_under_1ms"] == (d["p99"] < 1000)
    assert json.loads((tmp_path / "router.json").read_text())["decision_us"] == d
    assert (tmp_path / "router.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"r": [1, [2, "x"], False]}),
                                  msgpack.packb({"r": [1, [2]]}), msgpack.packb({1: [1, [2], False]})])
def test_malformed_snapshots_are_refused(data):
    with pytest.raises(ValueError):
        PrefixIndex.from_snapshot(data)
