// The CPU paged-attention kernel, rms_norm, rope + KV store, and the grammar-mask apply of structured output;
// engine/cpu_attention.py says how they work. Built as part of engine/cpu_model.cpp (one extension, which
// defines the Python module).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define BATON_SIMD 1
#include <immintrin.h>
#endif

namespace {

// Context tokens per tile: a task scores (and later weights) 16 cached rows at a time for each of its
// query rows, so the tile's K (V) stays in L1 while every query row of the task reads it.
constexpr int TILE = 16;
constexpr int PREFETCH = 4;       // tiles ahead that a sweep asks for (see attend)
constexpr int64_t MIN_CHUNK = 16;  // query tokens in a task's chunk of a long query, at least (see run)

// exp(x) for x <= 0 (softmax scores after max subtraction): Cephes expf, ~1 ulp; 0 below -87
// (where expf itself goes subnormal), so -inf padding contributes exactly nothing.
constexpr float EXP_LO = -87.0f, LOG2E = 1.44269504088896341f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f;
constexpr float EXP_P0 = 1.9875691500e-4f, EXP_P1 = 1.3981999507e-3f, EXP_P2 = 8.3334519073e-3f,
                EXP_P3 = 4.1665795894e-2f, EXP_P4 = 1.6666665459e-1f, EXP_P5 = 5.0000001201e-1f;

inline float exp_nonpos(float x) {
  if (!(x >= EXP_LO)) return x < EXP_LO ? 0.f : x;   // NaN stays NaN
  const float fi = std::floor(x * LOG2E + 0.5f);
  const float f = x - fi * LN2_HI - fi * LN2_LO;
  float p = EXP_P0;
  p = p * f + EXP_P1;
  p = p * f + EXP_P2;
  p = p * f + EXP_P3;
  p = p * f + EXP_P4;
  p = p * f + EXP_P5;
  p = p * f * f + f + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// s[0:n] (n a multiple of 16, padding = -inf) <- exp(s - max s); returns the sum
// In place: s[t] = exp(s[t] - m), m the row's max; returns their sum. A `sink` (gpt-oss's per-head learned logit,
// -inf where there is none) joins the max and the sum as one more score whose value weighs nothing: the row's
// weights then sum to less than 1. Without one the bits are those of the plain softmax.
inline float softmax_scalar(float* s, int64_t n, float sink = -INFINITY) {
  float m = sink;
  for (int64_t t = 0; t < n; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpos(s[t] - m);
    sum += s[t];
  }
  return sink > -INFINITY ? sum + exp_nonpos(sink - m) : sum;
}

// ---- the two inner products over one tile: scalar reference versions (any D, any CPU) ------------
// s[i] = dot(q, k[i][0:D]) for the tile's 16 rows
inline void qk_tile_scalar(const float* q, const float* const* k, int64_t D, float* s) {
  for (int i = 0; i < TILE; ++i) {
    const float* kr = k[i];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < D; ++d) acc += q[d] * kr[d];
    s[i] = acc;
  }
}

// o[0:D] += sum_i p[i] * v[i][0:D]
inline void pv_tile_scalar(const float* p, const float* const* v, int64_t D, float* o) {
  for (int i = 0; i < TILE; ++i) {
    const float pi = p[i];
    const float* vr = v[i];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] += pi * vr[d];
  }
}

