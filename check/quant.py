"""Part 6 of `baton check gpu`: quantized weights on the GPU.

- Kernels: the engine's QuantLinear over each packed layout the loaders make (q4 in groups of 32: GGUF
  Q4_0/Q4_1/Q4_K; q4 in groups of 128: GPTQ/AWQ; q8 in groups of 32: Q8_0; of 16: Q6_K; one scale per row:
  `quantization="int8"`; e4m3 with one scale per row: `quantization="fp8"`), on the linear shapes of a
  Llama-3-8B layer at M = 1, 16 and 256 tokens, in bf16: the Triton weight-only kernel (engine/quant_triton.py),
  and for FP8 past decode sizes `_scaled_mm` with per-token e4m3 activations. The reference is the fp32 product
  of the dequantized weights (FP8's GEMM: of the activations as quantized too, so only its own rounding is left);
  |y - ref| <= TOL x max |ref| per call. Each layout's time for the layer's four linears (median of
  triton.testing.do_bench, L2 flushed between runs) is set against the bf16 GEMM (cuBLAS) on the same shapes:
  the goal at M = 1 is half the speed-up the bytes allow (bf16 bytes / packed bytes). At decode sizes in bf16
  the layer runs q4 through torch's tinygemm int4 kernel (`_weight_int4pack_mm`, engine/quant.py); the Triton
  kernel's time on the same call is printed beside it.
- Models: part 2's random Llama-3 1B as a GPTQ checkpoint (4-bit round-to-nearest, group 128, written here) and
  quantized at load (`int8`, `fp8`). Each format's engine in bf16 is judged teacher-forced against the engine in
  fp32 on a float checkpoint of exactly the weights the format stands for (written here too), so the weights'
  rounding is in both and only the computation differs: weight-only formats may miss it by WEIGHT_ONLY_FACTOR
  x what the unquantized bf16 engine misses its fp32 run by; FP8 also rounds every activation to e4m3 and may
  miss by that plus FP8_MEAN_TOL. Each also decodes one request (CUDA graphs) for its batch-1 inter-token
  latency beside the unquantized model's.

The CPU dry mode runs the kernel cases under Triton's interpreter (fp32, tiny shapes, in a subprocess, as the
attention part) and the model cases on the tiny Llama, where GPTQ and int8 take the C++ kernels (int8
activations per 32 columns: a coarser judge, CPU_MEAN_TOL). `python -m check.quant` runs the CPU kernel cases
and prints their rows as JSON (the subprocess).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable

import torch

from check.compare import Tolerance, error_stats
from check.report import FAIL, INFO, PASS, Row, interpreted_rows, print_interpreted_rows
from check.models import free_memory
from engine.quant import QuantWeight, quantize_fp8, quantize_int8, quantize_tokens_fp8

# -- checkpoints in quantized formats (the tests write theirs with these too) ------------------------------------
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_4bit(w: torch.Tensor, group: int):
    """Asymmetric 4-bit per group of input columns, round to nearest, as GPTQ/AWQ store it: codes [K, N], fp16
    scales and integer zeros [K / group, N] (zeros kept in 1..15: GPTQ's v1 format cannot store 0), and w's
    dequantized [N, K]."""
    wt = w.float().t().contiguous()
    k, n = wt.shape
    g = wt.view(k // group, group, n)
    lo, hi = g.min(1).values, g.max(1).values
    scale = ((hi - lo) / 15).clamp_min(1e-6).half().float()
    zero = torch.round(-lo / scale).clamp(1, 15)
    q = torch.round(g / scale[:, None] + zero[:, None]).clamp(0, 15)
    deq = (scale[:, None] * (q - zero[:, None])).view(k, n).t().contiguous()
    return q.view(k, n).int(), scale.half(), zero.int(), deq


def quantize_8bit_sym(w: torch.Tensor, group: int):
    """Symmetric 8-bit per group of input columns, as GPTQ stores it (sym: every zero 128): codes [K, N] in 0..255,
    fp16 scales [K / group, N], and w's dequantized [N, K]."""
    wt = w.float().t().contiguous()
    k, n = wt.shape
    g = wt.view(k // group, group, n)
    scale = (2 * g.abs().amax(1) / 255).clamp_min(1e-6).half().float()
    q = torch.round(g / scale[:, None] + 128).clamp(0, 255)
    deq = (scale[:, None] * (q - 128)).view(k, n).t().contiguous()
    return q.view(k, n).int(), scale.half(), deq


def pack_bits(codes: torch.Tensor, dim: int, bits: int = 4, order=None) -> torch.Tensor:
    """32 // bits codes per int32 along `dim`: field i holds element order[i] of each run."""
    per = 32 // bits
    order = order or tuple(range(per))
    c = codes.movedim(dim, -1)
    c = c.reshape(*c.shape[:-1], -1, per)
    words = torch.zeros(c.shape[:-1], dtype=torch.int32)
    for i, src in enumerate(order):
        words |= c[..., src] << (bits * i)
    return words.movedim(-1, dim) if dim != c.dim() - 2 else words


# compressed-tensors schemes the writer makes: (format, weight type, bits, strategy)
CT_METHODS = {"ct-fp8": ("float-quantized", "float", 8, "channel"), "ct-int8": ("int-quantized", "int", 8, "channel"),
              "ct-w4a16": ("pack-quantized", "int", 4, "group"), "ct-w8a16": ("pack-quantized", "int", 8, "channel")}


def compressed_tensors_config(method: str, group: int) -> dict:
    fmt, kind, bits, strategy = CT_METHODS[method]
    weights = {"num_bits": bits, "type": kind, "strategy": strategy, "symmetric": True, "dynamic": False,
               "group_size": group if strategy == "group" else None, "actorder": None}
    acts = {"num_bits": 8, "type": kind, "strategy": "token", "symmetric": True, "dynamic": True} \
        if fmt != "pack-quantized" else None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts}},
            "ignore": ["lm_head"]}


