// Sampling on the CPU (engine/sampler.py): temperature, top-k, top-p, min-p and the inverse-CDF draw, one row per
// task, without sorting the vocabulary. Uses cpu_attention.cpp's exp_nonpos.
//
// Row r: xs = x / temp, w = exp(xs - max xs) (float), tokens ranked by xs descending, ties by id ascending.
// top-k keeps the first k; top-p keeps a token while the mass before it, over s (the sum of w over the top k,
// else over the row), is < top_p; min-p drops w < min_p (p < min_p * p_max, since p_max = 1 / s). The kept set
// is found from a histogram of w by binary exponent (48 buckets, each within a factor 2): buckets whole on one
// side of every cut are kept or dropped whole, and only a bucket a cut falls in is sorted. The draw is the
// first token, in id order, whose float64 prefix sum of kept w exceeds u * (their total): the same sums as
// torch's cumsum over the dense weights this also returns (w, 0 where filtered), so sampler.inverse_cdf of
// those picks the same token. Included in cpu_model.cpp inside namespace samp.

constexpr int NB = 48;

// bucket 0: w = 1 (the max); b in [1, NB-2]: w in [2^-b, 2^(1-b)); NB-1: everything smaller, 0 included
inline uint8_t bucket_of(float w) {
  uint32_t bits;
  std::memcpy(&bits, &w, sizeof bits);
  const int b = 127 - static_cast<int>((bits >> 23) & 0xFF);
  return static_cast<uint8_t>(b < 0 ? 0 : (b > NB - 1 ? NB - 1 : b));
}
inline double lower_of(int b) { return b == 0 ? 1.0 : (b == NB - 1 ? 0.0 : std::ldexp(1.0, -b)); }
inline double upper_of(int b) { return std::ldexp(1.0, 1 - b); }                    // exclusive

// out[0:n] <- the t in [0, V) with keep(bk[t]), ascending (out holds V); returns n. A word of 8 buckets for which
// any8 is false holds none (the kept are often few: most of a row's words are skipped whole).
constexpr uint64_t ONES = 0x0101010101010101ull, HIGHS = 0x8080808080808080ull;
inline bool has_zero(uint64_t x) { return ((x - ONES) & ~x & HIGHS) != 0; }               // some byte is 0
inline bool has_less(uint64_t x, unsigned n) { return ((x - ONES * n) & ~x & HIGHS) != 0; }  // some byte < n <= 128
template <class Any8, class Keep>
int64_t gather(const uint8_t* bk, int64_t V, Any8 any8, Keep keep, int32_t* out) {
  int64_t n = 0, t = 0;
  for (; t + 8 <= V; t += 8) {
    uint64_t word;
    std::memcpy(&word, bk + t, sizeof word);
    if (!any8(word)) continue;
    for (int j = 0; j < 8; ++j) {                   // branch-free: write each, advance past the kept
      out[n] = static_cast<int32_t>(t + j);
      n += keep(bk[t + j]);
    }
  }
  for (; t < V; ++t) {
    out[n] = static_cast<int32_t>(t);
    n += keep(bk[t]);
  }
  return n;
}

// a row task's buffers, V ids each: one bucket's members (shared by a row's walks), the row's kept ids
struct Scratch {
  std::vector<int32_t> members, kept;
  int64_t n_members = 0;
  int members_of = -1;
  explicit Scratch(int64_t V) : members(V), kept(V) {}
};

struct Row {
  const float* x;   // the row's logits (penalties and masks applied), before temperature
  int64_t V;
  float temp;
  int64_t k;        // top-k, 0 = off
  double top_p;     // 1 = off
  double min_p;     // 0 = off
  bool filtered() const { return (k > 0 && k < V) || top_p < 1.0 || min_p > 0.0; }
};

