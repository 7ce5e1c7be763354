"""`baton bench spec`: batch-1 inter-token latency with and without speculative decoding, in one run.

Workloads, all on the same model, every engine built once and alive together:
  (a) repeat   batch 1, greedy: prompts that ask to rewrite or copy a given code/text block (prompt lookup's case)
  (b) chat     batch 1, greedy: ordinary chat questions
  (c) batch32  32 chat requests submitted together, sampled (temperature 0.7, top_p 0.9, seeded per request)
  (d) layer_skip self-drafting (the target's first n layers) on the repeat and chat prompts, batch 1, greedy
(a)-(c) compare a plain engine with the main speculative one (default: ngram, adaptive depth). Runs are
interleaved: for each prompt the baseline runs, then every speculative engine, so drift on a shared
machine hits all alike. ITL per workload = sum(last_token_time - first_token_time) / sum(num_output_tokens - 1)
over its requests. Batch-1 requests are greedy and stop at EOS (both sides emit the same tokens); batch32
uses ignore_eos so the batch stays 32 wide.
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import time
from pathlib import Path
from typing import Any

from bench.engine_bench import machine_info, make_logger, pyplot, save, write_result

FULL = dict(max_tokens=256, batch_max_tokens=128, num_repeat=None, num_chat=None, num_layer_skip=None)
# the smoke run (tests): every workload and one layer_skip config, just enough to show each path runs
QUICK = dict(max_tokens=32, batch_max_tokens=16, num_repeat=2, num_chat=2, num_layer_skip=1)
BATCH = 32
LAYER_SKIP = [(8, False), (8, True), (16, False), (16, True)]   # (num_layers, adaptive) of (d)
LAYER_SKIP_K = 3
GOAL_REPEAT_SPEEDUP = 1.5           # (a): ITL_baseline / ITL_spec >= this
GOAL_NO_SLOWDOWN = 1.05             # (b), (c): ITL_spec <= this * ITL_baseline
MAX_MODEL_LEN = 4096
KV_BYTES_MAIN = 512 << 20           # baseline + main spec engine: room for 32 requests of (c)
KV_BYTES_SMALL = 256 << 20          # layer-skip engines: batch 1 only


# -- prompts ------------------------------------------------------------------------------------------
_PY_FUNC = '''def summarize_orders(orders, min_total=0, currency="USD", include_refunds=False):
    totals = {}
    counts = {}
    refunds = []
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        if order.get("status") == "refunded":
            if include_refunds:
                refunds.append(order["id"])
            continue
        customer = order["customer"]
        amount = 0
        for item in order["items"]:
            price = item["price"]
            qty = item.get("quantity", 1)
            discount = item.get("discount", 0)
            amount += price * qty * (1 - discount)
        if order.get("currency", "USD") != currency:
            amount = convert(amount, order["currency"], currency)
        totals[customer] = totals.get(customer, 0) + amount
        counts[customer] = counts.get(customer, 0) + 1
    result = []
    for customer, total in totals.items():
        if total < min_total:
            continue
        average = total / counts[customer]
        result.append({
            "customer": customer,
            "total": round(total, 2),
            "orders": counts[customer],
            "average": round(average, 2),
        })
    result.sort(key=lambda r: r["total"], reverse=True)
    if include_refunds:
        return result, refunds
    return result
'''

_PARAGRAPH = ("The lighthouse stood on the edge of the cliff for more then two hundred years. Every nigth the "
              "keeper climbed the narow stairs, one hundred and twelve steps in all, to light the great lamp at "
              "the top. Ships pasing along the rocky coast relied on its beam to avoid the reefs that had "
              "claimed so many vessels in the past. In winter the storms were fierce, and the keeper often "
              "stayed awake untill dawn, watching the waves crash against the rocks bellow. When the lamp was "
              "finaly automated in 1968, the last keeper packed his few belongings and walked down the hill to "
              "the village, where he lived quietly for the rest of his life, never once climbing a stair again.")

_JS_CODE = '''var express = require("express");
var bodyParser = require("body-parser");
var app = express();
var port = process.env.PORT || 8080;

app.use(bodyParser.json());

var users = [];
var nextId = 1;

app.get("/users", function (req, res) {
  res.json(users);
});

app.get("/users/:id", function (req, res) {
  var id = parseInt(req.params.id, 10);
  var user = users.find(function (u) { return u.id === id; });
  if (!user) {
    return res.status(404).json({ error: "not found" });
  }
  res.json(user);
});

app.post("/users", function (req, res) {
  var name = req.body.name;
  var email = req.body.email;
  if (!name || !email) {
    return res.status(400).json({ error: "name and email are required" });
  }
  var user = { id: nextId++, name: name, email: email };
  users.push(user);
  res.status(201).json(user);
});

app.delete("/users/:id", function (req, res) {
  var id = parseInt(req.params.id, 10);
  users = users.filter(function (u) { return u.id !== id; });
  res.status(204).end();
});

app.listen(port, function () {
  console.log("listening on port " + port);
});
'''

_YAML = '''server:
  host: 0.0.0.0
  port: 8080
  workers: 4
  timeout_seconds: 30
database:
  driver: postgres
  host: db.internal
  port: 5432
  name: inventory
  user: inventory_app
  pool_size: 10
  ssl: true
cache:
  backend: redis
  host: cache.internal
  port: 6379
  ttl_seconds: 300
logging:
  level: info
  format: json
  file: /var/log/inventory/app.log
features:
  enable_search: true
  enable_export: false
  max_page_size: 100
'''

_PY_CLASS = '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity, price):
        if name in self.items:
            self.items[name]["quantity"] += quantity
        else:
            self.items[name] = {"quantity": quantity, "price": price}

    def remove(self, name, quantity):
        if name not in self.items:
            raise KeyError(name)
        if self.items[name]["quantity"] < quantity:
            raise ValueError("not enough stock")
        self.items[name]["quantity"] -= quantity
        if self.items[name]["quantity"] == 0:
            del self.items[name]

    def value(self):
        total = 0
        for item in self.items.values():
            total += item["quantity"] * item["price"]
        return total

    def low_stock(self, threshold=5):
        return [name for name, item in self.items.items() if item["quantity"] < threshold]
'''

_RECIPE = ("Ingredients: 200 g flour, 100 g butter, 50 g sugar, 1 egg, a pinch of salt, 2 tablespoons of cold "
           "water. Method: Rub the butter into the flour and salt until the mixture looks like breadcrumbs. "
           "Stir in the sugar. Beat the egg with the water and add it to the bowl, mixing with a knife until "
           "the dough comes together. Wrap the dough and chill it for 30 minutes. Roll it out on a floured "
           "surface to a thickness of 3 mm, line a 23 cm tart tin, prick the base with a fork and chill again "
           "for 15 minutes. Bake blind at 190 C for 15 minutes, remove the beans and bake for 5 minutes more.")

REPEAT_PROMPTS: list[tuple[str, str]] = [
    ("py_type_hints", "Rewrite this Python function adding type hints. Keep the body unchanged.\n\n" + _PY_FUNC),
    ("fix_typos", "Copy this paragraph fixing the typos. Change nothing else.\n\n" + _PARAGRAPH),
    ("js_const_let", "Rewrite this JavaScript code replacing every `var` with `const` or `let` as appropriate. "
                     "Keep everything else the same.\n\n" + _JS_CODE),
    ("yaml_port", "Rewrite this YAML config with the server port changed to 9090 and the logging level set to "
                  "debug. Output the whole file.\n\n" + _YAML),
    ("py_docstrings", "Rewrite this Python class adding a one-line docstring to every method.\n\n" + _PY_CLASS),
    ("recipe_list", "Copy this recipe, rewriting the method as a numbered list of steps and keeping the wording "
                    "of each step.\n\n" + _RECIPE),
]

CHAT_PROMPTS: list[tuple[str, str]] = [
    ("hash_map", "Explain how a hash map works."),
    ("haiku", "Write a haiku about autumn."),
    ("tides", "What causes tides?"),
    ("rest_vs_rpc", "What is the difference between REST and RPC APIs?"),
    ("sleep", "Give me five tips for sleeping better."),
    ("photosynthesis", "Explain photosynthesis to a ten-year-old."),
    ("rome", "Why did the Western Roman Empire fall?"),
    ("email", "Write a short email asking my manager for a day off next Friday."),
]

_BATCH_EXTRA = [
    "How does a refrigerator keep food cold?", "What is a black hole?", "Suggest a name for a bakery.",
    "How do vaccines work?", "Write a limerick about a cat.", "What is the capital of Australia and why?",
    "Explain recursion with an example.", "What are the benefits of regular exercise?",
    "How do airplanes stay in the air?", "Describe the water cycle.", "What is inflation?",
    "Give three ideas for a rainy weekend.", "How does a compiler differ from an interpreter?",
    "What is the Pythagorean theorem?", "Write a two-line poem about the sea.", "Why is the sky blue?",
    "How do I make a good cup of tea?", "What does DNA do?", "Explain what a database index is.",
    "What were the causes of the First World War?", "How do solar panels generate electricity?",
    "Give me a packing list for a weekend hike.", "What is machine learning?", "How do bees make honey?",
]


def batch_prompts(n: int) -> list[str]:
    pool = [p for _, p in CHAT_PROMPTS] + _BATCH_EXTRA
    return [pool[i % len(pool)] for i in range(n)]


# -- helpers -----------------------------------------------------------------------------------------
log = make_logger("spec-bench")


def _itl(outs: list) -> float | None:
    """Pooled inter-token latency (s): total decode time over total inter-token gaps."""
    num = sum(o.metrics.last_token_time - o.metrics.first_token_time for o in outs if o.metrics.num_output_tokens > 1)
    den = sum(o.metrics.num_output_tokens - 1 for o in outs if o.metrics.num_output_tokens > 1)
    return num / den if den else None


def _spec_counters(outs: list) -> dict:
    drafts = sum(o.metrics.spec_num_drafts for o in outs)
    proposed = sum(o.metrics.spec_num_draft_tokens for o in outs)
    accepted = sum(o.metrics.spec_num_accepted_tokens for o in outs)
    return {"num_verify_steps_with_drafts": drafts, "num_draft_tokens": proposed, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / proposed if proposed else None,
            "mean_accepted_length": accepted / drafts if drafts else None,
            "draft_time_s": sum(o.metrics.spec_draft_time for o in outs),
            "verify_time_s": sum(o.metrics.spec_verify_time for o in outs)}


def _stats_delta(before: dict, after: dict) -> dict:
    """Engine-wide depth histogram and accepted-per-position over one workload (after - before)."""
    hb, ha = before.get("spec_depth_histogram", {}), after.get("spec_depth_histogram", {})
    hist = {int(k): ha[k] - hb.get(k, 0) for k in sorted(ha) if ha[k] - hb.get(k, 0)}
    pb, pa = before.get("spec_accepted_per_position", []), after.get("spec_accepted_per_position", [])
    pos = [pa[i] - (pb[i] if i < len(pb) else 0) for i in range(len(pa))]
    steps = sum(hist.values())
    return {"depth_histogram": hist, "accepted_per_position": pos,
            "mean_depth": sum(k * v for k, v in hist.items()) / steps if steps else None,
            "fraction_steps_k0": hist.get(0, 0) / steps if steps else None}


def _eos_before_limit(tokens: list[int], eos: int | None) -> bool:
    return eos is not None and eos in tokens


class Engines:
    """The engines of one run, by name; 'baseline' has no speculation."""

    def __init__(self, model: str | None):
        self.model, self.llms, self.configs = model, {}, {}       # None: the default model

    def build(self, name: str, spec: dict | None, kv_bytes: int) -> None:
        from engine import LLM
        t = time.perf_counter()
        self.llms[name] = LLM(self.model, max_model_len=MAX_MODEL_LEN, kv_cache_memory=kv_bytes,
                              speculative_config=spec)
        self.configs[name] = spec
        log(f"built {name} ({spec or 'no speculation'}) in {time.perf_counter() - t:.1f} s")

    def warm_up(self, prompt: list[int]) -> None:
        from engine import SamplingParams
        for llm in self.llms.values():
            llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.0))


# -- batch 1: baseline and every speculative engine, interleaved per prompt --------------------------
def run_batch1(engines: Engines, names: list[str], workload: str, prompts: list[tuple[str, list[int]]],
               max_tokens: int, eos: int | None) -> dict[str, dict]:
    """Greedy at batch 1. Returns per engine name: ITL, spec counters, depth histogram, per-request rows."""
    from engine import SamplingParams
    # greedy outputs are the same with and without speculation, so both sides stop at the same EOS:
    # no text the model did not mean to write is measured
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    before = {n: engines.llms[n].engine.stats() for n in names}
    outs: dict[str, list] = {n: [] for n in names}
    for i, (pname, ids) in enumerate(prompts):
        line = []
        for n in names:
            o = engines.llms[n].generate([ids], sp)[0]
            outs[n].append(o)
            tpot = o.metrics.time_per_output_token
            acc = o.metrics.spec_acceptance_rate
            line.append(f"{n} {tpot * 1e3:.1f} ms" + (f" acc {acc:.2f}" if acc is not None else ""))
        log(f"{workload} {i + 1}/{len(prompts)} {pname} ({len(ids)} prompt tokens): " + ", ".join(line))
    res = {}
    base = outs[names[0]]
    for n in names:
        o = outs[n]
        r: dict[str, Any] = {"itl_ms": _itl(o) * 1e3, "output_tokens": sum(x.metrics.num_output_tokens for x in o),
                             "mean_ttft_ms": statistics.fmean(x.metrics.ttft for x in o) * 1e3}
        if engines.configs[n] is not None:
            r.update(_spec_counters(o))
            r.update(_stats_delta(before[n], engines.llms[n].engine.stats()))
            r["identical_to_baseline"] = sum(list(a.token_ids) == list(b.token_ids) for a, b in zip(base, o))
            r["first_divergence"] = [_first_diff(a.token_ids, b.token_ids) for a, b in zip(base, o)]
        r["requests"] = [{"prompt": p, "prompt_tokens": len(x.prompt_token_ids),
                          "output_tokens": x.metrics.num_output_tokens,
                          "itl_ms": (x.metrics.time_per_output_token or 0) * 1e3,
                          "acceptance_rate": x.metrics.spec_acceptance_rate,
                          "mean_accepted_length": x.metrics.spec_mean_accepted_length}
                         for (p, _), x in zip(prompts, o)]
        res[n] = r
    res[names[0]]["eos_before_max_tokens"] = sum(_eos_before_limit(list(x.token_ids), eos) for x in base)
    return res


def _first_diff(a, b) -> int | None:
    a, b = list(a), list(b)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _compare(base: dict, spec: dict, greedy: bool, n: int) -> dict:
    out = {"itl_ms_baseline": base["itl_ms"], "itl_ms_spec": spec["itl_ms"],
           "speedup": base["itl_ms"] / spec["itl_ms"],
           "acceptance_rate": spec["acceptance_rate"], "mean_accepted_length": spec["mean_accepted_length"],
           "depth_histogram": spec["depth_histogram"], "mean_depth": spec["mean_depth"],
           "fraction_steps_k0": spec["fraction_steps_k0"], "accepted_per_position": spec["accepted_per_position"],
           "num_draft_tokens": spec["num_draft_tokens"], "num_accepted_tokens": spec["num_accepted_tokens"],
           "tokens_baseline": base["output_tokens"], "tokens_spec": spec["output_tokens"], "num_requests": n}
    if greedy:
        out["identical_outputs"] = spec["identical_to_baseline"]
        out["all_identical"] = spec["identical_to_baseline"] == n
    return out


# -- (c): 32 requests at once ------------------------------------------------------------------------
def run_batch(engines: Engines, spec_name: str, prompts: list[list[int]], max_tokens: int,
              rounds: int = 3) -> dict:
    """All requests at once, sampled; `rounds` rounds of a baseline and a spec run, which goes first alternating
    (AB BA AB...) so that neither always runs after the other (a machine that speeds up or slows down within a
    round hits both alike); each round uses other seeds. ITL and tokens/s pool every round."""
    from engine import SamplingParams
    res = {}
    outs: dict[str, list] = {"baseline": [], spec_name: []}
    walls = {"baseline": 0.0, spec_name: 0.0}
    before = engines.llms[spec_name].engine.stats()
    for r in range(rounds):
        params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1000 * (r + 1) + i, max_tokens=max_tokens,
                                 ignore_eos=True) for i in range(len(prompts))]
        for n in ("baseline", spec_name) if r % 2 == 0 else (spec_name, "baseline"):
            t = time.perf_counter()
            o = engines.llms[n].generate(prompts, params)
            wall = time.perf_counter() - t
            walls[n] += wall
            outs[n] += o
            log(f"batch{len(prompts)} round {r + 1}/{rounds} {n}: ITL {_itl(o) * 1e3:.1f} ms, "
                f"{sum(x.metrics.num_output_tokens for x in o) / wall:.1f} tok/s")
    for n, o in outs.items():
        toks = sum(x.metrics.num_output_tokens for x in o)
        r = {"itl_ms": _itl(o) * 1e3,
             "mean_request_itl_ms": statistics.fmean(x.metrics.time_per_output_token for x in o) * 1e3,
             "mean_ttft_ms": statistics.fmean(x.metrics.ttft for x in o) * 1e3,
             "wall_s": walls[n], "output_tokens": toks, "output_tokens_per_s": toks / walls[n], "rounds": rounds}
        if n != "baseline":
            r.update(_spec_counters(o))
            r.update(_stats_delta(before, engines.llms[n].engine.stats()))
        res[n] = r
    return res


# -- plot --------------------------------------------------------------------------------------------
def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 4]})
    w = result["workloads"]
    names = [n for n in ("repeat", "chat", "batch32") if n in w]
    xs = range(len(names))
    b = [w[n]["itl_ms_baseline"] for n in names]
    s = [w[n]["itl_ms_spec"] for n in names]
    ax1.bar([x - 0.2 for x in xs], b, 0.4, label="no speculation", color="tab:gray")
    bars = ax1.bar([x + 0.2 for x in xs], s, 0.4, label=result["spec_label"], color="tab:blue")
    for bar, n in zip(bars, names):
        acc = w[n]["acceptance_rate"]
        ax1.annotate(f"x{w[n]['speedup']:.2f}" + (f"\nacc {acc:.2f}" if acc is not None else ""),
                     (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(xs), names)
    ax1.set_ylabel("inter-token latency (ms)")
    ax1.set_title("ITL without / with speculation (speedup = base / spec)", fontsize=9)
    ax1.legend(fontsize=8)
    ax1.margins(y=0.2)

    ls = result.get("layer_skip", {})
    groups = [g for g in ("repeat", "chat") if g in ls]
    if groups:
        configs = list(ls[groups[0]]["configs"])
        labels = ["no speculation"] + configs
        width = 0.8 / len(labels)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for j, lab in enumerate(labels):
            vals, annots = [], []
            for g in groups:
                if j == 0:
                    vals.append(ls[g]["itl_ms_baseline"])
                    annots.append("")
                else:
                    c = ls[g]["configs"][lab]
                    vals.append(c["itl_ms"])
                    acc = c["acceptance_rate"]
                    annots.append(f"x{c['speedup']:.2f}\nacc " + (f"{acc:.2f}" if acc is not None else "-"))
            pos = [gi - 0.4 + width * (j + 0.5) for gi in range(len(groups))]
            bars = ax2.bar(pos, vals, width, label=lab, color="tab:gray" if j == 0 else colors[j % len(colors)])
            for bar, a in zip(bars, annots):
                ax2.annotate(a, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                             fontsize=7)
        ax2.set_xticks(range(len(groups)), groups)
        ax2.set_ylabel("inter-token latency (ms)")
        ax2.set_title("layer_skip self-drafting, batch 1 (speedup, acceptance rate)", fontsize=9)
        ax2.legend(fontsize=7)
        ax2.margins(y=0.25)
    fig.suptitle(f"{Path(result['model']).name} on {result['device']}, max_tokens {result['max_tokens']}"
                 + (" (quick)" if result["quick"] else ""), fontsize=10)
    save(fig, path)


# -- the command ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF model directory or .gguf (default: SmolLM2-135M-Instruct)")
    p.add_argument("--method", default="ngram", choices=("ngram", "layer_skip", "draft_model", "eagle", "eagle3", "mtp"),
                   help="speculation of workloads (a)-(c), adaptive depth (default: ngram)")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of that method (default 4)")
    p.add_argument("--num-layers", type=int, default=8, help="--method layer_skip: drafting layers")
    p.add_argument("--draft-model", default=None,
                   help="--method draft_model: the draft's path; eagle, eagle3: the head's (`baton bench eagle-head` "
                        "trains an EAGLE-3 head)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens per batch-1 request (default {FULL['max_tokens']}, quick {QUICK['max_tokens']})")
    p.add_argument("--batch-max-tokens", type=int, default=None,
                   help=f"tokens per request of batch32 (default {FULL['batch_max_tokens']}, "
                        f"quick {QUICK['batch_max_tokens']})")
    p.add_argument("--skip-layer-skip", action="store_true", help="leave out workload (d)")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['num_repeat']} repeat and {QUICK['num_chat']} chat prompts, "
                        f"{QUICK['max_tokens']} tokens (batch32: {QUICK['batch_max_tokens']}), "
                        f"{QUICK['num_layer_skip']} layer_skip config")
    p.add_argument("--out", "--out-dir", dest="out_dir", default="bench_out/spec",
                   help="directory for spec.json and spec_itl.png (default bench_out/spec)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def _main_spec(args) -> dict:
    spec: dict[str, Any] = {"method": args.method, "num_speculative_tokens": args.k, "adaptive": True}
    if args.method == "ngram":
        spec.update(prompt_lookup_min=1, prompt_lookup_max=4)
    elif args.method == "layer_skip":
        spec["num_layers"] = args.num_layers
    elif args.method != "mtp":
        if not args.draft_model:
            raise SystemExit(f"baton bench spec: --method {args.method} needs --draft-model PATH")
        spec["model"] = args.draft_model
    return spec


def run(args: argparse.Namespace) -> dict:
    from engine.loader import resolve_model
    started = time.perf_counter()
    cfg = QUICK if args.quick else FULL
    max_tokens = args.max_tokens or cfg["max_tokens"]
    batch_max_tokens = args.batch_max_tokens or cfg["batch_max_tokens"]
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model_path = resolve_model(args.model)
    spec_name = f"{args.method}_k{args.k}_adaptive"
    main_spec = _main_spec(args)

    # the model as the user named it: the default model runs as `baton serve` runs it, in its packed GGUF types
    # (engine/quant.py); a converted directory's path would run it dequantized to fp32
    engines = Engines(args.model)
    engines.build("baseline", None, KV_BYTES_MAIN)
    engines.build(spec_name, main_spec, KV_BYTES_MAIN)
    ls_names = []
    if not args.skip_layer_skip:
        for n_layers, adaptive in LAYER_SKIP[:cfg["num_layer_skip"]]:
            name = f"layer_skip{n_layers}_k{LAYER_SKIP_K}_" + ("adaptive" if adaptive else "fixed")
            engines.build(name, {"method": "layer_skip", "num_layers": n_layers,
                                 "num_speculative_tokens": LAYER_SKIP_K, "adaptive": adaptive}, KV_BYTES_SMALL)
            ls_names.append(name)

    base = engines.llms["baseline"]
    chat = lambda text: base.apply_chat_template([{"role": "user", "content": text}])  # noqa: E731
    repeat = [(n, chat(t)) for n, t in REPEAT_PROMPTS[:cfg["num_repeat"]]]
    chats = [(n, chat(t)) for n, t in CHAT_PROMPTS[:cfg["num_chat"]]]
    batch = [chat(t) for t in batch_prompts(BATCH)]
    eos = base.tokenizer.eos_token_id
    runner = base.engine.runner
    num_layers_total = runner.model.num_layers

    log("warming up every engine with one short request")
    engines.warm_up(chat("Hello!"))

    names = ["baseline", spec_name] + ls_names
    t = time.perf_counter()
    r_repeat = run_batch1(engines, names, "repeat", repeat, max_tokens, eos)
    r_chat = run_batch1(engines, names, "chat", chats, max_tokens, eos)
    r_batch = run_batch(engines, spec_name, batch, batch_max_tokens, rounds=2 if args.quick else 3)
    log(f"measured in {time.perf_counter() - t:.1f} s")

    workloads = {
        "repeat": {**_compare(r_repeat["baseline"], r_repeat[spec_name], True, len(repeat)),
                   "eos_before_max_tokens_baseline": r_repeat["baseline"]["eos_before_max_tokens"]},
        "chat": {**_compare(r_chat["baseline"], r_chat[spec_name], True, len(chats)),
                 "eos_before_max_tokens_baseline": r_chat["baseline"]["eos_before_max_tokens"]},
        "batch32": {**_compare(r_batch["baseline"], r_batch[spec_name], False, BATCH),
                    "tokens_per_s_baseline": r_batch["baseline"]["output_tokens_per_s"],
                    "tokens_per_s_spec": r_batch[spec_name]["output_tokens_per_s"],
                    "mean_request_itl_ms_baseline": r_batch["baseline"]["mean_request_itl_ms"],
                    "mean_request_itl_ms_spec": r_batch[spec_name]["mean_request_itl_ms"],
                    "wall_s_baseline": r_batch["baseline"]["wall_s"], "wall_s_spec": r_batch[spec_name]["wall_s"]},
    }
    w = workloads
    goals = {
        "repeat_speedup_ge_1.5": w["repeat"]["speedup"] >= GOAL_REPEAT_SPEEDUP,
        "chat_itl_spec_le_1.05x_baseline": w["chat"]["itl_ms_spec"] <= GOAL_NO_SLOWDOWN * w["chat"]["itl_ms_baseline"],
        "batch32_itl_spec_le_1.05x_baseline":
            w["batch32"]["itl_ms_spec"] <= GOAL_NO_SLOWDOWN * w["batch32"]["itl_ms_baseline"],
        "greedy_outputs_identical": w["repeat"]["all_identical"] and w["chat"]["all_identical"],
    }
    layer_skip = {}
    if ls_names:
        for g, r in (("repeat", r_repeat), ("chat", r_chat)):
            n = len(repeat if g == "repeat" else chats)
            layer_skip[g] = {"itl_ms_baseline": r["baseline"]["itl_ms"], "configs": {
                name: {k: v for k, v in {**_compare(r["baseline"], r[name], True, n),
                                         "itl_ms": r[name]["itl_ms"]}.items()
                       if k not in ("itl_ms_baseline", "itl_ms_spec")}
                for name in ls_names}}
    result: dict[str, Any] = {
        "benchmark": "spec", "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(), "model": model_path, "model_num_layers": num_layers_total,
        "device": str(runner.device), "dtype": str(runner.dtype).removeprefix("torch."),
        "quantization": runner.quantization,
        "quick": args.quick, "max_tokens": max_tokens, "batch_max_tokens": batch_max_tokens,
        "spec_engine": spec_name, "spec_config": main_spec,
        "spec_label": f"{args.method} k={args.k} adaptive",
        "layer_skip_configs": {n: engines.configs[n] for n in ls_names},
        "method_notes": {
            "itl": "sum over requests of (last_token_time - first_token_time) / sum of (num_output_tokens - 1)",
            "order": "per prompt: baseline, then each speculative engine (interleaved); "
                     "batch32: rounds of a baseline and a spec run, which goes first alternating (AB BA ...), "
                     "other seeds each round",
            "sampling": "repeat/chat/layer_skip greedy; batch32 temperature 0.7, top_p 0.9, seed 1000*(round+1)+i; "
                        "batch-1 stops at EOS; batch32 ignore_eos",
            "depth_histogram": "engine.stats() delta over the workload: chosen depth -> request-steps in decode",
            "goals": f"repeat speedup >= {GOAL_REPEAT_SPEEDUP}; chat and batch32 ITL_spec <= "
                     f"{GOAL_NO_SLOWDOWN} x ITL_baseline"},
        "workloads": workloads, "goals": goals, "layer_skip": layer_skip,
        "per_engine": {"repeat": r_repeat, "chat": r_chat, "batch32": r_batch},
    }
    for n in ("repeat", "chat", "batch32"):
        x = w[n]
        log(f"{n}: ITL {x['itl_ms_baseline']:.1f} -> {x['itl_ms_spec']:.1f} ms (x{x['speedup']:.2f}), "
            f"acceptance {x['acceptance_rate']}, identical {x.get('identical_outputs', '-')}")
    log(f"goals: {goals}")
    write_result(result, out_dir / "spec.json", {"itl": ("spec_itl.png", plot)})
    log(f"wrote {result['json_path']} and {result['plots']['itl']} in {time.perf_counter() - started:.0f} s")
    return result
