"""Prefix-aware routing on the real app: two prefill replicas, four tenants' shared 1,024-token prefixes
interleaved, each replica's KV room for 2.5 of them. The model is the reliability tests' tiny random Llama
(the hit rate depends on where prompts go and what each replica's KV holds, not on the weights; `baton bench
cluster` runs the same workload on SmolLM2). After one warm-up request per tenant the prefill pool's prefix hit rate (from /metrics) is at
least 90%, and clearly above the same run with Serve's power-of-two routing. The same with each tenant under a
LoRA adapter of its own (its prefix is then its adapter's KV), each prefill replica holding two adapters: the
routers keep a tenant where its adapter and its prefix are, so adapters swap in and out far less."""
from __future__ import annotations

import pytest
import ray

from bench.cluster_bench import routing_runs
from bench.models import make_lora_adapter

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.bench, pytest.mark.timeout(1200)]


def aware_and_pow2(tmp_path, adapters: bool = False) -> tuple[dict, dict]:
    """Both policies' runs of 16 tenants' requests on the tiny model (one Serve start, redeployed), each asserted
    to keep tenants on their replica: every request served, a hit rate of 90% or more, 15 points above pow2."""
    from bench.chaos_bench import tiny_model
    model = tiny_model(str(tmp_path / "tiny"))
    loras = {f"tenant{t}": make_lora_adapter(model, tmp_path / f"tenant{t}", rank=4, seed=t + 1)
             for t in range(4)} if adapters else None
    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", log_to_driver=False,
             namespace="test-routing")
    try:
        runs = routing_runs(["prefix_aware", "pow2"], 16, 2.0, 1024, (5.0, 1.0), model=model, adapters=loras)
        aware, pow2 = runs["prefix_aware"], runs["pow2"]
    finally:
        ray.shutdown()
    assert aware["ok"] == pow2["ok"] == 16, (aware["errors"], pow2["errors"])
    assert aware["prefix_hit_rate"] >= 0.90, aware
    assert aware["prefix_hit_rate"] - pow2["prefix_hit_rate"] >= 0.15, (aware, pow2)
    return aware, pow2


def test_prefix_aware_routing_keeps_tenants_on_their_replica(tmp_path):
    aware_and_pow2(tmp_path)


def test_adapter_aware_routing_keeps_lora_tenants_where_their_adapter_is(tmp_path):
    aware, pow2 = aware_and_pow2(tmp_path, adapters=True)
    assert aware["prefill_lora_loads"] < pow2["prefill_lora_loads"], (aware, pow2)     # after the warm-up
