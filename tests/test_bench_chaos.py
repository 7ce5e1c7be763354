"""`baton bench chaos` without a cluster: its command line, its schedule, and the per-phase report."""
from __future__ import annotations

import pytest

from bench.chaos_bench import DISRUPTIONS, Phase, counters_absent, move_counters, report, schedule
from bench.cluster_bench import Req, Result
from cli.main import build_parser


def test_the_command_line_parses_the_chaos_options():
    args = build_parser("chaos").parse_args(["bench", "chaos", "--phase-s", "5", "--rate", "3",
                                             "--disruptions", "kill_decode,roll", "--out", "x", "--json"])
    assert (args.phase_s, args.rate, args.disruptions, args.out_dir, args.json) == (5.0, 3.0, "kill_decode,roll",
                                                                                     "x", True)
    assert (args.prefill_replicas, args.decode_replicas, args.model) == (2, 2, None)
    assert args.bench_fn.__module__ == "bench.chaos_bench"


def test_the_schedule_puts_calm_between_disruptions_and_scales_down_then_up():
    assert schedule(DISRUPTIONS) == ["calm", "kill_decode", "calm", "kill_prefill", "calm", "pull_fail", "calm",
                                     "scale_down", "scale_up", "calm", "roll", "calm"]
    with pytest.raises(ValueError, match="unknown disruption"):
        schedule(["meteor"])


def test_move_counters_split_replays_from_kv_pulls_and_name_the_absent_ones():
    m = {'baton_request_moves_total{reason="replica_died",how="replay"}': 3.0,
         'baton_request_moves_total{reason="drain",how="kv_pull"}': 2.0,
         'baton_request_moved_tokens_total{how="replay"}': 40.0, 'baton_request_moved_tokens_total{how="kv_pull"}': 9.0,
         'baton_requests_total{status="ok"}': 100.0}
    assert move_counters(m) == {"moves_replay": 3.0, "moves_kv_pull": 2.0, "tokens_recomputed_by_replay": 40.0,
                                "tokens_moved_by_kv_pull": 9.0}
    assert counters_absent(m) == []
    assert counters_absent({'baton_requests_total{status="ok"}': 1.0}) == [
        "baton_request_moves_total", "tokens_recomputed_by_replay", "tokens_moved_by_kv_pull"]


def test_the_report_counts_failures_where_they_ended_and_latencies_against_calm():
    phases = [Phase("calm", 0, 10), Phase("kill_decode", 10, 20), Phase("calm", 20, 30)]

    def req(at, max_tokens=4):
        r = Req("hi", max_tokens, at=at, tag="chat", chat=True)
        return r
    ok = Result("chat", True, 200, ttft=0.1, itls=[0.01, 0.01, 0.01], tokens=4, usage_tokens=4)
    slow = Result("chat", True, 200, ttft=0.4, itls=[0.05] * 3, tokens=4, usage_tokens=4)
    cut = Result("chat", False, 200, ttft=0.1, tokens=2, error="replica_failed")
    short = Result("chat", True, 200, ttft=0.1, tokens=2, usage_tokens=2)
    refused = Result("chat", False, 503, error="HTTP 503")
    requests = [(req(1), ok, 2.0), (req(9), cut, 11.0), (req(12), slow, 13.0), (req(14), short, 15.0),
                (req(21), refused, 21.5), (req(25), ok, 26.0)]
    out = report(phases, requests, [], ["baton_request_moves_total"])
    got = [(p["name"], p["started"], p["ended"], p["failed"], p["failures"]) for p in out["phases"]]
    assert got == [("calm", 2, 1, 0, {}), ("kill_decode", 2, 3, 2, {"error_event": 1, "short_stream": 1}),
                   ("calm", 2, 2, 1, {"http": 1})]
    assert out["requests"] == 6 and out["failed"] == 3 and out["counters_absent"] == ["baton_request_moves_total"]
    assert out["calm"]["ttft_ms"]["p50"] == pytest.approx(100)
    assert out["phases"][1]["p99_vs_calm"]["ttft_ms"] == pytest.approx(4.0)
