"""The baton pass between engines of different TP sizes, in one process (a TP 2 engine spawns its worker):
prefill on one, pull the KV through KVLink (each rank its own heads; NIXL, and the Ray fallback on a local
Ray), decode on the other; greedy tokens equal one TP 1 engine doing it all, and no block stays pinned or
reserved: TP 2 -> 1, 1 -> 2, 2 -> 2 and (NIXL) 2 -> 4. Tiny random Llamas with 2 KV heads (split over TP 2,
replicated over TP 4) and 1 (replicated). Then rank 0's tally of
its ranks' pulls, against scripted ranks."""
from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.block_pool import blocks_for
from kvtransfer import KVLink
from kvtransfer.engine_link import TPRanks
from kvtransfer.rank_pulls import DONE, FAILED
from tests.conftest import make_tiny_checkpoint
from tests.test_kvtransfer_engines import EngineHost, cluster  # noqa: F401 - cluster: its local Ray fixture

XDIST_GROUP = "tensor-parallel"          # tests/conftest.py: with the other TP engines' modules, one fork server

pytestmark = pytest.mark.timeout(300)

TINY = dict(num_kv_blocks=48, max_model_len=256)
MODELS = {"2 KV heads": {}, "1 KV head": dict(num_key_value_heads=1)}
# (producer TP, consumer TP) -> the first token of its prompt (each pair its own prompt: no prefix cache hit)
PAIRS = {(2, 1): 10, (1, 2): 70, (2, 2): 130}
NIXL_PAIRS = {**PAIRS, (2, 4): 190}       # TP 4: both models' KV heads replicated over the ranks
TTL_S, NOW = 60.0, [time.time()]         # rank 0's clock: the test moves it past a pin's expiry


class TPHost(EngineHost):
    """EngineHost's prefill / decode / release, on an engine of any TP size in this process."""

    def __init__(self, model: str, tp: int, kind: str, prefix: str, registry: dict[str, bytes]):
        self.engine = LLMEngine(EngineConfig(model, tensor_parallel_size=tp, **TINY))
        self.link = KVLink(self.engine, prefix, kind=kind, peer_metadata=registry.__getitem__, ttl_s=TTL_S,
                           clock=lambda: NOW[0])
        registry.update(self.link.rank_metadata())     # what a replica registers with the state actor

    def pinned(self) -> int:
        return self.link.stats()["kv_pinned_requests"]


@pytest.fixture(scope="module", params=[pytest.param("1 KV head", marks=pytest.mark.slow), "2 KV heads"])
# slow: each model spawns seven TP workers (the replicated-head case runs in the full suite)
def model(request, tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("m"), "llama", **MODELS[request.param])


def _hosts(model: str, kind: str, pairs: dict):
    """A reference TP 1 engine, and hosts by TP size: {1: [one], 2: [two], ...} (TP 2 -> TP 2 needs two)."""
    registry: dict[str, bytes] = {}
    sizes = sorted({tp for pair in pairs for tp in pair})
    made = {tp: [TPHost(model, tp, kind, f"tp{tp}-{i}", registry) for i in range(2 if tp == 2 else 1)]
            for tp in sizes}
    yield LLMEngine(EngineConfig(model, **TINY)), made
    for host in [h for hosts in made.values() for h in hosts]:
        host.link.close()
        host.engine.shutdown()


@pytest.fixture(scope="module")
def nixl_hosts(model):
    yield from _hosts(model, "nixl", NIXL_PAIRS)


@pytest.fixture(scope="module")
def ray_hosts(cluster, model):
    """The Ray fallback on a local Ray: rank 0's payload is in the object store, a spawned worker's is not."""
    yield from _hosts(model, "ray", PAIRS)


def greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), "ref")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs[0].token_ids


@pytest.mark.parametrize("pair", sorted(NIXL_PAIRS), ids=lambda p: f"tp{p[0]}-to-tp{p[1]}")
def test_prefill_on_one_tp_size_decode_on_another_gives_one_engines_greedy_tokens(pair, nixl_hosts):
    _baton_pass(pair, *nixl_hosts, NIXL_PAIRS[pair])


@pytest.mark.parametrize("pair", sorted(PAIRS), ids=lambda p: f"tp{p[0]}-to-tp{p[1]}")
def test_the_ray_fallback_across_tp_sizes_gives_one_engines_greedy_tokens(pair, ray_hosts):
    _baton_pass(pair, *ray_hosts, PAIRS[pair])


