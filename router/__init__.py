"""The ingress (OpenAI HTTP API), the prefix index, the pools' request routers, the cluster state actor."""
from __future__ import annotations

import importlib

_EXPORTS = {"PrefixIndex": "router.prefix_index", "PrefillRanker": "router.prefix_index",
            "PrefixAwareRouter": "router.request_routers", "DecodeRouter": "router.request_routers",
            "ClusterState": "router.cluster_state", "Ingress": "router.ingress"}


def __getattr__(name: str):          # lazy: `from router import openai_protocol` must not start FastAPI or Serve
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'router' has no attribute {name!r}")


__all__ = list(_EXPORTS)
