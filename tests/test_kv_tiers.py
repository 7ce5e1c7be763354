"""The host KV tier (kv_offloading_size): a prefix the device cache evicted is copied back from host memory
instead of recomputed, with the same tokens; its KV events name the tier, and the router's index follows."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, ConfigError, SamplingParams
from engine.block_hash import block_hashes
from engine.kv_events import DEVICE, HOST
from router.prefix_index import PrefixIndex

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SMOL_BLOCK_BYTES = 30 * 3 * 2 * 16 * 64 * 4     # SmolLM2-135M fp32: layers x KV heads x (K, V) x 16 tokens x head_dim
HOST_GIB = 64 * SMOL_BLOCK_BYTES / 2**30         # 64 host blocks


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(smol_path: str, host_gib: float, events: list | None = None) -> LLM:
    llm = LLM(smol_path, num_kv_blocks=16, max_model_len=256, kv_offloading_size=host_gib)
    if events is not None:
        llm.engine.pool.on_event = events.append
    return llm


def _evict_with_fillers(llm: LLM, n: int = 4) -> None:
    """Other 68-token prompts: 5 blocks each with their outputs, four of them past the 16-block device cache."""
    llm.generate([_ids(68, 10 + k) for k in range(n)], GREEDY)


def test_a_prefix_evicted_to_the_host_tier_is_copied_back_not_recomputed(smol_path):
    prompt = _ids(68, 1)                         # 4 full blocks before the block of the last token
    events: list = []
    llm = _engine(smol_path, HOST_GIB, events)
    pool = llm.engine.pool
    assert pool.host_blocks == 64
    first = llm.generate([prompt], GREEDY)[0]
    _evict_with_fillers(llm)
    hashes = block_hashes(prompt[:64], 16, llm.engine.model_key)
    assert [tier for tier, _ in pool.find(hashes, prompt)] == [HOST] * 4, "the fillers evicted it to host memory"

    before = llm.engine.num_computed_tokens_total
    again = llm.generate([prompt], GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert again.metrics.num_cached_tokens == 64
    assert llm.engine.num_computed_tokens_total - before == 4 + GREEDY.max_tokens - 1
    stats = llm.engine.stats()
    assert stats["prefix_cache_host_hit_tokens"] == 64 and stats["kv_onloaded_blocks"] == 4
    assert stats["kv_offloaded_blocks"] >= 4 and stats["kv_host_blocks_used"] == stats["kv_offloaded_blocks"]
    assert [tier for tier, _ in pool.find(hashes, prompt)] == [DEVICE] * 4, "copied back, cached on the device again"
    assert pool.num_free_blocks == pool.num_blocks, "no KV block leaked"

    # the same run without the tier recomputes the prompt, and gives the same tokens
    cold = _engine(smol_path, 0.0)
    cold.generate([prompt], GREEDY)
    _evict_with_fillers(cold)
    out = cold.generate([prompt], GREEDY)[0]
    assert out.metrics.num_cached_tokens == 0 and out.token_ids == first.token_ids
    assert cold.engine.stats()["kv_host_blocks_total"] == 0

    # the KV events, replayed into the router's index, give both tiers exactly
    index = PrefixIndex()
    index.load_snapshot("r", 0, [])
    assert index.apply("r", 1, events)
    assert index.blocks["r"] == set(pool.cached_hashes())
    assert index.host_blocks["r"] == set(pool.host.lru)
    runs = index.match_tiers(hashes)
    assert runs == {"r": (4, 0)}, "on the device again (the host copy stays, so the index still counts it there)"


@pytest.mark.slow               # the fast tier keeps the evict-and-return case above and test_kv's random workload
def test_the_host_tier_is_lru_and_bounded(smol_path):
    """A host tier smaller than what the device evicts keeps the most recently evicted blocks."""
    llm = _engine(smol_path, 8 * SMOL_BLOCK_BYTES / 2**30)
    pool = llm.engine.pool
    assert pool.host_blocks == 8
    llm.generate([_ids(68, 1)], GREEDY)
    _evict_with_fillers(llm, 8)
    assert pool.num_host_blocks_used == 8 and llm.engine.stats()["kv_offloaded_blocks"] > 8
    again = llm.generate([_ids(68, 1)], GREEDY)[0]
    assert again.metrics.num_cached_tokens == 0, "the oldest prefix aged out of both tiers"
    assert pool.num_free_blocks == pool.num_blocks


@pytest.mark.parametrize("bad", [-1, "1GiB", True])
def test_kv_offloading_size_must_be_gib(bad):
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        LLM("tiny-llama", load_format="dummy", kv_offloading_size=bad)
