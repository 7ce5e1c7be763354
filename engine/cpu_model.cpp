// Baton's CPU kernels, built as one extension (engine/cpu_model.py), and the decoder stack that chains them.
//
// The kernels live in their own sources, included here each in a namespace of its own: the paged attention,
// rms_norm and rope ops (engine/cpu_attention.cpp), the packed-weight matmul (engine/quant_cpu.cpp), the LoRA
// products (engine/lora_cpu.cpp) and the sampler's filters and draw (engine/sampler_cpu.cpp). One
// build, one set of flags: the model's ops and its fused stack run the same machine code, so either gives the
// same bits.
//
// DecoderStack: the layers of a Llama-family model whose linears are packed for the matmul kernel, run in one call
// (Gemma's too: its norms after attention and the MLP, its GELU gate, a rope table per layer type, a sliding window and
// a score softcap per layer; Granite's residual multiplier). The Python forward (engine/model.py) spends about as long
// dispatching a layer's dozen small ops as the ops take at decode batch sizes, and holds the GIL while it does, which a
// server's event loop in the same process needs for every token it streams. Here a layer is rms_norm -> qkv matmul ->
// rope + KV store -> paged attention -> o matmul -> rms_norm (residual added) -> gate_up matmul -> silu(gate) * up
// (ATen's own ops, the same ones the Python path calls) -> down matmul: exactly the Python path's ops in its order, so
// the two give bitwise equal results (tests/test_cpu_model.py). With LoRA adapters (engine/lora.py) each linear adds
// its rows' adapter products after it, with the same kernels (engine/lora_cpu.cpp) as the modules' LoRALinear. The GIL
// is released for the whole stack.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace attn {
#include "cpu_attention.cpp"
}  // namespace attn
namespace quant {
#include "quant_cpu.cpp"
}  // namespace quant
namespace lora {
#include "lora_cpu.cpp"
}  // namespace lora
namespace samp {
#include "sampler_cpu.cpp"
}  // namespace samp

namespace {

// One linear's packed weights: one part per kind (a Q4_K_M checkpoint's Q6_K v beside its Q4_K q and k),
// their outputs side by side, then the bias if any.
struct Part { torch::Tensor packed; int64_t kind, group, n; };
struct Linear {
  std::vector<Part> parts;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const {
    torch::Tensor y;
    if (parts.size() == 1) {
      const Part& p = parts[0];
      y = quant::matmul(x, p.packed, p.kind, p.group, p.n);
    } else {
      std::vector<torch::Tensor> ys;
      for (const Part& p : parts) ys.push_back(quant::matmul(x, p.packed, p.kind, p.group, p.n));
      y = torch::cat(ys, -1);
    }
    return bias.has_value() ? y + *bias : y;
  }
};

Linear make_linear(const std::vector<std::tuple<torch::Tensor, int64_t, int64_t, int64_t>>& parts,
                   c10::optional<torch::Tensor> bias) {
  Linear l;
  for (const auto& [packed, kind, group, n] : parts) l.parts.push_back(Part{packed, kind, group, n});
  TORCH_CHECK(!l.parts.empty(), "a linear needs at least one packed part");
  l.bias = std::move(bias);
  return l;
}

// One linear's adapter slots (engine/lora.py's LoRALinear, its tensors shared: loading an adapter into a slot
// writes here): A [slots, parts * R, K] and one transposed B per part [slots, R, N_i].
struct LoRA {
  torch::Tensor a;
  std::vector<torch::Tensor> bt;
};

// The step's rows under an adapter, sorted by slot, and their slots (engine/lora_ops.py's LoRAPlan).
struct LoRARows {
  torch::Tensor rows, slots;
};

struct Layer {
  torch::Tensor in_norm, post_norm;                // post_norm: the norm before the MLP (its residual add fused)
  Linear qkv, o, gate_up, down;
  c10::optional<torch::Tensor> q_norm, k_norm;     // Qwen3's and Gemma 3's: one RMSNorm over head_dim for q and k
  int64_t window = 0;                              // a sliding window's tokens (Mistral, Gemma 2/3), 0: none
  double softcap = 0.0;                            // Gemma 2's score softcap, 0: none
  c10::optional<torch::Tensor> attn_out_norm, mlp_out_norm;   // Gemma 2/3's norms of attention's and the MLP's output
  bool gelu = false;                               // Gemma's gate: GELU (tanh), else SiLU
  int64_t rope = 0;                                // which of forward's cos/sin tables (Gemma 3: sliding, full)
  double residual_mult = 1.0;                      // Granite: attention's and the MLP's outputs scaled before the add
  std::vector<c10::optional<LoRA>> lora = std::vector<c10::optional<LoRA>>(4);   // qkv, o, gate_up, down
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate, double eps,
               double scale)
      : H_(num_heads), G_(num_kv_heads), D_(head_dim), I_(intermediate), eps_(eps), scale_(scale) {}

