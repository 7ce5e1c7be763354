"""The engine's side of a KV import: what a request whose prompt K/V come from elsewhere carries (RemotePrefill),
and what the scheduler asks of the transport that brings them (KVConnector; kvtransfer.KVLink implements it).

    engine.add_request(ids, params, rid, remote=RemotePrefill(...))
    scheduler: waits (priority order, max_num_seqs) until blocks for the prompt are free, reserves them
               -> connector.start_load(...)                    the request is WAITING_FOR_REMOTE_KVS
    each step: connector.finished_loads() -> the request runs from its transferred K/V (first token
               appended), or, if the load failed or its deadline passed first, prefills locally
A prefix pull (RemotePrefill.num_tokens: the leading blocks another replica caches) takes the same way; once
they are in place the request runs as a prefill whose prefix is computed, and its other tokens are computed here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class RemotePrefill:
    source: Any                       # opaque to the engine: a kvtransfer.KVHandoff, handed to the connector
    block_hashes: list[int]           # the prompt's full-block hashes (computed once, at the ingress)
    first_token: int | None           # sampled by the producer, None: decode samples it
    first_logprobs: dict[int, float] | None
    deadline: float                   # unix time after which no load may start (the source goes soon after):
                                      # prefill locally instead
    num_tokens: int | None = None     # None: the source covers the whole prompt (a prefill's hand-off). A
                                      # prefix pull: the source covers these leading tokens (whole blocks, with
                                      # block_hashes theirs), the rest is prefilled here (no first_token)


@dataclass
class Resume:
    """A request started elsewhere (another replica died or drained): what its client already has. The
    engine continues it from the next token without streaming any of this again."""
    token_ids: list[int]              # output tokens already sent to the client, in order
    text_chars: int                   # characters of output text already sent


@dataclass
class ImportStats:
    """How a request's import went (RequestMetrics' kv_transfer_* fields)."""
    transferred: bool = False
    blocks: int = 0                   # blocks pulled (leading blocks cached here are not)
    started: float | None = None      # time.monotonic() at start_load
    seconds: float = 0.0              # start_load to the K/V in place
    error: str | None = None          # why it fell back to a local prefill


class KVConnector(Protocol):
    """What the scheduler asks of a transport. Called from the engine's thread, under its lock."""

    def start_load(self, request_id: str, source: Any, block_ids: list[int], block_hashes: list[int],
                   num_tokens: int, skip_blocks: int) -> None:
        """Start filling block_ids[skip_blocks:] (a prompt of `num_tokens` tokens whose full blocks hash to
        `block_hashes`) from `source`. Raises if it cannot start; then nothing writes into the blocks."""

    def finished_loads(self) -> tuple[list[str], dict[str, str]]:
        """Loads that ended since the last call: (request ids whose K/V are in place, {request id: error})."""

    def cancel_load(self, request_id: str) -> None:
        """The request was aborted. A transfer still in flight may go on writing into its blocks: it is
        reported by finished_loads() once it has ended, and only then does the engine free them."""
