"""TransferConfig: the cluster config's `transfer:` section (cluster.ClusterConfig composes it), read by the
replicas' KV links."""
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
