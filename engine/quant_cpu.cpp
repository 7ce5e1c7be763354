// Weight-only quantized matmul for CPU: y [M, N] = x [M, K] @ W.T with W packed as 4-bit (scale and min per
// group) or 8-bit (scale per group) integers; see engine/quant_kernels.py for the formats and the numerics.
//
// Activations are quantized to int8 per row per 32-element block, so every block's dot product is an exact
// integer (AVX-512 VNNI: vpdpbusd, AVX2: maddubs, or plain C++). Weights come in tiles of 16 output rows
// laid out so that lane j of a 16 x int32 vector is row j and each 4-byte group of it is 4 consecutive k of
// that row: one vpdpbusd against 4 broadcast activation bytes advances all 16 rows. Each output element then
// accumulates its blocks in order b = 0, 1, ... with the same float ops (p = dot * d; acc = fma(p, s_a, acc);
// acc = fma(min, s_a * sum(q_a), acc)) whatever the tile shape, path or thread count, so a row's result does
// not depend on which rows share the call (bitwise M-invariance). Threads own disjoint tiles of output rows.
// Built as part of engine/cpu_model.cpp (one extension, which defines the Python module).
//
// FP8 ("f8"): e4m3 weights with one fp32 scale per output row, run as torch._scaled_mm runs them (W8A8): each
// activation row is quantized to e4m3 with the scale amax / 448 (engine/quant.py's quantize_tokens_fp8, the same
// fp32 ops and round-to-nearest-even), then y[m, n] = (sum_k q_a[m, k] * q_w[n, k]) * s_a[m] * s_w[n]. A product
// of two e4m3 values is exact in fp32, so fma and multiply-then-add agree; the sum keeps 16 partial sums (lane l
// takes k = l, l + 16, ...) added in a fixed tree, the same in the AVX-512 path and the plain one, whatever the
// batch or the threads. torch's own CPU _scaled_mm converts every weight element on each call: 50 times slower
// than fp32 at decode sizes on this VM (docs/benchmarks.md); this one reads each e4m3 byte once.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <vector>

namespace {

constexpr int64_t QK = 32;    // activation block (elements)
constexpr int64_t NT = 16;    // output rows per weight tile

inline int32_t load4(const void* p) { int32_t v; std::memcpy(&v, p, 4); return v; }

// One 32-element block of a row: q = round_even(x / s), s = max|x| / 127 (s = 0: all zero). q8 stores q + 128
// (vpdpbusd's unsigned operand; the weights' sums undo the offset).
void quantize_block(const float* x, uint8_t* q, float* s, float* ssum, bool offset) {
#if defined(__AVX512F__)
  __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b))) / 127.f;
  __m512i qa = _mm512_setzero_si512(), qb = qa;
  if (d != 0.f) {
    const __m512 dv = _mm512_set1_ps(d), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
    qa = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(a, dv), lo), hi));
    qb = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_div_ps(b, dv), lo), hi));
  }
  int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  __m256i packed = _mm256_set_m128i(_mm512_cvtepi32_epi8(qb), _mm512_cvtepi32_epi8(qa));
  if (offset) packed = _mm256_xor_si256(packed, _mm256_set1_epi8((char)0x80));
  _mm256_storeu_si256((__m256i*)q, packed);
#else
  float m = 0.f;
  for (int i = 0; i < QK; ++i) m = std::max(m, std::fabs(x[i]));
  float d = m / 127.f;
  int32_t sum = 0;
  for (int i = 0; i < QK; ++i) {
    int32_t v = d != 0.f ? (int32_t)std::nearbyint(std::min(std::max(x[i] / d, -127.f), 127.f)) : 0;
    sum += v;
    q[i] = (uint8_t)(offset ? v + 128 : v);
  }
#endif
  *s = d;
  *ssum = d * (float)sum;
}

struct Acts {                  // a quantized [M, K] activation: q uint8 [M, K], s and ssum fp32 [M, K / 32]
  torch::Tensor buf;           // all three in one allocation
  const uint8_t* q; const float* s; const float* ssum;
};

