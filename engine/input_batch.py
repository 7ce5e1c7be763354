"""The step's inputs in persistent buffers: per-sequence rows of token ids and block ids, and the
flat arrays of one forward (ids, positions, slots, lengths, logits rows) built with numpy, no
per-token Python loop, then copied to the device once per buffer without blocking.

Host buffers are numpy views of torch tensors (pinned on CUDA, so the copy is asynchronous); the
device buffers have fixed addresses, so a CUDA graph captured on them replays with new contents.
On CPU the host buffers are the model's inputs (no copy).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.block_pool import blocks_for


@dataclass
class StagedBuffer:
    """One input: a host tensor, its numpy view, and the device tensor it is copied to."""
    host: torch.Tensor
    np: np.ndarray
    device: torch.Tensor

    @classmethod
    def make(cls, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             pin: bool = True) -> "StagedBuffer":
        on_cuda = device.type == "cuda"
        host = torch.zeros(shape, dtype=dtype, pin_memory=on_cuda and pin)
        return cls(host, host.numpy(), torch.zeros(shape, dtype=dtype, device=device) if on_cuda else host)

    def to_device(self, n: int) -> torch.Tensor:
        """The first n rows on the device (views from row 0: the same addresses every step)."""
        if self.device is not self.host:
            self.device[:n].copy_(self.host[:n], non_blocking=True)
        return self.device[:n]


@dataclass
class StepShape:
    """One forward, sequence by sequence: first position, new tokens, trailing rows that want logits."""
    starts: np.ndarray
    query_lens: np.ndarray
    num_logits: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.query_lens.sum())

    @cached_property
    def flat(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(query_start_loc [B + 1], the sequence of each token, the position of each token)."""
        qsl = np.zeros(len(self.query_lens) + 1, np.int64)
        np.cumsum(self.query_lens, out=qsl[1:])
        owner = np.repeat(np.arange(len(self.query_lens)), self.query_lens)
        pos = np.arange(int(qsl[-1])) + np.repeat(self.starts - qsl[:-1], self.query_lens)
        return qsl, owner, pos

    def uniform_width(self) -> int | None:
        """w if every sequence runs w tokens and wants logits at all of them (a decode or verify
        step, vLLM's uniform decode; the batches CUDA graphs serve), else None."""
        w = int(self.query_lens[0]) if len(self.query_lens) else 0
        same = w > 0 and (self.query_lens == w).all() and (self.num_logits == w).all()
        return w if same else None


