"""The pools' autoscaling policies (cluster/autoscaling.py), driven tick by tick with metric sequences: load
ramp, spike, drain, oscillation, latency over the SLO, and the coupled prefill:decode ratio.

Each tick builds the AutoscalingContext Serve builds (its own class, with the AutoscalingConfig that
ClusterConfig.deployment_options produces), calls the policy through Serve's own wrapper, clamps to the
bounds as Serve's controller does, and applies the decision at once (replicas start instantly here).
"""
from __future__ import annotations

import logging
import math
import re

import pytest
from prometheus_client import generate_latest
from ray.serve.autoscaling_policy import _apply_app_level_autoscaling_config, _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig

from cluster.autoscaling import CoupledPolicy, PoolPolicy, decide, pool_demand, silent_replicas
from cluster.autoscaling_context import context
from cluster.config import ClusterConfig
from engine.errors import ConfigError

TICK_S = 1.0


def scaling(decode: dict | None = None, prefill: dict | None = None, coupling: dict | None = None) -> ClusterConfig:
    d: dict = {"coupling": coupling or {}}
    if decode is not None:
        d["decode"] = {"autoscaling": {"upscale_delay_s": 10, "downscale_delay_s": 30, "cooldown_s": 15,
                                       "max_replicas": 8, "itl_slo_s": 0, **decode}}
    if prefill is not None:
        d["prefill"] = {"autoscaling": {"upscale_delay_s": 10, "downscale_delay_s": 30, "cooldown_s": 15,
                                        "max_replicas": 8, "ttft_slo_s": 0, **prefill}}
    return ClusterConfig.from_dict(d)


class Sim:
    """Pools under a load function of time; `load(t)` gives per-pool totals of each signal."""

    def __init__(self, cfg: ClusterConfig, load, coupled: bool = True):
        self.cfg, self.load, self.t = cfg, load, 0.0
        self.pools = [p for p in ("prefill", "decode") if getattr(cfg, p) and getattr(cfg, p).autoscaling]
        self.config = {p: AutoscalingConfig(**cfg.deployment_options(p)["autoscaling_config"]) for p in self.pools}
        self.n = {p: self.config[p].initial_replicas or self.config[p].min_replicas for p in self.pools}
        self.state: dict = {p: {} for p in self.pools}
        if coupled:
            self.app_policy = CoupledPolicy()
            self.policy = _apply_app_level_autoscaling_config(self.app_policy)
        else:
            self.own = {p: PoolPolicy(**self.config[p].policy.policy_kwargs) for p in self.pools}
            self.policy = {p: _apply_autoscaling_config(self.own[p]) for p in self.pools}
        self.history: list[tuple[float, dict]] = []

    def ctx(self, pool: str) -> AutoscalingContext:
        n, totals = self.n[pool], self.load(self.t).get(pool, {})
        per = {name: {f"{pool}-{i}": v / max(n, 1) if name.endswith(("tokens", "seqs", "utilization")) else v
                      for i in range(n)} for name, v in totals.items()}
        return context(pool, n, per, self.config[pool], self.state[pool], self.t)

    def run(self, seconds: float) -> list[tuple[float, dict]]:
        for _ in range(int(seconds / TICK_S)):
            self.t += TICK_S
            if isinstance(self.policy, dict):
                decisions = {}
                for p in self.pools:
                    decisions[p], self.state[p] = self.policy[p](self.ctx(p))
            else:
                decisions, states = self.policy({p: self.ctx(p) for p in self.pools})
                self.state.update(states)
            for p, target in decisions.items():
                self.n[p] = min(max(math.ceil(target), self.config[p].min_replicas), self.config[p].max_replicas)
            self.history.append((self.t, dict(self.n)))
        return self.history

    def changes(self, pool: str) -> list[tuple[float, int]]:
        out, prev = [], None
        for t, n in self.history:
            if prev is not None and n[pool] != prev:
                out.append((t, n[pool]))
            prev = n[pool]
        return out


