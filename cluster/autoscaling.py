"""Autoscaling the two pools: Ray Serve custom policies fed by what each replica reports.

Signals (EngineReplica.record_autoscaling_stats; Serve averages each over look_back_period_s):
  prefill  queued_prefill_tokens  prompt tokens admitted but not yet computed
           utilization            fraction of the time the engine spent in model steps (since the last report)
           ttft_s                 p90 of arrival -> first token at the replica, over the last window
  decode   kv_utilization         used / total KV blocks
           running_seqs           running + waiting sequences (+ pulls waiting for KV room)
           itl_s                  p90 of the time between a sequence's tokens, over the last window
  both     tokens_in_flight       the tokens of every request it holds: what stopping it would move or
                                  replay, so a scale-down stops the replica with the fewest (victim_choice)

A pool's demand is the replica count its busiest signal asks for (fractional):
  prefill  max(sum utilization / target_utilization, sum queued tokens / target_queued_prefill_tokens,
               n * ttft / ttft_slo_s  if over the SLO)
Utilisation and running sequences grow in proportion to the load (Little's law), so they hold a steady
size; a queue alone would not: it empties once capacity suffices and the pool would shrink back into the
backlog (`baton bench autoscale` shows that oscillation). Queued tokens catch bursts before utilisation can.
  decode   max(sum kv_utilization / target_kv_utilization, sum running_seqs / target_running_seqs,
               n * itl / itl_slo_s  if over the SLO)
Latency only pushes up (it is not linear in replicas); it also blocks a scale-down while above
(1 - hysteresis) x SLO. So does a running replica with no report in Serve's aggregated metrics (silent_replicas):
a replica too busy to answer record_autoscaling_stats within Serve's timeout reports no signals at all, and
its absence must not read as zero load (Kubernetes' HPA likewise assumes missing pods at 100% for a
scale-down). On a starved machine a decode pool under load otherwise shrank 2 -> 1 at "demand 0.00" while
Serve counted 6 requests in flight.

Decision (decide): up to ceil(demand) when that exceeds the current target; down to ceil(demand / (1 -
hysteresis)) when that is below it. A direction must persist upscale_delay_s / downscale_delay_s before it
acts, and nothing acts within cooldown_s of the last change. Then min/max. Ray's own delays are set to 0:
these are the delays. A scale-up that undoes a recent scale-down (a reversal, within reversal_window_s)
doubles the downscale delay, up to MAX_DOWNSCALE_BACKOFF times; each window without one halves it. Demand is
not invariant to the pool's size (a decode pool shrunk to one replica runs slower, so its sequences hold their
KV longer and its demand rises past one): hysteresis alone let the planning simulator's day flap 1 <-> 2
every 10-15 minutes at the peak.

Coupling (CoupledPolicy, Serve's application-level policy, sees both pools at once): the prefill:decode
demand ratio r is an EWMA of samples taken while both pools carry load and neither is over its target (so
neither starves the other and hides its demand). Each pool's demand is raised to what the other's implies:
prefill >= r x decode, decode >= prefill / r. When a load step reaches the prefill pool first (it always
does), decode grows with it instead of becoming the next bottleneck one delay later, and vice versa.
mode fixed uses a configured ratio (a benchmark's, like Dynamo's profiled planner); off: independent pools.

This module is shipped by value into the Serve controller (Serve cloudpickles policies): it imports only the
standard library, pydantic, prometheus_client and plain constants (replica.names, pickled with it as values),
and reaches the cluster state actor by name.
"""
from __future__ import annotations

import inspect
import logging
import math
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from replica.names import DECODE, POOLS, PREFILL, STATE_NAMESPACE

log = logging.getLogger("ray.serve")

EXPORT_INTERVAL_S = 1.0
MAX_DOWNSCALE_BACKOFF = 8.0      # reversals stretch downscale_delay_s at most this many times
_EPS = 1e-9


