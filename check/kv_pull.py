"""Part 4 of `baton check gpu`: a KV pull between two processes over NIXL, VRAM to VRAM, byte-exact, with its GB/s.

A producer process holds a random KV cache in the engine's layout (Llama-3-8B's: 2 MiB blocks in bf16) behind a
NixlTransport; the consumer, this process, holds its own. Metadata and hand-offs cross a multiprocessing pipe
(no Ray). The consumer pulls scattered producer blocks into its own scattered blocks `REPEATS` times; the
first pull (handshake, wire-up) is reported apart, the rest by their median. After every pull the bytes are
compared with the producer's (its cache comes from a seeded generator on the same device, so the consumer
rebuilds it and compares bit patterns on the device, not 1 GiB through a hash on the host), and the producer
must have been notified. The CPU dry mode runs the same DRAM to DRAM on a tiny layout. Without NIXL the row
says it was skipped.
"""
from __future__ import annotations

import importlib
import importlib.util
import multiprocessing as mp
import statistics
import time
from typing import Callable

import numpy as np
import torch

from check.report import FAIL, PASS, SKIP, Row

# [KV heads, layers, K and V, block size, head dim] of one block (engine/kv_layout.py), and how many blocks a pull moves
GPU_LAYOUT, GPU_BLOCKS, GPU_PULL = (8, 32, 2, 16, 128), 1024, 512        # a pull of 1 GiB (8192 tokens)
CPU_LAYOUT, CPU_BLOCKS, CPU_PULL = (2, 2, 2, 16, 16), 64, 24
REPEATS = 5
COMPAT_KEY = "check-gpu:kv-pull"


PRODUCER_SEED, CONSUMER_SEED = 1, 2


def _cache(layout: tuple[int, ...], num_blocks: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """The same seed gives the same cache in any process on the same kind of device."""
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn((num_blocks, *layout), generator=g, dtype=dtype, device=device)


def _bits(kv: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    return kv[block_ids].contiguous().view(torch.uint8)


def producer(conn, layout, num_blocks: int, dtype: torch.dtype, device: str) -> None:
    """The other process: a cache behind a NixlTransport, driven over `conn` until it receives None."""
    from kvtransfer.nixl_transport import NixlTransport
    kv = _cache(layout, num_blocks, dtype, device, PRODUCER_SEED)
    t = NixlTransport(kv, "check-producer", COMPAT_KEY)
    conn.send(t.metadata())
    while (msg := conn.recv()) is not None:
        op, request_id, block_ids = msg
        if op == "export":
            conn.send(t.export(request_id, block_ids, [], 16 * len(block_ids), ttl_s=600))
        else:                                       # "notified": did NIXL tell us the pull has read the blocks?
            deadline = time.monotonic() + 10
            notified = t.poll()
            while request_id not in notified and time.monotonic() < deadline:
                time.sleep(1e-3)
                notified += t.poll()
            conn.send(request_id in notified)
    t.close()


def nixl_missing() -> str | None:
    if importlib.util.find_spec("nixl") is None:
        return "nixl not installed"
    for module in ("nixl._api", "kvtransfer.nixl_transport"):
        try:
            importlib.import_module(module)
        except Exception as e:                      # noqa: BLE001 - a broken install is a skip, said why
            return f"{module} does not import: {type(e).__name__}: {e}"
    return None


def check_kv_pull(cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    missing = nixl_missing()
    if missing:
        return [Row("kv_pull", "NIXL pull between two processes", f"skipped: {missing}", SKIP)]
    layout, num_blocks, n = (CPU_LAYOUT, CPU_BLOCKS, CPU_PULL) if cpu else (GPU_LAYOUT, GPU_BLOCKS, GPU_PULL)
    device, dtype = ("cpu", torch.float32) if cpu else ("cuda", torch.bfloat16)
    ctx = mp.get_context("spawn")                   # CUDA cannot be forked
    here, there = ctx.Pipe()
    proc = ctx.Process(target=producer, args=(there, layout, num_blocks, dtype, device), daemon=True)
    proc.start()
    try:
        log("kv_pull: producer started, pulling")
        return [_pull_row(_Producer(here, proc), layout, num_blocks, n, dtype, device)]
    finally:
        try:
            here.send(None)
        except OSError:                             # the producer is already gone
            pass
        proc.join(30)
        if proc.is_alive():
            proc.kill()


class _Producer:
    """The pipe to the producer process; an answer that does not come in time raises instead of hanging."""

    def __init__(self, conn, proc, timeout_s: float = 120.0):
        self.conn, self.proc, self.timeout_s = conn, proc, timeout_s

    def ask(self, *msg):
        if msg:
            self.conn.send(msg)
        if not self.conn.poll(self.timeout_s):
            raise RuntimeError(f"the producer process did not answer in {self.timeout_s:.0f} s "
                               f"(alive: {self.proc.is_alive()}, exit code {self.proc.exitcode})")
        return self.conn.recv()


def _pull_row(producer: _Producer, layout, num_blocks: int, n: int, dtype: torch.dtype, device: str) -> Row:
    from kvtransfer.nixl_transport import NixlTransport
    kv = _cache(layout, num_blocks, dtype, device, CONSUMER_SEED)
    theirs = _cache(layout, num_blocks, dtype, device, PRODUCER_SEED)
    t = NixlTransport(kv, "check-consumer", COMPAT_KEY)
    t.add_peer(producer.ask())                      # its metadata, sent once it is up
    rng = np.random.default_rng(0)
    seconds, exact, notified = [], [], []
    for i in range(REPEATS):
        src, dst = (rng.permutation(num_blocks)[:n].tolist() for _ in range(2))
        handoff = producer.ask("export", f"pull-{i}", src)
        _sync(device)
        start = time.perf_counter()
        t.pull(handoff, dst, timeout_s=120)
        _sync(device)
        seconds.append(time.perf_counter() - start)
        exact.append(torch.equal(_bits(kv, dst), _bits(theirs, src)))
        notified.append(producer.ask("notified", f"pull-{i}", src))
    t.close()
    nbytes = n * t.block_bytes
    median = statistics.median(seconds[1:])
    ok = all(exact) and all(notified)
    data = {"device": device, "dtype": str(dtype).removeprefix("torch."), "block_layout": list(layout),
            "block_bytes": t.block_bytes, "blocks_per_pull": n, "bytes_per_pull": nbytes, "pulls": REPEATS,
            "seconds": seconds, "first_pull_s": seconds[0], "median_pull_s": median, "gb_per_s": nbytes / median / 1e9,
            "byte_exact": exact, "producer_notified": notified, "passed": ok}
    mem = "DRAM to DRAM" if device == "cpu" else "VRAM to VRAM"
    result = (f"{nbytes / 1e6:.4g} MB in {median * 1e3:.2f} ms = {data['gb_per_s']:.3g} GB/s (first pull "
              f"{seconds[0] * 1e3:.0f} ms); byte-exact {sum(exact)}/{REPEATS}, notified {sum(notified)}/{REPEATS}")
    return Row("kv_pull", f"NIXL pull, {mem}, two processes", result, PASS if ok else FAIL, data=data)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
