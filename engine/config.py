"""EngineConfig: the engine's knobs, with vLLM's names."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import ConfigError
from engine.structured import GRAMMAR_COMPILE_TIMEOUT_S, MAX_GRAMMAR_BYTES

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

DEFAULT_CPU_KV_BYTES = 2 << 30        # 2 GiB: ~46k tokens of SmolLM2-135M
DEFAULT_GPU_KV_FRACTION = 0.85        # of device memory left after the weights


@dataclass
class EngineConfig:
    model: str | None = None                  # HF dir, .gguf, dummy shape name; None = default model
    tokenizer: str | None = None              # defaults to the model's
    dtype: str = "auto"                       # auto = bf16 on CUDA, fp32 on CPU
    device: str = "auto"                      # auto = cuda if available else cpu
    load_format: str = "auto"                 # auto | safetensors | dummy
    quantization: str = "auto"                # auto (GGUF, GPTQ, AWQ stay packed on CPU) | none | gguf | gptq | awq | int8 | fp8
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048        # token budget of one step (prefill chunks + decodes)
    max_model_len: int | None = None          # defaults to the model's max positions, capped at 8192
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory: int | float | None = None  # bytes (int) or fraction of device memory (float)
    num_kv_blocks: int | None = None          # overrides kv_cache_memory (tests, transfer peers)
    kv_offloading_size: float = 0.0           # GiB of host memory for blocks evicted from the KV cache (0: off)
    kv_cache_dtype: str = "auto"              # auto (the model's dtype) | int8 | fp8: 1 byte a value, per-token scales
    seed: int = 0                             # for dummy weights and unseeded sampling
    enforce_eager: bool = False               # CUDA: no CUDA graphs for decode and verify steps
    tensor_parallel_size: int = 1             # ranks one model is sharded over (KV heads: engine/kv_layout.py)
    distributed_executor_backend: str = "mp"  # TP workers: "mp" (processes) or "ray" (actors): engine/executor.py
    enable_expert_parallel: bool = False      # MoE under TP: each rank holds whole experts, not a share of each
    speculative_config: Any = None            # dict, vLLM-style: {"method": "ngram" | "draft_model" | "layer_skip" |
    #                                           "eagle" | "eagle3" | "mtp", ...} (engine/spec/config.py)
    enable_lora: bool = False                 # serve LoRA adapters (engine/lora.py) beside the base model
    max_loras: int = 1                        # adapters in device slots: at most this many in one step
    max_lora_rank: int = 16                   # the largest adapter rank accepted
    max_cpu_loras: int | None = None          # adapters kept loaded in host memory (default: max_loras)
    generation_config: str = "auto"           # auto (the model's generation_config.json) | vllm (none) | a directory
    override_generation_config: dict | None = None  # sampling fields over it: {"temperature": 0.6, ...}
    max_grammar_bytes: int = MAX_GRAMMAR_BYTES                   # structured output: the largest spec accepted
    grammar_compile_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # structured output: a slower compile is refused
    pooling_type: str | None = None           # embeddings: last | mean | cls (None: the model's sentence-transformers
                                              # config, else last): engine/pooling.py

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ConfigError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}")
        from engine.quant import QUANTIZATIONS
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if isinstance(self.kv_cache_memory, float) and not 0 < self.kv_cache_memory <= 1:
            raise ConfigError(f"kv_cache_memory as a fraction must be in (0, 1], got {self.kv_cache_memory}")
        from engine.kv_layout import KV_CACHE_DTYPES
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if isinstance(self.kv_offloading_size, bool) or not isinstance(self.kv_offloading_size, (int, float)) \
                or not self.kv_offloading_size >= 0:
            raise ConfigError(f"kv_offloading_size is GiB of host memory, >= 0, got {self.kv_offloading_size!r}")
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int)
                                               or self.max_cpu_loras < self.max_loras):
            raise ConfigError(f"max_cpu_loras must be an integer >= max_loras ({self.max_loras}), "
                              f"got {self.max_cpu_loras!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ConfigError(f"generation_config must be auto, vllm or a directory, got {self.generation_config!r}")
        from engine.generation_config import check_overrides
        check_overrides(self.override_generation_config)
        from engine.pooling import POOLING_TYPES
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        from engine.spec.config import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return _DTYPES[self.dtype]

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)
