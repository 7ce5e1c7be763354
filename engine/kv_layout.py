"""Which KV heads each tensor-parallel rank holds, the one rule the model, the cache and the transports share.

With tensor parallelism each rank computes its share of the attention heads and keeps the K/V of its
share of the KV heads, under the same block ids on every rank. When there are at least as many KV
heads as ranks they are split into contiguous runs, as evenly as they go (8 heads on TP 4: 2 each;
SmolLM2's 3 on TP 2: 1 and 2, so a model need not have a head count the TP size divides); when there
are fewer (GQA with 8 KV heads on TP 16, MQA) each is replicated on tp_size // num_kv_heads consecutive
ranks, so every rank holds exactly one (vLLM's rule). A rank's query heads are the ones its KV heads serve.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError


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
