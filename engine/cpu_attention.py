"""A C++ paged-attention kernel for CPU: short queries (decode, speculative verify) over the paged cache.

The torch reference gathers every sequence's K and V into a padded tensor and runs SDPA on it, so a
step moves its KV three times (read, write, read); a verify step (k+1 query tokens per sequence)
even goes one sequence at a time. This kernel walks the block table instead. One task per
(sequence, kv head) pair: it scores the sequence's n query tokens x G query heads of that kv head
(GQA) against each cached K row, 16 rows at a time, takes a causal softmax per query row, then the
weighted sum of the V rows, so each cached row is read once for all of them. A thread serves its
range of pairs sequence by sequence, every head of the range in one sweep where a token's heads are
one row (whole token rows stream in at once), a head at a time in the heads-outer cache (a head's
tokens are one span there), and a single sequence still spreads its kv heads over the threads.
Compiled once per machine (-march=native: AVX-512 or AVX2 inner loops, plain C++ otherwise) from
engine/cpu_attention.cpp as part of the one CPU extension (engine/cpu_model.py); if no compiler is there, the
torch reference is used and a warning says so.

Beside it, two ops of the CPU forward that torch runs as many small ones (each layer's overhead at decode
batch sizes is mostly op dispatch): rms_norm (with the residual add fused, as vLLM's fused_add_rms_norm) and
rope_write_kv (rotate q and k in place and store k and v at their cache slots). Every op here releases the
GIL while it runs, as torch's own do, so a server's event loop runs beside the forward.

The same module holds structured output's mask apply (apply_token_bitmask): it writes -inf over only the
tokens a grammar forbids, where xgrammar's CPU path and any torch expression touch the whole vocabulary.
"""
from __future__ import annotations

import torch

from engine.cpu_model import available, kernels as _load      # engine/cpu_attention.cpp is built as part of it

__all__ = ["available", "paged_attention_varlen", "paged_decode_attention", "apply_token_bitmask", "rms_norm",
           "rope_write_kv"]


def paged_attention_varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                           scale: float, k_scale=None, v_scale=None, window: int = 0,
                           softcap: float = 0.0, sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D], fp32; the contract of engine/attention.py (a sliding window, a softcap,
    attention sinks and attention chunks included): sequence i owns
    q[qsl[i]:qsl[i+1]], the last tokens of its seq_lens[i]-token context, causal among themselves.
    Any mix of query lengths; meant for short ones (a long prefill chunk scores into an
    [n * G, context] buffer per task and is better served by SDPA). A quantized cache (int8 or fp8 codes,
    engine/kv_layout.py) comes with its scales [blocks, block_size, kv_heads]; each tile of a head's rows is
    turned into floats once, as it is read."""
    return _load().paged_attention_varlen(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                          k_scale, v_scale, int(window), float(softcap), sinks, int(chunk))


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float,
                           k_scale=None, v_scale=None, window: int = 0, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence) -> [B, H, D]: the n = 1 case of the above."""
    return _load().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, k_scale, v_scale, int(window),
                                float(softcap), sinks, int(chunk))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits [R, V] (fp32) at -inf wherever bit t of bitmask [R, ceil(V / 32)] (int32) is 0, in the
    rows `rows` (int64)."""
    _load().apply_token_bitmask(logits, bitmask, rows)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of the rows of x [T, H] (fp32, contiguous); with `residual`, residual += x first (in place) and
    the norm is of the sum."""
    return _load().rms_norm(x, weight, eps, residual)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """In place on qkv [T, (H + 2G) * D]: rotate the q and k heads by cos/sin [T, D/2], then store k and v at
    their slots of one layer's caches [blocks, block_size, G, D]: fp32 as they are, or (an int8 cache, with its
    scales) quantized as engine/kv_layout.py's quantize_kv does, to the same bytes."""
    _load().rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads, k_scale, v_scale)
