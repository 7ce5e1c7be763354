"""`baton plan validate`: the simulator against measured runs of `baton bench` workloads on this machine.

Each case is one workload on one cluster config, run twice with the same requests: on a live local cluster
through the HTTP API (bench/cluster_bench.py's client), and in the simulator (plan/sim.py) with a calibrated
cost model (`baton plan calibrate`). Reported per case: TTFT and ITL p50/p90, goodput under the SLOs, measured
and simulated, and the relative error of each (goal: within 15%). With `--repeats N` (or several `--measured`
files) the measured figure is the median of N live runs, and their spread is reported: on this 2-core machine
most p90s of a few dozen requests move by more than 15% from one run to the next. The replicas' step counters
(replica/metrics.py STEP_COUNTERS) say how slowly each live run's engines stepped against the calibration's fit
(`speeds`, and by pool `pool_speeds`: measured step seconds over the fit's for the same steps, times the slowdown
the simulator gives engines stepping together), and each run is simulated at its own speed (`relative_error`) as
well as at the fit's (`relative_error_at_fit`, which adds the machine's drift since its calibration). The engines'
queue and prefill phases per pool (`engine_phases_ms`) and their step seconds (`engine_steps_s`) are reported
measured and simulated: where a TTFT error lies, in the engines or on the serving path around them.

Cases:
  replay         the first --replay-requests of Mooncake's conversation trace (bench/traces), 16-token blocks
                 (`baton bench replay`), disaggregated 1 prefill + 1 decode, prefix-aware routing
  replay_colo    the same on one colocated replica
  pd             `baton bench cluster`'s P/D workload: long-answer streams and long prompts, 1 + 1
  tenants        `baton bench cluster`'s routing workload: four tenants' shared prefixes, 2 prefill + 1 decode,
                 each prefill replica's KV holding 2.5 tenants' prefixes
  tenants_pow2   the same with Serve's power-of-two routing. Its random choices make it bimodal on this
                 workload: a run whose draws leave a tenant's prefix evicted everywhere recomputes it, queues, and
                 its TTFTs reach tens of seconds, where another run's stay under one. So it is simulated with
                 --sim-seeds seeds, and each figure is their median.
With a step's spread in the cost model (Overheads.step_jitter) every case draws, and every case is simulated so.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from plan.calibrate import engine_speed, fitted_s, pool_speeds
from plan.cost import Batch, LinearCost, attention_pairs, load_cost
from plan.sim import simulate
from plan.workload import from_reqs

ERROR_GOAL = 0.15
FIGURES = [("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("itl_ms", "p90"), ("goodput_rps", None)]


def one_at_a_time(warm: list, cost) -> list:
    """The live harness runs the warm-up requests one at a time, each when the last has finished (measure()); the
    simulator runs requests at their arrival times. So each simulated warm-up arrives twice its idle service time
    (at least 5 s) after the one before, and the last is over before the measured requests arrive at 0. With a
    fixed 5 s, a prompt of 1,056 tokens at 6.35 ms a token (a 2-core AVX2 VM) overlapped the next warm-up and the
    measured requests, and the simulated tenants queued for 27 s where the live ones waited 0.7 s."""
    overhead = getattr(getattr(cost, "overheads", None), "request_s", 0.0)
    gaps = []
    for w in warm:
        n = len(w.prompt)
        served = overhead + cost.step_s(Batch(n, attention_pairs(n, 0), 1, n)) + \
            float(np.sum(cost.decode_steps_s(1, n, max(w.max_tokens - 1, 0))))
        gaps.append(max(5.0, 2.0 * served))
    t = 0.0
    for w, gap in reversed(list(zip(warm, gaps))):
        t -= gap
        w.at = t
    return warm


def cases(args: argparse.Namespace, cost) -> dict[str, tuple[Any, list, list]]:
    """name -> (cluster config, warm-up requests, measured requests)."""
    from bench.cluster_bench import (BLOCK, Req, block_bytes, long_answers, long_prompts, poisson, serve_config,
                                     tenants)
    from bench.replay_bench import DEFAULT_TRACE, load_trace, mooncake_requests
    out = {}
    _, rows = load_trace(DEFAULT_TRACE)
    trace = mooncake_requests(rows[:args.replay_requests], 16, args.max_input_tokens, args.max_output_tokens,
                              args.speedup)
    warm = one_at_a_time([Req(list(range(300, 340)), 2, tag="warm-up")], cost)
    out["replay"] = (serve_config("disaggregated", "prefix_aware", 1, 1, 256 << 20, min_remote=64), warm, trace)
    out["replay_colo"] = (serve_config("colocated", "prefix_aware", 0, 1, 256 << 20), warm, trace)
    rng = np.random.default_rng(2)
    streams, longs = long_answers(args.streams, rng), long_prompts(args.long_prompts, rng)
    poisson(streams, args.rate, rng)
    poisson(longs, args.rate * args.long_prompts / max(args.streams, 1), rng)
    out["pd"] = (serve_config("disaggregated", "prefix_aware", 1, 1, 256 << 20), warm,
                 sorted(streams + longs, key=lambda r: r.at))
    rng = np.random.default_rng(1)
    twarm, treqs = tenants(args.tenant_requests, args.prefix_tokens, rng)
    one_at_a_time(twarm, cost)
    poisson(treqs, args.rate, rng)
    kv = int(2.5 * args.prefix_tokens / BLOCK * block_bytes())
    for policy, name in (("prefix_aware", "tenants"), ("pow2", "tenants_pow2")):
        out[name] = (serve_config("disaggregated", policy, 2, 1, kv, min_remote=0, decode_kv_bytes=256 << 20),
                     twarm, treqs)
    return {k: v for k, v in out.items() if k in args.cases}


def measure(config, warm: list, reqs: list, slo: tuple[float, float]) -> dict[str, Any]:
    """One live run of a case: `baton bench`'s summary, the engines' queue and prefill phases of the measured
    requests from the replicas' histograms (`engine_phases_ms`, as the simulator reports them), and their
    engines' step counters over the same requests (`engine_steps`, plan/calibrate.py step_sums)."""
    from bench.cluster_bench import drive, summarize, with_cluster
    from cluster.live_metrics import scrape
    from plan.calibrate import phase_sums, step_sums
    from plan.sim import phase_means

    def work(base: str, model: str) -> dict:
        for w in warm:                                   # one at a time, as the simulator's warm-up runs them
            asyncio.run(drive(base, model, [type(w)(w.prompt, w.max_tokens)]))
        time.sleep(1.0)
        before = scrape(base, fresh=True)
        results, wall = asyncio.run(drive(base, model, reqs))
        after = scrape(base, fresh=True)
        return {**summarize(results, wall, *slo), "engine_phases_ms": phase_means(phase_sums(before, after)),
                "engine_steps": step_sums(before, after)}
    return with_cluster(config, work)


