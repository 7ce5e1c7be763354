"""Embeddings (engine/pooling.py): LLM.embed against transformers' final hidden states, pooled last, mean or cls and
L2-normalized, as vLLM's pooling runner and sentence-transformers give them; chunked, batched beside generating
requests, from the prefix cache, preempted, truncated to Matryoshka sizes; no KV block left behind. The HTTP route
is tested on the real clusters (tests/test_cluster_e2e.py, tests/test_cluster_colocated.py)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import ConfigError, InvalidRequestError, PromptTooLongError
from tests.conftest import make_tiny_checkpoint

RNG = np.random.default_rng(7)
PROMPTS = [RNG.integers(3, 300, n).tolist() for n in (1, 5, 17, 40, 70)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


@pytest.fixture(scope="module")
def hidden(tiny):
    """transformers' final hidden states (after the last norm) of each prompt, fp32."""
    from transformers import AutoModel
    model = AutoModel.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS]


def want(h: torch.Tensor, kind: str, dims: int | None = None, normalize: bool = True) -> np.ndarray:
    v = h[-1] if kind == "last" else h.mean(0) if kind == "mean" else h[0]
    v = v[:dims] if dims else v
    return (torch.nn.functional.normalize(v, dim=-1) if normalize else v).numpy()


def vectors(outs) -> list[np.ndarray]:
    return [np.asarray(o.outputs.embedding, dtype=np.float32) for o in outs]


def assert_close(got: list[np.ndarray], expected: list[np.ndarray], atol: float = 2e-5) -> None:
    for i, (g, w) in enumerate(zip(got, expected)):
        assert g.shape == w.shape, (i, g.shape, w.shape)
        assert np.abs(g - w).max() < atol, (i, np.abs(g - w).max())


def no_blocks_held(llm: LLM) -> None:
    e = llm.engine
    assert not e.requests and not e.has_unfinished_requests()
    assert e.pool.num_used_blocks == 0, "an embedding request left KV blocks behind"


@pytest.mark.parametrize("kind", ["last", "mean", "cls"])
@pytest.mark.parametrize("chunk", [16, 2048])
def test_embeddings_equal_transformers_hidden_states_pooled(tiny, hidden, kind, chunk):
    """Each pooling of every prompt, in one batch, whole or in 16-token chunks (a 70-token prompt pools over five
    steps): the normalized vector of transformers' hidden states."""
    llm = LLM(tiny, num_kv_blocks=64, max_num_batched_tokens=chunk, pooling_type=kind)
    outs = llm.embed(PROMPTS)
    assert [o.prompt_token_ids for o in outs] == PROMPTS
    assert_close(vectors(outs), [want(h, kind) for h in hidden])
    for v in vectors(outs):
        assert abs(np.linalg.norm(v) - 1) < 1e-5
    raw = llm.embed(PROMPTS[3], PoolingParams(normalize=False))
    assert_close(vectors(raw), [want(hidden[3], kind, normalize=False)], atol=1e-4)
    no_blocks_held(llm)


def test_embeddings_beside_generating_and_preempted_requests(tiny, hidden):
    """Embedding requests in the steps of generating ones, in a KV cache small enough to preempt them mid-prompt
    (a mean pooling starts over): the generated tokens are what they are alone, and the embeddings are the
    reference's."""
    others = [[1, 2, 3, 4] * 6, [9, 8, 7] * 8]
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    alone = [o.token_ids for o in LLM(tiny, num_kv_blocks=64, max_model_len=256).generate(others, params)]
    for kind in ("last", "mean"):
        llm = LLM(tiny, num_kv_blocks=10, max_model_len=160, max_num_batched_tokens=24, pooling_type=kind)
        e = llm.engine
        gen = [e.add_request(p, params) for p in others]
        done = {}
        for _ in range(30):                     # the generating ones hold most of the cache when the others come
            done.update({o.request_id: o for o in e.step() if o.finished})
        embs = [e.add_request(p, pooling=PoolingParams()) for p in PROMPTS[2:]]
        while e.has_unfinished_requests():
            done.update({o.request_id: o for o in e.step() if o.finished})
        assert [done[r].token_ids for r in gen] == alone
        assert_close([done[r].embedding for r in embs], [want(h, kind) for h in hidden[2:]])
        assert all(not done[r].token_ids and done[r].finish_reason == "stop" for r in embs)
        assert sum(done[r].metrics.num_preemptions for r in embs) > 0, "the test meant to preempt them"
        no_blocks_held(llm)


def test_last_token_pooling_reads_the_prefix_cache_and_mean_pooling_does_not(tiny, hidden):
    """A prompt embedded again finds its blocks cached: last pooling computes only the block holding its last
    token; mean pooling computes every row again. Both give the reference's vector."""
    for kind, hits in (("last", 64), ("mean", 0)):
        llm = LLM(tiny, num_kv_blocks=64, pooling_type=kind)
        first, again = (llm.embed(PROMPTS[4])[0] for _ in range(2))
        assert first.metrics.num_cached_tokens == 0 and again.metrics.num_cached_tokens == hits
        assert_close(vectors([first, again]), [want(hidden[4], kind)] * 2)
        # and a generating request of the same prompt reads the blocks the embedding left in the cache
        gen = llm.generate([PROMPTS[4]], SamplingParams(temperature=0, max_tokens=2))[0]
        assert gen.metrics.num_cached_tokens == 64


