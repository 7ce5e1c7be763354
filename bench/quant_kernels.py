"""Quantized CPU matmul (engine/quant_kernels.py) against fp32 prepacked oneDNN, what the engine runs today.

`python -m bench.quant_kernels [--reps 15] [--out DIR]`: SmolLM2-135M's linear shapes (q4 group 32) and its
lm_head (q8 group 32), M = 1 .. 512 rows; the median µs of --reps calls each, the kernel's speedup over fp32,
a table on stdout and quant_kernels.json under --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import quant_kernels

SHAPES = [("qkv", 960, 576, "q4"), ("o_proj", 576, 576, "q4"), ("gate_up", 3072, 576, "q4"),
          ("down", 576, 1536, "q4"), ("lm_head", 49152, 576, "q8")]
ROWS = [1, 4, 16, 64, 512]
GROUP = 32


def _median_us(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def _weights(kind: str, n: int, k: int):
    if kind == "q4":
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8), torch.rand(n, k // GROUP) * 0.01,
                -torch.rand(n, k // GROUP) * 0.08)
    return torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n, k // GROUP) * 0.001, None


def run(reps: int) -> list[dict]:
    assert quant_kernels.available(), "the quantized matmul kernel did not compile"
    rows = []
    for name, n, k, kind in SHAPES:
        qs, scales, mins = _weights(kind, n, k)
        packed = quant_kernels.prepare(kind, qs, scales, mins, GROUP)
        w = torch.ops.mkldnn._reorder_linear_weight(quant_kernels.dequantize(kind, qs, scales, mins, GROUP), None)
        for m in ROWS:
            x = torch.randn(m, k)
            fp32 = _median_us(lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), reps)
            quant = _median_us(lambda: quant_kernels.matmul(x, packed, kind, GROUP, n, k), reps)
            rows.append(dict(shape=name, n=n, k=k, kind=kind, m=m, fp32_us=fp32, quant_us=quant,
                             speedup=fp32 / quant))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=Path("/tmp"))
    args = ap.parse_args()
    rows = run(args.reps)
    print(f"{'shape':>8} {'N':>6} {'K':>5} {'kind':>4} {'M':>4} {'fp32 µs':>10} {'quant µs':>10} {'speedup':>8}")
    for r in rows:
        print(f"{r['shape']:>8} {r['n']:>6} {r['k']:>5} {r['kind']:>4} {r['m']:>4} {r['fp32_us']:>10.1f} "
              f"{r['quant_us']:>10.1f} {r['speedup']:>7.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "quant_kernels.json"
    path.write_text(json.dumps(dict(threads=torch.get_num_threads(), group=GROUP, rows=rows), indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
