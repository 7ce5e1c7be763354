"""The real Serve app on loopback, driven by the official `openai` client: one prefill and one decode
replica of the default model, KV over NIXL (conftest's DISAGGREGATED app, shared with other modules). Greedy
output equals the offline engine's; stop strings, max_tokens and usage hold; bad input gets OpenAI error JSON;
/metrics shows both pools."""
from __future__ import annotations

import importlib.metadata
import json
import urllib.error
import urllib.request

import openai
import pytest

from cluster.live_metrics import pool_total as _pool_sum
from cluster.live_metrics import scrape
from engine import LLM, SamplingParams
from engine.block_hash import block_hashes
from engine.scheduler import attention_pairs
from tests.conftest import (CLUSTER_ENGINE, DISAGGREGATED, DISAGGREGATED_ENV, TEST_KEY, assert_not_in_ray_logs,
                            ingress_index_matches, served_model_key, wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = DISAGGREGATED["port"]
KEY = TEST_KEY
BASE = f"http://127.0.0.1:{PORT}"
MODEL = "SmolLM2-135M-Instruct"
ENGINE = CLUSTER_ENGINE


@pytest.fixture
def server(shared_cluster):
    return shared_cluster.up(DISAGGREGATED, DISAGGREGATED_ENV)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{BASE}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    return LLM(None, **ENGINE)              # the default model as the cluster runs it (packed GGUF)


def _metrics(fresh: bool = False) -> dict[str, float]:
    """Sample name with labels -> value, from one scrape of the ingress; `fresh`: every replica's report in it
    was read after this call began (each replica reports every REPORT_INTERVAL_S, on its own)."""
    return scrape(BASE, fresh)


def _post(path: str, body: bytes | dict, key: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key or KEY}"}
    req = urllib.request.Request(f"{BASE}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_api_keys_are_required_except_on_health_and_metrics(client):
    hi = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key in ("sk-wrong", "", f"{KEY}x"):
        code, err = _post("/v1/chat/completions", hi, key=key or " ")
        assert code == 401 and err["error"]["code"] == "invalid_api_key", err
        assert KEY not in json.dumps(err)                           # never echoed
    req = urllib.request.Request(f"{BASE}/v1/models")               # no header at all
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{BASE}/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert _post("/v1/chat/completions", hi, key="sk-other")[0] == 200      # every listed key works
    assert urllib.request.urlopen(f"{BASE}/health", timeout=30).status == 200
    assert urllib.request.urlopen(f"{BASE}/metrics", timeout=30).status == 200   # protect_metrics is off
    assert_not_in_ray_logs(KEY, "sk-other", "sk-wrong")      # never logged, accepted or not



def test_models_and_health(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(urllib.request.urlopen(f"{BASE}/health").read()) == {"status": "ok"}
    m = client.models.retrieve(MODEL)                        # OpenAI's GET /v1/models/{model}
    assert m.id == MODEL and m.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-17")
    assert e.value.body["code"] == "model_not_found"
    req = urllib.request.Request(f"{BASE}/version", headers={"Authorization": f"Bearer {KEY}"})
    assert json.loads(urllib.request.urlopen(req).read())["version"] == importlib.metadata.version("baton")


def test_every_replica_runs_serve_in_its_throughput_optimized_mode(server):
    """What Serve itself read in each replica's, proxy's and its controller's process (cluster/serving.py SERVE_ENV):
    user code and the handle's router on the process's event loop, gRPC between deployments and from the HTTP
    proxy, no direct ingress, and the two timers slowed down."""
    import ray

    def mode() -> tuple:
        from ray.serve._private import constants as c
        return (c.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD, c.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
                c.RAY_SERVE_USE_GRPC_BY_DEFAULT, c.RAY_SERVE_PROXY_USE_GRPC, c.RAY_SERVE_ENABLE_DIRECT_INGRESS,
                c.CONTROL_LOOP_INTERVAL_S, c.RAY_SERVE_METRICS_EXPORT_INTERVAL_MS)
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(("SERVE_REPLICA::baton#", "SERVE_PROXY_ACTOR")) or a["name"] == SERVE_CONTROLLER_NAME]
    kinds = {n.split("#")[1] if "#" in n else n.split("-")[0] for n in names}
    assert {"ingress", "prefill", "decode", "SERVE_PROXY_ACTOR", SERVE_CONTROLLER_NAME} <= kinds, names
    modes = ray.get([ray.get_actor(n, namespace="serve").__ray_call__.remote(lambda _a: mode()) for n in names],
                    timeout=30)
    # and the two slower timers: the controller's loop every 0.5 s, Serve's metrics exported every second
    assert all(m == (False, False, True, True, False, 0.5, 1000) for m in modes), dict(zip(names, modes))


def test_a_replica_reads_the_start_of_its_graceful_stop_in_its_own_process(server):
    """A decode replica learns that Serve is stopping it from Serve's own state in its process
    (decode_worker.server.serve_stop_begun, a private attribute of Ray 2.60's replica) rather than by asking the
    controller every half second. Held against the real Serve: inside a replica it reads False, not None (None
    would mean the attribute moved, and the drain watch would fall back to the controller's answer); once Serve
    begins the replica's graceful stop (its app deleted while a call is in flight), True, before that call ends."""
    import asyncio
    import threading
    import time

    import ray
    from ray import serve

    @serve.deployment(graceful_shutdown_timeout_s=60, ray_actor_options={"num_cpus": 0})
    class StopWatch:
        async def __call__(self, timeout_s: float) -> list:
            from decode_worker.server import serve_stop_begun
            seen, deadline = [serve_stop_begun()], time.monotonic() + timeout_s
            while serve_stop_begun() is False and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return seen + [serve_stop_begun()]

    decode = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
              if a["name"].startswith("SERVE_REPLICA::baton#decode")]
    from decode_worker.server import serve_stop_begun
    assert serve_stop_begun() is None                               # not a Serve replica
    assert ray.get([ray.get_actor(n, namespace="serve").__ray_call__.remote(lambda _a: serve_stop_begun())
                    for n in decode], timeout=30) == [False] * len(decode)
    handle = serve.run(StopWatch.bind(), name="stop-watch", route_prefix=None)
    try:
        watching = handle.remote(60)
        time.sleep(1.0)                                             # the call is in flight
        deleting = threading.Thread(target=serve.delete, args=("stop-watch",), daemon=True)
        deleting.start()
        assert watching.result(timeout_s=60) == [False, True]
        deleting.join(60)
    finally:
        if "stop-watch" in serve.status().applications:
            serve.delete("stop-watch")


def test_chat_greedy_equals_the_offline_engine_streamed_or_not(client, offline):
    messages = [{"role": "user", "content": "Name three things a relay runner must practise."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40))
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40)
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.choices[0].finish_reason == ("length" if want.finish_reason == "length" else "stop")

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_completions_stop_strings_and_max_tokens_hold(client, offline):
    prompt = "The four strokes of a relay swim are backstroke, breaststroke, butterfly and"
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    stop = want.text.split()[2]                                 # a word the model will write
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and stop not in r.choices[0].text
    assert want.text.startswith(r.choices[0].text)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stop=[stop], stream=True) if c.choices)
    assert streamed == r.choices[0].text


