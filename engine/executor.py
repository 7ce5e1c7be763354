"""Executor: the ranks of one engine's model. Rank 0 is the engine's own process and ModelRunner; with
tensor_parallel_size > 1, TP-1 workers (WorkerHandle: processes here, Ray actors on a cluster)
each hold the ModelRunner of their rank.

Every forward, rank 0 sends the step's inputs to the workers on the gloo control group and all ranks
run the same forward_step, so the model's collectives line up; only rank 0 gets logits and samples.
Anything else (sizing and allocating the KV cache, a KV transport's per-rank pulls) goes through
collective_rpc(fn, *args): fn(worker, *args) on every rank, results in rank order (vLLM's name).
"""
from __future__ import annotations

import functools
import logging
import multiprocessing as mp
import os
import threading
import weakref
from contextlib import contextmanager
from functools import cached_property
from collections import deque
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.input_batch import StepShape
from engine.loader import load_config
from engine.model_runner import ModelRunner, allocate_kv_caches, plan_kv_blocks
from engine.parallel import (DEFAULT_TIMEOUT_S, Rendezvous, TPGroup, TPWorkerError, check_heads, join_group,
                             new_rendezvous)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker of rank `rank` needs to build its shard (picklable: sent to a process or actor)."""
    config: EngineConfig
    model_path: str                 # resolved (engine.loader.resolve_model)
    max_model_len: int
    rank: int
    rendezvous: Rendezvous
    device: str                     # "cpu" or "cuda:<local rank>"; a Ray actor may use its own cuda:0


class TPWorker:
    """One rank: its TP group and ModelRunner. A worker (rank >= 1) also runs serve_steps() on a
    thread; `lock` keeps a collective_rpc call from running inside a step."""

    def __init__(self, runner: ModelRunner, group: TPGroup | None):
        self.runner, self.group = runner, group
        self.rank = 0 if group is None else group.rank
        self.lock = threading.Lock()

    @classmethod
    def build(cls, spec: WorkerSpec, store=None) -> "TPWorker":
        """Join the TP group (blocks until every rank has), then load this rank's shard."""
        device = torch.device(spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif spec.rank > 0:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.rendezvous.world_size))
        group = join_group(spec.rendezvous, spec.rank, device, store)
        runner = ModelRunner(spec.config, spec.model_path, load_config(spec.model_path), spec.max_model_len,
                             tp=group, device=device)
        return cls(runner, group)

    def serve_steps(self) -> None:
        """A worker's step loop: run each forward rank 0 sends, until it says stop or is gone."""
        while (step := self.group.recv_step()) is not None:
            shape, ids, tables, num_layers, lora_slots = step
            with self.lock:
                lora = self.runner.lora
                if lora is not None:                 # the step's adapters, as rank 0 put them in the slots
                    lora.clear_step() if lora_slots is None else lora.set_step(lora_slots, shape.query_lens)
                self.runner.forward_step(shape, ids, tables, num_layers)

    def start_serving(self) -> None:
        """A worker's process (or actor) runs the step loop on a thread and exits with it: rank 0 stopped
        it or is gone (a collective failed), so no worker outlives its engine."""
        threading.Thread(target=_serve_then_exit, args=(self,), daemon=True, name="baton-tp-steps").start()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(self, *args) between steps (a WorkerHandle.call arriving in the worker)."""
        with self.lock:
            return fn(self, *args)


class WorkerHandle(Protocol):
    """How rank 0 reaches one TP worker (rank >= 1), wherever it runs.

    `start(spec)` begins, remotely, `w = TPWorker.build(spec); w.start_serving()` and returns at once
    (rank 0 must join the group too before any worker can finish building). `ready` is a Future that
    resolves once the worker's shard is loaded (or fails with its error). `call(fn, *args)` runs
    `w.call(fn, *args)` there and returns a Future of the result (fn must be picklable: a module-level
    function). `alive()` is cheap (rank 0 asks it before every step); `kill()` ends the worker now and
    is idempotent. A worker given its own single device (a Ray actor's GPU is its cuda:0) replaces
    spec.device. Implementations: MPWorkerHandle (processes from the fork server, EngineConfig
    distributed_executor_backend="mp", the default) and a Ray actor one ("ray", see WORKER_HANDLES).
    """
    rank: int
    ready: Future

    @classmethod
    def start(cls, spec: WorkerSpec) -> "WorkerHandle": ...

    def call(self, fn: Callable[..., Any], *args: Any) -> Future: ...

    def alive(self) -> bool: ...

    def kill(self) -> None: ...


# -- the multiprocessing implementation ---------------------------------------------------------------
# The modules every worker needs, imported once per engine process by multiprocessing's fork server; each
# worker is forked from it. A spawned process imports them itself: torch and the engine, and transformers'
# config classes for load_config (whose first model config pulls in about 700 modules: accelerate, PIL, ...),
# 13 s a worker on a slow 2-core machine, where a TP 4 engine took 22 s to start. The fork server has imported
# modules and run nothing else (no OpenMP pool, no CUDA context), so its children start clean as spawned ones.
FORKSERVER_PRELOAD = ["engine.executor", "transformers.models.auto.configuration_auto",
                      "transformers.models.llama.configuration_llama"]


@functools.cache
def mp_context():
    """multiprocessing's "forkserver" context, preloading the engine, where the platform has it; else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)     # taken when the fork server starts (the first worker)
    return ctx


def _worker_main(spec: WorkerSpec, conn, environ: dict[str, str]) -> None:
    """A worker process: build the shard, serve steps on a thread and calls on this one. It exits when
    rank 0 stops it or goes away (pipe closed, collective failed): never an orphan. `environ` is rank 0's
    environment when it started the worker (the fork server's own dates from the server's start)."""
    os.environ.clear()
    os.environ.update(environ)
    try:
        worker = TPWorker.build(spec)
    except BaseException as e:                           # noqa: BLE001 - reported to rank 0
        conn.send((False, e))
        return
    conn.send((True, None))
    worker.start_serving()
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            os._exit(0)
        try:
            reply = (True, worker.call(fn, *args))
        except BaseException as e:                       # noqa: BLE001 - re-raised by rank 0
            reply = (False, e)
        conn.send(reply)


def _serve_then_exit(worker: TPWorker) -> None:
    try:
        worker.serve_steps()
    except BaseException as e:                           # noqa: BLE001 - rank 0 is gone: so are we
        log.warning("TP worker rank %d stops: %s", worker.rank, e)
    os._exit(0)


class MPWorkerHandle:
    """A TP worker in a process of its own, forked from the fork server (mp_context), daemon: it cannot
    outlive the engine's process."""

    def __init__(self, spec: WorkerSpec):
        self.rank = spec.rank
        ctx = mp_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(spec, child, dict(os.environ)), daemon=True,
                                 name=f"baton-tp-rank{spec.rank}")
        self._proc.start()
        child.close()
        self.ready: Future = Future()
        self._pending: deque[Future] = deque([self.ready])
        self._send_lock = threading.Lock()
        self._closed = False                      # the pipe is gone: calls fail at once
        threading.Thread(target=self._read_replies, daemon=True).start()

    @classmethod
    def start(cls, spec: WorkerSpec) -> "MPWorkerHandle":
        return cls(spec)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def call(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._send_lock:
            if self._closed or not self.alive():
                fut.set_exception(TPWorkerError(f"TP worker rank {self.rank} is not running"))
                return fut
            self._pending.append(fut)
            try:
                self._conn.send((fn, args))
            except OSError as e:                  # it died since: the reader fails what is pending
                self._pending.remove(fut)
                fut.set_exception(TPWorkerError(f"TP worker rank {self.rank} is not running: {e}"))
        return fut

    def alive(self) -> bool:
        return self._proc.is_alive()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(timeout=10)
        self._conn.close()

    def _read_replies(self) -> None:
        while True:
            try:
                ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            fut = self._pending.popleft()
            fut.set_result(value) if ok else fut.set_exception(value)
        with self._send_lock:
            self._closed = True
        while self._pending:
            self._pending.popleft().set_exception(TPWorkerError(f"TP worker rank {self.rank} exited"))


# -- the executor -------------------------------------------------------------------------------------
# distributed_executor_backend -> "module:WorkerHandle class", imported when a TP engine starts
WORKER_HANDLES = {"mp": "engine.executor:MPWorkerHandle", "ray": "replica.tp_workers:RayWorkerHandle"}


def worker_handle_class(backend: str) -> type:
    import importlib
    if backend not in WORKER_HANDLES:
        raise ConfigError(f"distributed_executor_backend must be one of {sorted(WORKER_HANDLES)}, got {backend!r}")
    module, name = WORKER_HANDLES[backend].split(":")
    return getattr(importlib.import_module(module), name)


def device_of(config: EngineConfig, rank: int) -> str:
    """cpu, or cuda:<base + rank>: one device per rank, counted from the configured one."""
    d = config.torch_device
    return "cpu" if d.type == "cpu" else f"cuda:{(d.index or 0) + rank}"


class Executor:
    """Rank 0's runner (`runner`) and the TP workers. At TP 1 it is the runner alone: no group, no hook."""

    def __init__(self, config: EngineConfig, model_path: str, hf_config, max_model_len: int,
                 handle_cls: type | None = None):
        self.config, self.workers = config, []
        self.failure: TPWorkerError | None = None
        tp = config.tensor_parallel_size
        if tp == 1:
            self.driver = TPWorker(ModelRunner(config, model_path, hf_config, max_model_len), None)
            self.runner = self.driver.runner
            return
        check_heads(hf_config.num_attention_heads, getattr(hf_config, "num_key_value_heads", None)
                    or hf_config.num_attention_heads, tp)      # a clear error before any process starts
        handle_cls = handle_cls or worker_handle_class(config.distributed_executor_backend)
        rdv, store = new_rendezvous(tp)
        spec = WorkerSpec(config, model_path, max_model_len, 0, rdv, device_of(config, 0))
        self.workers = [handle_cls.start(WorkerSpec(config, model_path, max_model_len, r, rdv, device_of(config, r)))
                        for r in range(1, tp)]
        self._finalizer = weakref.finalize(self, _kill_all, list(self.workers))
        try:
            self.driver = self._build_driver(spec, store, rdv.start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.runner = self.driver.runner
        self.runner.on_step = self._step
        if self.runner.lora is not None:
            self.runner.lora.on_load = self._load_lora

    def _build_driver(self, spec: WorkerSpec, store, timeout_s: float) -> TPWorker:
        """Rank 0 joins the group and loads its shard on a thread while the workers load theirs, all within the
        start-up timeout; a worker that fails (a bad model path, no device) is reported at once with its own
        error, not after that timeout."""
        built: Future = Future()

        def build() -> None:
            try:
                built.set_result(TPWorker.build(spec, store))
            except BaseException as e:                   # noqa: BLE001 - re-raised below
                built.set_exception(e)
        threading.Thread(target=build, daemon=True, name="baton-tp-rank0-build").start()
        wait([built, *(h.ready for h in self.workers)], timeout=timeout_s, return_when=FIRST_EXCEPTION)
        failed = [h for h in self.workers if h.ready.done() and h.ready.exception() is not None]
        if failed:
            raise TPWorkerError(f"TP worker rank {failed[0].rank} failed to start: {failed[0].ready.exception()!r}")
        late = [h.rank for h in self.workers if not h.ready.done()] + ([] if built.done() else [0])
        if late and (not built.done() or built.exception() is None):
            raise TPWorkerError(f"TP rank(s) {late} not ready in {timeout_s} s")
        return built.result()

    @property
    def tp_size(self) -> int:
        return 1 + len(self.workers)

    def collective_rpc(self, fn: Callable[..., Any], *args: Any, timeout: float | None = DEFAULT_TIMEOUT_S) -> list:
        """fn(worker, *args) on every rank (rank 0 here, in this thread), results in rank order."""
        futures = [h.call(fn, *args) for h in self.workers]
        mine = fn(self.driver, *args)
        try:
            return [mine] + [f.result(timeout=timeout) for f in futures]
        except TimeoutError as e:
            raise TPWorkerError(f"a TP worker did not answer {getattr(fn, '__name__', fn)} in {timeout} s") from e

    def allocate_kv(self, draft: ModelRunner | None = None) -> None:
        """Size the KV cache so every rank's shard fits (uneven head splits differ in bytes per block),
        then allocate the same number of blocks on every rank; a draft model lives on rank 0 only."""
        if not self.workers:
            allocate_kv_caches(self.runner, draft)
            return
        blocks, draft_blocks = plan_kv_blocks(self.config, self.runner.kv_budget(), self.runner.block_bytes,
                                              draft.block_bytes if draft is not None else None)
        blocks = min(blocks, *self.collective_rpc(_plan_blocks)[1:])
        self.collective_rpc(_allocate_kv, blocks)
        self.collective_rpc(_allocate_host_kv, min(self.collective_rpc(_host_block_count)))
        if draft is not None:
            draft.allocate_kv(draft_blocks)

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.runner.host_kv is None else self.runner.host_kv.shape[0]

    @cached_property
    def block_bytes(self) -> int:
        """Bytes of one block over all ranks (what a tier copy of it moves)."""
        return sum(self.collective_rpc(_block_bytes))

    def copy_blocks(self, copies: list[tuple[str, int, int]]) -> None:
        """Host-tier copies on every rank (each holds its heads' share of both tiers), between steps."""
        if not self.workers:
            self.runner.copy_blocks(copies)
        else:
            self.collective_rpc(_copy_blocks, copies)

    @contextmanager
    def _step(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray, num_layers: int | None):
        """Rank 0's on_step, around its forward: send the step's inputs to the workers first. A step that
        fails halfway leaves the ranks out of step (workers wait in a collective rank 0 left), so
        every later step fails too: the replica must be replaced."""
        self._send_step(shape, ids, tables, num_layers)
        try:
            yield
        except BaseException as e:
            if self.failure is None:
                self.failure = TPWorkerError(f"a tensor-parallel step failed on rank 0 ({e!r}); the ranks are "
                                             f"out of step: replace the replica")
            raise

    def _load_lora(self, slot: int, adapter) -> None:
        """Rank 0 put `adapter` in LoRA slot `slot` (before the step that uses it): every worker does too."""
        from engine.lora import LoRARequest
        request = LoRARequest(adapter.name, lora_path=adapter.path, lora_key=adapter.key)
        futures = [h.call(_load_lora_slot, slot, request) for h in self.workers]
        try:
            for f in futures:
                f.result(timeout=DEFAULT_TIMEOUT_S)
        except TimeoutError as e:
            raise TPWorkerError(f"a TP worker did not load LoRA adapter {adapter.name!r} in {DEFAULT_TIMEOUT_S} s") \
                from e

    def _send_step(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray, num_layers: int | None) -> None:
        """Fail fast on a dead worker, else send the step's inputs."""
        if self.failure is None:
            dead = [h.rank for h in self.workers if not h.alive()]
            if dead:
                self.failure = TPWorkerError(f"tensor-parallel worker rank(s) {dead} died: this engine cannot "
                                             f"run steps; replace the replica")
        if self.failure is not None:
            raise self.failure
        lora = self.runner.lora
        try:
            self.driver.group.send_step(shape, ids, tables, num_layers,
                                        None if lora is None or lora.step.slots is None else lora.seq_slots)
        except TPWorkerError as e:
            self.failure = e
            raise

    def shutdown(self) -> None:
        """Stop the workers (a stop message, then kill what is left) and wait for them: no orphans."""
        if not self.workers:
            return
        group = getattr(getattr(self, "driver", None), "group", None)
        if group is not None and self.failure is None and all(h.alive() for h in self.workers):
            try:
                group.send_stop()
            except TPWorkerError:
                pass
        self.failure = self.failure or TPWorkerError("the engine was shut down")
        self._finalizer()


def _kill_all(workers: list) -> None:
    for h in workers:
        h.kill()


def _plan_blocks(worker: TPWorker) -> int:
    r = worker.runner
    return plan_kv_blocks(r.config, r.kv_budget(), r.block_bytes)[0]


def _allocate_kv(worker: TPWorker, num_blocks: int) -> None:
    worker.runner.allocate_kv(num_blocks)


def _host_block_count(worker: TPWorker) -> int:
    return worker.runner.host_block_count()


def _allocate_host_kv(worker: TPWorker, num_blocks: int) -> None:
    worker.runner.allocate_host_kv(num_blocks)


def _block_bytes(worker: TPWorker) -> int:
    return worker.runner.block_bytes


def _copy_blocks(worker: TPWorker, copies: list[tuple[str, int, int]]) -> None:
    worker.runner.copy_blocks(copies)


def _load_lora_slot(worker: TPWorker, slot: int, request) -> None:
    worker.runner.lora.load_slot(slot, request)
