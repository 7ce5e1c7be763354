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


@pytest.mark.slow
@pytest.mark.bench
def test_bench_eagle_head_trains_a_head_baton_loads(tmp_path):
    """`baton bench eagle-head` on a few prompts: the loss falls, the held-out first drafts beat chance, and the
    checkpoint it writes is an EAGLE-3 head the engine drafts with, the greedy text unchanged."""
    from engine import LLM, SamplingParams
    result = run_bench("eagle-head", "--prompts", "12", "--max-tokens", "24", "--epochs", "3", "--draft-vocab", "512",
                       "--out", str(tmp_path))
    assert result["draft_vocab"] == 512 and result["steps"] == 3 * 2
    assert result["losses"][-1] < result["losses"][0]
    assert result["first_draft_accuracy"] > 0.05
    assert json.loads((tmp_path / "eagle_head.json").read_text())["evals"] == result["evals"]
    assert (tmp_path / "eagle_head.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    messages = [{"role": "user", "content": "Tell me about the ocean."}]
    params = SamplingParams(temperature=0, max_tokens=24)
    head = LLM(speculative_config={"method": "eagle3", "model": result["head"], "num_speculative_tokens": 2,
                                   "adaptive": False}, max_model_len=512)
    assert head.chat(messages, params).token_ids == LLM(max_model_len=512).chat(messages, params).token_ids
    assert head.engine.stats()["spec_num_draft_tokens"] > 0