def test_logit_bias_and_min_tokens_hold_across_the_hand_off(client, offline):
    """The prefill replica samples the first token with the request's bias, min_tokens and bad_words, the decode
    replica the rest: the text equals one engine's. A logit_bias naming no token of the model is a 400."""
    messages = [{"role": "user", "content": "What is the capital of France? One word."}]
    plain = offline.chat(messages, SamplingParams(temperature=0, max_tokens=40))
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 20, "the test wants an answer that ends early"
    params = SamplingParams(temperature=0, max_tokens=40, min_tokens=24, logit_bias={plain.token_ids[0]: -100})
    want = offline.chat(messages, params)
    assert want.token_ids[0] != plain.token_ids[0] and len(want.token_ids) > 24
    before = _metrics()
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=40,
                                       logit_bias={str(plain.token_ids[0]): -100}, extra_body={"min_tokens": 24})
    assert r.choices[0].message.content == want.text and r.usage.completion_tokens == len(want.token_ids)
    remote = 'baton_disaggregation_decisions_total{path="remote"}'
    assert _metrics().get(remote, 0.0) > before.get(remote, 0.0), "the request was meant to cross the hand-off"
    banned = plain.text.split()[0].strip(".")                     # vLLM's bad_words, in extra_body
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12, bad_words=[banned]))
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                       extra_body={"bad_words": [banned]})
    assert r.choices[0].message.content == want.text and banned not in want.text
    for bias, param in (({"49152": 1}, "logit_bias"), ({"7": 300}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logit_bias=bias)
        assert e.value.body["param"] == param, e.value.body


def test_echo_with_logprobs_scores_a_prompt_as_lm_eval_asks_and_vllms_prompt_logprobs(client, offline):
    """What lm-evaluation-harness sends to score a text (echo, logprobs 1, max_tokens 1): the prompt's tokens
    come back with their logprobs, the first with none, equal to one engine's; the prompt is computed whole
    where it decodes (no hand-off: the prefill replica's logits stay there)."""
    prompt = "The first runner of a relay hands the baton to the second runner inside the exchange zone."
    ids = offline.engine.tokenizer.encode(prompt)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, logprobs=1))[0]
    local = 'baton_disaggregation_decisions_total{path="local"}'
    before = _metrics()
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert _metrics().get(local, 0.0) > before.get(local, 0.0)
    c = r.choices[0]
    assert c.text == prompt + want.text
    lp = c.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for p in range(1, len(ids)):
        assert lp.token_logprobs[p] == pytest.approx(want.prompt_logprobs[p][ids[p]], abs=1e-4)
        assert len(lp.top_logprobs[p]) >= 1
    assert lp.token_logprobs[-1] == pytest.approx(want.logprobs[0][want.token_ids[0]], abs=1e-4)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
    zero = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, logprobs=1, echo=True, temperature=0)
    assert zero.choices[0].text == prompt and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:-1]      # the prompt's, nothing after
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True,
                                              temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == c.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=2,
                                          temperature=0, extra_body={"prompt_logprobs": 0})
    plps = chat.model_extra["prompt_logprobs"]
    assert plps[0] is None and len(plps) == chat.usage.prompt_tokens and all(len(d) == 1 for d in plps[1:])
    assert all(v["logprob"] <= 0 for d in plps[1:] for v in d.values())