def _baton_pass(pair: tuple[int, int], reference: LLMEngine, made: dict[int, list[TPHost]], start: int) -> None:
    producer, consumer = made[pair[0]][0], made[pair[1]][-1]
    NOW[0] = max(NOW[0], time.time())     # never behind real time: the consumer's import deadline reads it
    prompt = list(range(start, start + 50))                         # 3 full blocks and a partial one
    want = greedy(reference, prompt, 8)
    first, handoff = producer.prefill(prompt, f"a{pair}")
    assert first == want[0] and len(handoff.handle.rank_agents) == pair[0]
    assert producer.used_blocks() == blocks_for(len(prompt), 16) and producer.pinned() == 1
    got = consumer.decode(handoff, prompt, first, 8)
    assert got["tokens"] == want and got["transferred"] and got["pulled_blocks"] == 4, got
    assert producer.release() == [f"a{pair}"]                        # the consumer's rank 0 told producer rank 0
    assert producer.used_blocks() == 0 and producer.pinned() == 0 and consumer.used_blocks() == 0

    # the same opening, another ending: the consumer caches the 3 shared full blocks and pulls the last
    other = prompt[:48] + [3, 1, 4, 1, 5]
    want = greedy(reference, other, 8)
    first, handoff = producer.prefill(other, f"b{pair}")
    got = consumer.decode(handoff, other, first, 8)
    assert got["tokens"] == want and got["transferred"] and (got["local_blocks"], got["pulled_blocks"]) == (3, 1)
    assert producer.release() == [f"b{pair}"] and producer.used_blocks() == 0 and consumer.used_blocks() == 0

    # a handle for another prompt fills nothing: prefilled locally, nothing leaks
    _, handoff = producer.prefill(prompt, f"c{pair}")
    forged = [prompt[0] + 1] + prompt[1:]
    got = consumer.decode(handoff, forged, None, 4)
    assert not got["transferred"] and "another prompt" in got["error"]
    assert got["tokens"] == greedy(reference, forged, 4) and consumer.used_blocks() == 0
    NOW[0] += TTL_S                                                  # unpulled, its pin expires
    assert producer.release() == [f"c{pair}"] and producer.used_blocks() == 0 and producer.pinned() == 0


# -- rank 0's tally of every rank's pulls ------------------------------------------------------------

class ScriptedExecutor:
    """collective_rpc answers each call with the next scripted per-rank results."""

    def __init__(self, *answers: list):
        self.answers = list(answers)

    def collective_rpc(self, fn, *args) -> list:
        return self.answers.pop(0)


class Notified:
    kind, peer_metadata = "nixl", None

    def __init__(self):
        self.name, self.notified = "consumer.r0-x", []

    def notify_pulled(self, handoff) -> None:
        self.notified.append(handoff)


def _ranks(*answers: list) -> TPRanks:
    engine = type("Engine", (), {"executor": ScriptedExecutor(*answers)})()
    return TPRanks(engine, Notified(), [("consumer.r0-x", b""), ("consumer.r1-y", b"")])


def _handoff(request_id: str):
    from kvtransfer import KVHandle, KVHandoff
    return KVHandoff(KVHandle("p-1", request_id, [0], [7], 16, "c", 1e12))


def test_a_load_failed_on_one_rank_is_reported_only_once_no_rank_still_writes_into_its_blocks():
    ranks = _ranks([None, None], [{"r": FAILED}, {}], [{}, {}], [{}, {"r": DONE}])
    ranks.start("req", _handoff("r"), [3], 0)
    assert ranks.finished() == ([], {})          # rank 1's READ is still in flight: the blocks stay reserved
    assert ranks.finished() == ([], {})
    done, failed = ranks.finished()
    assert done == [] and list(failed) == ["req"] and "rank(s) [0]" in failed["req"]
    assert ranks.transport.notified == [] and not ranks.loads


def test_a_load_is_done_once_every_rank_is_and_the_producer_is_told_once():
    ranks = _ranks([None, None], [{}, {"r": DONE}], [{"r": DONE}, {}])
    ranks.start("req", _handoff("r"), [3], 0)
    assert ranks.finished() == ([], {})
    assert ranks.finished() == (["req"], {}) and len(ranks.transport.notified) == 1
    assert ranks.finished() == ([], {})           # nothing pending: no rank is asked


def test_a_load_no_rank_could_start_raises_and_one_rank_could_not_is_failed_when_the_others_end():
    from kvtransfer import KVTransferError
    ranks = _ranks(["refused", "refused"])
    with pytest.raises(KVTransferError, match="refused"):
        ranks.start("req", _handoff("r"), [3], 0)
    assert not ranks.loads
    ranks = _ranks([None, "unknown producer"], [{"r": DONE}, {}])
    ranks.start("req", _handoff("r"), [3], 0)
    assert list(ranks.finished()[1]) == ["req"] and ranks.transport.notified == []
