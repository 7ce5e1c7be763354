"""KV hand-off between engines in separate processes (Ray actors): exact pulls, partial pulls, 32 in
flight, unpin on notification and on timeout, a producer restarted mid-run, compatibility checks;
for NIXL and for the Ray fallback. A consumer meets a producer through its metadata, asked once."""
from __future__ import annotations

import sys
import time
from dataclasses import replace

import msgpack
import numpy as np
import pytest
import ray
import torch

from cluster.serving import init_ray
from kvtransfer import KVHandle, KVHandleError, KVHandoff, make_transport
from tests.conftest import wait_for

pytestmark = pytest.mark.timeout(300)

NUM_BLOCKS = 256
LAYOUT = (2, 4, 2, 16, 16)      # kv heads, layers, K/V, block size, head dim (engine/kv_layout.py): 16 KiB fp32 blocks
COMPAT = "llama:test:torch.float32:bs16:L4:kv2x16:v2"


def _actor(agent: str):
    return ray.get_actor(agent.rsplit("-", 1)[0])        # in these tests an agent's prefix names its actor


def _peer_metadata(agent: str) -> bytes:
    return ray.get(_actor(agent).metadata.remote())


class KVOwner:
    """Stands in for an engine's owner: a random KV cache of the engine's layout and its transport."""

    def __init__(self, kind: str, prefix: str, compat: str = COMPAT, num_blocks: int = NUM_BLOCKS):
        self.kv = torch.randn((num_blocks, *LAYOUT))     # different in every incarnation
        self.skew = 0.0                                   # seconds this owner's clock runs ahead
        self.t = make_transport(self.kv, prefix, compat, kind=kind, peer_metadata=_peer_metadata,
                                clock=lambda: time.time() + self.skew)

    def advance(self, seconds: float) -> None:
        self.skew += seconds

    def name(self) -> str:
        return self.t.name

    def metadata(self) -> bytes:
        return self.t.metadata()

    def export(self, request_id: str, block_ids: list[int], ttl_s: float = 60.0) -> KVHandoff:
        return self.t.export(request_id, block_ids, [], 16 * len(block_ids), ttl_s)

    def poll(self) -> list[str]:
        return self.t.poll()

    def blocks(self, block_ids: list[int]) -> np.ndarray:
        return self.kv[block_ids].numpy()

    def pull(self, jobs: list[tuple[KVHandoff, list[int], int]]) -> list[str | None]:
        """Start every pull, then wait for each: None where it succeeded, else 'ErrorType: message'."""
        started = []
        for handoff, dst, skip in jobs:
            try:
                started.append(self.t.start_pull(handoff, dst, skip))
            except Exception as e:
                started.append(e)
        out = []
        for p in started:
            try:
                if isinstance(p, Exception):
                    raise p
                p.wait(timeout_s=30)
                out.append(None)
            except Exception as e:
                out.append(f"{type(e).__name__}: {e}")
        return out

    def add_peer(self, metadata: bytes) -> str:
        try:
            return self.t.add_peer(metadata)
        except Exception as e:
            return f"{type(e).__name__}: {e}"


def _spawn(kind: str, prefix: str, **kw):
    return ray.remote(KVOwner).options(name=prefix, num_cpus=0, max_restarts=1).remote(kind, prefix, **kw)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.tobytes() == b.tobytes()


