"""ClusterConfig: the one schema of a Baton cluster (pydantic), loaded from one YAML file.

    model, served_model_name, dtype, device, mode, host, port
    ingress:         num_replicas, num_cpus, max_ongoing_requests
    prefill, decode: num_replicas | autoscaling {bounds, delays, cooldown, hysteresis, targets, SLOs
                     (cluster/autoscaling.py)}, num_cpus, num_gpus, memory, max_ongoing_requests,
                     graceful_shutdown_timeout_s, health_check_period_s, health_check_timeout_s, access_log,
                     engine {EngineConfig knobs, tensor_parallel_size among them}
    coupling:        mode (measured | fixed | off), ratio, smoothing
    router:          policy, load_weight, imbalance_threshold_tokens, index_sync_interval_s, host_tier_hit_weight
    disaggregation:  min_remote_prefill_tokens
    migration:       max_moves
    transfer:        backend, ttl_s, ucx_tls
    limits, tools (parser), admission, auth

The sections a lower package reads live next to it (router/config.py, kvtransfer/config.py); this module
composes them into the one schema. Every field has a description; a bad file raises one ConfigError listing
each problem with its path, unknown keys with a suggestion. `baton serve` flags override a few fields
(with_overrides); build_app (cluster/app.py) hands each deployment its sections as they are (the pydantic
objects, a pool's EngineConfig) and passes deployment_options on to Ray Serve unchanged.

GPUs per replica are its TP size: num_gpus is 0 (no GPU) or engine.tensor_parallel_size (a fraction at TP 1),
anything else is refused. A TP replica asks Serve for a placement group, one bundle per rank packed on one
node (STRICT_PACK), as Ray Serve LLM does: the replica actor is rank 0 in bundle 0, and its worker actors
(replica/tp_workers.py) take bundles 1..TP-1.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from cluster.autoscaling import Autoscaling, Coupling, DecodeAutoscaling, PrefillAutoscaling, policy_kwargs
from engine.config import DEFAULT_GPU_KV_FRACTION, EngineConfig
from engine.errors import ConfigError
from engine.kv_layout import KV_CACHE_DTYPES
from engine.quant import QUANTIZATIONS
from engine.spec.config import SpeculativeConfig
from kvtransfer.config import TransferConfig
from replica.names import INGRESS, POOLS
from router.config import (AdmissionConfig, AuthConfig, ChatConfig, DisaggregationConfig, LimitsConfig, LoRAConfig,
                           MigrationConfig, ReasoningConfig, RouterConfig, ToolsConfig)

CLUSTER_LEVEL_ENGINE_KEYS = ("model", "dtype", "device")
# EngineConfig fields the cluster sets itself: a TP replica's workers are Ray actors in its placement group
# and enable_lora follows the cluster's `lora` section
CLUSTER_SET_ENGINE_KEYS = ("distributed_executor_backend", "enable_lora")
# A replica without a GPU of its own gets a fixed, small KV cache instead of the engine's 2 GiB CPU
# default: 512 MiB is ~11k tokens of SmolLM2-135M in fp32 (46 KB a token), room for one full 8k
# context or 64 sequences of ~180 tokens, and two pools then hold 1 GiB of RAM between them, not 4.
POOL_KV_CACHE_BYTES_WITHOUT_GPU = 512 << 20
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def worker_bundle(with_gpu: bool) -> dict[str, float]:
    """The placement-group bundle of one tensor-parallel worker (rank >= 1; replica/tp_workers.py takes it)."""
    return {"CPU": 1.0, "GPU": 1.0} if with_gpu else {"CPU": 1.0}


class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _knob(name: str, text: str, **constraints: Any) -> Any:
    """A pool engine knob: unset (None) means the engine's own default, named in the description."""
    default = _ENGINE_DEFAULTS[name]
    return Field(None, description=text if default is None else f"{text} (engine default {default!r})",
                 **constraints)


