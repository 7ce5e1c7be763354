"""A mixture of experts' products in one kernel launch per projection (vLLM's `fused_moe`, on CUDA).

A step's T tokens each choose k experts: T x k (token, expert) pairs. `align_pairs` sorts the pairs by expert and
pads each expert's run to a multiple of BLOCK_M, so every block of BLOCK_M sorted pairs belongs to one expert;
`_moe_gemm_kernel` then runs one program per (block, BLOCK_N output columns): it gathers its pairs' input rows,
multiplies them by its expert's weight tile with `tl.dot` and writes each pair's row of the output (times the
pair's routing weight, for the down projection). Two launches make the block: gate/up ([E, 2I, H]) into
[T x k, 2I], SiLU(gate) x up in torch, down ([E, H, I]) into [T x k, H] weighted; each token's k rows are summed.
gpt-oss's experts add a bias to each projection (in torch, by each pair's expert) and gate with their own function.

Nothing is read back to the host: the padded length has a bound from shapes alone (T x k + E x (BLOCK_M - 1)),
programs past the step's real blocks return at once, and the sort, the counts and the offsets are device ops. The
grid then follows from shapes, as a CUDA graph needs (engine/model.py SparseMoE's loop syncs once a layer).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:                 # an install without Triton: SparseMoE loops over its experts
    triton = tl = None


def _jit(fn):
    return triton.jit(fn) if triton is not None else fn


def align_pairs(experts: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts [T, k] (each token's choices) -> (sorted pair ids [P], each block's expert [P / block_m]).

    Pair p = t * k + j is token t's j-th choice. The ids are sorted by expert (stable: tokens in order within
    one), each expert's run padded to a multiple of block_m with the id T x k (no pair); a block past the
    step's last real one has expert -1. P = the bound T x k + E (block_m - 1), rounded up to block_m. A choice
    outside 0..E-1 (expert parallel: another rank's expert) is in no block."""
    flat = experts.flatten().long()
    n, device = flat.numel(), flat.device
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)     # E: the pairs of no block
    bound = -(-(n + num_experts * (block_m - 1)) // block_m) * block_m
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts                  # each expert's first position among the sorted pairs
    dest = (ends - padded)[by_expert] + torch.arange(n, device=device) - first[by_expert]
    dest = torch.where(by_expert < num_experts, dest, bound)  # pairs of no block: one spare slot, cut off below
    ids = torch.full((bound + 1,), n, dtype=torch.long, device=device).scatter_(0, dest, order)[:bound]
    starts = torch.arange(0, bound, block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)
    block_expert = torch.where((starts < ends[-1]) & (block_expert < num_experts), block_expert, -1)
    return ids, block_expert


@_jit
def _moe_gemm_kernel(a_ptr, w_ptr, c_ptr, ids_ptr, experts_ptr, scale_ptr, num_pairs, N, K, a_per_token,
                     s_am, s_ak, s_we, s_wn, s_wk, s_cm, s_cn,
                     WEIGHTED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c[pair, n-tile] = a[row of pair] @ w[expert, n-tile]^T (x scale[pair] if WEIGHTED), accumulated in fp32.
    The row of pair p is p // a_per_token (k: the tokens' hidden states) or p (1: the pairs' own rows)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(experts_ptr + pid_m)
    if expert < 0:                                            # past the step's last block
        return
    ids = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    real = ids < num_pairs
    rows = (ids // a_per_token).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * s_we + n[None, :] * s_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        a = tl.load(a_ptr + rows[:, None] * s_am + k[None, :] * s_ak, mask=real[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + k[:, None] * s_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc += tl.dot(a, w, out_dtype=tl.float32)
    if WEIGHTED:
        acc *= tl.load(scale_ptr + ids, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(c_ptr + ids.to(tl.int64)[:, None] * s_cm + n[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=real[:, None] & n_ok[None, :])


def _gemm(a: torch.Tensor, w: torch.Tensor, ids: torch.Tensor, block_expert: torch.Tensor, num_pairs: int,
          a_per_token: int, scale: torch.Tensor | None, block_m: int, block_n: int, block_k: int) -> torch.Tensor:
    n_out, k_dim = w.shape[1], w.shape[2]
    c = torch.zeros((num_pairs, n_out), dtype=a.dtype, device=a.device)     # pairs in no block stay 0
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _moe_gemm_kernel[grid](a, w, c, ids, block_expert, scale if scale is not None else c, num_pairs, n_out, k_dim,
                           a_per_token, *a.stride(), *w.stride(), *c.stride(), WEIGHTED=scale is not None,
                           BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    return c


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
              *, block_m: int = 16, block_n: int = 64, block_k: int = 32, expert_start: int = 0,
              b13: torch.Tensor | None = None, b2: torch.Tensor | None = None, activation=None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate's rows, then up's); w2 [E, H, I]; weights and experts [T, k] (the router's)
    -> [T, H]: each token's experts' SiLU-gated MLPs, weighted and summed. block_* are powers of two of at least
    16 (tl.dot's least; tests in the interpreter use the smallest). Expert parallel: w13 and w2 hold experts
    expert_start.. only; the others' pairs add nothing here (their rank adds them).
    gpt-oss's experts: b13 [E, 2I] and b2 [E, H] are each expert's biases (b2 added before the routing weight), and
    `activation` ([pairs, 2I] -> [pairs, I]) replaces SiLU(gate) x up."""
    t, k = experts.shape
    num_pairs, inter = t * k, w13.shape[1] // 2
    if num_pairs == 0:
        return torch.zeros_like(x)
    local = experts.flatten().long() - expert_start
    ids, block_expert = align_pairs(local.view(t, k), w13.shape[0], block_m)
    gate_up = _gemm(x, w13, ids, block_expert, num_pairs, k, None, block_m, block_n, block_k)
    if b13 is not None or b2 is not None:          # each pair's expert's bias row; another rank's experts add none
        mine = ((local >= 0) & (local < w13.shape[0]))[:, None]
        row = local.clamp(0, w13.shape[0] - 1)
    if b13 is not None:
        gate_up = gate_up + torch.where(mine, b13[row], 0.0).to(gate_up.dtype)
    act = activation(gate_up) if activation is not None else F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    flat_weights = weights.flatten().contiguous()
    down = _gemm(act, w2, ids, block_expert, num_pairs, 1, flat_weights, block_m, block_n, block_k)
    if b2 is not None:
        down = down + torch.where(mine, flat_weights[:, None].to(b2.dtype) * b2[row], 0.0).to(down.dtype)
    return down.view(t, k, -1).sum(dim=1)
