"""Tensor-parallel process groups: the model's collectives (NCCL on CUDA, gloo on CPU) and a gloo
control group that carries each step's inputs from rank 0 to the workers, all with timeouts.

Groups are built from their own TCPStore, never torch.distributed's default group, so one process
can hold several engines (a test's TP 1 and TP 2, a prefill and a decode engine) and each TP
engine's ranks rendezvous on their own port.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from engine.errors import BatonError, ConfigError
from engine.input_batch import StepShape
from engine.kv_layout import KVHeadLayout

# A step's collectives normally take milliseconds; a peer that stops answering for this long is lost.
DEFAULT_TIMEOUT_S = float(os.environ.get("BATON_TP_TIMEOUT_S", "120"))
# Starting a rank (its process, torch's import, joining the group, loading its shard) takes seconds for a small
# model on an idle machine and minutes for a large one from slow storage or on a loaded machine.
START_TIMEOUT_S = float(os.environ.get("BATON_TP_START_TIMEOUT_S", "600"))
# A worker waits this long for the next step: idleness is no failure (rank 0's death closes the connection).
IDLE_TIMEOUT = datetime.timedelta(days=365)
_STOP, _STEP = 0, 1


class TPWorkerError(BatonError):
    """A tensor-parallel worker died or a collective failed: this engine cannot run steps any more."""


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's TCPStore listens; every rank builds its groups from it."""
    host: str
    port: int
    world_size: int
    timeout_s: float = DEFAULT_TIMEOUT_S           # each collective
    start_timeout_s: float = START_TIMEOUT_S       # every rank's arrival, and its shard loaded


@dataclass
class CollectiveTimes:
    """Seconds this rank waited in each kind of collective, and the steps it sent (`bench engine --tp`).
    Host time: on CPU (gloo) the collectives' whole cost; on CUDA, NCCL work is queued, not waited for."""
    all_reduce_s: float = 0.0
    gather_s: float = 0.0
    broadcast_s: float = 0.0
    steps: int = 0


