"""The ingress's Orchestrator when a decode replica dies mid-stream (router/orchestrator.py): the request
continues on another replica from what the client already has, as one stream, within the move budget, and
never goes back to the replica it left. The decode pool is a fake Serve handle whose replicas "die" (raise
Ray's ActorDiedError) after some deltas; the live cluster's version is in tests/test_reliability.py."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from ray.exceptions import ActorDiedError

from engine import SamplingParams
from engine.block_hash import block_hashes
from replica.messages import PoolRequest, PrefillResult, TokenDelta
from router.openai_protocol import OpenAIError
from router.orchestrator import Orchestrator

BS, KEY = 4, "test-model"
PROMPT = list(range(10, 20))                      # 2 full blocks and a partial one
ANSWER = list(range(100, 112))                    # what an undisturbed run streams, one token per delta


@dataclass
class FakeDecodePool:
    """decode.generate.remote(req): replica k of the calls streams ANSWER from where req.resume leaves off, and
    dies after die_after[k] deltas (None: runs to the end)."""
    die_after: list[int | None]
    drain_after: list[int | None] = field(default_factory=list)      # hand the request over after n deltas
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
        return self._stream(req, f"d{k}", self.die_after[k], drain)

    async def _stream(self, req, name, die_after, drain_after):
        start = len(req.resume.token_ids) if req.resume is not None else 0
        for i, tok in enumerate(ANSWER[start:]):
            if die_after is not None and i == die_after:
                raise ActorDiedError()
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


def run(pool: FakeDecodePool, max_moves: int = 3) -> list[TokenDelta]:
    o = Orchestrator(None, pool, {"block_size": BS, "model_key": KEY}, "", 0, 0.01, max_moves=max_moves)
    req = PoolRequest("r1", PROMPT, block_hashes(PROMPT, BS, KEY), SamplingParams(max_tokens=len(ANSWER)))

    async def collect():
        return [d async for d in o._decode(req)]
    return asyncio.run(collect())


@pytest.fixture(autouse=True)
def _no_serve_context(monkeypatch):
    monkeypatch.setattr("router.orchestrator._own_serve_request_ids", lambda rid: None)


def test_a_replica_dying_mid_stream_costs_the_client_nothing():
    pool = FakeDecodePool([3, 4, None])                    # two deaths: 3 tokens, 4 more, then the rest
    out = run(pool)
    assert [t for d in out for t in d.token_ids] == ANSWER                 # no token repeated or skipped
    assert "".join(d.text for d in out) == "".join(f"<{t}>" for t in ANSWER)
    assert out[-1].finished and out[-1].completion_tokens == len(ANSWER)
    first, second, third = pool.calls
    assert first.resume is None and first.avoid == ()
    assert second.resume.token_ids == ANSWER[:3] and second.resume.text_chars == len("".join(
        f"<{t}>" for t in ANSWER[:3]))
    assert second.avoid == ("d0",) and third.avoid == ("d0", "d1")        # never back to a replica it left
    assert third.resume.token_ids == ANSWER[:7] and third.num_moves == 2
    # the continuation's block hashes cover prompt + sent tokens, chained from the prompt's
    assert third.block_hashes == block_hashes(PROMPT + ANSWER[:7], BS, KEY)
    assert third.token_ids == PROMPT and third.prefill is None


def test_past_the_move_budget_the_error_goes_up():
    pool = FakeDecodePool([2, 2, None])
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


def test_a_draining_replica_hands_its_request_over_and_the_stream_goes_on():
    pool = FakeDecodePool([None, None, None], drain_after=[0, 4, None])   # handed back at once, then after 5 tokens
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
