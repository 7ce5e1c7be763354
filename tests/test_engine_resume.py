"""A request continued elsewhere (add_request(resume=)) streams exactly what it would have streamed had it never
moved; migrate_out takes a running request out with its blocks pinned. Tiny random Llama, fp32 CPU."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

import pytest

from engine import AsyncLLM, EngineConfig, InvalidRequestError, LLMEngine, Resume, SamplingParams
from engine.loader import resolve_model
from engine.outputs import RequestOutput
from tests.conftest import make_tiny_checkpoint

PROMPT = list(range(40, 70)) * 2                  # 60 tokens, repeated: prompt lookup finds drafts
N, K = 24, 7                                      # tokens of the whole run, tokens before the move
SAMPLED = dict(temperature=1.0, top_p=0.9, seed=11, repetition_penalty=1.3, frequency_penalty=0.5)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}
EOS = 2                                           # the tiny model's and the tokenizer's end of text


@dataclass
class Stream:
    """What a client of one request received: the concatenated deltas and the last output."""
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    last: RequestOutput | None = None

    def take(self, out: RequestOutput) -> None:
        self.tokens += out.new_token_ids
        self.text += out.new_text
        self.last = out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("resume"), "llama")


def make_engine(model: str, clock: Callable[[], float] = time.time, on_kv_event: Callable | None = None,
                **kw) -> LLMEngine:
    """The tiny model with the default model's tokenizer: its first 300 ids decode to bytes and short
    pieces, some of them halves of UTF-8 characters (the detokenizer's held-back text is exercised)."""
    return LLMEngine(EngineConfig(model, tokenizer=resolve_model(None), num_kv_blocks=64, max_model_len=256, **kw),
                     on_kv_event=on_kv_event, clock=clock)


def run(engine: LLMEngine, rid: str, until: int | None = None) -> Stream:
    """Step until the request finishes, or (until=) until its client got that many tokens."""
    got = Stream()
    while engine.has_unfinished_requests() and (until is None or len(got.tokens) < until):
        for out in engine.step():
            if out.request_id == rid:
                got.take(out)
    return got


def assert_no_leak(engine: LLMEngine) -> None:
    """Every block is free (prefix-cached ones are free-but-cached), none is pinned, nothing runs."""
    assert engine.pool.num_free_blocks == engine.pool.num_blocks, f"{engine.pool.num_used_blocks} blocks leaked"
    assert not engine.kv.pinned and not engine.requests and not engine.has_unfinished_requests()


def spanning_stop(engine: LLMEngine, stream: Stream, after: int) -> str:
    """Two characters of the stream's text past its first `after` tokens that no single token decodes to."""
    pieces = [engine.tokenizer.decode([t], skip_special_tokens=True) for t in stream.tokens]
    start = len(engine.tokenizer.decode(stream.tokens[:after + 2], skip_special_tokens=True))
    for i in range(start, len(stream.text) - 1):
        s = stream.text[i:i + 2]
        if "\ufffd" not in s and not any(s in p for p in pieces) and stream.text.find(s) == i:
            return s
    raise AssertionError("no stop string spans two tokens in this text")


def case_params(engine: LLMEngine, case: str) -> SamplingParams:
    """greedy: ends by max_tokens; sampled: seeded, penalised, ends at a stop string spanning tokens; min_tokens:
    seeded, EOS pushed by a bias but held off until K + 5 outputs (the replayed ones count)."""
    if case == "greedy":
        return SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    if case == "min_tokens":
        return SamplingParams(**SAMPLED, max_tokens=N, min_tokens=K + 5, logit_bias={EOS: 100.0})
    engine.add_request(PROMPT, SamplingParams(**SAMPLED, max_tokens=N, ignore_eos=True), "probe")
    stop = spanning_stop(engine, run(engine, "probe"), K)
    return SamplingParams(**SAMPLED, max_tokens=N, ignore_eos=True, stop=[stop])


def interrupted(engine: LLMEngine, params: SamplingParams, rid: str) -> Stream:
    """The first K tokens of a request, then it is aborted (its replica died)."""
    engine.add_request(PROMPT, params, rid)
    part = run(engine, rid, until=K)
    assert len(part.tokens) == K and engine.abort_request(rid)
    return part


def assert_continues(whole: Stream, part: Stream, rest: Stream) -> None:
    assert part.tokens + rest.tokens == whole.tokens
    assert part.text + rest.text == whole.text
    out, ref = rest.last, whole.last
    assert (out.finish_reason, out.stop_reason, out.token_ids, out.text) == \
           (ref.finish_reason, ref.stop_reason, ref.token_ids, ref.text)
    assert out.metrics.num_prompt_tokens == len(PROMPT) and out.metrics.num_output_tokens == len(whole.tokens)


@pytest.mark.parametrize("case", ["greedy", "sampled", "min_tokens"])
def test_a_replayed_request_streams_on_exactly_where_its_client_left_off(tiny, case):
    engine = make_engine(tiny)
    params = case_params(engine, case)
    engine.add_request(PROMPT, params, "whole")
    whole = run(engine, "whole")
    if case == "greedy":
        assert whole.last.finish_reason == "length" and len(whole.tokens) == N
    elif case == "min_tokens":
        assert whole.last.finish_reason == "stop" and whole.tokens.index(EOS) == K + 5 == len(whole.tokens) - 1
    else:
        assert whole.last.finish_reason == "stop" and whole.last.stop_reason == params.stop[0]
    part = interrupted(engine, params, "moved")
    resume = Resume(part.tokens, len(part.text))
    for dest in (engine, make_engine(tiny)):
        dest.add_request(PROMPT, params, "moved", resume=resume)
        rest = run(dest, "moved")
        assert_continues(whole, part, rest)
        if dest is engine:                 # the prompt and the first outputs come from the prefix cache
            assert rest.last.metrics.num_cached_tokens >= 64
        assert_no_leak(dest)


def test_a_replayed_request_continues_the_same_with_speculative_decoding_on_the_destination(tiny):
    source = make_engine(tiny)
    params = case_params(source, "greedy")
    source.add_request(PROMPT, params, "whole")
    whole = run(source, "whole")
    part = interrupted(source, params, "moved")
    dest = make_engine(tiny, speculative_config=NGRAM)
    dest.add_request(PROMPT, params, "moved", resume=Resume(part.tokens, len(part.text)))
    rest = run(dest, "moved")
    assert_continues(whole, part, rest)
    assert rest.last.metrics.spec_num_drafts > 0
    assert_no_leak(dest)


def test_a_resume_that_leaves_nothing_to_generate_is_refused_and_leaks_nothing(tiny):
    engine = make_engine(tiny)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    engine.add_request(PROMPT, params, "r")
    whole = run(engine, "r")
    toks = whole.tokens
    refused = [
        (params, Resume(toks, len(whole.text)), "already end the request \\(length\\)"),
        (SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[toks[3]]), Resume(toks[:5], 0), "\\(stop\\)"),
        (SamplingParams(temperature=0, max_tokens=N, stop=[whole.text[1:3]]), Resume(toks[:5], 0), "\\(stop\\)"),
        (SamplingParams(temperature=0, max_tokens=None, ignore_eos=True), Resume(toks * 9, 0), "\\(length\\)"),   # past max_model_len
        (params, Resume(toks[:5], 10_000), "characters were sent"),
        (params, Resume([], 0), "needs the output tokens"),
        (params, Resume([1 << 20], 0), "must be in"),
    ]
    for p, resume, why in refused:
        with pytest.raises(InvalidRequestError, match=why):
            engine.add_request(PROMPT, p, "again", resume=resume)
        assert_no_leak(engine)
    engine.add_request(PROMPT, params, "again", resume=Resume(toks[:-1], 0))     # the id is free; one token left
    rest = run(engine, "again")
    assert rest.tokens == toks[-1:] and rest.last.finish_reason == "length"


