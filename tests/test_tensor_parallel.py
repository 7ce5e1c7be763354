"""Tensor parallelism on CPU (gloo): TP 2 gives TP 1's greedy tokens, prefix-cache hits and KV events; each
rank reads only its slices of the weights; a dead worker fails the engine at once; no worker outlives it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from conftest import make_tiny_checkpoint, run_bench, wait_for
from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.llm_engine import LLMEngine
from engine.model import QuantEmbedding, QuantLinear
from engine.parallel import TPWorkerError
from engine.sampling_params import SamplingParams
from greedy import MAX_LOGPROB_GAP, TOP_K, baton_greedy, check_greedy_close

XDIST_GROUP = "tensor-parallel"          # tests/conftest.py: with the other TP engines' modules, one fork server

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=TOP_K)
PROMPTS = [[1, 5, 9, 33, 7], [2, 8, 100] + [4] * 30 + [250], list(range(40, 90))]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(num_kv_blocks=48, max_model_len=256, max_num_batched_tokens=32)   # chunked prefills: steps with no logits

# (model type, config overrides): MQA (1 KV head on 2 ranks: replicated) with uneven intermediate and vocab
# splits; Qwen2 with q/k/v biases and tied embeddings (the LM head shares the embedding's vocab shard); Qwen3's
# q/k norms (replicated: one of head_dim for every head) with a head_dim apart from hidden / heads; two
# mixtures of experts; Gemma 2 and 3 (bench/models.py GEMMA_TINY: sliding windows of 8, softcaps, sandwich norms,
# scaled embeddings under a vocabulary split), and Gemma 3 as its 4B+ models ship, multimodal
TINY_MODELS = {
    "llama-mqa": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, intermediate_size=161, vocab_size=301)),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    # experts: every rank its run of each expert's units (49: uneven), a dense layer beside them (its own width)
    "qwen3-moe": ("qwen3_moe", dict(moe_intermediate_size=49, mlp_only_layers=[1])),
    "mixtral": ("mixtral", dict(intermediate_size=161)),          # Mixtral's names: block_sparse_moe, w1/w3/w2
    "qwen2-moe": ("qwen2_moe", dict(shared_expert_intermediate_size=97)),   # the shared expert's term, split unevenly
    "gemma2": ("gemma2", dict(vocab_size=301)),
    "gemma3": ("gemma3_text", {}),
    "gemma3-multimodal": ("gemma3", {}),                          # its language model's tensors, the vision unread
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),            # fused qkv/gate_up in the file: each rank cuts its own
    "granite": ("granite", dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125,
                                logits_scaling=8.0)),             # its multipliers, with the vocabulary split
    "smollm3": ("smollm3", dict(no_rope_layers=[1, 0, 1])),      # a NoPE layer
    # sinks by query head; expert biases split with the experts' units (gate/up) or added once (down)
    "gpt-oss": ("gpt_oss", dict(intermediate_size=49)),
    "exaone4": ("exaone4", dict(sliding_window=8, sliding_window_pattern=3)),   # post norms, NoPE global layers
    "seed-oss": ("seed_oss", dict(head_dim=16)),                 # q/k/v biases split by heads, no o bias
    "glm4": ("glm4", dict(head_dim=16)),                         # each rank's heads' rows permuted for its RoPE pairs
    "cohere2": ("cohere2", dict(sliding_window=8, logit_scale=0.25,  # LayerNorms, the parallel block, scaled logits
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
    "ministral": ("ministral", dict(head_dim=16, sliding_window=8,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    # MLA: each rank its heads' rows of q and kv_b_proj and columns of o_proj, the latent cache whole (replicated);
    # grouped routing replicated, the shared experts split by units (49: uneven)
    "deepseek-v3": ("deepseek_v3", dict(moe_intermediate_size=49)),
    "deepseek-v2": ("deepseek_v2", dict(intermediate_size=161)),   # q_proj without a low rank; the dense layer uneven
    # chunked attention, q/k L2 norms and the NoPE layer's temperature by heads; each rank's heads' rows permuted for
    # its RoPE pairs; top-1 experts weighted on their input, split by units (49: uneven) with the shared expert
    "llama4": ("llama4_text", dict(intermediate_size=49)),
}


def engine(path: str, tp: int = 1, events: list | None = None, **kw) -> LLMEngine:
    cfg = EngineConfig(model=path, tensor_parallel_size=tp, **{**TINY, **kw})
    return LLMEngine(cfg, on_kv_event=None if events is None else events.append)


def generate(eng: LLMEngine, prompts, params=GREEDY) -> list:
    ids = [eng.add_request(p, params) for p in prompts]
    done = {}
    while eng.has_unfinished_requests():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    return [done[i] for i in ids]


def assert_same_greedy(ref: list, out: list, max_gap: float = MAX_LOGPROB_GAP) -> None:
    """Equal tokens; an all-reduce sums in another order than one matmul, so a near-tie may part them
    (check/compare.py's rule), never more."""
    for r, o in zip(ref, out):
        if o.token_ids != r.token_ids:
            check_greedy_close(baton_greedy(o), baton_greedy(r), max_gap)


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    """Each tiny checkpoint, written the first time a test asks for it."""
    class Paths(dict):
        def __missing__(self, name: str) -> str:
            kind, overrides = TINY_MODELS[name]
            self[name] = make_tiny_checkpoint(tmp_path_factory.mktemp(name), kind, **overrides)
            return self[name]
    return Paths()


# the families added after the first eleven run in the full suite only (`slow`): make test-fast keeps its 3 minutes
SLOW_TINY = {"smollm3", "ministral", "gpt-oss", "exaone4", "seed-oss", "glm4", "cohere2", "deepseek-v3", "deepseek-v2",
             "llama4"}


@pytest.fixture(scope="module", params=[pytest.param(n, marks=pytest.mark.slow) if n in SLOW_TINY else n
                                        for n in sorted(TINY_MODELS)])
def tiny_pair(request, tiny_paths):
    """(TP 1 engine, TP 2 engine, their KV events) of one tiny random checkpoint."""
    path = tiny_paths[request.param]
    ev1, ev2 = [], []
    tp1, tp2 = engine(path, 1, ev1), engine(path, 2, ev2)
    yield tp1, tp2, ev1, ev2
    tp2.shutdown()


def test_tp2_greedy_tokens_equal_tp1(tiny_pair):
    tp1, tp2, _, _ = tiny_pair
    assert_same_greedy(generate(tp1, PROMPTS), generate(tp2, PROMPTS))
    assert tp1.compat_key() == tp2.compat_key()        # a TP 2 producer's KV fits a TP 1 consumer


def test_tp2_embeddings_equal_tp1(tiny_pair):
    """An embedding pools rank 0's final hidden states, whole on every rank after the last all-reduce."""
    from engine.pooling import PoolingParams
    vectors = []
    for eng in tiny_pair[:2]:
        ids = [eng.add_request(p, pooling=PoolingParams()) for p in PROMPTS]
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        vectors.append([done[i].embedding for i in ids])
    for a, b in zip(*vectors):
        assert a.shape == (tiny_pair[0].hf_config.hidden_size,) and float(abs(a - b).max()) < 1e-5


def test_prefix_cache_and_kv_events_are_unchanged(tiny_pair):
    tp1, tp2, ev1, ev2 = tiny_pair
    shared = list(range(3, 3 + 40))                    # two full blocks of 16, shared by both requests
    for eng in (tp1, tp2):
        before = eng.stats()["prefix_cache_hit_tokens"]
        generate(eng, [shared + [7, 8]])
        out = generate(eng, [shared + [9, 10, 11]])[0]
        eng.hits = eng.stats()["prefix_cache_hit_tokens"] - before
        assert out.metrics.num_cached_tokens == 32
    assert tp1.hits == tp2.hits == 32
    assert ev1 and ev1 == ev2


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3-moe", "qwen2-moe", "gpt-oss", "deepseek-v3", "llama4"])
def test_expert_parallel_tp2_holds_whole_experts_and_gives_tp1s_tokens(tmp_path, name):
    """enable_expert_parallel: rank 0 holds experts 0-1 of 5, whole (every unit), rank 1 experts 2-4; each adds its
    experts' terms (gpt-oss's down bias too) and the block's one all-reduce sums them (a shared expert's term split
    by units, as before)."""
    kind, overrides = TINY_MODELS[name]
    experts = {"num_local_experts": 5} if kind in ("gpt_oss", "llama4_text") else {"num_experts": 5} \
        if kind != "deepseek_v3" else {"n_routed_experts": 5, "n_group": 1, "first_k_dense_replace": 0}   # no 4 groups
    path = make_tiny_checkpoint(tmp_path, kind, **{**overrides, **experts})
    tp1, ep = engine(path, 1), engine(path, 2, enable_expert_parallel=True)
    try:
        moe = ep.runner.model.model.layers[0].mlp
        width = ep.hf_config.intermediate_size if kind in ("gpt_oss", "llama4_text") else \
            ep.hf_config.moe_intermediate_size
        assert moe.local == range(0, 2) and moe.run == range(0, width) and moe.intermediate == width
        assert tuple(moe.experts.gate_up_proj.shape[:2]) == (2, 2 * moe.intermediate)
        assert_same_greedy(generate(tp1, PROMPTS), generate(ep, PROMPTS))
    finally:
        ep.shutdown()


def test_the_host_kv_tier_copies_every_ranks_share(tiny_paths):
    """With a host tier at TP 2, a prefix the device cache evicted comes back from host memory on both ranks
    (each holds its heads' share of both tiers): the same tokens as when it was computed, nothing recomputed."""
    def ids(seed: int) -> list[int]:                  # the tiny vocabulary has 301 tokens
        return torch.randint(5, 300, (100,), generator=torch.Generator().manual_seed(seed)).tolist()
    prompt = ids(0)                                   # 6 full blocks before the block of the last token
    eng = engine(tiny_paths["llama-mqa"], 2, num_kv_blocks=24, kv_offloading_size=0.01)
    try:
        first = generate(eng, [prompt])[0]
        generate(eng, [ids(k) for k in range(1, 5)])  # 7 blocks each: evicts it
        again = generate(eng, [prompt])[0]
        assert again.metrics.num_cached_tokens == 96
        assert eng.stats()["prefix_cache_host_hit_tokens"] == 96 and eng.stats()["kv_onloaded_blocks"] == 6
        assert_same_greedy([first], [again])
    finally:
        eng.shutdown()


@pytest.mark.slow                # the real model at TP 1 and 2 (the tiny shapes above run in the fast tier)
@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_smollm2_tp2_equals_tp1(smol_path, kv):
    """SmolLM2's 3 KV heads split unevenly (rank 0: 1, rank 1: 2), 9 query heads 3 and 6; each rank's share of an
    int8 cache is its heads' codes and scales. The all-reduce's last-bit differences can move an int8 code, so a
    near-tie there may be wider (tests/test_kv_quant.py's bound)."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    tp1 = engine(smol_path, 1, num_kv_blocks=32, kv_cache_dtype=kv)
    ref = generate(tp1, prompts, params)
    tp2 = engine(smol_path, 2, num_kv_blocks=32, kv_cache_dtype=kv)
    try:
        assert tp2.runner.model.num_kv_heads == 1 and tp2.runner.kv_cache.shape[1] == 1
        out = generate(tp2, prompts, params)
        assert_same_greedy(ref, out, MAX_LOGPROB_GAP if kv == "auto" else 0.3)
    finally:
        tp2.shutdown()


@pytest.mark.parametrize("spec", [  # the fast tier keeps layer_skip (drafts from the TP model itself)
    pytest.param({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}, marks=pytest.mark.slow),
    {"method": "layer_skip", "num_layers": 2, "num_speculative_tokens": 2, "adaptive": False},
    pytest.param({"method": "draft_model", "num_speculative_tokens": 2, "adaptive": False}, marks=pytest.mark.slow),
    pytest.param({"method": "eagle", "num_speculative_tokens": 2, "adaptive": False}, marks=pytest.mark.slow),
    pytest.param({"method": "eagle3", "num_speculative_tokens": 2, "adaptive": False}, marks=pytest.mark.slow)],
    ids=["ngram", "layer_skip", "draft_model", "eagle", "eagle3"])
def test_speculation_with_tp2_keeps_greedy_output(tiny_paths, spec, tmp_path):
    """ngram drafts without a model; layer_skip with the sharded target's first layers; a draft model runs
    unsharded on rank 0 (vLLM's draft_tensor_parallel_size=1), and so do EAGLE heads, with whole copies of the
    target's embedding (and, for EAGLE-1, its tied head) read from its checkpoint."""
    from test_spec_heads import write_eagle3_head, write_eagle_head
    path = tiny_paths["qwen2-tied"]
    if spec["method"] == "draft_model":
        spec = {**spec, "model": path}
    elif spec["method"] in ("eagle", "eagle3"):
        write = write_eagle_head if spec["method"] == "eagle" else write_eagle3_head
        spec = {**spec, "model": write(path, tmp_path / "head")}
    ref = generate(engine(path, 1), PROMPTS)
    eng = engine(path, 2, speculative_config=spec)
    try:
        assert_same_greedy(ref, generate(eng, PROMPTS))
        assert eng.stats()["spec_num_draft_tokens"] > 0
        if spec["method"] in ("eagle", "eagle3"):      # whole copies on rank 0; TP 1's drafts
            assert eng.draft_runner.model.model.embed_tokens.weight.shape[0] == eng.hf_config.vocab_size
            same_drafts_as_tp1(path, spec, eng)
    finally:
        eng.shutdown()


def same_drafts_as_tp1(path: str, spec: dict, tp2: LLMEngine) -> None:
    """The head drafts at TP 2 what it drafts at TP 1 (the target's hidden states it reads are whole on rank 0),
    request by request, but where a near-tie of the sums' order parts them."""
    from test_spec_heads import spy_drafts
    runs = []
    for eng in (engine(path, 1, speculative_config=spec), tp2):
        records = spy_drafts(eng)
        generate(eng, [[3, 4, 5] * 7, list(range(120, 160))])          # prompts neither has cached
        runs.append(records)
    assert len(runs[0]) > 5
    assert sum(a == b for a, b in zip(*runs)) >= 0.8 * len(runs[0])


@pytest.mark.slow
def test_deepseek_mtp_with_tp2_keeps_greedy_output(tmp_path):
    """DeepSeek-V3's prediction layer drafts on rank 0 beside a TP 2 target (its heads split, its latent whole)."""
    from test_spec_heads import add_mtp_layer
    path = add_mtp_layer(make_tiny_checkpoint(tmp_path / "v3", "deepseek_v3"), tmp_path / "mtp")
    spec = {"method": "mtp", "num_speculative_tokens": 2, "adaptive": False}
    ref = generate(engine(path, 1), PROMPTS)
    eng = engine(path, 2, speculative_config=spec)
    try:
        assert_same_greedy(ref, generate(eng, PROMPTS))
        assert eng.stats()["spec_num_draft_tokens"] > 0
        same_drafts_as_tp1(path, spec, eng)
    finally:
        eng.shutdown()


# -- sharded loading ------------------------------------------------------------------------------------
class CountingHandle:
    """Wraps a safetensors handle: counts the bytes each read hands out, whole tensors and slices."""

    def __init__(self, fh, log: dict):
        self.fh, self.log = fh, log

    def __enter__(self):
        self.fh.__enter__()
        return self

    def __exit__(self, *a):
        return self.fh.__exit__(*a)

    def keys(self):
        return self.fh.keys()

    def get_tensor(self, name):
        t = self.fh.get_tensor(name)
        self.log[name] = t.numel() * t.element_size()
        return t

    def get_slice(self, name):
        sl, log = self.fh.get_slice(name), self.log

        class Slice:
            def __getitem__(self, idx):
                t = sl[idx]
                log[name] = t.numel() * t.element_size()
                return t
        return Slice()


# -- packed (quantized) weights at TP 2 ----------------------------------------------------------------------
# SmolLM2 at TP 2, rank 0 (the driver, in this process): 3 query heads and 1 KV head of 64, 768 of 1536 MLP units
SMOL_RANK0 = {"qkv": 5 * 64, "o_in": 3 * 64, "gate_up": 2 * 768, "down_in": 768}


def test_lora_adapters_at_tp2_give_tp1s_tokens(tiny_paths, tmp_path):
    """LoRA under TP: each rank holds its share of every adapter (q/k/v's and gate/up's B rows, o's and down's A
    columns, on MQA's replicated KV head and an uneven intermediate split). A batch mixing the base and three
    adapters through two slots, so rank 0 evicts and the workers reload, gives TP 1's greedy tokens (up to an
    all-reduce's near-tie); and every adapter changes them."""
    from bench.models import make_lora_adapter
    from engine.lora import LoRARequest
    base = tiny_paths["llama-mqa"]
    adapters = {name: LoRARequest(name, i + 1, make_lora_adapter(base, tmp_path / name, rank=r, seed=i + 1, **kw))
                for i, (name, r, kw) in enumerate([("full", 8, {}), ("attn", 4, {"targets": ("q_proj", "k_proj",
                                                   "v_proj", "o_proj")}), ("mlp", 6, {"targets": ("down_proj",)})])}
    cases = [(name, p) for p in PROMPTS for name in (None, *adapters)]

    def run(eng: LLMEngine) -> list:
        ids = [eng.add_request(p, GREEDY, lora_request=adapters.get(n)) for n, p in cases]
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        return [done[i] for i in ids]

    lora = dict(enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8)
    ref = run(engine(base, 1, **lora))
    tp2 = engine(base, 2, **lora)
    try:
        out = run(tp2)
        stats = tp2.stats()
    finally:
        tp2.shutdown()
    assert_same_greedy(ref, out)
    assert stats["lora_loads"] >= 3 and stats["lora_evictions"] >= 1      # three adapters through two slots
    for (name, p), r in zip(cases, ref):
        if name is not None:
            assert r.token_ids != next(b.token_ids for (n, q), b in zip(cases, ref) if n is None and q == p), name


def _packed_calls(model) -> dict[str, tuple]:
    """Rank 0's first layer: each linear's kernel calls (kind, group, n, k), None where it runs in floats."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    calls = {}
    for name, m in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)):
        quant = getattr(m, "quant", m)                  # a row-parallel linear holds its packed part
        calls[name] = quant.calls if isinstance(quant, QuantLinear) else None
    return calls


@pytest.mark.slow
@pytest.mark.parametrize("quantization,gap", [("auto", 0.5), ("int8", 0.75), ("fp8", 1.0)])
def test_smollm2_runs_packed_at_tp2(quantization, gap):
    """Each rank holds its rows (q/k/v, gate/up) or columns (o, down) packed, as vLLM's ranks hold theirs: the
    default GGUF's own 4-bit codes (quantization auto; its Q8_0 vocabulary rows too, half a rank), or int8/e4m3
    quantized per rank at load. The text equals TP 1's up to a near-tie of the format's width (tests/test_quant.py's
    gaps): quantized activations let an all-reduce's last bit move a code, and quantized at load, a row-parallel
    rank's scales are over its own columns, as vLLM's are."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    prompts = [[1, 5, 9, 33, 7], list(range(100, 140))]
    tp1 = engine(None, 1, num_kv_blocks=32, quantization=quantization)
    ref = generate(tp1, prompts, params)
    tp2 = engine(None, 2, num_kv_blocks=32, quantization=quantization)
    try:
        kind = {"auto": "q4", "int8": "q8", "fp8": "f8"}[quantization]
        assert tp2.runner.quantization == tp1.runner.quantization == {"auto": "gguf"}.get(quantization, quantization)
        calls = _packed_calls(tp2.runner.model)
        assert calls["qkv"][0][:1] + calls["qkv"][0][2:] == (kind, SMOL_RANK0["qkv"], 576), calls
        assert calls["o"][0][:1] + calls["o"][0][2:] == (kind, 576, SMOL_RANK0["o_in"]), calls
        assert calls["gate_up"][0][2:] == (SMOL_RANK0["gate_up"], 576), calls
        assert calls["down"][0][2:] == (576, SMOL_RANK0["down_in"]), calls
        if quantization == "auto":          # the vocabulary's rows too (Q8_0): looked up, and the tied head's
            model = tp2.runner.model
            assert isinstance(model.model.embed_tokens.quant, QuantEmbedding)
            assert isinstance(model.lm_head, QuantLinear) and model.lm_head.calls[0][2] == 49152 // 2
            assert tp2.runner.weight_bytes < 0.55 * tp1.runner.weight_bytes
        assert_same_greedy(ref, generate(tp2, prompts, params), gap)
    finally:
        tp2.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("method,bits,intermediate,act_order", [
    ("gptq", 4, 128, False), ("gptq", 8, 128, False), ("fp8", 8, 128, False), ("gptq", 4, 160, False),
    ("gptq", 4, 128, True), ("ct-w4a16", 4, 128, False)])
def test_gptq_and_fp8_checkpoints_run_packed_at_tp2(tmp_path, method, bits, intermediate, act_order):
    """A GPTQ (group 32; 4-bit, or 8-bit), FP8 (per-channel scales) or compressed-tensors W4A16 checkpoint at TP 2:
    every rank's share stays packed, the codes and scales TP 1 holds, and GPTQ's text is TP 1's to fp32's order
    (its activations' int8 blocks are TP 1's; FP8's per-token scales are each rank's own). Where a rank's columns
    would cut a q4 block (160 MLP units: 80 a rank), that share runs dequantized, with fp32 activations, and the
    text is TP 1's up to a near-tie; so do an act-order checkpoint's row-parallel shares (a rank's columns hold
    parts of groups), whose q/k/v and gate/up rows stay packed in their act-order."""
    from check.quant import write_quantized
    path, _ = write_quantized(make_tiny_checkpoint(tmp_path / "float", "llama", intermediate_size=intermediate),
                              tmp_path / method, method, bits=bits if method == "gptq" else 4, act_order=act_order)
    tp1 = engine(path, 1)
    ref = generate(tp1, PROMPTS)
    tp2 = engine(path, 2)
    try:
        assert tp2.runner.quantization == ("compressed-tensors" if method.startswith("ct-") else method)
        calls = _packed_calls(tp2.runner.model)
        assert (calls["o"] is None) == act_order, calls
        assert act_order or calls["o"][0][3] == 32                          # 2 of 4 heads of 16: its columns
        assert (calls["down"] is None) == (intermediate == 160 or act_order), calls
        qkv = tp2.runner.model.model.layers[0].self_attn.qkv_proj
        assert calls["qkv"] is not None and (qkv.perms[0] is not None) == act_order
        exact_shares = method == "gptq" and intermediate == 128 and not act_order
        assert_same_greedy(ref, generate(tp2, PROMPTS), MAX_LOGPROB_GAP if exact_shares else 0.5)
    finally:
        tp2.shutdown()


@pytest.mark.slow
def test_a_gguf_at_tp3_pads_its_last_vocabulary_shard_and_keeps_tp1s_tokens(tmp_path):
    """4,096 vocabulary rows over 3 ranks: 1,366 a shard, the last one's 1,364 padded with zero rows, its embedding
    and untied head kept packed (Q8_0); q, k and v of three kinds, each rank's rows: 2 of 6 query heads, the one
    KV head replicated. The text is TP 1's up to a near-tie (int8 activations)."""
    from tests.gguf_files import write_gguf
    types = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_0",
             "ffn_gate": "Q4_1", "ffn_up": "Q8_0", "ffn_down": "Q4_0", "output": "Q8_0"}
    path = str(write_gguf(tmp_path / "m.gguf", types, hidden=192, intermediate=384, heads=6, kv_heads=1))
    prompts = [[1, 5, 9, 33, 7], list(range(3000, 3040)), [4095, 4094, 7]]
    tp1 = engine(path, 1)
    ref = generate(tp1, prompts)
    tp3 = engine(path, 3)
    try:
        assert tp3.runner.quantization == "gguf"
        model = tp3.runner.model
        assert isinstance(model.model.embed_tokens.quant, QuantEmbedding) and model.lm_head.calls[0][2] == 1366
        calls = _packed_calls(model)
        assert [c[0] for c in calls["qkv"]] == ["q4", "q4", "q8"] and calls["o"][0][3] == 64, calls
        assert_same_greedy(ref, generate(tp3, prompts), 0.5)
    finally:
        tp3.shutdown()


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch):
    import safetensors

    from engine.loader import iter_weights, load_config
    from engine.model import LlamaForCausalLM
    from engine.parallel import TPGroup
    path = make_tiny_checkpoint(tmp_path, "llama", num_key_value_heads=4, intermediate_size=256)
    real = safetensors.safe_open
    reads: dict[int, dict] = {}

    def load(rank: int, size: int) -> LlamaForCausalLM:
        reads[rank if size > 1 else -1] = log = {}
        monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: CountingHandle(real(*a, **k), log))
        with torch.device("meta"):
            model = LlamaForCausalLM(load_config(path), 256, tp=TPGroup(rank, size) if size > 1 else None)
        model.materialize(torch.device("cpu"), torch.float32).load_weights(iter_weights(path, model.weight_shard))
        return model
    full, r0, r1 = load(0, 1), load(0, 2), load(1, 2)
    whole = sum(reads[-1].values())
    replicated = sum(v for n, v in reads[-1].items() if "norm" in n)
    for rank in (0, 1):
        assert sum(reads[rank].values()) == (whole - replicated) // 2 + replicated   # half of every split tensor
        params = sum(p.numel() for p in (r0, r1)[rank].parameters())
        assert params * 4 < 0.55 * whole
    # the shards are the full tensor's pieces: rank 0's q rows first, rank 1's next
    q = full.model.layers[0].self_attn.qkv_proj.weight[:64]
    assert torch.equal(torch.cat([r0.model.layers[0].self_attn.qkv_proj.weight[:32],
                                  r1.model.layers[0].self_attn.qkv_proj.weight[:32]]), q)


