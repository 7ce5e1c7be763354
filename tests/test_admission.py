"""Admission control's rules (router/admission.py) on a fake clock: the measured prefill rate, the predicted
wait against the SLO, the cap, the KV budget, Retry-After, and that every path gives its tokens back."""
from __future__ import annotations

import pytest

from router.admission import Admission
from router.config import AdmissionConfig
from router.openai_protocol import OpenAIError


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def warm(adm: Admission, clock: Clock, rate: float, seconds: float = 4.0) -> None:
    """Serve back-to-back prompts of 0.1 s each at `rate` tokens/s, so the admission measures it."""
    end, size = clock.t + seconds, int(rate / 10)
    while clock.t < end:
        t = adm.admit([size], [size], 1)
        clock.t += size / rate
        t.progress(0, 1)
        t.release(0)


def test_an_idle_cluster_admits_anything_and_a_busy_one_refuses_what_would_miss_the_slo():
    clock = Clock()
    adm = Admission(AdmissionConfig(ttft_slo_s=2.0), clock=clock)
    assert adm.rate() is None
    huge = adm.admit([50_000], [50_000], 1)          # nothing queued: always admitted, even beyond the SLO
    huge.release(0)
    warm(adm, clock, rate=1000.0)
    assert adm.rate() == pytest.approx(1000.0, rel=0.02)
    held = [adm.admit([600], [600], 1) for _ in range(3)]     # 1,800 queued: 1.8 s of work
    with pytest.raises(OpenAIError) as e:
        adm.admit([600], [600], 1)                   # 2.4 s predicted > 2 s
    assert e.value.status == 429 and e.value.code == "rate_limit_exceeded"
    assert e.value.headers["Retry-After"] == "1"     # 0.4 s over, rounded up
    assert adm.admit([100], [100], 1)                # 1.9 s: fits
    held[0].progress(0, 1)                           # its first token: 600 tokens leave the queue
    adm.admit([600], [600], 1)
    assert adm.queued == 1200 + 100 + 600


def test_retry_after_tracks_the_excess_and_is_capped():
    clock = Clock()
    adm = Admission(AdmissionConfig(ttft_slo_s=1.0, max_retry_after_s=5), clock=clock)
    warm(adm, clock, rate=100.0, seconds=30)
    adm.admit([200], [200], 1)
    with pytest.raises(OpenAIError) as e:
        adm.admit([150], [150], 1)                   # 3.5 s predicted: 2.5 s over the SLO
    assert e.value.headers["Retry-After"] == "3"
    with pytest.raises(OpenAIError) as e:
        adm.admit([10_000], [10_000], 1)
    assert e.value.headers["Retry-After"] == "5"


def test_the_hard_cap_applies_before_any_rate_is_known():
    adm = Admission(AdmissionConfig(ttft_slo_s=100.0, max_queued_prompt_tokens=1000), clock=Clock())
    a = adm.admit([800], [800], 1)
    with pytest.raises(OpenAIError):
        adm.admit([300], [300], 1)
    a.release(0)
    adm.admit([300], [300], 1)


def test_the_kv_budget_counts_prompts_and_generated_tokens():
    adm = Admission(AdmissionConfig(kv_budget=1.0), kv_capacity_tokens=lambda: 1000, clock=Clock())
    a = adm.admit([0], [400], 2)                     # two choices of a cached 400-token prompt: 800 tokens
    a.progress(0, 50)
    a.progress(1, 100)                               # 950 held
    with pytest.raises(OpenAIError) as e:
        adm.admit([60], [60], 1)
    assert e.value.status == 429 and "KV" in e.value.message
    a.release(0)                                     # 450 back
    adm.admit([60], [60], 1)


def test_every_path_gives_its_tokens_back_exactly_once():
    adm = Admission(AdmissionConfig(), kv_capacity_tokens=lambda: 10_000, clock=Clock())
    t = adm.admit([100, 50], [120, 50], 2)            # two prompts x two choices
    assert adm.queued == 150 and adm.kv_tokens == 2 * 170
    t.progress(0, 1)
    t.progress(2, 1)
    assert adm.queued == 0                           # choices 1 and 3 share their prompt's prefill
    for c in (0, 1, 2, 3, 3, 0):                     # released twice: counted once
        t.release(c)
    t.progress(1, 5)                                 # a late delta after release changes nothing
    assert adm.queued == 0 and adm.kv_tokens == 0


def test_disabled_admission_admits_everything():
    clock = Clock()
    adm = Admission(AdmissionConfig(enabled=False, ttft_slo_s=0.1, max_queued_prompt_tokens=1), kv_capacity_tokens=lambda: 1,
                    clock=clock)
    warm(adm, clock, rate=10.0)
    for _ in range(5):
        adm.admit([1000], [1000], 1)


def test_the_time_a_first_token_takes_beyond_the_queue_is_learnt_and_kept_as_a_margin():
    """First tokens keep arriving 0.5 s after their predicted queue wait (the KV hand-off, the first decode
    step) while the prefill pool works on at 1,000 tokens/s: the margin learns the 0.5 s, and a queue that
    fitted before is refused."""
    clock = Clock()
    adm = Admission(AdmissionConfig(ttft_slo_s=2.0), clock=clock)
    warm(adm, clock, rate=1000.0)
    assert abs(adm.margin()) < 0.01                            # first tokens came when predicted
    for _ in range(40):
        t = adm.admit([100], [100], 1)                         # predicted: 0.1 s
        clock.t += 0.1
        for _ in range(5):                                     # others' prefills meanwhile (two prompts each:
            f = adm.admit([50, 50], [50, 50], 1)               # no sample of their own)
            clock.t += 0.1
            f.progress(0, 1), f.progress(1, 1), f.release(0), f.release(1)
        t.progress(0, 1)                                       # 0.6 s after admission: 0.5 s late
        t.release(0)
    assert adm.rate() == pytest.approx(1000.0, rel=0.02)
    assert adm.margin() == pytest.approx(0.5, abs=0.05)
    held = [adm.admit([600], [600], 1) for _ in range(2)]      # 1.2 s queued
    with pytest.raises(OpenAIError) as e:
        adm.admit([600], [600], 1)                             # 1.8 s + 0.5 s > 2 s
    assert "2.3 s" in e.value.message
    assert held and adm.admit([100], [100], 1)                 # 1.3 s + 0.5 s: fits


def test_a_streaming_body_the_server_never_started_gives_its_tokens_back():
    """A client that leaves before the response starts: the body generator never runs, nor its `finally`."""
    import gc
    adm = Admission(AdmissionConfig(), kv_capacity_tokens=lambda: 10_000, clock=Clock())
    t = adm.admit([100], [100], 1)

    async def body():
        try:
            yield b"never"
        finally:
            t.release_all()

    b = body()
    t.release_with(b)
    assert adm.queued == 100 and adm.kv_tokens == 100
    del b
    gc.collect()
    assert adm.queued == 0 and adm.kv_tokens == 0
