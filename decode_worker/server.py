"""DecodeServer: a decode-pool replica. It hands its engine the prompt's KV named by a KVHandle (the engine's
scheduler pulls it into blocks once it has room, or prefills the prompt itself if it cannot), or prefills
the prompt when told to, then streams tokens by continuous batching. In colocated mode it is the only pool
and always prefills itself."""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator

from engine import RemotePrefill, SamplingParams
from engine.block_hash import block_hashes
from engine.outputs import RequestMetrics, RequestOutput
from kvtransfer import KVHandle
from kvtransfer.errors import KVHandleError
from kvtransfer.handoff import KVHandoff
from replica.engine_replica import EngineReplica

log = logging.getLogger(__name__)
RESERVE_MARGIN_S = 2.0          # start no pull this close to the producer's unpin: prefill locally instead


class DecodeServer(EngineReplica):
    pool = "decode"

    async def generate(self, req: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """req: request_id, token_ids, sampling, and `prefill` (PrefillServer.prefill's answer) or None
        for a local prefill. Yields token deltas; the last one has finished=True and the usage."""
        ids, rid = req["token_ids"], req["request_id"]
        params = SamplingParams(**req["sampling"])
        remote = None
        if req.get("prefill"):
            try:
                remote = self._remote(req["prefill"], ids, req.get("block_hashes"))
            except KVHandleError as e:
                log.warning("request %s: bad KV handle (%s); prefilling locally", rid, e)
                self.metrics.transfer_failed()
                self.metrics.transfer_fallback()
        first, last = True, time.perf_counter()
        try:
            async for out in self.llm.generate(ids, params, rid, remote=remote):
                now = time.perf_counter()
                if first:
                    self.ttft.observe(now - last)
                elif out.new_token_ids:
                    self.itl.observe((now - last) / len(out.new_token_ids))
                last = now
                if out.finished and remote is not None:
                    self._observe_import(out.metrics)
                yield _delta(out, self.replica if first else None, out.metrics.kv_transferred)
                first = False
        finally:
            if remote is not None:
                self._blocks.pop(rid, None)

    def _remote(self, p: dict[str, Any], ids: list[int], hashes: list[int] | None) -> RemotePrefill:
        """What the engine needs to import the prompt's KV named by PrefillServer.prefill's answer `p`."""
        handle = KVHandle.from_bytes(p["handle"])
        if self.transfer_kind == "nixl":
            self._peer_metadata[handle.agent] = p["agent_metadata"]
            handoff = KVHandoff(handle)
        else:
            self._blocks[handle.request_id] = (p["blocks_ref"], len(handle.block_ids))
            handoff = KVHandoff(handle, p["blocks_ref"])
        if hashes is None:          # the prompt's own, never the handle's: a handle must match the prompt
            hashes = block_hashes(ids, self.engine.block_size, self.engine.model_key)
        return RemotePrefill(handoff, hashes, p["first_token"], p["first_logprobs"],
                             deadline=handle.expiry - RESERVE_MARGIN_S)

    def _observe_import(self, m: RequestMetrics) -> None:
        if m.kv_transferred:
            self.metrics.observe_transfer(m.kv_transfer_blocks * self.link.transport.block_bytes, m.kv_transfer_seconds)
        elif m.kv_transfer_error is not None:
            self.metrics.transfer_failed()
            self.metrics.transfer_fallback()


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
