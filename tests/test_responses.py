"""OpenAI's Responses API (router/responses.py): a request becomes the chat request it asks for, and the chat answer
comes back as a Response (output items, usage, status) or as the Responses events, each parsed with the `openai`
package's own types. The live cluster serves it in tests/test_cluster_colocated.py."""
from __future__ import annotations

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from replica.messages import TokenDelta
from router import openai_protocol as oa, responses as rs
from router.tools import ToolFormat

EVENTS = TypeAdapter(ResponseStreamEvent)


class Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def _deltas(*texts: str, finish: str = "stop") -> list[TokenDelta]:
    out = [TokenDelta([i], t, False, [{i: -0.5}], replica="d0" if i == 0 else None) for i, t in enumerate(texts[:-1])]
    return out + [TokenDelta([len(texts) - 1], texts[-1], True, [{len(texts) - 1: -0.25}], finish_reason=finish,
                             prompt_tokens=9, completion_tokens=len(texts), cached_tokens=4)]


def _builder(body: dict, reasoning: str = "none") -> rs.ResponsesBuilder:
    rreq = rs.parse({"model": "m", **body})
    req = oa.parse_request(rs.to_chat(rreq), chat=True)
    tools = oa.tool_plan(req, ToolFormat())
    inner = oa.ResponseBuilder("resp_1", 7, "m", True, req, Tok(), tools, [[1] * 9], reasoning)
    return rs.ResponsesBuilder(inner, rreq, cacheable_tokens=8)


def test_a_request_becomes_the_chat_request_it_asks_for():
    """Instructions first, a tool round trip as the assistant's call and the tool's answer (parallel calls in one
    turn), reasoning items left out, Responses' flat tools and tool_choice in the chat form, text.format as
    response_format, logprobs through include, vLLM's extras passed on."""
    rreq = rs.parse({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 20, "temperature": 0.5, "top_k": 5,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Add 2 and 2, "},
                                               {"type": "input_text", "text": "and 3 and 3."}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
                  {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 3, "b": 3}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "4"},
                  {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "6"}]},
                  {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4, 6"}]},
                  {"role": "user", "content": "Thanks"}],
        "tools": [{"type": "function", "name": "add", "parameters": {"type": "object"}, "strict": True}],
        "tool_choice": {"type": "function", "name": "add"}, "include": ["message.output_text.logprobs"],
        "text": {"format": {"type": "json_schema", "name": "sum", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"}, "store": True, "metadata": {"k": "v"}})
    body = rs.to_chat(rreq)
    assert body["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Add 2 and 2, and 3 and 3."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"}, {"role": "tool", "tool_call_id": "c2", "content": "6"},
        {"role": "assistant", "content": "4, 6"}, {"role": "user", "content": "Thanks"}]
    assert body["tools"] == [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"},
                                                               "strict": True}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "sum", "schema": {"type": "object"},
                                                                              "strict": True}}
    assert (body["max_tokens"], body["temperature"], body["top_k"], body["logprobs"], body["top_logprobs"],
            body["reasoning_effort"]) == (20, 0.5, 5, True, 0, "low")
    req = oa.parse_request(body, chat=True)                      # the chat request's own checks pass
    assert oa.structured_spec(req)[0] is not None and oa.tool_plan(req, ToolFormat()).mode == "named"
    assert rs.to_chat(rs.parse({"model": "m", "input": "Hi"}))["messages"] == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"truncation": "auto"}, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.function.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools.0.function.name"),
    ({"include": ["reasoning.encrypted_content"]}, "include.0"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_k": "many"}, "top_k"),
])
def test_what_a_response_cannot_be_is_a_400_naming_the_field(extra, param):
    body = {"model": "m", "input": "Hi", **extra}
    with pytest.raises(oa.OpenAIError) as e:
        rs.to_chat(rs.parse(body))
    assert e.value.status == 400 and e.value.param.startswith(param.split(".")[0]), (e.value.param, e.value.message)


def test_the_answer_is_a_response_with_its_items_and_usage():
    """Thinking, text and a call become reasoning, message and function_call items, as the `openai` package's
    Response type reads them; usage counts the thinking's tokens; max_output_tokens makes it incomplete."""
    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    b = _builder({"input": "2+2?", "tools": tools, "tool_choice": "auto", "metadata": {"k": "v"}},
                 reasoning="deepseek_r1")
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'
    for d in _deltas("Add", " them.</think>", "Calling. ", call):
        b.add(0, d)
    r = Response.model_validate(b.final())
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "Add them." and r.output[1].content[0].text == "Calling."
    assert (r.output[2].name, r.output[2].arguments) == ("add", '{"a": 2, "b": 2}') and r.output[2].call_id
    assert r.status == "completed" and r.store is False and r.metadata == {"k": "v"} and r.id == "resp_1"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.input_tokens_details.cached_tokens,
            r.usage.input_tokens_details.cache_write_tokens,        # the whole blocks' tokens not read from the cache
            r.usage.output_tokens_details.reasoning_tokens) == (9, 4, 4, 8 - 4, len("Add them."))
    assert r.output_text == "Calling."

    cut = _builder({"input": "Count", "max_output_tokens": 2, "top_logprobs": 1})
    for d in _deltas("One,", " two", finish="length"):
        cut.add(0, d)
    r = Response.model_validate(cut.final())
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == "One, two" and [lp.token for lp in r.output[0].content[0].logprobs] == ["<0>", "<1>"]


def test_the_stream_is_the_responses_events_in_order():
    """created and in_progress, then each item added, its deltas, done; completed with the whole Response. The
    deltas add up to the items, sequence numbers count up from 0, and a named call streams its arguments."""
    b = _builder({"input": "2+2?", "stream": True}, reasoning="deepseek_r1")
    events = b.first_chunks() + [e for d in _deltas("Add", " them.</th", "ink>It is", " 4.") for e in b.chunks(0, d)]
    parsed = [EVENTS.validate_python(e) for e in events]
    kinds = [e.type for e in parsed]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed" and [e.sequence_number for e in parsed] == list(range(len(parsed)))
    assert "".join(e.delta for e in parsed if e.type == "response.reasoning_text.delta") == "Add them."
    assert "".join(e.delta for e in parsed if e.type == "response.output_text.delta") == "It is 4."
    assert kinds.index("response.output_item.done") < kinds.index("response.content_part.added")  # one item at a time
    final = parsed[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"] and final.output_text == "It is 4."
    assert final.usage.output_tokens == 4
    assert b.sse(events[0]).startswith(b"event: response.created\ndata: {") and b.end() == b""

    tools = [{"type": "function", "name": "add", "parameters": {"type": "object"}}]
    named = _builder({"input": "2+2?", "stream": True, "tools": tools, "tool_choice": {"type": "function", "name": "add"}})
    events = named.first_chunks() + [e for d in _deltas('{"a": ', '2, "b": 2}') for e in named.chunks(0, d)]
    parsed = [EVENTS.validate_python(e) for e in events]
    assert "".join(e.delta for e in parsed if e.type == "response.function_call_arguments.delta") == '{"a": 2, "b": 2}'
    done = next(e for e in parsed if e.type == "response.function_call_arguments.done")
    assert (done.name, done.arguments) == ("add", '{"a": 2, "b": 2}')
    assert [(o.type, o.name) for o in parsed[-1].response.output] == [("function_call", "add")]
