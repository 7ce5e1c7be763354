"""A discrete-event simulator of a Baton cluster, for `baton plan`: how many prefill and decode replicas a
workload needs, at a scale no test machine has.

What runs is Baton's own code where the decision is Baton's:
- routing: the prefill pool's PrefixAwareRouter and the decode pool's DecodeRouter (router/request_routers.py,
  built with `offline`), reading a real PrefixIndex fed by the simulated engines' KV events, and
  routing stats refreshed every STATS_PERIOD_S like Serve's; `router.policy: pow2` is Serve's power of two;
- where a prompt is prefilled: router.orchestrator.prefill_remotely;
- autoscaling: cluster.autoscaling's CoupledPolicy / PoolPolicy, called with the AutoscalingContext Serve's
  controller builds, on the metrics EngineReplica reports, averaged over look_back_period_s;
- admission control: router.admission.Admission on the simulator's clock (429s counted, not served);
- the cluster: one ClusterConfig (mode, pools, engine knobs, router, disaggregation, autoscaling).

What is modelled: an engine is the scheduler's rule (engine/scheduler.py) on block counts instead of tensors:
running sequences first (a decode costs one token, an unfinished prompt a chunk of the step's token budget),
then waiting ones in arrival order while max_num_seqs and KV blocks allow; prefix-cache hits by block hash
with LRU eviction of free cached blocks; preemption (by recompute) of the newest sequence when blocks run out;
a decode request's blocks reserved before its KV is pulled. A remote prefill's first token reaches the client
as the live one does: with the decode replica's first output, at the end of the step that takes the import in
(with that step's token), not when the prefill replica samples it. A step costs what the cost model (plan/cost.py)
says. Steps that only decode are simulated as one run until a sequence finishes or new work arrives (a run
is cut at the step in progress), not as an event per token. At the 1,000-GPU scale that simulates a few thousand
requests a second, much of it routing (docs/benchmarks.md): a day of trace on one cluster of that size takes over
half an hour; as cells (plan/cells.py), one of which stands for the fleet, minutes.

Prefix pulls (issue 21) run by the replicas' rule: the ingress names the replica whose cached prefix is longest
(router.orchestrator.prefix_source), and the engine that is to prefill the prompt pulls those blocks instead
of computing them when kvtransfer.config.prefix_pull_pays says the pull is faster (the cost model's transfer
bandwidth, PREFIX_PULL_OVERHEAD_S, and the engine's own tokens per busy second), then computes the rest. The
source answers the export between two of its steps, with the blocks it still caches; an answer later than
kvtransfer.config.prefix_export_timeout_s means computing the prefix. Until the answer the request counts
among the asking replica's ongoing ones (as Serve counts it) but is not in its engine.

Left out, on purpose: LoRA, speculative decoding, the host KV tier, failures and migration, admission
control's several ingress replicas (one holds the whole budget here); KV events reach the index at once (the
real index lags by index_sync_interval_s).
"""
from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import numpy as np

from cluster.config import ClusterConfig
from engine.config import EngineConfig
from engine.kv_events import BlockRemoved, BlockStored
from engine.sampling_params import SamplingParams
from kvtransfer.config import PREFIX_PULL_OVERHEAD_S, prefix_export_timeout_s, prefix_pull_pays
from plan.cost import Batch, Cost
from replica.messages import PoolRequest
from replica.names import DECODE, POOLS, PREFILL
from router.admission import Admission
from router.openai_protocol import OpenAIError
from router.orchestrator import prefill_remotely, prefix_sources
from router.prefix_index import PrefixIndex
from router.request_routers import DecodeRouter, PrefixAwareRouter

STATS_PERIOD_S = 0.2          # cluster/app.py: Serve polls each replica's routing stats this often
ITL_BINS = np.logspace(-5, 3, 1601)      # 10 us .. 1000 s, 0.5% wide: pooled per-token gaps as a histogram
_BINS_PER_DECADE = 200
ITL_FLUSH = 1 << 16          # gaps add_itls holds before binning them


def _itl_bin(gaps: np.ndarray) -> np.ndarray:
    """ITL_BINS' bin of each gap (out-of-range gaps in the end bins), by its logarithm: np.histogram's
    search costs more than a run of the simulator's decode steps."""
    return np.clip(((np.log10(np.maximum(gaps, 1e-12)) + 5) * _BINS_PER_DECADE).astype(np.int64), 0,
                   len(ITL_BINS) - 2)


def _itl_bin_one(gap: float) -> int:
    """_itl_bin of one gap in plain Python (numpy on one value costs 30 times as much, once per token)."""
    return min(max(int((math.log10(max(gap, 1e-12)) + 5) * _BINS_PER_DECADE), 0), len(ITL_BINS) - 2)
_DEFAULTS = {k: getattr(EngineConfig, k) for k in ("block_size", "max_num_seqs", "max_num_batched_tokens")}


@dataclass(eq=False)
class SimRequest:
    id: int
    at: float                    # arrival, seconds
    prompt: int                  # prompt tokens
    output: int                  # output tokens (ignore_eos: the trace's length)
    hashes: list[int]            # chained hashes of the prompt's full blocks (the sim's block size)
    # results
    first: float | None = None   # first token's time, as the client gets it
    last: float | None = None
    tokens: int = 0
    rejected: bool = False       # admission control answered 429
    ticket: Any = None           # its admission ticket

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.at

    @property
    def mean_itl(self) -> float | None:
        """The gaps between its tokens sum to last - first, wherever they were made."""
        return (self.last - self.first) / (self.tokens - 1) if self.tokens > 1 else None


@dataclass(eq=False)
class Seq:
    """One request on one engine."""
    req: SimRequest
    need: int                    # prompt tokens this engine must hold KV for
    out: int                     # tokens this engine emits (the prompt's completion emits the first)
    remote: bool = False         # its KV comes from a prefill replica (decode pool)
    computed: int = 0            # prompt tokens with KV here
    tokens: int = 0              # KV tokens held
    nblocks: int = 0
    hashed: list[int] = field(default_factory=list)   # full blocks it holds under their hash
    cached: int = 0              # prompt tokens found cached
    source: tuple[str, str, int] | None = None   # (pool, replica, blocks): where the index says its prefix is
    fallback: tuple[str, str, int] | None = None  # the other pool's best holder, asked when source answers none
    pull_blocks: int = 0         # a prefix pull brings its first pull_blocks blocks (0: computed here)
    floor: int = 0               # blocks an earlier source's answer gave, while the fallback is asked for more
    added: float = 0.0           # its arrival at this engine (the replica's metrics' phases start here)
    scheduled: float | None = None   # its first step here (an import: the step boundary that finds its KV)
    prefilled: bool = False      # its first token was sampled here (the prefill phase recorded)


