"""Speculative decoding with draft heads that read the target's hidden states (engine/spec/head.py): EAGLE heads and
DeepSeek-V3's multi-token prediction layer.

The drafts an engine proposes are the heads' formula, recomputed from scratch with transformers' modules (the target's
hidden states from transformers, the head's decoder layer as a transformers layer), also past a prefix hit; greedy
output is the target's alone, token for token; an MTP layer that copies the target's is accepted; nothing leaks
through preemption and aborts; bad configurations are clear errors."""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.models import make_tiny_checkpoint, write_eagle3_head, write_eagle_head
from engine import LLM, ConfigError, SamplingParams, cpu_model
from engine.errors import ModelLoadError
from tests.test_spec_decode import assert_no_leak

PROMPTS = [list(range(10, 40)), [7, 8, 9] * 9, list(range(100, 137)), [5, 6] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
KW = dict(block_size=8, num_kv_blocks=96, max_model_len=256)


def add_mtp_layer(src: str, dst: Path, copy_of_target: bool = False, seed: int = 5) -> str:
    """`src` (a DeepSeek-V3) with the layer its num_nextn_predict_layers promises, as DeepSeek's release holds it:
    model.layers.{num_hidden_layers}. with a decoder layer, enorm, hnorm, eh_proj, shared_head.norm and copies of the
    embedding and head. Random (near the last layer's weights), or `copy_of_target`: for a one-layer target whose
    embeddings have unit RMS, a layer that computes what the target computes (eh_proj passes the embedding on, enorm
    leaves it as it is, the decoder layer and final norm are the target's)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert cfg.get("num_nextn_predict_layers", 1) == 1
    tensors = load_file(dst / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    noise = 0.0 if copy_of_target else 0.05
    extra = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + noise * torch.randn(v.shape, generator=g)
             for k, v in tensors.items() if f".layers.{n - 1}." in k}
    p = f"model.layers.{n}."
    if copy_of_target:
        extra[p + "eh_proj.weight"] = torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1)
        extra[p + "enorm.weight"] = torch.ones(h)
        extra[p + "hnorm.weight"] = torch.ones(h)
        extra[p + "shared_head.norm.weight"] = tensors["model.norm.weight"].clone()
    else:
        extra[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
        extra[p + "enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        extra[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        extra[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    extra[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    extra[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **extra}, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def eagle(llama, tmp_path_factory) -> str:
    return write_eagle_head(llama, tmp_path_factory.mktemp("eagle") / "head", fc_bias=True)


@pytest.fixture(scope="module")
def llama8(tmp_path_factory) -> str:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama8"), "llama", num_hidden_layers=8)


@pytest.fixture(scope="module")
def eagle3(llama8, tmp_path_factory) -> str:
    """Reading the streams entering layers 6, 1 and 6 again: out of order, one twice (the default of a 5 or 6 layer
    target has such repeats)."""
    return write_eagle3_head(llama8, tmp_path_factory.mktemp("eagle3") / "head", aux=[6, 1, 6])


@pytest.fixture(scope="module")
def v3_mtp(tmp_path_factory) -> str:
    v3 = make_tiny_checkpoint(tmp_path_factory.mktemp("v3"), "deepseek_v3")
    return add_mtp_layer(v3, tmp_path_factory.mktemp("v3mtp") / "ckpt")


def spec(method: str, head: str | None = None, k: int = 3) -> dict:
    return {"method": method, "num_speculative_tokens": k, "adaptive": False, **({"model": head} if head else {})}


def spy_drafts(llm) -> list:
    """Every draft the engine (an LLM's or an LLMEngine) proposes: (the sequence's tokens then, its head's base
    position, the drafts)."""
    drafter, records = getattr(llm, "engine", llm).spec.drafter, []
    inner = drafter.draft

    def draft(seqs, ks):
        drafts, timings = inner(seqs, ks)
        for seq, d in zip(seqs, drafts):
            if d.tokens:
                records.append((list(seq.token_ids), drafter.state[seq.request_id].base, d.tokens))
        return drafts, timings
    drafter.draft = draft
    return records


class HFEagle3:
    """EAGLE-3's formula as `baton bench eagle-head` trains it (bench/eagle_head.py Eagle3Head: plain torch with
    transformers' rotary tables; transformers has no EAGLE-3 model), over the target's streams from transformers'
    hidden states (hidden_states[i] enters layer i). The engine agreeing with it is also what makes a head the bench
    trains worth loading."""

    def __init__(self, target: str, head: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        from bench.eagle_head import Eagle3Head
        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.aux = AutoConfig.from_pretrained(head).eagle_config["eagle_aux_hidden_state_layer_ids"]
        self.head, self.ids = Eagle3Head.load(head)
        self.vocab = self.target.config.vocab_size

    @torch.no_grad()
    def drafts(self, tokens: list[int], base: int, k: int) -> list[torch.Tensor]:
        states = self.target.model(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = self.head.fc(torch.cat([states[i][0] for i in self.aux], -1)[base:])
        embeds = self.target.model.embed_tokens(torch.tensor(tokens[base + 1:]))
        out = []
        for _ in range(k):
            y = self.head.layer(embeds[None], hidden[None])[0]
            logits = torch.full((self.vocab,), float("-inf"))
            logits[self.ids] = self.head.lm_head(self.head.norm(y[-1]))
            out.append(logits)
            embeds = torch.cat([embeds, self.target.model.embed_tokens(logits.argmax()[None])])
            hidden = torch.cat([hidden, y[-1:]])
        return out


class HFHead:
    """The head's formula in transformers' modules: the target's hidden states from the whole target, the head's
    decoder layer as the target family's transformers layer (run over the whole draft sequence each time, no cache)."""

    def __init__(self, target: str, method: str, head: str | None):
        from transformers import AutoConfig, AutoModelForCausalLM
        self.target = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.method = method
        if method == "eagle":
            cfg = AutoConfig.from_pretrained(head)
            cfg._attn_implementation = "sdpa"
            w = load_file(Path(head) / "model.safetensors")
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
            model.model.load_state_dict({k: v for k, v in w.items() if k.startswith("layers.")}, strict=False)
            model.model.layers[0].input_layernorm = torch.nn.Identity()
            model.model.norm = torch.nn.Identity()
            self.fc = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias="fc.bias" in w)
            self.fc.load_state_dict({k[3:]: v for k, v in w.items() if k.startswith("fc.")})
        else:                          # the prediction layer as layer 0 of a one-layer model transformers loads
            cfg = AutoConfig.from_pretrained(target)
            n = cfg.num_hidden_layers
            cfg.num_hidden_layers, cfg.first_k_dense_replace = 1, 0
            w = load_file(Path(target) / "model.safetensors")
            p = f"model.layers.{n}."
            own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
            layer = {"model.layers.0." + k[len(p):]: v for k, v in w.items()
                     if k.startswith(p) and not k[len(p):].startswith(own)}
            with tempfile.TemporaryDirectory() as d:
                cfg.save_pretrained(d)
                save_file({**layer, "model.embed_tokens.weight": w["model.embed_tokens.weight"],
                           "model.norm.weight": w[p + "shared_head.norm.weight"], "lm_head.weight": w["lm_head.weight"]},
                          Path(d) / "model.safetensors", metadata={"format": "pt"})
                model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").eval()
            self.final, model.model.norm = model.model.norm, torch.nn.Identity()
            norm = type(self.final)
            self.enorm, self.hnorm = norm(cfg.hidden_size, cfg.rms_norm_eps), norm(cfg.hidden_size, cfg.rms_norm_eps)
            self.enorm.weight.data.copy_(w[p + "enorm.weight"])
            self.hnorm.weight.data.copy_(w[p + "hnorm.weight"])
            self.eh_proj = torch.nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
            self.eh_proj.weight.data.copy_(w[p + "eh_proj.weight"])
        self.head = model

    def combine(self, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
        e = self.target.model.embed_tokens(torch.tensor(tokens))
        if self.method == "eagle":
            return self.fc(torch.cat([e, hidden], -1))
        return self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], -1))

    @torch.no_grad()
    def drafts(self, tokens: list[int], base: int, k: int) -> list[torch.Tensor]:
        """The logits of k greedy drafts after `tokens` (the last one not yet computed by the target), for a head
        that read the target's hidden states from position `base`."""
        h = self.target.model(torch.tensor([tokens[:-1]])).last_hidden_state[0]      # after the final norm
        x = self.combine(tokens[base + 1:], h[base:])
        out = []
        for _ in range(k):
            y = self.head.model(inputs_embeds=x[None]).last_hidden_state[0]
            last = y[-1]
            logits = self.target.lm_head(last if self.method == "eagle" else self.final(last))
            out.append(logits)
            x = torch.cat([x, self.combine([int(logits.argmax())], last[None])])
        return out


