"""The router's prefix index is exact: fed only by real BlockPools' KV events (through the msgpack
codec), it agrees with a brute-force recount of every pool's cache; gaps force a resync; the
prefill ranking prefers hits, sticks, and falls back to least-loaded when loads are uneven."""
from __future__ import annotations

import random

from engine.kv import BlockPool, block_hashes, decode_events, encode_events
from router.cluster_state import ClusterState, IndexMirror, apply_entry
from router.prefix_index import PrefillRanker, PrefixIndex

BS, KEY = 4, "test-model"


class Replica:
    """A BlockPool driven like an engine: prompts cached block by block, freed, evicted by reuse."""

    def __init__(self, name: str, num_blocks: int):
        self.name, self.events, self.seq = name, [], 0
        self.pool = BlockPool(num_blocks, BS, True, self.events.append)

    def run_prompt(self, tokens: list[int]) -> None:
        hashes = block_hashes(tokens, BS, KEY)
        hit = self.pool.match(hashes, tokens)
        self.pool.touch(hit)
        n = len(hashes) - len(hit)
        if not self.pool.can_allocate(n):
            self.pool.free(hit)
            return
        new = self.pool.allocate(n)
        for i, b in enumerate(new, start=len(hit)):
            self.pool.cache_block(b, hashes[i], tokens[i * BS:(i + 1) * BS], hashes[i - 1] if i else None)
        self.pool.free(hit + new)

    def batch(self) -> tuple[int, bytes]:
        self.seq += 1
        events, self.events[:] = list(self.events), []
        return self.seq, encode_events(events)

    def leading(self, hashes: list[int]) -> int:
        cached = {b.hash for b in self.pool.blocks if b.hash is not None}
        n = 0
        while n < len(hashes) and hashes[n] in cached:
            n += 1
        return n


def test_index_matches_a_brute_force_recount_through_churn():
    rng = random.Random(0)
    systems = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    replicas = [Replica(f"r{i}", 24) for i in range(3)]
    index = PrefixIndex()
    for r in replicas:
        index.load_snapshot(r.name, 0, [])
    prompts = []
    for step in range(300):
        r = rng.choice(replicas)
        p = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(0, 10))]
        prompts.append(p)
        r.run_prompt(p)
        if step % 7 == 0 or step == 299:
            for x in replicas:
                seq, data = x.batch()
                assert index.apply(x.name, seq, decode_events(data))
            for q in prompts[-20:] + systems:
                h = block_hashes(q, BS, KEY)
                assert index.match(h) == {x.name: x.leading(h) for x in replicas}


def test_a_missing_batch_marks_the_replica_stale_until_a_snapshot():
    r, index = Replica("a", 16), PrefixIndex()
    index.load_snapshot("a", 0, [])
    r.run_prompt(list(range(8)))
    r.batch()                                          # batch 1 is lost
    r.run_prompt(list(range(100, 108)))
    seq, data = r.batch()
    assert not index.apply("a", seq, decode_events(data))
    assert "a" in index.stale
    cached = [b.hash for b in r.pool.blocks if b.hash is not None]
    index.load_snapshot("a", seq, cached)
    assert index.match(block_hashes(list(range(8)), BS, KEY)) == {"a": 2}
    index.remove_replica("a")
    assert index.match(block_hashes(list(range(8)), BS, KEY)) == {}


def test_state_actor_log_and_snapshots_give_mirrors_the_same_index():
    state, reps = ClusterState(), [Replica("p0", 16), Replica("p1", 16)]
    for r in reps:
        state.register("prefill", r.name, b"", 0)
    reps[0].run_prompt(list(range(12)))
    reps[1].run_prompt(list(range(8)) + [9, 9, 9, 9])
    for r in reps:
        state.publish("prefill", r.name, *r.batch())
    mirror = IndexMirror("unused")
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


def test_ranker_prefers_hits_sticks_and_falls_back_when_imbalanced():
    ranker = PrefillRanker(load_weight=1.0, imbalance_threshold=1000)
    h = list(range(1, 9))                              # 8 blocks of 16 = 128 tokens
    tiers, reason = ranker.rank(h, 128, 16, {"a": 6, "b": 0}, {"a": 0, "b": 0})
    assert tiers[0] == ["a"] and reason == "prefix_hit"
    # a hit is worth less than the queue in front of it
    tiers, _ = ranker.rank(h, 128, 16, {"a": 6, "b": 0}, {"a": 500, "b": 0})
    assert tiers[0] == ["b"]
    tiers, reason = ranker.rank(h, 128, 16, {"a": 8, "b": 0}, {"a": 5000, "b": 0})
    assert tiers[0] == ["b"] and reason == "imbalanced_least_loaded"
    # no hits anywhere: one prompt always lands on the same replica, different prompts spread
    firsts = {ranker.rank([k], 16, 16, {}, dict.fromkeys("abcd", 0))[0][0][0] for k in range(40)}
    assert len(firsts) > 1
    assert len({ranker.rank([7], 16, 16, {}, dict.fromkeys("abcd", 0))[0][0][0] for _ in range(5)}) == 1


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
    assert 0.4 < r["prefix_hit_decisions"] <= 0.75 + 1e-9      # half the queries continue a cached prompt
    assert json.loads((tmp_path / "router.json").read_text())["decision_us"] == d
    assert (tmp_path / "router.png").read_bytes()[:4] == b"\x89PNG"


def test_new_prefixes_spread_to_the_emptier_replica():
    ranker = PrefillRanker()
    tiers, _ = ranker.rank([1, 2], 32, 16, {}, {"a": 0, "b": 0}, {"a": 64, "b": 3})
    assert tiers[0] == ["b"]


def test_a_replica_that_stops_reporting_is_forgotten(monkeypatch):
    import router.cluster_state as cs
    state, r = ClusterState(), Replica("dead", 16)
    state.register("prefill", "dead", b"", 0)
    r.run_prompt(list(range(8)))
    state.publish("prefill", "dead", *r.batch())
    state.report("prefill", "dead", b"# metrics\n")
    h = block_hashes(list(range(8)), BS, KEY)
    assert state.index["prefill"].match(h) == {"dead": 2} and state.metrics_texts() == [b"# metrics\n"]
    monkeypatch.setattr(cs, "DEAD_AFTER_S", 0.0)
    version, entries, _ = state.changes(0)             # readers trigger the reaping
    assert state.index["prefill"].match(h) == {} and state.metrics_texts() == []
    assert entries[-1][2] == "dead" and entries[-1][4] == b"forget"     # mirrors hear it too
