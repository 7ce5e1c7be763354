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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <immintrin.h>

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

torch::Tensor matmul(torch::Tensor x, torch::Tensor packed, bool q4, int64_t group, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: contiguous fp32 [M, K]");
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
