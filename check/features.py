"""Part 7 of `baton check gpu`: the serving features whose device code only a GPU runs, on part 2's first random
model in the engine's dtype (bf16 on CUDA; fp32 in the CPU dry mode).

- Structured output: a JSON schema's requests, greedy and sampled, batched beside free ones (the grammar's bitmask
  applied on the device) all end with JSON the schema accepts.
- LoRA: an adapter (written here in PEFT's format, on q, v and down) through the engine's LoRA kernels (Triton on
  CUDA) gives the greedy tokens of the same model with the adapter merged into its weights, up to a near-tie.
- Speculative decoding: n-gram drafts verified on the device give the greedy tokens of plain decoding, up to a
  near-tie; so do a random EAGLE-3 head's (the target's streams kept on the device, the head run there).
- Beam search: a width of 1 gives the greedy tokens, up to a near-tie.

The near-tie rule is check/compare.py's; on a GPU its gap is the models part's bf16 tolerance (the two runs round
differently), in the dry mode fp32's.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch

from check.compare import MAX_LOGPROB_GAP, TOP_K, GreedyBatch
from check.report import FAIL, PASS, Row

SCHEMA = {"type": "object", "properties": {
    "id": {"enum": [1, 2, 3]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    "ok": {"type": "boolean"}}, "required": ["id", "tags", "ok"], "additionalProperties": False}
GPU_GAP = 2.25           # nats: the models part's bf16 tolerance on this model (docs/benchmarks.md, GPU runs)
LORA_TARGETS = ("q_proj", "v_proj", "down_proj")
LORA_RANK, LORA_ALPHA = 8, 16


def _matches(text: str) -> bool:
    """SCHEMA by hand (jsonschema need not be installed on the device)."""
    try:
        v = json.loads(text)
    except ValueError:
        return False
    return (isinstance(v, dict) and set(v) == {"id", "tags", "ok"} and v["id"] in (1, 2, 3)
            and isinstance(v["ok"], bool) and isinstance(v["tags"], list) and len(v["tags"]) <= 3
            and all(isinstance(t, str) and len(t) <= 8 for t in v["tags"]))


def _engine(path: str, cpu: bool, **kw):
    """An engine of its own KV budget (a GPU engine would otherwise take most of the device's free memory); the
    one before it is gone (free_memory)."""
    from check.models import free_memory
    from engine import LLM
    free_memory(torch.device("cpu" if cpu else "cuda"))
    return LLM(path, dtype="float32" if cpu else "bfloat16", device="cpu" if cpu else "cuda", max_num_seqs=8,
               max_model_len=512, kv_cache_memory=(64 << 20) if cpu else (1 << 30), **kw)


def _prompts(vocab: int, n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, min(vocab, 30000), (k,), generator=g).tolist() for k in (9, 24, 40, 71)[:n]]


def _close(name: str, ours: list, theirs: list, gap: float) -> Row:
    c = GreedyBatch.compare(ours, theirs, len(ours[0].token_ids), gap)
    return Row("features", name, c.text, FAIL if c.errors else PASS,
               data={"equal": c.equal, "prompts": len(ours), "errors": c.errors, "max_gap": gap})


def structured_row(path: str, cpu: bool) -> Row:
    from engine import SamplingParams
    from engine.structured import StructuredOutput
    llm = _engine(path, cpu)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    spec = StructuredOutput(json=SCHEMA)
    params = [SamplingParams(temperature=t, seed=3, max_tokens=96, structured=spec) for t in (0.0, 0.0, 1.0, 1.0)]
    free = SamplingParams(temperature=1.0, seed=4, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:2], params + [free, free])[:4]
    good = [o.finish_reason == "stop" and _matches(o.text) for o in outs]
    return Row("features", "structured output (JSON schema)",
               f"{sum(good)}/{len(outs)} outputs end and match the schema (greedy and sampled, beside free requests)",
               PASS if all(good) else FAIL, data={"texts": [o.text for o in outs], "matched": good})


def write_adapter(base: str, out: Path, seed: int = 5) -> str:
    """A random LoRA adapter of `base` in PEFT's files (what make_lora_adapter writes, without peft), and the
    model with it merged into its weights at out/merged."""
    from safetensors.torch import load_file, save_file
    import shutil
    state = load_file(f"{base}/model.safetensors")
    g = torch.Generator().manual_seed(seed)
    scaling = LORA_ALPHA / LORA_RANK
    tensors = {}
    for name, w in list(state.items()):
        prefix, piece = name.rsplit(".", 1)[0], name.split(".")[-2]
        if piece not in LORA_TARGETS or not name.endswith(".weight"):
            continue
        n, k = w.shape
        a = torch.randn(LORA_RANK, k, generator=g) / k ** 0.5
        b = torch.randn(n, LORA_RANK, generator=g) * w.float().std() * 0.5
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = a
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = b
        state[name] = (w.float() + scaling * b @ a).to(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": LORA_RANK, "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS),
        "bias": "none", "base_model_name_or_path": base}))
    merged = out / "merged"
    merged.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(merged / "model.safetensors"))
    for f in ("config.json", "generation_config.json"):
        if Path(base, f).is_file():
            shutil.copy(Path(base, f), merged)
    return str(out)


def lora_row(path: str, cpu: bool, workdir: Path) -> Row:
    from engine import LoRARequest, SamplingParams
    adapter = write_adapter(path, workdir / "adapter")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=TOP_K)
    llm = _engine(path, cpu, enable_lora=True, max_lora_rank=LORA_RANK)
    prompts = _prompts(llm.engine.hf_config.vocab_size)
    lora = LoRARequest("check", 1, adapter)
    ours = llm.generate(prompts, params, lora_request=[lora, None, lora, lora])
    base = [ours[1]]
    del llm
    merged = _engine(str(Path(adapter) / "merged"), cpu).generate(prompts, params)
    row = _close("LoRA adapter (the engine's LoRA kernels) vs its merged weights", [ours[i] for i in (0, 2, 3)],
                 [merged[i] for i in (0, 2, 3)], MAX_LOGPROB_GAP * 10 if cpu else GPU_GAP)
    changed = base[0].token_ids != merged[1].token_ids
    if not changed:                                    # the adapter must change the text, or the row proves nothing
        row.status, row.result = FAIL, row.result + "; the adapter changed no token"
    row.data["adapter_changes_the_text"] = changed
    return row


def spec_row(path: str, cpu: bool) -> Row:
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP_K)
    plain = _engine(path, cpu)
    prompts = [p * 3 for p in _prompts(plain.engine.hf_config.vocab_size, 3)]      # repeats: n-gram drafts hit
    want = plain.generate(prompts, params)
    del plain
    spec = _engine(path, cpu, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    got = spec.generate(prompts, params)
    row = _close("speculative decoding (n-gram) vs plain greedy", got, want, MAX_LOGPROB_GAP if cpu else GPU_GAP)
    drafts = sum(o.metrics.spec_num_draft_tokens for o in got)
    row.data["drafts"], row.data["accepted"] = drafts, sum(o.metrics.spec_num_accepted_tokens for o in got)
    if not drafts:
        row.status, row.result = FAIL, row.result + "; no draft was proposed"
    return row


def eagle_row(path: str, cpu: bool, workdir: Path) -> Row:
    """A random EAGLE-3 head (written here in its checkpoints' format) drafting from the target's streams: the
    runner keeps them on the device, the head's layer runs there; the greedy tokens are plain decoding's."""
    from bench.models import write_eagle3_head
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=TOP_K)
    plain = _engine(path, cpu)
    n = plain.engine.hf_config.num_hidden_layers
    prompts = _prompts(plain.engine.hf_config.vocab_size, 3)
    want = plain.generate(prompts, params)
    del plain
    head = write_eagle3_head(path, workdir / "eagle3", draft_vocab=128, aux=[0, n // 2, n - 1])
    spec = _engine(path, cpu, speculative_config={"method": "eagle3", "model": head, "num_speculative_tokens": 3,
                                                  "adaptive": False})
    got = spec.generate(prompts, params)
    row = _close("speculative decoding (EAGLE-3 head) vs plain greedy", got, want, MAX_LOGPROB_GAP if cpu else GPU_GAP)
    drafts = sum(o.metrics.spec_num_draft_tokens for o in got)
    row.data["drafts"] = drafts
    if not drafts:
        row.status, row.result = FAIL, row.result + "; no draft was proposed"
    return row


def beam_row(path: str, cpu: bool) -> Row:
    """A beam's tokens with each round's top logprobs read as a greedy output (its rounds run each beam's prompt
    on the cached prefix, so in bf16 a near-tie may round the other way)."""
    from types import SimpleNamespace

    from engine import BeamSearchParams, SamplingParams
    llm = _engine(path, cpu)
    prompts = _prompts(llm.engine.hf_config.vocab_size, 2)
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=TOP_K))
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=16, ignore_eos=True))
    as_outputs = [SimpleNamespace(token_ids=b.sequences[0].tokens[len(p):], logprobs=b.sequences[0].logprobs)
                  for p, b in zip(prompts, beams)]
    return _close("beam search, width 1 vs greedy", as_outputs, greedy, MAX_LOGPROB_GAP if cpu else GPU_GAP)


TEXTS = ['{"id": 1, "tags": ["relay", "baton"], "ok": true}', '{"id": 3, "tags": [], "ok": false}',
         "The second runner takes the baton in the exchange zone.", "Four legs of a hundred metres each."]


def with_tokenizer(path: str, out: Path) -> str:
    """The random checkpoint beside a small BPE tokenizer trained here (no hub on the device): structured output
    and beam search's text need one. Its special tokens take ids 0-2, the config's unk, bos and eos."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, trainers
    from transformers import PreTrainedTokenizerFast
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(path).iterdir():
        if f.name == "model.safetensors":
            (out / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, out)
    # printable ASCII as its alphabet, tokens read as they are (a byte-level alphabet's stand-in characters would
    # need the grammar engine to detect that encoding; this needs nothing)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    alphabet = [chr(c) for c in range(32, 127)]
    tok.train_from_iterator(TEXTS * 4, trainers.BpeTrainer(vocab_size=240, special_tokens=["<unk>", "<s>", "</s>"],
                                                           initial_alphabet=alphabet, limit_alphabet=len(alphabet)))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
                            ).save_pretrained(out)
    return str(out)


def check_features(path: str, cpu: bool, log: Callable[[str], None] = lambda m: None) -> list[Row]:
    import tempfile
    rows = []
    with tempfile.TemporaryDirectory(prefix="baton-features-") as tmp:
        log("features: a tokenizer for the random model")
        path = with_tokenizer(path, Path(tmp) / "model")
        for name, fn in (("structured output", lambda: structured_row(path, cpu)),
                         ("LoRA", lambda: lora_row(path, cpu, Path(tmp))),
                         ("speculative decoding", lambda: spec_row(path, cpu)),
                         ("EAGLE-3", lambda: eagle_row(path, cpu, Path(tmp))),
                         ("beam search", lambda: beam_row(path, cpu))):
            log(f"features: {name}")
            try:
                rows.append(fn())
            except Exception as e:                  # noqa: BLE001 - one feature fails, the others still run
                import traceback
                rows.append(Row("features", f"{name}: error", f"{type(e).__name__}: {e}", FAIL,
                                data={"traceback": traceback.format_exc()}))
    return rows
