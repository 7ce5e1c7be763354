"""`baton bench engine`: Baton's throughput, prefix-hit TTFT and decode speed against transformers, in one run."""
from __future__ import annotations

import argparse
import datetime as dt
import gc
import inspect
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

# Full-size workload; --quick swaps in the small one so a check on a shared CPU takes a minute or two.
FULL = dict(prompt_len=(32, 512), output_len=(16, 256), prefix_len=1024, suffix_len=32, ttft_trials=3,
            decode_prompt_len=32, decode_tokens=128)
QUICK = dict(prompt_len=(16, 64), output_len=(4, 16), prefix_len=256, suffix_len=16, ttft_trials=2,
             decode_prompt_len=16, decode_tokens=16)


# -- the workload (shared with other benchmarks) --------------------------------------------------
@dataclass
class WorkloadRequest:
    prompt_token_ids: list[int]
    max_tokens: int


def allowed_token_ids(tokenizer: Any, vocab_size: int) -> np.ndarray:
    """Token ids a random prompt may use: the model's vocab minus special tokens (BOS/EOS/chat markers),
    so no prompt accidentally ends a turn or a sequence."""
    special = set(getattr(tokenizer, "all_special_ids", None) or []) if tokenizer is not None else set()
    ids = np.arange(vocab_size)
    return ids[~np.isin(ids, list(special))] if special else ids


def make_workload(allowed: np.ndarray, num_requests: int, seed: int, prompt_len: tuple[int, int] = (32, 512),
                  output_len: tuple[int, int] = (16, 256)) -> list[WorkloadRequest]:
    """A seeded list of requests: lengths uniform in the inclusive ranges, prompts random ids from `allowed`.
    The same arguments give the same workload on every machine and for every system."""
    rng = np.random.default_rng(seed)
    p_lens = rng.integers(prompt_len[0], prompt_len[1] + 1, size=num_requests)
    o_lens = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    return [WorkloadRequest(rng.choice(allowed, size=int(p)).tolist(), int(o)) for p, o in zip(p_lens, o_lens)]


# -- small helpers ----------------------------------------------------------------------------------
_T0 = time.perf_counter()


def make_logger(name: str) -> Callable[[str], None]:
    """Progress lines `[name  seconds] msg` on stderr, so `--json` keeps stdout clean."""
    def log(msg: str) -> None:
        print(f"[{name} {time.perf_counter() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)
    return log


log = make_logger("engine-bench")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _exact_match(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens agree exactly: a check that the systems did the same work."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def machine_info() -> dict:
    import transformers
    return {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(),
            # the machine may be shared: the load at start says how much to trust the timings
            "loadavg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


# -- phase 1: throughput ----------------------------------------------------------------------------
def bench_baton(llm, workload: list[WorkloadRequest]) -> tuple[dict, list[list[int]]]:
    from engine import SamplingParams
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in workload]
    t = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in workload], params, use_tqdm=True)
    wall = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    res = {"wall_s": wall, "output_tokens": n_out, "output_tokens_per_s": n_out / wall,
           "mean_ttft_s": _mean([o.metrics.ttft for o in outs]),
           "mean_itl_s": _mean([o.metrics.time_per_output_token for o in outs])}
    return res, [list(o.token_ids) for o in outs]


def bench_hf_static(model, workload: list[WorkloadRequest], pad_id: int, batch_size: int) -> tuple[dict, list[list[int]]]:
    """transformers `generate` on fixed batches in request order: every batch runs until its longest request is
    done, so only the tokens each request asked for count as throughput."""
    dev = model.device
    tokens, wall, raw = [], 0.0, 0
    batches = [workload[i:i + batch_size] for i in range(0, len(workload), batch_size)]
    for batch in tqdm(batches, desc="hf static", file=sys.stderr):
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):                     # left padding: every prompt ends at the same column
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        max_new = max(r.max_tokens for r in batch)
        _sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad_id)
        _sync(dev)
        wall += time.perf_counter() - t
        gen = out[:, width:].cpu()
        raw += gen.numel()
        tokens += [gen[i, :r.max_tokens].tolist() for i, r in enumerate(batch)]
    requested = sum(r.max_tokens for r in workload)
    return {"wall_s": wall, "batch_size": batch_size, "output_tokens": requested,
            "output_tokens_per_s": requested / wall, "raw_generated_tokens": raw,
            "raw_generated_tokens_per_s": raw / wall}, tokens


