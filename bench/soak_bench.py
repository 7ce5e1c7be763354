"""`baton bench soak`: thousands of mixed requests against a real local cluster, then the leak checks.

The mix (seeded): plain and streamed completions and chats, n > 1, stop strings, streams the client
abandons after a few chunks, and over-limit requests (n, max_tokens, stop lists, a body past the limit)
that must get a 4xx. Closed loop at --concurrency. Afterwards, from the ingress /metrics: every replica's
KV blocks in use and pinned prompts back to zero, admission's queued tokens zero, the same replicas as at
the start (none restarted), and each replica's resident memory at the start and the end. Any 5xx, any
connection error or any unanswered request fails the run.

tests/test_reliability.py runs the same soak (soak, then cluster.live_metrics.leak_report) for a few
minutes in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from cluster.live_metrics import leak_report
from cluster.serving import init_ray

log = make_logger("soak-bench")
PORT = 8761
KINDS = ("complete", "stream", "chat", "n", "stop", "abort", "over_limit", "too_big")
WEIGHTS = (20, 20, 15, 8, 10, 12, 10, 5)
WORDS = "relay baton runner track lane split sprint anchor handoff zone pace finish".split()


def make_request(rng: random.Random, model: str, max_body: int) -> tuple[str, str, dict | bytes]:
    """(kind, path, body) of one soak request."""
    kind = rng.choices(KINDS, WEIGHTS)[0]
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    body: dict[str, Any] = {"model": model, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8]),
                            "seed": rng.randint(0, 1000)}
    path = "/v1/completions"
    if kind == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    if kind in ("stream", "abort"):
        body.update(stream=True, max_tokens=rng.randint(16, 64), ignore_eos=True)
    elif kind == "n":
        body["n"] = rng.randint(2, 4)
    elif kind == "stop":
        body.update(stop=rng.sample(WORDS, 3), max_tokens=32)
    elif kind == "over_limit":
        body.update(rng.choice([{"n": 1000}, {"max_tokens": 10**6}, {"stop": ["x"] * 5000},
                                {"temperature": -3}, {"top_p": 7}]))
    elif kind == "too_big":
        return kind, path, json.dumps({**body, "prompt": "x" * (max_body + 1024)}).encode()
    return kind, path, body


async def one(session, base: str, kind: str, path: str, body, rng: random.Random) -> tuple[str, str]:
    """(kind, outcome): ok | aborted | rejected_4xx | busy_429 | or a failure description."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        async with session.post(base + path, data=data, headers={"Content-Type": "application/json"}) as r:
            if r.status == 429:
                return kind, "busy_429" if r.headers.get("Retry-After") else "429 without Retry-After"
            if kind in ("over_limit", "too_big"):
                err = await r.json(content_type=None)
                ok = r.status in (400, 413) and set(err.get("error", {})) >= {"message", "type", "code"}
                return kind, "rejected_4xx" if ok else f"expected a 4xx error, got {r.status}"
            if r.status != 200:
                return kind, f"HTTP {r.status}: {(await r.text())[:200]}"
            if not body.get("stream"):
                out = await r.json()
                return kind, "ok" if out.get("choices") else f"no choices: {str(out)[:200]}"
            chunks, stop_after = 0, rng.randint(1, 6) if kind == "abort" else None
            async for raw in r.content:
                line = raw.strip()
                if line == b"data: [DONE]":
                    return kind, "ok"
                if line.startswith(b"data: "):
                    if b'"error"' in line[:12]:
                        return kind, f"error event: {line[:200]!r}"
                    chunks += 1
                    if stop_after is not None and chunks >= stop_after:
                        return kind, "aborted"              # leaving the block closes the connection
            return kind, "stream ended without [DONE]"
    except Exception as e:                              # noqa: BLE001 - a failure is a data point
        return kind, f"{type(e).__name__}: {e}"