// w[0:V] <- exp(x / temp - max): the division as torch's (IEEE), the exp cpu_attention's (SIMD over whole
// vectors, the scalar twin for the rest). false if every token is at -inf.
bool weigh(const Row& r, float* w) {
  const int64_t V = r.V;
  for (int64_t i = 0; i < V; ++i) w[i] = r.x[i] / r.temp;
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
#ifdef BATON_SIMD
  using S = attn::Simd;
  if (V >= S::W) {
    S::V mv = S::set1(m);
    for (; i + S::W <= V; i += S::W) mv = S::max(mv, S::load(w + i));
    m = S::hmax(mv);
  }
#endif
  for (int64_t t = i; t < V; ++t) m = w[t] > m ? w[t] : m;
  if (!(m > -std::numeric_limits<float>::infinity())) {
    std::fill(w, w + V, 0.f);
    return false;
  }
  i = 0;
#ifdef BATON_SIMD
  const S::V mv = S::set1(m);
  for (; i + S::W <= V; i += S::W) S::store(w + i, attn::exp_nonpos<S>(S::sub(S::load(w + i), mv)));
#endif
  for (; i < V; ++i) w[i] = attn::exp_nonpos(w[i] - m);
  return true;
}

// A walk over a row's tokens in rank order (xs descending, id ascending) that keeps them while a cut allows:
// at most k, while the mass before a token over s is < top_p (use_p), w >= min_p. Tokens come in groups of
// known count, mass and weight bounds: a group no cut can fall in is kept (or, once a cut is passed, dropped)
// whole; a group a cut may fall in is split: an exponent bucket into 256 groups by its weights' top 8
// mantissa bits, such a group (or bucket 0 / NB-1) sorted and walked token by token.
struct Walk {
  const Row& r;
  const float* w;
  const uint8_t* bk;
  int64_t k;
  double s;
  bool use_p;
  double min_p;
  Scratch& sc;
  double before = 0.0;       // mass of the kept tokens (in the order added)
  int64_t rank = 0;          // their number
  int whole = 0;             // buckets below this one are kept whole
  std::vector<int32_t> extra;  // and these, from the buckets a cut fell in
  std::vector<int32_t> grouped;
  std::vector<std::pair<float, int32_t>> sorted;

  enum Decision { STOP, WHOLE, SPLIT };
  bool p_cut(double mass_before) const { return use_p && mass_before / s >= r.top_p; }
  Decision decide(int64_t cnt, double mass, double lo, double hi) const {
    if (rank > 0 && (rank >= k || p_cut(before) || (min_p > 0.0 && hi <= min_p))) return STOP;   // never the top token
    if (rank + cnt <= k && !p_cut(before + mass) && lo >= min_p) return WHOLE;
    return SPLIT;
  }
  // tokens[0:n] sorted into rank order and walked one by one; false once one is cut
  bool tokens(const int32_t* t, int64_t n) {
    sorted.clear();
    for (int64_t j = 0; j < n; ++j) sorted.emplace_back(r.x[t[j]] / r.temp, t[j]);
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& c) {
      return a.first > c.first || (a.first == c.first && a.second < c.second);
    });
    for (const auto& e : sorted) {
      const float wt = w[e.second];
      if (rank > 0 && (rank >= k || p_cut(before) || static_cast<double>(wt) < min_p)) return false;
      extra.push_back(e.second);
      before += wt;
      ++rank;
    }
    return true;
  }
  // bucket b split; false once a token is cut
  bool split(int b) {
    if (sc.members_of != b) {
      const uint8_t bb = static_cast<uint8_t>(b);
      sc.n_members = gather(bk, r.V, [bb](uint64_t x) { return has_zero(x ^ (ONES * bb)); },
                            [bb](uint8_t v) { return v == bb; }, sc.members.data());
      sc.members_of = b;
    }
    const int32_t* ids = sc.members.data();
    const int64_t n = sc.n_members;
    if (b == 0 || b == NB - 1) return tokens(ids, n);
    int64_t cnt[256] = {0}, at[257];
    double mass[256] = {0.0};
    auto sub = [&](int32_t t) {                     // 0 for the largest weights of the bucket
      uint32_t bits;
      std::memcpy(&bits, w + t, sizeof bits);
      return 255 - static_cast<int>((bits >> 15) & 0xFF);
    };
    for (int64_t q = 0; q < n; ++q) {
      const int32_t t = ids[q];
      const int j = sub(t);
      ++cnt[j];
      mass[j] += w[t];
    }
    at[0] = 0;
    for (int j = 0; j < 256; ++j) at[j + 1] = at[j] + cnt[j];
    grouped.resize(static_cast<size_t>(n));
    {
      int64_t next[256];
      std::copy(at, at + 256, next);
      for (int64_t q = 0; q < n; ++q) grouped[next[sub(ids[q])]++] = ids[q];
    }
    for (int j = 0; j < 256; ++j) {
      if (cnt[j] == 0) continue;
      const int m = 255 - j;
      const Decision d = decide(cnt[j], mass[j], std::ldexp(1.0 + m / 256.0, -b), std::ldexp(1.0 + (m + 1) / 256.0, -b));
      if (d == STOP) return false;
      if (d == WHOLE) {
        extra.insert(extra.end(), grouped.begin() + at[j], grouped.begin() + at[j + 1]);
        before += mass[j];
        rank += cnt[j];
      } else if (!tokens(grouped.data() + at[j], cnt[j])) {
        return false;
      }
    }
    return true;
  }
  void run(const int64_t* cnt, const double* mass) {
    for (int b = 0; b < NB; ++b) {
      if (cnt[b] == 0) continue;
      const Decision d = decide(cnt[b], mass[b], lower_of(b), upper_of(b));
      if (d == STOP) return;
      if (d == WHOLE) {
        whole = b + 1;                              // (a split bucket before it was kept whole too)
        before += mass[b];
        rank += cnt[b];
      } else if (!split(b)) {
        return;
      }
    }
  }
};

