"""The KV cache's layout: which KV heads each tensor-parallel rank holds and how its cache tensor is laid out.

The one rule the model, the attention code, the cache and the transports share.

With tensor parallelism each rank computes its share of the attention heads and keeps the K/V of its
share of the KV heads, under the same block ids on every rank. When there are at least as many KV
heads as ranks they are split into contiguous runs, as evenly as they go (8 heads on TP 4: 2 each;
SmolLM2's 3 on TP 2: 1 and 2, so a model need not have a head count the TP size divides); when there
are fewer (GQA with 8 KV heads on TP 16, MQA) each is replicated on tp_size // num_kv_heads consecutive
ranks, so every rank holds exactly one (vLLM's rule). A rank's query heads are the ones its KV heads serve.

A rank's cache is one tensor, heads outermost inside a block:

    kv_cache[num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim]   (num_kv_heads: the rank's)

A whole block is one contiguous span (a same-layout pull is one descriptor per block), and so is one
head's K and V for every layer of a block, and a run of heads: a pull across TP sizes moves each
(block, source rank) run of heads as one span instead of one per (block, layer, K/V, token).
Attention reads layer l through the strided views of `layer_views`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError

# Part of every hand-off's compatibility hash: bump it when the bytes of a block change meaning.
# 1: [blocks, layers, 2, block_size, heads, head_dim]; 2: heads outer (above).
KV_LAYOUT_VERSION = 2


def kv_cache_shape(num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int,
                   head_dim: int) -> tuple[int, ...]:
    """The shape of a cache of `num_blocks` blocks holding `num_kv_heads` heads (a rank's)."""
    return (num_blocks, num_kv_heads, num_layers, 2, block_size, head_dim)


def allocate_kv_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache. On CPU it asks for transparent huge pages: a decode step reads every head's
    span of every block cold, and with 4 KiB pages each span costs a page walk of its own
    (SmolLM2 batch 32, one layer, cold: 2.3 ms with 4 KiB pages, 1.7-2.0 ms with huge pages)."""
    kv = torch.empty(shape, dtype=dtype, device=device)
    if kv.device.type == "cpu":
        _advise_huge_pages(kv)
    return kv.zero_()


def _advise_huge_pages(t: torch.Tensor) -> None:
    """madvise(MADV_HUGEPAGE) on the 2 MiB-aligned inside of t's memory, before anything touches it;
    a no-op where the kernel or libc says no."""
    import ctypes
    huge, start = 2 << 20, t.data_ptr()
    first, end = -(-start // huge) * huge, start + t.numel() * t.element_size()
    if end - first >= huge:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t((end - first) // huge * huge), 14)  # MADV_HUGEPAGE
        except (OSError, AttributeError):
            pass


def layer_views(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer`'s K and V, each a strided view [num_blocks, block_size, kv_heads, head_dim]
    (the attention contract of engine/attention.py)."""
    return kv_cache[:, :, layer, 0].transpose(1, 2), kv_cache[:, :, layer, 1].transpose(1, 2)


def head_bytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one head's K and V for every layer of a block: the unit a cross-TP pull moves."""
    return kv_cache.stride(1) * kv_cache.element_size()


@dataclass(frozen=True, slots=True)
class KVHeadLayout:
    num_kv_heads: int           # the model's
    tp_size: int = 1

    def __post_init__(self) -> None:
        n, tp = self.num_kv_heads, self.tp_size
        if tp < 1 or n < 1:
            raise ConfigError(f"tensor_parallel_size and KV heads must be >= 1, got {tp} and {n}")
        if n < tp and tp % n:
            raise ConfigError(f"{n} KV heads cannot be replicated evenly over tensor_parallel_size {tp}: "
                              f"with fewer KV heads than ranks, the heads must divide the ranks")

    @property
    def replicas(self) -> int:
        """How many ranks hold each KV head (1 unless heads are fewer than ranks)."""
        return max(self.tp_size // self.num_kv_heads, 1)

    def heads_of(self, rank: int) -> range:
        """The model's KV heads that `rank` holds, in the order its cache keeps them."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is outside tensor_parallel_size {self.tp_size}")
        n, tp = self.num_kv_heads, self.tp_size
        first = rank * n // tp
        return range(first, first + 1) if n < tp else range(first, (rank + 1) * n // tp)

    def ranks_holding(self, head: int) -> list[int]:
        return [r for r in range(self.tp_size) if head in self.heads_of(r)]