Acts quantize(const torch::Tensor& x, bool offset) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  torch::Tensor buf = torch::empty({M * K + 8 * M * nb}, torch::kUInt8);
  uint8_t* qp = buf.data_ptr<uint8_t>();
  float* sp = (float*)(qp + M * K);            // K % 32 == 0: aligned as the allocation
  float* ssp = sp + M * nb;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) quantize_block(xp + i * QK, qp + i * QK, sp + i, ssp + i, offset);
  });
  return Acts{buf, qp, sp, ssp};
}

// The weights of one call as engine/quant_kernels.py's prepare() lays them out: T = ceil(N / 16) tiles of 16 rows,
// each one stream of spans of S = max(group, 32) k that share their scales: S / 32 blocks, then the span's scales
// (16 fp32, two such for group 16), then for q4 its mins (16 fp32), for q8 its blocks' weight sums (16 int16 per
// block, per half-block for group 16). A block holds
//   q4: 256 bytes [4][16][4], byte (v, j, i) = q[k = 4v + i] | q[k = 16 + 4v + i] << 4 of row j
//   q8: 512 bytes [8][16][4], byte (c, j, i) = q[k = 4c + i] of row j
struct Weights {
  const uint8_t* buf;
  int64_t N, K, nb, group, bps, bytes, span;        // blocks per span, bytes per block, bytes per span
  const uint8_t* at(int64_t t, int64_t b) const { return buf + (t * (nb / bps) + b / bps) * span; }
  const uint8_t* q(int64_t t, int64_t b) const { return at(t, b) + b % bps * bytes; }
  const float* d(int64_t t, int64_t b) const { return (const float*)(at(t, b) + bps * bytes); }
  const float* mn(int64_t t, int64_t b) const { return d(t, b) + NT; }
  const int16_t* wsum(int64_t t, int64_t b) const {
    return (const int16_t*)(d(t, b) + (group == 16 ? 2 : 1) * NT) + b % bps * NT;
  }
};

inline void store_row(float* y, const float* acc, int64_t n0, int64_t N) {
  for (int64_t j = 0; j < NT && n0 + j < N; ++j) y[n0 + j] = acc[j];
}

#if defined(__AVX512VNNI__)
// MT activation rows x NV weight tiles, all K blocks, registers only.
template <int MT, int NV, bool Q4, bool G16>
void tile_avx512(const Weights& w, const Acts& a, int64_t t0, int64_t m0, float* y) {
  const int64_t K = w.K, nb = w.nb;
  const uint8_t* aq = a.q + m0 * K;
  const float *as = a.s + m0 * nb, *ass = a.ssum + m0 * nb;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT][NV];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int H = G16 ? 2 : 1;
    __m512i ia[H][MT][NV];
    for (int h = 0; h < H; ++h)
      for (int v = 0; v < NV; ++v) {
        __m512i init = _mm512_setzero_si512();
        if (!Q4) {                                              // (q + 128) . w = q . w + 128 * sum(w)
          const int16_t* ws = w.wsum(t0 + v, b) + h * NT;
          init = _mm512_sub_epi32(init, _mm512_slli_epi32(
              _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i*)ws)), 7));
        }
        for (int m = 0; m < MT; ++m) ia[h][m][v] = init;
      }
    const uint8_t* qa = aq + b * QK;
    if (Q4) {
      for (int c = 0; c < 4; ++c) {
        __m512i lo[NV], hi[NV];
        for (int v = 0; v < NV; ++v) {
          __m512i x = _mm512_loadu_si512(w.q(t0 + v, b) + c * 64);
          lo[v] = _mm512_and_si512(x, low);
          hi[v] = _mm512_and_si512(_mm512_srli_epi16(x, 4), low);
        }
        for (int m = 0; m < MT; ++m) {
          const __m512i al = _mm512_set1_epi32(load4(qa + m * K + 4 * c));
          const __m512i ah = _mm512_set1_epi32(load4(qa + m * K + 16 + 4 * c));
          for (int v = 0; v < NV; ++v)
            ia[0][m][v] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ia[0][m][v], lo[v], al), hi[v], ah);
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        __m512i wv[NV];
        for (int v = 0; v < NV; ++v) wv[v] = _mm512_loadu_si512(w.q(t0 + v, b) + c * 64);
        for (int m = 0; m < MT; ++m) {
          const __m512i av = _mm512_set1_epi32(load4(qa + m * K + 4 * c));
          for (int v = 0; v < NV; ++v) {
            __m512i& r = ia[G16 ? c / 4 : 0][m][v];
            r = _mm512_dpbusd_epi32(r, av, wv[v]);
          }
        }
      }
    }
    for (int v = 0; v < NV; ++v) {
      const float* dp = w.d(t0 + v, b);
      const __m512 d0 = _mm512_loadu_ps(dp), d1 = G16 ? _mm512_loadu_ps(dp + NT) : d0;
      const __m512 mn = Q4 ? _mm512_loadu_ps(w.mn(t0 + v, b)) : d0;
      for (int m = 0; m < MT; ++m) {
        __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(ia[0][m][v]), d0);
        if (G16) p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[H - 1][m][v]), d1, p);
        acc[m][v] = _mm512_fmadd_ps(p, _mm512_set1_ps(as[m * nb + b]), acc[m][v]);
        if (Q4) acc[m][v] = _mm512_fmadd_ps(mn, _mm512_set1_ps(ass[m * nb + b]), acc[m][v]);
      }
    }
  }
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < NV; ++v) {
      const int64_t n0 = (t0 + v) * NT;
      const __mmask16 keep = n0 + NT <= w.N ? 0xFFFF : (__mmask16)((1u << (w.N - n0)) - 1);
      _mm512_mask_storeu_ps(y + (m0 + m) * w.N + n0, keep, acc[m][v]);
    }
}

