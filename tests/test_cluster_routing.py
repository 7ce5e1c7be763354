"""Prefix-aware routing on the real app: two prefill replicas, four tenants' shared 1,024-token prefixes
interleaved, each replica's KV room for 2.5 of them. The model is the reliability tests' tiny random Llama
(the hit rate depends on where prompts go and what each replica's KV holds, not on the weights; `baton bench
cluster` runs the same workload on SmolLM2 and compares pow2 on the base model too). After one warm-up request
per tenant the prefill pool's prefix hit rate (from /metrics) is at least 90%. With each tenant under a LoRA
adapter of its own (its prefix is then its adapter's KV), each prefill replica holding two adapters, it is
clearly above the same run with Serve's power-of-two routing, and adapters swap in and out far less. All runs
share one Serve start (a redeploy between them): starting one is most of the test's time."""
from __future__ import annotations

import pytest
import ray

from bench.cluster_bench import routing_runs
from bench.models import make_lora_adapter
from cluster.serving import init_ray

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.bench, pytest.mark.timeout(1200)]


def test_prefix_and_adapter_aware_routing_keep_tenants_on_their_replica(tmp_path):
    """Two runs of 16 tenants' requests on the tiny model, each tenant under its own adapter, one Serve start
    (redeployed between them): prefix- and adapter-aware routing, then Serve's pow2. Every request is served;
    prefix-aware keeps a hit rate of 90% or more, 15 points above pow2, and loads adapters less. (The base
    model's prefix routing in a live cluster: tests/test_cluster_multi.py.)"""
    from bench.chaos_bench import tiny_model
    model = tiny_model(str(tmp_path / "tiny"))
    loras = {f"tenant{t}": make_lora_adapter(model, tmp_path / f"tenant{t}", rank=4, seed=t + 1) for t in range(4)}
    init_ray(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="test-routing")
    try:
        runs = routing_runs(["prefix_aware", "pow2"], 16, 2.0, 1024, (5.0, 1.0), model=model, adapters=loras)
    finally:
        ray.shutdown()
    aware, pow2 = runs["prefix_aware"], runs["pow2"]
    assert aware["ok"] == pow2["ok"] == 16, (aware["errors"], pow2["errors"])
    assert aware["prefix_hit_rate"] >= 0.90, aware
    assert aware["prefix_hit_rate"] - pow2["prefix_hit_rate"] >= 0.15, (aware, pow2)
    assert aware["prefill_lora_loads"] < pow2["prefill_lora_loads"], (aware, pow2)     # after the warm-up
