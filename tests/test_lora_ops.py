"""Batched multi-LoRA (engine/lora_ops.py): every row gets its own adapter's delta, base-model rows none; the torch
path against a per-row loop, the Triton kernels against the torch path (in the Triton interpreter, on CPU)."""
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU interpreter

import numpy as np
import pytest
import torch

from engine.lora_ops import apply_lora, apply_lora_torch, lora_groups


def _adapters(num_slots, ranks_k_n, dtype=torch.float32, seed=0):
    """a [S, R, K], b [S, N, R] with each slot's rank taken from `ranks`, zero-padded to the largest (as loaded)."""
    ranks, k, n = ranks_k_n
    g = torch.Generator().manual_seed(seed)
    r = max(ranks)
    a, b = torch.zeros(num_slots, r, k), torch.zeros(num_slots, n, r)
    for s, rank in enumerate(ranks):
        a[s, :rank] = torch.randn(rank, k, generator=g) / k ** 0.5
        b[s, :, :rank] = torch.randn(n, rank, generator=g)
    return a.to(dtype), b.to(dtype)


def _loop_reference(x, a, b, slots, y):
    out = y.clone()
    for t, s in enumerate(slots):
        if s >= 0:
            out[t] += b[s] @ (a[s] @ x[t])
    return out


@pytest.mark.parametrize("slots", [
    pytest.param([1, -1, 0, 2, 1, -1, 2, 0, 1], id="mixed"),
    pytest.param([2] * 6, id="one-adapter"),                    # one contiguous group: the slice path
    pytest.param([-1, 0, 0, 0, 1, -1, 1], id="runs-and-scatter"),
    pytest.param([-1, -1, -1], id="base-only"),
])
def test_torch_path_matches_per_row_loop(slots):
    a, b = _adapters(3, ([4, 1, 3], 24, 20))
    x, y = torch.randn(len(slots), 24), torch.randn(len(slots), 20)
    ref = _loop_reference(x, a, b, slots, y)
    apply_lora(x, a, b, np.array(slots), y)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    base = np.array(slots) < 0
    assert torch.equal(y[base], ref[base])                      # the base model's rows exactly as they were


def test_groups_passed_in_are_what_apply_uses():
    """A step computes groups once and every layer reuses them: same result as letting apply_lora group."""
    slots = np.array([0, 1, -1, 1, 0])
    a, b = _adapters(2, ([2, 2], 16, 8))
    x = torch.randn(5, 16)
    y1, y2 = torch.zeros(5, 8), torch.zeros(5, 8)
    apply_lora(x, a, b, slots, y1)
    apply_lora(x, a, b, slots, y2, groups=lora_groups(slots))
    assert torch.equal(y1, y2) and y1[:2].abs().sum() > 0


def test_lora_groups():
    groups = lora_groups(np.array([2, -1, 0, 2, 2, -1, 0]))
    assert [(s, idx.tolist()) for s, idx in groups] == [(0, [2, 6]), (2, [0, 3, 4])]
    assert all(idx.dtype == torch.int64 for _, idx in groups)
    assert lora_groups(np.array([-1, -1])) == []
    assert lora_groups(np.array([], dtype=np.int64)) == []


# -- the Triton kernels, in the interpreter (tiny sizes: it runs every program in Python) ----------------------
@pytest.fixture(scope="module")
def triton_lora():
    try:
        import triton  # noqa: F401
    except ImportError as e:
        pytest.skip(f"triton cannot be imported ({e}): the Triton LoRA kernels are untested here")
    from engine.lora_ops import apply_lora_triton
    return apply_lora_triton


