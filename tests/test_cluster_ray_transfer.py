"""The Ray object-store fallback selected by config (`transfer.backend: ray`): the same app, the same
greedy text as the offline engine, the KV counted as transferred and the prefill pins released."""
from __future__ import annotations

import time

import openai
import pytest

from cluster.live_metrics import pool_total, scrape
from engine import LLM, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PORT = 8735
ENGINE = {"kv_cache_memory": 96 << 20, "max_model_len": 1024}


def test_fallback_transport_serves_the_same_text(smol_path):
    from cluster.config import ClusterConfig
    from cluster.serving import start, stop
    cfg = ClusterConfig.from_dict({"port": PORT, "ingress": {"num_cpus": 0}, "transfer": {"backend": "ray"},
                                   "prefill": {"num_cpus": 0, "engine": ENGINE},
                                   "decode": {"num_cpus": 0, "engine": ENGINE},
                                   "disaggregation": {"min_remote_prefill_tokens": 0}})
    start(cfg, num_cpus=2)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="unused", max_retries=0, timeout=120)
        prompt = "A relay baton is passed in a twenty-metre exchange zone, and the outgoing runner"
        want = LLM(smol_path, **ENGINE).generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
        r = client.completions.create(model=cfg.model_name(), prompt=prompt, temperature=0, max_tokens=16)
        assert r.choices[0].text == want.text
        deadline, m = time.monotonic() + 10, {}
        while time.monotonic() < deadline:
            m = scrape(f"http://127.0.0.1:{PORT}")
            if pool_total(m, "baton_kv_pins_released_total", "prefill") >= 1:
                break
            time.sleep(0.5)
        assert pool_total(m, "baton_kv_transfer_bytes_total", "decode") > 0
        assert pool_total(m, "baton_kv_pins_released_total", "prefill") >= 1
        assert pool_total(m, "baton_kv_blocks_used", "prefill") == 0
    finally:
        stop()
        import ray
        ray.shutdown()