def _figure(run: dict, key: str, q: str | None) -> float | None:
    return run.get(key) if q is None else (run.get(key) or {}).get(q)


def _values(runs: list[dict]):
    """(key, quantile, the runs' values of that figure) for each compared figure."""
    for key, q in FIGURES:
        yield key, q, [v for v in (_figure(r, key, q) for r in runs) if v is not None]


def median_run(runs: list[dict]) -> dict:
    """One live run's figures from several (the first's, each compared figure the median over the runs): a p90 of
    a few dozen requests moves by more than the 15% goal from one run to the next on this machine."""
    out = json.loads(json.dumps(runs[0]))
    for key, q, vals in _values(runs):
        if vals:
            med = float(np.median(vals))
            if q is None:
                out[key] = med
            else:
                out.setdefault(key, {})[q] = med
    phases = [r["engine_phases_ms"] for r in runs if r.get("engine_phases_ms")]
    if phases:                                           # (live runs from before they were read: none)
        out["engine_phases_ms"] = {
            pool: {k: float(np.median(vals)) if (vals := [p[pool][k] for p in phases
                                                          if p.get(pool, {}).get(k) is not None]) else None
                   for k in ("queue", "queued", "prefill", "prefilled")}
            for pool in dict.fromkeys(pool for p in phases for pool in p)}
    return out


def phases_line(measured: dict | None, simulated: dict) -> str:
    """The engines' mean queue and prefill phases per pool, measured against simulated (ms)."""
    def one(run: dict | None, pool: str, k: str) -> str:
        v = ((run or {}).get("engine_phases_ms") or {}).get(pool, {}).get(k)
        return "-" if v is None else f"{v:.0f}"
    pools = dict.fromkeys([*((measured or {}).get("engine_phases_ms") or {}), *(simulated.get("engine_phases_ms") or {})])
    return "; ".join(f"{pool} queue {one(measured, pool, 'queue')} vs {one(simulated, pool, 'queue')}, prefill "
                     f"{one(measured, pool, 'prefill')} vs {one(simulated, pool, 'prefill')}" for pool in pools)


def spread(runs: list[dict]) -> dict[str, float | None]:
    """Per figure: (largest - smallest) / median over the live runs."""
    out = {}
    for key, q, vals in _values(runs):
        med = float(np.median(vals)) if vals else 0.0
        out[f"{key}{'.' + q if q else ''}"] = (max(vals) - min(vals)) / med if med else None
    return out


def errors(measured: dict, simulated: dict) -> dict[str, float | None]:
    out = {}
    for key, q in FIGURES:
        m, s = _figure(measured, key, q), _figure(simulated, key, q)
        out[f"{key}{'.' + q if q else ''}"] = (s - m) / m if m and s is not None else None
    return out