template <int NV, bool Q4, bool G16>
void tiles_avx512(const Weights& w, const Acts& a, int64_t t0, int64_t M, float* y) {
  constexpr int MT = 4;
  int64_t m0 = 0;
  for (; m0 + MT <= M; m0 += MT) tile_avx512<MT, NV, Q4, G16>(w, a, t0, m0, y);
  switch (M - m0) {
    case 3: tile_avx512<3, NV, Q4, G16>(w, a, t0, m0, y); break;
    case 2: tile_avx512<2, NV, Q4, G16>(w, a, t0, m0, y); break;
    case 1: tile_avx512<1, NV, Q4, G16>(w, a, t0, m0, y); break;
  }
}

template <bool Q4, bool G16>
void run(const Weights& w, const Acts& a, int64_t M, float* y) {
  const int64_t T = (w.N + NT - 1) / NT, pairs = (T + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      if (2 * p + 1 < T) tiles_avx512<2, Q4, G16>(w, a, 2 * p, M, y);
      else tiles_avx512<1, Q4, G16>(w, a, 2 * p, M, y);
    }
  });
}
#else
// Integer dots of one activation block against one weight tile: dot[h][j] for row j, half h (G16) of the block.
template <bool Q4, bool G16>
void block_dots(const uint8_t* wq, const uint8_t* qa, int32_t dot[2][NT]) {
#if defined(__AVX2__)
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {                     // rows 8 * half .. 8 * half + 7
    if (Q4) {
      const __m256i low = _mm256_set1_epi8(0x0F);
      __m256i s16 = _mm256_setzero_si256();                  // 8 pairs of 15 * 127 * 2 fit int16
      for (int c = 0; c < 4; ++c) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(wq + c * 64 + half * 32));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(x, low),
                                                         _mm256_set1_epi32(load4(qa + 4 * c))));
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(x, 4), low),
                                                         _mm256_set1_epi32(load4(qa + 16 + 4 * c))));
      }
      _mm256_storeu_si256((__m256i*)(dot[0] + 8 * half), _mm256_madd_epi16(s16, ones));
    } else {                                                 // sign trick: |w| (u8) . sign(a, w) (s8)
      __m256i s32[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
      for (int c = 0; c < 8; ++c) {
        __m256i x = _mm256_loadu_si256((const __m256i*)(wq + c * 64 + half * 32));
        __m256i av = _mm256_xor_si256(_mm256_set1_epi32(load4(qa + 4 * c)), _mm256_set1_epi8((char)0x80));
        __m256i pr = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(av, x)), ones);
        s32[G16 ? c / 4 : 0] = _mm256_add_epi32(s32[G16 ? c / 4 : 0], pr);
      }
      for (int h = 0; h < (G16 ? 2 : 1); ++h) _mm256_storeu_si256((__m256i*)(dot[h] + 8 * half), s32[h]);
    }
  }
