"""Tensor parallelism on a live cluster: a prefill replica with tensor_parallel_size 2 (the Serve replica, rank 0,
and one TP worker actor in its placement group: replica/tp_workers.py) hands its KV, re-sharded, to a TP 1 decode
replica. The openai client gets the single engine's greedy text through it; killing the prefill replica's worker
loses no request (the decode pool prefills what the broken replica cannot), and Serve replaces the replica, worker
and all, which then prefills for the decode pool again. A LoRA adapter's request, prefilled at TP 2 (each rank
holding its share of the adapter) and decoded at TP 1, gets the single engine's text under the adapter."""
from __future__ import annotations


import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PORT = 8739
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
# both pools run the GGUF dequantized (fp32), so the text is the fp32 engine's token for token (packed weights at
# TP 2 equal TP 1 up to the format's near-ties: tests/test_tensor_parallel.py)
TP_ENGINE = {**CLUSTER_ENGINE, "tensor_parallel_size": 2, "quantization": "none"}
# every prompt goes through the prefill pool (min_remote_prefill_tokens 0): its TP 2 replica's bundles are
# [{CPU: 1}, {CPU: 1}] on CPUs (gloo); no admission control: on a shared 2-core machine its TTFT forecast would
# refuse concurrent requests
PREFILL_TP2 = {"mode": "disaggregated", "port": PORT, "device": "cpu", "ingress": {"num_cpus": 0},
               "prefill": {"num_cpus": 1, "health_check_period_s": 1.0, "engine": TP_ENGINE},
               "decode": {"num_cpus": 0, "engine": {**CLUSTER_ENGINE, "quantization": "none"}},
               "disaggregation": {"min_remote_prefill_tokens": 0}, "admission": {"enabled": False}}
MESSAGES = [[{"role": "user", "content": "Why do relay runners practise the baton exchange?"}],
            [{"role": "user", "content": "Name three colours of the rainbow."}]]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, smol_path) -> str:
    from bench.models import make_lora_adapter
    return make_lora_adapter(smol_path, tmp_path_factory.mktemp("tp-lora") / "terse", rank=8, seed=11, scale=0.5)


@pytest.fixture
def client(shared_cluster, adapter):
    shared_cluster.up({**PREFILL_TP2, "lora": {"adapters": {"terse": adapter}}}, num_cpus=2)
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single_engine_texts(smol_path) -> list[str]:
    llm = LLM(smol_path, **CLUSTER_ENGINE)                  # TP 1, one process: the reference
    return [llm.chat(m, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)).text for m in MESSAGES]


def tp_workers(pool: str = "prefill") -> list[str]:
    """The names of the pool's live TP worker actors (baton-tp:<pool>#<replica>#rank<r>)."""
    import ray

    from replica.tp_workers import WORKER_NAME_PREFIX
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"{WORKER_NAME_PREFIX}{pool}#"))


def greedy_texts(client) -> list[str]:
    return [client.chat.completions.create(model=MODEL, messages=m, temperature=0, max_tokens=MAX_TOKENS)
            .choices[0].message.content for m in MESSAGES]


def kill_worker(name: str) -> None:
    import ray
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"] == name]
    ray.kill(ray.get_actor(name, namespace=actor["namespace"]), no_restart=True)


def prefill_paths() -> dict[str, float]:
    """How many prompts the orchestrator prefilled where (baton_disaggregation_decisions, from /metrics)."""
    from cluster.live_metrics import scrape
    m = scrape(BASE)
    return {path: m.get(f'baton_disaggregation_decisions_total{{path="{path}"}}', 0.0)
            for path in ("remote", "local", "local_after_prefill_failure")}


def test_prefill_tp2_hands_its_kv_to_decode_tp1_and_the_text_is_the_single_engines(client, single_engine_texts):
    (worker,) = tp_workers()                                # rank 1 of the one prefill replica, in its placement group
    assert worker.endswith("#rank1")
    before = prefill_paths()
    assert greedy_texts(client) == single_engine_texts
    after = prefill_paths()
    assert after["remote"] - before["remote"] == len(MESSAGES)          # both prefilled by the TP 2 replica
    assert after["local_after_prefill_failure"] == before["local_after_prefill_failure"]


def test_an_adapter_prefilled_at_tp2_gives_the_single_engines_text(client, adapter, smol_path):
    from engine import LoRARequest
    llm = LLM(smol_path, **CLUSTER_ENGINE, enable_lora=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = llm.apply_chat_template(MESSAGES[0])
    want = llm.generate([ids], params, lora_request=LoRARequest("terse", 1, adapter))[0].text
    assert want != llm.generate([ids], params)[0].text                 # the adapter changes the text
    before = prefill_paths()
    r = client.chat.completions.create(model="terse", messages=MESSAGES[0], temperature=0, max_tokens=MAX_TOKENS)
    assert r.choices[0].message.content == want
    assert prefill_paths()["remote"] - before["remote"] == 1             # through the TP 2 replica


def test_killing_a_prefill_tp_worker_loses_no_request_and_the_replica_comes_back(client, single_engine_texts):
    (victim,) = tp_workers()
    before = prefill_paths()
    kill_worker(victim)
    # the replica's next step fails (its worker is gone): the decode pool prefills those prompts itself
    assert greedy_texts(client) == single_engine_texts
    assert prefill_paths()["local_after_prefill_failure"] > before["local_after_prefill_failure"]
    # the replica's health check fails; Serve replaces it with its placement group and a new worker
    wait_for(lambda: tp_workers() and tp_workers() != [victim], 120, "Serve to replace the TP prefill replica")
    wait_for(lambda: _prefills_remotely(client), 120, "the new TP prefill replica to prefill")
    assert greedy_texts(client) == single_engine_texts


def _prefills_remotely(client) -> bool:
    before = prefill_paths()["remote"]
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    return prefill_paths()["remote"] > before
