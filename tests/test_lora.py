"""Multi-LoRA in the engine: adapters PEFT saved, served beside the base model in mixed batches.

Greedy tokens equal transformers + PEFT for every adapter, alone and in one batch mixing four adapters
and the base; adapters never share KV; slots and the host cache evict and reload without changing a
token; a bad adapter fails its own request and nothing else. Tiny random Llama (fp32 CPU), and SmolLM2.
"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from bench.models import make_lora_adapter, make_tiny_checkpoint
from engine import LLM, ConfigError, EngineConfig, InvalidRequestError, LoRAError, LoRARequest, SamplingParams
from engine.block_hash import block_hashes, namespace_key
from engine.loader import resolve_model

PROMPTS = [list(range(10, 40)), list(range(100, 150)), [7, 8, 9] * 9, list(range(200, 217))]
N = 16
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
# (rank, targets, rslora): full, attention only, MLP only, q/v with rsLoRA
ADAPTERS = {"full": (8, None, False), "attn": (4, ("q_proj", "k_proj", "v_proj", "o_proj"), False),
            "mlp": (6, ("gate_proj", "up_proj", "down_proj"), False), "qv": (3, ("q_proj", "v_proj"), True)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(root / "base", "llama")
    paths = {}
    for i, (name, (rank, targets, rslora)) in enumerate(ADAPTERS.items()):
        kw = {"targets": targets} if targets else {}
        paths[name] = make_lora_adapter(base, root / name, rank=rank, seed=i + 1, use_rslora=rslora, **kw)
    return {"base": base, "adapters": paths, "root": root}


def peft_greedy(base: str, adapter: str | None, prompt: list[int], n: int = N) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.eval().generate(input_ids=torch.tensor([prompt]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def lora_llm(base: str, **kw) -> LLM:
    kw = {"num_kv_blocks": 96, "max_model_len": 256, "enable_lora": True, "max_loras": 4, **kw}
    return LLM(base, tokenizer=resolve_model(None), **kw)


def req(tiny, name: str) -> LoRARequest:
    return LoRARequest(name, list(ADAPTERS).index(name) + 1, tiny["adapters"][name])


def assert_no_leak(llm: LLM) -> None:
    e = llm.engine
    assert e.pool.num_free_blocks == e.pool.num_blocks and not e.kv.pinned and not e.requests


@pytest.fixture(scope="module")
def reference(tiny) -> dict:
    """transformers + PEFT greedy tokens: (adapter or None, prompt index) -> tokens."""
    out = {}
    for name in [None, *ADAPTERS]:
        path = None if name is None else tiny["adapters"][name]
        for i, p in enumerate(PROMPTS):
            out[name, i] = peft_greedy(tiny["base"], path, p)
    return out


def test_each_adapter_alone_matches_peft_and_changes_the_output(tiny, reference):
    llm = lora_llm(tiny["base"])
    for name in ADAPTERS:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=req(tiny, name))
        for i, o in enumerate(outs):
            assert o.token_ids == reference[name, i], (name, i)
        assert any(reference[name, i] != reference[None, i] for i in range(len(PROMPTS))), name
    assert_no_leak(llm)


def test_an_engine_with_adapters_beside_a_plain_engine_of_its_base_changes_only_its_own_tokens(tiny, reference):
    """Both engines share the base's weights (engine/model_runner.py); the adapters wrap only their engine's."""
    plain = LLM(tiny["base"], tokenizer=resolve_model(None), num_kv_blocks=96, max_model_len=256)
    llm = lora_llm(tiny["base"])
    shared = {p.data_ptr() for p in plain.engine.runner.model.parameters()}
    assert shared <= {p.data_ptr() for p in llm.engine.runner.model.parameters()}, "one copy of the base"
    adapted = llm.generate(PROMPTS, GREEDY, lora_request=req(tiny, "full"))
    base = plain.generate(PROMPTS, GREEDY)
    for i, (a, b) in enumerate(zip(adapted, base)):
        assert a.token_ids == reference["full", i] and b.token_ids == reference[None, i], i


def test_a_batch_mixing_four_adapters_and_the_base_matches_peft(tiny, reference):
    """Every request of one batch runs under its own adapter (or none), in the same steps."""
    llm = lora_llm(tiny["base"], max_num_batched_tokens=64)     # prefill chunks mixed with decodes
    names = [None, *ADAPTERS]
    cases = [(n, i) for i in range(len(PROMPTS)) for n in names]
    outs = llm.generate([PROMPTS[i] for _, i in cases], GREEDY,
                        lora_request=[None if n is None else req(tiny, n) for n, _ in cases])
    for (n, i), o in zip(cases, outs):
        assert o.token_ids == reference[n, i], (n, i)
    held = llm.engine.stats()["lora_adapters"].values()
    assert sorted(name for name, in_slot in held if in_slot) == sorted(ADAPTERS)
    assert_no_leak(llm)


def test_fewer_slots_than_adapters_queue_requests_not_change_them(tiny, reference):
    """max_loras 2 with four adapters in flight: a step never holds more than two (the scheduler defers
    the rest), slots are evicted and reloaded, the host cache (max_cpu_loras 2) drops and rereads idle
    adapters, and every token is what a roomy engine gives."""
    llm = lora_llm(tiny["base"], max_loras=2, max_cpu_loras=2)
    seen = []
    runner = llm.engine.runner
    step = runner.lora.prepare_step

    def spy(keys, qlens):
        seen.append({k for k in keys if k is not None})
        return step(keys, qlens)
    runner.lora.prepare_step = spy
    names = list(ADAPTERS) * 2
    outs = llm.generate([PROMPTS[i % 4] for i in range(len(names))], GREEDY,
                        lora_request=[req(tiny, n) for n in names])
    for i, (n, o) in enumerate(zip(names, outs)):
        assert o.token_ids == reference[n, i % 4], (n, i)
    assert max(len(s) for s in seen) == 2
    assert runner.lora.loads >= 4 and runner.lora.evictions >= 2      # four adapters through two slots
    assert len(runner.lora.cache) <= 2
    llm.generate(PROMPTS[:1], GREEDY, lora_request=req(tiny, "full"))      # reread from disk: same tokens
    assert_no_leak(llm)


def test_adapters_never_share_kv(tiny):
    """The same prompt under the base, adapter A and adapter B: no cache hit across them; again under A:
    a hit. The KV events' hashes are the adapter's own chain (what the router recomputes)."""
    events = []
    from engine import LLMEngine
    e = LLMEngine(EngineConfig(tiny["base"], tokenizer=resolve_model(None), num_kv_blocks=96, max_model_len=256,
                               enable_lora=True, max_loras=2), on_kv_event=events.append)
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = e, e.tokenizer
    prompt = PROMPTS[1]
    one = SamplingParams(max_tokens=1, temperature=0)
    for lora in (None, req(tiny, "full"), req(tiny, "attn")):
        assert llm.generate(prompt, one, lora_request=lora)[0].metrics.num_cached_tokens == 0
    again = llm.generate(prompt, one, lora_request=req(tiny, "full"))[0]
    assert again.metrics.num_cached_tokens == 48
    stored = {h for ev in events for h in getattr(ev, "block_hashes", [])}
    key = e.model_key
    for lora in (None, req(tiny, "full"), req(tiny, "attn")):
        chain = block_hashes(prompt, e.block_size, namespace_key(key, lora and lora.key))
        assert set(chain) <= stored
    base, full = (set(block_hashes(prompt, e.block_size, namespace_key(key, k))) for k in (None, req(tiny, "full").key))
    assert not base & full


def test_the_adapter_key_is_its_content(tiny, tmp_path):
    """A copy under another name and path is the same adapter (same KV namespace); a changed file is not."""
    copy = shutil.copytree(tiny["adapters"]["full"], tmp_path / "copy")
    assert LoRARequest("other", 9, str(copy)).key == req(tiny, "full").key
    cfg = json.loads((copy / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] * 2
    (copy / "adapter_config.json").write_text(json.dumps(cfg))
    assert LoRARequest("other", 9, str(copy)).key != req(tiny, "full").key


def bad_adapters(tiny, tmp_path) -> dict[str, tuple[str, str]]:
    """name -> (path, what the error must say)."""
    good = tiny["adapters"]["full"]
    out = {"missing": (str(tmp_path / "nowhere"), "not a directory")}

    def variant(name, edit_cfg=None, weights=None):
        d = shutil.copytree(good, tmp_path / name)
        if edit_cfg is not None:
            cfg = json.loads((d / "adapter_config.json").read_text())
            edit_cfg(cfg)
            (d / "adapter_config.json").write_text(json.dumps(cfg))
        if weights is not None:
            (d / "adapter_model.safetensors").write_bytes(weights)
        return str(d)
    out["bad json"] = (variant("badjson"), "not valid JSON")
    (tmp_path / "badjson" / "adapter_config.json").write_text("{not json")
    out["dora"] = (variant("dora", lambda c: c.update(use_dora=True)), "DoRA")
    out["truncated"] = (variant("trunc", weights=b"\x00" * 10), "cannot read")
    out["no weights"] = (variant("nowt"), "adapter_model")
    os.remove(tmp_path / "nowt" / "adapter_model.safetensors")
    big = make_lora_adapter(tiny["base"], tmp_path / "big", rank=32, seed=5)
    out["rank"] = (big, "max_lora_rank")
    other = make_tiny_checkpoint(tmp_path / "otherbase", "llama", hidden_size=32, intermediate_size=96)
    out["other base"] = (make_lora_adapter(other, tmp_path / "otherlora", rank=4), "another base model")
    out["lm_head"] = (make_lora_adapter(tiny["base"], tmp_path / "head", rank=4, targets=("lm_head",)),
                      "supported module")
    return out


def test_a_bad_adapter_fails_its_request_alone(tiny, tmp_path, reference):
    llm = lora_llm(tiny["base"], max_lora_rank=16)
    e = llm.engine
    running = e.add_request(PROMPTS[0], GREEDY, lora_request=req(tiny, "full"))
    e.step()
    for what, (path, says) in bad_adapters(tiny, tmp_path).items():
        with pytest.raises(LoRAError, match=says):
            e.add_request(PROMPTS[1], GREEDY, lora_request=LoRARequest(what, 99, path))
        assert isinstance(LoRAError("x"), InvalidRequestError)
    got = []
    while e.has_unfinished_requests():
        got += [o for o in e.step() if o.finished]
    assert [o.request_id for o in got] == [running] and got[0].token_ids == reference["full", 0]
    assert e.runner.lora.cache[req(tiny, "full").key].refs == 0
    assert_no_leak(llm)


def test_rank_and_alpha_patterns_shape_their_modules_as_peft_does(tiny, tmp_path):
    """PEFT's per-module rank_pattern and alpha_pattern (regexes on module names; it writes them itself for a
    Qwen3-MoE's experts): each module's scaling is its own alpha over its own rank."""
    patterns = {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 64, r"layers\.1\.mlp\.down_proj": 1}}
    path = make_lora_adapter(tiny["base"], tmp_path / "patterns", rank=4, seed=9, **patterns)
    cfg = json.loads((tmp_path / "patterns" / "adapter_config.json").read_text())
    assert {k: cfg[k] for k in patterns} == patterns
    want = [peft_greedy(tiny["base"], path, p) for p in PROMPTS]
    flat = tmp_path / "flat"                          # the same weights read with one alpha: other tokens
    shutil.copytree(path, flat)
    (flat / "adapter_config.json").write_text(json.dumps({**cfg, "alpha_pattern": {}}))
    assert [peft_greedy(tiny["base"], str(flat), p) for p in PROMPTS] != want
    llm = lora_llm(tiny["base"])
    got = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("patterns", 1, path))
    assert [o.token_ids for o in got] == want
    (flat / "adapter_config.json").write_text(json.dumps({**cfg, "alpha_pattern": {"q_proj": -1}}))
    with pytest.raises(LoRAError, match="alpha_pattern must map module patterns to positive numbers"):
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("bad", 2, str(flat)))
    assert_no_leak(llm)


def test_lora_needs_enable_lora_and_max_cpu_loras_of_at_least_max_loras(tiny):
    llm = LLM(tiny["base"], tokenizer=resolve_model(None), num_kv_blocks=32, max_model_len=128)
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=req(tiny, "full"))
    EngineConfig(tiny["base"], enable_lora=True, tensor_parallel_size=2)      # tests/test_tensor_parallel.py
    with pytest.raises(ConfigError, match="max_cpu_loras"):
        EngineConfig(tiny["base"], enable_lora=True, max_loras=4, max_cpu_loras=2)


def test_speculation_under_an_adapter_keeps_its_tokens(tiny, reference):
    """n-gram drafts verified by the adapted model: the greedy tokens are the adapter's, exactly."""
    llm = lora_llm(tiny["base"], speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "adaptive": False})
    names = ["full", None, "qv", "mlp"]
    outs = llm.generate(PROMPTS, GREEDY, lora_request=[n and req(tiny, n) for n in names])
    for i, (n, o) in enumerate(zip(names, outs)):
        assert o.token_ids == reference[n, i], (n, i)
    assert_no_leak(llm)


