"""`baton plan calibrate`: a LinearCost for this machine from the engine's own step timings.

1. Steps: the real engine (the cluster config's pool engine, as a replica builds it, on the torch threads Ray
   gives a replica: OMP_NUM_THREADS is its whole CPUs, 1 with none) runs a grid of batches:
   prompts alone and behind a cached prefix (prefill chunks), and decode batches of 1 to 32 sequences at short
   and long contexts. Each step's shape (the scheduler's batch) and its time are recorded; least squares fits
   step = c0 + c_tok T + c_attn A + c_seq S (plan/cost.py).
2. Contention: the same decode batches again while another process runs prompts on its own engine; the
   slowdown says how much two replicas sharing these cores slow each other (`contention`). Step 3 measures it
   again where it matters, served (the ingress, the proxy and the client share the cores too), and keeps that
   figure: 4 streams decode alone, then while the prefill replica computes long prompts; the decode engine's
   step counters give its steps' slowdown (`contention`) and that of the serving work between them, its step
   period less its steps (`serving_contention`).
3. Overheads: a local disaggregated cluster (1 prefill + 1 decode replica) serves requests one at a time through
   the HTTP API, then 8 at once. The token gaps at batch 1 and 8 against the fitted steps are what streaming adds
   per step and per token (`step_s`, `token_s`); the TTFT of prompts the decode replica prefills itself, less
   that step, is the ingress overhead (`request_s`); the TTFT of prompts prefilled remotely, less that, the
   prefill step, the pull and the decode step that streams the first token, is the hand-off's (`handoff_s`).
   Bursts of 8 local prompts sent at once: the spacing at which the simulator gives their TTFTs, fastest to
   slowest, is the serial part of the serving path's work (`ingress_s`). Last, local prompts again while 8
   answers stream: their TTFT less their engine phases (the replicas' histograms), against the same alone, is
   what each stream adds to the serving path (`stream_s`).
The cluster's engines count their steps' seconds and shapes (replica/metrics.py STEP_COUNTERS): over the requests
served one at a time, against the fit's seconds for the same shapes, they say how slowly the machine ran in those
minutes (a VM's speed drifts by more than the simulator's error goal from one quarter of an hour to the next), so
the overheads are solved at that speed and kept at the fit's (engine_speed()).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from plan.cost import Batch, LinearCost, Overheads, attention_pairs, save_cost
from replica.names import DECODE, PREFILL

VOCAB = (200, 40000)
LOCAL_PROMPT = 40           # tokens: under the calibration cluster's min_remote_prefill_tokens (64)
STREAMS = 8                 # answers streaming while local prompts are timed (stream_s)
Z90 = 1.2815515655446004    # the standard normal's 90th percentile
BESIDE_S = 4.0              # seconds 4 streams decode alone before long prompts join them (contention)
BURST = 8                   # local prompts sent at once, three times (the serving path's serial part, ingress_s)
REMOTE_PROMPT = 256         # tokens: prefilled by the prefill replica


def _engine(config) -> Any:
    from engine.llm_engine import LLMEngine
    return LLMEngine(config)


def step_timings(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[Batch, float]]:
    """Run `prompts` to completion on `engine`, recording each step's batch shape and wall time."""
    from engine import SamplingParams
    rows: list[tuple[Batch, float]] = []
    sched = engine.scheduler
    schedule = sched.schedule
    seen: list = []

    def recording():
        out = schedule()
        seen.append(Batch(*out.shape()))
        return out
    sched.schedule = recording
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            seen.clear()
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
            if seen and seen[-1].tokens:
                rows.append((seen[-1], dt))
    finally:
        sched.schedule = schedule
    return rows