async def run_soak(base: str, model: str, n: int, concurrency: int, seed: int = 0, max_body: int = 1 << 20,
                   progress=None) -> dict[str, Any]:
    """n requests of the mix, `concurrency` at a time; the outcome counts and failures."""
    import aiohttp
    rng = random.Random(seed)
    reqs = [make_request(rng, model, max_body) for _ in range(n)]
    queue: asyncio.Queue = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    outcomes: Counter = Counter()
    failures: list[str] = []
    t0 = time.perf_counter()

    async def worker(session, wid: int) -> None:
        wrng = random.Random(seed * 1000 + wid)
        while not queue.empty():
            kind, path, body = queue.get_nowait()
            kind, outcome = await one(session, base, kind, path, body, wrng)
            outcomes[(kind, outcome if outcome in ("ok", "aborted", "rejected_4xx", "busy_429") else "FAIL")] += 1
            if outcome not in ("ok", "aborted", "rejected_4xx", "busy_429"):
                failures.append(f"{kind}: {outcome}")
            done = sum(outcomes.values())
            if progress and done % 250 == 0:
                progress(f"{done}/{n} requests, {time.perf_counter() - t0:.0f} s, {len(failures)} failures")

    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        await asyncio.gather(*(worker(s, w) for w in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"requests": n, "wall_s": wall, "requests_per_s": n / wall, "failures": failures[:20],
            "num_failures": len(failures),
            "outcomes": {f"{k}/{o}": v for (k, o), v in sorted(outcomes.items())}}


def soak(base: str, model: str, n: int, concurrency: int, seed: int = 0, max_body: int = 1 << 20,
         warmup: int = 200) -> dict[str, Any]:
    """Warm up, then two halves of n/2 requests, each replica's memory taken before, between and after them
    (at rest: no request in flight), then the leak checks. A leak grows both halves alike; a cache filling
    up to its bound (oneDNN's primitives, the allocator's arenas) grows the first more."""
    asyncio.run(run_soak(base, model, warmup, concurrency, seed + 1, max_body))
    marks = [leak_report(base)]
    halves = []
    for h in range(2):
        halves.append(asyncio.run(run_soak(base, model, n // 2 + h * (n % 2), concurrency, seed * 2 + h, max_body,
                                           progress=log)))
        marks.append(leak_report(base))
    outcomes: Counter = Counter()
    for r in halves:
        outcomes.update(r["outcomes"])
    wall = sum(r["wall_s"] for r in halves)
    result: dict[str, Any] = {
        "requests": n, "warmup_requests": warmup, "wall_s": wall, "requests_per_s": n / wall,
        "failures": (halves[0]["failures"] + halves[1]["failures"])[:20],
        "num_failures": sum(r["num_failures"] for r in halves), "outcomes": dict(sorted(outcomes.items())),
        "leaks_after": marks[-1], "replicas_before": sorted(marks[0]["rss_bytes"]),
        "replicas_after": sorted(marks[-1]["rss_bytes"])}
    for kind in ("rss", "heap"):
        series = {r: [m[f"{kind}_bytes"].get(r, 0.0) / 2**20 for m in marks] for r in marks[0][f"{kind}_bytes"]}
        result[f"{kind}_mb"] = {r: dict(zip(("start", "mid", "end"), v)) for r, v in series.items()}
        result[f"{kind}_growth_mb"] = {r: {"first_half": v[1] - v[0], "second_half": v[2] - v[1]}
                                       for r, v in series.items()}
    result["rss_growth_mb_max"] = max((v["end"] - v["start"] for v in result["rss_mb"].values()), default=None)
    result["heap_growth_second_half_mb_max"] = max((g["second_half"] for g in result["heap_growth_mb"].values()),
                                                   default=None)
    return result


# -- the benchmark ----------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=5000, help="requests in the soak (default 5000)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/soak",
                   help="directory for soak.json and soak.png (default bench_out/soak)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    oc = result["outcomes"]
    axes[0].barh(list(oc), list(oc.values()), color="tab:blue")
    axes[0].set_xlabel("requests")
    axes[0].set_title(f"soak: {result['requests']} requests, {result['num_failures']} failures")
    names = list(result["heap_mb"] or result["rss_mb"])
    kind = "heap" if result["heap_mb"] else "rss"
    x = range(len(names))
    for i, mark in enumerate(("start", "mid", "end")):
        axes[1].bar([j + (i - 1) * 0.27 for j in x], [result[f"{kind}_mb"][n][mark] for n in names], 0.27,
                    label=mark)
    axes[1].set_xticks(list(x), [n.split("/")[0] + "/" + n.split("/")[1][:6] for n in names], fontsize=8)
    axes[1].set_ylabel("heap in use, MiB" if kind == "heap" else "resident memory, MiB")
    axes[1].set_title("memory: after warm-up, half-way, at the end")
    axes[1].legend()
    save(fig, path)


def run(args: argparse.Namespace) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.serving import start, stop
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    engine = {"kv_cache_memory": 128 << 20, "max_model_len": 1024}
    cfg = ClusterConfig.from_dict({
        "model": args.model, "port": PORT, "ingress": {"num_cpus": 0},
        "prefill": {"num_replicas": args.prefill_replicas, "num_cpus": 0, "engine": engine},
        "decode": {"num_replicas": args.decode_replicas, "num_cpus": 0, "engine": engine},
        "disaggregation": {"min_remote_prefill_tokens": 16}})
    t = time.perf_counter()
    init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="baton-bench-soak")
    try:
        start(cfg)
        log(f"cluster up in {time.perf_counter() - t:.0f} s; soaking {args.requests} requests")
        result = soak(f"http://127.0.0.1:{PORT}", cfg.model_name(), args.requests, args.concurrency, args.seed,
                      cfg.limits.max_body_bytes)
    finally:
        stop()
        ray.shutdown()
    restarted = result["replicas_before"] != result["replicas_after"]
    result = {"benchmark": "soak", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "model": cfg.model_name(), "concurrency": args.concurrency,
              "passed": result["num_failures"] == 0 and result["leaks_after"]["clean"] and not restarted,
              "replicas_restarted": restarted, **result}
    write_result(result, out_dir / "soak.json", {"soak": plot})
    log(f"soak {'passed' if result['passed'] else 'FAILED'}: {result['num_failures']} failures, leaks clean="
        f"{result['leaks_after']['clean']}, max RSS growth {result['rss_growth_mb_max']:.1f} MiB, max heap growth in "
        f"the second half {result['heap_growth_second_half_mb_max']:.1f} MiB")
    return result
