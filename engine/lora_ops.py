"""Batched LoRA for a multi-LoRA step (Punica's BGMV): every token row adds its own adapter's B @ (A @ x).

Adapters sit in slots, their weights stacked per slot: `a` [S, R, K] (A, rows past an adapter's rank are zero),
`b` [S, N, R] (B with the adapter's scaling multiplied in, columns past its rank zero). Row t of the step uses
slot `slots[t]`; -1 is the base model (no LoRA), and such rows are left untouched. Three paths:
- CUDA: two Triton kernels (shrink x -> A x into an fp32 buffer, expand y += B (A x)), as vLLM's punica
  `lora_shrink`/`lora_expand`;
- CPU: engine/lora_cpu.cpp (fp32, each element summed in one fixed order: batch- and thread-invariant), built into
  the CPU kernels' one extension (engine/cpu_model.py), whose decoder stack also applies adapters in-line;
- CPU without a compiler: the torch path, one padded batched matmul pair per Linear, exact in float64.
"""
from __future__ import annotations

from functools import cached_property

import numpy as np
import torch


try:
    import triton
    import triton.language as tl
except ImportError:                 # an install without Triton: apply_lora takes the torch path (CPU)
    triton = tl = None

_TILE = 4096                        # elements of one weight tile per program (BLOCK_R x BLOCK_K or BLOCK_N x BLOCK_R)


def _jit(fn):
    """triton.jit where Triton is installed; without it the kernels stay plain functions (never launched)."""
    return triton.jit(fn) if triton is not None else fn


def lora_groups(slots: np.ndarray) -> list[tuple[int, torch.Tensor]]:
    """(slot, row indices) for each adapter slot present, ascending; base-model rows (-1) are in no group.
    The caller computes this once per step and passes it to every layer's apply_lora."""
    slots = np.asarray(slots)
    return [(int(s), torch.from_numpy(np.flatnonzero(slots == s)))
            for s in np.unique(slots[slots >= 0])]


class LoRAPlan:
    """How one step's rows meet the LoRA products, worked out once per step and read by every Linear: the rows
    with an adapter and their slots (the C++ kernel's inputs), or, for the torch path, each slot's rows gathered
    into a padded [groups, n_max] batch so every Linear runs one batched matmul pair however many adapters the
    step mixes. Each is built on first use: a step pays only for the path it runs."""

    def __init__(self, groups: list[tuple[int, torch.Tensor]]):
        self.groups = groups

    def __bool__(self) -> bool:
        return bool(self.groups)

    @cached_property
    def rows(self) -> torch.Tensor:
        """The rows with an adapter, slot by slot."""
        return torch.cat([idx for _, idx in self.groups]) if self.groups else torch.zeros(0, dtype=torch.long)

    @cached_property
    def row_slots(self) -> torch.Tensor:
        """The slot of each of `rows`."""
        return torch.cat([torch.full((len(idx),), s, dtype=torch.long) for s, idx in self.groups]) \
            if self.groups else torch.zeros(0, dtype=torch.long)

    @cached_property
    def run(self) -> tuple[int, int, int] | None:
        """(lo, hi, slot): one slot over one contiguous run of rows (views only), else None."""
        if len(self.groups) != 1:
            return None
        slot, idx = self.groups[0]
        lo, hi = int(idx[0]), int(idx[-1]) + 1
        return (lo, hi, slot) if hi - lo == len(idx) else None

    @cached_property
    def n_max(self) -> int:
        return max((len(idx) for _, idx in self.groups), default=0)

    @cached_property
    def slots(self) -> torch.Tensor:
        return torch.tensor([s for s, _ in self.groups], dtype=torch.long)

    @cached_property
    def identity(self) -> bool:
        """The slots present are 0..g-1 in order (the stacks need no index_select)."""
        return [s for s, _ in self.groups] == list(range(len(self.groups)))

    @cached_property
    def gather(self) -> torch.Tensor:
        """Each slot's rows padded to n_max (with its first row), slot after slot."""
        pad = [torch.cat([idx, idx[:1].expand(self.n_max - len(idx))]) for _, idx in self.groups]
        return torch.cat(pad) if pad else torch.zeros(0, dtype=torch.long)

    @cached_property
    def valid(self) -> torch.Tensor | None:
        """Positions of the real rows in the padded batch (None: nothing is padding)."""
        if all(len(idx) == self.n_max for _, idx in self.groups):
            return None
        return torch.cat([torch.arange(len(idx)) + g * self.n_max for g, (_, idx) in enumerate(self.groups)])