def grid(engine, rng: np.random.Generator, log: Callable[[str], None], quick: bool = False) -> list[tuple[Batch, float]]:
    rows: list[tuple[Batch, float]] = []
    step_timings(engine, [rng.integers(*VOCAB, 64).tolist()], 4)               # first-use costs, not recorded
    lengths = (32, 128, 512, 1024) if quick else (16, 32, 64, 128, 256, 512, 768, 1024, 1536)
    for n in lengths:                                          # prefill alone
        rows += step_timings(engine, [rng.integers(*VOCAB, n).tolist()], 1)
    prefix = rng.integers(*VOCAB, 1024).tolist()
    step_timings(engine, [prefix + [7]], 1)
    for n in (32, 256) if quick else (16, 64, 256, 512):       # behind a cached 1,024-token prefix
        rows += step_timings(engine, [prefix + rng.integers(*VOCAB, n).tolist()], 1)
    log(f"prefill: {len(rows)} steps")
    for ctx in (32, 512) if quick else (32, 256, 1024):        # decode batches (their prompts' steps count too)
        for b in (1, 4, 16) if quick or ctx > 512 else (1, 2, 4, 8, 16, 32):
            rows += step_timings(engine, [rng.integers(*VOCAB, ctx).tolist() for _ in range(b)], 8 if quick else 16)
        log(f"decode at context {ctx}: {len(rows)} steps")
    return rows


def replica_threads(num_cpus: float) -> int:
    """The torch threads a replica runs with: Ray sets OMP_NUM_THREADS to its whole CPUs, 1 when it has none."""
    return max(int(num_cpus), 1)


def _busy_neighbour(config, stop, threads: int) -> None:
    """Another replica's work on the same cores: prompts on an engine of its own until told to stop."""
    import torch
    torch.set_num_threads(threads)
    engine = _engine(config)
    rng = np.random.default_rng(1)
    while not stop.is_set():
        step_timings(engine, [rng.integers(*VOCAB, 512).tolist()], 1)