// ---- the SIMD versions: each kernel is written once against a traits struct S (S::V a vector of
// S::W floats, and the operations on it); the traits are the only ISA-specific code -----------------
#if defined(__AVX512F__)
struct Avx512 {
  using V = __m512;
  static constexpr int W = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V a) { _mm512_storeu_ps(p, a); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }     // a * b + c
  static V fnmadd(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }   // c - a * b
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {                             // 2^n for whole n in the normal range
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float lo, V r) {        // r, but 0 where x < lo (NaN x keeps r)
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, set1(lo), _CMP_NLT_UQ), r);
  }
  static float hsum(V a) { return _mm512_reduce_add_ps(a); }
  static float hmax(V a) { return _mm512_reduce_max_ps(a); }
  // Lane i of the result is the horizontal sum of a[i] (a transpose-and-add tree: ~3 ops per dot
  // product instead of a full horizontal reduction each).
  static V sums(const V* a) {
    V s[8], u[4], z[2];
    for (int j = 0; j < 8; ++j)                    // quarters 0,1 <- a[2j], 2,3 <- a[2j+1]
      s[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0x44),
                           _mm512_shuffle_f32x4(a[2 * j], a[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; ++j)                    // quarter k <- a[4j+k]
      u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0x88),
                           _mm512_shuffle_f32x4(s[2 * j], s[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; ++j)                    // lane k: {a[k], a[4+k]} (j=0), {a[8+k], a[12+k]} (j=1)
      z[j] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0x44),
                           _mm512_shuffle_ps(u[2 * j], u[2 * j + 1], 0xEE));
    const V r = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x88),     // r[4k+e] = sum a[4e+k]
                              _mm512_shuffle_ps(z[0], z[1], 0xDD));
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_ps(idx, r);
  }
};
using Simd = Avx512;
#elif defined(__AVX2__) && defined(__FMA__)
struct Avx2 {
  using V = __m256;
  static constexpr int W = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V a) { _mm256_storeu_ps(p, a); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnmadd(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V floor(V a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2(V n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23));
  }
  static V zero_below(V x, float lo, V r) { return _mm256_and_ps(_mm256_cmp_ps(x, set1(lo), _CMP_NLT_UQ), r); }
  static float hsum(V a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float hmax(V a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static V sums(const V* a) {                      // lane i = horizontal sum of a[i]
    const V h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const V h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const V lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
  }
};
using Simd = Avx2;
#endif

#ifdef BATON_SIMD
constexpr int64_t VW = Simd::W;                   // floats per vector; the SIMD path needs D % VW == 0
static_assert(TILE % VW == 0, "a tile is whole vectors");

template <class S>
inline typename S::V exp_nonpos(typename S::V x) {
  using V = typename S::V;
  const V fi = S::floor(S::fmadd(x, S::set1(LOG2E), S::set1(0.5f)));
  V f = S::fnmadd(fi, S::set1(LN2_HI), x);
  f = S::fnmadd(fi, S::set1(LN2_LO), f);
  V p = S::set1(EXP_P0);
  p = S::fmadd(p, f, S::set1(EXP_P1));
  p = S::fmadd(p, f, S::set1(EXP_P2));
  p = S::fmadd(p, f, S::set1(EXP_P3));
  p = S::fmadd(p, f, S::set1(EXP_P4));
  p = S::fmadd(p, f, S::set1(EXP_P5));
  p = S::add(S::fmadd(S::mul(p, f), f, f), S::set1(1.f));
  return S::zero_below(x, EXP_LO, S::mul(p, S::pow2(fi)));
}

template <class S>
inline float softmax(float* s, int64_t n, float sink) {
  using V = typename S::V;
  V m = S::set1(-INFINITY);
  for (int64_t t = 0; t < n; t += S::W) m = S::max(m, S::load(s + t));
  const float mf = std::max(S::hmax(m), sink);
  m = S::set1(mf);
  V sum = S::zero();
  for (int64_t t = 0; t < n; t += S::W) {
    const V e = exp_nonpos<S>(S::sub(S::load(s + t), m));
    S::store(s + t, e);
    sum = S::add(sum, e);
  }
  return sink > -INFINITY ? S::hsum(sum) + exp_nonpos(sink - mf) : S::hsum(sum);
}

template <class S>
inline void qk_tile(const float* q, const float* const* k, int64_t D, float* s) {
  using V = typename S::V;
  for (int h = 0; h < TILE; h += S::W) {           // S::W rows at a time, one accumulator each
    V acc[S::W];
#pragma GCC unroll 16
    for (int i = 0; i < S::W; ++i) acc[i] = S::zero();
    for (int64_t c = 0; c < D; c += S::W) {
      const V qv = S::load(q + c);
#pragma GCC unroll 16
      for (int i = 0; i < S::W; ++i) acc[i] = S::fmadd(qv, S::load(k[h + i] + c), acc[i]);
    }
    S::store(s + h, S::sums(acc));
  }
}

template <class S>
inline void pv_tile(const float* p, const float* const* v, int64_t D, float* o) {
  using V = typename S::V;
  constexpr int W = S::W;
  int64_t c = 0;
  for (; c + 4 * W <= D; c += 4 * W) {             // 4 vectors x 2 interleaved chains: 8 FMAs in flight
    V a0 = S::load(o + c), a1 = S::load(o + c + W);
    V a2 = S::load(o + c + 2 * W), a3 = S::load(o + c + 3 * W);
    V b0 = S::zero(), b1 = b0, b2 = b0, b3 = b0;
#pragma GCC unroll 8
    for (int i = 0; i < TILE; i += 2) {
      const V pa = S::set1(p[i]), pb = S::set1(p[i + 1]);
      const float* va = v[i] + c;
      const float* vb = v[i + 1] + c;
      a0 = S::fmadd(pa, S::load(va), a0);
      a1 = S::fmadd(pa, S::load(va + W), a1);
      a2 = S::fmadd(pa, S::load(va + 2 * W), a2);
      a3 = S::fmadd(pa, S::load(va + 3 * W), a3);
      b0 = S::fmadd(pb, S::load(vb), b0);
      b1 = S::fmadd(pb, S::load(vb + W), b1);
      b2 = S::fmadd(pb, S::load(vb + 2 * W), b2);
      b3 = S::fmadd(pb, S::load(vb + 3 * W), b3);
    }
    S::store(o + c, S::add(a0, b0));
    S::store(o + c + W, S::add(a1, b1));
    S::store(o + c + 2 * W, S::add(a2, b2));
    S::store(o + c + 3 * W, S::add(a3, b3));
  }
  for (; c < D; c += W) {
    V a = S::load(o + c), b = S::zero();
#pragma GCC unroll 8
    for (int i = 0; i < TILE; i += 2) {
      a = S::fmadd(S::set1(p[i]), S::load(v[i] + c), a);
      b = S::fmadd(S::set1(p[i + 1]), S::load(v[i + 1] + c), b);
    }
    S::store(o + c, S::add(a, b));
  }
}

inline void qk_tile_simd(const float* q, const float* const* k, int64_t D, float* s) { qk_tile<Simd>(q, k, D, s); }
inline float softmax_simd(float* s, int64_t n, float sink) { return softmax<Simd>(s, n, sink); }
inline void pv_tile_simd(const float* p, const float* const* v, int64_t D, float* o) { pv_tile<Simd>(p, v, D, o); }
#else
constexpr int64_t VW = 0;                         // no SIMD path: the scalar loops (auto-vectorised)
inline void qk_tile_simd(const float* q, const float* const* k, int64_t D, float* s) { qk_tile_scalar(q, k, D, s); }
inline float softmax_simd(float* s, int64_t n, float sink) { return softmax_scalar(s, n, sink); }
inline void pv_tile_simd(const float* p, const float* const* v, int64_t D, float* o) { pv_tile_scalar(p, v, D, o); }
#endif

// A quantized cache's codes to float: int8 as is, fp8 (e4m3fn: 1 sign, 4 exponent bits of bias 7, 3 mantissa
// bits, no infinities, 0x7f/0xff NaN) through a table of its 256 values.
struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float x = e == 0 ? std::ldexp(m / 8.f, -6) : std::ldexp(1.f + m / 8.f, e - 7);
      if (e == 15 && m == 7) x = std::numeric_limits<float>::quiet_NaN();
      v[b] = b & 128 ? -x : x;
    }
  }
};
const Fp8Table FP8;
struct Fp8 { uint8_t bits; };
// One row of a quantized cache as floats: dst[d] = code[d] * scale (vectorised for int8, the CPU's format; fp8
// goes through the table, one value at a time).
inline void dequant_row(const int8_t* row, float scale, int64_t D, float* dst) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale);
  for (; d + 16 <= D; d += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), s));
  }
