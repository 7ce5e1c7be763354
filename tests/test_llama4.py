"""Llama 4 beyond greedy parity with transformers (tests/test_engine_hf.py) and TP (tests/test_tensor_parallel.py):
LoRA adapters of its attention and dense layers against PEFT's merged model, and what it refuses."""
from __future__ import annotations

import shutil

import pytest
import torch

from bench.models import make_lora_adapter, make_tiny_checkpoint
from engine import LLM, LoRAError, LoRARequest, SamplingParams
from engine.model import SparseMoE
from tests.greedy import TOP_K, baton_greedy, check_greedy_close, hf_greedy

PROMPTS = [list(range(10, 40)), [7, 8, 9] * 9, list(range(200, 217))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)


@pytest.fixture(scope="module")
def llama4(tmp_path_factory) -> str:
    """bench/models.py LLAMA4_TINY: layers 0 and 2 sparse, layer 1 dense (intermediate_size_mlp wide)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama4_text")


@pytest.mark.slow
def test_lora_adapts_attention_and_the_dense_layer_and_refuses_the_shared_expert(llama4, tmp_path):
    """An adapter of q/k/v/o (their rows permuted for the interleaved RoPE, as the weights are) and of the dense
    layer's MLP (PEFT's names under feed_forward, its own width): Baton under it gives transformers' tokens with it
    merged. An adapter of the sparse layers' shared expert is refused by name, and the engine goes on."""
    from peft import PeftModel
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    path = make_lora_adapter(llama4, tmp_path / "a", rank=4, seed=3, targets=(
        "q_proj", "k_proj", "v_proj", "o_proj", "layers.1.feed_forward.gate_proj", "layers.1.feed_forward.up_proj",
        "layers.1.feed_forward.down_proj"))
    names = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert any(".layers.1.feed_forward.up_proj." in n for n in names)
    layers = LLM(llama4, num_kv_blocks=16, max_model_len=128).engine.runner.model.model.layers
    assert isinstance(layers[0].mlp, SparseMoE) and not isinstance(layers[1].mlp, SparseMoE)
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama4, dtype=torch.float32),
                                       path).merge_and_unload().eval()
    want = hf_greedy(merged, PROMPTS, 16)
    llm = LLM(llama4, num_kv_blocks=64, max_model_len=256, enable_lora=True, max_loras=2)
    outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, path))
    for out, ref in zip(outs, want):
        check_greedy_close(baton_greedy(out), ref)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] != [o.token_ids for o in outs]

    shared = tmp_path / "shared"
    tensors = dict(names)
    tensors["base_model.model.model.layers.0.feed_forward.shared_expert.gate_proj.lora_A.weight"] = torch.zeros(4, 64)
    tensors["base_model.model.model.layers.0.feed_forward.shared_expert.gate_proj.lora_B.weight"] = torch.zeros(48, 4)
    shutil.copytree(path, shared)
    save_file(tensors, str(shared / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="not a LoRA weight of a supported module"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("shared", 2, str(shared)))
    again = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 1, path))
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
