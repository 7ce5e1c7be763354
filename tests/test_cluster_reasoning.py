"""A reasoning parser on a live cluster (`reasoning.parser: deepseek_r1`), through the `openai` client. The model is
SmolLM2 with a reasoning tokenizer (tests/conftest.py's thinking_model: <think> and </think> are tokens of it).
SmolLM2 never closes a </think> by itself, so under DeepSeek-R1's rule its whole chat answer is thinking:
`reasoning_content` holds the offline engine's text and `content` is null, streamed or not; `include_reasoning: false`
leaves it out; completions are untouched. With a logit_bias that makes it close its thinking, structured output and a
forced tool call shape the answer after </think> and leave the thinking free, as vLLM does."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from engine import LLM, SamplingParams
from engine.structured import StructuredOutput
from tests.conftest import (CLUSTER_ENGINE, GRAMMAR_COMPILE_TIMEOUT_S, THINK_ASK as ASK, THINK_CLOSE_BIAS, THINK_END,
                            THINK_SCHEMA as SCHEMA)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8743
MODEL = "SmolLM2-135M-Instruct"
MESSAGES = [{"role": "user", "content": "Why is the last leg of a relay the anchor leg?"}]
CLOSE = {str(THINK_END): THINK_CLOSE_BIAS}        # the logit_bias that makes SmolLM2 close its thinking


@pytest.fixture(scope="module")
def model(thinking_model_dir):
    return thinking_model_dir


@pytest.fixture(scope="module")
def offline(model):
    return LLM(model, **CLUSTER_ENGINE, grammar_compile_timeout_s=GRAMMAR_COMPILE_TIMEOUT_S)


@pytest.fixture(scope="module")
def client(shared_cluster, model):
    shared_cluster.up({"model": model, "served_model_name": MODEL, "mode": "colocated", "port": PORT,
                       "ingress": {"num_cpus": 0}, "decode": {"num_cpus": 0, "engine": CLUSTER_ENGINE},
                       "reasoning": {"parser": "deepseek_r1"},
                       "limits": {"grammar_compile_timeout_s": GRAMMAR_COMPILE_TIMEOUT_S}})
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)


def test_an_answer_without_a_closing_tag_is_all_thinking_whole_or_streamed(client, offline):
    want = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=20)).text
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    msg = r.choices[0].message
    assert msg.content is None and msg.model_extra["reasoning_content"] == want

    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == want
    assert not any(d.content for d in deltas)

    hidden = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                            extra_body={"include_reasoning": False}).choices[0].message
    assert hidden.content is None and "reasoning_content" not in (hidden.model_extra or {})
    text = client.completions.create(model=MODEL, prompt="The anchor leg", temperature=0, max_tokens=8)
    assert text.choices[0].text == offline.generate(["The anchor leg"], SamplingParams(temperature=0,
                                                                                      max_tokens=8))[0].text


def test_structured_output_shapes_the_answer_after_the_thinking_whole_or_streamed(client, offline):
    """response_format's schema constrains what follows </think>: the thinking is the offline engine's free text (the
    same request without a grammar), the content parses and validates, streamed or not."""
    bias = {THINK_END: THINK_CLOSE_BIAS}
    gated = offline.chat(ASK, SamplingParams(temperature=0, max_tokens=60, logit_bias=bias,
                                             structured=StructuredOutput(json=SCHEMA, after_thinking=True)))
    free = offline.chat(ASK, SamplingParams(temperature=0, max_tokens=60, logit_bias=bias))
    thought = free.text[:free.text.index("</think>")]
    assert thought and gated.text.startswith(thought + "</think>")
    fmt = {"type": "json_schema", "json_schema": {"name": "leg", "schema": SCHEMA}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, response_format=fmt,
                                       logit_bias=CLOSE)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == thought
    assert msg.content == gated.text.partition("</think>")[2]
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                                 response_format=fmt, logit_bias=CLOSE, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == thought
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_a_forced_tool_call_follows_the_thinking(client):
    """A named tool_choice's arguments are the answer after </think>, the thinking apart, whole or streamed."""
    tools = [{"type": "function", "function": {"name": "record_leg", "parameters": SCHEMA}}]
    choice = {"type": "function", "function": {"name": "record_leg"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60, tools=tools,
                                       tool_choice=choice, logit_bias=CLOSE)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] and "</think>" not in msg.model_extra["reasoning_content"]
    [call] = msg.tool_calls
    assert call.function.name == "record_leg"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=60,
                                                 tools=tools, tool_choice=choice, logit_bias=CLOSE, stream=True))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert "".join(t.function.arguments or "" for t in calls) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