def bench_hf_continuous(model, workload: list[WorkloadRequest], pad_id: int, max_num_seqs: int,
                        max_batch_tokens: int) -> tuple[dict, list[list[int]] | None]:
    """transformers' own continuous batching (`generation/continuous_batching`). Its manager takes a
    max_new_tokens and eos_token_id per request (generate_batch only takes one for all), so we drive the
    manager directly: each request gets exactly its own length, and eos -1 means "never stop"."""
    try:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
    except ImportError as e:
        return {"available": False, "error": f"not in this transformers: {e}"}, None
    page = 256
    # size the paged cache for the workload instead of the default (60% of RAM on CPU)
    blocks = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // page) for r in workload) + 4
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in workload),
                               eos_token_id=-1, pad_token_id=pad_id)
    try:
        # the paged cache's page is `page_size` in recent transformers, `block_size` in earlier 5.x (5.17)
        size_key = "page_size" if "page_size" in inspect.signature(ContinuousBatchingConfig).parameters else "block_size"
        cb_cfg = ContinuousBatchingConfig(**{size_key: page}, num_blocks=blocks, max_batch_tokens=max_batch_tokens,
                                          max_requests_per_batch=max_num_seqs)
        t_setup = time.perf_counter()
        # no inference_mode here: the manager's thread updates tensors in place and handles no_grad itself
        with model.continuous_batching_context_manager(
                generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=30) as mgr:
            setup = time.perf_counter() - t_setup
            t = time.perf_counter()
            ids = [mgr.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1)
                   for r in workload]
            results = _collect_cb(mgr, ids)
            wall = time.perf_counter() - t
    except Exception as e:                       # a peer failing (e.g. on this device) must not sink the run
        return {"available": False, "error": f"{type(e).__name__}: {e}"}, None
    failed = [rid for rid in ids if results.get(rid) is None or results[rid].error is not None]
    if failed:
        first = results.get(failed[0])
        why = first.error if first is not None else "missing (generation thread stopped)"
        return {"available": False, "error": f"{len(failed)}/{len(ids)} requests failed, e.g. {failed[0]}: {why}"}, None
    tokens = [list(results[rid].generated_tokens)[:r.max_tokens] for rid, r in zip(ids, workload)]
    raw = sum(len(results[rid].generated_tokens) for rid in ids)
    requested = sum(r.max_tokens for r in workload)
    return {"available": True, "api": "ContinuousBatchingManager.add_request (per-request max_new_tokens, eos -1)",
            "per_request_max_new_tokens": True, "page_size": page, "num_blocks": blocks,
            "max_batch_tokens": max_batch_tokens, "max_requests_per_batch": max_num_seqs, "setup_s": setup,
            "wall_s": wall, "output_tokens": requested, "output_tokens_per_s": requested / wall,
            "raw_generated_tokens": raw}, tokens


def _collect_cb(mgr, ids: list[str]) -> dict:
    results: dict = {}
    bar = tqdm(total=len(ids), desc="hf continuous", file=sys.stderr)
    while len(results) < len(ids):
        r = mgr.get_result(timeout=1)
        if r is not None and r.is_finished():
            results[r.request_id] = r
            bar.update()
        elif r is None and not mgr.is_running():
            break                                # the generation thread died: report what is missing
    bar.close()
    return results


