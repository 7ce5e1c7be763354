"""SamplingParams: how one request is decoded (vLLM's names and meanings)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.structured import StructuredOutput


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0          # 0 = greedy
    top_k: int = 0                    # 0 or -1 = off
    top_p: float = 1.0                # nucleus mass, in (0, 1]
    min_p: float = 0.0                # drop tokens below min_p * p_max, in [0, 1]
    presence_penalty: float = 0.0     # in [-2, 2]: subtracted from a token's logit once it was generated
    frequency_penalty: float = 0.0    # in [-2, 2]: subtracted once per time it was generated
    repetition_penalty: float = 1.0   # > 0: logits of prompt and generated tokens divided (> 0) or multiplied
    seed: int | None = None           # the request's random stream: same seed, same tokens
    max_tokens: int | None = 16       # None = up to max_model_len
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0               # tokens before EOS, a stop token or a stop string may end the request
    logit_bias: dict[int, float] | None = None    # token id -> added to its logit, in [-100, 100] (OpenAI's)
    allowed_token_ids: list[int] | None = None    # only these may be sampled
    bad_words: list[str] | None = None            # words never to complete (vLLM's: their last token is banned
                                                  # where the output ends with the rest of the word)
    logprobs: int | None = None       # top-n logprobs per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None    # top-n logprobs per prompt token (0 = only the prompt's own); its
                                          # prompt is computed whole, not read from the prefix cache
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False    # the stop string, or the stop token's text, ends the output text
    structured: StructuredOutput | None = None    # a grammar the output must follow (engine/structured.py)
    # vLLM's: only requests with the same salt share prefix-cache blocks (engine.block_hash.namespace_key); a
    # secret of the tenant's, so never in a repr
    cache_salt: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias) or None
        if isinstance(self.allowed_token_ids, (list, tuple)):
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.bad_words, (list, tuple)):
            self.bad_words = list(self.bad_words) or None
        if isinstance(self.structured, dict):
            self.structured = StructuredOutput(**self.structured)
        self.validate()

    def validate(self) -> None:
        def bad(msg: str) -> None:
            raise InvalidRequestError(msg)

        for name in ("max_tokens", "top_k", "logprobs", "prompt_logprobs", "seed", "min_tokens"):
            if isinstance(getattr(self, name), bool):
                bad(f"{name} must be an integer, got {getattr(self, name)!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            bad(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            bad("cache_salt must be a non-empty string")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad(f"top_p must be in (0, 1], got {self.top_p}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            bad(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not _finite(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad(f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            bad(f"max_tokens must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.min_tokens and self.structured is not None:
            bad("min_tokens cannot be combined with structured output: the grammar decides where the output ends")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                bad("logit_bias must map token ids to biases")
            for tok, bias in self.logit_bias.items():
                if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
                    bad(f"logit_bias keys must be token ids (integers >= 0), got {tok!r}")
                if not _finite(bias) or not -100.0 <= bias <= 100.0:
                    bad(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {tok}")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                bad("allowed_token_ids must be a non-empty list of token ids")
            if any(not isinstance(t, int) or isinstance(t, bool) or t < 0 for t in self.allowed_token_ids):
                bad("allowed_token_ids must be token ids (integers >= 0)")
        if self.bad_words is not None and (not isinstance(self.bad_words, list)
                                           or any(not isinstance(w, str) or not w.strip() for w in self.bad_words)):
            bad("bad_words must be a list of non-empty strings")
        if self.structured is not None and (self.allowed_token_ids is not None or self.bad_words):
            bad(f"{'allowed_token_ids' if self.allowed_token_ids is not None else 'bad_words'} cannot be combined "
                f"with structured output: the grammar decides which tokens may come")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad(f"logprobs must be an integer in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            bad(f"prompt_logprobs must be an integer in [0, 20], got {self.prompt_logprobs}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop strings must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            bad("stop_token_ids must be non-negative integers")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**64):
            bad(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                bad("structured must be a StructuredOutput")
            self.structured.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x: float) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
