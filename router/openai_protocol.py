"""The OpenAI wire protocol: request models and their checks, errors in OpenAI's shape, response and
SSE chunk builders. No server here (router/ingress.py serves it).

Decisions: unknown request fields are ignored, as OpenAI and vLLM do; fields that would change the answer and
that Baton does not serve (UNSUPPORTED: suffix, audio, custom logits processors, ...) are refused
with a 400 naming the field rather than silently dropped. Structured output comes as
OpenAI's `response_format` (json_object, json_schema; vLLM's structural_tag) or vLLM's `structured_outputs`
(json, regex, choice, grammar, structural_tag; its older `guided_*` and `structural_tag` fields too), one of them
per request.
presence_penalty and frequency_penalty take OpenAI's range [-2, 2]; repetition_penalty (> 0) is vLLM's.
"""
from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.beam_search import BeamSearchParams
from engine.structured import StructuredOutput
from router.config import LimitsConfig
from router.reasoning import Stream as ReasoningStream, split as split_reasoning
from router.tools import ToolError, ToolFormat, ToolPlan, plan as _tool_plan, render as _render_tools

if TYPE_CHECKING:
    from replica.messages import TokenDelta

SSE_DONE = b"data: [DONE]\n\n"


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "BadRequestError", param: str | None = None,
                 code: str | int | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- requests ---------------------------------------------------------------------------------------
# The JSON schemas the OpenAPI document publishes (/openapi.json) for the fields whose checks are code, not
# pydantic types (their messages name the field as OpenAI's do): a body valid under the document passes the
# checks below, save what only the served model or the limits decide (token ids past the vocabulary, n, a
# tool_choice naming an undefined tool, two structured-output fields at once, a schema the grammar engine
# refuses). tests/test_openai_protocol.py holds the document to the checks.
_STR = {"type": "string"}
_TEXT = {"type": "string", "minLength": 1}
_OBJ = {"type": "object"}
_CONTENT = {"anyOf": [_STR, {"type": "array", "items": {  # ContentPart
    "type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _STR}}}]}
_NO_CALLS = {"tool_calls": {"type": "null"}}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": _STR, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"],
                 "properties": {"name": _STR, "arguments": {"anyOf": [_STR, _OBJ]}}}}}
_CALLS = {"type": "array", "minItems": 1, "items": _TOOL_CALL}
MESSAGE_SCHEMA = {"title": "Message", "anyOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "user", "developer"]}, "content": _CONTENT, **_NO_CALLS}},
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"const": "assistant"}, "content": _CONTENT, "tool_calls": {"anyOf": [_CALLS, {"type": "null"}]}}},
    {"type": "object", "required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [_CONTENT, {"type": "null"}]}, "tool_calls": _CALLS}},
    {"type": "object", "required": ["role", "content", "tool_call_id"], "properties": {
        "role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": {"type": "string", "minLength": 1},
        **_NO_CALLS}}]}
_TOKENS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
PROMPT_SCHEMA = {"title": "Prompt", "anyOf": [
    {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    _TOKENS, {"type": "array", "minItems": 1, "items": _TOKENS}]}
TOOLS_SCHEMA = {"anyOf": [{"type": "null"}, {"type": "array", "items": {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": _STR,
            "parameters": _OBJ, "strict": {"type": ["boolean", "null"]}}}}}}]}
TOOL_CHOICE_SCHEMA = {"anyOf": [{"type": "null"}, {"enum": ["none", "auto", "required"]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _STR}}}}]}
RESPONSE_FORMAT_SCHEMA = {"anyOf": [
    {"type": "null"},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["schema"], "properties": {
            "name": _STR, "description": _STR, "schema": _OBJ, "strict": {"type": ["boolean", "null"]}}}}},
    # vLLM's: xgrammar's structural tag ({"format": ...}), or its older form (structures and triggers)
    {"type": "object", "required": ["type", "format"], "properties": {"type": {"const": "structural_tag"},
                                                                      "format": _OBJ}},
    {"type": "object", "required": ["type", "structures", "triggers"], "properties": {
        "type": {"const": "structural_tag"}, "triggers": {"type": "array", "minItems": 1, "items": _TEXT},
        "structures": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["begin", "end", "schema"], "properties": {
                "begin": _TEXT, "end": _STR, "schema": _OBJ}}}}}]}
LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "null"}, {
    "type": "object", "propertyNames": {"pattern": "^[0-9]+$"},
    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}]}
