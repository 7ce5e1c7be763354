"""NixlTransport: KV blocks between two engines' caches as NIXL (UCX) one-sided READs.

Each engine owns one NIXL agent, named `<prefix>-<uuid>` afresh in every process, and registers its
whole KV cache once (DRAM on CPU, VRAM on CUDA), then prepares one descriptor per block: the
engine's layout keeps a block's K and V for every layer contiguous, so a pull of n blocks is n
descriptors, prepared once per peer and picked by index.

    producer                                   consumer
    metadata() --(registered once per process)--> add_peer(): compat checked first, then load + prep blocks
    export() -> KVHandoff ------------------------> start_pull(): READ blocks[skip:] into dst[skip:]
    poll() <-- NIXL notification "request id" ---  (sent by NIXL once the READ's data is read)

A pull naming an agent the consumer has never seen asks `peer_metadata(agent_name)` once (in a cluster:
the state actor, where every replica registered its metadata at start-up) and handshakes; the peer
table is the cache. A producer that restarted has a new agent name, so a cached entry never goes
stale: its handshake drops the old agent (same prefix), and a READ that fails forgets the peer and is
retried once after a fresh handshake; a handle naming a dead agent fails with KVTransferError for
that request only.

Across TP sizes (kvtransfer/transport.py): a consumer rank READs each run of its heads from the
producer rank that holds it, one descriptor per (block, run) (heads-outer caches make a run one span;
unprepared descriptor lists, built per pull), one transfer per producer rank; READs across TP carry no
notification, the producer's rank 0 is told by a separate message once the pull is done (notify).

UCX settings (environment, read when the agent is made):
- CPU (DRAM to DRAM): UCX_TLS defaults to CPU_UCX_TLS = "shm,tcp" unless already set: shm brings
  cma (process_vm_readv: a READ is one kernel copy, the producer's CPU is not involved) and
  shared-memory messages (wire-up, notifications) within a node; tcp reaches other nodes. Measured
  2026-11-22 on the 2-core dev VM, two Ray actors, 136 random blocks of 737,280 B (100 MB, the
  SmolLM2-135M fp32 layout), median of 10 pulls, two rounds (GB/s; 4-block pull in ms):
      UCX_TLS   100 MB pull      4 blocks          first 100 MB pull (handshake, wire-up)
      shm,tcp   3.4 / 4.3 GB/s   2.9 / 0.8 ms      0.09-0.11 s
      cma,tcp   3.3 / 3.5        1.1 / 1.1         0.08-0.11 s
      all       3.0 / 3.7        2.5 / 1.3         0.11-0.16 s    (UCX's default)
      tcp       0.6 / 0.6        6.1               0.21 s
      posix,tcp 0.7              -                 0.26 s         (no zero-copy READ: falls back to tcp)
  Same machine: a block-by-block torch copy_ within one process 6.3 GB/s median (9.0 best); the Ray
  fallback 1.0 GB/s.
- CUDA: nothing is set; UCX's default picks cuda_ipc (NVLink) within a node and rc (RDMA) across
  nodes. If you narrow UCX_TLS, keep cuda_copy in it: without it UCX takes VRAM for host memory.
- NIXL's progress thread waits PROGRESS_DELAY_US between polls instead of spinning (see
  _make_agent): a one-sided READ needs no producer CPU, but wire-up and tcp-emulated READs do.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from engine import faults
from kvtransfer.errors import KVTransferError
from kvtransfer.handle import KVHandle
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import KVTransport

log = logging.getLogger(__name__)

CPU_UCX_TLS = "shm,tcp"        # measured best here: see the module docstring
WAIT_POLL_S = 1e-4
PROGRESS_DELAY_US = 100        # NIXL progress thread's wait between polls (see _make_agent)


@dataclass(slots=True)
class Peer:
    name: str
    prefix: str
    num_blocks: int
    blocks: object              # NIXL prepared descriptor list of its blocks, one per block
    base: int                   # its cache's address, block geometry and memory: for runs of heads
    block_bytes: int
    mem: str
    dev: int


class NixlTransport(KVTransport):
    kind = "nixl"

    def __init__(self, kv_cache: torch.Tensor, name_prefix: str, compat_key: str,
                 peer_metadata: Callable[[str], bytes] | None = None, num_threads: int = 0,
                 clock: Callable[[], float] = time.time, **tp):
        super().__init__(kv_cache, name_prefix, compat_key, peer_metadata, clock, **tp)
        if kv_cache.device.type == "cpu":
            os.environ.setdefault("UCX_TLS", CPU_UCX_TLS)
        self.mem = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.dev = max(kv_cache.get_device(), 0)
        self.agent = _make_agent(self.name, num_threads)
        self.registration = self.agent.register_memory(kv_cache)
        self.local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._block_descs(kv_cache.data_ptr(), self.num_blocks, self.block_bytes, self.dev), self.mem)
        self.peers: dict[str, Peer] = {}
        self.by_prefix: dict[str, str] = {}                  # producer prefix -> its live agent
        self._metadata: bytes | None = None

    @staticmethod
    def _block_descs(base: int, num_blocks: int, block_bytes: int, dev: int) -> np.ndarray:
        d = np.empty((num_blocks, 3), dtype=np.uint64)
        d[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * block_bytes
        d[:, 1], d[:, 2] = block_bytes, dev
        return d

    # -- producer ---------------------------------------------------------------------------------
    def metadata(self) -> bytes:
        """What a consumer needs to READ from us: compat key, block geometry, NIXL agent metadata."""
        if self._metadata is None:
            self._metadata = self._envelope(nixl_md=self.agent.get_agent_metadata(),
                                            base=self.kv_cache.data_ptr(), mem=self.mem, dev=self.dev)
        return self._metadata

    def _notified(self) -> list[str]:
        return [m.decode(errors="replace") for msgs in self.agent.get_new_notifs().values() for m in msgs]

    # -- handshake --------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> str:
        """Handshake with a producer (cached); returns its agent name. A new incarnation of a known
        prefix replaces the old agent, which is dead."""
        env = self._open_envelope(metadata)
        name, prefix = env["name"], env["prefix"]
        if name in self.peers:
            return name
        if prefix in self.by_prefix:
            log.info("%s: producer %s restarted as %s", self.name, self.by_prefix[prefix], name)
            self.forget_peer(self.by_prefix[prefix])
        loopback = name == self.name
        try:
            if not loopback:
                self.agent.add_remote_agent(env["nixl_md"])
            blocks = self.agent.prep_xfer_dlist(
                name, self._block_descs(env["base"], env["num_blocks"], env["block_bytes"], env["dev"]), env["mem"])
        except Exception as e:
            if not loopback:
                self._quietly(self.agent.remove_remote_agent, name)
            raise KVTransferError(f"{self.name}: handshake with {name} failed: {e!r}") from e
        self.peers[name] = Peer(name, prefix, env["num_blocks"], blocks, env["base"], env["block_bytes"],
                                env["mem"], env["dev"])
        self.by_prefix[prefix] = name
        return name

    def peer(self, name: str) -> Peer:
        """The peer called `name`, handshaking through peer_metadata if it is new."""
        if name in self.peers:
            return self.peers[name]
        if self.peer_metadata is None:
            raise KVTransferError(f"{self.name}: unknown producer {name} and no peer_metadata to ask")
        try:
            metadata = self.peer_metadata(name)
        except Exception as e:
            raise KVTransferError(f"{self.name}: cannot get the metadata of producer {name}: {e!r}") from e
        got = self.add_peer(metadata)
        if got != name:
            raise KVTransferError(f"producer {name} is gone (its replica now runs {got}): stale KV handle")
        return self.peers[name]

    def forget_peer(self, name: str) -> None:
        peer = self.peers.pop(name, None)
        if peer is None:
            return
        if self.by_prefix.get(peer.prefix) == name:
            del self.by_prefix[peer.prefix]
        self._quietly(peer.blocks.release)
        if name != self.name:
            self._quietly(self.agent.remove_remote_agent, name)

    def _quietly(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:           # cleanup of a dead peer's state must not fail the caller
            log.debug("%s: %s failed: %r", self.name, getattr(fn, "__name__", fn), e)

    # -- consumer ---------------------------------------------------------------------------------
    def start_pull(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0,
                   notify: bool = True) -> NixlPull:
        handle = handoff.handle
        self._check_pull(handle, dst_block_ids, skip_blocks)
        pull = NixlPull(self, handle, np.asarray(dst_block_ids[skip_blocks:], dtype=np.int32),
                        np.asarray(handle.block_ids[skip_blocks:], dtype=np.int32), self.runs(handle), notify)
        pull.start()
        return pull

    def notify_pulled(self, handoff: KVHandoff) -> None:
        self._notify(handoff.handle)

    def _notify(self, handle: KVHandle) -> None:
        try:
            self.agent.send_notif(self.peer(handle.agent).name, handle.request_id.encode())
        except Exception as e:
            raise KVTransferError(f"{self.name}: cannot tell {handle.agent} that {handle.request_id} "
                                  f"was pulled: {e!r}") from e

    def read_runs(self, peer: Peer, runs, dst: np.ndarray, src: np.ndarray, notif: bytes = b""):
        """One READ of the runs of heads `runs` (all from `peer`) of blocks src into dst: a descriptor
        per (block, run), ordered block-major."""
        hb = self.head_bytes
        off = np.array([[r.src_head * hb, r.dst_head * hb, r.num_heads * hb] for r in runs], dtype=np.uint64)
        n = len(src) * len(runs)

        def descs(base: int, block_bytes: int, blocks: np.ndarray, col: int, dev: int) -> np.ndarray:
            d = np.empty((n, 3), dtype=np.uint64)
            d[:, 0] = (base + blocks.astype(np.uint64)[:, None] * block_bytes + off[None, :, col]).ravel()
            d[:, 1], d[:, 2] = np.tile(off[:, 2], len(src)), dev
            return d
        local = self.agent.get_xfer_descs(descs(self.kv_cache.data_ptr(), self.block_bytes, dst, 1, self.dev), self.mem)
        remote = self.agent.get_xfer_descs(descs(peer.base, peer.block_bytes, src, 0, peer.dev), peer.mem)
        return self.agent.initialize_xfer("READ", local, remote, peer.name, notif)

    def close(self) -> None:
        for name in list(self.peers):
            self.forget_peer(name)
        self._quietly(self.local.release)
        self._quietly(self.agent.deregister_memory, self.registration)


def _make_agent(name: str, num_threads: int):
    """A NIXL agent (UCX backend) whose progress thread pauses between polls. nixl's Python API
    hard-codes a pause of 0, a busy loop that burns a whole core per engine even when idle
    (measured here: 100% of a core, vs 3% with 100 us); the config class is swapped for the call."""
    import nixl._api as api                    # imported here: only engines that use NIXL need it
    base = api.nixlBind.nixlAgentConfig

    class Config(base):
        def __setattr__(self, key, value):
            super().__setattr__(key, PROGRESS_DELAY_US if key == "pthrDelay" else value)

    api.nixlBind.nixlAgentConfig = Config
    try:
        return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"], num_threads=num_threads))
    finally:
        api.nixlBind.nixlAgentConfig = base


class NixlPull:
    """One request's READs in flight (one per producer rank it reads from). After a failure it handshakes
    again and retries once."""

    def __init__(self, transport: NixlTransport, handle: KVHandle, dst: np.ndarray, src: np.ndarray,
                 runs: list, notify: bool = True):
        self.t, self.handle, self.dst, self.src, self.runs, self.notify = transport, handle, dst, src, runs, notify
        self.request_id = handle.request_id
        self.xfers: list = []
        self.notified = False                         # the producer was told by the READ itself
        self.finished = False
        self.retried = False
        self.stalled = False                          # fault injection: a READ that never completes
        self.cause: Exception | None = None          # why NIXL failed, for the error message
        self.error: KVTransferError | None = None

    def _sources(self) -> dict[str, tuple[Peer, list]]:
        """agent -> (its peer, the runs read from it), handshaking with producer ranks not met yet."""
        agents = self.handle.rank_agents
        by_rank: dict[int, list] = {}
        for run in self.runs:
            by_rank.setdefault(run.src_rank, []).append(run)
        out = {}
        for rank, runs in by_rank.items():
            peer = self.t.peer(agents[rank])
            if len(self.src) and int(self.src.max()) >= peer.num_blocks:
                raise KVTransferError(f"handle {self.request_id} names blocks past {peer.name}'s {peer.num_blocks}")
            out[peer.name] = (peer, runs)
        return out

    def start(self) -> None:
        t, msg = self.t, self.request_id.encode()
        try:
            sources = self._sources()
        except KVTransferError as e:
            self._fail(e)
        try:
            if not len(self.src):                     # every block was local: only unpin the producer
                state = "DONE"
            elif faults.fire("kv_pull_fail"):
                raise RuntimeError("injected fault kv_pull_fail")
            elif faults.fire("kv_pull_stall"):
                self.stalled, state = True, "PROC"
            else:
                # A single READ from producer rank 0 notifies it once the data is read (TP 1, as ever);
                # reads from several ranks are followed by one message (_settle)
                one = self.notify and list(sources) == [self.handle.agent]
                self.notified = one
                for peer, runs in sources.values():
                    note = msg if one else b""
                    if t.whole_blocks(self.handle, runs):
                        xfer = t.agent.make_prepped_xfer("READ", t.local, self.dst, peer.blocks, self.src,
                                                         notif_msg=note)
                    else:
                        xfer = t.read_runs(peer, runs, self.dst, self.src, note)
                    self.xfers.append(xfer)
                state = self._merge([t.agent.transfer(x) for x in self.xfers])
        except Exception as e:
            state, self.cause = "ERR", e
        self._settle(state)

    @staticmethod
    def _merge(states: list[str]) -> str:
        return "ERR" if "ERR" in states else "PROC" if "PROC" in states else "DONE"

    def done(self) -> bool:
        if self.error is not None:
            raise self.error
        if not self.finished:
            try:
                state = "PROC" if self.stalled else self._merge([self.t.agent.check_xfer_state(x) for x in self.xfers])
            except Exception as e:
                state, self.cause = "ERR", e
            self._settle(state)
        return self.finished

    def _settle(self, state: str) -> None:
        if state == "PROC":
            if self.t.clock() >= self.handle.expiry:
                self._fail(KVTransferError(f"pull of {self.request_id} not done by the handle's expiry"))
            return
        self._release()
        if state == "DONE":
            if self.t.clock() > self.handle.expiry:     # the producer may have reused the blocks meanwhile
                self._fail(KVTransferError(f"pull of {self.request_id} finished after the handle's expiry"))
            if self.notify and not self.notified:
                try:
                    self.t._notify(self.handle)
                except KVTransferError as e:
                    self._fail(e)
            self.finished = True
        elif not self.retried:
            log.warning("%s: READ of %s from %s failed (%r); handshaking again", self.t.name, self.request_id,
                        self.handle.rank_agents, self.cause)
            self.retried = True
            for agent in self.handle.rank_agents:
                self.t.forget_peer(agent)
            self.start()
        else:                                         # gone for good, most likely: forget it (its name never returns)
            for agent in self.handle.rank_agents:
                self.t.forget_peer(agent)
            self._fail(KVTransferError(f"pull of {self.request_id} from {self.handle.agent} failed: {self.cause!r}"))

    def wait(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                self._fail(KVTransferError(f"pull of {self.request_id} timed out after {timeout_s} s"))
            time.sleep(WAIT_POLL_S)

    def _release(self) -> None:
        """Free NIXL's requests; NIXL cancels one still in flight (where the backend can)."""
        xfers, self.xfers = self.xfers, []
        for xfer in xfers:
            self.t._quietly(xfer.release)

    def _fail(self, error: KVTransferError):
        self._release()
        self.error = error
        raise error
