"""The OpenAI wire format without a server: checks give OpenAI's status/param, and the bodies and chunks
we build parse as the official client's types."""
from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from replica.messages import TokenDelta
from router import openai_protocol as oa


class Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.fixture(scope="module")
def smol_tokenizer(smol_path):
    from engine.loader import load_tokenizer
    return load_tokenizer(smol_path)


def _chat(**kw):
    return oa.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}, chat=True)


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": list("abcde")}, "stop"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 2.5}, "presence_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "frequency_penalty": -3}, "frequency_penalty"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "repetition_penalty": 0}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
])
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(oa.OpenAIError) as e:
        oa.parse_request(body, chat=True)
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_context_length_and_sampling_mapping():
    with pytest.raises(oa.OpenAIError, match="maximum context length is 100 tokens.*90 in the prompt, 20 in"):
        oa.to_sampling_params(_chat(max_tokens=20), 100, 90)
    with pytest.raises(oa.OpenAIError) as e:
        oa.to_sampling_params(_chat(temperature=-1), 100, 10)
    assert e.value.param == "temperature"
    p = oa.to_sampling_params(_chat(seed=5, n=2, stop="x", top_p=0.5), 100, 10, index=1)
    assert (p.seed, p.max_tokens, p.stop, p.top_p) == (6, 90, ["x"], 0.5)
    p = oa.to_sampling_params(_chat(presence_penalty=-2, frequency_penalty=1.5, repetition_penalty=1.2), 100, 10)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (-2.0, 1.5, 1.2)
    assert oa.to_sampling_params(oa.parse_request({"model": "m", "prompt": "x", "frequency_penalty": 2}, chat=False),
                                 100, 10).frequency_penalty == 2.0
    with pytest.raises(oa.OpenAIError) as e:
        oa.check_model("other", ["m"])
    assert e.value.status == 404 and e.value.body()["error"]["code"] == "model_not_found"


def test_logit_bias_and_min_tokens_reach_the_engine_checked():
    p = oa.to_sampling_params(_chat(logit_bias={"5": 10, "299": -100}, min_tokens=4), 100, 10, vocab_size=300)
    assert (p.logit_bias, p.min_tokens) == ({5: 10.0, 299: -100.0}, 4)
    assert oa.to_sampling_params(_chat(), 100, 10, vocab_size=300).logit_bias is None
    for bias, words in (({"300": 1}, "not a token id of this model"), ({"x": 1}, "not a token id"),
                        ({"-1": 1}, "not a token id"), ({"9" * 5000: 1}, "not a token id"),
                        ({"5": 100.5}, r"\[-100, 100\]")):
        with pytest.raises(oa.OpenAIError, match=words) as e:
            oa.to_sampling_params(_chat(logit_bias=bias), 100, 10, vocab_size=300)
        assert e.value.status == 400 and e.value.param == "logit_bias"
    with pytest.raises(oa.OpenAIError, match="min_tokens must be at most max_tokens") as e:
        oa.to_sampling_params(_chat(min_tokens=9, max_tokens=8), 100, 10)
    assert e.value.param == "min_tokens"