class EngineKnobs(_Schema):
    """A pool's EngineConfig knobs (engine/config.py, vLLM's names); unset ones keep the engine's default.
    model, dtype and device are cluster-level: one value for both pools."""
    tokenizer: str | None = _knob("tokenizer", "Tokenizer directory (default: the model's own)")
    load_format: Literal["auto", "safetensors", "dummy"] | None = _knob(
        "load_format", "auto, safetensors, or dummy (random weights: benchmark a model without its checkpoint)")
    quantization: Literal[QUANTIZATIONS] | None = _knob(
        "quantization", "Weights: auto (a GGUF model, the default included, and a GPTQ, AWQ, FP8 or "
                        "compressed-tensors checkpoint run packed, on CPU and CUDA, each TP rank holding its share "
                        "packed), none (the model's dtype; dequantizes those), gguf, gptq, awq, compressed-tensors "
                        "(llm-compressor's FP8, int8 and packed W4A16/W8A16), int8 (weight-only, quantized at load), "
                        "fp8 (e4m3 weights with a scale per channel, quantized at load; FP8 GEMMs with per-token "
                        "activations)")
    block_size: int | None = _knob("block_size", "Tokens per KV block, a power of two; the same in both pools "
                                                 "(blocks move between them whole)")
    max_num_seqs: int | None = _knob("max_num_seqs", "Most sequences in one running batch")
    max_num_batched_tokens: int | None = _knob("max_num_batched_tokens", "Token budget of one engine step "
                                                                          "(prefill chunks plus decodes)")
    max_model_len: int | None = _knob("max_model_len", "Longest prompt plus output, in tokens "
                                                       "(default: the model's limit, at most 8192)")
    enable_prefix_caching: bool | None = _knob("enable_prefix_caching", "Reuse the KV blocks of prompt "
                                                                        "prefixes already computed")
    enable_chunked_prefill: bool | None = _knob("enable_chunked_prefill", "Split long prompts over steps so "
                                                                          "running decodes keep going")
    kv_cache_memory: int | float | None = _knob(
        "kv_cache_memory", "KV cache size: bytes (an integer) or a fraction of free device memory (a float in "
                           "(0, 1]). Unset: 512 MiB in a pool with num_gpus 0, else "
                           f"{DEFAULT_GPU_KV_FRACTION} of free GPU memory")
    num_kv_blocks: int | None = _knob("num_kv_blocks", "Exact KV block count; overrides kv_cache_memory", ge=1)
    kv_offloading_size: float | None = _knob(
        "kv_offloading_size", "GiB of host memory per replica (summed over its TP ranks) for a second KV tier: "
                              "prefix blocks the KV cache evicts are kept there and copied back on a hit instead "
                              "of recomputed (0: off)", ge=0)
    kv_cache_dtype: Literal[tuple(KV_CACHE_DTYPES)] | None = _knob(
        "kv_cache_dtype", "KV cache format: auto (the model's dtype), int8 or fp8 (e4m3): a byte a value and a scale "
                          "per token and head, about a quarter of fp32's bytes and half of bf16's, moved as is "
                          "between the pools; the same in both pools")
    seed: int | None = _knob("seed", "Seed of dummy weights and of requests that give none")
    enforce_eager: bool | None = _knob("enforce_eager", "On CUDA, run every step eagerly: no CUDA graphs for "
                                                        "decode and verify steps (they are captured at start-up)")
    tensor_parallel_size: int | None = _knob(
        "tensor_parallel_size", "Ranks one replica's model is sharded over, one device each, packed on one node; "
                                "a pool with GPUs gives each replica this many (num_gpus)", ge=1)
    enable_expert_parallel: bool | None = _knob(
        "enable_expert_parallel", "A mixture of experts under tensor parallelism: each rank holds whole experts "
                                  "(a run of them) rather than a share of every expert's units, as vLLM's "
                                  "--enable-expert-parallel; no effect on dense models or at TP 1")
    speculative_config: dict[str, Any] | None = _knob(
        "speculative_config", "Speculative decoding, vLLM-style: {method: ngram | draft_model | layer_skip | eagle | "
                              "eagle3 | mtp, num_speculative_tokens, ...} (off when unset)")

    generation_config: str | None = _knob(
        "generation_config", "The model's generation_config.json, as vLLM reads it: auto (its sampling fields "
                             "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens) are the defaults of "
                             "requests that leave them unset), vllm (no such defaults), or a directory holding a "
                             "generation_config.json to use instead. Its eos_token_id ends requests in every mode")
    override_generation_config: dict[str, Any] | None = _knob(
        "override_generation_config", "Sampling fields set over the generation config's, e.g. {temperature: 0.6, "
                                      "max_new_tokens: 512}")
    pooling_type: Literal["last", "mean", "cls"] | None = _knob(
        "pooling_type", "How /v1/embeddings pools a prompt's final hidden states: last (decoder embedding models), "
                        "mean or cls. Unset: the model's sentence-transformers Pooling config, else last")
    max_loras: int | None = _knob("max_loras", "LoRA adapters one step can run (device slots); more wait their "
                                               "turn (with the cluster's `lora` section on)", ge=1)
    max_lora_rank: int | None = _knob("max_lora_rank", "Largest LoRA rank accepted", ge=1)
    max_cpu_loras: int | None = _knob("max_cpu_loras", "LoRA adapters kept loaded in host memory, at least "
                                                       "max_loras (engine default: max_loras)", ge=1)

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _bytes_or_fraction(cls, v: Any) -> Any:
        if v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            return v
        raise ValueError(f"must be bytes (a positive integer) or a fraction of free device memory "
                         f"(a float in (0, 1]), got {v!r}")

    @field_validator("speculative_config")
    @classmethod
    def _speculative(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        try:
            SpeculativeConfig.parse(v)          # the engine's own checks and messages
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("speculative_config: ")) from None
        return v

    @model_validator(mode="after")
    def _engine_accepts(self) -> EngineKnobs:
        EngineConfig(**self.set_knobs())        # block_size a power of two, positive limits, ...
        return self

    def set_knobs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class PoolConfig(_Schema):
    """One pool of engine replicas (prefill or decode): how many, what Ray gives each, its engine knobs."""
    num_replicas: int | None = Field(None, ge=1, description="Fixed replica count: 1 unless autoscaling is "
                                                             "set (set one or the other)")
    autoscaling: Autoscaling | None = Field(None, description="Scale between min_replicas and max_replicas "
                                                              "on the pool's load signals (cluster/autoscaling.py)")
    num_cpus: float = Field(1.0, ge=0, description="Logical CPUs Ray reserves for each replica")
    num_gpus: float = Field(0.0, ge=0, description="GPUs Ray reserves for each replica: its "
                                                   "engine.tensor_parallel_size (one per rank; at TP 1 a fraction "
                                                   "shares a GPU); 0 runs it without a GPU of its own")
    memory: int | None = Field(None, gt=0, description="Bytes of memory Ray reserves for each replica "
                                                      "(default: none reserved)")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each replica "
                                                                          "needs, e.g. {baton_decode: 1} to place "
                                                                          "it on the nodes that advertise them "
                                                                          "(the Helm chart's worker groups do)")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests Serve sends one replica at once "
                                                            "(running plus queued in its engine)")
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0, description="Seconds a replica being removed (scale "
                                                                       "down, redeploy, node drain) may take to "
                                                                       "stop: a prefill replica finishes its "
                                                                       "requests; a decode replica hands its "
                                                                       "streams over (KV pull) and keeps its KV "
                                                                       "until pulled (at most the transfer TTL). "
                                                                       "The Helm chart gives pods 30 s more")
    health_check_period_s: float = Field(2.0, gt=0, description="Seconds between Serve's health checks of a "
                                                                "replica (engine thread alive). A replica that "
                                                                "died leaves routing and the prefix index when "
                                                                "the next check fails; Serve's default is 10")
    health_check_timeout_s: float = Field(10.0, gt=0, description="Seconds a health check may take before the "
                                                                 "replica counts as failed and is replaced")
    access_log: bool = Field(False, description="Serve's access log line for every call into this pool's "
                                                "replicas (the ingress logs each HTTP request either way). Off: "
                                                "Ray Serve 2.60 keeps every such record alive in the replica "
                                                "(about 1.5 KB per call, without bound; the soak found it)")
    engine: EngineKnobs = Field(default_factory=EngineKnobs, description="EngineConfig knobs of every "
                                                                         "replica in the pool")

    @model_validator(mode="before")
    @classmethod
    def _one_replica_count(cls, d: Any) -> Any:
        if not isinstance(d, dict):
            return d
        if d.get("autoscaling") is not None:
            if d.get("num_replicas") is not None:
                raise ValueError("set num_replicas or autoscaling, not both")
        elif d.get("num_replicas") is None:
            d = {**d, "num_replicas": 1}
        return d

    def engine_config(self, cluster: ClusterConfig) -> EngineConfig:
        """The EngineConfig of this pool's replicas: the cluster's model/dtype/device + its knobs."""
        kw = {"model": cluster.model, "dtype": cluster.dtype, "device": cluster.device, **self.engine.set_knobs(),
              "max_grammar_bytes": cluster.limits.max_grammar_bytes,           # one limit for ingress and pools
              "grammar_compile_timeout_s": cluster.limits.grammar_compile_timeout_s,
              "enable_lora": cluster.lora.on}
        if self.num_gpus == 0 and "kv_cache_memory" not in kw and "num_kv_blocks" not in kw:
            kw["kv_cache_memory"] = POOL_KV_CACHE_BYTES_WITHOUT_GPU
        if self.tensor_parallel_size > 1:       # TP workers: Ray actors in the replica's placement group
            kw["distributed_executor_backend"] = "ray"
        return EngineConfig(**kw)

    @property
    def tensor_parallel_size(self) -> int:
        return self.engine.tensor_parallel_size or _ENGINE_DEFAULTS["tensor_parallel_size"]

    def tp_problems(self, name: str) -> list[str]:
        """What in this pool (named `name`) disagrees with its TP size, each with its key's path: a replica with
        GPUs has one per rank; a TP replica without GPUs still reserves something for rank 0's bundle."""
        tp, gpus = self.tensor_parallel_size, self.num_gpus
        if gpus and gpus != tp and not (tp == 1 and gpus < 1):          # at TP 1 a fraction shares a GPU
            return [f"{name}.num_gpus: {gpus:g} but {name}.engine.tensor_parallel_size is {tp}: a replica takes "
                    f"one GPU per rank (set both to the GPUs it should use, or num_gpus 0 for none)"]
        if tp > 1 and not any(self.placement_group_bundles()[0].values()):   # Ray refuses an empty bundle
            return [f"{name}.num_cpus: 0 but {name}.engine.tensor_parallel_size is {tp} without GPUs: rank 0's "
                    f"placement-group bundle must reserve something (a CPU)"]
        return []

    def placement_group_bundles(self) -> list[dict[str, float]]:
        """One bundle per TP rank, as Ray Serve LLM asks for them: rank 0's holds the replica actor (its CPUs,
        memory, custom resources and GPU); each further rank's worker actor takes {GPU: 1, CPU: 1}, or
        {CPU: 1} on a pool without GPUs."""
        gpu = {"GPU": 1.0} if self.num_gpus else {}
        first = {"CPU": self.num_cpus, **gpu, **self._actor_extras(), **self.resources}
        return [first] + [worker_bundle(bool(gpu)) for _ in range(self.tensor_parallel_size - 1)]

    def cpus_per_replica(self) -> float:
        """Logical CPUs one replica takes: its own and, with TP > 1, its workers'."""
        return sum(b.get("CPU", 0.0) for b in self.placement_group_bundles())

    def _actor_extras(self) -> dict[str, Any]:
        return {"memory": self.memory} if self.memory is not None else {}

    def deployment_options(self, policy: dict[str, Any] | None = None) -> dict[str, Any]:
        """Ray Serve deployment options: the replica count (or autoscaling_config with Baton's policy and
        `policy` as its kwargs), resources, concurrency; with TP > 1 a placement group per replica, packed on one
        node, whose bundle 0 the replica actor (rank 0) takes."""
        tp = self.tensor_parallel_size
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": min(self.num_gpus, 1.0) if tp > 1
                                 else self.num_gpus, **self._actor_extras()}
        if self.resources:
            actor["resources"] = dict(self.resources)
        opts: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests,
                                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
                                "health_check_period_s": self.health_check_period_s,
                                "health_check_timeout_s": self.health_check_timeout_s,
                                "logging_config": {"enable_access_log": self.access_log}}
        if tp > 1:
            opts |= {"placement_group_bundles": self.placement_group_bundles(),
                     "placement_group_strategy": "STRICT_PACK"}        # NCCL between ranks wants one node
        if self.autoscaling is None:
            opts["num_replicas"] = self.num_replicas
        else:
            opts["autoscaling_config"] = {**self.autoscaling.ray_config(), "policy": {
                "policy_function": "cluster.autoscaling:PoolPolicy", "policy_kwargs": policy or {}}}
        return opts


