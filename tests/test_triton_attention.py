"""The Triton paged-attention kernel matches the torch reference (run in the Triton interpreter)."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported: CPU interpreter

import pytest
import torch

from engine.attention import AttentionMetadata, paged_attention_torch
from engine.triton_attention import triton_paged_attention

pytestmark = pytest.mark.triton

NUM_LAYERS = 2


def _batch(seqs, num_heads, num_kv_heads, head_dim, block_size, seed=0, spare_blocks=3):
    """Random mixed batch. seqs: (context_len, query_len) per sequence, query = last tokens.

    Returns q, the full KV tensor [blocks, layers, 2, block_size, kv_heads, D] and the metadata;
    blocks are handed out in shuffled order so logical and physical order differ.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq) + 1                # a padding column, like a real table
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[used:used + nb].int()
        used += nb

    query_lens = [n for _, n in seqs]
    seq_lens = [ctx for ctx, _ in seqs]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (ctx, n) in enumerate(seqs):
        for pos in range(ctx - n, ctx):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)

    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    kv = torch.randn(num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g)
    return q, kv, md


def _check(q, kv, md, layer=0):
    k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]      # strided views, as in the engine
    assert not k_cache.is_contiguous()
    scale = q.shape[-1] ** -0.5
    out = triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens,
                                 md.query_start_loc, md.max_query_len, scale)
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
    q, kv, md = _batch(seqs, num_heads, num_kv_heads, head_dim, block_size)
    _check(q, kv, md)


def test_layer1_strided_cache_and_q():
    """Layer 1 of the shared KV tensor and q sliced out of a packed qkv: all strides honored."""
    num_heads, num_kv_heads, head_dim = 4, 2, 32
    q, kv, md = _batch(MIXED, num_heads, num_kv_heads, head_dim, 16, seed=1)
    qkv = torch.randn(q.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    qkv[:, :num_heads] = q
    q_view = qkv[:, :num_heads]
    assert not q_view.is_contiguous()
    out1 = _check(q_view, kv, md, layer=1)
    # Layer 0 holds different values, so reading the wrong layer could not pass above.
    ref0 = paged_attention_torch(q, kv[:, 0, 0], kv[:, 0, 1], md, head_dim ** -0.5)
    assert not torch.allclose(out1, ref0, atol=1e-2)
