"""Reasoning parsers (router/reasoning.py), as vLLM's: a chat answer's thinking comes out as `reasoning_content`,
the rest as `content`, whole or streamed (a tag split across deltas is held back, never sent as text), with tool
calls read from the answer alone, and `include_reasoning: false` leaving the thinking out."""
from __future__ import annotations

import random

import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from replica.messages import TokenDelta
from router import openai_protocol as oa
from router.reasoning import Stream, split
from router.tools import ToolFormat


class Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("parser, text, want", [
    ("deepseek_r1", "<think>Plan it.</think>The answer.", ("Plan it.", "The answer.")),
    ("deepseek_r1", "Plan it.</think>The answer.", ("Plan it.", "The answer.")),      # <think> was in the prompt
    ("deepseek_r1", "Still thinking", ("Still thinking", None)),                       # no </think>: all thinking
    ("deepseek_r1", "Done.</think>", ("Done.", None)),
    ("qwen3", "<think>\nPlan it.\n</think>\n\nThe answer.", ("\nPlan it.\n", "\n\nThe answer.")),
    ("qwen3", "The answer, no thinking.", (None, "The answer, no thinking.")),        # thinking off
    ("qwen3", "<think>cut short", (None, "<think>cut short")),                         # no </think>: content
    ("none", "<think>a</think>b", (None, "<think>a</think>b")),
    # gpt-oss's harmony messages: the analysis channel is the reasoning, the final channel the content
    ("gpt_oss", "<|channel|>analysis<|message|>Plan it.<|end|><|start|>assistant<|channel|>final<|message|>"
                "The answer.<|return|>", ("Plan it.", "The answer.")),
    ("gpt_oss", "<|channel|>analysis<|message|>Cut short", ("Cut short", None)),
    ("gpt_oss", "<|channel|>final<|message|>Straight to it.<|return|>", (None, "Straight to it.")),
    # a call to a function stays in the content, in one form (the recipient in the role's header or the channel's)
    ("gpt_oss", "<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant to=functions.get_weather"
                "<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>",
     ("Look it up.", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Oslo"}<|call|>')),
    ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>",
     (None, "<|channel|>commentary to=functions.f<|message|>{}<|call|>")),
    ("gpt_oss", "<|channel|>anal", (None, None)),                                      # a header, no message yet
])
def test_a_whole_answer_splits_as_vllms_parsers_split_it(parser, text, want):
    assert split(parser, text) == want


@pytest.mark.parametrize("parser, text", [
    ("deepseek_r1", "<think>Plan: add 2 and 2.</think>The answer is 4."),
    ("deepseek_r1", "Plan: add 2 and 2.</think>The answer is 4."),
    ("deepseek_r1", "Thinking < and > and </thought> but never closing"),
    ("qwen3", "<think>\nPlan: add 2 and 2.\n</think>\n\nThe answer is 4."),
    ("qwen3", "No thinking, just < and </ and the answer."),
    ("gpt_oss", "<|channel|>analysis<|message|>Plan: a < b, so 2 + 2.<|end|><|start|>assistant<|channel|>final"
                "<|message|>The answer is 4 (not < 3).<|return|>"),
])
def test_a_stream_labels_each_piece_once_and_adds_up_to_the_whole_split(parser, text):
    """Cut anywhere, even inside a tag: no tag or part of one is ever sent, and the pieces add up to the split."""
    rng = random.Random(7)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(1, 8)))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s, thought, content, seen = Stream(parser), "", "", ""
        for k, p in enumerate(pieces):
            seen += p
            r, c = s.step(seen, k == len(pieces) - 1)
            assert "<think" not in r + c and "</think" not in r + c or parser == "deepseek_r1" and "<think>" not in text
            assert "<|" not in r + c and "|>" not in r + c               # no harmony marker, nor a part of one
            thought, content = thought + r, content + c
        want_r, want_c = split(parser, text)
        assert (thought, content) == (want_r or "", want_c or ""), pieces


def _deltas(*texts: str, prompt: int = 5) -> list[TokenDelta]:
    out = [TokenDelta([i], t, False, replica="d0" if i == 0 else None) for i, t in enumerate(texts[:-1])]
    return out + [TokenDelta([len(texts) - 1], texts[-1], True, finish_reason="stop", prompt_tokens=prompt,
                             completion_tokens=len(texts))]


def _chat(**kw):
    return oa.parse_request({"model": "m", "messages": [{"role": "user", "content": "2+2?"}], **kw}, chat=True)


def test_the_response_carries_the_thinking_apart_whole_or_streamed():
    parts = ("<think>Add", " them.</th", "ink>It is", " 4.")
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(), Tok(), reasoning="deepseek_r1")
    for d in _deltas(*parts):
        b.add(0, d)
    msg = ChatCompletion.model_validate(b.final()).choices[0].message
    assert msg.content == "It is 4." and msg.model_extra["reasoning_content"] == "Add them."

    s = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(stream=True), Tok(), reasoning="deepseek_r1")
    chunks = [ChatCompletionChunk.model_validate(c) for d in _deltas(*parts) for c in s.chunks(0, d)]
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert (thought, content) == ("Add them.", "It is 4.") and chunks[-1].choices[0].finish_reason == "stop"
    assert not any(c.choices[0].delta.content and c.choices[0].delta.model_extra.get("reasoning_content")
                   for c in chunks if c.choices[0].delta.model_extra)     # each piece labelled once

    hidden = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(include_reasoning=False), Tok(), reasoning="qwen3")
    for d in _deltas("<think>x", "</think>", "y"):
        hidden.add(0, d)
    assert hidden.final()["choices"][0]["message"] == {"role": "assistant", "content": "y"}
    plain = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(), Tok(), reasoning="deepseek_r1")
    for d in _deltas("no", " end tag"):
        plain.add(0, d)
    assert plain.final()["choices"][0]["message"] == {"role": "assistant", "content": None,
                                                      "reasoning_content": "no end tag"}


