"""Draft heads that read the target's hidden states: EAGLE's, EAGLE-3's and DeepSeek's multi-token prediction (MTP).

Each drafts token t+2 from the token t+1 and the target's hidden state at position t, through decoder layers of its
own with their own KV cache:

- eagle (EAGLE-1, Li et al. 2024; vLLM's "eagle" checkpoints): fc([embed(t+1); h_t]) with h_t the target's final
  hidden state (after its last norm), then its decoder layers, the first without its input norm; the target's
  lm_head on the sum, no norm before it.
- eagle3 (EAGLE-3, Li et al. 2025; vLLM's "eagle3"): h_t is fc of three of the target's residual streams side by side
  (entering layers 2, L/2 and L-3, or the head config's eagle_aux_hidden_state_layer_ids); the first layer's attention
  reads [input_norm(embed(t+1)); hidden_norm(h_t)] (twice the width), the stream carries h_t; a final norm and a head
  of its own over a draft vocabulary (d2t maps its ids to the target's).
- mtp (DeepSeek-V3's released `model.layers.{num_hidden_layers}`): eh_proj([enorm(embed(t+1)); hnorm(h_t)]) with h_t
  the target's final hidden state, one of the target's own decoder layers (MLA and experts), its shared_head.norm,
  then the target's lm_head.

The target's embedding (and, but for EAGLE-3, its head) are used, as the papers share them: a head checkpoint's copies
are not read (an EAGLE-3 head's own embedding is, where it ships one). Under TP the head runs on rank 0 with whole
copies read from the target's checkpoint (HeadRunner). Drafting further than one token feeds the head its own output
(the sum before any norm) in place of h_t, as vLLM does; an MTP checkpoint's first prediction layer drafts every depth.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.input_batch import items_shape
from engine.model import MLA_MODEL_TYPES, LlamaForCausalLM, RMSNorm, is_moe_layer
from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class SpecHead(LlamaForCausalLM):
    """forward(input_ids, positions, kv_cache, md, logits_indices, hidden) -> (logits of the chosen rows, the head's
    output at those rows: what the next draft reads as its hidden state). `hidden`: one row per input token, the
    target's final hidden state at the position before that token (or the head's own output, when chaining)."""

    def __init__(self, config, max_positions: int, kind: str, fc_bias: bool = False, own_embedding: bool = False,
                 own_head: bool = False, tied: bool = False):
        super().__init__(config, max_positions)
        h = config.hidden_size
        self.kind = kind
        if not own_head:
            self.lm_head = None                                      # the target's: set by share()
        if not own_embedding:
            self.model.embed_tokens = None
        self.tie_word_embeddings = own_head and tied                 # a copy of a tied target's: one tensor
        self._shared: tuple[nn.Module, nn.Module] | None = None
        self.register_buffer("d2t", None)                           # EAGLE-3: draft id -> target id - draft id
        if kind == "eagle":
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.model.layers[0].input_layernorm = nn.Identity()     # EAGLE's first layer reads fc's output as is
            self.model.norm = nn.Identity()                          # and the head reads the layers' sum as is
        elif kind == "eagle3":
            self.fc = nn.Linear(3 * int(getattr(config, "target_hidden_size", None) or h), h, bias=False)
            first = self.model.layers[0]
            attn = first.self_attn                                   # its attention reads [embedding; hidden]
            attn.qkv_proj = nn.Linear(2 * h, attn.q_size + 2 * attn.kv_size, bias=attn.qkv_proj.bias is not None)
            first.hidden_norm = RMSNorm(h, config.rms_norm_eps)
            self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
            self.draft_vocab = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
            self.target_vocab = config.vocab_size
            self.lm_head = nn.Linear(h, self.draft_vocab, bias=False)
            self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long))
            self.mapped = self.draft_vocab != config.vocab_size      # or a d2t that moves ids (load_weights)
        else:
            self.enorm = RMSNorm(h, config.rms_norm_eps)
            self.hnorm = RMSNorm(h, config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)

    def share(self, target: LlamaForCausalLM) -> None:
        """Take the target's embedding (unless the head has its own) and head (EAGLE-1, MTP): plain attributes, not this
        module's parameters."""
        embed = self.model.embed_tokens if self.model.embed_tokens is not None else target.model.embed_tokens
        self._shared = (embed, self.lm_head if self.lm_head is not None else target.lm_head)

    def materialize(self, device, dtype) -> "SpecHead":
        super().materialize(device, dtype)
        if self.d2t is not None:                                     # storage, not a parameter: zeroed (no map)
            self.d2t.zero_()
        return self

    def tie_weights(self) -> None:
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            super().tie_weights()

    def load_weights(self, weights) -> None:
        """EAGLE-3's d2t is a buffer, not a parameter: taken here, the rest as any model's."""
        def rest():
            for name, tensor in weights:
                if name == "d2t":
                    if self.d2t is None or tensor.shape != self.d2t.shape:
                        raise ModelLoadError(f"d2t of {tensor.shape[0]} ids, for a draft vocabulary of "
                                             f"{getattr(self, 'draft_vocab', 0)}")
                    self.d2t.copy_(tensor)
                    self._d2t_loaded = True
                elif name != "t2d":
                    yield name, tensor
        self._d2t_loaded = False
        super().load_weights(rest())
        if self.d2t is not None:
            if self.mapped and not self._d2t_loaded:
                raise ModelLoadError(f"a draft vocabulary of {self.draft_vocab} ids needs d2t, its map to the "
                                     f"target's {self.target_vocab}")
            self.mapped = self.mapped or bool(self.d2t.any())

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, md, logits_indices, hidden):
        embed, head = self._shared
        e = embed(input_ids)
        hidden = hidden.to(e.dtype)
        ropes = {kind: rope.tables(positions) for kind, rope in self.ropes.items()}
        layers = self.model.layers
        if self.kind == "eagle3":
            if hidden.shape[-1] != e.shape[-1]:                      # the target's three streams: fc them
                hidden = self.fc(hidden)
            first = layers[0]
            if self.norm_before_residual:
                h = first.hidden_norm(hidden)
                residual = h.clone()
            else:
                residual, h = hidden.clone(), first.hidden_norm(hidden)
            a = first.self_attn(torch.cat([first.input_layernorm(e), h], dim=-1), ropes, kv_cache, md)
            x = first.mlp(first.post_attention_layernorm.add(a, residual))
            layers = layers[1:]
        else:
            x = self.fc(torch.cat([e, hidden], dim=-1)) if self.kind == "eagle" else \
                self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
            residual = None
        for layer in layers:
            x, residual = layer(x, residual, ropes, kv_cache, md)
        out = (residual + x)[logits_indices]
        logits = head(self.model.norm(out)).float()
        if self.kind == "eagle3" and self.mapped:                   # onto the target's ids, -inf elsewhere
            full = logits.new_full((logits.shape[0], self.target_vocab), float("-inf"))
            full[:, torch.arange(self.draft_vocab, device=logits.device) + self.d2t] = logits
            logits = full
        return logits, out


