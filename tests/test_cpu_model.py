"""The C++ decoder stack (engine/cpu_model.py) runs a packed model's layers with the same kernels and ATen ops as the
Python modules, so an engine gives the same bits either way: teacher-forced logits over a prefill and a cached
chunk, and greedy tokens with their logprobs, on the default model (fp32 and int8 KV caches), on a GGUF whose
fused q/k/v mixes three packed types beside biases (qwen2) or before q/k norms (qwen3), on int8 and fp8 weights, and
with LoRA adapters wrapping the linears (their products added by the same kernel). Where it does not apply (fp8 KV)
the modules run, and the text is the same."""
from __future__ import annotations

import pytest
import torch

from check.compare import baton_greedy, check_greedy_close
from check.models import engine_logprobs
from engine import LLM, SamplingParams, cpu_model
from tests.conftest import make_tiny_checkpoint
from tests.gguf_files import write_gguf

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
# every layer packed: a q/k/v of three kinds (three kernel calls, their outputs side by side), Q8_0 o_proj
ALL_PACKED = {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q8_0",
              "ffn_gate": "Q4_1", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q8_0"}

pytestmark = pytest.mark.skipif(not cpu_model.available(), reason="no C++ compiler: the kernels are not built")


def _set_stack(monkeypatch, on: bool) -> None:
    monkeypatch.setenv("BATON_CPU_STACK", "1" if on else "0")
    cpu_model.stack_enabled.cache_clear()


def _run(llm: LLM, seqs: list[list[int]]):
    logits = engine_logprobs(llm, seqs)
    llm.engine.pool.reset_prefix_cache()
    outs = llm.generate(seqs, PARAMS)
    return logits, [(o.token_ids, o.logprobs) for o in outs]


@pytest.fixture
def stack_switch(monkeypatch):
    yield lambda on: _set_stack(monkeypatch, on)
    monkeypatch.undo()
    cpu_model.stack_enabled.cache_clear()


@pytest.mark.parametrize("case", ["smollm2", "smollm2 kv-int8", "qwen2 gguf mixed", "qwen3 gguf mixed", "llama int8",
                                  "llama fp8", "mistral int8", "gemma2 int8", "gemma3_text int8", "granite int8",
                                  "smollm3 int8"])
def test_the_stack_gives_the_module_forwards_bits(case, tmp_path, stack_switch):
    if case.startswith("smollm2"):
        llm = LLM(None, kv_cache_memory=64 << 20, max_model_len=512,
                  kv_cache_dtype="int8" if "int8" in case else "auto")
    elif case.startswith("qwen"):               # qwen3: its q/k norms, and a head_dim (32) apart from hidden / heads
        arch = case.split()[0]
        llm = LLM(str(write_gguf(tmp_path / "q.gguf", ALL_PACKED, arch=arch, hidden=256, intermediate=512,
                                 head_dim=32 if arch == "qwen3" else None)), num_kv_blocks=64, max_model_len=512)
    elif case.startswith("mistral"):            # a sliding window of 12 tokens: each layer passes it to the kernel
        llm = LLM(make_tiny_checkpoint(tmp_path, "mistral", sliding_window=12), quantization="int8", num_kv_blocks=64)
    elif case.startswith("gemma"):              # windows of 8, softcaps, output norms, GELU; Gemma 3's two RoPEs
        llm = LLM(make_tiny_checkpoint(tmp_path, case.split()[0]), quantization="int8", num_kv_blocks=64)
    elif case.startswith("granite"):            # its residual multiplier (the others act outside the stack)
        llm = LLM(make_tiny_checkpoint(tmp_path, "granite", embedding_multiplier=12.0, residual_multiplier=0.22,
                                       attention_multiplier=0.0078125, logits_scaling=8.0),
                  quantization="int8", num_kv_blocks=64)
    elif case.startswith("smollm3"):            # a NoPE layer: its RoPE table rotates by nothing
        llm = LLM(make_tiny_checkpoint(tmp_path, "smollm3", no_rope_layers=[1, 0, 1]), quantization="int8",
                  num_kv_blocks=64)
    else:
        llm = LLM(make_tiny_checkpoint(tmp_path, "llama"), quantization=case.split()[1], num_kv_blocks=64)
    g = torch.Generator().manual_seed(1)
    vocab = min(llm.engine.hf_config.vocab_size, 30000)
    seqs = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 30, 53)]
    stack_switch(True)
    stacked = _run(llm, seqs)
    assert llm.engine.runner.model._stack, "the stack did not run"
    stack_switch(False)
    modules = _run(llm, seqs)
    for a, b in zip(stacked[0], modules[0]):
        assert torch.equal(a, b)
    assert stacked[1] == modules[1]


