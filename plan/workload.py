"""Workloads for the simulator: the requests of `baton bench` runs (token ids, hashed with the one block hash),
Mooncake traces (hash ids as the blocks), and a day of a trace's requests on a diurnal curve."""
from __future__ import annotations

import math
from collections import Counter
from typing import Iterable, Iterator

import numpy as np

from engine.block_hash import block_hashes
from plan.sim import SimRequest

MOONCAKE_BLOCK = 512             # tokens per hash id in Mooncake's traces
KEY = "plan"                     # the model key the simulated blocks chain under (one model per run)


def from_reqs(reqs: Iterable, block_size: int) -> list[SimRequest]:
    """bench.cluster_bench.Req objects (prompt token ids, max_tokens, at): what a measured run sent."""
    out = []
    for i, r in enumerate(reqs):
        if not isinstance(r.prompt, list):
            raise ValueError("the simulator takes token-id prompts (a text prompt's length depends on the tokenizer)")
        out.append(SimRequest(i, r.at, len(r.prompt), r.max_tokens, block_hashes(r.prompt, block_size, KEY)))
    return out


def from_mooncake(rows: list[dict], speedup: float = 1.0, t0: float | None = None) -> list[SimRequest]:
    """Mooncake rows as they are (lengths in tokens, 512-token blocks): the simulator's block size is then 512,
    and a block's hash chains its hash ids (requests sharing leading ids share the prefix)."""
    t0 = rows[0]["timestamp"] if t0 is None else t0
    out = []
    for i, r in enumerate(rows):
        full = r["input_length"] // MOONCAKE_BLOCK
        out.append(SimRequest(i, (r["timestamp"] - t0) / 1e3 / speedup, max(1, r["input_length"]),
                              max(1, r["output_length"]), block_hashes(list(r["hash_ids"][:full]), 1, KEY)))
    return out


def diurnal(hour: np.ndarray, trough: float = 0.15) -> np.ndarray:
    """Relative request rate over a day (1 at the 14:00 peak, `trough` at 02:00): a cosine."""
    return trough + (1 - trough) * 0.5 * (1 + np.cos(2 * math.pi * (hour - 14) / 24))


def iter_day(rows: list[dict], peak_rps: float, hours: float = 24.0, seed: int = 0, trough: float = 0.15
              ) -> Iterator[dict]:
    """A day of Mooncake-shaped requests: arrivals a Poisson process whose rate follows `diurnal` (peak
    `peak_rps`); request i is row i mod len(rows) of the trace, its conversation's hash ids renamed per pass
    over the trace (a new set of users), ids shared by at least a tenth of the rows kept (system prompts). One
    by one, in arrival order: a day at the 1,000-GPU scale is millions of them."""
    rng = np.random.default_rng(seed)
    counts = Counter(h for r in rows for h in set(r["hash_ids"]))
    shared = {h for h, c in counts.items() if c >= max(2, len(rows) / 10)}
    span = max(counts) + 1 if counts else 1
    # thinning: candidate arrivals at the peak rate, kept with the curve's probability
    n = rng.poisson(peak_rps * hours * 3600)
    times = np.sort(rng.uniform(0, hours * 3600, n))
    times = times[rng.uniform(size=n) < diurnal(times / 3600, trough)]
    for i, t in enumerate(times):
        r = rows[i % len(rows)]
        k = i // len(rows)
        yield {"timestamp": float(t) * 1e3, "input_length": r["input_length"], "output_length": r["output_length"],
               "hash_ids": [h if h in shared else h + k * span for h in r["hash_ids"]]}


def day_of(rows: list[dict], peak_rps: float, hours: float = 24.0, seed: int = 0, trough: float = 0.15
           ) -> list[dict]:
    """iter_day's requests as a list."""
    return list(iter_day(rows, peak_rps, hours, seed, trough))
