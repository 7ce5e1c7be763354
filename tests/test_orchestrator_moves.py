"""The ingress's Orchestrator when a decode replica dies mid-stream (router/orchestrator.py): the request
continues on another replica from what the client already has, as one stream, within the move budget, and
never goes back to the replica it left. The decode pool is a fake Serve handle whose replicas "die" (raise
Ray's ActorDiedError) after some deltas; the live cluster's version is in tests/test_reliability.py. Each case
runs with the ingress's delta channels too (decode.stream_channels): a request's deltas after the first come
through its replica's channel, which dies with the replica."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from ray.exceptions import ActorDiedError

from engine import SamplingParams
from engine.block_hash import block_hashes
from replica.messages import PoolRequest, PrefillResult, TokenDelta
from router.openai_protocol import OpenAIError
from router.orchestrator import MOVES, Orchestrator

BS, KEY = 4, "test-model"
PROMPT = list(range(10, 20))                      # 2 full blocks and a partial one
ANSWER = list(range(100, 112))                    # what an undisturbed run streams, one token per delta


@dataclass
class FakeDecodePool:
    """decode.generate.remote(req): replica k of the calls streams ANSWER from where req.resume leaves off, and
    dies after die_after[k] deltas (None: runs to the end)."""
    die_after: list[int | None]
    drain_after: list[int | None] = field(default_factory=list)      # hand the request over after n deltas
    cut_after: list[int | None] = field(default_factory=list)        # end the call, unfinished, after n deltas
    calls: list[PoolRequest] = field(default_factory=list)

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, req: PoolRequest):
        k = len(self.calls)
        self.calls.append(req)
        drain = self.drain_after[k] if k < len(self.drain_after) else None
        cut = self.cut_after[k] if k < len(self.cut_after) else None
        return self._stream(req, f"d{k}", self.die_after[k], drain, cut)

    async def _stream(self, req, name, die_after, drain_after, cut_after=None):
        start = len(req.resume.token_ids) if req.resume is not None else 0
        for i, tok in enumerate(ANSWER[start:]):
            if die_after is not None and i == die_after:
                raise ActorDiedError()
            if cut_after is not None and i == cut_after:
                return
            if drain_after is not None and i == drain_after:      # this token comes with the hand-over
                kv = PrefillResult(name, tok, None, 0, None) if drain_after else None
                yield TokenDelta([tok] if drain_after else [], f"<{tok}>" if drain_after else "", True,
                                 replica=name if i == 0 else None, finish_reason="migrated", migrate=kv)
                return
            last = start + i == len(ANSWER) - 1
            d = TokenDelta([tok], f"<{tok}>", last, replica=name if i == 0 else None)
            if last:
                d.finish_reason, d.prompt_tokens, d.completion_tokens = "length", len(PROMPT), len(ANSWER)
            yield d


class _Call:
    """What a Serve streaming call returns: an async iterator with cancel()."""

    def __init__(self, agen):
        self.agen, self.cancelled = agen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):
        self.cancelled = True


@dataclass
class FakeChannelPool(FakeDecodePool):
    """The same replicas, with DeltaChannels: deltas.remote(ch) opens replica ch.target's channel; a request that
    names it gets its first delta on its call, marked channeled, and the rest through the channel. A replica that
    dies fails both."""
    channels: dict = field(default_factory=dict)       # replica -> queue of batches (or the error that ends it)
    late: bool = False                                 # a dying replica's channel still brings a delta, after
                                                       # the call's error has moved the request on
    opened: list = field(default_factory=list)
    calls_made: list = field(default_factory=list)

    @property
    def generate(self):
        return self

    @property
    def deltas(self):
        pool = self

        class _Deltas:
            def remote(self, ch):
                pool.opened.append(ch.target)
                queue = pool.channels[ch.target] = asyncio.Queue()

                async def read():
                    while True:
                        item = await queue.get()
                        if isinstance(item, BaseException):
                            raise item
                        yield item
                return _Call(read())
        return _Deltas()

    def remote(self, req: PoolRequest):
        k = len(self.calls)
        name = f"d{k}"
        inner = super().remote(req)
        call = _Call(self._channeled(req, name, inner) if req.channel and name in self.channels else inner)
        self.calls_made.append(call)
        return call

    async def _channeled(self, req, name, inner):
        first = True
        try:
            async for d in inner:
                if self.late:                          # a replica's steps take time: the late delta comes mid-way
                    await asyncio.sleep(0.01)
                if first:
                    d.channeled, first = not d.finished, False
                    yield d
                else:
                    self.channels[name].put_nowait([(req.channel_key, d)])
                if d.finished:
                    return
        except ActorDiedError as e:
            queue = self.channels[name]
            if self.late:                              # in flight when it died: it arrives after the move
                loop = asyncio.get_running_loop()
                loop.call_later(0.02, queue.put_nowait, [(req.channel_key, TokenDelta([999], "<999>", True))])
                loop.call_later(0.04, queue.put_nowait, e)
            else:
                queue.put_nowait(e)
            raise


def run(pool: FakeDecodePool, max_moves: int = 3, take: int | None = None) -> list[TokenDelta]:
    """The request's deltas as the orchestrator streams them (the first `take` only: then the client leaves)."""
    channels = isinstance(pool, FakeChannelPool)
    o = Orchestrator(None, pool, {"block_size": BS, "model_key": KEY}, "", 0, 0.01, max_moves=max_moves,
                     channels=channels)
    req = PoolRequest("r1", PROMPT, block_hashes(PROMPT, BS, KEY), SamplingParams(max_tokens=len(ANSWER)))

    async def collect():
        if channels:                              # every replica's channel open, as after a first request there
            for k in range(len(pool.die_after)):
                o.channels.open(f"d{k}")
            await asyncio.sleep(0)
        out = []
        stream = o._decode(req)
        async for d in stream:
            out.append(d)
            if len(out) == take:
                await stream.aclose()
                break
        if channels:
            assert o.channels.waiting == {}       # nothing left waiting for a delta
        return out
    return asyncio.run(collect())


