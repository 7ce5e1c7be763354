"""Orchestrator: one request's way through the prefill and decode pools, behind the HTTP layer (router/ingress.py).

    token ids + SamplingParams + block hashes (hashed once, by the ingress, with `hashes`)
      -> a PoolRequest (replica/messages.py), naming the replica (of either pool) that caches most of the prompt
         (prefix_source): the replica that prefills it may pull that prefix instead of computing it
      -> disaggregated?  uncached part on the best decode replica > min_remote_prefill_tokens
           yes: prefill pool (PrefixAwareRouter) -> PrefillResult (first token + KVHandoff) -> decode pool pulls
           no:  decode pool prefills itself (DecodeRouter prefers the replica that caches most)
      -> TokenDeltas streamed back from the decode replica (Serve streaming handle)
A failed prefill call, or a decode replica that dies before its first delta, sends the request to the
decode pool to prefill itself. A decode replica that dies mid-stream costs the client nothing either: the
request continues on another decode replica (never the one it left) from the tokens already sent
(`Resume`: prompt + those tokens recomputed, mostly from the prefix cache), up to `max_moves` times. Cancelling the iteration (client gone) cancels the Serve calls: each
pool aborts its request and frees its blocks. Latency histograms are observed here, where the client
sees them.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import Any, AsyncIterator

from prometheus_client import Counter, Histogram

from engine import Resume, SamplingParams
from engine.block_hash import block_hashes, namespace_key
from engine.lora import LoRARequest
from replica.messages import PoolRequest, PrefillResult, TokenDelta
from replica.names import DECODE, PREFILL
from router.cluster_state import IndexMirror
from router.request_routers import observe_found, prefill_finished

log = logging.getLogger(__name__)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0)
TTFT = Histogram("baton_time_to_first_token_seconds", "Time to first token, as the ingress sees it",
                 ["pool", "replica"], buckets=LATENCY_BUCKETS)
ITL = Histogram("baton_inter_token_latency_seconds", "Time between streamed token deltas, per token",
                ["pool", "replica"], buckets=LATENCY_BUCKETS)
E2E = Histogram("baton_e2e_request_latency_seconds", "Arrival to last token", ["pool", "replica"],
                buckets=LATENCY_BUCKETS)
REQUESTS = Counter("baton_requests", "Finished requests by status and finish reason",
                   ["status", "finish_reason"])
PATHS = Counter("baton_disaggregation_decisions", "Where prompts were prefilled", ["path"])
MOVES = Counter("baton_request_moves", "Requests continued on another decode replica mid-stream",
                ["reason", "how"])
MOVED_TOKENS = Counter("baton_request_moved_tokens", "Tokens of moved requests, by how their KV reached the "
                       "new replica: recomputed by a replay, or pulled", ["how"])


def prefill_remotely(num_tokens: int, decode_hit_blocks: int, block_size: int, min_remote: int) -> bool:
    """Whether a prompt goes to the prefill pool: a remote prefill pays a transfer, worth it only when the best
    decode replica would compute more than `min_remote` tokens of it (it caches `decode_hit_blocks`)."""
    return num_tokens - decode_hit_blocks * block_size > min_remote


def prefix_source(index: dict, hashes: list[int], disaggregated: bool) -> tuple[str, str, int] | None:
    """(pool, replica, blocks) over the pools' prefix indexes (pool -> PrefixIndex): the replica caching most of
    the prompt's leading blocks, a prefill replica on a tie (Orchestrator.prefix_source; plan/sim.py)."""
    pools = ((PREFILL, 1), (DECODE, 0)) if disaggregated else ((DECODE, 0),)
    best = max(((n, rank, rid, pool) for pool, rank in pools for rid, n in index[pool].match(hashes).items() if n),
               default=None)
    return (best[3], best[2], best[0]) if best is not None else None


