"""`baton bench engine --kv-tiers --quick`: the KV-tier benchmark runs end to end and writes its results: with
the host tier, revisits are served from host memory (nothing of a revisited document recomputed), without it
they are recomputed, and all three engines give the same tokens; an int8 KV cache in the device engine's bytes
keeps the whole working set on the device."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_kv_tiers_quick(tmp_path):
    result = run_bench("engine", "--kv-tiers", "--quick", "--out-dir", str(tmp_path))
    w, e = result["workload"], result["engines"]
    revisited = w["docs"] * (w["visits"] - 1) * (w["doc_tokens"] // 16 * 16)     # the documents' full blocks
    assert e["tiered"]["hit_tokens_host"] == revisited and e["tiered"]["hit_tokens_device"] == 0
    assert e["device"]["hit_tokens_host"] == 0 and e["device"]["hit_tokens_device"] == 0, "the cache is too small"
    assert e["roomy"]["hit_tokens_device"] == revisited and e["roomy"]["offloaded_blocks"] == 0
    assert e["tiered"]["computed_tokens"] == e["roomy"]["computed_tokens"] < e["device"]["computed_tokens"]
    assert e["tiered"]["moved_bytes"] > 0 and result["same_tokens"] is True
    assert result["revisit_ttft_device_over_tiered"] > 0
    int8 = e["int8"]
    assert int8["kv_blocks"] >= 3.7 * e["device"]["kv_blocks"] and int8["hit_tokens_device"] == revisited
    assert int8["computed_tokens"] == e["roomy"]["computed_tokens"] and int8["token_agreement_with_fp32"] > 0.5
    assert json.loads((tmp_path / "kv_tiers.json").read_text())["engines"] == e
    png = tmp_path / "kv_tiers.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.cluster                        # the benchmark starts a local Ray of its own
@pytest.mark.bench
def test_bench_cluster_tiers_quick(tmp_path):
    """`baton bench cluster --workload tiers --quick` (the tiny model), three of its runs on one Serve start.
    Without the host tier the prefill pool reuses almost nothing (the prefixes outgrow its caches and each
    tenant stays on its replica); with it, revisited prefixes come from host memory. The power-of-two run with
    prefix pulls serves every request (whether a pull pays for a model this small is the cost rule's call)."""
    result = run_bench("cluster", "--workload", "tiers", "--quick", "--tiers-runs", "baseline,host_tier,pow2_pull",
                       "--out", str(tmp_path))
    runs = result["runs"]
    assert list(runs) == ["baseline", "host_tier", "pow2_pull"]
    for name, r in runs.items():
        assert r["ok"] == r["requests"] == result["requests"], (name, r["errors"])
        assert r["prefill_query_tokens"] > 0 and 0 <= r["prefix_reuse_rate"] <= 1, (name, r)
    assert runs["baseline"]["prefill_host_hit_tokens"] == 0 and runs["host_tier"]["prefill_host_hit_tokens"] > 0
    assert result["host_tier_hit_rate_gain"] >= 2
    assert runs["baseline"]["prefill_pulled_tokens"] == runs["host_tier"]["prefill_pulled_tokens"] == 0
    assert json.loads((tmp_path / "tiers.json").read_text())["runs"] == runs
    assert (tmp_path / "tiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
