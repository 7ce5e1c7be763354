"""RayTransport: the fallback KV transport, block bytes copied through the Ray object store.

Same interface as NixlTransport, for where NIXL cannot run. The producer copies a prompt's pinned
blocks out of its cache when it exports them and puts the copy in the object store; the hand-off
carries its ObjectRef (KVHandoff.payload), so the consumer needs nothing else from the producer. The
pin has done its job once the bytes are copied: the request counts as pulled (the next poll() returns
it). The consumer writes the bytes of the blocks it does not cache into its own. Two more copies than
NIXL's one-sided READ, plus Ray's object transfer: that is why it is not the default.
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
                 clock: Callable[[], float] = time.time):
        super().__init__(kv_cache, name_prefix, compat_key, peer_metadata, clock)
        self.blocks = kv_cache.view(-1).view(torch.uint8).view(self.num_blocks, self.block_bytes)
        self.peers: dict[str, str] = {}           # agent name -> prefix
        self._pulled: list[str] = []

    # -- producer ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        return self._envelope()

    def _payload(self, handle: KVHandle) -> Any:
        """The pinned blocks' bytes [len, block_bytes], in the object store when Ray runs (else the array)."""
        data = torch.empty((len(handle.block_ids), self.block_bytes), dtype=torch.uint8)
        for i, b in enumerate(handle.block_ids):   # block by block: memcpy speed; a gather by index is 10x slower
            data[i].copy_(self.blocks[b])
        self._pulled.append(handle.request_id)
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
    def start_pull(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0) -> RayPull:
        handle = handoff.handle
        self._check_pull(handle, dst_block_ids, skip_blocks)
        if handoff.payload is None:
            raise KVTransferError(f"hand-off {handle.request_id} carries no block bytes")
        return RayPull(self, handle, list(dst_block_ids), skip_blocks, handoff.payload)

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


class RayPull:
    """One request's blocks on their way through the object store; the leading `skip` are cached here."""

    def __init__(self, transport: RayTransport, handle: KVHandle, dst: list[int], skip: int, ref):
        self.t, self.handle, self.dst, self.skip, self.ref = transport, handle, dst, skip, ref
        self.request_id = handle.request_id
        self.finished = False
        self.error: KVTransferError | None = None

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        if self.finished:
            return True
        import ray
        data = self.ref
        if isinstance(self.ref, ray.ObjectRef):
            if not ray.wait([self.ref], timeout=0)[0]:
                if self.t.clock() >= self.handle.expiry:
                    self._fail(KVTransferError(f"pull of {self.request_id} not done by the handle's expiry"))
                return False
            try:
                data = ray.get(self.ref)
            except Exception as e:
                cause = getattr(e, "cause", None) or e          # a RayTaskError carries the producer's error
                self._fail(KVTransferError(f"pull of {self.request_id} from {self.handle.agent} failed: {cause}"))
        try:
            if not isinstance(data, np.ndarray) or len(data) != len(self.dst):
                raise KVTransferError(f"hand-off {self.request_id} does not carry its {len(self.dst)} blocks")
            self.t.write_blocks(self.dst[self.skip:], data[self.skip:])
        except KVTransferError as e:
            self._fail(e)
        self.finished, self.ref = True, None
        return True

    def wait(self, timeout_s: float | None = None) -> None:
        import ray
        if isinstance(self.ref, ray.ObjectRef) and self.error is None:
            left = self.handle.expiry - self.t.clock()
            ray.wait([self.ref], timeout=max(0.0, left if timeout_s is None else min(left, timeout_s)))
        if not self.done():
            self._fail(KVTransferError(f"pull of {self.request_id} timed out"))

    def _fail(self, error: KVTransferError):
        self.ref, self.error = None, error
        raise error