def test_tokenize_counts_the_prompt_tokens_a_request_would_have_and_detokenize_inverts_it(client, offline):
    prompt = "The baton passes in a twenty-metre zone."
    code, out = _post("/tokenize", {"model": MODEL, "prompt": prompt, "return_token_strs": True})
    ids = offline.engine.tokenizer.encode(prompt)
    assert code == 200 and out["tokens"] == ids and out["count"] == len(ids) and len(out["token_strs"]) == len(ids)
    assert out["max_model_len"] == ENGINE["max_model_len"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who runs the anchor leg?"}]
    code, chat = _post("/tokenize", {"model": MODEL, "messages": messages})
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2)
    assert code == 200 and chat["count"] == r.usage.prompt_tokens
    code, back = _post("/detokenize", {"model": MODEL, "tokens": chat["tokens"]})
    assert code == 200 and "Who runs the anchor leg?" in back["prompt"] and back["prompt"].count("<|im_start|>") == 3
    for path, body, status, param in (
            ("/tokenize", {"model": "gpt-17", "prompt": "x"}, 404, "model"),
            ("/tokenize", {"model": MODEL, "prompt": "x", "temperature": 1}, 400, "temperature"),
            ("/tokenize", {"model": MODEL, "messages": []}, 400, "messages"),
            ("/detokenize", {"model": MODEL, "tokens": [1, 10**9]}, 400, "tokens")):
        code, err = _post(path, body)
        assert code == status and err["error"]["param"] == param, (path, body, err)
    assert _post("/tokenize", {"model": MODEL, "prompt": "x"}, key="sk-wrong")[0] == 401
    # vLLM's chat template options and truncation, as /v1/chat/completions would apply them
    from engine.llm import chat_token_ids
    turns = messages + [{"role": "assistant", "content": "The fastest"}]
    code, cont = _post("/tokenize", {"model": MODEL, "messages": turns, "add_generation_prompt": False,
                                     "continue_final_message": True})
    assert code == 200 and cont["tokens"] == chat_token_ids(offline.engine.tokenizer, turns, None, False, True)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=2,
                                       extra_body={"truncate_prompt_tokens": 8})
    assert r.usage.prompt_tokens == 8
    code, err = _post("/v1/chat/completions", {"model": MODEL, "messages": turns, "continue_final_message": True})
    assert code == 400 and err["error"]["param"] == "continue_final_message", err
    # as lm-evaluation-harness's remote tokenizer asks: no model named, and /tokenizer_info first
    req = urllib.request.Request(f"{BASE}/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        info = json.loads(resp.read())
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["model_max_length"] == ENGINE["max_model_len"]
    code, out = _post("/tokenize", {"prompt": prompt, "add_special_tokens": False})
    assert code == 200 and out["tokens"] == ids
    assert _post("/detokenize", {"tokens": ids}) == (200, {"prompt": prompt})


def test_bad_input_gets_openai_errors_and_the_cluster_goes_on(client):
    cases = [
        (b"{not json", 400, None),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}, 400, "max_tokens"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 99}, 400, "n"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5}, 400, "n"),       # limits.max_n
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["x"] * 5000}, 400, "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["y" * 300]}, 400, "stop"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 1100}]}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
        # a request's own template runs only where chat.trust_request_template says so (vLLM's default refuses it)
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' }}"}, 400,
         "chat_template"),
    ]
    big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * (10 << 20)}]}).encode()
    cases.append((big, 413, None))                                      # 10 MB against a 256 KiB limit
    for body, status, param in cases:
        code, err = _post("/v1/chat/completions", body)
        assert code == status, (body, err)
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"], err
        assert err["error"]["param"] == param, (body, err)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Still there?"}],
                                       temperature=0, max_tokens=4)
    assert r.usage.completion_tokens >= 1


