"""DecodeServer: a decode-pool replica. It pulls a prompt's KV named by a KVHandle into blocks it
reserved (or prefills the prompt itself when told to), then streams tokens by continuous batching.
In colocated mode it is the only pool and always prefills itself."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, AsyncIterator

from engine import SamplingParams
from engine.outputs import RequestOutput
from kvtransfer import KVHandle
from kvtransfer.errors import KVHandleError, KVTransferError
from replica.engine_replica import EngineReplica, run_blocking
from replica.names import DECODE

log = logging.getLogger(__name__)
RESERVE_RETRY_S = 0.05
RESERVE_MARGIN_S = 2.0          # stop waiting for room this long before the producer unpins


class DecodeServer(EngineReplica):
    pool = DECODE

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """req: request_id, token_ids, sampling, and `prefill` (PrefillServer.prefill's answer) or None
        for a local prefill. Yields token deltas; the last one has finished=True and the usage."""
        ids, rid = req["token_ids"], req["request_id"]
        params = SamplingParams(**req["sampling"])
        kw: dict[str, Any] = {}
        if req.get("prefill"):
            try:
                kw = await self._import(req["prefill"], ids, rid)
            except (KVTransferError, KVHandleError, MemoryError) as e:
                # the producer died, the pull failed or timed out, or no room came in time: compute the
                # prompt here instead (the producer's pin ends at its TTL); the request still succeeds
                log.warning("request %s: KV pull failed (%s); prefilling locally", rid, e)
                self.metrics.transfer_fallback()
        first, last = True, time.perf_counter()
        async for out in self.llm.generate(ids, params, rid, **kw):
            now = time.perf_counter()
            if first:
                self.ttft.observe(now - last)
            elif out.new_token_ids:
                self.itl.observe((now - last) / len(out.new_token_ids))
            last = now
            yield _delta(out, self.replica if first else None, bool(kw))
            first = False

    async def _import(self, p: dict[str, Any], ids: list[int], rid: str) -> dict[str, Any]:
        handle = KVHandle.from_bytes(p["handle"])
        if self.transfer_kind == "nixl":
            self._peer_metadata[handle.agent] = p["agent_metadata"]
        else:
            self._blocks[handle.request_id] = (p["blocks_ref"], len(handle.block_ids))
        t0, x = time.perf_counter(), None
        try:
            x = await self._reserve_and_pull(handle, ids)
            await x.wait_async()
        except BaseException:
            if x is not None:
                await asyncio.shield(run_blocking(self.llm.call, lambda e: x.cancel()))
            self.metrics.transfer_failed()
            raise
        finally:
            self._blocks.pop(handle.request_id, None)
        self.metrics.observe_transfer(x.num_pulled_blocks * self.link.transport.block_bytes, time.perf_counter() - t0)
        return {"kv": x.kv, "first_token": p["first_token"], "first_logprobs": p["first_logprobs"]}

    async def _reserve_and_pull(self, handle: KVHandle, ids: list[int]):
        """Reserve blocks and start the pull. While the cache is full, wait for running requests to
        free blocks (backpressure, like a waiting queue) until shortly before the producer unpins."""
        waiting = False
        try:
            while True:
                try:
                    return await self._start_import(handle, ids)
                except MemoryError:
                    if time.time() > handle.expiry - RESERVE_MARGIN_S:
                        raise
                    if not waiting:
                        waiting, self.awaiting_room = True, self.awaiting_room + 1
                    await asyncio.sleep(RESERVE_RETRY_S)
        finally:
            if waiting:
                self.awaiting_room -= 1

    async def _start_import(self, handle: KVHandle, ids: list[int]):
        """start_import in a thread. A caller cancelled meanwhile (client gone) never gets the import, but the
        thread still reserves its blocks: give them back once it has."""
        fut = asyncio.ensure_future(run_blocking(self.llm.call, lambda e: self.link.start_import(handle, ids)))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(self._undo_import)
            raise

    def _undo_import(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            x = fut.result()
            asyncio.ensure_future(run_blocking(self.llm.call, lambda e: x.cancel()))


def _delta(out: RequestOutput, replica: str | None, transferred: bool) -> dict[str, Any]:
    n = len(out.new_token_ids)
    d: dict[str, Any] = {"token_ids": out.new_token_ids, "text": out.new_text, "finished": out.finished,
                         "logprobs": out.logprobs[-n:] if out.logprobs is not None and n else None}
    if replica is not None:
        d["replica"] = replica
    if out.finished:
        d.update(finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                 prompt_tokens=len(out.prompt_token_ids), completion_tokens=len(out.token_ids),
                 cached_tokens=out.metrics.num_cached_tokens, transferred=transferred)
    return d
