"""`baton bench router`: how long one prefill routing decision takes with a big index.

The index holds `--prefixes` cached prompts spread over `--replicas` replicas (each prompt cached on
1-3 of them): tenants' shared system prompts followed by unique tails, fed as the BlockStored events
replicas publish. A decision is what PrefixAwareRouter.choose_replicas does: hash lookup of the
prompt's leading blocks in the index (match) plus the load-corrected ranking (rank). Queries are
2,048-token prompts: half continue a cached prompt, half share only a system prompt or nothing.
Goal: p99 under 1 ms.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_bench import machine_info, make_logger, pyplot
from engine.kv import BlockStored, block_hashes
from router.prefix_index import PrefillRanker, PrefixIndex

log = make_logger("router-bench")
BLOCK_SIZE = 16
GOAL_P99_US = 1000.0


def build(num_prefixes: int, num_replicas: int, num_tenants: int, rng: np.random.Generator):
    system = [rng.integers(0, 49152, size=int(rng.integers(32, 65)) * BLOCK_SIZE).tolist()
              for _ in range(num_tenants)]
    prompts = []
    for _ in range(num_prefixes):
        tail = rng.integers(0, 49152, size=int(rng.integers(4, 33)) * BLOCK_SIZE).tolist()
        prompts.append(system[int(rng.integers(num_tenants))] + tail)
    index = PrefixIndex()
    replicas = [f"replica-{i}" for i in range(num_replicas)]
    seqs = dict.fromkeys(replicas, 0)
    for r in replicas:
        index.load_snapshot(r, 0, [])
    tracemalloc.start()
    t = time.perf_counter()
    hashes = [block_hashes(p, BLOCK_SIZE, "bench") for p in prompts]
    hash_s = time.perf_counter() - t
    t = time.perf_counter()
    for h in hashes:
        for r in rng.choice(replicas, size=int(rng.integers(1, 4)), replace=False):
            seqs[r] += 1
            index.apply(str(r), seqs[r], [BlockStored(h, None)])
    build_s = time.perf_counter() - t
    mem = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return index, replicas, system, prompts, {"hash_s": hash_s, "build_s": build_s, "index_bytes": mem,
                                              "cached_blocks": len(index.masks)}


def queries(prompts, system, n: int, tokens: int, rng: np.random.Generator) -> list[list[int]]:
    out = []
    for i in range(n):
        kind = i % 4
        if kind < 2:
            base = prompts[int(rng.integers(len(prompts)))]        # continues a cached prompt
        elif kind == 2:
            base = system[int(rng.integers(len(system)))]          # shares a system prompt
        else:
            base = []                                              # nothing cached
        ids = base[:tokens] + rng.integers(0, 49152, size=max(tokens - len(base), 0)).tolist()
        out.append(block_hashes(ids, BLOCK_SIZE, "bench"))
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefixes", type=int, default=10_000, help="cached prompts in the index (default 10000)")
    p.add_argument("--replicas", type=int, default=16, help="prefill replicas (default 16)")
    p.add_argument("--tenants", type=int, default=50, help="distinct shared system prompts (default 50)")
    p.add_argument("--decisions", type=int, default=20_000, help="timed routing decisions (default 20000)")
    p.add_argument("--tokens", type=int, default=2048, help="prompt length of a query (default 2048)")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/router",
                   help="directory for router.json and router.png (default bench_out/router)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    rng = np.random.default_rng(0)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"building the index: {args.prefixes} prefixes over {args.replicas} replicas")
    index, replicas, system, prompts, built = build(args.prefixes, args.replicas, args.tenants, rng)
    log(f"{built['cached_blocks']} distinct cached blocks, {built['index_bytes'] / 2**20:.0f} MiB, "
        f"built in {built['build_s']:.1f} s")
    qs = queries(prompts, system, args.decisions, args.tokens, rng)
    ranker = PrefillRanker()
    loads = {r: int(rng.integers(0, 4096)) for r in replicas}
    times, hits = [], 0
    for h in qs[:200]:                                             # warm-up
        ranker.rank(h, args.tokens, BLOCK_SIZE, index.match(h), loads)
    for h in qs:
        t = time.perf_counter_ns()
        m = index.match(h)
        tiers, reason = ranker.rank(h, args.tokens, BLOCK_SIZE, m, loads)
        times.append((time.perf_counter_ns() - t) / 1e3)
        hits += reason == "prefix_hit"
    us = np.array(times)
    pct = {f"p{q}": float(np.percentile(us, q)) for q in (50, 90, 99)}
    result: dict[str, Any] = {
        "benchmark": "router", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "prefixes": args.prefixes, "replicas": args.replicas, "tenants": args.tenants,
        "decisions": args.decisions, "prompt_tokens": args.tokens, **built,
        "decision_us": {**pct, "mean": float(us.mean()), "max": float(us.max()), "median": statistics.median(times)},
        "prefix_hit_decisions": hits / len(qs),
        "goals": {"p99_under_1ms": pct["p99"] < GOAL_P99_US},
    }
    log(f"decision time p50 {pct['p50']:.1f} us, p90 {pct['p90']:.1f} us, p99 {pct['p99']:.1f} us, "
        f"max {us.max():.0f} us; {hits / len(qs):.0%} routed on a prefix hit")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.hist(us, bins=100, range=(0, float(np.percentile(us, 99.9))))
    for q, v in pct.items():
        ax.axvline(v, color="k", ls=":", lw=1)
        ax.text(v, ax.get_ylim()[1] * 0.9, q, rotation=90, fontsize=8)
    ax.set_xlabel("routing decision (match + rank), microseconds")
    ax.set_ylabel("decisions")
    ax.set_title(f"{args.prefixes} cached prefixes, {args.replicas} replicas, {args.tokens}-token prompts")
    fig.tight_layout()
    png = out_dir / "router.png"
    fig.savefig(png, dpi=120)
    plt.close(fig)
    result["plots"] = {"decision_us": str(png)}
    result["json_path"] = str(out_dir / "router.json")
    (out_dir / "router.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