def decode_seqs(f):
    return lambda t: {"decode": {"running_seqs": f(t), "kv_utilization": 0.0}}


# -- one pool ---------------------------------------------------------------------------------------
def test_a_load_ramp_scales_up_step_by_step_after_the_delay_and_never_down():
    cfg = scaling(decode={"target_running_seqs": 10, "cooldown_s": 5})
    sim = Sim(cfg, decode_seqs(lambda t: min(t, 60.0)))            # +1 sequence a second up to 60
    sim.run(120)
    ups = sim.changes("decode")
    assert all(b > a for (_, a), (_, b) in zip([(0, 1), *ups], ups))           # only ever up
    assert sim.n["decode"] == 6                                                  # 60 seqs / 10 per replica
    first_over = 10.0 + TICK_S                                                   # load exceeds 1 x 10 here
    assert first_over + 10 <= ups[0][0] <= first_over + 10 + 2 * TICK_S          # within the upscale delay


def test_a_spike_shorter_than_the_upscale_delay_changes_nothing_a_longer_one_scales_within_the_delay():
    cfg = scaling(decode={"target_running_seqs": 10})
    short = Sim(cfg, decode_seqs(lambda t: 35.0 if 20 <= t < 27 else 5.0))
    short.run(90)
    assert short.changes("decode") == []
    long = Sim(cfg, decode_seqs(lambda t: 35.0 if 20 <= t < 60 else 5.0))
    long.run(60)
    (t_up, n_up), = long.changes("decode")
    assert n_up == 4 and 30 <= t_up <= 31                       # 35 seqs -> 4 replicas, 10 s after it began


def test_a_drain_scales_down_only_after_the_downscale_delay_and_stops_at_min_replicas():
    cfg = scaling(decode={"target_running_seqs": 10, "min_replicas": 2, "initial_replicas": 6})
    sim = Sim(cfg, decode_seqs(lambda t: 55.0 if t < 20 else 0.0))
    sim.run(200)
    downs = sim.changes("decode")
    assert downs and downs[0][0] >= 20 + 30                     # held for downscale_delay_s after the drain
    assert sim.n["decode"] == 2 and all(n >= 2 for _, n in downs)


class SilentSim(Sim):
    """A Sim where the replicas in `silent` report no signals (their record_autoscaling_stats timed out: Serve's
    aggregated_metrics then has no entry for them) while they keep running."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.silent: set[str] = set()

    def ctx(self, pool: str):
        heard = {name: {r: v for r, v in by.items() if r not in self.silent}
                 for name, by in (super().ctx(pool).aggregated_metrics or {}).items()}
        return context(pool, self.n[pool], heard, self.config[pool], self.state[pool], self.t)


@pytest.mark.parametrize("coupled", [True, False], ids=["coupled", "pool-level"])
def test_a_replica_that_reports_nothing_blocks_a_scale_down_until_it_reports_again(coupled, caplog):
    """The starved machine's case: a decode pool of 2 under load, one replica too busy to answer Serve's stats
    call; the other's low figures must not shrink the pool (Serve still counted every request in flight)."""
    cfg = scaling(decode={"target_running_seqs": 10, "min_replicas": 1, "initial_replicas": 2})
    sim = SilentSim(cfg, decode_seqs(lambda t: 2.0), coupled=coupled)       # 1 sequence each: demand 0.2
    sim.silent = {"decode-1"}
    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            sim.run(200)                                            # far past downscale_delay_s (30) + cooldown
    finally:
        logger.removeHandler(caplog.handler)
    assert sim.changes("decode") == [] and sim.n["decode"] == 2
    assert "1 of the decode pool's running replicas report no signals" in caplog.text
    assert caplog.text.count("report no signals") == 1             # once per silent spell, not every tick
    if coupled:
        text = generate_latest(sim.app_policy.exporter.registry).decode()
        assert 'baton_autoscaling_silent_replicas{pool="decode"} 1.0' in text
    sim.silent = {"decode-0", "decode-1"}                           # nobody reports: Serve's demand reads 0
    sim.run(100)
    assert sim.n["decode"] == 2
    sim.silent = set()                                              # both report again: the low load shrinks it
    sim.run(60)
    (t, n), = sim.changes("decode")
    assert n == 1 and 300 + 30 <= t <= 300 + 30 + 2 * TICK_S          # after the delay, counted from the reports
    knobs = cfg.decode.autoscaling
    assert silent_replicas("decode", {"running_seqs": {"a": 0.0}}, ["a", "b"]) == ["b"]
    assert silent_replicas("decode", {"running_seqs": {"a": 0.0, "b": 0.0}}, ["a", "b"]) == []
    assert pool_demand("decode", knobs, {"running_seqs": {"a": 0.0}}, 2, silent=1)[2] is False
    assert pool_demand("decode", knobs, {"running_seqs": {"a": 0.0, "b": 0.0}}, 2, silent=0)[2] is True
    assert pool_demand("decode", knobs, {}, 2, silent=2)[:1] == (0.0,)      # the demand itself stays honest