class PrefillPoolConfig(PoolConfig):
    """The prefill pool: computes prompts' KV and hands it to the decode pool."""
    autoscaling: PrefillAutoscaling | None = Field(None, description="Scale on queued prompt tokens and TTFT "
                                                                     "between min_replicas and max_replicas")


class DecodePoolConfig(PoolConfig):
    """The decode pool: pulls the KV (or prefills short prompts itself) and streams tokens."""
    autoscaling: DecodeAutoscaling | None = Field(None, description="Scale on KV utilisation, running sequences "
                                                                    "and ITL between min_replicas and max_replicas")
    stream_interval_ms: float = Field(
        0.0, ge=0, le=1000, description="Send a stream's tokens at most once per this many milliseconds, the "
        "tokens made meanwhile in one message (the first token goes at once; the last may wait out the interval). "
        "0: every step's tokens as soon as they are made (a stream whose reader falls behind still gets what "
        "piled up in one message). "
        "On hosts where the serving path's CPU competes with the engine's, 20-50 trades smoothness for tokens/s "
        "(Ray Serve LLM batches at 50 ms; vLLM's stream_interval counts tokens)")
    stream_channels: bool = Field(
        True, description="Send the tokens one engine step made for all the streams of one ingress replica in one "
        "message: each ingress replica opens a channel on each decode replica it streams from, and a request's "
        "tokens after the first go through it (vLLM's engine core sends its API server one batch a step); each "
        "channel takes one of the decode replica's max_ongoing_requests. "
        "false: each request's own Serve call carries its tokens, a message a step each")


