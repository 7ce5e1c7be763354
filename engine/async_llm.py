"""AsyncLLM: the streaming interface the workers wrap — add a request, iterate its outputs, abort.

One background thread runs engine steps while there is work; asyncio callers get their outputs
through per-request queues. A consumer that stops iterating (client gone, task cancelled) aborts
its request, which frees its blocks before the next step.

That thread also builds the engine and runs `call()`s, so the model's parallel ops all start from one thread.
OpenMP (torch's intra-op pool) keeps a team of worker threads per thread that ever ran a parallel op, and once
the process holds more of them than it has cores, libgomp stops letting idle workers spin: every parallel
region then pays a futex wake-up. A model loaded on one thread and stepped on another decoded a token in 12.5
ms instead of 7 on this 2-core machine (docs/benchmarks.md, "Serving overhead").
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from typing import Any, AsyncIterator, Callable

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
LOAD_POLL_S = 5e-4          # after a step that made no output (K/V arriving, a prefill chunk): wait this long


class AsyncLLM:
    def __init__(self, model: str | None = None, engine: LLMEngine | None = None, *,
                 build: Callable[[], LLMEngine] | None = None, **kwargs: Any):
        """The engine given, or one built on the engine thread: by `build()`, else from model and kwargs (the
        module docstring says why there). A build that fails raises here."""
        self._lock = threading.Lock()                 # guards the engine: steps vs add/abort
        self._delivering = threading.Lock()           # outputs reach their streams in the order made
        self._wake = threading.Event()
        self._calls: list[tuple[concurrent.futures.Future, Callable, tuple, dict]] = []   # call()s for the thread
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self.engine = engine
        if engine is None:
            build = build or (lambda: LLMEngine(EngineConfig.from_kwargs(model, **kwargs)))
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="baton-engine", daemon=True)
        self._thread.start()
        if build is not None:
            built.result()                            # the build's exception, if it failed

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Yield RequestOutputs as tokens come (deltas in new_text/new_token_ids); the last has finished=True.
        A caller that falls behind the engine gets the outputs that piled up as one (vLLM does the same), so a
        slow consumer costs one hop per wake-up, not one per token. Bad input raises InvalidRequestError before anything is queued. kwargs go to
        LLMEngine.add_request (priority, prefill_only, remote, block_hashes, resume, lora_request)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def add() -> str:
            if params is not None and params.structured is not None:
                self.engine.grammars().compile(params.structured)     # cached for add_request; no lock held
            if kwargs.get("lora_request") is not None:
                self.engine.load_lora(kwargs["lora_request"])         # read from disk without the lock
            with self._lock:
                if self._closed:
                    raise RuntimeError("engine is shut down")
                rid = self.engine.add_request(prompt, params, request_id, **kwargs)
                self._streams[rid] = (loop, queue)
                return rid
        # in a thread: the lock is held for a whole engine step, which must not stall the event loop
        adding = asyncio.ensure_future(asyncio.to_thread(add))
        try:
            rid = await asyncio.shield(adding)
        except asyncio.CancelledError:           # the caller left while the request was being added
            adding.add_done_callback(lambda f: f.cancelled() or f.exception() or self.abort(f.result()))
            raise
        self._wake.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                while not queue.empty() and isinstance(item, RequestOutput) and not item.finished:
                    nxt = queue.get_nowait()     # the caller fell behind: one output carries every delta since
                    item = nxt if isinstance(nxt, BaseException) else coalesce(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> bool:
        """Stop a request whose caller left before its last output. A prefill_only request may have finished
        meanwhile: its caller never saw the output, so no handle to its pinned blocks exists; free them too."""
        with self._lock:
            self._streams.pop(request_id, None)
            return self.engine.abort_request(request_id) or self.engine.release_pinned(request_id)

    def migrate_out(self, request_ids: list[str]) -> list[RequestOutput]:
        """Take these requests out between steps (LLMEngine.migrate_out); each output also ends its
        generate() stream as the last, finished one. Unknown or finished ids are skipped."""
        with self._lock:
            outputs = [out for rid in request_ids if (out := self.engine.migrate_out(rid)) is not None]
            with self._delivering:           # after any step output the engine thread is still handing out
                _deliver([(stream, out) for out in outputs
                          if (stream := self._streams.pop(out.request_id, None)) is not None])
        return outputs

    def call(self, fn, *args, **kwargs):
        """fn(engine, ...) run on the engine thread between two steps (pins, exports, stats), its result or its
        exception returned here; blocks the calling thread until then."""
        if threading.current_thread() is self._thread:      # from a step's or a call's own code: it holds the lock
            return fn(self.engine, *args, **kwargs)
        if self._closed:
            with self._lock:
                return fn(self.engine, *args, **kwargs)
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((done, fn, args, kwargs))
        self._wake.set()
        return done.result()

    def _run_calls(self) -> None:
        """The call()s waiting (the engine lock held)."""
        calls, self._calls = self._calls, []
        for done, fn, args, kwargs in calls:
            try:
                done.set_result(fn(self.engine, *args, **kwargs))
            except BaseException as e:                   # noqa: BLE001 - the caller gets it
                done.set_exception(e)

    def stats(self) -> dict:
        with self._lock:
            return {**self.engine.stats(), "num_requests_tracked": len(self.engine.requests),
                    "num_open_streams": len(self._streams)}

    def shutdown(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        with self._lock:
            for done, *_ in self._calls:
                done.set_exception(RuntimeError("engine is shut down"))
            self._calls.clear()
        self.engine.shutdown()                   # tensor-parallel workers go with the engine

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self, build: Callable[[], LLMEngine] | None, built: concurrent.futures.Future) -> None:
        if build is not None:
            try:
                self.engine = build()
            except BaseException as e:                   # noqa: BLE001 - raised by the constructor
                built.set_exception(e)
                return
            built.set_result(None)
        while not self._closed:
            with self._lock:
                if self._calls:
                    self._run_calls()
                busy = self.engine.has_unfinished_requests()
                try:
                    outputs, error = (self.engine.step() if busy else []), None
                except Exception as e:                   # noqa: BLE001 - fail the batch, keep serving
                    log.exception("engine step failed")
                    outputs, error = [], e
                    for rid in list(self._streams):
                        self.engine.abort_request(rid)
                deliveries = []
                for out in outputs:
                    stream = self._streams.get(out.request_id)
                    if stream:
                        deliveries.append((stream, out))
                        if out.finished:
                            del self._streams[out.request_id]
                if error is not None:
                    deliveries += [(s, error) for s in self._streams.values()]
                    self._streams.clear()
                # hand out after releasing the engine lock (a request being added gets its turn), but before a
                # migrate_out can hand out its last output for the same request: the lock order is _lock, then
                # _delivering, in both places
                self._delivering.acquire()
            try:
                _deliver(deliveries)
            finally:
                self._delivering.release()
            if not busy or not outputs:
                # nothing to hand out (K/V arriving, a prefill chunk, nothing the scheduler can run): wait for a
                # wake-up or LOAD_POLL_S rather than spin on the lock, which burns a core and, as CPython's locks
                # are not fair, keeps an add or an abort waiting for it (a chunk's step is far longer than the wait)
                self._wake.wait(timeout=1.0 if not busy else LOAD_POLL_S)
                self._wake.clear()


def coalesce(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b, the later output, carrying a's deltas too (the other fields are cumulative)."""
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text)


def _deliver(deliveries: list[tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], Any]]) -> None:
    """Hand outputs (or an error) to their streams' event loops, in order: one wake-up of each loop for all of a
    step's outputs there (each call_soon_threadsafe writes to the loop's self-pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
    for (loop, queue), item in deliveries:
        by_loop.setdefault(loop, []).append((queue, item))
    for loop, items in by_loop.items():
        loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


__all__ = ["AsyncLLM"]
