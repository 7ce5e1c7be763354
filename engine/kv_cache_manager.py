"""KVCacheManager: the one owner of every sequence's block table (vLLM v1's KVCacheManager, nano-vllm's BlockManager).

It allocates slots for new tokens, frees, trims after a speculation rollback, looks up (and undoes)
prefix-cache hits, registers newly full blocks in the prefix cache, reserves a prompt's blocks for
an import, and pins a finished prefill's blocks for export until the transfer is done. Nothing else
writes `seq.block_table`; the block pool below it (block_pool.py) only counts references.

The low-level calls (`grow`, `shrink`, `release`) work on any block table, so a draft model's cache
(engine/spec/proposers.py), which tracks its own tokens, goes through the same code.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from engine.block_hash import block_hashes, namespace_key
from engine.block_pool import BlockPool, Copy, blocks_for
from engine.kv_events import DEVICE

if TYPE_CHECKING:
    from engine.sequence import Sequence


class KVCacheManager:
    def __init__(self, pool: BlockPool, model_key: str, run_copies: Callable[[list[Copy]], None] | None = None):
        self.pool = pool
        self.block_size = pool.block_size
        self.model_key = model_key
        self.pinned: dict[str, list[int]] = {}     # prefill role: request id -> blocks kept for export
        self.run_copies = run_copies               # the engine's: host-tier copies on every rank

    def flush_copies(self) -> None:
        """Run the host-tier copies the pool ordered (before the blocks they involve are written)."""
        copies = self.pool.take_copies()
        if copies and self.run_copies is not None:
            self.run_copies(copies)

    # -- any block table --------------------------------------------------------------------------
    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` to hold `num_tokens` slots; False (nothing taken) if the pool lacks the blocks."""
        need = blocks_for(num_tokens, self.block_size) - len(table)
        if need <= 0:
            return True
        if not self.pool.can_allocate(need):
            return False
        table.extend(self.pool.allocate(need))
        return True

    def shrink(self, table: list[int], num_tokens: int) -> bool:
        """Free the blocks of `table` past the ones holding `num_tokens` slots; True if there were any."""
        keep = blocks_for(num_tokens, self.block_size)
        if len(table) <= keep:
            return False
        self.pool.free(table[keep:])
        del table[keep:]
        return True

    def release(self, table: list[int]) -> None:
        if table:
            self.pool.free(table)
            table.clear()

    # -- a sequence's blocks ----------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Room for the K/V of `num_new_tokens` more tokens after the computed ones."""
        return self.grow(seq.block_table, seq.num_computed_tokens + num_new_tokens)

    def free(self, seq: Sequence) -> None:
        self.release(seq.block_table)
        _changed(seq)

    def trim(self, seq: Sequence) -> None:
        """Speculation rollback: free blocks past the one that will hold the next token; they hold
        only rejected drafts' K/V (never hashed, so never shared)."""
        if self.shrink(seq.block_table, seq.num_tokens):
            _changed(seq)

    def match_prefix(self, seq: Sequence) -> tuple[int, int]:
        """Reuse cached leading blocks of a sequence that holds none, from either tier (host blocks are
        copied back); the last prompt token is always computed (it gives logits), and a sequence that wants
        prompt logprobs, or pools every prompt row or the first, computes its whole prompt (vLLM's rule). Returns
        the blocks hit and how many of them came from the host tier; undo_prefix() gives them back."""
        bs = self.block_size
        usable = 0 if seq.computes_whole_prompt else (seq.num_tokens - 1) // bs
        self._hash_blocks(seq, usable)
        hit, from_host = self.pool.acquire(self.pool.find(seq.block_hashes[:usable], seq.token_ids))
        seq.block_table = hit
        _changed(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit) * bs
        return len(hit), from_host

    def undo_prefix(self, seq: Sequence) -> None:
        """Give back what match_prefix took (the sequence could not be admitted after all)."""
        self.free(seq)
        seq.num_computed_tokens = seq.num_cached_tokens = 0

    def cache_full_blocks(self, seq: Sequence, num_new_tokens: int) -> None:
        """After the model computed `num_new_tokens` more: register the blocks they filled."""
        if not self.pool.enable_caching:
            return
        bs = self.block_size
        full, before = seq.num_computed_tokens // bs, (seq.num_computed_tokens - num_new_tokens) // bs
        self._hash_blocks(seq, full)
        for j in range(before, full):
            if self.pool.blocks[seq.block_table[j]].hash is None:
                self.pool.cache_block(seq.block_table[j], seq.block_hashes[j],
                                      seq.token_ids[j * bs:(j + 1) * bs], seq.block_hashes[j - 1] if j else None)

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes (a chain) to its first `num_blocks` full blocks."""
        known, bs = len(seq.block_hashes), self.block_size
        if num_blocks > known:
            parent = seq.block_hashes[-1] if known else None
            key = namespace_key(self.model_key, seq.lora_key, seq.params.cache_salt)   # an adapter's (a salt's) KV is its own
            seq.block_hashes.extend(block_hashes(seq.token_ids[known * bs:num_blocks * bs], bs, key, parent))

    # -- imports (decode role) --------------------------------------------------------------------
    def reserve_prompt(self, seq: Sequence, num_tokens: int | None = None) -> int | None:
        """Blocks for the whole prompt (or its first `num_tokens`, whole blocks: a prefix pull) of a sequence
        whose K/V will be transferred: leading blocks in the local prefix cache are reused, the rest are
        fresh. Returns how many were cached here (they need no transfer), or None, holding nothing, if the
        pool lacks room."""
        bs, n = self.block_size, seq.num_tokens if num_tokens is None else num_tokens
        self._hash_blocks(seq, n // bs)
        found = self.pool.find(seq.block_hashes[:n // bs], seq.token_ids)
        on_device = sum(tier == DEVICE for tier, _ in found)
        if not self.pool.can_allocate(blocks_for(n, bs) - on_device):
            return None
        hit, from_host = self.pool.acquire(found)
        num_hit, seq.block_table = len(hit), hit
        _changed(seq)
        self.grow(seq.block_table, n)
        self.flush_copies()                         # the transfer writes these blocks before the next step
        self.pool.record_query(seq.num_tokens, num_hit * bs, from_host * bs)
        return num_hit

    # -- pins (prefill role) ----------------------------------------------------------------------
    def pin(self, seq: Sequence, num_tokens: int | None = None) -> list[int]:
        """Keep a finished prefill's blocks (its prompt's full and partial blocks), or a migrated
        sequence's blocks holding its first `num_tokens` tokens, for export; the sequence lets go of them."""
        if num_tokens is not None:
            self.shrink(seq.block_table, num_tokens)       # a rolled-back verify step may have left one more
        blocks, seq.block_table = seq.block_table, []
        _changed(seq)
        self.pinned[seq.request_id] = blocks
        return blocks

    def pin_prefix(self, pin_id: str, hashes: list[int], token_ids: list[int]) -> list[int]:
        """Pin the leading run of `hashes` (token ids checked) this engine caches, for another engine to pull (a
        prefix pull): a reference on each block under `pin_id` until unpin, as a prefix hit takes them. Blocks
        found only in the host tier are copied back into device blocks first (the copies are run here; on CUDA
        the caller waits for them before anything reads the blocks). Returns the block ids (none: nothing to
        export)."""
        if pin_id in self.pinned:
            raise ValueError(f"{pin_id!r} already holds pinned blocks")
        found = self.pool.find(hashes, token_ids)
        if not found:
            return []
        blocks, _ = self.pool.acquire(found)
        self.flush_copies()
        if blocks:
            self.pinned[pin_id] = blocks
        return blocks

    def unpin(self, request_id: str) -> bool:
        """The transfer is done (or timed out, or nobody will export): free the pinned blocks."""
        blocks = self.pinned.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True


def _changed(seq: Sequence) -> None:
    """Blocks left the table or were replaced (not only appended): whoever mirrors it rereads it whole
    (the model runner's persistent block table)."""
    seq.block_table_epoch += 1
