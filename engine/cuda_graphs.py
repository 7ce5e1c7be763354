"""CUDA graphs for decode and verify steps: which batch sizes are captured, how a step is padded to
one, and the capture and replay themselves.

A step where every sequence runs w tokens and samples all of them (a decode, w = 1, or a verify
step of 1 + k tokens: vLLM's "uniform decode") is padded to the next captured batch size and
replayed; prefills and mixed steps run eagerly. Padding rows run w tokens at positions 0..w-1 of
a block the pool never hands out (the padding block), so their K/V land nowhere that matters and
their logits rows are dropped. Everything but capture() and replay runs on CPU too, so tests
compare the padded forward with the unpadded one there.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine.input_batch import StepShape


def batch_buckets(max_num_seqs: int) -> list[int]:
    """Captured batch sizes (vLLM's): 1, 2, 4, then every multiple of 8, up to max_num_seqs (included)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def verify_widths(spec_config) -> list[int]:
    """Query widths of uniform steps: 1 (decode) and 1 + k for every depth the speculative decoder may pick."""
    if spec_config is None:
        return [1]
    return [1 + k for k in range(spec_config.num_speculative_tokens + 1)]


def graph_keys(max_num_seqs: int, widths: list[int], max_tokens: int) -> list[tuple[int, int]]:
    """(batch size, width) of every graph to capture, largest first (later ones reuse its memory pool)."""
    keys = [(b, w) for w in widths for b in batch_buckets(max_num_seqs) if b * w <= max_tokens]
    return sorted(keys, key=lambda k: k[0] * k[1], reverse=True)


def bucket_for(num_seqs: int, width: int, keys: list[tuple[int, int]]) -> int | None:
    """The smallest captured batch size of this width that holds num_seqs sequences, if any."""
    sizes = sorted(b for b, w in keys if w == width)
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def pad_step(shape: StepShape, token_ids: np.ndarray, tables: np.ndarray, size: int, w: int,
             padding_block: int) -> tuple[StepShape, np.ndarray, np.ndarray]:
    """The uniform step of width w grown to `size` sequences with padding rows (see the module's docstring)."""
    extra = size - len(shape.query_lens)
    fill = np.full(extra, w, np.int64)
    padded = StepShape(np.concatenate([shape.starts, np.zeros(extra, np.int64)]),
                       np.concatenate([shape.query_lens, fill]), np.concatenate([shape.num_logits, fill]))
    pad_tables = np.full((extra, tables.shape[1]), padding_block, np.int32)
    return (padded, np.concatenate([token_ids, np.zeros(extra * w, np.int64)]),
            np.concatenate([tables, pad_tables]))


def padding_step(size: int, width: int, max_blocks: int, padding_block: int):
    """A step of padding rows only: what graphs are captured with (their K/V go to the padding block)."""
    empty = StepShape(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    return pad_step(empty, np.zeros(0, np.int64), np.zeros((0, max_blocks), np.int32), size, width, padding_block)


@dataclass
class CapturedGraph:
    graph: "torch.cuda.CUDAGraph"
    logits: torch.Tensor            # the graph's output buffer, rewritten by every replay


def capture(forward: Callable[[], torch.Tensor], pool) -> CapturedGraph:
    """CUDA only: run `forward` once eagerly (Triton compiles, the allocator settles), then record it."""
    forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        logits = forward()
    return CapturedGraph(graph, logits)