  using Parts = std::vector<std::tuple<torch::Tensor, int64_t, int64_t, int64_t>>;
  void add_layer(torch::Tensor in_norm, torch::Tensor post_norm, const Parts& qkv, c10::optional<torch::Tensor> qkv_bias,
                 const Parts& o, c10::optional<torch::Tensor> o_bias, const Parts& gate_up,
                 c10::optional<torch::Tensor> gate_up_bias, const Parts& down, c10::optional<torch::Tensor> down_bias,
                 c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, int64_t window,
                 double softcap, c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> mlp_out_norm,
                 bool gelu, int64_t rope, double residual_mult) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "add_layer: q_norm and k_norm come together");
    TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(), "add_layer: output norms come together");
    TORCH_CHECK(rope >= 0, "add_layer: a rope table index");
    layers_.push_back(Layer{in_norm.contiguous(), post_norm.contiguous(), make_linear(qkv, qkv_bias),
                            make_linear(o, o_bias), make_linear(gate_up, gate_up_bias), make_linear(down, down_bias),
                            q_norm, k_norm});
    Layer& l = layers_.back();
    l.window = window, l.softcap = softcap, l.attn_out_norm = attn_out_norm, l.mlp_out_norm = mlp_out_norm;
    l.gelu = gelu, l.rope = rope, l.residual_mult = residual_mult;
  }

  // The adapter slots of one of layer i's linears (which: 0 qkv, 1 o, 2 gate_up, 3 down).
  void set_lora(int64_t i, int64_t which, torch::Tensor a, std::vector<torch::Tensor> bt) {
    TORCH_CHECK(i >= 0 && i < num_layers() && which >= 0 && which < 4, "set_lora: no such linear");
    TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && !bt.empty() && a.size(1) % static_cast<int64_t>(bt.size()) == 0,
                "set_lora: A [slots, parts * R, K], one B per part");
    layers_[i].lora[which] = LoRA{std::move(a), std::move(bt)};
  }

  // Each layer's K and V cache views, and for an int8 cache its scales (engine/kv_layout.py's LayerKV), kept
  // until the next call: they change only when the engine allocates its cache.
  void set_kv(std::vector<torch::Tensor> k, std::vector<torch::Tensor> v,
              std::vector<c10::optional<torch::Tensor>> k_scale, std::vector<c10::optional<torch::Tensor>> v_scale) {
    TORCH_CHECK(k.size() == layers_.size() && v.size() == k.size() && k_scale.size() == k.size() &&
                v_scale.size() == k.size(), "one K, V (and scale) view per layer");
    k_ = std::move(k), v_ = std::move(v), ks_ = std::move(k_scale), vs_ = std::move(v_scale);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [T, hidden]: the embeddings. Runs the first `num_layers` layers (all: -1) and returns (the last layer's
  // output, the residual stream), which the caller adds before the final norm, as engine/model.py does.
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x, const std::vector<torch::Tensor>& cos,
                                                   const std::vector<torch::Tensor>& sin,
                                                   const torch::Tensor& slot_mapping, const torch::Tensor& block_tables,
                                                   const torch::Tensor& seq_lens, const torch::Tensor& query_start_loc,
                                                   int64_t num_layers, const c10::optional<torch::Tensor>& lora_rows,
                                                   const c10::optional<torch::Tensor>& lora_slots,
                                                   const std::vector<int64_t>& aux_layers,
                                                   const c10::optional<torch::Tensor>& aux_out) const {
    const int64_t L = num_layers < 0 ? this->num_layers() : std::min(num_layers, this->num_layers());
    TORCH_CHECK(static_cast<int64_t>(k_.size()) == this->num_layers(), "set_kv before forward");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x: fp32 [T, hidden]");
    TORCH_CHECK(cos.size() == sin.size(), "one sin table per cos table");
    for (int64_t i = 0; i < L; ++i)
      TORCH_CHECK(layers_[i].rope < static_cast<int64_t>(cos.size()), "layer ", i, ": no rope table ",
                  layers_[i].rope);
    const int64_t T = x.size(0);
    x = x.contiguous();
    // rows under an adapter in this step (none: every row on the base model)
    c10::optional<LoRARows> ad;
    if (lora_rows.has_value() && lora_rows->numel() > 0) {
      TORCH_CHECK(lora_slots.has_value() && lora_slots->numel() == lora_rows->numel(), "one slot per LoRA row");
      ad = LoRARows{*lora_rows, *lora_slots};
    }
    // the linear, then its adapters' products where the step has some (the modules' LoRALinear, in its order)
    auto linear = [&](const Layer& l, int which, const Linear& lin, const torch::Tensor& in) {
      torch::Tensor y = lin(in);
      if (ad.has_value() && l.lora[which].has_value())
        lora::apply(in, l.lora[which]->a, l.lora[which]->bt, ad->rows, ad->slots, y);
      return y;
    };
    // an EAGLE-3 head's streams: the residual stream entering each of aux_layers, side by side in aux_out [T, n x hidden]
    if (!aux_layers.empty())
      TORCH_CHECK(aux_out.has_value() && aux_out->size(0) == T &&
                  aux_out->size(1) == static_cast<int64_t>(aux_layers.size()) * x.size(1), "aux_out: [T, n x hidden]");
    torch::Tensor residual;
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      for (size_t j = 0; j < aux_layers.size(); ++j)
        if (aux_layers[j] == i) {
          torch::Tensor dst = aux_out->narrow(1, static_cast<int64_t>(j) * x.size(1), x.size(1));
          if (i == 0) dst.copy_(x); else at::add_out(dst, x, residual);
        }
      torch::Tensor h;
      if (i == 0) {
        residual = x;
        h = attn::rms_norm(x, l.in_norm, eps_, c10::nullopt);
      } else {
        h = attn::rms_norm(x, l.in_norm, eps_, residual);
      }
      torch::Tensor qkv = linear(l, 0, l.qkv, h);
      if (l.q_norm.has_value()) {     // each head's q and k over head_dim first (engine/model.py Attention._qk_norm)
        torch::Tensor q = attn::rms_norm(qkv.narrow(1, 0, H_ * D_).reshape({T * H_, D_}), *l.q_norm, eps_,
                                         c10::nullopt);
        torch::Tensor k = attn::rms_norm(qkv.narrow(1, H_ * D_, G_ * D_).reshape({T * G_, D_}), *l.k_norm, eps_,
                                         c10::nullopt);
        qkv = at::cat({q.view({T, H_ * D_}), k.view({T, G_ * D_}), qkv.narrow(1, (H_ + G_) * D_, G_ * D_)}, 1);
      }
      attn::rope_write_kv(qkv, cos[l.rope], sin[l.rope], k_[i], v_[i], slot_mapping, H_, G_, ks_[i], vs_[i]);
      torch::Tensor q = qkv.narrow(1, 0, H_ * D_).view({T, H_, D_});
      torch::Tensor o = attn::paged_attention_varlen(q, k_[i], v_[i], block_tables, seq_lens, query_start_loc,
                                                     scale_, ks_[i], vs_[i], l.window, l.softcap, c10::nullopt, 0);
      o = linear(l, 1, l.o, o.reshape({T, H_ * D_}));
      if (l.attn_out_norm.has_value()) o = attn::rms_norm(o, *l.attn_out_norm, eps_, c10::nullopt);
      if (l.residual_mult != 1.0) o = o * l.residual_mult;
      h = attn::rms_norm(o, l.post_norm, eps_, residual);
      torch::Tensor gu = linear(l, 2, l.gate_up, h);
      torch::Tensor gate = gu.narrow(1, 0, I_);
      torch::Tensor act = (l.gelu ? at::gelu(gate, "tanh") : at::silu(gate)) * gu.narrow(1, I_, I_);
      x = linear(l, 3, l.down, act);
      if (l.mlp_out_norm.has_value()) x = attn::rms_norm(x, *l.mlp_out_norm, eps_, c10::nullopt);
      if (l.residual_mult != 1.0) x = x * l.residual_mult;
    }
    return {x, residual.defined() ? residual : x};
  }

 private:
  int64_t H_, G_, D_, I_;
  double eps_, scale_;
  std::vector<Layer> layers_;
  std::vector<torch::Tensor> k_, v_;
  std::vector<c10::optional<torch::Tensor>> ks_, vs_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // the kernels (engine/cpu_attention.py, engine/quant_kernels.py); each releases the GIL while it runs, like
  // torch's own ops, so a server's asyncio thread runs beside the forward
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("apply_token_bitmask", &attn::apply_token_bitmask, "grammar masks: -inf where a token's bit is 0", nogil);
  m.def("paged_attention_varlen", &attn::paged_attention_varlen, "queries of any length over the paged cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc"), py::arg("scale"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("sinks") = py::none(), py::arg("chunk") = 0, nogil);
  m.def("paged_decode", &attn::paged_decode, "one query token per sequence over the paged cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("window") = 0,
        py::arg("softcap") = 0.0, py::arg("sinks") = py::none(), py::arg("chunk") = 0, nogil);
  m.def("rms_norm", &attn::rms_norm, "RMSNorm of rows, with an optional residual added first (in place)",
        py::arg("x"), py::arg("w"), py::arg("eps"), py::arg("residual") = py::none(), nogil);
  m.def("rope_write_kv", &attn::rope_write_kv, "rotate q and k in place, store k and v at their cache slots",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("slot_mapping"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), nogil);
  m.def("matmul", &quant::matmul, "y [M, N] = x [M, K] @ W.T for packed q8 / q4 / f8 weights", nogil);
  m.def("f8_matmul_portable", [](torch::Tensor x, torch::Tensor packed, int64_t n) {
    return quant::f8_matmul(x, packed, n, true); }, "the fp8 matmul's plain loops (CPUs without AVX-512)", nogil);
  m.def("lora_shrink", &lora::shrink, "t [G, R] = per-row adapter A @ x[rows]", nogil);
  m.def("lora_expand", &lora::expand, "y[rows, c0:c0+N] += t[:, r0:r0+R] @ per-row adapter B part", nogil);
  m.def("lora_apply", &lora::apply, "y[rows] += per-row adapter B parts @ (A @ x[rows]), in place", nogil);
  m.def("sample_rows", &samp::sample_rows, "temperature, top-k, top-p, min-p and the inverse-CDF draw per row",
        py::arg("x"), py::arg("temp"), py::arg("top_k"), py::arg("top_p"), py::arg("min_p"), py::arg("u"),
        py::arg("dense"), nogil);
  m.def("isa", [] {
#if defined(__AVX512VNNI__)
    return "avx512vnni";
#elif defined(__AVX2__)
    return "avx2";
#else
    return "scalar";
#endif
  });
  py::class_<DecoderStack>(m, "DecoderStack")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, double>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("intermediate"), py::arg("eps"), py::arg("scale"))
      .def("add_layer", &DecoderStack::add_layer)
      .def("set_kv", &DecoderStack::set_kv)
      .def("set_lora", &DecoderStack::set_lora, py::arg("layer"), py::arg("which"), py::arg("a"), py::arg("bt"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start_loc"), py::arg("num_layers") = -1,
           py::arg("lora_rows") = py::none(), py::arg("lora_slots") = py::none(),
           py::arg("aux_layers") = std::vector<int64_t>(), py::arg("aux_out") = py::none(), nogil);
}
