"""The Triton weight-only matmul (engine/quant_triton.py), in Triton's CPU interpreter: q4 and q8 weights in the
layouts the loaders store (GGUF's 32-column nibble blocks, GPTQ/AWQ groups, Q6_K's groups of 16, int8's one
scale per row) against their dequantized product, for decode-sized M (split K) and wider M, fp32 and fp16
(the interpreter computes bf16 dots wrong: `baton check gpu` covers bf16 on a GPU). QuantLinear's GPU branch
runs the same kernel."""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU interpreter

import pytest
import torch

from engine.model import QuantLinear
from engine.quant import QuantWeight, quantize_fp8, quantize_int8, tinygemm_matmul, tinygemm_pack
from engine.quant_triton import plan, wo_matmul


def q4(n: int, k: int, group: int, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g)
    b = codes.view(n, -1, 2, 16)
    qs = (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, -1).contiguous()
    return QuantWeight("q4", qs, torch.rand(n, k // group, generator=g) * 0.02,
                       torch.randn(n, k // group, generator=g) * 0.02, group, "test")


def q8(n: int, k: int, group: int, seed: int = 0) -> QuantWeight:
    g = torch.Generator().manual_seed(seed)
    return QuantWeight("q8", torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                       torch.rand(n, k // group, generator=g) * 0.01, None, group, "test")


def f8(n: int, k: int, group: int, seed: int = 0) -> QuantWeight:
    return quantize_fp8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))


TOL = {torch.float32: 1e-5, torch.float16: 2e-3}          # relative to the output's largest magnitude


@pytest.mark.parametrize("make, n, k, group", [(q4, 48, 256, 32), (q4, 40, 256, 128), (q4, 33, 128, 64),
                                               (q8, 40, 192, 16), (q8, 48, 192, 192), (q8, 32, 256, 32),
                                               (f8, 40, 192, 192)])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_weight_only_matmul_equals_the_dequantized_product(make, n, k, group, m, dtype):
    w = make(n, k, group)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = wo_matmul(x, w)
    want = x.float() @ w.dequantize().t()
    assert y.dtype == dtype and y.shape == (m, n)
    assert (y.float() - want).abs().max() <= TOL[dtype] * want.abs().max()


def test_both_dequantization_paths_and_split_k_agree():
    """A tile inside one scale group applies the scale to the tile's product; forced to tiles wider than the group,
    the kernel dequantizes each weight instead; K split over programs sums partials in a fixed order. All three
    are the same product, and a run repeats bit for bit."""
    w = q4(48, 256, 32)
    x = torch.randn(3, 256)
    want = x @ w.dequantize().t()
    configs = {"scale after": (16, 32, 32, 1, 4), "per weight": (16, 32, 128, 1, 4), "split 4": (16, 32, 32, 4, 4)}
    for name, config in configs.items():
        y = wo_matmul(x, w, config)
        assert (y - want).abs().max() <= 1e-5 * want.abs().max(), name
        assert torch.equal(y, wo_matmul(x, w, config)), name
    assert plan(1, 2048, 2048, 128, 132)[3] > 1              # decode on a big GPU splits K to fill its SMs
    assert plan(256, 2048, 2048, 128, 132)[3] == 1


def test_quant_linear_gpu_branch_runs_the_kernel():
    """QuantLinear with the Triton branch (what a CUDA device takes): fused parts of different kinds (q4 q/k beside
    a q8 v, as a Q4_K_M GGUF has them) and a bias, against the dequantized Linear."""
    parts = [q4(32, 128, 32, seed=1), q4(16, 128, 32, seed=2), q8(16, 128, 16, seed=3)]
    bias = torch.randn(64)
    layer = QuantLinear(parts, bias, torch.device("cpu"), triton=True)
    assert layer.weights and not layer.packed and len(layer.calls) == 3    # mixed kinds: one call each
    x = torch.randn(2, 3, 128)
    want = x @ torch.cat([p.dequantize() for p in parts]).t() + bias
    y = layer(x)
    assert y.shape == (2, 3, 64) and (y - want).abs().max() <= 1e-5 * want.abs().max()
    per_row = QuantLinear([quantize_int8(torch.randn(24, 96))], None, torch.device("cpu"), triton=True)
    assert per_row(torch.randn(4, 96)).shape == (4, 24)


def test_fp8_weights_run_weight_only_at_decode_sizes_and_in_fp8_beyond():
    """FP8 at a decode-sized batch reads the e4m3 weights in the Triton kernel (activations as they are: the
    dequantized product); a prefill-sized one quantizes the activations per token for the FP8 GEMM."""
    from engine.quant import quantize_tokens_fp8
    from engine.quant_triton import FP8_WEIGHT_ONLY_MAX_M
    w = quantize_fp8(torch.randn(32, 64))
    layer = QuantLinear([w], None, torch.device("cpu"), triton=True)
    small, big = torch.randn(FP8_WEIGHT_ONLY_MAX_M, 64), torch.randn(FP8_WEIGHT_ONLY_MAX_M + 1, 64)
    torch.testing.assert_close(layer(small), small @ w.dequantize().t(), atol=1e-4, rtol=1e-4)
    xq, xs = quantize_tokens_fp8(big)
    torch.testing.assert_close(layer(big), (xq.float() * xs) @ w.dequantize().t(), atol=1e-4, rtol=1e-4)
    assert (layer(big) - big @ w.dequantize().t()).abs().max() > 1e-3        # really quantized: not the same


@pytest.mark.parametrize("group", [32, 128])
def test_tinygemm_layout_holds_our_q4_weights(group):
    """torch's tinygemm int4 layout (a CUDA QuantLinear runs q4 through it at decode sizes in bf16) holds our q4
    codes, scales and mins: through its CPU twin in fp32 the product is the dequantized weight's. What it does not
    take gets None: K not a multiple of 128, N not of 8, q8."""
    w = q4(48, 256, group)
    x = torch.randn(3, 256)
    want = x @ w.dequantize().t()
    y = tinygemm_matmul(x, w, tinygemm_pack(w, torch.float32))
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    assert tinygemm_pack(q4(48, 96, 32), torch.float32) is None
    assert tinygemm_pack(q4(36, 128, 32), torch.float32) is None
    assert tinygemm_pack(q8(48, 256, 32), torch.float32) is None


def test_quant_linear_routes_decode_sizes_to_tinygemm_and_the_rest_to_triton():
    """A layer of a q4 part tinygemm takes beside a q8 part it does not: up to tinygemm_max_m tokens of its dtype
    the q4 part goes through tinygemm and the q8 part through the Triton kernel; more tokens, or another dtype,
    take the Triton kernel for both. Every route gives the dequantized product."""
    parts = [q4(32, 128, 32, seed=1), q8(16, 128, 16, seed=2)]
    layer = QuantLinear(parts, None, torch.device("cpu"), triton=True)
    assert layer.route(1, torch.float32) == "triton"          # on CPU no layer packs for tinygemm by itself
    layer.tinygemm = [tinygemm_pack(w, torch.float32) for w in layer.weights]     # what CUDA + bf16 builds
    layer.tinygemm_max_m, layer.tinygemm_dtype = 4, torch.float32
    assert layer.tinygemm[1] is None
    want = lambda x: x @ torch.cat([p.dequantize() for p in parts]).t()        # noqa: E731
    for m, routes in ((4, ["tinygemm", "triton"]), (5, ["triton", "triton"])):
        assert [layer.route(m, torch.float32, i) for i in range(2)] == routes
        x = torch.randn(m, 128)
        assert (layer(x) - want(x)).abs().max() <= 1e-5 * want(x).abs().max()
    assert layer.route(1, torch.float16) == "triton"
