"""TransferConfig: the cluster config's `transfer:` section (cluster.ClusterConfig composes it), read by the
replicas' KV links; and the rule a replica (and the planning simulator, plan/sim.py) decides a prefix pull by."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TransferConfig(BaseModel):
    """Moving KV blocks from a prefill replica to a decode replica (kvtransfer/)."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Literal["nixl", "ray"] = Field("nixl", description="nixl: one-sided READs over UCX; ray: the "
                                                                "object store, where NIXL cannot run")
    ttl_s: float = Field(30.0, gt=0, description="Seconds a prefill replica keeps blocks no decode replica "
                                                 "pulled pinned")
    prefix_pull: bool = Field(True, description="A replica that prefills a prompt whose leading blocks another "
                                                "prefill replica caches pulls them instead of computing them, when "
                                                "the pull is estimated faster (prefix_pull_gbps against the "
                                                "replica's measured prefill rate)")
    prefix_pull_min_blocks: int = Field(4, ge=1, description="Fewest blocks a prefix pull must bring beyond what "
                                                             "the replica caches itself")
    prefix_pull_gbps: float = Field(1.0, gt=0, description="GB/s a prefix pull is assumed to reach until this "
                                                          "replica has measured its own pulls")
    ucx_tls: str | None = Field(None, min_length=1, description="UCX_TLS for the pools' NIXL agents, e.g. "
                                                                "'shm,tcp' or 'rc,cuda_copy,cuda_ipc' (default: "
                                                                "kvtransfer's choice); ignored with backend ray")


PREFIX_PULL_OVERHEAD_S = 0.01   # a prefix pull's fixed cost (the export call, the pull's set-up): 5-15 ms here
PREFIX_EXPORT_TIMEOUT_S = 2.0   # the least a replica waits for another's prefix export before computing the prefix


def prefix_export_timeout_s(blocks: int, block_size: int, computed_tokens: int, busy_seconds: float) -> float:
    """How long a replica waits for another's answer to a prefix export before computing the prefix itself: as
    long as computing those `blocks` would take at its engine's measured rate (tokens per busy second), at least
    PREFIX_EXPORT_TIMEOUT_S. The source answers between two of its steps, so the wait is what is left of its
    step in progress, and on a slow device one long prefill outlasts a fixed 2 s. A replica that gave up then
    computed the prefix, its own exports waited behind that step in turn, and the replicas asking it gave up
    too: under power-of-two routing on two CPU cores, TTFT p50 went from under 1 s to 10-30 s in some runs
    (docs/benchmarks.md). Waiting at most the compute time bounds the loss to twice it when the source is late."""
    if busy_seconds < 1.0 or computed_tokens <= 0:
        return PREFIX_EXPORT_TIMEOUT_S
    return max(PREFIX_EXPORT_TIMEOUT_S, blocks * block_size * busy_seconds / computed_tokens)


def prefix_pull_pays(blocks: int, block_bytes: int, block_size: int, pulled: tuple[float, float] | list,
                     default_gbps: float, computed_tokens: int, busy_seconds: float) -> bool:
    """Whether pulling `blocks` cached blocks beats computing their tokens: PREFIX_PULL_OVERHEAD_S plus their
    bytes at the bandwidth this replica's pulls reached (`pulled`: bytes, seconds; default_gbps before any)
    against their tokens at the rate its engine computes (tokens per busy second; before a second of it is
    measured, pull: a cached block is never slower to move than to compute on any engine measured here)."""
    nbytes, seconds = pulled
    bandwidth = nbytes / seconds if seconds > 0 else default_gbps * 1e9
    if busy_seconds < 1.0:
        return True
    pull_s = PREFIX_PULL_OVERHEAD_S + blocks * block_bytes / bandwidth
    return pull_s < blocks * block_size / (computed_tokens / busy_seconds)