# -- phase 2: TTFT with and without a prefix hit --------------------------------------------------
def bench_prefix_ttft(llm, allowed: np.ndarray, seed: int, prefix_len: int, suffix_len: int, trials: int) -> dict:
    """Cold: a fresh prefix the cache has never seen. Warm: the same prefix with another suffix, so only
    the suffix needs computing. Fresh prefixes per trial keep trials independent."""
    from engine import SamplingParams
    rng = np.random.default_rng(seed + 1)
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    cold, warm, cached = [], [], []
    for i in range(trials):
        prefix = rng.choice(allowed, size=prefix_len).tolist()
        sa, sb = (rng.choice(allowed, size=suffix_len).tolist() for _ in range(2))
        llm.engine.pool.reset_prefix_cache()
        a = llm.generate([prefix + sa], one)[0]
        b = llm.generate([prefix + sb], one)[0]
        cold.append(a.metrics.ttft)
        warm.append(b.metrics.ttft)
        cached.append(b.metrics.num_cached_tokens)
        log(f"  trial {i + 1}/{trials}: cold {a.metrics.ttft * 1e3:.1f} ms (cached {a.metrics.num_cached_tokens}), "
            f"warm {b.metrics.ttft * 1e3:.1f} ms (cached {b.metrics.num_cached_tokens})")
    c, w = statistics.median(cold), statistics.median(warm)
    return {"prefix_len": prefix_len, "suffix_len": suffix_len, "trials": trials, "cold_ttft_s": cold,
            "warm_ttft_s": warm, "median_cold_ttft_s": c, "median_warm_ttft_s": w, "warm_over_cold": w / c,
            "goal_warm_over_cold": 0.2, "meets_goal": w / c <= 0.2, "warm_num_cached_tokens": cached}


# -- phase 3: batch-1 decode against the memory-bandwidth bound -----------------------------------
def measure_bandwidth(device: torch.device, mib: int = 256, repeats: int = 5) -> dict:
    """Copy bandwidth: a copy reads and writes every byte, so traffic = 2 x size; best of several runs
    (the least disturbed by other work on the machine)."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - t)
    nbytes = src.numel() * 4
    return {"copy_mib": mib, "repeats": repeats, "best_copy_s": best, "bytes_per_s": 2 * nbytes / best,
            "definition": "bandwidth = 2 * bytes_copied / best_time (read + write traffic)"}


def bench_decode(llm, allowed: np.ndarray, seed: int, prompt_len: int, n_tokens: int, bandwidth: dict) -> dict:
    """One request alone: each decode step must read every weight once, so weight_bytes / bandwidth is a floor."""
    from engine import SamplingParams
    rng = np.random.default_rng(seed + 2)
    prompt = rng.choice(allowed, size=prompt_len).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=n_tokens, ignore_eos=True, temperature=0.0))[0]
    ms = out.metrics.time_per_output_token * 1e3
    wbytes = llm.engine.runner.weight_bytes
    bound_ms = wbytes / bandwidth["bytes_per_s"] * 1e3
    return {"prompt_len": prompt_len, "output_tokens": n_tokens, "ms_per_token": ms, "weight_bytes": wbytes,
            "bound_ms": bound_ms, "ms_per_token_over_bound": ms / bound_ms,
            "bound_definition": "bound_ms = weight_bytes / copy bandwidth"}


# -- phase 4: host time per decode step --------------------------------------------------------
STEP_GOAL_HOST_FRACTION = 0.10          # issue 16: host work under 10% of a batch-64 decode step


class _ForwardTimer:
    """Device time spent in the model's forward (eager calls and graph replays) while it is installed."""

    def __init__(self, runner):
        from engine.device_clock import device_clock
        self.runner, self.clock, self.seconds = runner, device_clock, 0.0
        eager = runner._model
        runner._model = lambda *a, **k: self._timed(eager, *a, **k)
        self._graphs = {key: g.graph for key, g in runner._graphs.items()}
        for key, g in runner._graphs.items():
            g.graph = _TimedReplay(self, g.graph)

    def _timed(self, fn, *a, **k):
        t = self.clock(self.runner.device)
        out = fn(*a, **k)
        self.seconds += self.clock(self.runner.device) - t
        return out

    def remove(self) -> None:
        del self.runner._model
        for key, graph in self._graphs.items():
            self.runner._graphs[key].graph = graph


@dataclass
class _TimedReplay:
    timer: _ForwardTimer
    graph: Any

    def replay(self) -> None:
        self.timer._timed(self.graph.replay)