@pytest.mark.triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("sizes,blocks", [
    pytest.param(([5, 2, 7], 48, 40), {}, id="one-tile"),
    # 16-wide tiles: K=40 and N=36 take three tiles each, the last one masked; rank 7 pads to 8
    pytest.param(([3, 7, 1], 40, 36), {"block_k": 16, "block_n": 16}, id="tiled"),
])
def test_triton_matches_torch(triton_lora, dtype, tol, sizes, blocks):
    slots = np.array([1, -1, 0, 2, 1, -1, 0])
    ranks, k, n = sizes
    a, b = _adapters(3, sizes, dtype, seed=1)
    x = torch.randn(len(slots), k).to(dtype)
    # y a strided view (a slice of a fused projection's output), as the engine adds into it
    fused = torch.randn(len(slots), n + 8).to(dtype)
    y = fused[:, 4:4 + n]
    ref = y.clone()
    apply_lora_torch(x, a, b, lora_groups(slots), ref)
    before = fused.clone()
    triton_lora(x, a, b, torch.from_numpy(slots).to(torch.int32), y, **blocks)
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)
    assert not torch.equal(y, before[:, 4:4 + n])               # the adapters did add something
    base = slots < 0
    assert torch.equal(fused[base], before[base])               # base rows, and columns outside y, untouched
    assert torch.equal(fused[:, :4], before[:, :4]) and torch.equal(fused[:, 4 + n:], before[:, 4 + n:])


def test_the_engines_cpu_layout_is_exact_whatever_the_batch_and_threads():
    """float64 stacks with one B per part (the engine's CPU layout) equal the block-diagonal layout, and a row's
    delta is bit-identical alone and inside a mixed, padded batch, with one thread or two: a LoRA request's tokens
    do not depend on where or beside whom it runs."""
    g = torch.Generator().manual_seed(3)
    parts, r = [40, 12, 12], 4
    a = torch.randn(3, 3 * r, 48, generator=g, dtype=torch.float64)
    blocks = [torch.randn(3, p, r, generator=g, dtype=torch.float64) for p in parts]
    diag = torch.zeros(3, sum(parts), 3 * r, dtype=torch.float64)
    for i, (o, p) in enumerate(zip(np.cumsum([0, *parts]), parts)):
        diag[:, o:o + p, i * r:(i + 1) * r] = blocks[i]
    x = torch.randn(7, 48, generator=g)
    slots = np.array([0, 2, -1, 2, 1, 2, 0])
    y_blocks, y_diag = torch.zeros(7, sum(parts)), torch.zeros(7, sum(parts))
    apply_lora(x, a, blocks, slots, y_blocks, parts=parts)
    apply_lora(x, a, diag, slots, y_diag, parts=parts)
    assert torch.equal(y_blocks, y_diag) and y_blocks[2].abs().sum() == 0 and y_blocks[0].abs().sum() > 0
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            alone = torch.zeros(1, sum(parts))
            apply_lora(x[3:4], a, blocks, np.array([2]), alone, parts=parts)
            mixed = torch.zeros(7, sum(parts))
            apply_lora(x, a, blocks, slots, mixed, parts=parts)
            assert torch.equal(mixed[3:4], alone) and torch.equal(mixed, y_blocks)
    finally:
        torch.set_num_threads(threads)


def test_the_cpu_kernel_matches_the_reference_and_is_exact_whatever_the_batch_and_threads():
    """engine/lora_cpu.cpp (fp32, transposed B parts) equals the per-row loop, and a row's delta is bit-identical
    alone and in a mixed batch, with one thread or two."""
    from engine.lora_ops import LoRAPlan, apply_lora_cpu, cpu_kernel
    if cpu_kernel() is None:
        pytest.skip("no C++ compiler on this machine: the engine runs the float64 torch path")
    g = torch.Generator().manual_seed(4)
    parts, r, k = [40, 12, 12], 4, 53                 # K not a multiple of the kernel's 16 lanes
    a = torch.randn(3, 3 * r, k, generator=g)
    bt = [torch.randn(3, r, p, generator=g) for p in parts]
    x = torch.randn(7, k, generator=g)
    slots = np.array([0, 2, -1, 2, 1, 2, 0])
    y = torch.randn(7, sum(parts), generator=g)
    want = y.double().clone()
    off = np.cumsum([0, *parts])
    for t, s in enumerate(slots):
        if s >= 0:
            h = a[s].double() @ x[t].double()
            for i in range(3):
                want[t, off[i]:off[i + 1]] += bt[i][s].double().T @ h[i * r:(i + 1) * r]
    got = y.clone()
    apply_lora_cpu(x, a, bt, LoRAPlan(lora_groups(slots)), got)
    assert torch.allclose(got.double(), want, atol=1e-4) and torch.equal(got[2], y[2])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            alone = y[3:4].clone()
            apply_lora_cpu(x[3:4], a, bt, LoRAPlan(lora_groups(np.array([2]))), alone)
            mixed = y.clone()
            apply_lora_cpu(x, a, bt, LoRAPlan(lora_groups(slots)), mixed)
            assert torch.equal(mixed[3:4], alone) and torch.equal(mixed, got)
    finally:
        torch.set_num_threads(threads)


