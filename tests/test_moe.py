"""Mixture-of-experts models (Mixtral, Qwen3-MoE) beyond greedy parity (tests/test_engine_hf.py) and TP
(tests/test_tensor_parallel.py): experts packed by quantization at load, what they refuse, by name, and LoRA
adapters of their attention."""
from __future__ import annotations

import shutil

import pytest
import torch

from bench.models import make_lora_adapter, make_tiny_checkpoint
from engine import LLM, LoRAError, LoRARequest, SamplingParams
from engine.errors import ModelLoadError
from check.models import engine_logprobs
from engine.model import QuantLinear, SparseMoE
from tests.greedy import TOP_K, baton_greedy, check_greedy_close, hf_greedy

PROMPTS = [list(range(10, 40)), [7, 8, 9] * 9, list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    """Qwen3-MoE, 3 layers: 0 and 2 sparse (4 experts, top 2), 1 dense (mlp_only_layers)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3moe"), "qwen3_moe", mlp_only_layers=[1])


def engine(path: str, **kw) -> LLM:
    return LLM(path, **{"num_kv_blocks": 64, "max_model_len": 256, **kw})


def test_the_layers_are_sparse_where_the_config_says_and_each_expert_is_read_once_a_step(moe):
    llm = engine(moe)
    layers = llm.engine.runner.model.model.layers
    assert [isinstance(la.mlp, SparseMoE) for la in layers] == [True, False, True]
    moe0 = layers[0].mlp
    calls = []
    real = torch.nn.functional.linear

    def counting(x, w, b=None):
        if w.dim() == 2 and w.shape[0] == 2 * moe0.intermediate:
            calls.append(x.shape[0])
        return real(x, w, b)
    torch.nn.functional.linear = counting
    try:
        moe0(torch.randn(40, 64))
    finally:
        torch.nn.functional.linear = real
    # 40 tokens x top 2 = 80 (token, expert) pairs over at most 4 experts: one gate/up product per expert hit
    assert 1 <= len(calls) <= 4 and sum(calls) == 80


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_quantization_at_load_packs_every_expert_and_keeps_the_router(moe, method):
    ref, q = engine(moe), engine(moe, quantization=method)
    layer = q.engine.runner.model.model.layers[0]
    assert sorted(layer.mlp.packed) == ["down_proj", "gate_up_proj"] and len(layer.mlp.packed["down_proj"]) == 4
    assert all(isinstance(m, QuantLinear) for ms in layer.mlp.packed.values() for m in ms)
    assert not isinstance(layer.mlp.gate, QuantLinear) and not hasattr(layer.mlp.experts, "gate_up_proj")
    assert q.engine.runner.weight_bytes < 0.6 * ref.engine.runner.weight_bytes
    # a position whose top-2 experts sit near a tie may take another under rounding and move far (measured: int8
    # up to 3 nats at one position of 74, where a dense model's worst is 0.2); the median position may not (int8
    # 0.2, fp8 0.7; with one layer's experts shifted by one, 5.4)
    median, scale = median_position_error(q, ref)
    assert median < 0.1 * scale
    alone = [q.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in q.generate(PROMPTS, GREEDY)] == alone       # batched equals alone, exactly


def median_position_error(q: LLM, ref: LLM) -> tuple[float, float]:
    """(median over positions of the largest log-probability error, the reference's largest |log-probability|)."""
    want = engine_logprobs(ref, PROMPTS)
    errors = torch.cat([(o - w).abs().amax(-1) for o, w in zip(engine_logprobs(q, PROMPTS), want)])
    return float(errors.median()), max(float(w.abs().max()) for w in want)


@pytest.mark.parametrize("method", ["gptq", "awq", "fp8", "ct-w8a16"])
def test_quantized_checkpoints_load_their_experts_packed(tmp_path, method):
    """GPTQ, AWQ, FP8 and compressed-tensors checkpoints of a mixture of experts (each expert's projections
    quantized, the router not): the experts load packed; dequantized at load they are exactly the float weights
    they stand for."""
    from check.quant import write_quantized
    src = make_tiny_checkpoint(tmp_path / "float", "qwen3_moe", moe_intermediate_size=64)   # K of down: groups of 32
    path, ref_path = write_quantized(src, tmp_path / method, method)
    ref, q, dense = engine(ref_path), engine(path), engine(path, quantization="none")
    layer = q.engine.runner.model.model.layers[0]
    assert sorted(layer.mlp.packed) == ["down_proj", "gate_up_proj"] and not isinstance(layer.mlp.gate, QuantLinear)
    for dq, want in zip(engine_logprobs(dense, PROMPTS), engine_logprobs(ref, PROMPTS)):
        torch.testing.assert_close(dq, want, atol=1e-4, rtol=1e-4)
    median, scale = median_position_error(q, ref)
    assert median < 0.1 * scale


def test_a_checkpoint_missing_an_expert_is_refused(moe, tmp_path):
    from safetensors.torch import load_file, save_file
    bad = tmp_path / "bad"
    shutil.copytree(moe, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing 1 tensors.*experts.3.up_proj"):
        engine(str(bad))
    tensors["model.layers.2.mlp.experts.3.up_proj.weight"] = torch.zeros(48, 64)
    tensors["model.layers.2.mlp.experts.4.up_proj.weight"] = torch.zeros(48, 64)     # a fifth expert of four
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="experts.4.up_proj.weight' has no place"):
        engine(str(bad))


def test_lora_adapts_attention_and_refuses_adapters_of_experts(moe, tmp_path):
    """An adapter of q/k/v/o: Baton under it gives transformers' tokens with it merged. Adapters of experts are
    refused by name, and the engine goes on: PEFT's of the stacked experts (its target_parameters, what it makes
    of gate/up/down on transformers 5), and one of a sparse layer's MLP as a dense one."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    attention = make_lora_adapter(moe, tmp_path / "attention", rank=4, seed=3,
                                  targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    base = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, attention).merge_and_unload().eval()
    want = hf_greedy(merged, PROMPTS, 16)
    llm = engine(moe, enable_lora=True, max_loras=2)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, attention))
    for out, ref in zip(outs, want):
        check_greedy_close(baton_greedy(out), ref)
    plain = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in plain] != [o.token_ids for o in outs]          # the adapter does change them

    experts = make_lora_adapter(moe, tmp_path / "experts", rank=4, seed=4)     # every target: the experts too
    assert any(".mlp.experts." in n for n in load_file(str(tmp_path / "experts" / "adapter_model.safetensors")))
    dense_named = tmp_path / "dense-named"
    shutil.copytree(attention, dense_named)
    tensors = load_file(str(dense_named / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"] = torch.zeros(48, 4)
    save_file(tensors, str(dense_named / "adapter_model.safetensors"))
    for i, (path, says) in enumerate([(experts, "adapts the experts of a mixture-of-experts layer"),
                                      (dense_named, "layer 0's MLP, a mixture of experts")]):
        with pytest.raises(LoRAError, match=says):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest(f"bad{i}", 2 + i, str(path)))
    again = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, attention))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    e = llm.engine
    assert e.pool.num_free_blocks == e.pool.num_blocks


def test_no_cuda_graphs_are_planned_for_experts(moe, tmp_path):
    """The experts' token counts cross to the host each layer: a graph could not replay them."""
    dense = make_tiny_checkpoint(tmp_path / "dense", "qwen3")
    assert engine(moe).engine.runner.graph_plan() == []
    assert engine(dense).engine.runner.graph_plan() != []


def test_gpt_oss_mxfp4_checkpoints_load_as_transformers_loads_them(tmp_path):
    """The released gpt-oss holds its experts in MXFP4 (4-bit e2m1 codes and a power of two per 32 values): they load
    dequantized, to transformers' own greedy tokens on the same file (its dequantizing load on CPU), and those
    differ from the float checkpoint's (the quantization was applied)."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    from bench.models import mxfp4_experts
    path = make_tiny_checkpoint(tmp_path / "float", "gpt_oss")
    floats = engine(path).generate(PROMPTS, GREEDY)
    mx = shutil.copytree(path, tmp_path / "mxfp4")
    mxfp4_experts(mx)
    hf = AutoModelForCausalLM.from_pretrained(mx, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    want = hf_greedy(hf, PROMPTS, 16)
    got = engine(str(mx)).generate(PROMPTS, GREEDY)
    for out, ref in zip(got, want):
        check_greedy_close(baton_greedy(out), ref)
    assert [o.token_ids for o in got] != [o.token_ids for o in floats]


def test_gpt_oss_experts_quantized_at_load_keep_their_biases(tmp_path):
    """quantization="int8" packs gpt-oss's experts; their biases and gate stay as they were: the median position's
    log-probabilities within the MoE bound of the float model's."""
    path = make_tiny_checkpoint(tmp_path, "gpt_oss")
    ref, q = engine(path), engine(path, quantization="int8")
    assert sorted(q.engine.runner.model.model.layers[0].mlp.packed) == ["down_proj", "gate_up_proj"]
    median, scale = median_position_error(q, ref)
    assert median < 0.1 * scale