#else
  for (int j = 0; j < NT; ++j) {
    int32_t s[2] = {0, 0};
    for (int k = 0; k < QK; ++k) {
      int32_t q;
      if (Q4) {
        uint8_t byte = wq[(k % 16 / 4) * 64 + j * 4 + k % 4];
        q = (k < 16 ? byte & 15 : byte >> 4) * (int32_t)(int8_t)qa[k];
      } else {
        q = (int32_t)(int8_t)wq[(k / 4) * 64 + j * 4 + k % 4] * ((int32_t)qa[k] - 128);
      }
      s[G16 ? k / 16 : 0] += q;
    }
    dot[0][j] = s[0];
    dot[1][j] = s[1];
  }
#endif
}

template <bool Q4, bool G16>
void run(const Weights& w, const Acts& a, int64_t M, float* y) {
  const int64_t T = (w.N + NT - 1) / NT, K = w.K, nb = w.nb;
  const uint8_t *aq = a.q;
  const float *as = a.s, *ass = a.ssum;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t m = 0; m < M; ++m) {
        float acc[NT] = {};
        int32_t dot[2][NT];
        for (int64_t b = 0; b < nb; ++b) {
          block_dots<Q4, G16>(w.q(t, b), aq + m * K + b * QK, dot);
          const float* d = w.d(t, b);
          const float* mn = w.mn(t, b);
          for (int j = 0; j < NT; ++j) {
            float p = (float)dot[0][j] * d[j];
            if (G16) p = std::fma((float)dot[1][j], d[NT + j], p);
            acc[j] = std::fma(p, as[m * nb + b], acc[j]);
            if (Q4) acc[j] = std::fma(mn[j], ass[m * nb + b], acc[j]);
          }
        }
        store_row(y + m * w.N, acc, t * NT, w.N);
      }
  });
}
#endif

// -- FP8 (e4m3) weights ------------------------------------------------------------------------------------
constexpr int64_t F8L = 16;                  // partial sums per output element

inline float f8_bits(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t f8_word(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

// The value of an e4m3 byte (0x7f / 0xff, e4m3fn's NaN, never occur: quantization saturates at 448).
inline float e4m3_value(uint8_t byte) {
  const uint32_t em = byte & 0x7f;
  const float mag = em < 8 ? (float)em * 0x1p-9f : f8_bits((em << 20) + (120u << 23));
  return f8_bits(f8_word(mag) | (uint32_t)(byte & 0x80) << 24);
}

// v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, as torch's .to(torch.float8_e4m3fn).
inline float e4m3_round(float v) {
  const float a = std::fabs(v);
  float r;
  if (a < 0x1p-6f) {                         // subnormal e4m3: a grid of 2^-9
    r = std::nearbyint(a * 512.f) * 0x1p-9f;
  } else {                                   // 3 mantissa bits kept, ties to even
    uint32_t b = f8_word(a);
    b += 0x7FFFFu + ((b >> 20) & 1u);
    r = f8_bits(b & 0xFFF00000u);
  }
  return std::copysign(r, v);
}

// Row m of x as its e4m3 values (fp32) and its scale.
void f8_quantize_row(const float* x, int64_t K, float* q, float* s) {
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  float d = amax / 448.f;
  d = std::isnan(d) ? d : std::max(d, 1e-12f);
  for (int64_t k = 0; k < K; ++k) q[k] = e4m3_round(std::min(std::max(x[k] / d, -448.f), 448.f));
  *s = d;
}

inline float f8_reduce(float* p) {           // the 16 partial sums in a fixed tree
  for (int w = F8L / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) p[l] += p[l + w];
  return p[0];
}

// Plain loops: the path of CPUs without AVX-512 (the compiler vectorizes the lanes), and the reference the
// AVX-512 path is tested against bit for bit (f8_matmul_portable).
void f8_rows_plain(const float* qa, const float* sa, const uint8_t* w, const float* sw, int64_t K, int64_t N,
                   int64_t M, int64_t n0, int64_t n1, float* y) {
  float lut[256];
  for (int i = 0; i < 256; ++i) lut[i] = e4m3_value((uint8_t)i);
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t k = 0; k < K; ++k) row[k] = lut[w[n * K + k]];
    for (int64_t m = 0; m < M; ++m) {
      float p[F8L] = {};
      const float* x = qa + m * K;
      for (int64_t k = 0; k < K; k += F8L)
        for (int l = 0; l < F8L; ++l) p[l] = std::fma(x[k + l], row[k + l], p[l]);
      y[m * N + n] = f8_reduce(p) * sa[m] * sw[n];
    }
  }
}

