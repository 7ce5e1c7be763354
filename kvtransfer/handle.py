"""KVHandle: what a prefill replica hands to a decode replica to name a prompt's pinned KV blocks."""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

import msgpack

from kvtransfer.errors import KVHandleError

HANDLE_VERSION = 2          # 2: the producer's TP size and one agent per producer rank
KINDS = ("nixl", "ray")


def compat_hash(compat_key: str) -> str:
    """A short stable digest of an engine's compat_key(), carried by every handle."""
    return hashlib.blake2b(compat_key.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class KVHandle:
    agent: str                  # producer's transport name (a new one per process incarnation)
    request_id: str
    block_ids: list[int]        # the producer's blocks, in prompt order
    block_hashes: list[int]     # the prompt's full-block hashes (engine.block_hash.block_hashes)
    num_tokens: int
    compat: str                 # compat_hash(producer's compat_key)
    expiry: float               # unix time at which the producer unpins, pulled or not
    kind: str = "nixl"          # the transport that can pull it
    tp_size: int = 1            # the producer's: its ranks hold KVHeadLayout(global KV heads, tp_size)'s heads
    agents: tuple[str, ...] = ()  # producer rank r's transport is agents[r]; () means (agent,) (TP 1)

    @property
    def rank_agents(self) -> list[str]:
        """Each producer rank's transport name, rank 0 first (rank 0 holds the lease)."""
        return list(self.agents) or [self.agent]

    def to_bytes(self) -> bytes:
        return msgpack.packb({"v": HANDLE_VERSION, **asdict(self)})

    def __reduce__(self):
        # inside a message Ray pickles (replica/messages.py), a handle still crosses as its msgpack bytes,
        # and is checked when it arrives (from_bytes validates)
        return KVHandle.from_bytes, (self.to_bytes(),)

    @classmethod
    def from_bytes(cls, data: bytes) -> KVHandle:
        try:
            d = msgpack.unpackb(data)
        except Exception as e:
            raise KVHandleError(f"a KVHandle must be msgpack bytes: {e}") from e
        if not isinstance(d, dict) or d.pop("v", None) != HANDLE_VERSION:
            raise KVHandleError(f"not a version-{HANDLE_VERSION} KVHandle")
        names = {f.name for f in fields(cls)}
        if set(d) != names:
            raise KVHandleError(f"KVHandle fields differ: missing {sorted(names - set(d))}, "
                                f"unknown {sorted(set(d) - names)}")
        handle = cls(**{**d, "agents": tuple(d["agents"]) if isinstance(d["agents"], list) else d["agents"]})
        handle.validate()
        return handle

    def validate(self) -> None:
        def ints(xs) -> bool:
            return isinstance(xs, list) and all(isinstance(x, int) and x >= 0 for x in xs)
        problems = [
            not (isinstance(self.agent, str) and self.agent) and "agent must be a non-empty string",
            not (isinstance(self.request_id, str) and self.request_id) and "request_id must be a non-empty string",
            not ints(self.block_ids) and "block_ids must be a list of ints >= 0",
            not ints(self.block_hashes) and "block_hashes must be a list of ints >= 0",
            not (isinstance(self.num_tokens, int) and self.num_tokens >= 0) and "num_tokens must be an int >= 0",
            not isinstance(self.compat, str) and "compat must be a string",
            not isinstance(self.expiry, (int, float)) and "expiry must be a unix time",
            self.kind not in KINDS and f"kind must be one of {KINDS}",
            not (isinstance(self.tp_size, int) and self.tp_size >= 1) and "tp_size must be an int >= 1",
            not (isinstance(self.agents, tuple) and all(isinstance(a, str) and a for a in self.agents))
            and "agents must be non-empty strings",
            len(self.rank_agents) != self.tp_size and "agents must name one transport per producer rank",
            self.agents and self.agents[0] != self.agent and "agents[0] must be agent (rank 0)",
        ]
        problems = [p for p in problems if p]
        if problems:
            raise KVHandleError("malformed KVHandle: " + "; ".join(problems))
        if len(self.block_hashes) > len(self.block_ids):
            raise KVHandleError(f"malformed KVHandle: {len(self.block_hashes)} hashes for {len(self.block_ids)} blocks")
