"""KV hand-off between pools of different TP sizes: the run planner, and pulls across TP sizes in one process
(each simulated rank its own cache shard and transport), byte-exact against a reference unsharded cache,
for NIXL and for the Ray fallback (its payload without Ray running)."""
from __future__ import annotations

import pytest
import torch

from engine.kv_layout import KVHeadLayout, kv_cache_shape
from kvtransfer import KVHandle, make_transport
from kvtransfer.rank_pulls import FAILED, RankPulls
from kvtransfer.tp_plan import HeadRun, plan_runs
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(120)

LAYERS, BLOCK, DIM, NUM_BLOCKS = 2, 4, 8, 12
COMPAT = "llama:test:torch.float32:bs4:L2:kv{heads}x8:v2"


# -- the planner ----------------------------------------------------------------------------------

def _plan(heads: int, producer_tp: int, consumer_tp: int) -> list[list[HeadRun]]:
    return [plan_runs(KVHeadLayout(heads, producer_tp), KVHeadLayout(heads, consumer_tp), r) for r in range(consumer_tp)]


def test_tp2_to_tp1_reads_each_producer_ranks_heads_as_one_run():
    assert _plan(4, 2, 1) == [[HeadRun(0, 0, 0, 2), HeadRun(1, 0, 2, 2)]]


def test_tp1_to_tp2_each_consumer_rank_reads_its_half_of_rank_0():
    assert _plan(4, 1, 2) == [[HeadRun(0, 0, 0, 2)], [HeadRun(0, 2, 0, 2)]]


def test_tp2_to_tp4_with_two_heads_replicates_each_head_on_two_consumer_ranks():
    assert _plan(2, 2, 4) == [[HeadRun(0, 0, 0, 1)], [HeadRun(0, 0, 0, 1)], [HeadRun(1, 0, 0, 1)], [HeadRun(1, 0, 0, 1)]]


def test_replicated_producer_heads_are_read_from_different_replicas():
    # TP 4 over 2 heads: ranks 0, 1 hold head 0 and ranks 2, 3 head 1; the two consumer ranks pick different ones
    assert _plan(2, 4, 2) == [[HeadRun(0, 0, 0, 1)], [HeadRun(3, 0, 0, 1)]]


def test_smollm2s_three_heads_from_tp1_to_tp2_split_unevenly():
    assert _plan(3, 1, 2) == [[HeadRun(0, 0, 0, 1)], [HeadRun(0, 1, 0, 2)]]


def test_same_layout_is_one_whole_run_per_rank():
    assert _plan(3, 2, 2) == [[HeadRun(0, 0, 0, 1)], [HeadRun(1, 0, 0, 2)]]


# -- pulls across TP sizes, ranks simulated in one process --------------------------------------

class Pool:
    """One replica's ranks: each its shard of a cache and its transport."""

    def __init__(self, kind: str, name: str, heads: int, tp: int, reference: torch.Tensor | None,
                 peers: dict, peer_metadata=None):
        self.layout = KVHeadLayout(heads, tp)
        self.transports = []
        for r in range(tp):
            held = list(self.layout.heads_of(r))
            cache = (reference[:, held].clone() if reference is not None
                     else torch.zeros(kv_cache_shape(NUM_BLOCKS, len(held), LAYERS, BLOCK, DIM)))
            t = make_transport(cache, name, COMPAT.format(heads=heads), kind=kind, peer_metadata=peer_metadata,
                               layout=self.layout, rank=r)
            peers[t.name] = t
            self.transports.append(t)
        self.ranks = [RankPulls(t) for t in self.transports]        # what each TP worker would hold

    def export(self, rid: str, blocks: list[int]):
        """What a TP engine's rank 0 does, after asking every rank (collective_rpc) for its part."""
        rank0 = self.transports[0]
        payloads = None if rank0.kind == "nixl" or len(self.transports) == 1 else \
            [t.shard_payload(blocks) for t in self.transports]
        return rank0.export(rid, blocks, [], len(blocks) * BLOCK, ttl_s=60,
                            agents=[t.name for t in self.transports], payloads=payloads)

    def pull(self, handoff, dst: list[int], skip: int = 0) -> list[str]:
        """What a TP engine does through collective_rpc: every rank starts its pull, rank 0 merges every
        rank's polls and, once all are done, tells the producer. Returns the ids that failed."""
        for r in self.ranks:
            r.start(handoff, dst, skip)
        states: dict[int, str] = {}                     # rank -> how its pull ended

        def ended() -> bool:                            # as kvtransfer/engine_link.py TPRanks.finished
            for i, r in enumerate(self.ranks):
                states.update({i: state for state in r.poll().values()})
            return len(states) == len(self.ranks)
        wait_for(ended, 30, "every rank's pull")
        if FAILED in states.values():
            return [handoff.handle.request_id]
        self.ranks[0].notify(handoff)
        return []

    def close(self) -> None:
        for t in self.transports:
            t.close()


