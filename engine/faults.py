"""Fault injection for drills and tests: named points on the serving path fail on demand.

Off unless $BATON_FAULTS_FILE names a JSON file of {"point": probability}; the file is re-read when it
changes, so the faults of a running cluster can be switched on and off (the reliability tests do; an
operator can too, for a game day). With the variable unset, `fire` costs one dictionary lookup.

Points (where they act):
  kv_pull_fail     decode side: a NIXL READ fails when posted (as if the producer were gone); the pull
                   retries once after a new handshake, then the request falls back to a local prefill
  kv_pull_stall    decode side: a READ is never completed, so the pull fails at the handle's expiry
  kv_events_drop   either pool: a replica's batch of KV events is lost on its way to the cluster state
"""
from __future__ import annotations

import json
import logging
import os
import random

log = logging.getLogger(__name__)

ENV = "BATON_FAULTS_FILE"
POINTS = ("kv_pull_fail", "kv_pull_stall", "kv_events_drop")

_cache: dict[str, object] = {"mtime": None, "faults": {}}


def active() -> dict[str, float]:
    path = os.environ.get(ENV)
    if not path:
        return {}
    try:
        st = os.stat(path)
        mtime = (st.st_ino, st.st_mtime_ns, st.st_size)          # os.replace gives a new inode each write
    except OSError:
        return {}
    if mtime != _cache["mtime"]:
        try:
            faults = {k: float(v) for k, v in json.loads(open(path).read() or "{}").items()}
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("fault file %s unreadable (%r): no faults", path, e)
            faults = {}
        unknown = set(faults) - set(POINTS)
        if unknown:
            log.warning("fault file %s names unknown points %s (known: %s)", path, sorted(unknown), POINTS)
        if faults:
            log.warning("fault injection active: %s", faults)
        _cache.update(mtime=mtime, faults=faults)
    return _cache["faults"]  # type: ignore[return-value]


def fire(point: str) -> bool:
    """Whether the fault at `point` happens this time."""
    p = active().get(point, 0.0) if os.environ.get(ENV) else 0.0
    return p > 0 and random.random() < p


def write(path: str, faults: dict[str, float]) -> None:
    """Switch faults (tests, drills): atomically, so a reader never sees half a file."""
    unknown = set(faults) - set(POINTS)
    if unknown:
        raise ValueError(f"unknown fault points {sorted(unknown)}; known: {POINTS}")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(faults, f)
    os.replace(tmp, path)
