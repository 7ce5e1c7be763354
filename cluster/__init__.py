"""The cluster config (one schema), the app builder, autoscaling policies, local start-up."""
from __future__ import annotations

import importlib

_EXPORTS = {"ClusterConfig": "cluster.config", "build_app": "cluster.app"}


def __getattr__(name: str):          # lazy: `baton generate` must not import Ray Serve
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")


__all__ = list(_EXPORTS)
