"""PrefillServer: a prefill-pool replica. It computes a prompt up to its first token, keeps the prompt's
blocks pinned and answers with a PrefillResult: the first token and the KVHandoff a decode replica pulls. A
prompt whose prefix another replica caches (PoolRequest.prefix_source) may have that prefix pulled from there
first (EngineReplica.prefix_remote); every replica also answers such pulls (export_prefix)."""
from __future__ import annotations

import dataclasses
import time

from replica.engine_replica import EngineReplica, export_pinned
from replica.messages import PoolRequest, PrefillResult
from replica.names import PREFILL


class PrefillServer(EngineReplica):
    pool = PREFILL

    async def prefill(self, req: PoolRequest) -> PrefillResult:
        """The first token is sampled here with the request's own parameters; decode continues from it."""
        params = dataclasses.replace(req.sampling, max_tokens=1, min_tokens=min(req.sampling.min_tokens, 1))
        out, t0 = None, time.perf_counter()
        remote = await self.prefix_remote(req)         # the prefix another prefill replica caches, pulled
        async for out in self.llm.generate(req.token_ids, params, req.request_id, prefill_only=True,
                                           block_hashes=req.block_hashes, lora_request=req.lora, remote=remote,
                                           priority=req.priority):
            pass
        pulled = self.observe_prefix_pull(out.metrics) if remote is not None else 0
        self.metrics.observe_finished(out.metrics, req.lora, len(req.token_ids), 0, prefilled=True)
        self.ttft.observe(time.perf_counter() - t0)
        handoff = await export_pinned(self.llm, self.link, out, req.block_hashes)
        return PrefillResult(self.replica, out.token_ids[0], out.logprobs[0] if out.logprobs else None,
                             out.metrics.num_cached_tokens, handoff, pulled)