def write_compressed_tensors_linear(method: str, w: torch.Tensor, prefix: str, group: int, packed: dict,
                                    ref: dict) -> None:
    """One linear as llm-compressor writes it: FP8 or int8 `weight` with a per-row `weight_scale`, or ints packed
    into int32 (`weight_packed`, each value + 2^(bits-1), low bits first along K) with `weight_scale` per group
    (4-bit) or row (8-bit) and `weight_shape`."""
    fmt, kind, bits, strategy = CT_METHODS[method]
    n, k = w.shape
    if kind == "float":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        packed[f"{prefix}.weight"] = (w / scale).to(torch.float8_e4m3fn)
        packed[f"{prefix}.weight_scale"] = scale
        ref[f"{prefix}.weight"] = packed[f"{prefix}.weight"].float() * scale
        return
    g = group if strategy == "group" else k
    qmax = 2 ** (bits - 1) - 1
    wg = w.view(n, k // g, g)
    scale = (wg.abs().amax(-1, keepdim=True) / (qmax + 0.5)).clamp_min(1e-8).half().float()
    q = torch.round(wg / scale).clamp(-qmax - 1, qmax)
    ref[f"{prefix}.weight"] = (q * scale).view(n, k)
    q = q.view(n, k).to(torch.int32)
    if fmt == "pack-quantized":
        packed[f"{prefix}.weight_packed"] = pack_bits(q + 2 ** (bits - 1), 1, bits)
        packed[f"{prefix}.weight_shape"] = torch.tensor([n, k], dtype=torch.int64)
    else:
        packed[f"{prefix}.weight"] = q.to(torch.int8)
    packed[f"{prefix}.weight_scale"] = scale.view(n, k // g).half()


# act-order's column order follows a linear's input: q, k and v share one, as gate and up do
ACT_ORDER_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def write_quantized(src: str, out: Path, method: str, group: int = 32,
                    device: torch.device | None = None, bits: int = 4, act_order: bool = False) -> tuple[str, str]:
    """`src`'s linears as a checkpoint in `out`, and a float checkpoint (fp32) of exactly the weights those stand
    for in out/ref. method: "gptq" (v1; 4-bit, or symmetric 8-bit with `bits` 8; `act_order`: desc_act, its groups
    of input columns out of order) or "awq" (GEMM) 4-bit, group -1: one group of all K; "fp8" (per-channel
    weight_scale) or "fp8-tensor" (one per tensor), as AutoFP8 and llm-compressor write them; "ct-fp8", "ct-int8",
    "ct-w4a16", "ct-w8a16": compressed-tensors (CT_METHODS); "int8" or "fp8-load": `src` itself is the model
    (quantized at load, engine/quant.py) and only the reference is written (int8 rounds the head too, so the
    reference unties it). `device`: where the rounding runs (a GPU quantizes a 1B model in a second)."""
    import shutil

    from safetensors.torch import load_file, save_file
    state = load_file(f"{src}/model.safetensors")
    config = json.loads(Path(f"{src}/config.json").read_text())
    packed, ref = {}, {}
    at_load = method in ("int8", "fp8-load")
    if method == "int8" and config.get("tie_word_embeddings") and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    for name, w in state.items():
        prefix, piece = name.rsplit(".", 1)[0], name.split(".")[-2]
        is_head = name == "lm_head.weight"
        if piece not in LINEARS and not (is_head and method == "int8"):
            packed[name], ref[name] = w, w.float()
            continue
        w = w.to(device or "cpu")
        if at_load:
            ref[name] = (quantize_int8 if method == "int8" else quantize_fp8)(w).dequantize().cpu()
            continue
        if method.startswith("ct-"):                       # llm-compressor's compressed-tensors
            write_compressed_tensors_linear(method, w.float().cpu(), prefix, group, packed, ref)
            continue
        if method.startswith("fp8"):
            wf = w.float()
            amax = wf.abs().amax() if method == "fp8-tensor" else wf.abs().amax(dim=1, keepdim=True)
            scale = amax / 448
            packed[name] = (wf / scale).to(torch.float8_e4m3fn).cpu()
            packed[f"{prefix}.weight_scale"] = scale.cpu()
            packed[f"{prefix}.input_scale"] = torch.tensor(1.0)          # a static scheme's: not used
            ref[name] = packed[name].float() * scale.cpu()
            continue
        k = w.shape[1]
        g = k if group == -1 else group
        # act-order: group j holds input columns perm[j * g:(j + 1) * g] (one order for the linears of one input)
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(
            sum(map(ord, prefix.replace(piece, ACT_ORDER_INPUT.get(piece, piece)))))) if act_order else torch.arange(k)
        inv = torch.argsort(perm)
        g_idx = (torch.arange(k, dtype=torch.int32) // g)[inv]
        w = w[:, perm.to(w.device)]                       # quantized in group order, stored in input order
        if bits == 8:
            q, scale, deq = (t.cpu() for t in quantize_8bit_sym(w, g))
            ref[name] = deq[:, inv]
            packed[f"{prefix}.qweight"] = pack_bits(q[inv], 0, 8)
            packed[f"{prefix}.qzeros"] = pack_bits(torch.full((k // g, q.shape[1]), 127, dtype=torch.int32), 1, 8)
            packed[f"{prefix}.g_idx"] = g_idx
            packed[f"{prefix}.scales"] = scale
            continue
        q, scale, zero, deq = (t.cpu() for t in quantize_4bit(w, g))
        ref[name] = deq[:, inv]
        q = q[inv]
        if method == "gptq":
            packed[f"{prefix}.qweight"] = pack_bits(q, 0)
            packed[f"{prefix}.qzeros"] = pack_bits((zero - 1) & 0xF, 1)
            packed[f"{prefix}.g_idx"] = g_idx
        else:
            packed[f"{prefix}.qweight"] = pack_bits(q, 1, 4, AWQ_ORDER)
            packed[f"{prefix}.qzeros"] = pack_bits(zero, 1, 4, AWQ_ORDER)
        packed[f"{prefix}.scales"] = scale
    qc = {"gptq": {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": bits == 8},
          **{m: compressed_tensors_config(m, group) for m in CT_METHODS},
          "awq": {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm", "zero_point": True},
          "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"}}
    ref_config = {**config, "torch_dtype": "float32"} | ({"tie_word_embeddings": False} if method == "int8" else {})
    outputs = [(out / "ref", ref, ref_config)]
    if not at_load:
        config_of = qc[method if method in qc else method.split("-")[0]]
        outputs.append((out, packed, {**config, "quantization_config": config_of}))
    for d, tensors, cfg in outputs:
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(cfg))
        if Path(gen := f"{src}/generation_config.json").is_file():
            shutil.copy(gen, d)
    return (src if at_load else str(out)), str(out / "ref")


# -- kernels ---------------------------------------------------------------------------------------------------
LAYOUTS = {                    # name -> (kind, group); group None: one scale per row
    "q4 g32 (GGUF Q4_0/Q4_1/Q4_K)": ("q4", 32),
    "q4 g128 (GPTQ/AWQ)": ("q4", 128),
    "q8 g32 (GGUF Q8_0)": ("q8", 32),
    "q8 g16 (GGUF Q6_K)": ("q8", 16),
    "q8 per row (int8)": ("q8", None),
    "fp8 per row (e4m3)": ("f8", None),
}
GPU_SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))   # Llama-3-8B: qkv, o, gate_up, down
CPU_SHAPES = ((48, 256), (40, 128))
GPU_M, CPU_M = (1, 16, 256), (1, 20)                        # 20: FP8's GEMM path
TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-5}          # x max |ref| of each call
GOAL_BYTES_SHARE = 0.5         # at M = 1: at least half the speed-up the bytes allow over bf16


def random_weight(kind: str, group: int | None, n: int, k: int, device: torch.device, seed: int) -> QuantWeight:
    """A weight of `kind` with random codes and scales near a trained model's (w ~ 0.02)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "f8":
        return quantize_fp8(torch.randn(n, k, generator=g) * 0.02).to(device)
    group = group or k
    if kind == "q8":
        return QuantWeight("q8", torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g),
                           torch.rand(n, k // group, generator=g) * 3e-4, None, group, "check").to(device)
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g).view(n, -1, 2, 16)
    qs = (codes[:, :, 0] | (codes[:, :, 1] << 4)).reshape(n, -1).contiguous()
    scales = torch.rand(n, k // group, generator=g) * 5e-3
    return QuantWeight("q4", qs, scales, -7.5 * scales, group, "check").to(device)


def _layer(w: QuantWeight, device: torch.device, dtype: torch.dtype):
    """The engine's own layer over `w` (QuantLinear: tinygemm for q4 at decode sizes in bf16, else the Triton
    kernel, or FP8's GEMM beyond decode sizes); the CPU dry mode takes the Triton branch, under the interpreter."""
    from engine.model import QuantLinear
    return QuantLinear([w], None, device, triton=True, dtype=dtype)


def _reference(x: torch.Tensor, w: QuantWeight, layer) -> torch.Tensor:
    """fp32 product of the dequantized weights; FP8 past decode sizes, where the device has its GEMM, quantizes
    the activations per token first, as the GEMM does."""
    from engine.quant_triton import FP8_WEIGHT_ONLY_MAX_M
    if w.kind == "f8" and x.shape[0] > FP8_WEIGHT_ONLY_MAX_M and layer.fp8[0][1]:
        xq, xs = quantize_tokens_fp8(x)
        return (xq.float() * xs) @ w.dequantize().t()
    return x.float() @ w.dequantize().t()


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=10, rep=25, return_mode="median")
    fn()
    t = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t) / 3 * 1e3