STRUCTURED_OUTPUTS_SCHEMA = {"anyOf": [{"type": "null"}, {
    "type": "object", "minProperties": 1, "maxProperties": 1, "additionalProperties": False, "properties": {
        "json": {"anyOf": [_OBJ, _TEXT]}, "json_object": {"const": True}, "regex": _TEXT,
        "choice": {"type": "array", "minItems": 1, "items": _TEXT}, "grammar": _TEXT,
        "structural_tag": {"anyOf": [_OBJ, {**_TEXT, "contentMediaType": "application/json"}]}}}]}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)     # 1e999 parses as inf: refused too
    model: str
    max_tokens: int | None = None
    # unset: the model's generation config default (engine/generation_config.py), else OpenAI's / vLLM's
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = Field(default=1, json_schema_extra={"minimum": 1})      # the most: limits.max_n, checked below
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)      # int64, as OpenAI
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)              # vLLM's: outputs before a stop may end the request
    include_stop_str_in_output: bool = False              # vLLM's: the stop string (or stop token's text) kept
    allowed_token_ids: list[int] | None = Field(default=None, json_schema_extra={      # vLLM's
        "minItems": 1, "items": {"type": "integer", "minimum": 0}})
    bad_words: list[str] | None = Field(default=None, json_schema_extra={"items": _TEXT})        # vLLM's
    skip_special_tokens: bool = True                      # vLLM's: special tokens' text left out
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)    # vLLM's: each prompt token's, top-n
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)    # vLLM's: keep the prompt's last k tokens
    cache_salt: str | None = Field(default=None, min_length=1)        # vLLM's: prefix-cache hits only within a salt
    priority: int = Field(default=0, ge=-(2**31), le=2**31 - 1)       # vLLM's: lower is scheduled first
    # vLLM's: the response's id (chatcmpl-/cmpl- before it), else a random one
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    return_tokens_as_token_ids: bool = False              # vLLM's: logprob tokens as "token_id:{id}"
    # OpenAI's: token id (as a string) -> a bias in [-100, 100] added to its logit
    logit_bias: Annotated[dict[str, float] | None, WithJsonSchema(LOGIT_BIAS_SCHEMA)] = None
    user: str | None = None
    # OpenAI: {"type": "text" | "json_object" | "json_schema"}
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(RESPONSE_FORMAT_SCHEMA)] = None
    # vLLM: {"json" | "regex" | "choice" | "grammar": ...}
    structured_outputs: Annotated[dict[str, Any] | None, WithJsonSchema(STRUCTURED_OUTPUTS_SCHEMA)] = None
    guided_json: dict[str, Any] | str | None = None        # vLLM's older names of the same
    guided_regex: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    guided_choice: list[str] | None = Field(default=None, json_schema_extra={"minItems": 1, "items": _TEXT})
    guided_grammar: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    structural_tag: str | None = Field(default=None, json_schema_extra={                   # vLLM's older field
        "minLength": 1, "contentMediaType": "application/json"})
    use_beam_search: bool = False                         # vLLM's: n beams (engine/beam_search.py), n choices
    length_penalty: float = 1.0                           # vLLM's: a beam's score is its logprob / length ** this

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One turn; its published schema (MESSAGE_SCHEMA) spells out what each role needs, which _check enforces."""
    model_config = ConfigDict(extra="ignore", json_schema_extra=lambda s: (s.clear(), s.update(MESSAGE_SCHEMA)))
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None          # assistant: the calls it made
    tool_call_id: str | None = None                          # tool: the call this result answers


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(json_schema_extra={"minItems": 1})
    add_generation_prompt: bool = True                    # vLLM's: false leaves the assistant turn's header out
    continue_final_message: bool = False                  # vLLM's: the last (assistant) message goes on
    chat_template_kwargs: dict[str, Any] | None = None    # vLLM's: the chat template's own variables
    # vLLM's: a Jinja template in place of the server's, run only where the server trusts them (chat section)
    chat_template: str | None = Field(default=None, json_schema_extra={"minLength": 1})
    documents: list[dict[str, Any]] | None = None         # vLLM's: retrieved documents, for a template that takes them
    reasoning_effort: Literal["low", "medium", "high"] | None = None   # OpenAI's: a template variable, as vLLM
    include_reasoning: bool = True                        # vLLM's: false leaves reasoning_content out
    add_special_tokens: bool = False                      # vLLM's: the tokenizer's own (BOS) on top of the template
    echo: bool = False                                    # vLLM's: the last message's content before the answer,
                                                          # when it is the answer's role (continuing it)
    # OpenAI's deprecated form of tools: refused (a 400)
    functions: Annotated[list[dict[str, Any]] | None, WithJsonSchema({"type": "null"})] = None
    function_call: Annotated[str | dict[str, Any] | None, WithJsonSchema({"type": "null"})] = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(TOOLS_SCHEMA)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool = True


class CompletionRequest(_Request):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema(PROMPT_SCHEMA)]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False                                    # the prompt before the completion (and its logprobs)
    add_special_tokens: bool = True                       # vLLM's: false encodes a text prompt without BOS
    best_of: int | None = Field(default=None, ge=1)       # refused (a 400) unless it equals n
    # refused (a 400) unless empty
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "null"}, {"const": ""}]})] = None


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: OpenAI's fields, and vLLM's add_special_tokens, truncate_prompt_tokens, normalize and
    priority; or vLLM's chat form: `messages` (one conversation, rendered by the chat template, without the
    assistant's turn unless add_generation_prompt) in place of `input`."""
    model_config = ConfigDict(extra="ignore")
    model: str
    input: Annotated[str | list[str] | list[int] | list[list[int]] | None, WithJsonSchema(PROMPT_SCHEMA)] = None
    messages: list[Message] | None = None
    add_generation_prompt: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)    # Matryoshka models only (engine/pooling.py)
    user: str | None = None
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    normalize: bool = True
    priority: int = 0


