"""The counter-based random streams: Philox4x32-10 bit for bit, and uniforms that depend only on
(seed, position, purpose)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.philox import ACCEPT, DRAFT, RESIDUAL, SAMPLE, as_seed, philox4x32, uniforms

# Random123's known-answer vectors (tests/kat_vectors, "philox4x32 10"): counter, key, expected output
KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


def test_philox4x32_10_matches_random123_known_answers():
    ctr = np.array([c for c, _, _ in KAT], dtype=np.uint64)
    key = np.array([k for _, k, _ in KAT], dtype=np.uint64)
    assert philox4x32(ctr, key).tolist() == [want for _, _, want in KAT]
    for i, (c, k, want) in enumerate(KAT):                   # a row alone gives what it gives in a batch
        assert philox4x32(ctr[i:i + 1], key[i:i + 1])[0].tolist() == want


def test_uniforms_depend_only_on_seed_position_and_purpose():
    seeds = np.array([1, 2, 2**64 - 1, 7, 7], dtype=np.uint64)
    pos = np.array([0, 5, 5, 100, 101])
    u = uniforms(seeds, pos, SAMPLE)
    assert [uniforms(seeds[i:i + 1], pos[i:i + 1], SAMPLE)[0] for i in range(5)] == u.tolist()
    assert len(set(u.tolist())) == 5
    others = [uniforms(seeds, pos, p) for p in (DRAFT, ACCEPT, RESIDUAL)]
    assert all((o != u).all() for o in others), "each purpose has its own stream"
    assert as_seed(-1) == 2**64 - 1 and uniforms(np.array([as_seed(-1)], dtype=np.uint64), [5], SAMPLE)[0] == u[2]


def test_uniforms_are_uniform_on_0_1():
    n = 200_000
    u = uniforms(np.repeat(np.arange(200, dtype=np.uint64), n // 200), np.tile(np.arange(n // 200), 200), SAMPLE)
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = np.bincount((u * 20).astype(int), minlength=20)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 50.0, f"chi-square {chi2:.1f} over 19 degrees of freedom"     # p ~ 1e-4
    assert u.mean() == pytest.approx(0.5, abs=0.003)
    assert len(np.unique(u)) == n, "53 random bits: no collisions at this size"
