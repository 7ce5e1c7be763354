"""`baton bench engine --loras N`: what serving N LoRA adapters in one batch costs against the base model alone.

Workload: `requests` prompts of `prompt_len` random token ids (fixed seed), `max_tokens` each (ignore_eos), all
submitted at once, so steps run at batch `requests`. Three runs of the same requests:

- base: a plain engine (enable_lora off), the peer;
- lora_idle: an engine with enable_lora and max_loras N, every request on the base model (what the wrapped
  Linears cost when no adapter runs);
- mixed: the same engine, the requests spread round-robin over N adapters (rank `rank` on q/k/v/o and
  gate/up/down, made with PEFT), so every step mixes N adapters.

Reported: output tokens/s of each, mixed/base (the goal: at least 0.7 on CPU), and lora_idle/base. The mixed
run's tokens are checked against each adapter's requests run alone (Baton against itself: exact).
"""
from __future__ import annotations

import argparse
import datetime as dt
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result

FULL = dict(requests=32, prompt_len=64, max_tokens=32, rank=16, repeats=2)
QUICK = dict(requests=8, prompt_len=24, max_tokens=8, rank=8, repeats=1)
log = make_logger("bench loras")


def _timed(llm, prompts, params, loras, repeats: int) -> tuple[float, list]:
    """Best of `repeats` runs: output tokens/s and the outputs' tokens."""
    best, tokens = 0.0, None
    for _ in range(repeats):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras)
        wall = time.perf_counter() - t
        best = max(best, sum(len(o.token_ids) for o in outs) / wall)
        tokens = [o.token_ids for o in outs]
    return best, tokens


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    names = ["base", "lora_idle", "mixed"]
    fig, ax = plt.subplots(figsize=(6, 4))
    bars = ax.bar(names, [result["runs"][n]["output_tok_s"] for n in names], color=["tab:gray", "tab:blue", "tab:green"])
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_ylabel("output tokens/s")
    w = result["workload"]
    ax.set_title(f"{w['requests']} requests at once, {result['loras']} adapters of rank {w['rank']}: "
                 f"mixed/base {result['mixed_over_base']:.2f}", fontsize=9)
    save(fig, path)


def run(args: argparse.Namespace) -> dict:
    from engine.loader import resolve_model
    cfg = QUICK if args.quick else FULL
    n = args.loras
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_dir = resolve_model(args.model)          # PEFT makes the adapters on the transformers checkpoint
    with tempfile.TemporaryDirectory(prefix="baton-loras-") as tmp:          # the adapters go with the run
        return _run(args, hf_dir, cfg, n, out, tmp)


def _run(args: argparse.Namespace, hf_dir: str, cfg: dict, n: int, out: Path, tmp: str) -> dict:
    import torch

    from bench.models import make_lora_adapter
    from engine import LLM, LoRARequest, SamplingParams
    log(f"making {n} adapters of rank {cfg['rank']} with PEFT on {hf_dir}")
    paths = [make_lora_adapter(hf_dir, Path(tmp) / f"a{i}", rank=cfg["rank"], seed=i + 1, scale=0.5) for i in range(n)]
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (cfg["prompt_len"],), generator=g).tolist() for _ in range(cfg["requests"])]
    params = SamplingParams(temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    common = dict(max_num_seqs=max(cfg["requests"], 8), max_model_len=512, kv_cache_memory=256 << 20)
    runs: dict[str, Any] = {}

    # the engines run the model as the user named it: the default model as `baton serve` runs it, in its packed
    # GGUF types (engine/quant.py); the converted directory's path would run it dequantized to fp32
    base = LLM(args.model, **common)
    quantization = base.engine.runner.quantization
    base.generate(prompts[:2], params)                                       # warm-up
    tok_s, _ = _timed(base, prompts, params, None, cfg["repeats"])
    runs["base"] = {"output_tok_s": tok_s}
    log(f"base: {tok_s:.1f} output tok/s")
    del base

    llm = LLM(args.model, **common, enable_lora=True, max_loras=n, max_lora_rank=cfg["rank"])
    llm.generate(prompts[:2], params, lora_request=[None, loras[0]])        # warm-up
    tok_s, _ = _timed(llm, prompts, params, None, cfg["repeats"])
    runs["lora_idle"] = {"output_tok_s": tok_s}
    log(f"enable_lora, base requests only: {tok_s:.1f} output tok/s")
    mix = [loras[i % n] for i in range(len(prompts))]
    tok_s, mixed = _timed(llm, prompts, params, mix, cfg["repeats"])
    runs["mixed"] = {"output_tok_s": tok_s, "lora_loads": llm.engine.runner.lora.loads}
    log(f"{n} adapters mixed: {tok_s:.1f} output tok/s")
    alone = {}
    for lora in loras:                                                     # each adapter's requests on their own
        idx = [i for i in range(len(prompts)) if mix[i] is lora]
        for i, o in zip(idx, llm.generate([prompts[i] for i in idx], params, lora_request=lora)):
            alone[i] = o.token_ids
    same = all(mixed[i] == alone[i] for i in range(len(prompts)))
    result: dict[str, Any] = {
        "benchmark": "loras", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": args.model or hf_dir, "quantization": quantization, "loras": n,
        "workload": cfg, "runs": runs,
        "mixed_over_base": runs["mixed"]["output_tok_s"] / runs["base"]["output_tok_s"],
        "idle_over_base": runs["lora_idle"]["output_tok_s"] / runs["base"]["output_tok_s"],
        "goal_mixed_over_base": 0.7, "mixed_equals_alone": same,
    }
    write_result(result, out / "loras.json", {"loras": ("loras.png", plot)})
    log(f"mixed/base {result['mixed_over_base']:.2f} (goal >= 0.7), idle/base {result['idle_over_base']:.2f}; "
        f"mixed tokens equal each adapter alone: {same}; wrote {result['json_path']}")
    return result
