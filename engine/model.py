"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, SmolLM, Gemma 1/2/3, Phi-3/4, Granite; Mixtral, Qwen2/3-MoE)
over a flat, paged batch.

Tokens of all sequences in a step are packed into one [num_tokens] row; attention finds each
sequence's context through the paged KV cache (engine/attention.py). Weight names follow Hugging
Face so checkpoints load unchanged; q/k/v and gate/up are fused at load time (fewer matmuls).

With tensor parallelism (a TPGroup given) each rank builds its shard (Megatron's split): q/k/v and
gate/up column-parallel (its heads, its run of the intermediate), o and down row-parallel (one
all-reduce each, bias added once after it), a vocab-parallel embedding and LM head (rank 0 gathers
the logits). Without one, the layers are plain nn.Linear/nn.Embedding: TP 1 runs no extra op.

Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE) replace the MLP with SparseMoE: a router and stacked
experts, each token through its top k. Under TP every rank holds its run of every expert's intermediate units
(vLLM's default), or with expert parallelism a run of whole experts; either way the block ends in one all-reduce,
as the dense MLP does.

Gemma's differences are options of the same modules: embeddings scaled by sqrt(hidden), norms of (1 + weight) (the 1
added at load), a GELU-gated MLP; Gemma 2/3 add a norm after attention and after the MLP, layers that alternate a
sliding window with full attention (Gemma 3's with a RoPE of their own), Gemma 2 a softcap on attention scores and
on the logits, Gemma 3 Qwen3's q/k norms. Phi-3's fused checkpoint tensors are split at load (`_unfused`); Granite
scales its embeddings, each sublayer's output, its attention scores and its logits by multipliers of its config.

DeepSeek-V2/V3 replace attention with multi-head latent attention (MLAAttention: one latent KV head in the cache,
engine/kv_layout.py's kv_parts 1) and route their experts within groups (SparseMoE), beside shared experts. Llama 4
adds chunked attention (engine/attention.py), a query temperature on its NoPE layers, q/k L2 norms and experts
weighted on their input.
"""
from __future__ import annotations

import functools
import re
from typing import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from engine import cpu_attention
from engine.attention import AttentionMetadata, paged_attention, write_kv
from engine.errors import ModelLoadError
from engine.kv_layout import LayerKV
from engine.loader import halves_from_pairs, text_weight_name
from engine.parallel import TPGroup, check_heads, query_heads_of, split_range, vocab_range
from engine.quant import (TINYGEMM_MAX_M, QuantWeight, fp8_gemm_supported, fp8_matmul, quantize_fp8, quantize_int8,
                          tinygemm_matmul, tinygemm_pack)

# DeepSeek-V2/V2.5 and V3/V3.1/R1: multi-head latent attention (MLAAttention), experts routed within groups
MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3"}
# Llama 4 (Scout, Maverick; text): chunked attention on three layers of four, no RoPE (and a query temperature) on the
# fourth, q/k L2 norms, RoPE over interleaved pairs; experts top-1 by sigmoid, weighted on their input, a shared one
LLAMA4_MODEL_TYPES = {"llama4_text"}
MOE_MODEL_TYPES = {"mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"} | MLA_MODEL_TYPES | LLAMA4_MODEL_TYPES
FUSED_MOE: bool | None = None         # the fused MoE kernel: None, on CUDA; tests set True (the Triton interpreter)
GEMMA_MODEL_TYPES = {"gemma", "gemma2", "gemma3_text"}
FUSED_NAME_MODEL_TYPES = {"phi3", "glm4"}          # checkpoints that hold qkv_proj or gate_up_proj already fused
SANDWICH_NORM_MODEL_TYPES = {"gemma2", "gemma3_text", "glm4"}   # a norm after attention and after the MLP as well
# RoPE over interleaved pairs (2i, 2i + 1) of each head's rotated dims (GPT-J's, GLM's, ERNIE's): q and k's rows are
# permuted at load so that the pairs become the halves the rotation pairs (LlamaForCausalLM._unfused)
INTERLEAVED_ROPE_MODEL_TYPES = {"glm4", "ernie4_5", "cohere2", "llama4_text"}
# attention and the MLP side by side on one norm's output, their sum joining the residual (Cohere's); LayerNorms
PARALLEL_BLOCK_MODEL_TYPES = {"cohere2"}
POST_NORM_MODEL_TYPES = {"olmo2", "olmo3", "exaone4"}   # norms after attention and after the MLP only, none before
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "ministral", "qwen2", "qwen3", "granite", "smollm3", "seed_oss"} | \
    MOE_MODEL_TYPES | GEMMA_MODEL_TYPES | FUSED_NAME_MODEL_TYPES | POST_NORM_MODEL_TYPES | \
    INTERLEAVED_ROPE_MODEL_TYPES | PARALLEL_BLOCK_MODEL_TYPES
# an RMSNorm over each head's q and k before the rotation
QK_NORM_MODEL_TYPES = {"qwen3", "qwen3_moe", "gemma3_text", "exaone4"}
FULL_QK_NORM_MODEL_TYPES = {"olmo2", "olmo3"}      # OLMo 2/3: an RMSNorm over the whole q and the whole k projection
# models whose config's sliding_window applies only with use_sliding_window (off in their releases)
OPT_IN_WINDOW_MODEL_TYPES = {"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "smollm3"}


def layer_window(config, layer_idx: int) -> int:
    """A layer's sliding window in tokens (engine/attention.py), 0 where it sees the whole context: every layer of a
    model with a sliding_window (Mistral-7B-v0.1: 4,096), or those its layer_types name "sliding_attention" (Gemma 2
    and 3 alternate them with full ones; Qwen2's from max_window_layers on). Qwen2 and Qwen3 configs carry a
    sliding_window that applies only with use_sliding_window (off in their releases), and SmolLM3's."""
    window = getattr(config, "sliding_window", None)
    if not window or config.model_type in OPT_IN_WINDOW_MODEL_TYPES and not getattr(config, "use_sliding_window", False):
        return 0
    types = getattr(config, "layer_types", None)
    return int(window) if types is None or types[layer_idx] == "sliding_attention" else 0


def rope_kind(config, layer_idx: int) -> str | None:
    """Which RoPE a layer takes: None where the model has one; its layer type where rope_parameters holds one per
    type (Gemma 3: theta 10,000 for sliding layers, 1,000,000 and maybe a scaling for full ones; OLMo 3); "nope" for
    a layer without position encoding (SmolLM3's every fourth: its no_rope_layers entry 0; EXAONE 4's global layers),
    whose table rotates by nothing (cos 1, sin 0: exact), so every attention path runs it as it runs the others."""
    nope = getattr(config, "no_rope_layers", None) if config.model_type in ("smollm3", "llama4_text") else None
    if nope is not None and not nope[layer_idx]:
        return "nope"
    if config.model_type in ("exaone4", "cohere2") and getattr(config, "sliding_window", None) and \
            config.layer_types[layer_idx] != "sliding_attention":
        return "nope"                       # EXAONE 4's and Command R7B's global layers, where it has local ones
    params = getattr(config, "rope_parameters", None) or {}
    types = getattr(config, "layer_types", None)
    return types[layer_idx] if types is not None and isinstance(params.get(types[layer_idx]), dict) else None


def activation(config) -> tuple[str, object]:
    """The MLP's gate activation as transformers names it and computes it: SiLU (Llama, Qwen, Mistral, Phi-3) or
    Gemma's GELU (tanh; the op the C++ decoder stack calls too), any other through transformers' table."""
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) or "silu"
    if name in STACK_ACTIVATIONS:
        return name, STACK_ACTIVATIONS[name]
    from transformers.activations import ACT2FN
    if name not in ACT2FN:
        raise ModelLoadError(f"unsupported activation {name!r}")
    return name, ACT2FN[name]


STACK_ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh")}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _cpu_kernel(x):
            return cpu_attention.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:            # one fused op; bit-identical to the steps below in fp32
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # HF's order for low precision: normalise in fp32, cast back, then scale
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += x (in place), then the norm of it: one pass on CPU."""
        if _cpu_kernel(x) and _cpu_kernel(residual):
            return cpu_attention.rms_norm(x, self.weight, self.eps, residual)
        residual.add_(x)
        return self(residual)


class LayerNorm(RMSNorm):
    """Cohere's LayerNorm: the mean taken out, scaled by a weight, no bias (RMSNorm's weight and interface)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.weight.shape, self.weight.float(), None, self.eps).to(x.dtype)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual.add_(x)
        return self(residual)


def norm_class(config):
    """The model's norm: RMSNorm, or Cohere's LayerNorm (its eps is layer_norm_eps)."""
    if config.model_type in PARALLEL_BLOCK_MODEL_TYPES:
        return lambda dim, _eps: LayerNorm(dim, float(config.layer_norm_eps))
    return RMSNorm


def _cpu_kernel(t: torch.Tensor) -> bool:
    """Whether the C++ CPU ops (engine/cpu_attention.py) take this tensor: fp32, contiguous, on CPU."""
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() and cpu_attention.available()


class RotaryEmbedding(nn.Module):
    """RoPE with the config's theta and scaling (default, linear, llama3, yarn, longrope, ... via HF's table), over the
    first rotary_dim of each head (Phi-3's partial_rotary_factor; all of it elsewhere)."""

    def __init__(self, config, head_dim: int, max_positions: int, kind: str | None = None):
        super().__init__()
        inv_freq, self.attention_scaling = _rope_inv_freq(config, head_dim, kind, max_positions)
        self.rotary_dim = 2 * inv_freq.numel()
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", (freqs.cos() * self.attention_scaling), persistent=False)
        self.register_buffer("sin", (freqs.sin() * self.attention_scaling), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for this step's positions, [T, 1, D/2]: looked up once, used by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] (HF's rotate_half convention: the two halves of D form the pairs); with tables of fewer
    than D/2 (a partial rotary dim), the first 2 x that many of D, the rest passed as they are."""
    dtype, rd = x.dtype, 2 * cos.shape[-1]
    x = x.float()
    x1, x2 = x[..., :rd].chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return (out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)).to(dtype)


def longrope_factors(config, max_positions: int) -> str | None:
    """Which of longrope's factor sets an engine of max_positions uses (_rope_inv_freq): "long" or "short"; None for
    any other RoPE."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type") != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings",
                                                                          None) or config.max_position_embeddings
    return "long" if max_positions > original else "short"