def _eagle_name(name: str) -> str:
    """An EAGLE or EAGLE-3 checkpoint's names (with or without "model."; EAGLE-3's layer as "midlayer."), as
    SpecHead's."""
    name = name.removeprefix("model.").replace("midlayer.", "layers.0.")
    return name if name.startswith(("fc.", "lm_head.")) or name in ("d2t", "t2d") else f"model.{name}"


class HeadRunner(ModelRunner):
    """A draft head's weights and its own KV cache (one block pool, like a draft model's), on the target's device."""
    shareable = False

    def __init__(self, config, path: str, hf_config, kind: str, target: ModelRunner, max_model_len: int,
                 target_path: str, fc_bias: bool = False, own_embedding: bool = False):
        self.kind, self.fc_bias, self.target_path = kind, fc_bias, target_path
        self.mtp_layer = target.hf_config.num_hidden_layers
        # under TP the target's embedding and head are vocabulary shards, run with collectives: the head, on rank 0
        # alone, holds whole copies, read from the target's checkpoint
        self.copies = target.tp is not None
        self.tied = bool(getattr(target.hf_config, "tie_word_embeddings", False))
        self.own_embedding = own_embedding or self.copies
        self.own_head = kind != "eagle3" and self.copies
        self.from_target = [n for n, own in (("model.embed_tokens.weight", own_embedding),
                                             ("lm_head.weight", kind == "eagle3" or self.tied))
                            if self.copies and not own]
        prefix = f"model.layers.{self.mtp_layer}."
        if kind == "mtp":                 # the target's checkpoint: only its prediction layer (and copies)
            self.keep = lambda n: n in self.from_target or n.startswith(prefix) and n[len(prefix):] not in (
                "embed_tokens.weight", "shared_head.head.weight")
        elif kind == "eagle":             # the original EAGLE code's layer 0 keeps an input norm it never runs
            self.keep = lambda n: n.removeprefix("model.") not in (
                "embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")
        super().__init__(config, path, hf_config, max_model_len)
        self.model.share(target.model)

    def new_model(self, hf_config, max_model_len, tp):
        return SpecHead(hf_config, max_model_len, self.kind, self.fc_bias, self.own_embedding, self.own_head,
                        self.tied)

    def checkpoint_tensors(self, weights):
        from engine.loader import iter_weights
        prefix = f"model.layers.{self.mtp_layer}."
        for name, tensor in weights:
            if name in self.from_target:                          # mtp: its copies come with the layer's tensors
                yield name, tensor
                continue
            if self.kind != "mtp":
                yield _eagle_name(name), tensor
                continue
            rest = name[len(prefix):]
            if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                yield rest, tensor
            elif rest == "shared_head.norm.weight":
                yield "model.norm.weight", tensor
            else:
                yield "model.layers.0." + rest, tensor
        if self.from_target and self.kind != "mtp":
            yield from iter_weights(self.target_path, keep=lambda n: n in self.from_target)

    def forward_batch(self, items, num_layers=None, hidden: torch.Tensor | None = None):
        """items as ModelRunner.forward_batch's; `hidden` one row per fed token (zeros when None: profiling).
        Returns the logits rows; the head's output at them is left in `self.out`."""
        shape, ids, tables = items_shape(items, self.block_size)
        x = self.stage(shape, ids, tables)
        if hidden is None:
            hidden = torch.zeros(len(ids), self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits, self.out = self.model(x.input_ids, x.positions, self.kv_layers, x.md, x.logits_indices, hidden)
        return logits


def load_head_runner(config, target: ModelRunner, max_model_len: int) -> HeadRunner:
    """The draft head of speculative_config (eagle, eagle3: its checkpoint; mtp: the target's own prediction layer),
    loaded before the KV caches are sized (model_runner.allocate_kv_caches). An EAGLE-3 head sets the target runner's
    aux_layers: the streams its forwards then keep."""
    from engine.config import EngineConfig
    from engine.loader import gguf_source, load_config, resolve_model
    spec, target_hf = config.speculative_config, target.hf_config
    target_path = resolve_model(config.model)
    if target.tp is not None and gguf_source(target_path) is not None:
        raise ConfigError(f"speculative_config: method {spec.method!r} under tensor parallelism reads whole copies of "
                          f"the target's embedding and head from a Hugging Face checkpoint, not a GGUF")
    if spec.method == "mtp":
        path = target_path
        layers = int(getattr(target_hf, "num_nextn_predict_layers", 0) or 0)
        if target_hf.model_type not in MLA_MODEL_TYPES or layers < 1:
            raise ConfigError(f"speculative_config: method 'mtp' needs a checkpoint with multi-token prediction "
                              f"layers (DeepSeek-V3's num_nextn_predict_layers); {config.model} "
                              f"({target_hf.model_type}) has none")
        if gguf_source(path) is not None:
            raise ConfigError("speculative_config: method 'mtp' reads the prediction layer from a Hugging Face "
                              "checkpoint, not a GGUF")
        hf = copy.deepcopy(target_hf)
        # one layer, built as the target's layer num_hidden_layers is (DeepSeek-V3's: experts)
        hf.first_k_dense_replace = 0 if is_moe_layer(target_hf, target_hf.num_hidden_layers) else 1
        hf.moe_layer_freq, hf.num_hidden_layers, hf.tie_word_embeddings = 1, 1, False
        fc_bias, own_embedding = False, False
    else:
        path = resolve_model(spec.model)
        hf = load_config(path)
        name = "an EAGLE-3" if spec.method == "eagle3" else "an EAGLE"
        if hf.model_type != "llama":
            raise ConfigError(f"speculative_config: {name} head is a Llama decoder layer; {spec.model} is "
                              f"{hf.model_type!r}")
        reads = int(getattr(hf, "target_hidden_size", None) or hf.hidden_size)
        own_embedding = spec.method == "eagle3" and _has_tensor(path, "embed_tokens.weight")
        if reads != target_hf.hidden_size or hf.vocab_size != target_hf.vocab_size or \
                hf.hidden_size != target_hf.hidden_size and not own_embedding:
            raise ConfigError(f"speculative_config: the head {spec.model} reads hidden states of {reads} over a "
                              f"vocabulary of {hf.vocab_size}; the target has {target_hf.hidden_size} and "
                              f"{target_hf.vocab_size}: it was trained for another model")
        fc_bias = _has_tensor(path, "fc.bias")
        hf.tie_word_embeddings = False
        if spec.method == "eagle3":                          # the target's streams the head reads, entering these
            n = target_hf.num_hidden_layers
            ids = getattr(hf, "eagle_aux_hidden_state_layer_ids", None) or \
                (getattr(hf, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids") or (2, n // 2, n - 3)
            ids = tuple(int(i) for i in ids)
            if len(ids) != 3 or not all(0 <= i < n for i in ids):
                raise ConfigError(f"speculative_config: the EAGLE-3 head reads three of the target's {n} layers, "
                                  f"got {list(ids)}")
            target.aux_layers = ids
    limit = getattr(hf, "max_position_embeddings", max_model_len)
    if limit < max_model_len:
        raise ConfigError(f"speculative_config: the draft head has {limit} positions, fewer than max_model_len "
                          f"{max_model_len}")
    c = config
    # the head's linears run as the target's do: int8 beside a GGUF or int8 target (the same kernels; in fp32 on
    # CPU a head of a few million weights read every draft costs a fifth of a packed SmolLM2 step), fp8 beside fp8
    quantization = {"gguf": "int8", "int8": "int8", "fp8": "fp8"}.get(target.quantization, "auto")
    dcfg = EngineConfig(model=path, dtype=c.dtype, device=c.device, block_size=c.block_size, seed=c.seed,
                        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                        enforce_eager=True, load_format="dummy" if c.load_format == "dummy" else "auto",
                        quantization=quantization)
    try:
        return HeadRunner(dcfg, path, hf, spec.method, target, max_model_len, target_path, fc_bias, own_embedding)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config: the {spec.method} head of {path}: {e}") from None


def _has_tensor(path: str, name: str) -> bool:
    from engine.loader import iter_weights
    return any(n.removeprefix("model.") == name for n, _ in iter_weights(path, keep=lambda n: n.endswith(name)))
