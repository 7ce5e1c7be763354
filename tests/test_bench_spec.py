"""`baton bench spec --quick`: the speculative-decoding benchmark runs end to end and writes its results."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_spec_quick(tmp_path):
    result = run_bench("spec", "--quick", "--out", str(tmp_path))
    w = result["workloads"]
    assert result["quantization"] == "gguf"               # the default model as `baton serve` runs it, packed
    assert set(w) == {"repeat", "chat", "batch32"}
    for name, x in w.items():
        assert x["itl_ms_baseline"] > 0 and x["itl_ms_spec"] > 0, name
        assert x["tokens_baseline"] == x["tokens_spec"] > 0, name      # ignore_eos: same work on both sides
    for name in ("repeat", "chat"):                                    # greedy: speculation changes no token
        assert w[name]["identical_outputs"] == w[name]["num_requests"], name
    assert w["repeat"]["num_draft_tokens"] > 0                         # prompt lookup found something to draft
    for group in result["layer_skip"].values():
        for name, c in group["configs"].items():
            assert c["itl_ms"] > 0 and c["identical_outputs"] == c["num_requests"], name
    assert set(result["goals"]) >= {"repeat_speedup_ge_1.5", "chat_itl_spec_le_1.05x_baseline",
                                    "batch32_itl_spec_le_1.05x_baseline"}
    assert json.loads((tmp_path / "spec.json").read_text())["workloads"] == w
    png = tmp_path / "spec_itl.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