def check_drafts(records: list, ref: HFHead) -> int:
    """Each proposed chain against the formula: equal up to the first draft where the reference's top two are within
    1e-3 (an fp32 near-tie), after which a chain is not compared. Returns how many drafts were compared."""
    compared = 0
    for tokens, base, drafts in records:
        for logits, got in zip(ref.drafts(tokens, base, len(drafts)), drafts):
            want = int(logits.argmax())
            if got != want:
                gap = float(logits[want] - logits[got])
                assert gap < 1e-3, f"draft {got} where the head's formula gives {want} (by {gap:.4f})"
                break
            compared += 1
    return compared


@pytest.mark.parametrize("method", ["eagle", "eagle3", pytest.param("mtp", marks=pytest.mark.slow)])
def test_drafts_are_the_heads_formula_and_greedy_output_is_the_targets(method, request):
    names = {"eagle": ("llama", "eagle"), "eagle3": ("llama8", "eagle3"), "mtp": ("v3_mtp", None)}[method]
    target, head = (None if n is None else request.getfixturevalue(n) for n in names)   # only the ones it reads
    want = [o.token_ids for o in LLM(target, **KW).generate(PROMPTS, GREEDY)]
    llm = LLM(target, speculative_config=spec(method, head), max_num_batched_tokens=48, **KW)
    records = spy_drafts(llm)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want      # batched, prompts chunked
    again = llm.generate([PROMPTS[2][:33] + [1, 2, 3]], GREEDY)[0]          # past a prefix hit of 32 tokens
    assert again.metrics.num_cached_tokens == 32
    assert again.token_ids == LLM(target, **KW).generate([PROMPTS[2][:33] + [1, 2, 3]], GREEDY)[0].token_ids
    assert {base for _, base, _ in records} == {0, 32}
    ref = HFEagle3(target, head) if method == "eagle3" else HFHead(target, method, head)
    assert check_drafts(records, ref) > 0.9 * sum(len(d) for *_, d in records)
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] == sum(len(d) for *_, d in records) > 100
    assert_no_leak(llm)