def validate(args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Each case measured live (or read from --measured) and simulated. With a calibrated cost model, each live
    run is simulated at the speed its engines stepped in that run (engine_speed(), from the replicas' step
    counters: measured seconds over the fit's for the same steps, the neighbours' slowdown as simulated taken
    out) as well as at the fit's: the first error is the simulator's, the second adds how far this machine
    drifted since its calibration. Each pool's own speed is reported (`pool_speeds`): simulating each pool at it
    was tried, and was no closer (docs/benchmarks.md)."""
    cost = load_cost(args.cost)
    slo = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    return {name: one_case(args, name, config, warm, reqs, cost, slo, log)
            for name, (config, warm, reqs) in cases(args, cost).items()}


def slowdowns(sims: list[dict]) -> dict[str, float]:
    """pool -> how many times as long its engines' steps took in simulation as alone (their neighbours' share of
    the cores, engine_steps_s): the median over the simulated runs."""
    pools = dict.fromkeys(p for s in sims for p in s.get("engine_steps_s", {}))
    return {p: float(np.median([s["engine_steps_s"][p]["stepped"] / s["engine_steps_s"][p]["alone"]
                                for s in sims if p in s.get("engine_steps_s", {})])) for p in pools}


def steps_line(runs: list[dict], cost: LinearCost, simulated: dict) -> str:
    """Per pool: the seconds the engines stepped and their steps, measured (median over the runs) and simulated,
    and the fit's seconds for the measured steps alone."""
    out = []
    for pool, sim in simulated.get("engine_steps_s", {}).items():
        got = [r["engine_steps"][pool] for r in runs if pool in (r.get("engine_steps") or {})]
        if got:
            alone = [fitted_s(cost, t) for t in got]
            out.append(f"{pool} {np.median([t['seconds'] for t in got]):.2f} vs {sim['stepped']:.2f} in "
                       f"{np.median([t['steps'] for t in got]):.0f} vs {sim['steps']} steps "
                       f"({np.median(alone):.2f} at the fit alone)")
    return "; ".join(out)


def one_case(args, name: str, config, warm: list, reqs: list, cost, slo, log) -> dict[str, Any]:
    if args.measured:                                # previous runs' live figures (same cases and flags): each run
        runs = []
        for f in args.measured:
            case = json.loads(Path(f).read_text())["cases"][name]
            runs += case.get("measured_runs") or [case["measured"]]
    elif args.simulate_only:
        runs = []
    else:
        runs = [measure(config, warm, reqs, slo) for _ in range(args.repeats)]
    bs = config.decode.engine.block_size or 16
    # what draws: Serve's power of two, and a step's spread (Overheads.step_jitter)
    seeds = args.sim_seeds if config.router.policy == "pow2" or cost.overheads.step_jitter > 0 else 1

    def simulated(speeds: list[float]) -> tuple[dict, list[dict]]:
        sims = [simulate(config, cost.at_speed(f) if f != 1.0 else cost, from_reqs(reqs, bs), slo,
                         warm=from_reqs(warm, bs), seed=s) for f in speeds for s in range(seeds)]
        for one in sims:
            one.pop("timeline")
            one.pop("ttft_points")
        return median_run(sims), sims
    t = time.perf_counter()
    sim, sims = simulated([1.0])
    sim_s = time.perf_counter() - t
    speeds = []
    if isinstance(cost, LinearCost):                     # (a GPU roofline does not scale with a CPU's drift)
        slow = slowdowns(sims)
        stepped = [r for r in runs if r.get("engine_steps")]
        speeds = [engine_speed(cost, [r["engine_steps"]], slow) for r in stepped]
        per_pool = [pool_speeds(cost, r["engine_steps"], slow) for r in stepped]
        if speeds:
            log(f"{name}: the engines stepped {', '.join(f'{v:.2f}' for v in speeds)}x as slowly as the fit in "
                f"the live runs (by pool: {'; '.join(_fmt(p) for p in per_pool)}; their neighbours' slowdown as "
                f"simulated, {_fmt(slow)}, taken out)")
    measured = median_run(runs) if runs else None
    res = {"requests": len(reqs), "measured": measured, "simulated": sim, "relative_error": None,
           "simulator_seconds": sim_s}
    if measured:
        res["relative_error"] = errors(measured, sim)
    if speeds and measured:                              # each run at its own speed: the simulator's own error
        res["simulated_at_fit"], res["relative_error_at_fit"] = sim, res["relative_error"]
        sim, sims = simulated(speeds)
        res["simulated"], res["relative_error"] = sim, errors(measured, sim)
        res["speeds"], res["pool_speeds"] = speeds, per_pool
    if seeds > 1:
        res["simulated_seeds"] = seeds
        res["simulated_spread"] = spread(sims)
    if len(runs) > 1:
        res["measured_runs"] = runs
        res["live_spread"] = spread(runs)
    err = res["relative_error"]
    if err:
        def line(e: dict) -> str:
            worst = max((abs(v) for v in e.values() if v is not None), default=None)
            return ", ".join(f"{k} {v:+.0%}" for k, v in e.items() if v is not None) + \
                (f" (worst {worst:.0%})" if worst is not None else "")
        log(f"{name}: {line(err)}" + (f"; at the speeds of the runs ({', '.join(f'{f:.2f}' for f in speeds)}x the "
                                       "fit's)" if speeds else ""))
        if speeds:
            log(f"{name}: at the fit's speed: {line(res['relative_error_at_fit'])}")
        log(f"{name}: engine phases in ms, measured vs simulated: {phases_line(measured, sim)}")
        if isinstance(cost, LinearCost) and (steps := steps_line(runs, cost, sim)):
            log(f"{name}: engine step seconds, measured vs simulated: {steps}")
    else:
        log(f"{name}: simulated {sim['ttft_ms']} TTFT, {sim['itl_ms']} ITL")
    return res


