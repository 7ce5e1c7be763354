"""`baton bench chaos`: open-loop load through the HTTP API while replicas die, KV pulls fail, pools scale and roll.

Load: Poisson arrivals at --rate requests/s, streamed (seeded): short chats (a few words, --chat-tokens answers)
and long-prompt completions (token-id prompts of --long-prompt-tokens, --long-answer-tokens answers), all
ignore_eos, so a stream's length is known. Failure = an HTTP error, an error event in the stream, or a stream
whose usage says fewer tokens than asked for (or that has no usage chunk).
Schedule (each phase --phase-s, or as long as its action takes; calm between disruptions):
  calm, kill_decode (ray.kill of the busiest decode replica), calm, kill_prefill (likewise), calm, pull_fail
  (every KV pull fails, through the fault file: engine/faults.py), calm, scale_down (decode 2 -> 1, a redeploy
  applied in place),
  scale_up (-> 2), calm, roll (a config update that replaces every prefill and decode replica), calm.
Per phase: requests started (by start time) and failed (by end time: a kill fails the streams under way), p50/p99
TTFT and ITL of the requests that ended in it against the calm phases', and request moves from the ingress
/metrics (baton_request_moves_total by `how`, and baton_request_moved_tokens_total: recomputed by replays vs moved
by KV pulls); a counter the cluster does not export yet (no move so far) counts as 0 and is listed under
`counters_absent`. A resize is applied in place (pool sizes are Serve deployment overrides: cluster/app.py), so
the ingress keeps its counters; a roll replaces the ingress too, and a phase's moves then count from the new
replica's 0 (`increase`: a lower bound).
The schedule runs against a running cluster (`run_chaos(Target, ...)`): tests/test_reliability.py runs a short
one on its module cluster.
"""
from __future__ import annotations

import argparse
import asyncio
import copy
import datetime as dt
import json
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from bench.cluster_bench import VOCAB, Req, Result, one
from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from bench.soak_bench import WORDS
from cluster.live_metrics import replica_gauges, scrape
from cluster.serving import init_ray
from engine import faults

log = make_logger("chaos-bench")
PORT = 8771
DISRUPTIONS = ("kill_decode", "kill_prefill", "pull_fail", "scale_down", "scale_up", "roll")
MOVES = "baton_request_moves_total"                  # router/orchestrator.py: by reason and how
MOVED_TOKENS = "baton_request_moved_tokens_total"    # tokens of moved requests, by how


@dataclass
class Target:
    """A running cluster, and what the disruptions need of it."""
    base: str                                   # http://host:port of the ingress
    model: str                                  # served model name
    fault_file: str | None = None               # the replicas' $BATON_FAULTS_FILE: pull_fail needs it
    config: dict | None = None                  # the dict the app was deployed from: scale and roll redeploy edits
    app: str = "baton"


@dataclass
class Phase:
    name: str
    start: float = 0.0                          # seconds after the load began
    end: float = 0.0
    note: str = ""                              # what the action did (the replica killed, the new config)
    moves: dict[str, float] = field(default_factory=dict)


@dataclass
class Mix:
    chat_tokens: int = 256                      # a chat answer's length: streams long enough to be under way
    long_prompt_tokens: int = 320               # when a disruption lands (moves are what the bench measures)
    long_answer_tokens: int = 64
    long_fraction: float = 0.3


def schedule(disruptions: tuple[str, ...] | list[str]) -> list[str]:
    """calm, then each disruption followed by calm (scale_up follows scale_down directly: one resize pair)."""
    names = ["calm"]
    for d in disruptions:
        if d not in DISRUPTIONS:
            raise ValueError(f"unknown disruption {d!r}; known: {DISRUPTIONS}")
        names += [d] if d == "scale_down" and "scale_up" in disruptions else [d, "calm"]
    return names


# -- the cluster: replicas, disruptions, counters ---------------------------------------------------------
def replicas(pool: str, app: str = "baton") -> list[str]:
    """Serve's running replica actors of a pool (actor names)."""
    import ray
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app}#{pool}#"))


def kill(actor_name: str, namespace: str = "serve") -> None:
    import ray
    ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)