#elif defined(BATON_SIMD)                          // AVX2
  const __m256 s = _mm256_set1_ps(scale);
  for (; d + 8 <= D; d += 8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), s));
  }
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(row[d]) * scale;
}
// fp8 e4m3fn by bits: its exponent and mantissa moved to fp32's places read as (1 + m/8) * 2^(e - 127) (an fp32
// subnormal for e = 0, which is e4m3's subnormal scaled the same way), so a multiply by 2^120 gives the value.
// Exact for every code the cache stores (quantize_kv clamps; 0x7f, NaN, is never written).
inline void dequant_row(const Fp8* row, float scale, int64_t D, float* dst) {
  const uint8_t* b = reinterpret_cast<const uint8_t*>(row);
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(scale), up = _mm512_set1_ps(0x1p120f);
  const __m512i mag = _mm512_set1_epi32(0x7f), sign = _mm512_set1_epi32(0x80);
  for (; d + 16 <= D; d += 16) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + d)));
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(x, mag), 20),
                                         _mm512_slli_epi32(_mm512_and_si512(x, sign), 24));
    _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(bits), up), s));
  }
#elif defined(BATON_SIMD)                          // AVX2
  const __m256 s = _mm256_set1_ps(scale), up = _mm256_set1_ps(0x1p120f);
  const __m256i mag = _mm256_set1_epi32(0x7f), sign = _mm256_set1_epi32(0x80);
  for (; d + 8 <= D; d += 8) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + d)));
    const __m256i bits = _mm256_or_si256(_mm256_slli_epi32(_mm256_and_si256(x, mag), 20),
                                         _mm256_slli_epi32(_mm256_and_si256(x, sign), 24));
    _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_castsi256_ps(bits), up), s));
  }
#endif
  for (; d < D; ++d) dst[d] = FP8.v[b[d]] * scale;
}

struct Problem {
  const float* q; int64_t qs0, qs1;               // q [T, Hq, D], last dim contiguous
  const void* k; int64_t ks0, ks1, ks2;           // k_cache [blocks, block_size, Hkv, D] (float, int8 or fp8)
  const void* v; int64_t vs0, vs1, vs2;
  const float* ksc; int64_t kss0, kss1, kss2;     // quantized caches: their scales [blocks, block_size, Hkv]
  const float* vsc; int64_t vss0, vss1, vss2;
  const int32_t* bt; int64_t bts0;                // block_tables [S, max_blocks]
  const int32_t* seq_lens;                        // [S]
  const int32_t* qsl;                             // [S + 1]; nullptr: one query per sequence
  float* out; int64_t os0, os1;                   // [T, Hq, D] contiguous
  int64_t Hkv, G, D, bs;
  float scale;
  int64_t window;                                 // > 0: a query at p sees keys p - window + 1 .. p only
  float softcap;                                  // > 0: scores s become softcap * tanh(s / softcap)
  const float* sinks;                             // [Hq]: each query head's sink logit (gpt-oss); nullptr: none
  int64_t chunk;                                  // > 0: a query at p sees keys p - p % chunk .. p only (Llama 4)
};