def kernel_rows(cpu: bool) -> list[Row]:
    device, dtype = (torch.device("cpu"), torch.float32) if cpu else (torch.device("cuda"), torch.bfloat16)
    shapes, ms = (CPU_SHAPES, CPU_M) if cpu else (GPU_SHAPES, GPU_M)
    rows, times = [], {}
    dense = {}
    for i, (n, k) in enumerate(shapes):
        dense[(n, k)] = (torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02).to(device, dtype)
    for m in ms:
        xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype) for _, k in shapes}
        times[("bf16", m)] = sum(_time_ms(lambda: xs[k] @ dense[(n, k)].t(), device) for n, k in shapes)
    bf16_bytes = sum(n * k * 2 for n, k in shapes)
    for name, (kind, group) in LAYOUTS.items():
        worst, errs, nbytes, triton_ms, kernel = 0.0, [], 0, {}, {}
        for i, (n, k) in enumerate(shapes):
            w = random_weight(kind, group, n, k, device, seed=100 + i)
            nbytes += w.nbytes
            layer = _layer(w, device, dtype)
            for m in ms:
                x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(device, dtype)
                fn = (lambda lay=layer, xx=x: lay(xx))
                y, ref = fn(), _reference(x, w, layer)
                s = error_stats(y, ref, Tolerance(TOL[dtype] * ref.abs().max().item()))
                worst = max(worst, s.worst)
                kernel[m] = layer.route(m, dtype)
                errs.append({"n": n, "k": k, "m": m, "kernel": kernel[m], **s.as_dict()})
                times[(name, m)] = times.get((name, m), 0.0) + _time_ms(fn, device)
                if kernel[m] == "tinygemm":        # the Triton kernel the layer would run otherwise, timed beside
                    triton = (lambda lay=layer, xx=x, ww=w: lay.wo_matmul(xx, ww))
                    triton_ms[m] = triton_ms.get(m, 0.0) + _time_ms(triton, device)
                del fn, y, ref
            del w, layer
        ok = all(e["passed"] for e in errs)
        rows.append(Row("quant", f"kernel {name}",
                        f"worst error {worst:.2f} of the tolerance ({TOL[dtype]:g} x max|ref|) over {len(errs)} calls",
                        PASS if ok else FAIL, data={"calls": errs, "bytes": nbytes}))
        for m in ms:
            t, base = times[(name, m)], times[("bf16", m)]
            allowed = bf16_bytes / nbytes
            goal = ""
            if m == 1:
                met = base / t >= GOAL_BYTES_SHARE * allowed
                goal = f">= {GOAL_BYTES_SHARE * allowed:.2f}x bf16: {'met' if met else 'missed'}"
            extra = f"; the Triton kernel {triton_ms[m] * 1e3:.1f} us" if m in triton_ms else ""
            rows.append(Row("quant", f"speed {name}, M={m}",
                            f"{kernel[m]} {t * 1e3:.1f} us = {base / t:.2f}x bf16 ({base * 1e3:.1f} us); "
                            f"{nbytes / t / 1e6:.0f} GB/s of weights{extra}", INFO, goal,
                            {"ms": t, "bf16_ms": base, "speedup": base / t, "bytes": nbytes, "bf16_bytes": bf16_bytes,
                             "shapes": [list(s) for s in shapes], "kernel": kernel[m],
                             "triton_ms": triton_ms.get(m)}))
    return rows