class IngressConfig(_Schema):
    """The HTTP front door (OpenAI API): parses, tokenizes and routes; each replica keeps the routing index."""
    num_replicas: int = Field(1, ge=1, description="Ingress replicas")
    num_cpus: float = Field(0.0, ge=0, description="Logical CPUs Ray reserves for each ingress replica; 0 so "
                                                   "that one CPU per pool replica fits a small machine (the "
                                                   "ingress mostly waits on the pools)")
    max_ongoing_requests: int = Field(1024, ge=1, description="Requests one ingress replica holds at once (each "
                                                              "until its last token streams); Serve's default "
                                                              "of 5 would cap the whole cluster at 5")
    resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each ingress "
                                                                          "replica needs, to place it on the nodes "
                                                                          "that advertise them (default: anywhere)")
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0, description="Seconds an ingress replica being removed "
                                                                       "(node drain, redeploy) may take to stop: "
                                                                       "it stops taking requests and finishes the "
                                                                       "streams it holds, which may be waiting on "
                                                                       "a decode replica moving with it (Serve's "
                                                                       "default of 20 cuts them). The Helm "
                                                                       "chart's worker pods wait 30 s more than "
                                                                       "this or their pool's, the longer")

    def deployment_options(self) -> dict[str, Any]:
        actor: dict[str, Any] = {"num_cpus": self.num_cpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        return {"num_replicas": self.num_replicas, "ray_actor_options": actor,
                "max_ongoing_requests": self.max_ongoing_requests,
                "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s}


class ClusterConfig(_Schema):
    """A whole Baton cluster: the model, both pools, routing and the KV hand-off."""
    model: str | None = Field(None, description="HF directory, .gguf file or dummy shape name "
                                                "(default SmolLM2-135M-Instruct)")
    served_model_name: str | None = Field(None, description="Name in /v1/models and in requests "
                                                            "(default: the model's file or directory name)")
    dtype: Literal["auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"] = Field(
        "auto", description="Weights and KV cache; auto: bfloat16 on CUDA, float32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where engines run; auto: CUDA if the "
                                                                       "replica sees a GPU, else CPU")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: a prefill pool and a decode pool; colocated: the decode "
                                     "pool prefills too (small deployments, the benchmark baseline) and the "
                                     "prefill section must be absent")
    host: str = Field("127.0.0.1", description="HTTP bind address: only this machine by default; 0.0.0.0 serves "
                                               "others (containers, Kubernetes), with API keys set (auth)")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="The HTTP ingress deployment")
    prefill: PrefillPoolConfig | None = Field(default_factory=PrefillPoolConfig, description="The prefill pool "
                                                                                             "(disaggregated mode only)")
    decode: DecodePoolConfig = Field(default_factory=DecodePoolConfig, description="The decode pool (both modes)")
    coupling: Coupling = Field(default_factory=Coupling, description="How autoscaling ties the two pools' sizes "
                                                                     "together (when both autoscale)")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Prefill routing")
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig,
                                                 description="When to prefill remotely (ignored when colocated)")
    migration: MigrationConfig = Field(default_factory=MigrationConfig, description="Streams that continue on "
                                                                                    "another decode replica")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="KV transfer between the pools")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Per-request limits at the ingress")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="Tool calling on chat completions")
    chat: ChatConfig = Field(default_factory=ChatConfig, description="Chat templates at the ingress")
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig, description="Reasoning models' thinking "
                                                                                    "on chat completions")
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig, description="Admission control (429 "
                                                                                     "beyond capacity) at the "
                                                                                     "ingress")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="API keys at the ingress")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="LoRA adapters served beside the model")

    @model_validator(mode="before")
    @classmethod
    def _colocated_has_no_prefill(cls, d: Any) -> Any:
        if isinstance(d, dict) and d.get("mode") == "colocated":
            if d.get("prefill") is not None:
                raise ValueError("prefill: mode colocated has no prefill pool (the decode pool prefills); "
                                 "remove the prefill section or set mode: disaggregated")
            d = {**d, "prefill": None}
        return d

    @model_validator(mode="after")
    def _gpus_are_the_tp_size(self) -> ClusterConfig:
        pools = [(name, getattr(self, name)) for name in POOLS if getattr(self, name) is not None]
        problems = [p for name, pool in pools for p in pool.tp_problems(name)]
        if problems:
            raise ValueError("\n  ".join(problems))
        return self

    @model_validator(mode="after")
    def _pools_fit_together(self) -> ClusterConfig:
        if self.mode == "disaggregated":
            if self.prefill is None:
                raise ValueError("prefill: mode disaggregated needs a prefill pool")
            for knob in ("block_size", "kv_cache_dtype"):
                values = {name: getattr(self.engine_config(name), knob) for name in POOLS}
                if values["prefill"] != values["decode"]:
                    raise ValueError(f"prefill.engine.{knob} ({values['prefill']}) and decode.engine.{knob} "
                                     f"({values['decode']}) must match: KV blocks move between the pools whole")
        return self

    # -- loading and saving -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, source: str = "cluster config") -> ClusterConfig:
        if d is not None and not isinstance(d, dict):
            raise ConfigError(f"invalid {source}: expected a mapping of keys, got {type(d).__name__}")
        try:
            return cls.model_validate(d or {})
        except ValidationError as e:
            raise ConfigError(f"invalid {source}:\n" + _explain(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        try:
            d = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read cluster config {path}: {e}") from None
        return cls.from_dict(d, source=f"cluster config {path}")

    def to_yaml(self) -> str:
        """Every field that has a value; from_yaml reads it back equal."""
        return yaml.safe_dump(self._dump(), sort_keys=False)

    def _dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)     # None is every optional field's default

    def with_overrides(self, model: str | None = None, prefill_replicas: int | None = None,
                       decode_replicas: int | None = None, port: int | None = None, chat_template: str | None = None,
                       trust_request_chat_template: bool | None = None) -> ClusterConfig:
        """A copy with `baton serve` flags applied (None keeps the value); a replica count replaces autoscaling."""
        d = self._dump()
        if model is not None:
            d["model"] = model
        if port is not None:
            d["port"] = port
        if chat_template is not None:
            d["chat"] = {**d.get("chat", {}), "template": chat_template}
        if trust_request_chat_template is not None:
            d["chat"] = {**d.get("chat", {}), "trust_request_template": trust_request_chat_template}
        for name, n in (("prefill", prefill_replicas), ("decode", decode_replicas)):
            if n is not None:
                if getattr(self, name) is None:
                    raise ConfigError(f"--{name}-replicas: mode {self.mode} has no {name} pool")
                d[name] = {k: v for k, v in d[name].items() if k != "autoscaling"} | {"num_replicas": n}
        return ClusterConfig.from_dict(d, source="cluster config after command-line overrides")

    # -- what the builder needs -------------------------------------------------------------------
    def model_name(self) -> str:
        """The served model name: served_model_name, else the model's file or directory name."""
        if self.served_model_name:
            return self.served_model_name
        from engine.loader import DEFAULT_MODEL
        return Path(self.model).name.removesuffix(".gguf") if self.model else DEFAULT_MODEL

    def pool(self, name: str) -> PoolConfig:
        p = getattr(self, name) if name in POOLS else None
        if p is None:
            raise ConfigError(f"this config has no {name} pool (mode {self.mode})")
        return p

    def engine_config(self, pool: str) -> EngineConfig:
        return self.pool(pool).engine_config(self)

    def deployment_options(self, name: str, state_actor: str | None = None) -> dict[str, Any]:
        """Ray Serve options (`.options(**...)`) of the `ingress`, `prefill` or `decode` deployment.
        state_actor: the cluster state actor's name, where the autoscaler exports its decisions."""
        if name == INGRESS:
            return self.ingress.deployment_options()
        pool = self.pool(name)
        policy = None
        if pool.autoscaling is not None:
            policy = policy_kwargs(name, pool.autoscaling, self.coupling, state_actor,
                                   self.engine_config(name).max_num_seqs)
        opts = pool.deployment_options(policy)
        if self.transfer.backend == "nixl" and self.transfer.ucx_tls:   # read when the NIXL agent starts
            opts["ray_actor_options"]["runtime_env"] = {"env_vars": {"UCX_TLS": self.transfer.ucx_tls}}
        return opts


def _fields_at(loc: tuple) -> list[str]:
    """Field names of the model at `loc` inside ClusterConfig ([] if it is not a model)."""
    model: type[BaseModel] = ClusterConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        args = (field.annotation, *getattr(field.annotation, "__args__", ()))
        sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors(include_url=False):
        loc, msg = err["loc"], err["msg"].removeprefix("Value error, ")
        path = ".".join(str(p) for p in loc)
        if err["type"] == "extra_forbidden" and loc[-2:-1] == ("engine",) and loc[-1] in CLUSTER_LEVEL_ENGINE_KEYS:
            lines.append(f"  {path}: set once for the cluster (top-level `{loc[-1]}:`), not per pool")
            continue
        if err["type"] == "extra_forbidden" and loc[-2:-1] == ("engine",) and loc[-1] in CLUSTER_SET_ENGINE_KEYS:
            lines.append(f"  {path}: set by the cluster (a TP replica's workers are Ray actors in its placement "
                         f"group)")
            continue
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), _fields_at(loc[:-1]), n=1)
            lines.append(f"  {path}: unknown key" + (f" (did you mean {close[0]}?)" if close else ""))
            continue
        if err["type"] not in ("value_error", "missing") and not isinstance(err.get("input"), (dict, list)):
            msg += f" (got {err['input']!r})"           # pydantic's own messages do not say it
        lines.append(f"  {path}: {msg}" if path else f"  {msg}")
    return "\n".join(lines)
