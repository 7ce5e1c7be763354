"""ClusterConfig: the one schema of a Baton cluster (pydantic), loaded from one YAML file.

Every field is documented; unknown keys anywhere are refused with their path and a suggestion.
`baton serve` flags override a few fields (with_overrides); build_app (cluster/app.py) reads the rest.
"""
from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.errors import ConfigError

CLUSTER_LEVEL_ENGINE_KEYS = ("model", "dtype", "device")


def _engine_fields() -> list[str]:
    from engine.config import EngineConfig
    return [f.name for f in dataclasses.fields(EngineConfig)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Autoscaling(_Strict):
    """Ray Serve's autoscaling_config, for one pool."""
    min_replicas: int = Field(1, ge=0, description="Fewest replicas")
    max_replicas: int = Field(1, ge=1, description="Most replicas")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at start (default: min_replicas)")
    target_ongoing_requests: float = Field(2.0, gt=0, description="Ongoing requests per replica to aim for")
    upscale_delay_s: float = Field(30.0, ge=0, description="Seconds a scale-up decision must hold")
    downscale_delay_s: float = Field(600.0, ge=0, description="Seconds a scale-down decision must hold")

    @model_validator(mode="after")
    def _order(self) -> Autoscaling:
        init = self.min_replicas if self.initial_replicas is None else self.initial_replicas
        if not self.min_replicas <= init <= self.max_replicas:
            raise ValueError(f"need min_replicas <= initial_replicas <= max_replicas, got "
                             f"{self.min_replicas} <= {init} <= {self.max_replicas}")
        return self


class PoolConfig(_Strict):
    """One pool's replicas: how many, what each gets, and its engine knobs (vLLM names)."""
    num_replicas: int = Field(1, ge=1, description="Fixed replica count (ignored when autoscaling is set)")
    autoscaling: Autoscaling | None = Field(None, description="Scale between min and max replicas instead")
    num_cpus: float = Field(1.0, ge=0, description="CPUs per replica (Ray resource)")
    num_gpus: float = Field(0.0, ge=0, description="GPUs per replica (Ray resource); 1 for a CUDA engine")
    memory: int | None = Field(None, ge=0, description="Bytes of memory per replica (Ray resource)")
    max_ongoing_requests: int = Field(64, ge=1, description="Requests Serve sends one replica at once")
    engine: dict[str, Any] = Field(default_factory=dict,
                                   description="EngineConfig knobs (block_size, max_num_seqs, kv_cache_memory, "
                                               "max_model_len, speculative_config, ...); model/dtype/device are "
                                               "cluster-level")

    @field_validator("engine")
    @classmethod
    def _known_knobs(cls, v: dict[str, Any]) -> dict[str, Any]:
        known = _engine_fields()
        for key in v:
            if key in CLUSTER_LEVEL_ENGINE_KEYS:
                raise ValueError(f"{key!r} is set once for the cluster (top-level `{key}:`), not per pool")
            if key not in known:
                raise ValueError(f"unknown engine knob {key!r}{_suggest(key, known)}")
        return v


class IngressConfig(_Strict):
    num_replicas: int = Field(1, ge=1, description="HTTP ingress replicas (each has the same routing index)")
    num_cpus: float = Field(0.5, ge=0, description="CPUs per ingress replica")


class RouterConfig(_Strict):
    policy: Literal["prefix_aware", "pow2"] = Field(
        "prefix_aware", description="Prefill routing: prefix_aware (KV-block index) or pow2 (Serve's default "
                                    "power-of-two choices, for comparison)")
    load_weight: float = Field(1.0, ge=0, description="Weight of a replica's queued prefill tokens against "
                                                       "the prompt tokens it would have to compute")
    imbalance_threshold_tokens: int = Field(8192, ge=0, description="Above this spread of queued prefill tokens "
                                                                    "between replicas, route least-loaded first")
    index_sync_interval_s: float = Field(0.01, gt=0, description="How often routers pull the KV index's changes")


class DisaggregationConfig(_Strict):
    min_remote_prefill_tokens: int = Field(
        64, ge=0, description="A prompt whose uncached part (on the best decode replica) is at most this many "
                              "tokens is prefilled by the decode replica itself; longer ones go to the prefill pool")


class TransferConfig(_Strict):
    backend: Literal["nixl", "ray"] = Field("nixl", description="KV transport: nixl (default) or ray (object "
                                                                "store fallback, where NIXL cannot run)")
    ttl_s: float = Field(30.0, gt=0, description="Seconds a prefill replica keeps unpulled blocks pinned")


class ClusterConfig(_Strict):
    model: str | None = Field(None, description="HF directory, .gguf file or dummy shape; default SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(None, description="Name in /v1/models and requests (default: from model)")
    dtype: str = Field("auto", description="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where engines run")
    mode: Literal["disaggregated", "colocated"] = Field(
        "disaggregated", description="disaggregated: prefill and decode pools; colocated: the decode pool "
                                     "does both (the prefill section is then not allowed)")
    host: str = Field("127.0.0.1", description="HTTP bind address; 0.0.0.0 exposes it beyond this machine")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    ingress: IngressConfig = Field(default_factory=IngressConfig, description="The HTTP ingress deployment")
    prefill: PoolConfig | None = Field(default_factory=lambda: PoolConfig(engine={"kv_cache_memory": 512 << 20}),
                                       description="The prefill pool (disaggregated mode)")
    decode: PoolConfig = Field(default_factory=lambda: PoolConfig(engine={"kv_cache_memory": 512 << 20}),
                               description="The decode pool (both modes)")
    router: RouterConfig = Field(default_factory=RouterConfig, description="Routing weights and thresholds")
    disaggregation: DisaggregationConfig = Field(default_factory=DisaggregationConfig,
                                                 description="When to prefill remotely")
    transfer: TransferConfig = Field(default_factory=TransferConfig, description="KV transfer between pools")

    @model_validator(mode="before")
    @classmethod
    def _colocated_has_no_prefill(cls, d: Any) -> Any:
        if isinstance(d, dict) and d.get("mode") == "colocated":
            if d.get("prefill") is not None:
                raise ValueError("mode colocated has no prefill pool: remove the prefill section")
            d = {**d, "prefill": None}
        return d

    # -- loading ----------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ClusterConfig:
        try:
            return cls.model_validate(d or {})
        except ValidationError as e:
            raise ConfigError("invalid cluster config:\n" + _explain(e)) from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        try:
            d = yaml.safe_load(Path(path).read_text())
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read cluster config {path}: {e}") from None
        return cls.from_dict(d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

    def with_overrides(self, model: str | None = None, prefill_replicas: int | None = None,
                       decode_replicas: int | None = None, port: int | None = None) -> ClusterConfig:
        d = self.model_dump(mode="json")
        if model is not None:
            d["model"] = model
        if port is not None:
            d["port"] = port
        for pool, n in (("prefill", prefill_replicas), ("decode", decode_replicas)):
            if n is not None:
                if d.get(pool) is None:
                    raise ConfigError(f"--{pool}-replicas: this config has no {pool} pool (mode {self.mode})")
                d[pool]["num_replicas"], d[pool]["autoscaling"] = n, None
        return ClusterConfig.from_dict(d)

    # -- what the builder needs -------------------------------------------------------------------
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        from engine.loader import DEFAULT_MODEL
        return Path(self.model).name.removesuffix(".gguf") if self.model else DEFAULT_MODEL

    def pool(self, name: str) -> PoolConfig:
        p = getattr(self, name)
        if p is None:
            raise ConfigError(f"this config has no {name} pool (mode {self.mode})")
        return p

    def engine_kwargs(self, pool: str) -> dict[str, Any]:
        """EngineConfig keyword arguments of a pool's replicas: cluster-level model/dtype/device + its knobs."""
        return {"model": self.model, "dtype": self.dtype, "device": self.device, **self.pool(pool).engine}

    def deployment_options(self, name: str) -> dict[str, Any]:
        """Ray Serve deployment options (.options(**...)) of `ingress`, `prefill` or `decode`."""
        if name == "ingress":
            return {"num_replicas": self.ingress.num_replicas,
                    "ray_actor_options": {"num_cpus": self.ingress.num_cpus}}
        p = self.pool(name)
        actor = {"num_cpus": p.num_cpus, "num_gpus": p.num_gpus}
        if p.memory:
            actor["memory"] = p.memory
        opts: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": p.max_ongoing_requests}
        if p.autoscaling is not None:
            opts["autoscaling_config"] = p.autoscaling.model_dump(exclude_none=True)
        else:
            opts["num_replicas"] = p.num_replicas
        return opts


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _explain(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parent = ClusterConfig
            for p in err["loc"][:-1]:
                field = parent.model_fields.get(str(p)) if isinstance(parent, type) else None
                ann = getattr(field, "annotation", None)
                parent = next((a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type)
                               and issubclass(a, BaseModel)), None)
            known = list(parent.model_fields) if parent is not None else []
            lines.append(f"  {path}: unknown key{_suggest(str(err['loc'][-1]), known)}")
        else:
            lines.append(f"  {path or '(top)'}: {err['msg'].removeprefix('Value error, ')}")
    return "\n".join(lines)
