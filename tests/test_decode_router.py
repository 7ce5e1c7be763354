"""The decode pool's RequestRouter (router/request_routers.py DecodeRouter), with Serve's replica and request
objects faked as far as choose_replicas reads them: a request that brings its KV goes to the replica with the
least KV in use and the fewest running sequences, counting what this router sent since the last stats; one
that prefills locally goes to the replica caching most of its prompt; a control call goes anywhere."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from engine import SamplingParams
from engine.block_hash import block_hashes
from kvtransfer import KVHandle, KVHandoff
from replica.messages import PoolRequest, PrefillResult
from router.config import RouterConfig
from router.prefix_index import PrefixIndex
from router.request_routers import DecodeRouter

BS, KEY = 16, "test-model"
PROMPT = list(range(100, 100 + 8 * BS))                  # 8 full blocks
HASHES = block_hashes(PROMPT, BS, KEY)
FROM_P0 = PrefillResult("p0", 7, None, 0, KVHandoff(KVHandle("prefill.p0-ab12", "r", list(range(8)), HASHES, len(PROMPT),
                                                          "c0ffee", 1.8e9)))


@dataclass
class FakeReplica:
    """What the router reads of Serve's RunningReplica: its id and the stats record_routing_stats reported."""
    name: str
    routing_stats: dict = field(default_factory=dict)

    @property
    def replica_id(self):
        return SimpleNamespace(unique_id=self.name)


def stats(used: int = 0, total: int = 100, running: int = 0) -> dict:
    return {"kv_blocks_used": used, "kv_blocks_total": total, "num_running": running, "time": time.time()}


def pending(request_id: str, prefill=None, hashes=HASHES, tokens=PROMPT):
    """Serve's PendingRequest as far as the router reads it: the PoolRequest the ingress sends, and its id."""
    payload = PoolRequest(request_id, tokens, hashes, SamplingParams(), prefill)
    return SimpleNamespace(args=[payload], metadata=SimpleNamespace(request_id=request_id))


def router(cached: dict[str, int] | None = None, max_num_seqs: int = 64) -> DecodeRouter:
    """A DecodeRouter without Serve's constructor, its index mirror a local index: replica -> leading blocks of
    PROMPT it caches."""
    r = DecodeRouter.__new__(DecodeRouter)
    cfg = RouterConfig()
    r.initialize_state(state_actor="unused", block_size=BS, max_num_seqs=max_num_seqs, index_sync_interval_s=0.01,
                       host_tier_hit_weight=0.9, load_weight=cfg.load_weight,
                       imbalance_threshold_tokens=cfg.imbalance_threshold_tokens)
    index = PrefixIndex()
    for name, n in (cached or {}).items():
        index.load_snapshot(name, 0, HASHES[:n])
    r.mirror = SimpleNamespace(index={"decode": index}, start=lambda: None)
    return r


def choose(r: DecodeRouter, replicas: list[FakeReplica], request) -> list[str]:
    tiers = asyncio.run(r.choose_replicas(replicas, request))
    assert all(len(t) == 1 for t in tiers)                    # one replica per tier, every candidate ranked
    return [t[0].name for t in tiers]


def test_a_transferred_request_goes_to_the_replica_with_the_least_kv_in_use():
    replicas = [FakeReplica("a", stats(used=60)), FakeReplica("b", stats(used=10)), FakeReplica("c", stats(used=30))]
    assert choose(router(), replicas, pending("r1", prefill=FROM_P0)) == ["b", "c", "a"]


def test_with_equal_kv_the_replica_running_fewer_sequences_wins():
    replicas = [FakeReplica("a", stats(used=20, running=40)), FakeReplica("b", stats(used=20, running=3))]
    assert choose(router(), replicas, pending("r1", prefill=FROM_P0))[0] == "b"
    # a full batch outweighs a little more KV: 64/64 running costs as much as the whole cache
    replicas = [FakeReplica("a", stats(used=25, running=64)), FakeReplica("b", stats(used=35, running=0))]
    assert choose(router(), replicas, pending("r2", prefill=FROM_P0))[0] == "b"