@dataclass
class StepInputs:
    """What the model takes for one forward, on the device."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    md: AttentionMetadata


class InputBatch:
    """Flat step buffers sized for max_tokens tokens of max_seqs sequences."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, block_size: int, device: torch.device,
                 pin: bool = True):
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        self.block_size = block_size

        def buf(shape, dtype=torch.int64):
            return StagedBuffer.make(shape, dtype, device, pin)
        self.input_ids, self.positions = buf((max_tokens,)), buf((max_tokens,))
        self.slot_mapping, self.logits_indices = buf((max_tokens,)), buf((max_tokens,))
        self.seq_lens, self.query_start_loc = buf((max_seqs,), torch.int32), buf((max_seqs + 1,), torch.int32)
        self.block_tables = buf((max_seqs, max_blocks), torch.int32)
        # set after the host->device copies: the host buffers are rewritten only once they are done
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fits(self, num_tokens: int, num_seqs: int, num_blocks: int) -> bool:
        return num_tokens <= self.max_tokens and num_seqs <= self.max_seqs and num_blocks <= self.max_blocks

    def stage(self, shape: StepShape, token_ids: np.ndarray, tables: np.ndarray) -> None:
        """Fill the host buffers: `token_ids` are the step's new tokens in order, `tables` its
        sequences' block tables [num_seqs, >= blocks used] (rows past a table's end are not read)."""
        if self._copied is not None:
            self._copied.synchronize()
        b, t = len(shape.query_lens), len(token_ids)
        qsl, owner, pos = shape.flat
        self.query_start_loc.np[:b + 1] = qsl
        bs = self.block_size
        self.input_ids.np[:t] = token_ids
        self.positions.np[:t] = pos
        self.slot_mapping.np[:t] = tables[owner, pos // bs].astype(np.int64) * bs + pos % bs
        self.seq_lens.np[:b] = shape.starts + shape.query_lens
        width = min(tables.shape[1], self.max_blocks)
        self.block_tables.np[:b, :width] = tables[:, :width]
        nl = shape.num_logits
        first = np.repeat(qsl[1:] - nl, nl)                          # each sequence's first logits row
        self.logits_indices.np[:int(nl.sum())] = first + np.arange(first.size) - np.repeat(np.cumsum(nl) - nl, nl)

    def to_device(self, shape: StepShape) -> StepInputs:
        """Copy what stage() filled (one non-blocking copy per buffer) and describe it for the model."""
        b, t = len(shape.query_lens), shape.num_tokens
        seq_lens = shape.starts + shape.query_lens
        md = AttentionMetadata(
            slot_mapping=self.slot_mapping.to_device(t), block_tables=self.block_tables.to_device(b),
            seq_lens=self.seq_lens.to_device(b), query_start_loc=self.query_start_loc.to_device(b + 1),
            max_query_len=int(shape.query_lens.max()), max_seq_len=int(seq_lens.max()),
            seq_lens_list=seq_lens.tolist(), query_lens_list=shape.query_lens.tolist())
        out = StepInputs(self.input_ids.to_device(t), self.positions.to_device(t),
                         self.logits_indices.to_device(int(shape.num_logits.sum())), md)
        if self._copied is not None:
            self._copied.record()
        return out


@dataclass
class _Row:
    index: int
    num_tokens: int = 0        # token ids written (a sequence's tokens only ever append)
    num_blocks: int = 0        # block ids written
    epoch: int = -1            # the sequence's block_table_epoch when its blocks were written


@dataclass
class SequenceRows:
    """Each running sequence's row of a token-id table [rows, max_model_len] and a block table
    [rows, max_blocks], kept across steps: a step writes only what changed (new tokens, drafts,
    new blocks; the whole block row after the KV cache manager removed or replaced blocks)."""
    max_rows: int
    max_model_len: int
    max_blocks: int
    token_ids: np.ndarray = field(init=False)
    block_table: np.ndarray = field(init=False)
    rows: dict[str, _Row] = field(default_factory=dict)
    free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.token_ids = np.zeros((self.max_rows, self.max_model_len), np.int64)
        self.block_table = np.zeros((self.max_rows, self.max_blocks), np.int32)
        self.free = list(range(self.max_rows - 1, -1, -1))

    def prepare(self, scheduled: list) -> tuple[StepShape, np.ndarray, np.ndarray, list, list]:
        """A scheduled step [(sequence, new tokens)]: its shape, token ids, block tables, the sequences that
        sample with their first logits row (those that reach their end: 1 + k rows with k drafts), and the
        prompt chunks whose every row gives logits for prompt logprobs: (sequence, first row, first position,
        rows). Such a chunk's last row is also its sampling row when it ends the prompt."""
        n = len(scheduled)
        rows, starts, qlens, nlogits = (np.empty(n, np.int64) for _ in range(4))
        samplers, prompt_rows, at = [], [], 0
        for i, (seq, q) in enumerate(scheduled):
            rows[i] = self.sync(seq)
            k, start = len(seq.spec_tokens), seq.num_computed_tokens
            done = start + q == seq.num_tokens + k
            starts[i], qlens[i], nlogits[i] = start, q, (1 + k) if done else 0
            if seq.wants_prompt_logprobs and start < seq.num_prompt_tokens - 1:
                nlogits[i] = q
                prompt_rows.append((seq, at, start, q))
            if done:
                samplers.append((seq, at + int(nlogits[i]) - 1 - k))
            at += int(nlogits[i])
        shape = StepShape(starts, qlens, nlogits)
        _, owner, pos = shape.flat
        return shape, self.token_ids[rows[owner], pos], self.block_table[rows], samplers, prompt_rows

    def sync(self, seq) -> int:
        """The row of `seq`, brought up to date (tokens, drafts at their positions, blocks)."""
        row = self.rows.get(seq.request_id) or self._take(seq.request_id)
        r, n = row.index, seq.num_tokens
        if n > row.num_tokens:
            self.token_ids[r, row.num_tokens:n] = seq.token_ids[row.num_tokens:]
            row.num_tokens = n
        if seq.spec_tokens:
            self.token_ids[r, n:n + len(seq.spec_tokens)] = seq.spec_tokens
        bt = seq.block_table
        if seq.block_table_epoch != row.epoch or len(bt) < row.num_blocks:
            row.num_blocks, row.epoch = 0, seq.block_table_epoch
        if len(bt) > row.num_blocks:
            self.block_table[r, row.num_blocks:len(bt)] = bt[row.num_blocks:]
            row.num_blocks = len(bt)
        return r

    def release(self, request_id: str) -> None:
        """The sequence finished, was aborted or preempted: its row is free (rewritten on reuse)."""
        row = self.rows.pop(request_id, None)
        if row is not None:
            self.free.append(row.index)

    def _take(self, request_id: str) -> _Row:
        if not self.free:                  # more live sequences than max_num_seqs (a missed release)
            grow = self.max_rows
            self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
            self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
            self.free = list(range(self.max_rows + grow - 1, self.max_rows - 1, -1))
            self.max_rows += grow
        row = self.rows[request_id] = _Row(self.free.pop())
        return row


def items_shape(items: list[tuple[list[int], int, list[int], int]],
                block_size: int) -> tuple[StepShape, np.ndarray, np.ndarray]:
    """Ad-hoc items (new tokens, first position, block table, logits rows), as the spec proposers
    and profiling pass them: their shape, token ids and a block-table array."""
    qlens = np.fromiter((len(t) for t, _, _, _ in items), np.int64, len(items))
    shape = StepShape(np.fromiter((s for _, s, _, _ in items), np.int64, len(items)), qlens,
                      np.fromiter((n for _, _, _, n in items), np.int64, len(items)))
    width = max(blocks_for(int((shape.starts + qlens).max()), block_size), max(len(bt) for _, _, bt, _ in items))
    tables = np.zeros((len(items), width), np.int32)
    for i, (_, _, bt, _) in enumerate(items):
        tables[i, :len(bt)] = bt
    ids = np.fromiter(itertools.chain.from_iterable(t for t, _, _, _ in items), np.int64, int(qlens.sum()))
    return shape, ids, tables
