"""A quantized KV cache (kv_cache_dtype "int8" / "fp8"): one byte a value and a scale per token and head, kept in
the block with its values (engine/kv_layout.py). A block takes a quarter of fp32's bytes and more; attention (the
C++ kernel, the torch reference and, in tests/test_triton_attention.py, the Triton kernel) reads it and matches
attention over the values it stands for; on SmolLM2 it stays close to the unquantized cache (teacher-forced
logits, perplexity on tests/data/perplexity.txt, greedy tokens) and equal to itself wherever the same bytes are
read: batched or alone, restored from the host tier, pulled from another engine."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from check.attention import quantized_cache, random_batch
from check.models import engine_logprobs
from engine import LLM, ConfigError, SamplingParams
from engine import cpu_attention
from engine.attention import paged_attention_torch, write_kv
from engine.block_hash import block_hashes
from engine.kv_events import DEVICE, HOST
from engine.kv_layout import KVCacheSpec, dequantize_kv, layer_views, quantize_kv
from tests.greedy import TOP_K, baton_greedy, check_greedy_close

TEXT = (Path(__file__).parent / "data" / "perplexity.txt").read_text()
SMOL = dict(num_kv_heads=3, num_layers=30, block_size=16, head_dim=64, dtype=torch.float32)


# -- the layout -----------------------------------------------------------------------------------------
def test_a_quantized_block_holds_its_scales_in_a_quarter_of_fp32s_bytes():
    fp32, int8 = KVCacheSpec(**SMOL), KVCacheSpec(**SMOL, kv_cache_dtype="int8")
    assert fp32.block_bytes == 737_280
    # per head: 30 layers x (K, V) x 16 tokens x 64 values, then 3,840 bytes of scales padded to whole rows
    assert int8.head_bytes == 61_440 + 4_096 and int8.block_bytes == 3 * 65_536
    assert fp32.block_bytes / int8.block_bytes == 3.75
    assert KVCacheSpec(**SMOL, kv_cache_dtype="fp8").block_bytes == int8.block_bytes

    # a block's bytes carry its values and its scales: a copy of one block's row is the same K and V
    spec = KVCacheSpec(2, 3, 16, 32, torch.float32, "int8")
    cache = spec.allocate(4, torch.device("cpu"))
    assert cache.dtype == torch.uint8 and cache.shape == (4, 2, spec.head_bytes)
    layers = spec.layers(cache)
    k, v = torch.randn(16, 2, 32), torch.randn(16, 2, 32)
    for layer in layers:                                                  # block 1, every layer
        write_kv(layer.k, layer.v, k, v, torch.arange(16) + 16, layer.k_scale, layer.v_scale)
    cache[3] = cache[1]
    for layer in layers:
        for codes, scale, x in ((layer.k, layer.k_scale, k), (layer.v, layer.v_scale, v)):
            assert torch.equal(codes[3], codes[1]) and torch.equal(scale[3], scale[1])
            assert (dequantize_kv(codes[3], scale[3], torch.float32) - x).abs().max() <= x.abs().max() / 254 + 1e-6
    assert not cache[[0, 2]].any(), "only the blocks written and copied changed"


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantize_kv_keeps_each_rows_error_within_its_formats_step(kv_cache_dtype):
    x = torch.randn(64, 4, 128) * torch.logspace(-3, 2, 64).view(64, 1, 1)       # rows of very different sizes
    x[5, 2] = 0                                                                    # a zero row: scale 1, codes 0
    codes, scale = quantize_kv(x, kv_cache_dtype)
    assert codes.dtype == {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    assert scale.shape == (64, 4) and scale[5, 2] == 1 and not codes[5, 2].float().any()
    err = (dequantize_kv(codes, scale, torch.float32) - x).abs()
    amax = x.abs().amax(-1, keepdim=True)
    # int8: half a step of max|x|/127; fp8 e4m3: 3 mantissa bits, half an ulp is 1/16 of the value (and the
    # smallest normal's step for values near zero)
    bound = amax / 254 if kv_cache_dtype == "int8" else x.abs() / 16 + amax / 448 * 2.0 ** -9
    assert (err <= bound * (1 + 1e-5) + 1e-12).all()


def test_the_fused_cpu_writer_stores_the_bytes_the_torch_writer_does():
    """The CPU forward rotates and stores int8 K/V in one C++ op; its bytes equal quantize_kv's."""
    if not cpu_attention.available():
        pytest.skip("no C++ compiler: the CPU forward uses the torch writer only")
    spec = KVCacheSpec(3, 2, 16, 64, torch.float32, "int8")
    caches = [spec.allocate(6, torch.device("cpu")) for _ in range(2)]
    heads, kv_heads, d, t = 9, 3, 64, 37
    qkv = torch.randn(t, (heads + 2 * kv_heads) * d)
    slots = torch.randperm(6 * 16)[:t]
    fused = spec.layers(caches[0])[1]
    cpu_attention.rope_write_kv(qkv.clone(), torch.ones(t, d // 2), torch.zeros(t, d // 2), fused.k, fused.v,
                                slots, heads, kv_heads, fused.k_scale, fused.v_scale)
    ref = spec.layers(caches[1])[1]
    k, v = qkv[:, heads * d:(heads + kv_heads) * d], qkv[:, (heads + kv_heads) * d:]
    write_kv(ref.k, ref.v, k.reshape(t, kv_heads, d), v.reshape(t, kv_heads, d), slots, ref.k_scale, ref.v_scale)
    assert torch.equal(caches[0], caches[1]) and caches[0].any()


# -- attention reads it ------------------------------------------------------------------------------
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("reader", ["cpu-kernel", "torch"])
def test_attention_over_a_quantized_cache_equals_attention_over_its_values(kv_cache_dtype, reader):
    """Decodes, a verify step, a fresh prefill and chunks on a cached prefix, one batch: each reader of the
    quantized cache gives what fp32 attention gives over the values the codes and scales stand for."""
    if reader == "cpu-kernel" and not cpu_attention.available():
        pytest.skip("no C++ compiler")
    seqs = [(37, 1), (70, 1), (9, 9), (40, 24), (53, 5)]
    q, kv, md = random_batch(seqs, 9, 3, 64, 16)
    spec, cache, values = quantized_cache(kv, kv_cache_dtype)
    scale = 64 ** -0.5
    for layer in (0, 1):
        ref = paged_attention_torch(q, *layer_views(values, layer), md, scale)
        k, v, ks, vs = spec.layers(cache)[layer]
        if reader == "torch":
            out = paged_attention_torch(q, k, v, md, scale, k_scale=ks, v_scale=vs)
        else:
            out = cpu_attention.paged_attention_varlen(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc,
                                                       scale, ks, vs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        # and the quantization is visible: the raw fp32 cache gives something else
        assert (paged_attention_torch(q, *layer_views(kv, layer), md, scale) - out).abs().max() > 1e-4


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_the_cpu_kernel_reads_every_code_as_its_value(kv_cache_dtype):
    """Every int8 code, and every fp8 e4m3 code but NaN (subnormals included), read through the kernel: a
    one-token context's attention output is its V row, times its scale."""
    if not cpu_attention.available():
        pytest.skip("no C++ compiler")
    dtype = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    if kv_cache_dtype == "fp8":
        codes = torch.cat([codes[(codes & 0x7F) != 0x7F], torch.zeros(2, dtype=torch.uint8)])    # 254 + 2 zeros
    spec = KVCacheSpec(1, 1, 16, 64, torch.float32, kv_cache_dtype)
    cache = spec.allocate(4, torch.device("cpu"))
    k, v, ks, vs = spec.layers(cache)[0]
    v[:, 0, 0].view(torch.uint8).copy_(codes.view(4, 64))           # sequence b's one token is block b's slot 0
    vs[:, 0, 0] = torch.tensor([1.0, 0.5, 3.0, 2.0 ** -20])
    ks[:, 0, 0] = 1.0
    ones = torch.ones(4, dtype=torch.int32)
    out = cpu_attention.paged_attention_varlen(torch.randn(4, 1, 64), k, v, torch.arange(4, dtype=torch.int32)[:, None],
                                               ones, torch.arange(5, dtype=torch.int32), 0.125, ks, vs)
    want = codes.view(4, 64).view(dtype).float() * vs[:, 0, 0, None]
    assert torch.equal(out[:, 0], want)


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of auto, int8, fp8, got 'int4'"):
        LLM(None, kv_cache_dtype="int4", num_kv_blocks=8)


# -- SmolLM2 with a quantized cache --------------------------------------------------------------------
KV = dict(kv_cache_memory=64 << 20, max_model_len=1024)


@pytest.fixture(scope="module")
def smol_kv(smol_path):
    """SmolLM2 (its fp32 dequantization, so the cache is the only difference) with each cache format."""
    return {kv: LLM(smol_path, quantization="none", kv_cache_dtype=kv, **KV) for kv in ("auto", "int8", "fp8")}


def _perplexity(lp: torch.Tensor, ids: list[int], start: int) -> float:
    return math.exp(-lp[torch.arange(start, len(ids) - 1), torch.tensor(ids[start + 1:])].mean().item())


# measured (docs/benchmarks.md): on the second half of 800 tokens, which reads the first half from the cache,
# perplexity 17.93 with fp32 KV, 17.91 int8, 18.59 fp8; top-1 agreement 0.974 / 0.943; mean KL 0.003 / 0.023
BOUNDS = {"int8": dict(ppl=1.01, agree=0.95, kl=0.01, gap=0.3), "fp8": dict(ppl=1.06, agree=0.9, kl=0.05, gap=0.6)}


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_smollm2_with_a_quantized_cache_stays_close_to_fp32_kv(smol_kv, kv_cache_dtype):
    ref_llm, llm = smol_kv["auto"], smol_kv[kv_cache_dtype]
    assert llm.engine.pool.num_blocks >= 3.7 * ref_llm.engine.pool.num_blocks, "the same memory holds 3.75x the tokens"
    assert llm.engine.compat_key() != ref_llm.engine.compat_key(), "hand-offs between the two formats are refused"
    ids = ref_llm.engine.tokenize(TEXT)[:800]
    half = len(ids) // 2                          # teacher forcing: the second half reads the first from the cache
    ref, lp = engine_logprobs(ref_llm, [ids])[0][half:], engine_logprobs(llm, [ids])[0][half:]
    bound = BOUNDS[kv_cache_dtype]
    assert _perplexity(lp, ids[half:], 0) < bound["ppl"] * _perplexity(ref, ids[half:], 0)
    assert (lp.argmax(-1) == ref.argmax(-1)).float().mean() > bound["agree"]
    assert (ref.exp() * (ref - lp)).sum(-1).mean() < bound["kl"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K)
    prompts = ["The capital of France is", "def fibonacci(n):", "List three colors:", "Once upon a time,"]
    for ours, want in zip(llm.generate(prompts, params), ref_llm.generate(prompts, params)):
        check_greedy_close(baton_greedy(ours), baton_greedy(want), max_gap=bound["gap"])


@pytest.mark.slow
def test_the_default_model_with_an_int8_cache_equals_itself_batched_alone_or_from_the_prefix_cache():
    """The default model runs its packed weights and sends every attention call through the C++ kernel, which
    reads the cache (engine/attention.py, one_kernel): a request's K/V bytes and its tokens do not depend on what
    else is in the batch or on whether its prompt came from the prefix cache."""
    llm = LLM(None, kv_cache_dtype="int8", **KV)                       # the GGUF, packed
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["Relay teams practise the hand-off more than the running: the baton must pass inside a twenty-metre "
               "zone, at full speed, without either runner looking back. Write a haiku about it.",
               "What is 17 times 23?", "Name a prime number above 100."]
    batched = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.pool.reset_prefix_cache()
    alone = [llm.generate([p], params)[0] for p in prompts]
    assert [o.token_ids for o in alone] == batched
    cached = llm.generate(prompts[:1], params)[0]
    assert cached.metrics.num_cached_tokens > 0 and cached.token_ids == batched[0]


def test_an_int8_prefix_restored_from_the_host_tier_gives_the_tokens_of_a_device_hit(smol_path):
    """The host tier moves a block's bytes, scales included: a prefix copied back from host memory reads as it
    did on the device."""
    spec = KVCacheSpec(**SMOL, kv_cache_dtype="int8")
    llm = LLM(smol_path, num_kv_blocks=24, max_model_len=256, kv_cache_dtype="int8",
              kv_offloading_size=64 * spec.block_bytes / 2**30)
    pool, greedy = llm.engine.pool, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert pool.host_blocks == 64
    prompt = torch.randint(100, 40000, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([prompt], greedy)
    device_hit = llm.generate([prompt], greedy)[0]
    assert device_hit.metrics.num_cached_tokens == 96
    fillers = [torch.randint(100, 40000, (100,), generator=torch.Generator().manual_seed(10 + k)).tolist()
               for k in range(4)]
    llm.generate(fillers, greedy)
    hashes = block_hashes(prompt[:96], 16, llm.engine.model_key)
    assert [tier for tier, _ in pool.find(hashes, prompt)] == [HOST] * 6
    host_hit = llm.generate([prompt], greedy)[0]
    assert host_hit.metrics.num_cached_tokens == 96 and llm.engine.stats()["kv_onloaded_blocks"] == 6
    assert host_hit.token_ids == device_hit.token_ids
    assert [tier for tier, _ in pool.find(hashes, prompt)] == [DEVICE] * 6
    assert pool.num_free_blocks == pool.num_blocks, "no KV block leaked"
