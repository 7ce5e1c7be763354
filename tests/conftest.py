"""Shared fixtures: the default model (converted once), tiny random HF checkpoints, engines."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # no GPU in CI: Triton kernels run in the interpreter

import pytest
import torch


@pytest.fixture(scope="session")
def smol_path() -> str:
    from engine.loader import resolve_model
    return resolve_model(None)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def smol_llm(smol_path):
    from engine import LLM
    return LLM(smol_path, kv_cache_memory=256 << 20, max_model_len=2048)


def make_tiny_checkpoint(tmp_dir, model_type: str, **overrides) -> str:
    """A random-weight HF checkpoint (safetensors) of a tiny GQA config, saved like a real one."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[model_type]
    cfg = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.2,
               tie_word_embeddings=False)
    cfg.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(cls(**cfg), dtype=torch.float32)
    model.save_pretrained(tmp_dir)
    return str(tmp_dir)


def hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """transformers greedy reference that never stops early (EOS disabled, like ignore_eos)."""
    ids = torch.tensor([prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def assert_not_in_ray_logs(*secrets: str) -> None:
    """No file of this process's Ray session (every replica, the proxy, the controller, the raylet) holds
    any of the secrets (prompt text, completions, API keys)."""
    import glob
    import time

    import ray
    time.sleep(1.0)                                         # log lines reach their files
    logs = ray._private.worker._global_node.get_logs_dir_path()
    files = [f for f in glob.glob(os.path.join(logs, "**", "*"), recursive=True) if os.path.isfile(f)]
    assert len(files) > 5
    for f in files:
        data = open(f, "rb").read()
        for secret in secrets:
            assert secret.encode() not in data, (f, secret)

