"""DeepSeek's MLA on a live disaggregated cluster: a tiny DeepSeek-V3 (random weights under SmolLM2's tokenizer)
prefilled in one replica and decoded in another, its latent KV handed over NIXL, the decode pool drafting with the
checkpoint's multi-token prediction layer. The openai client gets the single engine's greedy text, and the bytes the
decode replica pulled are the latent's: one vector of kv_lora_rank + qk_rope_head_dim a token and layer, not a key
and a value per head."""
from __future__ import annotations

import shutil
from pathlib import Path

import openai
import pytest

from bench.models import make_tiny_checkpoint
from cluster.live_metrics import pool_total, scrape
from engine import LLM, SamplingParams
from tests.conftest import CLUSTER_ENGINE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PORT = 8741
BASE = f"http://127.0.0.1:{PORT}"
MESSAGES = [[{"role": "user", "content": "Why do relay runners practise the baton exchange?"}],
            [{"role": "user", "content": "Name three colours of the rainbow."}]]
MAX_TOKENS = 12
MTP = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory, smol_path) -> str:
    """DeepSeek-V3's tiny config (bench/models.py) over SmolLM2's vocabulary, with its tokenizer and chat template."""
    from tests.test_spec_heads import add_mtp_layer
    path = Path(add_mtp_layer(make_tiny_checkpoint(tmp_path_factory.mktemp("dsv3"), "deepseek_v3", vocab_size=49152,
                                                   max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
                                                   pad_token_id=2), tmp_path_factory.mktemp("mtp") / "dsv3"))
    for f in Path(smol_path).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return str(path)


def test_a_deepseek_prompt_prefilled_in_one_replica_decodes_in_another_over_its_latent_cache(shared_cluster,
                                                                                            deepseek):
    llm = LLM(deepseek, **CLUSTER_ENGINE)
    want = [llm.chat(m, SamplingParams(temperature=0, max_tokens=MAX_TOKENS)).text for m in MESSAGES]
    cfg = llm.engine.hf_config
    latent_token_bytes = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4      # fp32
    del llm
    shared_cluster.up({"model": deepseek, "mode": "disaggregated", "port": PORT, "device": "cpu",
                       "ingress": {"num_cpus": 0}, "prefill": {"num_cpus": 0, "engine": CLUSTER_ENGINE},
                       "decode": {"num_cpus": 0, "engine": {**CLUSTER_ENGINE, "speculative_config": MTP}},
                       "disaggregation": {"min_remote_prefill_tokens": 0}, "admission": {"enabled": False}})
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    before = scrape(BASE, True)
    got = [client.chat.completions.create(model=name, messages=m, temperature=0, max_tokens=MAX_TOKENS)
           for m in MESSAGES]
    assert [c.choices[0].message.content for c in got] == want
    after = scrape(BASE, True)
    pulled = pool_total(after, "baton_kv_transfer_bytes_total", "decode") - \
        pool_total(before, "baton_kv_transfer_bytes_total", "decode")
    prompts = [c.usage.prompt_tokens for c in got]
    # whole blocks of 16 latent tokens, covering each prompt (its last block may be partly filled)
    assert pulled % (16 * latent_token_bytes) == 0
    assert sum(prompts) * latent_token_bytes <= pulled < sum(p + 16 for p in prompts) * latent_token_bytes
    # the decode replica drafted from the tokens it computed (the prompt's hidden states stayed in the prefill pool)
    assert pool_total(after, "baton_spec_proposed_tokens_total", "decode") > \
        pool_total(before, "baton_spec_proposed_tokens_total", "decode")
