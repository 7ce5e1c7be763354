"""Random-weight checkpoints of tiny configs, saved like real ones: what the tests and the CPU benchmarks that
measure the system rather than the model (reliability, chaos) load; and random EAGLE heads for them."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


# Gemma's tiny configs: head_dim apart from hidden / heads (Gemma's own 256), a query_pre_attn_scalar apart from it;
# Gemma 2/3's sliding window of 8 tokens (prompts run past it), Gemma 2's softcaps low enough to bite, Gemma 3's
# sliding and full layers each with a RoPE of its own (the full ones' scaled)
_GEMMA = dict(head_dim=16, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")
GEMMA_TINY = {
    "gemma": dict(_GEMMA, hidden_act="gelu_pytorch_tanh"),
    "gemma2": dict(_GEMMA, query_pre_attn_scalar=24, sliding_window=8, attn_logit_softcapping=2.0,
                   final_logit_softcapping=3.0),
    "gemma3_text": dict(_GEMMA, query_pre_attn_scalar=24, sliding_window=8,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}


# DeepSeek's tiny configs: q/k heads of 24 + 16 rotated dims, values of 20, a latent of 32 (V3: queries through a
# rank-48 projection too); V3's YaRN with both mscales (the softmax scale's); experts in groups
_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20,
                 n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=4, topk_group=2)
DEEPSEEK_TINY = {
    "deepseek_v3": dict(_DEEPSEEK, q_lora_rank=48, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                                         "rope_theta": 10000.0}),
    # V2's groups ranked by their best expert: with 2 of 4 kept, a top 2 is never cut; with 1 it is
    "deepseek_v2": dict(_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", topk_group=1,
                        routed_scaling_factor=1.5),
}


# Llama 4's tiny config: chunks of 8 positions on its RoPE layers (0 and 1), layer 2 without RoPE and with a query
# temperature that grows every 4 positions; q/k L2 norms; 4 experts, 1 a token, on layers 0 and 2, layer 1 dense
# (its own width); llama3's RoPE scaling
LLAMA4_TINY = dict(head_dim=16, intermediate_size=48, intermediate_size_mlp=96, num_local_experts=4,
                   num_experts_per_tok=1, moe_layers=[0, 2], no_rope_layers=[1, 1, 0], attention_chunk_size=8,
                   floor_scale=4, attn_scale=0.1, use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                    "rope_theta": 500000.0})


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
    elif model_type == "gpt_oss":                         # 4 experts, 2 a token; windows of 8 on every other layer;
        cfg.update(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8,   # YaRN (x8 of 64)
                   pad_token_id=0, bos_token_id=1, eos_token_id=2,
                   rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64, "rope_theta": 150000.0})
    elif model_type in ("llama4_text", "llama4"):
        cfg.update(LLAMA4_TINY)
    elif model_type in DEEPSEEK_TINY:                      # MLA; 8 experts in 4 groups, 2 a token; a dense layer
        cfg.update(DEEPSEEK_TINY[model_type])
    elif model_type in GEMMA_TINY:
        cfg.update(GEMMA_TINY[model_type])
    elif model_type in ("phi3", "olmo2", "olmo3", "smollm3", "glm4"):   # default special ids past a tiny vocabulary
        cfg.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    torch.manual_seed(1234)
    if model_type == "gemma3":       # Gemma 3 4B+'s multimodal checkpoint: its text model beside a tiny vision tower
        text = {**cfg, **GEMMA_TINY["gemma3_text"], **overrides}
        config = AutoConfig.for_model("gemma3", text_config=text, tie_word_embeddings=text["tie_word_embeddings"],
                                      vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                         num_attention_heads=2, image_size=28, patch_size=14),
                                      mm_tokens_per_image=4, image_token_index=cfg["vocab_size"] - 1,
                                      boi_token_index=cfg["vocab_size"] - 3, eoi_token_index=cfg["vocab_size"] - 2)
    elif model_type == "llama4":     # Llama 4 Scout's and Maverick's checkpoint: its text model beside a tiny vision
        config = AutoConfig.for_model("llama4", text_config=cfg, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=64),
            image_token_index=cfg["vocab_size"] - 1, boi_token_index=cfg["vocab_size"] - 3,
            eoi_token_index=cfg["vocab_size"] - 2, tie_word_embeddings=False)
    else:
        config = AutoConfig.for_model(model_type, **cfg)
    if model_type == "llama4":
        from transformers import Llama4ForConditionalGeneration
        model = Llama4ForConditionalGeneration._from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if model_type in GEMMA_TINY or model_type == "gemma3":    # Gemma starts its norms at 0 (1 + 0): make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.3)
    if model_type == "deepseek_v3":       # its experts' correction biases start at 0: make them move the choice
        with torch.no_grad():
            for name, p in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    p.normal_(0.0, 0.3)
    if model_type == "gpt_oss":           # its sinks and biases start at 0: make them count
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("sinks", "_bias", "router.bias")):
                    p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.2)
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


# MXFP4's 16 values (e2m1), by their 4-bit code: transformers' FP4_VALUES
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_experts(checkpoint_dir) -> None:
    """In place: a gpt-oss checkpoint's experts as the released gpt-oss holds them, MXFP4. Each run of 32 input
    values of an expert's projection (stored [E, out, in], transposed from the module's [E, in, out]) keeps a power of
    two (a uint8 scale, biased by 127) and 4-bit codes of the nearest e2m1 value, two a byte (the first in the low
    nibble) in `_blocks` [E, out, in / 32, 16]; config.json gains quantization_config {quant_method: mxfp4}."""
    import glob
    import json
    import os

    import torch
    from safetensors.torch import load_file, save_file
    values = torch.tensor(FP4_VALUES)
    path = glob.glob(os.path.join(checkpoint_dir, "*.safetensors"))[0]
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        w = tensors.pop(name).float().transpose(1, 2)
        e, rows, cols = w.shape
        runs = w.reshape(e, rows, cols // 32, 32)
        exp = torch.ceil(torch.log2(runs.abs().amax(-1).clamp_min(2.0 ** -120) / 6.0)).clamp(-127, 127)
        codes = ((runs / torch.exp2(exp)[..., None])[..., None] - values).abs().argmin(-1).to(torch.uint8)
        tensors[name + "_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        tensors[name + "_scales"] = (exp + 127).to(torch.uint8).contiguous()
    save_file(tensors, path, metadata={"format": "pt"})
    with open(os.path.join(checkpoint_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    with open(os.path.join(checkpoint_dir, "config.json"), "w") as f:
        json.dump(config, f)


# -- EAGLE heads: random ones in their checkpoints' formats (tests, the GPU check) ------------------------------
def head_config(target: str, **extra) -> dict:
    """A Llama layer's config of the target's widths (the decoder layer of an EAGLE head, whatever the target's family)."""
    cfg = json.loads((Path(target) / "config.json").read_text())
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters", "torch_dtype")
    return {"model_type": "llama", **{k: cfg[k] for k in keep if k in cfg}, "num_hidden_layers": 1,
            "tie_word_embeddings": False, **extra}


def _random_layer(cfg: dict, g: "torch.Generator", prefix: str, attn_in: int) -> dict[str, "torch.Tensor"]:
    import torch
    h, heads, kv, inter = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], \
        cfg["intermediate_size"]
    d = h // heads

    def rand(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5
    out = {prefix + "self_attn.q_proj.weight": rand(heads * d, attn_in),
           prefix + "self_attn.k_proj.weight": rand(kv * d, attn_in),
           prefix + "self_attn.v_proj.weight": rand(kv * d, attn_in),
           prefix + "self_attn.o_proj.weight": rand(h, heads * d), prefix + "mlp.gate_proj.weight": rand(inter, h),
           prefix + "mlp.up_proj.weight": rand(inter, h), prefix + "mlp.down_proj.weight": rand(h, inter)}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    return out


def write_eagle_head(target: str, dst: Path, fc_bias: bool = False, seed: int = 3) -> str:
    """An EAGLE-1 head for `target` as EAGLE's checkpoints hold it: fc over [embedding; hidden], one Llama layer under
    "layers.0." (with the input norm the original code keeps and never runs), no embedding or head of its own."""
    import torch
    from safetensors.torch import save_file
    cfg = head_config(target, architectures=["LlamaForCausalLMEagle"])
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    tensors = _random_layer(cfg, g, "layers.0.", h)
    tensors["fc.weight"] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    if fc_bias:
        tensors["fc.bias"] = 0.1 * torch.randn(h, generator=g)
    save_file(tensors, dst / "model.safetensors")
    return str(dst)


def write_eagle3_head(target: str, dst: Path, draft_vocab: int = 200, aux: list[int] | None = None,
                      seed: int = 4) -> str:
    """An EAGLE-3 head for `target` as its checkpoints hold it: fc over three of the target's streams, "midlayer."
    whose attention reads twice the width, its own final norm and head over `draft_vocab` of the target's ids (d2t:
    each one's offset to its target id; t2d: the target's ids it covers)."""
    import torch
    from safetensors.torch import save_file
    cfg = head_config(target, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
    if aux is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    ids = torch.randperm(cfg["vocab_size"], generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[ids] = True
    tensors = {**_random_layer(cfg, g, "midlayer.", 2 * h), "fc.weight": torch.randn(h, 3 * h, generator=g) / 8,
               "midlayer.hidden_norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
               "norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
               "lm_head.weight": torch.randn(draft_vocab, h, generator=g) / 2, "d2t": ids - torch.arange(draft_vocab),
               "t2d": t2d}
    save_file(tensors, dst / "model.safetensors")
    return str(dst)
