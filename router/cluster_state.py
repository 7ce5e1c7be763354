"""ClusterState: the one Ray actor that every replica reports to and every router reads from.

Lifetime: ClusterStateOwner, a one-replica deployment of the app, creates the actor (named, not detached), so
Ray ends it with its owner: deleting the app (serve delete, KubeRay) leaves no actor behind. Everyone else
reaches it by name (replica.names).

- KV events: each replica of both pools publishes numbered batches (msgpack, engine.kv_events.encode_events);
  the actor keeps the exact PrefixIndex of each pool and a log of recent batches. Routers (in every
  ingress replica, and wherever a handle routes) hold an IndexMirror that pulls the log since its
  version, or a snapshot when it fell too far behind, in the background: `choose_replicas` only reads
  the local mirror, so every ingress replica sees the same index and routing never waits on a call.
- Metrics: each replica sends its Prometheus exposition every REPORT_INTERVAL_S; the ingress /metrics
  merges them. A replica that stops reporting for DEAD_AFTER_S is forgotten (index and metrics), as
  is one Serve dropped from a pool (the request routers tell it at once).
- Transfer metadata: each replica registers its KV transport's metadata once, under its agent name (new in
  every process, so an entry never goes stale); a consumer asks for a producer's the first time it meets it.
- LoRA adapters: the registry of adapters the cluster serves (name -> path and key), read by every ingress.
- Lost KV events: a gap in a replica's batches marks it stale; its next metrics report learns so and
  the replica resends its whole cache as one batch (resync).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

from engine.kv_events import decode_events
from replica.names import POOLS, STATE_NAMESPACE, get_state_actor
from router.prefix_index import PrefixIndex

log = logging.getLogger(__name__)

LOG_CAPACITY = 4096             # event batches kept for mirrors; older mirrors take a snapshot
LONG_POLL_S = 1.0               # a mirror's wait_changes call returns after this long when nothing changed
DEAD_AFTER_S = 15.0


class ClusterState:
    def __init__(self, clock: Callable[[], float] = time.monotonic, dead_after_s: float = DEAD_AFTER_S):
        self.clock, self.dead_after_s = clock, dead_after_s         # tests inject both
        self.index = {p: PrefixIndex() for p in POOLS}
        self.version = 0
        self.log: deque[tuple[int, str, str, int, bytes]] = deque(maxlen=LOG_CAPACITY)
        self.metrics: dict[tuple[str, str], tuple[float, bytes]] = {}
        self.seen: dict[tuple[str, str], float] = {}
        self.transfer_md: dict[str, bytes] = {}     # agent -> metadata; kept when a replica is forgotten (it
                                                    # may be alive, only quiet): a few KiB per replica process
        self.loras: dict[str, tuple[int, str, str]] = {}    # LoRA adapters served: name -> (id, path, key)
        self._lora_ids = 0
        self._changed: asyncio.Event | None = None          # what waiting mirrors wait on; set by the next entry
        self.forgotten: dict[tuple[str, str], str] = {}      # why each replica forgotten while alive was

    # -- LoRA adapters (every ingress replica reads the same registry) -------------------------------
    def lora_adapters(self) -> dict[str, tuple[int, str, str]]:
        return dict(self.loras)

    def add_lora(self, name: str, path: str, key: str) -> bool:
        """Register an adapter a replica loaded and checked; False if the name is taken."""
        if name in self.loras:
            return False
        self._lora_ids += 1
        self.loras[name] = (self._lora_ids, path, key)
        return True

    def remove_lora(self, name: str) -> bool:
        return self.loras.pop(name, None) is not None

    # -- replicas ---------------------------------------------------------------------------------
    def register(self, pool: str, replica: str, seq: int) -> None:
        """A replica starts with an empty cache at sequence `seq`."""
        self.seen[(pool, replica)] = self.clock()
        self.index[pool].load_snapshot(replica, seq, [])
        self._append(pool, replica, -seq - 1, b"")            # negative seq: "reset to empty at seq"

    def register_transfer_metadata(self, agent: str, metadata: bytes) -> None:
        self.transfer_md[agent] = metadata

    def transfer_metadata(self, agent: str) -> bytes | None:
        return self.transfer_md.get(agent)

    def publish(self, pool: str, replica: str, seq: int, events: bytes) -> None:
        self.seen[(pool, replica)] = self.clock()
        try:
            decoded = decode_events(events)
        except ValueError as e:             # checked on receipt: the replica's entry waits for a snapshot
            log.warning("%s replica %s: KV event batch %d refused (%s); index marks it stale", pool, replica, seq, e)
            self.index[pool].stale.add(replica)
            return
        if not self.index[pool].apply(replica, seq, decoded):
            log.warning("%s replica %s: KV event batch %d arrived out of order; index marks it stale", pool,
                        replica, seq)
        self._append(pool, replica, seq, events)

    def report(self, pool: str, replica: str, exposition: bytes, seq: int | None = None) -> bool:
        """A replica's metrics and its last event batch number; the answer says whether its index entry is
        stale (then it resyncs). Calls from one replica arrive in order, so a batch number ahead of the last
        one applied means a batch was lost, even when no batch has come since."""
        now = self.clock()
        self.seen[(pool, replica)] = now
        self.metrics[(pool, replica)] = (now, exposition)
        if pool not in self.index:
            return False
        idx = self.index[pool]
        if seq is not None and idx.seq.get(replica, -1) < seq and replica not in idx.stale:
            if replica in idx.seq:
                log.warning("%s replica %s: KV event batches up to %d never arrived; index marks it stale", pool,
                            replica, seq)
            else:                   # forgotten (silent too long, or Serve's replica set briefly lacked it)
                log.warning("%s replica %s reports again after it was forgotten (%s); asking it to resync", pool,
                            replica, self.forgotten.pop((pool, replica), "never registered"))
            idx.stale.add(replica)
        return replica in idx.stale

    def resync(self, pool: str, replica: str, seq: int, events: bytes) -> None:
        """A stale replica's whole cache as batch `seq` (cleared, then stored: every cached hash); it
        replaces the entry, and the batches after it apply again. Mirrors see the same two log entries."""
        self.seen[(pool, replica)] = self.clock()
        try:
            decoded = decode_events(events)
        except ValueError as e:
            log.warning("%s replica %s: resync batch refused (%s)", pool, replica, e)
            return
        self.index[pool].load_snapshot(replica, seq - 1, [])
        self.index[pool].apply(replica, seq, decoded)
        self._append(pool, replica, -(seq - 1) - 1, b"")
        self._append(pool, replica, seq, events)
        log.info("%s replica %s: index entry resynced at batch %d", pool, replica, seq)

    def stale(self) -> dict[str, list[str]]:
        return {p: sorted(idx.stale) for p, idx in self.index.items()}

    def forget(self, pool: str, replica: str, why: str = "") -> None:
        self.seen.pop((pool, replica), None)
        self.metrics.pop((pool, replica), None)
        if pool not in self.index:          # the autoscaler's exposition: no index, no replica to forget
            return
        if replica in self.index[pool].seq:
            self.forgotten[(pool, replica)] = why or "forgotten"
            while len(self.forgotten) > LOG_CAPACITY:
                del self.forgotten[next(iter(self.forgotten))]
        self.index[pool].remove_replica(replica)
        self._append(pool, replica, 0, b"forget")

    def _append(self, pool: str, replica: str, seq: int, events: bytes) -> None:
        self.version += 1
        self.log.append((self.version, pool, replica, seq, events))
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _reap(self) -> None:
        now = self.clock()
        for (pool, replica), t in list(self.seen.items()):
            if now - t > self.dead_after_s:
                log.warning("%s replica %s silent for %.0f s: forgotten", pool, replica, now - t)
                self.forget(pool, replica, f"silent for {now - t:.0f} s")

    # -- readers ----------------------------------------------------------------------------------
    def changes(self, since: int) -> tuple[int, list | None, dict | None]:
        """(version, log entries after `since`, None) or (version, None, snapshots) when `since` is too old."""
        self._reap()
        if since == self.version:
            return self.version, [], None
        if self.log and since >= self.log[0][0] - 1:
            return self.version, [e for e in self.log if e[0] > since], None
        return self.version, None, {p: idx.snapshot() for p, idx in self.index.items()}

    async def wait_changes(self, since: int, timeout_s: float = LONG_POLL_S) -> tuple[int, list | None, dict | None]:
        """changes(since), once there is something after `since` or timeout_s has passed: a mirror's long poll.
        It hears of a batch as soon as it lands, and an idle cluster costs no polling. (This coroutine makes
        the actor an asyncio actor: every method runs on its one event loop, so none needs a lock.)"""
        if since == self.version:
            if self._changed is None:
                self._changed = asyncio.Event()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass
        return self.changes(since)

    def metrics_texts(self) -> list[bytes]:
        self._reap()
        return [text for _, text in self.metrics.values()]

    def replicas(self) -> dict[str, list[str]]:
        return {p: sorted(r for q, r in self.seen if q == p) for p in POOLS}


class ClusterStateOwner:
    """The app's `state` deployment (one replica): creates the ClusterState actor, named and not detached, so
    that Ray ends the actor with this replica, and the app's deletion leaves none behind. Its health is the
    actor's; the ingress's /metrics reads the replicas' metrics through it."""

    def __init__(self, actor_name: str):
        self.actor_name = actor_name
        self.actor = self._actor()

    def _actor(self):
        import ray
        # get_if_exists: a successor (Serve moving this replica off a draining node) finds its predecessor's
        # actor while that replica lives; the actor ends with its owner, and _call then makes a fresh one
        return ray.remote(ClusterState).options(name=self.actor_name, namespace=STATE_NAMESPACE, num_cpus=0,
                                                get_if_exists=True).remote()

    async def _call(self, method: str, *args):
        """The actor's method; an actor that ended with a former owner is replaced by one this replica owns
        (empty: replicas re-register and resync on their next report, routers re-read its index)."""
        from ray.exceptions import RayActorError
        try:
            return await getattr(self.actor, method).remote(*args)
        except RayActorError:
            log.warning("cluster state actor %s ended with its former owner; starting a new one", self.actor_name)
            self.actor = self._actor()
            return await getattr(self.actor, method).remote(*args)

    async def check_health(self) -> None:
        await self._call("stale")

    async def metrics_texts(self) -> list[bytes]:
        return await self._call("metrics_texts")

    async def lora_adapters(self) -> dict[str, tuple[int, str, str]]:
        return await self._call("lora_adapters")

    async def add_lora(self, name: str, path: str, key: str) -> bool:
        return await self._call("add_lora", name, path, key)

    async def remove_lora(self, name: str) -> bool:
        return await self._call("remove_lora", name)


