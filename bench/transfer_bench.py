"""`baton bench transfer`: the KV of one long request moved between two processes, in one run.

For each model shape (the default model, and the dummy 1B Llama shape):
  1. prefill time: a fresh engine of that shape prefills one random prompt of --tokens tokens
     (TTFT of a max_tokens=1 request, prefix cache cold), the time the transfer must stay well under;
  2. the copy bound: one process copies the same bytes (a) as one contiguous tensor copy and
     (b) block by block between two caches of the engine's layout;
  3. NIXL: two Ray actors, each with a random KV cache of that layout and a NixlTransport; the
     consumer pulls the prompt's blocks (scattered, as a prefill leaves them) into its own scattered
     blocks, `--repeats` times (the first pull, which includes the handshake, is reported apart);
  4. the Ray fallback (RayTransport), same actors' layout, same blocks.
A pull's time is the producer's export (the fallback copies the blocks out and into the object store
there; NIXL only pins) plus the consumer's pull, one hand-off at a time.
Every pull is checked byte-exact afterwards. Goals: NIXL >= 30% of the contiguous copy bound,
>= 3x the fallback, and NIXL's pull < 10% of the prefill time.

--producer-tp P --consumer-tp C: each actor stands for a pool of that TP size, its ranks' cache shards
and transports in the one process; every consumer rank pulls its heads from the producer ranks that hold
them (kvtransfer/tp_plan.py), the pull's time is until all are done. `descriptors_per_block` counts the
READ descriptors of one block over all consumer ranks (1 for TP 1 -> 1).

--kv-cache-dtypes auto,int8 (the default): each shape is measured with each KV cache dtype, as entries named
`<shape>` (auto) and `<shape> kv-<dtype>`; a quantized block (engine/kv_layout.py) is about a quarter of fp32's bytes,
its scales in it, so its `bytes` and GB/s say what a hand-off of the same prompt costs in that format.

--cross-node (root): the NIXL pulls of step 3 between two nodes of a 3-node Ray cluster built from network
namespaces (cluster/netns.py), producer on node 1 and consumer on node 2, against both on node 1, in one run
with the same shapes, blocks and TP sizes. UCX_TLS is tcp unless --ucx-tls says otherwise, as
`transfer.ucx_tls: tcp` sets it in a cluster: the namespaces share one kernel, so shared memory or cma would
skip the network. Writes
transfer_cross_node.json: per shape the prefill fields above, `same_node` and `cross_node` (each a pull
result: gbps, pull_s, first_pull_s, byte_exact, node_ips [producer, consumer], ucx_tls, ...) and
`cross_of_same` (cross-node GB/s over same-node GB/s); and transfer_cross_node.png.
"""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import hashlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result
from cluster.serving import init_ray

log = make_logger("transfer-bench")

SHAPES = ("default", "llama-1b")
# --cross-node: (producer, consumer) nodes of the 3-node namespace cluster; node 0, the head, runs the driver
PLACEMENTS = {"same_node": (1, 1), "cross_node": (1, 2)}
GOAL_OF_BOUND, GOAL_VS_FALLBACK, GOAL_OF_PREFILL = 0.30, 3.0, 0.10
BLOCK_SIZE = 16


