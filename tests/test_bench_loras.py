"""`baton bench engine --loras 3 --quick`: the multi-LoRA benchmark runs end to end and writes its results: a
batch mixing three adapters ran through three slots, its tokens equal each adapter's requests run alone, and
the base, idle-LoRA and mixed throughputs and their ratios are reported (the 0.7 goal is the benchmark's)."""
from __future__ import annotations

import json

import pytest

from tests.conftest import run_bench


@pytest.mark.slow
@pytest.mark.bench
def test_bench_loras_quick(tmp_path):
    result = run_bench("engine", "--loras", "3", "--quick", "--out-dir", str(tmp_path))
    runs = result["runs"]
    assert result["quantization"] == "gguf"          # the default model as `baton serve` runs it, packed
    assert result["loras"] == 3 and runs["mixed"]["lora_loads"] >= 3
    assert all(runs[n]["output_tok_s"] > 0 for n in ("base", "lora_idle", "mixed"))
    assert result["mixed_over_base"] == pytest.approx(runs["mixed"]["output_tok_s"] / runs["base"]["output_tok_s"])
    assert result["mixed_equals_alone"] is True
    assert json.loads((tmp_path / "loras.json").read_text())["runs"] == runs
    png = tmp_path / "loras.png"
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
