"""`baton bench eagle-head`: train a small EAGLE-3 head for a model on text the model writes itself, on this
machine, and measure how often its first draft is the model's next token on held-out text.

No EAGLE head for SmolLM2 can be downloaded here, so `baton bench spec --method eagle3` needs one made on this
machine. EAGLE-3's recipe in miniature (Li et al. 2025):
  1. the target answers training prompts greedily through Baton (subjects and templates disjoint from
     `bench spec`'s prompts); a tenth of them are held out;
  2. Baton's engine reads each prompt + answer and keeps the residual streams entering layers 2, L/2 and L-3 (what
     its runner keeps for an EAGLE-3 head, in the numbers it serves with: the default model packed);
  3. the head learns token t+2 from token t+1 and those streams at t: cross-entropy over a draft vocabulary of the
     text's most frequent tokens (d2t maps them to the target's ids). The first draft only: later drafts read the
     head's own output, which EAGLE-3 trains with its training-time test and this does not.
Saved as EAGLE-3 checkpoints are: config.json (draft_vocab_size, eagle_config) and model.safetensors (fc, midlayer,
norm, lm_head, d2t, t2d). Minutes of a CPU on a few tens of thousands of tokens, against the GPU-days on ShareGPT of a
released head: a floor for what EAGLE-3 gives. JSON (the losses, held-out first-draft accuracy) and a PNG.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result

log = make_logger("eagle-head")

SUBJECTS = ["volcanoes", "the printing press", "honeybees", "compound interest", "the water cycle", "chess openings",
            "sourdough bread", "black holes", "the Roman aqueducts", "photosynthesis", "jazz", "glaciers",
            "vaccines", "the stock market", "octopuses", "solar panels", "the Silk Road", "recycling plastic",
            "sleep", "earthquakes", "coffee", "the immune system", "electric cars", "tides", "origami",
            "the human heart", "coral reefs", "public libraries", "bicycles", "rainbows", "ancient Egypt",
            "machine translation", "mountain climbing", "penguins", "the moon landing", "wind turbines",
            "medieval castles", "the Olympic Games", "bread yeast", "hurricanes", "the telescope", "spiders",
            "the Amazon rainforest", "credit cards", "the piano", "deserts", "the internet", "dinosaurs",
            "bridges", "chocolate", "the French Revolution", "submarines", "elephants", "lightning",
            "paper money", "the human brain", "trains", "mushrooms", "satellites", "democracy", "rivers",
            "the camera", "wolves", "batteries", "tea", "skyscrapers", "the alphabet", "clouds", "antibiotics",
            "the compass", "whales", "gardening"]
TEMPLATES = ["Explain {s} to a curious ten-year-old.", "Write a short story in which {s} matter to the plot.",
             "List five surprising facts about {s}.", "What are the main arguments for and against {s}?",
             "Write a haiku and then a limerick about {s}.", "Summarize the history of {s} in one paragraph.",
             "Give me three questions a teacher could ask about {s}, with answers.",
             "Write a short dialogue between two friends arguing about {s}.",
             "Describe {s} in the style of a travel guide.",
             "What would change if {s} had never existed?"]


def prompts(n: int, seed: int) -> list[str]:
    texts = [t.format(s=s) for s in SUBJECTS for t in TEMPLATES]
    random.Random(seed).shuffle(texts)
    return texts[:n]


# -- the head, as Baton's SpecHead runs an EAGLE-3 layer (engine/spec/head.py), in trainable modules -------------
class RMSNorm(nn.Module):
    def __init__(self, h: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(h)), eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Eagle3Head(nn.Module):
    def __init__(self, cfg, draft_vocab: int):
        super().__init__()
        h, heads, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or h // heads
        self.heads, self.kv = heads, kv
        eps = cfg.rms_norm_eps
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.input_layernorm, self.hidden_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.post_attention_layernorm, self.norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.q_proj = nn.Linear(2 * h, heads * self.d, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * self.d, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * self.d, bias=False)
        self.o_proj = nn.Linear(heads * self.d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        self.rope = LlamaRotaryEmbedding(cfg)

    def forward(self, embeds: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """embeds [B, T, H] of tokens t+1, streams [B, T, 3H] at t -> draft logits [B, T, V_d]."""
        return self.lm_head(self.norm(self.layer(embeds, self.fc(streams))))

    def layer(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The decoder layer over [B, T] positions (causal): embeds of tokens t+1 and the hidden states at t (fc of the
        target's streams, or the head's own output when drafting further) -> its output before the final norm."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        b, t, _ = embeds.shape
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], -1)
        q = self.q_proj(x).view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
        cos, sin = self.rope(x, torch.arange(t)[None].expand(b, t))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        rep = self.heads // self.kv
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
        r = hidden + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        m = self.post_attention_layernorm(r)
        return r + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    @classmethod
    def load(cls, path: str) -> tuple["Eagle3Head", torch.Tensor]:
        """An EAGLE-3 checkpoint (written here or anywhere in its format, one layer) as this module, and its draft ids'
        target ids (d2t applied)."""
        from safetensors.torch import load_file
        from transformers import AutoConfig
        cfg = AutoConfig.from_pretrained(path)
        tensors = load_file(Path(path) / "model.safetensors")
        head = cls(cfg, tensors["lm_head.weight"].shape[0])
        names = {v: k for k, v in head._names().items()}
        head.load_state_dict({names[k]: v for k, v in tensors.items() if k in names})
        return head, torch.arange(len(tensors["d2t"])) + tensors["d2t"]

    def _names(self) -> dict[str, str]:
        """This module's parameter -> EAGLE-3's name for it."""
        m = "midlayer."
        out = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
            out[f"{name}.weight"] = f"{m}{name}.weight"
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{name}.weight"] = f"{m}self_attn.{name}.weight"
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{name}.weight"] = f"{m}mlp.{name}.weight"
        return out

    def checkpoint(self, ids: torch.Tensor, vocab: int) -> dict[str, torch.Tensor]:
        """The tensors under EAGLE-3's names."""
        params = dict(self.named_parameters())
        out = {theirs: params[ours].detach().contiguous().clone() for ours, theirs in self._names().items()}
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        out["d2t"], out["t2d"] = ids - torch.arange(len(ids)), t2d
        return out


