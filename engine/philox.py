"""Counter-based random streams: Philox4x32-10 (Salmon et al., Random123) in vectorised numpy.

A uniform is a pure function of (64-bit seed, token position, purpose), so a seeded request draws the
same numbers alone, in any batch, after preemption, and on another replica that replays it; nothing
is consumed, so nothing depends on how many draws came before.
"""
from __future__ import annotations

import numpy as np

# purposes: the third counter word, so each use of a position has its own stream
SAMPLE, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)      # round multipliers
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)      # key schedule (Weyl) increments
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox4x32(counter: np.ndarray, key: np.ndarray, rounds: int = 10) -> np.ndarray:
    """counter [N, 4], key [N, 2] of 32-bit words (any unsigned dtype) -> [N, 4] uint32.

    Words are held in uint64 so the 32x32 -> 64-bit products are exact."""
    c = [counter[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = key[:, 0].astype(np.uint64), key[:, 1].astype(np.uint64)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _LO, (k1 + _W1) & _LO
        p0, p1 = _M0 * c[0], _M1 * c[2]
        c = [(p1 >> _32) ^ c[1] ^ k0, p1 & _LO, (p0 >> _32) ^ c[3] ^ k1, p0 & _LO]
    return np.stack(c, axis=1).astype(np.uint32)


def uniforms(seeds: np.ndarray, positions: np.ndarray, purpose: int) -> np.ndarray:
    """float64 uniforms in [0, 1) with 53 random bits, one per (seed, position): key = the uint64
    seed, counter = (position, purpose, 0, 0)."""
    seeds = np.asarray(seeds, dtype=np.uint64)
    pos = np.asarray(positions, dtype=np.uint64)
    n = len(seeds)
    key = np.stack([seeds & _LO, seeds >> _32], axis=1)
    counter = np.zeros((n, 4), dtype=np.uint64)
    counter[:, 0] = pos & _LO
    counter[:, 1] = purpose
    out = philox4x32(counter, key).astype(np.uint64)
    bits = ((out[:, 0] >> np.uint64(5)) << np.uint64(26)) | (out[:, 1] >> np.uint64(6))   # 27 + 26 bits
    return bits.astype(np.float64) * (1.0 / (1 << 53))


def as_seed(seed: int) -> int:
    """A request's seed (int64 or uint64 range) as the uint64 key: two's complement for negatives."""
    return seed & 0xFFFF_FFFF_FFFF_FFFF
