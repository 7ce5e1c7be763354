"""The one block hash of the whole system: the router's index, the prefill cache and the decode cache all
call block_hashes(), so "replica R holds block h" means the same thing everywhere."""
from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np
import xxhash


def block_hashes(token_ids: Sequence[int], block_size: int, model_key: str | bytes,
                 parent: int | None = None) -> list[int]:
    """Chained hashes of the *full* blocks of `token_ids`: h_i = H(h_{i-1} || model_key || block i).

    Stable across processes and machines (xxh3-64 over little-endian bytes), never Python's hash().
    `parent` continues a chain (the hash of the block before `token_ids[0]`).
    """
    key = model_key.encode() if isinstance(model_key, str) else model_key
    ids = np.asarray(token_ids, dtype="<u4")
    out: list[int] = []
    prev = parent
    for i in range(len(ids) // block_size):
        h = xxhash.xxh3_64()
        h.update(b"\x00" * 8 if prev is None else prev.to_bytes(8, "little"))
        h.update(key)
        h.update(ids[i * block_size:(i + 1) * block_size].tobytes())
        prev = h.intdigest()
        out.append(prev)
    return out


def namespace_key(model_key: str, adapter_key: str | None = None, cache_salt: str | None = None) -> str:
    """The key a request's blocks are hashed under: the model's, or the model's under a LoRA adapter
    (engine/lora.py: a digest of the adapter's files), so KV computed with other weights never matches; and a
    request's cache_salt (vLLM's) in it, so only requests with the same salt share cached blocks (a tenant's
    prompts cannot be probed through another's cache hits). The salt enters as a digest: keys never hold it."""
    key = model_key if adapter_key is None else f"{model_key}|lora:{adapter_key}"
    if cache_salt is None:
        return key
    return f"{key}|salt:{hashlib.blake2b(cache_salt.encode(), digest_size=16).hexdigest()}"
