"""What every KV transport shares: the cache's block geometry, the producer's leases (when to tell the engine
to unpin: on the consumer's notification or at the handle's expiry), and the checks a pull passes before it
copies.

Producer (prefill engine owner):           Consumer (decode engine owner):
    handoff = t.export(rid, blocks, ...)       (blocks reserved by the engine's KV cache manager)
    ... send the KVHandoff (pickled) ...       t.pull(handoff, block_ids, skip_blocks=num_cached_here)
    for rid in t.poll():                       # or: x = t.start_pull(...); ... x.done() / x.wait()
        engine.release_pinned(rid)

A consumer reaches a producer it has not met through `peer_metadata(agent) -> bytes` (the producer's
metadata(), registered once per process; in a cluster the state actor keeps them), asked once per peer.

The engine's KV cache manager holds the pinned blocks; a transport keeps only each export's expiry.
Expiry is unix time from the injected `clock` (tests pass a fake one instead of sleeping).

Tensor parallelism: every rank has its own transport over its own cache shard (`layout`, `rank`),
named `<prefix>.r<rank>` and met by consumers through its own metadata() (peer_metadata is asked per
agent name, so a cluster registers each rank's metadata under its name). Only rank 0 exports and
holds leases: its export lists every producer rank's transport (`agents`; the Ray fallback: every
rank's `shard_payload`). Each consumer rank pulls its own heads (kvtransfer/tp_plan.py plans which
producer ranks hold them) with start_pull(..., notify=False); once every rank's pull is done, consumer
rank 0 calls notify_pulled(handoff), which tells producer rank 0. A TP-1 consumer just pulls (notify=True).
"""
from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Protocol

import msgpack
import torch

from engine.kv_layout import KVHeadLayout
from kvtransfer.errors import KVCompatibilityError, KVTransferError
from kvtransfer.handle import KVHandle, compat_hash
from kvtransfer.handoff import KVHandoff
from kvtransfer.tp_plan import HeadRun, is_whole_block, plan_runs

log = logging.getLogger(__name__)

ENVELOPE_VERSION = 2        # 2: a rank's TP size, rank and head geometry


class Pull(Protocol):
    """One request's transfer in flight. done() never blocks; both raise KVTransferError on failure."""
    request_id: str

    def done(self) -> bool: ...
    def wait(self, timeout_s: float | None = None) -> None: ...