def test_with_lora_adapters_the_stack_gives_the_module_forwards_bits(smol_path, tmp_path, stack_switch):
    """Adapters wrap the packed linears; the stack adds their products with the same kernel, after the same linear,
    so a step mixing two adapters and the base model gives the modules' tokens and logprobs, and each adapter's
    rows differ from the base model's (the products were applied)."""
    from bench.models import make_lora_adapter
    from engine import LoRARequest
    loras = [LoRARequest(f"a{i}", i + 1, make_lora_adapter(smol_path, tmp_path / f"a{i}", rank=8, seed=i + 1,
                                                           scale=0.5)) for i in range(2)]
    llm = LLM(None, kv_cache_memory=64 << 20, max_model_len=512, enable_lora=True, max_loras=2, max_lora_rank=8)
    prompt = list(range(100, 140))
    seqs, reqs = [prompt, prompt, prompt, list(range(200, 221))], [loras[0], None, loras[1], loras[0]]

    def run():
        llm.engine.pool.reset_prefix_cache()
        return [(o.token_ids, o.logprobs) for o in llm.generate(seqs, PARAMS, lora_request=reqs)]
    stack_switch(True)
    stacked = run()
    assert llm.engine.runner.model._stack, "the stack did not run"
    stack_switch(False)
    assert run() == stacked
    base = stacked[1][1]
    assert stacked[0][1] != base and stacked[2][1] != base and stacked[0][1] != stacked[2][1]
    base_llm = LLM(None, kv_cache_memory=64 << 20, max_model_len=512)
    assert [o.token_ids for o in base_llm.generate([prompt], PARAMS)] == [stacked[1][0]]   # a base row: the base text


def test_where_the_stack_does_not_apply_the_modules_run_the_same_text(tmp_path):
    seqs = [list(range(100, 140))]
    base = LLM(None, kv_cache_memory=64 << 20, max_model_len=512)
    want = base.generate(seqs, PARAMS)
    assert base.engine.runner.model._stack
    fp8 = LLM(None, kv_cache_memory=64 << 20, max_model_len=512, kv_cache_dtype="fp8")
    got = fp8.generate(seqs, PARAMS)
    assert fp8.engine.runner.model.cpu_stack(torch.zeros(1, 1), fp8.engine.runner.kv_layers) is None
    for ours, base_out in zip(got, want):     # an e4m3 cache's rounding: a near-tie of tests/test_kv_quant.py's width
        check_greedy_close(baton_greedy(ours), baton_greedy(base_out), max_gap=0.6)


def test_a_model_off_the_cpu_fp32_path_never_asks_for_the_extension(tmp_path, monkeypatch):
    """The C++ extension compiles on a machine's first use (~30 s) and serves CPU fp32 models only. A bf16 model (a
    GPU's dtype) runs without asking for it: on an H200 the first CUDA engine spent 36 s compiling it for nothing."""
    def refuse():
        raise AssertionError("the CPU extension was asked for")
    monkeypatch.setattr(cpu_model, "kernels", refuse)
    cpu_model.available.cache_clear()                         # answered once per process: ask again
    llm = LLM(make_tiny_checkpoint(tmp_path, "llama"), dtype="bfloat16", num_kv_blocks=64)
    out = llm.generate([list(range(5, 25))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    monkeypatch.undo()
    cpu_model.available.cache_clear()