@pytest.mark.parametrize("chat, extra, param", [
    (False, {"best_of": 3}, "best_of"), (False, {"suffix": "}"}, "suffix"),
    (True, {"functions": [{"name": "f", "parameters": {}}]}, "functions"), (True, {"function_call": "auto"}, "function_call"),
])
def test_openai_fields_that_would_change_the_answer_are_refused_not_ignored(chat, extra, param):
    base = {"model": "m", **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    with pytest.raises(oa.OpenAIError) as e:
        oa.parse_request({**base, **extra}, chat=chat)
    assert e.value.status == 400 and e.value.param == param and "not supported" in e.value.message
    if not chat:                                          # what equals the default is served
        oa.parse_request({**base, "n": 2, "best_of": 2, "suffix": ""}, chat=False)


@pytest.mark.parametrize("chat, extra, param", [
    (True, {"modalities": ["text", "audio"]}, "modalities"), (True, {"audio": {"voice": "alloy"}}, "audio"),
    (True, {"web_search_options": {}}, "web_search_options"),
    (False, {"logits_processors": ["my.Processor"]}, "logits_processors"), (True, {"vllm_xargs": {"a": 1}}, "vllm_xargs"),
    (False, {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    (True, {"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    (True, {"mm_processor_kwargs": {}}, "mm_processor_kwargs"),
    (False, {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
])
def test_vllm_and_openai_fields_baton_does_not_serve_are_refused_by_name(chat, extra, param):
    base = {"model": "m", **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    with pytest.raises(oa.OpenAIError) as e:
        oa.parse_request({**base, **extra}, chat=chat)
    assert e.value.status == 400 and e.value.param == param and "not supported" in e.value.message
    defaults = {"modalities": ["text"], "add_generation_prompt": True, "echo": False,
                "continue_final_message": False, "chat_template_kwargs": {}, "use_beam_search": False,
                "length_penalty": 1.0, "logits_processors": [], "vllm_xargs": {}, "guided_decoding_backend": "xgrammar",
                "spaces_between_special_tokens": True, "include_reasoning": True, "parallel_tool_calls": False}
    oa.parse_request({**base, **{k: v for k, v in defaults.items() if chat or k not in (
        "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "parallel_tool_calls")}}, chat=chat)


def test_vllms_stop_special_token_and_token_rule_extras_reach_the_engine():
    p = oa.to_sampling_params(_chat(include_stop_str_in_output=True, skip_special_tokens=False,
                                    allowed_token_ids=[3, 9], bad_words=["x y"]), 100, 10, vocab_size=300)
    assert p.include_stop_str_in_output and not p.skip_special_tokens
    assert (p.allowed_token_ids, p.bad_words) == ([3, 9], ["x y"])
    p = oa.to_sampling_params(_chat(), 100, 10)
    assert not p.include_stop_str_in_output and p.skip_special_tokens and p.allowed_token_ids is p.bad_words is None
    for extra, param in (({"allowed_token_ids": [3, 300]}, "allowed_token_ids"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"bad_words": [" "]}, "bad_words"),
                         ({"bad_words": ["x"], "response_format": {"type": "json_object"}}, "bad_words")):
        with pytest.raises(oa.OpenAIError) as e:
            req = _chat(**extra)
            oa.to_sampling_params(req, 100, 10, structured=oa.structured_spec(req)[0], vocab_size=300)
        assert e.value.status == 400 and e.value.param == param, (extra, e.value.message)


def test_echo_scores_a_prompt_with_its_logprobs_and_max_tokens_0_leaves_the_completion_out():
    """OpenAI's legacy completions: echo puts the prompt first, its tokens in the logprobs with theirs (the
    first with none); with max_tokens 0 the one token the engine samples is left out."""
    for max_tokens, want_text in ((1, "<5><6><7>"), (0, "<5><6>")):
        req = oa.parse_request({"model": "m", "prompt": [5, 6], "echo": True, "logprobs": 1,
                                "max_tokens": max_tokens}, chat=False)
        p = oa.to_sampling_params(req, 100, 2)
        assert (p.max_tokens, p.prompt_logprobs, p.logprobs) == (1, 1, 1)
        b = oa.ResponseBuilder("cmpl-1", 1, "m", False, req, Tok(), prompts=[[5, 6]])
        b.add(0, TokenDelta([7], "<7>", True, [{7: -0.5}], replica="d0", finish_reason="length", prompt_tokens=2,
                            completion_tokens=1, prompt_logprobs=[None, {6: -1.25, 9: -0.5}]))
        body = b.final()
        c = body["choices"][0]
        assert c["text"] == want_text
        # null for the first prompt token, as OpenAI's API and vLLM send (the SDK's type says float; its client
        # builds the response without validating, so users read None there: tests/test_cluster_e2e.py)
        assert c["logprobs"]["token_logprobs"] == [None, -1.25, -0.5][:2 + max_tokens]
        assert c["logprobs"]["top_logprobs"][:2] == [None, {"<9>": -0.5}]
        assert c["logprobs"]["text_offset"] == [0, 3, 6][:2 + max_tokens]
        assert body["usage"]["completion_tokens"] == max_tokens and c["finish_reason"] == "length"
    for max_tokens, want_text in ((1, "<5><6><7>"), (0, "<5><6>")):          # streamed: one chunk carries it all
        req = oa.parse_request({"model": "m", "prompt": [5, 6], "echo": True, "max_tokens": max_tokens,
                                "stream": True}, chat=False)
        b = oa.ResponseBuilder("cmpl-1", 1, "m", False, req, Tok(), prompts=[[5, 6]])
        chunks = b.chunks(0, TokenDelta([7], "<7>", True, None, replica="d0", finish_reason="length",
                                        prompt_tokens=2, completion_tokens=1))
        assert [c["choices"][0]["text"] for c in chunks] == [want_text]
    req = oa.parse_request({"model": "m", "prompt": "five six", "echo": True, "truncate_prompt_tokens": 1},
                           chat=False)                   # echo shows what was run: the kept tokens, decoded
    b = oa.ResponseBuilder("cmpl-1", 1, "m", False, req, Tok(), prompts=[[6]])
    b.add(0, TokenDelta([7], "<7>", True, None, replica="d0", finish_reason="length", completion_tokens=1))
    assert b.final()["choices"][0]["text"] == "<6><7>"
    with pytest.raises(oa.OpenAIError, match="0 only with echo"):
        oa.to_sampling_params(oa.parse_request({"model": "m", "prompt": "x", "max_tokens": 0}, chat=False), 100, 2)


def _deltas():
    return [TokenDelta([5], "Hel", False, [{5: -0.1, 6: -2.0}], replica="d0"),
            TokenDelta([6], "lo", True, [{6: -0.3, 5: -1.5}], finish_reason="length", prompt_tokens=7,
                       completion_tokens=2, cached_tokens=3)]


def test_bodies_and_chunks_parse_as_the_official_types():
    req = _chat(logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True})
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok())
    chunks = b.first_chunks() + [c for d in _deltas() for c in b.chunks(0, d)] + [b.usage_chunk()]
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "Hello"
    assert parsed[-1].usage.total_tokens == 9 and parsed[-2].choices[0].finish_reason == "length"
    assert parsed[-1].usage.prompt_tokens_details.cached_tokens == 3
    assert oa.sse(chunks[0]).startswith(b"data: {") and oa.sse(chunks[0]).endswith(b"\n\n")
    assert json.loads(oa.sse(chunks[0])[6:]) == chunks[0]
    full = ChatCompletion.model_validate(b.final())
    assert full.choices[0].message.content == "Hello"
    assert [t.token for t in full.choices[0].logprobs.content] == ["<5>", "<6>"]

    creq = oa.parse_request({"model": "m", "prompt": "x", "logprobs": 1}, chat=False)
    cb = oa.ResponseBuilder("cmpl-1", 1, "m", False, creq, Tok())
    for d in _deltas():
        cb.add(0, d)
    comp = Completion.model_validate(cb.final())
    assert comp.choices[0].text == "Hello" and comp.choices[0].logprobs.token_logprobs == [-0.1, -0.3]
    assert comp.usage.completion_tokens == 2


def test_vllms_response_extras_token_ids_as_text_chat_echo_request_id_and_continuous_usage():
    """return_tokens_as_token_ids writes each logprob token (and each top one) as "token_id:{id}"; chat echo puts
    the message the answer continues before it (the last message when it is the assistant's, or any last message
    with add_generation_prompt false, whose role the answer then takes, as vLLM names it), streamed as the first
    content; continuous_usage_stats puts the usage so far
    in every chunk."""
    req = _chat(logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok())
    for d in _deltas():
        b.add(0, d)
    lp = ChatCompletion.model_validate(b.final()).choices[0].logprobs.content
    assert [t.token for t in lp] == ["token_id:5", "token_id:6"]
    assert [t.token for t in lp[0].top_logprobs] == ["token_id:5", "token_id:6"]
    creq = oa.parse_request({"model": "m", "prompt": "x", "logprobs": 1, "return_tokens_as_token_ids": True}, chat=False)
    cb = oa.ResponseBuilder("cmpl-1", 1, "m", False, creq, Tok())
    for d in _deltas():
        cb.add(0, d)
    assert Completion.model_validate(cb.final()).choices[0].logprobs.tokens == ["token_id:5", "token_id:6"]

    said = [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "One, two,"}]
    for extra, echoed, role in [
            ({"continue_final_message": True, "add_generation_prompt": False}, "One, two,", "assistant"),
            ({}, "One, two,", "assistant"), ({"messages": said[:1], "add_generation_prompt": False}, "Count:", "user"),
            ({"messages": said[:1]}, "", "assistant"), ({"echo": False}, "", "assistant"),
            ({"messages": said[:1], "add_generation_prompt": False, "echo": False}, "", "user")]:
        body = {"model": "m", "messages": said, "echo": True, **extra}
        b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, oa.parse_request(body, chat=True), Tok())
        for d in _deltas():
            b.add(0, d)
        message = b.final()["choices"][0]["message"]
        assert (message["content"], message["role"]) == (echoed + "Hello", role), extra   # the role continued
        sb = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, oa.parse_request({**body, "stream": True}, chat=True), Tok())
        chunks = sb.first_chunks() + [c for d in _deltas() for c in sb.chunks(0, d)]
        streamed = [ChatCompletionChunk.model_validate(c).choices[0].delta.content or "" for c in chunks]
        assert "".join(streamed) == echoed + "Hello" and (not echoed or streamed[1] == echoed)
        assert chunks[0]["choices"][0]["delta"]["role"] == role

    req = _chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok(), prompts=[[1] * 7])
    chunks = [c for d in _deltas() for c in b.chunks(0, d)] + [b.usage_chunk()]
    usage = [ChatCompletionChunk.model_validate(c).usage for c in chunks]
    assert [(u.prompt_tokens, u.completion_tokens) for u in usage] == [(7, 1), (7, 2), (7, 2)]
    plain = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(stream=True, stream_options={"include_usage": True}),
                               Tok(), prompts=[[1] * 7])
    assert [c["usage"] for d in _deltas() for c in plain.chunks(0, d)] == [None, None]


def test_chat_templates_take_documents_reasoning_effort_and_the_tokenizers_special_tokens(smol_tokenizer):
    """vLLM's documents (for a RAG template), reasoning_effort (a template variable, as vLLM hands it), and
    add_special_tokens (chat: the tokenizer's BOS on top of the template; completions: false leaves it out)."""
    import copy
    from tokenizers.processors import TemplateProcessing
    from engine.llm import chat_token_ids
    tok = copy.deepcopy(smol_tokenizer)
    bos = tok.convert_tokens_to_ids("<|endoftext|>")
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<|endoftext|> $A",
                                                              special_tokens=[("<|endoftext|>", bos)])
    tok.chat_template = ("{% for d in documents or [] %}[{{ d.title }}]{% endfor %}{{ reasoning_effort or '-' }}"
                         "{% for m in messages %}{{ m.content }}{% endfor %}")
    msgs = [{"role": "user", "content": "hi"}]
    plain = chat_token_ids(tok, msgs, add_generation_prompt=False)
    assert tok.decode(plain) == "-hi" and plain[0] != bos
    assert chat_token_ids(tok, msgs, add_generation_prompt=False, add_special_tokens=True) == [bos] + plain
    docs = chat_token_ids(tok, msgs, add_generation_prompt=False, documents=[{"title": "Relay", "text": "..."}],
                          template_kwargs={"reasoning_effort": "low"})
    assert tok.decode(docs) == "[Relay]lowhi"
    assert tok.encode("hi")[0] == bos and tok.encode("hi", add_special_tokens=False)[0] != bos


def test_api_keys_from_the_environment(monkeypatch):
    from router.openai_protocol import ApiKeys, OpenAIError
    monkeypatch.delenv("BATON_T_KEYS", raising=False)
    assert not ApiKeys("BATON_T_KEYS").enabled
    ApiKeys("BATON_T_KEYS").check(None)                      # no keys configured: open
    monkeypatch.setenv("BATON_T_KEYS", " sk-a , sk-b ,")
    keys = ApiKeys("BATON_T_KEYS")
    assert keys.enabled
    keys.check("Bearer sk-a")
    keys.check("bearer sk-b")
    for bad in (None, "", "Bearer", "Bearer sk-c", "Basic sk-a", "sk-a", "Bearer sk-a sk-b"):
        with pytest.raises(OpenAIError) as e:
            keys.check(bad)
        assert e.value.status == 401 and e.value.body()["error"]["code"] == "invalid_api_key"
        assert "sk-a" not in e.value.message


def test_request_limits_are_configurable():
    from router.config import LimitsConfig
    from router.openai_protocol import OpenAIError, parse_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 6, "stop": ["a"] * 6}
    with pytest.raises(OpenAIError, match="n must be between 1 and 8|at most 4 stop"):
        parse_request(body, chat=True)
    req = parse_request(body, chat=True, limits=LimitsConfig(max_n=6, max_stop_sequences=6))
    assert req.n == 6
    with pytest.raises(OpenAIError, match="at most 3 characters"):
        parse_request({**body, "n": 1, "stop": ["abcd"]}, chat=True, limits=LimitsConfig(max_stop_chars=3))


def test_out_of_range_seeds_are_refused_before_they_reach_an_engine():
    from engine import SamplingParams
    from engine.errors import InvalidRequestError
    from router.openai_protocol import OpenAIError, parse_request
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    for seed in (2**80, -(2**64)):
        with pytest.raises(OpenAIError) as e:
            parse_request({**body, "seed": seed}, chat=True)
        assert e.value.status == 400 and e.value.param == "seed"
        with pytest.raises(InvalidRequestError, match="seed must be an integer in"):
            SamplingParams(seed=seed)
    assert parse_request({**body, "seed": 2**63 - 1}, chat=True).seed == 2**63 - 1
    SamplingParams(seed=2**63 + 7)            # seed + choice index stays inside torch's range


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TAG = {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>", "end": "</a>",
                                            "content": {"type": "json_schema", "json_schema": SCHEMA}}}
OLD_TAG = {"type": "structural_tag", "structures": [{"begin": "<a>", "schema": SCHEMA, "end": "</a>"}],
           "triggers": ["<a"]}


@pytest.mark.parametrize("extra, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, ("json_object", True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
     ("json", SCHEMA)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, ("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["a", "b"]}}, ("choice", ["a", "b"])),
    ({"structured_outputs": {"grammar": 'root ::= "x"'}}, ("grammar", 'root ::= "x"')),
    ({"guided_json": SCHEMA}, ("json", SCHEMA)),
    ({"guided_choice": ["y", "n"]}, ("choice", ["y", "n"])),
    ({"response_format": TAG}, ("structural_tag", TAG)),
    ({"response_format": OLD_TAG}, ("structural_tag", OLD_TAG)),
    ({"structured_outputs": {"structural_tag": json.dumps(TAG)}}, ("structural_tag", json.dumps(TAG))),
    ({"structural_tag": json.dumps(OLD_TAG)}, ("structural_tag", json.dumps(OLD_TAG))),
])
def test_response_format_and_vllms_structured_outputs_become_one_spec(extra, want):
    spec, _ = oa.structured_spec(_chat(**extra))
    if want is None:
        assert spec is None
    else:
        assert spec.kind == want[0] and getattr(spec, want[0]) == want[1]
        params = oa.to_sampling_params(_chat(**extra), 100, 10, structured=spec)
        assert params.structured is spec


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {**OLD_TAG, "triggers": []}}, "response_format"),
    ({"structured_outputs": {"structural_tag": "{nope"}}, "structured_outputs"),
    ({"structural_tag": json.dumps(OLD_TAG), "guided_json": SCHEMA}, "guided_json"),
])
def test_bad_structured_output_requests_get_400_naming_the_field(extra, param):
    with pytest.raises(oa.OpenAIError) as e:
        oa.structured_spec(_chat(**extra))
    assert e.value.status == 400 and e.value.param == param


