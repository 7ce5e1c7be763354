// Batched LoRA products on CPU (engine/lora_ops.py): the rows of one step, each under its own adapter slot.
//
//   shrink: t[i, r]            = sum_k x[rows[i], k] * a[slots[i], r, k]
//   expand: y[rows[i], c0 + n] += sum_r t[i, r0 + r] * bt[slots[i], r, n]     (bt: one part's B, transposed)
//
// Every output element is computed by one thread in one fixed order (16 lanes over k, then the lanes in
// order; r in order), and compiled with -ffp-contract=off, so a row's result is bitwise the same whichever
// rows share the call and however many threads run it: LoRA keeps the packed kernels' batch invariance.
//
// The rows come sorted by slot (LoRAPlan.rows), so the kernels work on tiles of up to MR rows under one adapter:
// a tile reads each of its adapter's A rows (shrink) or B rows (expand) once for all its rows, and holds MR x NR
// lane vectors (shrink) or MR x COLS columns (expand) in registers. Blocking changes which products are computed
// together, not the order each element's sum is taken in. A tile with fewer than MR rows repeats its last row and
// drops those results. With AVX-512 the tile's sums live in registers; with AVX2 (16 registers of 8 lanes) the
// tile runs in 2 x 2 blocks; elsewhere the compiler vectorizes the plain loops. All three give the same bits.
// Included by engine/cpu_model.cpp, whose decoder stack applies adapters in-line, and bound there (one extension,
// one set of flags).

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t MR = 4;         // rows per tile, all under one adapter
constexpr int64_t NR = 4;         // shrink: ranks per task
constexpr int64_t COLS = 64;      // expand: output columns per task
static_assert(MR % 2 == 0 && NR % 2 == 0 && COLS % 32 == 0, "the AVX2 blocks are 2 rows x 2 ranks, 2 rows x 32 columns");

// rows index [0, num_rows) and slots [0, num_slots): checked once per call, so a stale step plan fails cleanly
void check_rows(const torch::Tensor& rows, const torch::Tensor& slots, int64_t num_rows, int64_t num_slots) {
  TORCH_CHECK(rows.scalar_type() == torch::kLong && slots.scalar_type() == torch::kLong && rows.is_contiguous() &&
              slots.is_contiguous() && rows.numel() == slots.numel(), "LoRA rows and slots: int64, one slot per row");
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.numel(); i++)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < num_rows && sp[i] >= 0 && sp[i] < num_slots, "LoRA row ", rp[i], " (slot ",
                sp[i], ") outside the step's ", num_rows, " rows and ", num_slots, " slots");
}

// (first position in rows, number of rows) of each tile: up to MR consecutive rows with one slot
std::vector<std::pair<int64_t, int64_t>> tiles_of(const int64_t* slots, int64_t g) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t i = 0; i < g;) {
    int64_t n = 1;
    while (n < MR && i + n < g && slots[i + n] == slots[i]) n++;
    tiles.emplace_back(i, n);
    i += n;
  }
  return tiles;
}