class Orchestrator:
    def __init__(self, prefill_handle, decode_handle, model: dict[str, Any], state_actor: str,
                 min_remote_prefill_tokens: int, sync_interval_s: float, max_moves: int = 3):
        self.prefill, self.decode = prefill_handle, decode_handle.options(stream=True)
        self.model = model                        # DecodeServer.model_info(): key, block size, limits
        self.mirror = IndexMirror.shared(state_actor, sync_interval_s) if state_actor else None
        self.min_remote = min_remote_prefill_tokens
        self.max_moves = max_moves

    def hashes(self, token_ids: list[int], lora: LoRARequest | None = None) -> list[int]:
        """The prompt's full-block hashes (under its adapter's key, if any): computed here once per prompt, then
        carried by its PoolRequests."""
        return block_hashes(token_ids, self.model["block_size"], self.key(lora))

    def key(self, lora: LoRARequest | None) -> str:
        return namespace_key(self.model["model_key"], lora.key if lora is not None else None)

    def remote_prefill(self, token_ids: list[int], hashes: list[int]) -> bool:
        """Remote prefill pays a transfer; worth it only when the decode side would compute a lot."""
        if self.prefill is None:
            return False
        hit = 0
        if self.mirror is not None:
            self.mirror.start()
            hit = max(self.mirror.index[DECODE].match(hashes).values(), default=0)
        return prefill_remotely(len(token_ids), hit, self.model["block_size"], self.min_remote)

    def prefix_source(self, hashes: list[int]) -> tuple[str, str, int] | None:
        """(pool, replica, blocks): the replica of either pool the index says caches most of the prompt's leading
        blocks, and how many (a prefill replica on a tie): where the replica that prefills it may pull that
        prefix from (EngineReplica.prefix_remote)."""
        if self.mirror is None or not hashes:
            return None
        self.mirror.start()
        return prefix_source(self.mirror.index, hashes, self.prefill is not None)

    def cached_tokens(self, hashes: list[int]) -> int:
        """The longest prefix of these blocks any replica of either pool caches, in tokens (the index mirror)."""
        if self.mirror is None:
            return 0
        self.mirror.start()
        hit = max((max(idx.match(hashes).values(), default=0) for idx in self.mirror.index.values()), default=0)
        return hit * self.model["block_size"]

    def kv_capacity_tokens(self) -> int:
        """Tokens the decode pool's KV caches hold in all (replicas the index knows; at least one)."""
        replicas = len(self.mirror.index[DECODE].slots) if self.mirror is not None else 0
        return self.model.get("kv_blocks_total", 0) * self.model["block_size"] * max(replicas, 1)

    async def stream(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                     hashes: list[int] | None = None, lora: LoRARequest | None = None) -> AsyncIterator[TokenDelta]:
        """Token deltas of one request (see DecodeServer.generate); the last has finished=True. `lora`: the
        adapter it runs under."""
        rid = request_id or uuid.uuid4().hex
        _own_serve_request_ids(rid)
        t0 = time.perf_counter()
        hashes = hashes if hashes is not None else self.hashes(token_ids, lora)
        req = PoolRequest(rid, token_ids, hashes, params, lora=lora, prefix_source=self.prefix_source(hashes))
        status, reason, pool, replica = "error", "error", DECODE, "?"
        last, n = None, 0
        try:
            if self.remote_prefill(token_ids, hashes):
                try:
                    try:
                        req.prefill = await self.prefill.prefill.remote(req)
                    finally:
                        prefill_finished(rid)
                    PATHS.labels("remote").inc()
                    observe_found(PREFILL, rid, req.prefill.num_cached_tokens)
                except Exception as e:              # noqa: BLE001 - the decode replica can prefill it
                    log.warning("request %s: prefill pool failed (%s); the decode pool prefills it", rid,
                                _short(e))
                    PATHS.labels("local_after_prefill_failure").inc()
            else:
                PATHS.labels("local").inc()
            async for delta in self._decode(req):
                now = time.perf_counter()
                replica = delta.replica or replica
                if last is None:
                    TTFT.labels(pool, replica).observe(now - t0)
                elif delta.token_ids:
                    ITL.labels(pool, replica).observe((now - last) / len(delta.token_ids))
                last, n = now, n + len(delta.token_ids)
                if delta.finished:
                    status, reason = "ok", delta.finish_reason or "stop"
                    # what the decode engine found cached, against the router's prediction (one is kept only for
                    # a local prefill; a continuation drops it, see _continuation)
                    observe_found(DECODE, rid, None if delta.transferred else delta.cached_tokens)
                yield delta
        except (asyncio.CancelledError, GeneratorExit):
            status, reason = "aborted", "abort"
            raise
        except Exception as e:
            raise as_openai_error(e, rid) from e
        finally:
            REQUESTS.labels(status, reason).inc()
            if status == "ok":
                E2E.labels(pool, replica).observe(time.perf_counter() - t0)

    async def _decode(self, req: PoolRequest) -> AsyncIterator[TokenDelta]:
        """The decode pool's deltas, as one stream however often the request moves. A replica that dies
        before its first delta costs nothing the client saw: the request goes once more to a live replica
        (Serve routes around the dead one), which prefills it itself. One that dies later: the request
        continues from what was sent (`_continuation`), while the move budget lasts."""
        sent, chars, replica = [], 0, None        # everything the client has, across moves
        while True:
            try:
                handed_over = None
                async for delta in self.decode.generate.remote(req):
                    replica = delta.replica or replica
                    sent += delta.token_ids
                    chars += len(delta.text)
                    if delta.finish_reason == "migrated":        # the replica is draining: it handed us over
                        handed_over = delta
                        if delta.token_ids or delta.text:
                            yield TokenDelta(delta.token_ids, delta.text, False, delta.logprobs, delta.replica)
                        break
                    yield delta
                if handed_over is None:
                    return
                req = self._handed_over(req, sent, chars, replica, handed_over.migrate)
            except Exception as e:
                if not _replica_died(e):
                    raise
                if not sent and req.num_moves == 0:
                    log.warning("request %s: decode replica failed before its first token (%s); retrying on "
                                "another", req.request_id, _short(e))
                    PATHS.labels("decode_retry").inc()
                    req = replace(req, prefill=None, num_moves=1)
                elif req.num_moves < self.max_moves and sent:
                    log.warning("request %s: decode replica %s failed after %d tokens (%s); continuing on another",
                                req.request_id, replica, len(sent), _short(e))
                    req = self._continuation(req, sent, chars, replica)
                    MOVES.labels("replica_died", "replay").inc()
                    MOVED_TOKENS.labels("replay").inc(len(req.token_ids) + len(sent))
                else:
                    raise
                _own_serve_request_ids(req.request_id)   # a new Serve call: its own internal id

    def _handed_over(self, req: PoolRequest, sent: list[int], chars: int, left: str | None,
                     kv: PrefillResult | None) -> PoolRequest:
        """A draining replica's request, to continue elsewhere: from its KV hand-off when it gave one (the
        destination pulls prompt + sent[:-1]), else replayed. A planned move: it spends no move budget."""
        how = "kv_pull" if kv is not None and sent else "replay"
        log.warning("request %s: decode replica %s is draining; continuing on another by %s", req.request_id, left,
                    how)
        MOVES.labels("drain", how).inc()
        MOVED_TOKENS.labels(how).inc(len(req.token_ids) + len(sent))
        if not sent:                                    # nothing generated yet: start over elsewhere
            return replace(req, prefill=None, avoid=req.avoid + ((left,) if left else ()))
        return replace(self._continuation(req, sent, chars, left, kv), num_moves=req.num_moves)

    def _continuation(self, req: PoolRequest, sent: list[int], chars: int, left: str | None,
                      kv: PrefillResult | None = None) -> PoolRequest:
        """The request again, to be continued after the `sent` tokens (`chars` characters of text) by a
        decode replica other than the ones it left. It recomputes prompt + sent, or, given `kv`, pulls the K/V
        of prompt + sent[:-1] (sent[-1] is the hand-off's first token); the block hashes cover what it
        computes or pulls (they also let the router find a replica caching them)."""
        observe_found(DECODE, req.request_id, None)    # the next engine's cached count is not the routed one's
        bs, n = self.model["block_size"], len(req.token_ids) // self.model["block_size"]
        ids = req.token_ids + (sent if kv is None else sent[:-1])
        hashes = req.block_hashes[:n] + block_hashes(ids[n * bs:len(ids) // bs * bs], bs, self.key(req.lora),
                                                     req.block_hashes[n - 1] if n else None)
        return replace(req, block_hashes=hashes, prefill=kv, resume=Resume(list(sent), chars),
                       avoid=req.avoid + ((left,) if left else ()), num_moves=req.num_moves + 1)


def _replica_died(e: BaseException) -> bool:
    """The replica's actor died, or its tensor-parallel group broke (replica/engine_replica.py ReplicaLLM)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

    from engine.parallel import TPWorkerError
    return isinstance(e, (ActorDiedError, ActorUnavailableError, RayActorError, TPWorkerError)) \
        or isinstance(getattr(e, "cause", None), TPWorkerError)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def as_openai_error(e: BaseException, rid: str):
    """What the client is told about a failure inside the pools, in OpenAI's error shape: a replica that
    died is a 503 (try again); a request the engine refused is a 400; anything else a 500. The message
    names no prompt text."""
    from ray.exceptions import RayTaskError

    from engine.errors import InvalidRequestError
    from router.openai_protocol import OpenAIError
    if isinstance(e, OpenAIError):
        return e
    if _replica_died(e):
        return OpenAIError(503, f"the replica serving request {rid} failed; the request can be retried",
                           "ServiceUnavailableError", code="replica_failed", headers={"Retry-After": "1"})
    cause = e.cause if isinstance(e, RayTaskError) else e
    if isinstance(cause, InvalidRequestError):
        return OpenAIError(400, str(cause))
    log.error("request %s failed: %s", rid, _short(e))
    return OpenAIError(500, f"internal error in request {rid}: {type(cause).__name__}", "InternalServerError")


def _own_serve_request_ids(rid: str) -> None:
    """Give this task's Serve calls their own request ids. The n choices of one HTTP request run as
    sibling tasks that would otherwise share the HTTP request's ids, and Serve keys in-flight calls
    (streams, cancellation) by them: with n > 1 streams crossed and hung. Call inside the task."""
    _set_serve_request_ids(rid, uuid.uuid4().hex)


# -- shims over Ray's private API: one each, so an upgrade of Ray has one place to look -----------------
def _set_serve_request_ids(request_id: str, internal_id: str) -> None:
    """Set the Serve request context of this asyncio task (a contextvar, so sibling tasks are untouched).
    Private API, checked against Ray 2.60: ray.serve.context._set_request_context(request_id=...,
    _internal_request_id=...) sets the ids the handle's calls from this task carry; Serve has no public way to
    give a task's handle calls ids of their own."""
    from ray.serve import context
    context._set_request_context(request_id=request_id, _internal_request_id=internal_id)