@pytest.mark.slow
def test_an_mtp_layer_that_copies_the_target_is_accepted(tmp_path):
    """A one-layer DeepSeek-V3 whose prediction layer computes what the target computes (less its first token): its
    drafts are the target's next tokens, so most are accepted, and the output is the target's."""
    src = make_tiny_checkpoint(tmp_path / "v3", "deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0)
    tensors = load_file(Path(src) / "model.safetensors")
    e = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()     # unit RMS rows
    save_file(tensors, Path(src) / "model.safetensors", metadata={"format": "pt"})
    target = add_mtp_layer(src, tmp_path / "mtp", copy_of_target=True)
    want = [o.token_ids for o in LLM(target, **KW).generate(PROMPTS, GREEDY)]
    llm = LLM(target, speculative_config=spec("mtp", k=3), **KW)
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in out] == want
    stats = llm.engine.stats()
    assert stats["spec_acceptance_rate"] > 0.5, stats
    assert stats["spec_mean_accepted_length"] > 1.5
    assert_no_leak(llm)


@pytest.mark.slow
def test_nothing_leaks_through_preemption_and_aborts(llama, eagle):
    """A cache too small for every request at once preempts some (their head state goes and starts again where the
    target computes again); aborted requests free the head's blocks; the output is the target's."""
    prompts = [list(range(i, i + 40)) for i in range(10, 130, 20)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = {**KW, "num_kv_blocks": 24, "max_model_len": 128}
    want = [o.token_ids for o in LLM(llama, **kw).generate(prompts, params)]
    llm = LLM(llama, speculative_config=spec("eagle", eagle, k=4), **kw)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.stats()["num_preemptions"] > 0
    engine = llm.engine
    rids = [engine.add_request(p, params) for p in prompts[:3]]
    for _ in range(8):
        engine.step()
    for rid in rids:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(llm)


@pytest.mark.slow
def test_an_eagle3_head_reads_the_layers_its_config_names(llama8, tmp_path):
    """Without eagle_aux_hidden_state_layer_ids, the streams entering layers 2, L/2 and L-3 (vLLM's choice)."""
    llm = LLM(llama8, speculative_config=spec("eagle3", write_eagle3_head(llama8, tmp_path / "h")), **KW)
    assert llm.engine.runner.aux_layers == (2, 4, 5)
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == \
        [o.token_ids for o in LLM(llama8, **KW).generate(PROMPTS[:2], GREEDY)]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.slow
def test_an_eagle_head_in_pytorch_bins_loads(llama, eagle, tmp_path):
    """EAGLE's own checkpoints are pytorch_model.bin files: the same head, the same drafts."""
    binned = tmp_path / "bin"
    binned.mkdir()
    shutil.copy(Path(eagle) / "config.json", binned / "config.json")
    torch.save(load_file(Path(eagle) / "model.safetensors"), binned / "pytorch_model.bin")
    a = LLM(llama, speculative_config=spec("eagle", eagle), **KW)
    b = LLM(llama, speculative_config=spec("eagle", str(binned)), **KW)
    ra, rb = spy_drafts(a), spy_drafts(b)
    assert [o.token_ids for o in a.generate(PROMPTS[:2], GREEDY)] == \
        [o.token_ids for o in b.generate(PROMPTS[:2], GREEDY)]
    assert ra == rb and ra


@pytest.mark.parametrize("method,extra,words", [
    ("eagle", {}, 'needs "model"'),
    ("eagle3", {}, 'needs "model"'),
    ("mtp", {"model": "x"}, "own prediction layer"),
])
def test_bad_head_configs_are_clear_errors(method, extra, words):
    with pytest.raises(ConfigError, match=words):
        LLM("dummy-tiny", speculative_config={"method": method, **extra})


def test_heads_that_do_not_fit_the_target_are_refused(llama, tmp_path):
    with pytest.raises(ConfigError, match="multi-token prediction"):
        LLM(llama, speculative_config=spec("mtp"), **KW)               # a Llama has no prediction layer
    other = make_tiny_checkpoint(tmp_path / "wide", "llama", hidden_size=96)
    with pytest.raises(ConfigError, match="trained for another model"):
        LLM(llama, speculative_config=spec("eagle", write_eagle_head(other, tmp_path / "head")), **KW)
    with pytest.raises(ConfigError, match=r"three of the target's 3 layers, got \[1, 4, 6\]"):
        LLM(llama, speculative_config=spec("eagle3", write_eagle3_head(llama, tmp_path / "e3", aux=[1, 4, 6])), **KW)
    bare = make_tiny_checkpoint(tmp_path / "v3", "deepseek_v3")              # promises a layer it does not hold
    with pytest.raises(ModelLoadError, match="mtp head"):
        LLM(bare, speculative_config=spec("mtp"), **KW)


@pytest.mark.slow
@pytest.mark.skipif(not cpu_model.available(), reason="no C++ compiler: the kernels are not built")
def test_the_cpu_stack_keeps_the_same_streams_for_eagle3(llama8, eagle3, monkeypatch):
    """A packed target runs its layers in the C++ stack, which copies out the streams an EAGLE-3 head reads: the same
    drafts, bit for bit, as the module-by-module forward's."""
    runs = []
    for on in (True, False):
        monkeypatch.setenv("BATON_CPU_STACK", "1" if on else "0")
        cpu_model.stack_enabled.cache_clear()
        llm = LLM(llama8, quantization="int8", speculative_config=spec("eagle3", eagle3), **KW)
        records = spy_drafts(llm)
        outs = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert llm.engine.runner.model._stack                    # packed: the stack applies (when enabled)
        runs.append((outs, records))
    cpu_model.stack_enabled.cache_clear()
    assert runs[0] == runs[1] and len(runs[0][1]) > 10


@pytest.mark.slow
def test_an_eagle3_head_over_the_whole_vocabulary_needs_no_map(llama8, tmp_path):
    """A head whose draft vocabulary is the target's: its d2t, if it ships one, is all zeros and maps nothing."""
    head = write_eagle3_head(llama8, tmp_path / "h", draft_vocab=300)
    llm = LLM(llama8, speculative_config=spec("eagle3", head), **KW)
    assert not llm.engine.draft_runner.model.mapped
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], GREEDY)] == \
        [o.token_ids for o in LLM(llama8, **KW).generate(PROMPTS[:2], GREEDY)]


