"""`baton check gpu`: one command that shows Baton's CUDA path right on one NVIDIA GPU, and how fast it is.

Six parts, each a module of this package: the Triton attention kernel against the torch reference
(attention.py), the engine against transformers on random-weight models (models.py), throughput and batch-1
latency against transformers and the HBM bound (speed.py), a NIXL KV pull between two processes (kv_pull.py),
tensor parallelism over two GPUs against one (tp.py; skipped on a one-GPU machine), and quantized weights:
the Triton and FP8 matmuls in every packed layout, and GPTQ, int8 and fp8 models against their exact weights
(quant.py).
It needs only the repository and a stock CUDA PyTorch image: no Ray, no hub download, NIXL only for part 4.
It prints a table and writes every figure as JSON (--out). It exits 1 when a correctness row fails; a missed
performance goal is printed, not failed. `--cpu` runs the same code paths on the CPU with tiny sizes, so the
test suite keeps the check from rotting where no GPU is.
"""
from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from check.report import FAIL, Row, part_summary, row_to_dict, table, write_json

PARTS = ("attention", "models", "speed", "kv_pull", "tp", "quant", "features")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", action="store_true",
                   help="dry mode: the same code paths on the CPU, tiny sizes, fp32 (the test suite runs it)")
    p.add_argument("--out", default="check_gpu.json", help="where the JSON goes (default: ./check_gpu.json)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")


class Checkpoints:
    """Part 2's random-weight checkpoints, built on first use in a temporary directory; part 3 reuses the first."""

    def __init__(self, root: Path, cpu: bool, log: Callable[[str], None]):
        self.root, self.cpu, self.log = root, cpu, log
        self._paths: dict[str, str] | None = None

    def paths(self) -> dict[str, str]:
        if self._paths is None:
            from check.models import build_checkpoint, models
            device = torch.device("cpu" if self.cpu else "cuda")
            dtype = torch.float32 if self.cpu else torch.bfloat16
            self._paths = {}
            for name, (model_type, config) in models(self.cpu).items():
                self.log(f"building the random {name} checkpoint")
                self._paths[name] = build_checkpoint(self.root / name, model_type, config, dtype, device)
        return self._paths


def run_part(part: str, cpu: bool, checkpoints: Checkpoints, log: Callable[[str], None]) -> list[Row]:
    if part == "attention":
        from check.attention import check_attention
        return check_attention(cpu, log)
    if part == "models":
        from check.models import check_models
        return check_models(checkpoints.paths(), cpu, log)
    if part == "speed":
        from check.speed import check_speed
        return check_speed(next(iter(checkpoints.paths().values())), cpu, log)
    if part == "quant":
        from check.quant import check_quant
        return check_quant(next(iter(checkpoints.paths().values())), cpu, log)
    if part == "features":
        from check.features import check_features
        return check_features(next(iter(checkpoints.paths().values())), cpu, log)
    if part == "kv_pull":
        from check.kv_pull import check_kv_pull
        return check_kv_pull(cpu, log)
    from check.tp import check_tp
    return check_tp(checkpoints.paths(), cpu, log)


def _guarded(part: str, *args) -> list[Row]:
    """A part that raises is one failed row (with its traceback in the JSON); the other parts still run."""
    try:
        return run_part(part, *args)
    except Exception as e:                          # noqa: BLE001 - report every part, whatever one does
        return [Row(part, "error", f"{type(e).__name__}: {e}", FAIL, data={"traceback": traceback.format_exc()})]


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run(args: argparse.Namespace) -> int:
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        print(f"baton: error: unknown part(s) {unknown}; choose from {list(PARTS)}", file=sys.stderr)
        return 2
    if not args.cpu and not torch.cuda.is_available():
        print("baton: error: no CUDA device here; `baton check gpu --cpu` runs the CPU dry mode", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rows, seconds = run_parts(parts, args.cpu)
    result = _result(rows, seconds, args.cpu, time.perf_counter() - t0)
    write_json(result, Path(args.out))
    title = "baton check gpu" + (" --cpu (CPU dry mode: tiny sizes, fp32; goals are for one H100)" if args.cpu else "")
    print(f"{title}\n\n{table(rows)}\n\n{'PASSED' if result['passed'] else 'FAILED'} in {result['seconds']:.0f} s; "
          f"JSON: {args.out}")
    return 0 if result["passed"] else 1


def run_parts(parts: list[str], cpu: bool) -> tuple[list[Row], dict[str, float]]:
    """Every part in turn (progress on stderr), sharing one temporary directory of checkpoints."""
    from bench.engine_bench import make_logger
    log = make_logger("check-gpu")
    rows, seconds = [], {}
    with tempfile.TemporaryDirectory(prefix="baton-check-") as tmp:
        checkpoints = Checkpoints(Path(tmp), cpu, log)
        for part in parts:
            log(f"part {PARTS.index(part) + 1}: {part} ...")
            t = time.perf_counter()
            rows += _guarded(part, cpu, checkpoints, log)
            seconds[part] = time.perf_counter() - t
            log(f"part {PARTS.index(part) + 1}: {part} done in {seconds[part]:.1f} s")
    return rows, seconds


def _result(rows: list[Row], seconds: dict[str, float], cpu: bool, total_s: float) -> dict:
    from bench.engine_bench import machine_info
    summary = part_summary(rows)
    for part, s in seconds.items():
        summary[part]["seconds"] = s
    return {"check": "gpu", "mode": "cpu dry mode" if cpu else "cuda",
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {**machine_info(), "cuda": torch.version.cuda, "triton": _version("triton"),
                        "nixl": _version("nixl")},
            "parts": summary, "passed": all(s["passed"] for s in summary.values()), "seconds": total_s,
            "rows": [row_to_dict(r) for r in rows]}
