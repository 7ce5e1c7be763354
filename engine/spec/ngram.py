"""N-gram prompt lookup: propose the tokens that followed the latest earlier match of the context's tail."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class NgramLookup:
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k draft tokens (possibly none): the longest tail n-gram (<= prompt_lookup_max) that
        occurred earlier, newest occurrence first; what followed it is the proposal."""
        k = self.num_speculative_tokens if k is None else k
        ids = np.asarray(token_ids)
        n_tok = len(ids)
        ends = np.flatnonzero(ids[:n_tok - 1] == ids[n_tok - 1])     # earlier matches of the last token
        best = int(ends[-1]) if ends.size and self.prompt_lookup_min <= 1 else None
        for length in range(1, min(self.prompt_lookup_max, n_tok - 1)):
            ends = ends[ends >= length]                               # extend matches one token back
            ends = ends[ids[ends - length] == ids[n_tok - 1 - length]]
            if not ends.size:
                break
            if length + 1 >= self.prompt_lookup_min:
                best = int(ends[-1])
        if best is None:
            return []
        return ids[best + 1:best + 1 + k].tolist()