# -- models ----------------------------------------------------------------------------------------------------
FORMATS = {                    # row -> (write_quantized's method and keywords, the engine's quantization=, its kind)
    "gptq": ("gptq", {}, "auto", "gptq"),
    "gptq 8-bit": ("gptq", {"bits": 8}, "auto", "gptq"),
    "gptq act-order": ("gptq", {"act_order": True}, "auto", "gptq"),
    "awq": ("awq", {}, "auto", "awq"),
    "fp8 checkpoint": ("fp8", {}, "auto", "fp8"),
    **{m: (m, {}, "auto", "compressed-tensors") for m in CT_METHODS},
    "int8": ("int8", {}, "int8", "int8"),
    "fp8-load": ("fp8-load", {}, "fp8", "fp8"),
}
E4M3_ACTIVATIONS = {"fp8 checkpoint", "ct-fp8", "fp8-load"}   # W8A8: the GEMM rounds the activations too
# the CPU dry mode's: one of each path through the check (its loaders' every format: tests/test_quant.py)
CPU_FORMATS = ("gptq", "gptq act-order", "ct-fp8", "int8", "fp8-load")
WEIGHT_ONLY_FACTOR = 2.0       # x the unquantized bf16 engine's own error (same weights, fp32 reference)
FP8_MEAN_TOL = 1.0             # nats added by e4m3 activations and weights: the 1B model in fp32 on CPU, 0.70
CPU_MEAN_TOL, CPU_FP8_MEAN_TOL = 0.05, 0.15      # fp32, tiny model: weight-only / e4m3 activations
GPU_GROUP, CPU_GROUP = 128, 32
ITL_PROMPT, ITL_TOKENS = 128, 64


