"""The Serve RequestRouters of both pools. They run wherever a handle to the pool lives (the ingress
replicas), read only local state in `choose_replicas` (the IndexMirror, Serve's routing stats, what
they routed themselves since), and return ranked tiers like Serve's own routers.

- PrefixAwareRouter (prefill pool): ranks replicas by the prompt's leading blocks each caches, corrected
  by queued prefill tokens (router.prefix_index.PrefillRanker states the rule and its fallback).
- DecodeRouter (decode pool): a request that brings its KV goes to the replica with the most free KV
  and fewest running sequences; one that prefills locally prefers the replica caching most of it.
A PrefixExport (one replica asking another for a cached prefix) and a DeltaChannel (an ingress opening its
channel on one decode replica) go to their target, and nowhere else.
Requests without routing fields (control calls) go to any replica.
"""
from __future__ import annotations

import importlib
import time
from collections import deque
from typing import Any, Callable

from prometheus_client import Counter, Histogram
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.block_pool import blocks_for
from replica.messages import DeltaChannel, PoolRequest, PrefixExport
from replica.names import DECODE, PREFILL
from router.cluster_state import IndexMirror
from router.config import RouterConfig
from router.prefix_index import PrefillRanker

ROUTING_DECISIONS = Counter("baton_routing_decisions", "Routing decisions, by pool and reason", ["pool", "reason"])
ROUTING_SECONDS = Histogram("baton_routing_decision_seconds", "Time spent in choose_replicas", ["pool"],
                            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2))
INFLIGHT_TTL_S = 5.0
# router accuracy: what the index said the chosen replica caches against what its engine found
TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PREDICTED = Histogram("baton_router_predicted_cached_tokens", "Prompt tokens the routing index said the chosen "
                      "replica caches, per routed request", ["pool"], buckets=TOKEN_BUCKETS)
FOUND = Histogram("baton_router_found_cached_tokens", "Prompt tokens that replica's engine found in its prefix "
                  "cache, for the same requests", ["pool"], buckets=TOKEN_BUCKETS)
OUTCOMES = Counter("baton_router_cache_predictions", "Routed requests by how the prediction compared with what "
                   "the engine found: exact, over (the index promised more) or under", ["pool", "outcome"])
MAX_PENDING_PREDICTIONS = 10_000        # predictions whose request never reports back (it failed) age out


def _observe(pool: str, reason: str, seconds: float) -> None:
    """Count a decision in this process's live registry. Serve ships router classes by value, so the
    module-level metrics a method sees may be pickled copies; the imported module's are the real ones."""
    live = importlib.import_module(__name__)
    live.ROUTING_DECISIONS.labels(pool, reason).inc()
    live.ROUTING_SECONDS.labels(pool).observe(seconds)


def _live():
    """This process's imported module (Serve ships router classes by value; see _observe)."""
    return importlib.import_module(__name__)


_predictions: dict[tuple[str, str], int] = {}     # (pool, request id) -> predicted cached tokens, oldest first


def _predict(pool: str, request_id: str, tokens: int) -> None:
    pending = _live()._predictions
    pending[(pool, request_id)] = tokens
    while len(pending) > MAX_PENDING_PREDICTIONS:
        del pending[next(iter(pending))]


def observe_found(pool: str, request_id: str, found: int | None) -> None:
    """The engine of the replica a request was routed to reports the prompt tokens it found cached: observe
    them against the router's prediction for that replica (requests routed without one are skipped; None:
    the count is not comparable, drop the prediction)."""
    live = _live()
    predicted = live._predictions.pop((pool, request_id), None)
    if predicted is None or found is None:
        return
    live.PREDICTED.labels(pool).observe(predicted)
    live.FOUND.labels(pool).observe(found)
    live.OUTCOMES.labels(pool, "exact" if found == predicted else "over" if predicted > found else "under").inc()


def request_payload(pending: PendingRequest | None) -> PoolRequest | None:
    if pending is None or not pending.args or not isinstance(pending.args[0], PoolRequest):
        return None
    return pending.args[0]