# -- the steps ------------------------------------------------------------------------------------------------
def generate(model: str | None, texts: list[str], max_tokens: int) -> list[list[int]]:
    from engine import LLM, SamplingParams
    llm = LLM(model, max_model_len=1024, kv_cache_memory=512 << 20)
    chats = [llm.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    outs = llm.generate(chats, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [c + o.token_ids for c, o in zip(chats, outs)]


@torch.no_grad()
def target_streams(model: str | None, path: str, seqs: list[list[int]], aux: tuple[int, ...], workdir: Path):
    """Per sequence: the target's embeddings of its tokens and the residual streams entering the aux layers, as Baton
    serves it (the default model in its packed types): an engine with a placeholder EAGLE-3 head (random, only there
    to make the runner keep the streams) reads each sequence as a prompt, and its drafter's rows are taken."""
    from bench.models import write_eagle3_head
    from engine import LLM, SamplingParams
    placeholder = write_eagle3_head(path, workdir / "placeholder", draft_vocab=16, aux=list(aux))
    llm = LLM(model, max_model_len=1024, kv_cache_memory=256 << 20, enable_prefix_caching=False,
              speculative_config={"method": "eagle3", "model": placeholder, "num_speculative_tokens": 1})
    drafter, rows = llm.engine.spec.drafter, {}
    inner = drafter.observe

    def observe(seq, first, hidden):
        rows.setdefault(seq.request_id, []).append((first, hidden.float().clone()))
        inner(seq, first, hidden)
    drafter.observe = observe
    embed = llm.engine.runner.model.model.embed_tokens
    out = []
    for i in range(0, len(seqs), 16):
        rows.clear()
        for s, o in zip(seqs[i:i + 16], llm.generate(seqs[i:i + 16], SamplingParams(temperature=0, max_tokens=1))):
            chunks = sorted(rows[o.request_id], key=lambda c: c[0])
            assert chunks[0][0] == 0
            out.append((embed(torch.tensor(s)).float(), torch.cat([h for _, h in chunks])[:len(s)]))
        log(f"  target streams of {len(out)}/{len(seqs)} sequences")
    return out


def batches(items: list, size: int, rng: random.Random):
    order = list(range(len(items)))
    rng.shuffle(order)
    for i in range(0, len(order), size):
        yield [items[j] for j in order[i:i + size]]


def collate(group, to_draft: torch.Tensor):
    """Inputs at positions 0..T-3 of each sequence (embedding of t+1, streams at t) and labels t+2 (draft ids, -100
    where the token is outside the draft vocabulary), padded to the longest."""
    t = max(len(ids) for ids, _, _ in group) - 2
    h, w = group[0][1].shape[1], group[0][2].shape[1]
    emb, streams = torch.zeros(len(group), t, h), torch.zeros(len(group), t, w)
    labels = torch.full((len(group), t), -100, dtype=torch.long)
    for b, (ids, e, s) in enumerate(group):
        n = len(ids) - 2
        emb[b, :n], streams[b, :n] = e[1:n + 1], s[:n]
        labels[b, :n] = to_draft[torch.tensor(ids[2:])]
    return emb, streams, labels


def evaluate(head: Eagle3Head, items, to_draft) -> float:
    """The share of held-out positions whose first draft is the target's next token (outside the draft vocabulary:
    a miss)."""
    hits = total = 0
    with torch.no_grad():
        for ids, e, s in items:
            emb, streams, labels = collate([(ids, e, s)], to_draft)
            pred = head(emb, streams).argmax(-1)
            hits += int((pred == labels).sum())
            total += labels.shape[1]
    return hits / max(total, 1)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    a = ax.plot(result["loss_steps"], result["losses"], label="training loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax2 = ax.twinx()
    b = ax2.plot([e["step"] for e in result["evals"]], [e["first_draft_accuracy"] for e in result["evals"]], "o-",
                 color="tab:orange", label="held-out first-draft accuracy")
    ax2.set_ylabel("accuracy")
    ax2.set_ylim(0, 1)
    ax.legend(handles=a + b, loc="center right", fontsize=8)
    fig.suptitle(f"EAGLE-3 head for {Path(result['model']).name}: {result['train_tokens']} tokens, "
                 f"{result['epochs']} epochs", fontsize=9)
    save(fig, path)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct)")
    p.add_argument("--prompts", type=int, default=len(SUBJECTS) * len(TEMPLATES),
                   help=f"training + held-out prompts (default and most: {len(SUBJECTS) * len(TEMPLATES)})")
    p.add_argument("--max-tokens", type=int, default=192, help="tokens of each answer (default 192)")
    p.add_argument("--draft-vocab", type=int, default=4096, help="the head's vocabulary (default 4096)")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="sequences a step (default 8)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/eagle_head",
                   help="directory for head/ (the checkpoint), eagle_head.json and eagle_head.png")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.loader import resolve_model
    from safetensors.torch import save_file
    started = time.perf_counter()
    torch.manual_seed(args.seed)
    out_dir = Path(args.out_dir)
    (out_dir / "head").mkdir(parents=True, exist_ok=True)
    path = resolve_model(args.model)
    texts = prompts(args.prompts, args.seed)
    log(f"the target answers {len(texts)} prompts ({args.max_tokens} tokens each, greedy)")
    seqs = generate(args.model, texts, args.max_tokens)
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(path)
    n = cfg.num_hidden_layers
    aux = (2, n // 2, n - 3)
    log(f"the target's streams entering layers {aux}, from Baton's engine")
    with tempfile.TemporaryDirectory(prefix="baton-eagle-") as tmp:
        streams = target_streams(args.model, path, seqs, aux, Path(tmp))
    items = [(s, e, st) for s, (e, st) in zip(seqs, streams)]
    held = max(1, len(items) // 10)
    train, test = items[held:], items[:held]
    counts = torch.bincount(torch.tensor([t for s, _, _ in train for t in s[2:]]), minlength=cfg.vocab_size)
    ids = counts.argsort(descending=True)[:args.draft_vocab].sort().values
    to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    to_draft[ids] = torch.arange(len(ids))
    covered = float(counts[ids].sum() / counts.sum())
    train_tokens = sum(len(s) - 2 for s, _, _ in train)
    log(f"{train_tokens} training positions, {sum(len(s) - 2 for s, _, _ in test)} held out; the draft vocabulary's "
        f"{len(ids)} tokens cover {covered:.1%} of the training labels")
    head = Eagle3Head(cfg, len(ids))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(train) / args.batch)
    warm = max(1, steps // 10)                  # a linear warm-up, then a cosine to zero
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min((i + 1) / warm, 0.5 * (1 + math.cos(
        math.pi * min(max(i - warm, 0) / max(steps - warm, 1), 1.0)))))
    rng, losses, loss_steps, evals, step = random.Random(args.seed), [], [], [], 0
    evals.append({"step": 0, "first_draft_accuracy": evaluate(head, test, to_draft)})
    t_train = time.perf_counter()
    for epoch in range(args.epochs):
        for group in batches(train, args.batch, rng):
            emb, st, labels = collate(group, to_draft)
            loss = F.cross_entropy(head(emb, st).flatten(0, 1), labels.flatten(), ignore_index=-100)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            losses.append(loss.item())
            loss_steps.append(step)
        acc = evaluate(head, test, to_draft)
        evals.append({"step": step, "first_draft_accuracy": acc})
        log(f"epoch {epoch + 1}/{args.epochs}: loss {sum(losses[-5:]) / len(losses[-5:]):.3f}, held-out "
            f"first-draft accuracy {acc:.1%} ({time.perf_counter() - t_train:.0f} s)")
    head_cfg = {**cfg.to_dict(), "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle3"],
                "draft_vocab_size": len(ids), "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux)}}
    (out_dir / "head" / "config.json").write_text(json.dumps(head_cfg, indent=1))
    save_file(head.checkpoint(ids, cfg.vocab_size), out_dir / "head" / "model.safetensors")
    result: dict[str, Any] = {
        "benchmark": "eagle_head", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": path, "head": str(out_dir / "head"), "prompts": len(texts),
        "held_out_prompts": held, "max_tokens": args.max_tokens, "aux_layers": list(aux),
        "draft_vocab": len(ids), "draft_vocab_coverage": covered, "train_tokens": train_tokens,
        "epochs": args.epochs, "batch": args.batch, "lr": args.lr, "steps": step,
        "train_seconds": time.perf_counter() - t_train, "losses": losses, "loss_steps": loss_steps, "evals": evals,
        "first_draft_accuracy": evals[-1]["first_draft_accuracy"],
        "method_notes": {"accuracy": "held-out positions whose argmax draft is the target's greedy next token "
                                     "(tokens outside the draft vocabulary count as misses): the first draft's "
                                     "acceptance rate under greedy verification"},
    }
    write_result(result, out_dir / "eagle_head.json", {"loss": ("eagle_head.png", plot)})
    log(f"wrote the head to {out_dir / 'head'} and {result['json_path']} in {time.perf_counter() - started:.0f} s")
    return result