@dataclass
class TPGroup:
    """One rank's view of its TP group: rank, size and its two process groups (a TP 1 engine has none)."""
    rank: int = 0
    size: int = 1
    model_pg: object = None           # the model's all-reduces and the logits gather
    control_pg: object = None         # gloo: step headers and inputs (CPU tensors)
    store: object = None              # kept alive: the groups rendezvous through it
    times: CollectiveTimes | None = None   # set to count the time in collectives (benchmarks)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def kv_layout(self, num_kv_heads: int) -> KVHeadLayout:
        return KVHeadLayout(num_kv_heads, self.size)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        t0 = time.perf_counter()
        _wait(self.model_pg.allreduce([t]))
        self._count("all_reduce_s", t0)
        return t

    def gather_to_driver(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets every rank's t concatenated on the last dim; other ranks get None."""
        t0 = time.perf_counter()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        t = t.contiguous()
        outs = [[torch.empty_like(t) for _ in range(self.size)]] if self.is_driver else []
        _wait(self.model_pg.gather(outs, [t], opts))
        self._count("gather_s", t0)
        return torch.cat(outs[0], dim=-1) if self.is_driver else None

    # -- the step's inputs, rank 0 -> workers (gloo, CPU int64 tensors, no pickle) ------------------
    def send_step(self, shape: StepShape, ids: np.ndarray, tables: np.ndarray, num_layers: int | None,
                  lora_slots: np.ndarray | None = None) -> None:
        """`lora_slots`: each sequence's LoRA slot (-1: base; engine/lora.py), None: no adapter in this step."""
        t0 = time.perf_counter()
        b, n = len(shape.query_lens), len(ids)
        header = torch.tensor([_STEP, b, n, tables.shape[1], -1 if num_layers is None else num_layers,
                               int(lora_slots is not None), 0, 0])
        payload = np.concatenate([shape.starts, shape.query_lens, shape.num_logits, ids.astype(np.int64, copy=False),
                                  tables.reshape(-1).astype(np.int64, copy=False),
                                  np.empty(0, np.int64) if lora_slots is None else lora_slots.astype(np.int64)])
        _wait(self.control_pg.broadcast(header, 0))
        _wait(self.control_pg.broadcast(torch.from_numpy(payload), 0))
        self._count("broadcast_s", t0)
        if self.times is not None:
            self.times.steps += 1

    def _count(self, kind: str, t0: float) -> None:
        if self.times is not None:
            setattr(self.times, kind, getattr(self.times, kind) + time.perf_counter() - t0)

    def send_stop(self) -> None:
        _wait(self.control_pg.broadcast(torch.tensor([_STOP, 0, 0, 0, 0, 0, 0, 0]), 0))

    def recv_step(self) -> tuple[StepShape, np.ndarray, np.ndarray, int | None, np.ndarray | None] | None:
        """A worker waits for rank 0's next step: (shape, ids, tables, num_layers, lora_slots); None when rank 0
        stops the workers."""
        header = torch.zeros(8, dtype=torch.int64)
        _wait(self.control_pg.broadcast(header, 0, IDLE_TIMEOUT))    # an idle engine sends nothing for hours
        kind, b, n, cols, layers, lora = header[:6].tolist()
        if kind == _STOP:
            return None
        end = 3 * b + n + b * cols
        payload = torch.zeros(end + (b if lora else 0), dtype=torch.int64)
        _wait(self.control_pg.broadcast(payload, 0))
        p = payload.numpy()
        shape = StepShape(p[:b], p[b:2 * b], p[2 * b:3 * b])
        tables = p[3 * b + n:end].reshape(b, cols).astype(np.int32)
        return (shape, p[3 * b:3 * b + n], tables, None if layers < 0 else layers,
                p[end:].astype(np.int32) if lora else None)


def _wait(work) -> None:
    """Wait for a collective; a peer that died or timed out becomes the engine's typed error."""
    try:
        work.wait()
    except RuntimeError as e:
        raise TPWorkerError(f"tensor-parallel collective failed (a worker died or timed out): {e}") from e


def query_heads_of(layout: KVHeadLayout, num_heads: int, rank: int) -> range:
    """The query heads rank computes: those its KV heads serve (GQA), or its 1/tp of them when KV
    heads are replicated (then each rank's query heads still share its one KV head)."""
    if layout.num_kv_heads < layout.tp_size:
        per = num_heads // layout.tp_size
        return range(rank * per, (rank + 1) * per)
    group = num_heads // layout.num_kv_heads
    kv = layout.heads_of(rank)
    return range(kv.start * group, kv.stop * group)


def split_range(n: int, rank: int, size: int) -> range:
    """The contiguous run of n items rank holds (uneven splits allowed: the first ranks get fewer)."""
    return range(rank * n // size, (rank + 1) * n // size)


def vocab_range(vocab: int, rank: int, size: int) -> tuple[range, int]:
    """(the vocabulary rows rank holds, padded shard length): every shard has the same length so
    the logits gather is even; the last one's tail rows are zero padding."""
    per = -(-vocab // size)
    return range(min(rank * per, vocab), min((rank + 1) * per, vocab)), per


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> KVHeadLayout:
    """KVHeadLayout checks the KV heads; replicated KV heads also need the query heads split evenly."""
    layout = KVHeadLayout(num_kv_heads, size)
    if num_kv_heads < size and num_heads % size:
        raise ConfigError(f"{num_heads} query heads cannot be split over tensor_parallel_size {size}")
    return layout


def new_rendezvous(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S,
                   start_timeout_s: float = START_TIMEOUT_S) -> tuple[Rendezvous, object]:
    """Rank 0: a TCPStore on a free port (kept by the caller) and the address the workers join."""
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size, True, timeout=datetime.timedelta(seconds=start_timeout_s),
                          wait_for_workers=False)
    return Rendezvous(host, store.port, world_size, timeout_s, start_timeout_s), store


def join_group(rdv: Rendezvous, rank: int, device: torch.device, store=None) -> TPGroup:
    """Build this rank's groups (blocks until every rank joined, or the start-up timeout passes). The ranks
    first meet on the store: gloo's and NCCL's own joins wait only their groups' (collective) timeout, and a
    rank's process may take longer than that to start."""
    timeout, start = datetime.timedelta(seconds=rdv.timeout_s), datetime.timedelta(seconds=rdv.start_timeout_s)
    if store is None:
        store = dist.TCPStore(rdv.host, rdv.port, rdv.world_size, False, timeout=start)
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(rdv.world_size)], start)
    control = dist.ProcessGroupGloo(dist.PrefixStore("control", store), rank, rdv.world_size, timeout)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        model = dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, rdv.world_size, opts)
    else:
        model = dist.ProcessGroupGloo(dist.PrefixStore("model", store), rank, rdv.world_size, timeout)
    return TPGroup(rank, rdv.world_size, model, control, store)