def contention(config, engine, cost: LinearCost, rng: np.random.Generator, log: Callable[[str], None],
               threads: int) -> float:
    """(decode step time with a busy neighbour / alone - 1), from the fitted cost of the same steps."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    p = ctx.Process(target=_busy_neighbour, args=(config, stop, threads), daemon=True)
    p.start()
    try:
        time.sleep(15)                                         # its engine loads, then it computes
        rows = []
        for b in (1, 4, 16):
            rows += step_timings(engine, [rng.integers(*VOCAB, 128).tolist() for _ in range(b)], 24)
    finally:
        stop.set()
        p.join(60)
    ratio = float(np.median([s / cost.step_s(b) for b, s in rows]))
    log(f"contention: steps take {ratio:.2f}x as long beside a busy engine")
    return max(ratio - 1.0, 0.0)


def contention_beside(cost: LinearCost, alone: dict, beside: dict, prefill_speed: float) -> tuple[float, float]:
    """(contention, serving_contention) per busy neighbour, from the decode engine's step counters over two windows
    of the same streams (step_window(): the pool's step sums and the wall seconds between its reports), decoding
    alone and then while the prefill replica computes long prompts:
    - its steps against the fit's for them, beside over alone, less 1, over the share of the window the prefill
      engine was busy (its own step seconds over the window), with the prefill engine's steps against the fit at
      its speed alone (`prefill_speed`) beside a decode engine busy all along: the mean of the two is `contention`;
    - its step period (the window over its steps) less its mean step is the serving work each step waits for
      (the engine loop streaming the step's tokens); beside over alone, less 1, over the same share, is
      `serving_contention`."""
    (a, wa), (b, wb) = alone[DECODE], beside[DECODE]
    p = beside[PREFILL][0]
    busy = min(p["seconds"] / wb, 1.0)

    def ratio(t: dict) -> float:
        return t["seconds"] / fitted_s(cost, t)
    decode = (ratio(b) / ratio(a) - 1.0) / busy
    prefill = ratio(p) / prefill_speed - 1.0
    serving_a = wa / a["steps"] - a["seconds"] / a["steps"]
    serving_b = wb / b["steps"] - b["seconds"] / b["steps"]
    serving = (serving_b / serving_a - 1.0) / busy if serving_a > 0 else 0.0
    return max((decode + prefill) / 2, 0.0), max(serving, 0.0)


def step_window(before: dict[str, float], after: dict[str, float]) -> dict[str, tuple[dict[str, float], float]]:
    """pool -> (its step sums between two scrapes, step_sums(), and the seconds between its replicas' reports
    read by them): a pool of one replica."""
    from cluster.live_metrics import replica_gauges
    t0, t1 = (replica_gauges(m, "baton_replica_metrics_timestamp_seconds") for m in (before, after))
    walls = {}
    for key, t in t1.items():
        walls.setdefault(key.split("/")[0], t - t0.get(key, t))
    return {pool: (sums, walls[pool]) for pool, sums in step_sums(before, after).items()}


def overheads(ov: Overheads, cost: LinearCost, log: Callable[[str], None]) -> Overheads:
    """From a live 1 + 1 cluster: requests one at a time, prefilled remotely and by the decode replica (their
    TTFTs, and the token gap at batch 1), then 8 streams at once (the gap at batch 8); fit_overheads solves them.
    The engines' steps while requests came one at a time, against the fit's seconds for them, give the machine's
    speed in those minutes: the overheads are solved at it and kept at the fit's (cost.fit["serving_speed"])."""
    import asyncio

    from bench.cluster_bench import Req, drive, serve_config, with_cluster
    from cluster.live_metrics import pool_total, scrape
    rng = np.random.default_rng(2)
    alone = [Req(rng.integers(*VOCAB, REMOTE_PROMPT).tolist(), 16, at=2.0 * i) for i in range(6)]
    # prompts under min_remote_prefill_tokens: the decode replica prefills them (no hand-off, no pull)
    local = [Req(rng.integers(*VOCAB, LOCAL_PROMPT).tolist(), 16, at=1.0 * i) for i in range(6)]
    together = [Req(rng.integers(*VOCAB, 64).tolist(), 48) for _ in range(8)]
    # 4 streams decoding alone, then while the prefill replica computes 1,024-token prompts (the streams outlast
    # them; one token each, so that no answer joins the streams)
    beside_streams = [Req(rng.integers(*VOCAB, 64).tolist(), 900) for _ in range(4)]
    beside_prompts = [Req(rng.integers(*VOCAB, 1024).tolist(), 1) for _ in range(3)]
    # local prompts while STREAMS answers stream, their prompts prefilled remotely so that the decode pool's
    # prefill histogram holds only the local ones, and no stream ends between the two scrapes around them
    streaming = [Req(rng.integers(*VOCAB, 128).tolist(), 400) for _ in range(STREAMS)]
    under = [Req(rng.integers(*VOCAB, LOCAL_PROMPT).tolist(), 2, at=0.5 * i) for i in range(8)]
    # bursts of local prompts sent at once: how far apart the serving path delivers them (ingress_s)
    bursts = [Req(rng.integers(*VOCAB, LOCAL_PROMPT).tolist(), 2, at=2.0 * k) for k in range(3) for _ in range(BURST)]

    def streaming_while(base: str, model: str, streams: list, n: int):
        """Start `streams` in a thread; return it once the decode pool runs `n` of them."""
        import threading
        t = threading.Thread(target=lambda: asyncio.run(drive(base, model, streams)), daemon=True)
        t.start()
        deadline = time.monotonic() + 300
        while pool_total(scrape(base), "baton_num_requests_running", DECODE) < n:
            if time.monotonic() > deadline or not t.is_alive():
                raise RuntimeError(f"the calibration cluster never ran {n} streams at once")
            time.sleep(0.2)
        return t

    def loaded(base: str, model: str):
        t = streaming_while(base, model, streaming, STREAMS)
        before = scrape(base, fresh=True)
        res = asyncio.run(drive(base, model, under))[0]
        sums = phase_sums(before, scrape(base, fresh=True))
        t.join()
        return res, sums

    def beside(base: str, model: str):
        t = streaming_while(base, model, beside_streams, len(beside_streams))
        first = scrape(base, fresh=True)
        time.sleep(BESIDE_S)
        second = scrape(base, fresh=True)
        asyncio.run(drive(base, model, beside_prompts))
        third = scrape(base, fresh=True)
        # the streams must outlast the window (a faster engine once ended them before the prompts came, and the
        # contention measured nothing)
        lasted = pool_total(third, "baton_num_requests_running", DECODE) >= len(beside_streams)
        t.join()
        return (step_window(first, second), step_window(second, third)) if lasted else None

    def work(base: str, model: str):
        asyncio.run(drive(base, model, [Req(list(range(300, 340)), 2)]))
        out, phases, steps = [], [], []
        for reqs in (alone, local, together, bursts):
            before = scrape(base, fresh=True)
            out.append(asyncio.run(drive(base, model, reqs))[0])
            after = scrape(base, fresh=True)
            phases.append(engine_phase_s(before, after))
            steps.append(step_sums(before, after))
        return out, phases, steps, beside(base, model), loaded(base, model)
    config = serve_config("disaggregated", "prefix_aware", 1, 1, 256 << 20, min_remote=64)
    (one, here, eight, burst), phases, steps, windows, (under_res, under_sums) = with_cluster(config, work)
    # one request at a time: the engines rarely step together, so their steps against the fit's are the speed
    factor = engine_speed(cost, [steps[0], steps[1]])
    cost.fit["serving_speed"] = factor
    log(f"the cluster's engines stepped {factor:.2f}x as slowly as the fit while requests came one at a time: the "
        "overheads are solved at that speed and kept at the fit's")
    now = cost.at_speed(factor)
    ok = [r for r in one if r.ok and r.ttft is not None and len(r.itls) > 2]
    near = [r for r in here if r.ok and r.ttft is not None]
    batch = [r for r in eight if r.ok and len(r.itls) > 8]
    if not ok or not near or not batch:
        raise RuntimeError(f"the calibration cluster served no request: {[r.error for r in one + here + eight]}")
    gap1 = float(np.median([x for r in ok for x in r.itls[1:]]))
    gaps8 = [x for r in batch for x in r.itls[4:-4]]
    gap8 = float(np.median(gaps8))
    ov.step_jitter = step_jitter(gaps8)
    log(f"8 streams' token gaps: p90 {np.percentile(gaps8, 90) * 1e3:.1f} ms over "
        f"p50 {gap8 * 1e3:.1f} ms, a step's spread of sigma {ov.step_jitter:.3f}")
    local_ttft, remote_ttft = float(np.median([r.ttft for r in near])), float(np.median([r.ttft for r in ok]))
    # the engines' own time to the first token in the same runs (the prefill replica's for the remote prompts,
    # the decode replica's for the local ones), not the fit's: this VM's speed drifts by more than the overheads
    local_engine, remote_engine = phases[1].get(DECODE), phases[0].get(PREFILL)
    # the gaps' medians are a step's modelled time times the spread's median, exp(-sigma^2 / 2): the mean is solved
    mean = float(np.exp(0.5 * ov.step_jitter ** 2))
    fit_overheads(ov, now, local_ttft, remote_ttft, gap1 * mean, gap8 * mean, local_engine_s=local_engine,
                  remote_engine_s=remote_engine)
    # the serving path's serial part: the bursts' TTFTs, fastest to slowest, against the simulator's for each
    ttfts = [[r.ttft for r in burst[k * BURST:(k + 1) * BURST]] for k in range(3)]
    if all(t is not None for b in ttfts for t in b):
        ov.ingress_s = fit_ingress(now, ov, config, bursts[:BURST], ttfts)
        seen = ", ".join(f"{t * 1e3:.0f}" for t in np.sort(ttfts, axis=1).mean(axis=0))
        log(f"{BURST} local prompts at once, three times: TTFTs {seen} ms fastest to slowest; the serving path takes "
            f"them one after another, {ov.ingress_s * 1e3:.1f} ms each")
    # contention, served: the decode engine's steps and step period while the prefill replica computes, against
    # the same streams' alone
    try:
        if windows is None:
            raise ValueError("the streams ended before the long prompts did")
        cost.contention, cost.serving_contention = contention_beside(
            cost, *windows, engine_speed(cost, [{PREFILL: steps[0][PREFILL]}]))
        log(f"served contention per busy neighbour: engine steps {cost.contention:.2f}, the serving work around "
            f"them {cost.serving_contention:.2f}")
    except (ValueError, KeyError, ZeroDivisionError) as e:
        log(f"served contention not measured ({e!r}): the engines' own ({cost.contention:.2f}) is kept for both")
        cost.serving_contention = cost.contention
    # the serving path carrying streams: the local prompts' TTFT less their engine phases, against the same alone
    q, nq, f, nf = under_sums[DECODE]
    timed = [r.ttft for r in under_res if r.ok and r.ttft is not None]
    if timed and nq and nf and local_engine:
        alone_out, loaded_out = local_ttft - local_engine, float(np.median(timed)) - (q / nq + f / nf)
        ov.stream_s = max((loaded_out - alone_out) / STREAMS, 0.0)
        log(f"the serving path carrying {STREAMS} streams: {LOCAL_PROMPT}-token prompts' TTFT p50 "
            f"{np.median(timed) * 1e3:.1f} ms, {(q / nq + f / nf) * 1e3:.1f} ms of it in the engine "
            f"({loaded_out * 1e3:.1f} ms outside it, {alone_out * 1e3:.1f} ms alone): "
            f"{ov.stream_s * 1e3:.2f} ms more per stream")
    s = shapes(now, ov)
    def engine(fitted: float, got: float | None) -> str:
        return f"{fitted * 1e3:.1f} ms fitted, " + (f"{got * 1e3:.1f} ms measured" if got else "not measured")
    log(f"TTFT p50 {local_ttft * 1e3:.1f} ms for {LOCAL_PROMPT}-token prompts the decode replica prefills (its step "
        f"{engine(s['local'], local_engine)}), {remote_ttft * 1e3:.1f} ms for {REMOTE_PROMPT}-token ones prefilled "
        f"remotely (prefill {engine(s['prefill'], remote_engine)}, pull {s['pull'] * 1e3:.1f} ms, decode step "
        f"{s['step1'] * 1e3:.1f} ms)")
    log(f"overheads: request {ov.request_s * 1e3:.1f} ms, hand-off {ov.handoff_s * 1e3:.1f} ms; served gaps "
        f"{gap1 * 1e3:.1f} ms at batch 1 and {gap8 * 1e3:.1f} ms at 8 against steps of {s['step1'] * 1e3:.1f} and "
        f"{s['step8'] * 1e3:.1f} ms: serving adds {ov.step_s * 1e3:.2f} ms a step + {ov.token_s * 1e3:.2f} ms a token")
    kept = ov.at_speed(1.0 / factor)                    # the CPU work at the fit's speed
    if factor != 1.0:
        log(f"at the fit's speed: request {kept.request_s * 1e3:.1f} ms, hand-off {kept.handoff_s * 1e3:.1f} ms, "
            f"{kept.step_s * 1e3:.2f} ms a step, {kept.token_s * 1e3:.2f} ms a token, "
            f"{kept.stream_s * 1e3:.2f} ms a stream")
    return kept


def step_jitter(gaps: list[float]) -> float:
    """The sigma of a lognormal with the gaps' p90 over their p50 (Overheads.step_jitter): 0 for gaps with no tail."""
    if len(gaps) < 10:
        return 0.0
    p50, p90 = np.percentile(gaps, [50, 90])
    return max(float(np.log(p90 / p50)) / Z90, 0.0) if p50 > 0 else 0.0


def fit_ingress(cost: LinearCost, ov: Overheads, config, burst: list, ttfts: list[list[float]],
                grid: np.ndarray = np.arange(0.0, 0.1001, 0.001)) -> float:
    """Overheads.ingress_s from bursts of `burst`'s prompts sent at once: the spacing (on `grid`) at which the
    simulator, with the other overheads `ov` and the steps of `cost`, gives TTFTs closest to the measured ones,
    taken fastest to slowest and averaged over the bursts. With none, a burst's prompts reach the engine at
    once and share its first step; one after another, the first steps alone and the rest wait for it. Only the
    steps the prompts share show in their TTFTs, so a range of spacings fits as well as any: the middle one."""
    from dataclasses import replace

    from plan.sim import Simulator
    from plan.workload import from_reqs
    want = np.sort(np.array(ttfts, dtype=float), axis=1).mean(axis=0)
    bs = config.decode.engine.block_size or 16

    def error(spacing: float) -> float:
        reqs = from_reqs([type(r)(r.prompt, r.max_tokens) for r in burst], bs)
        Simulator(config, replace(cost, overheads=replace(ov, ingress_s=spacing))).run(reqs)
        return float(np.abs(np.sort([r.ttft for r in reqs]) - want).mean())
    errors = np.array([error(float(g)) for g in grid])
    best = grid[errors <= errors.min() + 1e-6]
    return float(best[len(best) // 2])


def shapes(cost: LinearCost, ov: Overheads) -> dict[str, float]:
    """The fitted seconds of the steps the served requests take: the local prompt's step, the remote prompt's
    prefill and pull, a decode step alone (context as the 16-token streams') and at batch 8."""
    return {"local": cost.step_s(Batch(LOCAL_PROMPT, attention_pairs(LOCAL_PROMPT, 0), 1, LOCAL_PROMPT)),
            "prefill": cost.step_s(Batch(REMOTE_PROMPT, attention_pairs(REMOTE_PROMPT, 0), 1, REMOTE_PROMPT)),
            "pull": ov.pull_s(REMOTE_PROMPT * cost.kv_bytes_per_token),
            "step1": cost.step_s(Batch(1, REMOTE_PROMPT + 16, 1, REMOTE_PROMPT + 16)),
            "step8": cost.step_s(Batch(8, 8 * 90, 8, 8 * 90))}


def fit_overheads(ov: Overheads, cost: LinearCost, local_ttft: float, remote_ttft: float, gap1: float,
                  gap8: float, local_engine_s: float | None = None, remote_engine_s: float | None = None) -> Overheads:
    """Solve the simulator's rules (plan/sim.py) for the serving overheads, from medians measured one request
    at a time (gap1: a stream's token gap alone; the TTFTs) and 8 streams at once (gap8):
    - a served gap at batch b = step(b) + step_s + b token_s: two batch sizes, two unknowns;
    - TTFT of a local prefill = request_s + its prompt's step + step_s + token_s (it streams its first token);
    - TTFT of a remote one = request_s + the prefill replica's step + step_s + handoff_s + the pull + the decode
      step that takes the import in and streams the first token with the second (LLMEngine.step).
    The prompts' steps are the fit's, or where given the engines' own measured seconds to the first token
    (`local_engine_s`: the decode replica's for the local prompts, `remote_engine_s`: the prefill replica's)."""
    s = shapes(cost, ov)
    local = local_engine_s if local_engine_s else s["local"]
    prefill = remote_engine_s if remote_engine_s else s["prefill"]
    ov.token_s = max(((gap8 - s["step8"]) - (gap1 - s["step1"])) / 7, 0.0)
    ov.step_s = max(gap1 - s["step1"] - ov.token_s, 0.0)
    ov.request_s = max(local_ttft - local - ov.step_s - ov.token_s, 0.0)
    ov.handoff_s = max(remote_ttft - ov.request_s - prefill - ov.step_s - s["pull"]
                       - s["step1"] - ov.step_s - ov.token_s, 0.0)
    return ov


def phase_sums(before: dict[str, float], after: dict[str, float]) -> dict[str, list]:
    """pool -> [queue seconds, queue count, prefill seconds, prefill count] of its replicas' phase histograms over
    the requests that ended between two scrapes (the simulator's Simulator.phases, read by plan.sim.phase_means)."""
    from cluster.live_metrics import pool_total
    return {pool: [pool_total(after, f"baton_request_{phase}_time_seconds_{part}", pool)
                   - pool_total(before, f"baton_request_{phase}_time_seconds_{part}", pool)
                   for phase in ("queue", "prefill") for part in ("sum", "count")]
            for pool in (PREFILL, DECODE)}


def step_sums(before: dict[str, float], after: dict[str, float]) -> dict[str, dict[str, float]]:
    """pool -> its replicas' engine step counters between two scrapes (replica/metrics.py STEP_COUNTERS, keyed
    as LLMEngine.step_totals: steps, seconds, tokens, pairs, seqs, context); pools that stepped none left out."""
    from cluster.live_metrics import pool_total
    from replica.metrics import STEP_COUNTERS
    out = {}
    for pool in (PREFILL, DECODE):
        sums = {key: pool_total(after, f"{name}_total", pool) - pool_total(before, f"{name}_total", pool)
                for key, name, _ in STEP_COUNTERS}
        if sums["steps"] > 0:
            out[pool] = sums
    return out


def fitted_s(cost: LinearCost, t: dict[str, float]) -> float:
    """The fit's seconds for the steps of one pool's step sums (step_sums())."""
    return cost.steps_s(t["steps"], Batch(t["tokens"], t["pairs"], t["seqs"], t["context"]))


def engine_speed(cost: LinearCost, runs: list[dict[str, dict[str, float]]],
                 slowdown: dict[str, float] | None = None) -> float:
    """How many times as slowly the engines stepped as the fit says, over the pools' step sums of `runs`
    (step_sums()): their measured seconds over the fit's for the same steps, each pool's fit times `slowdown`
    (its engines' slowdown by their neighbours where they stepped together: the simulator's figure for the same
    workload, Simulator.steps; none where requests came one at a time). 1.0 where nothing stepped."""
    measured = fitted = 0.0
    for sums in runs:
        for pool, t in sums.items():
            measured += t["seconds"]
            fitted += fitted_s(cost, t) * (slowdown or {}).get(pool, 1.0)
    return measured / fitted if fitted > 0 else 1.0


def pool_speeds(cost: LinearCost, sums: dict[str, dict[str, float]],
                slowdown: dict[str, float] | None = None) -> dict[str, float]:
    """engine_speed() of each pool alone."""
    return {pool: engine_speed(cost, [{pool: t}], slowdown) for pool, t in sums.items()}


def engine_phase_s(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """pool -> the mean seconds its replicas' engines took from a request's arrival to its first token sampled
    there (the queue and prefill phase histograms), over the requests that ended between two scrapes. The queue
    histogram also counts imports (no first token sampled there): a phase must not mix them with prompts the
    same pool prefills (the calibration's phases do not)."""
    return {pool: (q + f) / nf for pool, (q, _, f, nf) in phase_sums(before, after).items() if nf > 0}


def grid_engine(model: str | None = None):
    """(engine, its config, threads): the calibration cluster's decode engine in this process, on the torch
    threads Ray gives its replica, for the step grid."""
    from bench.cluster_bench import serve_config
    import torch
    cfg = serve_config("disaggregated", "prefix_aware", 1, 1, 256 << 20, model=model)
    config = cfg.engine_config("decode")
    threads = replica_threads(cfg.decode.num_cpus)          # time steps as a replica runs them
    torch.set_num_threads(threads)
    return _engine(config), config, threads


def calibrate(model: str | None, quick: bool, log: Callable[[str], None], serve: bool = True,
              transfer_gbps: float = 5.5) -> tuple[LinearCost, dict[str, Any]]:
    engine, config, threads = grid_engine(model)
    log(f"engine steps on {threads} thread(s), as a replica of the calibration cluster runs them")
    kv_bytes_per_token = engine.runner.block_bytes // config.block_size
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    rows = grid(engine, rng, log, quick)
    cost = LinearCost.fitted(rows, kv_bytes_per_token, shared_device=True,
                             overheads=Overheads(transfer_gbps=transfer_gbps), name="this machine (calibrated)")
    log(f"fit over {len(rows)} steps: step = {cost.c0 * 1e3:.2f} ms + {cost.c_tok * 1e6:.1f} us/token + "
        f"{cost.c_attn * 1e9:.2f} ns/pair + {cost.c_ctx * 1e9:.1f} ns/context token + {cost.c_seq * 1e6:.1f} us/seq (median error "
        f"{cost.fit['median_rel_error']:.1%}, p90 {cost.fit['p90_rel_error']:.1%})")
    cost.contention = contention(config, engine, cost, rng, log, threads)
    cost.cores, cost.threads = os.cpu_count() or 1, threads
    engine.shutdown()
    if serve:
        cost.overheads = overheads(cost.overheads, cost, log)
    info = {"steps": [[b.tokens, b.pairs, b.seqs, b.context, s] for b, s in rows], "seconds": time.perf_counter() - t,
            "threads": threads, "engine": {"block_size": config.block_size, "max_num_seqs": config.max_num_seqs,
                       "max_num_batched_tokens": config.max_num_batched_tokens}}
    return cost, info


def served_only(path: str, transfer_gbps: float, log: Callable[[str], None]) -> tuple[LinearCost, dict[str, Any]]:
    """The step fit of the calibration saved at `path`, with the serving overheads and contention measured anew."""
    import json

    from plan.cost import load_cost
    cost = load_cost(path)
    if not isinstance(cost, LinearCost):
        raise SystemExit(f"plan calibrate --steps-from: {path} holds a {cost.to_dict().get('kind')} cost model, "
                         "not the linear fit of this machine's steps")
    log(f"engine steps: the fit in {path} (step = {cost.c0 * 1e3:.2f} ms + {cost.c_tok * 1e6:.1f} us/token + ...)")
    t = time.perf_counter()
    cost.overheads = overheads(Overheads(transfer_gbps=transfer_gbps), cost, log)
    info = {**json.loads(Path(path).read_text()).get("calibration", {}), "steps_from": str(path),
            "seconds": time.perf_counter() - t}
    return cost, info


def calibrate_gpu(model: str, gpu: str, quick: bool, log: Callable[[str], None], device: str = "cuda"
                  ) -> tuple[Any, dict[str, Any]]:
    """The roofline preset of `gpu` for `model` (a checkpoint directory), its mfu, mbu and per-step overhead fitted
    to the engine's own step timings on this GPU (the grid above, one engine, CUDA graphs as served). No Ray and
    no cluster: the serving overheads stay the preset's."""
    from engine.config import EngineConfig
    from plan.cost import RooflineCost, model_shape
    config = EngineConfig(model=model, device=device, kv_cache_memory=1 << 30)   # the grid needs ~17k tokens
    dtype = str(config.torch_dtype).removeprefix("torch.")              # bf16 on CUDA, fp32 on CPU
    engine = _engine(config)
    preset = RooflineCost(gpu=gpu, model=model_shape(model))
    log(f"{preset.name}: {preset.params / 1e9:.2f} B parameters, {engine.runner.block_bytes // config.block_size} "
        f"KV bytes a token; engine on {device} in {dtype}")
    t = time.perf_counter()
    rows = grid(engine, np.random.default_rng(0), log, quick)
    engine.shutdown()
    cost, report = preset.fitted(rows)
    for name in ("preset", "fitted"):
        r = report[name]
        log(f"{name}: mfu {r['mfu']:.2f}, KV read at {r['kv_mbu']:.2f} of HBM bandwidth (weights at "
            f"{report['mbu']:.2f}), step overhead {r['step_overhead_s'] * 1e3:.2f} ms (with a prompt chunk "
            f"{r['prefill_overhead_s'] * 1e3:.2f} ms): median error {r['median_rel_error']:.1%}, "
            f"p90 {r['p90_rel_error']:.1%} over {len(rows)} steps ({report['prefill_steps']} with prompt tokens: "
            f"median {r.get('prefill_median_rel_error', 0):.1%})")
    info = {"steps": [[b.tokens, b.pairs, b.seqs, b.context, s] for b, s in rows], "seconds": time.perf_counter() - t,
            "roofline": report, "device": device, "dtype": dtype}
    return cost, info


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model (default: the served default, SmolLM2-135M-Instruct)")
    p.add_argument("--gpu", default=None, help="calibrate the roofline preset of this GPU (h100, h200) instead: fit its "
                                               "mfu, mbu and step overhead to the engine's steps on the GPU here (needs "
                                               "--model, a checkpoint directory; no cluster is started)")
    p.add_argument("--device", default="cuda", help="with --gpu: the torch device the engine runs on (default cuda)")
    p.add_argument("--quick", action="store_true", help="a smaller grid (tests)")
    p.add_argument("--no-serve", action="store_true", help="skip the live cluster (overheads stay 0)")
    p.add_argument("--steps-from", default=None, metavar="COST_JSON",
                   help="keep the engine step fit of an earlier calibration on this machine and measure only the "
                        "serving overheads and contention on a live cluster (2 minutes instead of 9)")
    p.add_argument("--transfer-gbps", type=float, default=5.5,
                   help="KV pull bandwidth (default 5.5 GB/s: `baton bench transfer`'s NIXL figure on this machine)")
    p.add_argument("--out", default="bench_out/plan/cost.json", help="where the cost model goes")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    import contextlib
    import sys

    from bench.engine_bench import machine_info, make_logger
    log = make_logger("plan calibrate")
    if args.gpu is not None:
        if args.model is None:
            raise SystemExit("plan calibrate --gpu needs --model (a checkpoint directory)")
        cost, info = calibrate_gpu(args.model, args.gpu, args.quick, log, device=args.device)
        save_cost(cost, args.out, machine=machine_info(), calibration=info)
        log(f"wrote {args.out}")
        return {"cost": cost.to_dict(), "path": str(args.out), "roofline": info["roofline"]}

    import ray

    from cluster.serving import init_ray
    with contextlib.redirect_stdout(sys.stderr):
        if not args.no_serve:
            init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                     namespace="baton-plan-calibrate")
        try:
            if args.steps_from is not None:
                cost, info = served_only(args.steps_from, args.transfer_gbps, log)
            else:
                cost, info = calibrate(args.model, args.quick, log, serve=not args.no_serve,
                                       transfer_gbps=args.transfer_gbps)
        finally:
            if ray.is_initialized():
                ray.shutdown()
    save_cost(cost, args.out, machine=machine_info(), calibration=info)
    log(f"wrote {args.out}")
    return {"cost": cost.to_dict(), "path": str(args.out)}
