"""OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it: a request is translated into the chat completion it
asks for, served by the same path (templates, tools, structured output, reasoning parsers, admission, the pools),
and the chat answer is shaped back into a Response: output items (reasoning, message, function calls), or streamed
as the Responses events.

- **Input:** a string, or items: messages (text parts; `input_text` / `output_text`), `function_call` and
  `function_call_output` items (a tool round trip), and `reasoning` items (left out: chat templates drop earlier
  thinking). A previous response's `output` can go back in as input, as OpenAI's docs show for stateless use.
- **Request fields:** `instructions` (a system message first), `max_output_tokens`, `temperature`, `top_p`, function
  `tools` with `tool_choice` and `parallel_tool_calls`, `text.format` (text, json_object, json_schema),
  `reasoning.effort` (a template variable), `top_logprobs` / `include: ["message.output_text.logprobs"]`, `metadata`
  (echoed), and vLLM's sampling extras (top_k, seed, stop, ...), each with the chat request's checks.
- **Stateless:** Baton keeps no responses. `store` is accepted and the response says `store: false`;
  `previous_response_id`, `conversation`, `background` and stored `prompt`s are refused by name (a 400).
- **Streaming:** `response.created`, `response.in_progress`, then per item `response.output_item.added`, its deltas
  (`response.reasoning_text.delta`, `response.content_part.added` + `response.output_text.delta`,
  `response.function_call_arguments.delta`) and their `.done` events, and `response.completed` (or
  `response.incomplete` at max_output_tokens) with the whole Response; each event has a `sequence_number`.
"""
from __future__ import annotations

import copy
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from router import openai_protocol as oa

_NAME = "^[A-Za-z0-9_-]{1,64}$"                            # a function's name, as the chat tools' schema has it


class _Part(BaseModel):
    """A piece of the request: fields of OpenAI's that Baton does not read (ids, statuses) are ignored."""
    model_config = ConfigDict(extra="ignore")


class TextPart(_Part):
    type: Literal["input_text", "output_text"]
    text: str


class InputMessage(_Part):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Part):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(_Part):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]


class ReasoningItem(_Part):
    type: Literal["reasoning"]


class FunctionTool(_Part):
    type: Literal["function"]
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceFunction(_Part):
    type: Literal["function"]
    name: str = Field(min_length=1)


class FormatText(_Part):
    type: Literal["text"]


class FormatJSONObject(_Part):
    type: Literal["json_object"]


class FormatJSONSchema(_Part):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class TextConfig(_Part):
    format: FormatText | FormatJSONObject | FormatJSONSchema | None = None


class ReasoningConfig(_Part):
    effort: Literal["low", "medium", "high"] | None = None


# What needs state Baton does not keep: refused by name when set (the document says null).
STATEFUL = {"previous_response_id": "previous_response_id needs stored responses; Baton keeps none: send the whole "
                                    "conversation as input (a previous response's output items can go in as they are)",
            "conversation": "conversations need stored state; Baton keeps none: send the whole conversation as input",
            "prompt": "stored prompt templates are not supported: send the instructions and input",
            "max_tool_calls": "max_tool_calls is not supported"}
NOT_STORED = ("No response {!r}: Baton stores no responses (they are answered, not kept), so none can be retrieved, "
              "deleted or cancelled")
# vLLM's sampling extras the chat request checks and serves, passed on as they are
SAMPLING = ("top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
            "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output", "allowed_token_ids",
            "bad_words", "skip_special_tokens", "logit_bias", "cache_salt", "priority", "request_id")
LOGPROBS = "message.output_text.logprobs"


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem] = \
        Field(json_schema_extra={"minLength": 1, "minItems": 1})
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[Literal["message.output_text.logprobs"]] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool = False
    store: bool = True                 # accepted; nothing is stored (the response says store: false)
    background: Literal[False] = False
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: None = None
    conversation: None = None
    prompt: None = None
    max_tool_calls: None = None


ResponsesRequest = create_model("ResponsesRequest", __base__=_Base,
                                **{n: (oa._Request.model_fields[n].annotation, oa._Request.model_fields[n])
                                   for n in SAMPLING})


