"""What a step, a transfer and a request's overheads cost in the planning simulator (plan/sim.py).

A step's time is a function of what the scheduler put in it (engine/scheduler.py's batch):
    T  new tokens (prefill chunks + one per decoding sequence)
    A  attention pairs: for each sequence, new tokens x the context they attend to (cached + new)
    S  sequences in the batch
    C  context: the KV tokens the batch reads (each sequence's cached + new tokens)
Two models answer it:

- LinearCost, calibrated on this machine (`baton plan calibrate`: the real engine's step timings over a grid of
  batches, fitted by least squares): step = c0 + c_tok T + c_attn A + c_ctx C + c_seq S (a prompt's attention
  is compute, pairs; a decode's is reading its context's KV). On a CPU the replicas of one
  machine share its cores (`shared_device`): a step that starts while k other engines are busy takes
  max(1, (k + 1) x threads / cores) x (1 + contention x k) times as long: the cores shared out, and the
  interference of a busy neighbour on a core of its own (memory bandwidth, caches; measured by the engines'
  step counters). The serving work around those steps (streaming their tokens: the ingress, the proxy, the
  replica's event loop) has no core of its own and slows more, by 1 + serving_contention x k (measured from the
  decode engine's step period less its steps).
- RooflineCost, for a GPU that was never measured: FLOPs (2 x parameters per token, 4 x layers x heads x
  head_dim per attention pair) at a fraction of peak, against the bytes read (the weights once per step, the
  context's KV) at a fraction of HBM bandwidth; the slower wins, plus a fixed per-step overhead. Presets for
  H100 and H200 SXM, a model's shape from its Hugging Face config (or a preset name).

Both give the KV bytes of a token (transfers, capacity), the KV-transfer bandwidth, and the fixed overheads of
the serving path the engine does not see: ingress to first step (`request_s`, of which `ingress_s` is serial: a
burst's requests wait for each other's), prefill to decode hand-off
(`handoff_s`), both longer by `stream_s` for each sequence the decode pool runs (the serving path carries their
tokens), and what streaming adds to a step (`step_s` + `token_s` per token it streams).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from engine.scheduler import attention_pairs  # noqa: F401  (the engine's rule; the planner's modules take it here)


@dataclass
class Batch:
    """The shape of one step: new tokens, attention pairs, sequences, KV tokens read."""
    tokens: int
    pairs: float
    seqs: int
    context: int


@dataclass
class Overheads:
    request_s: float = 0.0         # ingress: parse, tokenize, hash, route, the Serve calls to the first step
    handoff_s: float = 0.0         # prefill's answer to the decode replica's pull starting (Serve call, handle)
    transfer_gbps: float = 5.0     # KV pull bandwidth, GB/s
    transfer_latency_s: float = 0.002
    step_s: float = 0.0            # what serving adds to each engine step (streaming its outputs, the ingress's SSE)
    token_s: float = 0.0           # ... and to each token a step streams (on a CPU these share the engine's cores)
    stream_s: float = 0.0          # request_s and handoff_s grow by this for each sequence the decode pool runs:
                                   # the ingress's event loop and the cores it shares carry every stream's tokens
    ingress_s: float = 0.0         # the serial part of request_s: the client, the ingress and the proxy take a
                                   # burst's requests one after another, each this long (a queue with one server)
    step_jitter: float = 0.0       # the spread of a served step's time: each step takes a lognormal multiple of
                                   # its modelled time, mean 1 and this sigma (of the log); calibrated from a batch's
                                   # token gaps (their p90 over their p50), 0 on a GPU roofline

    def at_speed(self, factor: float) -> Overheads:
        """The serving path's CPU work (request, hand-off, streaming) taking `factor` times as long; transfers not."""
        return replace(self, request_s=self.request_s * factor, handoff_s=self.handoff_s * factor,
                       step_s=self.step_s * factor, token_s=self.token_s * factor, stream_s=self.stream_s * factor,
                       ingress_s=self.ingress_s * factor)

    def pull_s(self, nbytes: float) -> float:
        """Seconds a KV pull of `nbytes` takes: the transfer's latency, then its bandwidth."""
        return self.transfer_latency_s + nbytes / (self.transfer_gbps * 1e9)


