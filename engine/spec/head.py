"""Draft heads that read the target's hidden states: EAGLE's and DeepSeek's multi-token prediction (MTP) module.

Both draft token t+2 from the token t+1 and the target's final hidden state at position t (after its last norm),
through one decoder layer of their own with its own KV cache (one layer of it), and score with the target's head:

- eagle (EAGLE-1, Li et al. 2024; vLLM's "eagle" checkpoints): fc([embed(t+1); h_t]), then its decoder layers, the
  first without its input norm; the target's lm_head on the sum, no norm before it.
- mtp (DeepSeek-V3's released `model.layers.{num_hidden_layers}`): eh_proj([enorm(embed(t+1)); hnorm(h_t)]), one of
  the target's own decoder layers (MLA and experts), its shared_head.norm, then the target's lm_head.

Both use the target's embedding and head (the papers' shared modules: the checkpoints' copies are not read). Drafting
further than one token feeds the head its own output (the sum before any norm) in place of h_t, as vLLM does.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from engine.errors import ConfigError, ModelLoadError
from engine.input_batch import InputBatch, items_shape
from engine.model import MLA_MODEL_TYPES, LlamaForCausalLM, RMSNorm, is_moe_layer
from engine.model_runner import ModelRunner

log = logging.getLogger(__name__)


class SpecHead(LlamaForCausalLM):
    """forward(input_ids, positions, kv_cache, md, logits_indices, hidden) -> (logits of the chosen rows, the head's
    output at those rows: what the next draft reads as its hidden state). `hidden`: one row per input token, the
    target's final hidden state at the position before that token (or the head's own output, when chaining)."""

    def __init__(self, config, max_positions: int, kind: str, fc_bias: bool = False):
        super().__init__(config, max_positions)
        h = config.hidden_size
        self.kind = kind
        self.model.embed_tokens, self.lm_head = None, None          # the target's: set by share()
        self._shared: tuple[nn.Module, nn.Module] | None = None
        if kind == "eagle":
            self.fc = nn.Linear(2 * h, h, bias=fc_bias)
            self.model.layers[0].input_layernorm = nn.Identity()     # EAGLE's first layer reads fc's output as is
            self.model.norm = nn.Identity()                          # and the head reads the layers' sum as is
        else:
            self.enorm = RMSNorm(h, config.rms_norm_eps)
            self.hnorm = RMSNorm(h, config.rms_norm_eps)
            self.eh_proj = nn.Linear(2 * h, h, bias=False)

    def share(self, target: LlamaForCausalLM) -> None:
        """Take the target's embedding and head (plain attributes: not this module's parameters)."""
        self._shared = (target.model.embed_tokens, target.lm_head)

    def tie_weights(self) -> None:
        pass

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, md, logits_indices, hidden):
        embed, head = self._shared
        e = embed(input_ids)
        if self.kind == "eagle":
            x = self.fc(torch.cat([e, hidden.to(e.dtype)], dim=-1))
        else:
            x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden.to(e.dtype))], dim=-1))
        ropes = {kind: rope.tables(positions) for kind, rope in self.ropes.items()}
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ropes, kv_cache, md)
        out = (residual + x)[logits_indices]
        return head(self.model.norm(out)).float(), out


def _eagle_name(name: str) -> str:
    """An EAGLE checkpoint's names (with or without "model."), as SpecHead's."""
    name = name.removeprefix("model.")
    return name if name.startswith("fc.") else f"model.{name}"


class HeadRunner(ModelRunner):
    """A draft head's weights and its own KV cache (one block pool, like a draft model's), on the target's device."""
    shareable = False

    def __init__(self, config, path: str, hf_config, kind: str, target: ModelRunner, max_model_len: int,
                 fc_bias: bool = False):
        self.kind, self.fc_bias = kind, fc_bias
        self.mtp_layer = target.hf_config.num_hidden_layers
        prefix = f"model.layers.{self.mtp_layer}."
        if kind == "mtp":                 # the target's checkpoint: only its prediction layer, no shared copies
            self.keep = lambda n: n.startswith(prefix) and n[len(prefix):] not in (
                "embed_tokens.weight", "shared_head.head.weight")
        else:                             # the original EAGLE code's layer 0 keeps an input norm it never runs
            self.keep = lambda n: n.removeprefix("model.") not in (
                "embed_tokens.weight", "lm_head.weight", "layers.0.input_layernorm.weight")
        super().__init__(config, path, hf_config, max_model_len)
        self.model.share(target.model)

    def new_model(self, hf_config, max_model_len, tp):
        return SpecHead(hf_config, max_model_len, self.kind, self.fc_bias)

    def checkpoint_tensors(self, weights):
        prefix = f"model.layers.{self.mtp_layer}."
        for name, tensor in weights:
            if self.kind == "eagle":
                yield _eagle_name(name), tensor
                continue
            rest = name[len(prefix):]
            if rest.split(".")[0] in ("enorm", "hnorm", "eh_proj"):
                yield rest, tensor
            elif rest == "shared_head.norm.weight":
                yield "model.norm.weight", tensor
            else:
                yield "model.layers.0." + rest, tensor

    def forward_batch(self, items, num_layers=None, hidden: torch.Tensor | None = None):
        """items as ModelRunner.forward_batch's; `hidden` one row per fed token (zeros when None: profiling).
        Returns the logits rows; the head's output at them is left in `self.out`."""
        shape, ids, tables = items_shape(items, self.block_size)
        batch = self.inputs
        if not batch.fits(len(ids), len(shape.query_lens), tables.shape[1]):
            batch = InputBatch(len(ids), len(shape.query_lens), tables.shape[1], self.block_size, self.device,
                               pin=False)
        batch.stage(shape, ids, tables)
        x = batch.to_device(shape)
        if hidden is None:
            hidden = torch.zeros(len(ids), self.hf_config.hidden_size, dtype=self.dtype, device=self.device)
        logits, self.out = self.model(x.input_ids, x.positions, self.kv_layers, x.md, x.logits_indices, hidden)
        return logits


