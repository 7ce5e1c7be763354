"""Tile sizes of the Triton weight-only matmul (engine/quant_triton.py) on one CUDA GPU.

`python -m bench.quant_triton_sweep [--out DIR]`: every packed layout of `baton check gpu`'s part 6 (check/quant.py)
on the four linear shapes of a Llama-3-8B layer, at M = 1 (decode) and M = 256 (prefill), for each candidate
(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) and for plan()'s choice; the median µs of triton.testing.do_bench summed over
the four shapes, beside cuBLAS bf16. A line per layout as it goes, and quant_triton_sweep.json under --out (written
after each line). plan()'s M = 256 tiles came from this sweep on an H100 (docs/benchmarks.md).
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

CONFIGS = {1: [(16, bn, bk, w) for bn, bk, w in itertools.product((64, 128), (256, 512), (4, 8))],
           256: [(128, 128, 64, 8), (64, 128, 64, 4), (128, 64, 64, 4), (128, 128, 128, 8), (64, 64, 128, 4),
                 (128, 256, 64, 8)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_out/quant_triton"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.quant_triton_sweep needs a CUDA GPU")
    from triton.testing import do_bench

    from check.quant import GPU_SHAPES, LAYOUTS, random_weight
    from engine.quant_triton import _num_sms, fit_block_k, split_k, wo_matmul
    dev = torch.device("cuda")
    sms = _num_sms(dev)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "quant_triton_sweep.json"

    def bench(fn) -> float:
        return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3

    weights = {name: [random_weight(kind, g, n, k, dev, 100 + i) for i, (n, k) in enumerate(GPU_SHAPES)]
               for name, (kind, g) in LAYOUTS.items()}
    results = []
    for m, configs in CONFIGS.items():
        xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _, k in GPU_SHAPES}
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in GPU_SHAPES]
        bf16 = sum(bench(lambda: xs[k] @ d.t()) for (n, k), d in zip(GPU_SHAPES, dense))
        print(f"M={m} bf16 {bf16:.1f} us", flush=True)
        for name, ws in weights.items():
            timed = []
            for bm, bn, bk, warps in configs:
                try:
                    us = 0.0
                    for w, (n, k) in zip(ws, GPU_SHAPES):
                        b = fit_block_k(bk, w.group)
                        cfg = (bm, bn, b, split_k(m, n, k, bm, bn, b, sms), warps)
                        us += bench(lambda: wo_matmul(xs[k], w, cfg))
                    timed.append(([bm, bn, bk, warps], round(us, 1)))
                except Exception as e:                  # noqa: BLE001 - a tile too big for the SM's memory
                    timed.append(([bm, bn, bk, warps], type(e).__name__))
            default = sum(bench(lambda: wo_matmul(xs[k], w)) for w, (n, k) in zip(ws, GPU_SHAPES))
            print(f"M={m} {name}: plan() {default:.1f} us; " + " ".join(f"{tuple(c)}={t}" for c, t in timed),
                  flush=True)
            results.append({"m": m, "layout": name, "bf16_us": bf16, "plan_us": default, "configs": timed})
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