def test_embeddings_are_computed_in_the_prefill_pool_and_equal_the_offline_engines(client, offline):
    """/v1/embeddings through the openai client (base64 on the wire, its default): each input's prompt is computed
    in the prefill pool and pooled there, never handed to the decode pool; the vectors equal LLM.embed's on the
    same engine; floats and token-id inputs too; usage counts every input's tokens."""
    import numpy as np
    texts = ["The baton passes in a twenty-metre exchange zone.", "Paged attention keeps the KV cache in blocks.",
             "Relay"]
    want = [np.asarray(o.outputs.embedding) for o in offline.embed(texts)]
    m0 = _metrics(fresh=True)
    r = client.embeddings.create(model=MODEL, input=texts)
    assert r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    for d, w in zip(r.data, want):
        assert np.abs(np.asarray(d.embedding) - w).max() < 1e-4
    ids = [offline.engine.tokenizer.encode(t) for t in texts]
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(map(len, ids))
    m = _metrics(fresh=True)
    grew = {p: _pool_sum(m, "baton_prompt_tokens_total", p) - _pool_sum(m0, "baton_prompt_tokens_total", p)
            for p in ("prefill", "decode")}
    assert grew == {"prefill": r.usage.prompt_tokens, "decode": 0}
    assert _pool_sum(m, "baton_kv_transfer_bytes_total", "decode") == _pool_sum(m0, "baton_kv_transfer_bytes_total",
                                                                                "decode")
    code, out = _post("/v1/embeddings", {"model": MODEL, "input": ids[1], "encoding_format": "float"})
    assert code == 200 and out["object"] == "list" and out["data"][0]["object"] == "embedding"
    assert np.abs(np.asarray(out["data"][0]["embedding"]) - want[1]).max() < 1e-4
    assert out["usage"]["prompt_tokens"] == len(ids[1])
    # vLLM's chat form: the conversation under the chat template, without the assistant's turn
    messages = [{"role": "user", "content": texts[0]}]
    chat = offline.apply_chat_template(messages)                 # with the assistant's header: one more turn
    plain = offline.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    plain = list(plain["input_ids"] if isinstance(plain, dict) or hasattr(plain, "input_ids") else plain)
    code, out = _post("/v1/embeddings", {"model": MODEL, "messages": messages, "encoding_format": "float"})
    assert code == 200 and out["usage"]["prompt_tokens"] == len(plain) < len(chat), out
    want_chat = np.asarray(offline.embed([plain])[0].outputs.embedding)
    assert np.abs(np.asarray(out["data"][0]["embedding"]) - want_chat).max() < 1e-4