def load_head_runner(config, target: ModelRunner, max_model_len: int) -> HeadRunner:
    """The draft head of speculative_config (eagle: its checkpoint; mtp: the target's own prediction layer), loaded
    before the KV caches are sized (model_runner.allocate_kv_caches)."""
    from engine.config import EngineConfig
    from engine.loader import gguf_source, load_config, resolve_model
    spec, target_hf = config.speculative_config, target.hf_config
    if target.tp is not None:
        raise ConfigError(f"speculative_config: method {spec.method!r} under tensor parallelism is not supported yet "
                          f"(its head takes the target's whole embedding and head); use ngram or draft_model")
    if spec.method == "mtp":
        path = resolve_model(config.model)
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
        fc_bias = False
    else:
        path = resolve_model(spec.model)
        hf = load_config(path)
        if hf.model_type != "llama":
            raise ConfigError(f"speculative_config: an EAGLE head is a Llama decoder layer; {spec.model} is "
                              f"{hf.model_type!r}")
        if hf.hidden_size != target_hf.hidden_size or hf.vocab_size != target_hf.vocab_size:
            raise ConfigError(f"speculative_config: the EAGLE head {spec.model} reads hidden states of "
                              f"{hf.hidden_size} over a vocabulary of {hf.vocab_size}; the target has "
                              f"{target_hf.hidden_size} and {target_hf.vocab_size}: it was trained for another model")
        fc_bias = _has_tensor(path, "fc.bias")
        hf.tie_word_embeddings = False
    limit = getattr(hf, "max_position_embeddings", max_model_len)
    if limit < max_model_len:
        raise ConfigError(f"speculative_config: the draft head has {limit} positions, fewer than max_model_len "
                          f"{max_model_len}")
    c = config
    dcfg = EngineConfig(model=path, dtype=c.dtype, device=c.device, block_size=c.block_size, seed=c.seed,
                        max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
                        enforce_eager=True, load_format="dummy" if c.load_format == "dummy" else "auto",
                        quantization="auto" if c.quantization in ("gguf", "auto") else c.quantization)
    try:
        return HeadRunner(dcfg, path, hf, spec.method, target, max_model_len, fc_bias)
    except ModelLoadError as e:
        raise ModelLoadError(f"speculative_config: the {spec.method} head of {path}: {e}") from None


def _has_tensor(path: str, name: str) -> bool:
    from engine.loader import iter_weights
    return any(n.removeprefix("model.") == name for n, _ in iter_weights(path, keep=lambda n: n.endswith(name)))