def test_migrate_out_pins_a_running_requests_kv_and_replays_a_waiting_one(tiny):
    engine = make_engine(tiny, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    engine.add_request(PROMPT, params, "running")
    engine.add_request(PROMPT[:20], params, "waiting")            # max_num_seqs=1: it waits
    part = run(engine, "running", until=K)
    moved = engine.migrate_out("running")
    assert moved.finished and moved.finish_reason == "migrated" and moved.token_ids == part.tokens
    assert moved.new_token_ids == [] and len(moved.kv_blocks) == -(-(len(PROMPT) + K - 1) // 16)
    assert engine.pool.num_used_blocks == len(moved.kv_blocks)     # pinned for the destination's pull
    replay = engine.migrate_out("waiting")
    assert replay.finish_reason == "migrated" and replay.kv_blocks == [] and replay.token_ids == []
    assert engine.migrate_out("running") is None and engine.migrate_out("nobody") is None
    assert engine.release_pinned("running")
    assert_no_leak(engine)


def test_async_migrate_out_ends_the_stream_with_the_migrated_output(tiny):
    engine = make_engine(tiny)
    step = engine.step
    # the engine holds still once the client has 3 tokens, so the drain takes the request mid-stream
    engine.step = lambda: [] if "r" in engine.requests and engine.requests["r"].num_output_tokens >= 3 else step()
    llm = AsyncLLM(engine=engine)

    async def consume() -> list[RequestOutput]:
        outs = []
        async for out in llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), "r"):
            outs.append(out)
            # a consumer that falls behind gets several tokens in one output: count tokens, not outputs
            if not out.finished and sum(len(o.new_token_ids) for o in outs) == 3:
                (moved,) = await asyncio.to_thread(llm.migrate_out, ["r", "unknown"])
                assert moved.finish_reason == "migrated" and moved.kv_blocks
        return outs
    try:
        outs = asyncio.run(consume())
        assert outs[-1].finished and outs[-1].finish_reason == "migrated"
        assert outs[-1].token_ids == [t for o in outs for t in o.new_token_ids] and len(outs[-1].token_ids) == 3
        assert llm.stats()["num_open_streams"] == 0
        assert llm.call(lambda e: e.release_pinned("r"))
        assert llm.call(lambda e: e.pool.num_used_blocks) == 0
    finally:
        llm.shutdown()
