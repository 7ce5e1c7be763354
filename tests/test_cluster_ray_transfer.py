"""The Ray object-store fallback selected by config (`transfer.backend: ray`, conftest's SCALED_OUT app): the
same greedy text as the offline engine, the KV counted as transferred and the prefill pins released."""
from __future__ import annotations

import openai
import pytest

from cluster.live_metrics import pool_total, scrape
from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE, SCALED_OUT, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

BASE = f"http://127.0.0.1:{SCALED_OUT['port']}"


def test_fallback_transport_serves_the_same_text(shared_cluster):
    cfg = shared_cluster.up(SCALED_OUT)
    assert cfg.transfer.backend == "ray"
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = "A relay baton is passed in a twenty-metre exchange zone, and the outgoing runner"
    want = LLM(None, **CLUSTER_ENGINE).generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0]
    m0 = scrape(BASE)
    r = client.completions.create(model=cfg.model_name(), prompt=prompt, temperature=0, max_tokens=16)
    assert r.choices[0].text == want.text

    def grew(m: dict[str, float], metric: str, pool: str) -> float:
        return pool_total(m, metric, pool) - pool_total(m0, metric, pool)
    # each replica reports its metrics every half second, on its own clock: wait for both pools' reports
    m = wait_for(lambda: (lambda m: m if grew(m, "baton_kv_pins_released_total", "prefill") >= 1 and
                          pool_total(m, "baton_kv_blocks_used", "prefill") == 0 and
                          grew(m, "baton_kv_transfer_bytes_total", "decode") > 0 else None)(scrape(BASE)),
                 10, "the prefill pool to release the request's pinned blocks and the decode pool to count the pull")
    assert grew(m, "baton_kv_transfer_bytes_total", "decode") > 0
    assert grew(m, "baton_kv_pins_released_total", "prefill") >= 1
    assert pool_total(m, "baton_kv_blocks_used", "prefill") == 0