@dataclass
class LinearCost:
    """step = c0 + c_tok T + c_attn A + c_ctx C + c_seq S, calibrated from the engine's step timings on one machine."""
    c0: float
    c_tok: float
    c_attn: float
    c_seq: float
    kv_bytes_per_token: int
    c_ctx: float = 0.0
    overheads: Overheads = field(default_factory=Overheads)
    shared_device: bool = False    # the replicas of this machine share its compute (CPU cores)
    contention: float = 1.0        # with shared_device: a step takes 1 + contention x (other busy engines) as long
    serving_contention: float = 0.0    # ... and the serving work around it (Overheads.step_s, token_s) takes
                                       # 1 + serving_contention x (other busy engines) as long
    cores: int = 0                 # with shared_device: the machine's cores (0: not modelled) ...
    threads: int = 1               # ... and each engine's threads: k busy engines share the cores (k x threads / cores)
    name: str = "calibrated"
    fit: dict[str, Any] = field(default_factory=dict)     # how good the fit was (residuals), for the record
    kind: str = "linear"

    def step_s(self, b: Batch) -> float:
        return self.c0 + self.c_tok * b.tokens + self.c_attn * b.pairs + self.c_ctx * b.context + self.c_seq * b.seqs

    def steps_s(self, steps: int, total: Batch) -> float:
        """The fit's seconds for `steps` steps whose shapes sum to `total` (a linear model sums): what the engine's
        step counters (replica/metrics.py STEP_COUNTERS) predict."""
        return self.c0 * steps + self.c_tok * total.tokens + self.c_attn * total.pairs + self.c_ctx * total.context \
            + self.c_seq * total.seqs

    def at_speed(self, factor: float) -> LinearCost:
        """This machine running `factor` times as slow as when it was fitted (plan/calibrate.py speed(): a VM's
        speed drifts): every step, and the serving path's CPU work (request, hand-off, streaming), take `factor`
        times as long; transfers and contention do not change."""
        return replace(self, c0=self.c0 * factor, c_tok=self.c_tok * factor, c_attn=self.c_attn * factor,
                       c_ctx=self.c_ctx * factor, c_seq=self.c_seq * factor,
                       overheads=self.overheads.at_speed(factor))

    def decode_steps_s(self, batch: int, context: int, k: int, growth: float | None = None) -> np.ndarray:
        """Durations of k decode steps of `batch` sequences holding `context` tokens in all at the first (`growth`:
        what each step adds to the context read, `batch` without a window)."""
        ctx = context + (batch if growth is None else growth) * np.arange(1, k + 1, dtype=np.float64)
        return self.c0 + (self.c_tok + self.c_seq) * batch + (self.c_attn + self.c_ctx) * ctx

    @staticmethod
    def pairs(new: int, cached: int) -> float:
        """A chunk's attention pairs (a calibrated engine's model has no window)."""
        return attention_pairs(new, cached)

    @staticmethod
    def kv_read(context: int | np.ndarray) -> int | np.ndarray:
        """KV tokens a sequence's step reads, a layer's on average, at this context: all of them."""
        return context

    def kv_tokens(self, kv_cache_memory: int | float | None, num_kv_blocks: int | None, block_size: int) -> int:
        """Tokens one replica's KV cache holds (the engine's own rule: blocks, else bytes; a fraction needs a GPU)."""
        if num_kv_blocks:
            return num_kv_blocks * block_size
        if not isinstance(kv_cache_memory, int):
            raise ValueError("a calibrated CPU cost model needs kv_cache_memory in bytes or num_kv_blocks")
        return kv_cache_memory // (self.kv_bytes_per_token * block_size) * block_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def fitted(cls, rows: list[tuple[Batch, float]], kv_bytes_per_token: int, **kw: Any) -> LinearCost:
        """Least squares over measured (batch, seconds), coefficients kept non-negative (a negative one is
        dropped and the rest refitted), so extrapolation never predicts a faster step for more work."""
        x = np.array([[1.0, b.tokens, b.pairs, b.seqs, b.context] for b, _ in rows])
        y = np.array([s for _, s in rows])
        keep = [0, 1, 2, 3, 4]
        while True:
            coef, *_ = np.linalg.lstsq(x[:, keep] / y[:, None], np.ones(len(y)), rcond=None)   # relative error
            if (coef >= 0).all():
                break
            keep.pop(int(np.argmin(coef)))
        full = np.zeros(5)
        full[keep] = coef
        pred = x @ full
        rel = np.abs(pred - y) / y
        fit = {"steps": len(rows), "median_rel_error": float(np.median(rel)), "p90_rel_error": float(np.percentile(rel, 90))}
        c0, c_tok, c_attn, c_seq, c_ctx = map(float, full)
        return cls(c0, c_tok, c_attn, c_seq, kv_bytes_per_token=kv_bytes_per_token, c_ctx=c_ctx, fit=fit, **kw)