class _InflightLoad:
    """What a replica's last stats cannot show yet: work sent to it since (they predate it), less the work
    that finished since (they still count it). Without the second half a snapshot taken while a long prompt
    was prefilling would send the next requests of its prefix elsewhere until the next snapshot. `clock`:
    the replicas' stats clock (unix time; the planning simulator's own).

    Each replica's items are kept in the order they came, with their running sum: a query drops the ones its
    stats (or the TTL) now cover from the front, so it costs O(1) amortized however much is in flight."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.sent: dict[str, deque[tuple[float, int]]] = {}     # (time, tokens)
        self.done: dict[str, deque[tuple[float, int]]] = {}     # (time, -tokens): signed, so both just add up
        self.total: dict[str, int] = {}                 # replica -> the sum of the tokens of both, as held
        self.open: dict[str, tuple[str, int]] = {}      # request id -> (replica, load): routed, not finished
        self.clock = clock

    def _push(self, items: dict[str, deque[tuple[float, int]]], replica: str, tokens: int) -> None:
        items.setdefault(replica, deque()).append((self.clock(), tokens))
        self.total[replica] = self.total.get(replica, 0) + tokens

    def add(self, replica: str, tokens: int, request_id: str | None = None) -> None:
        self._push(self.sent, replica, tokens)
        if request_id is not None:
            self.open[request_id] = (replica, tokens)
            while len(self.open) > MAX_PENDING_PREDICTIONS:         # requests that failed before finishing
                del self.open[next(iter(self.open))]

    def finish(self, request_id: str) -> None:
        """The replica is done with the request's load (a prefill answered)."""
        routed = self.open.pop(request_id, None)
        if routed is not None:
            self._push(self.done, routed[0], -routed[1])

    def holds(self, replica: str) -> bool:
        """Whether extra() may be nonzero for the replica."""
        return replica in self.total

    def extra(self, replica: str, stats_time: float) -> int:
        """Tokens to add to the replica's stats (negative when more finished than was sent since them)."""
        total = self.total.get(replica)
        if total is None:                               # most of a large pool: nothing in flight
            return 0
        since = max(stats_time, self.clock() - INFLIGHT_TTL_S)
        for items in (self.sent, self.done):
            queue = items.get(replica)
            if queue is None:
                continue
            while queue and queue[0][0] <= since:
                total -= queue.popleft()[1]
            if not queue:
                del items[replica]
        if replica in self.sent or replica in self.done:
            self.total[replica] = total
        else:
            del self.total[replica]
        return total


_prefill_inflight = _InflightLoad()     # this process's prefill routers' (the orchestrator reports finishes)


def prefill_finished(request_id: str) -> None:
    """A prefill routed from this process answered: its replica's queue no longer holds it."""
    _live()._prefill_inflight.finish(request_id)


class _ForgetsGoneReplicas:
    """A replica Serve drops (died, restarted, scaled down) leaves the index at once, here and in the state
    actor, instead of after the state actor's DEAD_AFTER_S of silence. A replica still alive (draining) that
    publishes again is found stale and resyncs itself."""

    def update_replicas(self, replicas) -> None:
        before = {r.unique_id for r in self.curr_replicas}
        super().update_replicas(replicas)
        for rid in before - {r.unique_id for r in self.curr_replicas}:
            self._forget(rid, "Serve's replica set dropped it")

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id.unique_id, "a call found its actor dead")

    def _forget(self, rid: str, why: str) -> None:
        mirror = getattr(self, "mirror", None)
        if mirror is not None:
            mirror.forget(self.pool, rid, why)


