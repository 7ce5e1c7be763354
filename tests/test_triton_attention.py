"""The Triton paged-attention kernel matches the torch reference (run in the Triton interpreter)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU interpreter

import pytest
import torch

from check.attention import quantized_cache, random_batch
from engine.attention import paged_attention_torch
from engine.kv_layout import layer_views
from engine.triton_attention import triton_paged_attention

pytestmark = pytest.mark.triton


def _check(q, kv, md, layer=0, num_splits=None):
    k_cache, v_cache = layer_views(kv, layer)                # strided views, as in the engine
    assert not k_cache.is_contiguous()
    scale = q.shape[-1] ** -0.5
    out = triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.query_start_loc, md.max_query_len, scale, num_splits=num_splits)
    ref = paged_attention_torch(q, k_cache, v_cache, md, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    return out


# decode on 37 tokens, fresh 9-token prefill, 5-token chunk on a 20-token cached prefix,
# 3-token chunk on 50 cached tokens (context spans 4 blocks of 16).
MIXED = [(37, 1), (9, 9), (25, 5), (53, 3)]


@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,block_size,seqs",
    [
        pytest.param(4, 2, 32, 16, MIXED, id="gqa-d32"),
        pytest.param(2, 2, 64, 16, MIXED, id="mha-d64"),
        # non power-of-two group (3 -> padded to 4) and head_dim (24 -> 32), pages of 8;
        # 40- and 12-token queries need several query tiles of 16 tokens.
        pytest.param(3, 1, 24, 8, [(40, 40), (33, 1), (30, 12)], id="group3-d24-bs8"),
        pytest.param(4, 2, 32, 16, [(37, 1), (5, 1), (64, 1)], id="decode-only"),
    ],
)
def test_matches_reference(num_heads, num_kv_heads, head_dim, block_size, seqs):
    q, kv, md = random_batch(seqs, num_heads, num_kv_heads, head_dim, block_size)
    _check(q, kv, md)


def test_layer1_strided_cache_and_q():
    """Layer 1 of the shared KV tensor and q sliced out of a packed qkv: all strides honored."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    q, kv, md = random_batch(MIXED, num_heads, num_kv_heads, head_dim, 16, seed=1)
    qkv = torch.randn(q.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    qkv[:, :num_heads] = q
    q_view = qkv[:, :num_heads]
    assert not q_view.is_contiguous()
    out1 = _check(q_view, kv, md, layer=1)
    # Layer 0 holds different values, so reading the wrong layer could not pass above.
    ref0 = paged_attention_torch(q, *layer_views(kv, 0), md, head_dim ** -0.5)
    assert not torch.allclose(out1, ref0, atol=1e-2)


@pytest.mark.parametrize("num_splits", [2, 8])
@pytest.mark.parametrize("seqs", [pytest.param([(37, 1), (5, 1), (64, 1)], id="decode"),
                                  pytest.param([(40, 5), (3, 1), (21, 5)], id="verify"),
                                  pytest.param(MIXED, id="mixed")])
def test_split_kv_matches_the_reference(seqs, num_splits):
    """Flash-decoding's split of the keys (a GPU picks it for decode and verify batches with few programs;
    forced here): each slice's partial, then the combine, give the unsplit result, also where a slice holds
    no key of a short sequence (8 slices of a 5-token context)."""
    q, kv, md = random_batch(seqs, 4, 2, 32, 16, seed=3)
    _check(q, kv, md, num_splits=num_splits)


def test_split_count_follows_the_programs_and_the_query_width(monkeypatch):
    import engine.triton_attention as ta
    assert ta.num_kv_splits(8, 1, torch.device("cpu")) == 1               # the CPU interpreter: no split
    monkeypatch.setitem(ta._SMS, 0, 132)                                   # an H100's or H200's SMs
    num_kv_splits = ta.num_kv_splits
    cuda = torch.device("cuda", 0)
    assert num_kv_splits(8, 1, cuda) == 16                                 # batch 1, 8 KV heads: 128 programs
    assert num_kv_splits(64 * 8, 1, cuda) == 1                             # batch 64: 512 programs already
    assert num_kv_splits(32 * 8, 5, cuda) == 2                             # a verify step of 32 sequences
    assert num_kv_splits(8, 512, cuda) == 1                                # a prefill: never split


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("seqs,num_splits", [(MIXED, None), ([(37, 1), (5, 1), (64, 1)], 4)], ids=["mixed", "split"])
def test_a_quantized_cache_matches_the_reference_over_the_values_it_stands_for(kv_cache_dtype, seqs, num_splits):
    """int8 / fp8 codes with a scale per token and head (engine/kv_layout.py), read by the kernel in its loop."""
    q, kv, md = random_batch(seqs, 4, 2, 32, 16, seed=2)
    spec, cache, values = quantized_cache(kv, kv_cache_dtype)
    k, v, k_scale, v_scale = spec.layers(cache)[1]
    scale = 32 ** -0.5
    out = triton_paged_attention(q, k, v, md.block_tables, md.seq_lens, md.query_start_loc, md.max_query_len,
                                 scale, num_splits=num_splits, k_scale=k_scale, v_scale=v_scale)
    ref = paged_attention_torch(q, *layer_views(values, 1), md, scale)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("window,softcap", [(12, 0.0), (0, 4.0), (12, 4.0)])
def test_sliding_window_and_softcap(window, softcap, num_splits):
    """Gemma 2's layers (a sliding window, a score softcap) against the torch reference (itself checked token by
    token in tests/test_cpu_attention.py): decodes past the window, a chunk whose query tile starts past it (whole
    key tiles skipped), a fresh prompt longer than it; split over the keys too."""
    q, kv, md = random_batch([(37, 1), (70, 20), (40, 40), (9, 1)], 4, 2, 32, 16, seed=5)
    q = q * 3                                                          # scores large enough for the cap to bite
    k_cache, v_cache = layer_views(kv, 1)
    out = triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.max_query_len, 0.2, num_splits=num_splits, window=window, softcap=softcap)
    ref = paged_attention_torch(q, k_cache, v_cache, md, 0.2, window=window, softcap=softcap)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, paged_attention_torch(q, k_cache, v_cache, md, 0.2), atol=1e-3)


