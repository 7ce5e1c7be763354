"""Part 3 of `baton check gpu`: output tokens/s against transformers, and batch-1 decode against the HBM bound.

The workload, the peers and the bandwidth bound are `baton bench engine`'s own (bench/engine_bench.py), with
its defaults (64 requests, prompts of 32-512 and outputs of 16-256 random tokens, ignore_eos, greedy); the
model is part 2's random Llama-3 1B checkpoint (no hub download). The engine runs twice, with CUDA graphs and
with enforce_eager, then transformers `generate` in static batches and transformers' continuous batching on
the same GPU and dtype. Batch-1 inter-token latency is set against weight bytes / measured device copy
bandwidth, the time one decode step needs to read every weight once.

Goals on one H100: batch-1 ITL within 1.5x of the bound with CUDA graphs; throughput at least 3x transformers'
static batch. A goal is printed beside its figure; only a run that did not produce its tokens fails.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

from check.models import free_memory
from check.report import FAIL, INFO, PASS, Row

GOAL_ITL_OVER_BOUND = 1.5
GOAL_VS_STATIC = 3.0
CPU_REQUESTS, CPU_HF_BATCH = 6, 3                 # the dry mode's tiny workload (bench's QUICK lengths)


def bench_defaults() -> argparse.Namespace:
    """`baton bench engine`'s defaults (requests, seed, batch sizes), read from its own argument parser."""
    from bench.engine_bench import add_arguments
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([])