# -- knobs (the cluster config's `autoscaling:` sections; cluster/config.py uses these classes) -------------
class _Schema(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Autoscaling(_Schema):
    """Replica bounds, timing and hysteresis of one pool's policy."""
    min_replicas: int = Field(1, ge=0, description="Fewest replicas; 0 lets the pool scale to zero (Serve starts "
                                                   "one when a request waits, the request waits for it)")
    max_replicas: int = Field(1, ge=1, description="Most replicas; on Kubernetes the Ray autoscaler adds GPU "
                                                   "nodes when the cluster lacks room for them")
    initial_replicas: int | None = Field(None, ge=0, description="Replicas at deploy time (default min_replicas)")
    upscale_delay_s: float = Field(30.0, ge=0, description="Seconds the need for more replicas must last before "
                                                          "the pool grows: ignores bursts shorter than a replica's "
                                                          "start-up (Ray Serve's default)")
    downscale_delay_s: float = Field(600.0, ge=0, description="Seconds the need for fewer replicas must last before "
                                                             "the pool shrinks: a GPU replica takes minutes to come "
                                                             "back (Ray Serve's default)")
    cooldown_s: float = Field(60.0, ge=0, description="Seconds after a change in which the pool does not change "
                                                     "again: new replicas must load the model before their effect "
                                                     "shows in the metrics; above a replica's start-up time plus "
                                                     "look_back_period_s avoids overshoot")
    hysteresis: float = Field(0.2, ge=0, lt=1, description="Scale down only if the smaller pool would still run at "
                                                           "most (1 - hysteresis) of its targets, so that a load "
                                                           "near a boundary does not flap")
    reversal_window_s: float = Field(1800.0, ge=0, description="A scale-up within this many seconds of a "
                                     "scale-down, back to the size the pool shrank from, is a reversal: the signals "
                                     "at the smaller size said the shrink was wrong (a smaller decode pool runs each "
                                     "sequence slower, so its KV and sequences pile up). Each reversal doubles "
                                     f"downscale_delay_s, up to {2 ** 3}x; a window without one halves it (0: off)")
    look_back_period_s: float = Field(30.0, gt=0, description="Seconds over which Serve averages each replica's "
                                                              "reported metrics (Ray Serve's default)")
    metrics_interval_s: float = Field(10.0, gt=0, description="Seconds between a replica's metric reports to "
                                                              "Serve's controller (Ray Serve's default)")

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        lo, hi, start = self.min_replicas, self.max_replicas, self.initial_replicas
        if lo > hi:
            raise ValueError(f"min_replicas ({lo}) is more than max_replicas ({hi})")
        if start is not None and not lo <= start <= hi:
            raise ValueError(f"initial_replicas ({start}) must lie between min_replicas ({lo}) "
                             f"and max_replicas ({hi})")
        if self.metrics_interval_s >= self.look_back_period_s:
            raise ValueError(f"metrics_interval_s ({self.metrics_interval_s}) must be less than "
                             f"look_back_period_s ({self.look_back_period_s})")
        return self

    def ray_config(self) -> dict[str, Any]:
        """Ray Serve's autoscaling_config: bounds and metric timing; the delays are this policy's, Ray's are 0."""
        d = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
             "look_back_period_s": self.look_back_period_s, "metrics_interval_s": self.metrics_interval_s,
             "upscale_delay_s": 0.0, "downscale_delay_s": 0.0}
        if self.initial_replicas is not None:
            d["initial_replicas"] = self.initial_replicas
        return d


class PrefillAutoscaling(Autoscaling):
    """The prefill pool scales on engine utilisation, prompt tokens waiting to be computed and time to first token."""
    target_utilization: float = Field(0.7, gt=0, le=1, description="Fraction of the time each replica's engine "
                                                                   "computes prompts that the pool is sized for: "
                                                                   "headroom so a burst queues briefly, not long")
    target_queued_prefill_tokens: int = Field(8192, ge=1, description="Queued prompt tokens per replica the pool "
                                                                      "is sized for: about half a second of "
                                                                      "prefill for an 8B model on one H100")
    ttft_slo_s: float = Field(2.0, ge=0, description="p90 seconds from a prompt's arrival at a prefill replica to "
                                                     "its first token; above it the pool grows in proportion "
                                                     "(0: not a signal)")


class DecodeAutoscaling(Autoscaling):
    """The decode pool scales on KV memory, running sequences and inter-token latency."""
    target_kv_utilization: float = Field(0.8, gt=0, le=1, description="Fraction of KV blocks in use per replica "
                                                                      "the pool is sized for: room left for "
                                                                      "growing sequences and incoming prompts")
    target_running_seqs: int | None = Field(None, ge=1, description="Running plus waiting sequences per replica "
                                                                    "the pool is sized for (default: 3/4 of the "
                                                                    "pool's max_num_seqs)")
    itl_slo_s: float = Field(0.1, ge=0, description="p90 seconds between a sequence's tokens; above it the pool "
                                                    "grows in proportion (0: not a signal)")


