"""Small GGUF checkpoints the tests write with the `gguf` package: a tiny llama or qwen2 with random
weights in the quantized types we ask for, and SmolLM2's tokenizer cut to its first VOCAB tokens and the merges
among them (copied from the default GGUF, so transformers can read the file for the dequantized reference; the
whole 49k-token vocabulary made each of gguf's three parses of a file take seconds)."""
from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

VOCAB = 4096          # token ids of a written file are below this


@functools.cache
def _tokenizer_fields() -> list[tuple[str, object, object, object]]:
    """(key, value, type, sub-type) of the default GGUF's tokenizer, its vocabulary cut to VOCAB tokens."""
    import gguf

    from engine.loader import default_gguf
    src = gguf.GGUFReader(str(default_gguf()))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    out = []
    for key, field in src.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = tokens
        elif key == "tokenizer.ggml.token_type":
            value = value[:VOCAB]
        elif key == "tokenizer.ggml.merges":     # a merge stays when both parts and the result are kept
            value = [m for m in value if (p := m.split(" ", 1)) and len(p) == 2 and p[0] + p[1] in kept
                     and p[0] in kept and p[1] in kept]
        out.append((key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None))
    return out


def _raw_kquant(rng, rows: int, cols: int, type_name: str) -> np.ndarray:
    """Random blocks of a K-quant (the gguf package cannot quantize to them): random codes and
    sub-block scales, and super-block scales small enough that weights stay near 0.02."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halfs = {"Q4_K": [(0, 2e-4), (2, 1e-4)], "Q6_K": [(208, 2e-5)]}[type_name]
    for offset, scale in halfs:           # d (and Q4_K's dmin): fp16, positive
        d = rng.uniform(0.5, 1.0, raw.shape[:2]).astype(np.float16) * np.float16(scale)
        raw[:, :, offset:offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def write_gguf(path: Path, types: dict[str, str], *, arch: str = "llama", hidden: int = 256,
               intermediate: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2, seed: int = 0,
               head_dim: int | None = None, experts: int = 4, top_k: int = 2, expert_intermediate: int = 128,
               window: int = 8) -> Path:
    """`types` maps a GGUF tensor role ("token_embd", "attn_q", ..., "ffn_down", "output") to a type name
    (F32, Q8_0, Q4_0, Q4_1, Q4_K, Q6_K, or any other the gguf package can quantize to); roles not named
    are F32. K-quants need widths that are multiples of 256. An "output" entry writes an untied head.
    arch "qwen3moe": every layer's MLP is `experts` stacked experts of `expert_intermediate` units (roles
    "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), `top_k` a token, with the router "ffn_gate_inp" (F32);
    "qwen2moe" adds q/k/v biases and a shared expert of `intermediate` units ("ffn_*_shexp") with its gate.
    arch "gemma2" / "gemma3": a sliding window of `window` tokens (every other layer, Gemma 2; five of six, Gemma 3),
    norms after attention and the MLP (stored as llama.cpp stores Gemma's: 1 + weight), Gemma 2's softcaps (5 on
    scores, 10 on logits: low enough to bite), Gemma 3's q/k norms."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    vocab = VOCAB
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(2048)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    head_dim = head_dim or hidden // heads
    moe = arch in ("qwen2moe", "qwen3moe")
    if moe:
        w.add_expert_count(experts)
        w.add_expert_used_count(top_k)
        w.add_expert_feed_forward_length(expert_intermediate)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(intermediate)
    w.add_rope_dimension_count(head_dim)
    gemma = arch in ("gemma2", "gemma3")
    if head_dim != hidden // heads or gemma:              # transformers reads Gemma's head_dim from key_length
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if gemma:
        w.add_sliding_window(window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(5.0)
        w.add_final_logit_softcapping(10.0)
    for key, value, kind, sub in _tokenizer_fields():
        w.add_key_value(key, value, kind, sub)

    def add(name: str, role: str, rows: int, cols: int, stack: int = 0, std: float = 0.02) -> None:
        kind = types.get(role, "F32")
        if kind in ("Q4_K", "Q6_K"):
            w.add_tensor(name, _raw_kquant(rng, rows, cols, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
            return
        x = (rng.standard_normal(((stack,) if stack else ()) + (rows, cols)) * std).astype(np.float32)
        if kind == "F32":
            w.add_tensor(name, x)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", vocab, hidden)
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        add(p + "attn_q.weight", "attn_q", heads * head_dim, hidden)
        add(p + "attn_k.weight", "attn_k", kv_heads * head_dim, hidden)
        add(p + "attn_v.weight", "attn_v", kv_heads * head_dim, hidden)
        if gemma:
            for role in ("post_attention_norm", "post_ffw_norm"):
                w.add_tensor(p + role + ".weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
        if arch in ("qwen3", "qwen3moe", "gemma3"):       # q/k norms of head_dim
            for role in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(p + role + ".weight", (1 + 0.1 * rng.standard_normal(head_dim)).astype(np.float32))
        if arch in ("qwen2", "qwen2moe"):
            for role, n in (("attn_q", heads), ("attn_k", kv_heads), ("attn_v", kv_heads)):
                w.add_tensor(p + role + ".bias", (0.02 * rng.standard_normal(n * head_dim)).astype(np.float32))
        add(p + "attn_output.weight", "attn_output", hidden, heads * head_dim)
        if moe:
            w.add_tensor(p + "ffn_gate_inp.weight", (rng.standard_normal((experts, hidden)) * 0.5).astype(np.float32))
            # wide enough that the experts move the logits (at 0.02 their output is lost in the residual)
            add(p + "ffn_gate_exps.weight", "ffn_gate_exps", expert_intermediate, hidden, experts, 0.2)
            add(p + "ffn_up_exps.weight", "ffn_up_exps", expert_intermediate, hidden, experts, 0.2)
            add(p + "ffn_down_exps.weight", "ffn_down_exps", hidden, expert_intermediate, experts, 0.2)
            if arch == "qwen2moe":
                w.add_tensor(p + "ffn_gate_inp_shexp.weight", (rng.standard_normal(hidden) * 0.5).astype(np.float32))
                add(p + "ffn_gate_shexp.weight", "ffn_gate_shexp", intermediate, hidden, 0, 0.2)
                add(p + "ffn_up_shexp.weight", "ffn_up_shexp", intermediate, hidden, 0, 0.2)
                add(p + "ffn_down_shexp.weight", "ffn_down_shexp", hidden, intermediate, 0, 0.2)
            continue
        add(p + "ffn_gate.weight", "ffn_gate", intermediate, hidden)
        add(p + "ffn_up.weight", "ffn_up", intermediate, hidden)
        add(p + "ffn_down.weight", "ffn_down", hidden, intermediate)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    if "output" in types:
        add("output.weight", "output", vocab, hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for the llama architecture (convert_hf_to_gguf's LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_from_hf(hf_dir: str, path: Path, types: dict[str, str]) -> Path:
    """A tiny HF checkpoint written as llama.cpp writes it, in the types `types` names per role (F32 where not named),
    with the cut SmolLM2 tokenizer (the model's vocabulary must be VOCAB). The same weights the checkpoint holds, so
    transformers' run of the checkpoint is the reference.
    - Mixtral: architecture llama with expert_count and expert_used_count, q/k rows permuted, each layer's router
      ffn_gate_inp and experts stacked (ffn_*_exps).
    - Phi-3: architecture phi3, q/k/v fused (attn_qkv) and gate/up fused (ffn_up) as the checkpoint holds them, the
      rotated share of each head as rope.dimension_count, a sliding window, longrope's factors as the tensors
      rope_factors_long and rope_factors_short with the original context length."""
    import gguf
    import torch
    from gguf.quants import quantize
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg, sd = model.config, {k: v.numpy() for k, v in model.state_dict().items()}
    assert cfg.vocab_size == VOCAB, "the tokenizer written has VOCAB tokens"
    heads, kv_heads, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size
    phi3 = cfg.model_type == "phi3"
    w = gguf.GGUFWriter(str(path), "phi3" if phi3 else "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                               else cfg.rope_theta))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = getattr(cfg, "rope_parameters", None) or {}
    w.add_rope_dimension_count(int(hidden // heads * rope.get("partial_rotary_factor", 1.0)))
    if phi3:
        if cfg.sliding_window:
            w.add_sliding_window(cfg.sliding_window)
        if rope.get("rope_type") == "longrope":
            w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings")
                                            or cfg.original_max_position_embeddings)
    else:
        w.add_expert_count(cfg.num_local_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
    for key, value, kind, sub in _tokenizer_fields():
        w.add_key_value(key, value, kind, sub)

    def add(name: str, role: str, x: np.ndarray) -> None:
        kind = types.get(role, "F32")
        x = np.ascontiguousarray(x, dtype=np.float32)
        if kind == "F32" or x.ndim == 1:
            w.add_tensor(name, x)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name, quantize(x, qtype), raw_dtype=qtype)

    add("token_embd.weight", "token_embd", sd["model.embed_tokens.weight"])
    if phi3 and rope.get("rope_type") == "longrope":
        add("rope_factors_long.weight", "", np.array(rope["long_factor"], dtype=np.float32))
        add("rope_factors_short.weight", "", np.array(rope["short_factor"], dtype=np.float32))
    for i in range(cfg.num_hidden_layers):
        p, hf = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", "", sd[hf + "input_layernorm.weight"])
        add(p + "ffn_norm.weight", "", sd[hf + "post_attention_layernorm.weight"])
        if phi3:
            add(p + "attn_qkv.weight", "attn_qkv", sd[hf + "self_attn.qkv_proj.weight"])
            add(p + "attn_output.weight", "attn_output", sd[hf + "self_attn.o_proj.weight"])
            add(p + "ffn_up.weight", "ffn_up", sd[hf + "mlp.gate_up_proj.weight"])
            add(p + "ffn_down.weight", "ffn_down", sd[hf + "mlp.down_proj.weight"])
            continue
        add(p + "attn_q.weight", "attn_q", _permute(sd[hf + "self_attn.q_proj.weight"], heads))
        add(p + "attn_k.weight", "attn_k", _permute(sd[hf + "self_attn.k_proj.weight"], kv_heads))
        add(p + "attn_v.weight", "attn_v", sd[hf + "self_attn.v_proj.weight"])
        add(p + "attn_output.weight", "attn_output", sd[hf + "self_attn.o_proj.weight"])
        add(p + "ffn_gate_inp.weight", "", sd[hf + "mlp.gate.weight"])
        gate, up = np.split(sd[hf + "mlp.experts.gate_up_proj"], 2, axis=1)       # transformers 5: [E, 2I, H]
        add(p + "ffn_gate_exps.weight", "ffn_gate_exps", gate)
        add(p + "ffn_up_exps.weight", "ffn_up_exps", up)
        add(p + "ffn_down_exps.weight", "ffn_down_exps", sd[hf + "mlp.experts.down_proj"])
    add("output_norm.weight", "", sd["model.norm.weight"])
    add("output.weight", "output", sd["lm_head.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
