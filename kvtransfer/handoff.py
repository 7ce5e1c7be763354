"""KVHandoff: what a consumer needs to pull one prompt's KV blocks, the handle plus what its transport carries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtransfer.handle import KVHandle


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """Everything a consumer needs to pull one prompt's KV blocks: the handle and what its transport carries."""
    handle: KVHandle
    payload: Any = None     # transport-specific (Ray fallback: ObjectRef of the block bytes); NIXL: None