def test_score_and_rerank_rank_by_the_embeddings_cosine(client, offline):
    """vLLM's /v1/score and /rerank (Jina's, Cohere's) over an embedding model: cosine similarities of the offline
    engine's embeddings; rerank orders the documents best first and keeps top_n."""
    import numpy as np
    query = "Who runs the last leg of a relay?"
    docs = ["The anchor runs the last leg of a relay.", "Paged attention keeps the KV cache in blocks.",
            "Bananas are yellow."]
    vec = {t: np.asarray(o.outputs.embedding) for t, o in zip([query, *docs], offline.embed([query, *docs]))}
    want = [float(vec[query] @ vec[d]) for d in docs]
    code, out = _post("/v1/score", {"model": MODEL, "text_1": query, "text_2": docs})
    assert code == 200 and [d["index"] for d in out["data"]] == [0, 1, 2], out
    assert [d["score"] for d in out["data"]] == pytest.approx(want, abs=1e-4)
    code, pairwise = _post("/score", {"model": MODEL, "text_1": docs[:2], "text_2": [query, docs[0]]})
    assert code == 200 and [d["score"] for d in pairwise["data"]] == pytest.approx(
        [want[0], float(vec[docs[1]] @ vec[docs[0]])], abs=1e-4)
    code, ranked = _post("/v1/rerank", {"model": MODEL, "query": query, "documents": docs, "top_n": 2})
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert code == 200 and [r["index"] for r in ranked["results"]] == order
    assert [r["document"]["text"] for r in ranked["results"]] == [docs[i] for i in order]
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([want[i] for i in order], abs=1e-4)
    for path, body, param in [("/v1/score", {"model": MODEL, "text_1": ["a", "b"], "text_2": ["c"] * 3}, "text_2"),
                              ("/v1/score", {"model": MODEL, "text_1": [], "text_2": "c"}, "text_1"),
                              ("/v1/rerank", {"model": MODEL, "query": "q", "documents": []}, "documents"),
                              ("/rerank", {"model": MODEL, "query": "q", "documents": ["d"], "top_n": 0}, "top_n")]:
        code, err = _post(path, body)
        assert code == 400 and err["error"]["param"] == param, (path, body, err)


def test_bad_embedding_requests_get_openai_errors_and_the_cluster_goes_on(client):
    for body, status, param in [
            ({"model": MODEL, "input": []}, 400, "input"),
            ({"model": MODEL, "input": ""}, 400, "input"),
            ({"model": MODEL, "input": [[]]}, 400, "input"),
            ({"model": MODEL, "input": [[5, 10 ** 6]]}, 400, "input"),
            ({"model": MODEL, "input": "hi " * 1100}, 400, "input"),            # past max_model_len 1024
            ({"model": MODEL, "input": "hi", "dimensions": 64}, 400, "dimensions"),    # not a Matryoshka model
            ({"model": MODEL, "input": "hi", "encoding_format": "int8"}, 400, "encoding_format"),
            ({"model": "gpt-17", "input": "hi"}, 404, "model"),
            ({"model": MODEL, "input": "hi", "messages": [{"role": "user", "content": "hi"}]}, 400, "input"),
            ({"model": MODEL}, 400, "input"),
            ({"model": MODEL, "messages": []}, 400, "messages")]:
        code, err = _post("/v1/embeddings", body)
        assert code == status and err["error"]["param"] == param, (body, err)
    with pytest.raises(openai.BadRequestError, match="1100|tokens"):
        client.embeddings.create(model=MODEL, input="hi " * 1100)
    assert len(client.embeddings.create(model=MODEL, input="Still there?").data[0].embedding) == 576


