"""LoRA adapters in a live disaggregated cluster, through the `openai` client: `model` selects the base or an
adapter and the text is the offline engine's under the same adapter; /v1/models lists adapters with their
parent; adapters load and unload at run time (vLLM's endpoints, behind the API keys) while other requests
stream on; a bad adapter is a 400 naming the problem; the prefill router sends an adapter's requests to the
replica that holds it, so the pool loads it once. Two prefill replicas and one decode replica of SmolLM2."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import openai
import pytest

from bench.models import make_lora_adapter
from cluster.live_metrics import scrape
from engine import LLM, LoRARequest, SamplingParams
from tests.conftest import CLUSTER_ENGINE, DISAGGREGATED_ENV, TEST_KEY, TEST_KEYS_ENV, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8739
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
ENGINE = {**CLUSTER_ENGINE, "max_loras": 2}
MESSAGES = [{"role": "user", "content": "Name three things a relay team practises."}]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, smol_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cluster-lora")
    return {"terse": make_lora_adapter(smol_path, root / "terse", rank=8, seed=11, scale=0.5),
            "chatty": make_lora_adapter(smol_path, root / "chatty", rank=4, seed=12, scale=0.5,
                                        targets=("q_proj", "v_proj", "down_proj")),
            "too-big": make_lora_adapter(smol_path, root / "big", rank=32, seed=13)}


@pytest.fixture(scope="module")
def client(shared_cluster, adapters):
    shared_cluster.up({
        "port": PORT, "ingress": {"num_cpus": 0},
        "prefill": {"num_replicas": 2, "num_cpus": 0, "engine": ENGINE}, "decode": {"num_cpus": 0, "engine": ENGINE},
        "disaggregation": {"min_remote_prefill_tokens": 0}, "auth": {"api_keys_env": TEST_KEYS_ENV},
        "lora": {"adapters": {"terse": adapters["terse"]}}}, env=DISAGGREGATED_ENV)
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=TEST_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline(adapters):
    """The model as the cluster runs it (its GGUF, packed), with the adapters."""
    return LLM(None, **ENGINE, enable_lora=True)


def want(offline: LLM, name: str | None, path: str | None = None, max_tokens: int = 24) -> str:
    ids = offline.apply_chat_template(MESSAGES)
    lora = LoRARequest(name, 1, path) if name else None
    return offline.generate(ids, SamplingParams(temperature=0, max_tokens=max_tokens), lora_request=lora)[0].text


def post(path: str, body: dict, key: str | None = TEST_KEY) -> tuple[int, dict | str]:
    req = urllib.request.Request(f"{BASE}{path}", json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def chat(client, model: str, max_tokens: int = 24) -> str:
    r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=max_tokens)
    assert r.model == model
    return r.choices[0].message.content


def diverging(r, offline: LLM) -> str:
    """Where the cluster's greedy tokens (response r) leave the offline engine's (token, logprob, runner-up per
    position), and the cluster's counters of the paths a request can take (pulls, fallbacks, preemptions, hits)."""
    live = [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs])
            for t in r.choices[0].logprobs.content]
    o = offline.generate(offline.apply_chat_template(MESSAGES), SamplingParams(temperature=0, max_tokens=24,
                                                                                logprobs=2))[0]
    tok = offline.engine.tokenizer
    here = [(tok.decode([t]), round(lp[t], 4)) for t, lp in zip(o.token_ids, o.logprobs)]
    paths = {k: v for k, v in scrape(BASE, fresh=True).items() if "_bucket{" not in k and "_created{" not in k
             and any(n in k for n in ("kv_transfer", "prefix_pull", "preemptions", "prefix_cache_hit", "migrat"))}
    return f"cluster: {live}\noffline: {here}\ncounters: {paths}"


