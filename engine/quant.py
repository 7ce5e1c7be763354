"""Quantized weights kept packed: the formats the CPU kernels read, and how checkpoints become them.

Two packed kinds cover every format we load, each re-expressed without loss:
- "q4": 4-bit codes q in 0..15, w = scale * q + min per group of columns. GGUF Q4_0 (min = -8 scale),
  Q4_1 and Q4_K (each 32-column sub-block's 6-bit scale and min folded into fp32) land here.
- "q8": int8 codes, w = scale * q per group. GGUF Q8_0 (group 32), Q6_K (6-bit codes - 32, group 16) and
  `quantization="int8"` (an fp16/bf16/fp32 checkpoint quantized at load, one scale per output row).
GPTQ and AWQ checkpoints (4-bit, zero points, groups of a multiple of 32) land in "q4" too: min = -scale * zero;
8-bit GPTQ and llm-compressor's compressed-tensors (int8 W8A8, packed W4A16/W8A16, FP8) land in the kind they are.
A third kind, "f8", holds FP8 e4m3 weights with one fp32 scale per output row (`quantization="fp8"` of a float
checkpoint, or an FP8 checkpoint's per-tensor or per-channel `weight_scale`); its GEMM is torch's `_scaled_mm`.

`qs` holds the codes row by row: q8 as int8 [N, K]; q4 as uint8 [N, K / 2] where each 32-column block is
16 bytes, the low nibbles its columns 0..15 and the high nibbles 16..31 (GGUF's Q4_0/Q4_1 order).
`scales` (and q4's `mins`) are fp32 [N, K / group]. The kernels (engine/quant_kernels.py on CPU,
engine/quant_triton.py on a GPU) take these tensors; `dequantize` is the reference every format is checked against.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.errors import ConfigError, ModelLoadError

QUANTIZATIONS = ("auto", "none", "gguf", "gptq", "awq", "compressed-tensors", "int8", "fp8")   # EngineConfig's
HF_METHODS = ("gptq", "awq", "fp8", "compressed-tensors")   # quantization_config methods whose weights load packed

# GGUF types kept packed (the rest of a GGUF's tensors are dequantized to fp32 on load, with a warning).
PACKED_GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
FP8_MAX = 448.0                         # the largest finite e4m3fn


@dataclass
class QuantWeight:
    kind: str                     # "q4" | "q8" | "f8"
    qs: torch.Tensor              # q4: uint8 [N, K // 2]; q8: int8 [N, K]; f8: float8_e4m3fn [N, K]
    scales: torch.Tensor          # fp32 [N, K // group]
    mins: torch.Tensor | None     # q4: fp32 [N, K // group]; q8: None
    group: int                    # columns per scale: 16, 32, ..., K
    source: str                   # what it was: "Q4_1", "Q8_0", "int8", ...
    # GPTQ act-order (desc_act): column j holds input column perm[j] (its groups made contiguous), so a matmul
    # reads x[:, perm]; None: columns in input order
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * self.group

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.scales, self.mins) if t is not None)

    def to(self, device: torch.device) -> "QuantWeight":
        move = (lambda t: None if t is None else t.to(device))
        return QuantWeight(self.kind, move(self.qs), move(self.scales), move(self.mins), self.group, self.source,
                           move(self.perm))

    def rows(self, index) -> "QuantWeight":
        """The rows `index` (a slice, a permutation): a head's share, or q/k rows in HF order."""
        pick = (lambda t: None if t is None else t[index].contiguous())
        return QuantWeight(self.kind, pick(self.qs), pick(self.scales), pick(self.mins), self.group, self.source,
                           self.perm)

    def pad_rows(self, n: int) -> "QuantWeight":
        """n rows: these, then zero rows (codes, scales and mins 0: weights 0), a vocabulary shard's padding."""
        extra = n - self.shape[0]
        if extra <= 0:
            return self
        pad = (lambda t: None if t is None else torch.cat([t, t.new_zeros(extra, *t.shape[1:])]))
        return QuantWeight(self.kind, pad(self.qs), pad(self.scales), pad(self.mins), self.group, self.source,
                           self.perm)

    def cols(self, start: int, stop: int) -> "QuantWeight | None":
        """Columns start:stop (a row-parallel rank's share of the inputs, tensor parallelism), or None where they
        would cut a group of scales, a q4 block of 32, or leave a width the kernels do not take (then the caller
        runs that share dequantized)."""
        n, k = self.shape
        block = 16 if self.kind == "f8" else 32          # the C++ kernel's K multiple (q4: also its byte blocks)
        cuts_group = self.group < k and (start % self.group or stop % self.group)
        if self.perm is not None or start % block or (stop - start) % block or cuts_group:
            return None
        if self.group < k:
            scales = self.scales[:, start // self.group:stop // self.group].contiguous()
            mins = None if self.mins is None else self.mins[:, start // self.group:stop // self.group].contiguous()
            group = self.group
        else:                                             # one scale per row: it holds for any columns
            scales, mins, group = self.scales, self.mins, stop - start
        qs = self.qs[:, start // 2:stop // 2] if self.kind == "q4" else self.qs[:, start:stop]
        return QuantWeight(self.kind, qs.contiguous(), scales, mins, group, self.source)

    def shard(self, dim: int, start: int, stop: int) -> "QuantWeight | torch.Tensor":
        """A tensor-parallel rank's part: rows (dim 0) or columns (dim 1) start:stop, packed where the layout
        allows it, else dequantized to fp32."""
        if dim == 0:
            return self.rows(slice(start, stop))
        part = self.cols(start, stop)
        return part if part is not None else self.dequantize()[:, start:stop].contiguous()

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight":
        """Rows of several weights of one kind and group stacked (q, k, v into qkv)."""
        a = parts[0]
        if any((p.kind, p.group, p.shape[1]) != (a.kind, a.group, a.shape[1]) or not p.same_columns(a)
               for p in parts):
            raise ValueError("only weights of one kind, group, width and column order stack")
        cat = (lambda ts: None if ts[0] is None else torch.cat(ts))
        return QuantWeight(a.kind, cat([p.qs for p in parts]), cat([p.scales for p in parts]),
                           cat([p.mins for p in parts]), a.group, "+".join(sorted({p.source for p in parts})), a.perm)

    def same_columns(self, other: "QuantWeight") -> bool:
        """Both read x's columns in the same order (act-order: q, k and v quantized from one input share it)."""
        if self.perm is None or other.perm is None:
            return self.perm is None and other.perm is None
        return torch.equal(self.perm, other.perm)

    def codes(self, index=slice(None)) -> torch.Tensor:
        """The codes of rows `index` as [n, K] (q4 unpacked to 0..15; f8 as e4m3)."""
        qs = self.qs[index]
        if self.kind in ("q8", "f8"):
            return qs
        blocks = qs.view(qs.shape[0], -1, 16)
        return torch.cat([blocks & 0xF, blocks >> 4], dim=2).view(qs.shape[0], -1)

    def dequantize(self, index=slice(None)) -> torch.Tensor:
        """fp32 [n, K] of rows `index` (all by default): the embedding lookup and every test's reference."""
        q = self.codes(index).float()
        n, k = q.shape
        w = q.view(n, -1, self.group) * self.scales[index].unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins[index].unsqueeze(-1)
        w = w.view(n, k)
        if self.perm is not None:                         # back to input order
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w


def resolve_quantization(requested: str, gguf, named_gguf: bool, device: torch.device,
                         hf_method: str | None = None) -> str:
    """What the weights run as. "auto": a model named as a GGUF (the default model included) stays in its
    packed types, as llama.cpp and vLLM run it, and so does a GPTQ, AWQ or FP8 checkpoint (`hf_method`);
    anything else runs in the model's dtype ("none", which dequantizes those). Packed weights run on CPU (C++
    kernels) and CUDA (Triton; FP8 through torch's `_scaled_mm`), at any tensor_parallel_size (each rank holds its
    rows or columns packed, QuantWeight.shard). `gguf` is the GGUF the weights can load from (None for a dummy or
    a Hugging Face checkpoint)."""
    packed_ok = device.type in ("cpu", "cuda")
    if hf_method is not None:
        if requested in ("auto", hf_method):
            if packed_ok:
                return hf_method
            if requested == hf_method:
                raise ConfigError(f"quantization={hf_method!r} runs on CPU or CUDA only; quantization='none' "
                                  f"dequantizes the checkpoint")
            return "none"
        if requested != "none":
            raise ConfigError(f"the checkpoint holds {hf_method} weights: quantization must be auto, "
                              f"{hf_method} or none (dequantized), not {requested!r}")
        return "none"
    if requested in ("gptq", "awq"):                # fp8 also quantizes a float checkpoint at load
        raise ConfigError(f"quantization={requested!r} needs a checkpoint whose config.json says quant_method "
                          f"{requested!r}")
    if requested == "auto":
        return "gguf" if gguf is not None and named_gguf and packed_ok else "none"
    if requested == "gguf" and gguf is None:
        raise ConfigError("quantization='gguf' needs a GGUF model (a .gguf file or the default model)")
    if requested in ("gguf", "int8", "fp8") and not packed_ok:
        raise ConfigError(f"quantization={requested!r} runs on CPU or CUDA only")
    return requested


def quantize_int8(weight: torch.Tensor) -> QuantWeight:
    """Weight-only int8 with one scale per output row (vLLM's `quantization="int8"` on a float checkpoint)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0
    qs = torch.round(w / scales).clamp_(-127, 127).to(torch.int8)
    return QuantWeight("q8", qs.contiguous(), scales.contiguous(), None, w.shape[1], "int8")


# -- GGUF blocks -> packed ---------------------------------------------------------------------------
def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian fp16 fields (the last axis holds their 2 bytes) as fp32."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes 0..15 [N, K] -> [N, K / 2] in the q4 layout (per 32 columns: low nibbles 0..15, high 16..31)."""
    b = q.reshape(q.shape[0], -1, 2, 16).astype(np.uint8)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(q.shape[0], -1)


def from_gguf(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantWeight:
    """A GGUF tensor's bytes (uint8 [N, bytes per row], as gguf's reader gives them) of logical shape
    [N, K], re-expressed exactly as a QuantWeight."""
    n, k = shape
    raw = np.asarray(raw, dtype=np.uint8).reshape(n, -1)
    t = torch.from_numpy
    if type_name in ("Q8_0", "Q4_0", "Q4_1"):     # blocks of 32: fp16 d [, fp16 m], the codes; one read each
        fields = [("d", "<f2")] + [("m", "<f2")] * (type_name == "Q4_1") + [
            ("qs", "i1" if type_name == "Q8_0" else "u1", 32 if type_name == "Q8_0" else 16)]
        blocks = np.ascontiguousarray(raw).view(np.dtype(fields)).reshape(n, k // 32)
        d = blocks["d"].astype(np.float32)
        qs = t(np.ascontiguousarray(blocks["qs"]).reshape(n, -1))
        if type_name == "Q8_0":
            return QuantWeight("q8", qs, t(d), None, 32, type_name)
        m = -8.0 * d if type_name == "Q4_0" else blocks["m"].astype(np.float32)
        return QuantWeight("q4", qs, t(d), t(m), 32, type_name)
    if type_name == "Q4_K":                # 144 bytes / 256: d, dmin, 12 bytes of 6-bit scales and mins, 128 of codes
        blocks = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(blocks[:, :, 0:2]), _f16(blocks[:, :, 2:4])
        s = blocks[:, :, 4:16].astype(np.uint8)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        codes = blocks[:, :, 16:].reshape(n, k // 256, 4, 32)     # 4 chunks of 64 columns: low, then high nibbles
        q = np.stack([codes & 0xF, codes >> 4], axis=3).reshape(n, k)
        scales = (d[..., None] * sc.astype(np.float32)).reshape(n, k // 32)
        mins = (-(dmin[..., None] * mn.astype(np.float32))).reshape(n, k // 32)
        return QuantWeight("q4", t(_pack_nibbles(q)), t(scales), t(mins), 32, type_name)
    if type_name == "Q6_K":                # 210 bytes / 256: 128 low nibbles, 64 of 2-bit highs, 16 int8 scales, d
        blocks = raw.reshape(n, k // 256, 210)
        ql = blocks[:, :, 0:128].reshape(n, -1, 2, 64)            # two halves of 128 columns
        qh = blocks[:, :, 128:192].reshape(n, -1, 2, 1, 32)
        sc = blocks[:, :, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, :, 208:210])
        low = np.concatenate([ql & 0xF, ql >> 4], axis=3).reshape(n, -1, 2, 4, 32)   # column groups of 32
        high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 1, 4, 1)) & 3
        q = (low | (high << 4)).astype(np.int16) - 32
        scales = (d[..., None] * sc).reshape(n, k // 16)
        return QuantWeight("q8", t(q.astype(np.int8).reshape(n, k)), t(np.ascontiguousarray(scales)), None, 16,
                           type_name)
    raise ModelLoadError(f"GGUF type {type_name} is not kept packed (packed: {', '.join(PACKED_GGUF_TYPES)})")


# -- GPTQ / AWQ checkpoints -> packed -------------------------------------------------------------------
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)        # AutoAWQ's GEMM packing: nibble i of a word holds column ORDER[i]


def hf_quant_method(quant_config) -> str | None:
    """The method of a checkpoint's quantization_config that loads packed ("gptq", "awq", "fp8"), None without
    one (or for gpt-oss's MXFP4 experts, which load dequantized); a ModelLoadError naming the method or the option
    we do not load."""
    if not quant_config:
        return None
    q = quant_config if isinstance(quant_config, dict) else quant_config.to_dict()
    method = q.get("quant_method")
    if method == "mxfp4":                 # gpt-oss's experts: dequantized at load (LlamaForCausalLM._gpt_oss_tensors)
        return None
    if method not in HF_METHODS:
        raise ModelLoadError(f"this checkpoint holds {method or 'quantized'} weights (quantization_config in its "
                             f"config.json), which this engine does not load: GPTQ and AWQ (4-bit), FP8 (e4m3, "
                             f"per-tensor, per-channel or block-wise scales), GGUF and unquantized checkpoints load")
    if method == "compressed-tensors":
        compressed_tensors_scheme(q)                  # refuses what does not load, by name
        return method
    if method == "fp8":
        if q.get("weight_block_size") is not None:      # DeepSeek-V3's, Qwen3-FP8's: dequantized at load
            fp8_block_size(q)
            return None
        return method
    bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
    problems = []
    if bits not in ((4, 8) if method == "gptq" else (4,)):
        problems.append(f"bits {bits} ({'4 or 8' if method == 'gptq' else '4'} load)")
    if bits == 8 and q.get("sym") is False:
        problems.append("an asymmetric 8-bit scheme (sym false; symmetric 8-bit loads)")
    if not group or group != -1 and (group < 0 or group % 32):
        problems.append(f"group_size {group} (a multiple of 32, or -1, loads)")
    if method == "awq" and str(q.get("version", "gemm")).lower() != "gemm":
        problems.append(f"version {q.get('version')} (GEMM loads)")
    if problems:
        raise ModelLoadError(f"this {method} checkpoint is not loadable: {', '.join(problems)}")
    return method


# -- compressed-tensors (llm-compressor; vLLM's most common quantized format) ------------------------------------
CT_SCHEMES = {("float-quantized", "float", 8), ("naive-quantized", "float", 8), ("int-quantized", "int", 8),
              ("naive-quantized", "int", 8), ("pack-quantized", "int", 4), ("pack-quantized", "int", 8)}


def compressed_tensors_scheme(q: dict) -> dict:
    """The one weights scheme of a compressed-tensors quantization_config ({num_bits, type, strategy, group_size,
    format}): symmetric FP8 (8-bit float, per tensor or channel), int8 (per channel, group or tensor), or 4- or
    8-bit ints packed into int32 (W4A16/W8A16, per group or channel). Activation schemes are not read: activations
    are quantized per token (FP8) or per 32 values (the int kernels) as they come. Anything else is a
    ModelLoadError naming it."""
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    weights = [g.get("weights") or {} for g in groups]
    problems = []
    if not weights or any(w != weights[0] for w in weights):
        problems.append("config groups with different weight schemes (one scheme loads)")
    w = weights[0] if weights else {}
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if (fmt, kind, bits) not in CT_SCHEMES:
        problems.append(f"{bits}-bit {kind} weights in format {fmt!r} (FP8, int8, and 4- or 8-bit packed ints load)")
    if w.get("symmetric") is False:
        problems.append("asymmetric weights (zero points)")
    if w.get("actorder"):
        problems.append(f"actorder {w['actorder']!r}")
    if strategy not in ("tensor", "channel", "group") or (kind == "float" and strategy == "group"):
        problems.append(f"strategy {strategy!r}")
    group = w.get("group_size")
    if strategy == "group" and (not group or group % 32):
        problems.append(f"group_size {group} (a multiple of 32 loads)")
    if q.get("sparsity_config"):
        problems.append("sparsity")
    if problems:
        raise ModelLoadError(f"this compressed-tensors checkpoint is not loadable: {', '.join(problems)}")
    return {"bits": bits, "type": kind, "strategy": strategy, "group": group, "format": fmt}


def from_compressed_tensors(scheme: dict, tensors: dict[str, torch.Tensor]) -> QuantWeight:
    """One linear of a compressed-tensors checkpoint: FP8 (`weight` e4m3, `weight_scale`), int8 (`weight` int8,
    `weight_scale` per row, group or tensor) or packed ints (`weight_packed` int32 [N, K * bits / 32], each value
    stored + 2^(bits-1), low bits first, `weight_scale`, `weight_shape`)."""
    scale = tensors["weight_scale"].float()
    if scheme["type"] == "float":
        return from_fp8(tensors["weight"], scale)
    if scheme["format"] == "pack-quantized":
        n, k = (int(d) for d in tensors["weight_shape"].tolist())
        if scheme["bits"] == 4:
            codes = _unpack_bits(tensors["weight_packed"], 1)[:, :k].to(torch.uint8)                  # q + 8
        else:
            codes = (_unpack_bits(tensors["weight_packed"], 1, 8)[:, :k] - 128).to(torch.int8)          # q
    else:
        codes = tensors["weight"]
        n, k = codes.shape
    if scale.numel() == 1:
        scale = scale.reshape(1, 1).expand(n, 1)
    scale = scale.reshape(n, -1).contiguous()
    group = k // scale.shape[1]
    if scheme["bits"] == 4:                            # w = scale * (u - 8): a q4 min of -8 scale
        return QuantWeight("q4", _pack_nibbles_t(codes.contiguous()), scale, -8 * scale, group, "CT-W4A16")
    return QuantWeight("q8", codes.to(torch.int8).contiguous(), scale, None, group, "CT-int8")


def _unpack_bits(words: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """int32 words -> their 32 // bits codes (low bits first), spread along `dim` (that many times longer)."""
    per = 32 // bits
    codes = (words.unsqueeze(dim + 1) >> (bits * torch.arange(per, dtype=torch.int32)).view(
        [per if d == dim + 1 else 1 for d in range(words.dim() + 1)])) & ((1 << bits) - 1)
    shape = list(words.shape)
    shape[dim] *= per
    return codes.reshape(shape)


def act_order(g_idx: torch.Tensor | None, group: int) -> torch.Tensor | None:
    """GPTQ's g_idx (the group of each input column) as the column order that makes its groups contiguous: None
    when they already are (no act-order); a ModelLoadError where a group does not hold `group` columns."""
    if g_idx is None:
        return None
    g_idx = g_idx.long()
    if torch.equal(g_idx, torch.arange(len(g_idx)) // group):
        return None
    if not torch.equal(torch.bincount(g_idx, minlength=len(g_idx) // group), torch.full((len(g_idx) // group,), group)):
        raise ModelLoadError(f"this gptq checkpoint's g_idx does not give every group {group} columns")
    return torch.argsort(g_idx, stable=True)


def from_gptq_awq(method: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int,
                  gptq_v1: bool = True, bits: int = 4, g_idx: torch.Tensor | None = None) -> QuantWeight:
    """A GPTQ (qweight int32 [K/8, N] packed along K) or AWQ-GEMM (qweight int32 [K, N/8] packed along N, AutoAWQ's
    column order) linear as a q4 QuantWeight [N, K]: w = scale * (q - zero) = scale * q + (-scale * zero).
    GPTQ's v1 format stores each zero minus one. 8-bit GPTQ (qweight [K/4, N]; symmetric: every zero 128) is a q8
    QuantWeight of codes q - 128. group_size -1: one group of all K. GPTQ's act-order (`g_idx` grouping input
    columns out of order) keeps the codes with their groups made contiguous and the order x must be read in."""
    if group == -1:
        group = qweight.shape[0] * 32 // bits if method == "gptq" else qweight.shape[0]
    perm = act_order(g_idx, group) if method == "gptq" else None
    if bits == 8:
        q, z = _unpack_bits(qweight, 0, 8), _unpack_bits(qzeros, 1, 8) + (1 if gptq_v1 else 0)    # [K, N], [K/g, N]
        s = scales.float()
        k, n = q.shape
        if s.shape != (k // group, n) or z.shape[0] != k // group:
            raise ModelLoadError(f"gptq tensors disagree: qweight gives [{k}, {n}], scales are {tuple(s.shape)}, "
                                 f"group_size {group}")
        if not (z[:, :n] == 128).all():
            raise ModelLoadError("this 8-bit gptq checkpoint has zero points other than 128 (an asymmetric "
                                 "scheme), which this engine does not load: symmetric 8-bit loads")
        if perm is not None:
            q = q[perm]
        codes = (q.t() - 128).to(torch.int8).contiguous()                             # [N, K]
        return QuantWeight("q8", codes, s.t().contiguous(), None, group, "GPTQ-8bit", perm)
    if method == "gptq":
        q = _unpack_bits(qweight, 0)                                    # [K, N]
        z = _unpack_bits(qzeros, 1) + (1 if gptq_v1 else 0)            # [K/g, N]
    else:
        inv = torch.tensor([_AWQ_ORDER.index(i) for i in range(8)])
        unorder = (lambda t: t.view(t.shape[0], -1, 8)[:, :, inv].reshape(t.shape[0], -1))
        q, z = unorder(_unpack_bits(qweight, 1)), unorder(_unpack_bits(qzeros, 1))
    s = scales.float()
    k, n = q.shape
    if s.shape != (k // group, n) or z.shape[0] != k // group:
        raise ModelLoadError(f"{method} tensors disagree: qweight gives [{k}, {n}], scales are {tuple(s.shape)}, "
                             f"group_size {group}")
    z = z[:, :n].float()
    if perm is not None:
        q = q[perm]
    codes = q.t().contiguous().to(torch.uint8)                      # [N, K]
    return QuantWeight("q4", _pack_nibbles_t(codes), s.t().contiguous(), (-(s * z)).t().contiguous(), group,
                       method.upper(), perm)


def _pack_nibbles_t(q: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 uint8 [N, K] -> [N, K / 2] in the q4 layout."""
    b = q.view(q.shape[0], -1, 2, 16)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(q.shape[0], -1).contiguous()


# -- FP8: torch's _scaled_mm (CUDA capability 8.9+, and torch's CPU build) ------------------------------------
def quantize_fp8(weight: torch.Tensor) -> QuantWeight:
    """`quantization="fp8"`: e4m3 with one scale per output row (amax / 448), as vLLM's dynamic FP8."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    qs = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantWeight("f8", qs.contiguous(), scales.contiguous(), None, w.shape[1], "fp8")


def fp8_block_size(quant_config) -> tuple[int, int] | None:
    """An FP8 checkpoint's weight_block_size (rows, columns of each block that shares a scale: DeepSeek-V3's and
    Qwen3-FP8's [128, 128]), None where its scales are per tensor or per channel. Such weights load dequantized to
    the model's dtype (engine/loader.py iter_block_fp8_weights): there is no block-scaled FP8 GEMM here yet."""
    q = quant_config if isinstance(quant_config, dict) or quant_config is None else quant_config.to_dict()
    block = (q or {}).get("weight_block_size") if (q or {}).get("quant_method") == "fp8" else None
    if block is None:
        return None
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(f"weight_block_size {block!r}: two positive integers (rows, columns) load")
    return int(block[0]), int(block[1])


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-scaled FP8 weight [N, K] in fp32: each (block rows x block columns) tile of e4m3 codes times its
    scale (weight_scale_inv [ceil(N / rows), ceil(K / columns)], as DeepSeek's checkpoints name it)."""
    n, k = weight.shape
    rows, cols = -(-n // block[0]), -(-k // block[1])
    if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != (rows, cols):
        raise ModelLoadError(f"a block-wise FP8 weight must be float8_e4m3fn with scales [{rows}, {cols}] for its "
                             f"{(n, k)} in blocks of {block}; got {weight.dtype} and {tuple(scale_inv.shape)}")
    scales = scale_inv.float().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return weight.float() * scales


def from_fp8(weight: torch.Tensor, scale: torch.Tensor) -> QuantWeight:
    """An FP8 checkpoint's linear: e4m3 `weight` [N, K] and its `weight_scale` (a scalar: per tensor; [N] or
    [N, 1]: per channel) as an "f8" QuantWeight with one scale per row."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"an fp8 checkpoint's weight must be float8_e4m3fn, got {weight.dtype}")
    s = scale.float().reshape(-1)
    if s.numel() not in (1, n):
        raise ModelLoadError(f"weight_scale of {tuple(scale.shape)} for a weight of {(n, k)}: per-tensor (one "
                             f"value) and per-channel ({n} values) scales load")
    return QuantWeight("f8", weight.contiguous(), s.expand(n).reshape(n, 1).contiguous(), None, k, "FP8")


def fp8_gemm_supported(device: torch.device) -> bool:
    """torch._scaled_mm in FP8: CUDA capability 8.9+ (Ada, Hopper, Blackwell) and torch's CPU build."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu"


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> e4m3 codes and fp32 per-token scales [M, 1]."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    return (xf / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_matmul(x: torch.Tensor, w: QuantWeight, scale_row: torch.Tensor, use_gemm: bool) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T in x's dtype. `scale_row`: w's scales as fp32 [1, N] (what _scaled_mm takes)."""
    if not use_gemm:
        return x @ (w.qs.to(x.dtype) * w.scales.to(x.dtype)).t()
    xq, xs = quantize_tokens_fp8(x)
    out_dtype = torch.bfloat16 if x.device.type == "cuda" else torch.float32   # CUDA's row-wise scaling: bf16 out
    y = torch._scaled_mm(xq, w.qs.t(), scale_a=xs, scale_b=scale_row, out_dtype=out_dtype)
    return y.to(x.dtype)


# Up to this many tokens, q4 weights with bf16 activations run torch's tinygemm int4 kernel on CUDA; more take the
# Triton kernel. On an H200 (2026-11-28, `python -m bench.quant_triton_sweep --part small`) tinygemm took 84-178 us
# for a Llama-3-8B layer's four linears at M = 1-8 against the Triton kernel's 246-492 (cuBLAS bf16: 153); at M = 16
# the two traded places between runs, and from M = 32 the Triton kernel was faster (at 256, 0.72-0.96 ms vs 3.9).
TINYGEMM_MAX_M = 8


def tinygemm_pack(w: QuantWeight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A q4 weight in the layout of torch's tinygemm int4 kernel (`_weight_int4pack_mm`; on CPU its twin
    `_weight_int4pack_mm_for_cpu`): (packed codes, scales and zeros [K / group, N, 2] in `dtype`), or None where
    tinygemm does not take it: another kind, a group other than 32/64/128/256, K not a multiple of 128 (8 inner
    tiles of 16) or N not of 8. tinygemm's rule w = (q - 8) * scale + zero is ours, q * scale + min, with
    zero = min + 8 * scale. On a GPU it reads 4-bit weights several times faster at decode sizes than the Triton
    kernel's tl.dot tiles (engine/quant_triton.py; `baton check gpu`, docs/benchmarks.md)."""
    n, k = w.shape
    if w.kind != "q4" or w.group not in (32, 64, 128, 256) or k % 128 or n % 8:
        return None
    codes = w.codes().to(torch.int32)
    if w.qs.device.type == "cuda":          # two codes a byte, the even column in the high nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8), 8)
    else:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 8)
    zeros = w.mins + 8 * w.scales
    return packed, torch.stack([w.scales, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)


def tinygemm_matmul(x: torch.Tensor, w: QuantWeight, pack: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T through tinygemm, `pack` from tinygemm_pack (x in its dtype)."""
    op = torch.ops.aten._weight_int4pack_mm if x.is_cuda else torch.ops.aten._weight_int4pack_mm_for_cpu
    return op(x.contiguous(), pack[0], w.group, pack[1])