def test_the_pooling_comes_from_the_sentence_transformers_config(tiny, hidden, tmp_path):
    """A sentence-transformers model directory names its pooling (modules.json -> its Pooling module's config);
    the engine's pooling_type overrides it; a pooling Baton does not run is refused at start."""
    import shutil
    d = tmp_path / "st"
    shutil.copytree(tiny, d)
    (d / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (d / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
               "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    llm = LLM(str(d), num_kv_blocks=64)
    assert llm.engine.pooling.type == "mean"
    assert_close(vectors(llm.embed(PROMPTS[3])), [want(hidden[3], "mean")])
    assert LLM(str(d), num_kv_blocks=64, pooling_type="last").engine.pooling.type == "last"
    (d / "1_Pooling" / "config.json").write_text(json.dumps({**pooling, "pooling_mode_mean_tokens": False,
                                                            "pooling_mode_max_tokens": True}))
    with pytest.raises(ConfigError, match="pooling"):
        LLM(str(d), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="pooling_type"):
        LLM(tiny, num_kv_blocks=64, pooling_type="max")


def test_dimensions_cut_a_matryoshka_model_and_are_refused_elsewhere(tiny, hidden, tmp_path):
    import shutil
    llm = LLM(tiny, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="matryoshka"):
        llm.embed(PROMPTS[2], PoolingParams(dimensions=16))
    d = tmp_path / "mrl"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [16, 32, 64]}))
    mrl = LLM(str(d), num_kv_blocks=64)
    assert_close(vectors(mrl.embed(PROMPTS[2:4], PoolingParams(dimensions=16))),
                 [want(h, "last", dims=16) for h in hidden[2:4]])
    for bad, why in ((24, "one of"), (0, "positive"), (128, "one of")):
        with pytest.raises(InvalidRequestError, match=why):
            mrl.embed(PROMPTS[2], PoolingParams(dimensions=bad))
    no_blocks_held(mrl)


def test_bad_inputs_are_refused_and_leave_nothing_behind(tiny):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.embed([[]])
    with pytest.raises(PromptTooLongError, match="65 tokens"):
        llm.embed([PROMPTS[1], [5] * 65])                  # the good one is not queued either
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.embed([[5, 300]])
    assert len(llm.embed([[5] * 64])[0].outputs.embedding) == 64   # an input may fill max_model_len
    with pytest.raises(InvalidRequestError, match="hand-off"):
        llm.engine.add_request([1, 2, 3], prefill_only=True, pooling=PoolingParams())
    no_blocks_held(llm)


@pytest.mark.slow
def test_the_default_model_embeds_as_transformers_does(smol_path, hf_smol):
    """SmolLM2 (its GGUF packed, as `baton serve` runs it) against transformers on its fp32 conversion: the same
    direction, to the packed weights' error; the engine's fp32 copy, to fp32's."""
    from transformers import AutoTokenizer
    texts = ["The capital of France is Paris.", "Paged attention stores the KV cache in fixed-size blocks."]
    ids = [AutoTokenizer.from_pretrained(smol_path)(t)["input_ids"] for t in texts]
    with torch.no_grad():
        ref = [want(hf_smol.model(torch.tensor([i])).last_hidden_state[0], "last") for i in ids]
    assert hf_smol.config.hidden_size == len(ref[0]) == 576
    exact = LLM(smol_path, kv_cache_memory=64 << 20, max_model_len=512)
    assert_close(vectors(exact.embed(texts)), ref, atol=1e-4)
    packed = LLM(None, kv_cache_memory=64 << 20, max_model_len=512)
    assert packed.engine.runner.quantization != "none"
    got = vectors(packed.embed(texts))
    assert all(float(g @ r) > 0.98 for g, r in zip(got, ref)), [float(g @ r) for g, r in zip(got, ref)]
    # two different texts are far apart, so the bound above says something
    assert float(ref[0] @ ref[1]) < 0.9


def test_an_adapters_embeddings_are_its_peft_models(tiny, hidden, tmp_path):
    """A request under a LoRA adapter pools the adapted model's hidden states (PEFT's), beside base-model requests
    in the same steps, whose vectors stay the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from bench.models import make_lora_adapter
    from engine import LoRARequest
    path = make_lora_adapter(tiny, tmp_path / "adapter", rank=8, seed=3)
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32), path).eval()
    with torch.no_grad():
        adapted = [peft.base_model.model.model(torch.tensor([p])).last_hidden_state[0] for p in PROMPTS[2:4]]
    llm = LLM(tiny, num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, path)
    outs = llm.embed(PROMPTS[2:4] * 2, lora_request=[lora, lora, None, None])
    got = vectors(outs)
    assert_close(got[:2], [want(h, "last") for h in adapted], atol=5e-5)
    assert_close(got[2:], [want(h, "last") for h in hidden[2:4]])
    assert np.abs(got[0] - got[2]).max() > 1e-2                 # the adapter changes the vector
    no_blocks_held(llm)
