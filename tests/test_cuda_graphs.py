"""CUDA graphs' CPU twin: bucket sizes, enforce_eager, padded steps equal unpadded ones exactly, and a
replay over the persistent buffers (the capture call stood in for by a re-run) equals the eager step.
Also the KV memory split between the target and a draft model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import cpu_attention
from engine.config import EngineConfig
from engine.cuda_graphs import CapturedGraph, batch_buckets, bucket_for, graph_keys, verify_widths
from engine.errors import ConfigError
from engine.input_batch import items_shape
from engine.loader import load_config
from engine.model_runner import ModelRunner, plan_kv_blocks
from engine.spec.config import SpeculativeConfig

BS = 16


def test_buckets_go_up_to_max_num_seqs():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    assert batch_buckets(1) == [1]
    assert verify_widths(None) == [1]
    assert verify_widths(SpeculativeConfig("ngram", num_speculative_tokens=3)) == [1, 2, 3, 4]
    keys = graph_keys(12, [1, 3], max_tokens=24)
    assert set(keys) == {(1, 1), (2, 1), (4, 1), (8, 1), (12, 1), (1, 3), (2, 3), (4, 3), (8, 3)}
    assert keys[0] == (8, 3), "the largest graph is captured first (the others reuse its memory)"
    assert [bucket_for(n, 1, keys) for n in (1, 3, 5, 9, 12, 13)] == [1, 4, 8, 12, 12, None]
    assert bucket_for(9, 3, keys) is None, "24 tokens of budget: no graph of 12 x 3"


def runner(**cfg) -> ModelRunner:
    config = EngineConfig(model="llama-tiny", load_format="dummy", block_size=BS, max_num_seqs=8,
                          max_num_batched_tokens=64, **cfg)
    r = ModelRunner(config, "llama-tiny", load_config("llama-tiny"), max_model_len=256)
    r.allocate_kv(32)
    return r


def test_enforce_eager_plans_no_graph():
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    assert runner(enforce_eager=True, speculative_config=spec).graph_plan() == []
    plan = runner(speculative_config=spec).graph_plan()
    assert {w for _, w in plan} == {1, 2, 3} and {b for b, _ in plan} == {1, 2, 4, 8}
    assert runner().graph_sizes == [], "nothing is captured on CPU"


def contexts(r: ModelRunner, lens: list[int], rng) -> list[tuple[int, list[int]]]:
    """Prefill sequences of the given lengths (distinct blocks); returns (length, block table) of each."""
    out, next_block = [], 0
    for n in lens:
        bt = list(range(next_block, next_block + 4))
        next_block += 4
        r.forward_batch([(rng.integers(0, 500, n).tolist(), 0, bt, 0)])
        out.append((n, bt))
    return out


def uniform_step(ctx, width: int, rng):
    """Every sequence runs `width` tokens after its context and samples all of them (decode, verify)."""
    return [(rng.integers(0, 500, width).tolist(), n, bt, width) for n, bt in ctx]


@pytest.mark.parametrize("width", [1, 3])
def test_padded_forward_equals_unpadded_exactly(width):
    r, rng = runner(), np.random.default_rng(width)
    step = uniform_step(contexts(r, [5, 17, 30], rng), width, rng)
    eager = r.forward_batch(step).clone()
    cache = r.kv_cache.clone()
    shape, ids, tables = items_shape(step, BS)
    for size in (4, 8):
        padded = r.forward_padded(shape, ids, tables, size)
        assert torch.equal(padded, eager)
        assert torch.equal(r.kv_cache, cache), "padding rows wrote outside the padding block"


class Rerun:
    """A CUDA graph's CPU stand-in: replay() re-runs the captured forward into the captured output,
    reading only the persistent buffers the capture saw (as a graph reads its fixed addresses)."""
    replays = 0

    def __init__(self, forward, out):
        self.forward, self.out = forward, out

    def replay(self):
        Rerun.replays += 1
        with torch.inference_mode():
            self.out.copy_(self.forward())


@pytest.fixture
def rerun_graphs(monkeypatch):
    """Capture on CPU: the capture loop and dispatch run as on CUDA, engine.cuda_graphs.capture aside."""
    if not cpu_attention.available():
        pytest.skip("the CPU stand-in of a replay needs the C++ kernel (the torch reference reads host "
                    "lists that a graph would not refresh)")

    def fake_capture(forward, pool):
        out = forward()
        return CapturedGraph(Rerun(forward, out), out)

    monkeypatch.setattr("engine.model_runner.capture", fake_capture)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    Rerun.replays = 0

    def install(r: ModelRunner) -> ModelRunner:
        r.graph_keys = r.graph_plan()
        r.capture_graphs()
        return r
    return install


def test_replay_over_persistent_buffers_equals_eager(rerun_graphs):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    eager, graphed = runner(speculative_config=spec), rerun_graphs(runner(speculative_config=spec))
    assert sorted(graphed.graph_sizes) == sorted(graphed.graph_plan())
    for width in (1, 3, 2):
        rng_a, rng_b = np.random.default_rng(width), np.random.default_rng(width)
        ctx = contexts(eager, [3, 9, 21, 40, 7], rng_a)
        assert contexts(graphed, [3, 9, 21, 40, 7], rng_b) == ctx
        step = uniform_step(ctx, width, rng_a)
        assert step == uniform_step(ctx, width, rng_b)
        assert torch.equal(graphed.forward_batch(step), eager.forward_batch(step))
    assert Rerun.replays == 3
    mixed = [([1, 2], 3, [0], 2), ([4], 9, [4], 1)]           # not uniform: eager in both
    assert torch.equal(graphed.forward_batch(mixed), eager.forward_batch(mixed))
    assert Rerun.replays == 3


def test_engine_outputs_equal_with_graph_replays(rerun_graphs):
    """Greedy outputs of a speculating engine (decode and verify steps replayed) equal the eager engine's."""
    from engine import LLM, SamplingParams
    prompts = [[7, 8, 9, 10] * 6, [3, 4, 5] * 5 + [6], list(range(40, 60)), [11, 12] * 9]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def generate(graphs: bool) -> list[list[int]]:
        llm = LLM("llama-tiny", load_format="dummy", max_num_seqs=4, max_model_len=256, kv_cache_memory=8 << 20,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 2, "adaptive": False})
        if graphs:
            rerun_graphs(llm.engine.runner)
        return [o.token_ids for o in llm.generate(prompts, params)]
    assert generate(True) == generate(False)
    assert Rerun.replays >= 4, "decode and verify steps replayed graphs"