def test_use_beam_search_becomes_n_beams_and_refuses_what_it_would_drop():
    chat = lambda **kw: oa.parse_request({"model": "m", "messages": [{"role": "user", "content": "x"}], **kw},  # noqa
                                         chat=True)
    assert oa.beam_search_params(chat(), 16) is None
    params = oa.beam_search_params(chat(use_beam_search=True, n=3, length_penalty=0.5, ignore_eos=True), 16)
    assert (params.beam_width, params.max_tokens, params.length_penalty, params.ignore_eos) == (3, 16, 0.5, True)
    for kw, param in [({"stop": ["x"]}, "stop"), ({"logprobs": True}, "logprobs"), ({"min_tokens": 2}, "min_tokens"),
                      ({"response_format": {"type": "json_object"}}, "response_format"),
                      ({"presence_penalty": 0.5}, "presence_penalty")]:
        with pytest.raises(oa.OpenAIError) as e:
            oa.beam_search_params(chat(use_beam_search=True, **kw), 16)
        assert e.value.status == 400 and e.value.param == param
    oa.beam_search_params(chat(use_beam_search=True, response_format={"type": "text"}), 16)
    with pytest.raises(oa.OpenAIError) as e:
        oa.beam_search_params(chat(length_penalty=0.8), 16)
    assert e.value.param == "length_penalty"


