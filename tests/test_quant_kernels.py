"""The C++ quantized matmul (engine/quant_kernels.py) equals its torch emulation, stays within int8 activation
quantization's error of the dequantized fp32 matmul, and gives a row bitwise the same result whatever rows share
the call and however many threads run it (a sequence decodes the same alone or in a batch)."""
from __future__ import annotations

import pytest
import torch

from engine import quant_kernels as qk


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert qk.available(), "the C++ quantized matmul did not compile on this machine"


def _weights(kind: str, n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "q4":
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
                torch.rand(n, k // group, generator=g) * 0.02, -torch.rand(n, k // group, generator=g) * 0.15)
    return (torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
            torch.rand(n, k // group, generator=g) * 0.002, None)


CASES = [("q4", 32, 37, 64), ("q4", 32, 576, 576), ("q4", 128, 1536, 1536), ("q4", 32, 576, 1536),
         ("q4", 128, 37, 1536), ("q8", 16, 37, 576), ("q8", 16, 576, 64), ("q8", 32, 1536, 576),
         ("q8", 32, 37, 1536), ("q8", "K", 576, 576), ("q8", "K", 37, 64)]


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
        # int8 activations with a scale per 32 elements: ~0.5% relative error on Gaussian inputs
        ref = x @ w.T
        assert (y - ref).norm() / ref.norm() < 2e-2


@pytest.mark.parametrize("kind,group", [("q4", 32), ("q8", 16), ("q8", 32)])
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