def test_kv_budget_split_between_target_and_draft():
    cfg = EngineConfig(kv_cache_memory=1000)
    assert plan_kv_blocks(cfg, 1000, 30) == (33, None)
    # same tokens in both caches: n blocks each with 30 n + 10 n <= 1000
    assert plan_kv_blocks(cfg, 1000, 30, 10) == (25, 25)
    fixed = EngineConfig(speculative_config={"method": "draft_model", "model": "d", "draft_kv_blocks": 40})
    assert plan_kv_blocks(fixed, 1000, 30, 10) == (20, 40)          # the draft's 400 bytes first
    exact = EngineConfig(num_kv_blocks=7, speculative_config={"method": "draft_model", "model": "d"})
    assert plan_kv_blocks(exact, 1000, 30, 10) == (7, 7)
    with pytest.raises(ConfigError, match="less than one block"):
        plan_kv_blocks(cfg, 39, 30, 10)


def test_draft_model_shares_the_budget():
    """A draft model engine: its KV and the target's fit in kv_cache_memory together."""
    from engine import LLM
    budget = 8 << 20
    llm = LLM("llama-tiny", load_format="dummy", kv_cache_memory=budget, max_model_len=256,
              speculative_config={"method": "draft_model", "model": "llama-tiny", "num_speculative_tokens": 2})
    target, draft = llm.engine.runner, llm.engine.draft_runner
    assert target.num_blocks == draft.num_blocks
    used = target.num_blocks * target.block_bytes + draft.num_blocks * draft.block_bytes
    assert budget - (target.block_bytes + draft.block_bytes) < used <= budget
