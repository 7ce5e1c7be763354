"""The router's sections of the cluster config (cluster.ClusterConfig composes them): how the prefill pool is
chosen, when a prompt is prefilled remotely, what one request may ask for, admission control, API keys.
The ingress and the request routers receive these objects as they are; their defaults are written here once."""
from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.structured import GRAMMAR_COMPILE_TIMEOUT_S, MAX_GRAMMAR_BYTES


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RouterConfig(_Section):
    """How the prefill pool is chosen (the decode pool always goes by KV pressure)."""
    policy: Literal["prefix_aware", "pow2"] = Field(
        "prefix_aware", description="prefix_aware: the replica caching most of the prompt, load-corrected; "
                                    "pow2: Ray Serve's default power-of-two choices, for comparison")
    load_weight: float = Field(1.0, ge=0, description="Weight of a replica's queued prefill tokens against the "
                                                      "prompt tokens it would have to compute")
    imbalance_threshold_tokens: int = Field(8192, ge=0, description="When replicas' queued prefill tokens differ "
                                                                    "by more, route least-loaded first")
    index_sync_interval_s: float = Field(0.01, gt=0, description="Least seconds between two pulls of the KV-event "
                                                                 "index by each router while it changes (each pull "
                                                                 "is a long poll: an idle index costs no polling)")
    host_tier_hit_weight: float = Field(0.9, ge=0, le=1, description="What a prompt block cached only in a "
                                        "replica's host KV tier (kv_offloading_size) is worth to both pools' "
                                        "routers, against one in its device cache (1: the same; 0: nothing): "
                                        "copying it back costs a fraction of computing it")
    lora_load_cost_tokens: int = Field(256, ge=0, description="What loading a LoRA adapter costs a replica that "
                                       "does not hold it, in prompt tokens of prefill work: both pools' routers "
                                       "add it to such a replica's cost, so an adapter's requests go where it is "
                                       "loaded unless that replica is this much busier")


class DisaggregationConfig(_Section):
    """When a prompt is worth a remote prefill and a KV transfer."""
    min_remote_prefill_tokens: int = Field(
        64, ge=0, description="A prompt whose uncached part (on the best decode replica) is at most this many "
                              "tokens is prefilled by the decode replica itself; longer ones go to the prefill pool")


class MigrationConfig(_Section):
    """Requests that outlive their decode replica: when it dies mid-stream, the ingress continues the stream
    on another replica from the tokens already sent (prompt + those tokens recomputed, mostly from the prefix
    cache); the client sees one unbroken stream."""
    max_moves: int = Field(3, ge=0, description="Times one request may move to another decode replica; one "
                                                "more failure ends its stream with the error event (0: never "
                                                "move, as before)")


class LimitsConfig(_Section):
    """What one request may ask for; beyond it the ingress answers 400 (413 for the body) and runs nothing."""
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body in bytes (413 beyond): 1 MiB "
                                                              "holds a 100k-token prompt as text or token ids")
    max_prompt_tokens: int | None = Field(None, ge=1, description="Longest prompt in tokens (default: the model's "
                                                                  "max_model_len less one token of output)")
    max_n: int = Field(8, ge=1, le=128, description="Most choices (`n`) per request: each is a sequence in "
                                                    "the decode pool")
    max_embedding_inputs: int = Field(2048, ge=1, description="Most inputs one /v1/embeddings request may embed "
                                                               "(OpenAI's limit: 2,048); each is a prompt in a pool")
    max_stop_sequences: int = Field(4, ge=0, le=64, description="Most stop strings per request (OpenAI allows 4; "
                                                                "each is checked after every token)")
    max_stop_chars: int = Field(256, ge=1, description="Longest stop string in characters")
    max_grammar_bytes: int = Field(MAX_GRAMMAR_BYTES, ge=16, description="Largest structured-output spec (JSON "
                                   "schema, regex, choice list, grammar, structural tag or forced tool call) in "
                                   "bytes; the ingress "
                                   "and both pools' engines enforce it")
    grammar_compile_timeout_s: float = Field(GRAMMAR_COMPILE_TIMEOUT_S, gt=0, description="A structured-output "
                                             "spec that takes longer to compile is refused (400)")


class ToolsConfig(_Section):
    """Tool calling on chat completions (router/tools.py)."""
    parser: Literal["auto", "hermes", "llama3_json", "mistral", "pythonic", "harmony", "deepseek_v3"] = Field(
        "auto", description="How `auto` tool calls are read from the model's output, as vLLM's parsers of the same "
        "names: hermes (<tool_call> JSON blocks: Qwen2.5, Qwen3, SmolLM2, Hermes), llama3_json (Llama 3.1's "
        "{\"name\", \"parameters\"} JSON), mistral ([TOOL_CALLS] and a JSON array, or name[ARGS]{...}: Mistral, "
        "Magistral, Devstral), pythonic ([fn(arg=value), ...]: Llama 3.2 and 4 with pythonic templates, ToolACE), "
        "harmony (gpt-oss's commentary messages to functions.NAME; with reasoning.parser gpt_oss), deepseek_v3 "
        "(DeepSeek-V3, R1 and V3.1's calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜>); "
        "auto: mistral for a chat template that writes [TOOL_CALLS], pythonic for one that teaches the pythonic "
        "form, harmony for gpt-oss's, deepseek_v3 for DeepSeek's, llama3_json for one in Llama 3's JSON tool "
        "format, else hermes")