@pytest.mark.slow
def test_smollm2_adapters_match_peft(smol_path, tmp_path):
    """SmolLM2-135M with two adapters PEFT saved: greedy tokens equal transformers + PEFT (a near-tie allowed at
    the first difference, fp32), batched with each other and the base; and the adapters change the text."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from tests.greedy import TOP_K, baton_greedy, check_greedy_close, hf_greedy
    paths = {"a": make_lora_adapter(smol_path, tmp_path / "a", rank=16, seed=3, scale=0.5),
             "b": make_lora_adapter(smol_path, tmp_path / "b", rank=8, seed=4, scale=0.5,
                                    targets=("q_proj", "v_proj", "down_proj"))}
    llm = LLM(smol_path, kv_cache_memory=128 << 20, max_model_len=512, enable_lora=True, max_loras=2)
    prompts = [llm.engine.tokenize(t) for t in ("The capital of Germany is", "def fibonacci(n):")]
    names = ["a", "b", None]
    cases = [(n, p) for p in prompts for n in names]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=TOP_K)
    outs = llm.generate([p for _, p in cases], params,
                        lora_request=[None if n is None else LoRARequest(n, 1, paths[n]) for n, _ in cases])
    for name in names:
        model = AutoModelForCausalLM.from_pretrained(smol_path, dtype=torch.float32)
        model = (model if name is None else PeftModel.from_pretrained(model, paths[name])).eval()
        refs = hf_greedy(model, prompts, 24)
        for (n, p), o in zip(cases, outs):
            if n == name:
                check_greedy_close(baton_greedy(o), refs[prompts.index(p)])
    for i in range(len(prompts)):
        base = outs[3 * i + 2].token_ids
        assert outs[3 * i].token_ids != base and outs[3 * i + 1].token_ids != base


def test_without_a_compiler_the_float64_torch_path_gives_the_same_tokens(tiny, reference, monkeypatch):
    """No C++ kernel (no compiler, or BATON_CPU_KERNEL=0): the wrapped Linears keep float64 stacks and the torch
    path runs; the tokens are PEFT's as before, mixed batch included."""
    from engine import lora_ops
    monkeypatch.setattr(lora_ops, "cpu_kernel", lambda: None)
    llm = lora_llm(tiny["base"], max_num_batched_tokens=64)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.layout == "parts"
    names = ([None, *ADAPTERS] * 2)[:8]
    outs = llm.generate(PROMPTS * 2, GREEDY, lora_request=[n and req(tiny, n) for n in names])
    for i, (n, o) in enumerate(zip(names, outs)):
        assert o.token_ids == reference[n, i % 4], (n, i)