def run_engine(path: str, workload, allowed, args, cfg: dict, bandwidth: dict, device: torch.device,
               dtype: torch.dtype, enforce_eager: bool) -> tuple[dict, list[list[int]]]:
    """The bench's throughput and batch-1 decode phases on one engine."""
    from bench.engine_bench import bench_baton, bench_decode
    from engine import LLM, SamplingParams
    kv = None if device.type == "cuda" else 64 << 20      # the GPU default (a fraction of free memory), as the bench
    llm = LLM(path, dtype=str(dtype).removeprefix("torch."), device=device.type, enforce_eager=enforce_eager,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=kv)
    llm.generate([workload[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0))
    res, tokens = bench_baton(llm, workload)
    res["decode"] = bench_decode(llm, allowed, args.seed, cfg["decode_prompt_len"], cfg["decode_tokens"], bandwidth)
    res["graph_sizes"] = getattr(llm.engine.runner, "graph_sizes", None)
    del llm
    free_memory(device)
    return res, tokens


def run_peers(path: str, workload, args, hf_batch: int, device: torch.device, dtype: torch.dtype) -> dict:
    """transformers `generate` in static batches and its continuous batching, on the same weights and device."""
    from transformers import AutoModelForCausalLM

    from bench.engine_bench import bench_hf_continuous, bench_hf_static
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    with torch.inference_mode():                          # one-off costs outside the timed runs, as for the engine
        model.generate(input_ids=torch.tensor([workload[0].prompt_token_ids[:8]], device=device), max_new_tokens=2,
                       do_sample=False, eos_token_id=None, pad_token_id=0)
    static, static_tokens = bench_hf_static(model, workload, 0, hf_batch)       # a random model has no pad token
    cont, _ = bench_hf_continuous(model, workload, 0, args.max_num_seqs, args.max_num_batched_tokens)
    del model
    free_memory(device)
    return {"hf_static": static, "hf_continuous": cont, "static_tokens": static_tokens}


def check_speed(path: str, cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    from bench.engine_bench import FULL, QUICK, _exact_match, allowed_token_ids, make_workload, measure_bandwidth
    from engine.loader import load_config
    device, dtype = torch.device("cpu" if cpu else "cuda"), torch.float32 if cpu else torch.bfloat16
    args, cfg = bench_defaults(), QUICK if cpu else FULL
    allowed = allowed_token_ids(None, load_config(path).vocab_size)
    workload = make_workload(allowed, CPU_REQUESTS if cpu else args.num_requests, args.seed, cfg["prompt_len"],
                             cfg["output_len"])
    log("speed: device copy bandwidth")
    bandwidth = measure_bandwidth(device, mib=64 if cpu else 1024)
    engines, tokens = {}, {}
    for eager in (False, True):
        log(f"speed: engine, enforce_eager={eager}")
        engines[eager], tokens[eager] = run_engine(path, workload, allowed, args, cfg, bandwidth, device, dtype, eager)
    log("speed: transformers peers")
    peers = run_peers(path, workload, args, CPU_HF_BATCH if cpu else args.hf_batch_size, device, dtype)
    requested = sum(r.max_tokens for r in workload)
    peers["hf_static"]["exact_match_vs_engine"] = _exact_match(tokens[False], peers.pop("static_tokens"))
    static_tps = peers["hf_static"]["output_tokens_per_s"]
    for eager in (False, True):
        engines[eager].update(workload={"num_requests": len(workload), "prompt_len_range": list(cfg["prompt_len"]),
                                        "output_len_range": list(cfg["output_len"])}, bandwidth=bandwidth)
    rows = [_engine_row(engines[e], e, requested, static_tps, _exact_match(tokens[e], tokens[not e]))
            for e in (False, True)]
    rows += _peer_rows(peers, len(workload))
    rows += [_itl_row(engines[e]["decode"], e, bandwidth["bytes_per_s"]) for e in (False, True)]
    return rows


def _label(enforce_eager: bool) -> str:
    return "enforce_eager" if enforce_eager else "CUDA graphs"


def _engine_row(res: dict, eager: bool, requested: int, static_tps: float, agree_other: float) -> Row:
    vs = res["output_tokens_per_s"] / static_tps
    res.update(vs_hf_static=vs, requested_output_tokens=requested, agreement_with_other_mode=agree_other)
    ok = res["output_tokens"] == requested
    goal = "" if eager else f">= {GOAL_VS_STATIC:g}x static: {'met' if vs >= GOAL_VS_STATIC else 'missed'}"
    result = (f"{res['output_tokens_per_s']:.1f} tok/s = {vs:.2f}x HF static; {res['output_tokens']}/{requested} tokens"
              f"; same tokens as {_label(not eager)}: {agree_other:.0%}")
    return Row("speed", f"engine throughput, {_label(eager)}", result, PASS if ok else FAIL, goal, res)


def _peer_rows(peers: dict, n_requests: int) -> list[Row]:
    static, cont = peers["hf_static"], peers["hf_continuous"]
    rows = [Row("speed", f"transformers generate, static batch {static['batch_size']}",
                f"{static['output_tokens_per_s']:.1f} tok/s; same tokens as the engine: "
                f"{static['exact_match_vs_engine']:.0%} of {n_requests}", INFO, data=static)]
    if cont.get("available"):
        rows.append(Row("speed", "transformers continuous batching", f"{cont['output_tokens_per_s']:.1f} tok/s",
                        INFO, data=cont))
    else:
        rows.append(Row("speed", "transformers continuous batching", f"unavailable: {cont['error']}", INFO, data=cont))
    return rows


def _itl_row(decode: dict, eager: bool, bytes_per_s: float) -> Row:
    r = decode["ms_per_token_over_bound"]
    goal = "" if eager else f"<= {GOAL_ITL_OVER_BOUND:g}x bound: {'met' if r <= GOAL_ITL_OVER_BOUND else 'missed'}"
    result = (f"{decode['ms_per_token']:.2f} ms/token = {r:.2f}x the bound {decode['bound_ms']:.3f} ms "
              f"({decode['weight_bytes'] / 1e9:.3g} GB of weights at {bytes_per_s / 1e9:.0f} GB/s)")
    return Row("speed", f"batch-1 ITL, {_label(eager)}", result, INFO, goal, decode)