def _env_and_parent(worker, name: str) -> tuple[str | None, int]:
    return os.environ.get(name), os.getppid()


def test_a_worker_sees_the_environment_its_engine_had_when_it_started(tmp_path, monkeypatch):
    """Workers fork from a fork server that imported the engine once, with the environment of that moment; each
    worker still gets its engine's environment as it starts (BATON_CPU_KERNEL=0 and the like reach every rank)."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    monkeypatch.setenv("BATON_TEST_MARK", "first")
    first = engine(path, 2)
    monkeypatch.setenv("BATON_TEST_MARK", "second")
    second = engine(path, 2)
    try:
        (_, _), (mark1, server1) = first.executor.collective_rpc(_env_and_parent, "BATON_TEST_MARK")
        (_, _), (mark2, server2) = second.executor.collective_rpc(_env_and_parent, "BATON_TEST_MARK")
        assert (mark1, mark2) == ("first", "second")
        assert server1 == server2 != os.getpid()          # both forked from the one fork server
        assert [o.token_ids for o in generate(second, PROMPTS)] == [o.token_ids for o in generate(first, PROMPTS)]
    finally:
        first.shutdown()
        second.shutdown()


# -- failures and shutdown ------------------------------------------------------------------------------
def test_a_rank_that_starts_later_than_the_collective_timeout_still_joins():
    """Starting a rank (a process, torch's import, a shard to load) may take longer than a collective may: the
    ranks meet within the start-up timeout (gloo's own join would give up after the collective one)."""
    import threading

    from engine.parallel import join_group, new_rendezvous
    rdv, store = new_rendezvous(2, timeout_s=1.0, start_timeout_s=60.0)
    groups, errors = {}, []

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        try:
            groups[r] = join_group(rdv, r, torch.device("cpu"), None if r else store)
        except Exception as e:                           # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 3.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    sums = [torch.tensor([float(r + 1)]) for r in (0, 1)]
    threads = [threading.Thread(target=lambda r=r: groups[r].all_reduce(sums[r])) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [t.item() for t in sums] == [3.0, 3.0]        # the group works, with its 1 s collective timeout


def test_an_idle_worker_outwaits_the_collective_timeout():
    """A worker waits for the next step without a deadline (an engine may idle for hours); steps still flow."""
    import threading

    import numpy as np

    from engine.input_batch import StepShape
    from engine.parallel import join_group, new_rendezvous
    rdv, store = new_rendezvous(2, timeout_s=2.0)
    groups = {}
    cpu = torch.device("cpu")
    threads = [threading.Thread(target=lambda r=r: groups.update({r: join_group(rdv, r, cpu, None if r else store)}))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = []
    worker = threading.Thread(target=lambda: got.append(groups[1].recv_step()))
    worker.start()
    time.sleep(2.5)                                       # idle for longer than the collective timeout
    shape = StepShape(np.array([0, 3]), np.array([3, 1]), np.array([1, 1]))
    groups[0].send_step(shape, np.arange(4), np.array([[5, 6], [7, 8]], np.int32), 2)
    worker.join(timeout=10)
    got_shape, ids, tables, layers, lora = got[0]
    assert got_shape.query_lens.tolist() == [3, 1] and ids.tolist() == [0, 1, 2, 3]
    assert tables.tolist() == [[5, 6], [7, 8]] and layers == 2 and lora is None
    worker = threading.Thread(target=lambda: got.append(groups[1].recv_step()))      # a step with LoRA slots
    worker.start()
    groups[0].send_step(shape, np.arange(4), np.array([[5, 6], [7, 8]], np.int32), None, np.array([1, -1]))
    worker.join(timeout=10)
    got_shape, ids, tables, layers, lora = got[1]
    assert tables.tolist() == [[5, 6], [7, 8]] and layers is None and lora.tolist() == [1, -1]


def test_olmo_refuses_tensor_parallelism_by_name(tmp_path):
    """OLMo 2/3 normalise the whole q and k projections, over heads the ranks would split: refused, not run wrong."""
    with pytest.raises(Exception, match="olmo2.*tensor parallelism is not supported"):
        engine(make_tiny_checkpoint(tmp_path, "olmo2"), 2)


def test_tensor_parallel_size_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    path = make_tiny_checkpoint(tmp_path, "llama", num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="cannot be replicated evenly"):
        engine(path, 3)                                   # 2 KV heads on 3 ranks: refused before any process starts


def test_dead_worker_fails_the_next_step_fast_and_shutdown_leaves_no_process(tmp_path):
    path = make_tiny_checkpoint(tmp_path, "llama")
    eng = engine(path, 2)
    worker = eng.executor.workers[0]
    assert generate(eng, PROMPTS[:1])[0].finished
    os.kill(worker.pid, signal.SIGKILL)
    wait_for(lambda: not worker.alive(), 10, "the killed worker to exit")
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError, match="rank"):
        generate(eng, PROMPTS[:1])
    assert time.monotonic() - t0 < 15                      # seconds, not a hang (margin for a loaded machine)
    with pytest.raises(TPWorkerError):                    # and every later step, not a hang
        generate(eng, PROMPTS[:1])
    eng.shutdown()


@pytest.mark.slow                # two TP engines' worker processes in a child process
def test_no_worker_outlives_the_engine(tmp_path):
    """Shutdown stops an engine's workers; if the engine's process is killed instead, they exit on their own."""
    path = make_tiny_checkpoint(tmp_path, "llama")
    script = textwrap.dedent(f"""
        import time
        from engine.config import EngineConfig
        from engine.llm_engine import LLMEngine
        if __name__ == "__main__":
            cfg = EngineConfig(model={path!r}, tensor_parallel_size=2, num_kv_blocks=48, max_model_len=256)
            stopped, killed = LLMEngine(cfg), LLMEngine(cfg)
            print(stopped.executor.workers[0].pid, killed.executor.workers[0].pid, flush=True)
            stopped.shutdown()
            print("shut down", flush=True)
            time.sleep(60)
    """)
    (tmp_path / "run.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py")], stdout=subprocess.PIPE, text=True, env=env)
    try:
        stopped, killed = (int(p) for p in proc.stdout.readline().split())
        assert proc.stdout.readline().strip() == "shut down"
        wait_for(lambda: not alive(stopped), 10, "the worker to stop after shutdown")
        assert alive(killed)
        proc.kill()                                       # SIGKILL: no atexit, no finalizer runs
        wait_for(lambda: not alive(killed), 10, "the worker to stop after its engine's process was killed")
    finally:
        proc.kill()
        proc.wait()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:                  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.bench
def test_bench_engine_tp_quick(tmp_path):
    """`baton bench engine --tp 2 --quick`: both sizes' tokens/s and TP 2's time in collectives per step."""
    result = run_bench("engine", "--tp", "2", "--quick", "--out-dir", str(tmp_path))
    assert set(result["tp"]) == {"1", "2"} and all(r["output_tokens_per_s"] > 0 for r in result["tp"].values())
    step = result["tp"]["2"]["decode_batch1"]
    assert 0 < step["collectives_ms_per_step"] < step["step_ms"] and step["all_reduce_ms_per_step"] > 0
    assert result["exact_match_tp_vs_tp1"] == 1.0          # greedy: the same tokens at both sizes
    assert (tmp_path / "engine_tp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