# -- GPUs and models for the roofline -----------------------------------------------------------------
GPUS = {      # dense bf16 tensor-core FLOP/s, HBM bytes/s, HBM bytes, NVLink bytes/s each way (SXM parts, vendor figures)
    "h100": {"flops": 989e12, "bandwidth": 3.35e12, "memory": 80e9, "link": 450e9, "name": "NVIDIA H100 SXM 80GB"},
    "h200": {"flops": 989e12, "bandwidth": 4.8e12, "memory": 141e9, "link": 450e9, "name": "NVIDIA H200 SXM 141GB"},
}
MODELS = {    # Hugging Face config fields of models operators size clusters for
    "llama-3.1-8b": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256},
    "llama-3.1-70b": {"hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
                      "num_key_value_heads": 8, "intermediate_size": 28672, "vocab_size": 128256},
    "qwen2.5-32b": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 40,
                    "num_key_value_heads": 8, "intermediate_size": 27648, "vocab_size": 152064},
    "qwen3-8b": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
    "qwen3-32b": {"hidden_size": 5120, "num_hidden_layers": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
                  "head_dim": 128, "intermediate_size": 25600, "vocab_size": 151936},   # heads x head_dim: 8,192
    # mixtures of experts: every layer sparse
    "mixtral-8x7b": {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                     "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "vocab_size": 151936, "num_experts": 128,
                      "num_experts_per_tok": 8},
    # sliding windows: attention in those layers reads at most the window's tokens (the cache still holds all)
    "gemma-2-9b": {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 256, "intermediate_size": 14336, "vocab_size": 256000,
                   "sliding_window": 4096, "query_pre_attn_scalar": 256},
    "gemma-3-27b": {"model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
                    "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "intermediate_size": 21504,
                    "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": 168},
    "phi-4": {"model_type": "phi3", "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 40,
              "num_key_value_heads": 10, "intermediate_size": 17920, "vocab_size": 100352},
    # gpt-oss: experts with windows of 128 on every other layer (bf16 here: its MXFP4 experts load dequantized)
    "gpt-oss-20b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
                    "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "vocab_size": 201088,
                    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128},
    "gpt-oss-120b": {"model_type": "gpt_oss", "hidden_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64,
                     "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2880, "vocab_size": 201088,
                     "num_local_experts": 128, "num_experts_per_tok": 4, "sliding_window": 128},
    # DeepSeek's MLA: a latent of 512 + 64 a token and layer in the cache (on every GPU of a TP replica); experts
    # with shared ones beside them, the first layers dense. V3's released weights are block FP8, which the engine
    # loads dequantized to bf16 (the roofline's 2 bytes a parameter)
    "deepseek-v3": {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
                    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
                    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "intermediate_size": 18432,
                    "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8,
                    "n_shared_experts": 1, "first_k_dense_replace": 3, "vocab_size": 129280},
    # Llama 4: every layer (Scout) or every other one (Maverick) sparse, one expert a token beside a shared one; the
    # dense layers of their own width; chunked attention on three layers of four (not priced: the roofline reads
    # their whole context)
    "llama-4-scout": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                      "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192,
                      "intermediate_size_mlp": 16384, "num_local_experts": 16, "num_experts_per_tok": 1,
                      "interleave_moe_layer_step": 1, "vocab_size": 202048},
    "llama-4-maverick": {"model_type": "llama4_text", "hidden_size": 5120, "num_hidden_layers": 48,
                         "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
                         "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 128,
                         "num_experts_per_tok": 1, "interleave_moe_layer_step": 2, "vocab_size": 202048},
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 27,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512,
                         "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
                         "num_experts_per_tok": 6, "n_shared_experts": 2, "first_k_dense_replace": 1,
                         "vocab_size": 102400},
}


def moe_shape(m: dict[str, Any]) -> tuple[int, int, int, int]:
    """(experts a sparse layer holds, experts a token uses, parameters of one expert, sparse layers) of a config;
    zeros for a dense model: the engine's own rules (engine/model.py), on the config as a dict."""
    from engine.model import is_moe_layer, moe_intermediate_size, num_experts
    config = SimpleNamespace(**{"model_type": "", **m})
    experts = num_experts(config)
    if not experts:
        return 0, 0, 0, 0
    sparse = sum(1 for i in range(m["num_hidden_layers"]) if is_moe_layer(config, i))
    return experts, int(m["num_experts_per_tok"]), 3 * m["hidden_size"] * moe_intermediate_size(config), sparse


