"""The baton pass between two engines in two processes: one prefills (blocks pinned), the other pulls
the KV over the transport and decodes; greedy tokens equal one engine doing both. NIXL and the Ray
fallback, on the default model; and over NIXL an int8 KV cache, whose blocks carry their scales."""
from __future__ import annotations

import sys

import pytest
import ray

from cluster.serving import init_ray
from engine import LLM, EngineConfig, LLMEngine, RemotePrefill, SamplingParams
from engine.errors import InvalidRequestError
from engine.block_hash import block_hashes
from engine.block_pool import blocks_for
from kvtransfer import KVHandoff, KVLink

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ENGINE = dict(num_kv_blocks=96, max_model_len=1024)
STORY = ("The history of the relay race begins in ancient Greece, where runners carried torches from "
         "altar to altar. Modern relays pass a baton instead: four runners, each covering one leg, and "
         "the race is often won or lost in the exchange zone, where")


def _remote(engine: LLMEngine, handoff: KVHandoff, prompt: list[int], first: int | None) -> RemotePrefill:
    return RemotePrefill(handoff, block_hashes(prompt, engine.block_size, engine.model_key), first, None,
                         deadline=handoff.handle.expiry - 2)


def _peer_metadata(agent: str) -> bytes:
    return ray.get(ray.get_actor(agent.rsplit("-", 1)[0]).metadata.remote())


class EngineHost:
    """A pool replica in miniature: one engine and its KVLink, in its own process."""

    def __init__(self, kind: str, prefix: str, model: str, kv_cache_dtype: str = "auto"):
        self.engine = LLMEngine(EngineConfig(model, kv_cache_dtype=kv_cache_dtype, **ENGINE))
        self.link = KVLink(self.engine, prefix, kind=kind, peer_metadata=_peer_metadata)

    def metadata(self) -> bytes:
        return self.link.metadata()

    def _run(self):
        outs = []
        while self.engine.has_unfinished_requests():
            outs += [o for o in self.engine.step() if o.finished]
        return outs

    def prefill(self, prompt: list[int], request_id: str) -> tuple[int, KVHandoff]:
        self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id, prefill_only=True)
        (out,) = self._run()
        return out.token_ids[0], self.link.export(out)

    def decode(self, handoff: KVHandoff, prompt: list[int], first: int | None, max_tokens: int) -> dict:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(prompt, params, handoff.handle.request_id,
                                remote=_remote(self.engine, handoff, prompt, first))
        (out,) = self._run()
        m = out.metrics
        return {"tokens": out.token_ids, "local_blocks": m.num_cached_tokens // 16, "pulled_blocks": m.kv_transfer_blocks,
                "transferred": m.kv_transferred, "error": m.kv_transfer_error}

    def release(self) -> list[str]:
        return self.link.release_finished()

    def used_blocks(self) -> int:
        return self.engine.pool.num_used_blocks


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])    # workers cannot import this file
    init_ray(num_cpus=2, namespace="test-kv-engines", include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def references(smol_path):
    """One engine doing both, per KV cache dtype (built when first asked for)."""
    llms: dict[str, LLM] = {}

    def reference(kv_cache_dtype: str):
        if kv_cache_dtype not in llms:
            llms[kv_cache_dtype] = LLM(smol_path, kv_cache_dtype=kv_cache_dtype, **ENGINE)
        llm = llms[kv_cache_dtype]

        def greedy(prompt: list[int], n: int) -> list[int]:
            return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
        return llm.engine.tokenize, greedy
    return reference


@pytest.mark.parametrize("kind,kv", [("nixl", "auto"), ("ray", "auto"), ("nixl", "int8")])
def test_prefill_in_one_process_decode_in_another_gives_the_same_greedy_tokens(kind, kv, cluster, references,
                                                                               smol_path):
    tokenize, greedy = references(kv)
    host, name = ray.remote(EngineHost), f"{kind}-{kv}"
    prefill = host.options(name=f"prefill-{name}", num_cpus=0).remote(kind, f"prefill-{name}", smol_path, kv)
    decode = host.options(name=f"decode-{name}", num_cpus=0).remote(kind, f"decode-{name}", smol_path, kv)
    try:
        prompt = tokenize(STORY)                               # 50-odd tokens: 3 full blocks and a partial one
        want = greedy(prompt, 24)
        first, handle = ray.get(prefill.prefill.remote(prompt, "story"))
        assert first == want[0]
        assert ray.get(prefill.used_blocks.remote()) == blocks_for(len(prompt), 16)     # pinned for the pull
        got = ray.get(decode.decode.remote(handle, prompt, first, 24))
        assert got["tokens"] == want and got["local_blocks"] == 0 and got["transferred"]
        assert "story" in ray.get(prefill.release.remote()) and ray.get(prefill.used_blocks.remote()) == 0
        assert ray.get(decode.used_blocks.remote()) == 0

        # the same opening, another ending: decode already caches the shared full blocks and pulls the rest
        other = tokenize(STORY.removesuffix(", where") + ". Coaches drill the hand-off because")
        want = greedy(other, 16)
        first, handle = ray.get(prefill.prefill.remote(other, "other"))
        got = ray.get(decode.decode.remote(handle, other, first, 16))
        assert got["tokens"] == want and got["transferred"]
        assert got["local_blocks"] >= 2 and got["pulled_blocks"] == blocks_for(len(other), 16) - got["local_blocks"]

        # a handle for one prompt never fills the blocks of another: the forged prompt is prefilled
        # locally (its own greedy tokens), and the refusal leaks nothing
        _, handle = ray.get(prefill.prefill.remote(prompt, "wrong"))
        forged = prompt[:2] + [prompt[2] + 1] + prompt[3:]     # same length, another first block
        got = ray.get(decode.decode.remote(handle, forged, None, 4))
        assert not got["transferred"] and got["error"].startswith("KVTransferError") and "another prompt" in got["error"]
        assert got["tokens"] == greedy(forged, 4)
        assert ray.get(decode.used_blocks.remote()) == 0
    finally:
        ray.kill(prefill)
        ray.kill(decode)


def test_a_cancelled_import_keeps_its_blocks_until_the_read_in_flight_ends(tmp_path, monkeypatch):
    """A client that leaves mid-pull: were its reserved blocks freed at once, another request could take them
    while NIXL still writes into them. They wait until the pull has ended (here a READ that never completes,
    ended by the handle's expiry: the clock is moved past it), then the engine frees them."""
    import time

    from engine import faults
    from tests.conftest import make_tiny_checkpoint
    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    producer, consumer = (LLMEngine(EngineConfig(model, num_kv_blocks=32, max_model_len=256)) for _ in range(2))
    now = [time.time()]
    links: dict[str, KVLink] = {}
    links["p"] = KVLink(producer, "producer", kind="nixl", peer_metadata=lambda agent: links["p"].metadata(),
                        ttl_s=5, clock=lambda: now[0])
    link = KVLink(consumer, "consumer", kind="nixl", peer_metadata=lambda agent: links["p"].metadata(),
                  clock=lambda: now[0])
    try:
        prompt = list(range(10, 60))                          # 4 blocks
        producer.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), "r", prefill_only=True)
        (out,) = [o for o in producer.step() if o.finished]
        handoff = links["p"].export(out)
        path = tmp_path / "faults.json"
        faults.write(str(path), {"kv_pull_stall": 1.0})
        monkeypatch.setenv(faults.ENV, str(path))
        consumer.add_request(prompt, SamplingParams(temperature=0, max_tokens=4), "r",
                             remote=_remote(consumer, handoff, prompt, out.token_ids[0]))
        consumer.step()                                       # blocks reserved, the READ started (and stalls)
        monkeypatch.delenv(faults.ENV)
        assert consumer.scheduler.loading and consumer.pool.num_used_blocks == 4
        assert consumer.abort_request("r")
        assert consumer.pool.num_used_blocks == 4              # the READ has not ended: still reserved
        consumer.step()
        assert consumer.pool.num_used_blocks == 4
        now[0] += 6                                           # past the handle's expiry: the pull has failed
        consumer.step()
        assert consumer.pool.num_used_blocks == 0 and not consumer.has_unfinished_requests()
    finally:
        link.close()
        links["p"].close()