@pytest.mark.parametrize("kind, extra, kw", [
    ("phi3", {"partial_rotary_factor": 0.5},
     {"targets": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), "alpha_pattern": {"gate_up_proj": 2}}),
    ("gemma2", {}, {}),
    ("olmo2", {}, {}),
    ("glm4", {"head_dim": 16}, {"targets": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")})])
def test_adapters_of_other_families_match_peft(tmp_path, kind, extra, kw):
    """An adapter PEFT saved, beside the base model's rows in one batch, gives PEFT's tokens for both.
    - Phi-3 holds q/k/v and gate/up fused, and PEFT's adapters of it target qkv_proj and gate_up_proj: one A for the
      parts and one B over their rows. Each runs as its parts' adapters (that A, its rows of B), with the fused
      module's alpha from alpha_pattern (looked up under the part's name, the test fails).
    - Gemma 2's layers (sliding windows, softcaps, its norms and GELU gate) under an adapter of every linear.
    - OLMo 2's (norms after each sublayer, q/k norms over all heads) likewise.
    - GLM-4's q and k rows, which the engine permutes for its RoPE pairs: the adapter's B rows are permuted alike;
      its fused gate_up_proj too."""
    base = make_tiny_checkpoint(tmp_path / kind, kind, **extra)
    path = make_lora_adapter(base, tmp_path / "a", rank=4, seed=3, **kw)
    want = [peft_greedy(base, path, p) for p in PROMPTS[:2]]
    plain = [peft_greedy(base, None, p) for p in PROMPTS[:2]]
    assert want != plain
    llm = LLM(base, num_kv_blocks=96, max_model_len=256, enable_lora=True, max_loras=2)
    got = llm.generate(PROMPTS[:2] * 2, GREEDY, lora_request=[LoRARequest("a", 1, path)] * 2 + [None] * 2)
    assert [o.token_ids for o in got] == want + plain
    assert_no_leak(llm)
