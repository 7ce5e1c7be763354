"""`baton bench router`: how long one prefill routing decision takes with a big prefix index.

The index holds `--prefixes` cached prompts spread over `--replicas` replicas (each prompt cached on
1-3 of them): tenants' shared system prompts followed by unique tails. It is built the way a router
builds it: from msgpack batches of the per-block BlockStored events a BlockPool emits (a replica
stores only the blocks it did not already cache). A decision is what PrefixAwareRouter.choose_replicas
computes: the leading-block match over the index plus the load-corrected ranking. Queries are
`--tokens`-token prompts: half continue a cached prompt, a quarter share only a system prompt, a
quarter share nothing. Goal: p99 under 1 ms.
"""
from __future__ import annotations

import argparse
import datetime as dt
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from engine.block_hash import block_hashes
from engine.kv_events import BlockStored, decode_events, encode_events
from router.config import RouterConfig
from router.prefix_index import PrefillRanker, PrefixIndex

log = make_logger("router-bench")
BLOCK_SIZE = 16
VOCAB = 49152
GOAL_P99_US = 1000.0


@dataclass
class Workload:
    replicas: list[str]
    system: list[list[int]]                  # tenants' system prompts (token ids)
    prompts: list[list[int]]                 # cached prompts (token ids)
    batches: list[tuple[str, int, bytes]]    # (replica, seq, msgpack events), in arrival order
    num_events: int


def tokens(rng: np.random.Generator, blocks: tuple[int, int]) -> list[int]:
    return rng.integers(0, VOCAB, size=int(rng.integers(*blocks)) * BLOCK_SIZE).tolist()


def make_workload(num_prefixes: int, num_replicas: int, num_tenants: int, rng: np.random.Generator) -> Workload:
    system = [tokens(rng, (32, 65)) for _ in range(num_tenants)]
    prompts = [system[int(rng.integers(num_tenants))] + tokens(rng, (4, 33)) for _ in range(num_prefixes)]
    replicas = [f"replica-{i}" for i in range(num_replicas)]
    have = {r: set() for r in replicas}      # what each replica caches: it re-stores none of it
    seqs = dict.fromkeys(replicas, 0)
    batches, num_events = [], 0
    for p in prompts:
        hashes = block_hashes(p, BLOCK_SIZE, "bench")
        for r in rng.choice(replicas, size=int(rng.integers(1, 4)), replace=False).tolist():
            first = next((i for i, h in enumerate(hashes) if h not in have[r]), len(hashes))
            events = [BlockStored([h], hashes[i - 1] if i else None) for i, h in enumerate(hashes) if i >= first]
            have[r].update(hashes[first:])
            seqs[r] += 1
            batches.append((r, seqs[r], encode_events(events)))
            num_events += len(events)
    return Workload(replicas, system, prompts, batches, num_events)


def build_index(w: Workload) -> PrefixIndex:
    index = PrefixIndex()
    for r in w.replicas:
        index.load_snapshot(r, 0, [])        # each replica registers with an empty cache
    for r, seq, data in w.batches:
        if not index.apply(r, seq, decode_events(data)):
            raise RuntimeError(f"batch {seq} of {r} refused")
    return index


def measure_build(w: Workload) -> tuple[PrefixIndex, dict]:
    """Build twice: timed without tracemalloc (it slows allocation several-fold), then traced for memory."""
    t = time.perf_counter()
    index = build_index(w)
    build_s = time.perf_counter() - t
    tracemalloc.start()
    traced = build_index(w)
    index_bytes = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del traced
    return index, {"build_s": build_s, "events": w.num_events, "events_per_s": w.num_events / build_s,
                   "index_bytes": index_bytes, "distinct_blocks": index.num_distinct_blocks(),
                   "replica_blocks": sum(index.num_blocks().values())}


