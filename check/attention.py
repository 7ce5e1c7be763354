"""Part 1 of `baton check gpu`: the Triton paged-attention kernel against the torch reference, on mixed batches.

Each case is one launch over decodes, a fresh prefill, a prefill chunk on a cached prefix and speculative
verify steps (k + 1 query tokens), at a model's head shapes, in a dtype and a block size. The reference is
engine/attention.py's `paged_attention_torch` in fp32 on the CPU, fed the same (rounded) inputs, so the error
is the kernel's alone. On a GPU the kernel runs on the device; in the CPU dry mode it runs under Triton's
interpreter (TRITON_INTERPRET=1, fp32 and fp16: the interpreter computes bf16 wrong) in a subprocess, since
the variable must be set before triton is imported; without triton the C++ CPU kernel stands in.

`python -m check.attention` runs the CPU cases and prints their rows as JSON (the subprocess).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from check.compare import Tolerance, error_stats
from check.report import FAIL, PASS, Row, interpreted_rows, print_interpreted_rows
from engine.attention import AttentionMetadata, paged_attention_torch
from engine.kv_layout import KVCacheSpec, dequantize_kv, kv_cache_shape, layer_views, quantize_kv

NUM_LAYERS = 2               # the cache is one tensor of all layers: a layer's K/V are strided views
HEAD_SHAPES = {              # (query heads, KV heads, head dim)
    "SmolLM2-135M": (9, 3, 64),
    "Llama-3-8B": (32, 8, 128),
    "Gemma-2-2B": (8, 4, 256),       # its layers' sliding window and score softcap (the cases below)
    "gpt-oss-20b": (64, 8, 64),      # its attention sinks and sliding window (the cases below)
    # MLA: a TP-8 rank's 16 of 128 heads over one latent KV head of 512 + 64, the value its first 512 (the same view
    # as the key: a latent cache, engine/kv_layout.py kv_parts 1)
    "DeepSeek-V3": (16, 1, 576),
    "Llama-4-Scout": (40, 8, 128),   # its chunked attention layers (the cases below)
}
SPECIAL_SHAPES = ("Gemma-2-2B", "gpt-oss-20b", "DeepSeek-V3", "Llama-4-Scout")
# (context length, query length) per sequence: the query is the context's last tokens.
GPU_SEQS = [(2047, 1), (300, 1), (33, 1),      # decodes, one over 64+ pages
            (512, 512),                         # a fresh prefill
            (1200, 200),                        # a prefill chunk on 1000 cached tokens
            (900, 5), (64, 5)]                  # verify steps: the last token and 4 drafts
# decodes alone: few programs, so the kernel splits the keys (flash-decoding, num_kv_splits) and combines
GPU_DECODE_SEQS = [(2047, 1), (300, 1), (17, 1)]
CPU_SEQS = [(37, 1), (70, 1), (9, 9), (40, 24), (53, 5)]
TOLERANCES = {               # output rounding (half an ulp) plus the kernel's low-precision P @ V
    torch.float32: Tolerance(1e-4, 1e-4),
    torch.float16: Tolerance(2e-3, 2e-3),
    torch.bfloat16: Tolerance(1.6e-2, 1.6e-2),
}
Kernel = Callable[..., torch.Tensor]     # (q, k_cache, v_cache, md, scale) -> out


@dataclass(frozen=True)
class Case:
    model: str
    dtype: torch.dtype
    block_size: int
    seqs: tuple[tuple[int, int], ...]
    batch: str = ""
    kv_cache_dtype: str = "auto"             # int8 / fp8: the kernel reads a quantized cache and its scales
    window: int = 0                          # a sliding window (engine/attention.py), 0: none
    softcap: float = 0.0                     # Gemma 2's score softcap, 0: none
    sinks: bool = False                      # gpt-oss's sink logit per query head (random, seeded)
    latent: bool = False                     # MLA's latent cache: V is K's view
    chunk: int = 0                           # Llama 4's attention chunk, 0: none


    @property
    def name(self) -> str:
        kv = "" if self.kv_cache_dtype == "auto" else f" kv-{self.kv_cache_dtype}"
        opts = (f" window {self.window}" if self.window else "") \
            + (f" softcap {self.softcap:g}" if self.softcap else "") + (" sinks" if self.sinks else "") \
            + (" latent" if self.latent else "") + (f" chunk {self.chunk}" if self.chunk else "")
        return f"{self.model} {str(self.dtype).removeprefix('torch.')} bs{self.block_size}{kv}{opts}{self.batch}"


def cases(cpu: bool) -> list[Case]:
    dtypes = (torch.float32, torch.float16) if cpu else (torch.bfloat16, torch.float16)
    seqs = tuple(CPU_SEQS if cpu else GPU_SEQS)
    dense = [m for m in HEAD_SHAPES if m not in SPECIAL_SHAPES]
    out = [Case(model, dtype, bs, seqs) for model in dense for dtype in dtypes for bs in (16, 32)]
    # Gemma 2's layers: a sliding window shorter than most contexts (a decode's keys start mid-block, a prefill's
    # rows each start elsewhere, whole tiles are skipped), with and without its softcap
    window = 24 if cpu else 1000
    out += [Case("Gemma-2-2B", dtype, 16, seqs, window=window, softcap=sc) for dtype in dtypes for sc in (0.0, 50.0)]
    # gpt-oss's: sinks, on its sliding layers (a window of 128 on the GPU) and its full ones
    oss_window = 24 if cpu else 128
    out += [Case("gpt-oss-20b", dtype, 16, seqs, window=w, sinks=True) for dtype in dtypes for w in (0, oss_window)]
    # DeepSeek's MLA: 16 query heads on one KV head of 576 dims that is its own value; an int8 latent cache too
    out += [Case("DeepSeek-V3", dtype, 16, seqs, latent=True) for dtype in dtypes]
    out += [Case("DeepSeek-V3", dtypes[0], 16, seqs, kv_cache_dtype="int8", latent=True)]
    # Llama 4's chunked layers: chunks shorter than most contexts (its 8,192 cut to fit the cases' contexts)
    chunk = 16 if cpu else 256
    out += [Case("Llama-4-Scout", dtype, 16, seqs, chunk=chunk) for dtype in dtypes]
    if not cpu:
        out += [Case(model, dtype, 16, tuple(GPU_DECODE_SEQS), " decode") for model in dense for dtype in dtypes]
        out += [Case("Gemma-2-2B", dtype, 16, tuple(GPU_DECODE_SEQS), " decode", window=window, softcap=50.0)
                for dtype in dtypes]
        out += [Case("gpt-oss-20b", dtype, 16, tuple(GPU_DECODE_SEQS), " decode", sinks=True) for dtype in dtypes]
        out += [Case("DeepSeek-V3", dtype, 16, tuple(GPU_DECODE_SEQS), " decode", latent=True) for dtype in dtypes]
        out += [Case("Llama-4-Scout", dtype, 16, tuple(GPU_DECODE_SEQS), " decode", chunk=chunk) for dtype in dtypes]
    # a quantized cache (kv_cache_dtype): codes and scales, against the values they stand for
    out += [Case(model, dtypes[0], 16, seqs, kv_cache_dtype=kv) for model in dense for kv in ("int8", "fp8")]
    return out


def random_batch(seqs, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, seed: int = 0,
                 spare_blocks: int = 3, kv_parts: int = 2) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random mixed batch on the CPU in fp32. seqs: (context_len, query_len) per sequence, query = last tokens.

    Returns q, the full KV tensor (engine/kv_layout.py's layout) and the metadata; blocks are
    handed out in shuffled order so logical and physical order differ.
    """
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = max(blocks_per_seq) + 1                # a padding column, like a real table
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[used:used + nb].int()
        used += nb

    query_lens = [n for _, n in seqs]
    seq_lens = [ctx for ctx, _ in seqs]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (ctx, n) in enumerate(seqs):
        for pos in range(ctx - n, ctx):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)

    md = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        seq_lens_list=seq_lens,
        query_lens_list=query_lens,
    )
    kv = torch.randn(kv_cache_shape(num_blocks, num_kv_heads, NUM_LAYERS, block_size, head_dim, kv_parts), generator=g)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=g)
    return q, kv, md


