"""`baton bench replay`: a Mooncake trace becomes prompts that share exactly the prefixes its hash ids say, at
its arrival times; a bad trace line is named; the shipped slice replays against a live cluster end to end."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cluster_bench import Result, summarize
from bench.replay_bench import DEFAULT_TRACE, baton_requests, load_trace, mooncake_requests, trace_shape
from tests.conftest import run_bench


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_mooncake_prompts_share_what_their_hash_ids_share():
    fmt, rows = load_trace(DEFAULT_TRACE)
    assert fmt == "mooncake" and len(rows) == 200
    reqs = mooncake_requests(rows, block_tokens=16, max_input=100_000, max_output=10_000, speedup=2.0)
    for r, row in zip(reqs, rows):
        assert len(r.prompt) == round(row["input_length"] * 16 / 512)
        assert r.max_tokens == max(1, round(row["output_length"] * 16 / 512))
        assert r.at == pytest.approx(row["timestamp"] / 1e3 / 2.0)
    for i in range(40):
        for j in range(i + 1, 40):
            a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            shared = _common(a, b)
            want = min(shared * 16, len(reqs[i].prompt), len(reqs[j].prompt))
            assert _common(reqs[i].prompt, reqs[j].prompt) == want, (i, j)
    again = mooncake_requests(rows[:5], 16, 100_000, 10_000, 1.0)
    assert [r.prompt for r in again] == [r.prompt for r in reqs[:5]], "the same trace rebuilds the same prompts"
    capped = mooncake_requests(rows[:20], 16, 300, 4, 1.0)
    assert max(len(r.prompt) for r in capped) == 300 and max(r.max_tokens for r in capped) == 4
    shape = trace_shape(fmt, rows, reqs)
    assert shape["requests"] == 200 and 0 < shape["reusable_block_share"] < 1


def test_baton_traces_and_bad_lines(tmp_path):
    good = tmp_path / "t.jsonl"
    good.write_text('{"timestamp": 1000, "prompt": "hi", "max_tokens": 8}\n'
                    '{"timestamp": 3000, "prompt": [5, 6, 7], "max_tokens": 99}\n')
    fmt, rows = load_trace(good)
    reqs = baton_requests(rows, max_output=32, speedup=2.0)
    assert fmt == "baton" and [(r.prompt, r.max_tokens, r.at) for r in reqs] == [("hi", 8, 0.0), ([5, 6, 7], 32, 1.0)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: a mooncake trace line needs output_length, hash_ids"):
        load_trace(bad)


def test_goodput_counts_requests_meeting_both_slos():
    """DistServe's goodput: requests whose TTFT and mean ITL both meet their SLOs, per second of the run; a
    failed request counts against attainment, a one-token answer has no ITL to miss."""
    results = [Result("met", True, ttft=0.5, itls=[0.05, 0.15], tokens=3),       # mean ITL 0.1 s
               Result("slow first", True, ttft=2.5, itls=[0.05], tokens=2),
               Result("slow tokens", True, ttft=0.5, itls=[0.1, 0.4], tokens=3),  # mean 0.25 s
               Result("one token", True, ttft=1.0, tokens=1),
               Result("failed", False, status=500, error="boom")]
    s = summarize(results, wall=4.0, slo_ttft=2.0, slo_itl=0.2)
    assert (s["requests"], s["ok"], s["errors"]) == (5, 4, ["boom"])
    assert s["goodput_rps"] == 2 / 4.0 and s["slo_attainment"] == 2 / 5
    assert s["ttft_ms"]["p50"] == pytest.approx(750.0) and s["output_tokens_per_s"] == 9 / 4.0


@pytest.mark.slow
@pytest.mark.bench
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_bench_replay_quick_serves_the_trace(tmp_path):
    result = run_bench("replay", "--quick", "--out-dir", str(tmp_path))
    r = result["result"]
    assert result["format"] == "mooncake" and result["trace"]["requests"] == 12
    assert r["ok"] == r["requests"] == 12, r["errors"]
    # goodput is what met both SLOs, and so never more than the share of first tokens within the TTFT SLO (the
    # rule itself: test_goodput_counts_requests_meeting_both_slos; a slow machine may meet neither)
    ttft_ok = sum(ttft * 1e3 <= result["slo_ms"]["ttft"] for _, ttft in result["ttft_points"])
    assert len(result["ttft_points"]) == 12 and r["ttft_ms"]["p50"] > 0
    assert r["slo_attainment"] * 12 <= ttft_ok
    assert r["goodput_rps"] == pytest.approx(r["slo_attainment"] * 12 / r["wall_s"])
    assert r["prefix_hit_rate"] > 0, "every request of the trace starts with the same system-prompt block"
    assert json.loads((tmp_path / "replay.json").read_text())["result"] == r
    png = Path(tmp_path / "replay.png")
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
