"""A reasoning parser on a live cluster (`reasoning.parser: deepseek_r1`), through the `openai` client: SmolLM2 never
closes a </think>, so under DeepSeek-R1's rule its whole chat answer is thinking: `reasoning_content` holds the
offline engine's text and `content` is null, streamed or not; `include_reasoning: false` leaves it out; structured
output is refused by name (its grammar would constrain the thinking); completions are untouched."""
from __future__ import annotations

import openai
import pytest

from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8743
MODEL = "SmolLM2-135M-Instruct"
REASONING = {"mode": "colocated", "port": PORT, "ingress": {"num_cpus": 0},
             "decode": {"num_cpus": 0, "engine": CLUSTER_ENGINE}, "reasoning": {"parser": "deepseek_r1"}}
MESSAGES = [{"role": "user", "content": "Why is the last leg of a relay the anchor leg?"}]


@pytest.fixture(scope="module")
def client(shared_cluster):
    shared_cluster.up(REASONING)
    return openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)


def test_an_answer_without_a_closing_tag_is_all_thinking_whole_or_streamed(client):
    offline = LLM(None, **CLUSTER_ENGINE)
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


def test_structured_output_under_a_reasoning_parser_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError, match="reasoning parser") as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                       response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
