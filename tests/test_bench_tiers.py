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
    assert result["quantization"] == "gguf"          # the default model as `baton serve` runs it, packed
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
    """`baton bench cluster --workload tiers --quick` (the tiny model), its host-tier run alone (each run is a
    deployment, and the effect of the tier against none is asserted at the engine, above): every request is
    served, revisited prefixes come from host memory, nothing is pulled (each tenant stays on its replica), and
    the JSON on stdout parses although Ray prints while the cluster stops."""
    result = run_bench("cluster", "--workload", "tiers", "--quick", "--tiers-runs", "host_tier",
                       "--out", str(tmp_path))
    (run,) = result["runs"].values()
    assert run["ok"] == run["requests"] == result["requests"], run["errors"]
    assert run["prefill_query_tokens"] > 0 and run["prefill_host_hit_tokens"] > 0.5 * run["prefill_query_tokens"]
    assert run["prefill_pulled_tokens"] == 0 and run["prefix_reuse_rate"] == run["prefix_hit_rate"] <= 1
    assert result["host_tier_hit_rate_gain"] is None                 # no baseline run to compare with
    assert json.loads((tmp_path / "tiers.json").read_text())["runs"] == result["runs"]
    assert (tmp_path / "tiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