// t[i, j] for the tile's rows i and ranks j in [j0, j0 + nr): one lane vector per (row, rank)
void shrink_tile(const float* const* xs, int64_t m, const float* a, int64_t j0, int64_t nr, int64_t k,
                 float* const* ts) {
  float acc[MR][NR][LANES];
  for (int64_t u = 0; u < MR; u++)
    for (int64_t v = 0; v < NR; v++)
      for (int64_t l = 0; l < LANES; l++) acc[u][v][l] = 0.f;
  const float* ar[NR];
  for (int64_t v = 0; v < NR; v++) ar[v] = a + (j0 + std::min(v, nr - 1)) * k;
  int64_t i = 0;
#if defined(__AVX512F__)
  // the same lane sums in registers (the compiler's own vectors are 256 bits wide here, and spill)
  __m512 vacc[MR][NR];
  for (int64_t u = 0; u < MR; u++)
    for (int64_t v = 0; v < NR; v++) vacc[u][v] = _mm512_setzero_ps();
  for (; i + LANES <= k; i += LANES) {
    __m512 xv[MR];
    for (int64_t u = 0; u < MR; u++) xv[u] = _mm512_loadu_ps(xs[u] + i);
    for (int64_t v = 0; v < NR; v++) {
      const __m512 av = _mm512_loadu_ps(ar[v] + i);
      for (int64_t u = 0; u < MR; u++) vacc[u][v] = _mm512_add_ps(vacc[u][v], _mm512_mul_ps(xv[u], av));
    }
  }
  for (int64_t u = 0; u < MR; u++)
    for (int64_t v = 0; v < NR; v++) _mm512_storeu_ps(acc[u][v], vacc[u][v]);
#elif defined(__AVX2__)
  // 16 registers of 8 lanes: the tile in 2 x 2 blocks (rows x ranks), each lane vector two registers
  int64_t full = k - k % LANES;
  for (int64_t u0 = 0; u0 < MR; u0 += 2)
    for (int64_t v0 = 0; v0 < NR; v0 += 2) {
      __m256 vacc[2][2][2];
      for (int64_t u = 0; u < 2; u++)
        for (int64_t v = 0; v < 2; v++) vacc[u][v][0] = vacc[u][v][1] = _mm256_setzero_ps();
      for (int64_t q = 0; q < full; q += LANES) {
        const __m256 x00 = _mm256_loadu_ps(xs[u0] + q), x01 = _mm256_loadu_ps(xs[u0] + q + 8);
        const __m256 x10 = _mm256_loadu_ps(xs[u0 + 1] + q), x11 = _mm256_loadu_ps(xs[u0 + 1] + q + 8);
        for (int64_t v = 0; v < 2; v++) {
          const __m256 a0 = _mm256_loadu_ps(ar[v0 + v] + q), a1 = _mm256_loadu_ps(ar[v0 + v] + q + 8);
          vacc[0][v][0] = _mm256_add_ps(vacc[0][v][0], _mm256_mul_ps(x00, a0));
          vacc[0][v][1] = _mm256_add_ps(vacc[0][v][1], _mm256_mul_ps(x01, a1));
          vacc[1][v][0] = _mm256_add_ps(vacc[1][v][0], _mm256_mul_ps(x10, a0));
          vacc[1][v][1] = _mm256_add_ps(vacc[1][v][1], _mm256_mul_ps(x11, a1));
        }
      }
      for (int64_t u = 0; u < 2; u++)
        for (int64_t v = 0; v < 2; v++) {
          _mm256_storeu_ps(acc[u0 + u][v0 + v], vacc[u][v][0]);
          _mm256_storeu_ps(acc[u0 + u][v0 + v] + 8, vacc[u][v][1]);
        }
    }
  i = full;
#else
  for (; i + LANES <= k; i += LANES)
    for (int64_t v = 0; v < NR; v++)
      for (int64_t u = 0; u < MR; u++) {
#pragma omp simd
        for (int64_t l = 0; l < LANES; l++) acc[u][v][l] += xs[u][i + l] * ar[v][i + l];
      }
#endif
  for (int64_t u = 0; u < m; u++)
    for (int64_t v = 0; v < nr; v++) {
      for (int64_t q = i, l = 0; q < k; q++, l++) acc[u][v][l] += xs[u][q] * ar[v][q];
      float s = 0.f;
      for (int64_t l = 0; l < LANES; l++) s += acc[u][v][l];
      ts[u][j0 + v] = s;
    }
}

