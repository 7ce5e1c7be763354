"""Quantized matmul on CPU: y = x @ W.T with W held as packed 4-bit or 8-bit integers, or as FP8 (e4m3).

Decode reads every weight once per token, so on CPU its speed is the weights' bytes: SmolLM2-135M is 538 MB
of fp32 per token, ~6x fewer as 4-bit. The C++ kernel (engine/quant_cpu.cpp, built by engine/cpp_build.py)
quantizes the activations to int8 per 32-element block and takes each block's dot product in integers
(AVX-512 VNNI, AVX2 or plain C++), so it also keeps up with fp32 oneDNN on prefill-sized M.

Formats (what the caller builds, one row per output feature, K % 32 == 0):
  "q4": qs uint8 [N, K/2], a 32-element block b of a row in qs[n, 16b:16b+16], element j < 16 the low nibble of
        byte j, 16 + j its high nibble (GGUF order); w = scales[n, k // group] * q + mins[n, k // group], q 0..15.
  "q8": qs int8 [N, K]; w = scales[n, k // group] * q. group 16 (GGUF Q6_K) or a multiple of 32 dividing K.
  "f8": qs float8_e4m3fn [N, K], one scale per row; K % 16 == 0. W8A8 as torch._scaled_mm: each activation row
        quantized to e4m3 (engine/quant.py's quantize_tokens_fp8), y = dot(q_a, q_w) * s_a * s_w with 16 partial
        sums in a fixed order (engine/quant_cpu.cpp says how), so this kind is bitwise batch-invariant too.
Numerics: a row's block of x is s = max|x| / 127, q_a = round_half_even(x / s) (s = 0: zeros), and
y[m, n] = sum over blocks b, in order, of s_a[b] * (d * dot(q_w, q_a) [+ min * sum(q_a)]) (two half-block dots with
their scales for group 16), in fp32 with the same ops for every element, so a row's output is bitwise the same
whichever rows share the call and however many threads run it. `emulate` is that math in torch (float64).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.cpu_model import available, kernels as _load      # engine/quant_cpu.cpp is built as part of it

TILE = 16                              # output rows per packed weight tile
KINDS = {"q8": 0, "q4": 1, "f8": 2}    # the C++ matmul's `kind`


def _unpack_q4(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> q uint8 [N, K] in k order."""
    n = qs.shape[0]
    b = qs.view(n, -1, 16)
    return torch.stack([b & 15, b >> 4], dim=2).view(n, -1)


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """[N, ...] -> [ceil(N / 16), 16, ...], zero rows at the end."""
    pad = -t.shape[0] % TILE
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return t.view(-1, TILE, *t.shape[1:])


def _lanes(t: torch.Tensor) -> torch.Tensor:
    """Per-row values [N, G] -> [T, G, 16]: one 16-lane vector per tile and group."""
    return _tiles(t.contiguous()).transpose(1, 2).contiguous()


