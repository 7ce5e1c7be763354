"""What a user of structured outputs checks, through the `openai` client against a live cluster: every
JSON-schema response validates (chat, streamed or not, greedy and seeded sampled, n > 1), the client's own
`chat.completions.parse` gets its Pydantic object, a structural tag holds a tool call in its format, vLLM's
structured_outputs extras hold on completions, and a spec the grammar engine refuses is a 400 naming the field
while the cluster goes on. Tool calls: named and required calls parse and match their schemas
(check_tool_calls)."""
from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.test_structured_output import SCHEMAS
from tests.test_tools import TIME, WEATHER


class Leg(BaseModel):
    runner: str = Field(max_length=20)
    leg: int = Field(ge=1, le=4)
    anchor: bool


def json_schema(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check_structured_outputs(client: openai.OpenAI, model: str, quick: bool = False) -> None:
    """quick: one schema, one streamed sampled request and the vLLM extras (a second cluster mode)."""
    messages = [{"role": "user", "content": "Describe one runner of a relay team as JSON."}]
    for name in list(SCHEMAS)[:1] if quick else SCHEMAS:
        for temperature, stream in ((0.8, True),) if quick else ((0.0, False), (0.8, True)):
            kw = dict(model=model, messages=messages, temperature=temperature, seed=3, max_tokens=160,
                      response_format=json_schema(name))
            if stream:
                texts = {}
                for c in client.chat.completions.create(**kw, n=2, stream=True):
                    for ch in c.choices:
                        texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
                got = [texts[0], texts[1]]
            else:
                r = client.chat.completions.create(**kw)
                assert r.choices[0].finish_reason == "stop", r
                got = [r.choices[0].message.content]
            for text in got:
                jsonschema.validate(json.loads(text), SCHEMAS[name])
    if not quick:                                    # vLLM's structural tag: a tool call in the model's own format
        from tests.test_structured_output import CALL, CALLS, call_tags
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the weather in Paris? Call a tool."}],
            temperature=0, max_tokens=80, response_format=call_tags(at_least_one=True, stop_after_first=True))
        (name, args), = CALL.findall(r.choices[0].message.content)
        jsonschema.validate(json.loads(args), CALLS[name])
        parsed = client.chat.completions.parse(model=model, messages=messages, response_format=Leg, temperature=0,
                                               max_tokens=80).choices[0].message.parsed
        assert isinstance(parsed, Leg)
    obj = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=120,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)

    prompt = "The relay team's phone number is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=20, temperature=0.7, seed=1,
                                  extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=model, prompt="Did the team win? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")


def check_bad_specs_get_400(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "hi"}]
    bad = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nope"}}}}}}, "response_format"),
           ({"response_format": {"type": "yaml"}}, "response_format.type"),
           ({"response_format": {"type": "structural_tag", "format": {"type": "no_such_format"}}}, "response_format"),
           ({"extra_body": {"structured_outputs": {"regex": "(open"}}}, "structured_outputs"),
           ({"extra_body": {"structured_outputs": {"choice": ["x" * 70000]}}}, "structured_outputs"),
           ({"response_format": {"type": "json_schema", "json_schema": {"name": "tags", "schema": {      # not enforced
                "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}, "response_format")]
    for kw, param in bad:
        for stream in (False, True):                 # refused before a stream starts: no 200 then an error
            with pytest.raises(openai.BadRequestError) as e:
                r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, stream=stream,
                                                   **kw)
                list(r) if stream else None
            assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1


class GetWeather(BaseModel):
    city: str = Field(max_length=30)
    unit: Literal["c", "f"]


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for t in ch.delta.tool_calls or []:
                c = calls.setdefault(t.index, ["", ""])
                c[0] += (t.function.name or "") if t.function else ""
                c[1] += (t.function.arguments or "") if t.function else ""
            finish = ch.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


def check_tool_calls(client: openai.OpenAI, model: str, quick: bool = False) -> None:
    """Named and required calls always parse and match their tool's schema, streamed or not; auto answers
    are well-formed; a conversation with a tool result goes on; the client's pydantic tool helpers work.
    quick: the named call, streamed or not, and one required call."""
    tools = [WEATHER, TIME]
    params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    messages = [{"role": "user", "content": "What is the weather in Oslo right now?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, tool_choice=named,
                                       temperature=0, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and call.id
    jsonschema.validate(json.loads(call.function.arguments), params["get_weather"])
    content, calls, finish = _streamed_calls(client.chat.completions.create(
        model=model, messages=messages, tools=tools, tool_choice=named, temperature=0, max_tokens=60, stream=True))
    assert calls == [("get_weather", call.function.arguments)] and finish == "tool_calls" and content == ""

    for seed, stream in ((2, True),) if quick else ((1, False), (2, True)):
        kw = dict(model=model, messages=messages, tools=tools, tool_choice="required", temperature=0.8, seed=seed,
                  max_tokens=120, parallel_tool_calls=seed == 1)
        if stream:
            _, got, finish = _streamed_calls(client.chat.completions.create(**kw, stream=True))
        else:
            r = client.chat.completions.create(**kw)
            got, finish = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls], \
                r.choices[0].finish_reason
        # one call (parallel_tool_calls false) ends the array; parallel ones may go on to max_tokens (a small
        # model repeats itself): the whole calls that came are returned either way
        assert got, finish
        assert (finish == "tool_calls") if seed == 2 else (finish in ("tool_calls", "length")), (got, finish)
        for name, args in got:
            jsonschema.validate(json.loads(args), params[name])

    if quick:
        return
    r = client.chat.completions.create(model=model, messages=messages, tools=tools, temperature=0, max_tokens=60)
    msg = r.choices[0].message
    assert msg.content or msg.tool_calls
    for c in msg.tool_calls or []:
        jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])

    history = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    r = client.chat.completions.create(model=model, messages=history, tools=tools, temperature=0, max_tokens=30)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls

    parsed = client.chat.completions.parse(
        model=model, messages=messages, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, temperature=0, max_tokens=60)
    assert isinstance(parsed.choices[0].message.tool_calls[0].function.parsed_arguments, GetWeather)

    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "a": {"$ref": "#/nope"}}}}}
    for kw, param in [(dict(tools=[bad], tool_choice="required"), "tools"),
                      (dict(tools=tools, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
                      (dict(tool_choice="required"), "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=model, messages=messages, max_tokens=4, **kw)
        assert e.value.body["param"] == param, e.value.body
