// Batched LoRA products on CPU (engine/lora_ops.py): the rows of one step, each under its own adapter slot.
//
//   shrink: t[i, r]            = sum_k x[rows[i], k] * a[slots[i], r, k]
//   expand: y[rows[i], c0 + n] += sum_r t[i, r0 + r] * bt[slots[i], r, n]     (bt: one part's B, transposed)
//
// Every output element is computed by one thread in one fixed order (16 lanes over k, then the lanes in
// order; r in order), and compiled with -ffp-contract=off, so a row's result is bitwise the same whichever
// rows share the call and however many threads run it: LoRA keeps the packed kernels' batch invariance.
#include <torch/extension.h>

#include <algorithm>

namespace {

constexpr int64_t LANES = 16;
constexpr int64_t COLS = 64;      // output columns per expand task

float dot(const float* x, const float* a, int64_t k) {
  float lanes[LANES] = {0};
  int64_t i = 0;
  for (; i + LANES <= k; i += LANES) {
#pragma omp simd
    for (int64_t j = 0; j < LANES; j++) lanes[j] += x[i + j] * a[i + j];
  }
  for (int64_t j = 0; i < k; i++, j++) lanes[j] += x[i] * a[i];
  float s = 0.f;
  for (int64_t j = 0; j < LANES; j++) s += lanes[j];
  return s;
}

}  // namespace

torch::Tensor shrink(torch::Tensor x, torch::Tensor a, torch::Tensor rows, torch::Tensor slots) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && a.dtype() == torch::kFloat32, "shrink: fp32 only");
  TORCH_CHECK(x.is_contiguous() && a.is_contiguous(), "shrink: contiguous x and a");
  const int64_t g = rows.size(0), r = a.size(1), k = a.size(2);
  TORCH_CHECK(x.size(1) == k, "shrink: x and a disagree on K");
  auto t = torch::empty({g, r}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* ap = a.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* tp = t.data_ptr<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < g; i++)
    for (int64_t j = 0; j < r; j++) tp[i * r + j] = dot(xp + rp[i] * k, ap + (sp[i] * r + j) * k, k);
  return t;
}

void expand(torch::Tensor t, int64_t r0, torch::Tensor bt, torch::Tensor rows, torch::Tensor slots, torch::Tensor y,
            int64_t c0) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && bt.dtype() == torch::kFloat32 && y.dtype() == torch::kFloat32,
              "expand: fp32 only");
  TORCH_CHECK(t.is_contiguous() && bt.is_contiguous() && y.stride(1) == 1, "expand: contiguous rows");
  const int64_t g = rows.size(0), rp_ = bt.size(1), np_ = bt.size(2), rt = t.size(1), ys = y.stride(0);
  TORCH_CHECK(r0 + rp_ <= rt && c0 + np_ <= y.size(1), "expand: part out of range");
  const float* tp = t.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (np_ + COLS - 1) / COLS;
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t i = 0; i < g; i++)
    for (int64_t nb = 0; nb < blocks; nb++) {
      const int64_t n0 = nb * COLS, len = std::min(COLS, np_ - n0);
      float acc[COLS] = {0};
      const float* ti = tp + i * rt + r0;
      const float* bs = bp + sp[i] * rp_ * np_ + n0;
      for (int64_t r = 0; r < rp_; r++) {
        const float tv = ti[r];
        const float* br = bs + r * np_;
#pragma omp simd
        for (int64_t j = 0; j < len; j++) acc[j] += tv * br[j];
      }
      float* yr = yp + rp[i] * ys + c0 + n0;
#pragma omp simd
      for (int64_t j = 0; j < len; j++) yr[j] += acc[j];
    }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shrink", &shrink, "t [G, R] = per-row adapter A @ x[rows]", py::call_guard<py::gil_scoped_release>());
  m.def("expand", &expand, "y[rows, c0:c0+N] += t[:, r0:r0+R] @ per-row adapter B part",
        py::call_guard<py::gil_scoped_release>());
}
