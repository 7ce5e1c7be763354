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
    ucx_tls: str | None = Field(None, min_length=1, description="UCX_TLS for the pools' NIXL agents, e.g. "
                                                                "'shm,tcp' or 'rc,cuda_copy,cuda_ipc' (default: "
                                                                "kvtransfer's choice); ignored with backend ray")
