"""`baton bench engine --embed --quick`: the embedding benchmark runs end to end and writes its results: Baton on
the fp32 copy and packed, transformers batched as sentence-transformers runs it, their ratios, and Baton's vectors
agreeing with transformers' (the fp32 copy to fp32's order, the packed weights to their error)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_embed_quick(tmp_path):
    result = run_bench("engine", "--embed", "--quick", "--out-dir", str(tmp_path))
    systems = result["systems"]
    assert list(systems) == ["baton fp32", "baton gguf", "transformers"]
    for s in systems.values():
        assert s["prompt_tokens_per_s"] > 0 and s["inputs_per_s"] > 0
        assert s["over_transformers"] == pytest.approx(s["prompt_tokens_per_s"] /
                                                       systems["transformers"]["prompt_tokens_per_s"])
    assert systems["baton fp32"]["cosine_with_transformers"]["min"] > 0.9999
    assert systems["baton gguf"]["cosine_with_transformers"]["min"] > 0.95
    assert json.loads((tmp_path / "embed.json").read_text())["systems"] == systems
    png = tmp_path / "embed.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
