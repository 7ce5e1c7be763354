"""`baton bench engine --kv-tiers`: what the host KV tier saves when a working set of prefixes outgrows the cache.

Workload: `docs` distinct documents of `doc_tokens` tokens (random token ids, fixed seed), each asked about
`visits` times round-robin with a short question of its own, one request at a time (batch 1, so TTFT is the
prefill's own time), `max_tokens` each. Three engines run the same requests:

- device: a KV cache holding about `device_docs` documents (the working set does not fit; LRU evicts a
  document before it comes round again, so every revisit is recomputed),
- tiered: the same cache plus a host tier (kv_offloading_size) that holds the working set: a revisit copies
  its document's blocks back instead of computing them,
- roomy: a cache holding the whole working set (the ceiling: every revisit is a device hit),
- int8: the device engine's bytes with kv_cache_dtype int8 (3.75x its blocks for SmolLM2): how much of the
  working set a quantized cache keeps on the device in the same memory. Its tokens are compared with the
  others' (greedy agreement), not required equal: the cache's rounding may part them at a near-tie.

Reported per engine: TTFT of the revisits (median, p90), the prompt tokens computed, hits by tier, blocks and
bytes moved between tiers, wall time; and the revisit TTFT ratios device/tiered (what the tier buys) and
tiered/roomy (what the copy costs against a device hit). Every engine must give the same tokens.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path
from typing import Any

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result

FULL = dict(docs=12, doc_tokens=480, question_tokens=16, visits=3, max_tokens=8, device_docs=4)
QUICK = dict(docs=5, doc_tokens=96, question_tokens=8, visits=2, max_tokens=4, device_docs=2)
log = make_logger("bench kv-tiers")


def _workload(cfg: dict, vocab: int) -> list[tuple[int, list[int]]]:
    import torch
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(100, vocab - 1, (cfg["doc_tokens"],), generator=g).tolist() for _ in range(cfg["docs"])]
    reqs = []
    for v in range(cfg["visits"]):
        for d, doc in enumerate(docs):
            q = torch.randint(100, vocab - 1, (cfg["question_tokens"],), generator=g).tolist()
            reqs.append((v, doc + q))
    return reqs


def _run(name: str, model: str | None, cfg: dict, reqs: list, **engine: Any) -> dict:
    from engine import LLM, SamplingParams
    llm = LLM(model, max_model_len=2 * (cfg["doc_tokens"] + cfg["question_tokens"] + cfg["max_tokens"]),
              **engine)
    params = SamplingParams(temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    llm.generate([list(range(100, 132))], params)           # first-use costs outside the timing (no shared prefix)
    before = llm.engine.num_computed_tokens_total
    s0 = llm.engine.stats()
    ttft, tokens, t = [], [], time.perf_counter()
    for visit, prompt in reqs:
        out = llm.generate([prompt], params)[0]
        tokens.append(out.token_ids)
        if visit > 0:
            m = out.metrics
            ttft.append(m.first_token_time - m.arrival_time)
    wall = time.perf_counter() - t
    s = llm.engine.stats()
    moved = s["kv_offloaded_blocks"] + s["kv_onloaded_blocks"] - s0["kv_offloaded_blocks"] - s0["kv_onloaded_blocks"]
    res = {"quantization": llm.engine.runner.quantization,
           "kv_blocks": llm.engine.pool.num_blocks, "host_blocks": llm.engine.pool.host_blocks,
           "revisit_ttft_ms_median": statistics.median(ttft) * 1e3,
           "revisit_ttft_ms_p90": statistics.quantiles(ttft, n=10)[-1] * 1e3 if len(ttft) > 1 else ttft[0] * 1e3,
           "prompt_tokens": sum(len(p) for _, p in reqs),
           "computed_tokens": llm.engine.num_computed_tokens_total - before,
           "hit_tokens_device": (s["prefix_cache_hit_tokens"] - s["prefix_cache_host_hit_tokens"])
                                - (s0["prefix_cache_hit_tokens"] - s0["prefix_cache_host_hit_tokens"]),
           "hit_tokens_host": s["prefix_cache_host_hit_tokens"] - s0["prefix_cache_host_hit_tokens"],
           "offloaded_blocks": s["kv_offloaded_blocks"] - s0["kv_offloaded_blocks"],
           "onloaded_blocks": s["kv_onloaded_blocks"] - s0["kv_onloaded_blocks"],
           "moved_bytes": moved * s["kv_block_bytes"], "wall_s": wall, "_tokens": tokens}
    log(f"{name}: revisit TTFT median {res['revisit_ttft_ms_median']:.1f} ms, computed {res['computed_tokens']} "
        f"of {res['prompt_tokens']} prompt tokens, host hits {res['hit_tokens_host']} tokens, wall {wall:.1f} s")
    llm.engine.shutdown()
    return res


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    r = result["engines"]
    names = [n for n in ("device", "tiered", "roomy", "int8") if n in r]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    bars = a.bar(names, [r[n]["revisit_ttft_ms_median"] for n in names],
                 color=["tab:gray", "tab:blue", "tab:green", "tab:purple"][:len(names)])
    a.bar_label(bars, fmt="%.1f", fontsize=8)
    a.set_ylabel("revisit TTFT, median (ms)")
    w = result["workload"]
    a.set_title(f"{w['docs']} docs x {w['doc_tokens']} tokens, {w['visits']} visits; cache ~{w['device_docs']} docs",
                fontsize=9)
    dev = [r[n]["hit_tokens_device"] for n in names]
    host = [r[n]["hit_tokens_host"] for n in names]
    comp = [r[n]["computed_tokens"] for n in names]
    b.bar(names, comp, label="computed", color="tab:red")
    b.bar(names, dev, bottom=comp, label="device hit", color="tab:green")
    b.bar(names, host, bottom=[c + d for c, d in zip(comp, dev)], label="host hit", color="tab:blue")
    b.set_ylabel("prompt tokens")
    b.legend(fontsize=8)
    save(fig, path)


def run(args: argparse.Namespace) -> dict:
    from bench.cluster_bench import BLOCK, block_bytes
    from engine.loader import load_config, resolve_model
    cfg = QUICK if args.quick else FULL
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)          # the converted checkpoint: its config and KV block size
    hf = load_config(model)
    reqs = _workload(cfg, hf.vocab_size)
    per_doc = -(-(cfg["doc_tokens"] + cfg["question_tokens"] + cfg["max_tokens"]) // BLOCK)
    device_blocks = cfg["device_docs"] * per_doc
    host_gib = 1.25 * cfg["docs"] * per_doc * block_bytes(model) / 2**30       # fp32: CPU
    log(f"{len(reqs)} requests on {model}: device cache {device_blocks} blocks (~{cfg['device_docs']} docs), "
        f"host tier {host_gib:.3f} GiB (the working set of {cfg['docs']} docs)")
    # the engines run the model as the user named it: the default model as `baton serve` runs it, in its packed GGUF
    # types (engine/quant.py); the converted directory's path would run it dequantized to fp32
    engines = {
        "device": _run("device", args.model, cfg, reqs, num_kv_blocks=device_blocks),
        "tiered": _run("tiered", args.model, cfg, reqs, num_kv_blocks=device_blocks, kv_offloading_size=host_gib),
        "roomy": _run("roomy", args.model, cfg, reqs, num_kv_blocks=2 * cfg["docs"] * per_doc),
        "int8": _run("int8", args.model, cfg, reqs, kv_cache_memory=device_blocks * block_bytes(model),
                     kv_cache_dtype="int8"),
    }
    same = engines["device"]["_tokens"] == engines["tiered"]["_tokens"] == engines["roomy"]["_tokens"]
    pairs = [(a, b) for x, y in zip(engines["int8"]["_tokens"], engines["device"]["_tokens"]) for a, b in zip(x, y)]
    engines["int8"]["token_agreement_with_fp32"] = sum(a == b for a, b in pairs) / len(pairs)
    for e in engines.values():
        del e["_tokens"]
    result: dict[str, Any] = {
        "benchmark": "kv_tiers", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": args.model or model, "quantization": engines["device"]["quantization"],
        "workload": {**cfg, "requests": len(reqs), "host_gib": host_gib},
        "engines": engines, "same_tokens": same,
        "revisit_ttft_device_over_tiered": engines["device"]["revisit_ttft_ms_median"]
                                           / engines["tiered"]["revisit_ttft_ms_median"],
        "revisit_ttft_tiered_over_roomy": engines["tiered"]["revisit_ttft_ms_median"]
                                          / engines["roomy"]["revisit_ttft_ms_median"],
        "revisit_ttft_device_over_int8": engines["device"]["revisit_ttft_ms_median"]
                                         / engines["int8"]["revisit_ttft_ms_median"],
    }
    write_result(result, out / "kv_tiers.json", {"kv_tiers": ("kv_tiers.png", plot)})
    log(f"revisit TTFT: device-only / tiered {result['revisit_ttft_device_over_tiered']:.2f}x, tiered / all-device "
        f"{result['revisit_ttft_tiered_over_roomy']:.2f}x, device-only / int8 KV in the same memory "
        f"{result['revisit_ttft_device_over_int8']:.2f}x; same tokens: {same}; wrote {result['json_path']}")
    return result