class Coupling(_Schema):
    """How the two pools' sizes are tied together (the application-level policy)."""
    mode: Literal["measured", "fixed", "off"] = Field(
        "measured", description="measured: keep the prefill:decode demand ratio seen under balanced load; "
                                "fixed: keep `ratio`; off: each pool scales on its own signals only")
    ratio: float | None = Field(None, gt=0, description="Prefill replicas per decode replica: required with mode "
                                                        "fixed; with measured, the starting estimate (default 1)")
    ratio_window_s: float = Field(300.0, gt=0, description="Time constant (seconds) of the measured ratio's running "
                                                           "average: long enough that a transient load mix does "
                                                           "not resize the pools")

    @model_validator(mode="after")
    def _fixed_has_ratio(self) -> Coupling:
        if self.mode == "fixed" and self.ratio is None:
            raise ValueError("mode fixed needs a ratio (prefill replicas per decode replica)")
        return self


KNOBS = {PREFILL: PrefillAutoscaling, DECODE: DecodeAutoscaling}


# -- demand -------------------------------------------------------------------------------------------
SIGNALS = {PREFILL: ("utilization", "queued_prefill_tokens", "ttft_s"),
           DECODE: ("kv_utilization", "running_seqs", "itl_s")}


def silent_replicas(pool: str, metrics: dict[str, dict[Any, float]], replicas) -> list:
    """The running replicas with none of the pool's signals in `metrics` (Serve's aggregated_metrics): their
    last report carried no custom metrics (record_autoscaling_stats timed out or failed) or none has come yet."""
    reported = set().union(*(metrics.get(name, {}) for name in SIGNALS[pool]))
    return [r for r in replicas if r not in reported]


def pool_demand(pool: str, knobs: Autoscaling, metrics: dict[str, dict[Any, float]], n: int, silent: int = 0
                ) -> tuple[float, str, bool]:
    """(replicas the busiest signal asks for, that signal, whether shrinking is allowed: latency within the
    SLO's hysteresis and every running replica reporting). metrics: Serve's aggregated_metrics, {name: {replica:
    value}}; n: the pool's current target; silent: how many running replicas report nothing (silent_replicas)."""
    def total(name: str) -> float:
        return float(sum(metrics.get(name, {}).values()))

    def worst(name: str) -> float:
        return float(max(metrics.get(name, {}).values(), default=0.0))

    if pool == PREFILL:
        terms = {"utilization": total("utilization") / knobs.target_utilization,
                 "queued_prefill_tokens": total("queued_prefill_tokens") / knobs.target_queued_prefill_tokens}
        latency, slo = worst("ttft_s"), knobs.ttft_slo_s
        lat_name = "ttft"
    else:
        terms = {"kv_utilization": total("kv_utilization") / knobs.target_kv_utilization,
                 "running_seqs": total("running_seqs") / knobs.target_running_seqs}
        latency, slo = worst("itl_s"), knobs.itl_slo_s
        lat_name = "itl"
    may_shrink = True
    if slo > 0 and latency > 0:
        if latency > slo:
            terms[lat_name] = max(n, 1) * latency / slo
        may_shrink = latency <= (1 - knobs.hysteresis) * slo
    may_shrink = may_shrink and not silent
    reason = max(terms, key=terms.get)
    return terms[reason], reason, may_shrink