def running(target: Target, pool: str) -> dict[str, float]:
    """Replica id -> requests it runs (its last report: every 0.5 s)."""
    return {r.split("/")[1]: v for r, v in replica_gauges(scrape(target.base), "baton_num_requests_running").items()
            if r.startswith(pool + "/")}


def kill_busiest(target: Target, pool: str, wait_s: float = 5.0) -> str:
    """Kill the pool's replica running the most requests (a kill that hits an idle replica measures nothing):
    waits up to wait_s for one to run any."""
    deadline = time.monotonic() + wait_s
    while not any(running(target, pool).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    load = running(target, pool)
    actors = replicas(pool, target.app)
    victim = max(actors, key=lambda a: load.get(a.rsplit("#", 1)[1], 0.0))
    kill(victim)
    return victim


def redeploy_edit(target: Target, edit: Callable[[dict], None]) -> str:
    from cluster.config import ClusterConfig
    from cluster.serving import redeploy
    if target.config is None:
        raise ValueError("scale and roll phases need Target.config (the dict the app was deployed from)")
    edit(target.config)
    redeploy(ClusterConfig.from_dict(target.config), target.app)
    return json.dumps({p: {k: target.config[p].get(k) for k in ("num_replicas", "engine")}
                       for p in ("prefill", "decode")})


def roll(config: dict) -> None:
    """An engine setting both pools read at start: Serve replaces every prefill and decode replica."""
    for pool in ("prefill", "decode"):
        engine = config[pool].setdefault("engine", {})
        engine["max_num_seqs"] = engine.get("max_num_seqs", 64) + 1


def act(target: Target, name: str, decode_replicas: int) -> tuple[str, Callable[[], None]]:
    """Start phase `name`: (what was done, how to end it)."""
    if name in ("kill_decode", "kill_prefill"):
        return f"killed {kill_busiest(target, name.split('_')[1])}", lambda: None
    if name == "pull_fail":
        if target.fault_file is None:
            raise ValueError("pull_fail needs Target.fault_file (the replicas' $BATON_FAULTS_FILE)")
        faults.write(target.fault_file, {"kv_pull_fail": 1.0})
        return "every KV pull fails", lambda: faults.write(target.fault_file, {})
    if name in ("scale_down", "scale_up"):
        n = max(decode_replicas - 1, 1) if name == "scale_down" else decode_replicas
        if name == "scale_down":        # Serve picks the replica to stop: wait (briefly) until each runs streams
            deadline = time.monotonic() + 5.0
            while not all(running(target, "decode").values()) and time.monotonic() < deadline:
                time.sleep(0.1)
        return redeploy_edit(target, lambda c: c["decode"].update(num_replicas=n)), lambda: None
    if name == "roll":
        return redeploy_edit(target, roll), lambda: None
    return "", lambda: None


def move_counters(m: dict[str, float]) -> dict[str, float]:
    """Moves by `how` (replay | kv_pull), and tokens of moves: recomputed by replays vs moved by KV pulls."""
    out = {"moves_replay": 0.0, "moves_kv_pull": 0.0, "tokens_recomputed_by_replay": 0.0,
           "tokens_moved_by_kv_pull": 0.0}
    for k, v in m.items():
        name, pulled = k.split("{", 1)[0], 'how="kv_pull"' in k
        if name == MOVES:
            out["moves_kv_pull" if pulled else "moves_replay"] += v
        elif name == MOVED_TOKENS:
            out["tokens_moved_by_kv_pull" if pulled else "tokens_recomputed_by_replay"] += v
    return out


def increase(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each counter's increase between two scrapes. One that went down belongs to a new ingress replica (a
    roll replaced it; resizes do not) and counts from 0, as Prometheus' increase() does: a lower bound, since
    what the old replica counted after the first scrape went with it."""
    return {k: after[k] - before.get(k, 0.0) if after[k] >= before.get(k, 0.0) else after[k] for k in after}


def counters_absent(m: dict[str, float]) -> list[str]:
    """Which of move_counters' sums no exported counter feeds (each sample set to 1: a present one sums above 0)."""
    present = move_counters({k: 1.0 for k in m})
    moves = present["moves_replay"] + present["moves_kv_pull"]
    return ([MOVES] if not moves else []) + [k for k in ("tokens_recomputed_by_replay", "tokens_moved_by_kv_pull")
                                             if not present[k]]


# -- the schedule --------------------------------------------------------------------------------------------
def run_phases(target: Target, names: list[str], phase_s: float, t0: float, samples: list[dict],
               progress: Callable[[str], None]) -> list[Phase]:
    """Each phase: start its action (in a thread: a redeploy blocks), sample replica counts every second, end it
    when both phase_s has passed and the action returned; counters read at its edges."""
    decode_replicas = len(replicas("decode", target.app))
    phases, before = [], move_counters(scrape(target.base))
    for name in names:
        p = Phase(name, start=time.perf_counter() - t0)
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.update(zip(("note", "undo"), act(target, name, decode_replicas))))
        worker.start()
        while worker.is_alive() or time.perf_counter() - t0 < p.start + phase_s:
            samples.append({"t": time.perf_counter() - t0, "phase": name,
                            **{pool: len(replicas(pool, target.app)) for pool in ("prefill", "decode")}})
            time.sleep(1.0)
        worker.join()
        box.get("undo", lambda: None)()
        after = move_counters(scrape(target.base))
        p.end, p.note = time.perf_counter() - t0, box.get("note", "action failed")
        p.moves = increase(before, after)
        before = after
        phases.append(p)
        progress(f"{name}: {p.start:.0f}-{p.end:.0f} s {p.note}")
    return phases