class _PoolRouter(_ForgetsGoneReplicas, RequestRouter):
    """What both pools' routers share: a call without routing fields goes anywhere; a routed request's
    decision is timed and counted by reason, and the load it sends (`_rank`'s third value) counts against
    the replica it went to until that replica's stats can show it."""
    pool: str

    def _init_common(self, state_actor: str | None, index_sync_interval_s: float, block_size: int,
                     mirror=None, clock: Callable[[], float] = time.time) -> None:
        """mirror, clock: the planning simulator's index and clock (in Serve: the state actor's mirror, unix time)."""
        self.mirror = mirror if mirror is not None else IndexMirror.shared(state_actor, index_sync_interval_s)
        self.block_size = block_size
        self.first_only = False         # rank only the best replica (route(): the simulator's routers)
        # in Serve the prefill pool's is the process's, which the orchestrator tells of finished prefills
        self.inflight = _live()._prefill_inflight if mirror is None and self.pool == PREFILL else _InflightLoad(clock)
        # Serve request id -> (load it sends, leading blocks the index says each replica caches, blocks usable)
        self._routing: dict[str, tuple[int | None, dict[str, int] | None, int]] = {}

    def _rank(self, req: PoolRequest, by_id: dict[str, RunningReplica]
              ) -> tuple[list[list[str]], str, int | None, dict[str, int] | None]:
        """Tiers of replica ids, best first; the decision's reason; the load the best one gets (None: none);
        the leading blocks of the prompt the index says each replica caches (None: no prediction applies)."""
        raise NotImplementedError

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        context = getattr(pending_request, "routing_context", None)
        if context is not None:
            # every round ranks all candidates, so Serve should back off between rounds. Its retry loop does so
            # only when told (its locality helpers tell it; these routers do not use them): otherwise a request
            # whose every candidate it left (a draining replica is still listed) retries without ever yielding,
            # and the router's event loop, shared by every handle in the process, starves (the node-drain test)
            context.should_backoff = True
        req = request_payload(pending_request)
        if req is None:
            target = pending_request.args[0].target if pending_request is not None and pending_request.args \
                and isinstance(pending_request.args[0], (PrefixExport, DeltaChannel)) else None
            if target is not None:              # none while the target is not listed: Serve asks again
                return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]
            return [candidate_replicas]
        self.mirror.start()
        t0 = time.perf_counter()
        # a moved request never goes back to a replica it left (dead, or draining): with none other yet, the
        # empty answer makes Serve ask again as its replica set changes (a successor starts)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas if r.replica_id.unique_id not in req.avoid}
        if not by_id:
            return []
        tiers, reason, load, hits = self._rank(req, by_id)
        _observe(self.pool, reason, time.perf_counter() - t0)
        if load is not None or hits is not None:
            # the engine never takes the block holding the last prompt token from its cache (it gives logits)
            self._routing[pending_request.metadata.request_id] = (load, hits,
                                                                  (len(req.token_ids) - 1) // self.block_size)
            while len(self._routing) > MAX_PENDING_PREDICTIONS:   # requests cancelled before Serve routed them
                del self._routing[next(iter(self._routing))]
        return [[by_id[rid] for rid in tier if rid in by_id] for tier in tiers]

    @classmethod
    def offline(cls, **state: Any) -> _PoolRouter:
        """This router outside Serve (the planning simulator): Serve's constructor skipped, `state` as
        initialize_state takes it, with the simulator's `mirror` (its `index` per pool) and `clock`."""
        self = cls.__new__(cls)
        self.initialize_state(state_actor=None, **state)
        self.first_only = True
        return self

    def route(self, req: PoolRequest, by_id: dict[str, Any]) -> tuple[str | None, str]:
        """Outside Serve (the planning simulator, plan/sim.py): the replica this router picks for `req` among
        `by_id` (objects with `routing_stats`) and the decision's reason, its load counted in flight as
        on_request_routed counts it. The same ranking as choose_replicas: Serve takes the first tier's first
        replica that has room, which is the best one for these routers."""
        if req.avoid:
            by_id = {rid: r for rid, r in by_id.items() if rid not in req.avoid}
        if not by_id:
            return None, "none"
        tiers, reason, load, _ = self._rank(req, by_id)
        best = tiers[0][0] if tiers and tiers[0] else None
        if best is not None and load is not None:
            self.inflight.add(best, load, req.request_id if self.pool == PREFILL else None)
        return best, reason

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        routed = self._routing.pop(pending_request.metadata.request_id, None)
        if routed is None:
            return
        (load, hits, usable), rid = routed, replica_id.unique_id
        req = request_payload(pending_request)
        if load is not None:
            self.inflight.add(rid, load, req.request_id if req is not None and self.pool == PREFILL else None)
        if hits is not None and req is not None:
            _predict(self.pool, req.request_id, min(hits.get(rid, 0), usable) * self.block_size)


def lora_load_cost(req: PoolRequest, stats: dict | None, cost_tokens: int) -> int:
    """Prompt tokens of work a replica pays to serve this request's LoRA adapter: none for the base model
    or an adapter it holds (its routing stats list their keys), else the configured load cost."""
    if req.lora is None or cost_tokens == 0:
        return 0
    return 0 if req.lora.key in (stats or {}).get("loras", ()) else cost_tokens


def _credited(credit: dict[str, float], by_id: dict[str, Any]) -> dict[str, float]:
    """The index's credit for the replicas a router may pick that have any (usually all it lists: a shared
    system prompt lists most of a pool, so the common case is checked without a pass in Python)."""
    if credit.keys() <= by_id.keys() and all(credit.values()):
        return credit
    return {rid: c for rid, c in credit.items() if c and rid in by_id}


class PrefixAwareRouter(_PoolRouter):
    pool = PREFILL

    def initialize_state(self, state_actor: str | None, block_size: int, router: dict[str, Any], mirror=None,
                         clock: Callable[[], float] = time.time):
        """router: the cluster config's RouterConfig as JSON (Serve requires JSON router kwargs)."""
        cfg = RouterConfig.model_validate(router)
        self._init_common(state_actor, cfg.index_sync_interval_s, block_size, mirror, clock)
        self.ranker = PrefillRanker(load_weight=cfg.load_weight, imbalance_threshold=cfg.imbalance_threshold_tokens)
        self.host_weight, self.lora_cost = cfg.host_tier_hit_weight, cfg.lora_load_cost_tokens

    def _rank(self, req, by_id):
        """The load is the prompt tokens the best replica must prefill (those it does not cache). A LoRA
        request's blocks are its adapter's (the hashes are), and a replica lacking the adapter pays its load."""
        loads, extra, inflight, holds = {}, {}, self.inflight, self.inflight.holds
        lora = req.lora is not None and self.lora_cost > 0
        for rid, r in by_id.items():
            stats = r.routing_stats or {}
            queued = stats.get("queued_prefill_tokens", 0)
            if holds(rid):                              # (most of a large pool has nothing in flight)
                queued = max(queued + inflight.extra(rid, stats.get("time", 0.0)), 0)
            loads[rid] = queued
            if lora:
                extra[rid] = lora_load_cost(req, stats, self.lora_cost)
        index = self.mirror.index[self.pool]
        matches, credit = index.match_credit(req.block_hashes, self.host_weight)
        tiers, reason = self.ranker.rank(req.block_hashes, len(req.token_ids), self.block_size,
                                         _credited(credit, by_id), loads,
                                         index.num_blocks(), extra if any(extra.values()) else None,
                                         first_only=self.first_only)
        best = tiers[0][0] if tiers and tiers[0] else None
        if best is None:
            return tiers, reason, None, matches
        return tiers, reason, max(len(req.token_ids) - matches.get(best, 0) * self.block_size, 0), matches


class DecodeRouter(_PoolRouter):
    pool = DECODE

    def initialize_state(self, state_actor: str | None, block_size: int, max_num_seqs: int,
                         index_sync_interval_s: float, host_tier_hit_weight: float, lora_load_cost_tokens: int = 0,
                         *, load_weight: float, imbalance_threshold_tokens: int,
                         mirror=None, clock: Callable[[], float] = time.time):
        """load_weight, imbalance_threshold_tokens: the router section's, for local prefills (PrefillRanker)."""
        self._init_common(state_actor, index_sync_interval_s, block_size, mirror, clock)
        self.max_num_seqs, self.host_weight = max_num_seqs, host_tier_hit_weight
        self.lora_cost = lora_load_cost_tokens
        self.ranker = PrefillRanker(load_weight=load_weight, imbalance_threshold=imbalance_threshold_tokens)

    def _rank(self, req, by_id):
        """One replica per tier; the load is the request's KV blocks. A replica lacking the request's LoRA
        adapter pays its load: as prompt tokens to compute for a local prefill, and for a request that brings
        its KV as that many tokens more of its KV cache in use.

        A replica's pressure, 0..~2: its KV fraction in use plus its running-batch fraction, counting the
        requests sent to it since its stats (`sent`, in blocks)."""
        inflight = self.inflight.extra
        pressure, sent, load, kv_tokens = {}, {}, {}, {}
        lora = req.lora is not None and self.lora_cost > 0
        for rid, r in by_id.items():
            s = r.routing_stats or {}
            x = sent[rid] = inflight(rid, s.get("time", 0.0))
            total = max(s.get("kv_blocks_total", 1), 1)
            kv_tokens[rid] = total * self.block_size
            pressure[rid] = ((s.get("kv_blocks_used", 0) + x) / total
                             + (s.get("num_running", 0) + (x > 0)) / self.max_num_seqs)
            load[rid] = lora_load_cost(req, s, self.lora_cost) if lora else 0
        n = len(req.token_ids) + (len(req.resume.token_ids) if req.resume is not None else 0)   # to compute
        hits = None
        if req.prefill is None and req.block_hashes:
            # local prefill: the prefill pool's rule (uncached tokens + queued prompt tokens, least loaded first
            # when the queues differ too much), pressure breaking ties. Without the queues, every prompt that
            # shares a system prompt would pile onto the one replica caching it (`baton plan` showed it)
            hits, credit = self.mirror.index[self.pool].match_credit(req.block_hashes, self.host_weight)
            queued = {rid: (r.routing_stats or {}).get("queued_prefill_tokens", 0) + sent[rid] * self.block_size
                      for rid, r in by_id.items()}
            tiers, why = self.ranker.rank(req.block_hashes, n, self.block_size,
                                          _credited(credit, by_id),
                                          queued, None, load if lora else None, pressure, self.first_only)
            order = [t[0] for t in tiers]
            reason = {"prefix_hit": "local_prefill_hit", "imbalanced_least_loaded": "local_prefill_imbalanced"}.get(
                why, "local_prefill")
        else:
            def key(rid: str) -> tuple[float, str]:
                return pressure[rid] + load[rid] / kv_tokens[rid], rid
            order = [min(by_id, key=key)] if self.first_only else sorted(by_id, key=key)
            reason = "least_kv_pressure"
        # a prediction for a plain local prefill (a continuation also recomputes tokens the index does not cover)
        predicted = hits if hits is not None and req.resume is None else None
        return [[rid] for rid in order], reason, blocks_for(n, self.block_size) if order else None, predicted
