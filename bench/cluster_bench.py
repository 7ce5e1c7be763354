"""`baton bench cluster`: open-loop load against the HTTP API of a real local Serve app, in one run.

Load: Poisson arrivals at `--rate` requests/s, streamed /v1/completions with token-id prompts (exact
lengths), timings taken by the client from the SSE stream. Workloads (seeded):
  tenants      multi-tenant chat: 4 tenants' shared system prompts of --prefix-tokens, a unique
               32-token question each, 16-token answers
  long_prompt  unique 1,024-1,536-token prompts, 8-token answers
  long_answer  32-token prompts, 128-token answers (ignore_eos)
Comparisons, each cluster started afresh with the same engines and the same requests:
  routing  prefix-aware vs Serve's power-of-two routing on `tenants`, 2 prefill replicas whose KV cache
           holds about 2.5 tenants' prefixes: the prefill pool's prefix hit rate (from /metrics, after
           one warm-up request per tenant) and TTFT
  pd       disaggregated (1 prefill + 1 decode) vs colocated (2 replicas doing both) on long_answer
           streams with long_prompt arrivals mixed in: ITL p99 of the streams
Reports TTFT and ITL p50/p90/p99, throughput and goodput under the SLO (--slo-ttft-ms, --slo-itl-ms).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from cluster.live_metrics import pool_total, scrape
from cluster.serving import init_ray

log = make_logger("cluster-bench")
PORT = 8741
VOCAB = (200, 40000)            # random prompt ids: clear of SmolLM2's special tokens
BLOCK = 16                      # tokens per KV block (the engine's default)


def block_bytes(model: str | None = None) -> int:
    """fp32 K and V bytes of one block of `model` (a directory; None: the default, SmolLM2-135M: 737,280)."""
    from transformers import AutoConfig

    from engine.loader import resolve_model
    c = AutoConfig.from_pretrained(resolve_model(model))
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * BLOCK * 4


@dataclass
class Req:
    prompt: list[int] | str                          # a chat request's user message is text
    max_tokens: int
    at: float = 0.0                                  # arrival, seconds after the start
    tag: str = ""
    chat: bool = False                               # /v1/chat/completions instead of /v1/completions
    model: str | None = None                         # a LoRA adapter's name (None: the served model)


@dataclass
class Result:
    tag: str
    ok: bool
    status: int | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    e2e: float | None = None
    error: str | None = None
    usage_tokens: int | None = None                  # completion_tokens of the stream's usage chunk


# -- workloads --------------------------------------------------------------------------------------
def tenants(n: int, prefix_tokens: int, rng: np.random.Generator, num_tenants: int = 4) -> tuple[list[Req], list[Req]]:
    systems = [rng.integers(*VOCAB, size=prefix_tokens).tolist() for _ in range(num_tenants)]
    warm = [Req(s + rng.integers(*VOCAB, size=32).tolist(), 4, tag=f"warm{t}") for t, s in enumerate(systems)]
    reqs = [Req(systems[i % num_tenants] + rng.integers(*VOCAB, size=32).tolist(), 16, tag="tenants")
            for i in range(n)]
    return warm, reqs


def long_prompts(n: int, rng: np.random.Generator) -> list[Req]:
    return [Req(rng.integers(*VOCAB, size=int(rng.integers(1024, 1537))).tolist(), 8, tag="long_prompt")
            for _ in range(n)]


def long_answers(n: int, rng: np.random.Generator) -> list[Req]:
    return [Req(rng.integers(*VOCAB, size=32).tolist(), 128, tag="long_answer") for _ in range(n)]


def poisson(reqs: list[Req], rate: float, rng: np.random.Generator) -> list[Req]:
    t = 0.0
    for r in reqs:
        t += rng.exponential(1.0 / rate)
        r.at = t
    return reqs


# -- the client -------------------------------------------------------------------------------------
async def one(session, base: str, model: str, r: Req, t0: float) -> Result:
    await asyncio.sleep(max(0.0, r.at - (time.perf_counter() - t0)))
    body = {"model": r.model or model, "max_tokens": r.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    if r.chat:
        body["messages"] = [{"role": "user", "content": r.prompt}]
    else:
        body["prompt"] = r.prompt
    start = time.perf_counter()
    res, last = Result(r.tag, False), None
    try:
        async with session.post(f"{base}/v1/{'chat/' if r.chat else ''}completions", json=body) as resp:
            if resp.status != 200:
                return Result(r.tag, False, status=resp.status, error=f"HTTP {resp.status}: {(await resp.text())[:200]}"
                              + (f" Retry-After {resp.headers['Retry-After']}" if "Retry-After" in resp.headers else ""))
            res.status = 200
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(r.tag, False, status=200, ttft=res.ttft, tokens=res.tokens,
                                  error=str(chunk["error"]))
                if chunk.get("usage"):
                    res.usage_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk_text(chunk["choices"][0]):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                res.tokens += 1
        res.ok, res.e2e = True, time.perf_counter() - start
    except Exception as e:                              # noqa: BLE001 - a failed request is a data point
        res.error = repr(e)
    return res


def chunk_text(choice: dict) -> str:
    """A stream chunk's text: a completion's `text`, a chat's `delta.content`."""
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


