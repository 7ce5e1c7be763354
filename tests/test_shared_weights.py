"""Engines of one checkpoint in one process share its weights and tokenizer (engine/model_runner.py,
engine/loader.py): a second engine neither reads nor repacks them again nor holds a second copy, still gives its
own tokens while the first runs beside it, and the weights are freed with the last engine that holds them.
Different options load their own."""
from __future__ import annotations

import gc
import threading
import weakref

import pytest

from bench.models import make_tiny_checkpoint
from engine import LLM, PromptTooLongError, SamplingParams
from engine.loader import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = ["The capital of France is", "List three colours:", "def add(a, b):"]


def _params(llm: LLM) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in llm.engine.runner.model.named_parameters()}


def _side_by_side(engines: tuple[LLM, LLM], alone: list[list[int]]) -> None:
    """Each engine has its own KV cache bound to its own forward: steps interleaved, then both at once."""
    ids = {llm: [llm.engine.add_request(p, GREEDY) for p in PROMPTS] for llm in engines}
    done: dict = {}
    while any(llm.engine.has_unfinished_requests() for llm in engines):
        for llm in engines:
            done.update({o.request_id: o.token_ids for o in llm.engine.step() if o.finished})
    for llm in engines:
        assert [done[i] for i in ids[llm]] == alone
    outs: dict = {}
    threads = [threading.Thread(target=lambda llm=llm: outs.__setitem__(llm, llm.generate(PROMPTS * 2, GREEDY)))
               for llm in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for llm in engines:
        assert [o.token_ids for o in outs[llm]] == alone * 2
        assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks


def test_a_second_engine_shares_the_weights_and_both_give_their_own_tokens_side_by_side():
    """The default model, run packed: its C++ forward is bound to each engine's own KV cache."""
    first = LLM(None, kv_cache_memory=48 << 20, max_model_len=512)
    alone = [o.token_ids for o in first.generate(PROMPTS, GREEDY)]
    second = LLM(None, kv_cache_memory=24 << 20, max_model_len=512, max_num_seqs=4)
    assert _params(second) == _params(first), "one copy of the weights"
    assert second.engine.runner.weight_bytes == first.engine.runner.weight_bytes
    assert second.engine.tokenizer is first.engine.tokenizer                 # and the tokenizer
    assert load_tokenizer(first.engine.model_path) is not first.engine.tokenizer, "a caller's own, to change"
    _side_by_side((first, second), alone)
    del first                                                 # the second still holds the weights
    gc.collect()
    assert [o.token_ids for o in second.generate(PROMPTS, GREEDY)] == alone


def test_a_longer_max_model_len_shares_the_last_engine_frees_and_other_options_load_apart(tmp_path, monkeypatch):
    """A checkpoint of this test's own (the suite keeps the default model's weights loaded: tests/conftest.py)."""
    path = make_tiny_checkpoint(tmp_path / "m", "llama")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(path, num_kv_blocks=40, max_model_len=128)
    longer = LLM(path, num_kv_blocks=40, max_model_len=512)                 # its own rotary tables
    assert _params(longer) == _params(a)
    prompt = [(7 * i) % 290 + 5 for i in range(400)]                        # past the first engine's 128
    with pytest.raises(PromptTooLongError):
        a.generate([prompt], greedy)
    far = longer.generate([prompt], greedy)[0].token_ids
    int8 = LLM(path, num_kv_blocks=40, max_model_len=128, quantization="int8")
    assert set(_params(int8).values()).isdisjoint(_params(a).values()), "other weights, loaded apart"
    with monkeypatch.context() as env:                                       # packed another way: its own
        env.setenv("BATON_CPU_PACKED", "0")
        plain = LLM(path, num_kv_blocks=40, max_model_len=128)
    assert set(_params(plain).values()).isdisjoint(_params(a).values())
    assert len(plain.generate([prompt[:100]], greedy)[0].token_ids) == 8
    del plain
    norm = weakref.ref(a.engine.runner.model.model.norm.weight)
    del a, longer
    gc.collect()
    assert norm() is None, "the weights were freed with the last engine that held them"
    fresh = LLM(path, num_kv_blocks=40, max_model_len=512)                  # loaded anew: nothing to share
    assert fresh.generate([prompt], greedy)[0].token_ids == far
