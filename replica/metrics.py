"""A replica's Prometheus metrics (both pools), labelled pool and replica; the ingress merges every
replica's exposition into its own /metrics (router/metrics.py).

Contract names (like vLLM's, stable):
  baton_prompt_tokens_total / baton_generation_tokens_total (counters, as vllm:prompt_tokens_total and
      vllm:generation_tokens_total): a request's prompt and its first token count on the replica that
      sampled that token (the prefill pool's, after a KV hand-off), the tokens after it where decoded
  baton_num_preemptions_total (counter, as vllm:num_preemptions_total): sequences preempted for KV room
  baton_engine_steps_total, baton_engine_step_{seconds,tokens,attention_pairs,sequences,context_tokens}_total
      (counters): the engine's steps that computed tokens, their wall time and their summed shapes (what a
      step cost model reads: `baton plan validate` holds the fit's seconds for them against the measured)
  baton_request_{queue,prefill,decode}_time_seconds (histograms, as vLLM's): a finished request's time
      queued in this engine, prefilling here, decoding here; the ingress adds baton_request_prompt_tokens
      and baton_request_generation_tokens (histograms of finished requests' lengths)
  baton_kv_blocks_used / baton_kv_blocks_free (gauges): blocks held by live sequences or pinned for a
      transfer / blocks allocatable (cached but unreferenced blocks count as free)
  baton_prefix_cache_query_tokens_total / baton_prefix_cache_hit_tokens_total (counters)
  baton_prefix_cache_hits_by_tier_tokens_total{tier="device"|"host"} (counter): the hit tokens by the tier
      they were found in; baton_kv_tier_moves_blocks_total / _bytes_total{direction="offload"|"onload"}:
      blocks copied device -> host (evicted) and host -> device (hit); baton_kv_host_blocks_used / _total
  baton_stream_messages_total / baton_stream_deltas_total{path="request"|"channel"} (counters, decode pool):
      the Serve messages that carried streamed tokens and the token deltas they carried, on a request's own call
      or batched per engine step on an ingress's channel (replica/messages.py DeltaChannel)
"""
from __future__ import annotations

import ctypes
import threading
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from replica.names import PREFILL

TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# the engine's steps that computed something (LLMEngine.step_totals): their count, wall seconds and summed shapes,
# so that a cost model's seconds for the same steps can be held against the measured (plan/validate.py)
STEP_COUNTERS = (
    ("steps", "baton_engine_steps", "Engine steps that computed tokens"),
    ("seconds", "baton_engine_step_seconds", "Wall seconds of those steps (scheduling, forward, sampling, outputs)"),
    ("tokens", "baton_engine_step_tokens", "Tokens those steps computed (prompt chunks and decodes)"),
    ("pairs", "baton_engine_step_attention_pairs", "Attention pairs of those steps: each sequence's new tokens "
                                                   "times the tokens they attend to (causal)"),
    ("seqs", "baton_engine_step_sequences", "Sequences in those steps, summed over steps (mean batch: / steps)"),
    ("context", "baton_engine_step_context_tokens", "KV tokens those steps read: each sequence's cached and new "
                                                    "tokens, summed over steps"),
)


# mallinfo2 walks every malloc arena under its lock: about 5 ms a call in a decode replica that has served load
# (py-spy, 2026-11-29: 10 of the idle replica's 35 Python samples over 10 s of 0.5 s reports), and the engine
# thread's allocations wait for it meanwhile. So a replica with requests reads it this often, and one at rest (where
# the soak takes its memory) at every report.
HEAP_BUSY_INTERVAL_S = 10.0


