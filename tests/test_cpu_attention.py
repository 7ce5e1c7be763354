"""The C++ CPU decode kernel equals the torch reference on the real strided cache layout."""
from __future__ import annotations

import pytest
import torch

from engine import cpu_attention
from engine.attention import AttentionMetadata, paged_attention_torch


def _batch(lens, heads, kv_heads, head_dim, block_size=16, num_blocks=128, layers=3, layer=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, generator=g)
    max_blocks = max(-(-n // block_size) for n in lens)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[:len(lens) * max_blocks].view(len(lens), max_blocks).int()
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    md = AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.int64), block_tables=tables,
                           seq_lens=torch.tensor(lens, dtype=torch.int32),
                           query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
                           max_query_len=1, max_seq_len=max(lens), seq_lens_list=list(lens),
                           query_lens_list=[1] * len(lens))
    return q, kv[:, layer, 0], kv[:, layer, 1], md


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_attention.available(), "the C++ kernel did not compile on this machine"


@pytest.mark.parametrize("lens,heads,kv_heads,head_dim", [
    ([1, 17, 300, 64], 9, 3, 64),       # SmolLM2's shape: GQA group of 3
    ([5, 33], 4, 4, 32),                # MHA
    ([250], 8, 1, 128),                 # MQA, one long sequence
])
def test_kernel_matches_reference(lens, heads, kv_heads, head_dim):
    q, k, v, md = _batch(lens, heads, kv_heads, head_dim)
    want = paged_attention_torch(q, k, v, md, head_dim ** -0.5)
    got = paged_attention_torch(q, k, v, md, head_dim ** -0.5, decode_kernel=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_kernel_in_a_mixed_batch_with_a_prefill_chunk():
    q, k, v, md = _batch([40, 70], 9, 3, 64)
    # make sequence 1 a 6-token chunk continuing a cached prefix: queries rows 1..6
    q = torch.cat([q[:1], torch.randn(6, 9, 64)])
    md.query_lens_list, md.max_query_len = [1, 6], 6
    md.query_start_loc = torch.tensor([0, 1, 7], dtype=torch.int32)
    want = paged_attention_torch(q, k, v, md, 0.125)
    got = paged_attention_torch(q, k, v, md, 0.125, decode_kernel=True)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