def make_queries(w: Workload, n: int, num_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    out = []
    for i in range(n):
        kind = i % 4
        if kind < 2:
            base = w.prompts[int(rng.integers(len(w.prompts)))]      # continues a cached prompt
        elif kind == 2:
            base = w.system[int(rng.integers(len(w.system)))]        # shares a system prompt only
        else:
            base = []                                                # nothing cached
        ids = base[:num_tokens] + rng.integers(0, VOCAB, size=max(num_tokens - len(base), 0)).tolist()
        out.append(block_hashes(ids, BLOCK_SIZE, "bench"))
    return out


def time_decisions(index: PrefixIndex, queries: list[list[int]], num_tokens: int, loads: dict[str, int]):
    """Per decision: (match us, rank us, total us, reason)."""
    router = RouterConfig()                                          # the cluster's default routing rule
    ranker = PrefillRanker(router.load_weight, router.imbalance_threshold_tokens)
    cached = index.num_blocks()
    for h in queries[:200]:                                          # warm-up
        ranker.rank(h, num_tokens, BLOCK_SIZE, index.hits(h), loads, cached)
    rows = []
    for h in queries:
        t0 = time.perf_counter_ns()
        m = index.hits(h)
        t1 = time.perf_counter_ns()
        _, reason = ranker.rank(h, num_tokens, BLOCK_SIZE, m, loads, cached)
        t2 = time.perf_counter_ns()
        rows.append(((t1 - t0) / 1e3, (t2 - t1) / 1e3, (t2 - t0) / 1e3, reason))
    return rows


def percentiles(us: np.ndarray) -> dict[str, float]:
    return {**{f"p{q}": float(np.percentile(us, q)) for q in (50, 90, 99)},
            "mean": float(us.mean()), "max": float(us.max())}


def plot(us: np.ndarray, pct: dict[str, float], title: str, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(us, bins=100, range=(0, float(np.percentile(us, 99.9))))
    for q in ("p50", "p90", "p99"):
        ax.axvline(pct[q], color="k", ls=":", lw=1)
        ax.text(pct[q], ax.get_ylim()[1] * 0.9, f" {q} {pct[q]:.0f} us", rotation=90, fontsize=8, va="top")
    ax.set_xlabel("routing decision (match + rank), microseconds")
    ax.set_ylabel("decisions")
    ax.set_title(title)
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", type=int, default=10_000, help="cached prompts in the index (default 10000)")
    p.add_argument("--replicas", type=int, default=16, help="prefill replicas (default 16)")
    p.add_argument("--tenants", type=int, default=50, help="distinct shared system prompts (default 50)")
    p.add_argument("--decisions", type=int, default=20_000, help="timed routing decisions (default 20000)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length of a query (default 2048)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/router",
                   help="directory for router.json and router.png (default bench_out/router)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(args.seed)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"making {args.prefixes} prefixes over {args.replicas} replicas ({args.tenants} system prompts)")
    w = make_workload(args.prefixes, args.replicas, args.tenants, rng)
    index, built = measure_build(w)
    log(f"index: {built['distinct_blocks']} distinct blocks, {built['replica_blocks']} (replica, block) pairs, "
        f"{built['index_bytes'] / 2**20:.0f} MiB; built from {built['events']} events in {built['build_s']:.2f} s")
    queries = make_queries(w, args.decisions, args.tokens, rng)
    loads = {r: int(rng.integers(0, 4096)) for r in w.replicas}     # under the imbalance threshold
    rows = time_decisions(index, queries, args.tokens, loads)
    total = np.array([r[2] for r in rows])
    pct = percentiles(total)
    hits = sum(r[3] == "prefix_hit" for r in rows) / len(rows)
    result: dict[str, Any] = {
        "benchmark": "router", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "prefixes": args.prefixes, "replicas": args.replicas, "tenants": args.tenants,
        "decisions": args.decisions, "prompt_tokens": args.tokens, "block_size": BLOCK_SIZE, **built,
        "decision_us": pct,
        "match_us": percentiles(np.array([r[0] for r in rows])),
        "rank_us": percentiles(np.array([r[1] for r in rows])),
        "prefix_hit_decisions": hits,
        "goals": {"p99_under_1ms": pct["p99"] < GOAL_P99_US},
    }
    log(f"decision p50 {pct['p50']:.1f} us, p90 {pct['p90']:.1f} us, p99 {pct['p99']:.1f} us, max {pct['max']:.0f} us "
        f"(match p50 {result['match_us']['p50']:.1f}, rank p50 {result['rank_us']['p50']:.1f}); "
        f"{hits:.0%} routed on a prefix hit")
    title = f"{args.prefixes} cached prefixes, {args.replicas} replicas, {args.tokens}-token prompts"
    return write_result(result, out_dir / "router.json",
                        {"decision_us": ("router.png", lambda _, png: plot(total, pct, title, png))})