def make_request(rng: np.random.Generator, mix: Mix) -> Req:
    if rng.random() < mix.long_fraction:
        return Req(rng.integers(*VOCAB, size=mix.long_prompt_tokens).tolist(), mix.long_answer_tokens, tag="long")
    words = " ".join(rng.choice(WORDS, size=int(rng.integers(4, 20))))
    return Req(words, mix.chat_tokens, tag="chat", chat=True)


def failure(r: Req, res: Result) -> str | None:
    """Why a request failed (None: it did not): http, error_event, short_stream or client."""
    if res.ok:
        return None if res.usage_tokens == r.max_tokens else "short_stream"
    if res.status == 200:
        return "error_event"
    return "http" if res.status else "client"


async def open_loop(target: Target, rate: float, mix: Mix, seed: int, t0: float,
                    stopped: threading.Event) -> list[tuple[Req, Result, float]]:
    """Poisson arrivals until `stopped`; each request with its result and end time."""
    import aiohttp
    rng = np.random.default_rng(seed)

    async def timed(session, r: Req):
        res = await one(session, target.base, target.model, r, t0)
        return r, res, time.perf_counter() - t0
    tasks = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        while not stopped.is_set():
            r = make_request(rng, mix)
            r.at = time.perf_counter() - t0
            tasks.append(asyncio.create_task(timed(s, r)))
            await asyncio.sleep(rng.exponential(1.0 / rate))
        return list(await asyncio.gather(*tasks))


def run_chaos(target: Target, disruptions=DISRUPTIONS, phase_s: float = 20.0, rate: float = 2.0,
              mix: Mix | None = None, seed: int = 0, progress: Callable[[str], None] = log) -> dict[str, Any]:
    """Load the running cluster `target` through the schedule of `disruptions`; the per-phase report."""
    names, samples = schedule(list(disruptions)), []
    stopped, t0 = threading.Event(), time.perf_counter()

    async def main():
        loop = asyncio.create_task(open_loop(target, rate, mix or Mix(), seed, t0, stopped))
        try:
            phases = await asyncio.to_thread(run_phases, target, names, phase_s, t0, samples, progress)
        finally:
            stopped.set()                       # arrivals stop; the requests under way run to their end
        return phases, await loop
    phases, requests = asyncio.run(main())
    return report(phases, requests, samples, counters_absent(scrape(target.base)))   # not exported by the end


