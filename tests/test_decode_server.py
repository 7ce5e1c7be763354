"""A decode replica in process (decode_worker/server.py): a DecodeServer of a tiny model, its `generate` and
`deltas` called as Serve would call them, and its metrics report. Its delta channels: a request that joins a
channel sends its deltas after the first through it; one whose first delta meets a closing channel (the replica
began draining while the request prefilled) streams on its own call to the end, as the ingress then reads it; the
channel ends once its last request leaves, and no KV block is left behind. The live cluster's version is in
tests/test_cluster_e2e.py."""
from __future__ import annotations

import asyncio

import pytest

from decode_worker.server import DecodeServer
from engine import SamplingParams
from engine.config import EngineConfig
from engine.loader import resolve_model
from kvtransfer.config import TransferConfig
from replica.messages import DeltaChannel, PoolRequest
from tests.conftest import make_tiny_checkpoint, wait_for

PROMPT = list(range(40, 60))
N = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("decode"), "llama")
    srv = DecodeServer(EngineConfig(path, tokenizer=resolve_model(None), num_kv_blocks=64, max_model_len=256),
                       TransferConfig(), "", "tiny")
    yield srv
    srv.__del__()
    srv.llm.shutdown()


def request(rid: str, channel: str) -> PoolRequest:
    return PoolRequest(rid, PROMPT, [], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                       channel=channel, channel_key=f"key-{rid}")


def test_a_request_that_meets_a_closing_channel_streams_on_its_call_and_the_channel_ends(server):
    async def main():
        on_channel: dict[str, list] = {}
        ended = asyncio.Event()

        async def read():
            async for batch in server.deltas(DeltaChannel("ingress-1", server.replica)):
                for key, delta in batch:
                    on_channel.setdefault(key, []).append(delta)
            ended.set()
        reader = asyncio.create_task(read())
        while "ingress-1" not in server._channels:
            await asyncio.sleep(0.01)

        a = server.generate(request("a", "ingress-1"))
        first_a = await a.__anext__()
        assert first_a.channeled                          # it joined the channel: the rest come through it
        rest_a = asyncio.create_task(_drain(a))
        server._channels["ingress-1"].close()             # the replica begins draining, as _close_channels does
        b = [d async for d in server.generate(request("b", "ingress-1"))]
        assert not b[0].channeled
        # every one of b's deltas came on its call, the last finished: before the fix its deltas after the first
        # went to the channel under a key its ingress never read, and its stream at the ingress waited for ever
        assert b[-1].finished and "key-b" not in on_channel
        assert await asyncio.wait_for(rest_a, 30) == []   # a's call carries nothing after its first delta
        await asyncio.wait_for(ended.wait(), 30)          # the channel ends once a, its last user, has finished
        await reader
        a_tokens = first_a.token_ids + [t for d in on_channel["key-a"] for t in d.token_ids]
        b_tokens = [t for d in b for t in d.token_ids]
        assert on_channel["key-a"][-1].finished and a_tokens == b_tokens and len(a_tokens) == N
        assert "ingress-1" not in server._channels

    asyncio.run(main())
    free, total, running = server.llm.call(lambda e: (e.pool.num_free_blocks, e.pool.num_blocks, len(e.requests)))
    assert (free, total, running) == (total, total, 0)    # no block leaked


async def _drain(agen) -> list:
    return [d async for d in agen]


def test_the_heap_gauge_is_read_at_every_report_at_rest_and_seldom_under_load(server, monkeypatch):
    """mallinfo2 holds the allocator's locks while it walks every arena (milliseconds in a replica that has served
    load): a replica running requests reads it once per HEAP_BUSY_INTERVAL_S, one at rest at every report (where
    the soak takes each replica's memory)."""
    import replica.metrics as metrics
    reads = []
    monkeypatch.setattr(metrics, "heap_in_use", lambda: reads.append(1) or 1234 * len(reads))

    def heap_gauge() -> float:
        line = next(x for x in server.metrics.exposition().decode().splitlines()
                    if x.startswith("baton_replica_heap_in_use_bytes"))
        return float(line.rsplit(" ", 1)[1])

    at_rest = [heap_gauge() for _ in range(3)]
    assert len(reads) == 3 and at_rest == [1234, 2468, 3702]       # a fresh figure at every report

    async def main():
        gen = server.generate(PoolRequest("busy", PROMPT, [], SamplingParams(temperature=0, max_tokens=200,
                                                                             ignore_eos=True)))
        await gen.__anext__()                           # the request runs: the replica is busy
        busy = [heap_gauge() for _ in range(5)]
        await gen.aclose()                              # the client leaves: the replica aborts it
        return busy
    busy = asyncio.run(main())
    assert len(reads) <= 4 and len(set(busy)) == 1     # at most one read for five reports, the same figure
    wait_for(lambda: server.llm.call(lambda e: not e.requests), 30, "the aborted request to leave the engine")
    n = len(reads)
    heap_gauge()
    assert len(reads) == n + 1                          # at rest again: read at the next report


def test_a_pool_requests_priority_reaches_the_engine_that_decodes_it(server):
    """vLLM's `priority` (the API's field, carried by PoolRequest): the decode replica's engine schedules the
    request at it (lower first: tests/test_scheduler.py)."""
    async def main():
        gen = server.generate(PoolRequest("prio", PROMPT, [], SamplingParams(temperature=0, max_tokens=200,
                                                                             ignore_eos=True), priority=-3))
        await gen.__anext__()
        got = server.llm.call(lambda e: e.requests["prio"].priority)
        await gen.aclose()
        return got
    assert asyncio.run(main()) == -3
    wait_for(lambda: server.llm.call(lambda e: not e.requests), 30, "the aborted request to leave the engine")