@pytest.mark.parametrize("kind", ["nixl", "ray"])
@pytest.mark.parametrize("heads,producer_tp,consumer_tp", [(4, 2, 1), (4, 1, 2), (2, 2, 4), (3, 1, 2), (3, 2, 2)])
def test_every_consumer_rank_gets_exactly_its_heads(kind, heads, producer_tp, consumer_tp):
    g = torch.Generator().manual_seed(heads * 10 + producer_tp)
    reference = torch.randn(kv_cache_shape(NUM_BLOCKS, heads, LAYERS, BLOCK, DIM), generator=g)
    peers: dict = {}
    producer = Pool(kind, "prefill", heads, producer_tp, reference, peers)
    consumer = Pool(kind, "decode", heads, consumer_tp, None, peers, peer_metadata=lambda a: peers[a].metadata())
    try:
        src, dst = [3, 7, 8, 0, 11], [10, 5, 6, 1, 2]
        handoff = producer.export("req-1", src)
        assert handoff.handle.tp_size == producer_tp and len(handoff.handle.rank_agents) == producer_tp
        handoff = type(handoff)(KVHandle.from_bytes(handoff.handle.to_bytes()), handoff.payload)  # as it travels
        assert consumer.pull(handoff, dst, skip=1) == []          # block 3 -> 10 is "cached" at the consumer
        for r, t in enumerate(consumer.transports):
            want = reference[:, list(consumer.layout.heads_of(r))]
            assert torch.equal(t.kv_cache[dst[1:]], want[src[1:]])
            untouched = [b for b in range(NUM_BLOCKS) if b not in dst[1:]]
            assert not t.kv_cache[untouched].any()
        wait_for(lambda: producer.transports[0].poll() == ["req-1"], 30, "the producer's unpin")
        assert not producer.transports[0].leases
    finally:
        consumer.close()
        producer.close()


def test_only_rank_0_exports():
    peers: dict = {}
    pool = Pool("ray", "prefill", 2, 2, torch.zeros(kv_cache_shape(NUM_BLOCKS, 2, LAYERS, BLOCK, DIM)), peers)
    with pytest.raises(Exception, match="only rank 0"):
        pool.transports[1].export("r", [0], [], 4, ttl_s=10)
    with pytest.raises(ValueError, match="agents"):
        pool.transports[0].export("r", [0], [], 4, ttl_s=10)      # a TP-2 export must name both ranks


def test_a_rank_that_cannot_reach_its_producer_rank_fails_the_pull_and_nothing_is_unpinned():
    heads = 4
    reference = torch.randn(kv_cache_shape(NUM_BLOCKS, heads, LAYERS, BLOCK, DIM))
    peers: dict = {}
    producer = Pool("nixl", "prefill", heads, 2, reference, peers)
    consumer = Pool("nixl", "decode", heads, 2, None, peers, peer_metadata=lambda a: peers[a].metadata())
    try:
        handoff = producer.export("req-2", [1, 2])
        del peers[producer.transports[1].name]                    # producer rank 1's metadata is gone
        assert consumer.pull(handoff, [4, 5]) == ["req-2"]
        assert producer.transports[0].poll() == [] and "req-2" in producer.transports[0].leases
    finally:
        consumer.close()
        producer.close()
