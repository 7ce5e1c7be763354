"""Beam search, as vLLM runs it: outside the engine's step loop, one token at a time.

Each round asks for one token of every live beam (its prompt is the request's prompt plus the beam's tokens, so
the prefix cache holds all of it but the last few tokens) with the top 2 x beam_width log-probabilities. Every
beam's candidates are scored by their cumulative log-probability; a candidate that ends in EOS (unless
ignore_eos) is set aside as finished, the best beam_width of the rest live on. After max_tokens rounds, or when
no beam is left, the finished and the live beams are ranked by vLLM's length-penalized score, cumulative
log-probability / (tokens including the prompt, less a final EOS) ** length_penalty, and the best beam_width are
the answer.

`BeamSearch` holds one request's state and never runs a model: its caller asks `prompts()`, runs them, and hands
each one's top log-probabilities to `advance()`. The offline `LLM.beam_search` runs the rounds on its engine; the
ingress runs them through the pools (router/ingress.py), so both give the same beams.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

MAX_BEAM_WIDTH = 10


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams of at most `max_tokens` tokens each."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0           # the rounds' sampling temperature (their log-probabilities are the model's)
    length_penalty: float = 1.0

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {v!r}")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise InvalidRequestError(f"beam_width is at most {MAX_BEAM_WIDTH} (each round asks for 2 x beam_width "
                                      f"top log-probabilities, at most 20), got {self.beam_width}")
        if not isinstance(self.length_penalty, (int, float)) or self.length_penalty != self.length_penalty:
            raise InvalidRequestError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt and its tokens, each token's top log-probabilities, their running sum."""
    tokens: list[int]
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None            # the generated text, once the beam is returned
    finish_reason: str | None = None   # "stop" (EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first."""
    sequences: list[BeamSearchSequence]


def beam_score(beam: BeamSearchSequence, eos_ids: frozenset[int] | set[int], length_penalty: float) -> float:
    """vLLM's get_beam_search_score: the cumulative log-probability over the length (the prompt included, a final
    EOS not) to the power length_penalty."""
    n = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] in eos_ids else 0)
    return beam.cum_logprob / (max(n, 1) ** length_penalty)


class BeamSearch:
    """One prompt's beam search, driven from outside (the module's docstring)."""

    def __init__(self, prompt: list[int], params: BeamSearchParams, eos_ids, max_model_len: int):
        params.validate()
        self.prompt_len, self.params, self.eos_ids = len(prompt), params, frozenset(eos_ids)
        self.max_len = min(len(prompt) + params.max_tokens, max_model_len)
        self.beams = [BeamSearchSequence(list(prompt))]
        self.finished: list[BeamSearchSequence] = []

    @property
    def done(self) -> bool:
        return not self.beams or len(self.beams[0].tokens) >= self.max_len

    @property
    def num_top_logprobs(self) -> int:
        return 2 * self.params.beam_width

    def prompts(self) -> list[list[int]]:
        """This round's prompts: one per live beam."""
        return [b.tokens for b in self.beams]

    def advance(self, tops: list[dict[int, float]]) -> None:
        """Each live beam's top log-probabilities for its next token (in prompts() order)."""
        candidates = []
        for beam, top in zip(self.beams, tops, strict=True):
            for token, lp in top.items():
                child = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [top], beam.cum_logprob + lp)
                if token in self.eos_ids and not self.params.ignore_eos:
                    child.finish_reason = "stop"
                    self.finished.append(child)
                else:
                    candidates.append(child)
        candidates.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.beams = candidates[:self.params.beam_width]

    def results(self, decode=None) -> BeamSearchOutput:
        """The best beam_width of the finished and live beams; `decode(token ids) -> text` fills their text."""
        for b in self.beams:
            b.finish_reason = "length"
        ranked = sorted(self.finished + self.beams, reverse=True,
                        key=lambda b: beam_score(b, self.eos_ids, self.params.length_penalty))
        best = ranked[:self.params.beam_width]
        if decode is not None:
            for b in best:
                b.text = decode(b.tokens[self.prompt_len:])
        return BeamSearchOutput(best)
