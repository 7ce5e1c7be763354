"""DecodeServer: a decode-pool replica. It hands its engine the prompt's KV named by a KVHandoff (the engine's
scheduler pulls it into blocks once it has room, or prefills the prompt itself if it cannot), or prefills
the prompt when told to, then streams TokenDeltas by continuous batching. In colocated mode it is the only
pool and always prefills itself.

Drain: when Serve stops the replica (a scale-down, a new config rolling out, a node drain), it hands its
running sequences over instead of finishing them: each leaves the engine with its blocks pinned
(LLMEngine.migrate_out) and its stream ends with a TokenDelta whose `migrate` is the KV hand-off of
prompt + outputs (the last output plays the first token); the ingress continues it on another replica,
which pulls the KV. A sequence with no KV to give (still waiting, or arriving while draining) ends with
finish_reason "migrated" and no hand-off: the ingress replays it there.

Channels: an ingress replica opens one DeltaChannel on each decode replica it streams from (`deltas`). A request
that names it sends its first delta on its own call, marked `channeled`, and the rest through the channel: the
deltas one engine step made for all of that ingress's requests here leave as one message, not one each. The
request's own call stays open until it finishes, so an error, a cancellation or the replica's death still
reaches its caller as before. A draining replica ends its channels once no request sends through them."""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator

from engine import RemotePrefill
from engine.outputs import RequestMetrics
from replica.engine_replica import DRAIN_POLL_S, MIGRATION_POLL_S, RESERVE_MARGIN_S, EngineReplica, export_pinned
from replica.messages import DeltaChannel, PoolRequest, PrefillResult, TokenDelta
from replica.names import DECODE

log = logging.getLogger(__name__)
MIGRATED = "migrated"