def test_vllms_older_name_for_mtp_is_taken():
    from engine.spec.config import SpeculativeConfig
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "num_speculative_tokens": 1}).method == "mtp"


@pytest.mark.slow
def test_a_long_prompts_hidden_states_are_fed_as_they_pile_up(llama8, eagle3, monkeypatch):
    """A prompt's chunks feed the head once CATCH_UP_ROWS rows wait (here 16; 256 in use), not all at its first draft:
    no request holds more than that and a chunk; the drafts are still the formula's."""
    from engine.spec import proposers
    monkeypatch.setattr(proposers, "CATCH_UP_ROWS", 16)
    llm = LLM(llama8, speculative_config=spec("eagle3", eagle3), max_num_batched_tokens=24, **KW)
    drafter, most = llm.engine.spec.drafter, [0]
    inner = drafter.catch_up

    def catch_up(seqs):
        inner(seqs)
        most[0] = max([most[0]] + [len(st.hidden) for st in drafter.state.values()])
    drafter.catch_up = catch_up
    records = spy_drafts(llm)
    prompts = [list(range(3, 150)), [9, 8, 7, 6] * 30]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == \
        [o.token_ids for o in LLM(llama8, **KW).generate(prompts, GREEDY)]
    assert 0 < most[0] < 16 + 24
    assert check_drafts(records, HFEagle3(llama8, eagle3)) > 0.9 * sum(len(d) for *_, d in records)
    assert_no_leak(llm)
