"""A TP rank's side of a consumer engine's pulls: what each worker holds, driven through collective_rpc.

    rank 0 (engine)                                   every rank r (worker)
    collective_rpc(start, handoff, dst, skip)  --->   RankPulls.start: its transport READs its heads
    collective_rpc(poll)  <--- {id: done/failed} ---  RankPulls.poll
    merge_polls(per rank) -> ids done / failed everywhere
    rank 0's RankPulls.notify(handoff) for each done: producer rank 0 unpins (kvtransfer/transport.py)

A TP-1 engine keeps using its transport (KVLink) directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kvtransfer.errors import KVTransferError
from kvtransfer.handoff import KVHandoff
from kvtransfer.transport import KVTransport, Pull

DONE, FAILED = "done", "failed"


@dataclass
class RankPulls:
    transport: KVTransport                                   # this rank's, over its cache shard
    pulls: dict[str, Pull] = field(default_factory=dict)     # request id -> its pull in flight

    def start(self, handoff: KVHandoff, dst_block_ids: list[int], skip_blocks: int = 0) -> str:
        """Start this rank's READs; the pull's id is the request id. A pull refused at once polls as failed."""
        rid = handoff.handle.request_id
        try:
            self.pulls[rid] = self.transport.start_pull(handoff, dst_block_ids, skip_blocks, notify=False)
        except KVTransferError as e:
            self.pulls[rid] = _Failed(rid, e)
        return rid

    def poll(self) -> dict[str, str]:
        """The pulls that ended since the last poll: request id -> DONE or FAILED."""
        out = {}
        for rid, pull in list(self.pulls.items()):
            try:
                if not pull.done():
                    continue
                out[rid] = DONE
            except KVTransferError:
                out[rid] = FAILED
            del self.pulls[rid]
        return out

    def notify(self, handoff: KVHandoff) -> None:
        """Rank 0, once every rank's pull of `handoff` is done: the producer may unpin."""
        self.transport.notify_pulled(handoff)


@dataclass(frozen=True)
class _Failed:
    request_id: str
    error: KVTransferError

    def done(self) -> bool:
        raise self.error