class DecodeServer(EngineReplica):
    pool = DECODE

    def __init__(self, *args, stream_interval_s: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.draining = False
        self.stream_interval_s = stream_interval_s      # the decode section's stream_interval_ms
        self._channels: dict[str, _Channel] = {}         # DeltaChannel.channel -> its channel here
        threading.Thread(target=self._watch_stop, name="baton-drain-watch", daemon=True).start()

    async def generate(self, req: PoolRequest) -> AsyncIterator[TokenDelta]:
        """The request's deltas: its KV pulled from req.prefill's hand-off, or prefilled here when that is
        None (or the pull fails). The last delta has finished=True and the usage. With req.channel open here,
        only the first comes this way (marked `channeled`); the rest go through the channel."""
        if self.draining:               # a router that has not heard yet: hand it back untouched
            self.metrics.observe_streamed("request", 1)
            yield TokenDelta([], "", True, replica=self.replica, finish_reason=MIGRATED)
            return
        # the hand-off of a prefill, or for a local prefill a pull of its prefix from a prefill replica caching it
        remote = _remote(req.prefill, req.block_hashes) if req.prefill is not None else await self.prefix_remote(req)
        first, last, chan = True, time.perf_counter(), None
        try:
            async for out in self.llm.generate(req.token_ids, req.sampling, req.request_id, remote=remote,
                                               block_hashes=req.block_hashes, resume=req.resume,
                                               lora_request=req.lora, priority=req.priority):
                if out.finish_reason == MIGRATED:
                    delta = await self._hand_over(out, first)
                else:
                    now = time.perf_counter()
                    if first:
                        self.ttft.observe(now - last)
                    elif out.new_token_ids:
                        self.itl.observe((now - last) / len(out.new_token_ids))
                    last = now
                    if first and remote is not None:          # the import has ended (loaded or fallen back) by now
                        if remote.num_tokens is not None:
                            self.observe_prefix_pull(out.metrics)
                        else:
                            self._observe_import(out.metrics)
                    if out.finished:
                        self.metrics.observe_finished(out.metrics, req.lora, len(out.prompt_token_ids),
                                                      len(out.token_ids),
                                                      prefilled=req.prefill is None or not out.metrics.kv_transferred)
                    delta = TokenDelta.of(out, self.replica if first else None, out.metrics.kv_transferred)
                # only a request that joins the channel sends through it; one whose first delta meets a closing
                # channel (a drain began while it prefilled) streams on its call to the end, as its caller reads
                if first and not delta.finished and (joined := self._channels.get(req.channel)) is not None \
                        and not joined.closing:
                    chan = joined
                    chan.users += 1
                    delta.channeled = True
                if chan is not None and not first:
                    chan.put(req.channel_key, delta)
                else:
                    self.metrics.observe_streamed("request", 1)
                    yield delta
                if delta.finished:
                    return
                first = False
                if self.stream_interval_s:
                    # the tokens made meanwhile wait in the engine's queue for this stream, and come out of the
                    # next iteration as one output (AsyncLLM.generate coalesces what a slow reader left there)
                    await asyncio.sleep(max(0.0, now + self.stream_interval_s - time.perf_counter()))
        finally:
            if chan is not None:
                chan.leave()

    async def deltas(self, ch: DeltaChannel) -> AsyncIterator[list[tuple[str, TokenDelta]]]:
        """An ingress replica's channel here: the deltas of its channeled requests, a batch each time this
        event loop gets to it (once per engine step: the step's outputs reach their requests together). Ends
        when the replica drains and no request sends through it; a new one with the same id replaces it."""
        chan = _Channel(asyncio.get_running_loop())
        self._channels[ch.channel] = chan
        chan.closing = self.draining        # after the registration: a drain that began before it missed this one
        try:
            while True:
                if not chan.batch:
                    if chan.closing and chan.users == 0:
                        return
                    chan.ready.clear()
                    await chan.ready.wait()
                    continue
                batch, chan.batch = chan.batch, []
                self.metrics.observe_streamed("channel", len(batch))
                yield batch
        finally:
            if self._channels.get(ch.channel) is chan:
                del self._channels[ch.channel]

    def _close_channels(self) -> None:
        """Draining (from the watch thread): every channel ends once its requests have handed over."""
        for chan in list(self._channels.values()):
            chan.loop.call_soon_threadsafe(chan.close)

    async def _hand_over(self, out, first: bool) -> TokenDelta:
        """The last delta of a sequence drained out of the engine: its new tokens, and the hand-off of its
        pinned blocks (None when it has none, or the export failed: the ingress replays it then)."""
        delta = TokenDelta.of(out, self.replica if first else None)
        if out.kv_blocks:
            try:
                handoff = await export_pinned(self.llm, self.link, out)
                delta.migrate = PrefillResult(self.replica, out.token_ids[-1],
                                              out.logprobs[-1] if out.logprobs else None, 0, handoff)
            except Exception as e:          # noqa: BLE001 - the ingress replays it instead
                log.warning("decode replica %s: export of drained request %s failed (%s); it will be replayed",
                            self.replica, out.request_id, e)
        return delta

    def _watch_stop(self) -> None:
        """Learn that Serve is stopping this replica, then hand over every sequence, now and any that slips in
        (a request added as the drain began) until the process goes. The stop shows in this process within
        DRAIN_POLL_S (serve_stop_begun); a node's drain, which Serve marks before it starts the successors and
        stops this replica, only in the controller's answer, asked every MIGRATION_POLL_S (it answers from the
        state of every replica of the deployment: asked every 0.5 s, it cost an idle 2-core cluster about 6% of a
        core in the controller, the GCS and this replica, 2026-11-29)."""
        asked = time.monotonic()
        while not self._closed:
            time.sleep(DRAIN_POLL_S)
            try:
                if not self.draining:
                    begun = serve_stop_begun()
                    if begun is None or time.monotonic() - asked >= MIGRATION_POLL_S:
                        asked = time.monotonic()
                        begun = serve_is_stopping(self.replica)
                    if begun:
                        log.warning("decode replica %s: Serve is stopping it; handing over its requests", self.replica)
                        self.draining = True
                        self._close_channels()
                if self.draining:
                    # an embedding request is a prompt at most: it finishes here, within the shutdown timeout
                    ids = self.llm.call(lambda eng: [rid for rid, seq in eng.requests.items() if seq.pooling is None])
                    if ids:
                        self.llm.migrate_out(ids)
            except Exception:                           # noqa: BLE001 - keep watching, say why
                log.exception("decode replica %s: drain watch", self.replica)

    def _observe_import(self, m: RequestMetrics) -> None:
        """The transfer metrics of an import: its bytes and seconds, or a failure and a local prefill."""
        if m.kv_transferred:
            self.metrics.observe_transfer(m.kv_transfer_blocks * self.link.transport.block_bytes, m.kv_transfer_seconds)
        elif m.kv_transfer_error is not None:
            self.metrics.transfer_failed()
            self.metrics.transfer_fallback()


class _Channel:
    """One ingress's channel on this replica (DecodeServer.deltas): the deltas waiting for its next message. Used
    only on the replica's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, closing: bool = False):
        self.loop = loop
        self.batch: list[tuple[str, TokenDelta]] = []
        self.ready = asyncio.Event()
        self.users = 0                  # requests sending through it
        self.closing = closing          # the replica drains: no new users, and it ends when the last leaves

    def put(self, key: str, delta: TokenDelta) -> None:
        self.batch.append((key, delta))
        self.ready.set()

    def leave(self) -> None:
        self.users -= 1
        if self.closing and self.users == 0:
            self.ready.set()

    def close(self) -> None:
        self.closing = True
        self.ready.set()


def _remote(p: PrefillResult, hashes: list[int]) -> RemotePrefill:
    """What the engine needs to import the prompt's KV: the producer's pin ends at the handle's expiry."""
    return RemotePrefill(p.handoff, hashes, p.first_token, p.first_logprobs,
                         deadline=p.handoff.handle.expiry - RESERVE_MARGIN_S)


def serve_stop_begun() -> bool | None:
    """Whether Serve has begun this replica's graceful stop, read in this process: None outside a Serve replica,
    or where Ray's private attributes differ (the caller then asks the controller). Private API, checked against
    Ray 2.60: the process's actor instance (Serve's ReplicaActor) has `_replica_impl._shutting_down`, set as
    `perform_graceful_shutdown` begins and before it waits for ongoing requests."""
    try:
        import ray._private.worker as ray_worker
        worker = ray_worker.global_worker
        flag = worker.actors[worker.actor_id]._replica_impl._shutting_down
    except Exception:                                   # noqa: BLE001 - not a Serve replica, or another Ray
        return None
    return flag if isinstance(flag, bool) else None


def serve_is_stopping(replica: str) -> bool:
    """Whether Serve is stopping this replica (STOPPING, or PENDING_MIGRATION off a draining node). Serve runs
    no user code when a graceful stop begins (it waits for ongoing requests, then calls __del__), so the
    replica asks the controller. Private API, checked against Ray 2.60:
    ServeController.get_deployment_details(app, deployment).replicas[].state; outside Serve: False."""
    import ray
    from ray import serve
    from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
    try:
        ctx = serve.get_replica_context()
    except Exception:                                   # noqa: BLE001 - not a Serve replica (tests, bench)
        return False
    try:
        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        details = ray.get(controller.get_deployment_details.remote(ctx.app_name, ctx.deployment), timeout=5)
    except Exception:       # noqa: BLE001 - the controller restarting, or the app mid-deploy (no details yet)
        return False
    return any(r.replica_id == replica and str(getattr(r.state, "value", r.state)) in ("STOPPING", "PENDING_MIGRATION")
               for r in details.replicas)
