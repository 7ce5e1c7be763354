"""Tool calling on chat completions (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`).

Rendering: a chat template that takes tools itself (transformers' `apply_chat_template(tools=...)`: Qwen2.5,
Llama 3.1, Hermes) gets them, with the conversation's assistant tool_calls and tool messages, as OpenAI-shaped
turns. A template without tool support (SmolLM2's) gets them written in the way Hermes-style models are
trained to read them: the function signatures in a system block inside <tools></tools>, an assistant's calls
as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a tool's result as a user turn inside
<tool_response></tool_response>.

Parsing `auto` output (`ToolFormat.parser`, the cluster's `tools.parser`), as vLLM's parsers of the same names:
`hermes` reads <tool_call> blocks (Qwen2.5, Qwen3, SmolLM2, NousHermes); `llama3_json` reads Llama 3.1's JSON
calls, {"name": ..., "parameters": ...} (after an optional <|python_tag|>, several separated by `;`); `mistral`
reads what follows [TOOL_CALLS]: a JSON array of {"name", "arguments"} (Mistral 7B v0.3, Nemo, Small 3.1) or
`name[ARGS]{...}` per call (Magistral, Small 3.2, Devstral), and gives calls the 9-character ids Mistral's templates
require; `pythonic` reads a Python list of calls, [get_weather(city="Oslo"), ...] (Llama 3.2 and Llama 4 with
their pythonic templates, ToolACE); `harmony` reads gpt-oss's calls, commentary messages to `functions.NAME`
whose body is the arguments' JSON (router/reasoning.py's gpt_oss parser leaves them in the content, CALL_OPEN
...); `deepseek_v3` reads DeepSeek's calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>, each
<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME then its arguments in a ```json fence (V3, R1) or NAME<｜tool▁sep｜>
then the arguments' JSON (V3.1: vLLM's deepseek_v31), to <｜tool▁call▁end｜>. `auto` picks mistral for a template
that writes [TOOL_CALLS], pythonic for one that teaches the pythonic form, llama3_json for one that speaks Llama 3's
JSON, harmony for gpt-oss's (its <|channel|> markers), deepseek_v3 for DeepSeek's (its <｜tool▁calls▁begin｜>), and
hermes for every other.
[TOOL_CALLS] and [ARGS] are special tokens of Mistral's tokenizers, and DeepSeek's markers of its: under `mistral`
and `deepseek_v3` an `auto` request keeps special tokens' text, as vLLM's parsers make it, or its calls could not be
found.

Choice: `required` and a named function are enforced with a grammar (engine/structured.py), as vLLM does: a
named call's output is its arguments, a JSON object valid under the function's parameters schema; a
required call's output is a JSON array of {"name", "arguments"} objects, one item per call (one at most
without parallel_tool_calls). `auto` leaves the model free and parses <tool_call> blocks out of its text
(`parse_hermes`); `none` renders no tools. Streaming holds back only what may be the start of a tool call.
"""
from __future__ import annotations

import ast
import json
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured import StructuredOutput
from router.reasoning import CALL_END, CALL_OPEN, H_MESSAGE

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_TOOL_CALLS, _ARGS = "[TOOL_CALLS]", "[ARGS]"                     # Mistral's
_PYTHON_START, _PYTHON_END = "<|python_start|>", "<|python_end|>"  # Llama 4's, around a pythonic list
_PYTHONIC_TEMPLATE = "[func_name1(params_name1=params_value1"      # what pythonic templates teach
# DeepSeek's (fullwidth bars, U+2581 for the spaces)
_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
_DS_CALL, _DS_SEP, _DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
_DS_BLOCK = re.compile(re.escape(_DS_CALL) + r"(.*?)" + re.escape(_DS_SEP) + r"(.*?)(?:" + re.escape(_DS_CALL_END) +
                       r"|$)", re.DOTALL)
_DS_FENCE = re.compile(r"^\s*(\S+?)\s*\n```(?:json)?\s*\n?(.*?)\s*(?:```\s*)?$", re.DOTALL)
PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "harmony", "deepseek_v3")
_OPENERS = {"hermes": _OPEN, "mistral": _TOOL_CALLS, "harmony": CALL_OPEN,    # the tag opening a call in the text
            "deepseek_v3": _DS_CALLS}
