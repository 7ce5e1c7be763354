"""The scheduler without a model: token budget, chunked prefill, admission order, prefix hits, preemption.

A step is simulated the way LLMEngine.step does it: schedule(), then on_computed(seq, n) for every
scheduled (seq, n); a sequence whose tokens are all computed gets one (fake) sampled token appended,
and a sequence with max_tokens outputs finishes: removed from the scheduler, its blocks freed.
"""
from __future__ import annotations

import itertools
import random

import pytest

from engine.config import EngineConfig
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, Status

BS = 4
KEY = "test-model"


def make(num_blocks: int = 64, **cfg) -> tuple[Scheduler, BlockPool]:
    kw = dict(block_size=BS, max_num_seqs=3, max_num_batched_tokens=16)
    kw.update(cfg)
    config = EngineConfig(**kw)
    pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
    return Scheduler(config, KVCacheManager(pool, KEY)), pool


_fresh = itertools.count(10_000, 1000)


def seq(rid: str, prompt, max_tokens: int = 4, priority: int = 0) -> Sequence:
    """`prompt` is token ids, or a length (then distinct tokens, sharing no prefix with any other)."""
    if isinstance(prompt, int):
        start = next(_fresh)
        prompt = list(range(start, start + prompt))
    else:
        prompt = list(prompt)
    return Sequence(rid, prompt, SamplingParams(max_tokens=max_tokens), priority=priority)


def fake_token(s: Sequence) -> int:
    return 50_000 + 7 * s.num_output_tokens + len(s.request_id)


def check_invariants(sched: Scheduler, pool: BlockPool, out: SchedulerOutput) -> None:
    budget = sched.config.max_num_batched_tokens
    assert out.num_tokens <= budget, f"step used {out.num_tokens} tokens, budget {budget}"
    assert len(sched.running) <= sched.config.max_num_seqs
    seen = [s for s, _ in out.scheduled]
    assert len(seen) == len(set(map(id, seen))), "a sequence scheduled twice in one step"
    for s, n in out.scheduled:
        assert n > 0
        assert s.status is Status.RUNNING and s in sched.running
        assert s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * BS >= s.num_computed_tokens + n, "scheduled without KV room"
    for s in out.preempted:
        assert s.status is Status.WAITING and s in sched.waiting and s not in sched.running
        assert s.block_table == [] and s.num_computed_tokens == 0
        assert s not in seen
    # ref counts equal the number of running sequences holding each block
    holders: dict[int, int] = {}
    for s in [*sched.running, *sched.loading.values()]:
        assert len(set(s.block_table)) == len(s.block_table)
        for b in s.block_table:
            holders[b] = holders.get(b, 0) + 1
    for s in sched.waiting:
        assert s.block_table == [], "a waiting sequence holds KV blocks"
    for blk in pool.blocks:
        assert blk.ref_count == holders.get(blk.block_id, 0), f"block {blk.block_id} ref count is off"
    assert pool.num_free_blocks == pool.num_blocks - len(holders)


def step(sched: Scheduler, pool: BlockPool, finished: list[Sequence] | None = None) -> SchedulerOutput:
    for s in sched.finish_loads():         # as LLMEngine does with no first token: recompute the last one
        s.remote = None
        s.num_computed_tokens -= 1
    running_before = list(sched.running)
    out = sched.schedule()
    check_invariants(sched, pool, out)
    still_running = list(running_before)
    for victim in out.preempted:           # each victim is the newest (lowest priority) still running then
        assert victim.sort_key == max(s.sort_key for s in still_running), "preempted a sequence that is not the newest"
        still_running.remove(victim)
    apply(sched, pool, out, finished)
    return out


def apply(sched: Scheduler, pool: BlockPool, out: SchedulerOutput, finished: list[Sequence] | None = None) -> None:
    """What the engine does after the model ran: advance, sample a fake token, finish at max_tokens."""
    for s, n in out.scheduled:
        sched.on_computed(s, n)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(fake_token(s))
            if s.num_output_tokens >= s.params.max_tokens:
                sched.remove(s)
                s.status = Status.FINISHED
                sched.kv.free(s)
                if finished is not None:
                    finished.append(s)


