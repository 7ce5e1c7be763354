"""`baton bench transfer --quick`: the KV transfer benchmark runs end to end, every pull is exact, and it
writes its results; `--cross-node` does so between two nodes of a namespace cluster (root only)."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.cluster                        # the benchmark starts a local Ray of its own
@pytest.mark.bench
def test_bench_transfer_quick(tmp_path):
    result = run_bench("transfer", "--quick", "--out", str(tmp_path))
    assert list(result["shapes"]) == ["default", "default kv-int8"]           # each KV cache dtype, by default
    fp32, int8 = result["shapes"]["default"], result["shapes"]["default kv-int8"]
    assert fp32["block_bytes"] == 30 * 2 * 16 * 3 * 64 * 4          # SmolLM2-135M's fp32 block layout
    assert int8["block_bytes"] == 3 * (30 * 2 * 16 * 64 + 4096)     # a byte a value, and each head's scales
    assert int8["kv_cache_dtype"] == "int8" and int8["kv_dtype"] == "uint8" and fp32["kv_dtype"] == "float32"
    for shape in (fp32, int8):
        assert shape["num_blocks"] == 256 // 16 and shape["bytes"] == 16 * shape["block_bytes"]
        assert shape["prefill_s"] > 0
        for kind in ("nixl", "ray"):
            r = shape[kind]
            assert r["byte_exact"], kind
            assert r["producer_unpinned"] == result["repeats"] + 1, kind  # every pull released its pin
            assert r["gbps"] > 0 and len(r["pull_s_all"]) == result["repeats"], kind
            assert r["descriptors_per_block"] == 1, kind                   # same layout: one descriptor per block
    shape = fp32
    assert shape["nixl"]["ucx_tls"] == os.environ.get("UCX_TLS", "shm,tcp")      # kvtransfer's CPU default
    assert set(shape["ratios"]) == {"nixl_of_copy_bound", "nixl_of_per_block_copy", "nixl_vs_fallback",
                                    "nixl_pull_of_prefill"}
    assert json.loads((tmp_path / "transfer.json").read_text())["shapes"] == result["shapes"]
    png = tmp_path / "transfer.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.bench
def test_bench_transfer_cross_node(tmp_path):
    from cluster.netns import unavailable
    if why := unavailable():
        pytest.skip(f"no network namespaces: {why}")
    result = run_bench("transfer", "--cross-node", "--shapes", "default", "--kv-cache-dtypes", "auto", "--tokens", "32",
                       "--repeats", "2", "--out", str(tmp_path))
    (shape,) = result["shapes"].values()
    assert shape["num_blocks"] == 2 and shape["bytes"] == 2 * shape["block_bytes"]
    assert result["ucx_tls"] == "tcp"                  # over the veth pairs, not shared memory
    ips = result["cluster"]["ips"]
    for where, (producer, consumer) in {"same_node": (1, 1), "cross_node": (1, 2)}.items():
        r = shape[where]
        assert r["node_ips"] == [ips[producer], ips[consumer]], where
        assert r["byte_exact"] and r["gbps"] > 0 and r["ucx_tls"] == "tcp", where
        assert r["producer_unpinned"] == result["repeats"] + 1 and len(r["pull_s_all"]) == result["repeats"], where
    assert shape["cross_of_same"] == pytest.approx(shape["cross_node"]["gbps"] / shape["same_node"]["gbps"])
    assert json.loads((tmp_path / "transfer_cross_node.json").read_text())["shapes"] == result["shapes"]
    assert (tmp_path / "transfer_cross_node.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "baton-bench-xnode" not in listed, "the benchmark deletes its namespaces"


def test_bench_transfer_cross_node_says_why_it_cannot_run(monkeypatch, tmp_path):
    import cluster.netns
    from bench import transfer_bench
    from cli.main import build_parser
    monkeypatch.setattr(cluster.netns, "unavailable", lambda: "creating network namespaces needs root")
    args = build_parser("transfer").parse_args(["bench", "transfer", "--cross-node", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--cross-node: creating network namespaces needs root"):
        transfer_bench.run(args)
