"""ModelRunner: owns the model, the KV cache tensor, the step's persistent inputs and the CUDA graphs;
turns a scheduled batch into one forward."""
from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Callable, ContextManager

import numpy as np
import torch

from engine.block_pool import blocks_for
from engine.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, EngineConfig
from engine.cuda_graphs import CapturedGraph, bucket_for, capture, graph_keys, pad_step, padding_step, verify_widths
from engine.errors import ConfigError
from engine.kv_layout import KVCacheSpec
from engine.input_batch import InputBatch, SequenceRows, StepInputs, StepShape, items_shape
from engine.loader import (DUMMY_SHAPES, gguf_source, init_dummy_weights, iter_block_fp8_weights, iter_gguf_weights,
                           iter_hf_quant_weights, iter_weights, names_gguf, shard_weights)
from engine.model import LlamaForCausalLM, can_prepack
from engine.parallel import TPGroup
from engine.pooling import pool_positions
from engine.quant import fp8_block_size, hf_quant_method, resolve_quantization
from engine.sequence import Sequence

log = logging.getLogger(__name__)


# -- one checkpoint's weights, shared by the engines of a process ------------------------------------------------
# Engines in one process that load the same checkpoint with the same options (dtype, device, quantization) share
# its weights, read-only, as llama.cpp's processes share a model file's mapped pages: a second engine built while
# the first lives (a draft equal to its target, a notebook re-creating its LLM, a test suite's engines) neither
# reads nor repacks them again, nor holds a second copy. Each engine gets its own module tree (LoRA wraps
# its own linears; the C++ forward binds its own KV cache) over the same tensors. The weights are freed when the
# last engine holding them is. Changing a weight in place changes it for every engine that shares it.
_SHARED: "weakref.WeakValueDictionary[tuple, SharedWeights]" = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


class SharedWeights:
    """A loaded model before any engine ran it: the module tree each sharing engine copies."""

    def __init__(self, model: LlamaForCausalLM, weight_bytes: int):
        self.template, self.weight_bytes = own_tree(model), weight_bytes

    def model(self, max_positions: int) -> LlamaForCausalLM:
        model = own_tree(self.template)
        model.cover_positions(max_positions)               # its own rotary tables: not weights
        model.shared_weights = self                        # held while this engine's model lives
        return model


