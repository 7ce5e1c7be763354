"""The KV cache layout: which heads a TP rank holds, heads-outer blocks, and the attention code's reads and writes of it."""
from __future__ import annotations

import pytest
import torch

from engine.attention import _gather, write_kv
from engine.errors import ConfigError
from engine.kv_layout import KVHeadLayout, head_bytes, kv_cache_shape, layer_views

BLOCKS, HEADS, LAYERS, BS, D = 6, 3, 4, 8, 16


def _cache() -> torch.Tensor:
    return torch.randn(kv_cache_shape(BLOCKS, HEADS, LAYERS, BS, D), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("heads,tp,want", [
    (3, 2, [[0], [1, 2]]),              # SmolLM2 on TP 2: uneven split
    (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (2, 4, [[0], [0], [1], [1]]),       # fewer heads than ranks: each on 2 ranks
    (3, 1, [[0, 1, 2]]),
])
def test_heads_of_each_rank(heads, tp, want):
    layout = KVHeadLayout(heads, tp)
    assert [list(layout.heads_of(r)) for r in range(tp)] == want
    assert layout.replicas == max(tp // heads, 1)
    assert all(r in layout.ranks_holding(h) for r in range(tp) for h in layout.heads_of(r))


def test_uneven_replication_is_refused():
    with pytest.raises(ConfigError):
        KVHeadLayout(3, 4)


def test_a_block_a_head_and_a_run_of_heads_are_contiguous_spans():
    kv = _cache()
    assert kv.shape == (BLOCKS, HEADS, LAYERS, 2, BS, D)
    assert head_bytes(kv) == LAYERS * 2 * BS * D * 4
    assert kv[2].is_contiguous() and kv[2, 1:3].is_contiguous()      # one descriptor per run
    assert kv.stride(0) * kv.element_size() == HEADS * head_bytes(kv)


def test_layer_views_address_the_cache():
    kv = _cache()
    k, v = layer_views(kv, 2)
    assert k.shape == v.shape == (BLOCKS, BS, HEADS, D)
    assert torch.equal(k[4, 5, 1], kv[4, 1, 2, 0, 5]) and torch.equal(v[0, 7, 2], kv[0, 2, 2, 1, 7])


def test_write_kv_stores_each_token_at_its_slot_and_nowhere_else():
    kv = _cache()
    before = kv.clone()
    k_cache, v_cache = layer_views(kv, 1)
    slots = torch.tensor([3 * BS + 2, 0, 5 * BS + 7, 3 * BS + 3])
    k, v = torch.randn(4, HEADS, D), torch.randn(4, HEADS, D)
    write_kv(k_cache, v_cache, k, v, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(kv[s // BS, :, 1, 0, s % BS], k[i]) and torch.equal(kv[s // BS, :, 1, 1, s % BS], v[i])
        before[s // BS, :, 1, :, s % BS] = kv[s // BS, :, 1, :, s % BS]
    assert torch.equal(kv, before)


def test_gather_reads_each_sequences_tokens_heads_first():
    kv = _cache()
    k_cache, _ = layer_views(kv, 3)
    tables = torch.tensor([[4, 1, 0], [2, 5, 3]], dtype=torch.int32)
    got = _gather(k_cache, tables, 2 * BS + 3)                          # [seqs, heads, tokens, D]
    want = torch.stack([torch.cat([k_cache[b] for b in row.tolist()])[:2 * BS + 3] for row in tables])
    assert torch.equal(got, want.transpose(1, 2))
