"""Multi-LoRA: adapters in PEFT's format served beside the base model, mixed in one batch.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors` (what PEFT's
`save_pretrained` writes), with LoRA on any of q/k/v/o and gate/up/down, rank up to
`max_lora_rank`. The engine (`enable_lora=True`) keeps:

- a host cache of loaded adapters (`max_cpu_loras`, LRU; an adapter a live request uses stays), each
  checked against the model when it is first requested, so a bad file fails its request alone;
- `max_loras` device slots: every wrapped Linear holds its adapters' A stacked by slot ([slots, n*R, in],
  zero-padded ranks; a fused module, q/k/v or gate/up, one row-band per part) and their B with the
  scaling folded in: on CUDA one block-diagonal [slots, out, n*R] for the Triton kernels, on CPU one B
  per part (transposed for the C++ kernel, engine/lora_cpu.cpp; float64 for the torch path when no
  compiler is there), so a part the adapter does not train adds zero and costs nothing. A step names
  each token's slot (-1: the base model) and every wrapped Linear adds its LoRA product batched by
  slot (engine/lora_ops.py). On CPU either path gives a row the same bits alone or batched, with any
  thread count. The scheduler admits at most `max_loras` adapters among the running sequences, so a
  step never needs more slots.

A LoRA request's KV is another model's KV: its block hashes are chained under the adapter's key
(engine/block_hash.py `namespace_key`, from the adapter's content), so base and adapter blocks never mix, in the prefix
cache, in KV events, the router's index, or transfers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine.errors import ConfigError, InvalidRequestError

log = logging.getLogger(__name__)

# PEFT's module name -> (our fused module, part index): engine/model.py fuses q/k/v and gate/up
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1), "down_proj": ("mlp.down_proj", 0)}
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
# Phi-3's adapters target its fused modules: one A for all parts and one B over their rows, which are each part's
# adapter with that A and its rows of B (the same products)
_FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PARTS = {"self_attn.qkv_proj": 3, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 1}
# Llama 4 names its MLP feed_forward
_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|feed_forward)\.(\w+_proj)\.lora_([AB])"
                     r"(?:\.default)?\.weight$")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRAError(InvalidRequestError):
    """An adapter that cannot be served (missing or malformed files, a shape or rank the model refuses)."""


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name and path (vLLM's LoRARequest; lora_int_id kept for its callers). `lora_key`: its
    key when the caller knows it already (the cluster's registry carries the one a replica computed)."""
    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""
    lora_key: str | None = None

    @property
    def key(self) -> str:
        """The adapter's identity: a digest of its files, so the same adapter has the same KV namespace
        under any name or path, and a changed file is another adapter."""
        return self.lora_key or adapter_digest(self.lora_path)


_digests: dict[tuple, str] = {}


def adapter_digest(path: str) -> str:
    """blake2b of adapter_config.json and the weights file (cached by their paths, sizes and mtimes)."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
    files = (os.path.join(path, CONFIG_FILE), _weights_file(path))
    for f in files:
        if not os.path.isfile(f):
            raise LoRAError(f"LoRA adapter at {path!r} has no {os.path.basename(f)}")
    try:
        memo = tuple((os.path.realpath(f), st.st_size, st.st_mtime_ns) for f in files for st in [os.stat(f)])
    except OSError as e:
        raise LoRAError(f"LoRA adapter at {path!r}: {e.strerror}: {e.filename}") from None
    if memo not in _digests:
        h = hashlib.blake2b(digest_size=12)
        for f in files:
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        _digests[memo] = h.hexdigest()
    return _digests[memo]


def _weights_file(path: str) -> str:
    st = os.path.join(path, WEIGHTS_FILE)
    bin_ = os.path.join(path, "adapter_model.bin")
    return st if os.path.exists(st) or not os.path.exists(bin_) else bin_


@dataclass
class LoRAAdapter:
    """One adapter's weights, by (layer, our module): the A rows of each part and B with its scaling."""
    name: str
    key: str
    rank: int
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]]
    refs: int = 0                            # live requests using it (never evicted from the host cache)
    path: str = ""                           # where it was read (a TP worker reads it there too)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for parts in self.weights.values() for ab in parts.values()
                   for t in ab)