def rotary_dim(config, head_dim: int) -> int:
    """How much of each head RoPE rotates: head_dim times partial_rotary_factor (Phi-3's, in its config or its
    rope_parameters), all of it elsewhere."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor") if isinstance(params.get("partial_rotary_factor"), (int, float)) \
        else getattr(config, "partial_rotary_factor", None)
    return int(head_dim * (factor or 1.0))


def _rope_inv_freq(config, head_dim: int, kind: str | None = None,
                   max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, attention scaling). longrope (Phi-3's 128k models) has two sets of factors: the long
    ones where the engine's max_model_len passes original_max_position_embeddings, the short ones otherwise, for
    every position alike (llama.cpp's choice by context size; transformers switches per forward by its length,
    which would leave a cache of keys rotated the other way). "nope": no rotation (zero frequencies)."""
    if kind == "nope":
        return torch.zeros(rotary_dim(config, head_dim) // 2), 1.0
    params = getattr(config, "rope_parameters", None) or {}
    params = params[kind] if kind is not None else params
    scaling = getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    if rope_type == "default":
        dim = rotary_dim(config, head_dim)
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        return inv, 1.0
    if rope_type == "dynamic":
        raise ModelLoadError("dynamic NTK RoPE scaling is not supported (its frequencies depend on length)")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}")
    kw = {"layer_type": kind} if kind else {}
    if rope_type == "longrope":
        kw["seq_len"] = max_positions
    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **kw)
    return inv.float(), float(scale)


