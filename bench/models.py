"""Random-weight checkpoints of tiny configs, saved like real ones: what the tests and the CPU benchmarks that
measure the system rather than the model (reliability, chaos) load."""
from __future__ import annotations


def make_tiny_checkpoint(tmp_dir, model_type: str, **overrides) -> str:
    """A random-weight HF checkpoint (safetensors) of a tiny GQA config, saved like a real one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=300, max_position_embeddings=512, initializer_range=0.2,
               tie_word_embeddings=False)
    if model_type == "mixtral":                           # 4 experts, 2 a token
        cfg.update(num_local_experts=4, num_experts_per_tok=2)
    elif model_type == "qwen3_moe":                       # ... each of its own width, beside the dense one
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True)
    elif model_type == "qwen2_moe":                       # ... and a shared expert every token passes through
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96)
    cfg.update(overrides)
    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **cfg), dtype=torch.float32)
    model.save_pretrained(tmp_dir)
    return str(tmp_dir)


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_adapter(base_dir: str, out_dir, rank: int = 8, seed: int = 0, alpha: float | None = None,
                      targets=LORA_TARGETS, scale: float = 1.0, use_rslora: bool = False, **patterns) -> str:
    """A random LoRA adapter for the HF checkpoint at `base_dir`, saved by PEFT (adapter_config.json and
    adapter_model.safetensors) as a fine-tune would be. PEFT starts B at zero (a no-op); here A and B are
    random with B scaled by `scale`, so the adapter changes what the model says. `patterns`: PEFT's rank_pattern
    and alpha_pattern."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=list(targets),
                                            init_lora_weights=False, use_rslora=use_rslora, lora_dropout=0.0,
                                            **patterns))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return str(out_dir)
