"""The roles the pools need: prefill to the first token with blocks pinned; decode from imported KV."""
from __future__ import annotations

import torch

from engine import EngineConfig, LLMEngine, SamplingParams


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs


def test_prefill_then_decode_elsewhere_matches_one_engine(smol_path):
    cfg = dict(num_kv_blocks=64, max_model_len=512)
    prefill, decode = LLMEngine(EngineConfig(smol_path, **cfg)), LLMEngine(EngineConfig(smol_path, **cfg))
    assert prefill.compat_key() == decode.compat_key()
    prompt = prefill.tokenize("The history of the relay race begins in ancient Greece, where runners carried")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    ref = LLMEngine(EngineConfig(smol_path, **cfg))
    ref.add_request(prompt, params)
    want = _run(ref)[0].token_ids

    prefill.add_request(prompt, params, request_id="r1", prefill_only=True)
    (first,) = _run(prefill)
    assert first.finished and first.token_ids == want[:1] and first.kv_blocks
    assert prefill.pool.num_used_blocks == len(first.kv_blocks)         # pinned, not freed

    kv = decode.reserve_blocks(prompt)
    assert kv.num_local_blocks == 0 and len(kv.block_ids) == len(first.kv_blocks)
    for src, dst in zip(first.kv_blocks, kv.block_ids):                   # the "transfer": whole blocks
        decode.runner.kv_cache[dst].copy_(prefill.runner.kv_cache[src])
    assert prefill.release_pinned("r1") and not prefill.release_pinned("r1")
    assert prefill.pool.num_used_blocks == 0

    decode.add_request(prompt, params, request_id="r1", kv=kv, first_token=first.token_ids[0])
    (out,) = _run(decode)
    assert out.token_ids == want
    assert decode.pool.num_used_blocks == 0

    # the imported full blocks are now in decode's prefix cache: a second reservation needs no transfer
    again = decode.reserve_blocks(prompt)
    assert again.num_local_blocks == len(prompt) // 16
    decode.cancel_reservation(again)
    assert decode.pool.num_used_blocks == 0


def test_imported_kv_without_first_token_recomputes_only_the_last_token(smol_path):
    engine = LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512))
    prompt = engine.tokenize("Paged attention stores keys and values in fixed-size blocks so that")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(prompt, params)
    want = _run(engine)[0].token_ids
    engine.pool.reset_prefix_cache()
    donor = LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512))
    donor.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="d", prefill_only=True)
    (d,) = _run(donor)
    kv = engine.reserve_blocks(prompt)
    engine.runner.kv_cache[torch.tensor(kv.block_ids)] = donor.runner.kv_cache[torch.tensor(d.kv_blocks)]
    before = engine.num_computed_tokens_total
    engine.add_request(prompt, params, kv=kv)
    assert _run(engine)[0].token_ids == want
    assert engine.num_computed_tokens_total - before == 1 + (params.max_tokens - 1)


def test_a_request_the_prefill_token_already_ends_is_still_reported(smol_path):
    """max_tokens=1 (or the first token is a stop): decode admits it finished and reports it at once."""
    from engine.async_llm import AsyncLLM
    import asyncio
    cfg = dict(num_kv_blocks=64, max_model_len=512)
    prefill, decode = LLMEngine(EngineConfig(smol_path, **cfg)), AsyncLLM(engine=LLMEngine(EngineConfig(smol_path, **cfg)))
    prompt = prefill.tokenize("Relay batons are made of")
    prefill.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="r", prefill_only=True)
    (first,) = _run(prefill)
    kv = decode.call(LLMEngine.reserve_blocks, prompt)

    async def run():
        return [o async for o in decode.generate(prompt, SamplingParams(temperature=0, max_tokens=1), "r", kv=kv,
                                                 first_token=first.token_ids[0])]
    outs = asyncio.run(asyncio.wait_for(run(), 30))
    decode.shutdown()
    assert len(outs) == 1 and outs[0].finished and outs[0].token_ids == first.token_ids
    assert outs[0].finish_reason == "length" and decode.engine.pool.num_used_blocks == 0


def test_a_prefill_whose_caller_leaves_as_it_finishes_frees_its_pinned_blocks(smol_path):
    """The race a client disconnect hits: the engine finishes a prefill_only request (its blocks move to the
    pinned set) while the caller is being cancelled, so nobody ever sees the output or exports a handle. Without
    the release, those blocks stay used forever (no handle means no TTL to end the pin)."""
    import asyncio

    from engine.async_llm import AsyncLLM
    from tests.conftest import wait_for
    llm = AsyncLLM(engine=LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512)))
    prompt = llm.engine.tokenize("A relay team passes the baton in a twenty-metre zone " * 3)

    async def consume():
        async for _ in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), "p", prefill_only=True):
            pass

    async def run():
        task = asyncio.create_task(consume())
        while "p" not in llm._streams:               # added (in a thread)
            await asyncio.sleep(0.001)
        llm._wake.set()
        # polled without yielding to the loop: the finished output stays unread
        wait_for(lambda: "p" in llm.engine.pinned, 30, "the prefill to finish and pin its blocks", interval_s=0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    try:
        asyncio.run(run())
        assert llm.engine.pinned == {} and llm.engine.pool.num_used_blocks == 0
    finally:
        llm.shutdown()