def run_all(sched: Scheduler, pool: BlockPool, max_steps: int = 500) -> tuple[list[SchedulerOutput], list[Sequence]]:
    outs, finished = [], []
    for _ in range(max_steps):
        if not sched.has_work():
            return outs, finished
        outs.append(step(sched, pool, finished))
        assert outs[-1].scheduled or outs[-1].preempted, "no progress: nothing scheduled while work remains"
    raise AssertionError("requests did not finish")


def expected_tokens(s: Sequence, prompt_len: int) -> list[int]:
    """Outputs are a function of the output index only, so a recomputed sequence ends the same way."""
    out = list(s.token_ids[:prompt_len])
    for k in range(s.params.max_tokens):
        out.append(50_000 + 7 * k + len(s.request_id))
    return out


# ---------------------------------------------------------------------------------------------

def test_token_budget_respected_and_used():
    sched, pool = make(max_num_seqs=8)
    seqs = [seq(f"r{i}", 9 + i, max_tokens=5) for i in range(6)]
    for s in seqs:
        sched.add(s)
    outs, finished = run_all(sched, pool)
    assert all(o.num_tokens <= 16 for o in outs)
    assert outs[0].num_tokens == 16, "the first step should fill the budget with prompt tokens"
    assert len(finished) == 6
    assert all(s.num_output_tokens == 5 for s in seqs)


def test_long_prompt_is_chunked():
    sched, pool = make()
    s = seq("long", 40, max_tokens=3)
    sched.add(s)
    sizes = []
    for _ in range(3):
        out = step(sched, pool)
        assert [x for x, _ in out.scheduled] == [s]
        sizes.append(out.scheduled[0][1])
    assert sizes == [16, 16, 8]
    assert s.num_output_tokens == 1, "only the last chunk yields a token"
    out = step(sched, pool)
    assert out.scheduled == [(s, 1)]                  # then one token per decode step


def test_decodes_run_in_the_same_step_as_a_prefill_chunk():
    sched, pool = make()
    a = seq("a", 5, max_tokens=10)
    sched.add(a)
    step(sched, pool)                                 # a's prompt
    b = seq("b", 40, max_tokens=2)
    sched.add(b)
    out = step(sched, pool)
    assert out.scheduled == [(a, 1), (b, 15)]         # a's decode, b's first chunk fills the rest
    out = step(sched, pool)
    assert out.scheduled == [(a, 1), (b, 15)]
    out = step(sched, pool)
    assert out.scheduled == [(a, 1), (b, 10)]
    out = step(sched, pool)
    assert out.scheduled == [(a, 1), (b, 1)]