def _engine(path: str, dtype: torch.dtype, device: torch.device, eager: bool, quantization: str = "auto"):
    from engine import LLM
    return LLM(path, dtype=dtype_name(dtype), device=device.type, enforce_eager=eager,
               quantization=quantization, max_num_seqs=8, max_model_len=512 if device.type == "cpu" else 1024,
               kv_cache_memory=None if device.type == "cuda" else 64 << 20)


def _logprobs(path: str, seqs, dtype, device, eager: bool, quantization: str = "auto", itl: bool = False):
    """Teacher-forced log-probabilities (check/models.py's), and the batch-1 decode ms a token when `itl`."""
    from check.models import engine_logprobs
    from engine import SamplingParams
    llm = _engine(path, dtype, device, eager, quantization)
    out = {"logprobs": engine_logprobs(llm, seqs), "quantization": llm.engine.runner.quantization,
           "weight_bytes": llm.engine.runner.weight_bytes}
    if itl:
        prompt = seqs[-1][:ITL_PROMPT]
        llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
        res = llm.generate([prompt], SamplingParams(max_tokens=ITL_TOKENS, ignore_eos=True, temperature=0))[0]
        out["ms_per_token"] = res.metrics.time_per_output_token * 1e3
    del llm
    free_memory(device)
    return out


