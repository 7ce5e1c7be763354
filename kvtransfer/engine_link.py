"""KVLink: one engine's side of the baton pass, the glue between an LLMEngine and its KV transport.

    prefill replica                                  decode replica
    engine.add_request(..., prefill_only=True)
    out = <step until finished>
    handoff = link.export(out)  ---- handoff -------> engine.add_request(ids, params, rid, remote=RemotePrefill(
                                                          source=handoff, block_hashes=..., first_token=...,
                                                          deadline=...))
                                                     the scheduler reserves blocks when there is room and
                                                     calls link.start_load(...); each step polls
                                                     link.finished_loads()
    link.release_finished()  <- notification ---     (the producer unpins)

On the decode side KVLink is the engine's KVConnector (engine/kv_connector.py): leading blocks the
engine's own prefix cache holds are not pulled. The handle's block hashes must equal the prompt's,
so a handle never fills the blocks of another prompt. A cancelled load keeps its blocks until its
transfer has ended (finished_loads reports it, then the engine frees them).

Threads: the transport is used under the link's own lock (NIXL's agent is not thread-safe). The
connector calls come from the engine's thread under the engine's lock; release_finished is the
caller's to serialise with its engine loop (AsyncLLM.call): the lock order is always engine, then link.
"""
from __future__ import annotations

import threading
import time
from typing import Callable

from engine.block_hash import block_hashes
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvtransfer import make_transport
from kvtransfer.errors import KVTransferError
from kvtransfer.handle import KVHandle
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import Pull


class KVLink:
    def __init__(self, engine: LLMEngine, name_prefix: str, kind: str = "nixl", source: Callable | None = None,
                 ttl_s: float = 30.0, clock: Callable[[], float] = time.time, **options):
        self.engine, self.ttl_s = engine, ttl_s
        self._lock = threading.Lock()
        self._loads: dict[str, Pull] = {}            # request id -> its pull in flight (cancelled ones too)
        self.transport = make_transport(engine.runner.kv_cache, name_prefix, engine.compat_key(), kind=kind,
                                        source=source, clock=clock, **options)
        engine.attach_kv_connector(self)

    @property
    def name(self) -> str:
        return self.transport.name

    def metadata(self) -> bytes:
        with self._lock:
            return self.transport.metadata()

    # -- producer ---------------------------------------------------------------------------------
    def export(self, out: RequestOutput) -> KVHandle:
        """The handle of a finished prefill_only request's pinned prompt blocks."""
        if not out.finished or not out.kv_blocks:
            raise KVTransferError(f"request {out.request_id} holds no pinned prompt blocks to export")
        ids = out.prompt_token_ids
        hashes = block_hashes(ids, self.engine.block_size, self.engine.model_key)
        with self._lock:
            return self.transport.export(out.request_id, out.kv_blocks, hashes, len(ids), self.ttl_s)

    def copy_out(self, handle: KVHandle):
        """Ray fallback: the handle's block bytes now, for the object store (its pin is released at the
        next release_finished)."""
        with self._lock:
            return self.transport.read_blocks(handle.agent, handle.request_id, handle.block_ids)

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
            self._loads[request_id] = self.transport.start_pull(handle, block_ids, skip_blocks=skip_blocks)

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
