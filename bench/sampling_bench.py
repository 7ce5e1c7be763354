"""`baton bench engine --sampling`: what sampling costs against greedy decoding, on the CPU sampler kernel
(engine/sampler_cpu.cpp) and on torch's way (the one CUDA runs; BATON_CPU_SAMPLER=0), in one run.

Workload: `requests` prompts of `prompt_len` random token ids (fixed seed), `max_tokens` each (ignore_eos), all
submitted at once, so decode steps run at batch `requests`. After one untimed greedy pass, for each sampling
setting (seeded per request): greedy, the setting with the kernel, then with torch's way, best of `repeats` each;
greedy's figure is the best of all its runs (this VM's speed drifts by ~10% between runs). The settings are the ones
users send most: OpenAI's default (temperature 1), common model-card defaults (0.7 / top_p 0.9, 1.0 / top_p 0.95),
and llama.cpp's server defaults (0.8, top_k 40, top_p 0.95, min_p 0.05).

Reported: output tokens/s of each run, each sampled run over greedy, kernel over torch, and the share of
requests whose tokens are equal under both ways (the same definition; the two exp functions differ in the last
bit, which moves a draw only when its uniform falls within that of a boundary).
"""
from __future__ import annotations

import argparse
import datetime as dt
import os
import time
from pathlib import Path
from typing import Any

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result

FULL = dict(requests=32, prompt_len=64, max_tokens=64, repeats=2)
QUICK = dict(requests=8, prompt_len=16, max_tokens=12, repeats=1)
SETTINGS = {
    "t1.0": dict(temperature=1.0),
    "t0.7 p0.9": dict(temperature=0.7, top_p=0.9),
    "t1.0 p0.95": dict(temperature=1.0, top_p=0.95),
    "llama.cpp": dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05),
}
log = make_logger("bench sampling")


def _timed(llm, prompts, params, repeats: int, kernel: bool) -> tuple[float, list]:
    """Best of `repeats` runs with the sampler kernel on or off: output tokens/s and the outputs' tokens."""
    before = os.environ.get("BATON_CPU_SAMPLER")
    os.environ["BATON_CPU_SAMPLER"] = "1" if kernel else "0"
    try:
        best, tokens = 0.0, None
        for _ in range(repeats):
            t = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t
            best = max(best, sum(len(o.token_ids) for o in outs) / wall)
            tokens = [o.token_ids for o in outs]
        return best, tokens
    finally:
        if before is None:
            os.environ.pop("BATON_CPU_SAMPLER", None)
        else:
            os.environ["BATON_CPU_SAMPLER"] = before


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    names = list(result["settings"])
    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(names))
    kern = [result["settings"][n]["kernel_tok_s"] for n in names]
    tor = [result["settings"][n]["torch_tok_s"] for n in names]
    b1 = ax.bar([i - 0.2 for i in x], kern, 0.4, label="CPU sampler kernel", color="tab:green")
    b2 = ax.bar([i + 0.2 for i in x], tor, 0.4, label="torch's way (BATON_CPU_SAMPLER=0)", color="tab:gray")
    ax.bar_label(b1, fmt="%.0f", fontsize=8)
    ax.bar_label(b2, fmt="%.0f", fontsize=8)
    ax.axhline(result["greedy_tok_s"], color="black", linestyle="--", linewidth=1,
               label=f"greedy {result['greedy_tok_s']:.0f}")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("output tokens/s")
    w = result["workload"]
    ax.set_title(f"{w['requests']} seeded requests at once, {w['max_tokens']} tokens each", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    save(fig, path)


def run(args: argparse.Namespace) -> dict:
    import torch

    from engine import LLM, SamplingParams
    from engine.cpu_model import available
    cfg = QUICK if args.quick else FULL
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not available():
        raise SystemExit("the CPU kernels are not built (no compiler, or BATON_CPU_KERNEL=0): nothing to compare")
    llm = LLM(args.model, max_num_seqs=max(cfg["requests"], 8), max_model_len=512)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(100, 20000, (cfg["prompt_len"],), generator=g).tolist() for _ in range(cfg["requests"])]
    n = cfg["max_tokens"]
    greedy_params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate(prompts, greedy_params)                                    # warm-up: the whole batch once
    greedy_runs: list[float] = []
    settings: dict[str, Any] = {}
    for name, kw in SETTINGS.items():                  # greedy again beside each setting: the machine drifts
        greedy_runs.append(_timed(llm, prompts, greedy_params, cfg["repeats"], True)[0])
        params = [SamplingParams(**kw, seed=i, max_tokens=n, ignore_eos=True) for i in range(len(prompts))]
        kern, kern_tokens = _timed(llm, prompts, params, cfg["repeats"], True)
        tor, tor_tokens = _timed(llm, prompts, params, cfg["repeats"], False)
        settings[name] = {"params": kw, "kernel_tok_s": kern, "torch_tok_s": tor, "greedy_beside_tok_s": greedy_runs[-1],
                          "kernel_over_torch": kern / tor,
                          "requests_equal": sum(a == b for a, b in zip(kern_tokens, tor_tokens)) / len(prompts)}
        log(f"{name}: kernel {kern:.1f} tok/s, torch {tor:.1f} (greedy beside: {greedy_runs[-1]:.1f}); "
            f"requests equal under both: {settings[name]['requests_equal']:.0%}")
    greedy = max(greedy_runs)
    for s in settings.values():
        s["kernel_over_greedy"], s["torch_over_greedy"] = s["kernel_tok_s"] / greedy, s["torch_tok_s"] / greedy
    log(f"greedy (best of {len(greedy_runs) * cfg['repeats']} runs): {greedy:.1f} tok/s; over it: " + ", ".join(
        f"{k} kernel {s['kernel_over_greedy']:.2f} torch {s['torch_over_greedy']:.2f}" for k, s in settings.items()))
    result: dict[str, Any] = {
        "benchmark": "sampling", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": args.model or "SmolLM2-135M-Instruct",
        "quantization": llm.engine.runner.quantization, "workload": cfg, "greedy_tok_s": greedy, "settings": settings,
    }
    write_result(result, out / "sampling.json", {"sampling": ("sampling.png", plot)})
    log(f"wrote {result['json_path']}")
    return result
