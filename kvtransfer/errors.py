"""Typed errors of the KV hand-off; each fails one request, never the engine that raised it."""
from engine.errors import BatonError


class KVTransferError(BatonError):
    """Moving one request's KV blocks failed (peer gone, stale handle, expired pin, NIXL error)."""


class KVCompatibilityError(KVTransferError):
    """The two engines' caches do not hold the same thing (model, dtype, block size, shapes, layout
    version, transport kind): nothing was copied."""


class KVHandleError(BatonError, ValueError):
    """A KVHandle's bytes are not a well-formed handle."""