class Endpoint:
    """One engine's KV cache (random bytes, the engine's layout [blocks, heads, ...]) and its transport, in its
    own process; with tp > 1, its ranks' shards of that cache and one transport each."""

    def __init__(self, kind: str, prefix: str, shape: tuple[int, ...], seed: int, tp: int = 1,
                 dtype: str = "float32"):
        from engine.kv_layout import KVHeadLayout
        from kvtransfer import make_transport
        kv = random_cache(shape, dtype, seed)
        self.layout = KVHeadLayout(shape[1], tp)
        shards = [kv] if tp == 1 else [kv[:, list(self.layout.heads_of(r))].clone() for r in range(tp)]
        self.ts = [make_transport(shard, prefix, "bench:" + "x".join(map(str, shape[1:])), kind=kind,
                                  peer_metadata=_peer_metadata, layout=self.layout, rank=r)
                   for r, shard in enumerate(shards)]
        self.t = self.ts[0]                       # rank 0 exports and holds the leases

    def metadata(self, agent: str | None = None) -> bytes:
        return next(t for t in self.ts if agent in (None, t.name)).metadata()

    def export(self, request_id: str, block_ids: list[int]) -> tuple[Any, float]:
        """A hand-off of the blocks and the seconds its export took."""
        t = time.perf_counter()
        payloads = [r.shard_payload(block_ids) for r in self.ts] if self.t.kind == "ray" and len(self.ts) > 1 else None
        handoff = self.t.export(request_id, block_ids, [], BLOCK_SIZE * len(block_ids), 600,
                                agents=[r.name for r in self.ts], payloads=payloads)
        return handoff, time.perf_counter() - t

    def pull_time(self, handoff, dst: list[int]) -> float:
        t = time.perf_counter()
        if len(self.ts) == 1:
            self.t.pull(handoff, dst, timeout_s=120)
        else:                                     # every rank pulls its heads, then rank 0 tells the producer
            for pull in [r.start_pull(handoff, dst, notify=False) for r in self.ts]:
                pull.wait(120)
            self.t.notify_pulled(handoff)
        return time.perf_counter() - t

    def released(self) -> int:
        return len(self.t.poll())

    def digest(self, block_ids: list[int]) -> str:
        """Of the unsharded blocks (each head once, from the first rank that holds it)."""
        parts, seen = [], set()
        for r, t in enumerate(self.ts):
            if self.layout.heads_of(r)[0] not in seen:
                parts.append(t.kv_cache[block_ids])
                seen.update(self.layout.heads_of(r))
        return hashlib.blake2b(torch.cat(parts, 1).numpy().tobytes(), digest_size=16).hexdigest()

    def env(self) -> dict:
        import ray
        return {"UCX_TLS": os.environ.get("UCX_TLS"), "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}


def random_cache(shape: tuple[int, ...], dtype: str, seed: int) -> torch.Tensor:
    """Random contents of a cache: fp32 values, or a quantized cache's bytes (uint8)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == "uint8":
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.randn(shape, generator=g, dtype=getattr(torch, dtype))


def _peer_metadata(agent: str) -> bytes:
    """A rank's agent is `<actor>.r<rank>-<uuid>` (TP > 1), else `<actor>-<uuid>`."""
    import ray
    actor = re.sub(r"\.r\d+$", "", agent.rsplit("-", 1)[0])
    return ray.get(ray.get_actor(actor).metadata.remote(agent))


def descriptors_per_block(heads: int, producer_tp: int, consumer_tp: int) -> int:
    """READ descriptors that move one block, over all consumer ranks: one per run of heads."""
    from engine.kv_layout import KVHeadLayout
    from kvtransfer.tp_plan import plan_runs
    p, c = KVHeadLayout(heads, producer_tp), KVHeadLayout(heads, consumer_tp)
    return sum(len(plan_runs(p, c, r)) for r in range(consumer_tp))


# -- measurements -----------------------------------------------------------------------------------
def measure_prefill(model: str, tokens: int, kv_cache_dtype: str = "auto") -> dict:
    """TTFT of one cold prompt of `tokens` random ids (after a short warm-up request), and the engine's KV layout."""
    from engine import LLM, SamplingParams
    dummy = model not in (None, "default") and model.startswith("llama-")
    llm = LLM(None if model == "default" else model, load_format="dummy" if dummy else "auto",
              max_model_len=tokens + 16, kv_cache_memory=None, num_kv_blocks=-(-(tokens + 16) // BLOCK_SIZE) + 8,
              enable_prefix_caching=False, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    rng = np.random.default_rng(0)
    vocab = llm.engine.hf_config.vocab_size
    one = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([rng.integers(100, vocab - 100, 32).tolist()], one)                # warm-up
    out = llm.generate([rng.integers(100, vocab - 100, tokens).tolist()], one)[0]
    cache = runner.kv_cache
    res = {"model": llm.engine.model_path, "prefill_s": out.metrics.ttft, "tokens": tokens,
           "kv_block_shape": list(cache.shape[1:]), "kv_dtype": str(cache.dtype).removeprefix("torch."),
           "dtype": str(runner.dtype).removeprefix("torch."), "kv_cache_dtype": kv_cache_dtype,
           "block_bytes": runner.block_bytes, "weight_bytes": runner.weight_bytes}
    del llm, runner
    gc.collect()
    return res


def measure_copy_bound(num_blocks: int, block_shape: tuple[int, ...], repeats: int, dtype: str = "float32") -> dict:
    """The same bytes copied within one process: one contiguous copy_, and block by block between caches."""
    rng = np.random.default_rng(1)
    cache = 2 * num_blocks + 8
    src, dst = random_cache((cache, *block_shape), dtype, 1), random_cache((cache, *block_shape), dtype, 2)
    s_ids, d_ids = rng.permutation(cache)[:num_blocks].tolist(), rng.permutation(cache)[:num_blocks].tolist()
    flat_src, flat_dst = src[:num_blocks].clone(), torch.empty_like(src[:num_blocks])
    contiguous, per_block = [], []
    for _ in range(repeats + 1):                                  # the first of each is a warm-up
        t = time.perf_counter()
        flat_dst.copy_(flat_src)
        contiguous.append(time.perf_counter() - t)
        t = time.perf_counter()
        for a, b in zip(s_ids, d_ids):
            dst[b].copy_(src[a])
        per_block.append(time.perf_counter() - t)
    assert torch.equal(dst[d_ids], src[s_ids])
    return {"contiguous_s": statistics.median(contiguous[1:]), "per_block_s": statistics.median(per_block[1:])}


def measure_transport(kind: str, shape_name: str, num_blocks: int, block_shape: tuple[int, ...],
                      repeats: int, tps: tuple[int, int] = (1, 1), nodes: tuple[int, int] | None = None,
                      dtype: str = "float32") -> dict:
    """`nodes`: the producer's and the consumer's node in a NetnsCluster (its `baton_node_<i>` resources);
    None: wherever Ray puts them."""
    import ray
    cache = 2 * num_blocks + 8
    rng = np.random.default_rng(2)
    src, dst = rng.permutation(cache)[:num_blocks].tolist(), rng.permutation(cache)[:num_blocks].tolist()
    actor = ray.remote(Endpoint)
    where = f"-n{nodes[0]}n{nodes[1]}" if nodes else ""
    names = [f"{p}-{kind}-{shape_name}{where}".replace("_", "").replace(" ", "-") for p in ("producer", "consumer")]
    producer, consumer = (
        actor.options(name=n, num_cpus=0, resources={f"baton_node_{nodes[i]}": 0.01} if nodes else None)
        .remote(kind, n, (cache, *block_shape), i, tps[i], dtype) for i, n in enumerate(names))
    try:
        penv, env = ray.get([producer.env.remote(), consumer.env.remote()])
        times = []
        for i in range(repeats + 1):             # one at a time: the fallback's copies never pile up
            handoff, export_s = ray.get(producer.export.remote(f"pull-{i}", src))
            times.append(export_s + ray.get(consumer.pull_time.remote(handoff, dst)))
        exact = ray.get(consumer.digest.remote(dst)) == ray.get(producer.digest.remote(src))
        released, deadline = 0, time.monotonic() + 10
        while released < repeats + 1 and time.monotonic() < deadline:
            released += ray.get(producer.released.remote())
            time.sleep(0.01)
    finally:
        for a in (producer, consumer):
            ray.kill(a)
    return {"first_pull_s": times[0], "pull_s": statistics.median(times[1:]), "pull_s_min": min(times[1:]),
            "pull_s_all": times[1:], "byte_exact": exact, "producer_unpinned": released,
            "descriptors_per_block": descriptors_per_block(block_shape[0], *tps),
            "ucx_tls": env["UCX_TLS"] if kind == "nixl" else None, "node_ips": [penv["node_ip"], env["node_ip"]]}


def entry_name(shape: str, kv_cache_dtype: str) -> str:
    return shape if kv_cache_dtype == "auto" else f"{shape} kv-{kv_cache_dtype}"


def bench_shape(shape: str, tokens: int, repeats: int, tps: tuple[int, int] = (1, 1),
                kv_cache_dtype: str = "auto") -> dict:
    model, shape = shape, entry_name(shape, kv_cache_dtype)
    log(f"{shape}: prefill of {tokens} tokens")
    pre = measure_prefill(model, tokens, kv_cache_dtype)
    num_blocks, block_shape, dtype = -(-tokens // BLOCK_SIZE), tuple(pre["kv_block_shape"]), pre["kv_dtype"]
    nbytes = num_blocks * pre["block_bytes"]
    log(f"{shape}: prefill {pre['prefill_s']:.2f} s; KV {nbytes / 1e6:.1f} MB in {num_blocks} blocks")
    bound = measure_copy_bound(num_blocks, block_shape, repeats, dtype)
    res: dict[str, Any] = {**pre, "num_blocks": num_blocks, "bytes": nbytes,
                           "copy_bound_gbps": nbytes / bound["contiguous_s"] / 1e9,
                           "per_block_copy_gbps": nbytes / bound["per_block_s"] / 1e9, **bound}
    for kind in ("nixl", "ray"):
        r = measure_transport(kind, shape, num_blocks, block_shape, repeats, tps, dtype=dtype)
        r["gbps"] = nbytes / r["pull_s"] / 1e9
        log(f"{shape}: {kind} TP {tps[0]} -> {tps[1]} {r['gbps']:.2f} GB/s (median of {repeats}; first pull "
            f"{r['first_pull_s'] * 1e3:.0f} ms), {r['descriptors_per_block']} descriptors/block, exact {r['byte_exact']}")
        res[kind] = r
    n, bound_gbps = res["nixl"], res["copy_bound_gbps"]
    res["ratios"] = {"nixl_of_copy_bound": n["gbps"] / bound_gbps,
                     "nixl_of_per_block_copy": n["gbps"] / res["per_block_copy_gbps"],
                     "nixl_vs_fallback": n["gbps"] / res["ray"]["gbps"],
                     "nixl_pull_of_prefill": n["pull_s"] / res["prefill_s"]}
    q = res["ratios"]
    res["goals"] = {f"nixl_ge_{GOAL_OF_BOUND:.0%}_of_copy_bound": q["nixl_of_copy_bound"] >= GOAL_OF_BOUND,
                    f"nixl_ge_{GOAL_VS_FALLBACK:g}x_fallback": q["nixl_vs_fallback"] >= GOAL_VS_FALLBACK,
                    f"nixl_pull_lt_{GOAL_OF_PREFILL:.0%}_of_prefill": q["nixl_pull_of_prefill"] < GOAL_OF_PREFILL,
                    "byte_exact": n["byte_exact"] and res["ray"]["byte_exact"]}
    log(f"{shape}: copy bound {bound_gbps:.2f} GB/s, per-block copy {res['per_block_copy_gbps']:.2f} GB/s; "
        f"NIXL = {q['nixl_of_copy_bound']:.0%} of bound, {q['nixl_vs_fallback']:.1f}x fallback, "
        f"{q['nixl_pull_of_prefill']:.2%} of prefill")
    return res


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    shapes = list(result["shapes"])
    series = [("copy, one process", lambda r: r["copy_bound_gbps"]),
              ("per-block copy, one process", lambda r: r["per_block_copy_gbps"]),
              ("NIXL, two processes", lambda r: r["nixl"]["gbps"]),
              ("Ray fallback, two processes", lambda r: r["ray"]["gbps"])]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    w = 0.8 / len(series)
    for i, (label, f) in enumerate(series):
        vals = [f(result["shapes"][s]) for s in shapes]
        bars = ax.bar(np.arange(len(shapes)) + (i - (len(series) - 1) / 2) * w, vals, w, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks(np.arange(len(shapes)),
                  [f"{s}\n{result['shapes'][s]['bytes'] / 1e6:.0f} MB, {result['tokens']} tokens" for s in shapes])
    ax.set_ylabel("GB/s")
    tps = f", TP {result['producer_tp']} -> {result['consumer_tp']}" if result.get("producer_tp", 1) * \
        result.get("consumer_tp", 1) > 1 else ""
    ax.set_title(f"KV of one request between two engines{tps}")
    ax.legend(fontsize=8)
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=2048, help="prompt length whose KV is moved (default 2048)")
    p.add_argument("--shapes", default=",".join(SHAPES),
                   help="comma-separated: 'default' (SmolLM2-135M) and/or dummy shapes such as llama-1b")
    p.add_argument("--repeats", type=int, default=10, help="timed pulls per transport (default 10)")
    p.add_argument("--ucx-tls", default=None,
                   help="UCX_TLS for the NIXL actors (default: kvtransfer's choice; tcp with --cross-node)")
    p.add_argument("--kv-cache-dtypes", default="auto,int8",
                   help="comma-separated KV cache dtypes to measure each shape with: auto, int8, fp8 (default auto,int8)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 256 tokens, default model only, 3 repeats")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/transfer",
                   help="directory for transfer.json and transfer.png (default bench_out/transfer)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--producer-tp", type=int, default=1, help="the producer pool's TP size (default 1)")
    p.add_argument("--consumer-tp", type=int, default=1, help="the consumer pool's TP size (default 1)")
    p.add_argument("--cross-node", action="store_true",
                   help="NIXL pulls between two nodes of a 3-node Ray cluster in network namespaces against two "
                        "processes on one node (needs root); writes transfer_cross_node.json and .png")


def run(args: argparse.Namespace) -> dict:
    if args.cross_node:
        return run_cross_node(args)
    import ray
    started = time.perf_counter()
    tokens, repeats, shapes, out_dir = _sizes(args)
    env = {"UCX_TLS": args.ucx_tls} if args.ucx_tls else {}
    init_ray(namespace="baton-bench-transfer", include_dashboard=False, log_to_driver=False,
             logging_level="WARNING", runtime_env={"env_vars": env} if env else None)
    try:
        tps = (args.producer_tp, args.consumer_tp)
        per_shape = {entry_name(s, kv): bench_shape(s, tokens, repeats, tps, kv)
                     for s in shapes for kv in _kv_dtypes(args)}
    finally:
        ray.shutdown()
    result: dict[str, Any] = {
        "benchmark": "transfer", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "tokens": tokens, "repeats": repeats, "quick": args.quick,
        "producer_tp": args.producer_tp, "consumer_tp": args.consumer_tp,
        "method_notes": {
            "prefill_s": "TTFT of one cold max_tokens=1 request of `tokens` random ids, after a warm-up request",
            "copy_bound": "median of one contiguous torch copy_ of the same bytes in one process",
            "per_block_copy": "median of a block-by-block copy_ between two caches of the engine's layout",
            "pull_s": "median wall time of a blocking pull in the consumer actor, handshake excluded "
                      "(first_pull_s includes it); blocks scattered on both sides",
            "goals": f"NIXL >= {GOAL_OF_BOUND:.0%} of the copy bound, >= {GOAL_VS_FALLBACK:g}x the fallback, "
                     f"pull < {GOAL_OF_PREFILL:.0%} of prefill"},
        "shapes": per_shape,
        "goals": {f"{s}:{g}": ok for s, r in per_shape.items() for g, ok in r["goals"].items()},
    }
    write_result(result, out_dir / "transfer.json", {"gbps": ("transfer.png", plot)})
    log(f"goals: {result['goals']}")
    log(f"wrote {result['json_path']} and {result['plots']['gbps']} in {time.perf_counter() - started:.0f} s")
    return result


def _kv_dtypes(args: argparse.Namespace) -> list[str]:
    from engine.kv_layout import KV_CACHE_DTYPES
    kinds = [k.strip() for k in args.kv_cache_dtypes.split(",") if k.strip()]
    if bad := [k for k in kinds if k not in KV_CACHE_DTYPES]:
        raise SystemExit(f"--kv-cache-dtypes: {', '.join(bad)} unknown (choose from {', '.join(KV_CACHE_DTYPES)})")
    return kinds


def _sizes(args: argparse.Namespace) -> tuple[int, int, list[str], Path]:
    """Tokens, repeats, shapes and the output directory (made) the arguments ask for."""
    tokens, repeats = (256, 3) if args.quick else (args.tokens, args.repeats)
    shapes = ["default"] if args.quick else [s.strip() for s in args.shapes.split(",") if s.strip()]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return tokens, repeats, shapes, out_dir


# -- across nodes -----------------------------------------------------------------------------------
def run_cross_node(args: argparse.Namespace) -> dict:
    """--cross-node: the prefill (for the KV layout) here, then a 3-node namespace cluster whose head runs
    `cross_node_pulls`; the cluster and its namespaces are removed whatever happens."""
    from cluster.netns import NetnsCluster, unavailable
    why = unavailable()
    if why:
        raise SystemExit(f"baton bench transfer --cross-node: {why}; it builds a Ray cluster from network "
                         f"namespaces (cluster/netns.py), so run it as root on Linux")
    started = time.perf_counter()
    tokens, repeats, shapes, out_dir = _sizes(args)
    ucx_tls = args.ucx_tls or "tcp"
    per_shape: dict[str, dict] = {}
    for model in shapes:
        for kv in _kv_dtypes(args):
            shape = entry_name(model, kv)
            log(f"{shape}: prefill of {tokens} tokens (for the KV layout)")
            pre = measure_prefill(model, tokens, kv)
            num_blocks = -(-tokens // BLOCK_SIZE)
            per_shape[shape] = {**pre, "num_blocks": num_blocks, "bytes": num_blocks * pre["block_bytes"]}
    cluster = NetnsCluster(nodes=3, name="baton-bench-xnode", subnet="10.79.0")
    try:
        log(f"starting a {cluster.nodes}-node Ray cluster in network namespaces {cluster.ns(0)}..{cluster.ns(2)}")
        cluster.up()
        layouts = {s: {k: r[k] for k in ("num_blocks", "kv_block_shape", "kv_dtype", "bytes")}
                   for s, r in per_shape.items()}
        tps = (args.producer_tp, args.consumer_tp)
        code = (f"import json; from bench.transfer_bench import cross_node_pulls\n"
                f"print('OUT' + json.dumps(cross_node_pulls({layouts!r}, {repeats}, {ucx_tls!r}, {tps!r})))")
        res = cluster.exec(0, [sys.executable, "-c", code], timeout=1800, stderr=None)   # its progress: our stderr
        lines = [x for x in res.stdout.splitlines() if x.startswith("OUT")]
        if res.returncode != 0 or not lines:
            raise RuntimeError(f"the pulls on the cluster failed (exit {res.returncode}; its error is above)")
        pulls = json.loads(lines[-1][3:])
    finally:
        log("stopping the cluster, deleting its namespaces")
        cluster.down()
    for shape, r in per_shape.items():
        r.update(pulls[shape])
        r["cross_of_same"] = r["cross_node"]["gbps"] / r["same_node"]["gbps"]
        log(f"{shape}: cross-node {r['cross_node']['gbps']:.2f} GB/s = {r['cross_of_same']:.0%} of same-node "
            f"{r['same_node']['gbps']:.2f} GB/s (UCX_TLS={ucx_tls})")
    result: dict[str, Any] = {
        "benchmark": "transfer_cross_node", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "tokens": tokens, "repeats": repeats, "quick": args.quick, "ucx_tls": ucx_tls,
        "producer_tp": args.producer_tp, "consumer_tp": args.consumer_tp,
        "cluster": {"nodes": cluster.nodes, "ips": [cluster.ip(i) for i in range(cluster.nodes)],
                    "placements": PLACEMENTS},
        "method_notes": {
            "placements": "(producer node, consumer node); the consumer pulls, so KV flows from the first to the "
                          "second; node 0 (the head) runs the driver",
            "pull_s": "median wall time of a blocking NIXL pull in the consumer actor (plus the producer's export), "
                      "handshake excluded (first_pull_s includes it); blocks scattered on both sides",
            "byte_exact": "the consumer's pulled blocks hash equal to the producer's (blake2b of their bytes)",
            "cross_of_same": "cross-node GB/s over same-node GB/s, same UCX_TLS, shapes and blocks"},
        "shapes": per_shape,
    }
    write_result(result, out_dir / "transfer_cross_node.json", {"gbps": ("transfer_cross_node.png", plot_cross_node)})
    log(f"wrote {result['json_path']} and {result['plots']['gbps']} in {time.perf_counter() - started:.0f} s")
    return result


def cross_node_pulls(layouts: dict[str, dict], repeats: int, ucx_tls: str,
                     tps: tuple[int, int] = (1, 1)) -> dict[str, dict]:
    """In the head node's namespace: per shape, NIXL pulls between actors on the nodes of each placement."""
    import ray
    log = make_logger("transfer-bench on the head")       # this process's clock: it starts at 0 here
    init_ray(namespace="baton-bench-transfer", log_to_driver=False, logging_level="WARNING",
             runtime_env={"env_vars": {"UCX_TLS": ucx_tls}})
    out: dict[str, dict] = {}
    try:
        for shape, lay in layouts.items():
            for where, nodes in PLACEMENTS.items():
                log(f"{shape}: NIXL pulls, {where} (node {nodes[0]} -> node {nodes[1]}), UCX_TLS={ucx_tls}")
                r = measure_transport("nixl", shape, lay["num_blocks"], tuple(lay["kv_block_shape"]), repeats,
                                      tps, nodes, lay["kv_dtype"])
                r["gbps"] = lay["bytes"] / r["pull_s"] / 1e9
                log(f"{shape}: {where} {r['gbps']:.2f} GB/s (median of {repeats}; first pull "
                    f"{r['first_pull_s'] * 1e3:.0f} ms), {r['node_ips'][0]} -> {r['node_ips'][1]}, "
                    f"exact {r['byte_exact']}")
                out.setdefault(shape, {})[where] = r
    finally:
        ray.shutdown()
    return out


def plot_cross_node(result: dict, path: Path) -> None:
    plt = pyplot()
    shapes = list(result["shapes"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    w = 0.8 / len(PLACEMENTS)
    for i, where in enumerate(PLACEMENTS):
        vals = [result["shapes"][s][where]["gbps"] for s in shapes]
        bars = ax.bar(np.arange(len(shapes)) + (i - (len(PLACEMENTS) - 1) / 2) * w, vals, w,
                      label=where.replace("_", " ") + " (node {} -> node {})".format(*PLACEMENTS[where]))
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(np.arange(len(shapes)),
                  [f"{s}\n{result['shapes'][s]['bytes'] / 1e6:.1f} MB, {result['tokens']} tokens" for s in shapes])
    ax.set_ylabel("GB/s")
    top = max(r[w]["gbps"] for r in result["shapes"].values() for w in PLACEMENTS)
    ax.set_ylim(0, 1.25 * top)                                     # room for the legend above the bars
    tp = (result["producer_tp"], result["consumer_tp"])
    tps = f", TP {tp[0]} -> {tp[1]}" if tp != (1, 1) else ""
    ax.set_title(f"KV of one request, NIXL over UCX_TLS={result['ucx_tls']}{tps}: across nodes vs within one")
    ax.legend(fontsize=8, loc="upper center", ncols=2)
    save(fig, path)