# -- the published OpenAPI document agrees with the checks ------------------------------------------------
# What a body valid under /openapi.json may still be refused for: what only the limits, the served model or a
# combination of fields decide (the document cannot say it, or says it only loosely).
DOCUMENTED_ONLY_AT_RUNTIME = ("n must be between", "stop sequence", "not among the tools", "tool_choice needs tools",
                              "defined twice", "give one of", "not both", "exactly one of", "prompt token ids",
                              "at most", "may only equal n", "are not streamed", "no message to answer",
                              "structural tag")     # a structural tag as text: JSON of xgrammar's form


def _document() -> dict:
    from router.ingress import _openapi
    return _openapi()


def _validator(doc: dict, name: str):
    import jsonschema
    schema = {**doc["components"]["schemas"][name], "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema)


def _refusal(body: dict, chat: bool | str) -> str | None:
    """Why the ingress's checks refuse a body (None: they pass it); chat "responses": a /v1/responses body."""
    try:
        if chat == "responses":
            from router import responses as rs
            body, chat = rs.to_chat(rs.parse(body)), True
        req = oa.parse_request(body, chat=chat)
        for p in [] if chat else oa.completion_prompts(req):
            if isinstance(p, list):
                oa.check_token_ids(p, 49152)
        if chat:
            oa.tool_plan(req)
        oa.structured_spec(req)
    except oa.OpenAIError as e:
        return e.message
    return None


@pytest.mark.parametrize("chat, body", [
    (True, {"model": "m", "messages": []}),
    (True, {"model": "m", "messages": [{"role": "user"}]}),
    (True, {"model": "m", "messages": [{"role": "tool", "content": "22C"}]}),
    (True, {"model": "m", "messages": [{"role": "assistant"}]}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}]}),
    (True, {"model": "m", "messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "bad name!"}}]}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "sometimes"}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "structured_outputs": {"yaml": "a"}}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}],
            "structured_outputs": {"regex": "a", "choice": ["a"]}}),
    (False, {"model": "m", "prompt": ""}), (False, {"model": "m", "prompt": []}),
    (False, {"model": "m", "prompt": [-1]}),
    (False, {"model": "m", "prompt": "x", "suffix": "y"}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "function_call": "auto"}),
    (True, {"model": "m", "messages": [{"role": "user", "content": "x"}], "min_tokens": -1}),
])
def test_what_the_checks_refuse_the_openapi_document_calls_invalid(chat, body):
    assert _refusal(body, chat) is not None
    assert not _validator(_document(), "ChatCompletionRequest" if chat else "CompletionRequest").is_valid(body)


