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

A quantized cache (`kv_cache_dtype` "int8" or "fp8", see KVCacheSpec) keeps one byte per value and an fp32
scale per (token, head, layer, K/V). The scales live inside the head's span of the block, after its values:

    kv_cache[num_blocks, num_kv_heads, span] (bytes): values [num_layers, 2, block_size, head_dim],
                                                      then scales [num_layers, 2, block_size] (fp32, padded)

so everything that moves blocks or runs of heads as bytes (the transports, the host tier, cross-TP pulls)
moves a block's scales with it, unchanged.

A latent cache (`kv_parts` 1: multi-head latent attention, DeepSeek's MLA) keeps one vector per token, head and layer
where others keep two: the key, whose leading dims are also the value (the compressed KV, then the rotated key
part). Its shape has 1 where the others have 2; both views of a layer are the same tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import NamedTuple

import torch

from engine.errors import ConfigError

# Part of every hand-off's compatibility hash: bump it when the bytes of a block change meaning.
# 1: [blocks, layers, 2, block_size, heads, head_dim]; 2: heads outer (above).
KV_LAYOUT_VERSION = 2

# kv_cache_dtype (vLLM's name): "auto" keeps the model's dtype; "int8" and "fp8" (e4m3) keep one byte per value
# with a per-token, per-head scale: the largest |x| of the token's head maps to the format's largest value.
KV_CACHE_DTYPES = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
KV_QMAX = {"int8": 127.0, "fp8": 448.0}


class LayerKV(NamedTuple):
    """One layer's cache as attention reads it: K and V views [num_blocks, block_size, kv_heads, head_dim] and, for
    a quantized cache, their scales [num_blocks, block_size, kv_heads] (fp32; None for kv_cache_dtype "auto")."""
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """One rank's cache geometry and format: what a block holds, how many bytes it takes, and the per-layer
    views attention reads (`layers`)."""
    num_kv_heads: int           # the rank's
    num_layers: int
    block_size: int
    head_dim: int
    dtype: torch.dtype          # the model's (the cache's when kv_cache_dtype is "auto")
    kv_cache_dtype: str = "auto"
    kv_parts: int = 2           # 2: a key and a value; 1: a latent cache (the value is the key's leading dims)

    def __post_init__(self) -> None:
        if self.kv_parts not in (1, 2):
            raise ConfigError(f"kv_parts must be 1 or 2, got {self.kv_parts}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"got {self.kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return KV_CACHE_DTYPES[self.kv_cache_dtype] or self.dtype

    @property
    def _values(self) -> int:
        """Values per head span: K and V (or the latent) of every layer of a block."""
        return self.num_layers * self.kv_parts * self.block_size * self.head_dim

    @property
    def _scale_bytes(self) -> int:
        """The scales' share of a head span, padded so a span stays whole rows of block_size x head_dim
        (engine/attention.py reads the cache in such rows)."""
        row = self.block_size * self.head_dim
        return -(-self.num_layers * self.kv_parts * self.block_size * 4 // row) * row

    @property
    def head_bytes(self) -> int:
        """Bytes of one head's span of a block (every layer's K and V, and their scales)."""
        if not self.quantized:
            return self._values * torch.finfo(self.dtype).bits // 8
        return self._values + self._scale_bytes

    @property
    def block_bytes(self) -> int:
        return self.num_kv_heads * self.head_bytes

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if not self.quantized:
            return kv_cache_shape(num_blocks, self.num_kv_heads, self.num_layers, self.block_size, self.head_dim,
                                  self.kv_parts)
        return (num_blocks, self.num_kv_heads, self.head_bytes)

    def allocate(self, num_blocks: int, device: torch.device, pin_memory: bool = False) -> torch.Tensor:
        """A zeroed cache of num_blocks blocks: the model's dtype in the layout above, or bytes (quantized)."""
        dtype = self.dtype if not self.quantized else torch.uint8
        if pin_memory:
            return torch.zeros(self.shape(num_blocks), dtype=dtype, pin_memory=True)
        return allocate_kv_cache(self.shape(num_blocks), dtype, device)

    def layers(self, kv_cache: torch.Tensor) -> list[LayerKV]:
        """Every layer's views of `kv_cache` (a tensor `allocate` made, or its leading blocks)."""
        if not self.quantized:
            return [LayerKV(*layer_views(kv_cache, layer)) for layer in range(self.num_layers)]
        nb, h, L, bs, d = kv_cache.shape[0], self.num_kv_heads, self.num_layers, self.block_size, self.head_dim
        p, v = self.kv_parts, self.kv_parts - 1          # v: the value's part (the key's own in a latent cache)
        values = kv_cache[:, :, :self._values].view(self.storage_dtype).view(nb, h, L, p, bs, d)
        scales = kv_cache[:, :, self._values:self._values + L * p * bs * 4].view(torch.float32).view(nb, h, L, p, bs)
        return [LayerKV(values[:, :, layer, 0].transpose(1, 2), values[:, :, layer, v].transpose(1, 2),
                        scales[:, :, layer, 0].transpose(1, 2), scales[:, :, layer, v].transpose(1, 2))
                for layer in range(L)]


def quantize_kv(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes in the cache's dtype, fp32 scales [...]): one scale per row, x ~ codes * scale."""
    qmax = KV_QMAX[kv_cache_dtype]
    x = x.float()
    scale = x.abs().amax(-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / scale.unsqueeze(-1)
    if kv_cache_dtype == "int8":
        return y.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(torch.float8_e4m3fn), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


def kv_cache_shape(num_blocks: int, num_kv_heads: int, num_layers: int, block_size: int,
                   head_dim: int, kv_parts: int = 2) -> tuple[int, ...]:
    """The shape of a cache of `num_blocks` blocks holding `num_kv_heads` heads (a rank's)."""
    return (num_blocks, num_kv_heads, num_layers, kv_parts, block_size, head_dim)


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
    (the attention contract of engine/attention.py); a latent cache's (one part) twice, the same view."""
    return kv_cache[:, :, layer, 0].transpose(1, 2), kv_cache[:, :, layer, kv_cache.shape[3] - 1].transpose(1, 2)


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