def bench_step_host_time(llm, allowed: np.ndarray, seed: int, batch_sizes: tuple[int, ...] = (1, 64),
                         steps: int = 24) -> dict:
    """Decode-only steps of `batch` requests: the step's time and the forward's (both on the device
    clock); host time (inputs, sampling, bookkeeping) is their difference. Medians over the steps."""
    from engine import SamplingParams
    from engine.device_clock import device_clock
    engine, rng = llm.engine, np.random.default_rng(seed + 3)
    timer = _ForwardTimer(engine.runner)
    out = {"goal_host_fraction_at_64": STEP_GOAL_HOST_FRACTION, "definition":
           "host_ms = step_ms - forward_ms: an engine.step() of decodes only minus its model forward/graph replay"}
    try:
        for batch in batch_sizes:
            params = SamplingParams(max_tokens=steps + 3, ignore_eos=True, temperature=0.0)
            for _ in range(batch):
                engine.add_request(rng.choice(allowed, size=32).tolist(), params)
            rows = []
            while engine.has_unfinished_requests():
                running = engine.scheduler.running
                decode = (len(running) == batch and not engine.scheduler.waiting
                          and all(s.num_computed_tokens == s.num_tokens - 1 for s in running))
                timer.seconds = 0.0
                t = device_clock(engine.runner.device)
                engine.step()
                if decode:
                    rows.append((device_clock(engine.runner.device) - t, timer.seconds))
            rows = rows[2:]                                  # the first steps warm caches up
            step, fwd = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
            host = statistics.median(r[0] - r[1] for r in rows)
            out[f"batch_{batch}"] = {"steps": len(rows), "step_ms": step * 1e3, "forward_ms": fwd * 1e3,
                                     "host_ms": host * 1e3, "host_fraction": host / step}
            log(f"  batch {batch}: step {step * 1e3:.2f} ms, forward {fwd * 1e3:.2f} ms, "
                f"host {host * 1e3:.2f} ms ({host / step:.1%} of the step)")
    finally:
        timer.remove()
    last = out.get(f"batch_{batch_sizes[-1]}")
    out["meets_goal"] = last is not None and last["host_fraction"] < STEP_GOAL_HOST_FRACTION
    return out


PlotFn = Callable[[dict, Path], None]            # draws a result into a PNG file


def write_result(result: dict, path: Path, plots: dict[str, PlotFn | tuple[str, PlotFn]] | None = None) -> dict:
    """Draw each plot beside `path` (name -> plot function, file `<name>.png`; or name -> (file name, plot
    function)), then write the result as JSON, with the paths of both in it."""
    result["plots"] = {}
    for name, plot in (plots or {}).items():
        file, draw = plot if isinstance(plot, tuple) else (f"{name}.png", plot)
        png = path.parent / file
        draw(result, png)
        result["plots"][name] = str(png)
    result["json_path"] = str(path)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


# -- plots ------------------------------------------------------------------------------------------
def pyplot():
    import matplotlib
    matplotlib.use("Agg")                       # files only: no display on a server
    import matplotlib.pyplot as plt
    return plt