_ISA_WRAPPER = """#include <torch/extension.h>
#include <algorithm>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "{source}"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("shrink", &shrink); m.def("expand", &expand); }}
"""


@pytest.mark.slow
def test_the_cpu_kernel_gives_the_same_bits_built_for_avx2_and_for_plain_loops(tmp_path):
    """engine/lora_cpu.cpp has an AVX-512 path, an AVX2 path and plain loops: a replica's CPU picks one. Built
    without AVX-512 and without AVX2 (as on older or non-x86 CPUs), it gives the engine's own build's bits on
    ragged tiles, K and N (so adapters give the same tokens on every machine of a cluster)."""
    import platform

    from engine import cpu_model
    from engine.cpp_build import load_extension
    from engine.lora_ops import LoRAPlan, cpu_kernel
    if cpu_kernel() is None:
        pytest.skip("no C++ compiler on this machine: the engine runs the float64 torch path")
    source = Path(cpu_model.__file__).with_name("lora_cpu.cpp")
    wrapper = tmp_path / "lora_isa.cpp"
    wrapper.write_text(_ISA_WRAPPER.format(source=source))
    builds = {"engine": (cpu_kernel().lora_shrink, cpu_kernel().lora_expand)}
    if platform.machine() in ("x86_64", "AMD64"):
        for name, flags in (("avx2", ("-mno-avx512f",)), ("plain", ("-mno-avx512f", "-mno-avx2", "-mno-avx"))):
            mod = load_extension(f"baton_lora_isa_{name}", wrapper, f"LoRA kernel ({name})",
                                 ("-ffp-contract=off", *flags), (source,))
            assert mod is not None, f"the {name} build failed"
            builds[name] = (mod.shrink, mod.expand)
    g = torch.Generator().manual_seed(6)
    for rows, slots_n, rank, k, parts in [(32, 8, 48, 576, [576, 192, 192]), (7, 3, 16, 100, [1536, 70]),
                                          (1, 1, 8, 33, [70]), (45, 5, 12, 1536, [576])]:
        slots = np.sort(np.random.default_rng(rows).integers(0, slots_n, rows))
        plan = LoRAPlan(lora_groups(slots))
        x = torch.randn(rows, k, generator=g)
        a = torch.randn(slots_n, rank, k, generator=g)
        bt = [torch.randn(slots_n, rank // len(parts), p, generator=g) for p in parts]
        y0 = torch.randn(rows, sum(parts), generator=g)
        outs = {}
        for name, (shrink, expand) in builds.items():
            t, y, col = shrink(x, a, plan.rows, plan.row_slots), y0.clone(), 0
            for i, part in enumerate(bt):
                expand(t, i * (rank // len(parts)), part, plan.rows, plan.row_slots, y, col)
                col += part.shape[2]
            outs[name] = (t, y)
        for name, (t, y) in outs.items():
            assert torch.equal(t, outs["engine"][0]) and torch.equal(y, outs["engine"][1]), (name, rows, k, parts)


def test_the_cpu_kernel_refuses_rows_outside_the_step():
    """A step plan whose rows or slots fall outside the tensors (a stale plan) is a clear error, not a read past
    the end of x or a write past y."""
    from engine.lora_ops import LoRAPlan, apply_lora_cpu, cpu_kernel
    if cpu_kernel() is None:
        pytest.skip("no C++ compiler on this machine: the engine runs the float64 torch path")
    a, bt = torch.randn(2, 4, 8), [torch.randn(2, 4, 6)]
    x, y = torch.randn(3, 8), torch.zeros(3, 6)
    with pytest.raises(RuntimeError, match="outside the step"):
        apply_lora_cpu(x, a, bt, LoRAPlan(lora_groups(np.array([0, -1, 1, 1]))), y)     # 4 rows' plan, 3 rows
    with pytest.raises(RuntimeError, match="outside the step"):
        apply_lora_cpu(x, a, bt, LoRAPlan(lora_groups(np.array([0, 2, 1]))), y)         # slot 2 of 2
    assert torch.equal(y, torch.zeros(3, 6))