def pools(*args, **kwargs) -> list[FakeDecodePool]:
    return [FakeDecodePool(*args, **kwargs), FakeChannelPool(*args, **kwargs)]


@pytest.fixture(autouse=True)
def _no_serve_context(monkeypatch):
    monkeypatch.setattr("router.orchestrator._own_serve_request_ids", lambda rid: None)


@pytest.mark.parametrize("channels", [False, True])
def test_a_replica_dying_mid_stream_costs_the_client_nothing(channels):
    pool = pools([3, 4, None])[channels]                   # two deaths: 3 tokens, 4 more, then the rest
    out = run(pool)
    assert [t for d in out for t in d.token_ids] == ANSWER                 # no token repeated or skipped
    assert "".join(d.text for d in out) == "".join(f"<{t}>" for t in ANSWER)
    assert out[-1].finished and out[-1].completion_tokens == len(ANSWER)
    first, second, third = pool.calls
    assert first.resume is None and first.avoid == ()
    # what reached the client before each death: all 3 and 4 of the replicas' tokens on their own calls; through a
    # channel the call's error may overtake the channel's last batch (the replica's tokens in flight are lost, and
    # computed again where the request continues)
    n1, n2 = len(second.resume.token_ids), len(third.resume.token_ids)
    assert (n1, n2) == (3, 7) if not channels else 1 <= n1 <= 3 and n1 + 1 <= n2 <= n1 + 4
    assert second.resume.token_ids == ANSWER[:n1] and second.resume.text_chars == len("".join(
        f"<{t}>" for t in ANSWER[:n1]))
    assert second.avoid == ("d0",) and third.avoid == ("d0", "d1")        # never back to a replica it left
    assert third.resume.token_ids == ANSWER[:n2] and third.num_moves == 2
    # the continuation's block hashes cover prompt + sent tokens, chained from the prompt's
    assert third.block_hashes == block_hashes(PROMPT + ANSWER[:n2], BS, KEY)
    assert third.token_ids == PROMPT and third.prefill is None


@pytest.mark.parametrize("channels", [False, True])
def test_past_the_move_budget_the_error_goes_up(channels):
    pool = pools([2, 2, None])[channels]
    with pytest.raises(ActorDiedError):
        run(pool, max_moves=1)
    assert len(pool.calls) == 2


def test_with_no_moves_allowed_a_death_after_the_first_token_fails_as_before_and_before_it_retries_once():
    with pytest.raises(ActorDiedError):
        run(FakeDecodePool([2, None]), max_moves=0)
    pool = FakeDecodePool([0, None])                       # died before its first delta: one retry, from scratch
    assert [t for d in run(pool, max_moves=0) for t in d.token_ids] == ANSWER
    assert pool.calls[1].resume is None and pool.calls[1].num_moves == 1