def model_windows(m: dict[str, Any]) -> tuple[int, int]:
    """(sliding window, layers that use it) of a config: the engine's rule (engine/model.py layer_window) on the
    config transformers builds from these fields (its defaults: Gemma 2's every other layer, Gemma 3's five of
    six); (0, 0) for a model without one."""
    if not m.get("sliding_window") or not m.get("model_type"):
        return 0, 0
    from transformers import AutoConfig

    from engine.model import layer_window
    config = AutoConfig.for_model(m["model_type"], **{k: v for k, v in m.items()
                                                      if k not in ("model_type", "name", "architectures")})
    windows = [layer_window(config, i) for i in range(config.num_hidden_layers)]
    return max(windows), sum(1 for w in windows if w)


def windowed_pairs(new: int, cached: int, window: int) -> float:
    """attention_pairs under a sliding window: the query at position p (from 0) sees min(p + 1, window) keys."""
    lo, hi = cached + 1, cached + new                 # the queries' counts of visible keys without the window
    below = max(0, min(hi, window) - lo + 1)          # those at most the window: themselves
    first = lo
    total = below * (first + first + below - 1) / 2 if below else 0.0
    return total + window * (new - below)


def model_shape(model: str | dict) -> dict[str, Any]:
    """A preset name, a config.json path, a model directory holding one, or the config as a dict (a multimodal
    model's, Gemma 3 4B+'s: its text model's, as the engine serves it)."""
    if isinstance(model, dict):
        return model
    if model in MODELS:
        return {**MODELS[model], "name": model}
    path = Path(model)
    path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise ValueError(f"unknown model {model!r}: a preset ({', '.join(MODELS)}), or a config.json or its directory")
    config = json.loads(path.read_text())
    if isinstance(config.get("text_config"), dict):
        config = {"model_type": config["model_type"] + "_text", **config["text_config"]}
    return {**config, "name": str(model)}


def kv_value_bytes(kv_cache_dtype: str, model: dict[str, Any], dtype_bytes: float = 2.0) -> float:
    """Bytes one cached K or V value takes: the model's dtype ("auto"), or a byte and its share of the per-token,
    per-head fp32 scale (int8, fp8: engine/kv_layout.py)."""
    if kv_cache_dtype == "auto":
        return dtype_bytes
    d = model["kv_lora_rank"] + model["qk_rope_head_dim"] if model.get("kv_lora_rank") else \
        model.get("head_dim") or model["hidden_size"] // model["num_attention_heads"]
    return 1.0 + 4.0 / d