class IndexMirror:
    """A router process's copy of the pools' prefix indexes, kept current by one background task.
    One per process and actor (IndexMirror.shared): the ingress and its request routers share it."""
    _shared: dict[str, "IndexMirror"] = {}

    @classmethod
    def shared(cls, actor_name: str, interval_s: float) -> "IndexMirror":
        if actor_name not in cls._shared:
            cls._shared[actor_name] = cls(actor_name, interval_s)
        return cls._shared[actor_name]

    def __init__(self, actor_name: str, interval_s: float):
        self.actor_name, self.interval_s = actor_name, interval_s
        self.index = {p: PrefixIndex() for p in POOLS}
        self.version = 0
        self._task: asyncio.Task | None = None
        self._actor = None

    def start(self) -> None:
        """Begin syncing, on the running event loop (the first routing decision or request calls it)."""
        if self._task is None:
            self._task = asyncio.get_event_loop().create_task(self._run())

    @classmethod
    def stop_all(cls) -> None:
        """End every mirror of this process (its cluster is going away: a process that outlives it, such as a
        test driver that routed requests through its own handles, must not keep calling into Ray while Ray
        shuts down and starts again). Thread-safe: each task is cancelled on its own loop."""
        for mirror in cls._shared.values():
            task = mirror._task
            if task is not None and not task.done():
                task.get_loop().call_soon_threadsafe(task.cancel)
        cls._shared.clear()

    async def _run(self) -> None:
        while True:
            try:
                if self._actor is None:     # off the loop: a Ray call that blocks must not stall the routers'
                    self._actor = await asyncio.to_thread(get_state_actor, self.actor_name)
                await self.sync_once()
            except asyncio.CancelledError:
                raise
            except Exception as e:                     # the actor not up yet, or restarting: try again
                log.debug("index mirror: %r", e)
                self._actor = None
                await asyncio.sleep(0.5)
            await asyncio.sleep(self.interval_s)        # under load: one sync per interval at most

    async def sync_once(self) -> None:
        """One long poll of the state actor: returns at once if the index changed since our version, else when it
        next changes (or after LONG_POLL_S)."""
        version, entries, snapshots = await self._actor.wait_changes.remote(self.version)
        if snapshots is not None:
            self.index = {p: PrefixIndex.from_snapshot(s) for p, s in snapshots.items()}
        else:
            for _, pool, replica, seq, events in entries:
                apply_entry(self.index[pool], replica, seq, events)
        self.version = version

    def forget(self, pool: str, replica: str, why: str = "") -> None:
        """A replica is gone: out of this mirror now and out of the state actor (for every other mirror)."""
        self.index[pool].remove_replica(replica)
        if self._actor is not None:
            self._actor.forget.remote(pool, replica, why)


def apply_entry(index: PrefixIndex, replica: str, seq: int, events: bytes) -> None:
    if events == b"forget":
        index.remove_replica(replica)
    elif seq < 0:
        index.load_snapshot(replica, -seq - 1, [])
    else:
        index.apply(replica, seq, decode_events(events))


def merge_expositions(texts: list[bytes]) -> bytes:
    """Many replicas' Prometheus text as one exposition: each family's HELP/TYPE once, all samples."""
    from prometheus_client.parser import text_string_to_metric_families
    families: dict[str, object] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text.decode()):
            have = families.get(fam.name)
            if have is None:
                families[fam.name] = fam
            else:
                have.samples.extend(fam.samples)
    return _render(families.values())


def _render(families) -> bytes:
    from prometheus_client import CollectorRegistry, generate_latest

    class _Static:
        def collect(self):
            return list(families)

    reg = CollectorRegistry()
    reg.register(_Static())
    return generate_latest(reg)


__all__ = ["ClusterState", "ClusterStateOwner", "IndexMirror", "merge_expositions"]
