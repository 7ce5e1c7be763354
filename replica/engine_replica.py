"""EngineReplica: what a replica of either pool is: one engine (AsyncLLM), its KVLink, KV events shipped
to the cluster state actor, load stats for the request routers, and its Prometheus metrics.

With tensor_parallel_size > 1 the replica is rank 0 and its TP workers are Ray actors in its placement group
(replica/tp_workers.py); a worker that dies fails the replica: its health check raises and its requests fail
as TPWorkerError, which the ingress treats as the replica dying.

The prefill pool's PrefillServer and the decode pool's DecodeServer subclass it. Requests and answers
are the typed messages of replica/messages.py; KV events cross as msgpack. The cluster state actor
(router/cluster_state.py) is reached by name, never imported: a replica registers there once, with its
transport's metadata, and a consumer meeting a producer's agent for the first time asks it for them.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from typing import Any

from engine import EngineConfig, LLMEngine, RemotePrefill, faults
from engine.async_llm import AsyncLLM
from engine.errors import InvalidRequestError
from engine.kv_events import KVEvent, encode_events
from engine.outputs import RequestOutput
from engine.parallel import TPWorkerError
from kvtransfer import KVHandoff, KVLink
from kvtransfer.config import TransferConfig, prefix_export_timeout_s, prefix_pull_pays
from replica.messages import Embedding, PoolRequest, PrefixExport
from replica.metrics import LatencyWindow, ReplicaMetrics
from replica.names import get_state_actor

log = logging.getLogger(__name__)

PUBLISH_INTERVAL_S = 0.01       # KV events and unpins: the router's index lags by about this much
LATENCY_WINDOW_S = 10.0         # the TTFT / ITL quantiles the autoscaler sees cover this much recent time
REPORT_INTERVAL_S = 0.5         # metrics text to the state actor (the ingress /metrics shows it)
DRAIN_POLL_S = 0.5              # a draining replica learns it is being stopped within about this long
MIGRATION_POLL_S = 5.0          # ... and that its node is draining (Serve's PENDING_MIGRATION) within this long
PEER_TIMEOUT_S = 10.0           # asking the state actor for a producer's transfer metadata (once per producer)
TP_FAILURE_GRACE_S = 3.0        # a failed step waits this long for Ray to report a dead TP worker (about 1 s)
RESERVE_MARGIN_S = 2.0          # an import must start this long before its hand-off's lease ends


def replica_id() -> str:
    """Serve's id of this replica (what the request routers see), or a fresh one outside Serve."""
    try:
        from ray import serve
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return uuid.uuid4().hex[:8]


