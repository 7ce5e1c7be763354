"""PrefillServer: a prefill-pool replica. It computes a prompt up to its first token, keeps the prompt's
blocks pinned and hands back a KVHandle (plus what a decode replica needs to reach it)."""
from __future__ import annotations

import time
from typing import Any

from engine import SamplingParams
from replica.engine_replica import EngineReplica, run_blocking
from replica.names import PREFILL


class PrefillServer(EngineReplica):
    pool = PREFILL

    async def prefill(self, req: dict[str, Any]) -> dict[str, Any]:
        """req: request_id, token_ids, sampling (SamplingParams fields). The first token is sampled here
        with the request's own parameters; decode continues from it."""
        params = SamplingParams(**{**req["sampling"], "max_tokens": 1})
        out, t0 = None, time.perf_counter()
        async for out in self.llm.generate(req["token_ids"], params, req["request_id"], prefill_only=True):
            pass
        self.ttft.observe(time.perf_counter() - t0)
        handle = self.link.export(out)
        res = {"first_token": out.token_ids[0], "first_logprobs": out.logprobs[0] if out.logprobs else None,
               "handle": handle.to_bytes(), "replica": self.replica,
               "num_cached_tokens": out.metrics.num_cached_tokens}
        if self.transfer_kind == "nixl":
            res["agent_metadata"] = self.link.metadata()
        else:       # the fallback copies the blocks out now; the pin is released at the next poll
            import ray
            res["blocks_ref"] = ray.put(await run_blocking(self.link.copy_out, handle))
        return res