def lora_plan(slots: np.ndarray) -> LoRAPlan:
    return LoRAPlan(lora_groups(slots))


def apply_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots, y: torch.Tensor,
               groups: LoRAPlan | list[tuple[int, torch.Tensor]] | None = None, parts: list[int] | None = None) -> None:
    """y[t] += b[slots[t]] @ (a[slots[t]] @ x[t]) for every t with slots[t] >= 0 (in place).
    On CUDA the Triton kernels run; elsewhere the torch path (grouped by slot). `parts`: the output sizes of a
    fused Linear whose B is block-diagonal (part i uses A rows [i*R/p, (i+1)*R/p)); the torch path then skips
    the zero blocks."""
    if x.is_cuda:
        if not torch.is_tensor(slots):
            slots = torch.from_numpy(np.asarray(slots)).to(x.device, non_blocking=True)
        apply_lora_triton(x, a, b, slots, y)
    else:
        apply_lora_torch(x, a, b, lora_groups(slots) if groups is None else groups, y, parts)


def apply_lora_torch(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     groups: LoRAPlan | list[tuple[int, torch.Tensor]], y: torch.Tensor,
                     parts: list[int] | None = None) -> None:
    """The torch path: the rows of each slot gathered into one padded batch, then (rows x K) @ (K x R) @ (R x N)
    as two batched matmuls, computed in the stacks' dtype and rounded once to y's. On a CPU without a compiler
    for engine/lora_cpu.cpp the engine keeps the stacks in float64: BLAS sums in an order that depends on the thread count and the number of rows, and fp32
    sums in another order would make a request's tokens depend on where and beside whom it ran (the packed
    kernels are batch- and thread-invariant; this keeps adapters so: rounded fp64 results agree but for a
    difference of order 1e-16 landing on an fp32 rounding boundary)."""
    plan = groups if isinstance(groups, LoRAPlan) else LoRAPlan(groups)
    if not plan:
        return
    dt = a.dtype
    blocks = _blocks(b, parts, a.shape[1])
    if plan.run is not None:            # one adapter over one run of rows (a single-adapter batch, a prefill)
        lo, hi, slot = plan.run
        t = x[lo:hi].to(dt) @ a[slot].T
        d = [t[:, r0:r1] @ bi[slot].T for (r0, r1), bi in blocks]
        y[lo:hi] += (d[0] if len(d) == 1 else torch.cat(d, dim=1)).to(y.dtype)
        return
    g, n = len(plan.groups), plan.n_max
    whole = plan.identity and g == a.shape[0]
    pick = (lambda w: w) if whole else (lambda w: w.index_select(0, plan.slots))
    t = torch.bmm(x.index_select(0, plan.gather).to(dt).view(g, n, -1), pick(a).transpose(1, 2))
    d = [torch.bmm(t[:, :, r0:r1], pick(bi).transpose(1, 2)) for (r0, r1), bi in blocks]
    d = (d[0] if len(d) == 1 else torch.cat(d, dim=2)).view(g * n, -1)
    if plan.valid is not None:
        d = d.index_select(0, plan.valid)
    y.index_add_(0, plan.rows, d.to(y.dtype))


def cpu_kernel():
    """The CPU kernels' extension with engine/lora_cpu.cpp in it (engine/cpu_model.py), built on first use; None
    without a compiler, or with BATON_CPU_KERNEL=0."""
    from engine import cpu_model
    return cpu_model.kernels() if cpu_model.available() else None


def apply_lora_cpu(x: torch.Tensor, a: torch.Tensor, bt: list[torch.Tensor], plan: LoRAPlan, y: torch.Tensor) -> None:
    """The C++ path (fp32): `a` [S, R, K] as everywhere, `bt` one B per part, transposed [S, R/parts, N_i] (part i
    reads t's rank columns [i*R/parts, (i+1)*R/parts) and writes y's next N_i columns). Each element of the
    result is summed in one fixed order: bitwise the same alone or batched, with any thread count."""
    if plan:
        cpu_kernel().lora_apply(x, a, bt, plan.rows, plan.row_slots, y)


