"""`baton bench transfer --quick`: the KV transfer benchmark runs end to end, every pull is exact, and it
writes its results."""
from __future__ import annotations

import json
import os

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.cluster                        # the benchmark starts a local Ray of its own
@pytest.mark.bench
def test_bench_transfer_quick(tmp_path):
    result = run_bench("transfer", "--quick", "--out", str(tmp_path))
    (shape,) = result["shapes"].values()
    assert shape["num_blocks"] == 256 // 16 and shape["bytes"] == 16 * shape["block_bytes"]
    assert shape["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 4          # SmolLM2-135M's fp32 block layout
    assert shape["prefill_s"] > 0
    for kind in ("nixl", "ray"):
        r = shape[kind]
        assert r["byte_exact"], kind
        assert r["producer_unpinned"] == result["repeats"] + 1, kind  # every pull released its pin
        assert r["gbps"] > 0 and len(r["pull_s_all"]) == result["repeats"], kind
        assert r["descriptors_per_block"] == 1, kind                   # same layout: one descriptor per block
    assert shape["nixl"]["ucx_tls"] == os.environ.get("UCX_TLS", "shm,tcp")      # kvtransfer's CPU default
    assert set(shape["ratios"]) == {"nixl_of_copy_bound", "nixl_of_per_block_copy", "nixl_vs_fallback",
                                    "nixl_pull_of_prefill"}
    assert json.loads((tmp_path / "transfer.json").read_text())["shapes"] == result["shapes"]
    png = tmp_path / "transfer.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
