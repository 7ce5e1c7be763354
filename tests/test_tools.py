"""Tool calling without a server (router/tools.py, the chat response builder): tools and tool_choice are
checked with OpenAI's 400s, forced calls become grammars, Hermes-style <tool_call> blocks parse, the
conversation's tool turns render for any chat template, and responses and stream chunks parse as the
official client's types with tool_calls and finish_reason tool_calls."""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from replica.messages import TokenDelta
from router import openai_protocol as oa
from router.tools import ToolFormat, parse_hermes, parse_llama3_json, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


def chat(**kw):
    return oa.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}, chat=True)


class Tok:
    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("kw, param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_get_400_naming_the_field(kw, param):
    with pytest.raises(oa.OpenAIError) as e:
        oa.tool_plan(chat(**kw))
    assert e.value.status == 400 and e.value.param == param


def test_bad_tool_messages_get_400():
    for messages, param in [([{"role": "tool", "content": "22C"}], "messages.0.tool_call_id"),
                            ([{"role": "user"}], "messages.0.content"),
                            ([{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}],
                             "messages.0.tool_calls.0")]:
        with pytest.raises(oa.OpenAIError) as e:
            oa.parse_request({"model": "m", "messages": messages}, chat=True)
        assert e.value.param == param


def test_forced_choices_become_grammars_and_none_or_no_tools_none():
    named = oa.tool_plan(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert named.structured().json == TIME["function"]["parameters"]
    required = oa.tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = required.structured().json
    jsonschema.validate([{"name": "get_weather", "arguments": {"city": "Oslo"}}], schema)
    for bad in ([], [{"name": "get_time", "arguments": {"city": "Oslo"}}],
                [{"name": "get_time", "arguments": {"zone": "a"}}] * 2):       # one call at most here
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert oa.tool_plan(chat(tools=[WEATHER])).structured() is None           # auto: free text, parsed
    assert oa.tool_plan(chat(tools=[WEATHER], tool_choice="none")) is None
    assert oa.tool_plan(chat()) is None


def test_hermes_blocks_parse_into_calls_and_anything_else_stays_content():
    names = {"get_weather", "get_time"}
    content, calls = parse_hermes('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
                                  '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}', names)
    assert content == "Let me look." and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Oslo"} and calls[0].id != calls[1].id
    for text in ("It is sunny.", '<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
                 "<tool_call>{not json</tool_call>"):
        assert parse_hermes(text, names) == (text, [])


def test_required_calls_cut_off_by_max_tokens_keep_the_whole_ones():
    plan = oa.tool_plan(chat(tools=[WEATHER, TIME], tool_choice="required"))
    content, calls = plan.parse('[{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "get_weather", "argu')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"zone": "CET"})]
    assert plan.parse('[{"name": "get_ti') == ('[{"name": "get_ti', [])


def test_tool_turns_render_for_templates_without_tool_support():
    req = oa.parse_request({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]}, chat=True)
    msgs, template_tools = oa.chat_messages(req, oa.tool_plan(req))
    assert template_tools is None                               # written into the turns instead
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert msgs[3]["content"] == "<tool_response>\n22C\n</tool_response>"
    assert all(isinstance(m["content"], str) for m in msgs)


def _delta(text: str, finished: bool = False, reason: str | None = None) -> TokenDelta:
    return TokenDelta(token_ids=[1], text=text, finished=finished, finish_reason=reason, prompt_tokens=3,
                      completion_tokens=4, cached_tokens=0)


def _run(req, pieces: list[str], fmt: ToolFormat = ToolFormat()) -> tuple[dict, list[dict]]:
    plan = oa.tool_plan(req, fmt)
    whole = oa.ResponseBuilder("chatcmpl-1", 0, "m", True, req, Tok(), plan)
    streamed = oa.ResponseBuilder("chatcmpl-1", 0, "m", True, req, Tok(), plan)
    chunks = streamed.first_chunks()
    for k, p in enumerate(pieces):
        last = k == len(pieces) - 1
        whole.add(0, _delta(p, last, "stop" if last else None))
        chunks += streamed.chunks(0, _delta(p, last, "stop" if last else None))
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    return whole.final(), chunks