def _blocks(b, parts: list[int] | None, rank: int) -> list[tuple[tuple[int, int], torch.Tensor]]:
    """((rank columns), B block [S, N_i, r]) of each part. `b` is one B [S, N, R] (block-diagonal when `parts`
    has several: its blocks are read as strided views) or already a list of contiguous blocks (the engine's
    CPU layout, which skips the zeros)."""
    if isinstance(b, (list, tuple)):
        r = rank // len(b)
        return [((i * r, (i + 1) * r), bi) for i, bi in enumerate(b)]
    if not parts or len(parts) == 1:
        return [((0, rank), b)]
    r, off = rank // len(parts), np.cumsum([0, *parts])
    return [((i * r, (i + 1) * r), b[:, int(off[i]):int(off[i + 1]), i * r:(i + 1) * r]) for i in range(len(parts))]


@_jit
def _shrink_kernel(x_ptr, a_ptr, t_ptr, slots_ptr, K, R,
                   s_xt, s_xk, s_as, s_ar, s_ak, s_tt, s_tr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """t[row, :R] = a[slot] @ x[row], fp32: one program per row, K walked in BLOCK_K tiles."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:                    # base-model row: nothing to add
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    kk = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row.to(tl.int64) * s_xt
    a_rows = a_ptr + slot.to(tl.int64) * s_as + r[:, None] * s_ar
    acc = tl.zeros([BLOCK_R], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        k_ok = k < K
        xv = tl.load(x_row + k * s_xk, mask=k_ok, other=0.0).to(tl.float32)
        av = tl.load(a_rows + k[None, :] * s_ak, mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        # A matrix-vector product: tl.dot would need 16 rows, a decode step has one per program.
        acc += tl.sum(av * xv[None, :], 1)
    tl.store(t_ptr + row.to(tl.int64) * s_tt + r * s_tr, acc, mask=r_ok)


@_jit
def _expand_kernel(t_ptr, b_ptr, y_ptr, slots_ptr, N, R,
                   s_tt, s_tr, s_bs, s_bn, s_br, s_yt, s_yn,
                   BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[row, n-tile] += b[slot][n-tile] @ t[row]: one program per (row, BLOCK_N columns), added in fp32."""
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    tv = tl.load(t_ptr + row.to(tl.int64) * s_tt + r * s_tr, mask=r_ok, other=0.0)
    bv = tl.load(b_ptr + slot.to(tl.int64) * s_bs + n[:, None] * s_bn + r[None, :] * s_br,
                 mask=n_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    y_ptrs = y_ptr + row.to(tl.int64) * s_yt + n * s_yn
    yv = tl.load(y_ptrs, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (yv + tl.sum(bv * tv[None, :], 1)).to(y_ptr.dtype.element_ty), mask=n_ok)


def apply_lora_triton(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, y: torch.Tensor,
                      *, block_k: int | None = None, block_n: int | None = None) -> None:
    """The Triton path of apply_lora; `slots` an int tensor on x's device. Strided x and y are fine (a slice of a
    fused projection's output). block_k/block_n override the tile sizes (powers of two; tests use small ones).

    CUDA-graph safe: the grid and constexprs follow from shapes alone, and nothing is read back to the host."""
    num_tokens, k_dim = x.shape
    num_slots, rank, a_k = a.shape
    n_dim = y.shape[1]
    assert a_k == k_dim and b.shape == (num_slots, n_dim, rank), "lora weight shapes mismatch"
    assert slots.shape == (num_tokens,) and y.shape[0] == num_tokens, "one slot per row"
    if num_tokens == 0 or rank == 0:
        return
    block_r = triton.next_power_of_2(rank)
    block_k = block_k or min(triton.next_power_of_2(k_dim), max(16, _TILE // block_r))
    block_n = block_n or min(triton.next_power_of_2(n_dim), max(16, _TILE // block_r))
    # A x in fp32 (as vLLM's shrink buffer): B's product then rounds once, into y. Rows of slot -1 stay unwritten.
    t = torch.empty((num_tokens, rank), dtype=torch.float32, device=x.device)
    _shrink_kernel[(num_tokens,)](x, a, t, slots, k_dim, rank,
                                  *x.stride(), *a.stride(), *t.stride(), BLOCK_K=block_k, BLOCK_R=block_r)
    _expand_kernel[(num_tokens, triton.cdiv(n_dim, block_n))](t, b, y, slots, n_dim, rank,
                                                              *t.stride(), *b.stride(), *y.stride(),
                                                              BLOCK_N=block_n, BLOCK_R=block_r)