def report(phases: list[Phase], requests: list[tuple[Req, Result, float]], samples: list[dict],
           absent: list[str]) -> dict[str, Any]:
    def phase_of(t: float) -> int:
        return next((i for i, p in enumerate(phases) if t < p.end), len(phases) - 1)
    rows = [{"start": r.at, "end": end, "tag": r.tag, "failure": failure(r, res), "ttft": res.ttft,
             "itls": res.itls, "error": res.error} for r, res, end in requests]
    out = []
    for i, p in enumerate(phases):
        started = [x for x in rows if phase_of(x["start"]) == i]
        ended = [x for x in rows if phase_of(x["end"]) == i]
        failed = [x for x in ended if x["failure"]]
        out.append({**asdict(p), "started": len(started), "ended": len(ended), "failed": len(failed),
                    "failures": {k: sum(x["failure"] == k for x in failed) for k in {x["failure"] for x in failed}},
                    "errors": [x["error"] for x in failed if x["error"]][:3], **latencies(ended)})
    calm = latencies([x for x in rows if phases[phase_of(x["end"])].name == "calm"])
    for ph in out:
        ph["p99_vs_calm"] = {k: ph[k]["p99"] / calm[k]["p99"] if ph[k] and calm[k] else None
                             for k in ("ttft_ms", "itl_ms")}
    totals = {k: sum(p.moves.get(k, 0.0) for p in phases) for k in move_counters({})}
    return {"phases": out, "calm": calm, "requests": len(rows), "failed": sum(p["failed"] for p in out),
            "moves": totals, "counters_absent": absent, "replica_samples": samples,
            "timeline": [{k: x[k] for k in ("start", "end", "tag", "failure", "ttft")} for x in rows]}


def latencies(rows: list[dict]) -> dict[str, dict | None]:
    ttft = [x["ttft"] for x in rows if not x["failure"] and x["ttft"] is not None]
    itl = [v for x in rows if not x["failure"] for v in x["itls"]]
    return {k: {f"p{q}": float(np.percentile(a, q)) * 1e3 for q in (50, 99)} if a else None
            for k, a in (("ttft_ms", ttft), ("itl_ms", itl))}