def test_an_idle_pool_with_min_replicas_zero_scales_to_zero():
    cfg = scaling(decode={"target_running_seqs": 10, "min_replicas": 0, "initial_replicas": 1})
    sim = Sim(cfg, decode_seqs(lambda t: 0.0))
    sim.run(60)
    assert sim.changes("decode") == [(31.0, 0)]


def test_load_oscillating_around_a_boundary_does_not_flap():
    cfg = scaling(decode={"target_running_seqs": 10, "upscale_delay_s": 5, "downscale_delay_s": 5, "cooldown_s": 5})
    fast = Sim(cfg, decode_seqs(lambda t: 12.0 if int(t // 3) % 2 else 8.0))     # faster than the delays
    fast.run(300)
    assert fast.changes("decode") == []
    slow = Sim(cfg, decode_seqs(lambda t: 12.0 if int(t // 40) % 2 else 9.0))    # slower than the delays
    slow.run(400)
    assert slow.changes("decode") == [(45.0, 2)]                # up once; 9 seqs on 1 replica is inside the band
    no_band = Sim(scaling(decode={"target_running_seqs": 10, "upscale_delay_s": 5, "downscale_delay_s": 5,
                                  "cooldown_s": 5, "hysteresis": 0, "reversal_window_s": 0}),
                  decode_seqs(lambda t: 12.0 if int(t // 40) % 2 else 9.0))
    no_band.run(400)
    assert len(no_band.changes("decode")) >= 8                  # what the hysteresis prevents (reversals not backed off)


def test_a_load_that_grows_when_the_pool_shrinks_backs_off_instead_of_flapping():
    """The planning simulator's decode pool at the peak: at 2 replicas its sequences are 0.6 of a replica's
    target, so it shrinks; at 1 they run slower and pile up to 1.3, so it grows back. Each reversal doubles the
    downscale delay (up to 8x), and a quiet reversal window halves it again."""
    def flaps(window: float) -> tuple[list[float], Sim]:
        sim = Sim(scaling(decode={"target_running_seqs": 10, "initial_replicas": 2, "reversal_window_s": window}),
                  decode_seqs(lambda t: (6.0 if sim.n["decode"] >= 2 else 13.0) if t < 1500 else 1.0))
        sim.run(1500)
        return [t for t, n in sim.changes("decode") if n == 1], sim
    plain, _ = flaps(0.0)                                   # off: every delay + cooldown, a change each way
    downs, sim = flaps(300.0)
    assert len(plain) >= 20
    gaps = [b - a for a, b in zip(downs, downs[1:])]
    assert len(downs) <= 8 and gaps == sorted(gaps) and gaps[-1] >= 8 * 30     # 30 s, 60, 120, 240, then 240
    assert sim.state["decode"]["backoff"] == 8
    sim.run(3 * 300 + 60)                                   # the load is gone: three quiet windows halve it to 1
    assert sim.n["decode"] == 1 and sim.state["decode"]["backoff"] == 1


def test_max_replicas_caps_a_huge_load_and_the_cooldown_spaces_changes():
    cfg = scaling(decode={"target_running_seqs": 10, "max_replicas": 3, "cooldown_s": 40, "upscale_delay_s": 1})
    sim = Sim(cfg, decode_seqs(lambda t: 10.0 * t))
    sim.run(200)
    ups = sim.changes("decode")
    assert sim.n["decode"] == 3 and max(n for _, n in ups) == 3
    assert all(b - a >= 40 for (a, _), (b, _) in zip(ups, ups[1:]))


def test_kv_utilisation_and_itl_over_its_slo_scale_decode_and_latency_blocks_shrinking():
    cfg = scaling(decode={"target_running_seqs": 100, "target_kv_utilization": 0.5, "itl_slo_s": 0.05})
    kv = Sim(cfg, lambda t: {"decode": {"kv_utilization": 0.9, "running_seqs": 1.0}})
    kv.run(20)
    assert kv.n["decode"] == 2                                  # 0.9 used / 0.5 target
    itl = Sim(cfg, lambda t: {"decode": {"itl_s": 0.12, "running_seqs": 1.0}})
    itl.run(20)
    assert itl.n["decode"] == 3                                 # 1 x 0.12 / 0.05 -> 2.4
    knobs = cfg.decode.autoscaling
    assert pool_demand("decode", knobs, {"itl_s": {"a": 0.045}, "running_seqs": {"a": 1}}, 3)[2] is False
    assert pool_demand("decode", knobs, {"itl_s": {"a": 0.03}, "running_seqs": {"a": 1}}, 3)[2] is True


def test_prefill_scales_on_queued_tokens_and_ttft():
    cfg = scaling(prefill={"target_queued_prefill_tokens": 1000, "ttft_slo_s": 1.0})
    tokens = Sim(cfg, lambda t: {"prefill": {"queued_prefill_tokens": 3500.0}})
    tokens.run(20)
    assert tokens.n["prefill"] == 4
    ttft = Sim(cfg, lambda t: {"prefill": {"queued_prefill_tokens": 10.0, "ttft_s": 2.5}})
    ttft.run(20)
    assert ttft.n["prefill"] == 3
    busy = Sim(cfg, lambda t: {"prefill": {"queued_prefill_tokens": 10.0, "utilization": 1.9}})   # 1.9 / 0.7
    busy.run(20)
    assert busy.n["prefill"] == 3


def test_utilisation_holds_a_steady_size_where_a_queue_alone_would_shrink_back():
    cfg = scaling(prefill={"target_queued_prefill_tokens": 1000, "initial_replicas": 3})
    sim = Sim(cfg, lambda t: {"prefill": {"queued_prefill_tokens": 50.0, "utilization": 2.0}})   # no backlog
    sim.run(200)
    assert sim.changes("prefill") == [] and sim.n["prefill"] == 3


# -- both pools ---------------------------------------------------------------------------------------
def step_mix(t: float) -> dict:
    """Balanced for 60 s (prefill demand 2 x decode's), then 3x the load. The prefill pool sees it at once; the
    decode pool only sees what the 2 saturated prefill replicas pass on until 15 s after prefill grew."""
    k = 1.0 if t < 60 else 3.0
    return {"prefill": {"queued_prefill_tokens": 1600.0 * k},
            "decode": {"running_seqs": 8.0 if t < 85 else 24.0, "kv_utilization": 0.0}}


def test_the_coupled_policy_learns_the_ratio_and_grows_decode_with_prefill():
    cfg = scaling(prefill={"target_queued_prefill_tokens": 1000, "initial_replicas": 2},
                  decode={"target_running_seqs": 10}, coupling={"ratio_window_s": 10})
    coupled = Sim(cfg, step_mix)
    coupled.run(150)
    ratio = coupled.state["decode"]["ratio"]
    assert ratio == pytest.approx(2.0, rel=0.05)                # 1.6 / 0.8, learnt while balanced
    assert coupled.n == {"prefill": 5, "decode": 3}             # 4.8 and 4.8 / 2 -> 2.4: in step, same tick
    (t_p, _), = coupled.changes("prefill")
    (t_d, _), = coupled.changes("decode")
    assert t_p == t_d
    alone = Sim(cfg, step_mix, coupled=False)
    alone.run(84)
    assert alone.n == {"prefill": 5, "decode": 1}               # the bottleneck moved to decode
    body = generate_latest(coupled.app_policy.exporter.registry).decode()
    assert 'baton_autoscaling_decisions_total{direction="up",pool="decode",reason="coupling"} 1.0' in body
    assert re.search(r"baton_autoscaling_prefill_decode_ratio (1\.9|2\.0)", body)


def test_the_ratio_is_not_learnt_while_a_pool_is_over_its_target():
    cfg = scaling(prefill={"target_queued_prefill_tokens": 1000, "max_replicas": 1},
                  decode={"target_running_seqs": 10})
    starved = Sim(cfg, lambda t: {"prefill": {"queued_prefill_tokens": 5000.0},      # prefill saturated
                                  "decode": {"running_seqs": 2.0, "kv_utilization": 0.0}})
    starved.run(60)
    assert starved.state["decode"]["ratio"] == 1.0              # the starting estimate, untouched


def test_fixed_and_off_coupling():
    fixed = scaling(prefill={"target_queued_prefill_tokens": 1000}, decode={"target_running_seqs": 10},
                    coupling={"mode": "fixed", "ratio": 0.5})
    sim = Sim(fixed, lambda t: {"prefill": {"queued_prefill_tokens": 500.0},
                                "decode": {"running_seqs": 35.0, "kv_utilization": 0.0}})
    sim.run(30)
    assert sim.n == {"prefill": 2, "decode": 4}                 # 3.5 decode x 0.5 -> 1.75 prefill
    off = scaling(prefill={"target_queued_prefill_tokens": 1000}, decode={"target_running_seqs": 10},
                  coupling={"mode": "off"})
    sim = Sim(off, lambda t: {"prefill": {"queued_prefill_tokens": 500.0},
                              "decode": {"running_seqs": 35.0, "kv_utilization": 0.0}})
    sim.run(30)
    assert sim.n == {"prefill": 1, "decode": 4}
    with pytest.raises(ConfigError, match="coupling: .*mode fixed needs a ratio"):
        ClusterConfig.from_dict({"coupling": {"mode": "fixed"}})


def test_decisions_are_logged_with_their_reason(caplog):
    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="ray.serve"):
            Sim(scaling(decode={"target_running_seqs": 10}), decode_seqs(lambda t: 25.0)).run(15)
    finally:
        logger.removeHandler(caplog.handler)
    assert "baton autoscaler: decode 1 -> 3 replicas (running_seqs; demand 2.50 replicas)" in caplog.text


def test_decide_obeys_bounds_that_changed_under_it():
    knobs = scaling(decode={"min_replicas": 2, "max_replicas": 4}).decode.autoscaling
    assert decide(knobs, 0.0, "running_seqs", True, 1, 0.0, {})[:2] == (2, "up")
    assert decide(knobs, 9.0, "running_seqs", True, 6, 0.0, {})[:2] == (4, "down")


@pytest.mark.parametrize("bad, message", [
    ({"decode": {"autoscaling": {"hysteresis": 1.0}}}, "decode.autoscaling.hysteresis: Input should be less than 1"),
    ({"decode": {"autoscaling": {"target_kv_utilization": 1.5}}}, "decode.autoscaling.target_kv_utilization"),
    ({"prefill": {"autoscaling": {"target_kv_utilization": 0.5}}},
     "prefill.autoscaling.target_kv_utilization: unknown key"),
    ({"decode": {"autoscaling": {"metrics_interval_s": 30, "look_back_period_s": 10}}},
     "metrics_interval_s (30.0) must be less than look_back_period_s (10.0)"),
])
def test_bad_autoscaling_knobs_are_refused_with_their_path(bad, message):
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_dict(bad)
    assert message in str(e.value)


@pytest.mark.bench
def test_bench_autoscale_writes_json_and_a_plot_and_coupling_wins(tmp_path):
    import json

    from cli.main import main
    assert main(["bench", "autoscale", "--out-dir", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "autoscale_bench.json").read_text())
    assert (tmp_path / "autoscale_bench.png").stat().st_size > 10_000
    s = result["summary"]
    assert s["slo_violating_s"]["coupled"] < s["slo_violating_s"]["independent"]
    assert s["cost_ratio_coupled_vs_independent"] <= 1.1 and s["goal_met"] is True


def test_a_scale_down_stops_the_replica_with_the_fewest_tokens_in_flight():
    """Serve's own scheduler class (its choice: the newest replica on the node with the fewest) with the shim the
    policies install in the controller: once a policy has recorded each replica's tokens in flight, the replica
    cheapest to move goes first; with none recorded, and for other deployments, Serve's choice stands."""
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve._private.deployment_scheduler import DeploymentScheduler, SpreadDeploymentSchedulingPolicy

    class Nodes:                                           # Serve's node cache: one worker node, no labels
        def get_node_labels(self, node_id):
            return {}

    decode, other = DeploymentID("decode", "baton"), DeploymentID("ingress", "baton")
    scheduler = DeploymentScheduler(Nodes(), head_node_id="head", create_placement_group_fn=None)
    ids = {}
    for dep in (decode, other):
        scheduler.on_deployment_created(dep, SpreadDeploymentSchedulingPolicy())
        for name in ("old", "mid", "new"):                 # started in this order, all on node n1
            ids[dep, name] = ReplicaID(f"{dep.name}-{name}", dep)
            scheduler.on_replica_running(ids[dep, name], "n1")
    serve_pick = scheduler._get_replicas_to_stop(decode, 1)
    assert serve_pick == {ids[decode, "new"]}              # Serve's own rule: newest first

    cfg = scaling(decode={"min_replicas": 1, "initial_replicas": 3})
    config = AutoscalingConfig(**cfg.deployment_options("decode")["autoscaling_config"])
    policy = _apply_autoscaling_config(PoolPolicy(**config.policy.policy_kwargs))
    tokens = {ids[decode, "old"]: 40.0, ids[decode, "mid"]: 900.0, ids[decode, "new"]: 1500.0}
    ctx = context("decode", 3, {"running_seqs": {r: 1.0 for r in tokens}, "kv_utilization": {r: 0.1 for r in tokens},
                                "tokens_in_flight": tokens}, config, {}, 1.0)
    ctx.deployment_id = decode
    policy(ctx)                                            # records the costs where the scheduler reads them
    assert scheduler._get_replicas_to_stop(decode, 1) == {ids[decode, "old"]}
    assert scheduler._get_replicas_to_stop(decode, 2) == {ids[decode, "old"], ids[decode, "mid"]}
    assert scheduler._get_replicas_to_stop(other, 1) == {ids[other, "new"]}        # no costs: Serve's pick
    pending = ReplicaID("decode-starting", decode)         # a replica not running yet costs nothing to stop
    scheduler._launching_replicas[decode][pending] = None
    assert scheduler._get_replicas_to_stop(decode, 1) == {pending}
    del scheduler._launching_replicas[decode][pending]
    tokens[ids[decode, "mid"]] = 40.0                       # a tie: Serve's order decides between them
    policy(ctx)
    assert scheduler._get_replicas_to_stop(decode, 1) == {ids[decode, "mid"]}