def test_metrics_show_both_pools_and_the_transfer(client):
    m0 = _metrics(fresh=True)
    r = client.completions.create(model=MODEL, prompt="Relay teams win or lose in the exchange zone because " * 3,
                                  temperature=0, max_tokens=4, extra_body={"ignore_eos": True})

    def grew(m, name: str, pools=("prefill", "decode")) -> float:
        return sum(_pool_sum(m, name, p) - _pool_sum(m0, name, p) for p in pools)

    # the request's tokens, each counted once across the pools: its prompt where its first token was sampled
    # (the prefill pool, which handed its KV over), every token it generated where it was sampled
    m = _metrics(fresh=True)
    assert grew(m, "baton_generation_tokens_total") == r.usage.completion_tokens == 4
    assert grew(m, "baton_prompt_tokens_total") == r.usage.prompt_tokens
    remote = 'baton_disaggregation_decisions_total{path="remote"}'
    assert m.get(remote, 0) - m0.get(remote, 0) == 1                 # prefilled in the prefill pool
    assert grew(m, "baton_prompt_tokens_total", ["prefill"]) == r.usage.prompt_tokens
    # its phases: queued in each pool, prefilled in the prefill pool, decoded in the decode pool
    assert [grew(m, f"baton_request_{phase}_time_seconds_count", [pool]) for phase, pool in
            [("queue", "prefill"), ("queue", "decode"), ("prefill", "prefill"), ("prefill", "decode"),
             ("decode", "decode")]] == [1, 1, 1, 0, 1]
    # its lengths, as the ingress saw them
    for name, n in (("prompt", r.usage.prompt_tokens), ("generation", 4)):
        assert m[f"baton_request_{name}_tokens_count"] - m0.get(f"baton_request_{name}_tokens_count", 0) == 1
        assert m[f"baton_request_{name}_tokens_sum"] - m0.get(f"baton_request_{name}_tokens_sum", 0) == n
    for pool in ("prefill", "decode"):
        assert _pool_sum(m, "baton_kv_blocks_free", pool) > 0, pool
        assert _pool_sum(m, "baton_prefix_cache_query_tokens_total", pool) > 0, pool
    # its steps, as the engines count them: the prefill pool computed the prompt (less what it had cached) in one
    # step, the decode pool the three tokens after the first, one a step, each reading its context
    hit = grew(m, "baton_prefix_cache_hit_tokens_total", ["prefill"])
    prompt = r.usage.prompt_tokens
    assert [grew(m, f"baton_engine_step_{k}_total", ["prefill"]) for k in ("tokens", "sequences")] == [prompt - hit, 1]
    assert grew(m, "baton_engine_steps_total", ["prefill"]) == 1
    assert grew(m, "baton_engine_step_attention_pairs_total", ["prefill"]) == attention_pairs(prompt - hit, hit)
    assert [grew(m, f"baton_engine_step{k}_total", ["decode"]) for k in ("s", "_tokens", "_sequences")] == [3, 3, 3]
    assert grew(m, "baton_engine_step_context_tokens_total", ["decode"]) == 3 * prompt + 1 + 2 + 3
    assert 0 < grew(m, "baton_engine_step_seconds_total") < 30
    assert _pool_sum(m, "baton_kv_transfer_bytes_total", "decode") > 0
    assert _pool_sum(m, "baton_kv_pins_released_total", "prefill") >= 1
    assert sum(v for k, v in m.items() if k.startswith('baton_requests_total{') and 'status="ok"' in k) >= 1
    assert sum(v for k, v in m.items() if k.startswith("baton_routing_decisions_total{")) >= 1
    assert sum(v for k, v in m.items() if k.startswith("baton_time_to_first_token_seconds_count{")) >= 1


def test_a_request_aborted_mid_stream_frees_its_blocks_in_both_pools(client):
    prompt = "Write a very long story about a relay race across a whole continent. " * 4
    stream = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=600,
                                       extra_body={"ignore_eos": True}, stream=True)
    got = 0
    for chunk in stream:
        got += 1
        if got == 5:
            break
    stream.close()                                                # the client goes away mid-stream

    def aborted(m) -> float:
        return sum(v for k, v in m.items() if k.startswith('baton_requests_total{') and 'status="aborted"' in k)

    wait_for(lambda: (lambda m: aborted(m) >= 1 and all(_pool_sum(m, "baton_kv_blocks_used", p) == 0
                                                        for p in ("prefill", "decode")))(_metrics(fresh=True)),
             20, "both pools to free the aborted request's blocks")


def _streamed(m: dict[str, float], metric: str, path: str = "channel") -> float:
    """The decode pool's baton_stream_{messages,deltas}_total on its channels (or on the requests' own calls)."""
    return sum(v for k, v in m.items() if k.startswith(metric + "{") and f'path="{path}"' in k)