# -- the benchmark ----------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(3, 1, figsize=(11, 8), sharex=True)
    rows, end = result["timeline"], max(p["end"] for p in result["phases"])
    bins = np.arange(0, end + 2, 2.0)
    axes[0].hist([x["start"] for x in rows], bins, weights=[0.5] * len(rows), label="started/s", alpha=0.6)
    axes[0].hist([x["end"] for x in rows if x["failure"]], bins, weights=[0.5] * sum(1 for x in rows if x["failure"]),
                 label="failed/s", color="tab:red", alpha=0.8)
    axes[0].set_ylabel("requests/s")
    ok = [x for x in rows if not x["failure"] and x["ttft"] is not None]
    axes[1].scatter([x["start"] for x in ok], [x["ttft"] * 1e3 for x in ok], s=6, label="TTFT")
    axes[1].set_yscale("log")
    axes[1].set_ylabel("TTFT, ms")
    s = result["replica_samples"]
    for pool in ("prefill", "decode"):
        axes[2].step([x["t"] for x in s], [x[pool] for x in s], where="post", label=pool)
    axes[2].set_ylabel("replicas")
    axes[2].set_xlabel("seconds")
    for p in (p for p in result["phases"] if p["name"] != "calm"):      # event markers: the disruptions
        for ax in axes:
            ax.axvspan(p["start"], p["end"], color="tab:orange", alpha=0.12)
        axes[0].annotate(p["name"], (p["start"], 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                         rotation=90, va="top")
    for ax in axes:
        ax.legend(fontsize=7, loc="upper right")
        ax.grid(alpha=0.3)
    fig.suptitle(f"chaos: {result['requests']} requests, {result['failed']} failed")
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--phase-s", type=float, default=15.0, help="seconds per phase (default 15: a few minutes in all)")
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s (default 2)")
    p.add_argument("--disruptions", default=",".join(DISRUPTIONS),
                   help=f"comma-separated, in order (default {','.join(DISRUPTIONS)})")
    p.add_argument("--chat-tokens", type=int, default=Mix.chat_tokens, help="tokens per chat answer")
    p.add_argument("--long-prompt-tokens", type=int, default=Mix.long_prompt_tokens,
                   help="prompt tokens of a long-prompt request")
    p.add_argument("--long-answer-tokens", type=int, default=Mix.long_answer_tokens,
                   help="tokens per long-prompt answer")
    p.add_argument("--model", default=None, help="model (default: a tiny random Llama with SmolLM2's tokenizer; "
                                                 "e.g. SmolLM2-135M-Instruct's directory)")
    p.add_argument("--prefill-replicas", type=int, default=2)
    p.add_argument("--decode-replicas", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/chaos",
                   help="directory for chaos.json and chaos.png (default bench_out/chaos)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def tiny_model(directory: str) -> str:
    """The reliability tests' model: a tiny random Llama that speaks SmolLM2's tokenizer (the faults, not the
    model, are under test: it runs on a 2-core CPU box)."""
    from transformers import AutoTokenizer

    from engine.loader import resolve_model
    from bench.models import make_tiny_checkpoint
    make_tiny_checkpoint(directory, "llama", vocab_size=49152, max_position_embeddings=2048, num_hidden_layers=2,
                         bos_token_id=1, eos_token_id=2)
    AutoTokenizer.from_pretrained(resolve_model(None)).save_pretrained(directory)
    return str(directory)


def cluster_config(args: argparse.Namespace, model: str) -> dict:
    engine = {"kv_cache_memory": 64 << 20, "max_model_len": 512, "max_num_seqs": 64}
    return {"model": model, "port": PORT, "ingress": {"num_cpus": 0},
            "prefill": {"num_replicas": args.prefill_replicas, "num_cpus": 0, "engine": dict(engine)},
            "decode": {"num_replicas": args.decode_replicas, "num_cpus": 0, "engine": dict(engine)},
            "disaggregation": {"min_remote_prefill_tokens": 16}, "transfer": {"ttl_s": 3.0},
            "admission": {"enabled": False}}


def run(args: argparse.Namespace) -> dict:
    import os

    import ray

    from cluster.config import ClusterConfig
    from cluster.serving import start, stop
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    mix = Mix(chat_tokens=args.chat_tokens, long_prompt_tokens=args.long_prompt_tokens,
              long_answer_tokens=args.long_answer_tokens)
    with tempfile.TemporaryDirectory(prefix="baton-chaos-") as tmp:
        model = args.model or tiny_model(os.path.join(tmp, "tiny"))
        fault_file = os.path.join(tmp, "faults.json")
        faults.write(fault_file, {})
        os.environ[faults.ENV] = fault_file                 # the local Ray's processes inherit it at start
        config = cluster_config(args, model)
        cfg = ClusterConfig.from_dict(copy.deepcopy(config))
        init_ray(num_cpus=max(os.cpu_count() or 1, 4), include_dashboard=False, logging_level="WARNING",
                 log_to_driver=False, namespace="baton-bench-chaos")
        try:
            t = time.perf_counter()
            start(cfg)
            log(f"cluster up in {time.perf_counter() - t:.0f} s: {args.prefill_replicas} prefill + "
                f"{args.decode_replicas} decode, {cfg.model_name()}")
            target = Target(f"http://127.0.0.1:{PORT}", cfg.model_name(), fault_file, config)
            result = run_chaos(target, [d for d in args.disruptions.split(",") if d], args.phase_s, args.rate,
                               mix=mix, seed=args.seed)
        finally:
            stop()
            ray.shutdown()
    result = {"benchmark": "chaos", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine_info(), "model": args.model or "tiny random Llama (SmolLM2 tokenizer)",
              "rate_rps": args.rate, "phase_s": args.phase_s, "mix": asdict(mix), **result,
              "method_notes": {
                  "failure": "HTTP error, error event in the stream, or fewer completion tokens than max_tokens "
                             "(every request is ignore_eos)",
                  "attribution": "started: by start time; failed and latencies: by end time",
                  "moves": "deltas of the ingress /metrics counters over each phase; counters_absent lists those "
                           "this cluster does not export (counted as 0)"}}
    write_result(result, out_dir / "chaos.json", {"chaos": plot})
    for p in result["phases"]:
        log(f"{p['name']:>12}: {p['started']} started, {p['failed']} failed, TTFT {p['ttft_ms']}, moves {p['moves']}")
    return result
