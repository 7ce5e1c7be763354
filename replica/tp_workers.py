"""RayWorkerHandle: a tensor-parallel worker (rank >= 1) of a Serve replica, as a Ray actor in the replica's
placement group (engine/executor.py's WorkerHandle, distributed_executor_backend "ray"; "mp", spawned
processes, is the one outside Ray).

The replica actor is rank 0 in bundle 0 of the placement group Serve made for it (cluster/config.py asks for
one bundle per rank, STRICT_PACK: one node, so the ranks rendezvous on localhost); rank r's actor takes
bundle r. The actors are the replica's children: they die with it, and Serve replaces the replica, with a new
placement group, as one. A worker that dies is seen at once (a thread waits on a call that returns only when
the actor's process ends), so rank 0 fails its next step instead of waiting in a collective, and the
replica's health check fails (replica/engine_replica.py).
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.config import worker_bundle
from engine.executor import TPWorker, WorkerSpec
from engine.parallel import TPWorkerError

log = logging.getLogger(__name__)
WORKER_NAME_PREFIX = "baton-tp:"


@ray.remote(max_restarts=0, concurrency_groups={"watch": 1})
class TPWorkerActor:
    """One rank in its own process. build() joins the TP group and loads the shard, then the step loop runs on
    a thread (TPWorker.start_serving: the process exits with it); call() runs rank 0's collective_rpc functions
    in order (the default group has one thread); until_exit() never returns: the process ending answers it."""

    def build(self, spec: WorkerSpec) -> None:
        self.worker = TPWorker.build(spec)
        self.worker.start_serving()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.worker.call(fn, *args)

    @ray.method(concurrency_group="watch")
    def until_exit(self) -> None:
        threading.Event().wait()


def worker_name(rank: int) -> str | None:
    """`baton-tp:<deployment>#<replica>#rank<r>` inside a Serve replica (operators and tests find a replica's
    workers by it), else unnamed."""
    try:
        from ray import serve
        ctx = serve.get_replica_context()
    except Exception:                                   # noqa: BLE001 - not in a replica
        return None
    return f"{WORKER_NAME_PREFIX}{ctx.deployment}#{ctx.replica_id.unique_id}#rank{rank}"


def _placement(rank: int):
    """Bundle `rank` of the caller's placement group; without one (Ray outside Serve), this node: the ranks
    rendezvous on localhost."""
    pg = ray.util.get_current_placement_group()
    if pg is not None:
        return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


class RayWorkerHandle:
    """Rank 0's end of one TPWorkerActor (WorkerHandle): calls come back as concurrent Futures."""

    def __init__(self, spec: WorkerSpec):
        self.rank = spec.rank
        on_gpu = spec.device.startswith("cuda")
        if on_gpu:                      # Ray shows the actor its own GPU only, as cuda:0
            spec = dataclasses.replace(spec, device="cuda:0")
        bundle = worker_bundle(on_gpu)
        self._actor = TPWorkerActor.options(name=worker_name(spec.rank), num_cpus=bundle["CPU"],
                                            num_gpus=bundle.get("GPU", 0),
                                            scheduling_strategy=_placement(spec.rank)).remote()
        self.ready: Future = _as_future(self._actor.build.remote(spec), self.rank)
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name=f"baton-tp-watch-rank{self.rank}", daemon=True).start()

    @classmethod
    def start(cls, spec: WorkerSpec) -> RayWorkerHandle:
        return cls(spec)

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        if not self.alive():
            fut: Future = Future()
            fut.set_exception(TPWorkerError(f"TP worker rank {self.rank} is not running"))
            return fut
        return _as_future(self._actor.call.remote(fn, *args), self.rank)

    def alive(self) -> bool:
        return not self._stopped.is_set()

    def kill(self) -> None:
        self._stopped.set()
        try:
            ray.kill(self._actor, no_restart=True)
        except Exception:                               # noqa: BLE001 - already gone: nothing to kill
            pass

    def _watch(self) -> None:
        try:
            ray.get(self._actor.until_exit.remote())
        except Exception as e:                          # noqa: BLE001 - the actor's process ended
            if not self._stopped.is_set():
                log.error("TP worker rank %d died: %s", self.rank, type(e).__name__)
        self._stopped.set()


def _as_future(ref: ray.ObjectRef, rank: int) -> Future:
    """A Future of the ref's value; a dead actor becomes a TPWorkerError, as from MPWorkerHandle."""
    out: Future = Future()

    def done(f: Future) -> None:
        e = f.exception()
        if e is None:
            out.set_result(f.result())
        elif isinstance(e, ray.exceptions.RayActorError):
            out.set_exception(TPWorkerError(f"TP worker rank {rank} died: {type(e).__name__}"))
        else:
            out.set_exception(getattr(e, "cause", None) or e)   # the worker's own error, as raised there
    ref.future().add_done_callback(done)
    return out