class ScoreRequest(BaseModel):
    """POST /score, /v1/score (vLLM's, for an embedding model): text_1 scored against text_2, one against many or
    pairwise."""
    model_config = ConfigDict(extra="ignore")
    model: str
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class RerankRequest(BaseModel):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, Jina's and Cohere's): documents ranked by relevance to the query."""
    model_config = ConfigDict(extra="ignore")
    model: str
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)      # unset: every document
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    priority: int = 0


class TokenizeRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's; `model` may be left out: the served model); the chat form
    ({"model", "messages", "tools"}) is read as a chat completion request, so its count is the prompt tokens that
    request would have."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text (`model` may be left out: the served model)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's)."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's)."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=256)


def parse_body(body: Any, model: type[BaseModel]) -> BaseModel:
    """A small JSON body checked against its pydantic model; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) if err["loc"] else None
        raise OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from e


# Fields of OpenAI's or vLLM's API that would change the answer and that Baton does not serve: a value other than
# their default is a 400 naming the field, never silently dropped (other unknown fields are ignored, as vLLM does).
# field -> (is the value refused, why)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "audio": (lambda v: v is not None, "audio output is not supported"),
    "modalities": (lambda v: v is not None and v != ["text"], "modalities other than [\"text\"] are not supported"),
    "web_search_options": (lambda v: v is not None, "web search is not supported"),
    # vLLM's
    "logits_processors": (lambda v: bool(v), "custom logits processors are not supported"),
    "vllm_xargs": (lambda v: bool(v), "vllm_xargs (custom extensions) are not supported"),
    "guided_whitespace_pattern": (lambda v: v is not None, "guided_whitespace_pattern is not supported"),
    "guided_decoding_backend": (lambda v: v not in (None, "auto", "xgrammar"),
                                "guided_decoding_backends other than xgrammar (auto) are not supported"),
    "mm_processor_kwargs": (lambda v: v is not None, "multimodal inputs are not supported"),
    "kv_transfer_params": (lambda v: v is not None, "kv_transfer_params (vLLM's external prefill/decode hand-off) is "
                                                     "not supported: Baton hands the KV over between its own pools"),
}


def _refuse_unsupported(body: dict, chat: bool) -> None:
    for name, (refused, why) in UNSUPPORTED.items():
        if name in body and refused(body[name]):
            raise OpenAIError(400, why, param=name)


def parse_request(body: Any, chat: bool, limits: LimitsConfig = LimitsConfig()) -> ChatCompletionRequest | CompletionRequest:
    """The request, checked against `limits` (the defaults, or the cluster config's that the ingress passes)."""
    if not isinstance(body, dict):
        raise OpenAIError(400, "the request body must be a JSON object")
    _refuse_unsupported(body, chat)
    try:
        req = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err["loc"]) if err["loc"] else None
        raise OpenAIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param) from e
    _check(req, chat, limits)
    return req


def _check(req, chat: bool, limits: LimitsConfig) -> None:
    if chat and not req.messages:
        raise OpenAIError(400, "messages must be a non-empty list", param="messages")
    for i, m in enumerate(req.messages if chat else []):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise OpenAIError(400, f"messages[{i}].content is required", param=f"messages.{i}.content")
        if m.role == "tool" and not m.tool_call_id:
            raise OpenAIError(400, f"messages[{i}]: a tool message needs tool_call_id", param=f"messages.{i}.tool_call_id")
        for j, c in enumerate(m.tool_calls or []):
            fn = c.get("function") if isinstance(c, dict) else None
            if m.role != "assistant" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                    or not isinstance(fn.get("arguments"), (str, dict)):
                raise OpenAIError(400, f"messages[{i}].tool_calls[{j}] must be an assistant's "
                                       f'{{"type": "function", "function": {{"name", "arguments"}}}}',
                                  param=f"messages.{i}.tool_calls.{j}")
    if not chat and (req.prompt == [] or req.prompt == ""):
        raise OpenAIError(400, "prompt must not be empty", param="prompt")
    if not 1 <= req.n <= limits.max_n:
        raise OpenAIError(400, f"n must be between 1 and {limits.max_n}, got {req.n}", param="n")
    stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
    if len(stops) > limits.max_stop_sequences:
        raise OpenAIError(400, f"at most {limits.max_stop_sequences} stop sequences are allowed, got "
                               f"{len(stops)}", param="stop")
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise OpenAIError(400, f"a stop sequence may have at most {limits.max_stop_chars} characters",
                          param="stop")
    if req.prompt_logprobs is not None and req.stream:
        raise OpenAIError(400, "prompt_logprobs are not streamed; ask without stream", param="prompt_logprobs")
    if not chat and req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(400, f"best_of is not supported (it may only equal n, {req.n}); ask for n choices "
                               f"and pick among them", param="best_of")
    if not chat and req.suffix:
        raise OpenAIError(400, "suffix (insertion) is not supported", param="suffix")
    if chat and (req.functions is not None or req.function_call is not None):
        param = "functions" if req.functions is not None else "function_call"
        raise OpenAIError(400, f"{param} is OpenAI's deprecated form of tool calling and is not supported; "
                               f"use tools and tool_choice", param=param)


