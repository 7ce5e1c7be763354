"""A model's generation_config.json, as vLLM reads it: its sampling fields are the defaults of what a request leaves
unset (generation_config auto, or a directory; vllm turns them off), override_generation_config sets fields over
it, and its eos_token_id list ends requests in every mode. Bad settings are refused at start with the reason."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.errors import ConfigError
from router import openai_protocol as oa

PROMPT = "The three legs of a relay race are"


def model_with(tmp_path: Path, smol_path: str, generation: dict) -> str:
    """The default model's files beside a generation_config.json of our own (its weights are the same files)."""
    d = tmp_path / "model"
    d.mkdir()
    for f in Path(smol_path).iterdir():
        if f.name != "generation_config.json":
            (d / f.name).symlink_to(f)
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, **generation}))
    return str(d)


def test_the_models_generation_config_gives_defaults_and_eos_ids(tmp_path, smol_path):
    model = model_with(tmp_path, smol_path, {"eos_token_id": 2})
    probe = LLM(model, kv_cache_memory=64 << 20, max_model_len=512)
    greedy = probe.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids
    stop = greedy[3]                                              # the model's 4th greedy token: an EOS of its own
    first = greedy.index(stop)
    assert probe.engine.eos_ids == {2}
    (Path(model) / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, stop], "temperature": 0.0, "max_new_tokens": 7, "do_sample": True}))  # do_sample: ignored
    # engines of one checkpoint alive together share its weights (one load)
    auto = LLM(model, kv_cache_memory=64 << 20, max_model_len=512)
    off = LLM(model, kv_cache_memory=64 << 20, max_model_len=512, generation_config="vllm")
    over = LLM(model, kv_cache_memory=64 << 20, max_model_len=512, override_generation_config={"max_new_tokens": 3})
    assert auto.engine.generation.sampling == {"temperature": 0.0, "max_tokens": 7}
    assert off.engine.generation.sampling == {} and off.get_default_sampling_params() == SamplingParams()
    assert over.engine.generation.sampling == {"temperature": 0.0, "max_tokens": 3}

    # no SamplingParams: the model's defaults (greedy, 7 tokens), and its second EOS id ends the request
    out = auto.generate([PROMPT])[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"
    assert auto.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].token_ids \
        == greedy                                                 # SamplingParams given are used as given
    assert over.generate([PROMPT])[0].token_ids == greedy[:min(3, first + 1)]
    # "vllm": no sampling defaults, but the file's EOS ids still end requests (as vLLM reads them)
    assert stop in off.engine.eos_ids and 2 in off.engine.eos_ids
    out = off.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert out.token_ids == greedy[:first + 1] and out.finish_reason == "stop"


def test_a_generation_config_directory_replaces_the_models(tmp_path, smol_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "min_p": 0.05,
                                                                 "repetition_penalty": 1.1}))
    llm = LLM(smol_path, kv_cache_memory=64 << 20, max_model_len=512, generation_config=str(tmp_path))
    p = llm.get_default_sampling_params()
    assert (p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 0.05, 1.1, 16)


@pytest.mark.parametrize("kwargs,match", [
    (dict(override_generation_config={"temprature": 0.5}), r"unknown field\(s\) \['temprature'\]"),
    (dict(override_generation_config={"temperature": -1.0}), "temperature"),
    (dict(generation_config="/nonexistent/dir"), "no generation_config.json there"),
    (dict(generation_config=""), "generation_config must be auto, vllm or a directory"),
])
def test_bad_generation_settings_are_refused_with_the_reason(smol_path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(smol_path, kv_cache_memory=64 << 20, max_model_len=512, **kwargs)


def test_a_files_bad_default_is_refused_naming_the_generation_config(tmp_path, smol_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 1.5}))
    with pytest.raises(ConfigError, match="generation config's sampling defaults"):
        LLM(smol_path, kv_cache_memory=64 << 20, max_model_len=512, generation_config=str(tmp_path))


def test_the_api_takes_the_models_defaults_for_the_fields_a_request_leaves_unset():
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                "max_tokens": 100}
    req = oa.parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, chat=True)
    p = oa.to_sampling_params(req, max_model_len=2048, prompt_len=10, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (0.6, 0.9, 20, 0.05, 1.1, 100)
    assert oa.to_sampling_params(req, max_model_len=2048, prompt_len=1990, defaults=defaults).max_tokens == 58  # room
    # what the request sets wins, OpenAI's own defaults included when sent explicitly
    req = oa.parse_request({"model": "m", "prompt": "hi", "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0,
                            "repetition_penalty": 1.0, "max_tokens": 7}, chat=False)
    p = oa.to_sampling_params(req, max_model_len=2048, prompt_len=10, defaults=defaults)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 7)
    # no generation config: OpenAI's and vLLM's defaults, and max_tokens up to the context
    req = oa.parse_request({"model": "m", "prompt": "hi"}, chat=False)
    p = oa.to_sampling_params(req, max_model_len=2048, prompt_len=10)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty, p.max_tokens) == (1.0, 1.0, 0, 0.0, 1.0, 2038)
