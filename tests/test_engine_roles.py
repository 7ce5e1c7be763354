"""The roles the pools need: prefill to the first token with blocks pinned; decode from imported KV."""
from __future__ import annotations

import time

from engine import EngineConfig, LLMEngine, RemotePrefill, SamplingParams
from engine.block_hash import block_hashes


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    return outs


class CopyConnector:
    """An in-process "transfer": a load copies whole blocks from the producer engine's cache (the source)
    when the test lets it end (auto=True: at the next poll)."""

    def __init__(self, auto: bool = True):
        self.auto, self.started, self.pending = auto, {}, {}

    def start_load(self, request_id, source, block_ids, block_hashes, num_tokens, skip_blocks):
        producer, src_blocks = source
        self.started[request_id] = skip_blocks
        self.pending[request_id] = (producer, src_blocks[skip_blocks:], block_ids[skip_blocks:])

    def finish(self, engine: LLMEngine) -> list[str]:
        done = list(self.pending)
        for producer, src, dst in self.pending.values():
            for a, b in zip(src, dst):
                engine.runner.kv_cache[b].copy_(producer.runner.kv_cache[a])
        self.pending.clear()
        return done

    def finished_loads(self):
        return (self.finish(self.engine), {}) if self.auto else ([], {})

    def cancel_load(self, request_id):
        pass


def _importing(engine: LLMEngine, **kw) -> CopyConnector:
    conn = CopyConnector(**kw)
    conn.engine = engine
    engine.attach_kv_connector(conn)
    return conn


def _remote(engine: LLMEngine, prompt: list[int], source, first=None, deadline: float | None = None) -> RemotePrefill:
    token, lps = (first.token_ids[0], first.logprobs[0] if first.logprobs else None) if first else (None, None)
    return RemotePrefill(source, block_hashes(prompt, engine.block_size, engine.model_key), token, lps,
                         deadline=time.time() + 30 if deadline is None else deadline)


def test_prefill_then_decode_elsewhere_matches_one_engine(smol_path):
    cfg = dict(num_kv_blocks=64, max_model_len=512)
    prefill, decode = LLMEngine(EngineConfig(smol_path, **cfg)), LLMEngine(EngineConfig(smol_path, **cfg))
    conn = _importing(decode)
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

    decode.add_request(prompt, params, request_id="r1", remote=_remote(decode, prompt, (prefill, first.kv_blocks), first))
    (out,) = _run(decode)
    assert conn.started["r1"] == 0 and out.token_ids == want            # every block pulled; same tokens
    assert out.metrics.kv_transferred and out.metrics.kv_transfer_blocks == len(first.kv_blocks)
    assert out.metrics.kv_transfer_error is None
    assert decode.pool.num_used_blocks == 0
    assert prefill.release_pinned("r1") and not prefill.release_pinned("r1")
    assert prefill.pool.num_used_blocks == 0

    # the imported full blocks are now in decode's prefix cache: a second import pulls only the last one
    prefill.add_request(prompt, params, request_id="r2", prefill_only=True)
    (first,) = _run(prefill)
    decode.add_request(prompt, params, request_id="r2", remote=_remote(decode, prompt, (prefill, first.kv_blocks), first))
    (out,) = _run(decode)
    assert conn.started["r2"] == len(prompt) // 16 and out.token_ids == want
    assert out.metrics.kv_transfer_blocks == len(first.kv_blocks) - len(prompt) // 16
    assert decode.pool.num_used_blocks == 0


def test_imported_kv_without_first_token_recomputes_only_the_last_token(smol_path):
    engine = LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512))
    _importing(engine)
    prompt = engine.tokenize("Paged attention stores keys and values in fixed-size blocks so that")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request(prompt, params)
    want = _run(engine)[0].token_ids
    engine.pool.reset_prefix_cache()
    donor = LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512))
    donor.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="d", prefill_only=True)
    (d,) = _run(donor)
    before = engine.num_computed_tokens_total
    engine.add_request(prompt, params, remote=_remote(engine, prompt, (donor, d.kv_blocks)))
    assert _run(engine)[0].token_ids == want
    assert engine.num_computed_tokens_total - before == 1 + (params.max_tokens - 1)