def test_max_num_seqs_respected():
    sched, pool = make(max_num_seqs=3, max_num_batched_tokens=64)
    seqs = [seq(f"r{i}", 3, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = step(sched, pool)
    assert [x for x, _ in out.scheduled] == seqs[:3]
    assert len(sched.running) == 3 and len(sched.waiting) == 2
    outs, finished = run_all(sched, pool)
    assert all(len(o.scheduled) <= 3 for o in outs)
    assert len(finished) == 5


def test_fcfs_order():
    sched, pool = make(max_num_seqs=1)
    seqs = [seq(f"r{i}", 6, max_tokens=2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    _, finished = run_all(sched, pool)
    assert finished == seqs


def test_fcfs_admission_within_one_step():
    sched, pool = make(max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [seq(f"r{i}", 5 + (i % 3), max_tokens=2) for i in range(5)]
    for s in seqs:
        sched.add(s)
    out = step(sched, pool)
    assert [x for x, _ in out.scheduled] == seqs


def test_lower_priority_value_is_admitted_first():
    sched, pool = make(max_num_seqs=1)
    low = seq("low", 6, max_tokens=2, priority=5)
    normal = seq("normal", 6, max_tokens=2)
    urgent = seq("urgent", 6, max_tokens=2, priority=-1)
    for s in (low, normal, urgent):
        sched.add(s)
    _, finished = run_all(sched, pool)
    assert finished == [urgent, normal, low]


def test_same_priority_keeps_arrival_order():
    sched, pool = make(max_num_seqs=1)
    seqs = [seq(f"r{i}", 6, max_tokens=1, priority=p) for i, p in enumerate([2, 1, 2, 1])]
    for s in seqs:
        sched.add(s)
    _, finished = run_all(sched, pool)
    assert finished == [seqs[1], seqs[3], seqs[0], seqs[2]]


# ---------------------------------------------------------------------------------------------
# prefix cache

def test_prefix_cache_hit_for_a_shared_prefix():
    sched, pool = make()
    shared = list(range(200, 212))                    # 3 full blocks
    a = seq("a", shared + [1, 2], max_tokens=3)
    sched.add(a)
    step(sched, pool)                                 # a's whole prompt is computed and cached
    a_blocks = list(a.block_table)
    b = seq("b", shared + [7, 8, 9], max_tokens=3)
    sched.add(b)
    out = step(sched, pool)
    assert (b, 3) in out.scheduled, "only the 3 tokens after the cached prefix are computed"
    assert b.num_cached_tokens == 12
    assert b.block_table[:3] == a_blocks[:3], "the prefix blocks are shared, not copied"
    assert all(pool.blocks[x].ref_count == 2 for x in a_blocks[:3])
    assert pool.hit_tokens == 12 and pool.query_tokens == 14 + 15
    _, finished = run_all(sched, pool)
    assert b.num_output_tokens == 3


def test_prefix_hit_starts_at_the_hit():
    sched, pool = make()
    prompt = list(range(300, 309))                    # 9 tokens: 2 full blocks + 1
    a = seq("a", prompt, max_tokens=1)
    sched.add(a)
    run_all(sched, pool)
    b = seq("b", prompt, max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(b, 1)]
    assert b.num_computed_tokens == 8 and b.num_cached_tokens == 8


def test_whole_prompt_cached_still_computes_the_last_token():
    sched, pool = make()
    prompt = list(range(400, 408))                    # exactly 2 full blocks
    a = seq("a", prompt, max_tokens=1)
    sched.add(a)
    run_all(sched, pool)
    b = seq("b", prompt, max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    # block 1 holds the last prompt token, which must run to give logits: it cannot be a hit
    assert out.scheduled == [(b, 4)]
    assert b.num_cached_tokens == 4 and b.num_computed_tokens == 4
    for s, n in out.scheduled:
        sched.on_computed(s, n)
    assert b.num_computed_tokens == b.num_tokens


def test_prompt_shorter_than_a_block_has_no_hit():
    sched, pool = make()
    a = seq("a", [5, 6, 7, 8], max_tokens=1)
    sched.add(a)
    run_all(sched, pool)
    b = seq("b", [5, 6, 7, 8], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(b, 4)] and b.num_cached_tokens == 0


def test_different_prefix_no_hit():
    sched, pool = make()
    a = seq("a", list(range(10, 19)), max_tokens=1)
    sched.add(a)
    run_all(sched, pool)
    b = seq("b", [11] + list(range(11, 19)), max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    assert out.scheduled == [(b, 9)] and b.num_cached_tokens == 0


def test_prefix_caching_disabled_has_no_hit():
    sched, pool = make(enable_prefix_caching=False)
    prompt = list(range(300, 309))
    for rid in ("a", "b"):
        s = seq(rid, prompt, max_tokens=1)
        sched.add(s)
        out = sched.schedule()
        assert out.scheduled == [(s, 9)]
        assert s.num_cached_tokens == 0
        run_all_from(sched, pool, out)


def run_all_from(sched, pool, out):
    apply(sched, pool, out)
    run_all(sched, pool)


def test_generated_tokens_are_cached_too():
    """A follow-up turn that repeats prompt + answer hits the blocks filled during decode."""
    sched, pool = make()
    a = seq("a", list(range(500, 506)), max_tokens=6)
    sched.add(a)
    run_all(sched, pool)
    convo = list(a.token_ids)                          # 12 tokens: 3 full blocks
    b = seq("b", convo + [1, 2], max_tokens=1)
    sched.add(b)
    out = sched.schedule()
    # the last generated token was never computed, so block 2 (tokens 8..11) is not cached
    assert b.num_cached_tokens == 8
    assert out.scheduled == [(b, 6)]


# ---------------------------------------------------------------------------------------------
# preemption

def test_newest_running_sequence_is_preempted_and_resumes():
    # 6 blocks of 4 tokens; three 7-token prompts fill them, and the first decode past 8 tokens needs more
    sched, pool = make(num_blocks=6, max_num_seqs=3, max_num_batched_tokens=16)
    a, b, c = seq("a", 7, max_tokens=6), seq("b", 7, max_tokens=6), seq("c", 7, max_tokens=6)
    prompts = {s.request_id: list(s.token_ids) for s in (a, b, c)}
    for s in (a, b, c):
        sched.add(s)
    preempted_at = None
    finished: list[Sequence] = []
    for k in range(200):
        if not sched.has_work():
            break
        out = step(sched, pool, finished)
        if out.preempted and preempted_at is None:
            preempted_at = k
            assert out.preempted == [c], "the newest running sequence is the victim"
            assert c.status is Status.WAITING and c.block_table == [] and c.num_preemptions == 1
            assert c not in [x for x, _ in out.scheduled]
    assert preempted_at is not None, "the scenario should run out of blocks"
    assert a.num_preemptions == 0
    assert sorted(s.request_id for s in finished) == ["a", "b", "c"]
    for s in (a, b, c):
        assert s.status is Status.FINISHED
        assert s.token_ids == expected_tokens(s, 7)
        assert s.token_ids[:7] == prompts[s.request_id]
    assert pool.num_free_blocks == 6


def test_preempted_sequence_keeps_its_generated_tokens():
    sched, pool = make(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=16)
    a, b = seq("a", 7, max_tokens=6), seq("b", 6, max_tokens=6)
    sched.add(a)
    sched.add(b)
    for _ in range(50):
        out = step(sched, pool)
        if out.preempted:
            break
    victim = out.preempted[0]
    assert victim is b
    outputs = list(victim.output_token_ids)
    assert outputs, "b had generated tokens before it was preempted"
    assert victim.num_prompt_tokens == 6
    run_all(sched, pool)
    assert victim.output_token_ids[:len(outputs)] == outputs
    assert victim.token_ids == expected_tokens(victim, 6)


def test_lowest_priority_is_preempted_first():
    sched, pool = make(num_blocks=6, max_num_seqs=3, max_num_batched_tokens=16)
    a = seq("a", 7, max_tokens=6, priority=5)          # oldest, but least important
    b = seq("b", 7, max_tokens=6)
    c = seq("c", 7, max_tokens=6)
    for s in (a, b, c):
        sched.add(s)
    first = None
    finished: list[Sequence] = []
    for _ in range(200):
        if not sched.has_work():
            break
        out = step(sched, pool, finished)
        if out.preempted and first is None:
            first = out.preempted[0]
    assert first is a
    assert len(finished) == 3


def test_pool_returns_to_start_after_everything_finishes():
    sched, pool = make(num_blocks=10, max_num_seqs=3, max_num_batched_tokens=16)
    start = pool.num_free_blocks
    seqs = [seq(f"r{i}", 5 + 3 * i, max_tokens=7) for i in range(6)]
    for s in seqs:
        sched.add(s)
    outs, finished = run_all(sched, pool)
    assert len(finished) == 6
    assert any(o.preempted for o in outs), "the scenario should exercise preemption"
    assert pool.num_free_blocks == start
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not sched.running and not sched.waiting


@pytest.mark.parametrize("seed", range(6))
def test_random_workloads_finish_with_consistent_blocks(seed):
    rng = random.Random(seed)
    sched, pool = make(num_blocks=rng.choice([8, 12, 20]), max_num_seqs=rng.choice([2, 3, 5]),
                       max_num_batched_tokens=rng.choice([8, 16, 32]))
    base = [rng.randrange(1, 100) for _ in range(20)]
    seqs = []
    for i in range(10):
        shared = rng.randrange(0, 13)
        prompt = base[:shared] + [rng.randrange(1, 100) for _ in range(rng.randrange(1, 12))]
        s = seq(f"r{i}", prompt, max_tokens=rng.randrange(1, 8), priority=rng.choice([0, 0, 1]))
        seqs.append((s, len(prompt)))
    pending = list(seqs)
    finished: list[Sequence] = []
    for k in range(2000):
        if pending and rng.random() < 0.4:
            sched.add(pending.pop(0)[0])
        if not sched.has_work():
            if not pending:
                break
            continue
        out = step(sched, pool, finished)
        assert out.scheduled or out.preempted
    assert len(finished) == 10
    for s, n in seqs:
        assert s.token_ids == expected_tokens(s, n)
    assert pool.num_free_blocks == pool.num_blocks


# ---------------------------------------------------------------------------------------------
# chunked prefill off

def test_chunked_prefill_off_never_splits_a_prompt():
    sched, pool = make(enable_chunked_prefill=False, max_num_seqs=4, max_num_batched_tokens=16)
    seqs = [seq("a", 12, max_tokens=3), seq("b", 10, max_tokens=3), seq("c", 3, max_tokens=3)]
    for s in seqs:
        sched.add(s)
    out = step(sched, pool)
    # b does not fit in the 4 tokens left; it is not split, and c behind it waits (FCFS)
    assert out.scheduled == [(seqs[0], 12)]
    outs = [out]
    more, finished = run_all(sched, pool)
    outs += more
    for o in outs:
        for s, n in o.scheduled:
            assert n == 1 or n == s.num_prompt_tokens - s.num_cached_tokens, \
                f"{s.request_id} got a partial chunk of {n}"
    assert len(finished) == 3


def test_chunked_prefill_on_splits_the_same_prompt():
    sched, pool = make(max_num_seqs=4, max_num_batched_tokens=16)
    a, b = seq("a", 12, max_tokens=3), seq("b", 10, max_tokens=3)
    sched.add(a)
    sched.add(b)
    out = step(sched, pool)
    assert out.scheduled == [(a, 12), (b, 4)]


def test_engine_with_chunked_prefill_off_needs_a_budget_for_the_longest_prompt():
    """Without chunking a prompt must fit one step: the config is refused rather than left to hang."""
    from engine.errors import ConfigError, PromptTooLongError
    from engine.llm_engine import LLMEngine
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        LLMEngine(EngineConfig(model="llama-tiny", load_format="dummy", enable_chunked_prefill=False,
                               max_num_batched_tokens=16, num_kv_blocks=256))
    engine = LLMEngine(EngineConfig(model="llama-tiny", load_format="dummy", enable_chunked_prefill=False,
                                    max_num_batched_tokens=16, max_model_len=16, num_kv_blocks=256))
    with pytest.raises(PromptTooLongError):
        engine.add_request(list(range(1, 21)), SamplingParams(max_tokens=2), request_id="long")
    engine.add_request(list(range(1, 15)), SamplingParams(max_tokens=2), request_id="short")
    done = set()
    for _ in range(20):
        done |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert done == {"short"}


# -- imports (decode role): requests whose prompt K/V come from another engine ---------------------------

class FakeConnector:
    """Loads end when the test says so: done() / fail()."""

    def __init__(self):
        self.started: dict[str, tuple[list[int], int]] = {}     # request id -> (blocks, skip_blocks)
        self.cancelled: list[str] = []
        self._done, self._failed = [], {}

    def start_load(self, request_id, source, block_ids, block_hashes, num_tokens, skip_blocks):
        if source == "refuse":
            raise RuntimeError("the producer is gone")
        assert len(block_hashes) == num_tokens // BS and len(block_ids) == -(-num_tokens // BS)
        self.started[request_id] = (list(block_ids), skip_blocks)

    def finished_loads(self):
        done, failed, self._done, self._failed = self._done, self._failed, [], {}
        return done, failed

    def cancel_load(self, request_id):
        self.cancelled.append(request_id)

    def done(self, *request_ids):
        self._done += request_ids

    def fail(self, request_id, error="READ failed"):
        self._failed[request_id] = error


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_importer(num_blocks: int = 64, **cfg) -> tuple[Scheduler, BlockPool, FakeConnector, Clock]:
    sched, pool = make(num_blocks, **cfg)
    sched.connector, sched.clock = FakeConnector(), Clock()
    return sched, pool, sched.connector, sched.clock


def imported(rid: str, prompt, deadline: float = 2000.0, source="handoff", **kw) -> Sequence:
    from engine.block_hash import block_hashes
    from engine.kv_connector import RemotePrefill
    s = seq(rid, prompt, **kw)
    s.remote = RemotePrefill(source, block_hashes(s.token_ids, BS, KEY), None, None, deadline)
    s.block_hashes = list(s.remote.block_hashes)
    return s


def test_an_import_waits_for_room_in_the_queue_then_loads_and_runs():
    sched, pool, conn, _ = make_importer(num_blocks=6)
    hog = seq("hog", 16, max_tokens=2)                   # 4 blocks, 5 with its outputs
    sched.add(hog)
    step(sched, pool)
    x = imported("x", 8, max_tokens=2)                   # needs 2 blocks: not free while hog runs
    sched.add(x)
    step(sched, pool)
    assert x in sched.waiting and "x" not in conn.started and sched.num_awaiting_room == 1
    while not hog.is_finished:
        step(sched, pool)
    step(sched, pool)                                    # hog's blocks are free: x gets them and loads
    assert x.status is Status.WAITING_FOR_REMOTE_KVS and conn.started["x"] == (x.block_table, 0)
    assert sched.num_awaiting_room == 0
    out = step(sched, pool)
    assert out.scheduled == [] and sched.has_work()     # its K/V are not there yet: nothing to run
    conn.done("x")
    out = step(sched, pool)
    assert out.scheduled == [(x, 1)] and x.kv_import.transferred and x.kv_import.blocks == 2
    run_all(sched, pool)
    assert x.is_finished and x.num_output_tokens == 2 and pool.num_free_blocks == pool.num_blocks


def test_an_import_skips_the_blocks_cached_here():
    sched, pool, conn, _ = make_importer()
    prompt = list(range(100, 110))
    sched.add(seq("a", prompt, max_tokens=1))
    run_all(sched, pool)
    x = imported("x", prompt)
    sched.add(x)
    step(sched, pool)
    blocks, skip = conn.started["x"]
    assert skip == 2 and x.num_cached_tokens == 8 and x.kv_import.blocks == 1


def test_imports_respect_max_num_seqs_while_loading():
    sched, pool, conn, _ = make_importer(max_num_seqs=2)
    xs = [imported(f"x{i}", 6) for i in range(3)]
    for x in xs:
        sched.add(x)
    step(sched, pool)
    assert sorted(conn.started) == ["x0", "x1"] and xs[2] in sched.waiting     # a loading import holds a slot
    conn.done("x0")
    step(sched, pool)
    assert "x2" not in conn.started and len(sched.running) + len(sched.loading) == 2
    for _ in range(4):                                  # x0 finishes: x2 takes its slot
        step(sched, pool)
    assert xs[0].is_finished and "x2" in conn.started


def test_imports_keep_priority_order():
    sched, pool, conn, _ = make_importer(max_num_seqs=1)
    late = imported("late", 6, priority=1)
    urgent = imported("urgent", 6, priority=0)
    sched.add(late)
    sched.add(urgent)
    step(sched, pool)
    assert list(conn.started) == ["urgent"]


def test_an_import_behind_prompts_that_spend_the_step_s_budget_starts_its_load_in_that_step():
    """A pull needs no token budget. Held behind prompts that take whole steps (on a slow CPU, seconds each), a
    prefix pull's lease ran out and the prefix was computed after all; it now loads while they compute, and
    the prompts keep their order. Only imports of the head's priority start early, while slots allow."""
    sched, pool, conn, _ = make_importer(max_num_seqs=4)
    a, b = seq("a", 16, max_tokens=1), seq("b", 16, max_tokens=1)        # each a whole step's budget
    low, x, y = imported("low", 8, priority=1), imported("x", 8), imported("y", 8)
    for s in (a, b, low, x, y):
        sched.add(s)
    out = step(sched, pool)
    assert out.scheduled == [(a, 16)] and b in sched.waiting
    assert list(conn.started) == ["x", "y"] and x.status is y.status is Status.WAITING_FOR_REMOTE_KVS
    assert low in sched.waiting and "low" not in conn.started        # below b's priority: it waits its turn
    conn.done("x", "y")
    out = step(sched, pool)
    assert [s for s, _ in out.scheduled] == [x, y, b]       # x and y run (their last token), b next in order
    for _ in range(10):
        if "low" in conn.started:
            break
        step(sched, pool)
    conn.done("low")
    run_all(sched, pool)
    assert all(s.is_finished for s in (a, b, low, x, y)) and pool.num_free_blocks == pool.num_blocks


def test_an_import_past_its_deadline_is_prefilled_here():
    sched, pool, conn, clock = make_importer(num_blocks=6)
    hog = seq("hog", 16, max_tokens=3)
    sched.add(hog)
    step(sched, pool)
    x = imported("x", 8, deadline=clock.now + 5, max_tokens=2)
    sched.add(x)
    step(sched, pool)
    assert x in sched.waiting                            # no room yet, deadline not reached
    clock.now += 10                                      # the producer is about to unpin
    _, finished = run_all(sched, pool)
    assert "x" not in conn.started and x in finished and x.num_output_tokens == 2
    assert x.remote is None and not x.kv_import.transferred and "deadline" in x.kv_import.error


def test_a_failed_load_or_refused_start_is_prefilled_here():
    sched, pool, conn, _ = make_importer()
    x, y = imported("x", 9, max_tokens=2), imported("y", 9, max_tokens=2, source="refuse")
    sched.add(x)
    sched.add(y)
    step(sched, pool)
    assert "y" not in conn.started and "producer is gone" in y.kv_import.error and y in sched.running
    conn.fail("x")
    step(sched, pool)
    assert x in sched.running and x.num_cached_tokens == 0     # prefilled here from the start
    run_all(sched, pool)
    assert x.is_finished and y.is_finished and x.kv_import.error == "READ failed"
    assert x.token_ids == expected_tokens(x, 9) and y.token_ids == expected_tokens(y, 9)
    assert pool.num_free_blocks == pool.num_blocks


def test_an_aborted_import_keeps_its_blocks_until_its_load_ends():
    sched, pool, conn, _ = make_importer()
    x = imported("x", 9)
    sched.add(x)
    step(sched, pool)
    assert not sched.remove(x)                           # still loading: the blocks stay
    x.status = Status.FINISHED
    assert conn.cancelled == ["x"] and pool.num_used_blocks == 3
    step(sched, pool)
    assert pool.num_used_blocks == 3 and sched.num_seqs == 0    # it holds no slot any more
    conn.fail("x", "stalled past expiry")
    step(sched, pool)
    assert pool.num_used_blocks == 0 and not sched.has_work()


def test_a_loaded_import_is_preempted_like_any_request():
    sched, pool, conn, _ = make_importer(num_blocks=5)
    x = imported("x", 8, max_tokens=12)
    sched.add(x)
    step(sched, pool)
    conn.done("x")
    step(sched, pool)
    sched.add(seq("y", 8, max_tokens=12, priority=-1))
    outs, finished = run_all(sched, pool)
    assert x.num_preemptions >= 1 and x in finished and x.token_ids == expected_tokens(x, 8)
