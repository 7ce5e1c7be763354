"""`baton bench engine --structured --quick`: the structured-output benchmark runs end to end and writes its
results: both constrained batches stay as wide as the free one (no request ends early), their outputs follow
their grammars, every spec compiles and a cached compile is a lookup."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_structured_quick(tmp_path):
    result = run_bench("engine", "--structured", "--quick", "--out-dir", str(tmp_path))
    t = result["throughput"]
    assert result["quantization"] == "gguf"          # the default model as `baton serve` runs it, packed
    batch, max_tokens = result["workload"]["batch"], result["workload"]["max_tokens"]
    for name in ("free", "json_schema", "regex"):
        assert t[name]["output_tokens"] == batch * max_tokens and t[name]["finished_early"] == 0, (name, t[name])
        assert t[name]["tokens_per_s"] > 0 and t[name]["over_free"] > 0
    for name in ("json_schema", "regex", "json_object"):
        assert t[name]["outputs_follow_grammar"] == batch, name
    assert t["json_object"]["finished_outputs_parse"] == t["json_object"]["finished_early"]
    for name, c in result["compile"].items():
        assert c["cold_ms"] > 0 and c["cached_ms"] < c["cold_ms"], name
    (goal,) = result["goals"].values()
    assert isinstance(goal["met"], bool) and goal["value"] > 0
    assert json.loads((tmp_path / "structured.json").read_text())["throughput"] == t
    png = tmp_path / "structured.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