@dataclass
class RooflineCost:
    """A GPU replica of `tp` GPUs: step = max(FLOPs / (peak x mfu), bytes / (bandwidth x mbu)) + step_overhead_s."""
    gpu: str = "h100"
    model: dict[str, Any] = field(default_factory=lambda: model_shape("llama-3.1-8b"))
    tp: int = 1
    weight_bytes_per_param: float = 2.0       # bf16; 1 for FP8 weights
    kv_bytes_per_value: float = 2.0           # bf16 KV; an fp8 / int8 cache: kv_value_bytes
    mfu: float = 0.5                          # of peak FLOP/s a prefill reaches (vLLM-class engines: 0.4-0.6)
    mbu: float = 0.75                         # of HBM bandwidth a decode step reaches reading the weights
    kv_mbu: float | None = None               # ... and reading the KV cache (attention; None: mbu)
    step_overhead_s: float = 0.003            # scheduling, sampling, launches per step (CUDA graphs: ~2-4 ms)
    prefill_overhead_s: float | None = None   # the same for a step with a prompt chunk, which runs without CUDA
                                              # graphs (None: step_overhead_s; measured on an H200: ~12 ms, 1B)
    link_efficiency: float = 0.8              # of NVLink bandwidth a ring all-reduce reaches (NCCL's bus bandwidth)
    allreduce_latency_s: float = 15e-6        # one small all-reduce across the replica's GPUs (NCCL over NVSwitch)
    overheads: Overheads = field(default_factory=lambda: Overheads(request_s=0.01, handoff_s=0.005,
                                                                   transfer_gbps=25.0, transfer_latency_s=0.001))
    shared_device: bool = False
    kind: str = "roofline"

    def __post_init__(self) -> None:
        if self.gpu not in GPUS:
            raise ValueError(f"unknown GPU {self.gpu!r}: one of {', '.join(GPUS)}")
        m = self.model
        h, layers = m["hidden_size"], m["num_hidden_layers"]
        heads, kv_heads = m["num_attention_heads"], m.get("num_key_value_heads", m["num_attention_heads"])
        d = m.get("head_dim") or h // heads
        attention = h * heads * d + 2 * h * kv_heads * d + heads * d * h
        self.flops_per_pair = 4 * layers * heads * d
        self.kv_bytes_per_token = int(2 * layers * kv_heads * d * self.kv_bytes_per_value)
        if m.get("kv_lora_rank"):                    # MLA (engine/model.py MLAAttention), run absorbed
            attention, self.flops_per_pair, self.kv_bytes_per_token = self._mla(m)
        experts, top_k, expert, sparse = moe_shape(m)
        llama4 = m.get("model_type") == "llama4_text"
        dense_layer = attention + 3 * h * (m["intermediate_size_mlp"] if llama4 else m["intermediate_size"])
        shared = m.get("shared_expert_intermediate_size") or 0               # Qwen2-MoE's: every token's, gated
        deepseek = (m.get("n_shared_experts") or 0) * (m.get("moe_intermediate_size") or 0)   # DeepSeek's: ungated
        deepseek += m["intermediate_size"] if llama4 else 0                  # Llama 4's, ungated as DeepSeek's
        sparse_layer = attention + h * experts + (3 * h * shared + h if shared else 0) + 3 * h * deepseek
        held = (layers - sparse) * dense_layer + sparse * sparse_layer      # all but the experts
        self.params = held + sparse * experts * expert + m["vocab_size"] * h    # the embedding is read, not multiplied
        self.active_params = held + sparse * top_k * expert + m["vocab_size"] * h   # what one token multiplies by
        self.flops_per_token = 2 * self.active_params
        self.experts, self.top_k, self.expert_params, self.sparse_layers = experts, top_k, expert, sparse
        self.window, windowed = model_windows(m)
        self.window_share = windowed / layers              # of the layers, those that read at most the window
        g = GPUS[self.gpu]
        self.peak, self.bandwidth, self.memory = g["flops"] * self.tp, g["bandwidth"] * self.tp, g["memory"] * self.tp
        self.link = g["link"]
        self.layers, self.hidden = layers, h
        self.name = f"{self.tp}x {g['name']}, {m.get('name', 'model')}"

    def _mla(self, m: dict[str, Any]) -> tuple[int, int, int]:
        """MLA's (attention parameters of a layer, FLOPs per attention pair, KV bytes per token): q through its low
        rank (or whole), the latent and k_pe, kv_b_proj, o; a pair's score over the latent + k_pe and its value over
        the latent, per head (absorbed, as the engine runs it); the latent once a token and layer, held and read
        by every GPU of the replica (its heads split, the latent not: vLLM's MLA under TP likewise)."""
        h, heads, layers = m["hidden_size"], m["num_attention_heads"], m["num_hidden_layers"]
        rank, rope, nope, v = m["kv_lora_rank"], m["qk_rope_head_dim"], m["qk_nope_head_dim"], m["v_head_dim"]
        q_lora = m.get("q_lora_rank")
        q = h * q_lora + q_lora * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
        attention = q + h * (rank + rope) + rank * heads * (nope + v) + heads * v * h
        return attention, 2 * layers * heads * (2 * rank + rope), int(layers * (rank + rope) * self.kv_bytes_per_value
                                                                      * self.tp)

    def weight_bytes_read(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """Bytes of weights a step of `tokens` tokens reads: all of a dense model's; of a mixture of experts, the
        rest and the experts its tokens chose, once each. Tokens choose top_k of E experts alike and apart (the
        expected count of distinct ones: E (1 - (1 - k/E)^tokens)); real routers are skewed, so a step may touch
        fewer and this errs on the slow side."""
        if not self.experts:
            return self.params * self.weight_bytes_per_param
        touched = self.experts * (1.0 - (1.0 - self.top_k / self.experts) ** np.maximum(tokens, 1))
        rest = self.params - self.sparse_layers * self.experts * self.expert_params
        return (rest + self.sparse_layers * touched * self.expert_params) * self.weight_bytes_per_param

    def read_s(self, context: int | np.ndarray, tokens: int | np.ndarray = 1) -> float | np.ndarray:
        """Reading a step's weights (weight_bytes_read) and `context` tokens of KV, at their fractions of HBM
        bandwidth."""
        kv_mbu = self.mbu if self.kv_mbu is None else self.kv_mbu
        return (self.weight_bytes_read(tokens) / self.mbu + self.kv_bytes_per_token * context / kv_mbu) / self.bandwidth

    def step_s(self, b: Batch) -> float:
        flops = self.flops_per_token * b.tokens + self.flops_per_pair * b.pairs
        return max(flops / (self.peak * self.mfu), self.read_s(b.context, b.tokens)) + self.overhead_s(b) + \
            self.comm_s(b.tokens)

    def comm_s(self, tokens: int | np.ndarray) -> float | np.ndarray:
        """Tensor parallelism's all-reduces, not overlapped with compute (as in Baton's and vLLM's TP): two a layer
        (after attention and after the MLP) of the step's activations (tokens x hidden, bf16), each a ring over
        the tp GPUs: 2 (tp - 1) / tp of the bytes over NVLink, plus a fixed latency. None at tp 1."""
        if self.tp == 1:
            return 0.0
        size = tokens * self.hidden * 2.0
        one = self.allreduce_latency_s + 2 * (self.tp - 1) / self.tp * size / (self.link * self.link_efficiency)
        return 2 * self.layers * one

    def overhead_s(self, b: Batch) -> float:
        """Per-step overhead: a step with prompt tokens (more tokens than sequences) pays the prefill one."""
        if b.tokens > b.seqs and self.prefill_overhead_s is not None:
            return self.prefill_overhead_s
        return self.step_overhead_s

    def pairs(self, new: int, cached: int) -> float:
        """A chunk's attention pairs, a layer's on average: its windowed layers' (windowed_pairs) with the rest's."""
        full = attention_pairs(new, cached)
        if not self.window:
            return full
        return (1 - self.window_share) * full + self.window_share * windowed_pairs(new, cached, self.window)

    def kv_read(self, context: int | np.ndarray) -> float | np.ndarray:
        """KV tokens a sequence's decode step reads at this context, a layer's on average: a windowed layer's at most
        the window (Gemma 3-27B at 32k: 52 of 62 layers read 1,024)."""
        if not self.window:
            return context
        return (1 - self.window_share) * context + self.window_share * np.minimum(context, self.window)

    def decode_steps_s(self, batch: int, context: int, k: int, growth: float | None = None) -> np.ndarray:
        ctx = context + (batch if growth is None else growth) * np.arange(1, k + 1, dtype=np.float64)
        flops = self.flops_per_token * batch + self.flops_per_pair * ctx
        return np.maximum(flops / (self.peak * self.mfu), self.read_s(ctx, batch)) + self.step_overhead_s + \
            self.comm_s(batch)

    def fitted(self, rows: list[tuple[Batch, float]]) -> tuple[RooflineCost, dict[str, Any]]:
        """This roofline with mfu, kv_mbu and the two step overheads fitted to measured (batch, seconds) steps of the
        same model on the same GPU (`baton plan calibrate --gpu`): a grid over the two fractions, each overhead the
        median of what they leave unexplained in its kind of step, the least error kept (each kind of step
        counting alike; a step's error capped at 100%, so a stray slow step cannot steer it). mbu stays this
        roofline's: every decode step of one model reads the same weights, so their read time and the fixed
        per-step overhead cannot be told apart from its steps (only their sum); the overhead takes the rest.
        Returns the fit and a report of both models' errors."""
        flops = np.array([self.flops_per_token * b.tokens + self.flops_per_pair * b.pairs for b, _ in rows])
        weights = np.array([self.weight_bytes_read(b.tokens) for b, _ in rows], dtype=np.float64)
        kv = np.array([self.kv_bytes_per_token * b.context for b, _ in rows], dtype=np.float64)
        y = np.array([t for _, t in rows])
        rest = y - np.array([self.comm_s(b.tokens) for b, _ in rows], dtype=np.float64)   # less TP's all-reduces
        prefill = np.array([b.tokens > b.seqs for b, _ in rows])        # the two kinds of step (see overhead_s)
        kinds = [k for k in (prefill, ~prefill) if k.any()]

        def score(predicted: np.ndarray) -> float:
            """What the fit minimizes: each kind of step's mean error (each capped at 100%), averaged."""
            e = np.abs(predicted - y) / y
            return float(np.mean([np.minimum(e[k], 1.0).mean() for k in kinds]))
        # the preset is a candidate too: a fit is never worse than it by its own measure (on a loaded machine no
        # grid point may explain the steps, and the median-based overheads could then land further off)
        preset = self.overhead_s(Batch(2, 0, 1, 2))
        best = (score(np.array([self.step_s(b) for b, _ in rows])), self.mfu, self.kv_mbu or self.mbu,
                self.step_overhead_s, preset)
        for mfu in np.linspace(0.02, 0.8, 40):              # 0.8: above what any engine reaches
            compute = flops / (self.peak * mfu)
            for kv_mbu in np.linspace(0.02, 1.0, 50):
                bound = np.maximum(compute, (weights / self.mbu + kv / kv_mbu) / self.bandwidth)
                over = [max(float(np.median((rest - bound)[k])), 0.0) if k.any() else 0.0 for k in (prefill, ~prefill)]
                s = score(bound + np.where(prefill, over[0], over[1]) + (y - rest))
                if s < best[0]:
                    best = (s, float(mfu), float(kv_mbu), over[1], over[0])
        _, mfu, kv_mbu, decode_s, prefill_s = best
        fit = replace(self, mfu=mfu, kv_mbu=kv_mbu, step_overhead_s=decode_s, prefill_overhead_s=prefill_s)

        def summary(cost: RooflineCost) -> dict[str, float]:
            e = np.abs(np.array([cost.step_s(b) for b, _ in rows]) - y) / y
            out = {"mfu": cost.mfu, "kv_mbu": cost.kv_mbu or cost.mbu, "step_overhead_s": cost.step_overhead_s,
                   "prefill_overhead_s": cost.overhead_s(Batch(2, 0, 1, 2)),     # a step with a prompt token
                   "median_rel_error": float(np.median(e)), "p90_rel_error": float(np.percentile(e, 90)),
                   "score": score(np.array([cost.step_s(b) for b, _ in rows]))}
            for name, k in (("prefill", prefill), ("decode", ~prefill)):
                if k.any():
                    out[f"{name}_median_rel_error"] = float(np.median(e[k]))
            return out
        report = {"steps": len(rows), "prefill_steps": int(prefill.sum()), "mbu": self.mbu,
                  "preset": summary(self), "fitted": summary(fit)}
        return fit, report

    def kv_tokens(self, kv_cache_memory: int | float | None, num_kv_blocks: int | None, block_size: int) -> int:
        """Bytes given, or a fraction (default 0.9) of the replica's HBM less the weights."""
        if num_kv_blocks:
            return num_kv_blocks * block_size
        if isinstance(kv_cache_memory, int):
            room = kv_cache_memory
        else:
            room = (kv_cache_memory or 0.9) * self.memory - self.params * self.weight_bytes_per_param
        if room <= 0:
            raise ValueError(f"{self.name}: the weights do not fit; raise tp")
        return int(room // (self.kv_bytes_per_token * block_size)) * block_size

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "gpu": self.gpu, "model": self.model, "tp": self.tp, "mfu": self.mfu,
                "mbu": self.mbu, "kv_mbu": self.kv_mbu, "step_overhead_s": self.step_overhead_s,
                "prefill_overhead_s": self.prefill_overhead_s, "link_efficiency": self.link_efficiency,
                "allreduce_latency_s": self.allreduce_latency_s,
                "weight_bytes_per_param": self.weight_bytes_per_param, "kv_bytes_per_value": self.kv_bytes_per_value,
                "overheads": asdict(self.overheads), "name": self.name}


Cost = LinearCost | RooflineCost


def load_cost(path: str | Path) -> Cost:
    """A cost model saved by `baton plan calibrate` (or written by hand: the same fields)."""
    d = json.loads(Path(path).read_text())
    d = d.get("cost", d)
    ov = Overheads(**d.pop("overheads", {}))
    kind = d.pop("kind", "linear")
    if kind == "roofline":
        d.pop("name", None)
        return RooflineCost(**d, overheads=ov)
    return LinearCost(**d, overheads=ov)


def save_cost(cost: Cost, path: str | Path, **extra: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"cost": cost.to_dict(), **extra}, indent=2) + "\n")
