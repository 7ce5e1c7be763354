"""Colocated mode from the same config (one pool prefills and decodes): the openai client gets the offline
engine's greedy text, n seeded choices, logprobs, and /metrics shows only the decode pool; its streams are
batched (decode.stream_interval_ms); a request without a temperature takes the generation config's. Its pool runs a
host KV tier: a prompt the KV cache evicted is served from host memory, and the router's index knows where. Its
ingress renders chats with a chat template of its own (chat.template) and runs a request's own where it trusts
them (chat.trust_request_template)."""
from __future__ import annotations

import json
import random
import time
import urllib.request

import jsonschema
import openai
import pytest

from cluster.live_metrics import pool_total, scrape
from engine import LLM, SamplingParams
from engine.block_hash import block_hashes
from tests.conftest import CLUSTER_ENGINE, GRAMMAR_COMPILE_TIMEOUT_S, ingress_index_matches, served_model_key, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8733
MODEL = "SmolLM2-135M-Instruct"
ENGINE = {**CLUSTER_ENGINE, "kv_offloading_size": 0.125}    # 96 MiB of device KV (2080 tokens), 128 MiB on host
STREAM_INTERVAL_MS = 100
# a sampling default over the model's generation config: requests that set no temperature decode greedily
GENERATION = {"override_generation_config": {"temperature": 0.0}}
# SmolLM2's own chat template with another default system line (vLLM's --chat-template)
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\nYou are Baton, a relay coach<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
COLOCATED = {"mode": "colocated", "port": PORT, "ingress": {"num_cpus": 0},
             "decode": {"num_cpus": 0, "engine": {**ENGINE, **GENERATION}, "stream_interval_ms": STREAM_INTERVAL_MS},
             "limits": {"grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S},
             "chat": {"template": TEMPLATE, "trust_request_template": True}}


@pytest.fixture
def client(shared_cluster):
    shared_cluster.up(COLOCATED)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)


def test_colocated_embeds_in_its_one_pool(client):
    """Without a prefill pool an embedding's prompt is computed in the decode pool: the vectors equal the offline
    engine's, and that pool's prompt-token counter grew by the inputs' tokens."""
    import numpy as np
    texts = ["Four runners, one baton.", "The anchor leg runs last."]
    want = [np.asarray(o.outputs.embedding) for o in LLM(None, **ENGINE).embed(texts)]
    base = f"http://127.0.0.1:{PORT}"
    before = pool_total(scrape(base, True), "baton_prompt_tokens_total", "decode")
    r = client.embeddings.create(model=MODEL, input=texts)
    for d, w in zip(r.data, want):
        assert np.abs(np.asarray(d.embedding) - w).max() < 1e-4
    assert pool_total(scrape(base, True), "baton_prompt_tokens_total", "decode") - before == r.usage.prompt_tokens


def test_colocated_serves_greedy_n_and_logprobs(client):
    messages = [{"role": "user", "content": "Why do relay runners practise the baton exchange?"}]
    # the default model as the cluster runs it (its GGUF, packed)
    want = LLM(None, **ENGINE).chat(messages, SamplingParams(temperature=0, max_tokens=24), chat_template=TEMPLATE)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24,
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content == want.text
    lp = r.choices[0].logprobs.content
    assert len(lp) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in lp)
    assert all(t.logprob <= 0 and t.logprob >= t.top_logprobs[-1].logprob for t in lp)   # greedy: the top token

    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, max_tokens=16, n=3, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.message.content for c in r.choices}) > 1                       # seeds differ per choice
    again = client.chat.completions.create(model=MODEL, messages=messages, temperature=1.0, max_tokens=16, n=3, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    assert r.usage.prompt_tokens == len(want.prompt_token_ids)                   # counted once, not per choice
    assert r.usage.completion_tokens >= 3

    text = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=30).read().decode()
    assert 'baton_kv_blocks_free{pool="decode"' in text and 'pool="prefill"' not in text


def test_a_request_without_a_temperature_takes_the_generation_configs(client):
    """override_generation_config's temperature 0 is the default of a request that sets none (vLLM's
    generation-config defaults); a request's own temperature wins."""
    messages = [{"role": "user", "content": "Name a famous relay runner."}]
    offline = LLM(None, **ENGINE)
    greedy = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20), chat_template=TEMPLATE).text
    sampled = offline.chat(messages, SamplingParams(temperature=1.0, seed=5, max_tokens=20),
                           chat_template=TEMPLATE).text
    assert sampled != greedy
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20)
    assert r.choices[0].message.content == greedy
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=1.0, seed=5)
    assert r.choices[0].message.content == sampled


