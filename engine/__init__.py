"""Baton's engine: a paged-KV Llama-family runtime with prefix caching and continuous batching.

The names below are imported on first use (PEP 562). A process that needs only the engine's light modules
(the cluster state actor reads engine.kv_events; configs read engine.errors) then does not import torch,
which costs about a second of CPU and 150 MB in every such replica."""
from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "LLM": "engine.llm", "AsyncLLM": "engine.async_llm", "LLMEngine": "engine.llm_engine",
    "EngineConfig": "engine.config", "SamplingParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs", "RequestMetrics": "engine.outputs",
    "RemotePrefill": "engine.kv_connector", "Resume": "engine.kv_connector",
    "BatonError": "engine.errors", "ConfigError": "engine.errors", "InvalidRequestError": "engine.errors",
    "ModelLoadError": "engine.errors", "PromptTooLongError": "engine.errors",
    "LoRARequest": "engine.lora", "LoRAError": "engine.lora",
    "BeamSearchParams": "engine.beam_search", "BeamSearchOutput": "engine.beam_search",
    "PoolingParams": "engine.pooling", "EmbeddingRequestOutput": "engine.outputs",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