def quantized_cache(kv: torch.Tensor, kv_cache_dtype: str) -> tuple[KVCacheSpec, torch.Tensor, torch.Tensor]:
    """kv (a full cache in the model's layout, as random_batch makes it) stored in a quantized cache: returns its
    spec, the cache (bytes) and, in fp32 and kv's layout, the values its codes and scales stand for (the
    reference a kernel reading the quantized cache is judged against)."""
    nb, heads, layers, parts, bs, d = kv.shape
    spec = KVCacheSpec(heads, layers, bs, d, kv.dtype, kv_cache_dtype, parts)
    cache, ref = spec.allocate(nb, torch.device("cpu")), torch.empty(kv.shape)
    for layer, views in enumerate(spec.layers(cache)):
        for src, codes_view, scale_view, dst in zip(layer_views(kv, layer), views[:2], views[2:],
                                                    layer_views(ref, layer)):
            codes, scale = quantize_kv(src, kv_cache_dtype)
            codes_view.view(torch.uint8).copy_(codes.view(torch.uint8))
            scale_view.copy_(scale)
            dst.copy_(dequantize_kv(codes, scale, torch.float32))
    return spec, cache, ref


def metadata_to(md: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    return AttentionMetadata(md.slot_mapping.to(device), md.block_tables.to(device), md.seq_lens.to(device),
                             md.query_start_loc.to(device), md.max_query_len, md.max_seq_len,
                             md.seq_lens_list, md.query_lens_list)


# -- kernels ----------------------------------------------------------------------------------------
def triton_kernel(q, k_cache, v_cache, md: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
                  window: int = 0, softcap: float = 0.0, sinks=None, chunk: int = 0):
    from engine.triton_attention import triton_paged_attention
    return triton_paged_attention(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                                  md.max_query_len, scale, k_scale=k_scale, v_scale=v_scale, window=window,
                                  softcap=softcap, sinks=sinks, chunk=chunk)


def cpu_kernel(q, k_cache, v_cache, md: AttentionMetadata, scale: float, k_scale=None, v_scale=None,
               window: int = 0, softcap: float = 0.0, sinks=None, chunk: int = 0):
    """The C++ CPU kernel (engine/cpu_attention.py); fp32 queries, fp32 or quantized caches."""
    from engine.cpu_attention import paged_attention_varlen
    return paged_attention_varlen(q, k_cache, v_cache, md.block_tables, md.seq_lens, md.query_start_loc, scale,
                                  k_scale, v_scale, window, softcap, sinks, chunk)


KERNELS: dict[str, Kernel] = {"triton": triton_kernel, "cpu": cpu_kernel}


def run_case(case: Case, kernel: str | Kernel, device: torch.device, layer: int = 1) -> Row:
    """One launch of `kernel` on the case's batch (layer 1 of the cache: strided K/V views), judged against the
    fp32 reference on the same rounded inputs."""
    heads, kv_heads, head_dim = HEAD_SHAPES[case.model]
    q, kv, md = random_batch(case.seqs, heads, kv_heads, head_dim, case.block_size, kv_parts=1 if case.latent else 2)
    q, kv = q.to(case.dtype), kv.to(case.dtype)                  # round once; the reference sees the same values
    scale = head_dim ** -0.5
    fn = KERNELS[kernel] if isinstance(kernel, str) else kernel
    opts = {"window": case.window, "softcap": case.softcap} if case.window or case.softcap else {}
    opts.update({"chunk": case.chunk} if case.chunk else {})
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(7)) * 2 if case.sinks else None
    if case.kv_cache_dtype == "auto":
        extra = {"sinks": sinks} if sinks is not None else {}
        ref = paged_attention_torch(q.float(), *layer_views(kv.float(), layer), md, scale, **opts, **extra)
        extra = {"sinks": sinks.to(device)} if sinks is not None else {}
        out = fn(q.to(device), *layer_views(kv.to(device), layer), metadata_to(md, device), scale, **opts, **extra)
    else:
        spec, cache, deq = quantized_cache(kv, case.kv_cache_dtype)
        ref = paged_attention_torch(q.float(), *layer_views(deq, layer), md, scale)
        k, v, ks, vs = spec.layers(cache.to(device))[layer]
        out = fn(q.to(device), k, v, metadata_to(md, device), scale, k_scale=ks, v_scale=vs)
    tol = TOLERANCES[case.dtype]
    stats = error_stats(out, ref, tol)
    data = {"model": case.model, "heads": [heads, kv_heads, head_dim], "dtype": str(case.dtype).removeprefix("torch."),
            "block_size": case.block_size, "kv_cache_dtype": case.kv_cache_dtype,
            "seqs": [list(s) for s in case.seqs], "tokens": q.shape[0], "window": case.window,
            "softcap": case.softcap, "sinks": case.sinks, "latent": case.latent, "chunk": case.chunk,
            "kernel": kernel if isinstance(kernel, str) else getattr(kernel, "__name__", "custom"),
            "out_dtype_ok": out.dtype == case.dtype, "tolerance": {"atol": tol.atol, "rtol": tol.rtol},
            **stats.as_dict()}
    ok = stats.passed and data["out_dtype_ok"]
    data["passed"] = ok
    result = f"max err {stats.max_abs:.2e}, mean {stats.mean_abs:.2e} (tol {tol.atol:g} + {tol.rtol:g}|ref|)"
    return Row("attention", case.name, result, PASS if ok else FAIL, data=data)


# -- the part ---------------------------------------------------------------------------------------
def check_attention(cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    if not cpu:
        dev = torch.device("cuda")
        return [run_case(c, "triton", dev) for c in cases(cpu=False)]
    try:
        return interpreted_rows("check.attention")
    except RuntimeError as e:                   # no triton, or its interpreter failed: the C++ kernel stands in
        log(f"Triton interpreter unavailable ({e}); comparing the C++ CPU kernel instead")
        rows = [run_case(c, "cpu", torch.device("cpu")) for c in cases(cpu=True) if c.dtype == torch.float32]
        for r in rows:
            r.case += " (C++ CPU kernel)"
            r.data["interpreter_error"] = str(e)
        return rows


def main() -> None:
    print_interpreted_rows("check.attention",
                           lambda: [run_case(c, "triton", torch.device("cpu")) for c in cases(cpu=True)])


if __name__ == "__main__":
    main()