def test_the_client_sees_a_503_in_openai_shape_when_the_budget_is_spent():
    from router.orchestrator import as_openai_error
    err = as_openai_error(ActorDiedError(), "r1")
    assert isinstance(err, OpenAIError) and err.status == 503


@pytest.mark.parametrize("channels", [False, True])
def test_a_draining_replica_hands_its_request_over_and_the_stream_goes_on(channels):
    pool = pools([None, None, None], drain_after=[0, 4, None])[channels]  # handed back at once, then after 5 tokens
    out = run(pool, max_moves=0)                           # planned moves spend no budget
    assert [t for d in out for t in d.token_ids] == ANSWER
    assert not any(d.finished for d in out[:-1]) and out[-1].finished and out[-1].finish_reason == "length"
    assert all(d.finish_reason != "migrated" for d in out)                # the client never sees a hand-over
    first, second, third = pool.calls
    assert second.resume is None and second.avoid == ("d0",) and second.prefill is None     # nothing sent yet
    assert third.prefill is not None and third.prefill.first_token == ANSWER[4]             # pulls the KV
    assert third.resume.token_ids == ANSWER[:5] and third.avoid == ("d0", "d1")
    # the KV it pulls is prompt + sent[:-1]: that is what the hashes cover
    assert third.block_hashes == block_hashes(PROMPT + ANSWER[:4], BS, KEY)


def test_a_call_that_ends_before_its_last_delta_continues_elsewhere_instead_of_hanging_the_stream():
    """A replica's call that ends without a finished delta (its deltas went somewhere its caller does not read, as
    a request's did when its first delta met a draining replica's closing channel): the client's stream would wait
    for ever for the rest; it continues on another replica from what was sent."""
    lost = MOVES.labels("stream_lost", "replay")
    before = lost._value.get()
    pool = FakeDecodePool([None, None], cut_after=[4])
    out = run(pool)                     # it used to end here, unfinished, and the ingress waited for the rest
    assert [t for d in out for t in d.token_ids] == ANSWER and out[-1].finished
    assert pool.calls[1].resume.token_ids == ANSWER[:4] and pool.calls[1].avoid == ("d0",)
    assert lost._value.get() == before + 1              # operators see it apart from replicas that died


def test_channeled_deltas_arrive_in_order_and_a_client_that_leaves_cancels_the_call():
    pool = FakeChannelPool([None])
    out = run(pool)
    assert [t for d in out for t in d.token_ids] == ANSWER and out[-1].finished
    assert out[0].channeled and pool.opened == ["d0"]
    assert not pool.calls_made[0].cancelled                # it ended by itself
    pool = FakeChannelPool([None])
    assert [t for d in run(pool, take=3) for t in d.token_ids] == ANSWER[:3]
    assert pool.calls_made[0].cancelled                    # the replica aborts it


def test_a_late_delta_of_the_replica_a_request_left_never_reaches_its_continuation():
    """The request continues elsewhere under the same id; each call has its own key on the channel, so a delta the
    dead replica had in flight is dropped, not read as the new replica's."""
    pool = FakeChannelPool([3, None], late=True)
    out = run(pool)
    assert [t for d in out for t in d.token_ids] == ANSWER and out[-1].finished
    assert len(pool.calls) == 2 and pool.calls[1].resume is not None


def test_without_its_channel_a_replica_streams_on_the_call_and_the_ingress_opens_one():
    pool = FakeChannelPool([None])
    o = Orchestrator(None, pool, {"block_size": BS, "model_key": KEY}, "", 0, 0.01, channels=True)
    req = PoolRequest("r1", PROMPT, block_hashes(PROMPT, BS, KEY), SamplingParams(max_tokens=len(ANSWER)))

    async def collect():
        return [d async for d in o._decode(req)]
    out = asyncio.run(collect())
    assert [t for d in out for t in d.token_ids] == ANSWER and not out[0].channeled
    assert pool.opened == ["d0"]                           # for the requests after it