#if defined(__AVX512F__)
inline __m512 e4m3_16(const uint8_t* p) {    // 16 e4m3 bytes -> fp32, exactly e4m3_value's
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i em = _mm512_and_si512(v, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(0x1p-9f));
  const __m512 mag = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

// MR activation rows x NR weight rows, all of K, in registers. The weights come as e4m3 bytes (row n at
// w + n * K), or (WF) as their fp32 values, converted once for all of a prefill's rows (row j at wf + j * K).
template <int MR, int NR, bool WF>
void f8_tile(const float* qa, const float* sa, const uint8_t* w, const float* wf, const float* sw, int64_t K,
             int64_t N, int64_t m0, int64_t n0, float* y) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += F8L) {
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = WF ? _mm512_loadu_ps(wf + j * K + k) : e4m3_16(w + (n0 + j) * K + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(qa + (m0 + i) * K + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  alignas(64) float p[F8L];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      _mm512_store_ps(p, acc[i][j]);
      y[(m0 + i) * N + n0 + j] = f8_reduce(p) * sa[m0 + i] * sw[n0 + j];
    }
}

template <int MR, bool WF>
void f8_tile_r(int64_t r, const float* qa, const float* sa, const uint8_t* w, const float* wf, const float* sw,
               int64_t K, int64_t N, int64_t m0, int64_t n0, float* y) {
  switch (r) {
    case 4: return f8_tile<MR, 4, WF>(qa, sa, w, wf, sw, K, N, m0, n0, y);
    case 3: return f8_tile<MR, 3, WF>(qa, sa, w, wf, sw, K, N, m0, n0, y);
    case 2: return f8_tile<MR, 2, WF>(qa, sa, w, wf, sw, K, N, m0, n0, y);
    default: return f8_tile<MR, 1, WF>(qa, sa, w, wf, sw, K, N, m0, n0, y);
  }
}

template <bool WF>
void f8_tile_any(int64_t mr, int64_t r, const float* qa, const float* sa, const uint8_t* w, const float* wf,
                 const float* sw, int64_t K, int64_t N, int64_t m0, int64_t n0, float* y) {
  switch (mr) {
    case 4: return f8_tile_r<4, WF>(r, qa, sa, w, wf, sw, K, N, m0, n0, y);
    case 3: return f8_tile_r<3, WF>(r, qa, sa, w, wf, sw, K, N, m0, n0, y);
    case 2: return f8_tile_r<2, WF>(r, qa, sa, w, wf, sw, K, N, m0, n0, y);
    default: return f8_tile_r<1, WF>(r, qa, sa, w, wf, sw, K, N, m0, n0, y);
  }
}

// Weight rows [n0, n1) against all M activation rows, in tiles of 4 x 4. Past one tile of activation rows the
// block's weights are converted once into `buf`, and each tile of activation rows (in L1) meets all of them: the
// same values, so the same bits, at a prefill's speed.
void f8_block(const float* qa, const float* sa, const uint8_t* w, const float* sw, int64_t K, int64_t N, int64_t M,
              int64_t n0, int64_t n1, float* y, std::vector<float>& buf) {
  if (M <= 4) {
    for (int64_t n = n0; n < n1; n += 4) f8_tile_any<false>(M, std::min<int64_t>(4, n1 - n), qa, sa, w, nullptr, sw,
                                                            K, N, 0, n, y);
    return;
  }
  buf.resize((n1 - n0) * K);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < K; k += F8L) _mm512_storeu_ps(buf.data() + (n - n0) * K + k, e4m3_16(w + n * K + k));
  for (int64_t m0 = 0; m0 < M; m0 += 4)
    for (int64_t n = n0; n < n1; n += 4)
      f8_tile_any<true>(std::min<int64_t>(4, M - m0), std::min<int64_t>(4, n1 - n), qa, sa, w,
                        buf.data() + (n - n0) * K, sw, K, N, m0, n, y);
}
#endif