def _fmt(slow: dict[str, float]) -> str:
    return ", ".join(f"{p} {v:.2f}x" for p, v in slow.items()) or "none"


def plot(result: dict, path: Path) -> None:
    from bench.engine_bench import pyplot
    plt = pyplot()
    names = [n for n, c in result["cases"].items() if c["relative_error"]]
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(FIGURES)
    for j, (key, q) in enumerate(FIGURES):
        label = f"{key}{'.' + q if q else ''}"
        vals = [100 * (result["cases"][n]["relative_error"][label] or 0) for n in names]
        ax.bar(np.arange(len(names)) + j * width, vals, width, label=label)
    ax.axhspan(-100 * ERROR_GOAL, 100 * ERROR_GOAL, color="tab:green", alpha=0.1, label="goal")
    ax.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names)
    ax.set_ylabel("simulated vs measured (%)")
    ax.legend(fontsize=7, ncol=3)
    ax.set_title("baton plan validate: simulator errors per workload", fontsize=9)
    from bench.engine_bench import save
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost", default="bench_out/plan/cost.json", help="cost model from `baton plan calibrate`")
    names = ["replay", "replay_colo", "pd", "tenants", "tenants_pow2"]
    p.add_argument("--cases", nargs="+", default=names, choices=names)
    p.add_argument("--replay-requests", type=int, default=40, help="first N requests of the trace (default 40)")
    p.add_argument("--max-input-tokens", type=int, default=1024)
    p.add_argument("--max-output-tokens", type=int, default=32)
    p.add_argument("--speedup", type=float, default=0.5, help="replay: arrival times divided by this (default 0.5: "
                                                              "the trace's pace outruns two cores)")
    p.add_argument("--streams", type=int, default=12)
    p.add_argument("--long-prompts", type=int, default=6)
    p.add_argument("--tenant-requests", type=int, default=32)
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=200.0)
    p.add_argument("--simulate-only", action="store_true", help="no live runs: the simulator's figures only")
    p.add_argument("--measured", nargs="+", default=None, help="take the live figures from earlier validate.json "
                   "files (same cases and workload flags; several: each figure's median) instead of measuring again")
    p.add_argument("--repeats", type=int, default=1, help="live runs per case; each figure compared is their "
                                                          "median (default 1)")
    p.add_argument("--sim-seeds", type=int, default=9, help="simulated runs of a case that draws (routed by "
                   "power of two, or with a step's spread), each its own draws; each figure is their median, as the "
                   "live runs' (default 9)")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/plan")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> dict:
    import contextlib
    import sys

    import ray

    from bench.engine_bench import machine_info, make_logger, write_result
    from cluster.serving import init_ray
    log = make_logger("plan validate")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.redirect_stdout(sys.stderr):
        if not (args.simulate_only or args.measured):
            init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                     namespace="baton-plan-validate")
        try:
            res = validate(args, log)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    def within(key: str) -> tuple[int, int]:
        errs = [abs(v) for c in res.values() if c.get(key) for v in c[key].values() if v is not None]
        return sum(e <= ERROR_GOAL for e in errs), len(errs)
    (good, n), (good_fit, n_fit) = within("relative_error"), within("relative_error_at_fit")
    result = {"benchmark": "plan-validate", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "cost_model": str(args.cost), "cases": res,
              "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "error_goal": ERROR_GOAL,
              "within_goal": good, "figures": n}
    if n_fit:
        result["within_goal_at_fit"] = good_fit
    write_result(result, out_dir / "validate.json", {"validate": plot} if n else None)
    log(f"{good}/{n} figures within {ERROR_GOAL:.0%}" + (f" ({good_fit}/{n_fit} simulated at the fit's speed)"
                                                        if n_fit else "") + f"; wrote {result['json_path']}")
    return result
