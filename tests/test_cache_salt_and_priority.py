"""vLLM's cache_salt: a request's prefix-cache hits come only from requests with the same salt (and none from
unsalted ones), so one tenant cannot probe another's prompts through cache-hit timing; the salt never appears in a
key, a repr or an event. The API refuses an empty salt. (And vLLM's `priority`, the other scheduling field a request
carries to both pools.)"""
from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.block_hash import block_hashes, namespace_key
from engine.errors import InvalidRequestError
from router import openai_protocol as oa

PROMPT = "Relay teams practise the exchange zone more than anything else, because a dropped baton ends the race. " * 3


def test_only_requests_with_the_same_salt_share_cached_blocks(smol_path):
    llm = LLM(smol_path, kv_cache_memory=64 << 20, max_model_len=512)
    ids = llm.engine.tokenize(PROMPT)
    full = (len(ids) - 1) // llm.engine.block_size * llm.engine.block_size     # the last token is always computed

    def run(salt: str | None):
        return llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, cache_salt=salt))[0]

    first = run("tenant-a")
    assert first.metrics.num_cached_tokens == 0
    assert run("tenant-a").metrics.num_cached_tokens == full
    b = run("tenant-b")
    assert b.metrics.num_cached_tokens == 0 and b.token_ids == first.token_ids     # the same answer, computed again
    assert run(None).metrics.num_cached_tokens == 0                               # unsalted reads no salted block
    assert run(None).metrics.num_cached_tokens == full
    assert run("tenant-b").metrics.num_cached_tokens == full


def test_the_salt_is_in_no_key_and_no_repr():
    key = namespace_key("m", None, "s3cret-salt")
    assert "s3cret-salt" not in key and key != namespace_key("m", None, "other") != namespace_key("m")
    assert namespace_key("m", "adapter", "s3cret-salt") != key
    assert block_hashes(list(range(32)), 16, key) != block_hashes(list(range(32)), 16, "m")
    assert "s3cret-salt" not in repr(SamplingParams(cache_salt="s3cret-salt"))


def test_an_empty_salt_is_refused():
    with pytest.raises(InvalidRequestError, match="cache_salt must be a non-empty string"):
        SamplingParams(cache_salt="").validate()
    with pytest.raises(oa.OpenAIError) as e:
        oa.parse_request({"model": "m", "prompt": "hi", "cache_salt": ""}, chat=False)
    assert e.value.status == 400 and "cache_salt" in str(e.value.body)
    req = oa.parse_request({"model": "m", "prompt": "hi", "cache_salt": "abc"}, chat=False)
    assert oa.to_sampling_params(req, 2048, 5).cache_salt == "abc"


def test_the_api_takes_vllms_priority_within_int32():
    req = oa.parse_request({"model": "m", "prompt": "hi", "priority": -5}, chat=False)
    assert req.priority == -5 and oa.parse_request({"model": "m", "prompt": "hi"}, chat=False).priority == 0
    with pytest.raises(oa.OpenAIError) as e:
        oa.parse_request({"model": "m", "prompt": "hi", "priority": 2**40}, chat=False)
    assert e.value.status == 400 and "priority" in str(e.value.body)