class _EngineCollector:
    """Reads the engine's counters at scrape time (under the engine lock), so they are never stale copies; the
    heap in use (heap_in_use) at most every HEAP_BUSY_INTERVAL_S while requests run."""

    def __init__(self, pool: str, replica: str, owner):
        self.labels, self.owner = {"pool": pool, "replica": replica}, owner
        self._heap: tuple[float, int | None] = (float("-inf"), None)     # (monotonic time read, bytes)

    def _heap_in_use(self, busy: bool) -> int | None:
        now = time.monotonic()
        if not busy or now - self._heap[0] >= HEAP_BUSY_INTERVAL_S:
            self._heap = (now, heap_in_use())
        return self._heap[1]

    def collect(self):
        s = self.owner.llm.stats()
        t = self.owner.link.stats()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("baton_replica_metrics_timestamp_seconds", "Unix time this replica's metrics were read (the "
                    "ingress /metrics shows each replica's latest report, sent every REPORT_INTERVAL_S)", time.time())
        yield gauge("baton_replica_resident_memory_bytes", "Resident memory of the replica's process",
                    _rss())
        heap = self._heap_in_use(s.get("num_requests_tracked", 0) > 0)
        if heap is not None:
            yield gauge("baton_replica_heap_in_use_bytes", "Bytes in live malloc allocations (glibc mallinfo2, "
                                                           "all arenas and mmapped chunks): unlike resident "
                                                           "memory, freed memory the allocator keeps does not "
                                                           "count, so a leak shows here first", heap)
        yield gauge("baton_kv_blocks_used", "KV blocks held by live sequences or pinned for a transfer",
                    s["kv_blocks_used"])
        yield gauge("baton_kv_blocks_free", "KV blocks allocatable (cached but unreferenced blocks count as free)",
                    s["kv_blocks_free"])
        yield gauge("baton_kv_blocks_total", "KV blocks in the cache", s["kv_blocks_total"])
        yield counter("baton_prompt_tokens", "Prompt tokens of requests whose first token was sampled here (cached "
                                             "ones included)", s["prompt_tokens"])
        yield counter("baton_generation_tokens", "Tokens sampled here (a KV hand-off's first token counts where the "
                                                 "prefill sampled it)", s["generation_tokens"])
        yield counter("baton_num_preemptions", "Sequences preempted for KV room (recomputed later)",
                      s["num_preemptions"])
        steps = s["step_totals"]
        for key, name, doc in STEP_COUNTERS:
            yield counter(name, doc, steps[key])
        yield counter("baton_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                      s["prefix_cache_query_tokens"])
        yield counter("baton_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache",
                      s["prefix_cache_hit_tokens"])
        by_tier = CounterMetricFamily("baton_prefix_cache_hits_by_tier_tokens", "Prompt tokens found in the prefix "
                                      "cache, by the KV tier that held them", labels=names + ["tier"])
        by_tier.add_metric(values + ["device"], s["prefix_cache_hit_tokens"] - s["prefix_cache_host_hit_tokens"])
        by_tier.add_metric(values + ["host"], s["prefix_cache_host_hit_tokens"])
        yield by_tier
        moves = CounterMetricFamily("baton_kv_tier_moves_blocks", "KV blocks copied between tiers: offload "
                                    "(evicted from the device to host memory), onload (a host hit copied back)",
                                    labels=names + ["direction"])
        moved = CounterMetricFamily("baton_kv_tier_moves_bytes", "Bytes of those copies (all TP ranks)",
                                    labels=names + ["direction"])
        for direction, n in (("offload", s["kv_offloaded_blocks"]), ("onload", s["kv_onloaded_blocks"])):
            moves.add_metric(values + [direction], n)
            moved.add_metric(values + [direction], n * s["kv_block_bytes"])
        yield moves
        yield moved
        yield gauge("baton_kv_host_blocks_used", "KV blocks held in the host tier", s["kv_host_blocks_used"])
        yield gauge("baton_kv_host_blocks_total", "KV blocks the host tier holds at most (0: no host tier)",
                    s["kv_host_blocks_total"])
        yield gauge("baton_num_requests_running", "Sequences in the running batch", s["num_running"])
        yield gauge("baton_num_requests_waiting", "Sequences waiting to be scheduled (queue depth)", s["num_waiting"])
        yield gauge("baton_requests_tracked", "Requests the engine holds state for (running, waiting or "
                                              "finishing); zero at rest", s.get("num_requests_tracked", 0))
        yield gauge("baton_open_streams", "Output streams open between the engine and its callers; zero at rest",
                    s.get("num_open_streams", 0))
        yield gauge("baton_kv_pinned_requests", "Prompts whose blocks are pinned for a decode replica's pull "
                                                "(the engine's pins: one no lease will end shows here too)",
                    s["num_pinned"])
        released = CounterMetricFamily("baton_kv_pins_released", "Pinned prompts released, by reason",
                                       labels=names + ["reason"])
        released.add_metric(values + ["pulled"], t["kv_released_notified"])
        released.add_metric(values + ["expired"], t["kv_released_expired"])
        yield released
        yield counter("baton_spec_proposed_tokens", "Draft tokens proposed (speculative decoding)",
                      s.get("spec_num_draft_tokens", 0))
        yield counter("baton_spec_accepted_tokens", "Draft tokens accepted (speculative decoding)",
                      s.get("spec_num_accepted_tokens", 0))
        if "lora_adapters" in s:
            yield counter("baton_lora_loads", "LoRA adapters loaded into a device slot", s["lora_loads"])
            yield counter("baton_lora_evictions", "LoRA adapters evicted from a device slot for another",
                          s["lora_evictions"])
            held = GaugeMetricFamily("baton_lora_adapter_loaded", "LoRA adapters this replica holds: 1 in a device "
                                     "slot, 0 in host memory only", labels=names + ["adapter"])
            for name, in_slot in s["lora_adapters"].values():
                held.add_metric(values + [name], 1.0 if in_slot else 0.0)
            yield held


def _rss() -> int:
    import psutil
    return psutil.Process().memory_info().rss


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2          # glibc >= 2.33; None on musl, macOS, older glibc
    except (AttributeError, OSError):
        return None
    fn.restype, fn.argtypes = _MallInfo2, []
    return fn


_MALLINFO2 = _mallinfo2()


def heap_in_use() -> int | None:
    """Bytes held by live malloc allocations (small chunks in every arena plus mmapped ones), or None."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return m.uordblks + m.hblkhd


class ReplicaMetrics:
    def __init__(self, pool: str, replica: str, owner):
        self.registry = CollectorRegistry()
        self.labels = {"pool": pool, "replica": replica}
        self.registry.register(_EngineCollector(pool, replica, owner))
        names = list(self.labels)
        self.transfer_bytes = Counter("baton_kv_transfer_bytes", "KV bytes pulled into this replica", names,
                                      registry=self.registry).labels(**self.labels)
        self.transfer_seconds = Histogram("baton_kv_transfer_seconds", "Seconds per KV pull (reserve to done)",
                                          names, buckets=TRANSFER_BUCKETS, registry=self.registry).labels(**self.labels)
        self.transfer_failures = Counter("baton_kv_transfer_failures", "KV pulls that failed", names,
                                         registry=self.registry).labels(**self.labels)
        self.transfer_fallbacks = Counter("baton_kv_transfer_fallbacks", "Requests whose KV pull failed and that "
                                          "were prefilled locally instead", names,
                                          registry=self.registry).labels(**self.labels)
        self.prefix_pulls = Counter("baton_prefix_pulls", "Prompts whose cached prefix another replica holds, by "
                                    "what this replica did: pulled, computed (not worth a pull), none (the source "
                                    "no longer had enough of it), failed (the pull fell back to computing)",
                                    names + ["outcome"], registry=self.registry)
        self.prefix_pull_tokens = Counter("baton_prefix_pull_tokens", "Prompt tokens pulled from other replicas "
                                          "instead of computed", names, registry=self.registry).labels(**self.labels)
        self.lora_requests = Counter("baton_lora_requests", "Requests served under each LoRA adapter (base: the "
                                     "base model)", names + ["adapter"], registry=self.registry)
        self.lora_tokens = Counter("baton_lora_tokens", "Tokens of those requests: prompt (prefilled here) and "
                                   "generation", names + ["adapter", "kind"], registry=self.registry)
        self._streamed = {}                     # path -> (messages, deltas): the decode pool streams
        if pool != PREFILL:
            messages = Counter("baton_stream_messages", "Serve messages that carried streamed tokens, by path: a "
                               "request's own call, or an ingress's channel (a batch per step)", names + ["path"],
                               registry=self.registry)
            deltas = Counter("baton_stream_deltas", "Token deltas those messages carried, by path",
                             names + ["path"], registry=self.registry)
            self._streamed = {path: (messages.labels(**self.labels, path=path),
                                     deltas.labels(**self.labels, path=path)) for path in ("request", "channel")}

        def phase(name: str, doc: str):
            return Histogram(name, doc, names, buckets=PHASE_BUCKETS, registry=self.registry).labels(**self.labels)
        self.queue_time = phase("baton_request_queue_time_seconds", "Seconds from a request's arrival at this "
                                "engine to its first step (an import: to its KV's arrival), as vLLM's")
        self.prefill_time = phase("baton_request_prefill_time_seconds", "Seconds from the first step of a prompt "
                                  "computed here to its first token")
        self.decode_time = phase("baton_request_decode_time_seconds", "Seconds from a request's first token to "
                                 "its last, on the decode replica that streamed it")
        self._lock = threading.Lock()
        self._counts = {"bytes": 0, "pulls": 0, "failures": 0, "fallbacks": 0}

    def observe_finished(self, m, lora, prompt_tokens: int, generated_tokens: int, prefilled: bool) -> None:
        """A request that finished on this replica (m: its engine.outputs.RequestMetrics; `prefilled`: its
        first token was sampled here, or its prompt pooled): the time in each phase, and its tokens by adapter. One
        that generated nothing here (an embedding) had no decode phase."""
        if m.first_scheduled_time is not None:
            self.queue_time.observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
            if prefilled and m.first_token_time is not None:
                self.prefill_time.observe(max(m.first_token_time - m.first_scheduled_time, 0.0))
        if self.labels["pool"] != PREFILL and generated_tokens and m.first_token_time is not None \
                and m.last_token_time is not None:
            self.decode_time.observe(max(m.last_token_time - m.first_token_time, 0.0))
        self.observe_lora(lora, prompt_tokens, generated_tokens)

    def observe_streamed(self, path: str, deltas: int) -> None:
        """One message of streamed deltas sent on `path` ("request" or "channel")."""
        messages, counted = self._streamed[path]
        messages.inc()
        counted.inc(deltas)

    def observe_lora(self, lora, prompt_tokens: int, generated_tokens: int) -> None:
        """A finished request of this replica, by adapter (engine.lora.LoRARequest, None: the base model)."""
        name = lora.lora_name if lora is not None else "base"
        self.lora_requests.labels(**self.labels, adapter=name).inc()
        self.lora_tokens.labels(**self.labels, adapter=name, kind="prompt").inc(prompt_tokens)
        if generated_tokens:
            self.lora_tokens.labels(**self.labels, adapter=name, kind="generation").inc(generated_tokens)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(nbytes)
        self.transfer_seconds.observe(seconds)
        with self._lock:
            self._counts["bytes"] += nbytes
            self._counts["pulls"] += 1

    def transfer_failed(self) -> None:
        self.transfer_failures.inc()
        with self._lock:
            self._counts["failures"] += 1

    def transfer_fallback(self) -> None:
        self.transfer_fallbacks.inc()
        with self._lock:
            self._counts["fallbacks"] += 1

    def prefix_pull(self, outcome: str, tokens: int = 0) -> None:
        self.prefix_pulls.labels(**self.labels, outcome=outcome).inc()
        if tokens:
            self.prefix_pull_tokens.inc(tokens)

    def transfer_stats(self) -> dict:
        with self._lock:
            return {f"kv_transfer_{k}": v for k, v in self._counts.items()}

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class LatencyWindow:
    """Recent latencies (seconds) for the autoscaler: a quantile over the last `window_s`, 0 when none.
    Observed and read on the replica's event loop."""

    def __init__(self, window_s: float = 30.0, max_samples: int = 4096):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def observe(self, seconds: float) -> None:
        self._samples.append((time.monotonic(), seconds))

    def quantile(self, q: float) -> float:
        horizon = time.monotonic() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()
        if not self._samples:
            return 0.0
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(q * len(values)))]