def decide(knobs: Autoscaling, demand: float, reason: str, may_shrink: bool, n: int, now: float,
           state: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """(new target, direction up|down|hold, new state). state keys: want (+1/-1/0), since, last_change; and for
    reversals: backoff (the downscale delay's multiplier), shrunk (size before the last scale-down, its time),
    reversed (time of the last reversal, or of the last halving)."""
    state = dict(state)
    backoff, window = state.get("backoff", 1.0), knobs.reversal_window_s
    if backoff > 1 and now - state.get("reversed", now) >= window:   # a quiet window: halve it
        backoff = max(1.0, backoff / 2)
        state["reversed"] = now
    state["backoff"] = backoff
    up = min(max(math.ceil(demand - _EPS), knobs.min_replicas), knobs.max_replicas)
    down = min(max(math.ceil(demand / (1 - knobs.hysteresis) - _EPS), knobs.min_replicas), knobs.max_replicas)
    if n < knobs.min_replicas or n > knobs.max_replicas:        # bounds changed under us: obey at once
        state.update(want=0, since=None, last_change=now)
        return min(max(n, knobs.min_replicas), knobs.max_replicas), "up" if n < knobs.min_replicas else "down", state
    if up > n:
        want, target, delay = 1, up, knobs.upscale_delay_s
    elif down < n and may_shrink:
        want, target, delay = -1, down, knobs.downscale_delay_s * backoff
    else:
        state.update(want=0, since=None)
        return n, "hold", state
    if state.get("want") != want or state.get("since") is None:
        state.update(want=want, since=now)
    last = state.get("last_change")
    if now - state["since"] + _EPS < delay or (last is not None and now - last + _EPS < knobs.cooldown_s):
        return n, "hold", state
    state.update(want=0, since=None, last_change=now)
    shrunk = state.get("shrunk")
    if want < 0:
        state["shrunk"] = [n, now]
    elif shrunk is not None and window > 0 and target >= shrunk[0] and now - shrunk[1] <= window:
        state.update(backoff=min(backoff * 2, MAX_DOWNSCALE_BACKOFF), reversed=now, shrunk=None)
        log.info("baton autoscaler: a scale-up %d -> %d undid the scale-down %.0f s ago; the downscale delay is "
                 "now %.0fx", n, target, now - shrunk[1], state["backoff"])
    return target, "up" if want > 0 else "down", state


# -- Serve policies -----------------------------------------------------------------------------------
class _Pool:
    """One pool's knobs as Serve hands them back (the deployment's policy_kwargs)."""

    def __init__(self, kwargs: dict[str, Any]):
        kw = dict(kwargs)
        self.pool = kw.pop("pool")
        self.state_actor = kw.pop("state_actor")
        self.coupling = Coupling(**kw.pop("coupling", {}))
        self.knobs = KNOBS[self.pool](**kw)


def policy_kwargs(pool: str, knobs: Autoscaling, coupling: Coupling, state_actor: str | None,
                  max_num_seqs: int) -> dict[str, Any]:
    """What build_app puts in a pool's AutoscalingPolicy: its knobs (defaults resolved), coupling, actor name."""
    d = knobs.model_dump(mode="json")
    if pool == DECODE and d["target_running_seqs"] is None:
        d["target_running_seqs"] = max(1, max_num_seqs * 3 // 4)
    return {"pool": pool, **d, "coupling": coupling.model_dump(mode="json"), "state_actor": state_actor}


def _now(ctx) -> float:
    """The controller's clock as the context gives it (tests and benchmarks pass their own)."""
    return ctx.current_time if ctx.current_time is not None else time.time()


class _Exporter:
    """Decisions as Prometheus metrics, sent to the cluster state actor (the ingress /metrics shows them)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge
        self.registry = CollectorRegistry()
        self.target = Gauge("baton_autoscaling_target_replicas", "Replicas the autoscaler asks for", ["pool"],
                            registry=self.registry)
        self.desired = Gauge("baton_autoscaling_desired_replicas", "Replicas the pool's signals ask for "
                             "(fractional, after coupling)", ["pool"], registry=self.registry)
        self.decisions = Counter("baton_autoscaling_decisions", "Scaling changes by pool, direction and the "
                                 "signal that caused them", ["pool", "direction", "reason"], registry=self.registry)
        self.ratio = Gauge("baton_autoscaling_prefill_decode_ratio", "Prefill:decode demand ratio the coupled "
                           "policy keeps", registry=self.registry)
        self.silent = Gauge("baton_autoscaling_silent_replicas", "Running replicas whose last report carried no "
                            "signals (no scale-down while any)", ["pool"], registry=self.registry)
        self._actor, self._actor_name, self._looked, self._sent = None, None, 0.0, 0.0

    def push(self, actor_name: str | None, now: float) -> None:
        if actor_name is None or now - self._sent < EXPORT_INTERVAL_S:
            return
        try:
            import ray
            if self._actor is None or self._actor_name != actor_name:
                if now - self._looked < 5.0:
                    return
                self._looked = now
                self._actor = ray.get_actor(actor_name, namespace=STATE_NAMESPACE)
                self._actor_name = actor_name
            from prometheus_client import generate_latest
            self._actor.report.remote("autoscaler", "controller", generate_latest(self.registry))
            self._sent = now
        except Exception:                              # noqa: BLE001 - metrics must never stop scaling
            self._actor = None


# -- which replica a scale-down stops --------------------------------------------------------------------
def victim_choice():
    """Serve picks the replicas a scale-down stops in DeploymentScheduler._get_replicas_to_stop (a private API;
    checked against Ray 2.60): replicas not yet running first, then by node (free the node with the fewest
    replicas), newest first. It has no public hook, so this shim wraps that method once per process (the
    policies call it in the controller, where it runs): among the running replicas of a deployment whose costs
    the policy recorded, the cheapest to move go first, i.e. the fewest tokens in flight (a drain pulls their
    KV or replays them elsewhere). Serve's own pick breaks ties; gang-scheduled deployments and deployments
    with no costs keep Serve's choice. Returns the class (its `_baton_move_costs`: deployment id -> {replica id:
    tokens}), or None where Serve's internals differ (then Serve's choice stands)."""
    try:
        from ray.serve._private.deployment_scheduler import DeploymentScheduler
    except ImportError:
        return None
    if hasattr(DeploymentScheduler, "_baton_move_costs"):        # wrapped already, in this process
        return DeploymentScheduler
    original = DeploymentScheduler._get_replicas_to_stop
    if list(inspect.signature(original).parameters)[:3] != ["self", "deployment_id", "max_num_to_stop"]:
        log.warning("baton autoscaler: Serve's replica choice for scale-downs changed; it stays Serve's own")
        return None

    def get_replicas_to_stop(self, deployment_id, max_num_to_stop, *args, **kwargs):
        pick = original(self, deployment_id, max_num_to_stop, *args, **kwargs)
        costs = DeploymentScheduler._baton_move_costs.get(deployment_id)
        if not costs or args or kwargs.get("gang_id_by_replica") is not None:
            return pick
        running = set(self._running_replicas[deployment_id])
        serve_order: list = []                 # Serve's ranking, one more replica per call (a pool is tens)
        for k in range(1, len(running | pick) + 1):
            serve_order += original(self, deployment_id, k) - set(serve_order)
        rank = {r: i for i, r in enumerate(serve_order)}
        ranked = sorted(serve_order, key=lambda r: (r in running, costs.get(r, math.inf) if r in running else 0.0,
                                                    rank[r]))
        return set(ranked[:len(pick)])
    DeploymentScheduler._baton_move_costs = {}
    DeploymentScheduler._get_replicas_to_stop = get_replicas_to_stop
    return DeploymentScheduler


def record_move_costs(ctx) -> None:
    """Each replica's tokens in flight (as it reports them), where the scale-down's choice reads them."""
    costs = (ctx.aggregated_metrics or {}).get("tokens_in_flight")
    scheduler = victim_choice() if costs else None
    if scheduler is not None:
        scheduler._baton_move_costs[ctx.deployment_id] = dict(costs)


class _Base:
    def __init__(self):
        self.exporter = _Exporter()

    @staticmethod
    def _silent(pool: _Pool, ctx) -> int:
        return len(silent_replicas(pool.pool, ctx.aggregated_metrics or {}, ctx.running_replicas or ()))

    def _decide(self, pool: _Pool, ctx, demand: float, reason: str, may_shrink: bool, state: dict, silent: int
                ) -> tuple[int, dict]:
        record_move_costs(ctx)
        n, now = ctx.target_num_replicas, _now(ctx)
        if silent and not state.get("silent"):
            log.warning("baton autoscaler: %d of the %s pool's running replicas report no signals (busy past Serve's "
                        "RAY_SERVE_RECORD_AUTOSCALING_STATS_TIMEOUT_S, or just started): no scale-down until they do",
                        silent, pool.pool)
        self.exporter.silent.labels(pool.pool).set(silent)
        target, direction, state = decide(pool.knobs, demand, reason, may_shrink, n, now, state)
        state["silent"] = silent
        self.exporter.desired.labels(pool.pool).set(demand)
        self.exporter.target.labels(pool.pool).set(target)
        if target != n:
            self.exporter.decisions.labels(pool.pool, direction, reason).inc()
            log.info("baton autoscaler: %s %d -> %d replicas (%s; demand %.2f replicas)", pool.pool, n, target,
                     reason, demand)
        return target, state


class PoolPolicy(_Base):
    """Deployment-level policy: one pool on its own signals (used when no application-level policy runs)."""

    def __init__(self, **kwargs: Any):
        super().__init__()
        self.pool = _Pool(kwargs)

    def __call__(self, ctx) -> tuple[int, dict]:
        silent = self._silent(self.pool, ctx)
        demand, reason, may_shrink = pool_demand(self.pool.pool, self.pool.knobs, ctx.aggregated_metrics or {},
                                                 ctx.target_num_replicas, silent)
        target, state = self._decide(self.pool, ctx, demand, reason, may_shrink, ctx.policy_state, silent)
        self.exporter.push(self.pool.state_actor, time.time())
        return target, state


class CoupledPolicy(_Base):
    """Application-level policy: both pools' signals, then the prefill:decode ratio across them. Each pool's
    knobs come from its own deployment policy's kwargs, so the cluster config stays the one source."""

    def __call__(self, contexts: dict) -> tuple[dict, dict]:
        pools, inputs, silent = {}, {}, {}
        for dep_id, ctx in contexts.items():
            kwargs = getattr(getattr(ctx.config, "policy", None), "policy_kwargs", None) or {}
            if kwargs.get("pool") not in POOLS:
                continue                                 # not a Baton pool: leave it to its own policy
            p = _Pool(kwargs)
            pools[p.pool] = (dep_id, ctx, p)
            silent[p.pool] = self._silent(p, ctx)
            inputs[p.pool] = pool_demand(p.pool, p.knobs, ctx.aggregated_metrics or {}, ctx.target_num_replicas,
                                         silent[p.pool])
        demands = {name: [d, r, s] for name, (d, r, s) in inputs.items()}
        states = {name: dict(ctx.policy_state) for name, (_, ctx, _) in pools.items()}
        if len(pools) == 2:
            self._couple(pools, demands, states)
        decisions, out_states, actor = {}, {}, None
        for name, (dep_id, ctx, p) in pools.items():
            demand, reason, may_shrink = demands[name]
            decisions[dep_id], out_states[dep_id] = self._decide(p, ctx, demand, reason, may_shrink, states[name],
                                                                 silent[name])
            actor = actor or p.state_actor
        self.exporter.push(actor, time.time())
        return decisions, out_states

    def _couple(self, pools: dict, demands: dict, states: dict) -> None:
        coupling = pools[DECODE][2].coupling
        if coupling.mode == "off":
            return
        (dp, _, _), (dd, _, _) = demands[PREFILL], demands[DECODE]
        ratio = states[DECODE].get("ratio") or coupling.ratio or 1.0
        if coupling.mode == "fixed":
            ratio = coupling.ratio
        else:
            now = _now(pools[DECODE][1])
            last = states[DECODE].get("ratio_time", now)
            if self._balanced(pools, demands, states, now):
                ratio += (1 - math.exp(-max(now - last, 0.0) / coupling.ratio_window_s)) * (dp / dd - ratio)
            states[DECODE]["ratio_time"] = now
        states[DECODE]["ratio"] = ratio
        self.exporter.ratio.set(ratio)
        if ratio * dd > dp:
            demands[PREFILL][0:2] = [ratio * dd, "coupling"]
        elif dp / ratio > dd:
            demands[DECODE][0:2] = [dp / ratio, "coupling"]


    @staticmethod
    def _balanced(pools: dict, demands: dict, states: dict, now: float) -> bool:
        """Whether the demand ratio now says something about the load mix: both pools busy, neither over its
        target (which would starve the other), neither changed within its cooldown (no transient)."""
        for name in POOLS:
            _, ctx, p = pools[name]
            n, d, last = ctx.target_num_replicas, demands[name][0], states[name].get("last_change")
            if not 0.1 * n < d <= n or (last is not None and now - last < p.knobs.cooldown_s):
                return False
        return True


__all__ = ["Autoscaling", "PrefillAutoscaling", "DecodeAutoscaling", "Coupling", "pool_demand", "silent_replicas",
           "decide", "PoolPolicy", "CoupledPolicy", "policy_kwargs"]
