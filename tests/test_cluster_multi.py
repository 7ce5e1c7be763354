"""Scaled-out pools on the real app (conftest's SCALED_OUT): n-gram speculative decoding in the decode pool
leaves greedy text as the offline engine (and so the pool without it) writes it, and structured outputs and
tool calls valid; two ingress replicas, each routing on its own mirror of one prefix index, send a repeated
long prefix to the one prefill replica caching it."""
from __future__ import annotations

import json
import random
import urllib.request

import openai
import pytest

from cluster.live_metrics import pool_total, scrape
from engine.block_hash import block_hashes
from tests.conftest import (CLUSTER_ENGINE, SCALED_OUT, ingress_index_matches, on_ingress_replicas, served_model_key,
                            wait_for)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "SmolLM2-135M-Instruct"
BASE = f"http://127.0.0.1:{SCALED_OUT['port']}"
BLOCK = 16                                   # the engine's default block size


def complete(ids: list[int]) -> dict:
    body = json.dumps({"model": MODEL, "prompt": ids, "max_tokens": 2, "temperature": 0}).encode()
    req = urllib.request.Request(f"{BASE}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def prefix_hit_decisions() -> dict[str, float]:
    """Per ingress replica: its own routers' prefix-hit decisions for the prefill pool (its process's metrics)."""
    def count() -> float:
        import prometheus_client
        return prometheus_client.REGISTRY.get_sample_value(
            "baton_routing_decisions_total", {"pool": "prefill", "reason": "prefix_hit"}) or 0.0
    return on_ingress_replicas(count)


COUNT = [{"role": "user", "content": "Count from one to twenty in words, comma separated."}]
REPEAT = "red, green, blue, red, green, blue, red, green, blue, red, green,"     # the n-gram lookup finds drafts


def greedy_texts(port: int, api_key: str) -> list[str]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0, timeout=120)
    chat = client.chat.completions.create(model=MODEL, messages=COUNT, temperature=0, max_tokens=48)
    repeat = client.completions.create(model=MODEL, prompt=REPEAT, temperature=0, max_tokens=32,
                                       extra_body={"ignore_eos": True})
    return [chat.choices[0].message.content, repeat.choices[0].text]


def test_speculative_decoding_in_the_decode_pool_keeps_the_greedy_text(shared_cluster):
    """The text a pool without speculation writes is the offline engine's (tests/test_cluster_e2e.py and the
    multi-node tests hold that): the speculative pool must write it too."""
    from engine import LLM, SamplingParams
    reference = LLM(None, **CLUSTER_ENGINE)
    plain = [reference.chat(COUNT, SamplingParams(temperature=0, max_tokens=48)).text,
             reference.generate(REPEAT, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0].text]
    cfg = shared_cluster.up(SCALED_OUT)
    assert cfg.decode.engine.speculative_config["method"] == "ngram"
    m0 = scrape(BASE)
    assert greedy_texts(SCALED_OUT["port"], "unused") == plain

    def grew(metric: str):
        return lambda: pool_total(scrape(BASE), metric, "decode") > pool_total(m0, metric, "decode")
    wait_for(grew("baton_spec_proposed_tokens_total"), 30, "the decode pool to report drafted tokens")
    wait_for(grew("baton_spec_accepted_tokens_total"), 30, "the decode pool to report accepted drafts")


def test_structured_outputs_and_tool_calls_hold_with_ngram_speculation(shared_cluster):
    """The same checks as without speculation (tests/structured_checks.py): drafts the grammar refuses are cut
    and verify rows masked, so every schema-constrained answer still validates and forced calls parse."""
    from tests.structured_checks import check_structured_outputs, check_tool_calls
    shared_cluster.up(SCALED_OUT)
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    m0 = scrape(BASE)
    check_structured_outputs(client, MODEL, quick=True)
    check_tool_calls(client, MODEL, quick=True)
    assert pool_total(scrape(BASE), "baton_spec_proposed_tokens_total", "decode") > \
        pool_total(m0, "baton_spec_proposed_tokens_total", "decode")      # the drafter ran on these requests


