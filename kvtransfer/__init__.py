"""Baton's KV hand-off: moving a prompt's KV blocks from a prefill engine's cache to a decode engine's.

`make_transport(kv_cache, name_prefix, compat_key, kind="nixl" | "ray", peer_metadata=...)` builds one
transport per engine; NIXL (one-sided READs over UCX) is the default, the Ray object store the fallback.
A producer's export gives a `KVHandoff`, all a consumer needs to pull; nothing outside this package knows
which transport runs. See kvtransfer/transport.py for the flow; `KVLink` (engine_link.py) ties a
transport to an LLMEngine. Across TP sizes each rank has its own transport (`layout`, `rank` options;
kvtransfer/transport.py says how), a TP engine's workers hold `RankPulls` (kvtransfer/rank_pulls.py), and
its KVLink drives them from rank 0 (`TPRanks`, engine_link.py).
"""
from __future__ import annotations

from typing import Callable

import torch

from kvtransfer.errors import KVCompatibilityError, KVHandleError, KVTransferError
from kvtransfer.handle import KVHandle, compat_hash
from kvtransfer.handoff import KVHandoff
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.ray_transport import RayTransport
from kvtransfer.transport import KVTransport, Pull

TRANSPORTS = {"nixl": NixlTransport, "ray": RayTransport}


def make_transport(kv_cache: torch.Tensor, name_prefix: str, compat_key: str, kind: str = "nixl",
                   peer_metadata: Callable[[str], bytes] | None = None, **options) -> KVTransport:
    """The transport `kind` (cluster config) for one engine's cache. `peer_metadata(agent)` returns a
    producer's metadata() bytes by its agent name; a transport asks it once per producer it meets."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {kind!r}; choose one of {sorted(TRANSPORTS)}")
    return TRANSPORTS[kind](kv_cache, name_prefix, compat_key, peer_metadata=peer_metadata, **options)


from kvtransfer.engine_link import KVLink  # noqa: E402  (needs make_transport)
from kvtransfer.rank_pulls import RankPulls  # noqa: E402

__all__ = ["KVHandle", "KVHandoff", "KVLink", "RankPulls", "KVTransport", "NixlTransport", "RayTransport", "Pull", "make_transport", "compat_hash",
           "KVTransferError", "KVCompatibilityError", "KVHandleError", "TRANSPORTS"]