def test_concurrent_streams_share_the_channels_messages_and_a_client_leaving_one_frees_its_blocks(client, offline):
    """decode.stream_channels (on in this cluster): the tokens one decode step makes for several streams of the
    ingress leave the replica as one message, every stream gets the engine's text, and a client that leaves one
    stream mid-way aborts only that request."""
    import concurrent.futures
    prompts = [f"Describe leg {i} of a relay race across the mountains." for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = [o.text for o in offline.generate(prompts, params)]

    def stream(prompt: str, leave_after: int | None = None) -> str:
        chunks = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=24, stream=True,
                                           extra_body={"ignore_eos": True})
        text = []
        for c in chunks:
            text += [c.choices[0].text] if c.choices else []
            if len(text) == leave_after:
                chunks.close()                      # the client goes away mid-stream
                break
        return "".join(text)
    # the ingress opens its channel on a decode replica once a first request streams from it: one that comes
    # through the channel shows it is open
    start = _metrics(fresh=True)
    wait_for(lambda: stream("Warm up the channel.", None) is not None
             and _streamed(_metrics(fresh=True), "baton_stream_deltas_total") > _streamed(
                 start, "baton_stream_deltas_total"), 60, "a request's deltas through the channel")
    before = _metrics(fresh=True)
    with concurrent.futures.ThreadPoolExecutor(len(prompts) + 1) as pool:
        leaving = pool.submit(stream, "Write a very long story about a relay race. " * 3, 4)
        got = list(pool.map(stream, prompts))
        leaving.result()
    assert got == want
    # every stream's first delta came on its own call and the rest through the channel (a delta may carry several
    # tokens, where a stream fell behind the engine, so the deltas are not counted against the tokens)
    after = wait_for(lambda: (lambda m: m if _streamed(m, "baton_stream_messages_total", "request") - _streamed(
        before, "baton_stream_messages_total", "request") >= len(prompts) + 1 else None)(_metrics(fresh=True)), 20,
        "the replica's report counting every stream's first delta")
    assert _streamed(after, "baton_stream_messages_total", "request") - _streamed(
        before, "baton_stream_messages_total", "request") == len(prompts) + 1      # one each: the first
    deltas = _streamed(after, "baton_stream_deltas_total") - _streamed(before, "baton_stream_deltas_total")
    messages = _streamed(after, "baton_stream_messages_total") - _streamed(before, "baton_stream_messages_total")
    assert deltas >= len(prompts) and messages <= deltas / 2, (messages, deltas)   # streams shared messages
    wait_for(lambda: (lambda m: all(_pool_sum(m, "baton_kv_blocks_used", p) == 0
                                    for p in ("prefill", "decode")))(_metrics(fresh=True)),
             20, "both pools to free every block, the left stream's too")


def test_a_prompt_the_decode_pool_already_caches_is_prefilled_there(client, offline):
    """Conditional disaggregation: the second time, the decode replica holds all but the last partial
    block (< min_remote_prefill_tokens uncached), so it prefills locally: same text, no transfer. On this
    quiet cluster each pool's router predicted exactly the cached tokens its engine then found (none on the
    prefill replica the first time, the prompt's full blocks on the decode replica the second)."""
    def paths() -> dict[str, float]:
        m = _metrics()
        return {p: m.get(f'baton_disaggregation_decisions_total{{path="{p}"}}', 0.0) for p in ("local", "remote")}

    def predictions() -> dict[str, float]:
        m = _metrics()
        got = {f"{p}/{o}": m.get(f'baton_router_cache_predictions_total{{outcome="{o}",pool="{p}"}}',
                                 m.get(f'baton_router_cache_predictions_total{{pool="{p}",outcome="{o}"}}', 0.0))
               for p in ("prefill", "decode") for o in ("exact", "over", "under")}
        for p in ("prefill", "decode"):
            got[f"{p}/found"] = m.get(f'baton_router_found_cached_tokens_sum{{pool="{p}"}}', 0.0)
        return got

    prompt = "Coaches time each leg of the relay separately, and the fastest runner usually goes last: " * 2
    before, guessed = paths(), predictions()
    first = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    mid = paths()
    ids = offline.engine.tokenize(prompt)
    full = len(ids) // 16                               # the engine's default block size
    hashes = block_hashes(ids, 16, served_model_key())
    wait_for(lambda: all(max(m.values(), default=0) >= full for m in ingress_index_matches("decode", hashes).values()),
             10, "the decode replica's KV events to reach the ingress's index")
    second = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    after = paths()
    assert mid["remote"] == before["remote"] + 1 and mid["local"] == before["local"]
    assert after["local"] == mid["local"] + 1 and after["remote"] == mid["remote"]
    assert second.choices[0].text == first.choices[0].text
    assert second.usage.prompt_tokens_details.cached_tokens == min(full, (len(ids) - 1) // 16) * 16
    now = predictions()
    assert {k: now[k] - guessed[k] for k in now} == {
        "prefill/exact": 1, "prefill/over": 0, "prefill/under": 0, "prefill/found": 0,
        "decode/exact": 1, "decode/over": 0, "decode/under": 0,
        "decode/found": second.usage.prompt_tokens_details.cached_tokens}


def test_a_salted_prompt_hits_only_the_cache_of_its_own_salt_across_both_pools(client, offline):
    """vLLM's cache_salt: the second request with a salt reads the blocks the first left in either pool; another
    salt, and no salt, find none, wherever the router sends them; the text is the same."""
    prompt = "A salted prompt: the anchor leg runs last and carries the baton over the line. " * 3

    def ask(salt: str | None):
        extra = {} if salt is None else {"cache_salt": salt}
        return client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, extra_body=extra)

    first = ask("tenant-a")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = ask("tenant-a")
    assert again.usage.prompt_tokens_details.cached_tokens > 0 and again.choices[0].text == first.choices[0].text
    for salt in ("tenant-b", None):
        other = ask(salt)
        assert other.usage.prompt_tokens_details.cached_tokens == 0, salt
        assert other.choices[0].text == first.choices[0].text
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": ""})