def test_every_ingress_replica_routes_a_shared_prefix_to_the_replica_caching_it(shared_cluster):
    shared_cluster.up(SCALED_OUT)
    rng = random.Random(15)
    prefix = [rng.randrange(200, 40000) for _ in range(16 * BLOCK)]
    hashes = block_hashes(prefix, BLOCK, served_model_key())

    def views() -> list[dict[str, int] | None]:
        return list(ingress_index_matches("prefill", hashes).values())

    def new_suffix() -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(BLOCK)]
    # an ingress replica mirrors the index from its first request on: the proxy picks one per request
    for _ in range(40):
        if all(v is not None for v in views()):
            break
        complete(new_suffix())
    assert len(views()) == 2 and all(v is not None for v in views()), views()
    pulled_before = pool_total(scrape(BASE, fresh=True), "baton_prefix_pull_tokens_total", "prefill")
    complete(prefix + new_suffix())
    first = wait_for(lambda: (lambda v: v if all(max(m.values(), default=0) == 16 for m in v) else None)(views()),
                     10, "both ingress replicas' mirrors to hold the prefix")
    before = prefix_hit_decisions()
    cached = []
    for _ in range(40):        # until both ingress replicas have routed the prefix twice
        if all(n - before[name] >= 2 for name, n in prefix_hit_decisions().items()):
            break
        cached.append(complete(prefix + new_suffix())["usage"]["prompt_tokens_details"]["cached_tokens"])
    after = prefix_hit_decisions()
    assert all(after[name] - before[name] >= 2 for name in before), (before, after)
    assert cached and all(c == len(prefix) for c in cached), cached    # each found the whole prefix cached
    # one index: both mirrors agree, and only one prefill replica ever computed the prefix: the one that cached
    # it first; a request the router sent to the other (its load-imbalance fallback) pulled it from there
    final = wait_for(lambda: (lambda v: v if v[0] == v[1] else None)(views()), 30, "the two mirrors to agree")
    holders = [r for r, n in final[0].items() if n == 16]
    assert set(r for r, n in first[0].items() if n == 16) <= set(holders), (first, final)
    wait_for(lambda: pool_total(scrape(BASE), "baton_prefix_pull_tokens_total", "prefill") - pulled_before
             == (len(holders) - 1) * len(prefix), 10, "every other holder to have pulled the prefix")


def _outcomes(m: dict[str, float], outcome: str) -> float:
    return sum(v for k, v in m.items() if k.startswith("baton_prefix_pulls_total{") and f'outcome="{outcome}"' in k)


