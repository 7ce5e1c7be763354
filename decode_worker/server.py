"""DecodeServer: a decode-pool replica. It hands its engine the prompt's KV named by a KVHandoff (the engine's
scheduler pulls it into blocks once it has room, or prefills the prompt itself if it cannot), or prefills
the prompt when told to, then streams TokenDeltas by continuous batching. In colocated mode it is the only
pool and always prefills itself."""
from __future__ import annotations

import time
from typing import AsyncIterator

from engine import RemotePrefill
from engine.outputs import RequestMetrics
from replica.engine_replica import EngineReplica
from replica.messages import PoolRequest, PrefillResult, TokenDelta
from replica.names import DECODE

RESERVE_MARGIN_S = 2.0          # start no pull this close to the producer's unpin: prefill locally instead


class DecodeServer(EngineReplica):
    pool = DECODE

    async def generate(self, req: PoolRequest) -> AsyncIterator[TokenDelta]:
        """The request's deltas: its KV pulled from req.prefill's hand-off, or prefilled here when that is
        None (or the pull fails). The last delta has finished=True and the usage."""
        remote = _remote(req.prefill, req.block_hashes) if req.prefill is not None else None
        first, last = True, time.perf_counter()
        async for out in self.llm.generate(req.token_ids, req.sampling, req.request_id, remote=remote,
                                           block_hashes=req.block_hashes, resume=req.resume):
            now = time.perf_counter()
            if first:
                self.ttft.observe(now - last)
            elif out.new_token_ids:
                self.itl.observe((now - last) / len(out.new_token_ids))
            last = now
            if first and remote is not None:          # the import has ended (loaded or fallen back) by now
                self._observe_import(out.metrics)
            yield TokenDelta.of(out, self.replica if first else None, out.metrics.kv_transferred)
            first = False

    def _observe_import(self, m: RequestMetrics) -> None:
        """The transfer metrics of an import: its bytes and seconds, or a failure and a local prefill."""
        if m.kv_transferred:
            self.metrics.observe_transfer(m.kv_transfer_blocks * self.link.transport.block_bytes, m.kv_transfer_seconds)
        elif m.kv_transfer_error is not None:
            self.metrics.transfer_failed()
            self.metrics.transfer_fallback()


def _remote(p: PrefillResult, hashes: list[int]) -> RemotePrefill:
    """What the engine needs to import the prompt's KV: the producer's pin ends at the handle's expiry."""
    return RemotePrefill(p.handoff, hashes, p.first_token, p.first_logprobs,
                         deadline=p.handoff.handle.expiry - RESERVE_MARGIN_S)
