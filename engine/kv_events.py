"""KV events (stored, removed, cleared) that a block pool reports, and their msgpack codec: replicas
publish them, the router's prefix index consumes them in another process (never pickle).

A stored or removed block names its tier (`medium`, as vLLM's KV events): DEVICE, the engine's KV cache,
or HOST, the host-memory tier that holds blocks evicted from it (engine/block_pool.py, HostTier)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import msgpack


DEVICE, HOST = "device", "host"
MEDIA = (DEVICE, HOST)


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = DEVICE


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def encode_events(events: Sequence[KVEvent]) -> bytes:
    """KV events as msgpack, for the router's index in another process (never pickle)."""
    rows = []
    for e in events:
        if isinstance(e, BlockStored):
            rows.append(["stored", list(e.block_hashes), e.parent_block_hash, e.medium])
        elif isinstance(e, BlockRemoved):
            rows.append(["removed", list(e.block_hashes), e.medium])
        else:
            rows.append(["cleared"])
    return msgpack.packb(rows)


MAX_EVENT_BATCH_BYTES = 64 << 20


def decode_events(data: bytes) -> list[KVEvent]:
    """encode_events' inverse. Bytes from another process are checked against the schema on receipt: a
    malformed batch raises ValueError naming the first problem, and nothing of it is applied."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_EVENT_BATCH_BYTES:
        raise ValueError("a KV event batch must be msgpack bytes of at most 64 MiB")
    try:
        rows = msgpack.unpackb(data, strict_map_key=True)
    except Exception as e:                                  # noqa: BLE001 - msgpack raises several kinds
        raise ValueError(f"a KV event batch is not valid msgpack: {e}") from None
    if not isinstance(rows, list):
        raise ValueError("a KV event batch must be a list of events")

    def hashes(x, i: int) -> list[int]:
        if not isinstance(x, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in x):
            raise ValueError(f"KV event {i}: block hashes must be a list of integers")
        return x

    def medium(x, i: int) -> str:
        if x not in MEDIA:
            raise ValueError(f"KV event {i}: the medium must be one of {', '.join(MEDIA)}, got {str(x)[:40]!r}")
        return x

    out: list[KVEvent] = []
    for i, row in enumerate(rows):
        kind = row[0] if isinstance(row, list) and row else None
        if kind == "stored" and len(row) == 4:
            parent = row[2]
            if parent is not None and (not isinstance(parent, int) or isinstance(parent, bool)):
                raise ValueError(f"KV event {i}: the parent block hash must be an integer or nil")
            out.append(BlockStored(hashes(row[1], i), parent, medium(row[3], i)))
        elif kind == "removed" and len(row) == 3:
            out.append(BlockRemoved(hashes(row[1], i), medium(row[2], i)))
        elif kind == "cleared" and len(row) == 1:
            out.append(AllBlocksCleared())
        else:
            raise ValueError(f"KV event {i}: unknown kind or shape {str(row)[:80]!r}")
    return out