struct Scratch {
  std::vector<float> q, s, o, inv, rows;          // rows: a quantized tile's rows of one head, as floats
};

// Sequence b's query tokens [j0, j1) of its n, kv heads [h0, h1): for each head those tokens x G query
// heads (R rows) against the cached tokens each may see (query token j: the first L - n + j + 1). Each
// cached K and V row is read once for all the rows: one sweep scores tile by tile (every head of the
// run per tile, so whole token rows stream in together), a softmax per row over its causal range, then
// a second sweep for the weighted V sums. A row skips the tiles wholly past its range (a prompt's
// causal half): they would score -inf and weigh exactly 0, so its result is the same bits as if it
// swept them, and the same whichever rows share its call or its task. With a sliding window a row's range
// starts at its first visible token, and the tiles wholly before it are skipped the same way; so does an attention
// chunk's (a query sees only the keys of its own chunk of positions).
template <bool SIMD, class T>
void attend(const Problem& P, int64_t b, int64_t j0, int64_t j1, int64_t h0, int64_t h1, Scratch& w) {
  constexpr bool QUANT = !std::is_same<T, float>::value;
  const int64_t qs = P.qsl ? P.qsl[b] : b;
  const int64_t n = P.qsl ? P.qsl[b + 1] - qs : 1;
  const int64_t L = P.seq_lens[b];
  if (j1 <= j0 || L <= 0) return;
  const int64_t q0 = qs + j0, past = L - n + j0;     // query token j0 sees `past` + 1 cached tokens
  const int64_t G = P.G, D = P.D, R = (j1 - j0) * G, RR = (h1 - h0) * R;
  const int64_t tiles = (past + (j1 - j0) + TILE - 1) / TILE, Lp = tiles * TILE;
  // row r's visible tokens [first(r), seen(r)), and its tiles' start and end: those are all it scores and weighs
  auto seen = [&](int64_t r) { return past + (r % R) / G + 1; };
  auto first = [&](int64_t r) {
    const int64_t w = P.window > 0 ? std::max<int64_t>(0, seen(r) - P.window) : int64_t(0);
    return P.chunk > 0 ? std::max(w, (seen(r) - 1) / P.chunk * P.chunk) : w;
  };
  auto begin = [&](int64_t r) { return first(r) / TILE * TILE; };
  auto end = [&](int64_t r) { return (seen(r) + TILE - 1) / TILE * TILE; };
  const int64_t t_begin = begin(0);                  // row 0 (query token j0) sees the earliest tokens
  w.q.resize(RR * D);
  w.s.resize(RR * Lp);
  w.o.assign(RR * D, 0.f);
  w.inv.resize(RR);
  if (QUANT) w.rows.resize(TILE * D);
  float* qb = w.q.data();
  float* sb = w.s.data();
  float* ob = w.o.data();
  // row (h - h0) * R + j * G + g: token q0 + j, query head h * G + g
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < j1 - j0; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const float* src = P.q + (q0 + j) * P.qs0 + (h * G + g) * P.qs1;
        float* dst = qb + ((h - h0) * R + j * G + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * P.scale;
      }
  const int32_t* table = P.bt + b * P.bts0;
  const T* rows[TILE];
  const float* hrows[TILE];
  // the tile's cached token rows (at head h0); past the context's end, repeat its last row (scored,
  // then given weight 0), so every tile is full
  auto tile_rows = [&](const T* base, int64_t s0, int64_t s1, int64_t s2, int64_t t0) {
    for (int i = 0; i < TILE; ++i) {
      const int64_t t = std::min(t0 + i, L - 1);
      rows[i] = base + (int64_t)table[t / P.bs] * s0 + (t % P.bs) * s1 + h0 * s2;
    }
  };
  // head h's rows of the tile as floats: in place for a float cache; a quantized one's codes times their
  // token's scale, into scratch (the cache is read once, at a quarter of fp32's bytes for int8)
  auto head_rows = [&](int64_t s2, const float* sc, int64_t ss0, int64_t ss1, int64_t ss2, int64_t t0, int64_t h) {
    for (int i = 0; i < TILE; ++i) {
      const T* row = rows[i] + (h - h0) * s2;
      if constexpr (QUANT) {
        const int64_t t = std::min(t0 + i, L - 1);
        float* dst = w.rows.data() + i * D;
        dequant_row(row, sc[(int64_t)table[t / P.bs] * ss0 + (t % P.bs) * ss1 + h * ss2], D, dst);
        hrows[i] = dst;
      } else {
        hrows[i] = row;
      }
    }
  };
  // Ask for the rows PREFETCH tiles ahead (every head of the run): a decode is bound by the latency of
  // cold cache lines, and a head's span in a block (heads-outer cache) is too short for the hardware
  // prefetcher to run far enough ahead.
  constexpr int64_t LINE = 64 / sizeof(T);
  const int64_t last = std::min(L, Lp);               // past the rows' tiles nothing is read
  auto prefetch_tile = [&](const T* base, int64_t s0, int64_t s1, int64_t s2, int64_t t0) {
    for (int i = 0; i < TILE && t0 + i < last; ++i) {
      const T* row = base + (int64_t)table[(t0 + i) / P.bs] * s0 + ((t0 + i) % P.bs) * s1 + h0 * s2;
      for (int64_t h = 0; h < h1 - h0; ++h)
        for (int64_t d = 0; d < D; d += LINE) __builtin_prefetch(row + h * s2 + d, 0, 2);
    }
  };
  const T* K = static_cast<const T*>(P.k);
  const T* V = static_cast<const T*>(P.v);
  for (int64_t t0 = t_begin; t0 < t_begin + PREFETCH * TILE; t0 += TILE) prefetch_tile(K, P.ks0, P.ks1, P.ks2, t0);
  for (int64_t t0 = t_begin; t0 < Lp; t0 += TILE) {
    tile_rows(K, P.ks0, P.ks1, P.ks2, t0);
    prefetch_tile(K, P.ks0, P.ks1, P.ks2, t0 + PREFETCH * TILE);
    for (int64_t h = h0; h < h1; ++h) {
      head_rows(P.ks2, P.ksc, P.kss0, P.kss1, P.kss2, t0, h);
      for (int64_t r = (h - h0) * R; r < (h - h0 + 1) * R; ++r) {
        if (t0 >= end(r) || t0 < begin(r)) continue;
        if (SIMD) qk_tile_simd(qb + r * D, hrows, D, sb + r * Lp + t0);
        else qk_tile_scalar(qb + r * D, hrows, D, sb + r * Lp + t0);
      }
    }
  }
  for (int64_t r = 0; r < RR; ++r) {
    // query j sees context positions [0, L - n + j]: the rest of its last tile gets weight 0 (the
    // tiles past it would add exactly 0 to each lane's sum)
    float* s = sb + r * Lp;
    if (P.softcap > 0.f)
      for (int64_t t = first(r); t < seen(r); ++t) s[t] = P.softcap * std::tanh(s[t] / P.softcap);
    std::fill(s + begin(r), s + first(r), -INFINITY);
    std::fill(s + seen(r), s + end(r), -INFINITY);
    const int64_t n_r = end(r) - begin(r);
    // row r: query head (h0 + r / R) * G + (r % R) % G
    const float sink = P.sinks ? P.sinks[(h0 + r / R) * G + (r % R) % G] : -INFINITY;
    w.inv[r] = 1.f / (SIMD ? softmax_simd(s + begin(r), n_r, sink) : softmax_scalar(s + begin(r), n_r, sink));
  }
  for (int64_t t0 = t_begin; t0 < t_begin + PREFETCH * TILE; t0 += TILE) prefetch_tile(V, P.vs0, P.vs1, P.vs2, t0);
  for (int64_t t0 = t_begin; t0 < Lp; t0 += TILE) {
    tile_rows(V, P.vs0, P.vs1, P.vs2, t0);
    prefetch_tile(V, P.vs0, P.vs1, P.vs2, t0 + PREFETCH * TILE);
    for (int64_t h = h0; h < h1; ++h) {
      head_rows(P.vs2, P.vsc, P.vss0, P.vss1, P.vss2, t0, h);
      for (int64_t r = (h - h0) * R; r < (h - h0 + 1) * R; ++r) {
        if (t0 >= end(r) || t0 < begin(r)) continue;
        if (SIMD) pv_tile_simd(sb + r * Lp + t0, hrows, D, ob + r * D);
        else pv_tile_scalar(sb + r * Lp + t0, hrows, D, ob + r * D);
      }
    }
  }
  for (int64_t h = h0; h < h1; ++h)
    for (int64_t j = 0; j < j1 - j0; ++j)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = (h - h0) * R + j * G + g;
        const float inv = w.inv[r];
        const float* src = ob + r * D;
        float* dst = P.out + (q0 + j) * P.os0 + (h * G + g) * P.os1;
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
      }
}

