"""Baton's CPU kernels as one native extension, and the decoder stack that runs a packed model's layers in one call.

engine/cpu_model.cpp #includes the paged attention with its small ops (engine/cpu_attention.cpp, documented in
engine/cpu_attention.py), the packed-weight matmul (engine/quant_cpu.cpp, engine/quant_kernels.py), the batched
LoRA products (engine/lora_cpu.cpp, engine/lora_ops.py) and the sampler's filters and draw (engine/sampler_cpu.cpp,
engine/sampler.py), and builds them as one module: one compile per machine (engine/cpp_build.py), one set of
flags, so every caller runs the same machine code.

`DecoderStack` is the forward of a model whose linears are all packed for that matmul (a GGUF run in its stored
format, or quantization="int8"), from the embeddings to the last layer's output, in C++ with the GIL released:
at decode batch sizes the Python forward spent as long dispatching a layer's dozen small ops as the ops took,
holding the GIL that a replica's event loop needs for every token it streams. It chains the same kernels and
ATen ops as LlamaForCausalLM's modules, in the same order, so both give bitwise equal logits
(tests/test_cpu_model.py); engine/model.py chooses it where it applies (`cpu_stack`). Where LoRA adapters wrap the
linears (engine/lora.py), the stack adds their products after each linear with the same kernel.
"""
from __future__ import annotations

import functools
import os
from pathlib import Path

from engine.cpp_build import load_extension

HERE = Path(__file__).parent
SOURCE = HERE / "cpu_model.cpp"
INCLUDES = (HERE / "cpu_attention.cpp", HERE / "quant_cpu.cpp", HERE / "lora_cpu.cpp", HERE / "sampler_cpu.cpp")
NAME = "baton_cpu"
# no floating-point contraction: the matmul's rows must not depend on which rows share a call (quant_kernels.py)
CFLAGS = ("-ffp-contract=off",)


@functools.cache
def kernels():
    """The extension module, or None without a compiler (then each caller uses its torch reference)."""
    return load_extension(NAME, SOURCE, "CPU kernels", CFLAGS, INCLUDES)


@functools.cache
def available() -> bool:
    """Decided once per process (it is asked on every layer of every step); BATON_CPU_KERNEL=0 turns them off."""
    return os.environ.get("BATON_CPU_KERNEL", "1") != "0" and kernels() is not None


def sampler_enabled() -> bool:
    """BATON_CPU_SAMPLER=0 samples with torch's way instead of the kernel (to compare the two); read per call."""
    return os.environ.get("BATON_CPU_SAMPLER", "1") != "0"


@functools.cache
def stack_enabled() -> bool:
    """BATON_CPU_STACK=0 keeps the module-by-module forward (to compare the two)."""
    return os.environ.get("BATON_CPU_STACK", "1") != "0"
