"""Part 2 of `baton check gpu`: the engine against transformers on random-weight models built from config.

Each model (a Llama-3 shape of about 1B with llama3 RoPE scaling, a Qwen2 shape with its q/k/v bias, Qwen3's,
four layers of Qwen3-30B-A3B's mixture of experts, four of Gemma-2-2B's with a sliding window short enough to
matter and its softcaps, four of Phi-4-mini's: fused weights, partial and long RoPE, and four of gpt-oss-20b's:
attention sinks, windows, experts with biases and a clamped SwiGLU) is built
by transformers with random weights and saved with `save_pretrained` (safetensors), then loaded by both, as a
real checkpoint is. transformers in fp32 gives the reference: greedy continuations with their top logprobs,
and the teacher-forced log-probabilities of every position of prompt + continuation.

- Teacher-forced: the engine's log-probabilities over the same tokens (a prefill of the first half, then the
  rest as a chunk on the cached half) against the reference. In bf16 the tolerance is 3x what transformers'
  own bf16 run misses the reference by (measured here, on the same weights and tokens): the engine may not be
  much further from the exact answer than transformers in the same dtype. fp32 (the CPU dry mode) has a fixed
  tolerance.
- Greedy: the engine's greedy tokens, all prompts in one batch, with CUDA graphs and with enforce_eager,
  against the reference up to near-ties (check/compare.py: check_greedy_close) with that tolerance as the gap.
- A quantized KV cache (kv_cache_dtype int8 and fp8, the first model, CUDA graphs). The cache's rounding alone
  moves the log-probabilities: the engine in fp32 with that cache, teacher-forced against the reference, must
  stay under KV_MEAN_TOL in mean. On a GPU every token is read back from the quantized cache, a prefill's own
  new tokens too (as vLLM V1's paged attention does), while the CPU path attends to a context-free prefill's
  fresh K/V: the GPU's tolerance is wider. Measured in fp32: the 1B model on an H100 0.085 int8, 0.359 fp8
  (2026-11-26); the same shape on CPU (other random weights) 0.038 and 0.161; the dry mode's tiny models
  0.006-0.011 and 0.030-0.050. On a GPU the engine's run in its low dtype with the same cache is then judged
  against that fp32 run, which holds the same rounding, with the teacher-forced row's tolerance: what is left
  is the low dtype's error, and a kernel's bug. Its max may also add the cache's own worst rounding error: a K or
  V that the low dtype puts across a rounding boundary of the format is stored as the neighbouring code (fp8 on an
  H200, 2026-11-28: max 2.27 against the bare 2.25, mean 0.228 against 0.263). A greedy batch must complete with
  finite log-probabilities; its agreement with the reference is reported.

The final norm's weight is scaled so logits have a standard deviation of about 4, as a trained model's do:
with std-0.02 weights throughout, logits are nearly flat and every greedy token is a near-tie.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from check.compare import (MAX_LOGPROB_GAP, TOP_K, ErrorStats, Greedy, GreedyBatch, Tolerance, error_stats,
                           hf_greedy)
from check.report import FAIL, PASS, Row
from engine.loader import DUMMY_SHAPES
from engine.model import GEMMA_MODEL_TYPES

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
# name -> (model_type, config): the GPU run's shapes, then the CPU dry mode's tiny twins
GPU_MODELS = {
    "Llama-3-1B": ("llama", {**DUMMY_SHAPES["llama-1b"], "rope_scaling": LLAMA3_ROPE}),
    "Qwen2-0.5B": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                 num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                 rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768)),
    "Qwen3-0.6B": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960)),
    # Qwen3-30B-A3B's layer (128 experts of 768 units, 8 a token) in 4 layers: the experts' routing and indexing
    "Qwen3-30B-A3B-4L": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                           num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                           head_dim=128, vocab_size=151936, rope_theta=1000000.0,
                                           tie_word_embeddings=False, max_position_embeddings=40960)),
    # Gemma-2-2B's layer in 4 layers, its window cut from 4,096 to 128 so that the longer prompts run past it in the
    # sliding layers (every other one); its softcaps (50 on attention scores, 30 on logits) as released
    "Gemma-2-2B-4L-w128": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=4,
                                          num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                                          query_pre_attn_scalar=256, sliding_window=128, vocab_size=256000,
                                          attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                          max_position_embeddings=8192)),
    # Phi-4-mini's layer in 4 layers: q/k/v and gate/up fused in the checkpoint, RoPE over 3/4 of each head with
    # longrope's factors (synthetic ones, 48 = the rotated dims / 2; the check's max_model_len keeps the short set)
    "Phi-4-mini-4L": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=4,
                                   num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
                                   tie_word_embeddings=True, partial_rotary_factor=0.75, max_position_embeddings=131072,
                                   original_max_position_embeddings=4096, rope_theta=10000.0,
                                   pad_token_id=199999, bos_token_id=199999, eos_token_id=199999,
                                   rope_scaling={"rope_type": "longrope",
                                                 "short_factor": [1.0 + 0.02 * i for i in range(48)],
                                                 "long_factor": [1.0 + 0.5 * i for i in range(48)]})),
    # gpt-oss-20b's layer in 4 layers (32 experts of 2,880 units, 4 a token; attention sinks; a window of 128 on every
    # other layer; YaRN): the experts' biases and clamped SwiGLU run in the expert loop, the sinks in the kernel
    "gpt-oss-20b-4L": ("gpt_oss", dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32,
                                       num_experts_per_tok=4, num_hidden_layers=4, num_attention_heads=64,
                                       num_key_value_heads=8, head_dim=64, sliding_window=128, vocab_size=201088,
                                       max_position_embeddings=131072, pad_token_id=199999, bos_token_id=199998,
                                       eos_token_id=200002)),
    # DeepSeek-V2-Lite's layers in 4 (one dense, then 64 experts of 1,408 units, 6 a token, 2 shared): MLA over a
    # latent of 512 + 64 (a KV head of 576 in the kernel), a full-rank q, RoPE over interleaved pairs
    "DeepSeek-V2-Lite-4L": ("deepseek_v2", dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
                                                n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                                                first_k_dense_replace=1, num_hidden_layers=4, num_attention_heads=16,
                                                num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                                                vocab_size=102400, max_position_embeddings=163840,
                                                tie_word_embeddings=False)),
    # Llama-4-Scout's layers in 4 (16 experts of 8,192 units, 1 a token, on their input; a shared expert; q/k L2 norms;
    # the fourth layer without RoPE, with its query temperature), its chunks cut from 8,192 to 128 so the prompts
    # cross them
    "Llama-4-Scout-4L": ("llama4_text", dict(hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
                                             num_local_experts=16, num_experts_per_tok=1, num_hidden_layers=4,
                                             num_attention_heads=40, num_key_value_heads=8, head_dim=128,
                                             attention_chunk_size=128, vocab_size=202048, use_qk_norm=True,
                                             max_position_embeddings=10485760, pad_token_id=200018,
                                             bos_token_id=200000, eos_token_id=200008,
                                             rope_parameters={"rope_type": "llama3", "factor": 16.0,
                                                              "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                                                              "original_max_position_embeddings": 8192,
                                                              "rope_theta": 500000.0})),
}
CPU_MODELS = {
    "llama-tiny": ("llama", {**DUMMY_SHAPES["llama-tiny"], "rope_scaling": {**LLAMA3_ROPE, "factor": 8.0,
                                                                            "original_max_position_embeddings": 64},
                             "max_position_embeddings": 512}),
    "qwen2-tiny": ("qwen2", dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
                                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
    "qwen3-tiny": ("qwen3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True,
                                 max_position_embeddings=512)),
    "qwen3-moe-tiny": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, vocab_size=512, max_position_embeddings=512)),
    "gemma2-tiny": ("gemma2", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                                   vocab_size=512, attn_logit_softcapping=5.0, final_logit_softcapping=30.0,
                                   max_position_embeddings=512)),
    "phi3-tiny": ("phi3", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, partial_rotary_factor=0.5, sliding_window=12,
                               pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)),
    "gpt-oss-tiny": ("gpt_oss", dict(hidden_size=64, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     sliding_window=8, vocab_size=512, max_position_embeddings=512,
                                     pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                     rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                                                      "beta_slow": 1.0, "truncate": False,
                                                      "original_max_position_embeddings": 64,
                                                      "rope_theta": 150000.0})),
    # chunked attention (chunks of 8), a NoPE layer with its temperature, q/k L2 norms, top-1 experts on their input
    "llama4-tiny": ("llama4_text", dict(hidden_size=64, intermediate_size=48, intermediate_size_mlp=96,
                                        num_local_experts=4, num_experts_per_tok=1, moe_layers=[0], num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        no_rope_layers=[1, 0], attention_chunk_size=8, floor_scale=4, attn_scale=0.1,
                                        vocab_size=512, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
                                        eos_token_id=2)),
    # MLA over a latent cache; experts chosen in groups by sigmoid scores plus a correction bias; YaRN's mscale
    "deepseek-v3-tiny": ("deepseek_v3", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                             n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                                             q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=16,
                                             vocab_size=512, max_position_embeddings=512,
                                             rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                              "original_max_position_embeddings": 128,
                                                              "mscale": 1.0, "mscale_all_dim": 1.0,
                                                              "rope_theta": 10000.0})),
}
GPU_PROMPTS, GPU_NEW_TOKENS = (7, 60, 200, 450), 32
CPU_PROMPTS, CPU_NEW_TOKENS = (5, 17, 40), 12
KV_MEAN_TOL = {"int8": 0.05, "fp8": 0.2}                 # nats, mean over positions, CPU (see above)
GPU_KV_MEAN_TOL = {"int8": 0.15, "fp8": 0.6}             # every token through the cache
LOGIT_STD = 4.0
TOL_FACTOR = 3.0                                          # x transformers' own low-precision error
FLOORS = {torch.float32: (1e-3, 1e-4), torch.bfloat16: (0.05, 0.005), torch.float16: (0.02, 0.002)}  # max, mean


def models(cpu: bool) -> dict[str, tuple[str, dict]]:
    return CPU_MODELS if cpu else GPU_MODELS


def build_checkpoint(out_dir: Path, model_type: str, config: dict, dtype: torch.dtype, device: torch.device,
                     seed: int = 0) -> str:
    """A random-weight checkpoint of `config`, saved by transformers (safetensors) in `dtype`: the weights both
    systems load are then the same numbers, whatever dtype each computes in."""
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, **config)
    torch.manual_seed(seed)
    with torch.device(device):                            # initialising 1B weights on a GPU takes a second
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():       # Gemma's norms multiply by 1 + weight
        offset = 1.0 if model_type in GEMMA_MODEL_TYPES else 0.0
        model.model.norm.weight.fill_(LOGIT_STD / (cfg.initializer_range * cfg.hidden_size ** 0.5) - offset)
        if model_type == "gpt_oss":                       # its sinks and biases start at 0: make them count
            for name, p in model.named_parameters():
                if name.endswith(("sinks", "_bias", "router.bias")):
                    p.normal_(0.0, 1.0 if name.endswith("sinks") else 0.02)
        for name, b in model.named_buffers():             # DeepSeek-V3's correction biases start at 0 too
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    model.to(dtype).save_pretrained(out_dir)
    del model
    free_memory(device)
    return str(out_dir)


def random_prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in lengths]


def free_memory(device: torch.device) -> None:
    """Drop what a finished engine or model held (every part calls it between them)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# -- the reference ----------------------------------------------------------------------------------