// The cache's element type: fp32, or a quantized cache's int8 / fp8 codes (then with scales).
enum class Cache { F32, I8, FP8 };

Cache cache_kind(const torch::Tensor& c) {
  if (c.scalar_type() == torch::kFloat) return Cache::F32;
  if (c.scalar_type() == torch::kChar) return Cache::I8;
  TORCH_CHECK(c.scalar_type() == at::ScalarType::Float8_e4m3fn, "caches: fp32, int8 or fp8 (e4m3fn)");
  return Cache::FP8;
}

torch::Tensor run(torch::Tensor q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                  const c10::optional<torch::Tensor>& query_start_loc, double scale,
                  const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                  int64_t window, double softcap, const c10::optional<torch::Tensor>& sinks, int64_t chunk) {
  TORCH_CHECK(window >= 0 && softcap >= 0 && chunk >= 0, "window, softcap and chunk: >= 0 (0: none)");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4,
              "q [T, H, D], caches [blocks, block_size, kv_heads, D]");
  const Cache kind = cache_kind(k_cache);
  TORCH_CHECK(q.scalar_type() == torch::kFloat && v_cache.scalar_type() == k_cache.scalar_type(),
              "q fp32, K and V caches of one dtype");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V caches differ in shape");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "K/V head rows must be contiguous");
  const bool quant = kind != Cache::F32;
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()), "a quantized cache comes with its scales");
  if (quant)
    TORCH_CHECK(k_scale->scalar_type() == torch::kFloat && v_scale->scalar_type() == torch::kFloat &&
                k_scale->dim() == 3 && k_scale->sizes() == k_cache.sizes().slice(0, 3) &&
                v_scale->sizes() == k_scale->sizes(), "scales: fp32 [blocks, block_size, kv_heads]");
  const int64_t Hq = q.size(1), D = q.size(2), bs = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head_dim of q and the cache differ");
  TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0, "query heads must be a multiple of kv heads");
  q = q.contiguous();
  auto bt = block_tables.to(torch::kInt).contiguous();
  auto sl = seq_lens.to(torch::kInt).contiguous();
  const int64_t S = sl.numel(), T = q.size(0), nblocks = k_cache.size(0);
  TORCH_CHECK(bt.dim() == 2 && bt.size(0) == S, "block_tables must be [num_seqs, max_blocks]");
  torch::Tensor qsl;
  const int32_t* qslp = nullptr;
  if (query_start_loc.has_value()) {
    qsl = query_start_loc->to(torch::kInt).contiguous();
    TORCH_CHECK(qsl.numel() == S + 1, "query_start_loc must have num_seqs + 1 entries");
    qslp = qsl.data_ptr<int32_t>();
  } else {
    TORCH_CHECK(T == S, "decode: one query token per sequence");
  }
  const int32_t* slp = sl.data_ptr<int32_t>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int64_t maxb = bt.size(1);
  TORCH_CHECK(!qslp || (qslp[0] == 0 && qslp[S] == T), "query_start_loc must run from 0 to num_tokens");
  for (int64_t b = 0; b < S; ++b) {               // cheap host checks: no out-of-bounds reads below
    const int64_t n = qslp ? qslp[b + 1] - qslp[b] : 1, L = slp[b];
    TORCH_CHECK(n >= 0 && n <= L, "sequence ", b, ": ", n, " query tokens but context length ", L);
    TORCH_CHECK(L <= maxb * bs, "sequence ", b, ": context ", L, " exceeds its block table");
    for (int64_t i = 0, nb = n ? (L + bs - 1) / bs : 0; i < nb; ++i)
      TORCH_CHECK(btp[b * maxb + i] >= 0 && btp[b * maxb + i] < nblocks, "sequence ", b, ": bad block id");
  }
  torch::Tensor sk;
  if (sinks.has_value()) {
    sk = sinks->to(torch::kFloat).contiguous();
    TORCH_CHECK(sk.dim() == 1 && sk.numel() == Hq, "sinks: one per query head [", Hq, "]");
  }
  auto out = torch::empty_like(q);
  if (T == 0) return out;
  const float* ksc = quant ? k_scale->data_ptr<float>() : nullptr;
  const float* vsc = quant ? v_scale->data_ptr<float>() : nullptr;
  auto st = [&](const c10::optional<torch::Tensor>& t, int i) { return quant ? t->stride(i) : 0; };
  Problem P{q.data_ptr<float>(), q.stride(0), q.stride(1),
            k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            ksc, st(k_scale, 0), st(k_scale, 1), st(k_scale, 2),
            vsc, st(v_scale, 0), st(v_scale, 1), st(v_scale, 2),
            btp, maxb, slp, qslp, out.data_ptr<float>(), out.stride(0), out.stride(1),
            Hkv, Hq / Hkv, D, bs, static_cast<float>(scale), window, static_cast<float>(softcap),
            sinks.has_value() ? sk.data_ptr<float>() : nullptr, chunk};
  const bool simd = VW > 0 && D % VW == 0;
  // Tasks are (sequence, kv head) pairs, numbered sequence-major, so a single sequence still spreads
  // its kv heads over the threads. Where a token's heads are one row (stride(2) == D), a thread's
  // contiguous range of pairs is served sequence by sequence, all of that sequence's heads in the
  // range in one sweep over its blocks: whole token rows stream in at once (a per-head sweep would
  // read each row in slices, three times). In the heads-outer cache (engine/kv_layout.py) a head's
  // tokens of a block are one span instead, and a sweep per head reads it in order: sweeping several
  // heads at once there interleaves spans far apart, measured 10-30% slower on a cold cache.
  const int64_t run_heads = k_cache.stride(2) == D && v_cache.stride(2) == D ? Hkv : 1;
  // A long query (a prompt) is also cut into chunks of its tokens of equal causal work, so that one prompt
  // spreads evenly over the threads (by kv heads alone, SmolLM2's 3 split 2:1 over 2 threads). Tasks are
  // (chunk, kv head) pairs, chunks in sequence order.
  struct Chunk { int64_t b, j0, j1; };
  const int64_t threads = at::get_num_threads();
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < S; ++b) {
    const int64_t n = qslp ? qslp[b + 1] - qslp[b] : 1, L = slp[b];
    const int64_t C = std::max<int64_t>(1, std::min(2 * threads, n / MIN_CHUNK));
    const double work = (double)n * (L - n) + 0.5 * n * (n + 1);    // sum over j of L - n + j + 1 (a window's
                                                                    // work is flatter: chunks err uneven, not wrong)
    int64_t j0 = 0;
    for (int64_t j = 0, c = 1; j + 1 < n && c < C; ++j) {         // chunk c - 1 ends after token j once
      if ((double)(j + 1) * (L - n) + 0.5 * (j + 1) * (j + 2) >= work * c / C) {   // it holds c / C of the work
        chunks.push_back({b, j0, j + 1});
        j0 = j + 1;
        ++c;
      }
    }
    chunks.push_back({b, j0, n});
  }
  at::parallel_for(0, (int64_t)chunks.size() * Hkv, 1, [&](int64_t begin, int64_t end) {
    Scratch w;
    for (int64_t i = begin; i < end;) {
      const int64_t h0 = i % Hkv, h1 = std::min({Hkv, h0 + (end - i), h0 + run_heads});
      const auto [b, j0, j1] = chunks[i / Hkv];
      if (kind == Cache::F32) {
        if (simd) attend<true, float>(P, b, j0, j1, h0, h1, w);
        else attend<false, float>(P, b, j0, j1, h0, h1, w);
      } else if (kind == Cache::I8) {
        if (simd) attend<true, int8_t>(P, b, j0, j1, h0, h1, w);
        else attend<false, int8_t>(P, b, j0, j1, h0, h1, w);
      } else {
        if (simd) attend<true, Fp8>(P, b, j0, j1, h0, h1, w);
        else attend<false, Fp8>(P, b, j0, j1, h0, h1, w);
      }
      i += h1 - h0;
    }
  });
  return out;
}

}  // namespace

