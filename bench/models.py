"""Random-weight checkpoints of tiny configs, saved like real ones: what the tests and the CPU benchmarks that
measure the system rather than the model (reliability, chaos) load."""
from __future__ import annotations

import torch


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
