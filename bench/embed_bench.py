"""`baton bench engine --embed`: embedding throughput, Baton's LLM.embed against transformers as
sentence-transformers runs it, on the same inputs, in one run.

Workload: `inputs` prompts of random token ids (fixed seed; lengths uniform in `prompt_len`), embedded with last-token
pooling and L2 normalization (decoder embedding models' pooling, and Baton's default).
  baton fp32    LLM.embed on the model's fp32 copy (the weights transformers runs): continuous batching, the
                inputs' tokens packed into steps of max_num_batched_tokens, no padding
  baton packed  LLM.embed on the model as `baton serve` runs it (a GGUF stays packed)
  transformers  AutoModel forward in batches of `batch_size` (sentence-transformers' default, 32), sorted by length
                as sentence-transformers sorts them, right-padded with an attention mask, the last real token's
                hidden state pooled
Each system runs once untimed, then `repeats` times; its best is kept. Reported: inputs/s and prompt tokens/s of
each, Baton over transformers, and each Baton vector's cosine with transformers' (the agreement).
"""
from __future__ import annotations

import argparse
import datetime as dt
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.engine_bench import allowed_token_ids, machine_info, make_logger, pyplot, save, write_result

FULL = dict(inputs=128, prompt_len=(16, 256), batch_size=32, repeats=2)
QUICK = dict(inputs=12, prompt_len=(8, 40), batch_size=4, repeats=1)
log = make_logger("bench embed")


def _best(fn, repeats: int) -> tuple[float, Any]:
    """fn() once to warm up, then `repeats` timed runs: the shortest wall time and the last result."""
    out = fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def embed_transformers(model, prompts: list[list[int]], batch_size: int, pad_id: int) -> list[np.ndarray]:
    """sentence-transformers' way: batches of inputs sorted by length (longest first), right padding, the last real
    token's final hidden state, normalized; returned in input order."""
    import torch
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    out: list[np.ndarray | None] = [None] * len(prompts)
    with torch.inference_mode():
        for at in range(0, len(order), batch_size):
            batch = order[at:at + batch_size]
            width = max(len(prompts[i]) for i in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, i in enumerate(batch):
                ids[r, :len(prompts[i])] = torch.tensor(prompts[i])
                mask[r, :len(prompts[i])] = 1
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
            last = h[torch.arange(len(batch)), mask.sum(1) - 1]
            for r, v in zip(batch, torch.nn.functional.normalize(last, dim=-1)):
                out[r] = v.numpy()
    return out


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    names = list(result["systems"])
    fig, ax = plt.subplots(figsize=(7, 4))
    vals = [result["systems"][n]["prompt_tokens_per_s"] for n in names]
    bars = ax.bar(names, vals, color=["tab:green", "tab:olive", "tab:gray"][:len(names)])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("prompt tokens/s (embedded)")
    w = result["workload"]
    ax.set_title(f"{w['inputs']} inputs of {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, last-token pooling",
                 fontsize=9)
    save(fig, path)


def run(args: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModel

    from engine import LLM
    from engine.loader import resolve_model
    cfg = QUICK if args.quick else FULL
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp32_path = resolve_model(args.model)                 # the fp32 copy transformers reads too
    served = args.model                                   # None: the default model as `baton serve` runs it
    rng = np.random.default_rng(args.seed)
    fp32 = LLM(fp32_path, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024)
    allowed = allowed_token_ids(fp32.tokenizer, fp32.engine.hf_config.vocab_size)
    lens = rng.integers(cfg["prompt_len"][0], cfg["prompt_len"][1] + 1, size=cfg["inputs"])
    prompts = [rng.choice(allowed, size=int(n)).tolist() for n in lens]
    tokens = int(lens.sum())
    systems: dict[str, dict[str, Any]] = {}
    vectors: dict[str, list[np.ndarray]] = {}

    def record(name: str, wall: float, vecs: list[np.ndarray]) -> None:
        systems[name] = {"wall_s": wall, "inputs_per_s": len(prompts) / wall, "prompt_tokens_per_s": tokens / wall}
        vectors[name] = [np.asarray(v, dtype=np.float32) for v in vecs]
        log(f"{name}: {wall:.2f} s, {len(prompts) / wall:.1f} inputs/s, {tokens / wall:.0f} tokens/s")

    # Baton's prefix cache would serve every repeat from the first run's blocks: a repeat must compute, as the
    # peer does, so run k of a system embeds variant k (the same prompts, their first token changed); every system
    # ends on variant `repeats`, whose vectors are compared
    def variant(k: int) -> list[list[int]]:
        return [[int(allowed[(k * 7919 + 1) % len(allowed)])] + p[1:] for p in prompts]

    def runs(llm):
        k = iter(range(cfg["repeats"] + 1))
        return lambda: llm.embed(variant(next(k)))

    log(f"baton fp32 ({fp32_path}) ...")
    wall, outs = _best(runs(fp32), cfg["repeats"])
    record("baton fp32", wall, [o.outputs.embedding for o in outs])
    del fp32
    packed = LLM(served, max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=1024)
    quant = packed.engine.runner.quantization
    log(f"baton packed ({quant}) ...")
    wall, outs = _best(runs(packed), cfg["repeats"])
    record(f"baton {quant}", wall, [o.outputs.embedding for o in outs])
    del packed
    log("transformers ...")
    model = AutoModel.from_pretrained(fp32_path, dtype=torch.float32).eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    last = variant(cfg["repeats"])
    wall, vecs = _best(lambda: embed_transformers(model, last, cfg["batch_size"], pad), cfg["repeats"])
    record("transformers", wall, vecs)
    peer = systems["transformers"]["prompt_tokens_per_s"]
    for name, s in systems.items():
        s["over_transformers"] = s["prompt_tokens_per_s"] / peer
        if name != "transformers":
            cos = [float(a @ b) for a, b in zip(vectors[name], vectors["transformers"])]
            s["cosine_with_transformers"] = {"min": min(cos), "median": float(np.median(cos))}
    log(", ".join(f"{n} {s['over_transformers']:.2f}x" for n, s in systems.items()) + " transformers' tokens/s; "
        + ", ".join(f"{n} cosine min {s['cosine_with_transformers']['min']:.5f}" for n, s in systems.items()
                    if "cosine_with_transformers" in s))
    result: dict[str, Any] = {
        "benchmark": "embed", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": served or "SmolLM2-135M-Instruct", "fp32_path": fp32_path,
        "threads": torch.get_num_threads(), "max_num_batched_tokens": args.max_num_batched_tokens,
        "workload": {**cfg, "prompt_tokens": tokens, "seed": args.seed}, "systems": systems,
    }
    write_result(result, out / "embed.json", {"embed": ("embed.png", plot)})
    log(f"wrote {result['json_path']}")
    return result
