"""The typed messages between the pools (replica/messages.py): they survive pickling as Ray ships them, a
KVHandle inside still crosses as its checked msgpack bytes, and a decode replica's delta says what the
client is told."""
from __future__ import annotations

import pickle
from dataclasses import replace

import msgpack
import pytest

from engine import SamplingParams
from engine.outputs import RequestMetrics, RequestOutput
from kvtransfer import KVHandle, KVHandleError, KVHandoff
from replica.messages import PoolRequest, PrefillResult, TokenDelta

HANDLE = KVHandle("prefill.r1-0a1b2c", "req-1", [4, 9, 2], [11, 2**64 - 1], 40, "c0ffee", 1.8e9, "nixl")


def _request() -> PoolRequest:
    result = PrefillResult("r1", 42, {42: -0.5, 7: -1.25}, 16, KVHandoff(HANDLE, payload=[b"\x00" * 8]))
    return PoolRequest("req-1", list(range(40)), [11, 2**64 - 1],
                       SamplingParams(temperature=0.7, seed=3, stop=["\n"], max_tokens=5), result)


def test_a_pool_request_round_trips_through_pickle():
    req = _request()
    got = pickle.loads(pickle.dumps(req))
    assert got == req and got.prefill.handoff.handle == HANDLE and got.sampling.stop == ["\n"]
    local = replace(req, prefill=None)                 # the decode retry: the same request, prefilled there
    assert pickle.loads(pickle.dumps(local)) == local and req.prefill is not None


def test_a_handle_crosses_as_its_msgpack_bytes_and_is_checked_on_arrival():
    assert HANDLE.to_bytes() in pickle.dumps(_request())
    bad = msgpack.packb({**msgpack.unpackb(HANDLE.to_bytes()), "block_ids": [1, -2, 3]})
    forged = pickle.dumps(_request()).replace(HANDLE.to_bytes(), bad)
    with pytest.raises(KVHandleError, match="block_ids"):
        pickle.loads(forged)


def _output(new: list[int], finished: bool) -> RequestOutput:
    metrics = RequestMetrics(0.0, 0.0, 0.1, 0.2, 0.3 if finished else None, 40, 16, 3, 0)
    return RequestOutput("req-1", list(range(40)), [5, 6, 7][:1 + 2 * finished], "Hello"[:3 + 2 * finished], new,
                         "lo" if finished else "Hel", finished, "length" if finished else None, None, metrics,
                         logprobs=[{5: -0.1}, {6: -0.2}, {7: -0.3}][:1 + 2 * finished])


def test_a_delta_carries_the_new_tokens_and_on_the_last_the_usage():
    first = TokenDelta.of(_output([5], False), replica="d0")
    assert (first.token_ids, first.text, first.finished, first.logprobs, first.replica) == \
        ([5], "Hel", False, [{5: -0.1}], "d0")
    assert first.finish_reason is None and first.prompt_tokens == 0
    last = TokenDelta.of(_output([6, 7], True), transferred=True)
    assert (last.token_ids, last.logprobs, last.replica) == ([6, 7], [{6: -0.2}, {7: -0.3}], None)
    assert (last.finish_reason, last.prompt_tokens, last.completion_tokens, last.cached_tokens, last.transferred) == \
        ("length", 40, 3, 16, True)
    assert pickle.loads(pickle.dumps(last)) == last