def test_an_import_that_waits_for_room_then_runs_or_misses_its_deadline_gives_the_local_tokens(smol_path):
    """Blocks held by a running request: the import waits in the queue (no transfer started), then loads
    once they are free. A second one whose deadline passes meanwhile is prefilled here. Same tokens."""
    cfg = dict(num_kv_blocks=12, max_model_len=192)
    now = [1000.0]
    decode = LLMEngine(EngineConfig(smol_path, **cfg), clock=lambda: now[0])
    prefill = LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=256))
    conn = _importing(decode)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [prefill.tokenize(f"Runner number {i} takes the baton and sprints down the back straight"
                                f" towards the next exchange zone") for i in range(2)]
    want = []
    for i, p in enumerate(prompts):
        prefill.add_request(p, params, request_id=f"ref{i}")
        want.append(_run(prefill)[0].token_ids)
    firsts = []
    for i, p in enumerate(prompts):
        prefill.add_request(p, SamplingParams(temperature=0, max_tokens=1), request_id=f"x{i}", prefill_only=True)
        firsts.append(_run(prefill)[0])
    hog = list(range(1000, 1000 + 10 * 16 + 8))         # 11 of the 12 blocks, 12 with its outputs
    decode.add_request(hog, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), request_id="hog")
    decode.step()
    for i, p in enumerate(prompts):
        decode.add_request(p, params, request_id=f"x{i}",
                           remote=_remote(decode, p, (prefill, firsts[i].kv_blocks), firsts[i],
                                          deadline=now[0] + 10 * (i + 1)))
    decode.step()
    assert conn.started == {} and decode.scheduler.num_awaiting_room == 2
    now[0] += 15                                         # x1 may still load; x0's deadline has passed
    outs = {o.request_id: o for o in _run(decode)}
    assert list(conn.started) == ["x1"] and outs["x1"].metrics.kv_transferred
    assert not outs["x0"].metrics.kv_transferred and "deadline" in outs["x0"].metrics.kv_transfer_error
    assert [outs["x0"].token_ids, outs["x1"].token_ids] == want
    assert decode.pool.num_used_blocks == 0


def test_a_request_the_prefill_token_already_ends_is_still_reported(smol_path):
    """max_tokens=1 (or the first token is a stop): decode admits it finished and reports it at once."""
    from engine.async_llm import AsyncLLM
    import asyncio
    cfg = dict(num_kv_blocks=64, max_model_len=512)
    prefill, decode = LLMEngine(EngineConfig(smol_path, **cfg)), AsyncLLM(engine=LLMEngine(EngineConfig(smol_path, **cfg)))
    _importing(decode.engine)
    prompt = prefill.tokenize("Relay batons are made of")
    prefill.add_request(prompt, SamplingParams(temperature=0, max_tokens=1), request_id="r", prefill_only=True)
    (first,) = _run(prefill)
    remote = _remote(decode.engine, prompt, (prefill, first.kv_blocks), first)

    async def run():
        return [o async for o in decode.generate(prompt, SamplingParams(temperature=0, max_tokens=1), "r",
                                                 remote=remote)]
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
        wait_for(lambda: "p" in llm.engine.kv.pinned, 30, "the prefill to finish and pin its blocks", interval_s=0.005)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    try:
        asyncio.run(run())
        assert llm.engine.kv.pinned == {} and llm.engine.pool.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_a_prefill_whose_caller_leaves_during_the_export_or_whose_export_fails_frees_its_pinned_blocks(smol_path):
    """The race the reliability suite's client disconnects hit under load: the prefill finished and its caller
    left while the export waited for a thread (the replica's pool busy with stats calls). A cancelled pool job
    never runs, so no lease would ever end the pin. And an export that raises must unpin too."""
    import asyncio
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import pytest

    from engine.async_llm import AsyncLLM
    from kvtransfer import KVLink
    from kvtransfer.errors import KVTransferError
    from replica.engine_replica import export_pinned
    llm = AsyncLLM(engine=LLMEngine(EngineConfig(smol_path, num_kv_blocks=64, max_model_len=512)))
    link = KVLink(llm.engine, "producer", kind="ray", ttl_s=600)       # a lease would outlive the test
    prompt = llm.engine.tokenize("A relay team passes the baton in a twenty-metre zone " * 3)

    async def prefill(rid: str):
        async for out in llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), rid, prefill_only=True):
            pass
        assert rid in llm.engine.kv.pinned
        return out

    async def run():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        out = await prefill("left")
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait)            # the only thread is taken
        export = asyncio.create_task(export_pinned(llm, link, out))
        await asyncio.sleep(0.05)
        export.cancel()                                         # the client went away before the export ran
        gate.set()
        await asyncio.gather(export, busy, return_exceptions=True)
        for _ in range(1000):                                   # the withdrawal runs in the (one) pool thread
            if not llm.engine.kv.pinned:
                break
            await asyncio.sleep(0.01)
        assert llm.engine.kv.pinned == {}, "the withdrawn export still pins its blocks"
        assert link.transport.leases == {}

        out = await prefill("fails")
        with pytest.raises(KVTransferError):
            await export_pinned(llm, link, out, hashes=[1, 2, 3, 4, 5, 6, 7, 8, 9])     # wrong number of hashes
        assert "fails" not in llm.engine.kv.pinned

        out = await prefill("kept")                              # the normal path: pinned until pulled
        handoff = await export_pinned(llm, link, out)
        assert handoff.handle.request_id == "kept" and "kept" in llm.engine.kv.pinned
        llm.call(lambda _: link.withdraw("kept"))
    try:
        asyncio.run(asyncio.wait_for(run(), 60))
        assert llm.engine.kv.pinned == {} and llm.engine.pool.num_used_blocks == 0
    finally:
        llm.shutdown()