class BlockCache:
    """One engine's KV blocks: blocks held by sequences, free cached blocks in LRU order (hash -> None), and
    KV events for the index (engine/block_pool.py's rules, on counts)."""

    def __init__(self, num_blocks: int):
        self.total, self.used = num_blocks, 0
        self.ref: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.events: list = []

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.ref and h not in self.lru:
                break
            n += 1
        return n

    def free_blocks(self) -> int:
        return self.total - self.used            # free + evictable

    def take(self, seq: Seq, hashes: list[int]) -> None:
        """Hold the cached blocks `hashes` (a prefix hit)."""
        for h in hashes:
            if h in self.lru:
                del self.lru[h]
                self.used += 1
                self.ref[h] = 1
            else:
                self.ref[h] += 1
            seq.hashed.append(h)
        seq.nblocks += len(hashes)

    def allocate(self, seq: Seq, n: int) -> bool:
        if n <= 0:
            return True
        if self.total - self.used < n:
            return False
        evict = n - (self.total - self.used - len(self.lru))
        if evict > 0:
            gone = [self.lru.popitem(last=False)[0] for _ in range(evict)]
            self.events.append(BlockRemoved(gone))
        self.used += n
        seq.nblocks += n
        return True

    def register(self, seq: Seq, upto: int) -> None:
        """The sequence's first `upto` prompt blocks are full and computed: cache them under their hashes (a
        block another sequence cached first stays this sequence's private copy, as in the block pool)."""
        new = []
        for h in seq.req.hashes[len(seq.hashed):upto]:
            if h in self.ref or h in self.lru:
                break
            self.ref[h] = 1
            seq.hashed.append(h)
            new.append(h)
        if new:
            self.events.append(BlockStored(new, None))

    def release(self, seq: Seq) -> None:
        for h in seq.hashed:
            self.ref[h] -= 1
            if self.ref[h] == 0:
                del self.ref[h]
                self.lru[h] = None
                self.used -= 1
        self.used -= seq.nblocks - len(seq.hashed)
        seq.hashed, seq.nblocks = [], 0


