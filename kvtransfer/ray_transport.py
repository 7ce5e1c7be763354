"""RayTransport: the fallback KV transport, block bytes copied through the Ray object store.

Same interface as NixlTransport, for where NIXL cannot run. The producer copies a prompt's pinned
blocks out of its cache when it exports them and puts the copy in the object store; the hand-off
carries its ObjectRef (KVHandoff.payload), so the consumer needs nothing else from the producer. The
pin has done its job once the bytes are copied: the request counts as pulled (the next poll() returns
it). The consumer writes the bytes of the blocks it does not cache into its own. Two more copies than
NIXL's one-sided READ, plus Ray's object transfer: that is why it is not the default.

With TP the payload is a list, one part per producer rank (its shard_payload); a consumer rank copies
each run of its heads (kvtransfer/tp_plan.py) out of the part of the rank that holds it.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

import numpy as np
import torch

from kvtransfer.errors import KVTransferError
from kvtransfer.handle import KVHandle
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import KVTransport


class RayTransport(KVTransport):
    """peer_metadata is never asked: a hand-off carries its bytes, and the handle's compat hash is checked."""
    kind = "ray"

    def __init__(self, kv_cache: torch.Tensor, name_prefix: str, compat_key: str, peer_metadata=None,
                 clock: Callable[[], float] = time.time, **tp):
        super().__init__(kv_cache, name_prefix, compat_key, peer_metadata, clock, **tp)
        self.blocks = kv_cache.view(-1).view(torch.uint8).view(self.num_blocks, self.block_bytes)
        self.peers: dict[str, str] = {}           # agent name -> prefix
        self._pulled: list[str] = []

    # -- producer ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._envelope()

    def _payload(self, handle: KVHandle, payloads: list | None) -> Any:
        """TP 1: this cache's part (shard_payload); TP > 1: every rank's part, rank 0 first."""
        if payloads is None and self.layout.tp_size > 1:
            raise KVTransferError(f"{self.name}: a TP {self.layout.tp_size} export needs every rank's payload")
        self._pulled.append(handle.request_id)
        return payloads if payloads is not None else self.shard_payload(handle.block_ids)

    def shard_payload(self, block_ids: list[int]) -> Any:
        """The blocks' bytes [len, block_bytes], in the object store when Ray runs (else the array)."""
        data = torch.empty((len(block_ids), self.block_bytes), dtype=torch.uint8)
        for i, b in enumerate(block_ids):          # block by block: memcpy speed; a gather by index is 10x slower
            data[i].copy_(self.blocks[b])
        import ray
        return ray.put(data.numpy()) if ray.is_initialized() else data.numpy()

    def _notified(self) -> list[str]:
        pulled, self._pulled = self._pulled, []
        return pulled

    # -- handshake --------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        env = self._open_envelope(metadata)
        self.peers = {n: p for n, p in self.peers.items() if p != env["prefix"]}     # a restart replaces
        self.peers[env["name"]] = env["prefix"]
        return env["name"]

    # -- consumer ---------------------------------------------------------------------------------
    def start_pull(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0,
                   notify: bool = True) -> RayPull:
        """notify is moot here: the producer counted the blocks as pulled when it copied them out."""
        handle = handoff.handle
        self._check_pull(handle, dst_block_ids, skip_blocks)
        if handoff.payload is None:
            raise KVTransferError(f"hand-off {handle.request_id} carries no block bytes")
        parts = handoff.payload if handle.tp_size > 1 else [handoff.payload]
        if not isinstance(parts, list) or len(parts) != handle.tp_size:
            raise KVTransferError(f"hand-off {handle.request_id} does not carry its {handle.tp_size} ranks' blocks")
        runs = self.runs(handle)
        needed = sorted({r.src_rank for r in runs})
        return RayPull(self, handle, list(dst_block_ids), skip_blocks, {r: parts[r] for r in needed}, runs)

    def write_blocks(self, dst_block_ids: list[int], data) -> None:
        arr = np.frombuffer(data, dtype=np.uint8) if isinstance(data, (bytes, bytearray, memoryview)) else data
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.size != len(dst_block_ids) * self.block_bytes:
            raise KVTransferError(f"{self.name}: got {getattr(arr, 'size', '?')} bytes for "
                                  f"{len(dst_block_ids)} blocks of {self.block_bytes}")
        if dst_block_ids:
            with warnings.catch_warnings():          # Ray hands out read-only arrays; we only read them
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(arr.reshape(len(dst_block_ids), self.block_bytes))
            for i, b in enumerate(dst_block_ids):
                self.blocks[b].copy_(src[i])

    def write_runs(self, dst_block_ids: list[int], parts: dict[int, np.ndarray], runs) -> None:
        """Copy each run of heads out of its producer rank's part [blocks, its heads * head_bytes]."""
        heads = self.blocks.view(self.num_blocks, self.heads, self.head_bytes)
        for run in runs:
            arr = parts[run.src_rank]
            if arr.ndim != 2 or arr.shape[0] != len(dst_block_ids) or arr.shape[1] % self.head_bytes:
                raise KVTransferError(f"{self.name}: producer rank {run.src_rank}'s part has shape {arr.shape}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                src = torch.from_numpy(arr).view(len(dst_block_ids), -1, self.head_bytes)
            for i, b in enumerate(dst_block_ids):
                heads[b, run.dst_head:run.dst_head + run.num_heads].copy_(
                    src[i, run.src_head:run.src_head + run.num_heads])


class RayPull:
    """One request's blocks on their way through the object store (one part per producer rank this rank
    reads); the leading `skip` are cached here."""

    def __init__(self, transport: RayTransport, handle: KVHandle, dst: list[int], skip: int, parts: dict, runs):
        self.t, self.handle, self.dst, self.skip, self.parts, self.runs = transport, handle, dst, skip, parts, runs
        self.request_id = handle.request_id
        self.finished = False
        self.error: KVTransferError | None = None

    def _refs(self) -> list:
        import ray
        return [p for p in self.parts.values() if isinstance(p, ray.ObjectRef)]

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.finished:
            return True
        import ray
        refs = self._refs()
        if refs and len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            if self.t.clock() >= self.handle.expiry:
                self._fail(KVTransferError(f"pull of {self.request_id} not done by the handle's expiry"))
            return False
        data = {}
        for rank, part in self.parts.items():
            try:
                data[rank] = ray.get(part) if isinstance(part, ray.ObjectRef) else part
            except Exception as e:
                cause = getattr(e, "cause", None) or e          # a RayTaskError carries the producer's error
                self._fail(KVTransferError(f"pull of {self.request_id} from {self.handle.rank_agents[rank]} "
                                           f"failed: {cause}"))
        try:
            if any(not isinstance(a, np.ndarray) or len(a) != len(self.dst) for a in data.values()):
                raise KVTransferError(f"hand-off {self.request_id} does not carry its {len(self.dst)} blocks")
            self._write({r: a[self.skip:] for r, a in data.items()})
        except KVTransferError as e:
            self._fail(e)
        self.finished, self.parts = True, {}
        return True

    def _write(self, data: dict[int, np.ndarray]) -> None:
        if self.t.whole_blocks(self.handle, self.runs):          # same layout: whole blocks, as ever
            self.t.write_blocks(self.dst[self.skip:], data[self.runs[0].src_rank])
        else:
            self.t.write_runs(self.dst[self.skip:], data, self.runs)

    def wait(self, timeout_s: float | None = None) -> None:
        import ray
        refs = self._refs()
        if refs and self.error is None:
            left = self.handle.expiry - self.t.clock()
            ray.wait(refs, num_returns=len(refs),
                     timeout=max(0.0, left if timeout_s is None else min(left, timeout_s)))
        if not self.done():
            self._fail(KVTransferError(f"pull of {self.request_id} timed out"))

    def _fail(self, error: KVTransferError):
        self.parts, self.error = {}, error
        raise error