_HARMONY_CALL = re.compile(re.escape(CALL_OPEN) + r"([A-Za-z0-9_.-]+)" + re.escape(H_MESSAGE) + r"(.*?)(" +
                           re.escape(CALL_END) + r"|$)", re.DOTALL)
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
SYSTEM = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
          "For each function call, return a json object with function name and arguments within "
          "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
          "<args-json-object>}}\n</tool_call>")
SYSTEM_MISTRAL = ("# Tools\n\nYou may call one or more functions to assist with the user query. Their signatures:\n"
                  "{tools}\n\nTo call functions, respond with [TOOL_CALLS] followed by a JSON array of objects, each "
                  "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}.")
SYSTEM_PYTHONIC = ("# Tools\n\nYou may call one or more functions to assist with the user query. Their signatures:\n"
                   "{tools}\n\nTo call functions, respond with only a Python list of calls, in the format "
                   "[func_name1(params_name1=params_value1, params_name2=params_value2), func_name2(params)], and "
                   "nothing else.")
SYSTEM_DEEPSEEK = ("# Tools\n\nYou may call one or more functions to assist with the user query. Their signatures:\n"
                   "{tools}\n\nTo call functions, respond with " + _DS_CALLS + " then, for each call, " + _DS_CALL +
                   "function" + _DS_SEP + "<function-name>\n```json\n<args-json-object>\n```" + _DS_CALL_END +
                   ", and end with " + _DS_CALLS_END + ".")
SYSTEM_JSON = ("# Tools\n\nYou may call one or more functions to assist with the user query. Their signatures:\n"
               "{tools}\n\nTo call functions, respond with only JSON objects separated by ';', each in the format "
               "{{\"name\": <function-name>, \"parameters\": <args-json-object>}}, and nothing else.")


@dataclass(frozen=True)
class ToolFormat:
    """How one model reads tools and writes its calls: through its chat template's own tool support
    (`native`) or in text written into the system turn, and which parser reads `auto` calls back."""
    parser: str = "hermes"
    native: bool = False


