"""Embeddings: a prompt pooled into one vector of the model's final hidden states (after its last norm), as vLLM's
pooling runner and sentence-transformers give them.

A pooling request runs through the scheduler as a prompt does (chunked, batched with decodes, its last token
always computed); the step that computes its last prompt token ends it with the pooled vector instead of a
sampled token. `last` pooling (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral) reads one
row and takes prefix-cache hits; `mean` and `cls` read every prompt row or the first, so their prompt is computed
whole, as prompt logprobs' is.

The pooling type is the model's own where its sentence-transformers files say it (modules.json -> the Pooling
module's config.json, as vLLM reads them), else `last`; the engine's `pooling_type` option overrides both.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from engine.errors import ConfigError, InvalidRequestError

POOLING_TYPES = ("last", "mean", "cls")
_ST_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass(slots=True)
class PoolingParams:
    """One embedding request's options (vLLM's names): `normalize` to unit length (L2) after `dimensions`, which
    keeps the vector's first `dimensions` values (Matryoshka models only)."""
    normalize: bool = True
    dimensions: int | None = None

    def validate(self, hidden_size: int, matryoshka: bool | list[int]) -> None:
        d = self.dimensions
        if d is None:
            return
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise InvalidRequestError(f"dimensions must be a positive integer, got {d!r}")
        if not matryoshka:
            raise InvalidRequestError("this model does not support matryoshka representation: dimensions cannot "
                                      "be set")
        if isinstance(matryoshka, list) and d not in matryoshka:
            raise InvalidRequestError(f"dimensions must be one of the model's matryoshka dimensions {matryoshka}, "
                                      f"got {d}")
        if d > hidden_size:
            raise InvalidRequestError(f"dimensions must be at most the model's hidden size {hidden_size}, got {d}")


@dataclass
class PoolingConfig:
    """A model's pooling, read once: its type, and whether (and to which sizes) it may be truncated."""
    type: str = "last"
    matryoshka: bool | list[int] = False        # True: any size; a list: those sizes


def pooling_config(model_path: str, hf_config, override: str | None = None) -> PoolingConfig:
    """The model's pooling: `override` (the engine's pooling_type), else its sentence-transformers Pooling module,
    else `last`. Matryoshka sizes from its config (vLLM's `is_matryoshka` / `matryoshka_dimensions`)."""
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    matryoshka = list(dims) if dims else bool(getattr(hf_config, "is_matryoshka", False))
    kind = override or _sentence_transformers_pooling(model_path) or "last"
    if kind not in POOLING_TYPES:
        raise ConfigError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    return PoolingConfig(kind, matryoshka)


def _sentence_transformers_pooling(model_path: str) -> str | None:
    """The pooling mode of a sentence-transformers model directory (modules.json names its Pooling module's
    folder), or None where there is none or it is one Baton does not run (weighted mean, max)."""
    if not os.path.isdir(model_path):
        return None
    try:
        with open(os.path.join(model_path, "modules.json")) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        return None
    for m in modules if isinstance(modules, list) else []:
        if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
            try:
                with open(os.path.join(model_path, m.get("path", ""), "config.json")) as f:
                    cfg = json.load(f)
            except (OSError, ValueError):
                return None
            modes = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
            if len(modes) != 1 or any(cfg.get(k) for k in cfg if k.startswith("pooling_mode_") and k not in _ST_MODES):
                raise ConfigError(f"the model's sentence-transformers pooling {cfg} is not one Baton runs "
                                  f"({', '.join(POOLING_TYPES)})")
            return modes[0]
    return None


def pool_positions(kind: str, start: int, count: int, prompt_len: int) -> range:
    """The positions among start .. start + count - 1 (one step's chunk) whose hidden states a `kind` pooling
    reads."""
    if kind == "mean":
        return range(start, min(start + count, prompt_len))
    target = prompt_len - 1 if kind == "last" else 0
    return range(target, target + 1) if start <= target < start + count else range(0)


def finish(total, rows: int, kind: str, params: PoolingParams) -> np.ndarray:
    """The embedding of a prompt: the sum of its pooled rows (a torch tensor, fp32) over their count for `mean`,
    cut to `dimensions` and L2-normalized as asked. (torch is imported here: PoolingParams travels through
    processes that never load a model.)"""
    import torch
    v = total.float() / rows if kind == "mean" else total.float()
    if params.dimensions is not None:
        v = v[:params.dimensions]
    if params.normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.cpu().numpy().astype(np.float32)