def _calls_from(chunks: list[dict]) -> tuple[str, dict[int, dict]]:
    content, calls = "", {}
    for c in chunks:
        for ch in c["choices"]:
            content += ch["delta"].get("content") or ""
            for t in ch["delta"].get("tool_calls") or []:
                call = calls.setdefault(t["index"], {"id": None, "name": "", "arguments": ""})
                call["id"] = t.get("id") or call["id"]
                call["name"] += t.get("function", {}).get("name", "")
                call["arguments"] += t.get("function", {}).get("arguments", "")
    return content, calls


@pytest.mark.parametrize("case", ["named", "required", "auto-call", "auto-text"])
def test_responses_and_stream_chunks_carry_tool_calls_in_openais_shape(case):
    kw = {"named": dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}),
          "required": dict(tool_choice="required"), "auto-call": {}, "auto-text": {}}[case]
    pieces = {"named": ['{"city": ', '"Oslo"}'],
              "required": ['[{"name": "get_time", ', '"arguments": {"zone": "CET"}}]'],
              "auto-call": ["Checking. <tool", '_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'],
              "auto-text": ["It is <b>", "sunny</b>."]}[case]
    final, chunks = _run(chat(tools=[WEATHER, TIME], **kw), pieces)
    body = ChatCompletion.model_validate(final)
    msg, content, calls = body.choices[0].message, *_calls_from(chunks)
    if case == "auto-text":
        assert msg.content == content == "It is <b>sunny</b>." and not msg.tool_calls
        assert body.choices[0].finish_reason == "stop"
        return
    want = {"named": ("get_weather", {"city": "Oslo"}), "required": ("get_time", {"zone": "CET"}),
            "auto-call": ("get_weather", {"city": "Oslo"})}[case]
    assert body.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [want]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [want]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert content == ("Checking. " if case == "auto-call" else "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# -- chat templates with their own tool support, and Llama 3's JSON calls ----------------------------------
# A template written here in Llama 3.1's JSON tool format (tools in the system turn, calls as
# <|python_tag|>{"name", "parameters"}, results in an ipython turn); ChatML markers so SmolLM2's tokenizer has them.
LLAMA_LIKE = (
    '{%- if tools %}<|im_start|>system\nEnvironment: ipython\nTo call a function, respond with JSON '
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    '{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}'
    '{%- for m in messages %}'
    '{%- if m.role == "assistant" and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}'
    '<|python_tag|>{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    '{% endfor %}<|im_end|>\n'
    '{%- elif m.role == "tool" %}<|im_start|>ipython\n{{ m.content }}<|im_end|>\n'
    '{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}'
    '{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}')
HERMES_LIKE = ('{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>'
               ' Call with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n{% endif %}'
               '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}')
PLAIN = '{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}'


class Templated:
    def __init__(self, template):
        self.chat_template = template


@pytest.mark.parametrize("template, configured, want", [
    (PLAIN, "auto", ToolFormat("hermes", False)),            # SmolLM2's kind: tools written in, Hermes calls
    (HERMES_LIKE, "auto", ToolFormat("hermes", True)),       # Qwen2.5's kind
    (LLAMA_LIKE, "auto", ToolFormat("llama3_json", True)),
    (LLAMA_LIKE, "hermes", ToolFormat("hermes", True)),      # the config wins
    (PLAIN, "llama3_json", ToolFormat("llama3_json", False)),
    ({"default": PLAIN, "tool_use": LLAMA_LIKE}, "auto", ToolFormat("llama3_json", True)),
    # gpt-oss's: harmony's channels, its tools in a namespace of functions
    ("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{% endfor %}"
     "{% if tools %}namespace functions {% endif %}", "auto", ToolFormat("harmony", True)),
])
def test_the_tool_format_follows_the_chat_template_and_the_config(template, configured, want):
    assert tool_format(Templated(template), configured) == want


def test_a_template_with_tool_support_gets_the_tools_and_openai_shaped_turns(smol_path):
    from engine.llm import chat_token_ids
    from engine.loader import load_tokenizer
    tok = load_tokenizer(smol_path)
    tok.chat_template = LLAMA_LIKE
    fmt = tool_format(tok)
    req = oa.parse_request({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]}, chat=True)
    msgs, template_tools = oa.chat_messages(req, oa.tool_plan(req, fmt), fmt)
    assert template_tools == [WEATHER]
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}     # an object, as templates want
    assert msgs[2] == {"role": "tool", "content": "22C", "tool_call_id": "call_1"}
    prompt = tok.decode(chat_token_ids(tok, msgs, template_tools))
    assert "Environment: ipython" in prompt and json.dumps(WEATHER) in prompt
    assert '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}' in prompt
    assert "<|im_start|>ipython\n22C" in prompt and prompt.endswith("<|im_start|>assistant\n")
    # the same conversation without tools (tool_choice none) still renders its tool turns
    none = oa.parse_request({**req.model_dump(exclude_none=True), "tool_choice": "none"}, chat=True)
    msgs, template_tools = oa.chat_messages(none, oa.tool_plan(none, fmt), fmt)
    assert template_tools is None and "Environment" not in tok.decode(chat_token_ids(tok, msgs, template_tools))


