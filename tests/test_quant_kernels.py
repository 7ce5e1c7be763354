"""The C++ quantized matmul (engine/quant_kernels.py) equals its torch emulation, stays within int8 activation
quantization's error of the dequantized fp32 matmul, and gives a row bitwise the same result whatever rows share
the call and however many threads run it (a sequence decodes the same alone or in a batch). Its FP8 kind rounds
activations to e4m3 exactly as torch does, and its AVX-512 path gives the plain loops' bits."""
from __future__ import annotations

import pytest
import torch

from engine import cpu_model
from engine import quant_kernels as qk
from engine.quant import quantize_fp8, quantize_tokens_fp8


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert qk.available(), "the C++ quantized matmul did not compile on this machine"


def _weights(kind: str, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "f8":
        w = quantize_fp8(torch.randn(n, k, generator=g) * 0.05)
        return w.qs, w.scales, None
    if kind == "q4":
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                torch.rand(n, k // group, generator=g) * 0.02, -torch.rand(n, k // group, generator=g) * 0.15)
    return (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
            torch.rand(n, k // group, generator=g) * 0.002, None)


CASES = [("q4", 32, 37, 64), ("q4", 32, 576, 576), ("q4", 128, 1536, 1536), ("q4", 32, 576, 1536),
         ("q4", 128, 37, 1536), ("q8", 16, 37, 576), ("q8", 16, 576, 64), ("q8", 32, 1536, 576),
         ("q8", 32, 37, 1536), ("q8", "K", 576, 576), ("q8", "K", 37, 64),
         ("f8", "K", 37, 64), ("f8", "K", 576, 1536), ("f8", "K", 1536, 576)]


@pytest.mark.parametrize("kind,group,n,k", CASES)
def test_kernel_matches_emulation_and_dequantized_matmul(kind, group, n, k):
    group = k if group == "K" else group
    qs, scales, mins = _weights(kind, n, k, group)
    packed = qk.prepare(kind, qs, scales, mins, group)
    w = qk.dequantize(kind, qs, scales, mins, group)
    for m in (1, 3, 8, 17, 64):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        y = qk.matmul(x, packed, kind, group, n, k)
        want = qk.emulate(x, kind, qs, scales, mins, group)
        scale = want.abs().max().item()
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * scale)
        # int8 activations with a scale per 32 elements: ~0.5% relative error on Gaussian inputs (e4m3: ~3%)
        ref = x @ w.T
        assert (y - ref).norm() / ref.norm() < (5e-2 if kind == "f8" else 2e-2)


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 16), ("q8", 32), ("f8", 576)])
def test_rows_are_bitwise_independent_of_the_batch_and_threads(kind, group):
    n, k = 100, 576
    qs, scales, mins = _weights(kind, n, k, group, seed=1)
    packed = qk.prepare(kind, qs, scales, mins, group)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([qk.matmul(x[i:i + 1], packed, kind, group, n, k) for i in range(len(x))])
    for m in (2, 3, 5, 8, 17, 64, 200):
        assert torch.equal(qk.matmul(x[:m], packed, kind, group, n, k), alone[:m]), m
        assert torch.equal(qk.matmul(x[-m:], packed, kind, group, n, k), alone[-m:]), m
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = qk.matmul(x, packed, kind, group, n, k)
        torch.set_num_threads(2)
        two = qk.matmul(x, packed, kind, group, n, k)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, alone) and torch.equal(two, alone)


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 16)])
def test_zero_blocks_and_extreme_values_stay_finite(kind, group):
    n, k = 48, 128
    qs, scales, mins = _weights(kind, n, k, group, seed=3)
    packed = qk.prepare(kind, qs, scales, mins, group)
    x = torch.zeros(4, k)
    x[1, 32:64] = 1e30
    x[1, 64:96] = -1e-30
    x[2, :32] = 1e-44                       # subnormal: its scale underflows to 0, the block counts 0
    x[3] = torch.randn(k, generator=torch.Generator().manual_seed(4)) * 1e20
    y = qk.matmul(x, packed, kind, group, n, k)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], torch.zeros(n)) and torch.equal(y[2], torch.zeros(n))
    want = qk.emulate(x, kind, qs, scales, mins, group)
    for row in (1, 3):
        torch.testing.assert_close(y[row], want[row], rtol=1e-5, atol=1e-5 * want[row].abs().max().item())


def test_fp8_activations_round_as_torchs_e4m3_and_both_paths_give_the_same_bits():
    """Each activation row is rounded to e4m3 as torch's .to(float8_e4m3fn) rounds it (ties to even, subnormals
    included): every e4m3 value, every midpoint between two, the floats either side of each, and random values
    at two scales; a weight of 448 (scale 1) in one row reads each code back. CPUs without AVX-512 run the plain
    loops, which give the AVX-512 path's bits on ragged shapes."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[torch.isfinite(codes)].sort().values
    vals = torch.cat([codes, (codes[1:] + codes[:-1]) / 2])
    g = torch.Generator().manual_seed(5)
    vals = torch.cat([vals, vals.nextafter(torch.full_like(vals, 1e9)), vals.nextafter(torch.full_like(vals, -1e9)),
                      torch.randn(20000, generator=g) * 50, torch.randn(20000, generator=g) * 1e-3]).clamp(-448, 448)
    x = torch.zeros(len(vals), 16)
    x[:, 0], x[:, 1] = 448.0, vals                      # amax 448: the activation scale is exactly 1
    eye = quantize_fp8(torch.eye(16) * 448)              # row n reads column n back, times 448
    y = qk.matmul(x, qk.prepare("f8", eye.qs, eye.scales, None, 16), "f8", 16, 16, 16) / 448
    xq, xs = quantize_tokens_fp8(x)
    assert (xs == 1).all() and torch.equal(y[:, 1], xq[:, 1].float())
    portable = cpu_model.kernels().f8_matmul_portable
    for m, n, k in [(1, 37, 64), (5, 4, 16), (9, 1536, 576), (70, 7, 1536)]:
        qs, scales, _ = _weights("f8", n, k, k, seed=m)
        packed = qk.prepare("f8", qs, scales, None, k)
        x = torch.randn(m, k, generator=g)
        assert torch.equal(qk.matmul(x, packed, "f8", k, n, k), portable(x, packed[0], n)), (m, n, k)
