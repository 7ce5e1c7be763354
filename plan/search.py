"""`baton plan search`: the cheapest cluster for a trace under SLOs, found with the simulator.

Given a trace (Mooncake's format; default the slice in bench/traces), a request rate to plan for (the trace's
requests re-timed, or tiled with fresh users where the trace is too short), a model, a GPU and TP size, and
SLOs (TTFT, mean ITL) with an attainment target (the share of requests meeting both, over the run and over its
last quarter's arrivals: a pool short of a sustained load passes a short run's start):
  colocated       the fewest replicas doing both (the baseline)
  disaggregated   for each prefill count near what the prompt load needs, the fewest decode replicas (bisection);
                  the cheapest pair in GPUs
Then, with --day, a day of the trace on the diurnal curve (plan/workload.py) with both pools autoscaling
(Baton's coupled policy, bounds from the plan), against the plan's fixed size at the peak: replica-hours and
attainment hour by hour. JSON, a table on stderr, and PNGs.

The cost model is a roofline of the GPU (plan/cost.py: H100/H200 presets; --mfu, --mbu, --step-overhead-ms) or a
calibrated one (--cost). Stated assumptions travel in the JSON.

Each run is one process's work; --workers (default one per core) runs ahead the runs the search may read next,
and the day's runs side by side, in worker processes. The answer does not depend on the number of workers.

--cells K plans a fleet of K identical clusters (plan/cells.py): the search finds one cell's replicas, each run
simulating every cell (or --simulate-cells of them), and each cell's day autoscales on its own. Routing is then
over a cell's replicas, and a sample of the cells stands for the fleet: a day at the 1,000-GPU scale takes
minutes, where one cluster of that size takes about an hour a run.
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cluster.config import ClusterConfig
from plan.cost import MODELS, Batch, Cost, RooflineCost, kv_value_bytes, load_cost, model_shape
from plan.cells import fleet_summary, simulate_fleet, split
from plan.sim import Tally, run_tally
from plan.workload import MOONCAKE_BLOCK, day_of, from_mooncake, iter_day


def cluster(mode: str, prefill: int, decode: int, engine: dict[str, Any], min_remote: int,
            autoscaling: dict[str, dict] | None = None) -> ClusterConfig:
    d: dict[str, Any] = {"mode": mode, "decode": {"engine": engine},
                         "disaggregation": {"min_remote_prefill_tokens": min_remote},
                         "admission": {"enabled": False}}     # sized for the demand: every request served
    if mode == "disaggregated":
        d["prefill"] = {"engine": engine}
    for pool, n in (("prefill", prefill), ("decode", decode)):
        if pool in d:
            if autoscaling and pool in autoscaling:
                d[pool]["autoscaling"] = autoscaling[pool]
            else:
                d[pool]["num_replicas"] = n
    return ClusterConfig.from_dict(d)


def at_rate(rows: list[dict], rps: float, seconds: float, seed: int) -> list[dict]:
    """The trace's requests at `rps` for `seconds`: Poisson arrivals, the trace's rows in order, tiled with
    fresh users (day_of with a flat curve)."""
    return day_of(rows, rps, hours=seconds / 3600, seed=seed, trough=1.0)


DAY_PROGRESS = 1_000_000         # a day's progress line every this many requests through the front balancer
MAX_REPLICAS = 20_000              # a search that passes this many replicas of a pool gives up

# What every run of one search (or day) shares, set before its worker processes fork from this one: they read it
# from their copy of this module, so the requests (up to millions) are never pickled.
_JOB: dict[str, Any] = {}


# Workers are forked: one starts at once, with _JOB and the imports already in its memory (the simulator runs no
# torch or BLAS op whose threads a fork could leave stuck). Only on Linux: macOS's system libraries are not safe
# to use in a forked child (Python spawns there by default), so elsewhere the runs go one after the other.
FORK = sys.platform.startswith("linux")


def _workers(n: int):
    """A pool of n processes forked from this one."""
    return multiprocessing.get_context("fork").Pool(n)


def default_workers() -> int:
    """One per core this process may run on; 1 where workers cannot be forked."""
    return len(os.sched_getaffinity(0)) if FORK else 1


def usable_workers(n: int) -> int:
    """The worker processes a run may use when asked for n: none beyond this one where they cannot be forked."""
    return max(1, n) if FORK else 1


def _simulate_row(mode: str, p: int, d: int) -> dict[str, Any]:
    """One candidate run (in a worker process, or in this one): its row of the search's table. With cells,
    p and d are a cell's replicas and the GPUs the fleet's."""
    j, t = _JOB, time.perf_counter()
    out = simulate_fleet(cluster(mode, p, d, j["engine"], j["min_remote"]), j["cost"], j["parts"], j["cells"], j["slo"])
    return {"mode": mode, "prefill": p, "decode": d, "gpus": (p + d) * cost_tp(j["cost"]) * j["cells"],
            "attainment": out["slo_attainment"], "attainment_last_quarter": out["slo_attainment_last_quarter"],
            "goodput_rps": out["goodput_rps"], "ttft_ms": out["ttft_ms"],
            "itl_ms": out["itl_ms"], "prefix_hit_rate": out["prefix_hit_rate"], "sim_s": time.perf_counter() - t}


def held(row: dict[str, Any]) -> float:
    """A run's share of requests within the SLOs, over the whole run and over its last quarter's arrivals,
    whichever is lower: a pool short of a sustained load passes a short run on its start (the queue grows through
    the run) and fails by the hour; its last arrivals show it (the 1,000-GPU plan's day did)."""
    return min(row["attainment"], row["attainment_last_quarter"])


def bisection_order(lo: int, hi: int, n: int) -> list[int]:
    """The first n points a bisection for the smallest passing value in [lo, hi] may test, breadth first: this
    step's middle, then the next step's for either outcome (the lower half's first: it follows a pass), and so on."""
    out, todo = [], [(lo, hi)]
    while todo and len(out) < n:
        a, b = todo.pop(0)
        if a < b:
            mid = (a + b) // 2
            out.append(mid)
            todo += [(a, mid), (mid + 1, b)]
    return out


class Planner:
    """The search. With `workers` > 1, runs the search may read next start ahead in worker processes while it waits
    for the one it reads now (the next doubling; the next bisection step of either outcome): the same runs are
    read in the same order, so the plan, the table and the log are those of one process, only sooner.

    With `cells` > 1 the fleet is that many copies of one cluster (plan/cells.py): the search finds a cell's
    replicas, and each run simulates `sample` of the cells (default all)."""

    def __init__(self, requests, cost: Cost, engine: dict[str, Any], slo: tuple[float, float], target: float,
                 min_remote: int, log: Callable[[str], None], workers: int = 1, cells: int = 1,
                 sample: int | None = None):
        self.requests, self.cost, self.engine, self.slo, self.target = requests, cost, engine, slo, target
        self.min_remote, self.log, self.cells = min_remote, log, max(cells, 1)
        self.parts = split(requests, self.cells)[:sample or self.cells]
        self.workers = usable_workers(workers)
        self.runs: list[dict[str, Any]] = []
        self._rows: dict[tuple, dict] = {}          # finished runs, by (mode, prefill, decode)
        self._ahead: dict[tuple, Any] = {}          # runs started ahead: AsyncResults
        self._pool = None
        self.started_ahead = 0

    def attainment(self, mode: str, p: int, d: int) -> dict[str, Any]:
        """The run's row, logged and kept in `runs` in the order the search reads them (a run started ahead is
        waited for; one read before is not run again)."""
        key = (mode, p, d)
        if key in self._ahead:
            self._rows[key] = self._ahead.pop(key).get()
        if key not in self._rows:
            self._share()
            self._rows[key] = _simulate_row(*key)
        row = dict(self._rows[key])
        self.runs.append(row)
        cells = f" x {self.cells} cells" if self.cells > 1 else ""
        self.log(f"{mode} {p}P+{d}D{cells}: {row['attainment']:.1%} within SLOs "
                 f"({row['attainment_last_quarter']:.1%} of the last quarter's arrivals), TTFT p90 "
                 f"{(row['ttft_ms'] or {}).get('p90', float('nan')):.0f} ms, ITL p90 "
                 f"{(row['itl_ms'] or {}).get('p90', float('nan')):.1f} ms ({row['sim_s']:.1f} s)")
        return row

    def ahead(self, keys) -> None:
        """Start runs the search may read next, in order, while fewer than `workers` are running (the one the
        search is about to read first: a worker runs it while this process waits)."""
        if self.workers == 1:
            return
        if self._pool is None:
            self._share()                           # before the workers fork: they read it
            self._pool = _workers(self.workers)
        for key in keys:
            if sum(not r.ready() for r in self._ahead.values()) >= self.workers:
                return
            if key not in self._rows and key not in self._ahead:
                self._ahead[key] = self._pool.apply_async(_simulate_row, key)
                self.started_ahead += 1

    def _share(self) -> None:
        _JOB.update(parts=self.parts, cells=self.cells, cost=self.cost, engine=self.engine, slo=self.slo,
                    min_remote=self.min_remote)

    def close(self) -> None:
        """Stop the workers: runs started ahead and never read are dropped."""
        if self._pool is not None:
            self.log(f"{self.started_ahead} runs started ahead in {self.workers} worker processes, "
                     f"{len(self._ahead)} of them not needed")
            self._pool.terminate()
            self._pool.join()
            self._pool, self._ahead = None, {}
        _JOB.clear()

    @property
    def tp(self) -> int:
        return cost_tp(self.cost)

    def fewest(self, key: Callable[[int], tuple], lo: int = 1) -> int:
        """The smallest n >= lo whose run (key(n): mode, prefill, decode) meets the target, by doubling then
        bisection (attainment taken as monotone in n). Gives up when three doublings in a row gain nothing
        (another pool is the bottleneck)."""
        def ok(n: int) -> bool:
            return held(self.attainment(*key(n))) >= self.target
        hi, flat, last = lo, 0, -1.0
        while True:
            self.ahead([key(hi << i) for i in range(self.workers) if hi << i <= 2 * MAX_REPLICAS])   # and the next
            row = self.attainment(*key(hi))
            if held(row) >= self.target:
                break
            flat = flat + 1 if held(row) <= last + 1e-9 else 0
            if flat >= 3 or hi > MAX_REPLICAS:
                raise RuntimeError(f"more replicas stop helping at {hi} ({held(row):.1%} within SLOs): "
                                   "another pool is the bottleneck, or one request alone misses the SLOs")
            last, lo, hi = held(row), hi + 1, hi * 2
        while lo < hi:
            mid = (lo + hi) // 2
            self.ahead([key(n) for n in bisection_order(lo, hi, self.workers)])
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi

    def estimate(self) -> tuple[int, int]:
        """Replicas the offered load needs at full use: prompt tokens/s over one replica's prefill rate; KV-bound
        decode sequences (Little's law) over what one replica's KV holds. A cell's, with cells."""
        reqs = self.requests
        span = (max(r.at for r in reqs) - min(r.at for r in reqs) or 1.0) * self.cells
        prompt_rate = sum(r.prompt for r in reqs) / span
        budget = self.engine.get("max_num_batched_tokens", 2048)
        per_prefill = budget / self.cost.step_s(Batch(budget, self.cost.pairs(budget, 0), 1, budget))
        mean_ctx = float(np.mean([r.prompt + r.output / 2 for r in reqs]))
        kv = self.cost.kv_tokens(self.engine.get("kv_cache_memory"), None, self.engine.get("block_size", 16))
        seqs = max(1, min(int(kv / mean_ctx), self.engine.get("max_num_seqs", 256)))
        step = self.cost.decode_steps_s(seqs, int(seqs * self.cost.kv_read(mean_ctx)), 1,
                                        seqs * (self.cost.kv_read(mean_ctx + 1) - self.cost.kv_read(mean_ctx)))[0]
        decode_rate = seqs / step / float(np.mean([r.output for r in reqs]))          # requests/s one replica ends
        return max(1, math.ceil(prompt_rate / per_prefill)), max(1, math.ceil(len(reqs) / span / decode_rate))

    def plan(self) -> dict[str, Any]:
        """Colocated: the fewest replicas. Disaggregated: the fewest prefill replicas with decode to spare (as
        many decode replicas as colocated needs), then the fewest decode replicas behind them; one more prefill
        replica is tried in case it lets decode shrink by more."""
        p0, d0 = self.estimate()
        self.log(f"load estimate: {p0} prefill and {d0} decode replicas at full use")
        try:
            colo = self.fewest(lambda n: ("colocated", 0, n), lo=max(1, (p0 + d0) // 2))
            colocated = {"replicas": colo, "gpus": colo * self.tp * self.cells}
        except RuntimeError as e:           # e.g. long prompts' chunks stall the decodes batched with them
            colo, colocated = None, {"replicas": None, "gpus": None, "why": str(e)}
            self.log(f"colocated: {e}")
        spare = max(colo or 0, d0 * 2)
        p = self.fewest(lambda n: ("disaggregated", n, spare), lo=max(1, p0 // 2))
        best = None
        for pp in (p, p + 1):
            d = self.fewest(lambda n: ("disaggregated", pp, n), lo=max(1, d0 // 2))
            if best is None or pp + d < sum(best):
                best = (pp, d)
        return {"colocated": colocated, "cells": self.cells,
                "disaggregated": {"prefill": best[0], "decode": best[1], "gpus": sum(best) * self.tp * self.cells}}


def day_run(rows: list[dict], cost: Cost, engine: dict[str, Any], peak_rps: float, plan: dict, slo, min_remote: int,
            startup_s: float, hours: float, seed: int, log, queued_s: float = 0.5, workers: int = 1,
            cells: int = 1, sample: int | None = None) -> dict[str, Any]:
    """A day on the diurnal curve: the plan's fixed size against both pools autoscaling up to it x 1.5, the
    prefill pool's queued-token target `queued_s` of prefill per replica. With cells, the plan is a cell's and
    every cell (or the first `sample` of them) runs its day and autoscales on its own. With workers > 1 the runs
    (fixed and autoscaled, each cell) go side by side in worker processes, each on its own copy of its requests
    (as in one process, where the copies are made one after the other)."""
    cells = max(cells, 1)
    if cells == 1:
        parts = [from_mooncake(day_of(rows, peak_rps, hours=hours, seed=seed))]
        total = len(parts[0])
    else:       # the rows stream through the front balancer: only the simulated cells' are kept
        seen = [0, None]

        def counted(it):
            for row in it:
                seen[0] += 1
                seen[1] = row["timestamp"] if seen[1] is None else seen[1]
                if seen[0] % DAY_PROGRESS == 0:
                    log(f"day: {seen[0]:,} requests through the front balancer (at {row['timestamp'] / 3.6e6:.1f} h)")
                yield row
        kept = split(counted(iter_day(rows, peak_rps, hours=hours, seed=seed)), cells, sample,
                     blocks=lambda row: row["hash_ids"], size=lambda row: row["input_length"] + row["output_length"])
        total, parts = seen[0], [from_mooncake(p, t0=seen[1]) for p in kept]
    log(f"day: {total:,} requests over {hours:g} h (peak {peak_rps:g} req/s)" +
        (f", {cells} cells, {len(parts)} simulated ({sum(map(len, parts)):,} requests)" if cells > 1 else ""))
    p, d = plan["disaggregated"]["prefill"], plan["disaggregated"]["decode"]
    scale = {"min_replicas": 1, "upscale_delay_s": 30, "downscale_delay_s": 600, "cooldown_s": startup_s + 30,
             "look_back_period_s": 60, "metrics_interval_s": 10}
    budget = engine.get("max_num_batched_tokens", 2048)
    queued = int(queued_s * budget / cost.step_s(Batch(budget, cost.pairs(budget, 0), 1, budget)))
    # the pools scale on their load signals (utilisation, queued prompt tokens, KV, running sequences), not on
    # p90 latency: at a plan sized for 90% attainment the p90 TTFT sits at the SLO, which would hold the pools
    # at their maximum all day (the first day run showed it)
    runs = {"fixed": None, "autoscaled": {
        "prefill": {**scale, "max_replicas": math.ceil(p * 1.5), "initial_replicas": 1, "ttft_slo_s": 0,
                    "target_queued_prefill_tokens": max(queued, 1)},      # seconds of this GPU's prefill
        "decode": {**scale, "max_replicas": math.ceil(d * 1.5), "initial_replicas": 1, "itl_slo_s": 0}}}
    _JOB.update(parts=parts, day_clusters={name: cluster("disaggregated", p, d, engine, min_remote, auto)
                                           for name, auto in runs.items()},
                cost=cost, seed=seed, startup_s=startup_s, hours=hours, log=log, cells=cells)
    jobs = [(name, i) for name in runs for i in range(len(parts))]
    if usable_workers(workers) > 1:
        with _workers(min(workers, len(jobs))) as pool:
            done = pool.starmap(_day_one, jobs)
    else:
        done = [_day_one(*job) for job in jobs]
    _JOB.clear()
    out = {}
    for name in runs:
        tallies = [tl for (n, _), (tl, _) in zip(jobs, done) if n == name]
        merged = Tally.merge(tallies)
        s = fleet_summary(merged, cells, len(tallies), slo)
        good = merged.good(slo)
        hourly = []
        for h in range(int(math.ceil(hours))):
            inside = (merged.at >= h * 3600) & (merged.at < (h + 1) * 3600)
            hourly.append({"hour": h, "requests": round(int(inside.sum()) * cells / len(parts)),
                           "attainment": int((good & inside).sum()) / max(int(inside.sum()), 1)})
        s.update(hourly=hourly, gpu_hours=sum(s["replica_seconds"].values()) * cost_tp(cost) / 3600,
                 sim_s=sum(sec for (n, _), (_, sec) in zip(jobs, done) if n == name))
        log(f"day {name}: {s['slo_attainment']:.1%} within SLOs, {s['gpu_hours']:,.0f} GPU-hours, "
            f"simulated in {s['sim_s']:.0f} s")
        out[name] = s
    return out


def _day_one(name: str, cell: int) -> tuple[Tally, float]:
    """One cell's run of the day (in a worker process, or in this one): its tally and the seconds it took. Its
    progress lines are logged where it runs (the CLI's log writes to stderr from any process)."""
    j, t = _JOB, time.perf_counter()
    where = f"day {name}" + (f", cell {cell}" if j["cells"] > 1 else "")
    tally = run_tally(j["day_clusters"][name], j["cost"], j["parts"][cell], seed=j["seed"],
                       startup_s=j["startup_s"], horizon_s=j["hours"] * 3600,
                       progress=lambda m: j["log"](f"{where}: {m}"))
    return tally, time.perf_counter() - t


def cost_tp(cost: Cost) -> int:
    return getattr(cost, "tp", 1)


def plot(result: dict, path: Path) -> None:
    from bench.engine_bench import pyplot, save
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    runs = result["runs"]
    colo = sorted((r["gpus"], held(r)) for r in runs if r["mode"] == "colocated")
    ax.plot(*zip(*colo), "o-", label="colocated") if colo else None
    for p in sorted({r["prefill"] for r in runs if r["mode"] == "disaggregated"}):
        pts = sorted((r["gpus"], held(r)) for r in runs if r["mode"] == "disaggregated" and r["prefill"] == p)
        ax.plot(*zip(*pts), "s--", label=f"{p} prefill + n decode", alpha=0.8)
    ax.axhline(result["target_attainment"], color="tab:red", linestyle=":", label="target")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("within both SLOs (the lower of all and the last quarter)")
    ax.set_title(f"{result['model']} on {result['gpu']}, {result['rps']:g} req/s", fontsize=9)
    ax.legend(fontsize=7)
    save(fig, path)


def plot_day(result: dict, path: Path) -> None:
    from bench.engine_bench import pyplot, save
    plt = pyplot()
    day = result["day"]
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    tl = day["autoscaled"]["timeline"]
    if tl:
        t = [x["t"] / 3600 for x in tl]
        for pool in ("prefill", "decode"):
            a.plot(t, [x.get(f"{pool}_replicas", 0) for x in tl], label=f"{pool} replicas (autoscaled)")
    cells = result["plan"].get("cells", 1)          # the timeline counts the fleet's replicas
    p, d = (result["plan"]["disaggregated"][k] * cells for k in ("prefill", "decode"))
    a.axhline(p, color="tab:blue", linestyle=":", label="prefill (fixed)")
    a.axhline(d, color="tab:orange", linestyle=":", label="decode (fixed)")
    a.set_ylabel("replicas")
    a.legend(fontsize=7)
    for name in ("fixed", "autoscaled"):
        h = day[name]["hourly"]
        b.plot([x["hour"] + 0.5 for x in h], [x["attainment"] for x in h], "o-", label=name)
    b.set_xlabel("hour of the day")
    b.set_ylabel("within SLOs")
    b.legend(fontsize=7)
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from bench.replay_bench import DEFAULT_TRACE
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE), help="a Mooncake-format trace (default: the slice "
                                                                        "in bench/traces)")
    p.add_argument("--rps", type=float, default=None, help="plan for this many requests/s (default: the trace's "
                                                           "own rate)")
    p.add_argument("--seconds", type=float, default=120.0, help="simulated load per candidate (default 120 s)")
    p.add_argument("--model", default="llama-3.1-8b", help=f"a preset ({', '.join(MODELS)}) or a config.json / "
                                                           "model directory")
    p.add_argument("--gpu", default="h100", choices=["h100", "h200"])
    p.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallel)")
    p.add_argument("--mfu", type=float, default=0.5, help="roofline: share of peak FLOP/s reached (default 0.5)")
    p.add_argument("--mbu", type=float, default=0.75, help="roofline: share of HBM bandwidth reached (default 0.75)")
    p.add_argument("--step-overhead-ms", type=float, default=3.0, help="roofline: fixed cost of a step (default 3)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"],
                   help="roofline: the KV cache's format (auto: bf16; fp8/int8: a byte a value plus its scale)")
    p.add_argument("--cost", default=None, help="a cost model file instead (`baton plan calibrate`)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--min-remote-prefill-tokens", type=int, default=512)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-itl-ms", type=float, default=100.0)
    p.add_argument("--target", type=float, default=0.9, help="share of requests within both SLOs (default 0.9)")
    p.add_argument("--day", action="store_true", help="also a day of the trace on a diurnal curve peaking at --rps, "
                                                      "fixed at the plan against autoscaled")
    p.add_argument("--day-hours", type=float, default=24.0)
    p.add_argument("--queued-target-s", type=float, default=0.5,
                   help="day: the prefill pool's target_queued_prefill_tokens as seconds of one replica's prefill "
                        "(default 0.5, the knob's default meaning)")
    p.add_argument("--startup-s", type=float, default=120.0, help="a new replica's start-up (default 120 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=default_workers(),
                   help="processes the search's and the day's runs use (default: one per core; Linux only, elsewhere "
                        "1); the answer is the same for any number")
    p.add_argument("--cells", type=int, default=1,
                   help="the fleet as this many identical clusters behind a front load balancer (plan/cells.py); "
                        "the plan is one cell's replicas (default 1: one cluster)")
    p.add_argument("--simulate-cells", type=int, default=None,
                   help="simulate only this many of the cells and scale their rates and replica-hours to the fleet "
                        "(default: all)")
    p.add_argument("--day-simulate-cells", type=int, default=None,
                   help="the same for the day (default: as --simulate-cells); a day's cell holds a million requests "
                        "at the 1,000-GPU scale, so one cell stands for the fleet and the day takes minutes")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/plan")
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> dict:
    from bench.engine_bench import make_logger, write_result
    from bench.replay_bench import load_trace
    log = make_logger("plan search")
    started = time.perf_counter()
    fmt, rows = load_trace(args.trace)
    if fmt != "mooncake":
        raise SystemExit("baton plan search: a Mooncake-format trace (timestamp, input_length, output_length, hash_ids)")
    own = len(rows) / max((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1e3, 1e-9)
    rps = args.rps or own
    if args.cost:
        cost = load_cost(args.cost)
    else:
        shape = model_shape(args.model)
        cost = RooflineCost(gpu=args.gpu, model=shape, tp=args.tp, mfu=args.mfu, mbu=args.mbu,
                            step_overhead_s=args.step_overhead_ms / 1e3,
                            kv_bytes_per_value=kv_value_bytes(args.kv_cache_dtype, shape))
    engine = {"block_size": MOONCAKE_BLOCK, "max_num_seqs": args.max_num_seqs,
              "max_num_batched_tokens": args.max_num_batched_tokens}
    if isinstance(cost, RooflineCost):
        engine["kv_cache_memory"] = 0.9
    requests = from_mooncake(at_rate(rows, rps, args.seconds, args.seed))
    sample = args.simulate_cells or args.cells
    day_sample = args.day_simulate_cells or sample
    if args.cells < 1 or not (1 <= sample <= args.cells and 1 <= day_sample <= args.cells):
        raise SystemExit("baton plan search: --cells must be at least 1, and --simulate-cells and "
                         "--day-simulate-cells between 1 and --cells")
    log(f"{len(requests):,} requests at {rps:g} req/s for {args.seconds:g} s; cost model: {cost.name}" +
        (f"; {args.cells} cells, {sample} simulated" if args.cells > 1 else ""))
    slo = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    planner = Planner(requests, cost, engine, slo, args.target, args.min_remote_prefill_tokens, log, args.workers,
                      args.cells, sample)
    try:
        plan = planner.plan()
    finally:
        planner.close()
    colo, dis = plan["colocated"], plan["disaggregated"]
    per = f" a cell, x {args.cells} cells" if args.cells > 1 else ""
    log("plan: colocated " + (f"{colo['replicas']} replicas{per} ({colo['gpus']} GPUs)" if colo["gpus"] else
                               "cannot meet the target") +
        f"; disaggregated {dis['prefill']} prefill + {dis['decode']} decode{per} ({dis['gpus']} GPUs)")
    result: dict[str, Any] = {
        "benchmark": "plan-search", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "trace": str(args.trace), "trace_rps": own, "rps": rps, "seconds": args.seconds, "requests": len(requests),
        "model": cost.model.get("name", args.model) if isinstance(cost, RooflineCost) else cost.name,
        "gpu": args.gpu if isinstance(cost, RooflineCost) else "calibrated", "tp": cost_tp(cost),
        "cost_model": cost.to_dict(), "engine": engine, "min_remote_prefill_tokens": args.min_remote_prefill_tokens,
        "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "target_attainment": args.target,
        "cells": args.cells, "cells_simulated": sample, "plan": plan, "runs": planner.runs,
        "day_cells_simulated": day_sample if args.day else None,
        "assumptions": [
            "prompts and outputs have the trace's lengths; outputs run to their length (ignore_eos)",
            "prefix sharing as the trace's hash ids say, at their 512-token granularity (the simulator's KV block)",
            "step costs from the roofline: max(FLOPs / (peak x mfu), bytes / (HBM x mbu)) + a fixed step overhead, "
            "plus TP's two all-reduces a layer (a ring over NVLink at the cost model's link efficiency, plus a fixed "
            "latency, not overlapped with compute)" if isinstance(cost, RooflineCost) else
            "step costs from the calibrated model (--cost), fitted to measured steps",
            "KV: 90% of the replica's HBM less the bf16 weights; KV pulls at the cost model's bandwidth",
            "no failures, LoRA, speculative decoding or host KV tier"] + ([
            f"the fleet is {args.cells} identical cells (a cell: one cluster with its own routers, prefix index and "
            "autoscaling) behind a front balancer that keeps a conversation in its cell and evens the tokens sent; "
            "replica counts are a cell's, GPUs the fleet's" + (
                f"; {sample} of the cells simulated in the search, their rates and replica-hours scaled by "
                f"{args.cells}/{sample}" if sample < args.cells else "") + (
                f"; {day_sample} of the cells simulated in the day" if args.day and day_sample < args.cells else "")]
            if args.cells > 1 else []),
    }
    plots = {"plan": plot}
    if args.day:
        result["day"] = day_run(rows, cost, engine, rps, plan, slo, args.min_remote_prefill_tokens, args.startup_s,
                                args.day_hours, args.seed, log, args.queued_target_s, args.workers, args.cells,
                                day_sample)
        plots["day"] = plot_day
    result["seconds_taken"] = time.perf_counter() - started
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_result(result, out_dir / f"plan_{args.gpu}_{int(rps)}rps.json", plots)
    log(f"wrote {result['json_path']} in {result['seconds_taken']:.0f} s")
    return result
