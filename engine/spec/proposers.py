"""Proposers: where draft tokens come from.

- ngram: prompt lookup in the request's own tokens (no model; q is one-hot).
- draft_model: a smaller model with the target's vocabulary, in this worker, with its own paged KV
  cache and block pool. Each request's draft KV tracks the tokens it was fed; after a verify step
  the entries past the accepted tokens are dropped and their blocks freed.
- layer_skip: the target's own first n layers, then its final norm and head. It shares the
  target's KV cache: the K/V of those layers at the accepted positions are exactly what the draft
  would compute, so there is nothing to catch up; the draft writes layers < n of its own positions
  into blocks the verify step then overwrites.

A model proposer drafts autoregressively in batched passes: the first pass feeds each request what
its draft cache has not seen (for layer_skip, the last token), later passes feed the previous draft.
Drafts are sampled on the device from the *filtered*, penalized draft distribution by inverse CDF with
Philox(seed, position, DRAFT) (engine.sampler.draft_sample), so drafting replays exactly; the rows
are kept as q for exact rejection sampling; greedy requests take the argmax.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.device_clock import device_clock
from engine.sampler import draft_sample
from engine.spec.ngram import NgramLookup

if TYPE_CHECKING:
    from engine.kv_cache_manager import KVCacheManager
    from engine.sequence import Sequence


@dataclass
class Draft:
    tokens: list[int]
    probs: torch.Tensor | None          # [k, V] filtered draft distributions; None for one-hot


@dataclass
class _DraftKV:
    fed: list[int] = field(default_factory=list)      # tokens whose K/V are in the draft cache
    blocks: list[int] = field(default_factory=list)


class Proposer:
    """What SpecDecoder asks of a proposer; the defaults suit one that keeps no state."""
    model_based = False

    def available(self, seq: Sequence, room: int) -> int:
        """How many drafts it could offer (at most `room`)."""
        return room

    def peek(self, seq: Sequence) -> int | None:
        """The first draft it would propose now, if it knows without a model pass."""
        return None

    def rollback(self, seq: Sequence) -> None:
        """After a verify step: forget draft state past the accepted tokens."""

    def release(self, seq: Sequence) -> None:
        """The request finished, was aborted or preempted."""

    def stats(self) -> dict:
        return {}


class NgramProposer(Proposer):
    """Prompt lookup: the candidates are known before depth is chosen, so `available` proposes."""

    def __init__(self, cfg):
        self.lookup = NgramLookup(cfg.prompt_lookup_min, cfg.prompt_lookup_max, cfg.num_speculative_tokens)
        self._pending: dict[str, list[int]] = {}

    def available(self, seq: Sequence, room: int) -> int:
        tokens = self.lookup.propose(seq.token_ids, room) if room > 0 else []
        self._pending[seq.request_id] = tokens
        return len(tokens)

    def peek(self, seq: Sequence) -> int | None:
        tokens = self._pending.get(seq.request_id)
        return tokens[0] if tokens else None

    def draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[Draft], list[tuple[int, float]]]:
        out = [Draft(self._pending.pop(s.request_id, [])[:k], None) for s, k in zip(seqs, ks)]
        self._pending.clear()
        return out, []


class _ModelProposer(Proposer):
    model_based = True

    def __init__(self, runner, num_layers: int | None):
        self.runner, self.num_layers = runner, num_layers

    def _prepare(self, seq: Sequence, k: int) -> tuple[list[int], int, list[int]] | None:
        """(tokens to feed first, their first position, block table), or None if there is no room."""
        raise NotImplementedError

    def _after(self, seq: Sequence, fed: list[int]) -> None:
        pass

    def draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[Draft], list[tuple[int, float]]]:
        """Batched autoregressive drafting; returns the drafts and (requests, seconds) per pass."""
        live = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            prep = self._prepare(seq, k) if k > 0 else None
            if prep is not None:
                live.append((i, seq, k, *prep))
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        fed = {i: list(first) for i, _, _, first, _, _ in live}
        starts = {i: start for i, _, _, _, start, _ in live}
        timings = []
        for depth in range(max((k for _, _, k, *_ in live), default=0)):
            active = [(i, seq, bt) for i, seq, k, _, _, bt in live if k > depth]
            items = []
            for i, seq, bt in active:
                if depth == 0:
                    feed, pos = fed[i], starts[i]
                else:                                   # the previous draft, right after what was fed
                    feed, pos = [tokens[i][-1]], starts[i] + len(fed[i])
                    fed[i].append(tokens[i][-1])
                items.append((feed, pos, bt, 1))
            t0 = device_clock(self.runner.device)
            logits = self.runner.forward_batch(items, num_layers=self.num_layers)
            picks, q = draft_sample(logits, [seq for _, seq, _ in active], [tokens[i] for i, _, _ in active])
            for r, (i, seq, _) in enumerate(active):
                tokens[i].append(picks[r])
                if q[r] is not None:
                    probs[i].append(q[r])
            timings.append((len(active), device_clock(self.runner.device) - t0))
        for i, seq, *_ in live:
            self._after(seq, fed[i])
        drafts = [Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in range(len(seqs))]
        return drafts, timings


class DraftModelProposer(_ModelProposer):
    def __init__(self, runner, kv: KVCacheManager):
        super().__init__(runner, None)
        self.kv = kv                                     # the draft cache's own blocks
        self.state: dict[str, _DraftKV] = {}

    def _prepare(self, seq, k):
        st = self.state.setdefault(seq.request_id, _DraftKV())
        if not self.kv.grow(st.blocks, seq.num_tokens + k - 1):
            self.release(seq)                          # no room in the draft cache: no drafts now
            return None
        return seq.token_ids[len(st.fed):], len(st.fed), st.blocks

    def _after(self, seq, fed):
        st = self.state[seq.request_id]
        st.fed.extend(fed)

    def rollback(self, seq: Sequence) -> None:
        """Keep the draft K/V of tokens still in the sequence; free blocks past them."""
        st = self.state.get(seq.request_id)
        if st is None:
            return
        n = min(len(st.fed), seq.num_tokens)
        for j in range(max(0, n - 32), n):              # only the last drafts can differ
            if st.fed[j] != seq.token_ids[j]:
                n = j
                break
        del st.fed[n:]
        self.kv.shrink(st.blocks, n + 1)

    def release(self, seq: Sequence) -> None:
        st = self.state.pop(seq.request_id, None)
        if st is not None:
            self.kv.release(st.blocks)

    def stats(self) -> dict:
        return {"spec_draft_kv_blocks_used": self.kv.pool.num_used_blocks,
                "spec_draft_kv_blocks_total": self.kv.pool.num_blocks}


class LayerSkipProposer(_ModelProposer):
    def __init__(self, runner, num_layers: int, allocate_slots):
        super().__init__(runner, num_layers)
        self.allocate_slots = allocate_slots             # KVCacheManager.allocate_slots: the target's blocks

    def _prepare(self, seq, k):
        # the verify step needs slots for the last token and k drafts: take them now (the draft
        # writes its layers' K/V there); no room means no drafts this step
        if not self.allocate_slots(seq, 1 + k):
            return None
        return [seq.token_ids[-1]], seq.num_tokens - 1, seq.block_table