class ChatConfig(_Section):
    """Chat templates at the ingress, as vLLM's --chat-template and --trust-request-chat-template."""
    template: str | None = Field(None, description="The chat template of every chat request (and of /tokenize's "
                                 "messages) in place of the model's own: a Jinja file, read when the config is, or "
                                 "the template's text; for a model whose tokenizer has none, or to change it")
    trust_request_template: bool = Field(False, description="Run the chat_template a request brings (vLLM's "
                                         "--trust-request-chat-template); it renders in transformers' sandboxed "
                                         "Jinja, which a hostile template can still keep busy, so the default "
                                         "refuses such a request with a 400")

    @field_validator("template")
    @classmethod
    def _file_or_text(cls, v: str | None) -> str | None:
        return None if v is None else chat_template_text(v)


def chat_template_text(v: str) -> str:
    """A chat template given as a file (its text) or as the text itself, when it reads as a template (vLLM's
    rule for --chat-template); else ValueError."""
    if os.path.isfile(v):
        with open(v, encoding="utf-8") as f:
            return f.read()
    if not any(c in v for c in "{}\n"):
        raise ValueError(f"{v!r} is neither a file nor a Jinja template")
    return v


class ReasoningConfig(_Section):
    """Reasoning models' thinking on chat completions (router/reasoning.py), as vLLM's --reasoning-parser."""
    parser: Literal["none", "deepseek_r1", "qwen3", "gpt_oss"] = Field(
        "none", description="How a chat answer's thinking (between <think> and </think>) is split out into "
        "`reasoning_content`: deepseek_r1 (DeepSeek-R1 and its distills: everything before </think>), qwen3 (Qwen3, "
        "QwQ: only between both tags), gpt_oss (gpt-oss's harmony messages: the analysis channel is the reasoning, "
        "the final channel the content, calls to functions tool calls; special tokens' text is kept for it); none "
        "keeps it in the content. Under a parser, structured output and forced "
        "tool calls shape the answer alone: their grammar starts after the </think> token (or from the first token "
        "when the prompt closed its thinking), which the tokenizer must have as one token, as vLLM's parsers do; "
        "under gpt_oss after <|channel|>final<|message|>")


class AdmissionConfig(_Section):
    """Admission control at the ingress (router/admission.py): beyond capacity a request is answered 429 with
    Retry-After at once instead of joining a queue that would miss its deadline anyway."""
    enabled: bool = Field(True, description="Refuse requests the cluster cannot start in time (429); off: "
                                            "every valid request queues")
    ttft_slo_s: float = Field(5.0, gt=0, description="Seconds a request may wait for its first token: one whose "
                                                     "predicted wait (prompt tokens queued ahead of it and its "
                                                     "own, over the measured prefill rate) exceeds it gets a 429")
    max_queued_prompt_tokens: int | None = Field(None, ge=1, description="Hard cap on prompt tokens admitted "
                                                                        "but not yet past their first token, "
                                                                        "per ingress replica (default: none; the "
                                                                        "SLO rule alone)")
    kv_budget: float = Field(1.0, gt=0, description="Fraction of the decode pool's KV cache that admitted "
                                                    "requests' tokens (prompt and generated so far) may fill; "
                                                    "beyond it new requests get a 429 (above 1 lets the engines' "
                                                    "preemption absorb bursts)")
    max_retry_after_s: int = Field(30, ge=1, description="Largest Retry-After the ingress advertises")


class AuthConfig(_Section):
    """Optional API keys: clients send `Authorization: Bearer <key>`; keys live in the environment, not here."""
    api_keys_env: str = Field("BATON_API_KEYS", min_length=1, description="Environment variable holding the "
                                                                          "accepted keys, comma-separated; unset or "
                                                                          "empty: no authentication (bind to "
                                                                          "127.0.0.1 then)")
    protect_metrics: bool = Field(False, description="Require a key on /metrics too (/health is always open, "
                                                     "for probes)")


class LoRAConfig(_Section):
    """LoRA adapters served beside the base model (engine/lora.py; each pool's max_loras, max_lora_rank and
    max_cpu_loras size its engines). A request names an adapter in `model`."""
    enabled: bool = Field(False, description="Serve LoRA adapters (on when `adapters` names any)")
    adapters: dict[str, str] = Field(default_factory=dict, description="Adapters served from start-up: name -> "
                                     "directory with PEFT's adapter_config.json and adapter_model.safetensors, "
                                     "readable by every replica")
    runtime_updates: bool = Field(True, description="Allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                                                    "(vLLM's endpoints; API keys guard them when set)")

    @property
    def on(self) -> bool:
        return self.enabled or bool(self.adapters)
