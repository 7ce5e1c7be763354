"""LLMEngine: the synchronous core loop — add requests, step (schedule, forward, sample), abort.

Prefill role: a request added with prefill_only=True stops after its first token and keeps its
prompt blocks pinned (ref-counted) until release_pinned(); decode role: reserve_blocks() takes the
blocks a transfer will fill, and add_request(kv=...) admits a sequence whose prompt K/V are there.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.errors import ConfigError, InvalidRequestError, PromptTooLongError
from engine.block_hash import block_hashes
from engine.block_pool import KV_LAYOUT_VERSION, BlockPool
from engine.kv_events import KVEvent
from engine.loader import load_config, load_tokenizer, resolve_model
from engine.model_runner import ModelRunner
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status

log = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


@dataclass
class KVReservation:
    """Blocks a decode engine set aside for an incoming prompt: the first `num_local_blocks` were
    already in its prefix cache; the rest must be filled by a transfer before add_request(kv=...)."""
    token_ids: list[int]
    block_ids: list[int]
    block_hashes: list[int]
    num_local_blocks: int


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_event: Callable[[KVEvent], None] | None = None):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = load_tokenizer(config.tokenizer or self.model_path)
        hf = load_config(self.model_path)
        limit = getattr(hf, "max_position_embeddings", MAX_DEFAULT_MODEL_LEN)
        self.max_model_len = config.max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions")
        if not config.enable_chunked_prefill and self.max_model_len > config.max_num_batched_tokens:
            raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                              f"must be >= max_model_len ({self.max_model_len}): a prompt must fit one step")
        self.runner = ModelRunner(config, self.model_path, hf, self.max_model_len)
        self.hf_config = hf
        self.block_size = config.block_size
        if self.runner.num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(f"the KV cache holds {self.runner.num_blocks * self.block_size} tokens, "
                              f"less than max_model_len {self.max_model_len}: give it more memory")
        self.pool = BlockPool(self.runner.num_blocks, self.block_size, config.enable_prefix_caching, on_kv_event)
        self.model_key = self.compat_key()
        self.scheduler = Scheduler(config, self.pool, self.model_key)
        self.sampler = Sampler(config.seed)
        self.spec = None
        if config.speculative_config is not None:
            from engine.spec.decoder import SpecDecoder
            self.spec = SpecDecoder(self)
        self.eos_ids = self._eos_ids()
        self.requests: dict[str, Sequence] = {}
        self.pinned: dict[str, list[int]] = {}
        self._early_outputs: list[RequestOutput] = []      # requests finished when admitted
        self.num_computed_tokens_total = 0          # tokens the model actually ran (prefix hits excluded)
        self.busy_seconds_total = 0.0               # time spent in model steps (the autoscaler's utilisation)
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens (%.1f MiB, %d tokens), "
                 "max_model_len %d, weights loaded in %.1f s", self.model_path, self.runner.dtype,
                 self.runner.device, self.pool.num_blocks, self.block_size,
                 self.pool.num_blocks * self.runner.block_bytes / 2**20, self.pool.num_blocks * self.block_size,
                 self.max_model_len, self.runner.load_seconds)

    def _eos_ids(self) -> set[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            out.add(self.tokenizer.eos_token_id)
        return out

    def compat_key(self) -> str:
        """Model, dtype, block size, layer/head shapes, layout version: equal keys share KV blocks."""
        m = self.runner.model
        return (f"{self.hf_config.model_type}:{self.hf_config.vocab_size}:{self.hf_config.hidden_size}:"
                f"{self.runner.dtype}:bs{self.block_size}:L{m.num_layers}:kv{m.num_kv_heads}x{m.head_dim}:"
                f"v{KV_LAYOUT_VERSION}:{self.runner.weight_fingerprint()}")

    # -- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, prefill_only: bool = False,
                    kv: KVReservation | None = None, first_token: int | None = None,
                    first_logprobs: dict[int, float] | None = None, block_hashes: list[int] | None = None) -> str:
        """`block_hashes`: the prompt's full-block hashes when the caller has them (a pool request carries
        them from the ingress), so the prefix cache need not hash the prompt again."""
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt)
        self.check_prompt(ids)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seq = Sequence(request_id, ids, params, priority=priority, prefill_only=prefill_only)
        seq.block_hashes = list(block_hashes or [])
        if self.tokenizer is not None:
            seq.detok = Detokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens)
        self.requests[request_id] = seq
        if kv is not None:
            self._admit_transferred(seq, kv, first_token, first_logprobs)
        else:
            self.scheduler.add(seq)
        return request_id

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                                     f"(room is needed for at least one generated token)")
        vocab = self.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was not running."""
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.remove(seq)
        self._drop_spec(seq)
        self._free(seq)
        seq.status, seq.finish_reason = Status.FINISHED, "abort"
        seq.finished_time = time.monotonic()
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._early_outputs)

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        early, self._early_outputs = self._early_outputs, []
        drafted = self.spec.propose(self.scheduler.running) if self.spec is not None else []
        sched = self.scheduler.schedule()
        for seq in sched.preempted:
            self._drop_spec(seq)
        if not sched.scheduled:
            return early
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            seq.first_scheduled_time = seq.first_scheduled_time or now
        t0 = time.perf_counter()
        logits, samplers = self.runner.execute(sched.scheduled)
        for seq, n in sched.scheduled:
            if not seq.spec_tokens:                     # a verify step advances after acceptance
                self.scheduler.on_computed(seq, n)
            self.num_computed_tokens_total += n
        plain, verify, row = [], [], 0
        for seq in samplers:
            (verify if seq.spec_tokens else plain).append((seq, row))
            row += 1 + len(seq.spec_tokens)
        result = None
        if plain:
            rows = [r for _, r in plain] if verify else slice(None)
            result = self.sampler(logits[rows], [s.params for s, _ in plain], [s.generator for s, _ in plain])
        emitted = self.spec.verify(logits, verify, self.sampler.generator) if verify else []
        seconds = time.perf_counter() - t0
        self.busy_seconds_total += seconds
        now = time.monotonic()
        outputs = early
        for i, (seq, _) in enumerate(plain):
            tok = result.token_ids[i]
            if self.spec is not None:
                self.spec.observe_plain(seq, tok)
            self._append(seq, [tok], [result.logprobs[i]], now)
            outputs.append(self._output(seq))
        for (seq, _), (toks, lps) in zip(verify, emitted):
            self._append(seq, toks, lps, now)
            outputs.append(self._output(seq))
        if self.spec is not None:
            self.spec.end_step(drafted, [s for s, _ in verify], sched.scheduled, seconds)
        return outputs

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> None:
        """Add sampled tokens one by one (a verify step emits several), stopping where a stop token,
        stop string or length limit falls; the rest are dropped."""
        kept = 0
        for token, lp in zip(tokens, logprobs):
            seq.token_ids.append(token)
            if lp is not None:
                seq.logprobs.append(lp)
            kept += 1
            self._check_stop(seq, token)
            if seq.finish_reason is not None:
                break
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        if seq.spec_tokens:
            # the K/V of the last token and of the accepted drafts are valid: `kept` positions
            seq.spec_tokens, seq.spec_probs = [], None
            self.scheduler.on_computed(seq, kept)
        if seq.finish_reason is not None or seq.prefill_only:
            self._finish(seq)

    def trim_blocks(self, seq: Sequence) -> None:
        """Speculation rollback: free blocks past the one that will hold the next token; they hold
        only rejected drafts' K/V (never hashed, so never shared)."""
        keep = -(-seq.num_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def _drop_spec(self, seq: Sequence) -> None:
        if self.spec is not None:
            self.spec.release(seq)

    def _check_stop(self, seq: Sequence, token: int) -> None:
        p = seq.params
        stop_str = seq.detok.add(token) if seq.detok is not None else None
        if token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_ids and not p.ignore_eos:
            seq.finish_reason, seq.stop_reason = "stop", None
        elif stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._drop_spec(seq)
        seq.status = Status.FINISHED
        seq.finished_time = time.monotonic()
        if seq.detok is not None and not isinstance(seq.stop_reason, str):
            seq.detok.flush()                      # a stop string already cut the text: nothing pends
        del self.requests[seq.request_id]
        if seq.prefill_only:
            # keep the prompt's full and partial blocks for export; the first token's K/V is not there
            self.pinned[seq.request_id] = list(seq.block_table)
        else:
            self._free(seq)

    def _free(self, seq: Sequence) -> None:
        if seq.block_table:
            self.pool.free(seq.block_table)
            seq.block_table = []

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        new_ids = seq.output_token_ids[seq.num_streamed:]
        seq.num_streamed = seq.num_output_tokens
        new_text = seq.detok.take(finished) if seq.detok is not None else ""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            text=seq.detok.text if seq.detok is not None else "", new_token_ids=new_ids,
            new_text=new_text, finished=finished, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            metrics=self._metrics(seq), logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            kv_blocks=self.pinned.get(seq.request_id, []) if seq.prefill_only else [])

    @staticmethod
    def _metrics(seq: Sequence) -> RequestMetrics:
        return RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                              seq.last_token_time, seq.finished_time, seq.num_prompt_tokens,
                              seq.num_cached_tokens, seq.num_output_tokens, seq.num_preemptions,
                              seq.spec.num_drafts, seq.spec.num_draft_tokens, seq.spec.num_accepted_tokens,
                              seq.spec.draft_time, seq.spec.verify_time)

    # -- roles for the pools ----------------------------------------------------------------------
    def release_pinned(self, request_id: str) -> bool:
        """Prefill role: the transfer is done (or timed out); unpin the prompt's blocks."""
        blocks = self.pinned.pop(request_id, None)
        if blocks is None:
            return False
        self.pool.free(blocks)
        return True

    def reserve_blocks(self, token_ids: list[int], hashes: list[int] | None = None) -> KVReservation:
        """Decode role: hold blocks for a prompt's K/V; leading blocks in the local prefix cache are
        reused (no transfer needed for them), the rest are fresh and must be filled. `hashes`: the
        prompt's full-block hashes when the caller has them."""
        self.check_prompt(token_ids)
        bs = self.block_size
        n_blocks = -(-len(token_ids) // bs)
        hashes = list(hashes) if hashes is not None else block_hashes(token_ids, bs, self.model_key)
        hit = self.pool.match(hashes, token_ids)
        if not self.pool.can_allocate(n_blocks - len(hit)):
            raise MemoryError(f"no room for {n_blocks - len(hit)} KV blocks")
        self.pool.touch(hit)
        blocks = hit + self.pool.allocate(n_blocks - len(hit))
        self.pool.record_query(len(token_ids), len(hit) * bs)
        return KVReservation(list(token_ids), blocks, hashes, len(hit))

    def cancel_reservation(self, kv: KVReservation) -> None:
        self.pool.free(kv.block_ids)

    def _admit_transferred(self, seq: Sequence, kv: KVReservation, first_token: int | None,
                           first_logprobs: dict[int, float] | None) -> None:
        if kv.token_ids != seq.token_ids:
            raise InvalidRequestError("the KV reservation was made for other tokens")
        seq.block_table = list(kv.block_ids)
        seq.block_hashes = list(kv.block_hashes)
        seq.num_cached_tokens = kv.num_local_blocks * self.block_size
        self.scheduler.on_computed(seq, len(seq.token_ids))     # registers the transferred full blocks
        seq.first_scheduled_time = time.monotonic()
        if first_token is None:
            # recompute the last prompt token to get logits: its K/V slot is rewritten identically
            seq.num_computed_tokens -= 1
        else:
            self._append(seq, [first_token], [first_logprobs], time.monotonic())
        if seq.is_finished:                  # the prefill's token already ended it: report at the next step
            self._early_outputs.append(self._output(seq))
        else:
            seq.status = Status.RUNNING
            self.scheduler.running.append(seq)

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "kv_blocks_used": self.pool.num_used_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_pinned": len(self.pinned),
            "prefix_cache_query_tokens": self.pool.query_tokens,
            "prefix_cache_hit_tokens": self.pool.hit_tokens,
            "busy_seconds_total": self.busy_seconds_total,
            **(self.spec.stats() if self.spec is not None else {}),
        }
