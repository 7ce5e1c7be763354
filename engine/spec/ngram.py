"""N-gram prompt lookup: propose the tokens that followed the latest earlier match of the context's tail."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class NgramProposer:
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_speculative_tokens: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """Up to k draft tokens (possibly none): try the longest n-gram first, newest match first."""
        k = self.num_speculative_tokens if k is None else k
        ids = np.asarray(token_ids)
        n_tok = len(ids)
        for n in range(min(self.prompt_lookup_max, n_tok - 1), self.prompt_lookup_min - 1, -1):
            tail = ids[n_tok - n:]
            windows = np.lib.stride_tricks.sliding_window_view(ids[:n_tok - 1], n)   # starts 0..n_tok-1-n
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n                                     # what followed the match
                return ids[start:start + k].tolist()
        return []
