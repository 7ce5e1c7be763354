"""Prompt logprobs (vLLM's `prompt_logprobs`): each prompt token's log-probability given the tokens before it, with
the top-n, as a user scoring text sees them. Tiny random Llama, fp32 CPU, against transformers."""
from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from tests.conftest import make_tiny_checkpoint

PROMPT = [(7 * j + 3) % 300 for j in range(70)]          # spans several blocks and chunks


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plp"), "llama")


@pytest.fixture(scope="module")
def reference(tiny) -> torch.Tensor:
    """transformers' teacher-forced log-softmax over PROMPT: row p is the distribution of token p + 1."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([PROMPT])).logits[0].float().log_softmax(-1)


def check(out, reference: torch.Tensor, n: int) -> None:
    lps = out.prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for p in range(1, len(PROMPT)):
        d, ref = lps[p], reference[p - 1]
        assert PROMPT[p] in d and len(d) in (n, n + 1)
        assert d[PROMPT[p]] == pytest.approx(ref[PROMPT[p]].item(), abs=2e-4)
        top = ref.topk(n).indices.tolist() if n else []
        assert set(top) <= set(d), (p, top, d)
        for tok, v in d.items():
            assert v == pytest.approx(ref[tok].item(), abs=2e-4) and v <= 0


@pytest.mark.parametrize("chunk", [16, 2048])
def test_prompt_logprobs_equal_transformers_whatever_the_chunking(tiny, reference, chunk):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256, max_num_batched_tokens=chunk)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, logprobs=0))[0]
    check(out, reference, 3)
    assert len(out.token_ids) == 3 and len(out.logprobs) == 3


def test_a_cached_prompt_is_computed_again_for_its_logprobs_and_others_still_hit_the_cache(tiny, reference):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    plain = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    first = llm.generate([PROMPT], plain)[0]
    scored = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0))[0]
    assert scored.metrics.num_cached_tokens == 0, "its prompt's logits come from computing it"
    check(scored, reference, 0)
    assert scored.token_ids == first.token_ids
    again = llm.generate([PROMPT], plain)[0]
    assert again.metrics.num_cached_tokens >= 64 and again.prompt_logprobs is None


def test_prompt_logprobs_beside_speculating_and_preempted_requests(tiny, reference):
    """A batch where prompt rows, sampling rows and verify rows share one step, in a KV cache small enough to
    preempt: every other request's tokens are what they are alone, and the scores are the reference's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
    others = [[1, 2, 3, 1, 2, 3, 1, 2] * 3, [5, 6, 7, 5, 6, 7] * 4]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    alone = [o.token_ids for o in LLM(tiny, num_kv_blocks=64, max_model_len=256).generate(others, params)]
    for cfg in ({"speculative_config": spec, "num_kv_blocks": 64, "max_model_len": 256},
                {"num_kv_blocks": 10, "max_model_len": 160}):                    # 160 tokens for 254
        llm = LLM(tiny, max_num_batched_tokens=24, **cfg)
        outs = llm.generate(others + [PROMPT], [params, params,
                                                SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                               prompt_logprobs=2)])
        assert [o.token_ids for o in outs[:2]] == alone
        check(outs[2], reference, 2)
        if "speculative_config" in cfg:
            assert llm.engine.stats()["spec_num_accepted_tokens"] > 0
        else:
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test meant to preempt"


def test_prompt_rows_past_one_slice_are_recorded_in_order(tiny, reference, monkeypatch):
    from engine import sampler
    monkeypatch.setattr(sampler, "_PROMPT_ROWS", 7)       # 69 rows in slices of 7
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    check(llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0], reference, 2)


def test_a_one_token_prompt_has_none_and_still_reads_the_cache(tiny):
    llm = LLM(tiny, num_kv_blocks=64, max_model_len=256)
    out = llm.generate([[5]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None] and len(out.token_ids) == 2


def test_prompt_logprobs_must_be_in_range():
    from engine.errors import InvalidRequestError
    for bad in (-1, 21, 1.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    assert math.isclose(SamplingParams(prompt_logprobs=20).prompt_logprobs, 20)