def _finish(engine: LLMEngine, prompt: list[int], rid: str, params: SamplingParams, **kw):
    """Add one request and step the engine until it has finished; its output."""
    engine.add_request(prompt, params, rid, **kw)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs[0]


def _prefix_links(source: LLMEngine, puller: LLMEngine, name: str) -> dict[str, KVLink]:
    """NIXL links of a prefix pull's source ("s") and puller ("p") in this process."""
    links: dict[str, KVLink] = {}
    links["s"] = KVLink(source, f"{name}-source", kind="nixl", peer_metadata=lambda agent: links["s"].metadata())
    links["p"] = KVLink(puller, f"{name}-puller", kind="nixl", peer_metadata=lambda agent: links["s"].metadata())
    return links


def test_a_prefix_pull_takes_the_blocks_another_engine_caches_and_computes_only_the_rest(tmp_path):
    """Cross-replica prefix reuse, engine to engine over NIXL: the source pins the leading blocks of a prompt it
    caches (KVLink.export_prefix); the puller reserves only those, pulls them, then prefills the rest. Tokens
    equal a third engine computing the whole prompt; the source's pin ends when the puller says it pulled. A
    pull that cannot start is computed in full, and nothing leaks on either side."""
    import time

    from tests.conftest import make_tiny_checkpoint, wait_for
    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    source, puller, alone = (LLMEngine(EngineConfig(model, num_kv_blocks=32, max_model_len=256)) for _ in range(3))
    links = _prefix_links(source, puller, "prefix")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run(engine: LLMEngine, prompt: list[int], rid: str, **kw):
        return _finish(engine, prompt, rid, greedy, **kw)
    try:
        shared = list(range(10, 74))                                  # 4 full blocks
        prompt = shared + list(range(100, 120))
        run(source, shared + [5, 6, 7], "a")                         # the source caches the 4 blocks
        hashes = block_hashes(prompt, 16, source.model_key)
        handoff = links["s"].export_prefix("pin-1", hashes, prompt)
        assert handoff.handle.num_tokens == 64 and len(handoff.handle.block_ids) == 4
        assert source.pool.num_used_blocks == 4                      # pinned for the pull

        want = run(alone, prompt, "alone").token_ids
        before = puller.num_computed_tokens_total
        pulled = run(puller, prompt, "b", block_hashes=hashes, remote=RemotePrefill(
            handoff, hashes[:4], None, None, deadline=handoff.handle.expiry - 2, num_tokens=64))
        assert pulled.token_ids == want
        assert pulled.metrics.kv_transferred and pulled.metrics.kv_transfer_blocks == 4
        assert puller.num_computed_tokens_total - before == len(prompt) - 64 + greedy.max_tokens - 1
        wait_for(lambda: "pin-1" in links["s"].release_finished(), 30, "the source to hear the pull ended")
        assert source.pool.num_used_blocks == 0 and puller.pool.num_used_blocks == 0

        # a pull that cannot start in time: the whole prompt is computed here, same tokens
        puller.pool.reset_prefix_cache()
        late = links["s"].export_prefix("pin-2", hashes, prompt)
        before = puller.num_computed_tokens_total
        out = run(puller, prompt, "c", block_hashes=hashes, remote=RemotePrefill(
            late, hashes[:4], None, None, deadline=time.time() - 1, num_tokens=64))
        assert out.token_ids == want and not out.metrics.kv_transferred and "deadline" in out.metrics.kv_transfer_error
        assert puller.num_computed_tokens_total - before == len(prompt) + greedy.max_tokens - 1
        links["s"].withdraw("pin-2")                                  # nobody pulls it: the source lets go
        assert source.pool.num_used_blocks == 0 and puller.pool.num_used_blocks == 0

        # nothing cached at the source: nothing to export; a hand-off for another prompt is refused at once
        other = list(range(120, 200))
        assert links["s"].export_prefix("pin-3", block_hashes(other, 16, source.model_key), other) is None
        with pytest.raises(InvalidRequestError, match="not this prompt's"):
            puller.add_request(other, greedy, "d", block_hashes=block_hashes(other, 16, puller.model_key),
                               remote=RemotePrefill(handoff, hashes[:4], None, None, deadline=time.time() + 9,
                                                    num_tokens=64))
    finally:
        links["p"].close()
        links["s"].close()


