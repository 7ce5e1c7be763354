"""KVLink: one engine's side of the baton pass, the glue between an LLMEngine and its KV transport.

    prefill replica                                  decode replica
    engine.add_request(..., prefill_only=True)
    out = <step until finished>
    handoff = link.export(out, hashes) - handoff -> engine.add_request(ids, params, rid, remote=RemotePrefill(
                                                          source=handoff, block_hashes=..., first_token=...,
                                                          deadline=...))
                                                     the scheduler reserves blocks when there is room and
                                                     calls link.start_load(...); each step polls
                                                     link.finished_loads()
    link.release_finished()  <- notification ---     (the producer unpins)

On the decode side KVLink is the engine's KVConnector (engine/kv_connector.py): leading blocks the
engine's own prefix cache holds are not pulled. The handle's block hashes must equal the prompt's,
so a handle never fills the blocks of another prompt. In a cluster both sides take the request's
hashes (computed once, at the ingress) and hash nothing themselves. A cancelled load keeps its blocks until its
transfer has ended (finished_loads reports it, then the engine frees them).

Threads: the transport is used under the link's own lock (NIXL's agent is not thread-safe). The
connector calls come from the engine's thread under the engine's lock; release_finished is the
caller's to serialise with its engine loop (AsyncLLM.call): the lock order is always engine, then link.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from engine.block_hash import block_hashes as hash_blocks
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvtransfer import make_transport
from kvtransfer.config import TransferConfig
from kvtransfer.errors import KVTransferError
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import Pull


class KVLink:
    def __init__(self, engine: LLMEngine, name_prefix: str, kind: str = "nixl",
                 peer_metadata: Callable[[str], bytes] | None = None, ttl_s: float = TransferConfig.model_fields["ttl_s"].default,
                 clock: Callable[[], float] = time.time, **options):
        self.engine, self.ttl_s = engine, ttl_s
        self._lock = threading.Lock()
        self._loads: dict[str, Pull] = {}            # request id -> its pull in flight (cancelled ones too)
        self.transport = make_transport(engine.runner.kv_cache, name_prefix, engine.compat_key(), kind=kind,
                                        peer_metadata=peer_metadata, clock=clock, **options)
        engine.attach_kv_connector(self)

    @property
    def name(self) -> str:
        return self.transport.name

    def metadata(self) -> bytes:
        with self._lock:
            return self.transport.metadata()

    # -- producer ---------------------------------------------------------------------------------
    def export(self, out: RequestOutput, hashes: list[int] | None = None) -> KVHandoff:
        """The hand-off of a finished prefill_only request's pinned prompt blocks. `hashes`: the prompt's
        full-block hashes as the request carries them (hashed here only when not given). The Ray fallback
        copies the blocks out here: call it off the event loop."""
        if not out.finished or not out.kv_blocks:
            raise KVTransferError(f"request {out.request_id} holds no pinned prompt blocks to export")
        ids, bs = out.prompt_token_ids, self.engine.block_size
        hashes = hash_blocks(ids, bs, self.engine.model_key) if hashes is None else list(hashes)
        if len(hashes) != len(ids) // bs:
            raise KVTransferError(f"{len(hashes)} block hashes for a prompt of {len(ids) // bs} full blocks")
        with self._lock:
            return self.transport.export(out.request_id, out.kv_blocks, hashes, len(ids), self.ttl_s)

    def release_finished(self) -> list[str]:
        """Unpin the prompts consumers have pulled (or that expired); call it from the engine loop."""
        with self._lock:
            done = self.transport.poll()
        for request_id in done:
            self.engine.release_pinned(request_id)
        return done

    # -- consumer: the engine's KVConnector ---------------------------------------------------------
    def start_load(self, request_id: str, source: KVHandoff, block_ids: list[int], block_hashes: list[int],
                   num_tokens: int, skip_blocks: int) -> None:
        """Start pulling the blocks of the handoff `source` past the `skip_blocks` cached here."""
        handle = source.handle
        if handle.num_tokens != num_tokens or len(handle.block_ids) != len(block_ids):
            raise KVTransferError(f"handle {handle.request_id} covers {handle.num_tokens} tokens in "
                                  f"{len(handle.block_ids)} blocks, not this prompt's {num_tokens}")
        if handle.block_hashes != block_hashes:
            raise KVTransferError(f"handle {handle.request_id} was made for another prompt (block hashes differ)")
        with self._lock:
            self._loads[request_id] = self.transport.start_pull(source, block_ids, skip_blocks=skip_blocks)

    def finished_loads(self) -> tuple[list[str], dict[str, str]]:
        done, failed = [], {}
        with self._lock:
            for request_id, pull in list(self._loads.items()):
                try:
                    if not pull.done():
                        continue
                    done.append(request_id)
                except KVTransferError as e:        # failed: nothing writes into the blocks any more
                    failed[request_id] = str(e)
                del self._loads[request_id]
        return done, failed

    def cancel_load(self, request_id: str) -> None:
        """Nothing to do: a READ cannot be recalled; finished_loads reports it once it has ended."""

    def stats(self) -> dict:
        with self._lock:
            return self.transport.stats()

    def close(self) -> None:
        with self._lock:
            self.transport.close()
