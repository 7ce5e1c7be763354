"""The baton pass between two engines in two processes: one prefills (blocks pinned), the other pulls
the KV over the transport and decodes; greedy tokens equal one engine doing both. NIXL and the Ray
fallback, on the default model."""
from __future__ import annotations

import sys

import pytest
import ray

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from kvtransfer import KVHandoff, KVLink

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

ENGINE = dict(num_kv_blocks=96, max_model_len=1024)
STORY = ("The history of the relay race begins in ancient Greece, where runners carried torches from "
         "altar to altar. Modern relays pass a baton instead: four runners, each covering one leg, and "
         "the race is often won or lost in the exchange zone, where")


def _peer_metadata(agent: str) -> bytes:
    return ray.get(ray.get_actor(agent.rsplit("-", 1)[0]).metadata.remote())


class EngineHost:
    """A pool replica in miniature: one engine and its KVLink, in its own process."""

    def __init__(self, kind: str, prefix: str, model: str):
        self.engine = LLMEngine(EngineConfig(model, **ENGINE))
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

    def decode(self, handoff: KVHandoff, prompt: list[int], first: int, max_tokens: int) -> dict:
        x = self.link.start_import(handoff, prompt)
        local = x.kv.num_local_blocks
        x.wait(timeout_s=60)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(prompt, params, x.request_id, kv=x.kv, first_token=first)
        (out,) = self._run()
        return {"tokens": out.token_ids, "local_blocks": local, "pulled_blocks": x.num_pulled_blocks}

    def try_import(self, handoff: KVHandoff, prompt: list[int]) -> str:
        try:
            self.link.start_import(handoff, prompt).cancel()
            return "imported"
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def release(self) -> list[str]:
        return self.link.release_finished()

    def used_blocks(self) -> int:
        return self.engine.pool.num_used_blocks


@pytest.fixture(scope="module")
def cluster():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])    # workers cannot import this file
    ray.init(num_cpus=2, namespace="test-kv-engines", include_dashboard=False, log_to_driver=False,
             logging_level="WARNING")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def reference(smol_path):
    llm = LLM(smol_path, **ENGINE)

    def greedy(prompt: list[int], n: int) -> list[int]:
        return llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].token_ids
    return llm.engine.tokenize, greedy


@pytest.mark.parametrize("kind", ["nixl", "ray"])
def test_prefill_in_one_process_decode_in_another_gives_the_same_greedy_tokens(kind, cluster, reference, smol_path):
    tokenize, greedy = reference
    host = ray.remote(EngineHost)
    prefill = host.options(name=f"prefill-{kind}", num_cpus=0).remote(kind, f"prefill-{kind}", smol_path)
    decode = host.options(name=f"decode-{kind}", num_cpus=0).remote(kind, f"decode-{kind}", smol_path)
    try:
        prompt = tokenize(STORY)                               # 50-odd tokens: 3 full blocks and a partial one
        want = greedy(prompt, 24)
        first, handle = ray.get(prefill.prefill.remote(prompt, "story"))
        assert first == want[0]
        assert ray.get(prefill.used_blocks.remote()) == -(-len(prompt) // 16)     # pinned for the pull
        got = ray.get(decode.decode.remote(handle, prompt, first, 24))
        assert got["tokens"] == want and got["local_blocks"] == 0
        assert "story" in ray.get(prefill.release.remote()) and ray.get(prefill.used_blocks.remote()) == 0
        assert ray.get(decode.used_blocks.remote()) == 0

        # the same opening, another ending: decode already caches the shared full blocks and pulls the rest
        other = tokenize(STORY.removesuffix(", where") + ". Coaches drill the hand-off because")
        want = greedy(other, 16)
        first, handle = ray.get(prefill.prefill.remote(other, "other"))
        got = ray.get(decode.decode.remote(handle, other, first, 16))
        assert got["tokens"] == want
        assert got["local_blocks"] >= 2 and got["pulled_blocks"] == -(-len(other) // 16) - got["local_blocks"]

        # a handle for one prompt never fills the blocks of another, and the refusal leaks nothing
        _, handle = ray.get(prefill.prefill.remote(prompt, "wrong"))
        forged = prompt[:2] + [prompt[2] + 1] + prompt[3:]     # same length, another first block
        err = ray.get(decode.try_import.remote(handle, forged))
        assert err.startswith("KVTransferError") and "another prompt" in err
        assert ray.get(decode.used_blocks.remote()) == 0
    finally:
        ray.kill(prefill)
        ray.kill(decode)


def test_a_cancelled_import_keeps_its_blocks_until_the_read_in_flight_ends(tmp_path, monkeypatch):
    """A client that leaves mid-pull: were its reserved blocks freed at once, another request could take them
    while NIXL still writes into them. They wait until the pull has ended (here a READ that never completes,
    ended by the handle's expiry), then release_finished frees them."""
    from engine import faults
    from tests.conftest import make_tiny_checkpoint, wait_for
    model = make_tiny_checkpoint(tmp_path / "m", "llama")
    producer, consumer = (LLMEngine(EngineConfig(model, num_kv_blocks=32, max_model_len=256)) for _ in range(2))
    links: dict[str, KVLink] = {}
    links["p"] = KVLink(producer, "producer", kind="nixl", peer_metadata=lambda agent: links["p"].metadata(),
                        ttl_s=1.5)
    link = KVLink(consumer, "consumer", kind="nixl", peer_metadata=lambda agent: links["p"].metadata())
    try:
        prompt = list(range(10, 60))                          # 4 blocks
        producer.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), "r", prefill_only=True)
        (out,) = [o for o in producer.step() if o.finished]
        handle = links["p"].export(out)
        path = tmp_path / "faults.json"
        faults.write(str(path), {"kv_pull_stall": 1.0})
        monkeypatch.setenv(faults.ENV, str(path))
        x = link.start_import(handle, prompt)
        monkeypatch.delenv(faults.ENV)
        x.cancel()
        assert consumer.pool.num_used_blocks == 4              # the READ has not ended: still reserved
        link.release_finished()
        assert consumer.pool.num_used_blocks == 4
        def released() -> bool:                               # at the handle's 1.5 s expiry the pull fails
            link.release_finished()
            return consumer.pool.num_used_blocks == 0
        wait_for(released, 10, "the stalled pull to end at the handle's expiry and free its blocks")
    finally:
        link.close()
        links["p"].close()