// packed: the codes [N, K] (uint8) then the row scales [N] (fp32), engine/quant_kernels.py's prepare("f8").
torch::Tensor f8_matmul(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, bool portable) {
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % F8L == 0, "fp8 matmul: K must be a multiple of 16");
  TORCH_CHECK(packed.numel() == n * K + 4 * n, "packed fp8 weights do not match n, k");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* sw = (const float*)(w + n * K);               // K % 16 == 0: 4-byte aligned
  torch::Tensor acts = torch::empty({M * K + M}, torch::kFloat);
  float *qa = acts.data_ptr<float>(), *sa = qa + M * K;
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) f8_quantize_row(xp + m * K, K, qa + m * K, sa + m);
  });
  torch::Tensor y = torch::empty({M, n});
  float* yp = y.data_ptr<float>();
  if (M == 0) return y;
  constexpr int64_t NB = 16;                                 // weight rows a task takes (and converts once)
  at::parallel_for(0, (n + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * NB, n1 = std::min(n, b1 * NB);
#if defined(__AVX512F__)
    if (!portable) {
      std::vector<float> buf;
      for (int64_t b = b0; b < b1; ++b) f8_block(qa, sa, w, sw, K, n, M, b * NB, std::min(n, (b + 1) * NB), yp, buf);
      return;
    }
#endif
    f8_rows_plain(qa, sa, w, sw, K, n, M, n0, n1, yp);
  });
  return y;
}

// kind: KIND_Q8, KIND_Q4 or KIND_F8 (engine/quant_kernels.py's KINDS)
constexpr int64_t KIND_Q8 = 0, KIND_Q4 = 1, KIND_F8 = 2;

torch::Tensor matmul(torch::Tensor x, torch::Tensor packed, int64_t kind, int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
  if (kind == KIND_F8) return f8_matmul(x, packed, n, false);
  TORCH_CHECK(kind == KIND_Q8 || kind == KIND_Q4, "unknown packed kind");
  const bool q4 = kind == KIND_Q4;
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % QK == 0 && K % group == 0 && (group == 16 || group % QK == 0), "bad K or group");
  const int64_t bps = std::max(group, QK) / QK, bytes = q4 ? 256 : 512, nsc = group == 16 ? 2 : 1;
  Weights w{packed.data_ptr<uint8_t>(), n, K, K / QK, group, bps, bytes,
            bps * bytes + nsc * 64 + (q4 ? 64 : bps * nsc * 32)};
  TORCH_CHECK(packed.numel() == (n + NT - 1) / NT * (K / QK / bps) * w.span, "packed weights do not match n, k");
  Acts a = quantize(x, !q4);
  torch::Tensor y = torch::empty({M, n});
  if (M == 0) return y;
  if (q4) run<true, false>(w, a, M, y.data_ptr<float>());
  else if (group == 16) run<false, true>(w, a, M, y.data_ptr<float>());
  else run<false, false>(w, a, M, y.data_ptr<float>());
  return y;
}

}  // namespace
