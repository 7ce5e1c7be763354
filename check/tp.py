"""Part 5 of `baton check gpu`: tensor parallelism over two GPUs (NCCL) gives TP 1's greedy tokens, the first
model's GPTQ checkpoint too (each rank's share of the 4-bit codes packed), and what its collectives cost per decode
step. It runs where the machine has at least two GPUs (else one SKIP row); the CPU
dry mode runs the same code over gloo."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

from check.compare import MAX_LOGPROB_GAP, TOP_K, GreedyBatch
from check.models import CPU_NEW_TOKENS, CPU_PROMPTS, FLOORS, GPU_NEW_TOKENS, GPU_PROMPTS, random_prompts
from check.report import FAIL, INFO, PASS, SKIP, Row

TP = 2
DECODE_STEPS = 16


def _engine(path: str, tp: int, dtype: torch.dtype, device: str):
    from engine import LLM
    return LLM(path, tensor_parallel_size=tp, dtype=str(dtype).removeprefix("torch."), device=device,
               max_num_seqs=8, num_kv_blocks=256, max_model_len=512)


def _greedy(llm, prompts: list[list[int]], n: int):
    from engine import SamplingParams
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_K))


def _decode_step(llm, prompt: list[int]) -> dict:
    """Batch-1 decode steps: wall ms per step and rank 0's ms in collectives (TP > 1)."""
    from engine import SamplingParams
    from engine.parallel import CollectiveTimes
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))            # prefill outside the timing
    group, times = llm.engine.runner.tp, CollectiveTimes()
    if group is not None:
        group.times = times
    t = time.perf_counter()
    out = llm.generate([prompt], SamplingParams(max_tokens=DECODE_STEPS, temperature=0, ignore_eos=True))[0]
    step_ms = (time.perf_counter() - t) / len(out.token_ids) * 1e3
    if group is not None:
        group.times = None
    return {"step_ms": step_ms, "collectives_ms": (times.all_reduce_s + times.gather_s + times.broadcast_s)
            / max(times.steps, 1) * 1e3}


def check_tp(paths: dict[str, str], cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    gpus = 0 if cpu else torch.cuda.device_count()
    if not cpu and gpus < TP:
        return [Row("tp", f"TP {TP} vs TP 1", f"{gpus} GPU here: needs {TP}", SKIP, data={"gpus": gpus})]
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    lengths, n = (CPU_PROMPTS, CPU_NEW_TOKENS) if cpu else (GPU_PROMPTS, GPU_NEW_TOKENS)
    gap = max(FLOORS[dtype][0], MAX_LOGPROB_GAP)         # the all-reduce sums in another order than one GPU
    rows = []
    first, first_path = next(iter(paths.items()))
    with tempfile.TemporaryDirectory() as tmp:
        from check.quant import write_quantized
        gptq, _ = write_quantized(first_path, Path(tmp) / "gptq", "gptq", device=torch.device(device))
        # packed shards: each rank holds its rows or columns of the 4-bit codes (on CPU, int8 activations)
        cases = [(name, path, gap) for name, path in paths.items()] + \
            [(f"{first} GPTQ", gptq, max(gap, 0.5) if cpu else gap)]
        for name, path, max_gap in cases:
            rows += _tp_case(name, path, device, dtype, lengths, n, max_gap, log)
    return rows


def _tp_case(name: str, path: str, device: str, dtype: torch.dtype, lengths, n: int, gap: float,
             log: Callable[[str], None]) -> list[Row]:
    from engine.loader import load_config
    prompts = random_prompts(load_config(path).vocab_size, lengths, seed=1)
    speed = {}
    for tp in (1, TP):
        log(f"tp: {name}: TP {tp}")
        llm = _engine(path, tp, dtype, device)
        try:
            outs = _greedy(llm, prompts, n)
            speed[tp] = _decode_step(llm, prompts[0])
        finally:
            llm.engine.shutdown()
        if tp == 1:
            ref = outs
    c = GreedyBatch.compare(outs, ref, n, gap)
    s1, s2 = speed[1], speed[TP]
    return [Row("tp", f"{name} TP {TP} greedy vs TP 1", c.text, FAIL if c.errors else PASS,
                data={"equal": c.equal, "prompts": len(prompts), "errors": c.errors, "max_gap": gap}),
            Row("tp", f"{name} TP {TP} decode step, batch 1",
                f"{s2['step_ms']:.2f} ms ({s2['collectives_ms']:.2f} ms in collectives) vs TP 1 "
                f"{s1['step_ms']:.2f} ms", INFO, data={"tp1": s1, f"tp{TP}": s2})]
