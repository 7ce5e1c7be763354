"""SpeculativeConfig: which proposer drafts tokens, and how many (vLLM's `speculative_config` names)."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from engine.errors import ConfigError

METHODS = ("ngram", "draft_model", "layer_skip", "eagle", "eagle3", "mtp")
ALIASES = {"deepseek_mtp": "mtp"}           # vLLM's older name of DeepSeek's multi-token prediction


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int = 4       # the most drafts per step; adaptive depth picks 0..this
    model: str | None = None              # draft_model: a smaller model sharing the target's tokenizer; eagle, eagle3: the
                                          # EAGLE or EAGLE-3 head's checkpoint (engine/spec/head.py)
    prompt_lookup_min: int = 1            # ngram: shortest tail n-gram to look up
    prompt_lookup_max: int = 4            # ngram: longest
    num_layers: int | None = None         # layer_skip: how many of the target's first layers draft
    adaptive: bool = True                 # choose k per request each step (False: always the max)
    draft_kv_blocks: int | None = None    # draft_model, eagle(3), mtp: blocks of its own KV cache (default: the target's)
    # adaptive: seconds of a target step over T tokens, [[T, seconds], ...] with T increasing, instead of measuring
    # them at start-up (several seconds on a CPU): the same depth decisions on every start and machine, as
    # measured once (the engine still scales the table by the steps it times)
    step_costs: tuple[tuple[int, float], ...] | None = None

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative_config key(s) {unknown}; known: {sorted(known)}")
        if "method" not in value:
            raise ConfigError(f"speculative_config needs a method: one of {', '.join(METHODS)}")
        return cls(**{**value, "method": ALIASES.get(value["method"], value["method"])})

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"speculative_config: {msg}")

        if self.method not in METHODS:
            bad(f"method must be one of {', '.join(METHODS)}, got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16:
            bad(f"num_speculative_tokens must be an integer in [1, 16], got {k!r}")
        if self.method == "draft_model" and not self.model:
            bad('method "draft_model" needs "model": the path of a draft model')
        if self.method in ("eagle", "eagle3") and not self.model:
            bad(f'method "{self.method}" needs "model": the path of a head trained for the target')
        if self.method not in ("draft_model", "eagle", "eagle3") and self.model is not None:
            bad(f'"model" applies to methods "draft_model", "eagle" and "eagle3", not {self.method!r}'
                + (" (mtp drafts with the target's own prediction layer)" if self.method == "mtp" else ""))
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            bad(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "layer_skip":
            if not isinstance(self.num_layers, int) or isinstance(self.num_layers, bool) or self.num_layers < 1:
                bad('method "layer_skip" needs "num_layers": a positive integer')
        elif self.num_layers is not None:
            bad(f'"num_layers" applies to method "layer_skip", not {self.method!r}')
        if self.draft_kv_blocks is not None and self.draft_kv_blocks < 1:
            bad(f"draft_kv_blocks must be positive, got {self.draft_kv_blocks}")
        if self.step_costs is not None:
            try:
                costs = tuple((int(t), float(y)) for t, y in self.step_costs)
            except (TypeError, ValueError):
                costs = ()
            ok = costs and all(t >= 1 and math.isfinite(y) and y > 0 for t, y in costs) \
                and all(a[0] < b[0] for a, b in zip(costs, costs[1:])) \
                and all(float(t) == t0 for (t, _), (t0, _) in zip(costs, self.step_costs))
            if not ok:
                bad(f"step_costs must be [[T, seconds], ...] with whole T >= 1 increasing and seconds > 0, "
                    f"got {self.step_costs!r}")
            object.__setattr__(self, "step_costs", costs)
