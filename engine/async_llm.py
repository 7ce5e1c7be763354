"""AsyncLLM: the streaming interface the workers wrap — add a request, iterate its outputs, abort.

One background thread runs engine steps while there is work; asyncio callers get their outputs
through per-request queues. A consumer that stops iterating (client gone, task cancelled) aborts
its request, which frees its blocks before the next step.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from typing import Any, AsyncIterator

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)
LOAD_POLL_S = 5e-4          # while the only work is K/V arriving: wait this long between steps, not spin


class AsyncLLM:
    def __init__(self, model: str | None = None, engine: LLMEngine | None = None, **kwargs: Any):
        self.engine = engine or LLMEngine(EngineConfig.from_kwargs(model, **kwargs))
        self._lock = threading.Lock()                 # guards the engine: steps vs add/abort
        self._delivering = threading.Lock()           # outputs reach their streams in the order made
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="baton-engine", daemon=True)
        self._thread.start()

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
        """Run fn(engine, ...) under the engine lock (release pinned blocks, stats)."""
        with self._lock:
            return fn(self.engine, *args, **kwargs)

    def stats(self) -> dict:
        with self._lock:
            return {**self.engine.stats(), "num_requests_tracked": len(self.engine.requests),
                    "num_open_streams": len(self._streams)}

    def shutdown(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.shutdown()                   # tensor-parallel workers go with the engine

    # -- engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._closed:
            with self._lock:
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
            if not busy or (not outputs and self.engine.is_waiting_for_kv()):
                self._wake.wait(timeout=1.0 if not busy else LOAD_POLL_S)
                self._wake.clear()


def coalesce(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """b, the later output, carrying a's deltas too (the other fields are cumulative)."""
    return dataclasses.replace(b, new_token_ids=a.new_token_ids + b.new_token_ids, new_text=a.new_text + b.new_text)


def _deliver(deliveries: list[tuple[tuple[asyncio.AbstractEventLoop, asyncio.Queue], Any]]) -> None:
    """Hand outputs (or an error) to their streams' event loops, in order."""
    for (loop, queue), item in deliveries:
        loop.call_soon_threadsafe(queue.put_nowait, item)


__all__ = ["AsyncLLM"]