def test_requests_sent_since_the_last_stats_count_against_their_replica():
    r = router()
    replicas = [FakeReplica("a", stats(used=10)), FakeReplica("b", stats(used=12))]
    req = pending("r1", prefill=FROM_P0)
    assert choose(r, replicas, req)[0] == "a"
    r.on_request_routed(req, replicas[0].replica_id, None)     # 8 blocks on their way to a, unseen by its stats
    assert choose(r, replicas, pending("r2", prefill=FROM_P0))[0] == "b"


def test_a_local_prefill_goes_to_the_replica_caching_most_of_the_prompt_even_if_busier():
    replicas = [FakeReplica("idle", stats(used=0)), FakeReplica("warm", stats(used=70, running=20)),
                FakeReplica("some", stats(used=30))]
    r = router(cached={"warm": 8, "some": 3})
    assert choose(r, replicas, pending("r1")) == ["warm", "some", "idle"]
    # equal hits: pressure decides
    r = router(cached={"warm": 8, "idle": 8})
    assert choose(r, replicas, pending("r2"))[0] == "idle"


def test_a_local_prefill_weighs_the_prompt_tokens_queued_on_each_replica():
    """The prefill pool's rule (router.prefix_index.PrefillRanker): a replica caching the prompt whose queue of
    prompt tokens costs more than computing the prompt elsewhere loses to an idle one; past the imbalance
    threshold the least-loaded replica goes first whatever it caches."""
    def queued(n: int) -> dict:
        return {**stats(), "queued_prefill_tokens": n}
    r = router(cached={"warm": 8})
    assert choose(r, [FakeReplica("warm", queued(100)), FakeReplica("idle", queued(0))], pending("r1"))[0] == "warm"
    assert choose(r, [FakeReplica("warm", queued(200)), FakeReplica("idle", queued(0))], pending("r2"))[0] == "idle"
    r.ranker.imbalance_threshold = 50
    assert choose(r, [FakeReplica("warm", queued(60)), FakeReplica("idle", queued(0))], pending("r3"))[0] == "idle"


def test_a_host_tier_hit_counts_at_its_discount():
    """Blocks a replica holds only in its host KV tier count host_tier_hit_weight of a device block: 8 blocks
    in host memory (7.2 at 0.9) beat 6 on the device, and lose to them at 0.5 (4.0)."""
    replicas = [FakeReplica("device", stats()), FakeReplica("host", stats())]
    r = router(cached={"device": 6})
    r.mirror.index["decode"].load_snapshot("host", 0, [], HASHES)
    assert choose(r, replicas, pending("r1")) == ["host", "device"]
    assert r._routing["r1"][1] == {"device": 6, "host": 8}, "the prediction counts both tiers as cached"
    r.host_weight = 0.5
    assert choose(r, replicas, pending("r2")) == ["device", "host"]


def test_a_request_without_routing_fields_may_go_to_any_replica():
    replicas = [FakeReplica("a", stats(used=90)), FakeReplica("b")]
    control = SimpleNamespace(args=[], metadata=SimpleNamespace(request_id="c"))
    assert asyncio.run(router().choose_replicas(replicas, control)) == [replicas]
    assert asyncio.run(router().choose_replicas(replicas, None)) == [replicas]


def test_a_moved_request_never_goes_back_to_a_replica_it_left():
    from dataclasses import replace
    replicas = [FakeReplica("left", stats(used=0)), FakeReplica("other", stats(used=90, running=50))]
    req = pending("r1")
    req.args[0] = replace(req.args[0], avoid=("left",))
    r = router(cached={"left": 8})                         # caching the whole prompt does not bring it back
    assert choose(r, replicas, req) == ["other"]
    # only replicas it left: no answer, and Serve asks again once its replica set changes, backing off between
    # rounds: without the flag its retry loop never yields, and the ingress's handles all hang (a draining
    # replica stays listed until its successor runs, which that loop would then never hear of)
    req.routing_context = SimpleNamespace(should_backoff=False)
    assert asyncio.run(r.choose_replicas([replicas[0]], req)) == []
    assert req.routing_context.should_backoff is True


