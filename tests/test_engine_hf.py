"""Greedy output equals transformers' generate (up to an fp32 near-tie, tests/greedy.py), alone and batched
with tiny prefill chunks; Baton alone and Baton batched agree exactly."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.greedy import TOP_K, baton_greedy, check_greedy_close, hf_greedy

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "List three colors:",
    "1, 2, 3, 4,",
    "Translate to French: I like cheese.",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
    "import numpy as np\nx = np.arange(10)\n# compute the mean of x and print it together with a short message explaining",
]
GREEDY_64 = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=TOP_K)


@pytest.fixture(scope="module")
def smol_reference(hf_smol, smol_llm):
    prompt_ids = [smol_llm.engine.tokenize(p) for p in PROMPTS]
    return prompt_ids, hf_greedy(hf_smol, prompt_ids, 64)


@pytest.fixture(scope="module")
def smol_alone(smol_llm, smol_reference):
    prompt_ids, _ = smol_reference
    return [smol_llm.generate([ids], GREEDY_64)[0] for ids in prompt_ids]


@pytest.mark.slow
def test_smollm2_alone_matches_transformers(smol_alone, smol_reference):
    _, ref = smol_reference
    for out, want in zip(smol_alone, ref):
        check_greedy_close(baton_greedy(out), want)


@pytest.mark.slow
def test_smollm2_batched_chunked_matches_transformers_and_itself_alone(smol_path, smol_reference, smol_alone):
    prompt_ids, ref = smol_reference
    llm = LLM(smol_path, max_num_batched_tokens=24, kv_cache_memory=128 << 20, max_model_len=1024)   # forces 24-token chunks
    outs = llm.generate(prompt_ids, GREEDY_64)
    for out, want in zip(outs, ref):
        check_greedy_close(baton_greedy(out), want)
    assert [o.token_ids for o in outs] == [o.token_ids for o in smol_alone]       # Baton against itself: exact
    assert max(len(p) for p in prompt_ids) > 24                                   # some prompts really chunked
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize("model_type,extra", [
    ("llama", {}),
    ("qwen2", {}),                                                    # q/k/v bias
    ("qwen3", {"head_dim": 32}),               # q/k norms; head_dim apart from hidden / heads (Qwen3's 128 at 1024)
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),   # MQA + tied embeddings
    ("mixtral", {}),                                                  # 4 experts, top 2, renormalised
    ("qwen3_moe", {"head_dim": 32, "mlp_only_layers": [1]}),          # experts beside a dense layer; q/k norms
    ("qwen3_moe", {"norm_topk_prob": False}),                         # the top-k weights as the softmax gave them
    ("qwen2_moe", {"mlp_only_layers": [2]}),                          # q/k/v bias; a gated shared expert
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               "rope_theta": 50000.0}),
    ("mistral", {"sliding_window": 12}),                              # every layer sees its last 12 tokens
    ("qwen2", {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),   # layers 1.. windowed
    ("gemma", {}),                                   # scaled embeddings, 1 + w norms, GELU, tied head
    ("gemma2", {}),                                  # + sandwich norms, alternating windows, two softcaps
    ("gemma3_text", {}),                             # + q/k norms, a RoPE per layer type
    ("gemma3", {}),                                  # Gemma 3 4B+'s multimodal checkpoint, served as text
    ("phi3", {"sliding_window": 12}),                # fused qkv/gate_up in the checkpoint; Phi-3-mini-4k's window
    ("phi3", {"partial_rotary_factor": 0.5, "num_key_value_heads": 4}),      # RoPE over half of each head (Phi-4-mini)
    ("granite", {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                 "logits_scaling": 8.0}),                            # Granite 3's multipliers (its 8B's)
    ("smollm3", {"no_rope_layers": [1, 0, 1]}),                      # SmolLM3: a layer without RoPE (NoPE)
    ("ministral", {"head_dim": 16, "sliding_window": 8,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}),
    ("olmo2", {}),                                   # norms after each sublayer only; q/k norms over all heads
    ("olmo3", {"sliding_window": 8}),                # + windows on 3 of every 4 layers, a RoPE per layer type
    ("exaone4", {"sliding_window": 8, "sliding_window_pattern": 3}),     # post norms, per-head q/k norms, windows;
                                                     # its global layers without RoPE
    ("seed_oss", {"head_dim": 16}),                  # biases on q/k/v, not on o
    ("ernie4_5", {"head_dim": 16, "use_bias": True}),   # RoPE over interleaved pairs; biases everywhere
    ("cohere2", {"sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                 "logit_scale": 0.25}),          # Command R7B: LayerNorms, attention and MLP side by side, interleaved
                                                 # RoPE on the sliding layers only, logits scaled
    ("glm4", {"head_dim": 16}),                      # interleaved RoPE over half of each head, sandwich norms, gate/up
                                                     # fused in the checkpoint
    ("gpt_oss", {}),                                 # attention sinks, windows, biases, YaRN; experts with biases
                                                     # and a clamped SwiGLU, gate/up interleaved in the checkpoint
    ("deepseek_v3", {}),                             # MLA over a latent cache, queries through a low rank, RoPE
                                                     # over interleaved pairs, YaRN's mscale; experts chosen in
                                                     # groups by sigmoid + a correction bias, scaled; shared experts
    ("deepseek_v2", {}),                             # MLA with a full-rank q; groups ranked by their best softmax
])
def test_tiny_random_models_match_transformers(tmp_path, model_type, extra):
    from transformers import AutoModelForCausalLM
    path = make_tiny_checkpoint(tmp_path, model_type, **extra)
    _matches_transformers(path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())


def _matches_transformers(path: str, hf) -> None:
    """Greedy continuations of five random prompts (5-70 tokens) equal transformers' up to a near-tie, alone; and
    batched in prefill chunks of 16 they equal themselves alone, exactly."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 17, 33, 48, 70)]
    want = hf_greedy(hf, prompts, 32)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP_K)
    alone = LLM(path, block_size=8, num_kv_blocks=64)
    alone_outs = [alone.generate([p], params)[0] for p in prompts]
    for out, ref in zip(alone_outs, want):
        check_greedy_close(baton_greedy(out), ref)
    batched = LLM(path, block_size=8, num_kv_blocks=64, max_num_batched_tokens=16)
    outs = batched.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in alone_outs]     # Baton against itself: exact