def test_llama3_json_calls_parse():
    names = {"get_weather", "get_time"}
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                       '{"name": "get_time", "parameters": {"zone": "CET"}}', names)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert parse_llama3_json(' {"name": "get_time", "arguments": {"zone": "UTC"}}', names)[1][0].name == "get_time"
    for text in ("It is sunny.", '{"name": "launch", "parameters": {}}', '{"name": "get_time", "param',
                 'Sure: {"name": "get_time", "parameters": {}}'):
        assert parse_llama3_json(text, names) == (text, [])


@pytest.mark.parametrize("case", ["call", "text"])
def test_llama3_json_streams_hold_back_only_what_may_be_a_call(case):
    pieces = {"call": ['{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}'],
              "text": ["It is ", "sunny."]}[case]
    final, chunks = _run(chat(tools=[WEATHER, TIME]), pieces, ToolFormat("llama3_json", True))
    body = ChatCompletion.model_validate(final)
    content, calls = _calls_from(chunks)
    if case == "text":
        assert chunks[1]["choices"][0]["delta"] == {"content": "It is "}     # not held: no call starts so
        assert body.choices[0].message.content == content == "It is sunny." and not calls
        return
    assert not content and body.choices[0].finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]


def test_vllms_chat_template_options_shape_the_prompt_and_bad_ones_are_refused(smol_path):
    """add_generation_prompt false leaves the assistant header out; continue_final_message goes on with the
    last assistant message (no end tag); chat_template_kwargs reach the template as its variables."""
    from engine.errors import InvalidRequestError
    from engine.llm import chat_token_ids
    from engine.loader import load_tokenizer
    tok = load_tokenizer(smol_path)
    msgs = [{"role": "user", "content": "Name a relay leg."}, {"role": "assistant", "content": "The anchor"}]
    assert tok.decode(chat_token_ids(tok, msgs)).endswith("The anchor<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(chat_token_ids(tok, msgs, add_generation_prompt=False)).endswith("The anchor<|im_end|>\n")
    assert tok.decode(chat_token_ids(tok, msgs, add_generation_prompt=False,
                                     continue_final_message=True)).endswith("<|im_start|>assistant\nThe anchor")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{{ suffix | default('') }}"
    assert tok.decode(chat_token_ids(tok, msgs, template_kwargs={"suffix": " leg"})) == "Name a relay leg.The anchor leg"
    for kw, words in ((dict(continue_final_message=True), "continue_final_message needs add_generation_prompt false"),
                      (dict(add_generation_prompt=False, continue_final_message=True, messages=msgs[:1]),
                       "an assistant message last"),
                      (dict(template_kwargs={"tools": []}), "chat_template_kwargs may not set tools")):
        with pytest.raises(InvalidRequestError, match=words):
            chat_token_ids(tok, kw.pop("messages", msgs), **kw)


def test_mistral_calls_parse_in_both_of_its_formats_with_mistral_ids():
    """[TOOL_CALLS] then a JSON array (v3 tokenizers), or name[ARGS]{...} per call (v11+); content before it;
    ids of 9 letters and digits, which Mistral's templates check when the calls come back."""
    from router.tools import parse_mistral
    names = {"get_weather", "get_time"}
    content, calls = parse_mistral('Checking. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                                   '{"name": "get_time", "arguments": {"zone": "CET"}}]', names)
    assert content == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and calls[0].id != calls[1].id
    content, calls = parse_mistral('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]'
                                   '{"zone": "CET"}', names)
    assert content is None and [c.name for c in calls] == ["get_weather", "get_time"]
    for text in ("It is sunny.", '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]', '[TOOL_CALLS] [{"name": "get_t',
                 "[TOOL_CALLS]get_time{}", '[TOOL_CALLS]launch[ARGS]{}', "[TOOL_CALLS] []"):
        assert parse_mistral(text, names) == (text, [])


def test_pythonic_calls_parse_and_anything_else_stays_content():
    from router.tools import parse_pythonic
    names = {"get_weather", "get_time"}
    content, calls = parse_pythonic('[get_weather(city="Oslo", days=[1, 2], detail={"wind": true}), '
                                    "get_time(zone='CET')]", names)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": [1, 2], "detail": {"wind": True}}), ("get_time", {"zone": "CET"})]
    assert parse_pythonic('<|python_start|>[get_time(zone="UTC")]<|python_end|>', names)[1][0].name == "get_time"
    for text in ("It is sunny.", '[launch(x=1)]', '[get_time("CET")]', '[get_time(zone=os.environ)]',
                 '[get_time(zone="CET")', "[]", "Sure: [get_time(zone='CET')]", '[get_time(**{"zone": "x"})]',
                 "[" * 200 + "]" * 200):
        assert parse_pythonic(text, names) == (text, [])


@pytest.mark.parametrize("parser, pieces", [
    ("mistral", ["Checking. [TOOL", '_CALLS] [{"name": "get_weather", "arguments": {"city": "Oslo"}}]']),
    ("pythonic", ["[get_weather(", 'city="Oslo")]']),
    ("pythonic", ["It is ", "sunny."]),
    ("deepseek_v3", ["Checking. <｜tool▁calls", '▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
                     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"]),
])
def test_mistral_and_pythonic_streams_hold_back_only_what_may_be_a_call(parser, pieces):
    final, chunks = _run(chat(tools=[WEATHER, TIME]), pieces, ToolFormat(parser, True))
    body = ChatCompletion.model_validate(final)
    content, calls = _calls_from(chunks)
    if pieces[-1] == "sunny.":
        assert chunks[1]["choices"][0]["delta"] == {"content": "It is "}     # nothing that may start a call: sent
        assert body.choices[0].message.content == content == "It is sunny." and not calls
        return
    assert "[TOOL" not in content and "<｜" not in content and "get_weather" not in content
    assert body.choices[0].finish_reason == "tool_calls"
    assert content.strip() == (body.choices[0].message.content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", {"city": "Oslo"})]


def test_the_template_picks_the_parser_and_mistral_keeps_special_tokens(smol_path):
    """auto reads the chat template: one that writes [TOOL_CALLS] is Mistral's, one that teaches the pythonic form is
    pythonic. An auto request under mistral keeps special tokens' text ([TOOL_CALLS] is one); a forced call does
    not need to. A template without tool support gets the format written into the system turn, with the
    conversation's calls in it."""
    from engine.loader import load_tokenizer
    tok = load_tokenizer(smol_path)
    for template, parser in [("{% for m in messages %}[TOOL_CALLS]{{ m }}{% endfor %}", "mistral"),
                             ("{% if tools %}[func_name1(params_name1=params_value1, ...)]{% endif %}", "pythonic"),
                             (tok.chat_template, "hermes")]:
        tok.chat_template = template
        assert tool_format(tok).parser == parser
    mistral = ToolFormat("mistral", False)
    assert oa.tool_plan(chat(tools=[WEATHER]), mistral).keeps_special_tokens
    for choice, text in [({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}'),
                         ("required", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')]:
        _, [call] = oa.tool_plan(chat(tools=[WEATHER], tool_choice=choice), mistral).parse(text)
        assert len(call.id) == 9 and call.id.isalnum()                  # forced calls too get Mistral's ids
        assert oa.tool_plan(chat(tools=[WEATHER], tool_choice=choice)).parse(text)[1][0].id.startswith("call_")
    assert not oa.tool_plan(chat(tools=[WEATHER], tool_choice="required"), mistral).keeps_special_tokens
    assert not oa.tool_plan(chat(tools=[WEATHER]), ToolFormat("hermes", False)).keeps_special_tokens
    history = {"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [{"id": "a1b2c3d4e", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "22C"}]}
    for fmt, call in [(mistral, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]'),
                      (ToolFormat("pythonic", False), "[get_weather(city='Oslo')]")]:
        req = oa.parse_request(history, chat=True)
        msgs, template_tools = oa.chat_messages(req, oa.tool_plan(req, fmt), fmt)
        assert template_tools is None and msgs[2]["content"] == call
        assert ("[TOOL_CALLS]" if fmt.parser == "mistral" else "Python list of calls") in msgs[0]["content"]
        assert json.dumps(WEATHER) in msgs[0]["content"]


DS_V3 = ("Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n'
         '{"zone": "CET"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DS_V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}<｜tool▁call▁end｜>'
          '<｜tool▁calls▁end｜>')


def test_deepseek_calls_parse_in_v3s_and_v31s_forms():
    """V3's and R1's: `function<｜tool▁sep｜>NAME` and the arguments in a ```json fence; V3.1's: NAME<｜tool▁sep｜>
    then the JSON; the text before the calls is the content; a last call cut off after its JSON still counts.
    Anything else (no calls, an unknown function, arguments that are not a JSON object) stays content."""
    from router.tools import parse_deepseek_v3
    names = {"get_weather", "get_time"}
    content, calls = parse_deepseek_v3(DS_V3, names)
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]
    content, calls = parse_deepseek_v3(DS_V31, names)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    cut = DS_V3.split("<｜tool▁call▁end｜>")[0]                       # stopped before the call's end
    assert [c.name for c in parse_deepseek_v3(cut, names)[1]] == ["get_weather"]
    for text in ("It is sunny.", DS_V31.replace("get_weather", "launch"), DS_V31.replace('{"city": "Oslo"}', "[1]"),
                 DS_V31.replace('"Oslo"}', '"Os'), "<｜tool▁calls▁begin｜>", DS_V3.replace("```json", "")):
        assert parse_deepseek_v3(text, names) == (text, [])


def test_deepseeks_template_picks_its_parser_and_past_calls_render_in_its_format():
    """auto reads DeepSeek's markers in its template; an auto request keeps special tokens' text (the markers are
    special tokens). A template without tool support gets DeepSeek's format in the system turn and the
    conversation's calls written as DeepSeek writes them, which its parser reads back."""
    fmt = tool_format(Templated("{% for m in messages %}{{ m.content }}<｜tool▁calls▁begin｜>{% endfor %}"))
    assert fmt == ToolFormat("deepseek_v3", False)
    req = oa.parse_request({"model": "m", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"}]}, chat=True)
    plan = oa.tool_plan(req, fmt)
    assert plan.keeps_special_tokens
    msgs, template_tools = oa.chat_messages(req, plan, fmt)
    assert template_tools is None and "<｜tool▁calls▁begin｜>" in msgs[0]["content"]
    content, [call] = plan.parse(msgs[2]["content"])
    assert content is None and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
