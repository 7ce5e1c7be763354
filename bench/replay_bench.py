"""`baton bench replay TRACE`: replay a request trace open-loop against the HTTP API of a local cluster.

Formats (told apart by the first line's keys):
- Mooncake's (`timestamp` ms, `input_length`, `output_length`, `hash_ids`: remapped hashes of 512-token
  prompt blocks; requests sharing leading ids share that prefix). The trace holds no text, so prompts are
  rebuilt: each hash id becomes a fixed run of random token ids, and a prompt is its ids' runs, cut to its
  length, so requests share exactly the prefixes the trace says they share. A CPU cannot serve the trace's
  12k-token prompts at its rate, so lengths scale by `--block-tokens / 512` (16: 1/32), and outputs too.
- Baton's own JSONL: `{"timestamp": ms, "prompt": text or token ids, "max_tokens": n}`.

Arrivals keep the trace's times divided by `--speedup`. Each request streams (temperature 0, ignore_eos, so
it produces its output length). Reported: goodput under SLOs (DistServe's definition: requests per second
that meet both the TTFT SLO and the mean-ITL SLO), SLO attainment, TTFT and ITL percentiles, the prefix
cache hit rate of both pools (from /metrics), and the trace's own shape. JSON and a PNG.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from bench.cluster_bench import VOCAB, Req, drive, serve_config, summarize, with_cluster
from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from cluster.live_metrics import pool_total, scrape
from cluster.serving import init_ray

MOONCAKE_BLOCK = 512
DEFAULT_TRACE = Path(__file__).parent / "traces" / "mooncake_conversation_200.jsonl"
log = make_logger("bench replay")


def load_trace(path: str | Path) -> tuple[str, list[dict]]:
    """(format, rows) of a JSONL trace; a line that is not a request of the format raises ValueError naming it."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no requests")
    fmt = "mooncake" if "hash_ids" in rows[0] else "baton"
    need = {"mooncake": ("timestamp", "input_length", "output_length", "hash_ids"),
            "baton": ("timestamp", "prompt", "max_tokens")}[fmt]
    for i, r in enumerate(rows):
        missing = [k for k in need if k not in r]
        if missing:
            raise ValueError(f"{path}:{i + 1}: a {fmt} trace line needs {', '.join(missing)}")
    return fmt, rows


def mooncake_requests(rows: list[dict], block_tokens: int, max_input: int, max_output: int,
                      speedup: float, seed: int = 0) -> list[Req]:
    """Prompts rebuilt from hash ids (one fixed run of `block_tokens` random ids per hash id), lengths scaled
    by block_tokens / 512 and capped; arrivals at timestamp / speedup."""
    scale = block_tokens / MOONCAKE_BLOCK
    runs: dict[int, list[int]] = {}

    def run(h: int) -> list[int]:
        if h not in runs:
            runs[h] = np.random.default_rng([seed, h]).integers(*VOCAB, size=block_tokens).tolist()
        return runs[h]
    t0 = rows[0]["timestamp"]
    out = []
    for i, r in enumerate(rows):
        n = min(max(1, round(r["input_length"] * scale)), max_input)
        ids = [t for h in r["hash_ids"] for t in run(h)][:n]
        if len(ids) < n:                   # the trace's last block is partial; a short hash list is padded
            ids += np.random.default_rng([seed, -1 - i]).integers(*VOCAB, size=n - len(ids)).tolist()
        out.append(Req(ids, min(max(1, round(r["output_length"] * scale)), max_output),
                       at=(r["timestamp"] - t0) / 1e3 / speedup, tag="trace"))
    return out


def baton_requests(rows: list[dict], max_output: int, speedup: float) -> list[Req]:
    t0 = rows[0]["timestamp"]
    return [Req(r["prompt"], min(int(r["max_tokens"]), max_output), at=(r["timestamp"] - t0) / 1e3 / speedup,
                tag="trace") for r in rows]


def trace_shape(fmt: str, rows: list[dict], reqs: list[Req]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(reqs), "span_s": reqs[-1].at if reqs else 0.0,
                           "mean_prompt_tokens": float(np.mean([len(r.prompt) for r in reqs])),
                           "mean_output_tokens": float(np.mean([r.max_tokens for r in reqs]))}
    if fmt == "mooncake":
        seen: set[int] = set()
        reusable = total = 0
        for r in rows:                     # blocks an earlier request already had: the trace's reuse ceiling
            reusable += sum(h in seen for h in r["hash_ids"])
            total += len(r["hash_ids"])
            seen.update(r["hash_ids"])
        out["reusable_block_share"] = reusable / max(total, 1)
    return out