@pytest.mark.parametrize("num_splits", [None, 4])
def test_attention_chunks(num_splits):
    """Llama 4's chunked layers (chunks of 16) against the torch reference: decodes mid-chunk, a prompt chunk whose
    query tile starts chunks past the first key (whole key tiles skipped), a fresh prompt over several chunks; split
    over the keys too."""
    q, kv, md = random_batch([(37, 1), (70, 20), (40, 40), (9, 1)], 4, 2, 32, 16, seed=5)
    k_cache, v_cache = layer_views(kv, 1)
    out = triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.max_query_len, 0.2, num_splits=num_splits, chunk=16)
    ref = paged_attention_torch(q, k_cache, v_cache, md, 0.2, chunk=16)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, paged_attention_torch(q, k_cache, v_cache, md, 0.2), atol=1e-3)


@pytest.mark.parametrize("window, num_splits", [(0, None), (12, 4)])
def test_attention_sinks(window, num_splits):
    """gpt-oss's sinks (a logit per query head, with no value) against the torch reference (checked token by token in
    tests/test_cpu_attention.py), its sliding window too, split over the keys too (the sink joins the combine)."""
    q, kv, md = random_batch([(37, 1), (70, 20), (40, 40), (9, 1)], 4, 2, 32, 16, seed=6)
    sinks = torch.tensor([1.5, -2.0, 3.0, 0.0])
    k_cache, v_cache = layer_views(kv, 1)
    out = triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                 md.max_query_len, 0.2, num_splits=num_splits, window=window, sinks=sinks)
    ref = paged_attention_torch(q, k_cache, v_cache, md, 0.2, window=window, sinks=sinks)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(ref, paged_attention_torch(q, k_cache, v_cache, md, 0.2, window=window), atol=1e-3)