def test_the_prefix_source_is_the_replica_caching_most_of_the_prompt():
    """What the ingress names in PoolRequest.prefix_source (a replica that prefills the prompt may pull from it):
    the replica of either pool with the longest cached run of its leading blocks, a decode replica on a tie;
    none when no replica caches any. PoolRequest.prefix_fallback: the other pool's best holder."""
    from router.prefix_index import PrefixIndex

    class Mirror:
        def __init__(self):
            self.index = {"prefill": PrefixIndex(), "decode": PrefixIndex()}

        def start(self):
            pass
    prompt = list(range(100, 200))
    hashes = block_hashes(prompt, BS, KEY)
    o = Orchestrator(object(), FakeDecodePool([]), {"block_size": BS, "model_key": KEY}, "", 0, 0.01)
    assert o.prefix_sources(hashes) == []                          # no index (no state actor)
    o.mirror = Mirror()
    assert o.prefix_sources(hashes) == []                          # both pools' indexes empty (at start-up)
    o.mirror.index["decode"].load_snapshot("d", 0, hashes[:3])
    assert o.prefix_sources(hashes)[0] == ("decode", "d", 3)         # the prefill pool's index still empty
    assert o.cached_tokens(hashes) == 3 * BS and o.remote_prefill(prompt, hashes)
    o.mirror.index["prefill"].load_snapshot("a", 0, hashes[:2])
    o.mirror.index["prefill"].load_snapshot("b", 0, hashes[:5] + [7])
    o.mirror.index["decode"].load_snapshot("d", 0, hashes[:5])
    assert o.prefix_sources(hashes)[0] == ("decode", "d", 5)        # a tie: the decode replica
    # asked second, when the first answers that it no longer holds them: the other pool's best holder
    assert o.prefix_sources(hashes) == [("decode", "d", 5), ("prefill", "b", 5)]
    o.mirror.index["prefill"].load_snapshot("b", 0, hashes[:6])
    assert o.prefix_sources(hashes) == [("prefill", "b", 6), ("decode", "d", 5)]  # the most blocks first
    o.mirror.index["decode"].load_snapshot("d", 0, hashes)
    assert o.prefix_sources(hashes) == [("decode", "d", len(hashes)), ("prefill", "b", 6)]
    assert o.prefix_sources(block_hashes(list(range(300, 340)), BS, KEY)) == []
    o.prefill = None                                                # colocated: decode replicas only
    o.mirror.index["prefill"].load_snapshot("b", 0, hashes)
    assert o.prefix_sources(hashes) == [("decode", "d", len(hashes))]


def test_a_prefix_pull_is_taken_when_moving_the_blocks_beats_computing_them():
    from kvtransfer.config import prefix_pull_pays
    smol = 737_280                                                  # SmolLM2's fp32 block
    # this CPU: ~1,000 prompt tokens/s, pulls at 4 GB/s: 8 blocks are 128 ms to compute, 11.5 ms to pull
    assert prefix_pull_pays(8, smol, 16, (4e9, 1.0), 1.0, 10_000, 10.0)
    # a GPU computing 20,000 tokens/s over a measured 0.1 GB/s link: 6.4 ms to compute, 69 ms to pull
    assert not prefix_pull_pays(8, smol, 16, (1e8, 1.0), 1.0, 200_000, 10.0)
    # before any pull is measured the configured bandwidth counts; before a second of compute, pull
    assert not prefix_pull_pays(8, smol, 16, (0, 0.0), 0.01, 200_000, 10.0)
    assert prefix_pull_pays(8, smol, 16, (1e8, 1.0), 1.0, 0, 0.2)


def test_a_replica_waits_for_a_prefix_export_as_long_as_computing_the_prefix_would_take():
    """The source answers an export between two of its steps. A replica that gave up after a fixed 2 s while the
    source ran a long prefill computed the prefix itself, and under power-of-two routing on two CPU cores that
    cascaded into TTFTs of 10-30 s; it now waits as long as computing would take it, at least 2 s."""
    from kvtransfer.config import PREFIX_EXPORT_TIMEOUT_S, prefix_export_timeout_s
    assert prefix_export_timeout_s(64, 16, 0, 0.0) == PREFIX_EXPORT_TIMEOUT_S == 2.0      # nothing measured yet
    assert prefix_export_timeout_s(64, 16, 5_000, 0.5) == 2.0                            # under a busy second
    # the Zen 1 VM: 157.5 prompt tokens a busy second; 1,024 tokens would take 6.5 s to compute
    assert prefix_export_timeout_s(64, 16, 1_575, 10.0) == pytest.approx(1024 / 157.5)
    assert prefix_export_timeout_s(64, 16, 200_000, 10.0) == 2.0                          # a GPU: the floor
