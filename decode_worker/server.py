"""DecodeServer: a decode-pool replica. It pulls a prompt's KV named by a KVHandoff into blocks it
reserved (or prefills the prompt itself when told to), then streams TokenDeltas by continuous batching.
In colocated mode it is the only pool and always prefills itself."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from kvtransfer import KVHandoff
from kvtransfer.errors import KVHandleError, KVTransferError
from replica.engine_replica import EngineReplica, run_blocking
from replica.messages import PoolRequest, PrefillResult, TokenDelta
from replica.names import DECODE

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.05
RESERVE_MARGIN_S = 2.0          # stop waiting for room this long before the producer unpins


class DecodeServer(EngineReplica):
    pool = DECODE

    async def generate(self, req: PoolRequest) -> AsyncIterator[TokenDelta]:
        """The request's deltas: its KV pulled from req.prefill's hand-off, or prefilled here when that is
        None (or the pull fails). The last delta has finished=True and the usage."""
        ids, rid = req.token_ids, req.request_id
        kw: dict[str, Any] = {}
        if req.prefill is not None:
            try:
                kw = await self._import(req.prefill, ids, req.block_hashes)
            except (KVTransferError, KVHandleError, MemoryError) as e:
                # the producer died, the pull failed or timed out, or no room came in time: compute the
                # prompt here instead (the producer's pin ends at its TTL); the request still succeeds
                log.warning("request %s: KV pull failed (%s); prefilling locally", rid, e)
                self.metrics.transfer_fallback()
        first, last = True, time.perf_counter()
        async for out in self.llm.generate(ids, req.sampling, rid, block_hashes=req.block_hashes, **kw):
            now = time.perf_counter()
            if first:
                self.ttft.observe(now - last)
            elif out.new_token_ids:
                self.itl.observe((now - last) / len(out.new_token_ids))
            last = now
            yield TokenDelta.of(out, self.replica if first else None, "kv" in kw)
            first = False

    async def _import(self, p: PrefillResult, ids: list[int], hashes: list[int]) -> dict[str, Any]:
        t0, x = time.perf_counter(), None
        try:
            x = await self._reserve_and_pull(p.handoff, ids, hashes)
            await x.wait_async()
        except BaseException:
            if x is not None:
                await asyncio.shield(run_blocking(self.llm.call, lambda e: x.cancel()))
            self.metrics.transfer_failed()
            raise
        self.metrics.observe_transfer(x.num_pulled_blocks * self.link.transport.block_bytes, time.perf_counter() - t0)
        return {"kv": x.kv, "first_token": p.first_token, "first_logprobs": p.first_logprobs}

    async def _reserve_and_pull(self, handoff: KVHandoff, ids: list[int], hashes: list[int]):
        """Reserve blocks and start the pull. While the cache is full, wait for running requests to
        free blocks (backpressure, like a waiting queue) until shortly before the producer unpins."""
        waiting = False
        try:
            while True:
                try:
                    return await self._start_import(handoff, ids, hashes)
                except MemoryError:
                    if time.time() > handoff.handle.expiry - RESERVE_MARGIN_S:
                        raise
                    if not waiting:
                        waiting, self.awaiting_room = True, self.awaiting_room + 1
                    await asyncio.sleep(RESERVE_RETRY_S)
        finally:
            if waiting:
                self.awaiting_room -= 1

    async def _start_import(self, handoff: KVHandoff, ids: list[int], hashes: list[int]):
        """start_import in a thread. A caller cancelled meanwhile (client gone) never gets the import, but the
        thread still reserves its blocks: give them back once it has."""
        fut = asyncio.ensure_future(run_blocking(self.llm.call,
                                                 lambda e: self.link.start_import(handoff, ids, hashes)))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._undo_import)
            raise

    def _undo_import(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            x = fut.result()
            asyncio.ensure_future(run_blocking(self.llm.call, lambda e: x.cancel()))