class EngineReplica:
    pool = ""

    def __init__(self, engine: EngineConfig, transfer: TransferConfig, state_actor: str, served_model_name: str):
        self.replica = replica_id()
        self.served_model_name = served_model_name
        self._events: list[KVEvent] = []
        self._events_lock = threading.Lock()
        self._bg_wake = threading.Event()               # set by the engine thread when it emits a KV event
        self._seq = 0
        # built on the engine's own thread, which runs every step and call (engine/async_llm.py says why)
        self.llm = (ReplicaLLM if engine.tensor_parallel_size > 1 else AsyncLLM)(
            build=lambda: LLMEngine(engine, on_kv_event=self._on_event))
        self.engine = eng = self.llm.engine
        self.link = KVLink(eng, f"{self.pool}.{self.replica}", kind=transfer.backend,
                           peer_metadata=self._peer_metadata, ttl_s=transfer.ttl_s)
        self.transfer = transfer
        self._pool_handles: dict[str, Any] = {}          # pool -> deployment handle, for prefix pulls
        self._withdrawals: set[asyncio.Future] = set()   # prefix exports being withdrawn (held till done)
        self._pulled = [0, 0.0]                         # bytes and seconds of this replica's prefix pulls
        self.metrics = ReplicaMetrics(self.pool, self.replica, self)
        self.ttft = LatencyWindow(LATENCY_WINDOW_S)      # arrival -> first token at this replica
        self.itl = LatencyWindow(LATENCY_WINDOW_S)       # between a sequence's tokens
        self._busy_mark = (time.monotonic(), 0.0)       # (when, engine busy seconds then): utilisation
        self._state_name, self._state = state_actor, None   # found lazily: the app's `state` deployment creates it
        self._closed = False
        self._bg = threading.Thread(target=self._background, name="baton-replica-bg", daemon=True)
        self._bg.start()
        log.info("%s replica %s ready: %s", self.pool, self.replica, self.engine.compat_key())

    # -- model facts for the ingress ------------------------------------------------------------------
    def model_info(self) -> dict:
        e = self.engine
        return {"model_key": e.model_key, "block_size": e.block_size, "max_model_len": e.max_model_len,
                "vocab_size": e.hf_config.vocab_size, "kv_blocks_total": e.pool.num_blocks,
                "eos_token_ids": sorted(e.eos_ids), "default_sampling": dict(e.generation.sampling),
                "model_path": e.model_path, "served_model_name": self.served_model_name,
                "hidden_size": e.hf_config.hidden_size, "pooling_type": e.pooling.type,
                "matryoshka": e.pooling.matryoshka}

    async def load_lora(self, lora) -> dict:
        """Load and check a LoRA adapter (engine.lora.LoRARequest) into this replica's host cache (in a thread:
        it reads files; the engine lock is not taken); raises engine.lora.LoRAError naming what is wrong.
        Returns its key (the KV namespace)."""
        await run_blocking(self.engine.load_lora, lora)
        return {"key": lora.key}

    async def embed(self, req: PoolRequest) -> Embedding:
        """An embedding request (req.pooling): its prompt computed here, batched with this replica's other work,
        and pooled (engine/pooling.py). Nothing is handed off; its blocks stay in the prefix cache."""
        out = None
        async for out in self.llm.generate(req.token_ids, None, req.request_id, block_hashes=req.block_hashes,
                                           lora_request=req.lora, priority=req.priority, pooling=req.pooling):
            pass
        self.metrics.observe_finished(out.metrics, req.lora, len(req.token_ids), 0, prefilled=True)
        return Embedding(self.replica, out.embedding, len(req.token_ids), out.metrics.num_cached_tokens)

    # -- prefix pulls: reuse of a prompt's prefix cached on another prefill replica --------------------------
    async def export_prefix(self, req: PrefixExport) -> KVHandoff | None:
        """Another replica pulls a prompt's prefix from here: the hand-off of its leading blocks cached on this
        replica's device, pinned until pulled or expired; None when fewer than req.min_blocks are."""
        def export(_engine: LLMEngine) -> KVHandoff | None:
            return self.link.export_prefix(req.pin_id, req.block_hashes, req.token_ids, req.min_blocks)
        return await run_blocking(self.llm.call, export)

    async def withdraw_prefix(self, req: PrefixExport) -> None:
        """The replica that asked for req.pin_id's export will not pull it (another source gave it more): unpin
        those blocks now rather than when the lease expires."""
        await run_blocking(self.llm.call, lambda _engine: self.link.withdraw(req.pin_id))

    async def prefix_remote(self, req: PoolRequest) -> RemotePrefill | None:
        """For a prompt this replica is about to prefill: a prefix pull from req.prefix_source (the replica, of
        either pool, the router's index says caches most of it), or None to compute it all. A pull must bring
        transfer.prefix_pull_min_blocks beyond what this replica caches, and be estimated faster than
        computing them: PREFIX_PULL_OVERHEAD_S + bytes / bandwidth (this replica's measured pulls, else
        transfer.prefix_pull_gbps) against tokens / this engine's measured compute rate. The source's answer is
        waited for as long as kvtransfer.config.prefix_export_timeout_s says. req.prefix_fallback, the other
        pool's best holder, is asked next when the first source answers that it no longer holds the blocks (the
        index lags its evictions) or fails at once, when this replica itself is named first (its own cache is
        what a pull is counted against), and when the first answers with fewer blocks than the index says the
        fallback holds (it evicted part of them): then the fallback must bring prefix_pull_min_blocks more than
        that answer, and the pull it replaces is withdrawn."""
        if req.prefix_source is None or not self.transfer.prefix_pull or req.resume is not None:
            return None
        best: tuple[RemotePrefill, str, PrefixExport] | None = None       # (pull, its pool, what was asked)
        for n, src in enumerate((req.prefix_source, req.prefix_fallback)):
            if src is None:
                break
            if src[1] == self.replica:
                continue
            got = len(best[0].block_hashes) if best is not None else 0
            if best is not None and self._usable(req, src[2]) < got + self.transfer.prefix_pull_min_blocks:
                break                               # the fallback holds no more than the first gave
            remote, ask_next, ask = await self._prefix_from(req, src, f"{req.request_id}-prefix{n or ''}", got)
            if remote is not None:
                if best is not None:                # the fallback gave more: the first's pin is not needed
                    self._withdraw(best[1], best[2])
                best = (remote, src[0], ask)
            elif best is None and not ask_next:
                return None
        return best[0] if best is not None else None

    def _usable(self, req: PoolRequest, blocks: int) -> int:
        """Of `blocks` leading blocks a source holds, those a pull may bring: the last prompt token is computed."""
        return min(blocks, (len(req.token_ids) - 1) // self.engine.block_size, len(req.block_hashes))

    async def _prefix_from(self, req: PoolRequest, src: tuple[str, str, int], pin_id: str, floor: int = 0
                           ) -> tuple[RemotePrefill | None, bool, PrefixExport | None]:
        """One source's answer to prefix_remote: the pull (of more than `floor` blocks, what an earlier answer
        gave), or None and whether another source may be asked; and the request made, if any."""
        pool, source, blocks = src
        bs = self.engine.block_size
        usable = self._usable(req, blocks)
        hashes, ids = req.block_hashes[:usable], req.token_ids[:usable * bs]
        # read without the engine's lock (find only reads): an engine call waits for the step in progress, a
        # long prefill's seconds on a slow device; a count off by a racing step only moves the estimate, and
        # the scheduler matches the prefix again when it reserves the blocks
        local = max(len(self.engine.pool.find(hashes, ids)), floor)
        gain = usable - local
        if gain < self.transfer.prefix_pull_min_blocks:
            return None, False, None
        if not self._pull_pays(gain):
            self.metrics.prefix_pull("computed")
            return None, False, None
        ask = PrefixExport(pin_id, hashes, ids, local + self.transfer.prefix_pull_min_blocks, source)
        wait_s = prefix_export_timeout_s(gain, bs, self.engine.num_computed_tokens_total,
                                         self.engine.busy_seconds_total)
        try:
            handoff = await asyncio.wait_for(self._pool_handle(pool).export_prefix.remote(ask), wait_s)
        except Exception as e:                      # noqa: BLE001 - the source is gone or slow: compute it
            log.warning("%s replica %s: prefix export from %s replica %s failed (%s)", self.pool, self.replica,
                        pool, source, type(e).__name__)
            self.metrics.prefix_pull("failed")
            return None, not isinstance(e, asyncio.TimeoutError), ask    # (waited as long as computing takes)
        if handoff is None:
            self.metrics.prefix_pull("none")
            return None, True, ask
        h = handoff.handle
        return RemotePrefill(handoff, h.block_hashes, None, None, deadline=h.expiry - RESERVE_MARGIN_S,
                             num_tokens=h.num_tokens), False, ask

    def _withdraw(self, pool: str, ask: PrefixExport) -> None:
        """Tell a source its export will not be pulled (in the background; its lease ends it anyway)."""
        async def withdraw() -> None:
            try:
                await self._pool_handle(pool).withdraw_prefix.remote(ask)
            except Exception as e:                  # noqa: BLE001 - gone: nothing of it to unpin
                log.info("%s replica %s: withdrawing prefix export %s failed (%s)", self.pool, self.replica,
                         ask.pin_id, type(e).__name__)
        task = asyncio.ensure_future(withdraw())
        self._withdrawals.add(task)
        task.add_done_callback(self._withdrawals.discard)

    def observe_prefix_pull(self, m) -> int:
        """After a request added with a prefix pull: count it, and learn the bandwidth. Returns tokens pulled."""
        if not m.kv_transferred:
            self.metrics.prefix_pull("failed")
            return 0
        nbytes, tokens = m.kv_transfer_blocks * self.link.transport.block_bytes, m.kv_transfer_blocks * self.engine.block_size
        self._pulled = [self._pulled[0] + nbytes, self._pulled[1] + m.kv_transfer_seconds]
        self.metrics.observe_transfer(nbytes, m.kv_transfer_seconds)
        self.metrics.prefix_pull("pulled", tokens)
        return tokens

    def _pull_pays(self, blocks: int) -> bool:
        e = self.engine
        return prefix_pull_pays(blocks, self.link.transport.block_bytes, e.block_size, self._pulled,
                                self.transfer.prefix_pull_gbps, e.num_computed_tokens_total, e.busy_seconds_total)

    def _pool_handle(self, pool: str):
        """A handle to one of the app's pools (made on first use)."""
        if pool not in self._pool_handles:
            from ray import serve
            self._pool_handles[pool] = serve.get_deployment_handle(pool, serve.get_replica_context().app_name)
        return self._pool_handles[pool]

    # -- routing stats (Serve polls record_routing_stats) ---------------------------------------------
    async def record_routing_stats(self) -> dict[str, Any]:
        return await run_blocking(self.llm.call, _load)

    # -- autoscaling signals (Serve polls record_autoscaling_stats; cluster/autoscaling.py reads them) ----
    async def record_autoscaling_stats(self) -> dict[str, float]:
        load = await run_blocking(self.llm.call, _load)
        (then, busy_then), now = self._busy_mark, time.monotonic()
        self._busy_mark = (now, load["busy_seconds"])
        utilization = min((load["busy_seconds"] - busy_then) / max(now - then, 1e-3), 1.0)
        return {"queued_prefill_tokens": float(load["queued_prefill_tokens"]), "utilization": utilization,
                "kv_utilization": load["kv_blocks_used"] / max(load["kv_blocks_total"], 1),
                "running_seqs": float(load["num_running"] + load["num_waiting"]),
                "tokens_in_flight": float(load["tokens_in_flight"]),
                "ttft_s": self.ttft.quantile(0.9), "itl_s": self.itl.quantile(0.9)}

    # -- KV events and unpins, off the request path ---------------------------------------------------
    def _on_event(self, event: KVEvent) -> None:          # engine thread
        with self._events_lock:
            self._events.append(event)
        self._bg_wake.set()

    def _state_actor(self):
        try:
            return get_state_actor(self._state_name)
        except ValueError:                  # not created yet
            return None

    def _find_state(self) -> None:
        import ray
        state = self._state_actor()
        if state is None:
            return
        ray.get([state.register.remote(self.pool, self.replica, 0),
                 *(state.register_transfer_metadata.remote(name, md) for name, md in self.link.rank_metadata())])
        self._state = state

    def _background(self) -> None:
        """KV events to the state actor, unpins of pulled exports, metrics reports. While busy it runs every
        PUBLISH_INTERVAL_S; idle, it sleeps until the engine emits a KV event or the next report is due (no
        polling, nor engine-lock traffic, while nothing is cached, freed or pinned for an export)."""
        import ray
        last_report, report = 0.0, None
        while not self._closed:
            try:
                if self._state is None:
                    self._find_state()
                if self.engine.kv.pinned:             # exports a consumer may have pulled by now
                    self.llm.call(lambda _: self.link.release_finished())
                self._publish()
                if report is not None and ray.wait([report], timeout=0)[0]:    # answered: reading it never waits
                    ref, report = report, None
                    if ray.get(ref):                                        # the index entry went stale
                        self._resync()
                if report is None and time.monotonic() - last_report > REPORT_INTERVAL_S and self._state is not None:
                    last_report = time.monotonic()
                    report = self._state.report.remote(self.pool, self.replica, self.metrics.exposition(), self._seq)
            except ray.exceptions.RayActorError:
                # the state actor ended with its owner (the state replica moved off a draining node): find its
                # successor by name and register again; the next report finds the entry behind and resyncs
                log.warning("%s replica %s: the cluster state actor is gone; registering with its successor",
                            self.pool, self.replica)
                self._state, report = None, None
                time.sleep(0.5)
            except Exception:                                  # noqa: BLE001 - keep serving, say why
                log.exception("%s replica %s: background loop", self.pool, self.replica)
            time.sleep(PUBLISH_INTERVAL_S)                     # batches events: one publish per interval at most
            self._bg_wake.clear()                              # before the check: an event after it wakes the wait
            if not self._events and not self.engine.kv.pinned:
                self._bg_wake.wait(max(0.0, last_report + REPORT_INTERVAL_S - time.monotonic()))

    def _publish(self) -> None:
        with self._events_lock:
            events, self._events = self._events, []
        if self._state is None:
            with self._events_lock:              # keep them for when the state actor is found
                self._events[:0] = events
            return
        if events:
            self._seq += 1          # Ray runs one caller's calls to an actor in order: no gaps unless lost
            if faults.fire("kv_events_drop"):
                return
            self._state.publish.remote(self.pool, self.replica, self._seq, encode_events(events))

    def _resync(self) -> None:
        """A batch of events was lost: send the whole cache as the next batch (cleared + stored), taken
        under the engine lock so that no event falls between the snapshot and the batches after it."""
        def snapshot(engine: LLMEngine) -> tuple[int, bytes]:
            with self._events_lock:
                self._events.clear()                       # the snapshot subsumes them
                self._seq += 1
                return self._seq, encode_events(engine.pool.snapshot_events())
        seq, events = self.llm.call(snapshot)
        self._state.resync.remote(self.pool, self.replica, seq, events)
        # the state actor says why (events lost, or this replica forgotten: silent, or dropped by Serve's replica set,
        # as at an app's deletion)
        log.info("%s replica %s: the index asked for a resync; sent the whole cache", self.pool, self.replica)

    # -- transfer peers: a producer's metadata, asked once per agent (the transport caches it) ------------
    def _peer_metadata(self, agent: str) -> bytes:
        """The transport asks this at its first pull from a producer process (under the engine lock, like the
        pull itself): one round trip to the state actor per producer, then the transport's peer table serves."""
        import ray
        state = self._state or self._state_actor()
        metadata = None if state is None else ray.get(state.transfer_metadata.remote(agent), timeout=PEER_TIMEOUT_S)
        if metadata is None:
            raise LookupError(f"no transfer metadata registered for {agent}")
        return metadata

    def stats(self) -> dict:
        return {**self.llm.stats(), **self.link.stats(), **self.metrics.transfer_stats()}

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising gets the replica replaced, with its placement
        group and TP workers (they are its children)."""
        if not self.llm._thread.is_alive():
            raise RuntimeError("the engine thread died")
        if (failure := tp_failure(self.engine)) is not None:
            raise failure

    def __del__(self):
        """Serve calls this once the replica's requests have ended (a drain ends a decode replica's streams by
        handing them over): keep the process, and its pinned blocks, until consumers have pulled them or
        their lease has run out, so no hand-off in flight loses its source."""
        if getattr(self, "link", None) is None:        # __init__ failed part-way: nothing was pinned
            return
        deadline = time.monotonic() + self.link.ttl_s + 1.0
        while self.llm.call(lambda e: bool(e.kv.pinned)) and time.monotonic() < deadline:
            self.llm.call(lambda _: self.link.release_finished())
            time.sleep(0.05)
        self._closed = True


def tp_failure(engine: LLMEngine) -> TPWorkerError | None:
    """Why this engine's TP group cannot run steps (a worker died, or a step failed), or None."""
    executor = engine.executor
    dead = [h.rank for h in executor.workers if not h.alive()]
    if dead:
        return TPWorkerError(f"tensor-parallel worker rank(s) {dead} died: the replica must be replaced")
    return executor.failure


