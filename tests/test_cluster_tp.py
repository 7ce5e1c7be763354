"""Tensor parallelism on a live cluster: a replica with tensor_parallel_size 2 is the Serve replica (rank 0) and
one TP worker actor in its placement group (replica/tp_workers.py). The openai client gets the single engine's
greedy text from it; killing its worker fails its streams cleanly (an OpenAI 503 error event, never a hang or
a 500), and Serve replaces the replica, worker and all, which then serves the same text again."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PORT = 8739
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
TP_ENGINE = {**CLUSTER_ENGINE, "tensor_parallel_size": 2}
# one decode replica that prefills too, sharded over 2 ranks on CPUs (gloo): bundles [{CPU: 1}, {CPU: 1}];
# no admission control: on a shared 2-core machine its TTFT forecast would refuse the concurrent streams
COLOCATED_TP2 = {"mode": "colocated", "port": PORT, "device": "cpu", "ingress": {"num_cpus": 0},
                 "decode": {"num_cpus": 1, "health_check_period_s": 1.0, "engine": TP_ENGINE},
                 "admission": {"enabled": False}}
MESSAGES = [[{"role": "user", "content": "Why do relay runners practise the baton exchange?"}],
            [{"role": "user", "content": "Name three colours of the rainbow."}]]
MAX_TOKENS = 12


@pytest.fixture
def client(shared_cluster):
    shared_cluster.up(COLOCATED_TP2, num_cpus=2)
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def single_engine_texts(smol_path) -> list[str]:
    llm = LLM(smol_path, **CLUSTER_ENGINE)                  # TP 1, one process: the reference
    return [llm.chat(m, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)).text for m in MESSAGES]


def tp_workers(pool: str = "decode") -> list[str]:
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


def stream_through(client, prompts: list[str], fault) -> list[dict]:
    """Stream every prompt at once (threads), call fault() once each stream has tokens; what each got: chunks
    and the error its stream ended with (an OpenAI error event raises openai.APIError in the client)."""
    outs = [{"chunks": 0, "error": None} for _ in prompts]

    def run(prompt: str, out: dict) -> None:
        try:
            for chunk in client.completions.create(model=MODEL, prompt=prompt, max_tokens=200, temperature=0,
                                                   stream=True):
                out["chunks"] += 1
        except openai.APIError as e:
            out["error"] = e
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p, o) for p, o in zip(prompts, outs)]
        wait_for(lambda: all(o["chunks"] >= 2 for o in outs), 60, "every stream to get tokens")
        fault()
        for f in futures:
            f.result(timeout=60)            # a stream that hangs fails the test here
    return outs


def test_a_tp2_replica_serves_the_single_engines_greedy_text(client, single_engine_texts):
    (worker,) = tp_workers()                                # rank 1 of the one replica, in its placement group
    assert worker.endswith("#rank1")
    assert greedy_texts(client) == single_engine_texts


def test_killing_a_tp_worker_fails_its_streams_cleanly_and_the_replica_comes_back(client, single_engine_texts):
    (victim,) = tp_workers()
    prompts = [f"Count slowly from {i} to one hundred:" for i in range(3)]
    for out in stream_through(client, prompts, lambda: kill_worker(victim)):
        e = out["error"]           # every stream is on the one replica: each ends with OpenAI's 503 error event
        assert isinstance(e, openai.APIError) and (e.type, e.code) == ("ServiceUnavailableError", "replica_failed"), out
    # the replica's health check fails; Serve replaces it with its placement group and a new worker
    wait_for(lambda: tp_workers() and tp_workers() != [victim], 120, "Serve to replace the TP replica")
    wait_for(lambda: _serves(client), 120, "the new TP replica to serve")   # its first step warms up (~30 s here)
    assert greedy_texts(client) == single_engine_texts


def _serves(client) -> bool:
    try:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
        return True
    except openai.APIStatusError as e:              # the old replica's last requests: 503 until it is gone
        assert e.status_code == 503, e
        return False