def own_tree(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of a module tree with module objects and attribute dicts of its own and the same tensors."""
    copy = object.__new__(type(module))
    copy.__dict__ = dict(module.__dict__)
    copy._modules = {k: None if m is None else own_tree(m) for k, m in module._modules.items()}
    copy._parameters, copy._buffers = dict(module._parameters), dict(module._buffers)
    return copy


def weights_key(model_path: str, gguf, hf_config, device: torch.device, dtype: torch.dtype,
                quantization: str) -> tuple | None:
    """What the loaded weights depend on: the files read (path, size, modification time), the config, where and
    how they are held, and the layouts this process packs them in (oneDNN's, the C++ kernel's: switches a test or
    an operator may turn off, BATON_CPU_PACKED and BATON_CPU_KERNEL)."""
    from pathlib import Path

    from engine.model import _quant_kernels
    files = [Path(gguf)] if gguf is not None else sorted(Path(model_path).glob("*.safetensors"))
    try:
        stamps = tuple((str(f.resolve()), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
    except OSError:
        return None
    kernel = device.type == "cpu" and quantization != "none" and _quant_kernels() is not None
    return (stamps, hf_config.to_json_string(), str(device), str(dtype), quantization, can_prepack(device, dtype),
            kernel)


def loaded_weights(key: tuple | None) -> SharedWeights | None:
    if key is None:
        return None
    with _SHARED_LOCK:
        return _SHARED.get(key)


def remember_weights(key: tuple, model: LlamaForCausalLM, weight_bytes: int) -> None:
    shared = SharedWeights(model, weight_bytes)
    model.shared_weights = shared
    with _SHARED_LOCK:
        _SHARED.setdefault(key, shared)


class ModelRunner:
    """Built with the weights only; allocate_kv() then sizes the cache (see allocate_kv_caches).

    With tensor parallelism (`tp`) it holds one rank's shard of the model and of the KV cache (same
    block ids on every rank); rank 0's `on_step` sends each forward's inputs to the other ranks
    (engine/executor.py), which run the same forward_step so the model's collectives line up.
    """

    def __init__(self, config: EngineConfig, model_path: str, hf_config, max_model_len: int,
                 tp: TPGroup | None = None, device: torch.device | None = None):
        self.config = config
        self.device, self.dtype = device or config.torch_device, config.torch_dtype
        self.hf_config = hf_config
        self.tp = tp
        self.on_step: Callable[[StepShape, np.ndarray, np.ndarray, int | None], ContextManager] | None = None
        t0 = time.perf_counter()
        dummy = config.load_format == "dummy" or model_path in DUMMY_SHAPES
        gguf = None if dummy else gguf_source(model_path)
        quant_config = getattr(hf_config, "quantization_config", None)
        hf_method = None if dummy else hf_quant_method(quant_config)
        self.quantization = resolve_quantization(config.quantization, gguf, names_gguf(config.model), self.device,
                                                 hf_method)
        key = None if dummy or tp is not None or not self.shareable else weights_key(
            model_path, gguf if self.quantization == "gguf" else None, hf_config, self.device, self.dtype,
            self.quantization)
        shared = loaded_weights(key)
        if shared is not None:                              # another engine of this process loaded the same
            self.model, self.weight_bytes = shared.model(max_model_len), shared.weight_bytes
            log.info("weights of %s: shared with another engine in this process", model_path)
        else:
            self._load(model_path, hf_config, max_model_len, tp, dummy, gguf, hf_method, quant_config)
            if key is not None:
                remember_weights(key, self.model, self.weight_bytes)
        self.lora = None                                    # engine/lora.py LoRAManager (enable_lora)
        if config.enable_lora:
            from engine.lora import LoRAManager
            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras or config.max_loras, self.dtype, self.device)
        self.load_seconds = time.perf_counter() - t0
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.num_blocks = 0
        self.host_kv: torch.Tensor | None = None           # the host tier (allocate_host_kv)
        self.graph_keys: list[tuple[int, int]] = []        # (batch size, query width) of the graphs to replay
        self._graphs: dict[tuple[int, int], CapturedGraph] = {}

    shareable = True          # engines of one process may share these weights (a draft head's are its own)

    def new_model(self, hf_config, max_model_len: int, tp: TPGroup | None) -> LlamaForCausalLM:
        """The module the checkpoint loads into (on the meta device)."""
        return LlamaForCausalLM(hf_config, max_positions=max_model_len, tp=tp,
                                expert_parallel=self.config.enable_expert_parallel)

    def checkpoint_tensors(self, weights):
        """The checkpoint's tensors as the model takes them (a draft head renames its own)."""
        return weights

    keep: Callable[[str], bool] | None = None      # tensors of the checkpoint to read (None: all)

    def _load(self, model_path, hf_config, max_model_len, tp, dummy, gguf, hf_method, quant_config) -> None:
        with torch.device("meta"):
            model = self.new_model(hf_config, max_model_len, tp)
        self.model = model.materialize(self.device, self.dtype).eval()
        shard, keep = self.model.weight_shard, self.keep
        if dummy:
            init_dummy_weights(self.model, self.config.seed)
        elif self.quantization == "gguf":
            self.model.load_weights(self.checkpoint_tensors(shard_weights(iter_gguf_weights(gguf, hf_config), shard)))
        elif hf_method is not None:
            self.model.load_weights(self.checkpoint_tensors(shard_weights(
                iter_hf_quant_weights(model_path, quant_config, self.quantization == "none", keep), shard)))
        elif fp8_block_size(quant_config) is not None:      # block-scaled FP8: dequantized, then this rank's share
            log.warning("%s holds block-wise FP8 weights: they run dequantized to %s (no block-scaled FP8 GEMM here "
                        "yet), twice the checkpoint's bytes in bf16", model_path, self.dtype)
            self.model.load_weights(self.checkpoint_tensors(shard_weights(
                iter_block_fp8_weights(model_path, fp8_block_size(quant_config), keep), shard)))
        else:
            self.model.load_weights(self.checkpoint_tensors(iter_weights(model_path, shard, keep)))
        if hf_method is None and self.quantization in ("int8", "fp8"):   # a float checkpoint quantized at load
            self.model.quantize_linears(self.quantization)
        if can_prepack(self.device, self.dtype):
            self.model.prepack_linears()
        self.weight_bytes = self.model.weight_bytes()       # after prepacking: a tied head gets its own copy there

    def allocate_kv(self, num_blocks: int) -> None:
        """The KV cache, the step buffers and (on CUDA, unless enforce_eager) the CUDA graphs."""
        self.num_blocks = num_blocks
        # One block more than the pool's: the padding block of CUDA-graph padding rows. The model
        # gets all of them; the pool and the transports see only the first num_blocks (kv_cache).
        self.kv_blocks = self.kv_spec.allocate(num_blocks + 1, self.device)
        self.kv_cache = self.kv_blocks[:num_blocks]
        self.kv_layers = self.kv_spec.layers(self.kv_blocks)          # what the model's layers read and write
        self.padding_block = num_blocks
        c, max_blocks = self.config, blocks_for(self.max_model_len, self.block_size)
        self.inputs = InputBatch(c.max_num_batched_tokens, c.max_num_seqs, max_blocks, self.block_size, self.device)
        self.rows = SequenceRows(c.max_num_seqs, self.max_model_len, max_blocks)
        if self.device.type == "cuda" and self.tp is None:   # TP > 1 runs eagerly (collectives not captured)
            self.graph_keys = self.graph_plan()
            self.capture_graphs()

    def allocate_host_kv(self, num_blocks: int) -> None:
        """The host tier's cache: the same layout in host memory (pinned on CUDA, so copies are async)."""
        self.host_kv = None
        if num_blocks > 0:
            self.host_kv = self.kv_spec.allocate(num_blocks, torch.device("cpu"), pin_memory=self.device.type == "cuda")

    def host_block_count(self) -> int:
        """Host-tier blocks of this rank's share of kv_offloading_size (GiB, summed over the TP ranks)."""
        size = self.config.kv_offloading_size if self.config.enable_prefix_caching else 0
        ranks = 1 if self.tp is None else self.tp.size
        return int(size * 2**30 / ranks) // self.block_bytes if size else 0

    def copy_blocks(self, copies: list[tuple[str, int, int]]) -> None:
        """Run host-tier copies in order: ("out", device block, host block), ("in", host block, device
        block). On CUDA they are queued on the compute stream, ahead of the next forward that reads or
        overwrites the blocks (non-blocking: from and to pinned memory)."""
        for kind, src, dst in copies:
            if kind == "out":
                self.host_kv[dst].copy_(self.kv_cache[src], non_blocking=True)
            else:
                self.kv_cache[dst].copy_(self.host_kv[src], non_blocking=True)

    # -- KV cache ---------------------------------------------------------------------------------
    @property
    def kv_spec(self) -> KVCacheSpec:
        """This rank's cache: its KV heads, the model's layers and head size, the block size and kv_cache_dtype."""
        m = self.model
        return KVCacheSpec(m.num_kv_heads, m.num_layers, self.block_size, m.head_dim, self.dtype,
                           self.config.kv_cache_dtype, m.kv_parts)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V for every layer (and a quantized cache's scales), contiguous (one transfer
        descriptor)."""
        return self.kv_spec.block_bytes

    def weight_fingerprint(self) -> str:
        """A cheap content hash of the weights (a few embedding rows): same checkpoint, same key,
        wherever it was loaded from."""
        import hashlib
        rows = self.model.embedding_rows(8).detach().float().cpu().numpy().tobytes()
        return hashlib.blake2b(rows, digest_size=8).hexdigest()

    def kv_budget(self) -> int:
        """Bytes for every KV cache of this engine (the target's and a draft model's): kv_cache_memory,
        a fraction of it taken of what is free now, after all weights are loaded."""
        mem = self.config.kv_cache_memory
        if mem is None:
            mem = DEFAULT_GPU_KV_FRACTION if self.device.type == "cuda" else DEFAULT_CPU_KV_BYTES
        if isinstance(mem, float):
            mem = int(self._available_memory() * mem)
        return int(mem)

    def _available_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


    # -- CUDA graphs ------------------------------------------------------------------------------
    def graph_plan(self) -> list[tuple[int, int]]:
        """(batch size, query width) of the graphs this config captures on CUDA; none with enforce_eager."""
        c = self.config
        if c.enforce_eager:
            return []
        if self.model.has_moe:               # until a GPU run has captured the fused MoE kernel (engine/moe_ops.py)
            log.info("a mixture-of-experts model runs eagerly: no CUDA graphs")
            return []
        return graph_keys(c.max_num_seqs, verify_widths(c.speculative_config), c.max_num_batched_tokens)

    @property
    def graph_sizes(self) -> list[tuple[int, int]]:
        """The graphs captured (batch size, query width): empty on CPU and with enforce_eager."""
        return list(self._graphs)

    def capture_graphs(self) -> None:
        """Capture every planned graph on a step of padding rows, largest first (CUDA; tests on CPU
        stand a replay-by-rerun in for engine.cuda_graphs.capture)."""
        t0, pool = time.perf_counter(), torch.cuda.graph_pool_handle()
        for size, width in self.graph_keys:
            shape, ids, tables = padding_step(size, width, self.inputs.max_blocks, self.padding_block)
            self.inputs.stage(shape, ids, tables)
            x = self.inputs.to_device(shape)
            self._graphs[(size, width)] = capture(lambda x=x: self._model(x), pool)
        log.info("captured %d CUDA graphs in %.1f s", len(self._graphs), time.perf_counter() - t0)

    # -- one forward ------------------------------------------------------------------------------
    def execute(self, scheduled: list[tuple[Sequence, int]], capture: bool = False
                ) -> tuple[torch.Tensor, list, list, list, list]:
        """Run the model over the scheduled tokens; logits for sequences that now sample, and for prompt
        chunks that want prompt logprobs. Returns the logits, the samplers (sequence, first row) and the
        prompt chunks (sequence, first row, first position, rows): SequenceRows.prepare; the final hidden
        states each embedding request pools this step: (sequence, rows) (engine/pooling.py); and with `capture`
        (a draft head reads them: engine/spec/head.py), every other sequence's final hidden states:
        (sequence, the position of its first row, rows).

        A sequence's tokens are its token_ids followed by its draft tokens (seq.spec_tokens). One that
        reaches its end samples: a plain one gets one logits row, a speculating one gets 1 + k rows
        (the target's distribution after each of its last token and k drafts), in batch order.
        The logits are valid until the next forward (a replayed graph rewrites its output).
        """
        shape, ids, tables, samplers, prompt_rows = self.rows.prepare(scheduled)
        if self.lora is not None:                           # each token's adapter slot, loading what is missing
            self.lora.prepare_step([seq.lora_key for seq, _ in scheduled], shape.query_lens)
        owners, flat = pooled_rows(scheduled)
        captured, at = [], 0
        for seq, q in scheduled if capture else ():
            if seq.pooling is None:
                captured.append((seq, seq.num_computed_tokens, len(flat), len(flat) + q))
                flat.extend(range(at, at + q))
            at += q
        if not flat:
            return self.forward_step(shape, ids, tables), samplers, prompt_rows, [], []
        logits, hidden, *aux = self.forward_step(shape, ids, tables, hidden=flat)
        drafted = aux[0] if aux else hidden                 # an EAGLE-3 head reads layers' streams, others the last
        return logits, samplers, prompt_rows, [(seq, hidden[a:b]) for seq, a, b in owners], \
            [(seq, first, drafted[a:b]) for seq, first, a, b in captured]

    def release(self, request_id: str) -> None:
        """The sequence finished, was aborted or preempted: free its rows of the persistent tables."""
        self.rows.release(request_id)

    def forward_batch(self, items: list[tuple[list[int], int, list[int], int]],
                      num_layers: int | None = None) -> torch.Tensor:
        """items: (new tokens, position of the first, block table, how many trailing rows want logits).

        Writes the tokens' K/V to the cache at their slots and returns the requested logits rows
        [sum of rows, vocab] in order. `num_layers` runs only the first layers (layer-skip drafts).
        It runs the base model: a layer-skip draft of a LoRA request is a base draft (the verify step,
        with the adapter, keeps the output exact).
        """
        if self.lora is not None:
            self.lora.clear_step()
        return self.forward_step(*items_shape(items, self.block_size), num_layers=num_layers)

    def forward_step(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray,
                     num_layers: int | None = None, hidden: list[int] | None = None):
        """A uniform step of the whole model replays a graph (padded); anything else runs eagerly.
        Returns the logits rows (None on TP ranks other than 0); given `hidden` (token rows whose final hidden
        states are pooled), (logits, those hidden states), from an eager forward. The TP workers' forwards need
        no rows: the hidden states after the last norm are whole on every rank."""
        if self.on_step is None:
            return self._forward(shape, ids, tables, num_layers, hidden)
        with self.on_step(shape, ids, tables, num_layers):     # TP rank 0: the workers run this step too
            return self._forward(shape, ids, tables, num_layers, hidden)

    def _forward(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray,
                 num_layers: int | None, hidden: list[int] | None = None):
        lora = self.lora is not None and self.lora.step.slots is not None     # an adapter step runs eagerly
        eager = lora or hidden is not None
        width = shape.uniform_width() if num_layers is None and self.graph_keys and not eager else None
        size = bucket_for(len(shape.query_lens), width, self.graph_keys) if width else None
        if size is not None and tables.shape[1] <= self.inputs.max_blocks:
            return self.forward_padded(shape, ids, tables, size)
        rows = None if hidden is None else torch.tensor(hidden, dtype=torch.long).to(self.device, non_blocking=True)
        return self._model(self.stage(shape, ids, tables), num_layers, rows)

    def stage(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray) -> StepInputs:
        """A step's inputs on the device, in the step buffers (or, larger than a step: profiling, a draft's
        catch-up, buffers for this call only)."""
        batch = self.inputs
        if not batch.fits(len(ids), len(shape.query_lens), tables.shape[1]):
            batch = InputBatch(len(ids), len(shape.query_lens), tables.shape[1], self.block_size, self.device,
                               pin=False)
        batch.stage(shape, ids, tables)
        return batch.to_device(shape)

    def forward_padded(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray, size: int) -> torch.Tensor:
        """A uniform step padded to `size` sequences: its graph replayed on CUDA, the padded batch run
        eagerly where there is none (CPU, tests). Returns the real rows' logits."""
        width = int(shape.query_lens[0])
        padded = pad_step(shape, ids, tables, size, width, self.padding_block)
        self.inputs.stage(*padded)
        x = self.inputs.to_device(padded[0])
        graph = self._graphs.get((size, width))
        if graph is None:
            return self._model(x)[:shape.num_tokens]
        graph.graph.replay()
        return graph.logits[:shape.num_tokens]

    aux_layers: tuple[int, ...] | None = None      # layers whose input streams an EAGLE-3 head reads

    def _model(self, x: StepInputs, num_layers: int | None = None, hidden_indices: torch.Tensor | None = None):
        return self.model(x.input_ids, x.positions, self.kv_layers, x.md, x.logits_indices, num_layers=num_layers,
                          hidden_indices=hidden_indices, aux_layers=self.aux_layers)


