"""Tile sizes of the Triton weight-only matmul (engine/quant_triton.py) on one CUDA GPU.

`python -m bench.quant_triton_sweep [--out DIR]`: every packed layout of `baton check gpu`'s part 6 (check/quant.py)
on the four linear shapes of a Llama-3-8B layer, at M = 1 (decode) and M = 256 (prefill), for each candidate
(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) and for plan()'s choice; the median µs of triton.testing.do_bench summed over
the four shapes, beside cuBLAS bf16. A line per layout as it goes, and quant_triton_sweep.json under --out (written
after each line). plan()'s M = 256 tiles came from this sweep on an H100 (docs/benchmarks.md).
`--part small`: q4 through torch's tinygemm against the Triton kernel at M = 1-256 (engine/quant.py's
TINYGEMM_MAX_M came from it, on an H200), and int8 per row through torch's `_weight_int8pack_mm`; quant_small_m.json.
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
    ap.add_argument("--part", choices=("tiles", "small"), default="tiles",
                    help="tiles: the Triton kernel's tile sizes; small: q4 through tinygemm against the Triton kernel "
                         "at M = 1-256 (where TINYGEMM_MAX_M comes from), and q8 per row through torch's int8 kernel")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.quant_triton_sweep needs a CUDA GPU")
    if args.part == "small":
        return small(args.out)
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


def small(out: Path) -> None:
    """q4 layouts: the layer's tinygemm against the Triton kernel per M; q8 per row: torch's `_weight_int8pack_mm`
    (where this torch has it on CUDA) against the Triton kernel. Sums over the four shapes, do_bench medians."""
    from triton.testing import do_bench

    from check.quant import GPU_SHAPES, LAYOUTS, random_weight
    from engine.quant import tinygemm_matmul, tinygemm_pack
    from engine.quant_triton import wo_matmul
    dev = torch.device("cuda")
    out.mkdir(parents=True, exist_ok=True)
    path, results = out / "quant_small_m.json", []

    def bench(fn) -> float:
        return do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3

    for name, (kind, g) in LAYOUTS.items():
        if kind == "f8" or (kind == "q8" and g is not None):
            continue
        ws = [random_weight(kind, g, n, k, dev, 100 + i) for i, (n, k) in enumerate(GPU_SHAPES)]
        if kind == "q4":
            peers = [tinygemm_pack(w, torch.bfloat16) for w in ws]
            peer = lambda x, w, p: tinygemm_matmul(x, w, p)                          # noqa: E731
        else:
            peers = [(w.qs, w.scales.view(-1).to(torch.bfloat16)) for w in ws]
            peer = lambda x, w, p: torch.ops.aten._weight_int8pack_mm(x, p[0], p[1])  # noqa: E731
        for m in (1, 2, 4, 8, 16, 32, 64, 256):
            xs = {k: torch.randn(m, k, device=dev, dtype=torch.bfloat16) for _, k in GPU_SHAPES}
            dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for n, k in GPU_SHAPES]
            bf16 = sum(bench(lambda: xs[k] @ d.t()) for (n, k), d in zip(GPU_SHAPES, dense))
            tri = sum(bench(lambda: wo_matmul(xs[k], w)) for w, (n, k) in zip(ws, GPU_SHAPES))
            try:
                refs = [wo_matmul(xs[k], w).float() for w, (n, k) in zip(ws, GPU_SHAPES)]
                err = max(((peer(xs[k], w, p).float() - ref).abs().max() / ref.abs().max()).item()
                          for w, p, ref, (n, k) in zip(ws, peers, refs, GPU_SHAPES))
                other = round(sum(bench(lambda: peer(xs[k], w, p)) for w, p, (n, k) in zip(ws, peers, GPU_SHAPES)), 1)
            except Exception as e:                      # noqa: BLE001 - a torch without the kernel on CUDA
                err, other = None, f"{type(e).__name__}: {e}"[:120]
            print(f"{name} M={m}: bf16 {bf16:.1f} us, Triton {tri:.1f} us, torch's kernel {other} us "
                  f"(max diff {err})", flush=True)
            results.append({"layout": name, "m": m, "bf16_us": round(bf16, 1), "triton_us": round(tri, 1),
                            "torch_kernel_us": other, "rel_diff": err})
            path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=1))
    print(f"JSON: {path}")


if __name__ == "__main__":
    main()