class KVTransport:
    """Base of NixlTransport and RayTransport: one per engine, producer and consumer at once.

    `name_prefix` names the replica and must survive its restarts (a restart gets the same prefix
    and a new uuid: consumers drop the dead incarnation); `compat_key` is engine.compat_key().
    Use a transport from one thread (or one asyncio loop): NIXL's agent is not locked."""
    kind = ""

    def __init__(self, kv_cache: torch.Tensor, name_prefix: str, compat_key: str,
                 peer_metadata: Callable[[str], bytes] | None = None, clock: Callable[[], float] = time.time,
                 layout: KVHeadLayout | None = None, rank: int = 0):
        if not kv_cache.is_contiguous() or kv_cache.dim() < 2:
            raise ValueError("the KV cache must be one contiguous tensor [num_blocks, heads, ...]")
        self.layout = layout or KVHeadLayout(kv_cache.shape[1])       # TP 1: the rank holds every head
        self.rank = rank
        self.heads = len(self.layout.heads_of(rank))
        if kv_cache.shape[1] != self.heads:
            raise ValueError(f"rank {rank}'s cache holds {kv_cache.shape[1]} heads, its layout {self.heads}")
        self.kv_cache = kv_cache
        self.num_blocks = kv_cache.shape[0]
        self.block_bytes = kv_cache.stride(0) * kv_cache.element_size()
        self.head_bytes = kv_cache.stride(1) * kv_cache.element_size()   # one head, every layer (engine/kv_layout.py)
        self.prefix = name_prefix if self.layout.tp_size == 1 else f"{name_prefix}.r{rank}"
        self.name = f"{self.prefix}-{uuid.uuid4().hex[:12]}"     # a restart is a new peer, never the old one
        self.compat_key = compat_key
        self.compat = compat_hash(compat_key)
        self.peer_metadata = peer_metadata          # agent name -> its metadata(): how a peer is first met
        self.clock = clock
        self.leases: dict[str, float] = {}           # exported request id -> unix time its pin ends
        self.num_released = {"notified": 0, "expired": 0}

    # -- producer ---------------------------------------------------------------------------------
    def export(self, request_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int,
               ttl_s: float, agents: list[str] | None = None, payloads: list | None = None) -> KVHandoff:
        """Pin `block_ids` for a consumer until it notifies or `ttl_s` passes (poll() says when); the
        hand-off is all a consumer needs to pull them. With TP, rank 0 exports for every rank: `agents`
        are the ranks' transport names, `payloads` their shard_payload(block_ids) (Ray fallback)."""
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise ValueError(f"block ids must be in [0, {self.num_blocks})")
        if self.rank != 0:
            raise KVTransferError(f"{self.name}: only rank 0 exports (and holds the leases)")
        agents = agents or [self.name]
        if len(agents) != self.layout.tp_size or agents[0] != self.name:
            raise ValueError(f"agents must name the {self.layout.tp_size} ranks' transports, this one first")
        expiry = self.clock() + ttl_s
        self.leases[request_id] = expiry
        handle = KVHandle(self.name, request_id, list(block_ids), list(block_hashes), num_tokens, self.compat,
                          expiry, self.kind, self.layout.tp_size, tuple(agents) if len(agents) > 1 else ())
        return KVHandoff(handle, self._payload(handle, payloads))

    def withdraw(self, request_id: str) -> bool:
        """Drop an export whose hand-off never left the producer (its caller went away): no consumer will pull
        it, so its pin ends now, not at its TTL. False if it holds no lease."""
        return self.leases.pop(request_id, None) is not None

    def _payload(self, handle: KVHandle, payloads: list | None) -> Any:
        """What a hand-off carries besides its handle (the Ray fallback: the block bytes)."""
        return None

    def shard_payload(self, block_ids: list[int]) -> Any:
        """This rank's part of a TP export's payload (the Ray fallback: its blocks' bytes); None for NIXL."""
        return None

    def poll(self) -> list[str]:
        """Request ids to unpin now (engine.release_pinned): pulled by their consumer, or expired."""
        done = [r for r in self._notified() if self.leases.pop(r, None) is not None]
        now = self.clock()
        expired = [r for r, expiry in self.leases.items() if now >= expiry]
        for r in expired:
            del self.leases[r]
        if expired:
            log.warning("%s: %d KV pins expired unpulled: %s", self.name, len(expired), expired[:8])
        self.num_released["notified"] += len(done)
        self.num_released["expired"] += len(expired)
        return done + expired

    def _notified(self) -> list[str]:
        raise NotImplementedError

    # -- handshake --------------------------------------------------------------------------------
    def _envelope(self, **extra) -> bytes:
        return msgpack.packb({"v": ENVELOPE_VERSION, "kind": self.kind, "name": self.name, "prefix": self.prefix,
                              "compat_key": self.compat_key, "block_bytes": self.block_bytes,
                              "head_bytes": self.head_bytes, "heads": self.heads, "tp_size": self.layout.tp_size,
                              "rank": self.rank, "num_blocks": self.num_blocks, **extra})

    def _open_envelope(self, metadata: bytes) -> dict:
        """A peer's metadata, checked against ours before anything else is done with it."""
        try:
            env = msgpack.unpackb(metadata)
            name, key, kind, version = env["name"], env["compat_key"], env["kind"], env["v"]
        except Exception as e:
            raise KVTransferError(f"{self.name}: malformed peer metadata ({e!r})") from e
        if version != ENVELOPE_VERSION:
            raise KVTransferError(f"peer {name} speaks metadata version {version}, not {ENVELOPE_VERSION}")
        if kind != self.kind:
            raise KVCompatibilityError(f"peer {name} uses the {kind!r} transport, this engine {self.kind!r}")
        if key != self.compat_key or env["head_bytes"] != self.head_bytes \
                or env["block_bytes"] != env["heads"] * env["head_bytes"]:
            raise KVCompatibilityError(f"peer {name}'s KV cache is not compatible with {self.name}'s: "
                                       f"{key!r} ({env['head_bytes']} B/head/block) vs "
                                       f"{self.compat_key!r} ({self.head_bytes} B/head/block)")
        return env

    # -- consumer ---------------------------------------------------------------------------------
    def pull(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0,
             timeout_s: float | None = None) -> None:
        """Copy the producer's blocks [skip:] into dst [skip:] and tell the producer; blocking."""
        self.start_pull(handoff, dst_block_ids, skip_blocks).wait(timeout_s)

    def start_pull(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0,
                   notify: bool = True) -> Pull:
        """Start copying this rank's heads of the producer's blocks [skip:] into dst [skip:]; with
        notify, the producer is told once they are here (a TP consumer's ranks pass False and rank 0
        calls notify_pulled when all are done)."""
        raise NotImplementedError

    def notify_pulled(self, handoff: KVHandoff) -> None:
        """Tell producer rank 0 that every consumer rank has its blocks (it unpins them)."""

    def runs(self, handle: KVHandle) -> list[HeadRun]:
        """Which producer ranks hold this rank's heads (kvtransfer/tp_plan.py)."""
        return plan_runs(KVHeadLayout(self.layout.num_kv_heads, handle.tp_size), self.layout, self.rank)

    def whole_blocks(self, handle: KVHandle, runs: list[HeadRun]) -> bool:
        """Same layout as the producer rank read: whole blocks, one descriptor each."""
        return is_whole_block(runs, KVHeadLayout(self.layout.num_kv_heads, handle.tp_size), self.layout, self.rank)

    def _check_pull(self, handle: KVHandle, dst_block_ids: list[int], skip_blocks: int) -> None:
        """Refuse, before any byte moves, a pull that could copy the wrong thing."""
        if handle.kind != self.kind:
            raise KVCompatibilityError(f"handle {handle.request_id} is for the {handle.kind!r} transport, "
                                       f"this engine uses {self.kind!r}")
        if handle.compat != self.compat:
            raise KVCompatibilityError(f"handle {handle.request_id} comes from an incompatible engine "
                                       f"(compat {handle.compat} vs {self.compat} = {self.compat_key!r})")
        if len(dst_block_ids) != len(handle.block_ids):
            raise KVTransferError(f"handle {handle.request_id} has {len(handle.block_ids)} blocks, "
                                  f"{len(dst_block_ids)} destination blocks given")
        if not 0 <= skip_blocks <= len(dst_block_ids):
            raise KVTransferError(f"skip_blocks {skip_blocks} is outside [0, {len(dst_block_ids)}]")
        if any(not 0 <= b < self.num_blocks for b in dst_block_ids):
            raise KVTransferError(f"destination block ids must be in [0, {self.num_blocks})")
        if self.clock() >= handle.expiry:
            raise KVTransferError(f"handle {handle.request_id} expired {self.clock() - handle.expiry:.1f} s ago: "
                                  f"its producer may have reused the blocks")

    def close(self) -> None:
        pass

    def stats(self) -> dict:
        return {"kv_pinned_requests": len(self.leases), "kv_released_notified": self.num_released["notified"],
                "kv_released_expired": self.num_released["expired"]}
