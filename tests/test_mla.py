"""DeepSeek-V2/V3's multi-head latent attention (engine/model.py MLAAttention) beyond greedy parity with transformers
(tests/test_engine_hf.py) and TP (tests/test_tensor_parallel.py): the latent cache's size, a quantized latent
cache, weights quantized at load, the hand-off of latent blocks over NIXL, a checkpoint's multi-token prediction
layers, and what it refuses."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.models import make_tiny_checkpoint
from check.models import engine_logprobs
from engine import LLM, EngineConfig, LLMEngine, RemotePrefill, SamplingParams
from engine.block_hash import block_hashes
from engine.errors import ConfigError
from engine.model import MLAAttention, QuantLinear
from tests.greedy import TOP_K, baton_greedy, check_greedy_close
from tests.test_kvtransfer_engines import _finish, _prefix_links

PROMPTS = [list(range(10, 40)), [7, 8, 9] * 9, list(range(200, 237))]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> str:
    """DeepSeek-V3, 3 layers (the first dense): 4 heads of q/k 24 + 16 rotated dims and values of 20 over a latent
    of 32 (bench/models.py DEEPSEEK_TINY)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v3"), "deepseek_v3")


def engine(path: str, **kw) -> LLM:
    return LLM(path, **{"block_size": 8, "num_kv_blocks": 64, "max_model_len": 256, **kw})


def test_the_latent_cache_keeps_one_vector_a_token_and_layer(v3):
    """A block holds, per token and layer, the latent (32) and the rotated key part (16): once, not as a key and a
    value, and not per head (each head's key and value would take 4 x (40 + 20))."""
    llm = engine(v3)
    runner, cfg = llm.engine.runner, llm.engine.hf_config
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert (runner.kv_spec.num_kv_heads, runner.kv_spec.head_dim, runner.kv_spec.kv_parts) == (1, latent, 1)
    assert runner.block_bytes == cfg.num_hidden_layers * 8 * latent * 4
    per_head = cfg.num_hidden_layers * 8 * cfg.num_attention_heads * (
        cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim) * 4
    assert per_head == 5 * runner.block_bytes
    layer = runner.kv_layers[0]
    assert layer.k.data_ptr() == layer.v.data_ptr() and layer.k.shape[1:] == (8, 1, latent)
    assert "kv1x48:latent" in llm.engine.compat_key()
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == alone          # batched equals alone, exactly
    again = llm.generate([PROMPTS[2]], GREEDY)[0]                                    # from the prefix cache
    assert again.metrics.num_cached_tokens == 32 and again.token_ids == alone[2]
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_a_quantized_latent_cache_stays_close_to_fp32(v3, kv_cache_dtype):
    """One byte a value and a scale a token: a quarter of the block's bytes (and the scales); log-probabilities
    within a small distance of the fp32 cache's, and batched equals alone exactly (no prefix hits)."""
    ref, q = engine(v3), engine(v3, kv_cache_dtype=kv_cache_dtype)
    assert q.engine.runner.kv_spec.kv_parts == 1
    assert q.engine.runner.block_bytes < 0.4 * ref.engine.runner.block_bytes
    want = engine_logprobs(ref, PROMPTS)
    errors = torch.cat([(o - w).abs().amax(-1) for o, w in zip(engine_logprobs(q, PROMPTS), want)])
    assert float(errors.median()) < 0.05 * max(float(w.abs().max()) for w in want)
    alone = [q.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
    q.engine.pool.reset_prefix_cache()     # a prefix hit reads its prompt's K quantized, a whole prompt not (as vLLM)
    assert [o.token_ids for o in q.generate(PROMPTS, GREEDY)] == alone


def test_weights_quantized_at_load_keep_kv_b_proj_in_floats(v3):
    """quantization="int8": every projection packed but kv_b_proj, which MLA reads as a weight (absorbed into the
    query and the output); the experts packed too."""
    ref, q = engine(v3), engine(v3, quantization="int8")
    attn = q.engine.runner.model.model.layers[1].self_attn
    assert isinstance(attn, MLAAttention) and isinstance(attn.kv_b_proj, torch.nn.Linear)
    assert all(isinstance(m, QuantLinear) for m in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa))
    assert sorted(q.engine.runner.model.model.layers[1].mlp.packed) == ["down_proj", "gate_up_proj"]
    want = engine_logprobs(ref, PROMPTS)
    errors = torch.cat([(o - w).abs().amax(-1) for o, w in zip(engine_logprobs(q, PROMPTS), want)])
    assert float(errors.median()) < 0.1 * max(float(w.abs().max()) for w in want)