@pytest.mark.parametrize("body", [
    {"model": "m", "input": ""}, {"model": "m", "input": []}, {"model": "m"},
    {"model": "m", "input": [{"role": "wizard", "content": "x"}]},
    {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]},
    {"model": "m", "input": [{"type": "item_reference", "id": "msg_1"}]},
    {"model": "m", "input": "x", "previous_response_id": "resp_1"},
    {"model": "m", "input": "x", "background": True},
    {"model": "m", "input": "x", "truncation": "auto"},
    {"model": "m", "input": "x", "tools": [{"type": "web_search"}]},
    {"model": "m", "input": "x", "tools": [{"type": "function", "name": "bad name!"}]},
    {"model": "m", "input": "x", "tool_choice": "sometimes"},
    {"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}},
    {"model": "m", "input": "x", "include": ["file_search_call.results"]},
    {"model": "m", "input": "x", "max_output_tokens": 0},
    {"model": "m", "input": "x", "min_tokens": -1},
])
def test_what_the_responses_checks_refuse_the_openapi_document_calls_invalid(body):
    assert _refusal(body, "responses") is not None
    assert not _validator(_document(), "ResponsesRequest").is_valid(body)


def test_bodies_valid_under_the_openapi_document_pass_the_checks():
    """What a client generates from /openapi.json (schemathesis, as the fuzz suite does) is served, save what
    only the limits, the model or a combination of fields decide."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_dict(_document())
    refused: dict[str, int] = {}
    total = 0
    for path, chat in (("/v1/chat/completions", True), ("/v1/completions", False), ("/v1/responses", "responses")):
        @settings(max_examples=45, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(schema[path]["POST"].as_strategy(generation_mode=GenerationMode.POSITIVE))
        def run(case):
            nonlocal total
            total += 1
            why = _refusal(case.body, chat)
            if why is not None and not any(s in why for s in DOCUMENTED_ONLY_AT_RUNTIME):
                refused[why[:150]] = refused.get(why[:150], 0) + 1
        run()
    assert total >= 120 and not refused, "\n".join(f"{n} x {why}" for why, n in refused.items())


def test_embedding_bodies_carry_floats_or_openais_base64():
    """OpenAI's base64 is the float32 values' little-endian bytes (the openai client decodes it so); inputs come
    as a text, texts, token ids or lists of them (or vLLM's messages: a body with neither is the route's 400,
    tests/test_cluster_e2e.py)."""
    import base64

    import numpy as np
    v = [np.array([0.5, -1.25, 3e-8], dtype=np.float32), np.array([1.0, 0.0, -0.0], dtype=np.float32)]
    floats = oa.embedding_body("embd-1", 7, "m", v, "float", 9)
    assert floats["data"][1] == {"object": "embedding", "index": 1, "embedding": [1.0, 0.0, -0.0]}
    assert floats["usage"] == {"prompt_tokens": 9, "total_tokens": 9} and floats["object"] == "list"
    b64 = oa.embedding_body("embd-1", 7, "m", v, "base64", 9)
    for d, want in zip(b64["data"], v):
        assert np.array_equal(np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4"), want)
    for given, prompts in (("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]])):
        req = oa.parse_body({"model": "m", "input": given}, oa.EmbeddingRequest)
        assert oa.completion_prompts(req) == prompts
    for bad in ({"model": "m", "input": "x", "encoding_format": "int8"},
                {"model": "m", "input": "x", "dimensions": 0}, {"model": "m", "input": [1, "a"]}):
        with pytest.raises(oa.OpenAIError) as e:
            oa.parse_body(bad, oa.EmbeddingRequest)
        assert e.value.status == 400


def test_score_pairs_and_rerank_bodies():
    """vLLM's pairing of text_1 with text_2 (one against many, or item by item), and the rerank order with top_n."""
    def pairs(t1, t2):
        return oa.score_pairs(oa.parse_body({"model": "m", "text_1": t1, "text_2": t2}, oa.ScoreRequest))
    assert pairs("q", ["a", "b"]) == [("q", "a"), ("q", "b")]
    assert pairs(["x", "y"], ["a", "b"]) == [("x", "a"), ("y", "b")]
    assert pairs("q", "a") == [("q", "a")]
    with pytest.raises(oa.OpenAIError, match="text_1 has 2"):
        pairs(["x", "y"], ["a", "b", "c"])
    req = oa.parse_body({"model": "m", "query": "q", "documents": ["a", "b", "c"], "top_n": 2}, oa.RerankRequest)
    body = oa.rerank_body("rerank-1", "m", req, [0.1, 0.9, 0.5], 7)
    assert [(r["index"], r["document"]["text"], r["relevance_score"]) for r in body["results"]] == \
        [(1, "b", 0.9), (2, "c", 0.5)]
    assert body["usage"] == {"total_tokens": 7}
    bare = oa.parse_body({"model": "m", "query": "q", "documents": ["a"], "return_documents": False}, oa.RerankRequest)
    assert oa.rerank_body("r", "m", bare, [0.3], 2)["results"] == [{"index": 0, "relevance_score": 0.3}]
