"""Reading a running cluster's merged /metrics (the ingress's): one scrape as {sample: value}, a pool's total of
a counter, each replica's gauge, and the leak check after load. Benchmarks and cluster tests both use it."""
from __future__ import annotations

import time
import urllib.request
from typing import Any


# A fresh scrape waits past router.cluster_state.DEAD_AFTER_S (15 s): a replica that a redeploy or a failure
# replaced is listed, with its last report, until the state actor forgets it
FRESH_TIMEOUT_S = 30.0


def scrape(base: str, fresh: bool = False, timeout_s: float = FRESH_TIMEOUT_S) -> dict[str, float]:
    """Sample name with labels -> value, from one scrape of the ingress at `base` (http://host:port). The ingress
    shows each replica's latest report (sent every REPORT_INTERVAL_S): with `fresh`, scrape again until every
    replica's report was read after this call began (by this machine's clock: for tests and benchmarks on one
    host), so that whatever ended before the call shows in every pool's counters and gauges."""
    since, deadline = time.time(), time.monotonic() + timeout_s
    while True:
        out = {}
        for line in urllib.request.urlopen(f"{base}/metrics", timeout=30).read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        stale = {r for r, t in replica_gauges(out, "baton_replica_metrics_timestamp_seconds").items() if t < since}
        if not fresh or not stale:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"no report newer than {timeout_s:g} s ago from replicas {sorted(stale)}")
        time.sleep(0.1)


def pool_total(m: dict[str, float], metric: str, pool: str) -> float:
    return sum(v for k, v in m.items() if k.startswith(metric + "{") and f'pool="{pool}"' in k)


def replica_gauges(m: dict[str, float], metric: str) -> dict[str, float]:
    """pool/replica -> value of a per-replica gauge."""
    out = {}
    for k, v in m.items():
        if k.startswith(metric + "{"):
            labels = dict(p.split("=", 1) for p in k[len(metric) + 1:-1].split(","))
            out[f"{labels['pool'].strip(chr(34))}/{labels['replica'].strip(chr(34))}"] = v
    return out


def leak_report(base: str, settle_s: float = 20.0) -> dict[str, Any]:
    """Wait (up to settle_s) for every replica to hold no KV blocks and no pins and the ingress to hold no
    admitted tokens; then report what each holds, and each replica's memory. Each scrape waits (briefly) for
    reports newer than itself, so that one sent before the last request ended cannot pass for clean; a replica
    that died and is not yet forgotten stops no scrape."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            m = scrape(base, fresh=True, timeout_s=2.0)
        except TimeoutError:
            m = scrape(base)
        used = replica_gauges(m, "baton_kv_blocks_used")
        pinned = replica_gauges(m, "baton_kv_pinned_requests")
        queued = m.get("baton_admission_queued_prompt_tokens", 0.0)
        kv_tokens = m.get("baton_admission_kv_tokens", 0.0)
        tracked = {r: v for g in ("baton_requests_tracked", "baton_open_streams")
                   for r, v in replica_gauges(m, g).items() if v}           # per-request state left anywhere
        clean = not any(used.values()) and not any(pinned.values()) and not queued and not kv_tokens \
            and not tracked
        if clean or time.monotonic() > deadline:
            return {"clean": clean, "kv_blocks_used": used, "kv_pinned_requests": pinned,
                    "requests_tracked_or_streams": tracked,
                    "admission_queued_tokens": queued, "admission_kv_tokens": kv_tokens,
                    "rss_bytes": replica_gauges(m, "baton_replica_resident_memory_bytes"),
                    "heap_bytes": replica_gauges(m, "baton_replica_heap_in_use_bytes")}
        time.sleep(0.5)