@pytest.mark.slow
def test_latent_blocks_pulled_over_nixl_give_the_tokens_of_one_engine(v3):
    """A prefix pull engine to engine over NIXL (tests/test_kvtransfer_engines.py's): the puller takes the source's
    latent blocks and computes only the rest; the tokens equal an engine computing it all."""
    source, puller, alone = (LLMEngine(EngineConfig(v3, num_kv_blocks=32, max_model_len=256)) for _ in range(3))
    links = _prefix_links(source, puller, "mla")
    try:
        shared = list(range(10, 74))                                  # 4 full blocks of 16
        prompt = shared + list(range(100, 120))
        _finish(source, shared + [5, 6, 7], "a", GREEDY)
        hashes = block_hashes(prompt, 16, source.model_key)
        handoff = links["s"].export_prefix("pin-1", hashes, prompt)
        assert handoff.handle.num_tokens == 64 and len(handoff.handle.block_ids) == 4
        want = _finish(alone, prompt, "alone", GREEDY).token_ids
        before = puller.num_computed_tokens_total
        pulled = _finish(puller, prompt, "b", GREEDY, block_hashes=hashes, remote=RemotePrefill(
            handoff, hashes[:4], None, None, deadline=handoff.handle.expiry - 2, num_tokens=64))
        assert pulled.token_ids == want and pulled.metrics.kv_transfer_blocks == 4
        assert puller.num_computed_tokens_total - before == len(prompt) - 64 + GREEDY.max_tokens - 1
    finally:
        links["p"].close()
        links["s"].close()


def test_multi_token_prediction_layers_in_the_checkpoint_are_not_loaded(v3, tmp_path):
    """DeepSeek-V3's released weights carry a layer past num_hidden_layers (its multi-token prediction module); the
    model loads without it, the same tokens."""
    path = tmp_path / "with-mtp"
    shutil.copytree(v3, path)
    tensors = load_file(path / "model.safetensors")
    extra = {k.replace("model.layers.2.", "model.layers.3."): v.clone() for k, v in tensors.items()
             if ".layers.2." in k}
    extra["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**tensors, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    want = [o.token_ids for o in engine(v3).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in engine(str(path)).generate(PROMPTS, GREEDY)] == want


def test_lora_is_refused_by_name(v3):
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        engine(v3, enable_lora=True)


def write_block_fp8(src: str, dst, block: tuple[int, int]) -> tuple[str, str]:
    """DeepSeek-V3's release format from a float checkpoint: each projection's weight as e4m3 codes with a
    weight_scale_inv per (rows x columns) block (partial blocks at the edges), norms, embeddings, routers and the
    head as they are. Returns (the FP8 checkpoint, a float checkpoint of the values its codes stand for)."""
    tensors = load_file(f"{src}/model.safetensors")
    fp8, ref = {}, {}
    for name, w in tensors.items():
        if w.dim() != 2 or not name.endswith("proj.weight") and ".proj_with_mqa." not in name:
            fp8[name] = ref[name] = w
            continue
        rows, cols = -(-w.shape[0] // block[0]), -(-w.shape[1] // block[1])
        scale = torch.empty(rows, cols)
        codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        deq = torch.empty(w.shape)
        for i in range(rows):
            for j in range(cols):
                tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
                scale[i, j] = tile.abs().max() / 448.0
                c = (tile / scale[i, j]).to(torch.float8_e4m3fn)
                codes[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = c
                deq[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = c.float() * scale[i, j]
        fp8[name], fp8[name.replace(".weight", ".weight_scale_inv")], ref[name] = codes, scale, deq
    cfg = json.loads(open(f"{src}/config.json").read())
    for out, ts, qc in ((dst / "fp8", fp8, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                            "weight_block_size": list(block)}), (dst / "ref", ref, None)):
        shutil.copytree(src, out)
        save_file(ts, out / "model.safetensors", metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps({**cfg, **({"quantization_config": qc} if qc else {})}))
    return str(dst / "fp8"), str(dst / "ref")


@pytest.mark.slow
def test_block_fp8_checkpoints_load_as_the_values_their_blocks_stand_for(v3, tmp_path):
    """DeepSeek-V3's (and Qwen3-FP8's) block-wise FP8: each tile of codes times its scale, blocks cut at the edges
    included, loaded as the model's floats: the same log-probabilities and tokens as a float checkpoint of those
    values, at TP 1 and TP 2 (each rank cuts its share after dequantizing). quantization="fp8" requantizes them per
    row."""
    fp8, ref = write_block_fp8(v3, tmp_path, (16, 24))            # 64 columns: blocks of 24, 24 and 16
    want, got = engine(ref), engine(fp8)
    assert got.engine.runner.quantization == "none"
    for a, b in zip(engine_logprobs(got, PROMPTS), engine_logprobs(want, PROMPTS)):
        assert torch.equal(a, b)
    with_logprobs = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_K)
    tp2 = engine(fp8, tensor_parallel_size=2)       # an all-reduce sums in another order: a near-tie may part them
    try:
        for o, r in zip(tp2.generate(PROMPTS, with_logprobs), want.generate(PROMPTS, with_logprobs)):
            check_greedy_close(baton_greedy(o), baton_greedy(r))
    finally:
        tp2.engine.shutdown()
    per_row = engine(fp8, quantization="fp8")
    attn = per_row.engine.runner.model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj, QuantLinear) and attn.q_b_proj.calls[0][0] == "f8"
