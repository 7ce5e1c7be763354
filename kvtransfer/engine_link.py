"""KVLink: one engine's side of the baton pass, the glue between an LLMEngine and its KV transport.

    prefill replica                                  decode replica
    engine.add_request(..., prefill_only=True)
    out = <step until finished>
    handoff = link.export(out, hashes) - handoff -> engine.add_request(ids, params, rid, remote=RemotePrefill(
                                                          source=handoff, block_hashes=..., first_token=...,
                                                          deadline=...))
                                                     the scheduler reserves blocks when there is room and
                                                     calls link.start_load(...); each step polls
                                                     link.finished_loads()
    link.release_finished()  <- notification ---     (the producer unpins)

On the decode side KVLink is the engine's KVConnector (engine/kv_connector.py): leading blocks the
engine's own prefix cache holds are not pulled. The handle's block hashes must equal the prompt's,
so a handle never fills the blocks of another prompt. In a cluster both sides take the request's
hashes (computed once, at the ingress) and hash nothing themselves. A cancelled load keeps its blocks until its
transfer has ended (finished_loads reports it, then the engine frees them).

Tensor parallelism (kvtransfer/transport.py): each rank has a transport over its own cache shard. Rank 0's
is `transport`, the workers' are made on the workers (collective_rpc) and kept in the worker object's
`kv_links` dict (link name -> RankPulls). Only rank 0 exports (every rank's agent, and for the Ray fallback
every rank's payload) and holds leases; every rank pulls its own heads, and a load is done once all are
(then rank 0 tells the producer). Workers cannot reach the state actor: rank 0 resolves the producer
agents' metadata (cached) and sends it with each pull. At TP 1 none of this runs.

Threads: the transport is used under the link's own lock (NIXL's agent is not thread-safe). The
connector calls come from the engine's thread under the engine's lock; release_finished is the
caller's to serialise with its engine loop (AsyncLLM.call): the lock order is always engine, then link.
A worker runs the link's calls one at a time, between steps (TPWorker.call).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.block_hash import block_hashes as hash_blocks
from engine.kv_layout import KVHeadLayout
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from kvtransfer import make_transport
from kvtransfer.config import TransferConfig
from kvtransfer.errors import KVTransferError
from kvtransfer.handoff import KVHandoff
from kvtransfer.rank_pulls import FAILED, RankPulls
from kvtransfer.transport import KVTransport, Pull

log = logging.getLogger(__name__)


class KVLink:
    def __init__(self, engine: LLMEngine, name_prefix: str, kind: str = "nixl",
                 peer_metadata: Callable[[str], bytes] | None = None, ttl_s: float = TransferConfig.model_fields["ttl_s"].default,
                 clock: Callable[[], float] = time.time, **options):
        self.engine, self.ttl_s = engine, ttl_s
        self._lock = threading.Lock()
        self._loads: dict[str, Pull] = {}            # request id -> its pull in flight (cancelled ones too)
        tp = engine.executor.tp_size
        if tp > 1:          # this rank's heads of the model's (engine/kv_layout.py)
            options = {**options, "layout": KVHeadLayout(engine.runner.model.total_kv_heads, tp), "rank": 0}
        self.transport = make_transport(engine.runner.kv_cache, name_prefix, engine.compat_key(), kind=kind,
                                        peer_metadata=peer_metadata, clock=clock, **options)
        self.ranks = TPRanks.open(engine, self.transport, name_prefix, kind, options) if tp > 1 else None
        engine.attach_kv_connector(self)

    @property
    def name(self) -> str:
        return self.transport.name

    def metadata(self) -> bytes:
        with self._lock:
            return self.transport.metadata()

    def rank_metadata(self) -> list[tuple[str, bytes]]:
        """(transport name, metadata) of every rank, rank 0 first: each must be registered where
        consumers look producers up (the cluster state actor)."""
        if self.ranks is None:
            return [(self.name, self.metadata())]
        return list(self.ranks.metadata)

    # -- producer ---------------------------------------------------------------------------------
    def export(self, out: RequestOutput, hashes: list[int] | None = None) -> KVHandoff:
        """The hand-off of a finished prefill_only request's pinned prompt blocks, or of a migrated one's
        (prompt + outputs[:-1]). `hashes`: those tokens' full-block hashes as the request carries them
        (hashed here only when not given). The Ray fallback copies the blocks out here: call it off the
        event loop."""
        if not out.finished or not out.kv_blocks:
            raise KVTransferError(f"request {out.request_id} holds no pinned prompt blocks to export")
        ids, bs = out.prompt_token_ids, self.engine.block_size
        if out.finish_reason == "migrated":
            ids = ids + out.token_ids[:-1]
        hashes = hash_blocks(ids, bs, self.engine.model_key) if hashes is None else list(hashes)
        if len(hashes) != len(ids) // bs:
            raise KVTransferError(f"{len(hashes)} block hashes for a prompt of {len(ids) // bs} full blocks")
        if self.ranks is not None:
            return self.ranks.export(self._lock, out.request_id, out.kv_blocks, hashes, len(ids), self.ttl_s)
        with self._lock:
            return self.transport.export(out.request_id, out.kv_blocks, hashes, len(ids), self.ttl_s)

    def export_prefix(self, pin_id: str, hashes: list[int], token_ids: list[int],
                      min_blocks: int = 1) -> KVHandoff | None:
        """A prefix pull's source side: pin the leading blocks of `hashes` (a prompt's full-block hashes, its
        `token_ids` checked) this engine caches on the device and hand them off under `pin_id`, as a prefill's
        blocks are (lease, notification, expiry). None when fewer than `min_blocks` are cached here. Call it
        under the engine lock (AsyncLLM.call)."""
        blocks = self.engine.pin_prefix(pin_id, hashes, token_ids)
        if len(blocks) < max(min_blocks, 1):
            if blocks:
                self.engine.release_pinned(pin_id)
            return None
        n, bs = len(blocks), self.engine.block_size
        try:
            if self.ranks is not None:
                return self.ranks.export(self._lock, pin_id, blocks, list(hashes[:n]), n * bs, self.ttl_s)
            with self._lock:
                return self.transport.export(pin_id, blocks, list(hashes[:n]), n * bs, self.ttl_s)
        except BaseException:
            self.engine.release_pinned(pin_id)
            raise

    def withdraw(self, request_id: str) -> None:
        """A pinned request nobody will pull (its export failed, or its caller left before the hand-off went
        out): end its lease, if it got one, and unpin its blocks now. Call it under the engine lock (AsyncLLM.call)."""
        with self._lock:
            self.transport.withdraw(request_id)
        self.engine.release_pinned(request_id)

    def release_finished(self) -> list[str]:
        """Unpin the prompts consumers have pulled (or that expired); call it from the engine loop."""
        with self._lock:
            done = self.transport.poll()
        for request_id in done:
            self.engine.release_pinned(request_id)
        return done

    # -- consumer: the engine's KVConnector ---------------------------------------------------------
    def start_load(self, request_id: str, source: KVHandoff, block_ids: list[int], block_hashes: list[int],
                   num_tokens: int, skip_blocks: int) -> None:
        """Start pulling the blocks of the handoff `source` past the `skip_blocks` cached here."""
        handle = source.handle
        if handle.num_tokens != num_tokens or len(handle.block_ids) != len(block_ids):
            raise KVTransferError(f"handle {handle.request_id} covers {handle.num_tokens} tokens in "
                                  f"{len(handle.block_ids)} blocks, not this prompt's {num_tokens}")
        if handle.block_hashes != block_hashes:
            raise KVTransferError(f"handle {handle.request_id} was made for another prompt (block hashes differ)")
        with self._lock:
            if self.ranks is not None:
                self.ranks.start(request_id, source, block_ids, skip_blocks)
                return
            self._loads[request_id] = self.transport.start_pull(source, block_ids, skip_blocks=skip_blocks)

    def finished_loads(self) -> tuple[list[str], dict[str, str]]:
        done, failed = [], {}
        with self._lock:
            if self.ranks is not None:
                return self.ranks.finished()
            for request_id, pull in list(self._loads.items()):
                try:
                    if not pull.done():
                        continue
                    done.append(request_id)
                except KVTransferError as e:        # failed: nothing writes into the blocks any more
                    failed[request_id] = str(e)
                del self._loads[request_id]
        return done, failed

    def cancel_load(self, request_id: str) -> None:
        """Nothing to do: a READ cannot be recalled; finished_loads reports it once it has ended."""

    def stats(self) -> dict:
        with self._lock:
            return self.transport.stats()

    def close(self) -> None:
        with self._lock:
            if self.ranks is not None:
                self.ranks.close()
            self.transport.close()


# -- tensor parallelism: the workers' transports, driven from rank 0 ---------------------------------------
@dataclass
class TPLoad:
    """A TP consumer's load of one hand-off: which ranks' pulls have not ended, which failed."""
    request_id: str                     # the consumer's
    handoff: KVHandoff
    in_flight: set[int]
    failed: list[int] = field(default_factory=list)


@dataclass
class TPRanks:
    """Rank 0's view of a TP engine's per-rank transports (rank 0's is the KVLink's own), under its lock."""
    engine: LLMEngine
    transport: KVTransport                                    # rank 0's
    metadata: list[tuple[str, bytes]]                         # every rank's (name, metadata), rank 0 first
    loads: dict[str, TPLoad] = field(default_factory=dict)    # handle's request id -> the load
    peers: dict[str, bytes] = field(default_factory=dict)     # producer agent -> its metadata (cache)

    @classmethod
    def open(cls, engine: LLMEngine, transport: KVTransport, name_prefix: str, kind: str, options: dict) -> "TPRanks":
        """Make every worker's transport, rank 0 being given the KVLink's. Workers get no peer_metadata
        and the default clock (what they are sent must be picklable)."""
        _links(engine.executor.driver)[transport.name] = RankPulls(transport)
        worker_options = {k: v for k, v in options.items() if k not in ("layout", "rank")}
        metadata = engine.executor.collective_rpc(_open_rank, transport.name, name_prefix, engine.compat_key(),
                                                  kind, transport.layout, worker_options)
        return cls(engine, transport, metadata)

    @property
    def key(self) -> str:
        return self.transport.name

    def export(self, lock: threading.Lock, request_id: str, block_ids: list[int], hashes: list[int],
               num_tokens: int, ttl_s: float) -> KVHandoff:
        """Rank 0 exports for every rank; the Ray fallback's payload is every rank's copy of its shard
        (copied outside the lock: workers copy theirs between steps)."""
        payloads = None
        if self.transport.kind == "ray":
            payloads = self.engine.executor.collective_rpc(_shard_payload, self.key, block_ids)
        with lock:
            return self.transport.export(request_id, block_ids, hashes, num_tokens, ttl_s,
                                         agents=[name for name, _ in self.metadata], payloads=payloads)

    def start(self, request_id: str, source: KVHandoff, block_ids: list[int], skip_blocks: int) -> None:
        """Every rank starts its pull. Raises only when no rank started one (then nothing writes)."""
        handle = source.handle
        if handle.request_id in self.loads:
            raise KVTransferError(f"hand-off {handle.request_id} is already being pulled here")
        peers = {agent: self._peer(agent) for agent in handle.rank_agents} if self.transport.peer_metadata else {}
        started = self.engine.executor.collective_rpc(_start_rank, self.key, self._fetched(source), block_ids,
                                                      skip_blocks, peers)
        refused = [r for r, error in enumerate(started) if error is not None]
        if len(refused) == len(started):
            raise KVTransferError(started[0])
        for r in refused:                  # the load fails once the other ranks' pulls have ended
            log.warning("pull of %s: TP rank %d could not start: %s", handle.request_id, r, started[r])
        self.loads[handle.request_id] = TPLoad(request_id, source, set(range(len(started))) - set(refused), refused)

    def _fetched(self, source: KVHandoff) -> KVHandoff:
        """The Ray fallback's hand-off with its block bytes fetched here: the workers (spawned processes)
        are no Ray clients. It blocks this step for the fetch (rank 0's own copy is then local)."""
        if self.transport.kind != "ray":
            return source
        import ray
        parts = source.payload if isinstance(source.payload, list) else [source.payload]
        try:
            parts = [ray.get(p) if isinstance(p, ray.ObjectRef) else p for p in parts]
        except Exception as e:
            raise KVTransferError(f"cannot fetch the blocks of {source.handle.request_id}: {e!r}") from e
        return KVHandoff(source.handle, parts if isinstance(source.payload, list) else parts[0])

    def _peer(self, agent: str) -> bytes:
        if agent not in self.peers:
            try:
                self.peers[agent] = self.transport.peer_metadata(agent)
            except Exception as e:
                raise KVTransferError(f"cannot get the metadata of producer {agent}: {e!r}") from e
        return self.peers[agent]

    def finished(self) -> tuple[list[str], dict[str, str]]:
        """Loads every rank has ended: done if all succeeded (the producer is told), else failed. One
        still in flight on any rank is not reported: its READ may still write into the blocks."""
        if not self.loads:
            return [], {}
        for rank, polled in enumerate(self.engine.executor.collective_rpc(_poll_rank, self.key)):
            for rid, state in polled.items():
                load = self.loads.get(rid)
                if load is not None:
                    load.in_flight.discard(rank)
                    load.failed += [rank] if state == FAILED else []
        done, failed = [], {}
        for rid, load in list(self.loads.items()):
            if load.in_flight:
                continue
            del self.loads[rid]
            if load.failed:
                failed[load.request_id] = f"pull of {rid} failed on TP rank(s) {sorted(load.failed)}"
            else:
                done.append(load.request_id)
                self._notify(load.handoff)
        return done, failed

    def _notify(self, handoff: KVHandoff) -> None:
        """Tell producer rank 0; if that fails the blocks are still here, and the producer's pin expires."""
        try:
            self.transport.notify_pulled(handoff)
        except KVTransferError as e:
            log.warning("%s", e)

    def close(self) -> None:
        """The workers' transports (rank 0's is the KVLink's to close); workers already gone took theirs."""
        try:
            self.engine.executor.collective_rpc(_close_rank, self.key)
        except Exception as e:                   # noqa: BLE001 - closing must not fail the caller
            log.debug("closing the TP ranks' transports: %r", e)


def _links(worker) -> dict[str, RankPulls]:
    """A TP worker's RankPulls by link name (an attribute the links add to the worker object)."""
    return worker.__dict__.setdefault("kv_links", {})


def _open_rank(worker, key: str, name_prefix: str, compat_key: str, kind: str, layout: KVHeadLayout,
               options: dict) -> tuple[str, bytes]:
    links = _links(worker)
    if key not in links:
        links[key] = RankPulls(make_transport(worker.runner.kv_cache, name_prefix, compat_key, kind=kind,
                                              layout=layout, rank=worker.rank, **options))
    t = links[key].transport
    return t.name, t.metadata()


def _shard_payload(worker, key: str, block_ids: list[int]) -> Any:
    return _links(worker)[key].transport.shard_payload(block_ids)


def _start_rank(worker, key: str, handoff: KVHandoff, block_ids: list[int], skip_blocks: int,
                peers: dict[str, bytes]) -> str | None:
    """Meet the producer ranks this rank reads from, then start its pull; the error if none started."""
    pulls = _links(worker)[key]
    t, handle = pulls.transport, handoff.handle
    try:
        for agent in {handle.rank_agents[run.src_rank] for run in t.runs(handle)} & peers.keys():
            t.add_peer(peers[agent])
        pulls.start(handoff, block_ids, skip_blocks)
    except Exception as e:                   # noqa: BLE001 - this rank has no pull in flight
        return str(e) if isinstance(e, KVTransferError) else repr(e)
    return None


def _poll_rank(worker, key: str) -> dict[str, str]:
    return _links(worker)[key].poll()


def _close_rank(worker, key: str) -> None:
    pulls = _links(worker).pop(key, None)
    if pulls is not None and worker.rank > 0:
        pulls.transport.close()