def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages_and_the_first_at_once(client):
    """decode.stream_interval_ms: the tokens made within an interval reach the client as one chunk (Ray Serve
    LLM's stream batching), the first token alone, and the text is the engine's."""
    prompt = "The baton passes from runner to runner"
    want = LLM(None, **ENGINE).generate([prompt], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))[0]
    chunks, arrived = [], []
    for c in client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=64, stream=True,
                                       logprobs=1, extra_body={"ignore_eos": True}):
        if c.choices and c.choices[0].text:
            chunks.append(c)
            arrived.append(time.monotonic())
    per_chunk = [len(c.choices[0].logprobs.tokens) for c in chunks]
    assert "".join(c.choices[0].text for c in chunks) == want.text and sum(per_chunk) == 64
    assert per_chunk[0] == 1                                   # the first token is not held back
    # at most one message per interval after the first (1.5x and 2 messages of slack for the client's reads):
    # where the tokens come faster than that (a normal day: 64 in about a second), they share messages; a
    # machine slow enough to make each token in more than an interval sends them one by one, as it should
    span_s = arrived[-1] - arrived[0]
    assert len(chunks) <= 2 + 1.5 * span_s * 1000 / STREAM_INTERVAL_MS, (len(chunks), span_s)
    if span_s * 1000 / STREAM_INTERVAL_MS < 40:
        assert len(chunks) < 64 and max(per_chunk) > 1         # later ones share messages


def test_colocated_structured_outputs_and_tool_calls_validate_and_bad_specs_get_400(client):
    from tests.structured_checks import check_bad_specs_get_400, check_structured_outputs, check_tool_calls
    check_structured_outputs(client, MODEL, quick=True)      # the whole set runs disaggregated (test_cluster_e2e)
    check_bad_specs_get_400(client, MODEL)
    check_tool_calls(client, MODEL, quick=True)


def _tokenize(body: dict) -> list[int]:
    req = urllib.request.Request(f"http://127.0.0.1:{PORT}/tokenize", json.dumps({"model": MODEL, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def test_the_servers_chat_template_and_a_trusted_requests_own(client, smol_path):
    """chat.template renders every chat in place of the model's (here: its default system line), and a request's
    own chat_template renders its prompt where chat.trust_request_template allows it; the answer is the offline
    engine's on those prompt tokens."""
    from engine.llm import chat_token_ids
    from engine.loader import load_tokenizer
    tok = load_tokenizer(smol_path)
    messages = [{"role": "user", "content": "Who runs the last leg?"}]
    ids = _tokenize({"messages": messages})
    assert ids == chat_token_ids(tok, messages, chat_template=TEMPLATE) != chat_token_ids(tok, messages)
    assert "You are Baton, a relay coach" in tok.decode(ids)
    own = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}coach:"
    ids = _tokenize({"messages": messages, "chat_template": own})
    assert ids == tok.encode("user: Who runs the last leg?\ncoach:", add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=12,
                                       extra_body={"chat_template": own})
    want = LLM(None, **ENGINE).generate([ids], SamplingParams(temperature=0, max_tokens=12))[0]
    assert r.choices[0].message.content == want.text and r.usage.prompt_tokens == len(ids)
    with pytest.raises(openai.BadRequestError) as e:                 # the template's own error: a 400 naming it
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                       extra_body={"chat_template": "{{ raise_exception('no users here') }}"})
    assert e.value.body["param"] == "chat_template" and "no users here" in e.value.body["message"]


def test_use_beam_search_gives_the_offline_engines_beams(client):
    """vLLM's use_beam_search over HTTP: its rounds run through the pool one token a beam, and the n choices are
    the offline LLM.beam_search's beams, best first, streamed or not; a field it would drop is a 400."""
    from engine import BeamSearchParams
    prompt = "The baton exchange in a relay race"
    offline = LLM(None, **ENGINE)
    ids = offline.engine.tokenize(prompt)
    beams = offline.beam_search(ids, BeamSearchParams(beam_width=3, max_tokens=12))[0].sequences
    want = [b.text for b in beams]
    kw = dict(model=MODEL, prompt=prompt, n=3, max_tokens=12, extra_body={"use_beam_search": True})
    r = client.completions.create(**kw)
    assert [c.text for c in r.choices] == want and len(set(want)) == 3
    assert r.usage.completion_tokens == sum(len(b.tokens) - len(ids) for b in beams)
    texts = {}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert [texts[i] for i in range(3)] == want
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**{**kw, "extra_body": {"use_beam_search": True, "min_tokens": 2}})
    assert e.value.body["param"] == "min_tokens"


