"""ModelRunner: owns the model and the KV cache tensor; turns a scheduled batch into one forward."""
from __future__ import annotations

import logging
import time

import torch

from engine.attention import AttentionMetadata
from engine.config import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_KV_FRACTION, EngineConfig
from engine.errors import ConfigError
from engine.loader import DUMMY_SHAPES, init_dummy_weights, iter_weights
from engine.model import LlamaForCausalLM, can_prepack
from engine.sequence import Sequence

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_path: str, hf_config, max_model_len: int):
        self.config = config
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.hf_config = hf_config
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(self.hf_config, max_positions=max_model_len)
        self.model = model.materialize(self.device, self.dtype).eval()
        if config.load_format == "dummy" or model_path in DUMMY_SHAPES:
            init_dummy_weights(self.model, config.seed)
        else:
            self.model.load_weights(iter_weights(model_path))
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        if can_prepack(self.device, self.dtype):
            self.model.prepack_linears()
        self.load_seconds = time.perf_counter() - t0
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        self.kv_cache = torch.zeros(self.kv_shape(self.num_blocks), dtype=self.dtype, device=self.device)

    # -- KV cache ---------------------------------------------------------------------------------
    def kv_shape(self, num_blocks: int) -> tuple[int, ...]:
        m = self.model
        return (num_blocks, m.num_layers, 2, self.block_size, m.num_kv_heads, m.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: K and V for every layer, contiguous (one transfer descriptor)."""
        n = 1
        for d in self.kv_shape(1):
            n *= d
        return n * torch.finfo(self.dtype).bits // 8

    def weight_fingerprint(self) -> str:
        """A cheap content hash of the weights (a few embedding rows): same checkpoint, same key,
        wherever it was loaded from."""
        import hashlib
        rows = self.model.model.embed_tokens.weight[:8].detach().float().cpu().numpy().tobytes()
        return hashlib.blake2b(rows, digest_size=8).hexdigest()

    def _num_blocks(self) -> int:
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        mem = c.kv_cache_memory
        if mem is None:
            mem = DEFAULT_GPU_KV_FRACTION if self.device.type == "cuda" else DEFAULT_CPU_KV_BYTES
        if isinstance(mem, float):
            mem = int(self._available_memory() * mem)
        blocks = int(mem) // self.block_bytes
        if blocks < 1:
            raise ConfigError(f"kv_cache_memory {mem} bytes is less than one block ({self.block_bytes} bytes)")
        return blocks

    def _available_memory(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return free
        import os
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

    # -- one forward ------------------------------------------------------------------------------
    def execute(self, scheduled: list[tuple[Sequence, int]]) -> tuple[torch.Tensor, list[Sequence]]:
        """Run the model over the scheduled tokens; logits for sequences that now sample.

        A sequence's tokens are its token_ids followed by its draft tokens (seq.spec_tokens). One that
        reaches its end samples: a plain one gets one logits row, a speculating one gets 1 + k rows
        (the target's distribution after each of its last token and k drafts), in batch order.
        """
        items, samplers = [], []
        for seq, n in scheduled:
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start:start + n]
            spec = seq.spec_tokens
            if start + n > seq.num_tokens:                  # a verify step: last token + drafts
                tokens = tokens + spec[:start + n - seq.num_tokens]
            done = start + n == seq.num_tokens + len(spec)
            items.append((tokens, start, seq.block_table, (1 + len(spec)) if done else 0))
            if done:
                samplers.append(seq)
        return self.forward_batch(items), samplers

    def forward_batch(self, items: list[tuple[list[int], int, list[int], int]],
                      num_layers: int | None = None) -> torch.Tensor:
        """items: (new tokens, position of the first, block table, how many trailing rows want logits).

        Writes the tokens' K/V to the cache at their slots and returns the requested logits rows
        [sum of rows, vocab] in order. `num_layers` runs only the first layers (layer-skip drafts).
        """
        input_ids, positions, slots, qlens, slens, logit_rows = [], [], [], [], [], []
        bs = self.block_size
        for tokens, start, bt, n_logits in items:
            n = len(tokens)
            end = start + n
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            slots.extend(bt[p // bs] * bs + p % bs for p in range(start, end))
            qlens.append(n)
            slens.append(end)
            logit_rows.extend(range(len(input_ids) - n_logits, len(input_ids)))
        max_blocks = max(len(bt) for _, _, bt, _ in items)
        tables = torch.zeros((len(items), max_blocks), dtype=torch.int32)
        for i, (_, _, bt, _) in enumerate(items):
            tables[i, :len(bt)] = torch.tensor(bt, dtype=torch.int32)
        qsl = [0]
        for n in qlens:
            qsl.append(qsl[-1] + n)
        dev = self.device
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=tables.to(dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(qlens), max_seq_len=max(slens),
            seq_lens_list=slens, query_lens_list=qlens)
        return self.model(torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev),
                          self.kv_cache, md, torch.tensor(logit_rows, dtype=torch.int64, device=dev),
                          num_layers=num_layers)