// q [T, H, D]: sequence i owns q[qsl[i]:qsl[i+1]], the last tokens of its seq_lens[i]-token
// context, causal among themselves (and within `window` tokens, where > 0; within their `chunk` of positions, where
// > 0; scores soft-capped where softcap > 0; each query head's sink logit joining its softmax, where sinks are given).
torch::Tensor paged_attention_varlen(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     torch::Tensor query_start_loc, double scale,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     int64_t window, double softcap, c10::optional<torch::Tensor> sinks,
                                     int64_t chunk) {
  return run(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, window, softcap,
             sinks, chunk);
}

// One query token per sequence (the n = 1 case).
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor seq_lens, double scale,
                           c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                           int64_t window, double softcap, c10::optional<torch::Tensor> sinks, int64_t chunk) {
  return run(q, k_cache, v_cache, block_tables, seq_lens, c10::nullopt, scale, k_scale, v_scale, window, softcap,
             sinks, chunk);
}

// Structured output (engine/structured.py): logits[rows[i], t] = -inf wherever bit t of bitmask[rows[i]] is 0.
// Writes only the forbidden tokens: a word of 32 allowed tokens is skipped, a word of none is 32 stores.
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1, "fp32 logits, rows contiguous");
  TORCH_CHECK(bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(), "int32 bitmask");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "int64 rows");
  float* L = logits.data_ptr<float>();
  const int32_t* B = bitmask.data_ptr<int32_t>();
  const int64_t* R = rows.data_ptr<int64_t>();
  const int64_t vocab = logits.size(1), words = bitmask.size(1), lstride = logits.stride(0), n = rows.size(0);
  const float neg = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* l = L + R[i] * lstride;
      const uint32_t* b = reinterpret_cast<const uint32_t*>(B + R[i] * words);
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        uint32_t off = ~b[w];
        const int64_t base = w * 32, lim = std::min<int64_t>(32, vocab - base);
        if (lim < 32) off &= (1u << lim) - 1;
        if (off == 0xFFFFFFFFu) {
          std::fill(l + base, l + base + 32, neg);
          continue;
        }
        while (off) {
          l[base + __builtin_ctz(off)] = neg;
          off &= off - 1;
        }
      }
    }
  });
}

