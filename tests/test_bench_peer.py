"""`baton bench peer`'s report: the goals' ratios over several rounds (the servers themselves need a llama-server
binary, built outside the tests; docs/benchmarks.md has the runs)."""
from __future__ import annotations

import pytest

from bench.peer_bench import GOALS, median_ratios, ratios


def _server(decode: float, prefill: float, streams: float, ttft_ms: float) -> dict:
    return {"decode": {"tokens_per_s": decode}, "prefill": {"tokens_per_s": prefill},
            "streams": {"output_tokens_per_s": streams, "ttft_ms": {"p50": ttft_ms}}}


def _round(speed: float, baton_decode: float) -> dict:
    """One round on a machine running at `speed`: every server scales with it, but Baton's batch-1 decode is
    `baton_decode` times llama.cpp's."""
    return {"llama_cpp": _server(60 * speed, 250 * speed, 65 * speed, 9000 / speed),
            "engine_alone": {"decode_tokens_per_s": 100 * speed, "output_tokens_per_s": 280 * speed},
            "baton": {"colocated": _server(60 * speed * baton_decode, 1000 * speed, 200 * speed, 1500 / speed)}}


def test_one_round_is_its_own_ratios():
    r = _round(1.0, 1.05)
    assert median_ratios([r]) == ratios(r)
    assert ratios(r)["colocated"]["meets"] == {"decode_x": True, "streams_x": True, "prefill_x": True,
                                               "http_share": False}


def test_rounds_on_a_drifting_machine_compare_within_each_round_and_take_the_median():
    # the machine runs at half speed in the second round: pooling the servers' figures across rounds would mix
    # a fast llama.cpp with a slow Baton; within each round the ratios are the machine's speed-free ones
    rounds = [_round(1.0, 1.10), _round(0.5, 0.90), _round(0.8, 1.02)]
    out = median_ratios(rounds)
    coloc = out["colocated"]
    assert coloc["decode_x"] == pytest.approx(1.02)                   # the median of 1.10, 0.90, 1.02
    assert coloc["prefill_x"] == pytest.approx(4.0) and coloc["streams_x"] == pytest.approx(200 / 65)
    assert coloc["http_share"] == pytest.approx(200 / 280)
    assert coloc["streams_ttft_p50_x"] == pytest.approx(1500 / 9000)
    assert coloc["meets"] == {k: coloc[k] >= v for k, v in GOALS.items()}
    assert coloc["meets"]["decode_x"] and not coloc["meets"]["http_share"]
    assert [e["colocated"]["decode_x"] for e in out["each_round"]] == pytest.approx([1.10, 0.90, 1.02])
    assert out["engine_alone_decode_x"] == pytest.approx(100 / 60)
    assert out["best_mode_for_streams"] == "colocated"
    # a goal met in one round of three is not met
    low = median_ratios([_round(1.0, 1.10), _round(1.0, 0.90), _round(1.0, 0.95)])
    assert not low["colocated"]["meets"]["decode_x"]