def test_vllms_response_extras_over_the_cluster(client, offline):
    """request_id names the response; return_tokens_as_token_ids gives the very ids the offline engine samples;
    chat echo puts the assistant message being continued before its continuation; continuous_usage_stats counts
    the tokens so far in every chunk."""
    from engine.llm import chat_token_ids
    messages = [{"role": "user", "content": "Name the four legs of a relay."}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=12))
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12, logprobs=True,
                                       extra_body={"request_id": "relay-42", "return_tokens_as_token_ids": True})
    assert r.id == "chatcmpl-relay-42"
    assert [int(t.token.removeprefix("token_id:")) for t in r.choices[0].logprobs.content] == want.token_ids

    started = [*messages, {"role": "assistant", "content": "The first leg"}]
    ids = chat_token_ids(offline.tokenizer, started, add_generation_prompt=False, continue_final_message=True)
    rest = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10))[0].text
    r = client.chat.completions.create(model=MODEL, messages=started, temperature=0, max_tokens=10, extra_body={
        "echo": True, "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content == "The first leg" + rest

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None and c.usage.prompt_tokens == len(want.prompt_token_ids) for c in chunks)
    assert counts == sorted(counts) and counts[-1] == len(want.token_ids) and len(set(counts)) > 2


def test_structured_outputs_and_tool_calls_hold_across_the_prefill_decode_hand_off(client):
    """The prefill replica samples the first token under the grammar; the decode replica rebuilds the grammar
    state from the tokens it receives (tests/structured_checks.py)."""
    from tests.structured_checks import check_bad_specs_get_400, check_structured_outputs, check_tool_calls
    before = _metrics()
    check_structured_outputs(client, MODEL)
    check_bad_specs_get_400(client, MODEL)
    check_tool_calls(client, MODEL)
    after = _metrics()        # constrained prompts went through the prefill pool and its KV hand-off
    remote = 'baton_disaggregation_decisions_total{path="remote"}'
    assert after.get(remote, 0.0) > before.get(remote, 0.0)


def test_a_decode_replica_prefilling_locally_pulls_the_prefix_a_prefill_replica_caches(server, offline):
    """The decode pool's conditional prefill with cross-replica reuse: a prompt the decode replica prefills
    itself, whose first 12 blocks the prefill replica caches (an earlier prompt's, still pinned for its own
    hand-off), has them pulled over NIXL and computes only the rest: the offline engine's text. The earlier
    hand-off is then consumed too, and every pin ends."""
    import random
    from dataclasses import replace

    from ray import serve

    from replica.messages import PoolRequest
    rng = random.Random(33)
    prefix = [rng.randrange(200, 40000) for _ in range(12 * 16)]
    first, prompt = (prefix + [rng.randrange(200, 40000) for _ in range(n)] for n in (5, 20))
    key, greedy = served_model_key(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefill, decode = (serve.get_deployment_handle(pool, "baton") for pool in ("prefill", "decode"))
    stream = decode.options(stream=True)
    a = PoolRequest("prefix-a", first, block_hashes(first, 16, key), greedy)
    m0 = _metrics(fresh=True)
    a = replace(a, prefill=prefill.prefill.remote(a).result(timeout_s=120))      # cached (and pinned) there only
    b = PoolRequest("prefix-b", prompt, block_hashes(prompt, 16, key), greedy, prefix_source=("prefill", a.prefill.replica, 12))
    assert [t for d in stream.generate.remote(b) for t in d.token_ids] == \
        offline.generate([prompt], greedy)[0].token_ids
    assert [t for d in stream.generate.remote(a) for t in d.token_ids] == \
        offline.generate([first], greedy)[0].token_ids
    m = wait_for(lambda: (lambda m: m if all(_pool_sum(m, "baton_kv_blocks_used", p) == 0
                                             for p in ("prefill", "decode")) else None)(_metrics(fresh=True)),
                 20, "every pin to end")
    assert _pool_sum(m, "baton_prefix_pull_tokens_total", "decode") - \
        _pool_sum(m0, "baton_prefix_pull_tokens_total", "decode") == 12 * 16