class RowParallelLinear(nn.Module):
    """A Linear whose input features are split over the ranks: the partial products are summed by one
    all-reduce and the bias is added once, after it. Parameter names match nn.Linear's (HF's)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp, self.packed, self.quant = tp, None, None

    def prepack(self) -> None:
        self.packed = PackedLinear(self.weight, None)
        del self.weight                                   # the packed copy replaces it

    def quantize(self, quant: "QuantLinear") -> None:
        """Packed weights (this rank's columns) replace the float ones; the bias is still added once, after."""
        self.quant = quant
        del self.weight

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's product of its columns: one term of the sum (a LoRA delta of its columns joins it)."""
        local = self.quant if self.quant is not None else self.packed if self.packed is not None else \
            (lambda t: F.linear(t, self.weight))
        return local(x)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        """The ranks' terms summed, then the bias once."""
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.partial(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the vocabulary (padded to an even shard): ids outside them look up zeros,
    and one all-reduce assembles every token's row."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.rows, self.per = vocab_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(self.per, hidden))
        self.tp, self.quant = tp, None

    def quantize(self, quant: "QuantEmbedding") -> None:
        """This rank's rows packed (a GGUF's embedding) replace the float ones."""
        self.quant = quant
        del self.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.rows.start) & (ids < self.rows.stop)
        local = (ids - self.rows.start) * mine
        h = (self.quant(local) if self.quant is not None else F.embedding(local, self.weight)) * mine.unsqueeze(-1)
        return self.tp.all_reduce(h)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup | None) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=bias) if tp is None else RowParallelLinear(
        in_features, out_features, bias, tp)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPGroup | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        if tp is None:
            self.q_heads, self.kv_heads = range(heads), range(kv_heads)
        else:                                             # this rank's share (engine/kv_layout.py)
            layout = check_heads(heads, kv_heads, tp.size)
            self.q_heads, self.kv_heads = query_heads_of(layout, heads, tp.rank), layout.heads_of(tp.rank)
        self.num_heads, self.num_kv_heads = len(self.q_heads), len(self.kv_heads)
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False)) or \
            config.model_type == "qwen2_moe" and bool(getattr(config, "qkv_bias", True)) or \
            config.model_type == "ernie4_5" and bool(getattr(config, "use_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        qk_norm = config.model_type in QK_NORM_MODEL_TYPES        # Qwen3: one norm of head_dim, every head alike
        self.full_qk_norm = config.model_type in FULL_QK_NORM_MODEL_TYPES     # OLMo: one over all heads at once
        if self.full_qk_norm and tp is not None:
            raise ModelLoadError(f"{config.model_type}'s q/k norms span every head: tensor parallelism is not supported "
                                 f"for it")
        q_dim, k_dim = (self.q_size, self.kv_size) if self.full_qk_norm else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, config.rms_norm_eps) if qk_norm or self.full_qk_norm else None
        self.k_norm = RMSNorm(k_dim, config.rms_norm_eps) if qk_norm or self.full_qk_norm else None
        # Seed-OSS: biases on q/k/v (attention_bias), none on o (attention_out_bias)
        out_bias = getattr(config, "attention_out_bias", None) if config.model_type == "seed_oss" else \
            getattr(config, "use_bias", None) if config.model_type == "ernie4_5" else \
            False if config.model_type == "glm4" else None             # GLM-4: biases on q/k/v only
        self.o_proj = row_linear(self.q_size, config.hidden_size,
                                 bool(getattr(config, "attention_bias", False) if out_bias is None else out_bias), tp)
        pre_scalar = getattr(config, "query_pre_attn_scalar", None) if config.model_type in SANDWICH_NORM_MODEL_TYPES \
            else None
        self.scale = (pre_scalar or self.head_dim) ** -0.5              # Gemma 2/3: query_pre_attn_scalar's
        if config.model_type == "granite":                                # Granite: its own attention_multiplier
            self.scale = float(config.attention_multiplier)
        self.window = layer_window(config, layer_idx)                    # engine/attention.py; 0: none
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        self.rope_kind = rope_kind(config, layer_idx)
        self.rotary_dim = rotary_dim(config, self.head_dim)
        self.rope_head_dim = self.head_dim                # what the RoPE tables are built for (MLA: its k_pe's)
        llama4 = config.model_type in LLAMA4_MODEL_TYPES
        types = getattr(config, "layer_types", None) or []
        # Llama 4: a chunked layer's queries see their own chunk of positions only (engine/attention.py)
        self.chunk = int(config.attention_chunk_size or 0) if llama4 and layer_idx < len(types) and \
            types[layer_idx] == "chunked_attention" else 0
        # ... its RoPE layers' q and k L2-normalised per head (no weight; before the rotation, which keeps norms)
        self.l2_qk_norm = llama4 and bool(config.use_qk_norm) and self.rope_kind != "nope"
        self.l2_eps = float(config.rms_norm_eps) if self.l2_qk_norm else 0.0
        # ... and its NoPE layers' queries scaled by a temperature that grows with position (LlamaForCausalLM.forward)
        self.temperature = llama4 and bool(config.attn_temperature_tuning) and self.rope_kind == "nope"
        self.one_kernel = False                           # set for quantized weights (engine/attention.py)
        # gpt-oss: a learned sink logit per query head, in every softmax (engine/attention.py); this rank's heads
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if config.model_type == "gpt_oss" else None

    def forward(self, x, ropes: dict, kv_cache: list[LayerKV], md: AttentionMetadata):
        """ropes: this step's cos/sin tables by rope_kind."""
        rope = ropes[self.rope_kind]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None or self.l2_qk_norm:
            qkv = self._qk_norm(qkv)
        k_cache, v_cache, k_scale, v_scale = kv_cache[self.layer_idx]
        # rotate and store in one op: fp32 caches, and int8 ones (fp8 codes are written by write_kv)
        fused = _cpu_kernel(qkv) and k_cache.dtype in (torch.float32, torch.int8) and self.rotary_dim == self.head_dim
        if fused:
            t = qkv.shape[0]
            cpu_attention.rope_write_kv(qkv, rope[0].view(t, -1), rope[1].view(t, -1), k_cache, v_cache,
                                        md.slot_mapping, self.num_heads, self.num_kv_heads, k_scale, v_scale)
            q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        else:
            qk = apply_rope(qkv[:, :self.q_size + self.kv_size].view(x.shape[0], -1, self.head_dim), *rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]        # one rotation for q and k
        v = qkv[:, self.q_size + self.kv_size:].view(-1, self.num_kv_heads, self.head_dim)
        if not fused:
            write_kv(k_cache, v_cache, k, v, md.slot_mapping, k_scale, v_scale)
        if self.temperature:
            q = (q * ropes["q_temperature"]).to(q.dtype)
        o = paged_attention(q, k_cache, v_cache, md, self.scale, k_new=k, v_new=v, one_kernel=self.one_kernel,
                            k_scale=k_scale, v_scale=v_scale, window=self.window, softcap=self.softcap,
                            sinks=self.sinks, chunk=self.chunk)
        return self.o_proj(o.reshape(-1, self.q_size))


    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3's: each head's q and k normalised over head_dim (before the rotation, as transformers does); OLMo's:
        the whole q and the whole k projection, each normalised over all its heads."""
        t, q_end, k_end = qkv.shape[0], self.q_size, self.q_size + self.kv_size
        if self.l2_qk_norm:                               # Llama 4's: no weight
            q = F.rms_norm(qkv[:, :q_end].reshape(t * self.num_heads, self.head_dim), (self.head_dim,), None,
                           self.l2_eps)
            k = F.rms_norm(qkv[:, q_end:k_end].reshape(t * self.num_kv_heads, self.head_dim), (self.head_dim,), None,
                           self.l2_eps)
            return torch.cat([q.view(t, -1), k.view(t, -1), qkv[:, k_end:]], dim=1)
        if self.full_qk_norm:
            return torch.cat([self.q_norm(qkv[:, :q_end]), self.k_norm(qkv[:, q_end:k_end]), qkv[:, k_end:]], dim=1)
        q = self.q_norm(qkv[:, :q_end].reshape(t * self.num_heads, self.head_dim))
        k = self.k_norm(qkv[:, q_end:k_end].reshape(t * self.num_kv_heads, self.head_dim))
        return torch.cat([q.view(t, -1), k.view(t, -1), qkv[:, k_end:]], dim=1)


def mla_scale(config) -> float:
    """MLA's softmax scale: 1 / sqrt(the q/k head size), times YaRN's mscale(factor, mscale_all_dim) squared where the
    RoPE is scaled so (DeepSeek's, as transformers computes it)."""
    import math
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    all_dim = params.get("mscale_all_dim", 0) if params.get("rope_type", params.get("type", "default")) != "default" \
        else 0
    if all_dim and params.get("factor", 1.0) > 1:
        mscale = 0.1 * all_dim * math.log(params["factor"]) + 1.0
        scale *= mscale * mscale
    return scale


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention, run as vLLM and SGLang run it, over a latent cache: a token's keys and
    values are one compressed vector c (kv_lora_rank, normed) and one rotated key part k_pe (qk_rope_head_dim) shared
    by every head, and each head's key and value are c times that head's rows of kv_b_proj (W_uk, W_uv). Absorbing
    W_uk into the query (q_nope W_uk: kv_lora_rank wide) makes each score [q_nope W_uk, q_pe] . [c, k_pe]: attention
    with one KV head of kv_lora_rank + qk_rope_head_dim dims whose value is the key's first kv_lora_rank, which the
    cache keeps once (kv_parts 1, engine/kv_layout.py); the output's first kv_lora_rank, times W_uv, is each head's
    value. The cache holds 576 numbers a token and layer for DeepSeek-V3 where its 128 heads' keys and values would
    be 40,960. Every attention path runs it as it runs MQA.

    Queries come from q_proj (V2-Lite) or a low-rank q_a_proj, q_a_layernorm, q_b_proj. Under TP each rank computes
    its heads (its rows of q_b_proj and kv_b_proj, its columns of o_proj) and keeps the whole latent, as a replicated
    KV head. RoPE over DeepSeek's interleaved pairs: q's and k_pe's rows are permuted at load (_unfused)."""

    def __init__(self, config, layer_idx: int, tp: TPGroup | None = None):
        super().__init__()
        self.layer_idx = layer_idx
        heads = config.num_attention_heads
        if tp is None:
            self.q_heads = range(heads)
        else:
            self.q_heads = query_heads_of(check_heads(heads, 1, tp.size), heads, tp.rank)
        self.kv_heads, self.num_heads, self.num_kv_heads = range(1), len(self.q_heads), 1
        self.nope, self.rope_dim = int(config.qk_nope_head_dim), int(config.qk_rope_head_dim)
        self.v_dim, self.rank = int(config.v_head_dim), int(config.kv_lora_rank)
        self.qk_dim = self.nope + self.rope_dim
        self.head_dim = self.rank + self.rope_dim        # the cache's one head
        self.rope_head_dim = self.rope_dim
        self.q_size = self.num_heads * self.v_dim         # attention's output, o_proj's input
        bias, hidden = bool(getattr(config, "attention_bias", False)), config.hidden_size
        q_lora = getattr(config, "q_lora_rank", None)
        if q_lora:
            self.q_a_proj = nn.Linear(hidden, q_lora, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(q_lora, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.rank, self.num_heads * (self.nope + self.v_dim), bias=False)   # stays float
        self.o_proj = row_linear(self.q_size, hidden, bias, tp)
        self.scale = mla_scale(config)
        self.rope_kind, self.one_kernel = None, False      # one RoPE table; set for quantized weights

    def forward(self, x, ropes: dict, kv_cache: list[LayerKV], md: AttentionMetadata):
        t = x.shape[0]
        cos, sin = ropes[self.rope_kind]
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(t, self.num_heads, self.qk_dim).split([self.nope, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]                # [heads, nope, rank], [heads, v, rank]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)          # [t, heads, rank]
        q = torch.cat([q_latent, apply_rope(q_pe, cos, sin)], dim=-1).contiguous()
        k = torch.cat([self.kv_a_layernorm(c.contiguous()), apply_rope(k_pe.reshape(t, 1, -1), cos, sin)[:, 0]],
                      dim=-1).view(t, 1, self.head_dim)
        k_cache, v_cache, k_scale, v_scale = kv_cache[self.layer_idx]
        write_kv(k_cache, None, k, None, md.slot_mapping, k_scale, None)
        o = paged_attention(q, k_cache, v_cache, md, self.scale, k_new=k, v_new=k, one_kernel=self.one_kernel,
                            k_scale=k_scale, v_scale=v_scale)
        o = torch.bmm(o[..., :self.rank].transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)   # [t, heads, v]
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None, intermediate_size: int | None = None):
        super().__init__()
        size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
        self.run = split_range(intermediate_size or config.intermediate_size, rank, size)   # this rank's units
        self.intermediate = len(self.run)
        bias = bool(getattr(config, "mlp_bias", False) or config.model_type == "ernie4_5" and
                    getattr(config, "use_bias", False))
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = row_linear(self.intermediate, config.hidden_size, bias, tp)
        self.act_name, self.act = activation(config)

    def forward(self, x):
        return self.down_proj(self._gated(x))

    def partial(self, x):
        """Under TP this rank's term of the output (its units), to be summed by the caller's all-reduce."""
        h = self._gated(x)
        return self.down_proj.partial(h) if isinstance(self.down_proj, RowParallelLinear) else self.down_proj(h)

    def _gated(self, x):
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.act(gate) * up


def _fused_moe_ops():
    """engine/moe_ops.py where Triton imports, else None; imported on first use (Triton's import is 0.15 s that a
    CPU engine never needs)."""
    from engine import moe_ops
    return moe_ops if moe_ops.triton is not None else None


def num_experts(config) -> int:
    """Experts per MoE layer (Mixtral's num_local_experts, Qwen2/3-MoE's num_experts, DeepSeek's n_routed_experts); 0
    for a dense model."""
    if config.model_type not in MOE_MODEL_TYPES:
        return 0
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
               or getattr(config, "n_routed_experts", None) or 0)


def is_moe_layer(config, layer_idx: int) -> bool:
    """Whether this layer's MLP is sparse: every layer of Mixtral; Qwen2/3-MoE's but those in mlp_only_layers and
    off their decoder_sparse_step (transformers' rule)."""
    if num_experts(config) == 0:
        return False
    if config.model_type in ("qwen2_moe", "qwen3_moe"):
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return layer_idx not in (getattr(config, "mlp_only_layers", None) or []) and (layer_idx + 1) % step == 0
    if config.model_type in LLAMA4_MODEL_TYPES:           # Llama 4: its moe_layers (Maverick's every other one)
        layers = getattr(config, "moe_layers", None)
        step = int(getattr(config, "interleave_moe_layer_step", 1) or 1)
        return layer_idx in layers if layers is not None else (layer_idx + 1) % step == 0
    if config.model_type in MLA_MODEL_TYPES:              # DeepSeek: dense first layers, then every moe_layer_freq-th
        return layer_idx >= int(getattr(config, "first_k_dense_replace", 0) or 0) and \
            layer_idx % int(getattr(config, "moe_layer_freq", 1) or 1) == 0
    return True


def moe_intermediate_size(config) -> int:
    """Each expert's intermediate units: Qwen2/3-MoE's moe_intermediate_size, Mixtral's intermediate_size."""
    if config.model_type in ("qwen2_moe", "qwen3_moe") or config.model_type in MLA_MODEL_TYPES:
        return int(config.moe_intermediate_size)
    return int(config.intermediate_size)


class SparseMoE(nn.Module):
    """A sparse MLP block: the router's softmax over the experts, each token's top k (renormalised to sum to 1 for
    Mixtral, and for Qwen2/3-MoE where norm_topk_prob), each expert a SiLU-gated MLP, a token's output its
    experts' outputs weighted. Experts are stacked as transformers keeps them: gate_up_proj [E, 2I, H], down_proj [E, H, I].

    The step's (token, expert) pairs are sorted by expert and each expert hit runs once on its tokens: its weights
    are read once a step however many tokens chose it. On CUDA one Triton kernel a projection does it
    (engine/moe_ops.py, vLLM's fused_moe), reading nothing back; elsewhere, and for packed experts, a loop over the
    experts hit, whose counts cross to the host (one sync a layer). MoE models run eagerly (engine/model_runner.py
    graph_plan): the fused kernel's capture in a CUDA graph awaits a GPU run.

    Packed experts (a GGUF's, a GPTQ/AWQ/FP8 checkpoint's, quantization="int8"/"fp8"): each expert's gate/up and
    down become a QuantLinear (`packed`), read as stored, in place of that projection's stacked floats.

    Qwen2-MoE adds a shared expert every token passes through (a dense MLP of shared_expert_intermediate_size),
    scaled by the sigmoid of its own gate; under TP its term joins the experts' before the one all-reduce. DeepSeek's
    routing and shared experts: _deepseek_route and __init__."""

    def __init__(self, config, tp: TPGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        size, rank = (1, 0) if tp is None else (tp.size, tp.rank)
        self.num_experts, self.top_k = num_experts(config), int(config.num_experts_per_tok)
        if not 0 < self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.top_k} must be within 1..{self.num_experts} experts")
        if expert_parallel and size > 1:                  # this rank's run of whole experts
            self.local = split_range(self.num_experts, rank, size)
            self.run = range(moe_intermediate_size(config))
        else:                                             # every expert, this rank's run of each one's units
            self.local = range(self.num_experts)
            self.run = split_range(moe_intermediate_size(config), rank, size)
        self.intermediate = len(self.run)
        # gpt-oss: a softmax over the top k logits, which is the full softmax's top k renormalised
        self.renormalize = config.model_type in ("mixtral", "gpt_oss") or bool(getattr(config, "norm_topk_prob", False))
        # gpt-oss: its router has a bias, its experts' projections too, and its gate is a clamped SwiGLU
        self.gpt_oss = config.model_type == "gpt_oss"
        # its down projection's bias joins an expert's output once: on the rank holding the expert whole (expert
        # parallel), or on rank 0 where each rank holds a run of every expert's units (the sum is all-reduced)
        self.down_bias_here = tp is None or (expert_parallel and size > 1) or rank == 0
        self.gate = nn.Linear(config.hidden_size, self.num_experts, bias=self.gpt_oss)     # the router: replicated
        self.experts = nn.Module()                        # this rank's experts: global e is row e - local.start
        self.experts.gate_up_proj = nn.Parameter(torch.empty(len(self.local), 2 * self.intermediate,
                                                             config.hidden_size))
        self.experts.down_proj = nn.Parameter(torch.empty(len(self.local), config.hidden_size, self.intermediate))
        if self.gpt_oss:
            self.experts.gate_up_proj_bias = nn.Parameter(torch.empty(len(self.local), 2 * self.intermediate))
            self.experts.down_proj_bias = nn.Parameter(torch.empty(len(self.local), config.hidden_size))
            self.swiglu_alpha, self.swiglu_limit = float(config.swiglu_alpha), float(config.swiglu_limit)
        self.tp = tp
        self.packed: dict[str, nn.ModuleList] = {}       # "gate_up_proj" / "down_proj" -> one QuantLinear an expert
        shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
        self.shared_expert = MLP(config, tp, shared) if shared else None
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if shared else None
        # DeepSeek: V3 scores experts by a sigmoid and chooses by score + a per-expert correction bias (the weights
        # stay the scores); V2 by the softmax. Both may limit a token to its topk_group best groups of experts
        # (n_group of them): V3 ranks a group by the sum of its two best, V2 ("group_limited_greedy") by its best.
        # The chosen weights (renormalised where norm_topk_prob) are scaled by routed_scaling_factor, and
        # n_shared_experts experts' worth of a dense MLP every token passes through (no gate) adds its term.
        deepseek = config.model_type in MLA_MODEL_TYPES
        self.sigmoid = config.model_type == "deepseek_v3"
        n_group = int(getattr(config, "n_group", None) or 1) if deepseek else 1
        grouped = self.sigmoid or getattr(config, "topk_method", None) == "group_limited_greedy"
        self.groups = (n_group, int(config.topk_group)) if deepseek and grouped and n_group > 1 else None
        if self.groups and (self.num_experts % n_group or not 0 < self.groups[1] <= n_group):
            raise ModelLoadError(f"{self.num_experts} experts do not form {n_group} groups of which to keep "
                                 f"{self.groups[1]}")
        self.routed_scaling = float(getattr(config, "routed_scaling_factor", None) or 1.0) if deepseek else 1.0
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts)) if self.sigmoid else None
        n_shared = int(getattr(config, "n_shared_experts", None) or 0) if deepseek else 0
        # Llama 4: each token's top expert by its logit, weighted by the logit's sigmoid on the expert's input (not its
        # output), and a shared expert of the experts' width, ungated as DeepSeek's
        self.llama4 = config.model_type in LLAMA4_MODEL_TYPES
        n_shared = 1 if self.llama4 else n_shared
        self.shared_experts = MLP(config, tp, moe_intermediate_size(config) * n_shared) if n_shared else None

    def pack(self, which: str, experts: list[list[QuantWeight]]) -> None:
        """Every expert's `which` ("gate_up_proj": its gate's and up's parts; "down_proj") as packed weights, in
        place of the stacked floats."""
        old = getattr(self.experts, which)
        mods = nn.ModuleList(QuantLinear(parts, None, old.device, dtype=old.dtype) for parts in experts)
        self.add_module(f"packed_{which}", mods)
        self.packed[which] = mods
        delattr(self.experts, which)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], experts [T, k]) of each token: softmax in fp32, the top k, renormalised where the model
        does."""
        logits = self.gate(x).float()
        if self.sigmoid or self.groups:
            return self._deepseek_route(logits, x.dtype)
        if self.llama4:                                   # the top logits' sigmoids
            top, experts = torch.topk(logits, self.top_k, dim=-1)
            return torch.sigmoid(top).to(x.dtype), experts
        probs = torch.softmax(logits, dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def _deepseek_route(self, logits: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSeek's routing (__init__): scores, the groups kept, the top k of those groups' experts by score (V3:
        plus its correction bias), weighted by their scores."""
        scores = logits.sigmoid() if self.sigmoid else torch.softmax(logits, dim=-1)
        choice = scores + self.e_score_correction_bias.float() if self.sigmoid else scores
        if self.groups is not None:
            n_group, keep = self.groups
            grouped = choice.view(choice.shape[0], n_group, -1)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1) if self.sigmoid else grouped.amax(dim=-1)
            kept = torch.zeros_like(group_scores, dtype=torch.bool)
            kept.scatter_(1, torch.topk(group_scores, keep, dim=-1)[1], True)
            choice = choice.masked_fill(~kept.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        experts = torch.topk(choice, self.top_k, dim=-1)[1]
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * self.routed_scaling).to(dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        moe_ops = _fused_moe_ops() if (x.is_cuda if FUSED_MOE is None else FUSED_MOE) and not self.packed and \
            not (self.llama4 and self.top_k > 1) else None
        if moe_ops is not None:
            x_in = x
            if self.llama4:                               # one expert a token: its weight scales its input
                x_in, weights = x * weights, torch.ones_like(weights)
            pairs_per_expert = x.shape[0] * self.top_k / self.num_experts     # from shapes: a graph may hold it
            extra = {} if not self.gpt_oss else {
                "b13": self.experts.gate_up_proj_bias, "activation": self._gpt_oss_gate,
                "b2": self.experts.down_proj_bias if self.down_bias_here else None}
            out = moe_ops.fused_moe(x_in, self.experts.gate_up_proj, self.experts.down_proj, weights, experts,
                                    block_m=64 if pairs_per_expert >= 64 else 16, block_n=64, block_k=64,
                                    expert_start=self.local.start, **extra)
            return self._finish(x, out)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)                    # pairs by expert; tokens in order within one
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        gate_up, down = self._projection("gate_up_proj"), self._projection("down_proj")
        start = 0
        for e, n in enumerate(counts):
            start += n
            if n == 0 or e not in self.local:             # expert parallel: another rank's expert adds its term
                continue
            rows, i = tokens[start - n:start], e - self.local.start
            if self.gpt_oss:
                y = down(i, self._gpt_oss_gate(gate_up(i, x[rows]) + self.experts.gate_up_proj_bias[i]))
                if self.down_bias_here:
                    y = y + self.experts.down_proj_bias[i]
                y = y * pair_weights[start - n:start, None]
            elif self.llama4:                             # the weight on the expert's input
                gate, up = gate_up(i, x[rows] * pair_weights[start - n:start, None]).split(self.intermediate, dim=-1)
                y = down(i, F.silu(gate) * up)
            else:
                gate, up = gate_up(i, x[rows]).split(self.intermediate, dim=-1)
                y = down(i, F.silu(gate) * up) * pair_weights[start - n:start, None]
            out.index_add_(0, rows, y)
        return self._finish(x, out)

    def _gpt_oss_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gpt-oss's gate: the gate clamped above at `limit`, the up part within +-limit, (up + 1) * gate *
        sigmoid(alpha * gate) (transformers' GptOssExperts, over our gate-then-up halves)."""
        gate, up = gate_up.split(self.intermediate, dim=-1)
        gate, up = gate.clamp(max=self.swiglu_limit), up.clamp(-self.swiglu_limit, self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))

    def _finish(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The experts' sum, plus the shared expert's gated term where the model has one, summed over the ranks."""
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.partial(x)
        if self.shared_experts is not None:              # DeepSeek's and Llama 4's: ungated
            out = out + self.shared_experts.partial(x)
        return out if self.tp is None else self.tp.all_reduce(out)

    def _projection(self, which: str):
        """(expert, x) -> x through that expert's `which`: its packed QuantLinear, or its row of the stacked floats."""
        if which in self.packed:
            mods = self.packed[which]
            return lambda e, x: mods[e](x)
        w = getattr(self.experts, which)
        return lambda e, x: F.linear(x, w[e])


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, tp: TPGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        self.self_attn = (MLAAttention if config.model_type in MLA_MODEL_TYPES else Attention)(config, layer_idx, tp)
        dense = getattr(config, "intermediate_size_mlp", None) if config.model_type in LLAMA4_MODEL_TYPES else None
        self.mlp = SparseMoE(config, tp, expert_parallel) if is_moe_layer(config, layer_idx) else \
            MLP(config, tp, dense)
        # OLMo 2/3 normalise attention's and the MLP's outputs, not their inputs: no input_layernorm
        self.post_norm = config.model_type in POST_NORM_MODEL_TYPES
        self.parallel = config.model_type in PARALLEL_BLOCK_MODEL_TYPES     # Cohere: one norm for both sublayers
        norm, eps = norm_class(config), getattr(config, "rms_norm_eps", None)
        self.input_layernorm = None if self.post_norm else norm(config.hidden_size, eps)
        self.post_attention_layernorm = None if self.parallel else RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Gemma 2/3: post_attention_layernorm normalises attention's output, and two more norms frame the MLP
        self.sandwich = config.model_type in SANDWICH_NORM_MODEL_TYPES
        # Granite scales attention's and the MLP's outputs before each joins the residual stream
        self.residual_multiplier = float(getattr(config, "residual_multiplier", 1.0)) \
            if config.model_type == "granite" else 1.0
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.sandwich or self.post_norm:
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, ropes, kv_cache, md):
        """x: the last layer's output (the embeddings, with residual None, for the first); residual: the stream
        so far. Returns (this layer's output, the stream): each norm adds the two first (vLLM's fused add)."""
        if self.parallel:                      # Cohere: attention and the MLP of the same normed stream, summed
            if residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h = self.input_layernorm.add(x, residual)
            return self.self_attn(h, ropes, kv_cache, md) + self.mlp(h), residual
        if self.post_norm:                     # OLMo: stream + norm(attention(stream)), then + norm(MLP(that))
            residual = x if residual is None else residual.add_(x)
            residual = residual + self.post_attention_layernorm(self.self_attn(residual, ropes, kv_cache, md))
            return self.post_feedforward_layernorm(self.mlp(residual)), residual
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h = self.input_layernorm.add(x, residual)
        a = self.self_attn(h, ropes, kv_cache, md)
        if self.sandwich:
            h = self.pre_feedforward_layernorm.add(self.post_attention_layernorm(a), residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        if self.residual_multiplier != 1.0:
            h = self.post_attention_layernorm.add(a * self.residual_multiplier, residual)
            return self.mlp(h) * self.residual_multiplier, residual
        h = self.post_attention_layernorm.add(a, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config, tp: TPGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        self.embed_tokens = (nn.Embedding(config.vocab_size, config.hidden_size) if tp is None
                             else VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp, expert_parallel)
                                    for i in range(config.num_hidden_layers))
        self.norm = norm_class(config)(config.hidden_size, getattr(config, "rms_norm_eps", None))


class PackedLinear(nn.Module):
    """A Linear whose weight oneDNN reordered once for CPU fp32 GEMMs.

    MKL's sgemm behind F.linear repacks the weight on every call; with the packing done at load,
    the same products run 1.3-3x faster at decode batch sizes and 10-20% faster on prefill chunks
    (measured on the 2-core EPYC, see docs/benchmarks.md).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def _quant_kernels():
    """engine/quant_kernels.py when its C++ kernel built on this machine, else None."""
    try:
        from engine import quant_kernels
    except ImportError:
        return None
    return quant_kernels if quant_kernels.available() else None


class QuantLinear(nn.Module):
    """A Linear over packed quantized weights (engine/quant.py), read as stored on every call: on CPU by the C++
    kernel (engine/quant_kernels.py; FP8 there as torch's `_scaled_mm` computes it, e4m3 activations), on CUDA by
    the Triton kernel (engine/quant_triton.py) and FP8 by `_scaled_mm`, at decode-sized batches by the Triton
    kernel (weight-only: the FP8 GEMM is slower than bf16 there). Parts of different kinds (a Q4_K_M GGUF's Q6_K
    v beside its Q4_K q and k) run one call each. On CPU without a compiler the weight is dequantized once and runs
    as an fp32 Linear (FP8: through torch's own `_scaled_mm`)."""

    def __init__(self, parts: list[QuantWeight], bias: torch.Tensor | None, device: torch.device | None = None,
                 triton: bool | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else parts[0].qs.device
        triton = device.type != "cpu" if triton is None else triton   # True on CPU: the interpreter (tests)
        same = all((p.kind, p.group) == (parts[0].kind, parts[0].group) and p.same_columns(parts[0]) for p in parts)
        weights = [QuantWeight.cat(parts)] if same and len(parts) > 1 else list(parts)
        self.sources = [p.source for p in parts]
        self.calls = [(w.kind, w.group, *w.shape) for w in weights]      # what each kernel call computes
        # GPTQ act-order: the order each call reads x's columns in (None: as they come)
        self.perms = [None if w.perm is None else w.perm.to(device) for w in weights]
        self.bias = None if bias is None else bias.detach().to(device)
        self.packed, self.dense, self.weights, self.tinygemm = [], None, [], []
        self.kernels = None if triton else _quant_kernels()
        if self.kernels is not None and any(w.kind in ("q4", "q8") and w.shape[1] % 32 for w in weights):
            self.kernels = None              # the kernel quantizes activations in blocks of 32 columns
        # FP8 on CPU: the C++ kernel where it builds (K % 16 == 0), else torch's _scaled_mm (50x slower)
        if triton or any(w.kind == "f8" for w in weights) and (
                self.kernels is None or any(w.kind == "f8" and w.shape[1] % 16 for w in weights)):
            self.weights = [w.to(device) for w in weights]              # GPU kernels and FP8 read them as stored
            self.fp8 = [(w.scales.view(1, -1).contiguous(), fp8_gemm_supported(device) and (
                device.type != "cuda" or w.shape[0] % 16 == 0 and w.shape[1] % 16 == 0))    # CUDA's GEMM: 16s
                if w.kind == "f8" else None for w in self.weights]
            self.wo_matmul, self.f8_weight_only_m = None, -1     # -1: FP8 always through its GEMM
            self.tinygemm, self.tinygemm_max_m, self.tinygemm_dtype = [None] * len(self.weights), -1, None
            if triton:
                from engine.quant_triton import FP8_WEIGHT_ONLY_MAX_M, wo_matmul
                self.wo_matmul = wo_matmul
                if device.type == "cuda" and dtype == torch.bfloat16:   # decode-sized q4 batches: torch's tinygemm
                    self.tinygemm = [tinygemm_pack(w, dtype) for w in self.weights]
                    self.tinygemm_max_m, self.tinygemm_dtype = TINYGEMM_MAX_M, dtype
                # decode-sized batches read e4m3 weights in the Triton kernel (Triton converts e4m3 on CUDA 8.9+)
                if device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9):
                    self.f8_weight_only_m = FP8_WEIGHT_ONLY_MAX_M
            return
        if self.kernels is not None:         # the kernel's own layout replaces the loader's
            self.packed = [self.kernels.prepare(w.kind, w.qs, w.scales, w.mins, w.group) for w in weights]
        else:                                # no compiler: dequantized once
            self.dense = torch.cat([w.dequantize() for w in weights])
            self.fallback = PackedLinear(self.dense, self.bias) if can_prepack(self.dense.device, torch.float32) \
                else (lambda x: F.linear(x, self.dense, self.bias))

    def tensors(self) -> list[torch.Tensor]:
        """What it holds in memory (weight_bytes)."""
        held = [t for p in self.packed for t in p] + ([] if self.dense is None else [self.dense])
        held += [t for w in self.weights for t in (w.qs, w.scales, w.mins) if t is not None]
        held += [t for pack in self.tinygemm if pack is not None for t in pack]
        return held + ([] if self.bias is None else [self.bias])

    def route(self, m: int, dtype: torch.dtype, i: int = 0) -> str:
        """The kernel that weight i's call on m tokens of `dtype` runs (GPU branch): "tinygemm", "triton", or FP8's
        "scaled_mm" (or "dense" where the device has no FP8 GEMM)."""
        if self.tinygemm[i] is not None and m <= self.tinygemm_max_m and dtype == self.tinygemm_dtype:
            return "tinygemm"
        if self.fp8[i] is None or m <= self.f8_weight_only_m:
            return "triton"
        return "scaled_mm" if self.fp8[i][1] else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weights:
            x2 = x.reshape(-1, x.shape[-1])
            kernels = [self.route(x2.shape[0], x2.dtype, i) for i in range(len(self.weights))]
            xs = [x2 if perm is None else x2.index_select(1, perm) for perm in self.perms]
            ys = [tinygemm_matmul(xi, w, self.tinygemm[i]) if kernel == "tinygemm"
                  else self.wo_matmul(xi, w) if kernel == "triton" else fp8_matmul(xi, w, *self.fp8[i])
                  for i, (w, kernel, xi) in enumerate(zip(self.weights, kernels, xs))]
            y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
            y = y.reshape(*x.shape[:-1], y.shape[-1])
            return y if self.bias is None else y + self.bias.to(y.dtype)
        if self.dense is not None:
            return self.fallback(x.float()).to(x.dtype)
        x32 = x.float().contiguous()
        ys = [self.kernels.matmul(x32 if perm is None else x32.index_select(1, perm), p, *call)
              for call, p, perm in zip(self.calls, self.packed, self.perms)]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
        return (y if self.bias is None else y + self.bias).to(x.dtype)


class QuantEmbedding(nn.Module):
    """Token embeddings kept packed: a lookup dequantizes only the rows it reads, to the model's dtype."""

    def __init__(self, weight: QuantWeight, device: torch.device | None = None, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight = weight if device is None else weight.to(device)
        self.dtype = dtype

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qweight.qs, self.qweight.scales, self.qweight.mins) if t is not None]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.qweight.dequantize(ids).to(self.dtype)


# one expert's tensor in a checkpoint: Qwen3-MoE's names, and Mixtral's (block_sparse_moe, read as mlp, and w1/w3/w2)
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_PARTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_STACKED_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")
_EXPERT_BIASES = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj_bias|down_proj_bias)$")


_GPT_OSS_EXPERTS = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")


def _gpt_oss_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A gpt-oss checkpoint's tensors as the other mixtures' (stacked experts, transformers 5's in-memory layout):
    its router is the MoE's `gate`; its experts' gate_up_proj [E, H, 2I], gate and up interleaved column by column,
    becomes [E, 2I, H], gate's rows then up's (its bias likewise); down_proj [E, I, H] becomes [E, H, I]. An MXFP4
    checkpoint's experts (the released gpt-oss: `_blocks` of 4-bit e2m1 pairs and `_scales`, a power of two per 32
    values) are dequantized first, by transformers' own function, to that same [E, H, 2I] / [E, I, H] layout."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in weights:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        m = _GPT_OSS_EXPERTS.match(name)
        if m is None:
            yield name, t
            continue
        prefix, which, suffix = m.groups()
        if suffix in ("_blocks", "_scales"):
            got = pending.setdefault(prefix + which, {})
            got[suffix] = t
            if len(got) < 2:
                continue
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors
            t, suffix = convert_moe_packed_tensors(got["_blocks"], got["_scales"], dtype=torch.float32), None
            del pending[prefix + which]
        if suffix == "_bias":
            yield name, _deinterleave(t, 1) if which == "gate_up_proj" else t
        elif which == "gate_up_proj":
            yield prefix + which, _deinterleave(t.transpose(1, 2), 1).contiguous()
        else:
            yield prefix + which, t.transpose(1, 2).contiguous()
    if pending:
        raise ModelLoadError(f"MXFP4 experts without both blocks and scales: {sorted(pending)[:3]}")


_LLAMA4_NAMES = ((".feed_forward.router.", ".mlp.gate."), (".feed_forward.shared_expert.", ".mlp.shared_experts."),
                 (".feed_forward.", ".mlp."))


def llama4_name(name: str) -> str:
    """A Llama 4 checkpoint's name as the other mixtures': feed_forward is the MLP, its router the gate, its shared
    expert DeepSeek's ungated shared_experts."""
    for old, new in _LLAMA4_NAMES:
        if old in name:
            return name.replace(old, new)
    return name


def _llama4_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A Llama 4 checkpoint's tensors under llama4_name, its stacked experts (gate_up_proj [E, H, 2I]: gate's
    columns then up's; down_proj [E, I, H]) as the other mixtures' stacked experts ([E, 2I, H], [E, H, I])."""
    for name, t in weights:
        name = llama4_name(name)
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")) and t.dim() == 3:
            t = t.transpose(1, 2).contiguous()
        yield name, t


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's gate/up pairs along `dim` (gate at even indices, up at odd) as gate's half, then up's."""
    return t.index_select(dim, halves_from_pairs(t.shape[dim], t.shape[dim]))


def _absorbed(parent: nn.Module, name: str) -> bool:
    """MLA's kv_b_proj: read as a weight (absorbed into the query and the output), never run as a Linear, so neither
    packed nor quantized."""
    return isinstance(parent, MLAAttention) and name == "kv_b_proj"


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    import os
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and os.environ.get("BATON_CPU_PACKED", "1") != "0")


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, kv_cache, md, logits_indices) -> logits of the chosen rows
    (None on TP ranks other than 0). kv_cache: every layer's views of the cache (KVCacheSpec.layers)."""

    def __init__(self, config, max_positions: int, tp: TPGroup | None = None, expert_parallel: bool = False):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(f"model_type {config.model_type!r} is not supported "
                                 f"(supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
        self.config, self.tp = config, tp
        self.model = LlamaModel(config, tp, expert_parallel)
        attn = self.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim      # this rank's KV heads
        self.total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.kv_parts = 2                                 # engine/kv_layout.py: K and V, or MLA's one latent
        if isinstance(attn, MLAAttention):
            self.total_kv_heads, self.kv_parts = 1, 1
        self.num_layers = config.num_hidden_layers
        self.max_positions = max_positions
        # RoPE tables by rope_kind (Gemma 3's two; else one, under None), built by materialize() on the real device
        self.ropes: dict[str | None, RotaryEmbedding] = {}
        gemma = config.model_type in GEMMA_MODEL_TYPES
        # Gemma scales its embeddings by sqrt(hidden), Granite by its embedding_multiplier
        self.embed_scale = config.hidden_size ** 0.5 if gemma else float(config.embedding_multiplier) \
            if config.model_type == "granite" and config.embedding_multiplier != 1.0 else None
        self.norm_offset = 1.0 if gemma else 0.0        # Gemma's norms multiply by 1 + weight: added at load
        self.final_softcap = float(getattr(config, "final_logit_softcapping", None) or 0.0)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0)) if config.model_type == "granite" else 1.0
        self.logit_scale = float(config.logit_scale) if config.model_type in PARALLEL_BLOCK_MODEL_TYPES else 1.0
        self.multimodal = getattr(config, "multimodal", None)   # engine/loader.py: the text of a Gemma 3 4B+
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.q_temperature = (float(config.floor_scale), float(config.attn_scale)) if any(
            getattr(la.self_attn, "temperature", False) for la in self.model.layers) else None
        self._stack, self._stack_kv = None, None        # cpu_stack(): the C++ forward, when it applies
        self._stack_lora = None                          # the LoRA adapters' step (engine/lora.py), where it has them
        vocab = config.vocab_size if tp is None else vocab_range(config.vocab_size, tp.rank, tp.size)[1]
        self.lm_head = nn.Linear(config.hidden_size, vocab, bias=False)
        self.tie_weights()

    @property
    def has_moe(self) -> bool:
        return any(isinstance(layer.mlp, SparseMoE) for layer in self.model.layers)

    def dense_mlp(self) -> "MLP | None":
        """The first dense MLP (every dense layer's is split alike), or None where every layer is sparse."""
        return next((layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MLP)), None)

    def tie_weights(self) -> None:
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def materialize(self, device: torch.device, dtype: torch.dtype) -> "LlamaForCausalLM":
        """Allocate (uninitialised) storage for a model built on the meta device."""
        self.to_empty(device=device).to(dtype).requires_grad_(False)
        self.tie_weights()
        self._build_ropes(device)
        return self

    def _build_ropes(self, device: torch.device) -> None:
        kinds = {layer.self_attn.rope_kind for layer in self.model.layers}
        dim = self.model.layers[0].self_attn.rope_head_dim
        self.ropes = {kind: RotaryEmbedding(self.config, dim, self.max_positions, kind).to(device) for kind in kinds}

    @property
    def rope_tag(self) -> str:
        """What the KV's rotation depends on beyond the config: longrope's factor set (engines with others cannot
        share blocks), else nothing."""
        factors = longrope_factors(self.config, self.max_positions)
        return f":rope-{factors}" if factors else ""

    def cover_positions(self, max_positions: int) -> None:
        """Rotary tables for this many positions (an engine sharing weights loaded for another max_model_len)."""
        if max_positions != self.max_positions:
            self.max_positions = max_positions
            self._build_ropes(next(iter(self.ropes.values())).cos.device)

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, md: AttentionMetadata, logits_indices,
                num_layers: int | None = None, hidden_indices: torch.Tensor | None = None,
                aux_layers: tuple[int, ...] | None = None):
        """`num_layers` runs only the first layers, then the final norm and head (layer-skip drafts).
        `hidden_indices`: rows whose final hidden states (after the last norm) embedding requests pool; given, the
        forward returns (logits, those hidden states). `aux_layers` (with hidden_indices; an EAGLE-3 head reads them):
        it returns (logits, those hidden states, the residual stream entering each of those layers at those rows,
        side by side)."""
        h, residual = self.model.embed_tokens(input_ids), None
        if self.embed_scale is not None:                 # in the embeddings' dtype, as transformers rounds it
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype)
        aux = {} if aux_layers is not None and hidden_indices is not None else None     # layer -> its stream's rows
        streams = None
        stack = self.cpu_stack(h, kv_cache)
        if stack is not None:                            # the same ops in C++, the GIL released (engine/cpu_model.py)
            plan = self._stack_lora.groups if self._stack_lora is not None else None     # None: no adapter this step
            streams = None if aux is None else h.new_empty(h.shape[0], len(aux_layers) * h.shape[1])
            h, residual = stack.forward(h, [r.cos[positions] for r in self.ropes.values()],
                                        [r.sin[positions] for r in self.ropes.values()], md.slot_mapping,
                                        md.block_tables, md.seq_lens, md.query_start_loc,
                                        -1 if num_layers is None else num_layers,
                                        plan.rows if plan else None, plan.row_slots if plan else None,
                                        list(aux_layers) if aux is not None else [], streams)
            if aux is not None:
                streams = streams[hidden_indices]
        else:
            ropes = {kind: rope.tables(positions) for kind, rope in self.ropes.items()}
            if self.q_temperature is not None:           # Llama 4's NoPE layers: log1p(floor((p + 1) / f)) * a + 1
                floor_scale, attn_scale = self.q_temperature
                ropes["q_temperature"] = (torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) *
                                          attn_scale + 1.0).view(-1, 1, 1)
            for i, layer in enumerate(self.model.layers[:num_layers]):
                if aux is not None and i in aux_layers:
                    aux[i] = h[hidden_indices] if residual is None else h[hidden_indices] + residual[hidden_indices]
                h, residual = layer(h, residual, ropes, kv_cache, md)
            if aux is not None:                          # side by side in aux_layers' order, as the stack writes them
                streams = torch.cat([aux[i] for i in aux_layers], dim=-1)
        if residual is not None:
            h = residual.add_(h)
        pooled = None if hidden_indices is None else self.model.norm(h[hidden_indices])
        h = self.model.norm(h[logits_indices])       # only rows that are sampled need the head
        if self.tp is None:
            logits = self._cap(self.lm_head(h).float())
        else:
            logits = self.tp.gather_to_driver(self.lm_head(h))
            logits = None if logits is None else self._cap(logits[:, :self.config.vocab_size].float())
        if aux is not None:
            return logits, pooled, streams
        return logits if hidden_indices is None else (logits, pooled)

    def _cap(self, logits: torch.Tensor) -> torch.Tensor:
        """Gemma 2's final softcap: C * tanh(logits / C); Granite's logits over its logits_scaling, Cohere's times its
        logit_scale; in place (fp32)."""
        if self.logits_scaling != 1.0:
            logits.div_(self.logits_scaling)
        if self.logit_scale != 1.0:                        # Cohere's: logits times logit_scale
            logits.mul_(self.logit_scale)
        if self.final_softcap:
            logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def cpu_stack(self, x: torch.Tensor, kv_cache: list[LayerKV]):
        """The C++ DecoderStack (engine/cpu_model.py) for this forward, or None where the modules run it: it takes a
        CPU fp32 model at TP 1 whose every linear is packed for the kernel (LoRA adapters wrapping them included: the
        stack adds their products with the same kernel) and an fp32 or int8 cache. Built at the first forward (after the
        engine's set-up swapped in what it swaps); the cache's views are handed over when they change."""
        from engine import cpu_model
        # the cheap tests first: on a GPU the CPU extension is never built (its compile took 36 s of a first engine)
        if x.dtype != torch.float32 or x.device.type != "cpu" or not kv_cache \
                or kv_cache[0].k.dtype not in (torch.float32, torch.int8):
            return None
        if self._stack is None:
            self._stack = self._build_cpu_stack() or False
        if not self._stack:
            return None
        if self._stack_kv is not kv_cache:
            self._stack.set_kv([c.k for c in kv_cache], [c.v for c in kv_cache],
                               [c.k_scale for c in kv_cache], [c.v_scale for c in kv_cache])
            self._stack_kv = kv_cache
        return self._stack if cpu_model.stack_enabled() else None

    def _build_cpu_stack(self):
        from engine import cpu_model
        from engine.lora import LoRALinear
        from engine.quant_kernels import KINDS
        layers = self.model.layers
        # the C++ stack runs dense MLPs of SiLU or GELU gates, RoPE over whole heads, norms before each sublayer
        # and q/k norms per head
        if self.has_moe or any(isinstance(la.self_attn, MLAAttention) or la.mlp.act_name not in STACK_ACTIVATIONS
                               or la.self_attn.chunk or la.self_attn.l2_qk_norm or la.self_attn.temperature
                               or la.post_norm or la.parallel
                               or la.self_attn.full_qk_norm
                               or la.self_attn.rotary_dim != la.self_attn.head_dim for la in layers):
            return None
        attn, mlp = layers[0].self_attn, layers[0].mlp
        wrapped = [(la.self_attn.qkv_proj, la.self_attn.o_proj, la.mlp.gate_up_proj, la.mlp.down_proj) for la in layers]
        adapters = [[m if isinstance(m, LoRALinear) else None for m in ms] for ms in wrapped]
        linears = [[m.base if a is not None else m for m, a in zip(ms, ad)] for ms, ad in zip(wrapped, adapters)]
        if self.tp is not None or not cpu_model.available() or not all(la.self_attn.one_kernel for la in layers) \
                or not all(isinstance(m, QuantLinear) and m.packed and m.dense is None and not any(
                    p is not None for p in m.perms) for ms in linears for m in ms) \
                or any(a is not None and a.layout != "cpu" for ad in adapters for a in ad):
            return None
        norm = layers[0].input_layernorm
        stack = cpu_model.kernels().DecoderStack(attn.num_heads, attn.num_kv_heads, attn.head_dim, mlp.intermediate,
                                                 norm.eps, attn.scale)
        for la, ms in zip(layers, linears):
            parts = [([(p, KINDS[kind], group, n) for (kind, group, n, _k), (p,) in zip(m.calls, m.packed)], m.bias)
                     for m in ms]
            norms = [None if n is None else n.weight.detach() for n in (la.self_attn.q_norm, la.self_attn.k_norm)]
            # Gemma 2/3: the norm before the MLP is pre_feedforward_layernorm; post_attention_layernorm and
            # post_feedforward_layernorm normalise attention's and the MLP's outputs
            pre_mlp, outs = (la.pre_feedforward_layernorm,
                             (la.post_attention_layernorm, la.post_feedforward_layernorm)) \
                if la.sandwich else (la.post_attention_layernorm, (None, None))
            stack.add_layer(la.input_layernorm.weight.detach(), pre_mlp.weight.detach(),
                            *[a for part in parts for a in part], *norms, la.self_attn.window, la.self_attn.softcap,
                            *[None if n is None else n.weight.detach() for n in outs],
                            la.mlp.act_name != "silu", list(self.ropes).index(la.self_attn.rope_kind),
                            la.residual_multiplier)
        for i, ad in enumerate(adapters):               # LoRA's slots, shared: an adapter loaded later is seen there
            for which, a in enumerate(ad):
                if a is not None:
                    stack.set_lora(i, which, a.a, a.b)
                    self._stack_lora = a.step
        return stack

    def embedding_rows(self, n: int) -> torch.Tensor:
        """The first n rows of the token embedding, as numbers (packed or not): the weights' fingerprint."""
        emb = self.model.embed_tokens
        emb = getattr(emb, "quant", None) or emb           # a vocabulary shard's packed rows (rank 0: the first)
        return emb.qweight.dequantize(slice(0, n)) if isinstance(emb, QuantEmbedding) else emb.weight[:n]

    def weight_bytes(self) -> int:
        """Bytes of every weight held, packed ones included (oneDNN's reordered fp32 copies too: opaque tensors,
        no data pointer), each shared tensor once."""
        held = list(self.parameters()) + [t for m in self.modules() if isinstance(m, (QuantLinear, QuantEmbedding))
                                         for t in m.tensors()]
        onednn = {id(m.packed): m.packed for m in self.modules() if isinstance(m, PackedLinear)}
        return sum({t.data_ptr(): t.numel() * t.element_size() for t in held}.values()) + \
            sum(t.numel() * t.element_size() for t in onednn.values())

    def quantize_linears(self, method: str = "int8") -> int:
        """quantization="int8": every Linear (the head too; a tied embedding stays as it is for lookups) becomes
        int8 with one scale per output row. "fp8": every Linear but the head (as vLLM) becomes e4m3 with one scale
        per output row. Returns how many."""
        quantize = {"int8": quantize_int8, "fp8": quantize_fp8}[method]
        # a router stays as it is (as vLLM keeps it): it is small, and its rounding would move tokens' experts
        swaps = [(parent, name, child) for parent in self.modules() for name, child in parent.named_children()
                 if isinstance(child, nn.Linear) and not (method == "fp8" and child is self.lm_head)
                 and not isinstance(parent, SparseMoE) and not _absorbed(parent, name)]
        moes = [la.mlp for la in self.model.layers if isinstance(la.mlp, SparseMoE)]
        for moe in moes:                                  # each expert's gate/up and down, one scale per row
            for which in ("gate_up_proj", "down_proj"):
                if which not in moe.packed:
                    moe.pack(which, [[quantize(w)] for w in getattr(moe.experts, which)])
        for parent, name, child in swaps:
            setattr(parent, name, QuantLinear([quantize(child.weight)], child.bias, child.weight.device,
                                               dtype=child.weight.dtype))
        rows = [m for m in self.modules() if isinstance(m, RowParallelLinear)]    # TP: this rank's columns
        for m in rows:
            m.quantize(QuantLinear([quantize(m.weight)], None, m.weight.device, dtype=m.weight.dtype))
        self._attention_in_one_kernel()
        return len(swaps) + len(rows) + 2 * sum(len(moe.local) for moe in moes)

    def _attention_in_one_kernel(self) -> None:
        """Quantized linears quantize their activations: every attention call takes the one C++ path, so a
        sequence's numbers do not depend on chunking or prefix hits (engine/attention.py)."""
        for layer in self.model.layers:
            layer.self_attn.one_kernel = True

    def prepack_linears(self) -> int:
        """After loading: swap every Linear for a PackedLinear (CPU fp32). Returns how many."""
        swaps = [(parent, name, child) for parent in self.modules() for name, child in parent.named_children()
                 if isinstance(child, nn.Linear) and not _absorbed(parent, name)]
        for parent, name, child in swaps:
            setattr(parent, name, PackedLinear(child.weight, child.bias))
        rows = [m for m in self.modules() if isinstance(m, RowParallelLinear) and m.quant is None]
        for m in rows:
            m.prepack()
        return len(swaps) + len(rows)

    # -- weights ---------------------------------------------------------------------------------
    _FUSED = {  # HF name piece -> (our fused param, shard index)
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def weight_shard(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop): the part of checkpoint tensor `name` this rank holds; None: all of it."""
        if self.tp is None:
            return None
        if self.multimodal:                               # a vision tensor: nothing read
            name = text_weight_name(name)
            if name is None:
                return 0, 0, 0
        layer = self._LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.num_layers:
            return 0, 0, 0                                # DeepSeek's multi-token prediction layers: not run
        if self.config.model_type in LLAMA4_MODEL_TYPES:
            name = llama4_name(name)
        expert = _EXPERT.match(name)
        if expert is not None:                            # every expert's run of units, as the dense MLP's
            moe = self.model.layers[int(expert.group(1))].mlp
            if int(expert.group(2)) not in getattr(moe, "local", ()):
                return 0, 0, 0                            # expert parallel: another rank's expert, nothing read
            run = moe.run
            return (1, run.start, run.stop) if expert.group(3) in ("down_proj", "w2") else (0, run.start, run.stop)
        attn, mlp = self.model.layers[0].self_attn, self.dense_mlp()
        for shared in (".shared_expert.", ".shared_experts."):   # Qwen2-MoE's, DeepSeek's: a dense MLP of their width
            if shared in name:
                mlp = self.get_submodule(name.split(shared)[0] + shared[:-1])
        if isinstance(attn, MLAAttention) and ".self_attn." in name:
            return self._mla_shard(name, attn)
        d = attn.head_dim
        units = mlp.run if mlp is not None else range(0)
        rows = {"q_proj": range(attn.q_heads.start * d, attn.q_heads.stop * d),
                "k_proj": range(attn.kv_heads.start * d, attn.kv_heads.stop * d), "gate_proj": units,
                "up_proj": units, "embed_tokens": self.model.embed_tokens.rows}
        rows["v_proj"], rows["lm_head"] = rows["k_proj"], rows["embed_tokens"]
        cols = {"o_proj": rows["q_proj"], "down_proj": units}
        if name.endswith(".self_attn.sinks"):             # gpt-oss: one per query head
            return 0, attn.q_heads.start, attn.q_heads.stop
        piece = name.split(".")[-2]
        if piece in rows:
            return 0, rows[piece].start, rows[piece].stop
        if piece in cols and name.endswith(".weight"):
            return 1, cols[piece].start, cols[piece].stop
        return None                                       # norms, row-parallel biases: replicated

    @staticmethod
    def _mla_shard(name: str, attn: "MLAAttention") -> tuple[int, int, int] | None:
        """MLA under TP: this rank's heads' rows of q (q_proj or q_b_proj) and kv_b_proj, their columns of o_proj; the
        low-rank projections and their norms replicated."""
        heads, piece = attn.q_heads, name.split(".")[-2]
        per = {"q_proj": attn.qk_dim, "q_b_proj": attn.qk_dim, "kv_b_proj": attn.nope + attn.v_dim}
        if piece in per:
            return 0, heads.start * per[piece], heads.stop * per[piece]
        if piece == "o_proj" and name.endswith(".weight"):
            return 1, heads.start * attn.v_dim, heads.stop * attn.v_dim
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up. Every parameter must be filled. Packed
        weights (engine/quant.py, from a GGUF) replace their Linear or Embedding once all parts are in."""
        params = dict(self.named_parameters())
        filled: set[str] = set()
        packed: dict[str, dict[int, tuple[QuantWeight, str, str]]] = {}
        packed_experts: dict[tuple[int, str], dict[int, QuantWeight]] = {}    # (layer, part) -> expert -> weight
        if self.config.model_type == "gpt_oss":
            weights = _gpt_oss_tensors(weights)
        if self.config.model_type in LLAMA4_MODEL_TYPES:
            weights = _llama4_tensors(weights)
        for name, tensor in self._unfused(weights):
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name = name.replace(".block_sparse_moe.", ".mlp.")     # Mixtral's router and experts
            if _EXPERT.match(name):
                filled.add(self._load_expert(name, tensor, packed_experts))
                continue
            if _STACKED_EXPERTS.match(name):
                filled.update(self._load_stacked_experts(name, tensor))
                continue
            if _EXPERT_BIASES.match(name):
                filled.add(self._load_expert_bias(name, tensor))
                continue
            target, shard = name, None
            for piece, (fused, idx) in self._FUSED.items():
                if f".{piece}." in name and not (".self_attn." in name and self.kv_parts == 1):   # MLA: no q/k/v
                    target, shard = name.replace(piece, fused), idx
                    break
            if target not in params:
                raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
            if isinstance(tensor, QuantWeight) and self.tp is not None and \
                    target in ("model.embed_tokens.weight", "lm_head.weight"):
                tensor = tensor.pad_rows(self.model.embed_tokens.per)    # every vocabulary shard as long
            if isinstance(tensor, QuantWeight):
                packed.setdefault(target.rpartition(".")[0], {})[shard or 0] = (tensor, target, name)
            else:
                if self.norm_offset and target.endswith("norm.weight"):     # Gemma's 1 + weight, once
                    tensor = tensor.float() + self.norm_offset
                self._copy_in(params[target], tensor, target, shard, name)
            filled.add(name)
        self._install_packed_experts(packed_experts)
        self._install_packed(packed, params)
        missing = self._expected_names() - filled
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _unfused(self, weights: Iterable[tuple[str, torch.Tensor | QuantWeight]]):
        """The checkpoint's tensors as load_weights takes them: a multimodal checkpoint's language model's under their
        text names (its vision tower's dropped); Phi-3's qkv_proj [q; k; v] and gate_up_proj [gate; up], floats or
        packed (a GGUF's attn_qkv and ffn_up), read whole, as the separate q/k/v or gate/up tensors of other
        checkpoints (each this rank's rows under TP)."""
        fuse = self.config.model_type in FUSED_NAME_MODEL_TYPES
        interleaved = self.config.model_type in INTERLEAVED_ROPE_MODEL_TYPES
        mla = self.config.model_type in MLA_MODEL_TYPES
        for name, tensor in weights:
            if self.multimodal:
                name = text_weight_name(name)
                if name is None:
                    continue
            if mla:
                name, tensor = self._mla_tensor(name, tensor)
                if name is None:
                    continue
            if self.config.model_type == "glm4":        # its sandwich norms under Gemma 2's names
                name = name.replace(".post_attention_layernorm.", ".pre_feedforward_layernorm.") \
                    .replace(".post_self_attn_layernorm.", ".post_attention_layernorm.") \
                    .replace(".post_mlp_layernorm.", ".post_feedforward_layernorm.")
            if interleaved and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
                tensor = self._halves_from_pairs(tensor)
            if not (fuse and (".qkv_proj." in name or ".gate_up_proj." in name)):
                yield name, tensor
                continue
            cfg, d = self.config, self.model.layers[0].self_attn.head_dim
            if ".qkv_proj." in name:
                kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
                fused, pieces, sizes = "qkv_proj", ("q_proj", "k_proj", "v_proj"), \
                    [cfg.num_attention_heads * d, kv * d, kv * d]
            else:
                fused, pieces, sizes = "gate_up_proj", ("gate_proj", "up_proj"), [cfg.intermediate_size] * 2
            if tensor.shape[0] != sum(sizes):
                raise ModelLoadError(f"tensor {name!r} has {tensor.shape[0]} rows, model expects {sum(sizes)}")
            start = 0
            for piece, size in zip(pieces, sizes):
                part_name = name.replace(fused, piece)
                lo, hi = start, start + size
                cut = self.weight_shard(part_name)        # rows only: q/k/v and gate/up are cut by rows
                if cut is not None:
                    lo, hi = start + cut[1], start + cut[2]
                start += size
                yield part_name, tensor[lo:hi] if isinstance(tensor, torch.Tensor) else tensor.rows(slice(lo, hi))

    _LAYER = re.compile(r"^model\.layers\.(\d+)\.")

    def _mla_tensor(self, name: str, tensor):
        """A DeepSeek checkpoint's tensor as load_weights takes it: (None, None) for its multi-token prediction layers
        (past num_hidden_layers; not run); V3's correction bias under the MoE block; with RoPE over interleaved pairs
        (V2's, V3's rope_interleave), the rotated rows of q (the last qk_rope_head_dim of each head) and of k_pe (the
        last of kv_a_proj_with_mqa) reordered to the halves the rotation pairs, as for GLM's (_halves_from_pairs)."""
        layer = self._LAYER.match(name)
        if layer is not None and int(layer.group(1)) >= self.num_layers:
            return None, None
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        attn = self.model.layers[0].self_attn
        interleaved = self.config.model_type == "deepseek_v2" or getattr(self.config, "rope_interleave", True)
        if interleaved and (".self_attn.q_proj." in name or ".self_attn.q_b_proj." in name or
                            ".self_attn.kv_a_proj_with_mqa." in name):
            head = attn.qk_dim if "kv_a_proj" not in name else attn.head_dim
            if tensor.shape[0] % head:
                raise ModelLoadError(f"{name}: {tensor.shape[0]} rows are not whole heads of {head}")
            index = halves_from_pairs(tensor.shape[0], head, attn.rope_dim, offset=head - attn.rope_dim)
            tensor = tensor.rows(index) if isinstance(tensor, QuantWeight) else tensor[index]
        return name, tensor

    def _halves_from_pairs(self, tensor):
        """q or k's rows (weight or bias; this rank's whole heads), each head's rotated dims reordered from interleaved
        pairs (0, 1), (2, 3), ... to the halves (0, 2, ... | 1, 3, ...) the rotation pairs: the same scores, since q
        and k are permuted alike, under the rotation every other model takes."""
        attn = self.model.layers[0].self_attn
        rows = tensor.shape[0]
        if rows % attn.head_dim:
            raise ModelLoadError(f"q/k rows {rows} are not whole heads of {attn.head_dim}")
        index = halves_from_pairs(rows, attn.head_dim, attn.rotary_dim)
        return tensor.rows(index) if isinstance(tensor, QuantWeight) else tensor[index]

    def _install_packed(self, packed: dict[str, dict[int, tuple[QuantWeight, str, str]]], params) -> None:
        """Each module whose weight came packed becomes a QuantLinear / QuantEmbedding (a tied head shares
        the embedding's packed rows). A fused module with a part that came as floats stays float."""
        for module, parts in packed.items():
            if module == "model.embed_tokens":
                old = self.model.embed_tokens.weight
                if self.tp is not None:                   # this rank's rows, looked up and all-reduced
                    self.model.embed_tokens.quantize(QuantEmbedding(parts[0][0], old.device, old.dtype))
                else:
                    self.model.embed_tokens = QuantEmbedding(parts[0][0], old.device, old.dtype)
                if self.tie_word_embeddings:
                    self.lm_head = QuantLinear([parts[0][0]], None, old.device, dtype=old.dtype)
                continue
            whole = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
            old = self.get_submodule(module)
            if module.endswith(".kv_b_proj"):             # MLA absorbs it into q and the output: kept as floats
                qw, target, name = parts[0]
                self._copy_in(params[target], qw.dequantize(), target, None, name)
                continue
            if not isinstance(old, (nn.Linear, RowParallelLinear)):
                raise ModelLoadError(f"{module} cannot hold packed weights")
            if len(parts) < whole:
                for shard, (qw, target, name) in parts.items():
                    self._copy_in(params[target], qw.dequantize(), target, shard if whole > 1 else None, name)
                continue
            if isinstance(old, RowParallelLinear):        # TP: this rank's columns, reduced, then the bias
                old.quantize(QuantLinear([parts[0][0]], None, old.weight.device, dtype=old.weight.dtype))
                continue
            parent, _, attr = module.rpartition(".")
            setattr(self.get_submodule(parent), attr,
                    QuantLinear([parts[i][0] for i in range(whole)], old.bias, old.weight.device,
                                dtype=old.weight.dtype))
        if any(isinstance(m, QuantLinear) for m in self.modules()):
            self._attention_in_one_kernel()

    def _load_expert(self, name: str, tensor, packed: dict[tuple[int, str], dict[int, QuantWeight]]) -> str:
        """One expert's gate, up or down weight (HF's per-expert tensors; Mixtral's w1, w3, w2) into its row of the
        stacked experts, or, packed, into `packed` (installed once all are in). Returns its name as Qwen3-MoE
        spells it (what _expected_names lists)."""
        layer, expert, part = _EXPERT.match(name).groups()
        part = _EXPERT_PARTS.get(part, part)
        moe = self.model.layers[int(layer)].mlp if int(layer) < len(self.model.layers) else None
        if not isinstance(moe, SparseMoE) or int(expert) >= moe.num_experts:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        canonical = f"model.layers.{layer}.mlp.experts.{expert}.{part}.weight"
        if int(expert) not in moe.local:                  # expert parallel: another rank holds it
            return canonical
        row = int(expert) - moe.local.start
        if not isinstance(tensor, torch.Tensor):
            packed.setdefault((int(layer), part), {})[row] = tensor
            return canonical
        dst = (moe.experts.down_proj if part == "down_proj" else moe.experts.gate_up_proj)[row]
        if part != "down_proj":
            dst = dst.split(moe.intermediate, dim=0)[part == "up_proj"]
        if dst.shape != tensor.shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(tensor)
        return canonical

    def _install_packed_experts(self, packed: dict[tuple[int, str], dict[int, QuantWeight]]) -> None:
        """A layer's gate/up runs packed where every expert's gate and up came packed, its down where every down
        did; anything short of that (a type that stays float, a TP cut through a group of scales) is dequantized
        into the stacked floats."""
        for layer, moe in enumerate(self.model.layers):
            if not isinstance(moe.mlp, SparseMoE):
                continue
            moe = moe.mlp
            parts = {part: packed.get((layer, part), {}) for part in ("gate_proj", "up_proj", "down_proj")}
            n = len(moe.local)                            # keyed by this rank's row of each expert
            every = lambda *ps: all(len(parts[p]) == n for p in ps)     # noqa: E731
            if every("gate_proj", "up_proj"):
                moe.pack("gate_up_proj", [[parts["gate_proj"][e], parts["up_proj"][e]] for e in range(n)])
            else:
                for p in ("gate_proj", "up_proj"):
                    for e, qw in parts[p].items():
                        self._load_expert(f"model.layers.{layer}.mlp.experts.{e + moe.local.start}.{p}.weight",
                                          qw.dequantize(), {})
            if every("down_proj"):
                moe.pack("down_proj", [[parts["down_proj"][e]] for e in range(n)])
            else:
                for e, qw in parts["down_proj"].items():
                    self._load_expert(f"model.layers.{layer}.mlp.experts.{e + moe.local.start}.down_proj.weight",
                                      qw.dequantize(), {})

    def _load_stacked_experts(self, name: str, tensor) -> list[str]:
        """Every expert of a layer at once, stacked as transformers 5 holds them in memory (a state dict it did not
        save: gate_up_proj [E, 2I, H], gate's rows then up's; down_proj [E, H, I]), read whole: this rank keeps its
        experts' run of units. Returns the per-expert names it fills."""
        layer, which = _STACKED_EXPERTS.match(name).groups()
        moe = self.model.layers[int(layer)].mlp if int(layer) < len(self.model.layers) else None
        if not isinstance(moe, SparseMoE):
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"{name}: quantized expert weights do not load yet; a mixture-of-experts model "
                                 f"loads from a float checkpoint")
        run = torch.tensor(list(moe.run), dtype=torch.long)
        tensor = tensor[moe.local.start:moe.local.stop] if tensor.dim() == 3 else tensor    # this rank's experts
        if which == "gate_up_proj" and tensor.dim() == 3 and tensor.shape[1] % 2 == 0:
            gate, up = tensor.chunk(2, dim=1)
            mine, dst = torch.cat([gate.index_select(1, run), up.index_select(1, run)], dim=1), moe.experts.gate_up_proj
        elif which == "down_proj" and tensor.dim() == 3:
            mine, dst = tensor.index_select(2, run), moe.experts.down_proj
        else:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}: not stacked experts")
        if mine.shape != dst.shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)} "
                                 f"(this rank's units)")
        with torch.no_grad():
            dst.copy_(mine)
        parts = ("down_proj",) if which == "down_proj" else ("gate_proj", "up_proj")
        return [f"model.layers.{layer}.mlp.experts.{e}.{p}.weight" for e in range(moe.num_experts) for p in parts]

    def _load_expert_bias(self, name: str, tensor: torch.Tensor) -> str:
        """gpt-oss's stacked expert biases (gate_up's de-interleaved, gate's half then up's): this rank's experts, and
        of gate_up's its run of each one's units."""
        layer, which = _EXPERT_BIASES.match(name).groups()
        moe = self.model.layers[int(layer)].mlp if int(layer) < len(self.model.layers) else None
        if not isinstance(moe, SparseMoE) or not moe.gpt_oss:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in the model")
        mine = tensor[moe.local.start:moe.local.stop]
        if which == "gate_up_proj_bias":
            run = torch.tensor(list(moe.run), dtype=torch.long)
            gate, up = mine.chunk(2, dim=1)
            mine = torch.cat([gate.index_select(1, run), up.index_select(1, run)], dim=1)
        dst = getattr(moe.experts, which)
        if mine.shape != dst.shape:
            raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)} "
                                 f"(this rank's experts and units)")
        with torch.no_grad():
            dst.copy_(mine)
        return name

    def _copy_in(self, param, tensor, target: str, shard: int | None, name: str) -> None:
        with torch.no_grad():
            dst = param
            if shard is not None:
                attn = self.model.layers[0].self_attn
                sizes = ([attn.q_size, attn.kv_size, attn.kv_size] if ".qkv_proj." in target
                         else [self.get_submodule(target.rsplit(".", 2)[0]).intermediate] * 2)
                dst = param.split(sizes, dim=0)[shard]
            elif self.tp is not None and target in ("model.embed_tokens.weight", "lm_head.weight"):
                dst.zero_()                               # the last shard's padding rows stay zero
                dst = dst[:tensor.shape[0]]
            if dst.shape != tensor.shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(dst.shape)}")
            dst.copy_(tensor)

    def _expected_names(self) -> set[str]:
        names = set()
        for n, _ in self.named_parameters():
            if n == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if ".mlp.experts." in n:                      # stacked (or packed): listed below
                continue
            for piece, (fused, _) in self._FUSED.items():
                if fused in n:
                    if (fused == "qkv_proj") == (piece in ("q_proj", "k_proj", "v_proj")):
                        names.add(n.replace(fused, piece))
                    break
            else:
                names.add(n)
        for i, layer in enumerate(self.model.layers):      # each expert's tensors, as checkpoints hold them
            if isinstance(layer.mlp, SparseMoE):
                names.update(f"model.layers.{i}.mlp.experts.{e}.{part}.weight" for e in range(layer.mlp.num_experts)
                             for part in ("gate_proj", "up_proj", "down_proj"))
                if layer.mlp.gpt_oss:
                    names.update(f"model.layers.{i}.mlp.experts.{b}" for b in ("gate_up_proj_bias", "down_proj_bias"))
        return names