// RMSNorm of the rows of x [T, H] by w [H]: x / sqrt(mean(x^2) + eps) * w, in HF's order. With a residual,
// residual += x first and the norm is of that sum (vLLM's fused_add_rms_norm): one pass over each row where
// torch takes six ops. 16 running sums per row, then a fixed tree: the same for every T and thread count.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                       const c10::optional<torch::Tensor>& residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat && x.device().is_cpu(),
              "x: contiguous fp32 [T, H] on CPU");
  const int64_t T = x.size(0), H = x.size(1);
  TORCH_CHECK(w.numel() == H && w.is_contiguous() && w.scalar_type() == torch::kFloat, "w: fp32 [H]");
  float* r = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == torch::kFloat, "residual: like x");
    r = residual->data_ptr<float>();
  }
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 8, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      const float* src = xp + t * H;
      if (r) {
        float* rr = r + t * H;
        for (int64_t h = 0; h < H; ++h) rr[h] += src[h];
        src = rr;
      }
      float acc[16] = {0.f};
      int64_t h = 0;
      for (; h + 16 <= H; h += 16)
        for (int j = 0; j < 16; ++j) acc[j] += src[h + j] * src[h + j];
      for (; h < H; ++h) acc[h & 15] += src[h] * src[h];
      for (int width = 8; width >= 1; width /= 2)
        for (int j = 0; j < width; ++j) acc[j] += acc[j + width];
      const float inv = 1.0f / std::sqrt(acc[0] / static_cast<float>(H) + e);
      float* dst = op + t * H;
      for (int64_t k = 0; k < H; ++k) dst[k] = (src[k] * inv) * wp[k];
    }
  });
  return out;
}