// y rows of the tile, columns [n0, n0 + len) of this part: += t[:, r0:r0+rp] @ bt rows
template <bool Full>
void expand_tile(const float* const* ts, const float* bt, int64_t rp, int64_t np, int64_t n0, int64_t len,
                 float* const* ys, int64_t m) {
  float acc[MR][COLS];
  const int64_t w = Full ? COLS : len;
#if defined(__AVX512F__)
  if constexpr (Full) {             // the same sums in registers: 4 vectors of 16 columns per row
    constexpr int64_t V = COLS / LANES;
    __m512 vacc[MR][V];
    for (int64_t u = 0; u < MR; u++)
      for (int64_t c = 0; c < V; c++) vacc[u][c] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rp; r++) {
      const float* br = bt + r * np + n0;
      __m512 bv[V];
      for (int64_t c = 0; c < V; c++) bv[c] = _mm512_loadu_ps(br + c * LANES);
      for (int64_t u = 0; u < MR; u++) {
        const __m512 tv = _mm512_set1_ps(ts[u][r]);
        for (int64_t c = 0; c < V; c++) vacc[u][c] = _mm512_add_ps(vacc[u][c], _mm512_mul_ps(tv, bv[c]));
      }
    }
    for (int64_t u = 0; u < m; u++)
      for (int64_t c = 0; c < V; c++) {
        float* yr = ys[u] + n0 + c * LANES;
        _mm512_storeu_ps(yr, _mm512_add_ps(_mm512_loadu_ps(yr), vacc[u][c]));
      }
    return;
  }
#elif defined(__AVX2__)
  if constexpr (Full) {             // the same sums in 2 rows x 32 columns blocks: 8 accumulators of 8 lanes
    for (int64_t u0 = 0; u0 < MR; u0 += 2)
      for (int64_t c0 = 0; c0 < COLS; c0 += 32) {
        __m256 vacc[2][4];
        for (int64_t u = 0; u < 2; u++)
          for (int64_t c = 0; c < 4; c++) vacc[u][c] = _mm256_setzero_ps();
        for (int64_t r = 0; r < rp; r++) {
          const float* br = bt + r * np + n0 + c0;
          const __m256 b0 = _mm256_loadu_ps(br), b1 = _mm256_loadu_ps(br + 8), b2 = _mm256_loadu_ps(br + 16),
                       b3 = _mm256_loadu_ps(br + 24);
          for (int64_t u = 0; u < 2; u++) {
            const __m256 tv = _mm256_set1_ps(ts[u0 + u][r]);
            vacc[u][0] = _mm256_add_ps(vacc[u][0], _mm256_mul_ps(tv, b0));
            vacc[u][1] = _mm256_add_ps(vacc[u][1], _mm256_mul_ps(tv, b1));
            vacc[u][2] = _mm256_add_ps(vacc[u][2], _mm256_mul_ps(tv, b2));
            vacc[u][3] = _mm256_add_ps(vacc[u][3], _mm256_mul_ps(tv, b3));
          }
        }
        for (int64_t u = 0; u < 2 && u0 + u < m; u++)
          for (int64_t c = 0; c < 4; c++) {
            float* yr = ys[u0 + u] + n0 + c0 + c * 8;
            _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), vacc[u][c]));
          }
      }
    return;
  }
#endif
  for (int64_t u = 0; u < MR; u++)
    for (int64_t j = 0; j < COLS; j++) acc[u][j] = 0.f;
  for (int64_t r = 0; r < rp; r++) {
    const float* br = bt + r * np + n0;
    for (int64_t u = 0; u < MR; u++) {
      const float tv = ts[u][r];
#pragma omp simd
      for (int64_t j = 0; j < w; j++) acc[u][j] += tv * br[j];
    }
  }
  for (int64_t u = 0; u < m; u++) {
    float* yr = ys[u] + n0;
#pragma omp simd
    for (int64_t j = 0; j < w; j++) yr[j] += acc[u][j];
  }
}

}  // namespace