def test_the_routers_cache_prediction_is_observed_against_what_the_engine_found():
    """A local prefill records what the index says the chosen replica caches (capped below the block with the
    last prompt token, which the engine always computes); the engine's count is observed against it once, as
    exact, over or under. Transferred and continued requests get no prediction."""
    from prometheus_client import REGISTRY

    from engine import Resume
    from router.request_routers import observe_found

    def outcomes() -> dict[str, float]:
        return {o: REGISTRY.get_sample_value("baton_router_cache_predictions_total",
                                             {"pool": "decode", "outcome": o}) or 0.0 for o in ("exact", "over", "under")}

    def route(r: DecodeRouter, request, to: str) -> None:
        choose(r, [FakeReplica("a", stats()), FakeReplica("b", stats())], request)
        r.on_request_routed(request, SimpleNamespace(unique_id=to), None)

    r, before = router(cached={"a": 8, "b": 3}), outcomes()
    found0 = REGISTRY.get_sample_value("baton_router_found_cached_tokens_sum", {"pool": "decode"}) or 0.0
    route(r, pending("whole"), "a")              # all 8 blocks cached: the engine can take 7 of them
    observe_found("decode", "whole", 7 * BS)
    route(r, pending("stale"), "b")              # the index says 3 blocks; the engine had evicted one
    observe_found("decode", "stale", 2 * BS)
    observe_found("decode", "stale", 2 * BS)     # observed once only
    route(r, pending("kv", prefill=FROM_P0), "a")
    observe_found("decode", "kv", 0)             # it brought its KV: nothing to compare
    moved = pending("moved")
    moved.args[0].resume = Resume([5, 6], 2)
    route(r, moved, "a")
    observe_found("decode", "moved", 3 * BS)
    after = outcomes()
    assert {o: after[o] - before[o] for o in after} == {"exact": 1, "over": 1, "under": 0}
    assert REGISTRY.get_sample_value("baton_router_found_cached_tokens_sum", {"pool": "decode"}) - found0 == 9 * BS


def test_a_replica_lacking_the_requests_lora_adapter_pays_its_load():
    """router.lora_load_cost_tokens: a replica whose routing stats do not list the adapter's key costs that many
    tokens more: of KV in use for a request that brings its KV (so a slightly busier replica holding the
    adapter wins, a much busier one does not), of work for a local prefill. The base model pays nothing."""
    from engine.lora import LoRARequest
    lora = LoRARequest("tone", 1, "/unused", lora_key="k-tone")
    r = router()
    r.lora_cost = 256                                   # tokens; the caches hold 100 blocks of 16 = 1,600
    hashes = block_hashes(PROMPT, BS, f"{KEY}|lora:k-tone")

    def with_lora(rid, prefill=None):
        req = pending(rid, prefill=prefill, hashes=hashes)
        req.args[0].lora = lora
        return req
    holds = {**stats(used=20), "loras": ["k-tone"]}
    assert choose(r, [FakeReplica("a", stats(used=10)), FakeReplica("b", holds)], with_lora("r1", FROM_P0))[0] == "b"
    busy = {**stats(used=40), "loras": ["k-tone"]}      # 30 blocks (480 tokens) busier: more than the load
    assert choose(r, [FakeReplica("a", stats(used=10)), FakeReplica("b", busy)], with_lora("r2", FROM_P0))[0] == "a"
    assert choose(r, [FakeReplica("a", stats(used=10)), FakeReplica("b", holds)], pending("r3", FROM_P0))[0] == "a"
    # a local prefill that neither replica caches: the one holding the adapter computes less
    assert choose(r, [FakeReplica("a", stats()), FakeReplica("b", {**stats(), "loras": ["k-tone"]})],
                  with_lora("r4"))[0] == "b"