def prepare(kind: str, qs, scales, mins, group: int) -> tuple[torch.Tensor, ...]:
    """The kernel's layout (engine/quant_cpu.cpp), one uint8 tensor: rows in tiles of 16, each tile one stream of
    spans of max(group, 32) k, a span's blocks (bytes arranged so that one 4-byte lane per row holds 4 consecutive
    k) followed by its scales and its mins (q4) or its weights' int16 sums (q8), each a 16-lane vector.

    A q4 block's byte j holds k = j and k = 16 + j (GGUF order), and the kernel's lane wants the same pairs, so
    both formats' blocks are the stored bytes moved as 4-byte words: one copy per part, straight into its place
    (a replica's start-up pays this for every linear layer)."""
    if kind == "f8":                       # the codes, then the row scales: one tensor
        codes = qs.contiguous().view(torch.uint8).reshape(-1)
        return (torch.cat([codes, scales.float().reshape(-1).contiguous().view(torch.uint8)]),)
    if kind not in ("q4", "q8"):
        raise ValueError(f"unknown quantized kind {kind!r}")
    n, k = qs.shape[0], qs.shape[1] * (2 if kind == "q4" else 1)
    spans = k // max(group, 32)
    if kind == "q4":
        extra = _lanes(mins.float())
    else:
        wg = 16 if group == 16 else 32
        sums = qs.numpy().reshape(n, k // wg, wg).sum(-1, dtype=np.int16)  # |sum| <= 32 * 128; numpy's is 3x torch's
        extra = _lanes(torch.from_numpy(sums))
    w = _tiles(qs.contiguous().view(torch.uint8).view(torch.int32))         # [T, row, block * word]
    t = w.shape[0]
    blocks = w.view(t, TILE, spans, -1).permute(0, 2, 3, 1)                # [T, span, block * word, row]
    lanes = [p.view(torch.uint8).reshape(t, spans, -1) for p in (_lanes(scales.float()), extra)]
    sizes = [blocks.shape[2] * TILE * 4] + [p.shape[2] for p in lanes]     # bytes of each part in a span
    out = torch.empty(t, spans, sum(sizes), dtype=torch.uint8)
    out[:, :, :sizes[0]].view(torch.int32).view(t, spans, -1, TILE).copy_(blocks)
    out[:, :, sizes[0]:sizes[0] + sizes[1]].copy_(lanes[0])
    out[:, :, sizes[0] + sizes[1]:].copy_(lanes[1])
    return (out,)


def matmul(x: torch.Tensor, packed: tuple, kind: str, group: int, n: int, k: int) -> torch.Tensor:
    """x fp32 [M, K] -> y fp32 [M, N] for weights packed by prepare()."""
    return _load().matmul(x.float().contiguous(), *packed, KINDS[kind], group, n)


def _quantize_acts(x: torch.Tensor):
    """x [M, K] -> q [M, K/32, 32] (integers as float64), s [M, K/32] (float64 of the fp32 scale)."""
    xb = x.float().reshape(x.shape[0], -1, 32)
    s = xb.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, torch.round((xb / s).clamp(-127, 127)), 0)
    return q.double(), s.squeeze(-1).double()


def emulate(x: torch.Tensor, kind: str, qs, scales, mins, group: int) -> torch.Tensor:
    """The kernel's math in torch: exact integer block dots, the per-block scaling summed in float64 (f8: torch's
    own e4m3 activations, the dot in float64)."""
    if kind == "f8":
        from engine.quant import quantize_tokens_fp8
        xq, xs = quantize_tokens_fp8(x)
        return ((xq.double() @ qs.double().t()) * xs.double() * scales.double().reshape(1, -1)).float()
    qa, sa = _quantize_acts(x)
    m, nb = sa.shape
    n = qs.shape[0]
    qw = (_unpack_q4(qs) if kind == "q4" else qs).double()
    u = 16 if group == 16 else 32                                          # elements per weight scale within a block
    dots = torch.einsum("mbj,nbj->mnb", qa.reshape(m, -1, u), qw.view(n, -1, u))
    d = scales.double().repeat_interleave(group // u, dim=1)                # [N, K/u]
    y = torch.einsum("mnu,nu,mu->mn", dots, d, sa.repeat_interleave(32 // u, dim=1))
    if kind == "q4":
        mn = mins.double().repeat_interleave(group // 32, dim=1)            # [N, K/32]
        y += torch.einsum("nb,mb->mn", mn, sa * qa.sum(-1))
    return y.float()


def dequantize(kind: str, qs, scales, mins, group: int) -> torch.Tensor:
    """fp32 [N, K]."""
    if kind == "f8":
        return qs.float() * scales.float().reshape(-1, 1)
    q = (_unpack_q4(qs) if kind == "q4" else qs).float()
    w = q * scales.float().repeat_interleave(group, dim=1)
    return w + mins.float().repeat_interleave(group, dim=1) if kind == "q4" else w