def test_a_prefill_replica_pulls_a_prefix_the_other_caches_instead_of_computing_it(shared_cluster):
    """Cross-replica prefix reuse (issue 21): a prompt whose first 12 blocks one prefill replica caches, sent to
    the other (as a request avoiding the first is): that replica pulls the 12 blocks from it (here over the Ray
    fallback transport), computes only the rest, and the decode pool writes the offline engine's text. Both
    replicas' pins end: the source's when the pull is done, the puller's when the decode replica pulled. Then
    a prompt only the decode replica caches (it prefilled it itself) is pulled from there by a prefill replica,
    after the source named first answered that it holds none of it (the fallback), and a prompt whose named
    source answers with only its first half is pulled whole from the fallback, which holds all of it."""
    from dataclasses import replace

    from ray import serve

    from engine import LLM, SamplingParams
    from replica.messages import PoolRequest
    shared_cluster.up(SCALED_OUT)
    rng = random.Random(21)
    prefix = [rng.randrange(200, 40000) for _ in range(12 * BLOCK)]
    complete(prefix + [rng.randrange(200, 40000) for _ in range(5)])     # one prefill replica caches the prefix
    key = served_model_key()
    hashes = block_hashes(prefix, BLOCK, key)
    view = wait_for(lambda: next((v for v in ingress_index_matches("prefill", hashes).values()
                                  if v is not None and max(v.values(), default=0) == 12 and len(v) == 2), None),
                    10, "an ingress mirror to see both prefill replicas and the one caching the prefix")
    source = next(r for r, n in view.items() if n == 12)
    m0 = scrape(BASE)
    prompt = prefix + [rng.randrange(200, 40000) for _ in range(20)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    req = PoolRequest("prefix-pull-test", prompt, block_hashes(prompt, BLOCK, key), greedy, avoid=(source,),
                      prefix_source=("prefill", source, 12))
    result = serve.get_deployment_handle("prefill", "baton").prefill.remote(req).result(timeout_s=120)
    assert result.replica != source and result.num_pulled_tokens == 12 * BLOCK
    deltas = serve.get_deployment_handle("decode", "baton").options(stream=True).generate.remote(
        replace(req, prefill=result))
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == LLM(None, **CLUSTER_ENGINE).generate([prompt], greedy)[0].token_ids
    m = wait_for(lambda: (lambda m: m if all(pool_total(m, "baton_kv_blocks_used", p) == 0
                                             for p in ("prefill", "decode")) else None)(scrape(BASE)),
                 20, "every pin of the pull and of the hand-off to end")
    assert pool_total(m, "baton_prefix_pull_tokens_total", "prefill") - \
        pool_total(m0, "baton_prefix_pull_tokens_total", "prefill") == 12 * BLOCK

    # a source in the other pool: a prompt the decode replica prefilled itself, pulled by a prefill replica
    decode = serve.get_deployment_handle("decode", "baton").options(stream=True)
    other = [rng.randrange(200, 40000) for _ in range(10 * BLOCK + 3)]
    local = PoolRequest("prefix-decode-source", other, block_hashes(other, BLOCK, key), greedy)
    want = [t for d in decode.generate.remote(local) for t in d.token_ids]          # cached on the decode replica
    holder = wait_for(lambda: next((r for v in ingress_index_matches("decode", block_hashes(other, BLOCK, key)).values()
                                    if v for r, n in v.items() if n == 10), None), 10, "the index to see it")
    # named first: the prefill replica holding the other prefix, as an index that lags an eviction names it; it
    # answers that it holds none of these blocks, and the puller asks the fallback, the decode replica
    none_before = _outcomes(scrape(BASE, fresh=True), "none")
    req = PoolRequest("prefix-pull-from-decode", other, block_hashes(other, BLOCK, key), greedy, avoid=(source,),
                      prefix_source=("prefill", source, 10), prefix_fallback=("decode", holder, 10))
    result = serve.get_deployment_handle("prefill", "baton").prefill.remote(req).result(timeout_s=120)
    assert result.replica != source and result.num_pulled_tokens == 10 * BLOCK
    assert _outcomes(scrape(BASE, fresh=True), "none") - none_before == 1
    assert [t for d in decode.generate.remote(replace(req, prefill=result)) for t in d.token_ids] == want
    # named first: the very replica asked (the index had not seen it evict them): it asks the fallback at once
    third = [rng.randrange(200, 40000) for _ in range(10 * BLOCK + 3)]
    alone = PoolRequest("prefix-third", third, block_hashes(third, BLOCK, key), greedy)
    want = [t for d in decode.generate.remote(alone) for t in d.token_ids]
    wait_for(lambda: any(v and max(v.values()) == 10 for v in
                         ingress_index_matches("decode", block_hashes(third, BLOCK, key)).values()), 10, "the index")
    req = PoolRequest("prefix-self-named", third, block_hashes(third, BLOCK, key), greedy, avoid=(source,),
                      prefix_source=("prefill", result.replica, 10), prefix_fallback=("decode", holder, 10))
    again = serve.get_deployment_handle("prefill", "baton").prefill.remote(req).result(timeout_s=120)
    assert again.replica == result.replica and again.num_pulled_tokens == 10 * BLOCK
    assert [t for d in decode.generate.remote(replace(req, prefill=again)) for t in d.token_ids] == want
    wait_for(lambda: all(pool_total(scrape(BASE), "baton_kv_blocks_used", p) == 0 for p in ("prefill", "decode")),
             20, "every pin to end")
    # named first: a prefill replica that holds only the first half (it evicted the rest, as far as the puller
    # knows): it answers with 8 blocks, the decode replica holds all 16, so the puller asks it for more and pulls
    # those (it withdraws the first answer; with this cluster's Ray transport that pin ended at the copy anyway)
    half, rest = ([rng.randrange(200, 40000) for _ in range(8 * BLOCK)] for _ in range(2))
    fourth = half + rest + [rng.randrange(200, 40000) for _ in range(3)]
    first = PoolRequest("prefix-half", half + [7, 8, 9], block_hashes(half + [7, 8, 9], BLOCK, key), greedy,
                        avoid=(result.replica,))
    first = replace(first, prefill=serve.get_deployment_handle("prefill", "baton").prefill.remote(first)
                    .result(timeout_s=120))
    assert first.prefill.replica == source
    list(decode.generate.remote(first))
    full = PoolRequest("prefix-full", fourth, block_hashes(fourth, BLOCK, key), greedy)
    want = [t for d in decode.generate.remote(full) for t in d.token_ids]                # on the decode replica
    wait_for(lambda: any(v and max(v.values()) == 16 for v in
                         ingress_index_matches("decode", block_hashes(fourth, BLOCK, key)).values()), 10, "the index")
    wait_for(lambda: all(pool_total(scrape(BASE), "baton_kv_blocks_used", p) == 0 for p in ("prefill", "decode")),
             20, "the first half's hand-off to end")
    req = PoolRequest("prefix-short-answer", fourth, block_hashes(fourth, BLOCK, key), greedy, avoid=(source,),
                      prefix_source=("prefill", source, 16), prefix_fallback=("decode", holder, 16))
    fourth_result = serve.get_deployment_handle("prefill", "baton").prefill.remote(req).result(timeout_s=120)
    assert fourth_result.replica != source and fourth_result.num_pulled_tokens == 16 * BLOCK
    assert [t for d in decode.generate.remote(replace(req, prefill=fourth_result)) for t in d.token_ids] == want
    wait_for(lambda: all(pool_total(m, "baton_kv_blocks_used", p) == 0 for m in [scrape(BASE, fresh=True)]
                         for p in ("prefill", "decode")), 10, "every pin to end")