def test_model_selects_the_adapter_and_the_text_is_the_offline_engines(client, adapters, offline):
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {MODEL, "terse"}
    assert models["terse"].model_extra["parent"] == MODEL and models["terse"].model_extra["root"] == adapters["terse"]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, logprobs=True,
                                       top_logprobs=2)
    assert r.model == MODEL
    base, terse = r.choices[0].message.content, chat(client, "terse")
    if base != want(offline, None):
        # once in about twenty CI runs (stop 47) the cluster's base text left the offline engine's at a token
        # whose top two were 0.16 apart, which no kernel path here explains (chunking, batching, threads, a
        # local prefill after a failed pull all give the offline bits): say which path this request took
        pytest.fail(f"cluster {base!r} != offline {want(offline, None)!r}\n{diverging(r, offline)}")
    assert terse == want(offline, "terse", adapters["terse"])
    assert terse != base
    r = client.completions.create(model="terse", prompt="The baton passes from", temperature=0, max_tokens=12)
    ids = offline.engine.tokenize("The baton passes from")
    assert r.choices[0].text == offline.generate(ids, SamplingParams(temperature=0, max_tokens=12),
                                                 lora_request=LoRARequest("terse", 1, adapters["terse"]))[0].text
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        chat(client, "no-such-adapter")
    def served(adapter: str) -> float:        # replicas report their metrics every half second
        return sum(v for k, v in scrape(BASE).items() if k.startswith("baton_lora_requests_total{")
                   and 'pool="decode"' in k and f'adapter="{adapter}"' in k)
    wait_for(lambda: served("terse") >= 2 and served("base") >= 1, 30, "per-adapter request counts")
    assert any(k.startswith("baton_lora_adapter_loaded{") and 'adapter="terse"' in k for k in scrape(BASE))


def test_the_prefill_router_keeps_an_adapter_on_the_replica_that_holds_it(client):
    """Prompts that share no prefix, all under one adapter: the first goes anywhere and loads it there, the
    rest follow it (the other replica would pay lora_load_cost_tokens). Routing that ignored adapters would
    spread them by prompt hash over both replicas, and both would load it."""
    for i in range(6):
        client.completions.create(model="terse", prompt=f"{i * 7919} is a number; write it in words:",
                                  temperature=0, max_tokens=2)
    def by_replica() -> dict[str, float]:
        return {k: v for k, v in scrape(BASE).items() if k.startswith("baton_lora_requests_total{")
                and 'pool="prefill"' in k and 'adapter="terse"' in k}
    wait_for(lambda: sum(by_replica().values()) >= 6, 30, "the prefill pool's count of the 6 requests")
    assert len(by_replica()) == 1, by_replica()
    m = scrape(BASE)
    held = [k for k in m if k.startswith("baton_lora_adapter_loaded{") and 'pool="prefill"' in k
            and 'adapter="terse"' in k]
    assert len(held) == 1, held


def test_adapters_load_and_unload_at_run_time_while_others_stream(client, adapters, offline):
    stop, failures, done = threading.Event(), [], [0]

    def traffic():
        while not stop.is_set():
            try:
                chat(client, MODEL, max_tokens=8)
                done[0] += 1
            except Exception as e:          # noqa: BLE001 - reported below
                failures.append(e)
    t = threading.Thread(target=traffic)
    t.start()
    try:
        load = {"lora_name": "chatty", "lora_path": adapters["chatty"]}
        assert post("/v1/load_lora_adapter", load, key=None)[0] == 401
        status, body = post("/v1/load_lora_adapter", load)
        assert status == 200 and "chatty" in body
        assert chat(client, "chatty") == want(offline, "chatty", adapters["chatty"])
        assert {m.id for m in client.models.list().data} == {MODEL, "terse", "chatty"}
        status, err = post("/v1/load_lora_adapter", load)
        assert status == 400 and "already been loaded" in err["error"]["message"]
        status, err = post("/v1/load_lora_adapter", {"lora_name": "big", "lora_path": adapters["too-big"]})
        assert status == 400 and "max_lora_rank" in err["error"]["message"] and err["error"]["param"] == "lora_path"
        status, err = post("/v1/load_lora_adapter", {"lora_name": "gone", "lora_path": "/nonexistent/adapter"})
        assert status == 400 and "not a directory" in err["error"]["message"]
        status, err = post("/v1/load_lora_adapter", {"lora_name": "x"})
        assert status == 400 and err["error"]["param"] == "lora_path"
        status, body = post("/v1/unload_lora_adapter", {"lora_name": "chatty"})
        assert status == 200
        with pytest.raises(openai.NotFoundError):
            chat(client, "chatty")
        assert post("/v1/unload_lora_adapter", {"lora_name": "chatty"})[0] == 404
        assert chat(client, "terse") == want(offline, "terse", adapters["terse"])    # the others stay
    finally:
        stop.set()
        t.join()
    assert not failures and done[0] >= 1