def test_a_prefix_the_source_keeps_in_its_host_tier_is_copied_back_and_pulled(tmp_path):
    """The source's device cache evicted the prefix to its host tier: export_prefix copies the blocks back into
    device blocks, pins and hands them off; the puller's tokens equal one engine computing everything."""
    from engine.kv_events import HOST
    from tests.conftest import make_tiny_checkpoint, wait_for
    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    tiny_block = 3 * 2 * 2 * 16 * 16 * 4            # layers x KV heads x (K, V) x 16 tokens x head_dim, fp32
    source = LLMEngine(EngineConfig(model, num_kv_blocks=12, max_model_len=128,
                                    kv_offloading_size=32 * tiny_block / 2**30))
    puller, alone = (LLMEngine(EngineConfig(model, num_kv_blocks=32, max_model_len=128)) for _ in range(2))
    assert source.pool.host_blocks == 32, "the tiny model's block size changed: fix tiny_block"
    links = _prefix_links(source, puller, "host")
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def run(engine: LLMEngine, prompt: list[int], rid: str, **kw):
        return _finish(engine, prompt, rid, greedy, **kw)
    try:
        prompt = list(range(10, 74)) + list(range(100, 110))         # 4 full blocks and a partial one
        run(source, prompt, "a")
        for k in range(3):                                            # fillers push it out of the 12 device blocks
            run(source, list(range(120 + 60 * k, 120 + 60 * k + 50)), f"fill{k}")
        hashes = block_hashes(prompt, 16, source.model_key)
        tiers = [tier for tier, _ in source.pool.find(hashes, prompt)]
        assert len(tiers) == 4 and HOST in tiers, tiers                  # some (or all) only in host memory
        handoff = links["s"].export_prefix("pin-h", hashes, prompt)
        assert handoff is not None and handoff.handle.num_tokens == 64
        pulled = run(puller, prompt, "b", block_hashes=hashes, remote=RemotePrefill(
            handoff, hashes[:4], None, None, deadline=handoff.handle.expiry - 2, num_tokens=64))
        assert pulled.metrics.kv_transferred and pulled.metrics.kv_transfer_blocks == 4
        assert pulled.token_ids == run(alone, prompt, "alone").token_ids
        wait_for(lambda: "pin-h" in links["s"].release_finished(), 30, "the source to hear the pull ended")
        assert source.pool.num_used_blocks == 0 and puller.pool.num_used_blocks == 0
    finally:
        links["p"].close()
        links["s"].close()