def test_tool_calls_are_read_from_the_answer_not_the_thinking():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    req = _chat(tools=tools, tool_choice="auto")
    plan = oa.tool_plan(req, ToolFormat())
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
    text = ("<think>I could write ", call.replace("add", "sub"), " but no.</think>", "Calling. ", call)
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok(), plan, reasoning="deepseek_r1")
    for d in _deltas(*text):
        b.add(0, d)
    msg = b.final()["choices"][0]["message"]
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["add"] and "sub" in msg["reasoning_content"]

    s = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(tools=tools, tool_choice="auto", stream=True), Tok(),
                           oa.tool_plan(_chat(tools=tools, tool_choice="auto", stream=True), ToolFormat()),
                           reasoning="deepseek_r1")
    chunks = [ChatCompletionChunk.model_validate(c) for d in _deltas(*text) for c in s.chunks(0, d)]
    calls = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function.name]
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
                      if c.choices[0].delta.model_extra)
    assert calls == ["add"] and "sub" in thought and chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("choice", ["named", "required"])
def test_a_forced_tool_call_follows_the_thinking(choice):
    """Under a parser a forced call's grammar waits for </think> (the engine's after_thinking): the thinking streams
    as reasoning_content, and the call (its arguments streamed as they come, for a named one) is the answer alone."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    tool_choice = {"type": "function", "function": {"name": "add"}} if choice == "named" else "required"
    args = '{"a": 2, "b": 2}'
    answer = args if choice == "named" else f'[{{"name": "add", "arguments": {args}}}]'
    text = ("<think>Two", " and two.</th", "ink>", answer[:7], answer[7:])
    for stream in (False, True):
        req = _chat(tools=tools, tool_choice=tool_choice, stream=stream)
        b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok(), oa.tool_plan(req, ToolFormat()),
                               reasoning="deepseek_r1")
        if not stream:
            for d in _deltas(*text):
                b.add(0, d)
            msg = ChatCompletion.model_validate(b.final()).choices[0].message
            assert msg.model_extra["reasoning_content"] == "Two and two." and not msg.content
            assert [(c.function.name, c.function.arguments) for c in msg.tool_calls] == [("add", args)]
            continue
        chunks = [ChatCompletionChunk.model_validate(c) for d in _deltas(*text) for c in b.chunks(0, d)]
        deltas = [c.choices[0].delta for c in chunks]
        thought = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
        calls = [t for d in deltas for t in d.tool_calls or []]
        first_call = next(i for i, d in enumerate(deltas) if d.tool_calls)
        assert thought == "Two and two." and not any((d.model_extra or {}).get("reasoning_content")
                                                     for d in deltas[first_call:])
        assert [t.function.name for t in calls if t.function.name] == ["add"]
        assert "".join(t.function.arguments or "" for t in calls) == args
        assert chunks[-1].choices[0].finish_reason == "tool_calls" and not any(d.content for d in deltas)


def test_gpt_oss_tool_calls_and_reasoning_whole_or_streamed():
    """gpt-oss (reasoning parser gpt_oss, tool parser harmony): the analysis channel streams as reasoning_content, a
    commentary message to functions.get_weather is the tool call with its JSON arguments, no marker reaches the
    client; a final answer without a call is the content."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    parts = ("<|channel|>analysis<|message|>Need the", " weather.<|end|><|start|>assistant<|channel|>comm",
             "entary to=functions.get_weather <|constrain|>json<|message|>{\"city\":", " \"Oslo\"}<|call|>")
    for stream in (False, True):
        req = _chat(tools=tools, tool_choice="auto", stream=stream)
        plan = oa.tool_plan(req, ToolFormat("harmony", True))
        assert plan.keeps_special_tokens
        b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, req, Tok(), plan, reasoning="gpt_oss")
        if not stream:
            for d in _deltas(*parts):
                b.add(0, d)
            msg = b.final()["choices"][0]["message"]
            assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
                [("get_weather", '{"city": "Oslo"}')]
            continue
        chunks = [ChatCompletionChunk.model_validate(c) for d in _deltas(*parts) for c in b.chunks(0, d)]
        thought = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks
                          if c.choices[0].delta.model_extra)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t.function.name for c in chunks for t in c.choices[0].delta.tool_calls or [] if t.function.name]
        assert thought == "Need the weather." and content == "" and calls == ["get_weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    b = oa.ResponseBuilder("chatcmpl-1", 1, "m", True, _chat(), Tok(), reasoning="gpt_oss")
    for d in _deltas("<|channel|>analysis<|message|>Easy.<|end|>", "<|start|>assistant<|channel|>final<|message|>",
                     "Four.<|return|>"):
        b.add(0, d)
    assert b.final()["choices"][0]["message"] == {"role": "assistant", "content": "Four.",
                                                  "reasoning_content": "Easy."}
