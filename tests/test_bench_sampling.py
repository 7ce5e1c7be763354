"""`baton bench engine --sampling --quick`: the sampling benchmark runs end to end and writes its results: greedy
and every sampling setting, each on the CPU sampler kernel and on torch's way, their ratios, and seeded requests
that sample the same tokens under both (one definition, two implementations)."""
from __future__ import annotations

import json

import pytest

from bench.sampling_bench import SETTINGS
from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_sampling_quick(tmp_path):
    result = run_bench("engine", "--sampling", "--quick", "--out-dir", str(tmp_path))
    assert result["quantization"] == "gguf" and result["greedy_tok_s"] > 0
    assert set(result["settings"]) == set(SETTINGS)
    for name, s in result["settings"].items():
        assert s["kernel_tok_s"] > 0 and s["torch_tok_s"] > 0
        assert s["kernel_over_torch"] == pytest.approx(s["kernel_tok_s"] / s["torch_tok_s"])
        assert s["kernel_over_greedy"] == pytest.approx(s["kernel_tok_s"] / result["greedy_tok_s"])
        assert s["requests_equal"] == 1.0, name
    assert json.loads((tmp_path / "sampling.json").read_text())["settings"] == result["settings"]
    png = tmp_path / "sampling.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