def model_rows(path: str, cpu: bool, workdir: Path, log: Callable[[str], None]) -> list[Row]:
    from check.models import GPU_PROMPTS, random_prompts
    from engine.loader import load_config
    device, dtype = (torch.device("cpu"), torch.float32) if cpu else (torch.device("cuda"), torch.bfloat16)
    seqs = random_prompts(load_config(path).vocab_size, (40, 70) if cpu else GPU_PROMPTS, seed=3)
    rows = []
    log("quant: the unquantized model, fp32 and the engine's dtype")
    exact = _logprobs(path, seqs, torch.float32, device, eager=True)
    base = _logprobs(path, seqs, dtype, device, eager=cpu, itl=True)
    base_err = error_stats(torch.cat(base["logprobs"]), torch.cat(exact["logprobs"]), Tolerance(float("inf")))
    rows.append(Row("quant", "model unquantized", f"{dtype_name(dtype)} vs fp32: err mean {base_err.mean_abs:.3g}, "
                    f"max {base_err.max_abs:.3g}; batch-1 {base['ms_per_token']:.2f} ms/token, "
                    f"{base['weight_bytes'] / 1e9:.3g} GB", INFO,
                    data={"error": base_err.as_dict(), "ms_per_token": base["ms_per_token"],
                          "weight_bytes": base["weight_bytes"]}))
    for fmt in CPU_FORMATS if cpu else FORMATS:
        rows += _guarded(f"model {fmt}", lambda f=fmt: [_format_row(f, path, seqs, base, base_err, cpu, workdir, log)])
    return rows


def _format_row(fmt: str, path: str, seqs, base: dict, base_err, cpu: bool, workdir: Path, log) -> Row:
    """One format's checkpoints written, its engine against fp32 on the weights it stands for, its batch-1 ITL."""
    device, dtype = (torch.device("cpu"), torch.float32) if cpu else (torch.device("cuda"), torch.bfloat16)
    import shutil
    method, kwargs, quantization, kind = FORMATS[fmt]
    log(f"quant: {fmt}: writing the checkpoints")
    out = workdir / fmt.replace(" ", "-")
    try:                   # each format's fp32 reference of a 1B model is 5 GB: the device's disk holds few at once
        qpath, refpath = write_quantized(path, out, method, CPU_GROUP if cpu else GPU_GROUP, device, **kwargs)
        log(f"quant: {fmt}: fp32 on its exact weights, then the engine in {dtype_name(dtype)}")
        ref = _logprobs(refpath, seqs, torch.float32, device, eager=True)
        ours = _logprobs(qpath, seqs, dtype, device, eager=cpu, quantization=quantization, itl=True)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    err = error_stats(torch.cat(ours["logprobs"]), torch.cat(ref["logprobs"]), Tolerance(float("inf")))
    if cpu:
        tol = CPU_FP8_MEAN_TOL if fmt in E4M3_ACTIVATIONS else CPU_MEAN_TOL
    elif fmt in E4M3_ACTIVATIONS:
        tol = base_err.mean_abs + FP8_MEAN_TOL
    else:
        tol = WEIGHT_ONLY_FACTOR * base_err.mean_abs
    ok = err.passed and err.mean_abs <= tol and ours["quantization"] == kind
    speed = base["ms_per_token"] / ours["ms_per_token"]
    return Row("quant", f"model {fmt}",
               f"vs fp32 on its weights: err mean {err.mean_abs:.3g} (tol {tol:.3g}), max {err.max_abs:.3g}; "
               f"batch-1 {ours['ms_per_token']:.2f} ms/token = {speed:.2f}x unquantized; "
               f"{ours['weight_bytes'] / 1e9:.3g} GB", PASS if ok else FAIL,
               data={"error": err.as_dict(), "tol_mean": tol, "ms_per_token": ours["ms_per_token"],
                     "speedup_vs_unquantized": speed, "weight_bytes": ours["weight_bytes"],
                     "quantization": ours["quantization"]})


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _guarded(case: str, fn) -> list[Row]:
    """The kernels and each format's model run on whatever the others do: one that raises is one failed row."""
    try:
        return fn()
    except Exception as e:                          # noqa: BLE001 - report every case
        import traceback
        return [Row("quant", f"{case}: error", f"{type(e).__name__}: {e}", FAIL,
                    data={"traceback": traceback.format_exc()})]


def check_quant(path: str, cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    import tempfile
    log("quant: kernels")
    kernels = (lambda: interpreted_rows("check.quant")) if cpu else (lambda: kernel_rows(cpu=False))
    rows = _guarded("kernels", kernels)
    with tempfile.TemporaryDirectory(prefix="baton-quant-") as tmp:
        rows += _guarded("models", lambda: model_rows(path, cpu, Path(tmp), log))
    return rows


def main() -> None:
    print_interpreted_rows("check.quant", lambda: kernel_rows(cpu=True))


if __name__ == "__main__":
    main()
