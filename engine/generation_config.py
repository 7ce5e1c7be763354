"""A model's generation config (generation_config.json), read as vLLM reads it.

- Its `eos_token_id` (one id or a list: Llama 3's instruct models list <|eot_id|> and <|eom_id|> there) ends
  requests as the tokenizer's EOS does, whatever the mode.
- Its sampling fields are the defaults of requests that leave them unset (vLLM's `--generation-config auto`, its
  default since 0.9): temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens. Only
  the fields the file sets to other than transformers' own defaults count (GenerationConfig.to_diff_dict, as
  vLLM), and `do_sample` is ignored, as vLLM ignores it.

EngineConfig.generation_config: "auto" (the model's file), "vllm" (no sampling defaults: vLLM's own), or a
directory holding a generation_config.json to use instead. override_generation_config sets fields over either.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.errors import ConfigError, InvalidRequestError
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# the generation config's sampling fields (transformers' names), and the SamplingParams field each sets
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)    # SamplingParams field -> the model's default
    eos_token_ids: tuple[int, ...] = ()

    def params(self, **kwargs: Any) -> SamplingParams:
        """SamplingParams with the model's defaults under what kwargs set (vLLM's get_default_sampling_params)."""
        return SamplingParams(**{**self.sampling, **kwargs})


def check_overrides(overrides: dict[str, Any] | None) -> None:
    if overrides is None:
        return
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise ConfigError(f"override_generation_config must be a mapping of field names, got {overrides!r}")
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        raise ConfigError(f"override_generation_config: unknown field(s) {unknown}; the sampling fields are "
                          f"{sorted(FIELDS)}")


def _read(directory: Path) -> dict[str, Any] | None:
    """The file's fields that differ from transformers' defaults, or None when there is no file."""
    if not (directory / "generation_config.json").is_file():
        return None
    from transformers import GenerationConfig
    try:
        return GenerationConfig.from_pretrained(str(directory)).to_diff_dict()
    except (OSError, ValueError) as e:
        raise ConfigError(f"{directory / 'generation_config.json'} could not be read: {e}") from None


def load(model_path: str, mode: str = "auto", overrides: dict[str, Any] | None = None) -> GenerationDefaults:
    """The defaults of `model_path` (a model directory, or a dummy shape name: none) under `mode`."""
    check_overrides(overrides)
    model_dir = Path(model_path)
    if mode in ("auto", "vllm"):
        source = model_dir if model_dir.is_dir() else None
    else:
        source = Path(mode).expanduser()
        if not (source / "generation_config.json").is_file():
            raise ConfigError(f"generation_config {mode!r}: no generation_config.json there (give auto, vllm, or a "
                              f"directory that holds one)")
    found = (_read(source) if source is not None else None) or {}
    eos = found.get("eos_token_id")
    eos_ids = tuple(sorted({int(t) for t in (eos if isinstance(eos, list) else [] if eos is None else [eos])}))
    sampling = {} if mode == "vllm" else {FIELDS[k]: found[k] for k in FIELDS if found.get(k) is not None}
    sampling.update({FIELDS[k]: v for k, v in (overrides or {}).items()})
    defaults = GenerationDefaults(sampling, eos_ids)
    try:
        defaults.params().validate()
    except InvalidRequestError as e:
        raise ConfigError(f"the generation config's sampling defaults {sampling} are not valid: {e}") from None
    if sampling:
        log.info("sampling defaults from the generation config (%s): %s; requests that set a field keep theirs "
                 "(generation_config='vllm' turns these off)", source or "overrides", sampling)
    return defaults
