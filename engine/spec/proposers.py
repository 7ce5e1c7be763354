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


class _OwnCache(Proposer):
    """A proposer with a KV cache of its own (self.kv: its block pool's manager; self.state: each request's blocks)."""
    kv: KVCacheManager
    state: dict

    @property
    def pool(self):
        return self.kv.pool

    def release(self, seq: Sequence) -> None:
        st = self.state.pop(seq.request_id, None)
        if st is not None:
            self.kv.release(st.blocks)

    def stats(self) -> dict:
        return {"spec_draft_kv_blocks_used": self.kv.pool.num_used_blocks,
                "spec_draft_kv_blocks_total": self.kv.pool.num_blocks}


class DraftModelProposer(_OwnCache, _ModelProposer):
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


CATCH_UP_ROWS = 256          # a request's hidden-state rows waiting for the head: fed at once past this many


@dataclass
class _HeadState:
    base: int                                  # the real position of the head's position 0
    hidden: torch.Tensor                       # the target's hidden states of real positions `at`.., not yet fed
    at: int                                    # base + fed
    fed: int = 0                               # head positions fed from the target's hidden states (their KV kept)
    blocks: list[int] = field(default_factory=list)


class HiddenStateProposer(_OwnCache):
    """EAGLE, EAGLE-3 and MTP heads (engine/spec/head.py): they read the target's hidden states (its final ones, or
    EAGLE-3's three streams), which every forward of the target leaves here (observe). Head position i holds the K/V of (token at real position base + i + 1, the
    target's hidden state at base + i). `base` is the first position whose hidden state the head saw: 0 after a
    whole prefill; past a prefix hit, a prompt pulled from a prefill replica or a resume, the head attends from
    where the target's forwards began (the earlier hidden states were never computed here). Its positions count
    from base (RoPE scores depend on distances only), its blocks are its own (like a draft model's)."""
    model_based = True
    num_layers = None

    def __init__(self, runner, kv: KVCacheManager):
        self.runner, self.kv = runner, kv
        self.state: dict[str, _HeadState] = {}

    def observe(self, seq: Sequence, first: int, rows: torch.Tensor) -> None:
        """A forward of the target computed rows of seq from real position `first`. A verify step's rows past the
        accepted drafts stay until the next forward's rows replace them: only positions below num_computed_tokens
        are ever fed."""
        st = self.state.get(seq.request_id)
        if st is None or not st.at <= first <= st.at + len(st.hidden):
            # new, or not where it left off (computed again after a preemption): the head starts again at `first`
            self.release(seq)
            self.state[seq.request_id] = _HeadState(base=first, hidden=rows, at=first)
            return
        st.hidden = rows if first == st.at else torch.cat([st.hidden[:first - st.at], rows])

    def catch_up(self, seqs: list[Sequence]) -> None:
        """Feed the head the rows of requests that piled up CATCH_UP_ROWS or more (a long prompt's chunks: their hidden
        states would otherwise wait in memory until its first draft, three streams a token for EAGLE-3), at every
        position whose next token is known; no logits. Their K/V is what the first draft pass would write."""
        items, hidden, done = [], [], []
        for seq in seqs:
            st = self.state.get(seq.request_id)
            if st is None or len(st.hidden) < CATCH_UP_ROWS:
                continue
            end = min(seq.num_computed_tokens, seq.num_tokens - 1, st.at + len(st.hidden))   # i reads token i + 1
            if end <= st.at:
                continue
            if not self.kv.grow(st.blocks, end - st.base):
                self.release(seq)                                   # no room: it starts again at its next rows
                continue
            items.append((seq.token_ids[st.at + 1:end + 1], st.fed, st.blocks, 0))
            hidden.append(st.hidden[:end - st.at])
            done.append((st, end))
        if items:
            self.runner.forward_batch(items, hidden=torch.cat(hidden))
            for st, end in done:
                st.hidden, st.at, st.fed = st.hidden[end - st.at:], end, end - st.base

    def draft(self, seqs: list[Sequence], ks: list[int]) -> tuple[list[Draft], list[tuple[int, float]]]:
        """The first pass feeds each request the positions the head has not read, from the target's hidden states;
        later passes feed the last draft with the head's own output."""
        live = []
        for i, (seq, k) in enumerate(zip(seqs, ks)):
            st = self.state.get(seq.request_id)
            end = seq.num_computed_tokens                           # real positions below have hidden states
            if k <= 0 or st is None or not st.at < end <= st.at + len(st.hidden):
                continue
            if not self.kv.grow(st.blocks, end - st.base + k):
                self.release(seq)                                   # no room in the head's cache: no drafts now
                continue
            live.append((i, seq, k, st, end))
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        out: dict[int, torch.Tensor] = {}
        timings = []
        for depth in range(max((k for _, _, k, _, _ in live), default=0)):
            active = [(i, seq, st, end) for i, seq, k, st, end in live if k > depth]
            items, hidden = [], []
            for i, seq, st, end in active:
                if depth == 0:
                    feed = seq.token_ids[st.at + 1:end + 1]
                    items.append((feed, st.fed, st.blocks, 1))
                    hidden.append(st.hidden[:end - st.at])
                else:
                    items.append(([tokens[i][-1]], end - st.base + depth - 1, st.blocks, 1))
                    hidden.append(out[i])
            t0 = device_clock(self.runner.device)
            logits = self.runner.forward_batch(items, hidden=torch.cat(hidden))
            for r, (i, *_) in enumerate(active):
                out[i] = self.runner.out[r:r + 1]
            picks, q = draft_sample(logits, [seq for _, seq, _, _ in active], [tokens[i] for i, *_ in active])
            for r, (i, *_) in enumerate(active):
                tokens[i].append(picks[r])
                if q[r] is not None:
                    probs[i].append(q[r])
            timings.append((len(active), device_clock(self.runner.device) - t0))
        for i, seq, k, st, end in live:                             # what was fed from the target stays
            st.hidden, st.at, st.fed = st.hidden[end - st.at:], end, end - st.base
        return [Draft(tokens[i], torch.stack(probs[i]) if probs[i] else None) for i in range(len(seqs))], timings

    def rollback(self, seq: Sequence) -> None:
        """Blocks past the positions fed from the target go (the chained drafts' K/V is rewritten next time)."""
        st = self.state.get(seq.request_id)
        if st is not None:
            self.kv.shrink(st.blocks, st.fed + 1)