def _released(producer, want: set[str], timeout_s: float = 10.0) -> set[str]:
    got: set[str] = set()

    def all_released() -> bool:
        got.update(ray.get(producer.poll.remote()))
        return want <= got
    wait_for(all_released, timeout_s, f"the producer to unpin {sorted(want)}", interval_s=0.02)
    return got


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])    # workers cannot import this file
    init_ray(num_cpus=2, namespace="test-kvtransfer", include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module", params=["nixl", "ray"])
def pair(request, cluster):
    kind = request.param
    producer, consumer = _spawn(kind, f"producer-{kind}"), _spawn(kind, f"consumer-{kind}")
    ray.get([producer.name.remote(), consumer.name.remote()])
    yield kind, producer, consumer
    for a in (producer, consumer):
        ray.kill(a)


# -- without Ray ----------------------------------------------------------------------------------

def test_handle_round_trips_and_rejects_malformed_bytes():
    h = KVHandle("prefill-0-ab12", "req-1", [3, 1, 2], [2**64 - 1, 7], 40, "c0ffee", 1.8e9, "nixl")
    assert KVHandle.from_bytes(h.to_bytes()) == h
    d = msgpack.unpackb(h.to_bytes())
    for bad in (b"\xc1garbage", msgpack.packb([1, 2]), msgpack.packb({**d, "v": 99}),
                msgpack.packb({k: v for k, v in d.items() if k != "expiry"}),
                msgpack.packb({**d, "block_ids": [1, "x"]}), msgpack.packb({**d, "kind": "carrier-pigeon"}),
                msgpack.packb({**d, "extra": 1}), msgpack.packb({**d, "tp_size": 0}),
                msgpack.packb({**d, "tp_size": 2}),                   # two producer ranks, one agent
                msgpack.packb({**d, "tp_size": 2, "agents": ["other-0", "prefill-1-cd34"]})):
        with pytest.raises(KVHandleError):
            KVHandle.from_bytes(bad)


def test_make_transport_rejects_an_unknown_kind():
    with pytest.raises(ValueError, match="nixl"):
        make_transport(torch.zeros(4, 8), "x", COMPAT, kind="carrier-pigeon")


def test_a_consumer_asks_for_a_producers_metadata_once_for_many_pulls():
    """The resolver (in a cluster: the state actor) is asked once per producer agent, not per hand-off; a
    restarted producer is a new agent, asked for once more."""
    asked: list[str] = []
    producers = {}

    def peer_metadata(agent: str) -> bytes:
        asked.append(agent)
        return producers[agent].metadata()

    def producer():
        t = make_transport(torch.randn((16, *LAYOUT)), "producer-once", COMPAT)
        producers[t.name] = t
        return t

    consumer = make_transport(torch.zeros((16, *LAYOUT)), "consumer-once", COMPAT, peer_metadata=peer_metadata)
    first = producer()
    try:
        for i in range(6):
            consumer.pull(first.export(f"r{i}", [i, 15 - i], [], 32, ttl_s=30), [i, 15 - i], timeout_s=30)
        assert asked == [first.name]
        assert torch.equal(consumer.kv_cache[:6], first.kv_cache[:6])
        again = producer()                                   # the same replica, restarted: a new agent
        for i in range(3):
            consumer.pull(again.export(f"s{i}", [i], [], 16, ttl_s=30), [i], timeout_s=30)
        assert asked == [first.name, again.name]
        assert torch.equal(consumer.kv_cache[:3], again.kv_cache[:3])
    finally:
        for t in (consumer, *producers.values()):
            t.close()


# -- two processes --------------------------------------------------------------------------------

def test_pull_is_byte_exact_and_touches_only_its_blocks(pair):
    _, producer, consumer = pair
    src, dst = [3, 7, 8, 9, 40], [100, 5, 6, 200, 11]
    before = ray.get(consumer.blocks.remote(list(range(NUM_BLOCKS))))
    handle = ray.get(producer.export.remote("exact", src))
    assert ray.get(consumer.pull.remote([(handle, dst, 0)])) == [None]
    after = ray.get(consumer.blocks.remote(list(range(NUM_BLOCKS))))
    assert _same(after[dst], ray.get(producer.blocks.remote(src)))
    rest = sorted(set(range(NUM_BLOCKS)) - set(dst))
    assert _same(after[rest], before[rest])


def test_partial_pull_leaves_the_locally_cached_blocks_alone(pair):
    _, producer, consumer = pair
    src, dst = [20, 21, 22, 23, 24, 25], [50, 51, 52, 53, 54, 55]
    before = ray.get(consumer.blocks.remote(dst))
    handle = ray.get(producer.export.remote("partial", src))
    assert ray.get(consumer.pull.remote([(handle, dst, 2)])) == [None]
    after = ray.get(consumer.blocks.remote(dst))
    assert _same(after[:2], before[:2])
    assert _same(after[2:], ray.get(producer.blocks.remote(src[2:])))
    # every block already local: nothing is copied, but the producer still hears it can unpin
    handle = ray.get(producer.export.remote("all-local", [30, 31]))
    before = ray.get(consumer.blocks.remote([60, 61]))
    assert ray.get(consumer.pull.remote([(handle, [60, 61], 2)])) == [None]
    assert _same(ray.get(consumer.blocks.remote([60, 61])), before)
    assert "all-local" in _released(producer, {"all-local"})


def test_32_transfers_in_flight_are_all_exact_and_all_unpinned(pair):
    _, producer, consumer = pair
    rng = np.random.default_rng(0)
    srcs = [rng.choice(NUM_BLOCKS, size=3, replace=False).tolist() for _ in range(32)]
    dsts = rng.permutation(NUM_BLOCKS)[:96].reshape(32, 3).tolist()       # disjoint destinations
    handles = ray.get([producer.export.remote(f"many-{i}", s) for i, s in enumerate(srcs)])
    assert ray.get(consumer.pull.remote([(h, d, 0) for h, d in zip(handles, dsts)])) == [None] * 32
    got = ray.get(consumer.blocks.remote(sum(dsts, [])))
    want = ray.get(producer.blocks.remote(sum(srcs, [])))
    assert _same(got, want)
    ids = {f"many-{i}" for i in range(32)}
    assert ids <= _released(producer, ids)


def test_producer_unpins_when_the_consumer_says_it_pulled(pair):
    kind, producer, consumer = pair
    ray.get(producer.poll.remote())
    handle = ray.get(producer.export.remote("notify", [1, 2]))
    if kind == "ray":               # the hand-off carries a copy of the blocks: the pin ends at once
        assert "notify" in ray.get(producer.poll.remote())
    else:
        assert "notify" not in ray.get(producer.poll.remote())      # pinned while nobody pulled
    assert ray.get(consumer.pull.remote([(handle, [1, 2], 0)])) == [None]
    if kind == "nixl":
        assert "notify" in _released(producer, {"notify"})


def test_producer_unpins_at_expiry_and_an_expired_handle_is_refused(pair):
    kind, producer, consumer = pair
    ray.get(producer.poll.remote())
    handle = ray.get(producer.export.remote("ttl", [4, 5], 0.5))
    if kind == "nixl":              # (the Ray fallback unpins at export: see the test above)
        assert "ttl" not in ray.get(producer.poll.remote())
    ray.get([producer.advance.remote(0.6), consumer.advance.remote(0.6)])   # both clocks: expiry is unix time
    if kind == "nixl":
        assert "ttl" in ray.get(producer.poll.remote())           # at its 0.5 s expiry, nobody having pulled
    before = ray.get(consumer.blocks.remote([70, 71]))
    (err,) = ray.get(consumer.pull.remote([(handle, [70, 71], 0)]))
    assert err.startswith("KVTransferError") and "expired" in err
    assert _same(ray.get(consumer.blocks.remote([70, 71])), before)


def test_incompatible_engines_never_copy(pair):
    kind, producer, consumer = pair
    odd = _spawn(kind, f"odd-{kind}", compat=COMPAT.replace("bs16", "bs32"), num_blocks=16)
    try:
        before = ray.get(consumer.blocks.remote([0]))
        (err,) = ray.get(consumer.pull.remote([(ray.get(odd.export.remote("odd", [1])), [0], 0)]))
        assert err.startswith("KVCompatibilityError")
        assert ray.get(consumer.add_peer.remote(ray.get(odd.metadata.remote()))).startswith("KVCompatibilityError")
        assert _same(ray.get(consumer.blocks.remote([0])), before)
    finally:
        ray.kill(odd)
    # a handle of the other transport kind is refused the same way
    other = "ray" if kind == "nixl" else "nixl"
    handoff = ray.get(producer.export.remote("kind", [1]))
    forged = replace(handoff, handle=replace(handoff.handle, kind=other))
    (err,) = ray.get(consumer.pull.remote([(forged, [0], 0)]))
    assert err.startswith("KVCompatibilityError")


def test_consumer_recovers_from_a_producer_restart(pair):
    _, producer, consumer = pair
    old = ray.get(producer.name.remote())
    first, stale = ray.get([producer.export.remote("before", [10, 11]), producer.export.remote("stale", [12])])
    assert ray.get(consumer.pull.remote([(first, [80, 81], 0)])) == [None]       # the old agent is known
    ray.kill(producer, no_restart=False)

    def restarted() -> bool:                                       # ray.kill returns before the process dies
        try:
            return ray.get(producer.name.remote(), timeout=10) != old
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            return False
    wait_for(restarted, 60, "the producer to come back", interval_s=0.2)
    before = ray.get(consumer.blocks.remote([90]))
    (err,) = ray.get(consumer.pull.remote([(stale, [90], 0)]))     # names the dead agent: fails alone
    assert err.startswith("KVTransferError"), err
    assert _same(ray.get(consumer.blocks.remote([90])), before)
    after = ray.get(producer.export.remote("after", [10, 11, 12]))
    assert ray.get(consumer.pull.remote([(after, [82, 83, 84], 0)])) == [None]
    assert _same(ray.get(consumer.blocks.remote([82, 83, 84])), ray.get(producer.blocks.remote([10, 11, 12])))
    (err,) = ray.get(consumer.pull.remote([(stale, [90], 0)]))     # the new incarnation replaced the old
    assert err.startswith("KVTransferError"), err