def replay(reqs: list[Req], mode: str, kv_bytes: int, slo: tuple[float, float]) -> dict:
    def work(base: str, model: str) -> dict:
        asyncio.run(drive(base, model, [Req(list(range(300, 340)), 2, tag="warm-up")]))   # first-use costs
        before = scrape(base, fresh=True)                       # reports read after the warm-up ended
        results, wall = asyncio.run(drive(base, model, reqs))
        after = scrape(base, fresh=True)

        def delta(metric: str) -> float:
            return sum(pool_total(after, metric, p) - pool_total(before, metric, p) for p in ("prefill", "decode"))
        q, h = delta("baton_prefix_cache_query_tokens_total"), delta("baton_prefix_cache_hit_tokens_total")
        return {**summarize(results, wall, *slo), "prefix_hit_rate": h / q if q else None,
                "query_tokens": q, "hit_tokens": h,
                "_points": [(r.at, res.ttft) for r, res in zip(reqs, results) if res.ok and res.ttft is not None]}
    return with_cluster(serve_config(mode, "prefix_aware", 1, 1, kv_bytes, min_remote=64), work)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    pts = result["ttft_points"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.scatter([p[0] for p in pts], [p[1] * 1e3 for p in pts], s=8)
    a.axhline(result["slo_ms"]["ttft"], color="tab:red", linestyle="--", label="TTFT SLO")
    a.set_xlabel("arrival (s)")
    a.set_ylabel("TTFT (ms)")
    a.legend(fontsize=8)
    r = result["result"]
    a.set_title(f"{result['trace']['requests']} requests, {r['goodput_rps']:.2f} good req/s, "
                f"hit rate {r['prefix_hit_rate'] or 0:.1%}", fontsize=9)
    ttft = np.sort([p[1] * 1e3 for p in pts])
    b.plot(ttft, np.arange(1, len(ttft) + 1) / max(len(ttft), 1))
    b.set_xlabel("TTFT (ms)")
    b.set_ylabel("share of requests")
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE),
                   help="a JSONL trace, Mooncake's or Baton's (default: the first 200 requests of Mooncake's "
                        "conversation trace, bench/traces/README.md)")
    p.add_argument("--speedup", type=float, default=1.0, help="divide the trace's arrival times by this")
    p.add_argument("--block-tokens", type=int, default=16,
                   help="Mooncake traces: tokens per 512-token hash block; lengths scale by this / 512 (default 16, "
                        "the KV block size: shared hash blocks are shared KV blocks)")
    p.add_argument("--max-input-tokens", type=int, default=1536, help="cap on a rebuilt prompt (default 1536)")
    p.add_argument("--max-output-tokens", type=int, default=64, help="cap on a request's output (default 64)")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--mode", choices=("disaggregated", "colocated"), default="disaggregated",
                   help="1 prefill + 1 decode replica, or 1 colocated replica")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="each replica's KV cache (default 256 MiB)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO: TTFT at most (default 2000)")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput SLO: mean ITL at most (default 200)")
    p.add_argument("--quick", action="store_true", help="a smoke run: the first 12 requests, prompts of at most "
                                                        "192 tokens")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/replay",
                   help="directory for replay.json and replay.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    import ray
    if args.quick:
        args.max_requests, args.max_input_tokens = args.max_requests or 12, min(args.max_input_tokens, 192)
    fmt, rows = load_trace(args.trace)
    rows = rows[:args.max_requests] if args.max_requests else rows
    reqs = (mooncake_requests(rows, args.block_tokens, args.max_input_tokens, args.max_output_tokens, args.speedup)
            if fmt == "mooncake" else baton_requests(rows, args.max_output_tokens, args.speedup))
    shape = trace_shape(fmt, rows, reqs)
    log(f"{fmt} trace {args.trace}: {shape['requests']} requests over {shape['span_s']:.1f} s, mean prompt "
        f"{shape['mean_prompt_tokens']:.0f} tokens, output {shape['mean_output_tokens']:.0f}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slo = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    # Ray's driver threads print worker errors (a controller's shutdown) on stdout: keep it for the JSON
    with contextlib.redirect_stdout(sys.stderr):
        init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
                 namespace="baton-bench-replay")
        try:
            res = replay(reqs, args.mode, args.kv_cache_mib << 20, slo)
        finally:
            ray.shutdown()
    points = res.pop("_points")
    result: dict[str, Any] = {
        "benchmark": "replay", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "trace_path": str(args.trace), "format": fmt, "trace": shape,
        "speedup": args.speedup, "block_tokens": args.block_tokens if fmt == "mooncake" else None,
        "mode": args.mode, "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "result": res,
        "ttft_points": points,
        "method_notes": {"goodput": "requests meeting both SLOs (TTFT, and the mean of its ITLs) per second of the "
                                    "replay (DistServe's definition)",
                         "timings": "client side, from the SSE stream: TTFT = send to first text chunk",
                         "prefix_hit_rate": "both pools' prefix-cache hit tokens / query tokens, from /metrics"},
    }
    write_result(result, out_dir / "replay.json", {"replay": plot})
    log(f"goodput {res['goodput_rps']:.2f} req/s ({res['slo_attainment']:.0%} within SLOs), TTFT {res['ttft_ms']}, "
        f"hit rate {res['prefix_hit_rate']}; wrote {result['json_path']}")
    return result