def save(fig, path: Path, dpi: int = 120) -> None:
    """Write a finished figure and close it (pyplot keeps every open figure alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def plot_throughput(result: dict, path: Path) -> None:
    plt = pyplot()
    t = result["throughput"]
    systems = {"Baton": t["baton"], "HF static": t.get("hf_static"), "HF continuous": t.get("hf_continuous")}
    names = [n for n, r in systems.items() if r and r.get("available", True)]
    vals = [systems[n]["output_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(names, vals, color=["tab:blue", "tab:gray", "tab:orange"][:len(names)])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s (requested tokens)")
    ax.set_title(f"{result['workload']['num_requests']} requests, {Path(result['model']).name}")
    save(fig, path)


def plot_ttft(prefix: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    vals = [prefix["median_cold_ttft_s"] * 1e3, prefix["median_warm_ttft_s"] * 1e3]
    bars = ax.bar(["cold (no prefix hit)", "warm (prefix hit)"], vals, color=["tab:red", "tab:green"])
    ax.bar_label(bars, fmt="%.1f ms")
    for x, key in ((0, "cold_ttft_s"), (1, "warm_ttft_s")):   # every trial, so the spread is visible
        ax.scatter([x] * len(prefix[key]), [v * 1e3 for v in prefix[key]], color="black", s=12, zorder=3)
    ax.set_ylabel("TTFT (ms), median of trials")
    ax.set_title(f"{prefix['prefix_len']}-token prefix + {prefix['suffix_len']}-token suffix: "
                 f"warm/cold {prefix['warm_over_cold']:.2f}", fontsize=9)
    save(fig, path)


# -- the command ------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of the transformers peer")
    p.add_argument("--skip-hf", action="store_true", help="measure Baton only")
    p.add_argument("--quick", action="store_true",
                   help=f"short prompts/outputs and a small prefix for a smoke run: {QUICK}")
    p.add_argument("--out-dir", default="bench_out/engine")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.add_argument("--tp", type=int, default=1,
                   help="compare tensor_parallel_size 1 and this size: tokens/s and the time in collectives per "
                        "step, to engine_tp.json (on CPU: gloo, one process per rank)")
    p.add_argument("--structured", action="store_true",
                   help="constrained (JSON schema, regex) vs free decoding at batch 32 and grammar compile times, "
                        "to structured.json (bench/structured_bench.py)")
    p.add_argument("--structured-max-tokens", type=int, default=None, help="per request, with --structured")
    p.add_argument("--structured-repeats", type=int, default=None,
                   help="interleaved runs per system, with --structured")
    p.add_argument("--kv-tiers", action="store_true",
                   help="a working set of prefixes past the KV cache: device-only vs a host KV tier vs a cache that "
                        "holds it all, revisit TTFT and hits by tier, to kv_tiers.json (bench/tiers_bench.py)")
    p.add_argument("--loras", type=int, default=0, metavar="N",
                   help="a batch mixing N LoRA adapters (made with PEFT) against the base model alone, output "
                        "tokens/s, to loras.json (bench/lora_bench.py)")
    p.add_argument("--sampling", action="store_true",
                   help="sampled decoding against greedy, the CPU sampler kernel against torch's way, to "
                        "sampling.json (bench/sampling_bench.py)")
    p.add_argument("--embed", action="store_true",
                   help="embedding throughput, LLM.embed (fp32 and packed) against transformers batched as "
                        "sentence-transformers runs it, to embed.json (bench/embed_bench.py)")
    p.add_argument("--step-only", action="store_true",
                   help="only the host time per decode step at batch 1 and 64 (phase 4), to engine_step.json")


def _phase(name: str, fn: Callable, *args) -> Any:
    log(f"{name} ...")
    t = time.perf_counter()
    res = fn(*args)
    log(f"{name} done in {time.perf_counter() - t:.1f} s")
    return res


def run(args: argparse.Namespace) -> dict:
    from engine import LLM, SamplingParams
    from engine.loader import resolve_model
    if args.tp > 1:
        return run_tp(args)
    if args.structured:
        from bench.structured_bench import run as run_structured
        return run_structured(args)
    if args.kv_tiers:
        from bench.tiers_bench import run as run_tiers
        return run_tiers(args)
    if args.loras:
        from bench.lora_bench import run as run_loras
        return run_loras(args)
    if args.sampling:
        from bench.sampling_bench import run as run_sampling
        return run_sampling(args)
    if args.embed:
        from bench.embed_bench import run as run_embed
        return run_embed(args)
    cfg = QUICK if args.quick else FULL
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)

    log(f"loading Baton on {model_path}")
    llm = LLM(model_path, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    runner = llm.engine.runner
    allowed = allowed_token_ids(llm.tokenizer, llm.engine.hf_config.vocab_size)
    workload = make_workload(allowed, args.num_requests, args.seed, cfg["prompt_len"], cfg["output_len"])
    result: dict[str, Any] = {
        "benchmark": "engine", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": model_path,
        "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
        "engine_config": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                          "block_size": llm.engine.block_size, "kv_blocks": llm.engine.pool.num_blocks},
        "workload": {"num_requests": args.num_requests, "seed": args.seed, "quick": args.quick,
                     "prompt_len_range": list(cfg["prompt_len"]), "output_len_range": list(cfg["output_len"]),
                     "prompt_tokens": sum(len(r.prompt_token_ids) for r in workload),
                     "requested_output_tokens": sum(r.max_tokens for r in workload),
                     "ignore_eos": True, "temperature": 0.0, "prompt_ids": "uniform over non-special vocab"},
    }
    # a first tiny request pays one-off costs (allocator, kernels) outside every timed phase
    llm.generate([workload[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    if args.step_only:
        result["step_host_time"] = _phase("phase 4: host time per step", bench_step_host_time, llm, allowed,
                                          args.seed, (1, args.max_num_seqs))
        return write_result(result, out_dir / "engine_step.json")

    baton, baton_tokens = _phase("phase 1: Baton throughput", bench_baton, llm, workload)
    result["throughput"] = {"baton": baton}
    result["prefix_ttft"] = _phase("phase 2: prefix-hit TTFT", bench_prefix_ttft, llm, allowed, args.seed,
                                   cfg["prefix_len"], cfg["suffix_len"], cfg["ttft_trials"])
    bw = _phase("memory bandwidth", measure_bandwidth, runner.device)
    result["decode"] = _phase("phase 3: batch-1 decode", bench_decode, llm, allowed, args.seed,
                              cfg["decode_prompt_len"], cfg["decode_tokens"], bw)
    result["decode"]["bandwidth"] = bw
    result["step_host_time"] = _phase("phase 4: host time per step", bench_step_host_time, llm, allowed,
                                      args.seed, (1, args.max_num_seqs))
    device, dtype = runner.device, runner.dtype
    del llm, runner                                      # free Baton's KV cache before the peers load
    gc.collect()

    if not args.skip_hf:
        result["throughput"].update(_bench_peers(args, model_path, device, dtype, workload, baton_tokens))
    _ratios(result["throughput"])

    write_result(result, out_dir / "engine.json", {
        "throughput": ("engine_throughput.png", plot_throughput),
        "ttft": ("engine_ttft.png", lambda r, png: plot_ttft(r["prefix_ttft"], png))})
    log(f"wrote {result['json_path']} and {len(result['plots'])} plots in {time.perf_counter() - _T0:.0f} s")
    return result


def _bench_peers(args, model_path: str, device: torch.device, dtype: torch.dtype,
                 workload: list[WorkloadRequest], baton_tokens: list[list[int]]) -> dict:
    """The transformers peers on the same weights, device and dtype (fp32 on CPU) as Baton."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    log("loading transformers model")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    tok = AutoTokenizer.from_pretrained(model_path)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.inference_mode():                          # warm-up, as for Baton
        model.generate(input_ids=torch.tensor([workload[0].prompt_token_ids[:8]], device=device), max_new_tokens=2,
                       do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    static, static_tokens = _phase("phase 1: HF static batching", bench_hf_static, model, workload, pad_id,
                                   args.hf_batch_size)
    static["exact_match_vs_baton"] = _exact_match(baton_tokens, static_tokens)
    cont, cont_tokens = _phase("phase 1: HF continuous batching", bench_hf_continuous, model, workload, pad_id,
                               args.max_num_seqs, args.max_num_batched_tokens)
    if cont_tokens is not None:
        cont["exact_match_vs_baton"] = _exact_match(baton_tokens, cont_tokens)
    else:
        log(f"HF continuous batching unavailable: {cont['error']}")
    return {"hf_static": static, "hf_continuous": cont}


def _ratios(t: dict) -> None:
    b = t["baton"]["output_tokens_per_s"]
    for key, name in (("hf_static", "baton_vs_static"), ("hf_continuous", "baton_vs_hf_continuous")):
        peer = t.get(key)
        t[name] = b / peer["output_tokens_per_s"] if peer and peer.get("available", True) else None


# -- --tp: tensor parallelism -------------------------------------------------------------------------
def bench_tp_size(model_path: str, tp: int, args, workload: list[WorkloadRequest], allowed: np.ndarray,
                  decode_tokens: int) -> tuple[dict, list[list[int]]]:
    """Throughput of one TP size on the workload, then batch-1 decode steps: wall time per step and, at
    TP > 1, rank 0's time in all-reduces, the logits gather and the step-input broadcast per step."""
    from engine import LLM, SamplingParams
    from engine.parallel import CollectiveTimes
    llm = LLM(model_path, tensor_parallel_size=tp, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    try:
        group = llm.engine.runner.tp
        llm.generate([workload[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
        res, tokens = bench_baton(llm, workload)
        params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0)
        prompt = np.random.default_rng(args.seed + 5).choice(allowed, size=32).tolist()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))     # prefill outside the timing
        times = CollectiveTimes()
        if group is not None:
            group.times = times
        t = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        wall = time.perf_counter() - t
        steps = len(out.token_ids)
        res["decode_batch1"] = {"steps": steps, "step_ms": wall / steps * 1e3}
        if group is not None:
            per = {k: getattr(times, k) / times.steps * 1e3 for k in ("all_reduce_s", "gather_s", "broadcast_s")}
            res["decode_batch1"].update({f"{k[:-2]}_ms_per_step": v for k, v in per.items()})
            res["decode_batch1"]["collectives_ms_per_step"] = sum(per.values())
            res["decode_batch1"]["all_reduces_per_step"] = 2 * llm.engine.runner.model.num_layers + 1
        return res, tokens
    finally:
        llm.engine.shutdown()


def plot_tp(result: dict, path: Path) -> None:
    plt = pyplot()
    sizes = sorted(result["tp"], key=int)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bars = a.bar([f"TP {s}" for s in sizes], [result["tp"][s]["output_tokens_per_s"] for s in sizes],
                 color=["tab:blue", "tab:orange"])
    a.bar_label(bars, fmt="%.1f")
    a.set_ylabel("output tokens / s")
    a.set_title(f"{result['workload']['num_requests']} requests, {Path(result['model']).name}", fontsize=9)
    bottom = np.zeros(len(sizes))
    for key, label in (("all_reduce_ms_per_step", "all-reduce"), ("gather_ms_per_step", "logits gather"),
                       ("broadcast_ms_per_step", "step-input broadcast")):
        vals = np.array([result["tp"][s]["decode_batch1"].get(key, 0.0) for s in sizes])
        b.bar([f"TP {s}" for s in sizes], vals, bottom=bottom, label=label)
        bottom += vals
    rest = np.array([result["tp"][s]["decode_batch1"]["step_ms"] for s in sizes]) - bottom
    b.bar([f"TP {s}" for s in sizes], rest, bottom=bottom, label="compute and host", color="lightgray")
    b.set_ylabel("ms per batch-1 decode step")
    b.legend(fontsize=8)
    save(fig, path)


def run_tp(args: argparse.Namespace) -> dict:
    from engine.loader import load_config, load_tokenizer, resolve_model
    cfg = QUICK if args.quick else FULL
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    vocab = load_config(model_path).vocab_size
    allowed = allowed_token_ids(load_tokenizer(model_path), vocab)
    n = min(args.num_requests, 16) if args.quick else args.num_requests
    workload = make_workload(allowed, n, args.seed, cfg["prompt_len"], cfg["output_len"])
    result: dict[str, Any] = {
        "benchmark": "engine_tp", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": model_path, "tp": {},
        "workload": {"num_requests": n, "seed": args.seed, "quick": args.quick,
                     "prompt_len_range": list(cfg["prompt_len"]), "output_len_range": list(cfg["output_len"])},
        "note": "CPU: every rank shares the same cores, so TP does not speed up here; the figure is the "
                "collectives' cost per step",
    }
    tokens = {}
    for tp in (1, args.tp):
        result["tp"][str(tp)], tokens[tp] = _phase(f"TP {tp}", bench_tp_size, model_path, tp, args, workload,
                                                   allowed, cfg["decode_tokens"] + 16)
    result["exact_match_tp_vs_tp1"] = _exact_match(tokens[1], tokens[args.tp])
    write_result(result, out_dir / "engine_tp.json", {"tp": ("engine_tp.png", plot_tp)})
    d = result["tp"][str(args.tp)]["decode_batch1"]
    log(f"TP {args.tp}: {d['collectives_ms_per_step']:.2f} ms of collectives in a {d['step_ms']:.2f} ms decode "
        f"step; wrote {result['json_path']}")
    return result