def read_adapter_config(path: str) -> dict:
    """adapter_config.json, checked for what Baton serves (plain LoRA on the attention and MLP projections)."""
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter path {path!r} is not a directory")
    try:
        with open(os.path.join(path, CONFIG_FILE)) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter at {path!r} has no {CONFIG_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAError(f"LoRA adapter at {path!r}: {CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter at {path!r}: {CONFIG_FILE} is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter at {path!r}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for flag, what in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                       ("layers_to_transform", "layers_to_transform")):
        if cfg.get(flag):
            raise LoRAError(f"LoRA adapter at {path!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none":
        raise LoRAError(f"LoRA adapter at {path!r}: bias={cfg['bias']!r} is not supported (only 'none')")
    for k in ("r", "lora_alpha"):
        v = cfg.get(k)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise LoRAError(f"LoRA adapter at {path!r}: {k} must be a positive number, got {v!r}")
    # per-module overrides (PEFT writes them for Qwen3-MoE's fused experts, say): a rank is read from the shapes
    for k in ("rank_pattern", "alpha_pattern"):
        v = cfg.get(k) or {}
        if not isinstance(v, dict) or any(isinstance(x, bool) or not isinstance(x, (int, float)) or x <= 0
                                          for x in v.values()):
            raise LoRAError(f"LoRA adapter at {path!r}: {k} must map module patterns to positive numbers, got {v!r}")
        try:
            for key in v:
                re.compile(key)
        except (re.error, TypeError) as e:
            raise LoRAError(f"LoRA adapter at {path!r}: {k} has a bad pattern ({e})") from None
    return cfg


def module_alpha(cfg: dict, module: str) -> float:
    """lora_alpha of one module (`model.layers.3.self_attn.q_proj`): the first alpha_pattern key that matches
    the end of its name, as PEFT's get_pattern_key matches it, else the adapter's."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return float(alpha)
    return float(cfg["lora_alpha"])


def load_adapter(request: LoRARequest, model, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read and check an adapter against `model` (engine/model.py LlamaForCausalLM): whole weights, as PEFT saved
    them, whatever share of the model a TP rank holds (LoRAManager cuts its share)."""
    path = request.lora_path
    cfg = read_adapter_config(path)
    tensors = _read_tensors(path)
    config, layers, head_dim = model.config, model.num_layers, model.model.layers[0].self_attn.head_dim
    hidden = config.hidden_size
    inter = getattr(config, "intermediate_size_mlp", None) or config.intermediate_size     # Llama 4's dense width
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    fused_of: dict[tuple[int, str], str] = {}                 # a part that came in a fused module's tensors: its name
    for name, t in tensors.items():
        m = _WEIGHT.search(name)
        if m is None and ".experts." in name:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} adapts the experts of a "
                            f"mixture-of-experts layer, which is not supported (adapters of attention are)")
        if m is None:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} is not a LoRA weight of a "
                            f"supported module ({', '.join(TARGETS)})")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module in _FUSED_TARGETS and layer < layers and t.dim() == 2:
            parts = _FUSED_TARGETS[module]
            sizes = [dims[p][1] for p in parts]
            if which == "B" and t.shape[0] != sum(sizes):
                raise LoRAError(f"LoRA adapter {request.lora_name!r}: layer {layer} {module} has B "
                                f"{tuple(t.shape)}; this model needs B [{sum(sizes)}, r] (was it trained for another "
                                f"base model?)")
            for piece, rows in zip(parts, t.split(sizes) if which == "B" else [t] * len(parts)):
                pairs.setdefault((layer, piece), {})[which] = rows
                fused_of[(layer, piece)] = module
            continue
        if module not in TARGETS or layer >= layers:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} has no place in this model "
                            f"({layers} layers; modules {', '.join(TARGETS)})")
        if m.group(2) != "self_attn" and not hasattr(model.model.layers[layer].mlp, "gate_up_proj"):
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: tensor {name!r} adapts layer {layer}'s MLP, a "
                            f"mixture of experts: adapters of experts are not supported (attention's are)")
        pairs.setdefault((layer, module), {})[which] = t
    if not pairs:
        raise LoRAError(f"LoRA adapter {request.lora_name!r} has no LoRA weights")
    from engine.model import INTERLEAVED_ROPE_MODEL_TYPES
    if config.model_type in INTERLEAVED_ROPE_MODEL_TYPES:     # q and k's rows as the model permuted them at load
        for (_, module), pair in pairs.items():
            if module in ("q_proj", "k_proj") and "B" in pair:
                pair["B"] = model._halves_from_pairs(pair["B"])
    rslora = bool(cfg.get("use_rslora"))
    weights: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: layer {layer} {module} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        k, n = dims[module]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != k or b.shape != (n, r):
            raise LoRAError(f"LoRA adapter {request.lora_name!r}: layer {layer} {module} has A {tuple(a.shape)} "
                            f"and B {tuple(b.shape)}; this model needs A [r, {k}] and B [{n}, r] "
                            f"(was it trained for another base model?)")
        if r > max_rank:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} has rank {r}, above max_lora_rank {max_rank}")
        named = fused_of.get((layer, module), module)        # PEFT's patterns name the module the adapter targets
        alpha = module_alpha(cfg, f"model.layers.{layer}.{'self_attn' if named in _ATTENTION else 'mlp'}.{named}")
        scaling = alpha / (r ** 0.5 if rslora else r)
        fused, part = TARGETS[module]
        weights.setdefault((layer, fused), {})[part] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype))
        rank = max(rank, r)
    return LoRAAdapter(request.lora_name, request.key, rank, weights, path=path)


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    f = _weights_file(path)
    try:
        if f.endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(f)
        return torch.load(f, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise LoRAError(f"LoRA adapter at {path!r} has no {WEIGHTS_FILE}") from None
    except Exception as e:                         # noqa: BLE001 - a truncated or foreign file
        raise LoRAError(f"LoRA adapter at {path!r}: cannot read {os.path.basename(f)} ({type(e).__name__}: {e})") \
            from None


@dataclass
class LoRAStep:
    """The current forward's adapters, read by every LoRALinear: each token's slot and the rows per slot."""
    slots: torch.Tensor | None = None              # [T] int32 (-1: base), None: no adapter in this step
    groups: object = None                          # engine.lora_ops.LoRAPlan: the torch path's batching


class LoRALinear(nn.Module):
    """A Linear (plain, packed or quantized) plus its adapters' products for the rows that have one. Under TP a
    column-parallel Linear adds its output rows' share of the products; a row-parallel one (its input columns
    split) adds its columns' term of them to its own term of the sum, before the all-reduce adds the ranks'."""

    def __init__(self, base: nn.Module, in_features: int, parts: list[int], max_loras: int, max_rank: int,
                 step: LoRAStep, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.step, self.parts, self.rank = base, step, parts, max_rank
        self.row_parallel = hasattr(base, "reduce")         # engine/model.py RowParallelLinear
        n = len(parts)
        self.a = torch.zeros(max_loras, n * max_rank, in_features, dtype=dtype, device=device)
        self.layout = "diagonal"            # the Triton kernels' layout: one block-diagonal B [S, N, n*R]
        if device.type == "cpu" and dtype == torch.float32:
            from engine.lora_ops import cpu_kernel
            if cpu_kernel() is not None:    # engine/lora_cpu.cpp: fp32, one transposed B per part
                self.layout = "cpu"
                self.b = [torch.zeros(max_loras, max_rank, p) for p in parts]
            else:                           # the torch path: float64 stacks (exact products), one B per part
                self.layout = "parts"
                self.a = self.a.double()
                self.b = [torch.zeros(max_loras, p, max_rank, dtype=torch.float64) for p in parts]
        if self.layout == "diagonal":
            self.b = torch.zeros(max_loras, sum(parts), n * max_rank, dtype=dtype, device=device)

    def set_slot(self, slot: int, parts: dict[int, tuple[torch.Tensor, torch.Tensor]] | None) -> None:
        """Write an adapter's A and B into `slot` (zeros where it trains no part: None clears it)."""
        self.a[slot].zero_()
        for b in self.b if isinstance(self.b, list) else [self.b]:
            b[slot].zero_()
        off = np.cumsum([0, *self.parts])
        for i, (a, b) in (parts or {}).items():
            r, R = a.shape[0], self.rank
            self.a[slot, i * R:i * R + r].copy_(a)
            if self.layout == "cpu":
                self.b[i][slot, :r].copy_(b.T)
            elif self.layout == "parts":
                self.b[i][slot, :, :r].copy_(b)
            else:
                self.b[slot, off[i]:off[i + 1], i * R:i * R + r].copy_(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.partial(x) if self.row_parallel else self.base(x)
        if self.step.slots is not None:
            from engine.lora_ops import apply_lora, apply_lora_cpu
            if self.layout == "cpu":
                apply_lora_cpu(x, self.a, self.b, self.step.groups, y)
            else:
                apply_lora(x, self.a, self.b, self.step.slots, y, self.step.groups, self.parts)
        return self.base.reduce(y) if self.row_parallel else y


class LoRAManager:
    """The runner's adapters: the host cache (loaded, checked) and the device slots of the wrapped model.

    Under tensor parallelism every rank has one, and every rank's slot i holds the same adapter: rank 0's
    decides (prepare_step) and tells the workers through `on_load` (engine/executor.py), which read the adapter
    from its path and hold their share of it (load_slot); each step's slots travel with the step's inputs
    (set_step). A rank's share: q/k/v's B rows of its heads, gate/up's of its intermediate units, and o/down's A
    columns of its inputs (their B whole: each rank's term of the delta is summed by the layer's all-reduce)."""

    def __init__(self, model, max_loras: int, max_rank: int, max_cpu_loras: int,
                 dtype: torch.dtype, device: torch.device):
        if not hasattr(model.model.layers[0].self_attn, "qkv_proj"):
            raise ConfigError(f"enable_lora: LoRA adapters of {model.config.model_type}'s multi-head latent attention "
                              f"are not supported")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.max_cpu_loras, self.dtype, self.device = max(max_cpu_loras, max_loras), dtype, device
        self.step = LoRAStep()
        self.cache: OrderedDict[str, LoRAAdapter] = OrderedDict()     # key -> adapter, LRU first
        self.slots: OrderedDict[str, int] = OrderedDict()             # key -> device slot, LRU first
        self.free_slots = list(range(max_loras - 1, -1, -1))
        self.loads = self.evictions = 0
        self._lock = threading.Lock()             # register() runs on request threads, the rest in the step
        self.on_load = None                       # TP rank 0: (slot, adapter) -> the workers load it there too
        self.seq_slots: np.ndarray | None = None  # this step's slot of each sequence (-1: base)
        self.shard = _tp_shard(model)
        self.layers: list[dict[str, LoRALinear]] = []
        for layer in model.model.layers:
            mods = {}
            for fused, n in _PARTS.items():
                if fused.startswith("mlp.") and not hasattr(layer.mlp, "gate_up_proj"):
                    continue                          # a sparse MoE block: adapters reach its attention only
                parent_name, _, attr = fused.rpartition(".")
                parent = layer.get_submodule(parent_name)
                base = getattr(parent, attr)
                parts = self._part_sizes(fused)
                in_features = {"self_attn.qkv_proj": model.config.hidden_size, "mlp.gate_up_proj":
                               model.config.hidden_size, "self_attn.o_proj": layer.self_attn.q_size,
                               "mlp.down_proj": layer.mlp.intermediate}[fused]
                mods[fused] = LoRALinear(base, in_features, parts, max_loras, max_rank, self.step, dtype, device)
                setattr(parent, attr, mods[fused])
            self.layers.append(mods)

    def _part_sizes(self, fused: str) -> list[int]:
        attn, mlp, hidden = self.model.model.layers[0].self_attn, self.model.dense_mlp(), \
            self.model.config.hidden_size
        return {"self_attn.qkv_proj": [attn.q_size, attn.kv_size, attn.kv_size], "self_attn.o_proj": [hidden],
                "mlp.gate_up_proj": [mlp and mlp.intermediate] * 2, "mlp.down_proj": [hidden]}[fused]

    # -- host cache -------------------------------------------------------------------------------
    def register(self, request: LoRARequest) -> LoRAAdapter:
        """A request uses this adapter: load and check it if it is not cached, and hold it until release()."""
        key = request.key
        with self._lock:
            adapter = self.cache.get(key)
        if adapter is None:
            adapter = load_adapter(request, self.model, self.max_rank, self.dtype)    # outside the lock: slow
            log.info("loaded LoRA adapter %r (rank %d, %.1f MiB) from %s", request.lora_name, adapter.rank,
                     adapter.nbytes / 2**20, request.lora_path)
        with self._lock:
            adapter = self.cache.setdefault(key, adapter)
            self.cache.move_to_end(key)
            adapter.refs += 1
            self._trim_cache()
        return adapter

    def release(self, key: str) -> None:
        with self._lock:
            adapter = self.cache.get(key)
            if adapter is not None:
                adapter.refs = max(0, adapter.refs - 1)
                self._trim_cache()

    def _trim_cache(self) -> None:
        idle = [k for k, a in self.cache.items() if a.refs == 0 and k not in self.slots]
        while len(self.cache) > self.max_cpu_loras and idle:
            del self.cache[idle.pop(0)]

    def keys(self) -> list[str]:
        """Keys of the adapters held (host cache), thread-safe."""
        with self._lock:
            return list(self.cache)

    def stats(self) -> dict:
        """Loads into slots, evictions from them, and what is held: adapter key -> (name, in a device slot)."""
        with self._lock:
            held = {k: (a.name, k in self.slots) for k, a in self.cache.items()}
        return {"lora_loads": self.loads, "lora_evictions": self.evictions, "lora_adapters": held}

    # -- device slots -----------------------------------------------------------------------------
    def prepare_step(self, keys: list[str | None], query_lens: np.ndarray) -> None:
        """Slots for this step's sequences (their adapters' keys, None: base), loading what is missing
        into free or least recently used slots, and each token's slot for the wrapped Linears."""
        if all(k is None for k in keys):
            self.clear_step()
            return
        needed = {k for k in keys if k is not None}
        if len(needed) > self.max_loras:
            raise RuntimeError(f"a step with {len(needed)} adapters; max_loras is {self.max_loras}")
        for key in needed:
            if key in self.slots:
                self.slots.move_to_end(key)
                continue
            if not self.free_slots:
                victim = next(k for k in self.slots if k not in needed)
                self.free_slots.append(self.slots.pop(victim))
                self.evictions += 1
            slot = self.free_slots.pop()
            adapter = self.cache[key]
            self._write_slot(slot, adapter)
            if self.on_load is not None:
                self.on_load(slot, adapter)
            self.slots[key] = slot
            self.loads += 1
        self.set_step(np.array([-1 if k is None else self.slots[k] for k in keys], np.int32), query_lens)

    def set_step(self, seq_slots: np.ndarray, query_lens: np.ndarray) -> None:
        """Each token's slot, from its sequence's (-1: base), for the wrapped Linears' next forward."""
        from engine.lora_ops import lora_plan
        self.seq_slots = seq_slots
        tokens = np.repeat(seq_slots, query_lens)
        self.step.slots = torch.from_numpy(tokens).to(self.device)
        self.step.groups = lora_plan(tokens) if self.device.type != "cuda" else None

    def clear_step(self) -> None:
        self.step.slots, self.step.groups, self.seq_slots = None, None, None

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        for i, mods in enumerate(self.layers):
            for fused, m in mods.items():
                parts = adapter.weights.get((i, fused))
                if parts is not None and self.shard is not None:
                    cols, rows = self.shard[fused]
                    parts = {j: (a if cols is None else a.index_select(1, cols),
                                 b if rows is None else b.index_select(0, rows[j])) for j, (a, b) in parts.items()}
                m.set_slot(slot, parts)

    def load_slot(self, slot: int, request: LoRARequest) -> None:
        """A TP worker: rank 0 put this adapter in `slot`; hold this rank's share of it in the same slot (read
        from its path unless the host cache has it)."""
        with self._lock:
            adapter = self.cache.get(request.key)
        if adapter is None:
            adapter = load_adapter(request, self.model, self.max_rank, self.dtype)
        with self._lock:
            adapter = self.cache.setdefault(request.key, adapter)
            self.cache.move_to_end(request.key)
            for key in [k for k, s in self.slots.items() if s == slot]:
                del self.slots[key]
            self.slots[request.key] = slot
            self._trim_cache()
        self._write_slot(slot, adapter)
        self.loads += 1


def _tp_shard(model) -> dict[str, tuple] | None:
    """This TP rank's share of an adapter, by module: (A's input columns or None, each part's B output rows or
    None); None without TP. One layer's heads and units stand for all (engine/model.py splits every layer alike)."""
    if model.tp is None or model.tp.size == 1:
        return None
    attn, mlp = model.model.layers[0].self_attn, model.dense_mlp()

    def rows(heads: range) -> torch.Tensor:
        return (torch.tensor(list(heads))[:, None] * attn.head_dim + torch.arange(attn.head_dim)).flatten()
    q, kv, units = rows(attn.q_heads), rows(attn.kv_heads), torch.tensor(list(mlp.run if mlp else []), dtype=torch.long)
    return {"self_attn.qkv_proj": (None, [q, kv, kv]), "mlp.gate_up_proj": (None, [units, units]),
            "self_attn.o_proj": (q, None), "mlp.down_proj": (units, None)}