def parse(body: Any) -> BaseModel:
    """The Responses request, checked: its own fields here, the chat request's when it is translated."""
    if not isinstance(body, dict):
        raise oa.OpenAIError(400, "the request body must be a JSON object")
    for name, why in STATEFUL.items():
        if body.get(name) is not None:
            raise oa.OpenAIError(400, why, param=name)
    if body.get("background"):
        raise oa.OpenAIError(400, "background responses need stored state; Baton keeps none", param="background")
    if body.get("truncation") not in (None, "disabled"):
        raise oa.OpenAIError(400, "truncation must be disabled: a conversation over the model's length is refused, "
                                  "not cut", param="truncation")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) if err["loc"] else None
        raise oa.OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from e
    if req.input == "" or req.input == []:
        raise oa.OpenAIError(400, "input must not be empty", param="input")
    return req


def _text(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def to_chat(req) -> dict:
    """The chat completion request a Responses request asks for (its body, for oa.parse_request)."""
    messages: list[dict] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    for item in [InputMessage(role="user", content=req.input)] if isinstance(req.input, str) else req.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)              # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    if not messages:
        raise oa.OpenAIError(400, "input has no message to answer (only reasoning items)", param="input")
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream,
                            "parallel_tool_calls": req.parallel_tool_calls,
                            **req.model_dump(include=set(SAMPLING), exclude_unset=True)}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("user", "user")):
        if getattr(req, src) is not None:
            body[dst] = getattr(req, src)
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if isinstance(req.tool_choice, ToolChoiceFunction):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJSONObject):
        body["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, FormatJSONSchema):
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_,
            **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    if req.top_logprobs is not None or LOGPROBS in (req.include or []):
        body.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    return body


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _item_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def _output_text(text: str, logprobs: list | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _message_item(text: str, logprobs: list | None, status: str = "completed") -> dict:
    return {"type": "message", "id": _item_id("msg"), "role": "assistant", "status": status,
            "content": [_output_text(text, logprobs)]}


def _call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _item_id("fc"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


class ResponsesBuilder:
    """The ingress's builder for /v1/responses: a chat ResponseBuilder (`inner`) collects the answer; this shapes it
    as a Response, or its chat chunks as Responses events. It answers what the ingress asks of a builder."""

    def __init__(self, inner: oa.ResponseBuilder, req, cacheable_tokens: int = 0):
        """`cacheable_tokens`: the prompt's tokens in whole KV blocks, which the prefix cache keeps once computed."""
        self.inner, self.rreq, self.req = inner, req, inner.req       # .req: the chat request (its priority, ...)
        self.cacheable = cacheable_tokens
        self.id = inner.id
        self.seq = 0                                 # the events' sequence_number
        self.items: list[dict] = []                  # streamed: the output items so far, each as it stands
        self.open: dict | None = None                # streamed: the item taking deltas
        self.finish: str | None = None

    def add(self, i: int, d) -> list:
        return self.inner.add(i, d)

    # -- the Response ---------------------------------------------------------------------------------
    def _usage(self, chat: dict, reasoning: str) -> dict:
        thinking = len(self.inner.tok.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        cached = chat["prompt_tokens_details"]["cached_tokens"]
        return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {
                    "cached_tokens": cached, "cache_write_tokens": max(0, self.cacheable - cached)},
                "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thinking},
                "total_tokens": chat["total_tokens"]}

    def _response(self, output: list[dict], status: str, usage: dict | None) -> dict:
        r = self.rreq
        fmt = (r.text.format.model_dump(by_alias=True, exclude_none=True) if r.text and r.text.format
               else {"type": "text"})
        choice = (r.tool_choice.model_dump() if isinstance(r.tool_choice, ToolChoiceFunction)
                  else r.tool_choice or "auto")
        return {"id": self.id, "object": "response", "created_at": self.inner.created, "status": status,
                "background": False, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": r.instructions, "max_output_tokens": r.max_output_tokens, "max_tool_calls": None,
                "metadata": r.metadata or {}, "model": self.inner.model, "output": output,
                "parallel_tool_calls": r.parallel_tool_calls, "previous_response_id": None,
                "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
                "store": False, "temperature": r.temperature, "text": {"format": fmt}, "tool_choice": choice,
                "tools": [t.model_dump(exclude_none=True) for t in r.tools or []], "top_logprobs": r.top_logprobs,
                "top_p": r.top_p, "truncation": "disabled", "usage": usage, "user": r.user}

    def final(self) -> dict:
        body = self.inner.final()
        choice = body["choices"][0]
        msg, status = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
        output = []
        if msg.get("reasoning_content"):
            output.append(_reasoning_item(msg["reasoning_content"]))
        if msg.get("content"):
            output.append(_message_item(msg["content"], (choice.get("logprobs") or {}).get("content"), status))
        for c in msg.get("tool_calls") or []:
            output.append(_call_item(c["id"], c["function"]["name"], c["function"]["arguments"]))
        return self._response(output, status, self._usage(body["usage"], msg.get("reasoning_content") or ""))

    # -- streamed -------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def sse(self, event: dict) -> bytes:
        return f"event: {event['type']}\n".encode() + oa.sse(event)

    def sse_error(self, err: oa.OpenAIError) -> bytes:
        e = err.body()["error"]
        return self.sse(self._event("error", code=e.get("code") or e.get("type"), message=e["message"],
                                    param=e.get("param")))

    def end(self) -> bytes:
        return b""                                    # the Responses stream ends with its last event, no [DONE]

    def usage_chunk(self) -> None:
        return None                                   # the usage goes in the final response event

    def first_chunks(self) -> list[dict]:
        r = self._response([], "in_progress", None)
        return [self._event("response.created", response=r), self._event("response.in_progress", response=r)]

    def _start(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        out = [self._event("response.output_item.added", output_index=len(self.items) - 1, item=copy.deepcopy(item))]
        if item["type"] == "message":
            item["content"].append(_output_text("", []))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                                   content_index=0, part=_output_text("", [])))
        return out

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = "incomplete" if self.finish == "length" and item["type"] == "message" else "completed"
        if item["type"] == "reasoning":
            out = [self._event("response.reasoning_text.done", **where, content_index=0,
                               text=item["content"][0]["text"])]
        elif item["type"] == "message":
            part = item["content"][0]
            out = [self._event("response.output_text.done", **where, content_index=0, text=part["text"],
                               logprobs=part["logprobs"]),
                   self._event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            out = [self._event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"])]
        return out + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]

    def _grow(self, kind: str, text: str, logprobs: list) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            out += self._start(_reasoning_item("", "in_progress") if kind == "reasoning"
                               else {**_message_item("", None, "in_progress"), "content": []})
        item, where = self.open, {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "reasoning":
            item["content"][0]["text"] += text
            return out + [self._event("response.reasoning_text.delta", **where, delta=text)]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return out + [self._event("response.output_text.delta", **where, delta=text, logprobs=logprobs)]

    def chunks(self, i: int, d) -> list[dict]:
        out = []
        for chunk in self.inner.chunks(i, d):
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out += self._grow("reasoning", delta["reasoning_content"], [])
                if delta.get("content"):
                    out += self._grow("message", delta["content"], (choice.get("logprobs") or {}).get("content") or [])
                for call in delta.get("tool_calls") or []:
                    fn = call.get("function") or {}
                    if call.get("id"):
                        out += self._close()
                        out += self._start(_call_item(call["id"], fn.get("name") or "", "", "in_progress"))
                    if fn.get("arguments") and self.open is not None and self.open["type"] == "function_call":
                        self.open["arguments"] += fn["arguments"]
                        out.append(self._event("response.function_call_arguments.delta", item_id=self.open["id"],
                                               output_index=len(self.items) - 1, delta=fn["arguments"]))
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
        if d.finished:
            out += self._close()
            status = "incomplete" if self.finish == "length" else "completed"
            thinking = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "reasoning")
            usage = self._usage(self.inner.usage(), thinking)
            out.append(self._event(f"response.{status}", response=self._response(self.items, status, usage)))
        return out
