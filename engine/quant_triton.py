"""Quantized matmuls on a GPU: y = x @ W.T with W packed (engine/quant.py), read as stored.

One Triton kernel, weight-only, for "q4" and "q8" (GGUF, GPTQ, AWQ, `quantization="int8"`) and, at decode-sized
M, "f8" (e4m3 weights; larger M runs FP8 GEMMs through torch's `_scaled_mm`, engine/quant.py: fp8_matmul). Each
program loads [BLOCK_N, BLOCK_K] tiles of codes as stored (contiguous bytes: q4's byte j of a 32-column block
holds columns j and j + 16, so the activations are read as those two halves), dequantizes them in registers to
x's dtype and takes tl.dot with fp32 accumulation; the weights cross HBM once, as 4 or 8 bits. When a tile lies
inside one scale group (GPTQ/AWQ's 128, int8's and fp8's whole row) the codes go into the dot as they are and
the scale (and q4's min, times the row sums of x) is applied to the tile's product; a tile of several groups
(GGUF's 32 and 16) scales each weight. Small M (decode) splits K over programs so that every SM streams weights;
the slices' fp32 partials are summed in a fixed order (no atomics: a run repeats bit for bit).

Layouts as engine/quant.py stores them: q4 qs uint8 [N, K/2] (each 32 columns in 16 bytes, low nibbles first),
q8 qs int8 [N, K], f8 float8_e4m3fn [N, K]; scales (and q4's mins) fp32 [N, K / group].
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.quant import QuantWeight


@triton.jit
def _wo_matmul_kernel(
    x_ptr, qs_ptr, s_ptr, m_ptr, y_ptr,
    M, N, K, k_per_split,
    s_xm, s_qn, s_sn, s_yk, s_ym,
    KIND: tl.constexpr, GROUP: tl.constexpr, SCALE_AFTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """KIND 0: q8 (int8 codes), 1: q4 (two codes a byte), 2: f8 (e4m3). SCALE_AFTER: the tile lies in one scale
    group (GROUP % BLOCK_K == 0); else the tile holds BLOCK_K // GROUP whole groups."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    NG: tl.constexpr = 1 if SCALE_AFTER else BLOCK_K // GROUP
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if SCALE_AFTER:
            scale = tl.load(s_ptr + rn * s_sn + k0 // GROUP, mask=n_ok, other=0.0)
        else:
            gi = k0 // GROUP + tl.arange(0, NG)
            g_mask = n_ok[:, None] & (gi * GROUP < k_hi)[None, :]
            scale = tl.load(s_ptr + rn[:, None] * s_sn + gi[None, :], mask=g_mask, other=0.0)       # [BN, NG]
        if KIND == 1:
            # a 32-column block is 16 bytes: byte j holds column j (low nibble) and j + 16 (high nibble)
            HALF: tl.constexpr = BLOCK_K // 2
            j = tl.arange(0, HALF)
            col = k0 + (j // 16) * 32 + j % 16
            c_ok = col < k_hi
            byte = tl.load(qs_ptr + rn[:, None] * s_qn + (k0 // 2 + j)[None, :], mask=n_ok[:, None] & c_ok[None, :],
                           other=0).to(tl.int32)
            x_lo = tl.load(x_ptr + rm[:, None] * s_xm + col[None, :], mask=m_ok[:, None] & c_ok[None, :], other=0.0)
            x_hi = tl.load(x_ptr + rm[:, None] * s_xm + (col + 16)[None, :], mask=m_ok[:, None] & c_ok[None, :],
                           other=0.0)
            lo = (byte & 0xF).to(tl.float32)
            hi = (byte >> 4).to(tl.float32)
            if SCALE_AFTER:
                part = tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=DOT_PREC)
                part += tl.dot(x_hi, tl.trans(hi.to(x_lo.dtype)), input_precision=DOT_PREC)
                acc += part * scale[None, :]
                mins = tl.load(m_ptr + rn * s_sn + k0 // GROUP, mask=n_ok, other=0.0)
                xsum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
                acc += xsum[:, None] * mins[None, :]
            else:
                mins = tl.load(m_ptr + rn[:, None] * s_sn + gi[None, :], mask=g_mask, other=0.0)
                lo = tl.reshape(tl.reshape(lo, (BLOCK_N, NG, GROUP // 2)) * scale[:, :, None] + mins[:, :, None],
                                (BLOCK_N, HALF))
                hi = tl.reshape(tl.reshape(hi, (BLOCK_N, NG, GROUP // 2)) * scale[:, :, None] + mins[:, :, None],
                                (BLOCK_N, HALF))
                acc += tl.dot(x_lo, tl.trans(lo.to(x_lo.dtype)), input_precision=DOT_PREC)
                acc += tl.dot(x_hi, tl.trans(hi.to(x_lo.dtype)), input_precision=DOT_PREC)
        else:
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < k_hi
            x = tl.load(x_ptr + rm[:, None] * s_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w_ok = n_ok[:, None] & k_ok[None, :]
            q = tl.load(qs_ptr + rn[:, None] * s_qn + k[None, :], mask=w_ok)   # no `other`: e4m3 takes no int 0
            q = tl.where(w_ok, q.to(tl.float32), 0.0)
            if SCALE_AFTER:
                acc += tl.dot(x, tl.trans(q.to(x.dtype)), input_precision=DOT_PREC) * scale[None, :]
            else:
                w = tl.reshape(tl.reshape(q, (BLOCK_N, NG, GROUP)) * scale[:, :, None], (BLOCK_N, BLOCK_K))
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PREC)
    tl.store(y_ptr + split * s_yk + rm[:, None] * s_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


_KINDS = {"q8": 0, "q4": 1, "f8": 2}
FP8_WEIGHT_ONLY_MAX_M = 16     # up to this many tokens, FP8 weights run weight-only here rather than in an FP8 GEMM


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan(m: int, n: int, k: int, group: int, sms: int, kind: str = "q8") -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, splits, num_warps) for one call. Decode-sized M streams wide tiles of weights
    (64 rows x 256 columns a step) and splits K until there are about two programs per SM; larger M uses GEMM
    tiles and no split. BLOCK_K shrinks until a tile holds whole scale groups or lies inside one."""
    if m <= 16:
        bm, bn, bk, warps = 16, 64, 256, 4
    elif m <= 64:
        bm, bn, bk, warps = 64, 64, 128, 4
    elif kind == "q4":                                    # an H100 sweep's best at M = 256 (docs/benchmarks.md)
        bm, bn, bk, warps = 64, 64, 128, 4
    else:
        bm, bn, bk, warps = 128, 64, 64, 4
    bk = fit_block_k(min(bk, max(32, triton.next_power_of_2(k))), group)
    return bm, bn, bk, split_k(m, n, k, bm, bn, bk, sms), warps


def fit_block_k(bk: int, group: int) -> int:
    """Halve BLOCK_K (down to 32) until a tile holds whole scale groups or lies inside one."""
    while bk > 32 and group % bk and bk % group:
        bk //= 2
    return bk


def split_k(m: int, n: int, k: int, bm: int, bn: int, bk: int, sms: int) -> int:
    """Slices of K for decode-sized M (<= 16): doubled while there are steps to share and fewer than about two
    programs per SM; 1 for larger M."""
    tiles, steps, splits = triton.cdiv(m, bm) * triton.cdiv(n, bn), triton.cdiv(k, bk), 1
    while m <= 16 and splits * 2 <= steps and tiles * splits * 2 <= 2 * sms:
        splits *= 2
    return splits


def wo_matmul(x: torch.Tensor, w: QuantWeight, config: tuple | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16 on a GPU; fp32 too) @ dequantize(w).T -> [M, N] in x's dtype. `config` overrides
    plan() (benchmarks)."""
    if w.kind not in _KINDS:
        raise ValueError(f"wo_matmul takes q4/q8/f8 weights, not {w.kind!r}")
    x = x.contiguous()
    m, k = x.shape
    n = w.scales.shape[0]
    bm, bn, bk, splits, warps = config or plan(m, n, k, w.group, _num_sms(x.device), w.kind)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    out = torch.empty((splits, m, n), device=x.device, dtype=torch.float32 if splits > 1 else x.dtype)
    scale_after = w.group % bk == 0
    if not scale_after and bk % w.group:
        raise ValueError(f"BLOCK_K {bk} neither inside nor a multiple of the scale group {w.group}")
    mins = w.mins if w.mins is not None else w.scales
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), splits)
    _wo_matmul_kernel[grid](
        x, w.qs, w.scales, mins, out, m, n, k, k_per_split,
        x.stride(0), w.qs.stride(0), w.scales.stride(0), out.stride(0), out.stride(1),
        KIND=_KINDS[w.kind], GROUP=w.group, SCALE_AFTER=scale_after,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_PREC="ieee" if x.dtype == torch.float32 else None,
        num_warps=warps, num_stages=3 if x.device.type == "cuda" else 1,
    )
    return out[0] if splits == 1 else out.sum(0).to(x.dtype)