@pytest.mark.parametrize("model_type", ["llama4_text", "llama4"])
def test_llama4_matches_transformers(tmp_path, model_type):
    """Llama 4 (bench/models.py LLAMA4_TINY): chunked attention (chunks of 8: prompts run past several), a NoPE layer
    with its query temperature, q/k L2 norms, RoPE over interleaved pairs with llama3's scaling, top-1 experts
    weighted on their input beside a shared expert and a dense layer of its own width; and Scout's and Maverick's
    multimodal checkpoint, served as text (against transformers' language model of it: its multimodal forward
    of text alone fails in this transformers). The reference runs one prompt at a time (check/compare.py
    hf_greedy)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    path = make_tiny_checkpoint(tmp_path, model_type)
    hf = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval().language_model \
        if model_type == "llama4" else AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _matches_transformers(path, hf)


LONGROPE = {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.4, 2.9, 3.5],
                             "long_factor": [1.0, 1.5, 2.2, 3.0, 4.1, 5.3, 6.6, 8.0]},
            "original_max_position_embeddings": 128, "max_position_embeddings": 512}


def test_phi3_longrope_takes_its_factors_by_max_model_len(tmp_path):
    """Phi-3.5's long RoPE has short factors for contexts up to original_max_position_embeddings and long ones past
    it. transformers picks per forward by its length; the engine picks once, by max_model_len (llama.cpp's rule), so
    that a cache never holds keys rotated both ways: up to 128 it equals transformers on sequences that stay short,
    past 128 on sequences that start long."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_checkpoint(tmp_path, "phi3", **LONGROPE)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K)
    for max_model_len, lengths in ((128, (5, 40, 100)), (512, (130, 200))):
        prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]
        llm = LLM(path, block_size=8, num_kv_blocks=96, max_model_len=max_model_len)
        for out, ref in zip(llm.generate(prompts, params), hf_greedy(hf, prompts, 24)):
            check_greedy_close(baton_greedy(out), ref)
    prompt = prompts[0][:40]                             # the factors alone part the two engines
    short = LLM(path, block_size=8, num_kv_blocks=96, max_model_len=128).generate([prompt], params)
    long = LLM(path, block_size=8, num_kv_blocks=96, max_model_len=512).generate([prompt], params)
    assert short[0].token_ids != long[0].token_ids or short[0].logprobs != long[0].logprobs
    # their KV differs for the same tokens: the two cannot share blocks (a hand-off between them is refused)
    tags = [LLM(path, num_kv_blocks=32, max_model_len=n).engine.compat_key() for n in (128, 512)]
    assert tags[0].endswith(":rope-short") and tags[1].endswith(":rope-long")
