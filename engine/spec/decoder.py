"""SpecDecoder: speculative decoding inside the engine's continuous batching.

Each step, before scheduling, it picks a depth k for every request in decode (adaptive.py), asks the
proposer for k drafts and leaves them on the sequence (seq.spec_tokens). The scheduler gives such a
request 1 + k tokens; the runner computes the target's logits at all of them, in the same forward
as plain decodes and prefill chunks. After the forward, verify() runs exact rejection sampling
(rejection.py) and the engine appends the emitted tokens one by one, so stop tokens, stop strings
and max_tokens cut a run of accepted tokens where they fall. Then K/V past the accepted tokens
is rolled back: target blocks past the next token's slot and the draft cache's stale entries are
freed.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from engine.errors import ConfigError
from engine.block_pool import BlockPool
from engine.device_clock import device_clock
from engine.kv_cache_manager import KVCacheManager
from engine.sampler import LogprobRows, process_logits, to_device, to_host
from engine.sequence import Sequence
from engine.spec.adaptive import PROBE_EVERY, DepthController, LinearCost, StepCost
from engine.spec.config import SpeculativeConfig
from engine.spec.metrics import SpecMetrics
from engine.spec.proposers import DraftModelProposer, HiddenStateProposer, LayerSkipProposer, NgramProposer
from engine.spec.rejection import VerifyRows, rejection_sample
from engine.structured import cut_drafts

log = logging.getLogger(__name__)

SHADOW_EVERY = 4              # prompt lookup at k = 0: look (and learn) every this many steps


class SpecDecoder:
    def __init__(self, engine):
        self.engine = engine
        self.cfg: SpeculativeConfig = engine.config.speculative_config
        self.max_k = self.cfg.num_speculative_tokens
        self.metrics = SpecMetrics()
        self.drafter = self._build_drafter()
        sizes = [t for t in (1, 2, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128)
                 if t <= max(engine.config.max_num_batched_tokens, 2)]
        if not self.cfg.adaptive:
            verify = StepCost([(1, 1.0)])
        else:
            verify = StepCost(list(self.cfg.step_costs or self._profile(engine.runner, None, sizes)))
        if self.cfg.method == "ngram":
            draft_cost = (0.0, 2e-5)                         # a numpy lookup per request
        else:
            d1, d8 = (t for _, t in self._profile(self.drafter.runner, self.drafter.num_layers, [1, 8]))
            b = max((d8 - d1) / 7, 0.0)
            draft_cost = (max(d1 - b, 0.0), b)
        self.controller = DepthController(self.max_k, self.cfg.adaptive, verify, LinearCost(*draft_cost))
        log.info("speculative decoding: %s, up to %d drafts (%s); step %.1f ms at 1 token, %.1f ms at %d; "
                 "draft pass %.1f ms + %.2f ms/request", self.cfg.method, self.max_k,
                 "adaptive" if self.cfg.adaptive else "fixed", verify(1) * 1e3, verify(sizes[-1]) * 1e3,
                 sizes[-1], draft_cost[0] * 1e3, draft_cost[1] * 1e3)

    def _build_drafter(self):
        e, cfg = self.engine, self.cfg
        if cfg.method == "ngram":
            return NgramProposer(cfg)
        if cfg.method == "layer_skip":
            total = e.runner.model.num_layers
            if not cfg.num_layers < total:
                raise ConfigError(f"speculative_config: num_layers must be below the target's {total} layers, "
                                  f"got {cfg.num_layers}")
            return LayerSkipProposer(e.runner, cfg.num_layers, e.kv.allocate_slots)
        if cfg.method in ("eagle", "eagle3", "mtp"):
            runner = e.draft_runner                          # engine/spec/head.py, loaded before the KV caches
            log.info("%s head: %.1f MiB of weights, %d KV blocks", cfg.method, runner.weight_bytes / 2**20,
                     runner.num_blocks)
            return HiddenStateProposer(runner, KVCacheManager(BlockPool(runner.num_blocks, runner.block_size,
                                                                        enable_caching=False), ""))
        return self._load_draft_model()

    @property
    def reads_hidden(self) -> bool:
        """Whether the proposer reads the target's hidden states (the runner then keeps every row's)."""
        return isinstance(self.drafter, HiddenStateProposer)

    def observe_hidden(self, rows: list) -> None:
        """A forward's final hidden states: (sequence, its first position, rows)."""
        for seq, first, hidden in rows:
            self.drafter.observe(seq, first, hidden)
        self.drafter.catch_up([seq for seq, _, _ in rows])

    def _load_draft_model(self) -> DraftModelProposer:
        """The engine loaded the draft's weights before sizing its KV caches (load_draft_runner)."""
        runner = self.engine.draft_runner
        log.info("draft model %s: %.1f MiB of weights, %d KV blocks", self.cfg.model, runner.weight_bytes / 2**20,
                 runner.num_blocks)
        pool = BlockPool(runner.num_blocks, runner.block_size, enable_caching=False)
        return DraftModelProposer(runner, KVCacheManager(pool, ""))

    @staticmethod
    def _profile(runner, num_layers: int | None, sizes: list[int]) -> list[tuple[int, float]]:
        """Seconds of a forward over T one-token rows, for each T: the cost table's prior. Three rounds over
        every size, the best of each size, then made non-decreasing in T (a longer step never costs less),
        so that a burst of other work on the machine during one measurement does not bend the table.
        Writes garbage K/V to the padding block, which no sequence owns."""
        def timed(n: int) -> float:
            items = [([0], 0, [runner.padding_block], 1)] * n
            t0 = device_clock(runner.device)
            runner.forward_batch(items, num_layers=num_layers)
            return device_clock(runner.device) - t0
        timed(1)                                             # warm-up (kernel build, allocator)
        best = [timed(n) for n in sizes]
        for _ in range(2):
            best = [min(b, timed(n)) for b, n in zip(best, sizes)]
        for i in range(len(best) - 2, -1, -1):               # the lower envelope, non-decreasing
            best[i] = min(best[i], best[i + 1])
        return list(zip(sizes, best))

    # -- before scheduling: choose depths, draft ----------------------------------------------------
    def propose(self, running: list[Sequence]) -> list[Sequence]:
        """Leave drafts on decode-phase requests; returns the requests that got some."""
        e = self.engine
        cands, limits, alphas = [], [], []
        base = 0
        for seq in running:
            seq.spec_tokens, seq.spec_probs = [], None
            base += seq.num_tokens - seq.num_computed_tokens
            if seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens < 1 or seq.prefill_only:
                continue                                     # still in prefill
            room = min(self.max_k, e.max_model_len - seq.num_tokens - 1)
            if seq.params.max_tokens is not None:
                room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
            cands.append(seq)
            limits.append(room)
            alphas.append(self.controller.alpha(seq.spec.acc, seq.spec.trials))
        if not cands:
            return []
        base = min(base, e.config.max_num_batched_tokens)
        if not self.drafter.model_based:
            # prompt lookup only where a draft could pay (a first pass with every room open), and
            # every SHADOW_EVERY idle steps to keep measuring requests left at k = 0
            pre = self.controller.choose(alphas, limits, base)
            limits = [self.drafter.available(seq, room) if k > 0 or (seq.spec.idle_steps + 1) % SHADOW_EVERY == 0
                      else 0 for seq, room, k in zip(cands, limits, pre)]
        ks = self.controller.choose(alphas, limits, base)
        for i, seq in enumerate(cands):
            if ks[i] == 0 and self.cfg.adaptive:
                seq.spec.shadow = self.drafter.peek(seq) if limits[i] > 0 else None
                seq.spec.idle_steps += 1
                if self.drafter.model_based and limits[i] > 0 and seq.spec.idle_steps >= PROBE_EVERY:
                    ks[i], seq.spec.idle_steps = 1, 0        # re-measure a request left at k = 0
            elif ks[i] > 0:
                seq.spec.idle_steps, seq.spec.shadow = 0, None
            self.metrics.num_steps_k[ks[i]] = self.metrics.num_steps_k.get(ks[i], 0) + 1
        chosen = [(s, k) for s, k in zip(cands, ks) if k > 0]
        t0 = time.perf_counter()
        drafts, passes = self.drafter.draft([s for s, _ in chosen], [k for _, k in chosen])
        elapsed = time.perf_counter() - t0
        for n, secs in passes:
            self.controller.draft.observe(n, secs)
        out = []
        for (seq, _), d in zip(chosen, drafts):
            tokens, probs = d.tokens, d.probs
            if seq.guide is not None and tokens:        # structured output: cut where the grammar refuses
                tokens, probs = cut_drafts(seq.guide, tokens, probs)
            if tokens:
                seq.spec_tokens, seq.spec_probs = tokens, probs
                seq.spec.draft_time += elapsed
                out.append(seq)
        self.metrics.draft_time += elapsed
        return out

    # -- after the forward: verify ------------------------------------------------------------------
    def verify(self, logits: torch.Tensor, entries: list[tuple[Sequence, int]]) -> list[tuple[list[int], list]]:
        """entries: (sequence, its first logits row). Returns per sequence the emitted tokens (the
        accepted drafts and one corrected or bonus token) and their logprobs (or Nones). Runs where
        the logits are; one copy to the host."""
        seqs = [s for s, _ in entries]
        first = np.fromiter((r for _, r in entries), dtype=np.int64, count=len(entries))
        rows = VerifyRows.of(seqs)
        raw = logits.index_select(0, to_device(first[rows.seq] + rows.offset, logits.device)).float()
        target = process_logits(raw, [seqs[s] for s in rows.seq.tolist()], rows.ahead(seqs))
        if any(s.guide is not None for s in seqs):      # structured output: the masked target distribution
            from engine.structured import mask_verify_rows
            target = mask_verify_rows(target, seqs, rows.seq.tolist(), rows.offset.tolist())
        res = rejection_sample(target, seqs)
        lps = LogprobRows.of([seqs[s].params for s in rows.seq.tolist()])
        row_tokens = res.tokens[to_device(rows.seq, raw.device), to_device(rows.offset, raw.device)]
        tokens, counts, *lp_arrays = to_host(res.tokens, res.counts, *lps.on_device(raw, row_tokens))
        row_lps = lps.on_host(lp_arrays, tokens[rows.seq, rows.offset].astype(np.int64).tolist(), len(rows.seq))
        out = []
        for i, seq in enumerate(seqs):
            n, at = int(counts[i]), int(rows.start[i])
            out.append((tokens[i, :n].astype(np.int64).tolist(), row_lps[at:at + n]))
            k, accepted = len(seq.spec_tokens), n - 1
            self.metrics.record(k, accepted)
            self.controller.observe(seq.spec, k, accepted)
            seq.spec.num_drafts += 1
            seq.spec.num_draft_tokens += k
            seq.spec.num_accepted_tokens += accepted
        return out

    def observe_plain(self, seq: Sequence, token: int) -> None:
        """A plain decode of a request left at k = 0 by prompt lookup: had it drafted, its first
        draft would have been accepted iff it equals the token the target chose (for a one-hot
        draft the chance of that is p(draft), exactly the acceptance probability)."""
        if seq.spec.shadow is not None:
            self.controller.observe(seq.spec, 1, int(token == seq.spec.shadow))
            seq.spec.shadow = None

    def end_step(self, drafted: list[Sequence], verified: list[Sequence], scheduled: list[tuple[Sequence, int]],
                 seconds: float) -> None:
        if all(n <= 1 + self.max_k for _, n in scheduled):  # decode/verify steps correct the cost table
            self.controller.verify.observe(sum(n for _, n in scheduled), seconds)
        if verified:
            self.metrics.verify_time += seconds
        for seq in verified:
            seq.spec.verify_time += seconds
        for seq in drafted:
            seq.spec_tokens, seq.spec_probs = [], None
            if not seq.is_finished:
                self.engine.kv.trim(seq)
                self.drafter.rollback(seq)

    def release(self, seq: Sequence) -> None:
        """The request finished, was aborted or preempted: its draft state goes."""
        seq.spec_tokens, seq.spec_probs = [], None
        self.drafter.release(seq)

    def stats(self) -> dict:
        return {**self.metrics.as_dict(), **self.drafter.stats()}