// The kept set of a filtered row from its weights w: on return bk[t] (each token's bucket, filled here) is below
// the returned bucket, or 255, for the tokens kept.
int kept_set(const Row& r, const float* w, uint8_t* bk, Scratch& sc) {
  const int64_t V = r.V;
  for (int64_t i = 0; i < V; ++i) bk[i] = bucket_of(w[i]);
  // per bucket, the count and the mass, each in four interleaved partials: no chain of dependent adds in memory
  int64_t cnts[4][NB] = {{0}};
  double part[4][NB] = {{0.0}};
  int64_t i = 0;
  for (; i + 4 <= V; i += 4)
    for (int j = 0; j < 4; ++j) {
      part[j][bk[i + j]] += w[i + j];
      ++cnts[j][bk[i + j]];
    }
  for (; i < V; ++i) {
    part[0][bk[i]] += w[i];
    ++cnts[0][bk[i]];
  }
  int64_t cnt[NB];
  double mass[NB];
  for (int b = 0; b < NB; ++b) {
    cnt[b] = (cnts[0][b] + cnts[1][b]) + (cnts[2][b] + cnts[3][b]);
    mass[b] = (part[0][b] + part[1][b]) + (part[2][b] + part[3][b]);
  }
  const bool has_k = r.k > 0 && r.k < V, has_p = r.top_p < 1.0;
  sc.members_of = -1;
  double s = 0.0;                                   // the normalizer top-p is taken against: the top k's mass
  if (has_k) {
    Walk top{r, w, bk, r.k, 1.0, false, 0.0, sc};
    top.run(cnt, mass);
    s = top.before;
  } else if (has_p) {
    for (int b = 0; b < NB; ++b) s += mass[b];
  }
  Walk walk{r, w, bk, has_k ? r.k : V, s, has_p, r.min_p, sc};
  walk.run(cnt, mass);
  for (const int32_t t : walk.extra) bk[t] = 255;
  return walk.whole;
}