def tool_format(tokenizer, parser: str = "auto") -> ToolFormat:
    """The format for this tokenizer's chat template; `parser` (auto, hermes, llama3_json) as configured."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):                     # named templates: transformers takes tool_use for tools
        template = template.get("tool_use") or template.get("default") or ""
    native = "tools" in template
    if parser == "auto":
        llama = _PYTHON_TAG in template or '"parameters": ' in template
        parser = ("mistral" if _TOOL_CALLS in template else "pythonic" if _PYTHONIC_TEMPLATE in template else
                  "harmony" if "<|channel|>" in template else "deepseek_v3" if _DS_CALLS in template else
                  "llama3_json" if native and llama and _OPEN not in template else "hermes")
    if parser not in PARSERS:
        raise ValueError(f"tool parser must be auto or one of {', '.join(PARSERS)}, got {parser!r}")
    return ToolFormat(parser, native)


class ToolError(ValueError):
    """A malformed tools / tool_choice / tool message; the message names the field (`param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def openai_call_id() -> str:
    """A call id in OpenAI's form."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str                         # JSON text, as OpenAI sends it
    id: str = field(default_factory=openai_call_id)

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def mistral_call_id() -> str:
    """A call id as Mistral's chat templates require it back: 9 letters and digits."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


@dataclass
class ToolPlan:
    """What a request's tools ask of the engine and of the response."""
    tools: list[dict]                      # [{"name", "description"?, "parameters"?}]
    mode: str                              # auto | required | named
    name: str | None = None                # the named function
    parallel: bool = True
    format: ToolFormat = ToolFormat()

    def parameters(self, name: str) -> dict:
        fn = next(t for t in self.tools if t["name"] == name)
        return fn.get("parameters") or {"type": "object"}

    def structured(self) -> StructuredOutput | None:
        """The grammar of a forced call (None for auto)."""
        if self.mode == "named":
            return StructuredOutput(json=self.parameters(self.name))
        if self.mode == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"enum": [t["name"]]},
                                                                 "arguments": self.parameters(t["name"])},
                                "required": ["name", "arguments"], "additionalProperties": False}
                               for t in self.tools]}
            schema = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput(json=schema)
        return None

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The message's content and tool calls from a choice's whole text."""
        if self.mode == "named":
            return None, [ToolCall(self.name, text.strip(), self.call_id())]
        if self.mode == "required":
            calls = _complete_items(text)      # cut off by max_tokens: the calls that came whole
            if not calls:
                return text, []
            return None, [ToolCall(c["name"], json.dumps(c["arguments"]), self.call_id()) for c in calls]
        names = {t["name"] for t in self.tools}
        parse = {"llama3_json": parse_llama3_json, "mistral": parse_mistral, "pythonic": parse_pythonic,
                 "harmony": parse_harmony, "deepseek_v3": parse_deepseek_v3}
        return parse.get(self.format.parser, parse_hermes)(text, names)

    def call_id(self) -> str:
        """A new call's id: Mistral's 9 characters under its parser (its templates check them), else OpenAI's form."""
        return mistral_call_id() if self.format.parser == "mistral" else openai_call_id()

    @property
    def keeps_special_tokens(self) -> bool:
        """Mistral's [TOOL_CALLS] is a special token, and so are harmony's and DeepSeek's markers: an auto request's
        text must keep special tokens' text."""
        return self.mode == "auto" and self.format.parser in ("mistral", "harmony", "deepseek_v3")

    def holdback(self, text: str) -> int:
        """auto, streaming: how much of `text` (all the choice's text so far) may go out as content: up to a
        tool call's opening tag, or to a tail that may begin one (llama3_json: a call is the whole output, so
        nothing goes out while the text may begin with one)."""
        if self.format.parser in ("llama3_json", "pythonic"):
            head = text.lstrip()
            opens = ("{", _PYTHON_TAG) if self.format.parser == "llama3_json" else ("[", _PYTHON_START)
            maybe_call = not head or head.startswith(opens) or any(o.startswith(head) for o in opens)
            return 0 if maybe_call else len(text)
        opener = _OPENERS[self.format.parser]
        at = text.find(opener)
        if at >= 0:
            return at
        for n in range(min(len(opener) - 1, len(text)), 0, -1):
            if opener.startswith(text[-n:]):
                return len(text) - n
        return len(text)


def _complete_items(text: str) -> list[dict]:
    """The whole items of a JSON array of objects, even when the array was cut off (a model that keeps
    calling until max_tokens)."""
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    if at == 0:
        return []
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            obj, at = decoder.raw_decode(text, at)
        except ValueError:
            return items
        if not isinstance(obj, dict) or "name" not in obj or "arguments" not in obj:
            return items
        items.append(obj)


def parse_hermes(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """<tool_call>{"name": ..., "arguments": ...}</tool_call> blocks (the last one may lack its closing tag:
    the model stopped there) become tool calls; the text before the first is the content. A block that is not
    a JSON call of a known function leaves the whole text as content."""
    at = text.find(_OPEN)
    if at < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[at:]):
        try:
            obj = json.loads(block)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args)))
    content = text[:at].strip()
    return content or None, calls


def parse_harmony(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """gpt-oss's calls, as the gpt_oss reasoning parser writes them into the content (CALL_OPEN name <|message|>
    arguments <|call|>; the last may lack its end: the model stopped there); the text around them is the content.
    A call that is not of a known function, or whose arguments are not JSON, leaves the whole text as content."""
    found = list(_HARMONY_CALL.finditer(text))
    if not found:
        return text, []
    calls = []
    for m in found:
        name, args = m.group(1), m.group(2).strip()
        try:
            obj = json.loads(args)
        except ValueError:
            return text, []
        if name not in names:
            return text, []
        calls.append(ToolCall(name, json.dumps(obj)))
    content = _HARMONY_CALL.sub("", text).strip()
    return content or None, calls


def parse_deepseek_v3(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """DeepSeek's calls after <｜tool▁calls▁begin｜> (module docstring): V3's and R1's `function<｜tool▁sep｜>NAME`
    with the arguments in a ```json fence, or V3.1's `NAME<｜tool▁sep｜>ARGUMENTS`; the last may lack its end (the
    model stopped there). The text before is the content. A call of an unknown function, or whose arguments are not
    JSON, leaves the whole text as content."""
    at = text.find(_DS_CALLS)
    if at < 0:
        return text, []
    calls = []
    for head, body in _DS_BLOCK.findall(text[at:].replace(_DS_CALLS_END, "")):
        if head.strip() == "function":                     # V3: the name, then its arguments fenced
            fenced = _DS_FENCE.match(body)
            if fenced is None:
                return text, []
            name, args = fenced.groups()
        else:
            name, args = head.strip(), body
        try:
            obj = json.loads(args)
        except ValueError:
            return text, []
        if name not in names or not isinstance(obj, dict):
            return text, []
        calls.append(ToolCall(name, json.dumps(obj)))
    content = text[:at].strip()
    return (content or None, calls) if calls else (text, [])


def parse_llama3_json(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """Llama 3.1's JSON tool calls: the whole output is {"name": ..., "parameters": ...} objects (after an
    optional <|python_tag|>, separated by ';' or whitespace). Anything else, or a call of an unknown function,
    leaves the whole text as content."""
    body = text.strip()
    body = body[len(_PYTHON_TAG):].lstrip() if body.startswith(_PYTHON_TAG) else body
    if not body.startswith("{"):
        return text, []
    decoder, at, calls = json.JSONDecoder(), 0, []
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or obj.get("name") not in names:
            return text, []
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append(ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args)))
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _mistral_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args), mistral_call_id())


def parse_mistral(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """What follows [TOOL_CALLS]: a JSON array of {"name", "arguments"} objects (Mistral's v3 tokenizers), or
    name[ARGS]{arguments} after each [TOOL_CALLS] (v11 and later); the text before is the content. A call that is
    not JSON, or of an unknown function, leaves the whole text as content."""
    at = text.find(_TOOL_CALLS)
    if at < 0:
        return text, []
    decoder, calls = json.JSONDecoder(), []
    for part in text[at:].split(_TOOL_CALLS)[1:]:
        part = part.strip()
        if not part:
            continue
        try:
            if part.startswith("["):
                objs, _ = decoder.raw_decode(part)
                found = [_mistral_call(o, names) for o in objs] if isinstance(objs, list) and objs else [None]
            else:
                name, sep, args = part.partition(_ARGS)
                obj, _ = decoder.raw_decode(args.strip()) if sep else (None, 0)
                found = [_mistral_call({"name": name.strip(), "arguments": obj}, names) if sep else None]
        except ValueError:
            return text, []
        if None in found:
            return text, []
        calls += found
    content = text[:at].strip()
    return (content or None, calls) if calls else (text, [])


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _python_value(node: ast.AST) -> Any:
    """A literal argument of a pythonic call (JSON's true/false/null too, which models write)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_python_value(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        return {_python_value(k): _python_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


def parse_pythonic(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """A Python list of calls with keyword arguments, [get_weather(city="Oslo"), get_time(zone="CET")] (inside
    <|python_start|> <|python_end|> for Llama 4), is the whole output. Anything else, a positional argument, a
    value that is not a literal, or an unknown function, leaves the whole text as content."""
    body = text.strip()
    if body.startswith(_PYTHON_START):
        body = body[len(_PYTHON_START):].removesuffix(_PYTHON_END).strip()
    if not (body.startswith("[") and body.endswith("]")):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names
                    and not node.args and all(k.arg is not None for k in node.keywords)):
                return text, []
            calls.append(ToolCall(node.func.id, json.dumps({k.arg: _python_value(k.value) for k in node.keywords})))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return text, []
    return None, calls


def plan(tools: list[dict] | None, tool_choice: Any, parallel: bool, fmt: ToolFormat = ToolFormat()) -> ToolPlan | None:
    """The request's plan, or None when it has no tools (or tool_choice none). Raises ToolError."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise ToolError("tool_choice needs tools", "tool_choice")
        return None
    fns = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ToolError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", f"tools.{i}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ToolError(f"tools[{i}].function.name must match [A-Za-z0-9_-]{{1,64}}", f"tools.{i}.function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                            f"tools.{i}.function.parameters")
        if any(f["name"] == name for f in fns):
            raise ToolError(f"tools[{i}]: function {name!r} is defined twice", f"tools.{i}.function.name")
        fns.append({k: v for k, v in (("name", name), ("description", fn.get("description")),
                                      ("parameters", params)) if v is not None})
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return None
    if choice in ("auto", "required"):
        return ToolPlan(fns, choice, parallel=parallel, format=fmt)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                        '{"name": ...}}', "tool_choice")
    if not any(f["name"] == named for f in fns):
        raise ToolError(f"tool_choice names {named!r}, which is not among the tools", "tool_choice")
    return ToolPlan(fns, "named", named, parallel, fmt)


def render(messages: list[dict[str, Any]], plan_: ToolPlan | None,
           fmt: ToolFormat = ToolFormat()) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The turns for the chat template and the tools to pass it (None: none, or written into the turns).
    A native template gets OpenAI-shaped turns (an assistant's calls with their arguments as objects, tool
    results as `tool` turns); any other, plain role/content turns in Hermes' format (or Llama 3's JSON one)."""
    if fmt.native:
        out = []
        for m in messages:
            turn = {"role": m["role"], "content": m.get("content") or ""}
            if m["role"] == "assistant" and m.get("tool_calls"):
                turn["tool_calls"] = [{"id": c.get("id") or openai_call_id(), "type": "function",
                                       "function": {"name": c["function"]["name"],
                                                    "arguments": _arguments(c["function"]["arguments"])}}
                                      for c in m["tool_calls"]]
            elif m["role"] == "tool":
                turn["tool_call_id"] = m.get("tool_call_id")
            out.append(turn)
        tools = [{"type": "function", "function": t} for t in plan_.tools] if plan_ is not None else None
        return out, tools
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                fn = c["function"]
                args = _arguments(fn["arguments"])
                if fmt.parser == "llama3_json":
                    calls.append(json.dumps({"name": fn["name"], "parameters": args}))
                elif fmt.parser == "mistral":
                    calls.append({"name": fn["name"], "arguments": args})
                elif fmt.parser == "deepseek_v3":             # as DeepSeek-V3's template writes past calls
                    calls.append(f"{_DS_CALL}function{_DS_SEP}{fn['name']}\n```json\n{json.dumps(args)}\n```"
                                 f"{_DS_CALL_END}")
                elif fmt.parser == "pythonic":
                    kwargs = args if isinstance(args, dict) else {}
                    calls.append(f"{fn['name']}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
                else:
                    calls.append(f"{_OPEN}\n{json.dumps({'name': fn['name'], 'arguments': args})}\n{_CLOSE}")
            if fmt.parser == "mistral":
                calls = [_TOOL_CALLS + json.dumps(calls)]
            elif fmt.parser == "pythonic":
                calls = [f"[{', '.join(calls)}]"]
            elif fmt.parser == "deepseek_v3":
                calls = [_DS_CALLS + "".join(calls) + _DS_CALLS_END]
            content = ("; " if fmt.parser == "llama3_json" else "\n").join(([content] if content else []) + calls)
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan_ is not None:
        system = {"llama3_json": SYSTEM_JSON, "mistral": SYSTEM_MISTRAL, "pythonic": SYSTEM_PYTHONIC,
                  "deepseek_v3": SYSTEM_DEEPSEEK}.get(fmt.parser, SYSTEM)
        block = system.format(tools="\n".join(json.dumps({"type": "function", "function": t}) for t in plan_.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _arguments(args: Any) -> Any:
    """A call's arguments as an object where they are JSON text (OpenAI sends text; templates want objects)."""
    if not isinstance(args, str):
        return args
    try:
        return json.loads(args)
    except ValueError:
        return args