def test_the_responses_api_serves_the_chat_answer_streamed_with_tools_and_schemas(client):
    """client.responses, as a user of OpenAI's newer API calls it: the output text is the offline engine's chat answer
    (instructions as the system message) and usage counts it; the streamed events add up to it and end with the
    whole response; a forced function call goes round (its output items and the result back in as input) to the
    answer chat completions give for the same conversation; text.format's schema shapes the output; what needs stored
    state is a 400 naming the field, and retrieving, deleting or cancelling a response a 404 saying none is stored."""
    coach, ask = "You coach a relay team in one sentence.", "Why practise the baton exchange?"
    want = LLM(None, **ENGINE).chat([{"role": "system", "content": coach}, {"role": "user", "content": ask}],
                                    SamplingParams(temperature=0, max_tokens=24), chat_template=TEMPLATE)
    r = client.responses.create(model=MODEL, instructions=coach, input=ask, max_output_tokens=24, temperature=0)
    assert r.output_text == want.text and r.id.startswith("resp_") and r.store is False
    assert (r.usage.input_tokens, r.usage.output_tokens) == (len(want.prompt_token_ids), len(want.token_ids))
    assert r.status == ("incomplete" if want.finish_reason == "length" else "completed")
    events = list(client.responses.create(model=MODEL, instructions=coach, input=ask, max_output_tokens=24,
                                          temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want.text
    assert events[0].type == "response.created" and events[-1].response.output_text == want.text

    split = {"type": "object", "properties": {"runner": {"type": "string", "maxLength": 12},
                                              "leg": {"type": "integer", "minimum": 1, "maximum": 4}},
             "required": ["runner", "leg"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_split", "description": "A runner's split time on a leg",
              "parameters": split}]
    question = [{"role": "user", "content": "What was Ana's split on the anchor leg?"}]
    r = client.responses.create(model=MODEL, input=question, tools=tools, max_output_tokens=40,
                                tool_choice={"type": "function", "name": "get_split"})
    [call] = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), split)
    history = question + [o.model_dump(exclude_none=True) for o in r.output] + [
        {"type": "function_call_output", "call_id": call.call_id, "output": "11.2 seconds"}]
    answer = client.responses.create(model=MODEL, input=history, tools=tools, max_output_tokens=24)
    chat = client.chat.completions.create(model=MODEL, max_tokens=24, tools=[
        {"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}], messages=question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_split", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "11.2 seconds"}])
    assert answer.output_text and answer.output_text == chat.choices[0].message.content

    shaped = client.responses.create(model=MODEL, input="Record Ana's anchor leg.", max_output_tokens=40,
                                     text={"format": {"type": "json_schema", "name": "split", "schema": split}})
    jsonschema.validate(json.loads(shaped.output_text), split)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="And then?", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    for stored in (client.responses.retrieve, client.responses.delete, client.responses.cancel):
        with pytest.raises(openai.NotFoundError, match="stores no responses"):
            stored(r.id)


def test_a_prompt_evicted_to_the_host_tier_is_copied_back_with_the_same_text(client):
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(400)]          # 24 blocks before its last token's
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    for _ in range(6):                                                # 2700 other tokens: past the device cache
        client.completions.create(model=MODEL, prompt=[rng.randrange(100, 40000) for _ in range(450)], max_tokens=1)
    base = f"http://127.0.0.1:{PORT}"
    before = scrape(base)
    hashes = block_hashes(prompt, 16, served_model_key())
    assert any(m and max(m.values()) >= 24 for m in ingress_index_matches("decode", hashes).values()), \
        "the index still counts the prompt as cached (in the host tier)"
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)

    def total(m, metric: str, label: str) -> float:
        return sum(v for k, v in m.items() if k.startswith(metric + "{") and label in k)
    # the replica reports its metrics every half second: wait for the report that counts this request
    after = wait_for(lambda: (lambda m: m if total(m, "baton_kv_tier_moves_blocks_total", 'direction="onload"') >
                              total(before, "baton_kv_tier_moves_blocks_total", 'direction="onload"') else None)(
                                  scrape(base)), 10, "the replica's report of the copy back")

    def delta(metric: str, label: str) -> float:
        return total(after, metric, label) - total(before, metric, label)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 384
    assert delta("baton_prefix_cache_hits_by_tier_tokens_total", 'tier="host"') == 384, \
        "every cached block of the prompt came back from host memory"
    assert delta("baton_kv_tier_moves_blocks_total", 'direction="onload"') == 24
    assert delta("baton_kv_tier_moves_bytes_total", 'direction="onload"') == 24 * (30 * 3 * 2 * 16 * 64 * 4)
    assert pool_total(after, "baton_kv_host_blocks_used", "decode") > 24