def load_draft_runner(config, target_hf, max_model_len: int):
    """A draft model's runner with its weights and no KV cache yet: the engine loads it before it sizes
    the caches, so the target's KV budget leaves room for it (model_runner.allocate_kv_caches)."""
    from engine.config import EngineConfig
    from engine.loader import load_config, resolve_model
    from engine.model_runner import ModelRunner
    cfg = config.speculative_config
    path = resolve_model(cfg.model)
    hf = load_config(path)
    if hf.vocab_size != target_hf.vocab_size:
        raise ConfigError(f"speculative_config: the draft model's vocabulary ({hf.vocab_size}) differs from "
                          f"the target's ({target_hf.vocab_size}); a draft must share the target's tokenizer")
    limit = getattr(hf, "max_position_embeddings", max_model_len)
    if limit < max_model_len:
        raise ConfigError(f"speculative_config: the draft model has {limit} positions, fewer than "
                          f"max_model_len {max_model_len}; lower max_model_len or pick another draft")
    c = config
    dcfg = EngineConfig(model=cfg.model, dtype=c.dtype, device=c.device, block_size=c.block_size, seed=c.seed,
                        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                        enforce_eager=c.enforce_eager, load_format="dummy" if c.load_format == "dummy" else "auto",
                        quantization="auto" if c.quantization == "gguf" else c.quantization)
    return ModelRunner(dcfg, path, hf, max_model_len)