# What a beam search cannot honour: its rounds rank the model's own log-probabilities, one token at a time
BEAM_SEARCH_REFUSES = ("stop", "stop_token_ids", "logprobs", "top_logprobs", "prompt_logprobs", "echo", "min_tokens",
                       "logit_bias", "bad_words", "allowed_token_ids", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "response_format", "structured_outputs", "guided_json", "guided_regex",
                       "guided_choice", "guided_grammar", "structural_tag", "tools", "tool_choice")


def beam_search_params(req, max_tokens: int) -> BeamSearchParams | None:
    """vLLM's use_beam_search: n beams of max_tokens (the request's, checked by to_sampling_params), n choices; None
    without it. A field beam search would drop is a 400 naming it (vLLM ignores them)."""
    if not req.use_beam_search:
        if req.length_penalty != 1.0:
            raise OpenAIError(400, "length_penalty is beam search's: set use_beam_search", param="length_penalty")
        return None
    for name in BEAM_SEARCH_REFUSES:
        v = getattr(req, name, None)
        if v not in (None, False, 0, 0.0, [], {}, "") and not (name == "response_format" and v.get("type") == "text"):
            raise OpenAIError(400, f"{name} is not served with use_beam_search (beam search ranks the model's own "
                                   f"log-probabilities)", param=name)
    params = BeamSearchParams(beam_width=req.n, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                              length_penalty=req.length_penalty)
    try:
        params.validate()
    except InvalidRequestError as e:
        raise OpenAIError(400, f"n: {e}", param="n") from e
    return params


def structured_spec(req) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured-output spec and the field it came in (None, None: free text)."""
    legacy = {k.removeprefix("guided_"): v for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                                     "structural_tag") if (v := getattr(req, k)) is not None}
    legacy_name = next((k if k == "structural_tag" else f"guided_{k}" for k in legacy), "")
    given = [name for name, v in (("response_format", req.response_format), ("structured_outputs",
                                                                           req.structured_outputs),
                                  (legacy_name, legacy)) if v]
    if len(given) > 1:
        raise OpenAIError(400, f"give one of {' and '.join(given)}, not both", param=given[1])
    if not given:
        return None, None
    param = given[0]
    try:
        if req.response_format:
            kind = req.response_format.get("type")
            if kind == "text":
                return None, None
            if kind == "json_object":
                return StructuredOutput(json_object=True), param
            if kind == "json_schema":
                js = req.response_format.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, dict):
                    raise OpenAIError(400, "response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format.json_schema.schema")
                return StructuredOutput(json=schema), param
            if kind == "structural_tag":
                return StructuredOutput(structural_tag=req.response_format), param
            raise OpenAIError(400, f"response_format.type must be text, json_object, json_schema or structural_tag, "
                                   f"got {kind!r}", param="response_format.type")
        spec = req.structured_outputs or legacy
        unknown = sorted(set(spec) - {"json", "json_object", "regex", "choice", "grammar", "structural_tag"})
        if unknown:
            raise OpenAIError(400, f"{param}: unknown key(s) {', '.join(unknown)}; one of json, json_object, "
                                   f"regex, choice, grammar, structural_tag", param=param)
        return StructuredOutput(**spec), param
    except InvalidRequestError as e:
        raise OpenAIError(400, f"{param}: {e}", param=param) from e


def check_prompt_length(num_tokens: int, limits: LimitsConfig) -> None:
    limit = limits.max_prompt_tokens
    if limit is not None and num_tokens > limit:
        raise OpenAIError(400, f"the prompt has {num_tokens} tokens; this server accepts at most {limit}",
                          param="messages", code="context_length_exceeded")


def check_token_ids(ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    if not ids:
        raise OpenAIError(400, f"{'an' if param[0] in 'aeiou' else 'a'} {param} must not be empty", param=param)
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise OpenAIError(400, f"{param} token ids must be in [0, {vocab_size})", param=param)


class ApiKeys:
    """Bearer keys from an environment variable (comma-separated); none set: every request passes. A presented
    key is hashed and compared with every stored digest in constant time (hmac.compare_digest, no early exit),
    so timing says nothing about the keys; keys are never logged or echoed."""

    def __init__(self, env_name: str):
        keys = [k.strip() for k in os.environ.get(env_name, "").split(",") if k.strip()]
        self._digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def check(self, authorization: str | None) -> None:
        if not self._digests:
            return
        scheme, _, token = (authorization or "").partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(presented, d)
        if scheme.lower() != "bearer" or not ok:
            raise OpenAIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                              "invalid_request_error", code="invalid_api_key")


def check_model(requested: str, served: list[str]) -> None:
    if requested not in served:
        raise OpenAIError(404, f"The model `{requested}` does not exist. Served: {served}", "NotFoundError",
                          "model", "model_not_found")


def tool_plan(req, fmt: ToolFormat = ToolFormat()) -> ToolPlan | None:
    """A chat request's tools and tool_choice, checked (router/tools.py); None when it calls no tools."""
    if not isinstance(req, ChatCompletionRequest):
        return None
    try:
        return _tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls, fmt)
    except ToolError as e:
        raise OpenAIError(400, str(e), param=e.param) from e


