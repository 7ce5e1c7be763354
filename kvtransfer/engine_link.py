"""KVLink: one engine's side of the baton pass, the glue between an LLMEngine and its KV transport.

    prefill replica                                  decode replica
    engine.add_request(..., prefill_only=True)
    out = <step until finished>
    handoff = link.export(out, hashes) -- KVHandoff --> x = link.start_import(handoff, prompt_ids, hashes)
                                                     await x.wait_async()        (or x.wait())
                                                     engine.add_request(prompt_ids, params, kv=x.kv,
                                                                        first_token=first)
    link.release_finished()  <- notification ---     (the producer unpins; on failure x.cancel())

The decode side reserves its blocks first; leading blocks its own prefix cache already holds are
not pulled. The handle's block hashes must equal the hashes of the prompt the decode side was
given, so a handle never fills the blocks of another prompt. In a cluster both sides take the
request's hashes (computed once, at the ingress) and hash nothing themselves.

Threads: the transport is used under the link's own lock (NIXL's agent is not thread-safe), never
under the engine's, so checking a pull does not wait for an engine step. Engine calls
(reserve/release) are the caller's to serialise with its engine loop (AsyncLLM.call).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Callable

from engine.block_hash import block_hashes as hash_blocks
from engine.llm_engine import KVReservation, LLMEngine
from engine.outputs import RequestOutput
from kvtransfer import make_transport
from kvtransfer.errors import KVTransferError
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import Pull


class KVImport:
    """A reservation being filled by a pull. Pass `kv` to add_request once done; cancel() on failure."""

    def __init__(self, engine: LLMEngine, kv: KVReservation, pull: Pull, lock: threading.Lock,
                 draining: list["KVImport"]):
        self.engine, self.kv, self.pull, self._lock, self._draining = engine, kv, pull, lock, draining
        self.request_id = pull.request_id
        self.num_pulled_blocks = len(kv.block_ids) - kv.num_local_blocks

    def done(self) -> bool:
        with self._lock:
            return self.pull.done()

    def wait(self, timeout_s: float | None = None) -> None:
        with self._lock:
            self.pull.wait(timeout_s)

    async def wait_async(self, poll_s: float = 5e-4) -> None:
        while not self.done():
            await asyncio.sleep(poll_s)

    def cancel(self) -> None:
        """Give the reserved blocks back (the pull failed, or the request was aborted). A READ still in flight
        would go on writing into them after another request got them: those blocks wait until the pull has
        ended (at the handle's expiry at the latest), when KVLink.release_finished frees them."""
        if self.kv is None:
            return
        if self.in_flight():
            if self not in self._draining:
                self._draining.append(self)
            return
        self.engine.cancel_reservation(self.kv)
        self.kv = None

    def in_flight(self) -> bool:
        try:
            with self._lock:
                return not self.pull.done()
        except KVTransferError:                 # failed: nothing writes into the blocks any more
            return False


class KVLink:
    def __init__(self, engine: LLMEngine, name_prefix: str, kind: str = "nixl",
                 peer_metadata: Callable[[str], bytes] | None = None, ttl_s: float = 30.0, **options):
        self.engine, self.ttl_s = engine, ttl_s
        self._lock = threading.Lock()
        self._draining: list[KVImport] = []          # cancelled imports waiting for their READ to end
        self.transport = make_transport(engine.runner.kv_cache, name_prefix, engine.compat_key(), kind=kind,
                                        peer_metadata=peer_metadata, **options)

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
        ids = out.prompt_token_ids
        hashes = self._hashes(ids, hashes)
        with self._lock:
            return self.transport.export(out.request_id, out.kv_blocks, hashes, len(ids), self.ttl_s)

    def _hashes(self, ids: list[int], given: list[int] | None) -> list[int]:
        bs = self.engine.block_size
        if given is None:
            return hash_blocks(ids, bs, self.engine.model_key)
        if len(given) != len(ids) // bs:
            raise KVTransferError(f"{len(given)} block hashes for a prompt of {len(ids) // bs} full blocks")
        return list(given)

    def release_finished(self) -> list[str]:
        """Unpin the prompts consumers have pulled (or that expired); call it from the engine loop."""
        with self._lock:
            done = self.transport.poll()
        for request_id in done:
            self.engine.release_pinned(request_id)
        for x in [x for x in self._draining if not x.in_flight()]:     # cancelled imports whose READ ended
            self._draining.remove(x)
            x.cancel()
        return done

    # -- consumer ---------------------------------------------------------------------------------
    def start_import(self, handoff: KVHandoff, token_ids: list[int], hashes: list[int] | None = None) -> KVImport:
        """Reserve blocks for `token_ids` (whose full-block hashes are `hashes`, hashed here when not given)
        and start pulling the ones not cached here."""
        handle, bs = handoff.handle, self.engine.block_size
        if handle.num_tokens != len(token_ids) or len(handle.block_ids) != -(-len(token_ids) // bs):
            raise KVTransferError(f"handle {handle.request_id} covers {handle.num_tokens} tokens in "
                                  f"{len(handle.block_ids)} blocks, not this prompt's {len(token_ids)}")
        kv = self.engine.reserve_blocks(token_ids, self._hashes(token_ids, hashes))
        try:
            if handle.block_hashes != kv.block_hashes:
                raise KVTransferError(f"handle {handle.request_id} was made for another prompt (block hashes differ)")
            with self._lock:
                pull = self.transport.start_pull(handoff, kv.block_ids, skip_blocks=kv.num_local_blocks)
        except BaseException:
            self.engine.cancel_reservation(kv)
            raise
        return KVImport(self.engine, kv, pull, self._lock, self._draining)

    def stats(self) -> dict:
        with self._lock:
            return self.transport.stats()

    def close(self) -> None:
        with self._lock:
            self.transport.close()
