"""The messages the pools exchange: one typed object per hop of a request, instead of dicts read by key.

    ingress process (router/ingress.py -> router/orchestrator.py)
      tokenizes once, hashes the prompt's full blocks once, builds a PoolRequest
        |-- PoolRequest ------------------> prefill replica (PrefillServer.prefill)
        |                                   (prefix_source: it may pull the prompt's cached prefix from the
        |                                   replica named there first: PrefixExport -> KVHandoff, then a pull)
        |<- PrefillResult ----------------  first token + the KVHandoff of the pinned prompt blocks
        |-- PoolRequest(prefill=result) --> decode replica (DecodeServer.generate)
        |                                   (prefill=None: the decode replica prefills the prompt itself)
        |<- TokenDelta, TokenDelta, ... --  streamed; the last has finished=True and the usage
        |-- PoolRequest(pooling=...) -----> a prefill replica, else a decode one (EngineReplica.embed): an
        |<- Embedding --------------------  embedding request, its prompt computed and pooled there, no hand-off
        |-- DeltaChannel -----------------> decode replica (DecodeServer.deltas), once per replica it streams from
        |<- [(call key, TokenDelta)] -----  a batch per engine step: every delta after the first of this
        |                                   ingress's requests on that replica (PoolRequest.channel names it,
        |                                   PoolRequest.channel_key tags each call's deltas)
      router/openai_protocol.py's ResponseBuilder turns the deltas into OpenAI bodies and SSE chunks

Each hop is a Serve call: Ray pickles these dataclasses (small, typed, in one Python version per cluster).
The request routers (router/request_routers.py) read the PoolRequest of a pending call to route it.
What our own code ships between processes stays msgpack: a KVHandle inside a KVHandoff pickles as its
msgpack bytes (kvtransfer/handle.py) and is checked when it arrives; KV events go to the cluster state actor
as msgpack batches. The block hashes travel with the request: the prefill engine caches under them, the
decode engine reserves with them, and a KVHandle carries the same list, so a decode replica checks that a
hand-off was made for its prompt without hashing it again.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_connector import Resume
from engine.lora import LoRARequest
from engine.outputs import RequestOutput
from engine.pooling import PoolingParams
from engine.sampling_params import SamplingParams
from kvtransfer.handoff import KVHandoff


@dataclass(slots=True)
class PrefillResult:
    """A prefill replica's answer: the first token, sampled with the request's own parameters, and the hand-off."""
    replica: str                                # Serve's id of the prefill replica
    first_token: int
    first_logprobs: dict[int, float] | None
    num_cached_tokens: int                      # prompt tokens the prefill replica found in its prefix cache
    handoff: KVHandoff
    num_pulled_tokens: int = 0                  # prompt tokens it pulled from another replica (a prefix pull)


@dataclass(slots=True)
class PoolRequest:
    """One choice of one HTTP request, as both pools see it."""
    request_id: str
    token_ids: list[int]
    block_hashes: list[int]                     # engine.block_hash.block_hashes of token_ids' full blocks
    sampling: SamplingParams
    prefill: PrefillResult | None = None        # None: the decode replica prefills the prompt itself
    resume: Resume | None = None                # a continuation: the outputs its client already has
    avoid: tuple[str, ...] = ()                 # decode replicas this request left: never routed back there
    num_moves: int = 0                          # times it moved (replica died or drained): the retry budget
    priority: int = 0                           # vLLM's: lower is scheduled first, in both pools' engines
    lora: LoRARequest | None = None             # the adapter it runs under (None: the base model); block_hashes
                                                # are chained under its key (engine.block_hash.namespace_key)
    prefix_source: tuple[str, str, int] | None = None  # (pool, replica, leading blocks the index says it caches):
                                                # where the replica that prefills may pull the prefix from
    prefix_fallback: tuple[str, str, int] | None = None  # the other pool's best holder: asked when the first
                                                # answers that it no longer holds the blocks
    channel: str | None = None                  # the ingress's DeltaChannel: a decode replica holding it sends
                                                # the deltas after the first through it (None: all on the call)
    channel_key: str | None = None              # this call's tag on the channel: unique per call, so a request
                                                # continued elsewhere under its id never reads a late delta of
                                                # the replica it left
    pooling: PoolingParams | None = None        # an embedding request (EngineReplica.embed); `sampling` unread


@dataclass(slots=True)
class Embedding:
    """A replica's answer to an embedding request: the pooled vector (float32, engine/pooling.py)."""
    replica: str
    embedding: np.ndarray
    prompt_tokens: int
    cached_tokens: int                          # prompt tokens its prefix cache held


@dataclass(slots=True)
class PrefixExport:
    """A replica's request to the replica `target` (of either pool) for the leading blocks of a prompt it caches
    (a prefix pull): at least `min_blocks` of them, else nothing (None comes back)."""
    pin_id: str
    block_hashes: list[int]
    token_ids: list[int]                        # the blocks' tokens (checked against the cached ones)
    min_blocks: int
    target: str                                 # Serve's id of the replica asked (both pools' routers obey it)


@dataclass(slots=True)
class DeltaChannel:
    """An ingress replica's call that opens its channel on the decode replica `target`: a stream of batches, each
    `[(PoolRequest.channel_key, TokenDelta), ...]`, the deltas one engine step made for every request of that
    ingress on the replica whose first delta said `channeled`. One message a step for all of them, where each
    request's own call would carry one a token (vLLM's engine core sends its API server one output batch a step)."""
    channel: str                                # the ingress replica's id for it (PoolRequest.channel)
    target: str                                 # Serve's id of the decode replica (its router obeys it)


@dataclass(slots=True)
class TokenDelta:
    """New tokens of one request, streamed by a decode replica; the last one has finished=True and the usage."""
    token_ids: list[int]
    text: str
    finished: bool
    logprobs: list[dict[int, float]] | None = None    # one per new token, when the request asked for them
    replica: str | None = None                  # the decode replica: on the first delta only
    finish_reason: str | None = None            # the rest: on the last delta only
    stop_reason: int | str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    transferred: bool = False                   # the prompt's KV came from a prefill replica
    migrate: PrefillResult | None = None        # a draining replica's last delta: continue from this hand-off
    channeled: bool = False                     # on a first delta: the rest come through the request's channel
    prompt_logprobs: list[dict[int, float] | None] | None = None   # on a first delta, when the request asked

    @classmethod
    def of(cls, out: RequestOutput, replica: str | None = None, transferred: bool = False) -> TokenDelta:
        """The delta of one engine output (`replica` on a request's first delta)."""
        n = len(out.new_token_ids)
        d = cls(out.new_token_ids, out.new_text, out.finished,
                out.logprobs[-n:] if out.logprobs is not None and n else None, replica,
                prompt_logprobs=out.prompt_logprobs if replica is not None else None)
        if out.finished:
            d.finish_reason, d.stop_reason = out.finish_reason, out.stop_reason
            d.prompt_tokens, d.completion_tokens = len(out.prompt_token_ids), len(out.token_ids)
            d.cached_tokens, d.transferred = out.metrics.num_cached_tokens, transferred
        return d
