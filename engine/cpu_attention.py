"""A C++ paged decode-attention kernel for CPU: reads each cached K/V row once, no gathered copy.

The torch reference gathers every sequence's K and V into a padded tensor and runs SDPA on it, so a
decode step moves its KV three times (read, write, read). At batch 64 with ~700-token contexts that
is most of a SmolLM2 decode step. This kernel walks the block table instead: one task per
sequence, scores of every query head against each cached row, softmax, then the weighted V sum.
Compiled once per machine (-march=native) with torch's cpp_extension, cached under
$BATON_CACHE/torch_extensions keyed by the CPU's feature flags;
if no compiler is there, the torch reference is used and a warning says so.
"""
from __future__ import annotations

import functools
import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k_cache.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && k_cache.stride(2) == k_cache.size(3), "K rows must be contiguous");
  TORCH_CHECK(v_cache.stride(3) == 1 && v_cache.stride(2) == v_cache.size(3), "V rows must be contiguous");
  q = q.contiguous();
  auto bt = block_tables.to(torch::kInt).contiguous();
  auto sl = seq_lens.to(torch::kInt).contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t bs = k_cache.size(1), Hkv = k_cache.size(2), G = Hq / Hkv, maxb = bt.size(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // One task per sequence: each cached token's row holds every kv head, so a task streams whole
  // contiguous rows (fewer cache lines and TLB misses than one task per head).
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t b = begin; b < end; ++b) {
      const int64_t len = slp[b];
      scores.resize(Hq * len);
      const float* qb = qp + b * Hq * D;
      for (int64_t t = 0; t < len; ++t) {
        const float* row = kp + (int64_t)btp[b * maxb + t / bs] * ks0 + (t % bs) * ks1;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* k = row + (hq / G) * D;
          const float* qq = qb + hq * D;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < D; ++d) s += qq[d] * k[d];
          scores[hq * len + t] = s * fscale;
        }
      }
      for (int64_t hq = 0; hq < Hq; ++hq) {
        float* sg = scores.data() + hq * len;
        float m = -INFINITY;
        for (int64_t t = 0; t < len; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      float* ob = op + b * Hq * D;
      std::fill(ob, ob + Hq * D, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const float* row = vp + (int64_t)btp[b * maxb + t / bs] * vs0 + (t % bs) * vs1;
        for (int64_t hq = 0; hq < Hq; ++hq) {
          const float* v = row + (hq / G) * D;
          const float p = scores[hq * len + t];
          float* o = ob + hq * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
        }
      }
    }
  });
  return out;
}
"""

_lock = threading.Lock()
_module = None
_failed = False


def _load():
    global _module, _failed
    with _lock:
        if _module is None and not _failed:
            try:
                from torch.utils.cpp_extension import load_inline
                from engine.loader import cache_dir
                build = cache_dir() / "torch_extensions" / f"torch{torch.__version__}-{_cpu_key()}"
                build.mkdir(parents=True, exist_ok=True)
                log.info("loading the CPU paged-attention kernel (compiled on first use per machine, ~30 s)")
                _module = load_inline("baton_cpu_attention_v2", cpp_sources=_SOURCE, functions=["paged_decode"],
                                      extra_cflags=["-O3", "-march=native", "-fopenmp", "-fopenmp-simd"],
                                      extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
            except Exception as e:                       # noqa: BLE001 - no compiler: keep serving
                _failed = True
                log.warning("CPU attention kernel unavailable (%s); using the torch reference", e)
    return _module


def _cpu_key() -> str:
    """Builds use -march=native: key them by the CPU's feature flags so none runs on another CPU."""
    import hashlib
    import platform
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            flags += next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.blake2b(flags.encode(), digest_size=6).hexdigest()


@functools.cache
def available() -> bool:
    """Decided once per process (it is asked on every layer of every step)."""
    return os.environ.get("BATON_CPU_KERNEL", "1") != "0" and _load() is not None


def paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale: float) -> torch.Tensor:
    """q [B, H, D] (one new token per sequence) -> [B, H, D]; same contract as the torch reference."""
    return _load().paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)