class ReplicaLLM(AsyncLLM):
    """AsyncLLM whose requests fail as TPWorkerError when the TP group breaks under them, which the ingress
    treats as the replica dying (503; retried elsewhere before the first token, router/orchestrator.py). A
    killed worker breaks rank 0's collective (gloo: at once) a moment before Ray reports the actor dead, so a
    failed request waits up to TP_FAILURE_GRACE_S for that report before it counts as a plain error."""

    async def generate(self, *args: Any, **kwargs: Any):
        try:
            async for out in super().generate(*args, **kwargs):
                yield out
        except InvalidRequestError:                    # the request's own fault, refused before any step
            raise
        except Exception as e:
            failure = await self._tp_failure_after(e)
            if failure is None:
                raise
            raise failure from e

    async def _tp_failure_after(self, e: Exception) -> TPWorkerError | None:
        if isinstance(e, TPWorkerError):
            return e
        deadline = time.monotonic() + TP_FAILURE_GRACE_S
        while (failure := tp_failure(self.engine)) is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return failure


def _load(engine: LLMEngine) -> dict[str, Any]:
    """What the routers weigh: prompt tokens not yet computed, sequences, KV use (under the engine lock)."""
    s = engine.scheduler
    queued = sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in (*s.waiting, *s.running)
                 if seq.remote is None)                    # an import's prompt comes computed
    # imports (decode) wait among the waiting, for KV room or for their K/V to arrive
    lora = engine.runner.lora
    return {"queued_prefill_tokens": queued, "num_running": len(s.running), "num_waiting": len(s.waiting) + len(s.loading),
            "kv_blocks_used": engine.pool.num_used_blocks, "kv_blocks_total": engine.pool.num_blocks,
            "busy_seconds": engine.busy_seconds_total, "time": time.time(),
            "tokens_in_flight": sum(seq.num_tokens for seq in engine.requests.values()),   # what a stop moves
            # the LoRA adapters it holds (keys): one it lacks costs a load (RouterConfig.lora_load_cost_tokens)
            "loras": lora.keys() if lora is not None else []}


async def export_pinned(llm: AsyncLLM, link: KVLink, out: RequestOutput, hashes: list[int] | None = None) -> KVHandoff:
    """The hand-off of a finished request's pinned blocks (KVLink.export, off the event loop: the Ray fallback
    copies there). The pin never outlives its use: an export that fails is withdrawn at once, and so is one
    whose caller leaves meanwhile. The export is shielded from that cancellation, since a thread-pool job
    cancelled before it starts would leave the blocks pinned with no lease to ever end them."""
    def withdraw(_engine: LLMEngine) -> None:
        link.withdraw(out.request_id)

    job = asyncio.ensure_future(run_blocking(link.export, out, hashes))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:          # nobody will pull it: withdraw it once the export has ended
        loop = asyncio.get_running_loop()
        job.add_done_callback(lambda _: loop.run_in_executor(None, llm.call, withdraw))
        raise
    except Exception:
        await run_blocking(llm.call, withdraw)
        raise


async def run_blocking(fn, *args):
    """Engine-lock calls from asyncio code: in a thread, so an engine step never stalls the event loop."""
    return await asyncio.to_thread(fn, *args)