async def drive(base: str, model: str, reqs: list[Req]) -> tuple[list[Result], float]:
    import aiohttp
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        t0 = time.perf_counter()
        out = await asyncio.gather(*(one(s, base, model, r, t0) for r in reqs))
        return list(out), time.perf_counter() - t0


def summarize(results: list[Result], wall: float, slo_ttft: float, slo_itl: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ttft = np.array([r.ttft for r in ok if r.ttft is not None])
    itl = np.array([x for r in ok for x in r.itls])

    def pct(a):
        return {f"p{q}": float(np.percentile(a, q)) * 1e3 for q in (50, 90, 99)} if len(a) else None
    good = [r for r in ok if r.ttft is not None and r.ttft <= slo_ttft
            and (not r.itls or float(np.mean(r.itls)) <= slo_itl)]
    return {"requests": len(results), "ok": len(ok), "errors": [r.error for r in results if not r.ok][:5],
            "ttft_ms": pct(ttft), "itl_ms": pct(itl), "wall_s": wall,
            "output_tokens_per_s": sum(r.tokens for r in ok) / wall, "goodput_rps": len(good) / wall,
            "slo_attainment": len(good) / max(len(results), 1)}


# -- one cluster at a time ----------------------------------------------------------------------------
def serve_config(mode: str, policy: str, prefill: int, decode: int, kv_bytes: int, min_remote: int = 64,
                 decode_kv_bytes: int | None = None, admission: dict | None = None, model: str | None = None,
                 adapters: dict[str, str] | None = None, host_gib: float = 0.0, prefix_pull: bool = True,
                 max_model_len: int = 2048) -> Any:
    """`adapters`: LoRA adapters served (name -> path); each prefill replica then holds two (max_loras and
    max_cpu_loras 2), so a third adapter's request evicts one and reads its files again. `host_gib`: each
    replica's host KV tier; `prefix_pull`: cross-replica prefix pulls (transfer.prefix_pull)."""
    from cluster.config import ClusterConfig
    engine = {"kv_cache_memory": kv_bytes, "max_model_len": max_model_len, "kv_offloading_size": host_gib}
    d: dict[str, Any] = {"port": PORT, **({"model": model} if model else {}), "mode": mode, "ingress": {"num_cpus": 0},
                         "decode": {"num_replicas": decode, "num_cpus": 0,
                                    "engine": {**engine, "kv_cache_memory": decode_kv_bytes or kv_bytes}},
                         "router": {"policy": policy}, "disaggregation": {"min_remote_prefill_tokens": min_remote},
                         "admission": admission or {"enabled": False}, "transfer": {"prefix_pull": prefix_pull}}
    if mode == "disaggregated":
        d["prefill"] = {"num_replicas": prefill, "num_cpus": 0, "engine": engine}
    if adapters:
        d["lora"] = {"adapters": adapters}
        d["decode"]["engine"]["max_loras"] = len(adapters)
        if mode == "disaggregated":
            d["prefill"]["engine"] = {**engine, "max_loras": 2, "max_cpu_loras": 2}
    return ClusterConfig.from_dict(d)


def with_cluster(cfgs, fn):
    """fn(base URL, model name) on a cluster running each config in turn (one config, or a list: the later ones
    redeploy the app in place, as `serve deploy` of an edited config would). Returns fn's result, or a list."""
    from cluster.app import APP_NAME
    from cluster.serving import redeploy, start, stop
    many = isinstance(cfgs, list)
    results = []
    t = time.perf_counter()
    start(cfgs[0] if many else cfgs)
    try:
        for i, cfg in enumerate(cfgs if many else [cfgs]):
            if i:
                t = time.perf_counter()
                redeploy(cfg, APP_NAME)
            log(f"cluster up in {time.perf_counter() - t:.0f} s: {cfg.mode}, prefill routing {cfg.router.policy}")
            results.append(fn(f"http://127.0.0.1:{PORT}", cfg.model_name()))
    finally:
        stop()
    return results if many else results[0]


def routing_runs(policies: list[str], n: int, rate: float, prefix_tokens: int,
                 slo: tuple[float, float], model: str | None = None,
                 adapters: dict[str, str] | None = None) -> dict[str, dict]:
    """The same tenants' workload under each prefill routing policy, on one Serve start: each policy after the
    first redeploys the app (Serve replaces the prefill replicas, so every policy starts cold). Each prefill
    replica's KV holds 2.5 tenants' prefixes, whatever the model (`model`: default SmolLM2-135M).
    `adapters` (name -> path, one per tenant): tenant t's requests run under the t-th adapter (its prefix is
    then its adapter's KV); the prefill pool's adapter loads into a slot are reported too."""
    rng = np.random.default_rng(1)
    warm, reqs = tenants(n, prefix_tokens, rng, len(adapters) if adapters else 4)
    poisson(reqs, rate, rng)
    if adapters:
        names = list(adapters)
        warm = [replace(w, model=names[t]) for t, w in enumerate(warm)]
        reqs = [replace(r, model=names[i % len(names)]) for i, r in enumerate(reqs)]
    kv = int(2.5 * prefix_tokens / BLOCK * block_bytes(model))
    runs = [(p, p, adapters, (warm, reqs)) for p in policies]
    workloads = iter([w for *_, w in runs])

    def work(base: str, model: str) -> dict:
        warm, reqs = next(workloads)
        for w in warm:                                          # one request per tenant, one at a time
            asyncio.run(drive(base, model, [w]))
        before = scrape(base, fresh=True)                       # reports read after the warm-up ended
        results, wall = asyncio.run(drive(base, model, reqs))
        after = scrape(base, fresh=True)
        q = pool_total(after, "baton_prefix_cache_query_tokens_total", "prefill") - \
            pool_total(before, "baton_prefix_cache_query_tokens_total", "prefill")
        h = pool_total(after, "baton_prefix_cache_hit_tokens_total", "prefill") - \
            pool_total(before, "baton_prefix_cache_hit_tokens_total", "prefill")
        out = {**summarize(results, wall, *slo), "prefix_hit_rate": h / q if q else None,
               "prefill_query_tokens": q, "prefill_hit_tokens": h}
        if reqs[0].model is not None:
            out["prefill_lora_loads"] = pool_total(after, "baton_lora_loads_total", "prefill") - \
                pool_total(before, "baton_lora_loads_total", "prefill")
        return out
    # every prompt goes through the prefill pool (the decode replica would otherwise prefill a tenant's
    # prompt itself once it caches the prefix: conditional disaggregation, but not what is measured here)
    cfgs = [serve_config("disaggregated", p, 2, 1, kv, min_remote=0, decode_kv_bytes=256 << 20, model=model,
                         adapters=a) for _, p, a, _ in runs]
    return dict(zip([name for name, *_ in runs], with_cluster(cfgs, work)))


# name -> (host tier on, cross-replica prefix pulls on, workload): "spread" visits the tenants in turn under
# prefix-aware routing, their prefixes 4x one prefill replica's KV; "pow2" sends 3 of 4 requests to one tenant
# under Serve's power-of-two routing (load only), every prefix fits: a tenant's prompt often lands on the
# replica that has not computed its prefix, which computes it, or pulls it from the one that has
TIERS_RUNS = {"baseline": (False, False, "spread"), "host_tier": (True, False, "spread"),
              "prefix_pull": (False, True, "spread"), "both": (True, True, "spread"),
              "pow2": (False, False, "pow2"), "pow2_pull": (False, True, "pow2")}


def tiers_runs(n: int, rate: float, prefix_tokens: int, num_tenants: int, slo: tuple[float, float],
               model: str | None = None, names: list[str] | None = None) -> dict[str, dict]:
    """`--workload tiers`: `num_tenants` tenants' shared prefixes on 2 prefill replicas (prefix-aware routing)
    and 1 decode replica; the runs of TIERS_RUNS (`names`: some of them) on one Serve start, each after the
    first redeploying the app so that it starts cold. Per run: the prefill pool's prefix reuse (tokens found
    in its own cache, either tier, or pulled from the other replica, over prompt tokens asked), TTFT
    percentiles and output tokens/s."""
    names = names or list(TIERS_RUNS)
    rng = np.random.default_rng(3)
    warm, spread = tenants(n, prefix_tokens, rng, num_tenants)
    poisson(spread, rate, rng)
    hot = [replace(r, prompt=warm[0].prompt[:prefix_tokens] + r.prompt[prefix_tokens:]) if i % 4 else r
           for i, r in enumerate(spread)]                      # 3 of 4 requests: tenant 0's prefix
    per_tenant = -(-(prefix_tokens + 32) // BLOCK)
    small = int(num_tenants * per_tenant / 4 * block_bytes(model))            # a quarter of the prefixes
    roomy = int(1.25 * num_tenants * per_tenant * block_bytes(model))        # all of them
    host_gib = roomy / 2**30
    longest = prefix_tokens + 32 + 16                                            # prompt and answer
    cfgs = [serve_config("disaggregated", "prefix_aware" if TIERS_RUNS[name][2] == "spread" else "pow2", 2, 1,
                         small if TIERS_RUNS[name][2] == "spread" else roomy,
                         min_remote=0, decode_kv_bytes=256 << 20, model=model,
                         host_gib=host_gib if TIERS_RUNS[name][0] else 0.0, prefix_pull=TIERS_RUNS[name][1],
                         max_model_len=longest) for name in names]
    workloads = iter([spread if TIERS_RUNS[name][2] == "spread" else hot for name in names])
    # (with pow2 routing the warm-up, one request per tenant, lands each prefix on one replica or the other)

    def work(base: str, model_name: str) -> dict:
        reqs = next(workloads)
        for w in warm:                                          # each tenant once, one at a time
            asyncio.run(drive(base, model_name, [w]))
        before = scrape(base, fresh=True)                       # reports read after the warm-up ended
        results, wall = asyncio.run(drive(base, model_name, reqs))
        after = scrape(base, fresh=True)

        def grew(metric: str, label: str = "") -> float:
            """Per series (replica), after less before: a replica of the previous run that the ingress still
            lists in `before` must not count against this run's."""
            return sum(v - before.get(k, 0.0) for k, v in after.items()
                       if k.startswith(metric + "{") and 'pool="prefill"' in k and label in k)
        q, h = grew("baton_prefix_cache_query_tokens_total"), grew("baton_prefix_cache_hit_tokens_total")
        host = grew("baton_prefix_cache_hits_by_tier_tokens_total", 'tier="host"')
        pulled = grew("baton_prefix_pull_tokens_total")
        return {**summarize(results, wall, *slo), "prefill_query_tokens": q, "prefill_hit_tokens": h,
                "prefill_host_hit_tokens": host, "prefill_pulled_tokens": pulled,
                "prefix_hit_rate": h / q if q else None, "prefix_reuse_rate": (h + pulled) / q if q else None}
    out = dict(zip(names, with_cluster(cfgs, work)))
    for name, r in out.items():
        log(f"tiers {name}: reuse {r['prefix_reuse_rate'] or 0:.1%} (hits {r['prefill_hit_tokens']:.0f}, of them "
            f"host {r['prefill_host_hit_tokens']:.0f}; pulled {r['prefill_pulled_tokens']:.0f} of "
            f"{r['prefill_query_tokens']:.0f} tokens), TTFT {r['ttft_ms']}")
    return out


def tiers_run(args: argparse.Namespace, slo: tuple[float, float], out_dir: Path, started: float) -> dict:
    model = None
    if args.quick:
        from bench.chaos_bench import tiny_model
        model = tiny_model(str(out_dir / "tiny"))
    names = [n.strip() for n in args.tiers_runs.split(",") if n.strip()] if args.tiers_runs else list(TIERS_RUNS)
    if bad := [n for n in names if n not in TIERS_RUNS]:
        raise SystemExit(f"--tiers-runs: {', '.join(bad)} unknown (choose from {', '.join(TIERS_RUNS)})")
    tenants_n = 8
    log(f"KV tiers: {tenants_n} tenants x {args.prefix_tokens}-token prefixes; {args.requests} requests at "
        f"{args.rate}/s per run; runs {', '.join(names)}")
    runs = tiers_runs(args.requests, args.rate, args.prefix_tokens, tenants_n, slo, model, names)

    def ratio(a: str, b: str, key: str = "p50") -> float | None:
        if a not in runs or b not in runs:
            return None
        x, y = runs[a]["ttft_ms"], runs[b]["ttft_ms"]
        return x[key] / y[key] if x and y and y[key] else None

    def gain(a: str, b: str, key: str) -> float | None:
        if a not in runs or b not in runs:
            return None
        return (runs[b][key] or 0) / max(runs[a][key] or 0, 1e-9)
    result = {"benchmark": "cluster-tiers", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "quick": args.quick, "model": model or "default", "rate_rps": args.rate,
              "prefix_tokens": args.prefix_tokens, "tenants": tenants_n, "requests": args.requests,
              "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "runs": runs,
              "host_tier_hit_rate_gain": gain("baseline", "host_tier", "prefix_hit_rate"),
              "host_tier_ttft_p50_ratio": ratio("baseline", "host_tier"),
              "prefix_pull_reuse_gain": gain("baseline", "prefix_pull", "prefix_reuse_rate"),
              "pow2_pull_reuse_gain": gain("pow2", "pow2_pull", "prefix_reuse_rate"),
              "pow2_pull_ttft_p50_ratio": ratio("pow2", "pow2_pull"),
              "method_notes": {"spread": "the tenants in turn; each prefill replica's device KV holds about a quarter "
                                         "of their prefixes, the host tier (when on) all of them",
                               "pow2": "power-of-two routing (load only); 3 of 4 requests share tenant 0's prefix; "
                                       "every prefix fits in each replica's KV",
                               "reuse": "prompt tokens the prefill pool found cached (either tier) or pulled from the "
                                        "other prefill replica, over the prompt tokens it was asked",
                               "ratios": "the first run's TTFT over the second's: > 1 means the second is faster"}}
    write_result(result, out_dir / "tiers.json", {"tiers": plot_tiers})
    log(f"wrote {result['json_path']} in {time.perf_counter() - started:.0f} s")
    return result


def plot_tiers(result: dict, path: Path) -> None:
    plt = pyplot()
    runs = result["runs"]
    names = list(runs)
    colors = (["tab:gray", "tab:blue", "tab:orange", "tab:green", "tab:brown", "tab:red"] * 2)[:len(names)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    hit = [100 * (runs[n]["prefix_hit_rate"] or 0) for n in names]
    pulled = [100 * ((runs[n]["prefix_reuse_rate"] or 0) - (runs[n]["prefix_hit_rate"] or 0)) for n in names]
    a.bar(names, hit, color=colors, label="found cached (either tier)")
    a.bar(names, pulled, bottom=hit, color="tab:purple", label="pulled from the other replica")
    a.set_ylabel("prefill prompt tokens reused, %")
    a.legend(fontsize=8)
    for i, q in enumerate(("p50", "p90", "p99")):
        b.bar(np.arange(len(names)) + (i - 1) * 0.25, [runs[n]["ttft_ms"][q] if runs[n]["ttft_ms"] else 0
                                                       for n in names], 0.25, label=q)
    b.set_xticks(np.arange(len(names)), names)
    b.set_ylabel("TTFT, ms")
    b.legend(fontsize=8)
    save(fig, path)


def pd_run(mode: str, n_streams: int, n_long: int, rate: float, slo: tuple[float, float]) -> dict:
    rng = np.random.default_rng(2)
    streams, longs = long_answers(n_streams, rng), long_prompts(n_long, rng)
    poisson(streams, rate, rng)
    poisson(longs, rate * n_long / max(n_streams, 1), rng)
    prefill, decode = (1, 1) if mode == "disaggregated" else (0, 2)

    def work(base, model):
        asyncio.run(drive(base, model, [Req([300] * 32, 2)]))  # warm-up
        results, wall = asyncio.run(drive(base, model, streams + longs))
        return {"streams": summarize([r for r in results if r.tag == "long_answer"], wall, *slo),
                "long_prompts": summarize([r for r in results if r.tag == "long_prompt"], wall, *slo)}
    return with_cluster(serve_config(mode, "prefix_aware", prefill, decode, 256 << 20), work)


def overload_prompts(n: int, rng: np.random.Generator, tokens: int = 256, answer: int = 16) -> list[Req]:
    return [Req(rng.integers(*VOCAB, size=tokens).tolist(), answer, tag="overload") for _ in range(n)]


def saturation_rate(base: str, model: str, concurrency: int, n: int) -> float:
    """Requests/s the cluster completes with `concurrency` always in flight (closed loop): its capacity."""
    reqs = overload_prompts(n, np.random.default_rng(3))

    async def closed():
        import aiohttp
        queue = list(reqs)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            async def worker():
                while queue:
                    await one(s, base, model, queue.pop(), time.perf_counter())
            t0 = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            return time.perf_counter() - t0
    return n / asyncio.run(closed())


def overload_run(admission: bool, n: int, factor: float, slo_ttft_s: float, concurrency: int,
                 sat: float | None = None) -> dict:
    """1 prefill + 1 decode replica; offer `factor` times the saturation rate `sat` (measured here first when
    not given: both runs of a comparison get the same offered load) as Poisson arrivals."""
    adm = {"enabled": True, "ttft_slo_s": slo_ttft_s} if admission else {"enabled": False}

    def work(base, model):
        asyncio.run(drive(base, model, [Req([300] * 32, 2)]))            # warm-up
        nonlocal sat
        sat = sat if sat is not None else saturation_rate(base, model, concurrency, max(n // 3, 12))
        reqs = poisson(overload_prompts(n, np.random.default_rng(4)), factor * sat, np.random.default_rng(5))
        log(f"overload (admission {'on' if admission else 'off'}): saturation {sat:.2f} req/s; offering "
            f"{factor * sat:.2f} req/s")
        results, wall = asyncio.run(drive(base, model, reqs))
        ok = [r for r in results if r.ok]
        rejected = [r for r in results if r.status == 429]
        other = [r for r in results if not r.ok and r.status != 429]
        ttft = np.array([r.ttft for r in ok if r.ttft is not None])
        return {"saturation_rps": sat, "offered_rps": factor * sat, "requests": len(results), "ok": len(ok),
                "rejected_429": len(rejected), "other_failures": len(other), "failures": [r.error for r in other][:5],
                "retry_after_present": all("Retry-After" in (r.error or "") for r in rejected),
                "admitted_ttft_ms": {f"p{q}": float(np.percentile(ttft, q)) * 1e3 for q in (50, 90, 99)}
                if len(ttft) else None, "wall_s": wall, "goodput_rps": sum(
                    1 for r in ok if r.ttft is not None and r.ttft <= slo_ttft_s) / wall}
    return with_cluster(serve_config("disaggregated", "prefix_aware", 1, 1, 256 << 20, admission=adm), work)


def plot_overload(result: dict, path: Path) -> None:
    plt = pyplot()
    o = result["overload"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    names = list(o)
    for i, q in enumerate(("p50", "p90", "p99")):
        axes[0].bar(np.arange(len(names)) + (i - 1) * 0.25,
                    [o[n]["admitted_ttft_ms"][q] if o[n]["admitted_ttft_ms"] else 0 for n in names], 0.25, label=q)
    axes[0].axhline(result["overload_slo_ttft_ms"], color="red", ls="--", label="TTFT SLO")
    axes[0].set_xticks(np.arange(len(names)), names)
    axes[0].set_ylabel("TTFT of served requests, ms")
    axes[0].set_title(f"{result['overload_factor']:g}x the saturation rate")
    axes[0].legend(fontsize=8)
    axes[1].bar(names, [o[n]["ok"] for n in names], label="served")
    axes[1].bar(names, [o[n]["rejected_429"] for n in names], bottom=[o[n]["ok"] for n in names], label="429")
    axes[1].set_ylabel("requests")
    axes[1].legend(fontsize=8)
    save(fig, path)


def lora_run(args: argparse.Namespace, slo: tuple[float, float], out_dir: Path, started: float) -> dict:
    """`--workload lora`: the tenants' routing comparison with one LoRA adapter per tenant."""
    import tempfile

    from engine.loader import resolve_model
    base = resolve_model(None)
    with tempfile.TemporaryDirectory(prefix="baton-bench-lora-") as tmp:      # the adapters go with the run
        return _lora_run(args, slo, out_dir, started, base, Path(tmp))


def _lora_run(args: argparse.Namespace, slo: tuple[float, float], out_dir: Path, started: float, base: str,
              tmp: Path) -> dict:
    from bench.models import make_lora_adapter
    adapters = {f"tenant{t}": make_lora_adapter(base, tmp / f"tenant{t}", rank=8, seed=t + 1, scale=0.5)
                for t in range(4)}
    log(f"routing with 4 LoRA tenants: prefix_aware (adapter-aware) then pow2, {args.requests} requests at "
        f"{args.rate}/s")
    runs = routing_runs(["prefix_aware", "pow2"], args.requests, args.rate, args.prefix_tokens, slo,
                        adapters=adapters)
    for policy, r in runs.items():
        log(f"lora {policy}: hit rate {r['prefix_hit_rate']:.1%}, adapter loads {r['prefill_lora_loads']:.0f}, "
            f"TTFT {r['ttft_ms']}")
    a, p = runs["prefix_aware"], runs["pow2"]
    result = {"benchmark": "cluster-lora", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "quick": args.quick, "rate_rps": args.rate, "prefix_tokens": args.prefix_tokens,
              "slo_ms": {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "routing": runs,
              "hit_rate_gain": (a["prefix_hit_rate"] or 0) - (p["prefix_hit_rate"] or 0),
              "ttft_p50_ratio_pow2_over_aware": p["ttft_ms"]["p50"] / a["ttft_ms"]["p50"]
              if a["ttft_ms"] and p["ttft_ms"] else None,
              "method_notes": {"adapters": "one rank-8 adapter per tenant on every projection; each prefill replica "
                                           "holds two (max_loras and max_cpu_loras 2)",
                               "routing_kv": "each prefill replica's KV cache holds ~2.5 tenants' prefixes"}}
    write_result(result, out_dir / "lora.json", {"lora": plot_lora})
    log(f"wrote {result['json_path']} in {time.perf_counter() - started:.0f} s")
    return result


def plot_lora(result: dict, path: Path) -> None:
    plt = pyplot()
    runs = result["routing"]
    names = list(runs)
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, label in ((a, "prefix_hit_rate", "prefill prefix hit rate"),
                           (b, "prefill_lora_loads", "adapter loads into a slot (prefill pool)")):
        bars = ax.bar(names, [runs[n][key] or 0 for n in names], color=["tab:blue", "tab:gray"])
        ax.bar_label(bars, fmt="%.2f" if key == "prefix_hit_rate" else "%.0f", fontsize=8)
        ax.set_title(label, fontsize=9)
    for n, color in zip(names, ["tab:blue", "tab:gray"]):
        t = runs[n]["ttft_ms"] or {}
        c.plot(["p50", "p90", "p99"], [t.get(q, 0) for q in ("p50", "p90", "p99")], marker="o", color=color, label=n)
    c.set_title("TTFT (ms)", fontsize=9)
    c.legend(fontsize=8)
    save(fig, path)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    r = result["routing"]
    names = list(r)
    axes[0].bar(names, [100 * (r[n]["prefix_hit_rate"] or 0) for n in names], color=["tab:green", "tab:gray"])
    axes[0].set_ylabel("prefill prefix hit rate, %")
    axes[0].set_title("tenants: hit rate")
    for i, q in enumerate(("p50", "p90", "p99")):
        axes[1].bar(np.arange(len(names)) + (i - 1) * 0.25, [r[n]["ttft_ms"][q] if r[n]["ttft_ms"] else 0
                                                             for n in names], 0.25, label=q)
    axes[1].set_xticks(np.arange(len(names)), names)
    axes[1].set_ylabel("TTFT, ms")
    axes[1].set_title("tenants: TTFT")
    axes[1].legend(fontsize=8)
    p = result["pd"]
    modes = list(p)
    for i, q in enumerate(("p50", "p90", "p99")):
        axes[2].bar(np.arange(len(modes)) + (i - 1) * 0.25,
                    [p[m]["streams"]["itl_ms"][q] if p[m]["streams"]["itl_ms"] else 0 for m in modes], 0.25, label=q)
    axes[2].set_xticks(np.arange(len(modes)), modes)
    axes[2].set_ylabel("ITL of streams, ms")
    axes[2].set_title("long answers + long prompts: ITL")
    axes[2].legend(fontsize=8)
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=48, help="tenants requests per routing policy (default 48)")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, requests/s (default 1.0)")
    p.add_argument("--prefix-tokens", type=int, default=1024, help="tenants' shared prompt length (default 1024)")
    p.add_argument("--streams", type=int, default=12, help="long-answer streams of the P/D comparison (default 12)")
    p.add_argument("--long-prompts", type=int, default=6, help="long prompts mixed in (default 6)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO: TTFT at most (default 2000)")
    p.add_argument("--slo-itl-ms", type=float, default=200.0, help="goodput SLO: mean ITL at most (default 200)")
    p.add_argument("--workload", choices=["default", "lora", "tiers"], default="default",
                   help="lora: only the routing comparison, each tenant under its own LoRA adapter (made with PEFT), "
                        "prefix- and adapter-aware routing against power-of-two: hit rate, TTFT and adapter "
                        "loads, to lora.json. tiers: 8 tenants' prefixes, 4x one prefill replica's KV, with the "
                        "host tier and cross-replica prefix pulls off and on: reuse, TTFT, to tiers.json")
    p.add_argument("--tiers-runs", default=None, help="with --workload tiers: which runs, comma-separated "
                                                      "(baseline, host_tier, prefix_pull, both, pow2, pow2_pull; "
                                                      "default all)")
    p.add_argument("--skip-pd", action="store_true", help="leave out the disaggregated vs colocated comparison")
    p.add_argument("--quick", action="store_true", help="a smoke run: 12 tenants requests, 256-token prefixes, "
                                                        "4 streams, 2 long prompts")
    p.add_argument("--overload", action="store_true", help="only the overload comparison: admission control on vs "
                                                           "off at --overload-factor times the saturation rate")
    p.add_argument("--overload-requests", type=int, default=200,
                   help="requests offered per overload run (default 200)")
    p.add_argument("--overload-factor", type=float, default=2.0, help="offered load over saturation (default 2)")
    p.add_argument("--overload-slo-ttft-ms", type=float, default=3000.0,
                   help="admission's TTFT objective in the overload runs (default 3000)")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/cluster",
                   help="directory for cluster.json and cluster.png (default bench_out/cluster)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    import ray
    started = time.perf_counter()
    if args.quick:
        args.requests, args.prefix_tokens, args.streams, args.long_prompts = 12, 256, 4, 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    slo = (args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3)
    init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="baton-bench-cluster")
    if args.workload in ("lora", "tiers"):
        try:
            return (lora_run if args.workload == "lora" else tiers_run)(args, slo, out_dir, started)
        finally:
            ray.shutdown()
    if args.overload:
        try:
            overload, sat = {}, None
            for on in (False, True):                 # the run without admission measures the saturation rate
                name = "admission" if on else "no_admission"
                overload[name] = overload_run(on, args.overload_requests, args.overload_factor,
                                              args.overload_slo_ttft_ms / 1e3, concurrency=8, sat=sat)
                sat = overload[name]["saturation_rps"]
                log(f"overload {name}: {overload[name]['ok']} served, {overload[name]['rejected_429']} refused, "
                    f"TTFT {overload[name]['admitted_ttft_ms']}")
        finally:
            ray.shutdown()
        a, b = overload["admission"], overload["no_admission"]
        result = {"benchmark": "cluster-overload", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine_info(), "overload_factor": args.overload_factor,
                  "overload_slo_ttft_ms": args.overload_slo_ttft_ms, "overload": overload,
                  "every_request_answered": a["other_failures"] == 0 and a["ok"] + a["rejected_429"] == a["requests"],
                  "admitted_p99_ttft_within_slo": bool(a["admitted_ttft_ms"]) and
                  a["admitted_ttft_ms"]["p99"] <= args.overload_slo_ttft_ms,
                  "p99_ttft_ratio_without_over_with": (b["admitted_ttft_ms"]["p99"] / a["admitted_ttft_ms"]["p99"])
                  if a["admitted_ttft_ms"] and b["admitted_ttft_ms"] else None}
        write_result(result, out_dir / "overload.json", {"overload": plot_overload})
        log(f"wrote {result['json_path']} in {time.perf_counter() - started:.0f} s")
        return result
    try:
        log(f"routing: prefix_aware then pow2, {args.requests} tenants requests at {args.rate}/s")
        routing = routing_runs(["prefix_aware", "pow2"], args.requests, args.rate, args.prefix_tokens, slo)
        for policy, r in routing.items():
            log(f"routing {policy}: hit rate {r['prefix_hit_rate']:.1%}, TTFT {r['ttft_ms']}")
        pd = {}
        if not args.skip_pd:
            for mode in ("disaggregated", "colocated"):
                log(f"pd: {mode}, {args.streams} streams + {args.long_prompts} long prompts")
                pd[mode] = pd_run(mode, args.streams, args.long_prompts, args.rate, slo)
                log(f"pd {mode}: stream ITL {pd[mode]['streams']['itl_ms']}")
    finally:
        ray.shutdown()
    result: dict[str, Any] = {
        "benchmark": "cluster", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "quick": args.quick, "rate_rps": args.rate, "slo_ms":
            {"ttft": args.slo_ttft_ms, "itl": args.slo_itl_ms}, "prefix_tokens": args.prefix_tokens,
        "routing": routing, "pd": pd,
        "method_notes": {
            "timings": "client side, from the SSE stream: TTFT = send to first text chunk; ITL = between chunks",
            "prefix_hit_rate": "prefill pool's prefix-cache hit tokens / query tokens over the measured requests "
                               "(after one warm-up request per tenant), from the ingress /metrics",
            "routing_kv": "each prefill replica's KV cache holds ~2.5 tenants' prefixes",
            "pd": "disaggregated = 1 prefill + 1 decode replica; colocated = 2 replicas doing both"},
    }
    if routing.get("pow2", {}).get("prefix_hit_rate") is not None and routing["prefix_aware"]["prefix_hit_rate"]:
        result["routing_hit_rate_gain"] = routing["prefix_aware"]["prefix_hit_rate"] - routing["pow2"]["prefix_hit_rate"]
    write_result(result, out_dir / "cluster.json", {"cluster": plot} if pd else None)
    log(f"wrote {result['json_path']} in {time.perf_counter() - started:.0f} s")
    return result