def blocks(tokens: int, bs: int) -> int:
    return -(-tokens // bs)


class Engine:
    """One replica's engine: the scheduler's rule over a BlockCache, steps timed by the cost model."""

    def __init__(self, sim: Simulator, rid: str, pool: str, kv_tokens: int, knobs: dict[str, Any]):
        self.sim, self.rid, self.pool = sim, rid, pool
        self.bs = knobs["block_size"]
        self.max_seqs, self.budget = knobs["max_num_seqs"], knobs["max_num_batched_tokens"]
        self.kv = BlockCache(kv_tokens // self.bs)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.loading = 0
        self.asking = 0                      # requests waiting for another replica's prefix export
        self.arrived: list[Seq] = []         # imports whose KV arrived since the last step boundary
        self.busy = False
        self.step_end = 0.0                  # when its step in progress ends (a step; a run's are in self.run)
        self.version = 0                     # a cut run's end event is stale
        self.run: tuple | None = None        # (start, cumulative ends, seqs, each step's cost alone, the steps'
                                             # slowdown) of a multi-step decode run
        self.busy_s = 0.0
        self.computed_tokens = 0             # tokens its steps computed (the prefix-pull rule's rate)
        self.pull_stats = [0.0, 0.0]         # bytes, seconds of its prefix pulls (the rule's bandwidth)
        self.event_seq = 0
        self.ready_at = 0.0
        self.stopping = False
        self.stats: dict[str, Any] = {}
        self.stats_due = -math.inf                 # when Serve next polls its routing stats
        self.ttfts: deque[tuple[float, float]] = deque()     # (time, seconds) for the autoscaling signal
        self.itls: deque[tuple[float, Any]] = deque()      # (time, a gap or an array of a run's gaps)
        self.sim.index_of(pool).load_snapshot(rid, 0, [])

    # -- what the routers and the autoscaler read ------------------------------------------------------
    @property
    def queued_prefill_tokens(self) -> int:
        return sum(s.need - s.computed for s in self.waiting if not s.remote) + \
            sum(s.need - s.computed for s in self.running)

    @property
    def routing_stats(self) -> dict[str, Any]:
        """EngineReplica's routing stats, as fresh as Serve's polling makes them."""
        now = self.sim.now
        if now >= self.stats_due:
            self.stats_due = now + STATS_PERIOD_S
            self.stats = {"time": now, "queued_prefill_tokens": self.queued_prefill_tokens,
                          "kv_blocks_used": self.kv.used, "kv_blocks_total": self.kv.total,
                          "num_running": len(self.running) + self.loading, "loras": ()}
        return self.stats

    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running) + self.loading + self.asking

    def boundary(self) -> float:
        """When the engine is next between two steps, where a call (a prefix export) runs: now when idle."""
        if not self.busy:
            return self.sim.now
        if self.run is not None:
            start, ends = self.run[:2]
            i = min(int(np.searchsorted(ends, self.sim.now - start, side="right")), len(ends) - 1)
            return start + float(ends[i])
        return self.step_end

    def tokens_in_flight(self) -> int:
        return sum(s.tokens for s in self.running) + self.queued_prefill_tokens

    # -- work in --------------------------------------------------------------------------------------
    def add(self, seq: Seq) -> None:
        seq.added = self.sim.now
        if seq.source is not None and not seq.remote:
            if seq.source[1] == self.rid and seq.fallback is not None:     # named first: the other holder next
                seq.source, seq.fallback = seq.fallback, None
            seq.pull_blocks = self._prefix_pull(seq)
            if seq.pull_blocks:
                self.asking += 1
                self.sim.ask_export(self, seq)
                return
        self.waiting.append(seq)
        self.kick()

    def exported(self, seq: Seq, blocks: int) -> None:
        """The source answered the export with `blocks` leading blocks (0: none, or too late; computed here)."""
        self.asking -= 1
        seq.pull_blocks, seq.floor = blocks, 0
        self.waiting.append(seq)
        self.kick()

    def _prefix_pull(self, seq: Seq) -> int:
        """EngineReplica.prefix_remote's decision: the blocks a pull from seq.source would leave this engine
        holding, or 0 to compute them (pulls off, the source is this engine, it would bring fewer than
        prefix_pull_min_blocks, or prefix_pull_pays says computing is faster)."""
        t = self.sim.cfg.transfer
        _pool, rid, n = seq.source
        if not t.prefix_pull or rid == self.rid:
            return 0
        hashes = seq.req.hashes
        usable = self.usable(seq, n)
        gain = usable - max(self.kv.match(hashes[:usable]), seq.floor)
        if gain < t.prefix_pull_min_blocks or not prefix_pull_pays(
                gain, self.sim.cost.kv_bytes_per_token * self.bs, self.bs, self.pull_stats, t.prefix_pull_gbps,
                self.computed_tokens, self.busy_s):
            return 0
        return usable

    def usable(self, seq: Seq, blocks: int) -> int:
        """Of `blocks` leading blocks a source holds, those a pull may bring (the last prompt token is computed;
        EngineReplica._usable)."""
        return min(blocks, (seq.need - 1) // self.bs, len(seq.req.hashes))

    def kick(self) -> None:
        """New work: start a step if idle, or cut a decode run at the step in progress."""
        if not self.busy:
            self.sim.at(self.sim.now, self._step)
        elif self.run is not None:
            self._cut()

    def _cut(self) -> None:
        """End the run with the step in progress (its next step sees the new work)."""
        start, ends, *rest = self.run
        done = int(np.searchsorted(ends, self.sim.now - start, side="left")) + 1
        if done >= len(ends):
            return
        self.version += 1
        v = self.version
        self.run = (start, ends[:done], *rest)
        self.sim.at(start + float(ends[done - 1]), lambda: self._end_run(v))

    # -- one step ---------------------------------------------------------------------------------------
    def _step(self) -> None:
        if self.busy:
            return
        if self.arrived:                     # LLMEngine.step finds the finished loads as it starts: their queue
            now = self.sim.now               # phase ends here (replica/metrics.py), not at the KV's arrival
            for seq in self.arrived:
                seq.scheduled = now
                self.sim.phase(self.pool, 0, now - seq.added, seq.req)
            self.arrived = []
        sched: list[tuple[Seq, int]] = []
        budget, bs, kv = self.budget, self.bs, self.kv
        preempted = 0                                   # (the running list is only searched after a preemption)
        decode_only = True                              # every scheduled sequence decodes (a run of steps)
        for seq in list(self.running):
            if preempted and seq not in self.running:   # preempted by an earlier one this step
                continue
            n = min(seq.need - seq.computed, budget) if seq.computed < seq.need else 1
            if n <= 0:
                continue
            if seq.tokens + n > seq.nblocks * bs:       # (a decode mostly fits the blocks it holds)
                while not kv.allocate(seq, blocks(seq.tokens + n, bs) - seq.nblocks):
                    victim = self.running[-1]
                    self._preempt(victim, sched)
                    preempted += 1
                    if victim is seq:
                        break
                if preempted and seq not in self.running:
                    continue
            sched.append((seq, n))
            if seq.computed < seq.need:
                decode_only = False
            budget -= n
        if preempted:                                   # (a preemption may have taken a prompt chunk out again)
            decode_only = all(seq.computed >= seq.need for seq, _ in sched)
        while self.waiting and budget > 0 and len(self.running) + self.loading < self.max_seqs:
            seq = self.waiting[0]
            hashes = self._leading(seq)
            hit = kv.match(hashes)
            if seq.pull_blocks > hit or seq.remote:     # an import or a prefix pull: no budget
                if not self._start_import(seq, hashes, hit):
                    break
                self.waiting.popleft()
                continue
            kv.take(seq, hashes[:hit])
            seq.computed = seq.tokens = seq.cached = hit * self.bs
            n = min(seq.need - seq.computed, budget)
            if not kv.allocate(seq, blocks(seq.tokens + n, self.bs) - seq.nblocks):
                kv.release(seq)
                seq.computed = seq.tokens = 0
                break
            self.waiting.popleft()
            self.sim.hits[self.pool][0] += seq.need
            self.sim.hits[self.pool][1] += seq.cached
            self.running.append(seq)
            sched.append((seq, n))
            decode_only = False
            budget -= n
        if budget <= 0:                                 # the scheduler's _start_loads_behind
            for seq in [s for s in self.waiting if s.remote or s.pull_blocks]:
                if len(self.running) + self.loading >= self.max_seqs:
                    break
                hashes = self._leading(seq)
                hit = kv.match(hashes)
                if seq.pull_blocks <= hit and not seq.remote:
                    continue
                if not self._start_import(seq, hashes, hit):
                    break
                self.waiting.remove(seq)
        self._flush_events()
        if not sched:
            return
        self.busy = True
        slow, serving = self.sim.slowdown(self)
        if decode_only:
            self.computed_tokens += len(sched)
            self._decode_run([seq for seq, _ in sched], slow, serving)
            return
        self.computed_tokens += sum(n for _, n in sched)
        b = Batch(0, 0.0, len(sched), 0)
        now, cost = self.sim.now, self.sim.cost
        for seq, n in sched:
            b.tokens += n
            b.pairs += cost.pairs(n, seq.tokens)
            b.context += cost.kv_read(seq.tokens + n)
            if seq.scheduled is None:               # its first step (a decode-only batch holds none)
                seq.scheduled = now
                self.sim.phase(self.pool, 0, now - seq.added, seq.req)
        ov = self.sim.cost.overheads
        streams = sum(seq.computed + n >= seq.need for seq, n in sched) if self.pool != PREFILL else 0
        alone = self.sim.cost.step_s(b)
        self.sim.stepped(self.pool, now, alone, slow)
        dur = float(self.sim.jittered(alone * slow + (ov.step_s + ov.token_s * streams) * serving))
        self.version += 1
        v, start = self.version, self.sim.now
        self.step_end = start + dur
        self.sim.at(start + dur, lambda: self._end_step(v, start, sched))

    def _leading(self, seq: Seq) -> list[int]:
        """The hashes of the prompt's blocks a cache hit may cover (the last token is always computed)."""
        return seq.req.hashes[:max(min(len(seq.req.hashes), (seq.need - 1) // self.bs), 0)]

    def _start_import(self, seq: Seq, hashes: list[int], hit: int) -> bool:
        """Hold the blocks of a waiting import (the whole prompt) or prefix pull (its leading blocks), and start
        the pull of those not cached here; False when the blocks are not free (it stays waiting)."""
        kv = self.kv
        kv.take(seq, hashes[:hit])
        need = seq.pull_blocks if seq.pull_blocks > hit else blocks(seq.need + 1, self.bs)
        if not kv.allocate(seq, need - seq.nblocks):
            kv.release(seq)
            return False
        self.loading += 1
        seq.cached = hit * self.bs
        if seq.pull_blocks > hit:                       # a prefix pull: pull, then compute the rest
            self.sim.hits[self.pool][0] += seq.need
            self.sim.hits[self.pool][1] += seq.cached
            self.sim.prefix_pull(self, seq, (seq.pull_blocks - hit) * self.bs)
        else:                                           # reserve the whole prompt, pull what is not cached
            self.sim.pull(self, seq, seq.need - seq.cached)
        return True

    def _decode_run(self, seqs: list[Seq], slow: float, serving: float) -> None:
        bs = self.bs
        k = min([s.out for s in seqs])                  # (list comprehensions: cheaper than generators here)
        tokens = np.array([s.tokens for s in seqs], np.int64)
        held = np.array([s.nblocks for s in seqs], np.int64)
        free = self.kv.free_blocks()
        while True:
            more = -(-(tokens + k) // bs) - held         # the run's blocks, taken up front
            short = more > 0                             # (a sequence may hold more than it needs)
            if k <= 1 or int(more[short].sum()) <= free:
                break
            k //= 2
        for i in np.flatnonzero(short).tolist():
            self.kv.allocate(seqs[i], int(more[i]))
        self._flush_events()
        ov = self.sim.cost.overheads
        cost = self.sim.cost                        # a window: its layers' reads stop growing past it
        alone = cost.decode_steps_s(len(seqs), float(np.sum(cost.kv_read(tokens))), k,
                                    float(np.sum(cost.kv_read(tokens + 1) - cost.kv_read(tokens))))
        ends = np.cumsum(self.sim.jittered(alone * slow + (ov.step_s + ov.token_s * len(seqs)) * serving))
        self.version += 1
        v, start = self.version, self.sim.now
        self.run = (start, ends, seqs, alone, slow)
        self.sim.at(start + float(ends[-1]), lambda: self._end_run(v))

    def _end_run(self, v: int) -> None:
        if v != self.version or self.run is None:
            return
        start, ends, seqs, alone, slow = self.run
        self.sim.stepped(self.pool, start, float(alone[:len(ends)].sum()), slow, len(ends))
        self._finish_run(start, ends, seqs)

    def _finish_run(self, start: float, ends: np.ndarray, seqs: list[Seq]) -> None:
        """The first len(ends) steps of a decode run: every sequence got a token per step. This loop runs once
        per sequence per run (a run ends at every arrival and finish), so it does the least it can: the token
        gaps go to the histogram and the autoscaler's window as one array per run."""
        self.run = None
        k = len(ends)
        t_first, t_last = start + float(ends[0]), start + float(ends[-1])
        self.busy_s += float(ends[-1])
        self.computed_tokens += k * len(seqs) - len(seqs)    # its first step's tokens counted when scheduled
        gaps, done = [], []
        for s in seqs:
            s.tokens += k
            s.out -= k
            r = s.req
            if r.last is None:
                r.first = t_first
            else:
                gaps.append(t_first - r.last)
            r.tokens += k
            r.last = t_last
            if r.ticket is not None:
                r.ticket.progress(0, k)
            if s.out <= 0:
                done.append(s)
        if gaps:                                        # the gaps before the run's first token
            g = np.array(gaps)
            self.sim.add_itls(g)
            self.itls.append((t_first, g))
        if k > 1:                                       # every sequence's gaps after its run's first token
            steps = ends[1:] - ends[:-1]
            self.sim.add_itls(steps, len(seqs))
            self.itls.append((t_last, steps[-1:]))
        else:
            self.itls.append((t_last, ends[-1:]))
        for s in done:
            self._done(s)
        self.busy = False
        self._step()

    def _end_step(self, v: int, start: float, sched: list[tuple[Seq, int]]) -> None:
        if v != self.version:
            return
        now = self.sim.now
        self.busy_s += now - start
        for seq, n in sched:
            if seq not in self.running:
                continue
            if seq.computed < seq.need:                 # a prompt chunk
                seq.computed += n
                seq.tokens += n
                self.kv.register(seq, min(seq.computed // self.bs, len(seq.req.hashes)))
                if seq.computed < seq.need:
                    continue
            else:
                seq.tokens += 1
            self._emit(seq, now)
        self._flush_events()
        self.busy = False
        self._step()

    def _emit(self, seq: Seq, now: float) -> None:
        r = seq.req
        if not seq.remote and not seq.prefilled:
            seq.prefilled = True
            self.sim.phase(self.pool, 1, now - seq.scheduled, r)
        if self.pool == PREFILL and r.output > 1:
            # a remote prefill's first token reaches the client with the decode replica's first output, after
            # the hand-off, the pull and the step that takes the import in (LLMEngine.step emits it with that
            # step's token, r.first set there); the prefill replica's own TTFT still feeds the autoscaler
            self.ttfts.append((now, now - r.at))
        elif r.first is None:
            r.first = r.last = now
            if not seq.remote:
                self.ttfts.append((now, now - r.at))
        else:
            gap = now - r.last
            self.sim.add_itl(gap)
            self.itls.append((now, gap))
            r.last = now
        r.tokens += 1
        if r.ticket is not None:
            r.ticket.progress(0, 1)
        seq.out -= 1
        if seq.out <= 0:
            self._done(seq)

    def _done(self, seq: Seq) -> None:
        self.running.remove(seq)
        if self.pool == PREFILL and seq.req.output > 1:
            self.sim.handoff(self, seq)                 # its blocks stay held until the decode replica pulled them
        else:
            self.kv.release(seq)
            self.sim.finished(seq.req)

    def unpin(self, seq: Seq) -> None:
        self.kv.release(seq)
        self._flush_events()
        self.kick()

    def prefix_pulled(self, seq: Seq, nbytes: float, seconds: float) -> None:
        """A prefix pull arrived: its blocks are cached here, and the rest of the prompt is computed."""
        self.loading -= 1
        self.pull_stats = [self.pull_stats[0] + nbytes, self.pull_stats[1] + seconds]
        seq.computed = seq.tokens = seq.pull_blocks * self.bs
        self.kv.register(seq, seq.pull_blocks)
        self._flush_events()
        self.running.append(seq)
        self.kick()

    def pulled(self, seq: Seq) -> None:
        """An import's KV arrived: it runs (its prompt's blocks cached here too)."""
        self.loading -= 1
        self.arrived.append(seq)                        # its queue phase ends at the next step boundary
        seq.computed = seq.tokens = seq.need
        self.kv.register(seq, min(seq.need // self.bs, len(seq.req.hashes)))
        self._flush_events()
        self.running.append(seq)
        self.kick()

    def _preempt(self, seq: Seq, sched: list[tuple[Seq, int]]) -> None:
        self.running.remove(seq)
        sched[:] = [(s, n) for s, n in sched if s is not seq]
        self.kv.release(seq)
        seq.computed = seq.tokens = 0
        seq.need = seq.req.prompt + seq.req.tokens      # recompute the prompt and what it generated
        seq.remote, seq.pull_blocks = False, 0
        self.sim.preemptions += 1
        self.waiting.appendleft(seq)

    def _flush_events(self) -> None:
        if self.kv.events:
            self.event_seq += 1
            self.sim.index_of(self.pool).apply(self.rid, self.event_seq, self.kv.events)
            self.kv.events = []


class _Mirror:
    """What the routers read: the exact index of each pool (router.cluster_state.IndexMirror's shape)."""

    def __init__(self):
        self.index = {p: PrefixIndex() for p in POOLS}

    def start(self) -> None:
        pass

    def forget(self, pool: str, rid: str, why: str = "") -> None:
        self.index[pool].remove_replica(rid)


class Simulator:
    """Runs `requests` through a cluster built from `config`, with step costs from `cost`."""

    def __init__(self, config: ClusterConfig, cost: Cost, seed: int = 0, startup_s: float = 60.0,
                 horizon_s: float | None = None, progress: Callable[[str], None] | None = None):
        self.cfg, self.cost, self.startup_s, self.horizon = config, cost, startup_s, horizon_s
        self.rng = random.Random(seed)
        self.jitter_rng = np.random.default_rng(seed)   # step times' spread (Overheads.step_jitter), its own stream
        self.now = 0.0
        self.queue: list = []
        self.n = 0
        self.mirror = _Mirror()
        self.colocated = config.mode == "colocated" or config.prefill is None
        self.pools = [DECODE] if self.colocated else [PREFILL, DECODE]
        self.knobs = {p: self._knobs(p) for p in self.pools}
        bs = {self.knobs[p]["block_size"] for p in self.pools}
        if len(bs) > 1:
            raise ValueError("block_size must be the same in both pools")
        self.block_size = bs.pop()
        self.engines: dict[str, list[Engine]] = {p: [] for p in self.pools}
        self.fleet_version = 0                          # bumped when a replica is added or stopped (live())
        self._live: dict[str, tuple[int, float, dict[str, Engine]]] = {}
        self.ids = 0
        self.hits = {p: [0, 0] for p in POOLS}          # query tokens, hit tokens
        self.prefix_pulls = [0, 0]                      # pulls, tokens pulled
        self.prefix_export_timeouts = 0                 # prefix pulls given up: the source answered too late
        self._itl_hist = np.zeros(len(ITL_BINS) - 1)
        self._itl_pending: list[tuple[np.ndarray, int]] = []     # add_itls' gaps not binned yet
        self._itl_pending_n = 0
        self.preemptions = 0
        # pool -> [queue seconds, queue count, prefill seconds, prefill count] of the measured requests (at >= 0):
        # the phases the replicas' histograms hold (replica/metrics.py), queue from a request's arrival at an
        # engine to its first step there (an import: to the step boundary that finds its KV arrived), prefill from
        # that step to the first token sampled there
        self.phases = {p: [0.0, 0, 0.0, 0] for p in POOLS}
        # pool -> [seconds its engines stepped, the cost model's seconds for those steps alone, steps] over those that
        # began at >= 0 (the engine's part: no serving overheads): stepped / alone is the slowdown the engines met
        # from their neighbours (LinearCost.shared_device), which the replicas' step counters measure with the
        # machine's speed (plan/calibrate.py engine_speed)
        self.steps = {p: [0.0, 0.0, 0] for p in POOLS}
        self.done: list[SimRequest] = []
        self.replica_seconds = {p: 0.0 for p in self.pools}
        self.timeline: list[dict[str, Any]] = []
        self.progress = progress
        self._pins: dict[int, tuple[Engine, Seq]] = {}     # request -> the prefill holding its blocks for the pull
        router = config.router
        self.policy = router.policy
        self.prefill_router = PrefixAwareRouter.offline(
            block_size=self.block_size, router=router.model_dump(mode="json"), mirror=self.mirror, clock=self._clock)
        self.decode_router = DecodeRouter.offline(
            block_size=self.block_size, max_num_seqs=self.knobs[DECODE]["max_num_seqs"],
            index_sync_interval_s=router.index_sync_interval_s, host_tier_hit_weight=router.host_tier_hit_weight,
            load_weight=router.load_weight, imbalance_threshold_tokens=router.imbalance_threshold_tokens,
            mirror=self.mirror, clock=self._clock)
        for p in self.pools:
            pc = self._pool(p)
            n = pc.num_replicas or 1
            if pc.autoscaling is not None:
                n = pc.autoscaling.initial_replicas if pc.autoscaling.initial_replicas is not None \
                    else pc.autoscaling.min_replicas
            for _ in range(n):
                self._add_engine(p, ready=0.0)
        self.scaler = _Scaler(self) if any(self._pool(p).autoscaling for p in self.pools) else None
        self.admission = Admission(config.admission, self._kv_capacity, clock=self._clock) \
            if config.admission.enabled else None

    def _kv_capacity(self) -> int:
        """Tokens the decode pool's KV caches hold (the ingress's Orchestrator.kv_capacity_tokens)."""
        return sum(e.kv.total for e in self.live(DECODE).values()) * self.block_size

    # -- config ----------------------------------------------------------------------------------------
    def _pool(self, pool: str):
        return self.cfg.prefill if pool == PREFILL else self.cfg.decode

    def _knobs(self, pool: str) -> dict[str, Any]:
        e = self._pool(pool).engine
        return {k: getattr(e, k) if getattr(e, k) is not None else v for k, v in _DEFAULTS.items()} | {
            "kv_cache_memory": e.kv_cache_memory, "num_kv_blocks": e.num_kv_blocks}

    def _add_engine(self, pool: str, ready: float) -> Engine:
        k = self.knobs[pool]
        kv_tokens = self.cost.kv_tokens(k["kv_cache_memory"], k["num_kv_blocks"], k["block_size"])
        self.ids += 1
        e = Engine(self, f"{pool}-{self.ids}", pool, kv_tokens, k)
        e.ready_at = ready
        self.engines[pool].append(e)
        self.fleet_version += 1
        return e

    def index_of(self, pool: str) -> PrefixIndex:
        return self.mirror.index[pool]

    # -- events ----------------------------------------------------------------------------------------
    def _clock(self) -> float:
        return self.now

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self.n += 1
        heapq.heappush(self.queue, (t, self.n, fn))

    def slowdown(self, engine: Engine) -> tuple[float, float]:
        """Replicas sharing one machine's compute (LinearCost.shared_device): a step started while k other engines
        are busy shares the cores with them and meets their interference, and so does the serving work around it
        (plan/cost.py): how many times as long each takes. The others' decode runs are cut so that their next steps
        see it too."""
        if not self.cost.shared_device:
            return 1.0, 1.0
        busy = [e for p in self.pools for e in self.engines[p] if e.busy and e is not engine]
        for e in busy:
            if e.run is not None:
                e._cut()
        k = len(busy)
        share = max(1.0, (k + 1) * self.cost.threads / self.cost.cores) if self.cost.cores else 1.0
        return share * (1.0 + self.cost.contention * k), share * (1.0 + self.cost.serving_contention * k)

    def jittered(self, steps):
        """Steps' modelled times (a float or an array), each times a lognormal multiple with mean 1 and sigma
        Overheads.step_jitter (unchanged without it). A served step's time varies with what else the machine runs
        in it (the serving path's bursts, Ray's threads): the token gaps' tail, which the means alone do not give."""
        sigma = self.cost.overheads.step_jitter
        if sigma <= 0:
            return steps
        return steps * self.jitter_rng.lognormal(-0.5 * sigma * sigma, sigma, np.shape(steps))

    def streams(self) -> int:
        """Sequences the decode pool runs now: the streams the serving path carries (Overheads.stream_s)."""
        return sum(len(e.running) for e in self.engines[DECODE])

    def live(self, pool: str) -> dict[str, Engine]:
        """The pool's replicas that take work now (started, not stopping): kept until a replica is added or
        stopped, or the next one starting is ready (a request routes over it twice). Callers do not change it."""
        version, until, live = self._live.get(pool, (-1, 0.0, None))
        if version == self.fleet_version and self.now < until:
            return live
        now, engines = self.now, self.engines[pool]
        live = {e.rid: e for e in engines if e.ready_at <= now and not e.stopping}
        until = min((e.ready_at for e in engines if e.ready_at > now and not e.stopping), default=math.inf)
        self._live[pool] = (self.fleet_version, until, live)
        return live

    # -- the request path ------------------------------------------------------------------------------
    def arrive(self, r: SimRequest) -> None:
        """The ingress: at r.at + request_s admission control (router/admission.py, when enabled) takes the
        request or answers 429; the prompt then goes to the prefill pool or a decode replica."""
        hashes = r.hashes
        decode_hit = self.index_of(DECODE).longest(hashes)[0]
        if self.admission is not None:
            cached = max((idx.longest(hashes)[0] for idx in self.mirror.index.values()), default=0) * self.block_size
            try:
                r.ticket = self.admission.admit([max(r.prompt - cached, 0)], [r.prompt], 1)
            except OpenAIError:
                r.rejected = True
                self.finished(r)
                return
        sources = prefix_sources(self.mirror.index, hashes, not self.colocated)
        source, fallback = (sources + [None, None])[:2]
        if not self.colocated and prefill_remotely(r.prompt, decode_hit, self.block_size,
                                                   self.cfg.disaggregation.min_remote_prefill_tokens):
            engine = self._route(PREFILL, r, prefill=False)
            engine.add(Seq(r, need=r.prompt, out=1, source=source, fallback=fallback))
        else:
            engine = self._route(DECODE, r, prefill=False)
            engine.add(Seq(r, need=r.prompt, out=r.output, source=source, fallback=fallback))

    def _route(self, pool: str, r: SimRequest, prefill: bool) -> Engine:
        live = self.live(pool)
        if not live:                                    # a pool scaled to zero: the request waits for one
            live = {e.rid: e for e in self.engines[pool] if not e.stopping} or \
                {self._add_engine(pool, self.now + self.startup_s).rid: self.engines[pool][-1]}
        if pool == PREFILL and self.policy == "pow2":
            a, b = self.rng.sample(list(live.values()), 2) if len(live) > 1 else [next(iter(live.values()))] * 2
            return a if a.ongoing() <= b.ongoing() else b
        req = PoolRequest(str(r.id), _Len(r.prompt), r.hashes, _GREEDY, prefill=_REMOTE if prefill else None)
        router = self.prefill_router if pool == PREFILL else self.decode_router
        rid, _ = router.route(req, live)
        return live[rid]

    def handoff(self, source: Engine, seq: Seq) -> None:
        """The prefill replica answered: the request goes to a decode replica, which pulls its KV."""
        r = seq.req
        self.prefill_router.inflight.finish(str(r.id))      # as the orchestrator tells its process's routers

        def go() -> None:
            self._pins[r.id] = (source, seq)
            self._route(DECODE, r, prefill=True).add(Seq(r, need=r.prompt, out=r.output - 1, remote=True))
        ov = self.cost.overheads
        self.at(self.now + ov.handoff_s + (ov.stream_s * self.streams() if ov.stream_s else 0.0), go)

    def pull(self, engine: Engine, seq: Seq, tokens: int) -> None:
        ov = self.cost.overheads
        seconds = ov.pull_s(tokens * self.cost.kv_bytes_per_token)

        def arrived() -> None:
            src = self._pins.pop(seq.req.id, None)
            if src is not None:
                src[0].unpin(src[1])
            engine.pulled(seq)
        self.at(self.now + seconds, arrived)

    def ask_export(self, engine: Engine, seq: Seq) -> None:
        """EngineReplica.prefix_remote asks seq.source for its blocks: the source answers at its next step
        boundary (export_prefix is a call between steps) with the leading blocks it still caches, unless that is
        later than prefix_export_timeout_s, when the asking replica computes the prefix (or pulls what an
        earlier answer gave: seq.floor)."""
        pool, rid, _ = seq.source
        src = self.live(pool).get(rid) if pool in self.engines else None
        hashes = seq.req.hashes[:seq.pull_blocks]
        local = max(engine.kv.match(hashes), seq.floor)
        t = prefix_export_timeout_s(len(hashes) - local, engine.bs, engine.computed_tokens, engine.busy_s)
        if src is None:                                 # gone: the call fails at once
            self._no_export(engine, seq)
            return
        at = src.boundary()
        if at - self.now > t:
            self.prefix_export_timeouts += 1
            self.at(self.now + t, lambda: engine.exported(seq, seq.floor))
            return

        def answer() -> None:
            n = src.kv.match(hashes)
            if n >= max(engine.kv.match(hashes), seq.floor) + self.cfg.transfer.prefix_pull_min_blocks:
                if not self._more_from_fallback(engine, seq, n):
                    engine.exported(seq, n)
            else:                                       # it no longer holds them
                self._no_export(engine, seq)
        self.at(at, answer)

    def _more_from_fallback(self, engine: Engine, seq: Seq, got: int) -> bool:
        """A source answered with `got` blocks where the index says the fallback holds prefix_pull_min_blocks
        more (the source evicted part of them): ask the fallback for more than `got` (the pull it would replace
        stays pinned meanwhile). False when the fallback is not asked."""
        fb = seq.fallback
        if fb is None or fb[1] == engine.rid or \
                engine.usable(seq, fb[2]) < got + self.cfg.transfer.prefix_pull_min_blocks:
            return False
        seq.source, seq.fallback, seq.floor = fb, None, got
        seq.pull_blocks = engine._prefix_pull(seq)
        if not seq.pull_blocks:                         # not worth asking: pull what the first gave
            return False
        self.ask_export(engine, seq)
        return True

    @staticmethod
    def _no_export(engine: Engine, seq: Seq) -> None:
        """The source answered none or failed at once: the fallback holder next, by the same rule, if any (an
        answer an earlier source gave, seq.floor, is pulled when there is none)."""
        if seq.fallback is not None and seq.fallback[1] != engine.rid:
            seq.source, seq.fallback = seq.fallback, None
            engine.asking -= 1
            engine.add(seq)
        else:
            engine.exported(seq, seq.floor)

    def prefix_pull(self, engine: Engine, seq: Seq, tokens: int) -> None:
        """A prefix pull of `tokens` from another replica (its blocks are not pinned there: left out)."""
        nbytes = tokens * self.cost.kv_bytes_per_token
        seconds = PREFIX_PULL_OVERHEAD_S + nbytes / (self.cost.overheads.transfer_gbps * 1e9)
        self.prefix_pulls[0] += 1
        self.prefix_pulls[1] += tokens
        self.at(self.now + seconds, lambda: engine.prefix_pulled(seq, nbytes, seconds))

    def phase(self, pool: str, which: int, seconds: float, r: SimRequest) -> None:
        """A request's queue (which 0) or prefill (1) phase on an engine of `pool` (warm-up requests left out)."""
        if r.at >= 0:
            acc = self.phases[pool]
            acc[2 * which] += seconds
            acc[2 * which + 1] += 1

    def stepped(self, pool: str, start: float, alone: float, slow: float, steps: int = 1) -> None:
        """`steps` steps of an engine of `pool` that began at `start`, costing `alone` seconds alone and run `slow`
        times as slowly (warm-up steps, before 0, left out)."""
        if start >= 0:
            acc = self.steps[pool]
            acc[0] += alone * slow
            acc[1] += alone
            acc[2] += steps

    def add_itl(self, gap: float) -> None:
        self._itl_hist[_itl_bin_one(gap)] += 1

    def add_itls(self, gaps: np.ndarray, times: int = 1) -> None:
        """Each of `gaps`, `times` times. Binned in bulk (ITL_FLUSH gaps at a time, and when read): a decode run
        adds a few gaps, and binning them at once cost more in numpy calls than the run's own work."""
        self._itl_pending.append((gaps, times))
        self._itl_pending_n += len(gaps)
        if self._itl_pending_n >= ITL_FLUSH:
            self._flush_itls()

    def _flush_itls(self) -> None:
        if not self._itl_pending:
            return
        gaps = np.concatenate([g for g, _ in self._itl_pending])
        times = np.repeat(np.array([t for _, t in self._itl_pending], dtype=np.float64),
                          [len(g) for g, _ in self._itl_pending])
        # (whole counts summed in float64: exact, so the histogram is the one adding them one by one gives)
        self._itl_hist += np.bincount(_itl_bin(gaps), weights=times, minlength=len(self._itl_hist))
        self._itl_pending, self._itl_pending_n = [], 0

    @property
    def itl_hist(self) -> np.ndarray:
        """Every token gap so far as counts over ITL_BINS."""
        self._flush_itls()
        return self._itl_hist

    def finished(self, r: SimRequest) -> None:
        if r.ticket is not None:
            r.ticket.release(0)
        self.done.append(r)

    # -- run -------------------------------------------------------------------------------------------
    def run(self, requests: list[SimRequest]) -> None:
        """Every request through the cluster (their results land on them; `Tally.of` reads them)."""
        self.expected = len(requests)
        ov = self.cost.overheads
        free = -math.inf                                # when the serving path's serial part is next free
        for r in sorted(requests, key=lambda r: r.at) if ov.ingress_s else requests:
            at = max(r.at, free) if ov.ingress_s else r.at    # a burst's requests wait for each other's serial part
            free = at + ov.ingress_s
            if ov.stream_s:                             # the ingress's time grows with the streams it carries
                self.at(at, lambda r=r: self.at(self.now + ov.request_s + ov.stream_s * self.streams(),
                                                lambda: self.arrive(r)))
            else:
                self.at(at + ov.request_s, lambda r=r: self.arrive(r))
        end = self.horizon or (max((r.at for r in requests), default=0.0) + 3600.0)
        if self.scaler is not None:
            self.scaler.start()
        last_t, events, next_report = 0.0, 0, 0.0
        while self.queue:
            t, _, fn = heapq.heappop(self.queue)
            if t > end and len(self.done) >= len(requests):
                break
            self._account(t - last_t)
            last_t = self.now = t
            fn()
            events += 1
            if self.progress is not None and events % 200_000 == 0 and t >= next_report:
                self.progress(f"simulated {t:,.0f} s, {len(self.done):,}/{len(requests):,} requests done")
                next_report = t
            if len(self.done) >= len(requests) and (self.scaler is None or t > (self.horizon or 0)):
                break

    def _account(self, dt: float) -> None:
        if dt > 0:
            for p in self.pools:
                self.replica_seconds[p] += dt * len(self.engines[p])


class _Len:
    """The router reads len(token_ids) only: a length without the ids (a day of trace would not fit)."""
    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


_GREEDY = SamplingParams(temperature=0.0)
_REMOTE = object()          # the router only asks whether a request brings its KV


class _Scaler:
    """Serve's controller for the simulator: every metrics_interval_s each replica reports what
    EngineReplica.record_autoscaling_stats reports; each pool's policy sees the look-back averages."""

    def __init__(self, sim: Simulator):
        from ray.serve.config import AutoscalingConfig

        from cluster.autoscaling import CoupledPolicy, PoolPolicy, policy_kwargs
        self.sim = sim
        cfg = sim.cfg
        self.pools = [p for p in sim.pools if sim._pool(p).autoscaling is not None]
        kwargs = {p: policy_kwargs(p, sim._pool(p).autoscaling, cfg.coupling, None, sim.knobs[p]["max_num_seqs"])
                  for p in self.pools}                  # what build_app gives each pool's policy
        self.conf = {p: AutoscalingConfig(**sim._pool(p).deployment_options(kwargs[p])["autoscaling_config"])
                     for p in self.pools}
        self.interval = min(sim._pool(p).autoscaling.metrics_interval_s for p in self.pools)
        coupled = len(self.pools) == 2 and cfg.coupling.mode != "off"
        self.policy = CoupledPolicy() if coupled else {p: PoolPolicy(**kwargs[p]) for p in self.pools}
        self.state: dict[str, dict] = {p: {} for p in self.pools}
        self.samples: dict[str, deque] = {p: deque() for p in self.pools}
        self.busy_mark: dict[str, float] = {}

    def start(self) -> None:
        self.sim.at(self.interval, self.tick)

    def _report(self, e: Engine, now: float) -> dict[str, float]:
        then_busy = self.busy_mark.get(e.rid, 0.0)
        self.busy_mark[e.rid] = e.busy_s
        window = 30.0

        def p90(q: deque) -> float:
            while q and q[0][0] < now - window:
                q.popleft()
            return float(np.percentile(np.hstack([x for _, x in q]), 90)) if q else 0.0
        return {"queued_prefill_tokens": float(e.queued_prefill_tokens),
                "utilization": min((e.busy_s - then_busy) / self.interval, 1.0),
                "kv_utilization": e.kv.used / max(e.kv.total, 1), "running_seqs": float(e.ongoing()),
                "ttft_s": p90(e.ttfts), "itl_s": p90(e.itls)}

    def tick(self) -> None:
        from cluster.autoscaling_context import context
        sim, now = self.sim, self.sim.now
        contexts, metrics = {}, {}
        for p in self.pools:
            live = list(sim.live(p).values())
            self.samples[p].append((now, {e.rid: self._report(e, now) for e in live}))
            look = sim._pool(p).autoscaling.look_back_period_s
            while self.samples[p] and self.samples[p][0][0] < now - look:
                self.samples[p].popleft()
            agg: dict[str, dict[str, float]] = {}
            for _, reps in self.samples[p]:
                for rid, m in reps.items():
                    for k, v in m.items():
                        agg.setdefault(k, {}).setdefault(rid, []).append(v)
            rids = [e.rid for e in live]
            running = set(rids)
            metrics[p] = {k: {rid: float(np.mean(v)) for rid, v in d.items() if rid in running}
                          for k, d in agg.items()}
            n = sum(not e.stopping for e in sim.engines[p])
            contexts[p] = context(p, n, metrics[p], self.conf[p], self.state[p], now, rids)
        if isinstance(self.policy, dict):
            decisions = {}
            for p in self.pools:
                decisions[p], self.state[p] = self.policy[p](contexts[p])
        else:
            decisions, states = self.policy(contexts)
            self.state.update(states)
        for p, target in decisions.items():
            self._resize(p, int(target))
        sim.timeline.append({"t": now, **{f"{p}_replicas": sum(not e.stopping for e in sim.engines[p])
                                          for p in sim.pools}})
        if not (len(sim.done) >= sim.expected and now > (sim.horizon or 0)):
            sim.at(now + self.interval, self.tick)

    def _resize(self, pool: str, target: int) -> None:
        sim = self.sim
        alive = [e for e in sim.engines[pool] if not e.stopping]
        for _ in range(target - len(alive)):
            sim._add_engine(pool, sim.now + sim.startup_s)
        for _ in range(len(alive) - target):
            # the replica whose work costs least to move (fewest tokens in flight) goes; it takes no new work
            # and leaves when its sequences end
            victim = min((e for e in sim.engines[pool] if not e.stopping), key=lambda e: e.tokens_in_flight())
            victim.stopping = True
            sim.fleet_version += 1
            sim.index_of(pool).remove_replica(victim.rid)
            self._retire(victim)

    def _retire(self, e: Engine) -> None:
        sim = self.sim
        if e.ongoing() == 0 and not e.busy:
            sim.engines[e.pool].remove(e)
        else:
            sim.at(sim.now + 1.0, lambda: self._retire(e))


@dataclass
class Tally:
    """What a summary reads of a run: each request's times and tokens as arrays (NaN: none), and the run's
    counters. Small enough to come back from a worker process, and tallies add up (`merge`): the cells of a
    fleet (plan/cells.py) are summarized as one."""
    at: np.ndarray
    first: np.ndarray
    last: np.ndarray
    tokens: np.ndarray
    rejected: np.ndarray
    itl_hist: np.ndarray
    preemptions: int
    replica_seconds: dict[str, float]
    hits: dict[str, list[int]]                  # pool -> [query tokens, hit tokens]
    prefix_pulls: list[int]                     # pulls, tokens pulled
    prefix_export_timeouts: int
    timeline: list[dict[str, Any]]
    phases: dict[str, list]                      # Simulator.phases
    steps: dict[str, list]                       # Simulator.steps

    @classmethod
    def of(cls, requests: list[SimRequest], sim: Simulator) -> Tally:
        def times(xs) -> np.ndarray:
            return np.array([np.nan if x is None else x for x in xs], dtype=float)
        return cls(at=np.array([r.at for r in requests], dtype=float), first=times(r.first for r in requests),
                   last=times(r.last for r in requests), tokens=np.array([r.tokens for r in requests], dtype=np.int64),
                   rejected=np.array([r.rejected for r in requests], dtype=bool), itl_hist=sim.itl_hist.copy(),
                   preemptions=sim.preemptions, replica_seconds=dict(sim.replica_seconds),
                   hits={p: list(v) for p, v in sim.hits.items()}, prefix_pulls=list(sim.prefix_pulls),
                   prefix_export_timeouts=sim.prefix_export_timeouts, timeline=list(sim.timeline),
                   phases={p: list(v) for p, v in sim.phases.items()}, steps={p: list(v) for p, v in sim.steps.items()})

    @classmethod
    def merge(cls, parts: list[Tally]) -> Tally:
        """Runs side by side as one: requests pooled, counters summed, the replica timelines added up tick by
        tick (a run that stopped ticking counts its last sizes)."""
        if len(parts) == 1:
            return parts[0]
        keys = list(dict.fromkeys(k for t in parts for k in t.replica_seconds))
        timeline, nxt, last = [], [0] * len(parts), [{}] * len(parts)
        for now in sorted({x["t"] for t in parts for x in t.timeline}):
            row: dict[str, Any] = {"t": now}
            for i, t in enumerate(parts):
                while nxt[i] < len(t.timeline) and t.timeline[nxt[i]]["t"] <= now:
                    last[i], nxt[i] = t.timeline[nxt[i]], nxt[i] + 1
                for k, v in last[i].items():
                    if k != "t":
                        row[k] = row.get(k, 0) + v
            timeline.append(row)
        return cls(at=np.concatenate([t.at for t in parts]), first=np.concatenate([t.first for t in parts]),
                   last=np.concatenate([t.last for t in parts]), tokens=np.concatenate([t.tokens for t in parts]),
                   rejected=np.concatenate([t.rejected for t in parts]), itl_hist=sum(t.itl_hist for t in parts),
                   preemptions=sum(t.preemptions for t in parts),
                   replica_seconds={k: sum(t.replica_seconds.get(k, 0.0) for t in parts) for k in keys},
                   hits={p: [sum(t.hits[p][i] for t in parts) for i in (0, 1)] for p in parts[0].hits},
                   prefix_pulls=[sum(t.prefix_pulls[i] for t in parts) for i in (0, 1)],
                   prefix_export_timeouts=sum(t.prefix_export_timeouts for t in parts), timeline=timeline,
                   phases={p: [sum(t.phases[p][i] for t in parts) for i in range(4)] for p in parts[0].phases},
                   steps={p: [sum(t.steps[p][i] for t in parts) for i in range(3)] for p in parts[0].steps})

    def good(self, slo: tuple[float, float]) -> np.ndarray:
        """Which requests met both SLOs: first token within slo[0], mean gap (if it has gaps) within slo[1]."""
        done = ~np.isnan(self.first) & ~np.isnan(self.last)
        with np.errstate(invalid="ignore", divide="ignore"):
            itl = (self.last - self.first) / (self.tokens - 1)
        return done & (self.first - self.at <= slo[0]) & ((self.tokens <= 1) | (itl <= slo[1]))

    def summary(self, slo: tuple[float, float] | None = None, scale: float = 1.0) -> dict[str, Any]:
        """The run in `baton bench`'s terms (bench/cluster_bench.summarize): TTFT and ITL percentiles (ITL
        pooled over every token gap), goodput under SLOs when given, prefix hit rate, replica-seconds. `scale`:
        the fleet these requests are a sample of, in their multiples (its rates and replica-seconds)."""
        done = ~np.isnan(self.first) & ~np.isnan(self.last)
        ttft = self.first[done] - self.at[done]
        wall = (float(self.last[done].max()) if done.any() else 0.0) - min(0.0, float(self.at.min()) if len(self.at)
                                                                          else 0.0)

        def pct(a: np.ndarray) -> dict | None:
            return {f"p{q}": float(np.percentile(a, q)) * 1e3 for q in (50, 90, 99)} if len(a) else None
        out: dict[str, Any] = {"requests": len(self.at), "completed": int(done.sum()), "wall_s": wall,
                               "ttft_ms": pct(ttft), "itl_ms": hist_percentiles(self.itl_hist),
                               "output_tokens_per_s": int(self.tokens[done].sum()) / wall * scale if wall else 0.0,
                               "preemptions": self.preemptions,
                               "replica_seconds": {p: round(v * scale, 1) for p, v in self.replica_seconds.items()}}
        q = sum(v[0] for v in self.hits.values())
        out["prefix_hit_rate"] = sum(v[1] for v in self.hits.values()) / q if q else None
        out["prefix_pulls"], out["prefix_pulled_tokens"] = self.prefix_pulls
        out["prefix_export_timeouts"] = self.prefix_export_timeouts
        out["engine_phases_ms"] = phase_means(self.phases)
        out["engine_steps_s"] = {p: {"stepped": a, "alone": b, "steps": n} for p, (a, b, n) in self.steps.items() if b}
        out["rejected_429"] = int(self.rejected.sum())
        if slo is not None:
            ok = self.good(slo)
            good = int(ok.sum())
            out["goodput_rps"] = good / wall * scale if wall else 0.0
            out["slo_attainment"] = good / max(len(self.at), 1)
            # the requests that arrived in the last quarter of the arrivals' span: a queue that grows through the
            # run (a pool short of the load) shows there first
            late = self.at >= self.at.min() + 0.75 * (self.at.max() - self.at.min()) if len(self.at) else ok
            out["slo_attainment_last_quarter"] = int(ok[late].sum()) / max(int(late.sum()), 1)
        return out

    def ttft_points(self) -> list[tuple[float, float]]:
        seen = ~np.isnan(self.first)
        return list(zip(self.at[seen].tolist(), (self.first[seen] - self.at[seen]).tolist()))


def phase_means(phases: dict[str, list]) -> dict[str, dict[str, float | int | None]]:
    """pool -> the mean queue and prefill phase in ms and how many requests each holds, from
    [queue seconds, queue count, prefill seconds, prefill count] (pools with none left out): the replicas'
    phase histograms read the same way (plan/calibrate.py phase_sums)."""
    return {p: {"queue": q / nq * 1e3 if nq else None, "queued": int(nq),
                "prefill": f / nf * 1e3 if nf else None, "prefilled": int(nf)}
            for p, (q, nq, f, nf) in phases.items() if nq or nf}


def hist_percentiles(hist: np.ndarray) -> dict | None:
    total = hist.sum()
    if total == 0:
        return None
    cum = np.cumsum(hist) / total
    mids = np.sqrt(ITL_BINS[:-1] * ITL_BINS[1:])
    return {f"p{q}": float(mids[min(np.searchsorted(cum, q / 100), len(mids) - 1)]) * 1e3 for q in (50, 90, 99)}


def simulate(config: ClusterConfig, cost: Cost, requests: list[SimRequest], slo: tuple[float, float] | None = None,
             warm: list[SimRequest] = (), **kw: Any) -> dict[str, Any]:
    """One run: the summary (Tally.summary's fields) of `requests` on `config`, the clock's 0 being the first
    request's start (`warm`: requests before it, at negative times, left out of the summary; ITL percentiles
    count theirs too). The requests are copied, so one list can run on several configs."""
    tally = run_tally(config, cost, requests, warm, **kw)
    return {**tally.summary(slo), "timeline": tally.timeline, "ttft_points": tally.ttft_points()}


def run_tally(config: ClusterConfig, cost: Cost, requests: list[SimRequest], warm: list[SimRequest] = (),
              **kw: Any) -> Tally:
    """One run on copies of the requests (`warm` first, left out of the tally): its Tally."""
    warm = [replace(r, first=None, last=None, tokens=0) for r in warm]
    requests = [replace(r, first=None, last=None, tokens=0) for r in requests]
    sim = Simulator(config, cost, **kw)
    sim.run([*warm, *requests])
    return Tally.of(requests, sim)