def pooled_rows(scheduled: list) -> tuple[list[tuple[Sequence, int, int]], list[int]]:
    """The token rows of a step whose hidden states its embedding requests pool (engine.pooling.pool_positions
    of each one's chunk): (sequence, its first and end index into those rows), and the rows in the step's flat
    token order."""
    owners, flat, at = [], [], 0
    for seq, q in scheduled:
        if seq.pooling is not None:
            start = seq.num_computed_tokens
            positions = pool_positions(seq.pool_kind, start, q, seq.num_prompt_tokens)
            if len(positions):
                owners.append((seq, len(flat), len(flat) + len(positions)))
                flat.extend(at + p - start for p in positions)
        at += q
    return owners, flat


def plan_kv_blocks(config: EngineConfig, budget: int, block_bytes: int,
                   draft_block_bytes: int | None = None) -> tuple[int, int | None]:
    """Blocks of the target's KV cache and of a draft model's (None without one) in `budget` bytes.

    The draft's weights are loaded before this runs, so a fraction of free memory already leaves
    them out; the cache memory is then split so both caches hold the same number of tokens (a
    draft can follow every sequence the target holds), or the draft takes draft_kv_blocks and the
    target the rest. num_kv_blocks sets the target's count outright (and the draft's by default).
    """
    spec = config.speculative_config
    fixed = spec.draft_kv_blocks if spec is not None and draft_block_bytes is not None else None
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks, (fixed or config.num_kv_blocks) if draft_block_bytes else None
    if draft_block_bytes is None:
        target, draft = budget // block_bytes, None
    elif fixed is not None:
        target, draft = (budget - fixed * draft_block_bytes) // block_bytes, fixed
    else:
        target = draft = budget // (block_bytes + draft_block_bytes)
    if target < 1:
        need = block_bytes + (draft_block_bytes or 0) * (1 if fixed is None else fixed)
        with_draft = " with the draft model's" if draft_block_bytes else ""
        raise ConfigError(f"kv_cache_memory {budget} bytes is less than one block ({need} bytes{with_draft})")
    return target, draft


def allocate_kv_caches(target: ModelRunner, draft: ModelRunner | None = None) -> None:
    """Size and allocate the target's KV cache and a draft model's from one budget (plan_kv_blocks)."""
    blocks, draft_blocks = plan_kv_blocks(target.config, target.kv_budget(), target.block_bytes,
                                          draft.block_bytes if draft is not None else None)
    target.allocate_kv(blocks)
    target.allocate_host_kv(target.host_block_count())
    if draft is not None:
        draft.allocate_kv(draft_blocks)