@dataclass
class Reference:
    prompts: list[list[int]]
    greedy: list[Greedy]                  # transformers in fp32
    logprobs: list[torch.Tensor]          # teacher-forced, fp32 on the CPU: [len(prompt) + new tokens, vocab]
    tol_max: float                        # what the engine's log-probabilities may miss the reference by
    tol_mean: float
    hf_low: ErrorStats | None             # transformers in the engine's dtype against the reference

    def sequences(self) -> list[list[int]]:
        return [p + g.tokens for p, g in zip(self.prompts, self.greedy)]


def _hf_model(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


@torch.inference_mode()
def _hf_logprobs(model, seqs: list[list[int]]) -> list[torch.Tensor]:
    return [model(input_ids=torch.tensor([s], device=model.device)).logits[0].float().log_softmax(-1).cpu()
            for s in seqs]


def hf_reference(path: str, prompts: list[list[int]], new_tokens: int, dtype: torch.dtype,
                 device: torch.device) -> Reference:
    """transformers' fp32 greedy continuations and teacher-forced log-probabilities; in a lower `dtype`, also how
    far transformers itself lands from them, which sets the engine's tolerance."""
    model = _hf_model(path, torch.float32, device)
    with torch.inference_mode():
        greedy = hf_greedy(model, prompts, new_tokens)
    seqs = [p + g.tokens for p, g in zip(prompts, greedy)]
    ref = _hf_logprobs(model, seqs)
    del model
    free_memory(device)
    tol_max, tol_mean = FLOORS[dtype]
    hf_low = None
    if dtype != torch.float32:
        model = _hf_model(path, dtype, device)
        hf_low = _stats(_hf_logprobs(model, seqs), ref, Tolerance(float("inf")))
        del model
        free_memory(device)
        tol_max, tol_mean = max(tol_max, TOL_FACTOR * hf_low.max_abs), max(tol_mean, TOL_FACTOR * hf_low.mean_abs)
    return Reference(prompts, greedy, ref, tol_max, tol_mean, hf_low)


def _stats(ours: list[torch.Tensor], ref: list[torch.Tensor], tol: Tolerance) -> ErrorStats:
    return error_stats(torch.cat(ours), torch.cat(ref), tol)


# -- the engine's side ------------------------------------------------------------------------------
def engine_logprobs(llm, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Teacher-forced log-probabilities of every position: one step prefills each sequence's first half, a
    second step runs the rest as a chunk on that cached half. Call with no request running: the steps write
    the first blocks of the cache directly, so the prefix cache forgets what they held."""
    runner, bs = llm.engine.runner, llm.engine.block_size
    if not llm.engine.pool.reset_prefix_cache():
        raise RuntimeError("teacher forcing needs an idle engine (a cached block is in use)")
    first, rest, start = [], [], 0
    for s in seqs:
        table = list(range(start, start + -(-len(s) // bs)))
        start += len(table)
        half = len(s) // 2
        first.append((s[:half], 0, table, half))
        rest.append((s[half:], half, table, len(s) - half))
    a, b = runner.forward_batch(first).float().cpu(), runner.forward_batch(rest).float().cpu()
    out, i, j = [], 0, 0
    for s in seqs:
        half = len(s) // 2
        out.append(torch.cat([a[i:i + half], b[j:j + len(s) - half]]).log_softmax(-1))
        i, j = i + half, j + len(s) - half
    return out


def engine_for(path: str, ref: Reference, dtype: torch.dtype, device: torch.device, enforce_eager: bool,
               kv_cache_dtype: str = "auto"):
    from engine import LLM
    tokens = sum(len(s) for s in ref.sequences())
    return LLM(path, dtype=str(dtype).removeprefix("torch."), device=device.type, enforce_eager=enforce_eager,
               max_num_seqs=8, num_kv_blocks=2 * (tokens // 16 + len(ref.prompts)) + 8,
               max_model_len=max(len(s) for s in ref.sequences()) + 16, kv_cache_dtype=kv_cache_dtype)


def compare_logprobs(name: str, llm, ref: Reference) -> Row:
    stats = _stats(engine_logprobs(llm, ref.sequences()), ref.logprobs, Tolerance(ref.tol_max))
    ok = stats.passed and stats.mean_abs <= ref.tol_mean
    hf = f" (transformers' own: {ref.hf_low.max_abs:.3g} / {ref.hf_low.mean_abs:.3g})" if ref.hf_low else ""
    result = (f"logprob err max {stats.max_abs:.3g}, mean {stats.mean_abs:.3g}{hf}; "
              f"tol {ref.tol_max:.3g} / {ref.tol_mean:.3g}")
    data = {**stats.as_dict(), "passed": ok, "tol_max": ref.tol_max, "tol_mean": ref.tol_mean,
            "tokens": sum(len(s) for s in ref.sequences()),
            "transformers_low_precision": ref.hf_low.as_dict() if ref.hf_low else None}
    return Row("models", f"{name} teacher-forced", result, PASS if ok else FAIL, data=data)


def compare_greedy(name: str, llm, ref: Reference, label: str) -> Row:
    """All prompts in one batch, greedy with top logprobs, each against its reference up to a near-tie."""
    from engine import SamplingParams
    n = len(ref.greedy[0].tokens)
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate(ref.prompts, params)
    gap = max(ref.tol_max, MAX_LOGPROB_GAP)
    c = GreedyBatch.compare(outs, ref.greedy, n, gap)
    data = {"prompts": len(outs), "new_tokens": n, "equal": c.equal, "near_ties": c.near_ties,
            "errors": c.errors, "max_gap": gap, "passed": not c.errors}
    return Row("models", f"{name} greedy, {label}", c.text, FAIL if c.errors else PASS, data=data)


def compare_quantized_kv(name: str, llm, ref: Reference, kv_cache_dtype: str,
                         fp32_same_cache: list[torch.Tensor] | None = None) -> Row:
    """A quantized cache: the fp32 run's mean error against the reference under KV_MEAN_TOL; on a GPU, the low
    dtype's run against that fp32 run (`fp32_same_cache`) within the teacher-forced tolerance; and a greedy batch
    that completes."""
    import math

    from engine import SamplingParams
    ours = engine_logprobs(llm, ref.sequences())
    tol = (GPU_KV_MEAN_TOL if fp32_same_cache is not None else KV_MEAN_TOL)[kv_cache_dtype]
    rounding = _stats(fp32_same_cache if fp32_same_cache is not None else ours, ref.logprobs, Tolerance(float("inf")))
    ok = rounding.passed and rounding.mean_abs <= tol                   # passed: no NaN
    result = f"fp32 with the cache: err mean {rounding.mean_abs:.3g} (tol {tol:g}), max {rounding.max_abs:.3g}"
    data = {"rounding": rounding.as_dict(), "kv_cache_dtype": kv_cache_dtype, "tol_mean": tol}
    if fp32_same_cache is not None:
        # a low-dtype K or V near a rounding boundary of the cache's format lands on the other code, so a position
        # may differ by what the rounding costs (at most rounding.max_abs) on top of the low dtype's own error
        tol_max = ref.tol_max + rounding.max_abs
        low = _stats(ours, fp32_same_cache, Tolerance(tol_max))
        ok = ok and low.passed and low.mean_abs <= ref.tol_mean
        result += (f"; low dtype vs it: max {low.max_abs:.3g}, mean {low.mean_abs:.3g} "
                   f"(tol {tol_max:.3g} / {ref.tol_mean:.3g})")
        data |= {"low_vs_fp32": low.as_dict(), "tol_max": tol_max, "tol_mean_low": ref.tol_mean,
                 "total": _stats(ours, ref.logprobs, Tolerance(float("inf"))).as_dict()}
    n = len(ref.greedy[0].tokens)
    outs = llm.generate(ref.prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=TOP_K))
    complete = all(len(o.token_ids) == n and all(math.isfinite(v) for lp in o.logprobs for v in lp.values())
                   for o in outs)
    agree = sum(a == b for o, want in zip(outs, ref.greedy) for a, b in zip(o.token_ids, want.tokens))
    ok = ok and complete
    result += f"; greedy {agree}/{n * len(outs)} tokens as the reference{'' if complete else ', INCOMPLETE'}"
    data |= {"greedy_complete": complete, "greedy_agreement": agree / (n * len(outs)), "passed": ok}
    return Row("models", f"{name} kv {kv_cache_dtype}", result, PASS if ok else FAIL, data=data)


# -- the part ---------------------------------------------------------------------------------------
def check_models(paths: dict[str, str], cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    device = torch.device("cpu" if cpu else "cuda")
    dtype = torch.float32 if cpu else torch.bfloat16
    lengths, new_tokens = (CPU_PROMPTS, CPU_NEW_TOKENS) if cpu else (GPU_PROMPTS, GPU_NEW_TOKENS)
    rows = []
    for name, path in paths.items():
        log(f"models: {name}: transformers reference")
        from engine.loader import load_config
        ref = hf_reference(path, random_prompts(load_config(path).vocab_size, lengths), new_tokens, dtype, device)
        for eager in (False, True):
            log(f"models: {name}: engine, enforce_eager={eager}")
            llm = engine_for(path, ref, dtype, device, enforce_eager=eager)
            if not eager:
                rows.append(compare_logprobs(name, llm, ref))
            rows.append(compare_greedy(name, llm, ref, f"enforce_eager={eager}"))
            del llm
            free_memory(device)
        if name == next(iter(paths)):
            for kv in KV_MEAN_TOL:
                fp32 = None
                if dtype != torch.float32:
                    log(f"models: {name}: engine in fp32, kv_cache_dtype={kv}")
                    llm = engine_for(path, ref, torch.float32, device, enforce_eager=False, kv_cache_dtype=kv)
                    fp32 = engine_logprobs(llm, ref.sequences())
                    del llm
                    free_memory(device)
                log(f"models: {name}: engine, kv_cache_dtype={kv}")
                llm = engine_for(path, ref, dtype, device, enforce_eager=False, kv_cache_dtype=kv)
                rows.append(compare_quantized_kv(name, llm, ref, kv, fp32))
                del llm
                free_memory(device)
    return rows