// One head's row x [D] into int8 codes and its scale, as engine/kv_layout.py's quantize_kv does it (the same
// float operations, so both give the same bytes): scale = max|x| / 127 (1 for a zero row), codes round(x / scale).
inline void quantize_row(const float* x, int64_t D, int8_t* codes, float* scale) {
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  float s = amax / 127.f;
  if (!(s > 0.f)) s = 1.f;
  for (int64_t d = 0; d < D; ++d)
    codes[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / s))));
  *scale = s;
}

// In place on qkv [T, (H + 2G) * D]: rotate its H query and G key heads by cos/sin [T, D/2] (HF's rotate_half:
// d pairs with d + D/2), then store the keys and the values at their slots of one layer's caches
// [blocks, block_size, G, D] (any strides, rows contiguous). Replaces rotate, concatenate and two scatters.
// An int8 cache stores codes, and each row's scale at its slot of k_scale / v_scale [blocks, block_size, G].
void rope_write_kv(torch::Tensor qkv, const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor k_cache,
                   torch::Tensor v_cache, const torch::Tensor& slot_mapping, int64_t H, int64_t G,
                   c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.scalar_type() == torch::kFloat, "qkv: contiguous fp32");
  const bool quant = k_cache.scalar_type() == torch::kChar;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() && k_cache.stride(3) == 1 &&
              (k_cache.scalar_type() == torch::kFloat || quant) && v_cache.scalar_type() == k_cache.scalar_type(),
              "caches: fp32 or int8 [blocks, block_size, G, D], K and V alike, rows contiguous");
  TORCH_CHECK(quant == (k_scale.has_value() && v_scale.has_value()), "an int8 cache comes with its scales");
  if (quant)
    TORCH_CHECK(k_scale->scalar_type() == torch::kFloat && k_scale->dim() == 3 &&
                k_scale->sizes() == k_cache.sizes().slice(0, 3) && k_scale->strides() == v_scale->strides() &&
                v_scale->sizes() == k_scale->sizes(), "scales: fp32 [blocks, block_size, G], K and V alike");
  const int64_t T = qkv.size(0), D = k_cache.size(3), half = D / 2, bs = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == G && qkv.size(1) == (H + 2 * G) * D && D % 2 == 0, "qkv width != (H + 2G) * D");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * half && sin.numel() == T * half &&
              cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat, "cos, sin: fp32 [T, D/2]");
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t nslots = k_cache.size(0) * bs;
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < nslots, "slot out of range");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t el = k_cache.element_size();
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2), W = (H + 2 * G) * D;
  float* ks = quant ? k_scale->data_ptr<float>() : nullptr;
  float* vs = quant ? v_scale->data_ptr<float>() : nullptr;
  const int64_t ss0 = quant ? k_scale->stride(0) : 0, ss1 = quant ? k_scale->stride(1) : 0,
                ss2 = quant ? k_scale->stride(2) : 0;
  at::parallel_for(0, T, 4, [&](int64_t b, int64_t end) {
    for (int64_t t = b; t < end; ++t) {
      float* row = base + t * W;
      const float* c = cp + t * half;
      const float* s = snp + t * half;
      for (int64_t head = 0; head < H + G; ++head) {
        float* x = row + head * D;
        for (int64_t d = 0; d < half; ++d) {
          const float a = x[d], bb = x[d + half];
          x[d] = a * c[d] - bb * s[d];
          x[d + half] = bb * c[d] + a * s[d];
        }
      }
      const int64_t blk = sp[t] / bs, off = sp[t] % bs, slot = blk * s0 + off * s1;
      for (int64_t g = 0; g < G; ++g) {
        const float* krow = row + (H + g) * D;
        const float* vrow = row + (H + G + g) * D;
        if (quant) {
          const int64_t si = blk * ss0 + off * ss1 + g * ss2;
          quantize_row(krow, D, reinterpret_cast<int8_t*>(kc) + slot + g * s2, ks + si);
          quantize_row(vrow, D, reinterpret_cast<int8_t*>(vc) + slot + g * s2, vs + si);
        } else {
          std::memcpy(kc + (slot + g * s2) * el, krow, D * sizeof(float));
          std::memcpy(vc + (slot + g * s2) * el, vrow, D * sizeof(float));
        }
      }
    }
  });
}
