"""Baton's engine: a paged-KV Llama-family runtime with prefix caching and continuous batching."""
from engine.config import EngineConfig
from engine.errors import BatonError, ConfigError, InvalidRequestError, ModelLoadError, PromptTooLongError
from engine.async_llm import AsyncLLM
from engine.llm import LLM
from engine.kv_connector import RemotePrefill, Resume
from engine.llm_engine import LLMEngine
from engine.lora import LoRAError, LoRARequest
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "AsyncLLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "RequestMetrics",
           "RemotePrefill", "Resume", "BatonError", "ConfigError", "InvalidRequestError", "ModelLoadError",
           "PromptTooLongError", "LoRARequest", "LoRAError"]
