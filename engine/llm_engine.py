"""LLMEngine: the synchronous core loop — add requests, step (schedule, forward, sample), abort.

Prefill role: a request added with prefill_only=True stops after its first token and keeps its
prompt blocks pinned (ref-counted) until release_pinned(); decode role: add_request(remote=...) queues
a request whose prompt K/V a KVConnector (attach_kv_connector) brings from another engine.
Moving a running request: migrate_out() finishes it "migrated" with its blocks pinned like a prefill's;
add_request(resume=...) continues one started elsewhere from its next token.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

import numpy as np
import torch

from engine import generation_config
from engine.config import EngineConfig
from engine.detokenizer import Detokenizer
from engine.device_clock import device_clock
from engine.errors import ConfigError, InvalidRequestError, PromptTooLongError
from engine.block_pool import BlockPool
from engine.kv_cache_manager import KVCacheManager
from engine.kv_connector import KVConnector, RemotePrefill, Resume
from engine.kv_events import KVEvent
from engine.kv_layout import KV_LAYOUT_VERSION
from engine.loader import load_config, resolve_model, shared_tokenizer
from engine.executor import Executor
from engine.outputs import RequestMetrics, RequestOutput
from engine.pooling import PoolingParams, finish, pooling_config
from engine.sampler import Sampler, record_prompt_logprobs
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.structured import StepMasks

log = logging.getLogger(__name__)

MAX_DEFAULT_MODEL_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig, on_kv_event: Callable[[KVEvent], None] | None = None,
                 clock: Callable[[], float] = time.time):
        self.config = config
        self.model_path = resolve_model(config.model)
        self.tokenizer = shared_tokenizer(config.tokenizer or self.model_path)
        hf = load_config(self.model_path)
        # the generation config (before the weights load: a bad one fails fast): its EOS ids end requests too, its
        # sampling fields are the defaults of requests that leave them unset
        self.generation = generation_config.load(self.model_path, config.generation_config,
                                                 config.override_generation_config)
        limit = getattr(hf, "max_position_embeddings", MAX_DEFAULT_MODEL_LEN)
        self.max_model_len = config.max_model_len or min(limit, MAX_DEFAULT_MODEL_LEN)
        if self.max_model_len > limit:
            raise ConfigError(f"max_model_len {self.max_model_len} exceeds the model's {limit} positions")
        if not config.enable_chunked_prefill and self.max_model_len > config.max_num_batched_tokens:
            raise ConfigError(f"without chunked prefill, max_num_batched_tokens ({config.max_num_batched_tokens}) "
                              f"must be >= max_model_len ({self.max_model_len}): a prompt must fit one step")
        self.executor = Executor(config, self.model_path, hf, self.max_model_len)
        self.runner = self.executor.runner                  # rank 0's: the one that samples
        self.hf_config = hf
        # a draft model's weights load first, so the KV budget leaves them room (model_runner.plan_kv_blocks)
        self.draft_runner = None
        method = config.speculative_config.method if config.speculative_config is not None else None
        if method == "draft_model":
            from engine.spec.decoder import load_draft_runner
            self.draft_runner = load_draft_runner(config, hf, self.max_model_len)
        elif method in ("eagle", "eagle3", "mtp"):                  # a head that reads the target's hidden states
            from engine.spec.head import load_head_runner
            self.draft_runner = load_head_runner(config, self.runner, self.max_model_len)
        self.executor.allocate_kv(self.draft_runner)
        self.block_size = config.block_size
        if self.runner.num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(f"the KV cache holds {self.runner.num_blocks * self.block_size} tokens, "
                              f"less than max_model_len {self.max_model_len}: give it more memory")
        self.pool = BlockPool(self.runner.num_blocks, self.block_size, config.enable_prefix_caching, on_kv_event,
                              host_blocks=self.executor.num_host_blocks if config.enable_prefix_caching else 0)
        # the prefix cache's key: KV computed with other weights (packed or not) is other KV; the hand-off's
        # compat_key stays the same (the layout is)
        quant = self.runner.quantization
        self.model_key = self.compat_key() + ("" if quant == "none" else f":q={quant}")
        self.kv = KVCacheManager(self.pool, self.model_key, self.executor.copy_blocks)
        self.scheduler = Scheduler(config, self.kv, clock)
        self.sampler = Sampler(config.seed)
        self.spec = None
        if config.speculative_config is not None:
            from engine.spec.decoder import SpecDecoder
            self.spec = SpecDecoder(self)
        self.eos_ids = self._eos_ids() | set(self.generation.eos_token_ids)
        self.pooling = pooling_config(self.model_path, hf, config.pooling_type)    # embedding requests' pooling
        self._grammars = None                       # engine.structured.GrammarCompiler, made on first use
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, Sequence] = {}
        self._early_outputs: list[RequestOutput] = []      # requests finished when admitted
        self.num_computed_tokens_total = 0          # tokens the model actually ran (prefix hits excluded)
        self.num_prompt_tokens_total = 0            # prompts of requests whose first token was sampled here
        self.num_generation_tokens_total = 0        # tokens sampled here and kept (not a producer's first token)
        self.busy_seconds_total = 0.0               # time spent in model steps (the autoscaler's utilisation)
        # steps that computed something: how many, their wall seconds (all of step()), and the sums of their
        # shapes (SchedulerOutput.shape): a cost model's predicted seconds for them, against the measured
        self.step_totals = {"steps": 0, "seconds": 0.0, "tokens": 0, "pairs": 0.0, "seqs": 0, "context": 0}
        log.info("engine ready: %s (weights %s, %.0f MiB), %s on %s (%d threads), %d KV blocks of %d tokens (%.1f MiB, %d tokens), "
                 "%d host-tier blocks, max_model_len %d, weights loaded in %.1f s", self.model_path, quant,
                 self.runner.weight_bytes / 2**20, self.runner.dtype,
                 self.runner.device, torch.get_num_threads(), self.pool.num_blocks, self.block_size,
                 self.pool.num_blocks * self.runner.block_bytes / 2**20, self.pool.num_blocks * self.block_size,
                 self.pool.host_blocks,
                 self.max_model_len, self.runner.load_seconds)

    def _eos_ids(self) -> set[int]:
        ids = getattr(self.hf_config, "eos_token_id", None)
        out = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            out.add(self.tokenizer.eos_token_id)
        return out

    def compat_key(self) -> str:
        """Model, dtype, KV cache dtype, block size, layer/head shapes, layout version (and longrope's factor set): equal
        keys share KV blocks.
        The model's KV heads, not this rank's: engines of any tensor_parallel_size can share blocks. Weight
        quantization is not in it (the KV layout is the same), beyond the weights' fingerprint."""
        m, kv = self.runner.model, self.config.kv_cache_dtype
        latent = '' if m.kv_parts == 2 else ':latent'              # MLA's one vector a token (engine/kv_layout.py)
        return (f"{self.hf_config.model_type}:{self.hf_config.vocab_size}:{self.hf_config.hidden_size}:"
                f"{self.runner.dtype}{'' if kv == 'auto' else ':kv-' + kv}:bs{self.block_size}:L{m.num_layers}:"
                f"kv{m.total_kv_heads}x{m.head_dim}{latent}:v{KV_LAYOUT_VERSION}:"
                f"{self.runner.weight_fingerprint()}{m.rope_tag}")

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP 1)."""
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()

    def grammars(self):
        """The structured-output compiler for this model's tokenizer (thread-safe: callers compile a request's
        grammar before taking the engine's lock, so the step loop never waits for a compile)."""
        with self._grammars_lock:
            if self._grammars is not None:
                return self._grammars
            if self.tokenizer is None:
                raise InvalidRequestError("structured output needs the model's tokenizer")
            from engine.structured import GrammarCompiler
            self._grammars = GrammarCompiler(self.tokenizer, self.hf_config.vocab_size, sorted(self.eos_ids),
                                             max_bytes=self.config.max_grammar_bytes,
                                             timeout_s=self.config.grammar_compile_timeout_s)
        return self._grammars

    # -- requests ---------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, prefill_only: bool = False,
                    remote: RemotePrefill | None = None, block_hashes: list[int] | None = None,
                    resume: Resume | None = None, lora_request=None, pooling: PoolingParams | None = None) -> str:
        """Queue a request. `remote`: its prompt's K/V (and first token) come from another engine
        through the attached KVConnector; if they cannot, it is prefilled here. `block_hashes`: the
        prompt's full-block hashes when the caller has them (a pool request carries them from the
        ingress; an import's are remote.block_hashes), so the prefix cache need not hash it again.
        `resume`: it was started elsewhere; it continues after resume.token_ids, streaming none of them
        (with `remote`, the import covers prompt + resume.token_ids[:-1], see engine/kv_connector.py).
        `lora_request` (engine.lora.LoRARequest): run under that adapter (enable_lora); its files are
        loaded and checked here if they are not cached, and a bad adapter fails this request alone.
        `pooling` (engine/pooling.py): an embedding request; it ends when its prompt is computed, its output's
        `embedding` the pooled vector, and samples nothing (`params` are not read)."""
        if pooling is not None:
            pooling.validate(self.hf_config.hidden_size, self.pooling.matryoshka)
            if remote is not None or prefill_only or resume is not None:
                raise InvalidRequestError("an embedding request runs where it is computed: no hand-off, no resume")
            params = SamplingParams(max_tokens=1, temperature=0.0)
        params = params or SamplingParams()
        params.validate()
        ids = self.tokenize(prompt)
        self.check_prompt(ids, pooled=pooling is not None)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if resume is not None and prefill_only:
            raise InvalidRequestError("a resumed request cannot be prefill_only")
        if params.prompt_logprobs is not None and (remote is not None or prefill_only):
            raise InvalidRequestError("prompt_logprobs need the prompt computed where the request decodes, "
                                      "not imported or handed off")
        seq = Sequence(request_id, ids, params, priority=priority, prefill_only=prefill_only, remote=remote)
        if pooling is not None:
            seq.pooling, seq.pool_kind = pooling, self.pooling.type
        self._token_rules(seq)
        if lora_request is not None:
            seq.lora, seq.lora_key = lora_request, self._loras(lora_request).register(lora_request).key
            seq.lora_held = True
        try:
            self._admit_new(seq, params, resume, remote, block_hashes)
        except BaseException:
            self._release_lora(seq)
            raise
        return request_id

    def _token_rules(self, seq: Sequence) -> None:
        """Checks a request's token ids against the vocabulary and sets what the sampler reads of its token
        rules: the tokens min_tokens keeps from sampling (EOS unless ignore_eos, and stop_token_ids), the allowed
        ids, and bad_words as token ids (vLLM's: each word alone and after a space, where the space makes a new
        first token of the same length). A request for prompt logprobs starts its list with the first token's
        None."""
        p, vocab = seq.params, self.hf_config.vocab_size
        for name, ids in (("logit_bias", p.logit_bias), ("allowed_token_ids", p.allowed_token_ids)):
            if ids and max(ids) >= vocab:
                raise InvalidRequestError(f"{name} token ids must be in [0, {vocab}), got {max(ids)}")
        if p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_ids)
            seq.min_stops = tuple(sorted(t for t in stops if t < vocab))
            if len(seq.min_stops) == vocab or (p.allowed_token_ids and set(p.allowed_token_ids) <= set(seq.min_stops)):
                raise InvalidRequestError("min_tokens with every token that may be sampled a stop token leaves "
                                          "nothing to sample")
        if p.allowed_token_ids is not None:
            seq.allowed_ids = np.unique(np.asarray(p.allowed_token_ids, dtype=np.int64))
        if p.prompt_logprobs is not None:
            seq.prompt_logprobs = [None]                    # the first prompt token has none (vLLM's shape)
        if p.bad_words:
            if self.tokenizer is None:
                raise InvalidRequestError("bad_words need the model's tokenizer")
            words: list[tuple[int, ...]] = []
            for word in p.bad_words:
                plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
                spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
                words.append(plain)
                if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                    words.append(spaced)
            seq.bad_word_ids = tuple(w for w in words if w)

    def _admit_new(self, seq: Sequence, params: SamplingParams, resume: Resume | None,
                   remote: RemotePrefill | None, block_hashes: list[int] | None) -> None:
        ids, request_id = seq.token_ids, seq.request_id
        if self.tokenizer is not None and seq.pooling is None:
            seq.detok = Detokenizer(self.tokenizer, ids, params.stop, params.skip_special_tokens,
                                    params.include_stop_str_in_output)
        if params.structured is not None:
            seq.guide = self.grammars().matcher(params.structured, seq.token_ids)
        if resume is not None:
            self._replay(seq, resume)
        prefix = remote is not None and remote.num_tokens is not None
        hashes = remote.block_hashes if remote is not None and not prefix else block_hashes
        if remote is not None and not prefix and len(hashes) != seq.num_tokens // self.block_size:
            raise InvalidRequestError(f"{len(hashes)} block hashes for {seq.num_tokens // self.block_size} full "
                                      f"blocks to import")
        if prefix:
            n, bs = remote.num_tokens, self.block_size
            if n <= 0 or n % bs or n >= seq.num_tokens or len(remote.block_hashes) != n // bs \
                    or remote.first_token is not None or resume is not None:
                raise InvalidRequestError(f"a prefix pull covers whole blocks short of the prompt ({n} of "
                                          f"{seq.num_tokens} tokens, {len(remote.block_hashes)} hashes), no first token")
            if hashes is not None and list(hashes[:n // bs]) != list(remote.block_hashes):
                raise InvalidRequestError("the prefix pull's block hashes are not this prompt's")
        seq.block_hashes = list(hashes or [])
        seq.sampling_seed = self.sampler.request_seed(params.seed)
        self.requests[request_id] = seq
        self.scheduler.add(seq)

    def load_lora(self, lora_request) -> None:
        """Load and check an adapter into the host cache now (it stays while the cache has room); raises
        engine.lora.LoRAError for a bad one. Thread-safe: callers load before taking the engine's lock."""
        loras = self._loras(lora_request)
        loras.release(loras.register(lora_request).key)

    def _loras(self, lora_request):
        """The runner's LoRAManager; a LoRA request to an engine without enable_lora is refused."""
        if self.runner.lora is None:
            raise InvalidRequestError(f"LoRA adapter {lora_request.lora_name!r} requested, but this engine "
                                      f"was not started with enable_lora")
        return self.runner.lora

    def _release_lora(self, seq: Sequence) -> None:
        """The sequence is gone: its adapter may leave the host cache again."""
        if seq.lora_held:
            self.runner.lora.release(seq.lora_key)
            seq.lora_held = False

    def _replay(self, seq: Sequence, resume: Resume) -> None:
        """Give a new sequence the outputs its client already has, as they evolved where it started (the
        detokenizer's held-back text included), and mark them streamed. Refused if they end it already."""
        toks = resume.token_ids
        if not toks:
            raise InvalidRequestError("a resume needs the output tokens already sent")
        if min(toks) < 0 or max(toks) >= self.hf_config.vocab_size:
            raise InvalidRequestError(f"resumed token ids must be in [0, {self.hf_config.vocab_size})")
        for token in toks:
            if seq.guide is not None and not seq.guide.accept(token):
                raise InvalidRequestError(f"resumed token {token} breaks the request's structured output grammar")
            seq.token_ids.append(token)
            self._check_stop(seq, token, guided=True)
            if seq.finish_reason is not None:
                raise InvalidRequestError(f"the {len(toks)} resumed output tokens already end the request "
                                          f"({seq.finish_reason}): nothing is left to generate")
        text = seq.detok.text if seq.detok is not None else ""
        if not 0 <= resume.text_chars <= len(text):
            raise InvalidRequestError(f"{resume.text_chars} characters were sent of a resumed text of {len(text)}")
        if seq.detok is not None:
            seq.detok.emitted = resume.text_chars
        seq.num_streamed = len(toks)
        if seq.remote is not None:
            if seq.remote.first_token != toks[-1]:
                raise InvalidRequestError("a resumed import's first token must be the last resumed output")
            seq.pending_token = seq.token_ids.pop()

    def attach_kv_connector(self, connector: KVConnector) -> None:
        """Decode role: what fills the blocks of requests added with remote=."""
        self.scheduler.connector = connector

    def check_prompt(self, ids: list[int], pooled: bool = False) -> None:
        """`pooled`: an embedding's input, which may fill max_model_len (it generates nothing)."""
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if pooled and len(ids) > self.max_model_len:
            raise PromptTooLongError(f"the input has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if not pooled and len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                                     f"(room is needed for at least one generated token)")
        vocab = self.hf_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its blocks. False if it was not running."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        self._drop(seq, "abort")
        return True

    def migrate_out(self, request_id: str) -> RequestOutput | None:
        """Take a request out between steps to continue it elsewhere; it finishes "migrated". A running one
        whose K/V cover all its tokens but the last keeps those blocks pinned for export (out.kv_blocks,
        released like a prefill's); any other (waiting, preempted, loading, mid-prefill) holds none and is
        replayed. None if unknown."""
        seq = self.requests.get(request_id)
        if seq is None:
            return None
        movable = (seq.status is Status.RUNNING and not seq.prefill_only and seq.num_output_tokens >= 1
                   and seq.num_computed_tokens == seq.num_tokens - 1)
        self._drop(seq, "migrated", pin=movable)
        seq.restore_pending()                   # a resumed import cut short: the caller replays all outputs
        return self._output(seq)

    def _drop(self, seq: Sequence, reason: str, pin: bool = False) -> None:
        """Finish a sequence now (abort, migration): its blocks are freed, or pinned for export."""
        del self.requests[seq.request_id]
        if self.scheduler.remove(seq):             # else a transfer may still write into its blocks
            if pin:
                self.kv.pin(seq, seq.num_tokens - 1)
            else:
                self.kv.free(seq)
        self._leave_batch(seq)                     # speculative drafts go: the destination proposes anew
        self._release_lora(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
        seq.finished_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._early_outputs)

    def is_waiting_for_kv(self) -> bool:
        """Nothing to compute until a transfer ends (a step would only poll the connector)."""
        s = self.scheduler
        return bool(s.loading) and not s.running and not self._early_outputs

    # -- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        began = time.perf_counter()
        self._start_imported(self.scheduler.finish_loads())
        early, self._early_outputs = self._early_outputs, []
        drafted = self.spec.propose(self.scheduler.running) if self.spec is not None else []
        sched = self.scheduler.schedule()
        self.kv.flush_copies()                      # host-tier copies before the forward writes or reads them
        for seq in sched.preempted:
            self._leave_batch(seq)
            seq.pool_sum, seq.pool_rows = None, 0          # it computes its prompt again
        if not sched.scheduled:
            return early
        shape = sched.shape()
        now = time.monotonic()
        for seq, _ in sched.scheduled:
            seq.first_scheduled_time = seq.first_scheduled_time or now
        t0 = device_clock(self.runner.device)
        masks = StepMasks.start([s for s, _ in sched.scheduled], self.hf_config.vocab_size) \
            if self._grammars is not None and self.runner.device.type == "cuda" else None   # fill during the forward
        capture = self.spec is not None and self.spec.reads_hidden
        logits, samplers, prompt_rows, pooled, hidden = self.runner.execute(sched.scheduled, capture)
        if hidden:
            self.spec.observe_hidden(hidden)
        for seq, n in sched.scheduled:
            if not seq.spec_tokens:                     # a verify step advances after acceptance
                self.scheduler.on_computed(seq, n)
            self.num_computed_tokens_total += n
        for seq, rows in pooled:
            total = rows.float().sum(0)
            seq.pool_sum = total if seq.pool_sum is None else seq.pool_sum.add_(total)
            seq.pool_rows += len(rows)
        plain, verify, embedded = [], [], []
        for seq, row in samplers:
            (embedded if seq.pooling is not None else verify if seq.spec_tokens else plain).append((seq, row))
        if prompt_rows:
            record_prompt_logprobs(logits, prompt_rows)
        result = None
        if plain:
            rows = [r for _, r in plain] if verify or prompt_rows or embedded else slice(None)
            result = self.sampler(logits[rows], [s for s, _ in plain], masks)
        emitted = self.spec.verify(logits, verify) if verify else []
        seconds = device_clock(self.runner.device) - t0
        self.busy_seconds_total += seconds
        now = time.monotonic()
        outputs = early
        for i, (seq, _) in enumerate(plain):
            tok = result.token_ids[i]
            if self.spec is not None:
                self.spec.observe_plain(seq, tok)
            if seq.num_output_tokens == 0:              # its first token is sampled here: its prompt counts here
                self.num_prompt_tokens_total += seq.num_prompt_tokens
            self.num_generation_tokens_total += self._append(seq, [tok], [result.logprobs[i]], now)
            outputs.append(self._output(seq))
        for (seq, _), (toks, lps) in zip(verify, emitted):
            self.num_generation_tokens_total += self._append(seq, toks, lps, now)
            outputs.append(self._output(seq))
        for seq, _ in embedded:
            self.num_prompt_tokens_total += seq.num_prompt_tokens
            seq.embedding = finish(seq.pool_sum, seq.pool_rows, seq.pool_kind, seq.pooling)
            seq.pool_sum, seq.finish_reason = None, "stop"
            seq.first_token_time = seq.last_token_time = now
            self._finish(seq)
            outputs.append(self._output(seq))
        if self.spec is not None:
            self.spec.end_step(drafted, [s for s, _ in verify], sched.scheduled, seconds)
        totals = self.step_totals
        totals["steps"] += 1
        totals["seconds"] += time.perf_counter() - began
        for key, value in zip(("tokens", "pairs", "seqs", "context"), shape):
            totals[key] += value
        return outputs

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list, now: float) -> int:
        """Add sampled tokens one by one (a verify step emits several), stopping where a stop token,
        stop string or length limit falls; the rest are dropped. Returns how many were kept."""
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
        return kept

    def _leave_batch(self, seq: Sequence) -> None:
        """The sequence finished, was aborted or preempted: its draft state and its rows of the
        runner's persistent step tables go."""
        if self.spec is not None:
            self.spec.release(seq)
        self.runner.release(seq.request_id)

    def _check_stop(self, seq: Sequence, token: int, guided: bool = False) -> None:
        """`token` was just appended: feed it to the detokenizer and the grammar (unless `guided`: the caller
        did) and finish the sequence where it ends it."""
        p = seq.params
        too_soon = seq.num_output_tokens <= p.min_tokens    # the first min_tokens outputs never stop it (vLLM)
        stop_id = token in p.stop_token_ids
        by_token = not too_soon and (stop_id or (token in self.eos_ids and not p.ignore_eos))
        stop_str = None
        if seq.detok is not None and (not by_token or p.include_stop_str_in_output):
            # the text of a stop token or EOS that ends the request is left out, as vLLM and OpenAI do
            stop_str = seq.detok.add(token, find_stop=not too_soon)
        if seq.guide is not None and not guided and not seq.guide.accept(token):
            # sampling is masked, so only a token from elsewhere (a prefill replica without the grammar) can
            # land here: end the request rather than stream output its grammar forbids
            log.warning("request %s: token %d breaks its grammar; ending it", seq.request_id, token)
            seq.finish_reason, seq.stop_reason = "abort", None
        elif by_token:
            seq.finish_reason, seq.stop_reason = "stop", token if stop_id else None
        elif stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif seq.guide is not None and seq.guide.terminated:      # the grammar is complete (its end token came)
            seq.finish_reason, seq.stop_reason = "stop", None
        elif (p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens) or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        self._leave_batch(seq)
        seq.status = Status.FINISHED
        seq.finished_time = time.monotonic()
        if seq.detok is not None and not isinstance(seq.stop_reason, str):
            seq.detok.flush()                      # a stop string already cut the text: nothing pends
        del self.requests[seq.request_id]
        self._release_lora(seq)
        if seq.prefill_only:
            # keep the prompt's full and partial blocks for export; the first token's K/V is not there
            self.kv.pin(seq)
        else:
            self.kv.free(seq)

    def _output(self, seq: Sequence) -> RequestOutput:
        finished = seq.is_finished
        migrated = seq.finish_reason == "migrated"
        new_ids = seq.output_token_ids[seq.num_streamed:]
        seq.num_streamed = seq.num_output_tokens
        # a migrated request keeps its held-back text: the destination decides whether a stop string ends it
        new_text = seq.detok.take(finished and not migrated) if seq.detok is not None else ""
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=seq.prompt_token_ids, token_ids=seq.output_token_ids,
            text=seq.detok.text if seq.detok is not None else "", new_token_ids=new_ids,
            new_text=new_text, finished=finished, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            metrics=self._metrics(seq), logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs if seq.params.prompt_logprobs is not None else None,
            embedding=seq.embedding,
            kv_blocks=self.kv.pinned.get(seq.request_id, []) if seq.prefill_only or migrated else [])

    @staticmethod
    def _metrics(seq: Sequence) -> RequestMetrics:
        return RequestMetrics(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                              seq.last_token_time, seq.finished_time, seq.num_prompt_tokens,
                              seq.num_cached_tokens, seq.num_output_tokens, seq.num_preemptions,
                              seq.spec.num_drafts, seq.spec.num_draft_tokens, seq.spec.num_accepted_tokens,
                              seq.spec.draft_time, seq.spec.verify_time, seq.kv_import.transferred,
                              seq.kv_import.blocks, seq.kv_import.seconds, seq.kv_import.error)

    # -- roles for the pools ----------------------------------------------------------------------
    def pin_prefix(self, pin_id: str, hashes: list[int], token_ids: list[int]) -> list[int]:
        """Another engine's prefix pull: pin the leading blocks of `hashes` cached here (a host-tier block is
        copied back first), under `pin_id` (release_pinned ends it). Returns their block ids (possibly none)."""
        blocks = self.kv.pin_prefix(pin_id, hashes, token_ids)
        if blocks and self.runner.device.type == "cuda":
            torch.cuda.synchronize(self.runner.device)          # host-tier copies land before another process reads
        return blocks

    def release_pinned(self, request_id: str) -> bool:
        """Prefill role: the transfer is done (or timed out); unpin the prompt's blocks."""
        return self.kv.unpin(request_id)

    def _start_imported(self, loaded: list[Sequence]) -> None:
        """Imports whose prompt K/V arrived: append the producer's first token, or recompute the last
        prompt token for its logits (its K/V slot is rewritten identically)."""
        now = time.monotonic()
        for seq in loaded:
            seq.first_scheduled_time = now
            remote, seq.remote = seq.remote, None
            if remote.num_tokens is not None:   # a prefix pull: the rest of the prompt is computed here
                continue
            if seq.pending_token is not None:   # a resumed import: its first token was checked and sent
                seq.restore_pending()
                continue
            if remote.first_token is None:
                seq.num_computed_tokens -= 1
                continue
            self._append(seq, [remote.first_token], [remote.first_logprobs], now)
            if seq.is_finished:                 # the prefill's token already ended it: report it now
                self._early_outputs.append(self._output(seq))

    # -- stats ------------------------------------------------------------------------------------
    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.pool.num_blocks,
            "kv_blocks_free": self.pool.num_free_blocks,
            "kv_blocks_used": self.pool.num_used_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_awaiting_kv_room": self.scheduler.num_awaiting_room,     # decode: imports waiting for blocks
            "num_loading_kv": len(self.scheduler.loading),               # decode: imports whose K/V are arriving
            "num_pinned": len(self.kv.pinned),
            "num_preemptions": self.scheduler.num_preemptions_total,
            "prompt_tokens": self.num_prompt_tokens_total,
            "generation_tokens": self.num_generation_tokens_total,
            "prefix_cache_query_tokens": self.pool.query_tokens,
            "prefix_cache_hit_tokens": self.pool.hit_tokens,
            "prefix_cache_host_hit_tokens": self.pool.host_hit_tokens,
            "kv_host_blocks_total": self.pool.host_blocks,
            "kv_host_blocks_used": self.pool.num_host_blocks_used,
            "kv_offloaded_blocks": self.pool.offloaded_blocks,
            "kv_onloaded_blocks": self.pool.onloaded_blocks,
            "kv_block_bytes": self.executor.block_bytes,
            "busy_seconds_total": self.busy_seconds_total,
            "step_totals": dict(self.step_totals),
            **(self.spec.stats() if self.spec is not None else {}),
            **(self.runner.lora.stats() if self.runner.lora is not None else {}),
        }