torch::Tensor shrink(torch::Tensor x, torch::Tensor a, torch::Tensor rows, torch::Tensor slots) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && a.dtype() == torch::kFloat32, "shrink: fp32 only");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous(), "shrink: contiguous x and a");
  const int64_t g = rows.size(0), r = a.size(1), k = a.size(2);
  TORCH_CHECK(x.size(1) == k, "shrink: x and a disagree on K");
  check_rows(rows, slots, x.size(0), a.size(0));
  auto t = torch::empty({g, r}, x.options());
  if (g == 0 || r == 0) return t;
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* tp = t.data_ptr<float>();
  const auto tiles = tiles_of(sp, g);
  const int64_t nt = static_cast<int64_t>(tiles.size()), rb = (r + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < nt * rb; task++) {
    const auto [i0, m] = tiles[task / rb];
    const int64_t j0 = (task % rb) * NR;
    const float* xs[MR];
    float* ts[MR];
    for (int64_t u = 0; u < MR; u++) {
      const int64_t i = i0 + std::min(u, m - 1);
      xs[u] = xp + rp[i] * k;
      ts[u] = tp + i * r;
    }
    shrink_tile(xs, m, ap + sp[i0] * r * k, j0, std::min(NR, r - j0), k, ts);
  }
  return t;
}

void expand(torch::Tensor t, int64_t r0, torch::Tensor bt, torch::Tensor rows, torch::Tensor slots, torch::Tensor y,
            int64_t c0) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && bt.dtype() == torch::kFloat32 && y.dtype() == torch::kFloat32,
              "expand: fp32 only");
  TORCH_CHECK(t.is_contiguous() && bt.is_contiguous() && y.stride(1) == 1, "expand: contiguous rows");
  const int64_t g = rows.size(0), rp_ = bt.size(1), np_ = bt.size(2), rt = t.size(1), ys_ = y.stride(0);
  TORCH_CHECK(r0 + rp_ <= rt && c0 + np_ <= y.size(1) && t.size(0) == g, "expand: part out of range");
  check_rows(rows, slots, y.size(0), bt.size(0));
  if (g == 0) return;
  const float* tp = t.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const auto tiles = tiles_of(sp, g);
  const int64_t nt = static_cast<int64_t>(tiles.size()), blocks = (np_ + COLS - 1) / COLS;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < nt * blocks; task++) {
    const auto [i0, m] = tiles[task / blocks];
    const int64_t n0 = (task % blocks) * COLS, len = std::min(COLS, np_ - n0);
    const float* ts[MR];
    float* ys[MR];
    for (int64_t u = 0; u < MR; u++) {
      const int64_t i = i0 + std::min(u, m - 1);
      ts[u] = tp + i * rt + r0;
      ys[u] = yp + rp[i] * ys_ + c0;
    }
    const float* bs = bp + sp[i0] * rp_ * np_;
    if (len == COLS)
      expand_tile<true>(ts, bs, rp_, np_, n0, len, ys, m);
    else
      expand_tile<false>(ts, bs, rp_, np_, n0, len, ys, m);      // a part's last, narrower block
  }
}

// y += each row's adapter product, in place: A [slots, parts * R, K] and one transposed B per part [slots, R, N_i]
// (part i reads t's rank columns [i*R, (i+1)*R) and writes y's next N_i columns). The one composition of the two
// kernels: engine/lora_ops.py's apply_lora_cpu and the decoder stack (engine/cpu_model.cpp) both call it.
void apply(const torch::Tensor& x, const torch::Tensor& a, const std::vector<torch::Tensor>& bt,
           const torch::Tensor& rows, const torch::Tensor& slots, torch::Tensor y) {
  TORCH_CHECK(!bt.empty() && a.size(1) % static_cast<int64_t>(bt.size()) == 0, "apply: one B per part of A's rows");
  const torch::Tensor t = shrink(x.contiguous(), a, rows, slots);
  const int64_t rank = a.size(1) / static_cast<int64_t>(bt.size());
  int64_t col = 0;
  for (size_t i = 0; i < bt.size(); i++) {
    expand(t, static_cast<int64_t>(i) * rank, bt[i], rows, slots, y, col);
    col += bt[i].size(2);
  }
}