def chat_messages(req: ChatCompletionRequest, tools: ToolPlan | None = None,
                  fmt: ToolFormat = ToolFormat()) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """The conversation's turns for the chat template, and the tools to hand the template (None: none, or
    written into the turns): router/tools.py renders them for the model's format."""
    return _render_tools([{"role": "system" if m.role == "developer" else m.role, "content": _text(m.content),
                           "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id} for m in req.messages],
                         tools, fmt)


def message_text(m: Message) -> str:
    """A message's text (its text parts joined)."""
    return _text(m.content)


def _chat_echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text, when the answer has its role (the assistant's, or with
    add_generation_prompt false the last message's own), so the answer reads as that message continued."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    if req.add_generation_prompt and last.role != "assistant":
        return ""
    return _text(last.content)


def _text(content: str | list[ContentPart] | None) -> str:
    """A message's content as text (its parts joined)."""
    return "" if content is None else content if isinstance(content, str) else "".join(p.text for p in content)


def completion_prompts(req: CompletionRequest | EmbeddingRequest) -> list[str | list[int]]:
    """A completion's prompts, or an embedding request's inputs: one text or token list, or a list of them."""
    p = req.input if isinstance(req, EmbeddingRequest) else req.prompt
    if isinstance(p, str):
        return [p]
    if p and all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


def prompt_only(req) -> bool:
    """echo with max_tokens 0 (OpenAI's legacy way to score a text): the prompt and its logprobs, no completion."""
    return isinstance(req, CompletionRequest) and req.echo and req.max_tokens == 0


def logit_bias(req, vocab_size: int) -> dict[int, float] | None:
    """The request's logit_bias with token ids as integers, checked against the vocabulary (OpenAI's keys are
    strings); its values are checked with the other sampling parameters."""
    if not req.logit_bias:
        return None
    out = {}
    for key, bias in req.logit_bias.items():
        tok = int(key) if key.isascii() and key.isdigit() and len(key) <= 12 else -1     # no 10^5-digit int()
        if not 0 <= tok < vocab_size:
            raise OpenAIError(400, f"logit_bias: {key!r} is not a token id of this model (an integer in "
                                   f"[0, {vocab_size}))", param="logit_bias")
        out[tok] = bias
    return out


def to_sampling_params(req, max_model_len: int, prompt_len: int, index: int = 0,
                       structured: StructuredOutput | None = None, vocab_size: int | None = None,
                       defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The engine's parameters for choice `index` (seeded choices get seed + index), with OpenAI's checks;
    `structured`: the request's checked spec (structured_spec, compiled once by the ingress); `vocab_size`: the
    model's, for logit_bias's keys (None: not checked here; the engine checks them); `defaults`: the model's
    generation config (SamplingParams fields, engine/generation_config.py) for the fields the request leaves unset,
    max_tokens among them (at most the room left)."""
    defaults = defaults or {}
    room = max_model_len - prompt_len
    if room <= 0:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens. However, your "
                               f"prompt has {prompt_len} tokens. Please reduce the length of the prompt.",
                          param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                          code="context_length_exceeded")
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    if prompt_only(req):
        max_tokens = 1                 # the engine samples one token after a prompt; the answer leaves it out
    if max_tokens is not None and max_tokens <= 0:
        raise OpenAIError(400, f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}",
                          param="max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise OpenAIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                               f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
                               f"{max_tokens} in the completion). Please reduce the length of the prompt or "
                               f"completion.", param="max_tokens", code="context_length_exceeded")
    if vocab_size is not None and req.allowed_token_ids and not all(0 <= t < vocab_size for t in req.allowed_token_ids):
        raise OpenAIError(400, f"allowed_token_ids must be token ids of this model (in [0, {vocab_size}))",
                          param="allowed_token_ids")
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
    prompt_logprobs = req.prompt_logprobs
    if not isinstance(req, ChatCompletionRequest) and req.echo and req.logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)    # echo: the prompt's tokens come with theirs
    try:
        unset = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
        chosen = {k: getattr(req, k) if getattr(req, k) is not None else defaults.get(k, v) for k, v in unset.items()}
        if max_tokens is None:
            max_tokens = min(room, defaults.get("max_tokens", room))
        return SamplingParams(**chosen, presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              seed=None if req.seed is None else req.seed + index, max_tokens=max_tokens,
                              stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                              ignore_eos=req.ignore_eos, min_tokens=req.min_tokens,
                              include_stop_str_in_output=req.include_stop_str_in_output, cache_salt=req.cache_salt,
                              allowed_token_ids=req.allowed_token_ids, bad_words=req.bad_words,
                              skip_special_tokens=req.skip_special_tokens,
                              logit_bias=logit_bias(req, vocab_size if vocab_size is not None else 2**63),
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)
    except InvalidRequestError as e:
        param = str(e).split(" ", 1)[0]
        raise OpenAIError(400, str(e), param=param if param in type(req).model_fields else None) from e


# -- responses --------------------------------------------------------------------------------------
def sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def tokenizer_info_body(tokenizer, max_model_len: int) -> dict:
    """GET /tokenizer_info (vLLM's): what a client needs to tokenize as the server does (lm-evaluation-harness
    reads it, with /tokenize and /detokenize, to use the server's tokenizer)."""
    return {"tokenizer_class": type(tokenizer).__name__, "eos_token": tokenizer.eos_token,
            "bos_token": tokenizer.bos_token, "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": getattr(tokenizer, "chat_template", None), "model_max_length": max_model_len,
            "vocab_size": len(tokenizer), "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False))}


def tokenize_body(ids: list[int], max_model_len: int, token_strs: list[str] | None = None) -> dict:
    """/tokenize's answer, vLLM's fields."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": token_strs}


def embedding_body(rid: str, created: int, model: str, vectors: list, encoding_format: str,
                   prompt_tokens: int) -> dict:
    """/v1/embeddings' answer: each input's vector in order, as floats or as OpenAI's base64 (the float32
    values' little-endian bytes, which the openai client asks for by default and decodes)."""
    def encode(v):
        return v.tolist() if encoding_format == "float" else base64.b64encode(v.astype("<f4").tobytes()).decode()
    return {"id": rid, "object": "list", "created": created, "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def score_pairs(req: ScoreRequest) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs a score request asks for, as vLLM pairs them: one text_1 against each text_2,
    else the two lists item by item (of one length)."""
    t1 = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    t2 = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    if not t1 or not t2:
        raise OpenAIError(400, "text_1 and text_2 must not be empty", param="text_1" if not t1 else "text_2")
    if len(t1) == 1:
        return [(t1[0], b) for b in t2]
    if len(t1) != len(t2):
        raise OpenAIError(400, f"text_1 has {len(t1)} texts and text_2 {len(t2)}: give one text_1, or as many as "
                               f"text_2", param="text_2")
    return list(zip(t1, t2))


def score_body(rid: str, created: int, model: str, scores: list[float], prompt_tokens: int) -> dict:
    return {"id": rid, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "score", "score": sc} for i, sc in enumerate(scores)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}


def rerank_body(rid: str, model: str, req: RerankRequest, scores: list[float], tokens: int) -> dict:
    """The documents by score, best first, the request's top_n of them (each with its index in the request)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:req.top_n]
    return {"id": rid, "model": model, "usage": {"total_tokens": tokens},
            "results": [{"index": i, "relevance_score": scores[i],
                         **({"document": {"text": req.documents[i]}} if req.return_documents else {})}
                        for i in order]}


def models_body(names: list[str], max_model_len: int, adapters: dict[str, str] | None = None) -> dict:
    """/v1/models: the served model(s), then each LoRA adapter (name -> path) with the base as its `parent`
    and its path as `root` (vLLM's fields)."""
    now = int(time.time())
    data = [{"id": n, "object": "model", "created": now, "owned_by": "baton", "root": n, "parent": None,
             "max_model_len": max_model_len} for n in names]
    data += [{"id": a, "object": "model", "created": now, "owned_by": "baton", "root": path, "parent": names[0],
              "max_model_len": max_model_len} for a, path in (adapters or {}).items()]
    return {"object": "list", "data": data}


class ResponseBuilder:
    """Collects one request's choices from the orchestrator's token deltas; emits OpenAI bodies or chunks."""

    def __init__(self, rid: str, created: int, model: str, chat: bool, req, tokenizer, tools: ToolPlan | None = None,
                 prompts: list[list[int]] | None = None, reasoning: str = "none"):
        """`prompts`: each prompt's token ids (choice i answers prompt i // n), for echo and prompt logprobs;
        `reasoning`: the reasoning parser (router/reasoning.py) that splits a chat answer's thinking out."""
        self.id, self.created, self.model, self.chat, self.req, self.tok = rid, created, model, chat, req, tokenizer
        self.prompts = prompts or []
        self.echo = not chat and req.echo
        self.prompt_only = prompt_only(req)      # echo, max_tokens 0: the sampled token is left out
        self.plps: dict[int, list] = {}          # prompt logprobs per choice (vLLM's, or echo's), from its first delta
        self.tools = tools if chat else None     # tool calls are parsed out of each choice's text
        self.streamed: dict[int, int] = {}       # tools, streaming: characters of content sent per choice
        self.held: dict[int, list] = {}          # tools, streaming: logprob items not sent yet
        self.text: dict[int, list[str]] = {}
        self.lps: dict[int, list] = {}
        self.finish: dict[int, str] = {}
        self.prompt_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.want_lp = bool(req.logprobs) if chat else req.logprobs is not None
        self.generated: dict[int, int] = {}      # tokens per choice so far (continuous usage stats)
        self.chat_echo = _chat_echo(req) if chat else ""   # vLLM's chat echo: the message the answer continues
        # the answer's role, as vLLM names it: the assistant's, or without the assistant's header (add_generation_prompt
        # false) the role of the last message, which the answer continues
        self.role = "assistant" if not chat or req.add_generation_prompt or not req.messages else req.messages[-1].role
        self.reasoning = reasoning if chat else "none"
        self.streams: dict[int, ReasoningStream] = {}   # reasoning, streaming: each choice's split so far

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def add(self, i: int, d: TokenDelta) -> list:
        """Record a delta of choice i; returns its logprob items (token text, logprob, top)."""
        first = i not in self.text
        if d.prompt_logprobs is not None:
            self.plps[i] = d.prompt_logprobs
        if self.prompt_only:
            d = replace(d, token_ids=[], text="", logprobs=None, completion_tokens=0,
                        finish_reason="length" if d.finished else None)
        items = self._logprobs(d) if self.want_lp else []
        if first and self.echo:                   # the prompt before the completion, with its logprobs
            self.text[i] = [self._prompt_text(i)]
            items = self._prompt_items(i) + items if self.want_lp else items
        self.text.setdefault(i, []).append(d.text)
        self.lps.setdefault(i, []).extend(items)
        self.generated[i] = self.generated.get(i, 0) + len(d.token_ids)
        if d.finished:
            self.finish[i] = "length" if d.finish_reason == "length" else "stop"
            self.prompt_tokens[i] = d.prompt_tokens
            self.completion_tokens[i] = d.completion_tokens
            self.cached_tokens[i] = d.cached_tokens
        return items

    def _prompt_text(self, i: int) -> str:
        """echo: the prompt as given, or its token ids decoded (given as ids, or cut by truncate_prompt_tokens)."""
        given = completion_prompts(self.req)[i // self.req.n]
        if isinstance(given, str) and not self.req.truncate_prompt_tokens:
            return given
        return self.tok.decode(self.prompts[i // self.req.n])

    def _prompt_items(self, i: int) -> list:
        """echo with logprobs: the prompt's tokens as logprob items (the first has none, as OpenAI's)."""
        ids, lps = self.prompts[i // self.req.n], self.plps.get(i) or []
        return [self._item(tok, lps[p] if p < len(lps) else None) for p, tok in enumerate(ids)]

    def _item(self, tok: int, lp: dict[int, float] | None) -> tuple:
        """A token as a logprob item: its text, its logprob and the top (text, logprob) pairs (None, None: none).
        With return_tokens_as_token_ids (vLLM's) a token's text is "token_id:{id}": every token identifiable, even
        one whose bytes are not valid UTF-8 alone."""
        text = self._token(tok)
        if lp is None:
            return text, None, None
        top = sorted(lp.items(), key=lambda kv: -kv[1])
        return text, lp.get(tok, top[0][1] if top else 0.0), [(self._token(t), v) for t, v in top]

    def _token(self, tok: int) -> str:
        return f"token_id:{tok}" if self.req.return_tokens_as_token_ids else self.tok.decode([tok])

    def _prompt_logprobs_body(self, i: int) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: {logprob, decoded}}."""
        if self.req.prompt_logprobs is None:
            return None
        return [None if lp is None else {str(t): {"logprob": v, "decoded_token": self.tok.decode([t])}
                                         for t, v in sorted(lp.items(), key=lambda kv: -kv[1])}
                for lp in self.plps.get(i, [])]

    def _logprobs(self, d: TokenDelta) -> list:
        return [self._item(tok, lp) for tok, lp in zip(d.token_ids, d.logprobs or []) if lp is not None]

    def _lp_body(self, items: list) -> dict | None:
        if not self.want_lp:
            return None
        if self.chat:
            n = self.req.top_logprobs or 0
            return {"content": [{"token": t, "logprob": v, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())}
                                                  for a, b in top[:n]]} for t, v, top in items]}
        offsets, pos = [], 0
        for t, _, _ in items:
            offsets.append(pos)
            pos += len(t)
        n = self.req.logprobs or 0
        return {"tokens": [t for t, _, _ in items], "token_logprobs": [v for _, v, _ in items],
                "top_logprobs": [None if top is None else dict(top[:n]) for _, _, top in items] if n else None,
                "text_offset": offsets}

    def usage(self) -> dict:
        prompt = sum(v for i, v in self.prompt_tokens.items() if i % self.req.n == 0)   # once per prompt, not per choice
        completion = sum(self.completion_tokens.values())
        if self.req.stream and len(self.completion_tokens) < self._num_choices():      # so far (continuous stats)
            prompt = sum(len(p) for p in self.prompts)
            completion = sum(self.completion_tokens.get(i, g) for i, g in self.generated.items())
        cached = sum(v for i, v in self.cached_tokens.items() if i % self.req.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def final(self) -> dict:
        choices = []
        for i in sorted(self.text):
            text = "".join(self.text[i])
            lp = self._lp_body(self.lps.get(i, []))
            if self.chat:
                thought, text = split_reasoning(self.reasoning, text)
                finish = self.finish.get(i, "stop")
                message = {"role": self.role,
                           "content": self.chat_echo + (text or "") if text is not None or self.chat_echo else None}
                if thought is not None and self.req.include_reasoning:
                    message["reasoning_content"] = thought
                if self.tools is not None and text is not None:
                    content, calls = self.tools.parse(text)
                    if calls:
                        message.update(content=self.chat_echo + (content or "") or None,
                                       tool_calls=[c.as_dict() for c in calls])
                        finish = "tool_calls" if finish != "length" else finish
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": self.finish.get(i, "stop")})
            if self.req.prompt_logprobs is not None and not self.chat:      # vLLM's place for completions
                choices[-1]["prompt_logprobs"] = self._prompt_logprobs_body(i)
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if self.req.prompt_logprobs is not None and self.chat:                # and for chat (one prompt)
            body["prompt_logprobs"] = self._prompt_logprobs_body(0)
        return body

    # -- streaming --------------------------------------------------------------------------------
    def _chunk(self, choices: list, usage: dict | None = None) -> dict:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.req.include_usage:
            body["usage"] = usage if usage is not None or not self.req.continuous_usage else self.usage()
        return body

    def first_chunks(self) -> list[dict]:
        if not self.chat:
            return []
        out = [self._chunk([{"index": i, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(self._num_choices())])]
        if self.chat_echo:
            out.append(self._chunk([{"index": i, "delta": {"content": self.chat_echo}, "logprobs": None,
                                     "finish_reason": None} for i in range(self._num_choices())]))
        return out

    def _num_choices(self) -> int:
        return self.req.n * (1 if self.chat else len(completion_prompts(self.req)))

    def chunks(self, i: int, d: TokenDelta) -> list[dict]:
        before = len(self.text.get(i, []))
        items = self.add(i, d)
        if self.reasoning != "none":
            return self._reasoning_chunks(i, d, items)
        if self.tools is not None:
            return self._tool_chunks(i, d, items)
        lp = self._lp_body(items)
        finish = self.finish.get(i) if d.finished else None
        text = "".join(self.text[i][before:])       # this delta's text as add() kept it (echo: the prompt first)
        if not text and finish is None and not items:
            return []
        if self.chat:
            choice = {"index": i, "delta": {"content": text} if text else {}, "logprobs": lp,
                      "finish_reason": finish}
        else:
            choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
        return [self._chunk([choice])]

    def _reasoning_chunks(self, i: int, d: TokenDelta, items: list) -> list[dict]:
        """A chat choice under a reasoning parser: its thinking streams as `reasoning_content` deltas, then the
        answer as content (through the tool-call logic under tools: it reads the answer alone)."""
        stream = self.streams.setdefault(i, ReasoningStream(self.reasoning))
        thought, content = stream.step("".join(self.text[i]), d.finished)
        thought = thought if self.req.include_reasoning else ""
        if self.tools is not None:
            lead = [self._chunk([{"index": i, "delta": {"reasoning_content": thought}, "logprobs": None,
                                  "finish_reason": None}])] if thought else []
            return lead + self._tool_chunks(i, d, items, stream.content)
        finish = self.finish.get(i) if d.finished else None
        if not thought and not content and finish is None and not items:
            return []
        delta = {**({"reasoning_content": thought} if thought else {}), **({"content": content} if content else {})}
        return [self._chunk([{"index": i, "delta": delta, "logprobs": self._lp_body(items), "finish_reason": finish}])]

    def _tool_chunks(self, i: int, d: TokenDelta, items: list, text: str | None = None) -> list[dict]:
        """A chat choice under tools: a named call streams its arguments as they come; under auto, content
        streams up to what may open a tool call; the calls themselves go out once the choice ends, as
        OpenAI's deltas (id, type and name, then the arguments). `text`: the answer so far (default: all the
        choice's text; under a reasoning parser, what follows the thinking)."""
        t, text = self.tools, "".join(self.text[i]) if text is None else text
        self.held.setdefault(i, []).extend(items)
        finish = self.finish.get(i) if d.finished else None
        out = []

        def chunk(delta: dict, reason: str | None = None) -> dict:
            lp, self.held[i] = self._lp_body(self.held[i]), []
            return self._chunk([{"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}])
        if t.mode == "named":                           # the call opens with its answer (after any thinking)
            if i not in self.streamed and (text or finish is not None):
                self.streamed[i] = 0
                call = {"index": 0, "id": t.call_id(), "type": "function",
                        "function": {"name": t.name, "arguments": ""}}
                out.append(chunk({"tool_calls": [call]}))
            sent = self.streamed.get(i, 0)
            if len(text) > sent:
                out.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": text[sent:]}}]}))
                self.streamed[i] = len(text)
            if finish is not None:
                out.append(chunk({}, "tool_calls" if finish != "length" else finish))
            return out
        sent = self.streamed.get(i, 0)
        if t.mode == "auto" and finish is None:
            upto = t.holdback(text)
            if upto > sent:
                out.append(chunk({"content": text[sent:upto]}))
                self.streamed[i] = upto
            return out
        if finish is None:
            return out
        content, calls = t.parse(text)
        if not calls:                                   # no call after all: the rest of the text is content
            if len(text) > sent:
                out.append(chunk({"content": text[sent:]}))
            return out + [chunk({}, finish)]
        for j, c in enumerate(calls):
            out.append(chunk({"tool_calls": [{"index": j, "id": c.id, "type": "function",
                                              "function": {"name": c.name, "arguments": ""}}]}))
            out.append(chunk({"tool_calls": [{"index": j, "function": {"arguments": c.arguments}}]}))
        return out + [chunk({}, "tool_calls" if finish != "length" else finish)]

    def usage_chunk(self) -> dict | None:
        return self._chunk([], self.usage()) if self.req.include_usage else None

    # -- the stream's framing (router/responses.py frames its events its own way) -----------------
    def sse(self, chunk: dict) -> bytes:
        return sse(chunk)

    def sse_error(self, err: OpenAIError) -> bytes:
        return sse(err.body())

    def end(self) -> bytes:
        return SSE_DONE
