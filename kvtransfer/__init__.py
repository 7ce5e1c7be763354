"""Baton's KV hand-off: moving a prompt's KV blocks from a prefill engine's cache to a decode engine's.

`make_transport(kv_cache, name_prefix, compat_key, kind="nixl" | "ray")` builds one transport per
engine; NIXL (one-sided READs over UCX) is the default, the Ray object store the fallback. See
kvtransfer/transport.py for the flow; `KVLink` (engine_link.py) ties a transport to an LLMEngine.
"""
from __future__ import annotations

from typing import Callable

import torch

from kvtransfer.errors import KVCompatibilityError, KVHandleError, KVTransferError
from kvtransfer.handle import KVHandle, compat_hash
from kvtransfer.nixl_transport import NixlTransport
from kvtransfer.ray_transport import RayTransport
from kvtransfer.transport import KVTransport, Pull

TRANSPORTS = {"nixl": NixlTransport, "ray": RayTransport}


def make_transport(kv_cache: torch.Tensor, name_prefix: str, compat_key: str, kind: str = "nixl",
                   source: Callable | None = None, **options) -> KVTransport:
    """The transport `kind` (cluster config) for one engine's cache. `source` reaches a producer by agent name:
    NIXL: source(agent) -> its metadata() bytes; Ray: source(agent, request_id, block_ids) ->
    its read_blocks(...) result (an ObjectRef or the array)."""
    if kind not in TRANSPORTS:
        raise ValueError(f"unknown KV transport {kind!r}; choose one of {sorted(TRANSPORTS)}")
    if kind == "nixl":
        return NixlTransport(kv_cache, name_prefix, compat_key, metadata_source=source, **options)
    return RayTransport(kv_cache, name_prefix, compat_key, block_source=source, **options)


from kvtransfer.engine_link import KVLink  # noqa: E402  (needs make_transport)

__all__ = ["KVHandle", "KVLink", "KVTransport", "NixlTransport", "RayTransport", "Pull", "make_transport", "compat_hash",
           "KVTransferError", "KVCompatibilityError", "KVHandleError", "TRANSPORTS"]
