"""A running request moved between two engines with its KV (a drain): A takes it out (migrate_out), exports its
pinned blocks, B pulls them over NIXL and streams on exactly as if it had never moved; no block is left behind.
A pull that cannot happen falls back to a local prefill on B. Two tiny engines in one process."""
from __future__ import annotations

import time

import pytest

from engine import LLMEngine, RemotePrefill, Resume, SamplingParams
from engine.block_hash import block_hashes
from engine.kv_events import BlockRemoved, BlockStored
from kvtransfer import KVHandoff, KVLink
from tests.test_engine_resume import (K, N, PROMPT, SAMPLED, Stream, assert_continues, assert_no_leak,
                                      make_engine, run)

TTL_S = 5


@pytest.fixture(scope="module")
def pair(tiny):
    """Engines A and B with a NIXL KVLink each, on one clock the tests may move past a hand-off's expiry."""
    now = [time.time()]
    events: dict[str, list] = {"a": [], "b": []}
    a = make_engine(tiny, on_kv_event=events["a"].append)
    b = make_engine(tiny, clock=lambda: now[0], on_kv_event=events["b"].append)
    links: dict[str, KVLink] = {}
    peer = lambda agent: links["a"].metadata()                      # noqa: E731 - B only ever pulls from A
    links["a"] = KVLink(a, "source", kind="nixl", peer_metadata=peer, ttl_s=TTL_S, clock=lambda: now[0])
    links["b"] = KVLink(b, "dest", kind="nixl", peer_metadata=peer, clock=lambda: now[0])
    yield a, b, links["a"], now, events
    links["b"].close()
    links["a"].close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from tests.conftest import make_tiny_checkpoint
    return make_tiny_checkpoint(tmp_path_factory.mktemp("migrate"), "llama")


def stored(events: list) -> set[int]:
    return {h for e in events if isinstance(e, BlockStored) for h in e.block_hashes}


def migrate(a: LLMEngine, link: KVLink, params: SamplingParams, rid: str) -> tuple[Stream, KVHandoff, list[int]]:
    """Run a request on A for K tokens, take it out and export its KV: what A's client got, the hand-off,
    and the moved tokens' (prompt + outputs[:-1]) full-block hashes."""
    a.add_request(PROMPT, params, rid)
    part = run(a, rid, until=K)
    out = a.migrate_out(rid)
    part.take(out)
    assert out.finish_reason == "migrated" and out.token_ids == part.tokens
    hashes = block_hashes(PROMPT + out.token_ids[:-1], a.block_size, a.model_key)
    return part, link.export(out, hashes), hashes


def released(link: KVLink, rid: str, timeout_s: float = 10.0) -> bool:
    """Whether A's link hears within `timeout_s` that `rid`'s hand-off is done with (B's notification crosses
    NIXL asynchronously; A's engine loop polls for it the same way)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if rid in link.release_finished():
            return True
        time.sleep(0.01)
    return False


def resume_on(b: LLMEngine, params: SamplingParams, rid: str, part: Stream, handoff: KVHandoff,
              hashes: list[int]) -> Stream:
    remote = RemotePrefill(handoff, hashes, part.tokens[-1], None, deadline=handoff.handle.expiry - 2)
    b.add_request(PROMPT, params, rid, remote=remote, resume=Resume(part.tokens, len(part.text)))
    return run(b, rid)


@pytest.mark.parametrize("case", ["greedy", "sampled"])
def test_a_drained_request_continues_on_another_engine_from_its_pulled_kv(pair, case):
    a, b, link, _, events = pair
    b.pool.reset_prefix_cache()                  # B starts cold: it pulls every block
    params = (SamplingParams(temperature=0, max_tokens=N, ignore_eos=True) if case == "greedy"
              else SamplingParams(**SAMPLED, max_tokens=N, ignore_eos=True))
    a.add_request(PROMPT, params, f"whole-{case}")
    whole = run(a, f"whole-{case}")
    part, handoff, hashes = migrate(a, link, params, f"moved-{case}")
    assert a.pool.num_used_blocks == len(handoff.handle.block_ids)      # pinned until B has pulled
    rest = resume_on(b, params, f"moved-{case}", part, handoff, hashes)
    assert_continues(whole, part, rest)
    m = rest.last.metrics
    assert m.kv_transferred and m.kv_transfer_error is None and m.kv_transfer_blocks == len(hashes) + 1
    assert released(link, f"moved-{case}")                               # B told A it pulled
    # routers learn that B now holds the moved blocks, and A still caches them (nothing was removed)
    assert set(hashes) <= stored(events["b"]) and set(hashes) <= stored(events["a"])
    assert not set(hashes) & {h for e in events["a"] if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert_no_leak(a)
    assert_no_leak(b)


def test_a_hand_off_past_its_deadline_is_prefilled_on_the_destination_and_continues_exactly(pair):
    a, b, link, now, _ = pair
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    a.add_request(PROMPT, params, "whole-late")
    whole = run(a, "whole-late")
    part, handoff, hashes = migrate(a, link, params, "late")
    now[0] += TTL_S + 1                          # the drain took too long: A's pin expired
    rest = resume_on(b, params, "late", part, handoff, hashes)
    assert_continues(whole, part, rest)
    assert not rest.last.metrics.kv_transferred and rest.last.metrics.kv_transfer_error
    assert released(link, "late")                # A unpins the expired hand-off
    assert_no_leak(a)
    assert_no_leak(b)


def test_a_request_drained_while_its_kv_arrives_is_replayed_whole_and_leaks_nothing(pair):
    """Drained again before its pull ended: no blocks go with it (its whole output is replayed elsewhere);
    the reserved blocks are freed once the pull has ended."""
    a, b, link, _, _ = pair
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    part, handoff, hashes = migrate(a, link, params, "twice")
    remote = RemotePrefill(handoff, hashes, part.tokens[-1], None, deadline=handoff.handle.expiry - 2)
    b.add_request(PROMPT, params, "twice", remote=remote, resume=Resume(part.tokens, len(part.text)))
    b.step()                                               # blocks reserved, the pull started
    assert b.scheduler.loading
    out = b.migrate_out("twice")
    assert out.finish_reason == "migrated" and out.kv_blocks == [] and out.token_ids == part.tokens
    assert out.new_token_ids == [] and out.new_text == ""   # its client has all of it already
    while b.has_unfinished_requests():
        b.step()
    assert released(link, "twice")
    assert_no_leak(a)
    assert_no_leak(b)