// the first index whose float64 prefix sum of w[ids] exceeds u * (their total), or the last; ids ascending
// (all of [0, n) when ids is null): sequential sums, as torch's cumsum over the dense weights
int64_t draw(const float* w, const int32_t* ids, int64_t n, double u) {
  double total = 0.0;
  for (int64_t j = 0; j < n; ++j) total += w[ids ? ids[j] : j];
  const double target = u * total;
  double csum = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    csum += w[ids ? ids[j] : j];
    if (csum > target) return j;
  }
  return n - 1;
}

// x [R, V] float32 rows; temp [R] float32 (> 0); top_k [R] int64 (0 = off); top_p, min_p [R] float64; u [R] float64
// or None. Returns (tokens [R] int64 if u, weights [R, V] float32 (0 where filtered) and keep [R, V] bool if
// dense; else empty).
std::vector<torch::Tensor> sample_rows(torch::Tensor x, torch::Tensor temp, torch::Tensor top_k, torch::Tensor top_p,
                                       torch::Tensor min_p, c10::optional<torch::Tensor> u, bool dense) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "fp32 logits, rows contiguous");
  const int64_t R = x.size(0), V = x.size(1);
  TORCH_CHECK(V < (int64_t(1) << 31), "vocabulary too large");
  auto checked = [R](const torch::Tensor& t, torch::ScalarType dt, const char* what) {
    TORCH_CHECK(t.scalar_type() == dt && t.is_contiguous() && t.numel() == R, what);
    return t;
  };
  const float* T = checked(temp, torch::kFloat32, "temp: float32 [R]").data_ptr<float>();
  const int64_t* K = checked(top_k, torch::kInt64, "top_k: int64 [R]").data_ptr<int64_t>();
  const double* P = checked(top_p, torch::kFloat64, "top_p: float64 [R]").data_ptr<double>();
  const double* M = checked(min_p, torch::kFloat64, "min_p: float64 [R]").data_ptr<double>();
  const double* U = u ? checked(*u, torch::kFloat64, "u: float64 [R]").data_ptr<double>() : nullptr;
  torch::Tensor tokens = U ? torch::empty({R}, torch::kInt64) : torch::Tensor();
  torch::Tensor weights = dense ? torch::empty({R, V}, torch::kFloat32) : torch::Tensor();
  torch::Tensor keep = dense ? torch::empty({R, V}, torch::kBool) : torch::Tensor();
  const float* X = x.data_ptr<float>();
  const int64_t xstride = x.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> wbuf(dense ? 0 : V);
    std::vector<uint8_t> bk(V);
    Scratch sc(V);
    for (int64_t i = begin; i < end; ++i) {
      const Row r{X + i * xstride, V, T[i], K[i], P[i], M[i]};
      float* w = dense ? weights.data_ptr<float>() + i * V : wbuf.data();
      uint8_t* kp = dense ? reinterpret_cast<uint8_t*>(keep.data_ptr<bool>()) + i * V : nullptr;
      const bool any = weigh(r, w);
      if (!any || !r.filtered()) {                  // every token kept (all at weight 0 if all were at -inf)
        if (U) tokens.data_ptr<int64_t>()[i] = draw(w, nullptr, V, U[i]);
        if (kp) std::fill(kp, kp + V, uint8_t(1));
        continue;
      }
      const unsigned below = static_cast<unsigned>(kept_set(r, w, bk.data(), sc));   // the kept ids, ascending:
      const int32_t* ids = sc.kept.data();
      const int64_t n = gather(bk.data(), V, [below](uint64_t x) { return has_less(x, below) || has_zero(~x); },
                               [below](uint8_t v) { return v < below || v == 255; }, sc.kept.data());
      TORCH_CHECK(n > 0, "sample_rows: a filtered row kept no token");   // the top token is always kept
      if (U) tokens.data_ptr<int64_t>()[i] = ids[draw(w, ids, n, U[i])];
      if (kp) {
        std::fill(kp, kp + V, uint8_t(0));
        for (int64_t q = 0; q < n; ++q) kp[ids[q]] = 1;
        for (int64_t t = 0; t < V; ++t) w[t] = kp[t] ? w[t] : 0.f;
      }
    }
  });
  return {tokens, weights, keep};
}
