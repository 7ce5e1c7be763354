"""`baton bench autoscale`: the coupled policy against independent per-pool scaling, on a load step.

A fluid model of a disaggregated cluster, one tick a second, driven by Baton's real policies (CoupledPolicy, and
PoolPolicy per pool as the peer: how Ray Serve LLM scales its pools, each on its own signals):
  - requests arrive at `rate` per second (a step: --low, then --high for --high-s seconds, then --low again);
    each has --prompt tokens to prefill and --output tokens to decode;
  - a prefill replica computes --prefill-tps prompt tokens a second; a decode replica runs up to --decode-seqs
    sequences at --decode-tok-s tokens a second each; a prefilled request waits for a free decode slot;
  - a replica the policy adds serves only --startup-s later (model load), as on a GPU node;
  - what replicas report is what EngineReplica reports: prefill utilisation and queued prefill tokens (Little's
    law for an M/D/1 queue below saturation, the backlog above), running + waiting sequences, KV utilisation.
Per policy: seconds in which a request's wait for prefill or for a decode slot exceeds --slo-s, the worst such
wait, and replica-seconds (the cost). The goal: fewer SLO-violating seconds at no more than 10% more cost.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from ray.serve.config import AutoscalingConfig

from cluster.autoscaling import CoupledPolicy, PoolPolicy
from cluster.autoscaling_context import context
from cluster.config import ClusterConfig
from replica.names import POOLS


def spread(pool: str, n: int, totals: dict[str, float]) -> dict[str, dict]:
    return {name: {f"{pool}-{i}": v / max(n, 1) for i in range(n)} for name, v in totals.items()}


def simulate(args: argparse.Namespace, coupled: bool) -> dict[str, Any]:
    scale = {"upscale_delay_s": args.upscale_delay_s, "downscale_delay_s": 120, "cooldown_s": args.startup_s + 30,
             "max_replicas": 32}
    cfg = ClusterConfig.from_dict({
        "prefill": {"autoscaling": {**scale, "target_queued_prefill_tokens": int(args.prefill_tps), "ttft_slo_s": 0}},
        "decode": {"autoscaling": {**scale, "target_running_seqs": int(0.75 * args.decode_seqs), "itl_slo_s": 0},
                   "engine": {"max_num_seqs": args.decode_seqs}},
        "coupling": {"ratio_window_s": 60}})
    conf = {p: AutoscalingConfig(**cfg.deployment_options(p)["autoscaling_config"]) for p in POOLS}
    policy = CoupledPolicy() if coupled else {p: PoolPolicy(**conf[p].policy.policy_kwargs) for p in POOLS}
    active, target = {"prefill": 1, "decode": 1}, {"prefill": 1, "decode": 1}
    pending: list[tuple[float, str]] = []             # (ready at, pool)
    state: dict = {p: {} for p in POOLS}
    backlog = waiting = running = 0.0                 # prompt tokens, requests waiting for decode, sequences
    duration = args.output / args.decode_tok_s
    rows, violating, worst, cost = [], 0, 0.0, 0.0
    for t in range(args.duration_s):
        now = float(t)
        for ready, pool in [x for x in pending if x[0] <= now]:
            pending.remove((ready, pool))
            active[pool] += 1
        rate = args.high if args.low_s <= t < args.low_s + args.high_s else args.low
        # prefill: fluid backlog, plus the M/D/1 queue a stochastic stream keeps below saturation
        cap = active["prefill"] * args.prefill_tps
        backlog += rate * args.prompt
        done = min(backlog, cap)
        backlog -= done
        rho = min(rate * args.prompt / max(cap, 1e-9), 0.99)
        queued = backlog + args.prompt * (rho + rho * rho / (2 * (1 - rho)))
        prefill_wait = backlog / max(cap, 1e-9)
        # decode: prefilled requests take free slots; sequences leave after `duration`
        waiting += done / args.prompt
        running -= running / duration
        admit = min(waiting, max(active["decode"] * args.decode_seqs - running, 0.0))
        waiting -= admit
        running += admit
        decode_wait = waiting / max(running / duration, 1e-9) if waiting > 0.5 else 0.0
        wait = prefill_wait + decode_wait
        violating += wait > args.slo_s
        worst = max(worst, wait)
        cost += active["prefill"] + active["decode"]
        metrics = {"prefill": spread("prefill", target["prefill"], {"queued_prefill_tokens": queued,
                                                                    "utilization": done / args.prefill_tps}),
                   "decode": spread("decode", target["decode"], {
                       "running_seqs": running + waiting,
                       "kv_utilization": running / args.decode_seqs})}
        if coupled:
            decisions, states = policy({p: context(p, target[p], metrics[p], conf[p], state[p], now) for p in POOLS})
            state.update(states)
        else:
            decisions = {}
            for p in POOLS:
                decisions[p], state[p] = policy[p](context(p, target[p], metrics[p], conf[p], state[p], now))
        for p, want in decisions.items():
            want = min(max(math.ceil(want), conf[p].min_replicas), conf[p].max_replicas)
            if want > target[p]:
                pending += [(now + args.startup_s, p)] * (want - target[p])
            elif want < target[p]:
                drop = target[p] - want
                cancelled = [x for x in pending if x[1] == p][:drop]
                for x in cancelled:
                    pending.remove(x)
                active[p] -= drop - len(cancelled)
            target[p] = want
        rows.append({"t": t, "rate": rate, "prefill": active["prefill"], "decode": active["decode"],
                     "prefill_wait_s": prefill_wait, "decode_wait_s": decode_wait})
    return {"slo_violating_s": int(violating), "worst_wait_s": round(worst, 2), "replica_s": round(cost),
            "max_replicas": {p: max(r[p] for r in rows) for p in POOLS}, "timeline": rows}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--low", type=float, default=6.0, help="requests/s before and after the step (default 6)")
    p.add_argument("--high", type=float, default=18.0, help="requests/s during the step (default 18)")
    p.add_argument("--low-s", type=int, default=300, help="seconds before the step (default 300)")
    p.add_argument("--high-s", type=int, default=600, help="seconds of the step (default 600)")
    p.add_argument("--duration-s", type=int, default=1500, help="simulated seconds (default 1500)")
    p.add_argument("--prompt", type=int, default=2000, help="uncached prompt tokens per request (default 2000)")
    p.add_argument("--output", type=int, default=250, help="output tokens per request (default 250)")
    p.add_argument("--prefill-tps", type=float, default=16000, help="prefill tokens/s per replica (default 16000)")
    p.add_argument("--decode-seqs", type=int, default=64, help="sequences per decode replica (default 64)")
    p.add_argument("--decode-tok-s", type=float, default=25.0, help="tokens/s per sequence (default 25)")
    p.add_argument("--startup-s", type=float, default=60.0, help="seconds before a new replica serves (default 60)")
    p.add_argument("--upscale-delay-s", type=float, default=15.0, help="both pools' upscale_delay_s (default 15)")
    p.add_argument("--slo-s", type=float, default=2.0, help="a wait above this violates the SLO (default 2)")
    p.add_argument("--out-dir", default="bench_out/autoscale",
                   help="directory for autoscale_bench.json and .png (default bench_out/autoscale)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    from bench.engine_bench import make_logger, pyplot, save
    log = make_logger("autoscale-bench")
    started = time.perf_counter()
    results = {}
    for name, coupled in (("coupled", True), ("independent", False)):
        log(f"simulating {args.duration_s} s with the {name} policy")
        results[name] = simulate(args, coupled)
    c, i = results["coupled"], results["independent"]
    summary = {"slo_violating_s": {"coupled": c["slo_violating_s"], "independent": i["slo_violating_s"]},
               "worst_wait_s": {"coupled": c["worst_wait_s"], "independent": i["worst_wait_s"]},
               "replica_s": {"coupled": c["replica_s"], "independent": i["replica_s"]},
               "cost_ratio_coupled_vs_independent": round(c["replica_s"] / i["replica_s"], 3),
               "goal_met": c["slo_violating_s"] < i["slo_violating_s"] and c["replica_s"] <= 1.1 * i["replica_s"]}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for name, style in (("coupled", "-"), ("independent", "--")):
        rows = results[name]["timeline"]
        ts = [r["t"] for r in rows]
        axes[0].plot(ts, [r["prefill"] for r in rows], style, label=f"prefill ({name})")
        axes[0].plot(ts, [r["decode"] for r in rows], style, label=f"decode ({name})")
        axes[1].plot(ts, [r["decode_wait_s"] for r in rows], style, label=name)
        axes[2].plot(ts, [r["prefill_wait_s"] for r in rows], style, label=name)
    axes[0].set_ylabel("serving replicas")
    axes[1].set_ylabel("wait for a decode slot (s)")
    axes[2].set_ylabel("wait for prefill (s)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"load step {args.low:g} -> {args.high:g} req/s: coupled vs independent pool scaling")
    plot = out_dir / "autoscale_bench.png"
    save(fig, plot, dpi=110)
    result = {"bench": "autoscale", "params": {k: v for k, v in vars(args).items() if not callable(v)},
              "summary": summary, "plot": str(plot), "seconds": round(time.perf_counter() - started, 2),
              "results": {k: {kk: vv for kk, vv in v.items() if kk != "timeline"} for k, v in results.items()}}
    (out_dir / "autoscale_bench.json").write_text(json.dumps(result, indent=2, default=str))
    log(f"SLO-violating seconds: coupled {c['slo_violating_s']} vs independent {i['slo_violating_s']}; "
        f"cost ratio {summary['cost_ratio_coupled_vs_independent']}")
    return result
