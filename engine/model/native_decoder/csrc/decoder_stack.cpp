// The decoder layers of a Llama-family model in one C++ call: the CPU counterpart of a captured
// step. Each layer runs the same ATen operators, on the same shapes, as the Hugging Face modules
// the engine runs eagerly (with the engine's packed linear layers and paged-attention kernel), so
// the result is bitwise the eager path's; what goes is the Python interpreter between them
// (module calls, ~60 small operators per layer, each dispatched from Python).
//
// Fused kernels replace chains of element-wise operators: rotary embedding (q * cos,
// rotate_half(q) * sin, their sum), the residual add + RMSNorm around ATen's own mean, and the
// MLP's silu(gate) * up. Each computes every element as the eager operators do, each operation
// rounded to the tensor's dtype, so they too are bitwise the eager result. That needs no
// contraction of a * b + c into a fused multiply-add: this file is compiled with -ffp-contract=off.
// Measurements behind these choices: ops/bench/README.md (its per-machine sections and "Figures
// behind the kernels' comments").

// at::vec at the width this file is compiled for (-march=native), in a private namespace so its
// inline functions are never confused with libtorch's own copies. (The attention kernel's source
// has the same block: each extension is one self-contained file, the unit engine/kernels/cpp_build.py
// hashes to decide a rebuild, so they share no header.)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY tokenmill_native_avx512
#define TOKENMILL_VEC_CAPABILITY "AVX512"
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY tokenmill_native_avx2
#define TOKENMILL_VEC_CAPABILITY "AVX2"
#else
#define CPU_CAPABILITY tokenmill_native_default
#define TOKENMILL_VEC_CAPABILITY "DEFAULT"
#endif

#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// Rows per task of a parallel loop over rows of `row_elements`: as ATen's element-wise operators
// split work (at::internal::GRAIN_SIZE elements), so a small batch stays on the calling thread.
int64_t row_grain(int64_t row_elements) { return std::max<int64_t>(1, at::internal::GRAIN_SIZE / row_elements); }

// f(begin', end') over [begin, end) on torch's intra-op threads (through its stable C shim). Not
// at::parallel_for: its parallel path is inline OpenMP code, which this file (no -fopenmp) compiles
// away, so every loop here ran on the calling thread while the other thread waited. f must not
// throw.
template <typename F>
void parallel_rows(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const auto call = [](int64_t b, int64_t e, void* context) { (*static_cast<const F*>(context))(b, e); };
  const AOTITorchError status =
      torch_parallel_for(begin, end, grain, call, const_cast<void*>(static_cast<const void*>(&f)));
  TORCH_CHECK(status == AOTI_TORCH_SUCCESS, "decoder stack: torch_parallel_for failed");
}

// mkldnn::_linear_pointwise: oneDNN matmul with a weight packed by mkldnn::_reorder_linear_weight.
Tensor packed_linear(const Tensor& x, const Tensor& packed_weight, const OptTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, std::string_view,
                                     c10::List<std::optional<at::Scalar>>, std::optional<std::string_view>)>();
  return op.call(x, packed_weight, bias, "none", c10::List<std::optional<at::Scalar>>(),
                 std::optional<std::string_view>(""));
}

// tokenmill_panel::linear: engine/kernels/panel_linear's kernel (float32 and bfloat16 on CPUs without AVX-512).
Tensor panel_linear(const Tensor& x, const Tensor& packed_weight, const OptTensor& bias, int64_t out_features) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tokenmill_panel::linear", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const OptTensor&, int64_t)>();
  return op.call(x, packed_weight, bias, out_features);
}

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tokenmill::reshape_and_cache", "")
                       .typed<void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&)>();
  op.call(key, value, key_cache, value_cache, slot_mapping);
}

Tensor paged_attention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache,
                       const Tensor& block_tables, const Tensor& seq_lens, const Tensor& query_start_loc,
                       double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("tokenmill::paged_attention", "")
                       .typed<Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, double)>();
  return op.call(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale);
}

// The fused loops below run bfloat16 and float16 vectorised (the RMSNorm's and the rotary's scalar
// conversions were a visible share of a bfloat16 decode step at large batches), with the same
// roundings; the scalar loops finish each range.
template <typename T>
constexpr bool kReduced = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

// float32 vectors (a, b) rounded to T, as the eager operator's result, and widened back.
template <typename T>
std::tuple<at::vec::Vectorized<float>, at::vec::Vectorized<float>> rounded(at::vec::Vectorized<float> a,
                                                                         at::vec::Vectorized<float> b) {
  return at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
}

// Hugging Face's LlamaRMSNorm, optionally of (residual + delta), the residual add before it:
//   h = residual + delta                    (rounded to T)
//   variance = float(h).pow(2).mean(-1)     (the mean is ATen's own reduction)
//   out = weight * T(float(h) * rsqrt(variance + eps))
// Element-wise steps are fused and round as the eager operators do; the sum inside the mean stays
// ATen's, whose order a hand-written loop would not reproduce. Returns {h, out}.
template <typename T>
void add_and_square(const Tensor& residual, const OptTensor& delta, Tensor& h, Tensor& squares) {
  using acc = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<T>;
  using FVec = at::vec::Vectorized<float>;
  const int64_t rows = residual.size(0), dim = residual.size(1);
  const T* rp = residual.const_data_ptr<T>();
  const T* dp = delta ? delta->const_data_ptr<T>() : nullptr;
  T* hp = h.mutable_data_ptr<T>();
  float* sp = squares.mutable_data_ptr<float>();
  parallel_rows(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    int64_t i = begin * dim;
    if constexpr (kReduced<T>) {
      for (; i + Vec::size() <= end * dim; i += Vec::size()) {
        auto [x0, x1] = at::vec::convert_to_float<T>(Vec::loadu(rp + i));
        if (dp) {
          auto [d0, d1] = at::vec::convert_to_float<T>(Vec::loadu(dp + i));
          const Vec value = at::vec::convert_from_float<T>(x0 + d0, x1 + d1);
          value.store(hp + i);
          std::tie(x0, x1) = at::vec::convert_to_float<T>(value);
        }
        (x0 * x0).store(sp + i);
        (x1 * x1).store(sp + i + FVec::size());
      }
    }
    for (; i < end * dim; ++i) {
      const T value = dp ? static_cast<T>(static_cast<acc>(rp[i]) + static_cast<acc>(dp[i])) : rp[i];
      if (dp) hp[i] = value;
      const float x = static_cast<float>(value);
      sp[i] = x * x;
    }
  });
}

template <typename T>
void scale_rows(const Tensor& h, const Tensor& variance, const Tensor& weight, float eps, Tensor& out) {
  using Vec = at::vec::Vectorized<T>;
  const int64_t rows = h.size(0), dim = h.size(1);
  const T* hp = h.const_data_ptr<T>();
  const float* vp = variance.const_data_ptr<float>();
  const T* wp = weight.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  parallel_rows(0, rows, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float inv = 1.0f / std::sqrt(vp[r] + eps);  // ATen's rsqrt: a rounded sqrt, then a rounded division
      const T* row = hp + r * dim;
      T* o = op + r * dim;
      int64_t i = 0;
      if constexpr (kReduced<T>) {
        const at::vec::Vectorized<float> scale(inv);
        for (; i + Vec::size() <= dim; i += Vec::size()) {
          auto [h0, h1] = at::vec::convert_to_float<T>(Vec::loadu(row + i));
          auto [n0, n1] = rounded<T>(h0 * scale, h1 * scale);
          auto [w0, w1] = at::vec::convert_to_float<T>(Vec::loadu(wp + i));
          at::vec::convert_from_float<T>(w0 * n0, w1 * n1).store(o + i);
        }
      }
      for (; i < dim; ++i) {
        const T normed = static_cast<T>(static_cast<float>(row[i]) * inv);
        o[i] = static_cast<T>(static_cast<float>(wp[i]) * static_cast<float>(normed));
      }
    }
  });
}

std::pair<Tensor, Tensor> add_rms_norm(const Tensor& residual, const OptTensor& delta,
                                       const Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() && (!delta || delta->is_contiguous()) &&
                  weight.is_contiguous() && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: unexpected layout or dtype");
  Tensor h = delta ? at::empty_like(residual) : residual;
  Tensor squares = at::empty(residual.sizes(), residual.options().dtype(at::kFloat));
  Tensor out = at::empty_like(residual);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_and_square",
                                  [&] { add_and_square<scalar_t>(residual, delta, h, squares); });
  Tensor variance = squares.mean(-1);
  // eps is a Python float: ATen adds it to a float32 tensor as float32.
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "scale_rows",
                                  [&] { scale_rows<scalar_t>(h, variance, weight, static_cast<float>(eps), out); });
  return {h, out};
}

// out[t, h, :] = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). Each operator of
// the eager expression rounds to T; so does each step here.
template <typename T>
void rotate_rows(const Tensor& x, const Tensor& cos, const Tensor& sin, Tensor& out) {
  using acc = at::opmath_type<T>;
  using Vec = at::vec::Vectorized<T>;
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1);
  const T* xp = x.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  // a * c + b * s, each product and the sum rounded to T.
  const auto rotate = [](Vec a, Vec b, Vec c, Vec s) -> Vec {
    if constexpr (std::is_same_v<T, acc>) {
      return a * c + b * s;  // two roundings and a third: no contraction (-ffp-contract=off)
    } else {
      auto [a0, a1] = at::vec::convert_to_float<T>(a);
      auto [b0, b1] = at::vec::convert_to_float<T>(b);
      auto [c0, c1] = at::vec::convert_to_float<T>(c);
      auto [s0, s1] = at::vec::convert_to_float<T>(s);
      auto [p0, p1] = rounded<T>(a0 * c0, a1 * c1);
      auto [q0, q1] = rounded<T>(b0 * s0, b1 * s1);
      return at::vec::convert_from_float<T>(p0 + q0, p1 + q1);
    }
  };
  auto mul = [](T a, T b) { return static_cast<T>(static_cast<acc>(a) * static_cast<acc>(b)); };
  auto add = [](T a, T b) { return static_cast<T>(static_cast<acc>(a) + static_cast<acc>(b)); };
  parallel_rows(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cp + t * dim;
      const T* s = sp + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = xp + t * xs0 + h * xs1;
        T* o = op + (t * heads + h) * dim;
        int64_t i = 0;
        for (; i + Vec::size() <= half; i += Vec::size()) {
          const Vec x1 = Vec::loadu(row + i), x2 = Vec::loadu(row + half + i);
          rotate(x1, x2.neg(), Vec::loadu(c + i), Vec::loadu(s + i)).store(o + i);
          rotate(x2, x1, Vec::loadu(c + half + i), Vec::loadu(s + half + i)).store(o + half + i);
        }
        for (; i < half; ++i) {
          const T neg_x2 = static_cast<T>(-static_cast<acc>(row[i + half]));
          o[i] = add(mul(row[i], c[i]), mul(neg_x2, s[i]));
          o[i + half] = add(mul(row[i + half], c[i + half]), mul(row[i], s[i + half]));
        }
      }
    }
  });
}

// x: [T, heads, dim] (dim contiguous); cos, sin: [T, dim] contiguous. Returns [T, heads, dim].
Tensor rotary(const Tensor& x, const Tensor& cos, const Tensor& sin) {
  TORCH_CHECK(x.stride(2) == 1 && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == x.size(2) &&
                  sin.size(1) == x.size(2),
              "rotary: unexpected layout (the rotary tables must span the whole head)");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "rotary: cos/sin dtype differs from the input's");
  Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rotary",
                                  [&] { rotate_rows<scalar_t>(x, cos, sin, out); });
  return out;
}

// Hugging Face's SiLU-gated MLP middle, act_fn(gate) * up, in one pass over gate_up = [gate | up]:
// each element as ATen's silu and mul kernels compute it when ATen runs at this file's vector
// width (the caller checks): the same at::vec exp (Sleef's), the same conversions, the silu
// rounded to T before the product, and the scalar formula for the tail past the last pair of
// vectors, as ATen's vectorised loop leaves it.
template <typename T>
void silu_mul_rows(const Tensor& gate_up, int64_t width, Tensor& out) {
  using Vec = at::vec::Vectorized<T>;
  using FVec = at::vec::Vectorized<float>;
  constexpr int64_t kStep = 2 * Vec::size();
  const int64_t rows = gate_up.size(0), ld = gate_up.stride(0);
  const T* in = gate_up.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  parallel_rows(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = in + r * ld;
      const T* up = gate + width;
      T* o = op + r * width;
      int64_t i = 0;
      for (; i + kStep <= width; i += kStep) {
        for (int64_t v = 0; v < kStep; v += Vec::size()) {
          const Vec g = Vec::loadu(gate + i + v), u = Vec::loadu(up + i + v);
          if constexpr (std::is_same_v<T, float>) {
            ((g / (Vec(1.0f) + g.neg().exp())) * u).store(o + i + v);
          } else {
            auto [g0, g1] = at::vec::convert_to_float<T>(g);
            const Vec silu = at::vec::convert_from_float<T>(g0 / (FVec(1.0f) + g0.neg().exp()),
                                                            g1 / (FVec(1.0f) + g1.neg().exp()));
            auto [s0, s1] = at::vec::convert_to_float<T>(silu);
            auto [u0, u1] = at::vec::convert_to_float<T>(u);
            at::vec::convert_from_float<T>(s0 * u0, s1 * u1).store(o + i + v);
          }
        }
      }
      for (; i < width; ++i) {
        const float x = static_cast<float>(gate[i]);
        const T silu = static_cast<T>(x / (1.0f + std::exp(-x)));
        o[i] = static_cast<T>(static_cast<float>(silu) * static_cast<float>(up[i]));
      }
    }
  });
}

// gate_up: [T, 2 * width] with contiguous rows. Returns silu(gate) * up, [T, width].
Tensor silu_and_mul(const Tensor& gate_up, int64_t width) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * width,
              "silu_and_mul: gate_up must be [tokens, 2 * intermediate] with contiguous rows");
  Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows<float>(gate_up, width, out);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul: float32 or bfloat16 only");
    silu_mul_rows<c10::BFloat16>(gate_up, width, out);
  }
  return out;
}

// logits.max(dim=-1).indices of one row: the first index of its maximum, a NaN counting as the
// maximum (the first NaN). Two passes: the maximum (vectorised, NaN-propagating), then the first
// position equal to it (vectorised 2 x Vec::size() at a time; the row is in cache by then).
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  using Vec = at::vec::Vectorized<T>;
  using FVec = at::vec::Vectorized<float>;
  const auto load = [](const T* p) -> std::pair<FVec, FVec> {
    if constexpr (std::is_same_v<T, float>) {
      return {FVec::loadu(p), FVec::loadu(p + FVec::size())};
    } else {
      auto [lo, hi] = at::vec::convert_to_float<T>(Vec::loadu(p));
      return {lo, hi};
    }
  };
  constexpr int64_t kStep = 2 * FVec::size();
  const auto bigger = [](float a, float b) { return std::isnan(a) || std::isnan(b) ? a + b : std::max(a, b); };
  float best = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kStep) {
    FVec acc(best);
    for (; i + kStep <= n; i += kStep) {
      auto [lo, hi] = load(x + i);
      acc = at::vec::maximum(acc, at::vec::maximum(lo, hi));
    }
    best = at::vec::vec_reduce_all<float>([](FVec a, FVec b) { return at::vec::maximum(a, b); }, acc);
  }
  for (; i < n; ++i) best = bigger(best, static_cast<float>(x[i]));
  const bool nan = std::isnan(best);
  const auto matches = [&](float v) { return nan ? std::isnan(v) : v == best; };
  i = 0;
  if (!nan) {
    const FVec target(best);
    const int none_equal = (1 << FVec::size()) - 1;  // zero_mask: a bit per lane that compared unequal
    for (; i + kStep <= n; i += kStep) {
      auto [lo, hi] = load(x + i);
      if ((lo == target).zero_mask() != none_equal || (hi == target).zero_mask() != none_equal) break;
    }
  }
  for (; i < n; ++i)
    if (matches(static_cast<float>(x[i]))) return i;
  return 0;  // unreachable: some element equals the maximum
}

// logits: [rows, vocab] float32 or bfloat16 with contiguous rows. Returns int64 [rows], as
// logits.max(dim=-1).indices (the engine's greedy choice).
Tensor greedy_token_ids(const Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0,
              "greedy_token_ids: logits must be [rows, vocab] with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1), ld = logits.stride(0);
  Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* op = out.mutable_data_ptr<int64_t>();
  const auto run = [&](auto* data) {
    parallel_rows(0, rows, row_grain(vocab), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) op[r] = row_argmax(data + r * ld, vocab);
    });
  };
  if (logits.scalar_type() == at::kFloat) {
    run(logits.const_data_ptr<float>());
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kBFloat16, "greedy_token_ids: float32 or bfloat16 logits only");
    run(logits.const_data_ptr<c10::BFloat16>());
  }
  return out;
}

struct Layer {
  Tensor input_norm;
  double input_eps;
  Tensor qkv_weight;  // packed; rows: q, then k, then v
  OptTensor qkv_bias;
  Tensor o_weight;  // packed
  OptTensor o_bias;
  Tensor post_norm;
  double post_eps;
  Tensor gate_up_weight;  // packed; rows: gate, then up
  OptTensor gate_up_bias;
  Tensor down_weight;  // packed
  OptTensor down_bias;
  Tensor key_cache;  // [num_blocks, block_size, kv_heads, head_dim]
  Tensor value_cache;
};

// A stack of Llama-family decoder layers: RMSNorm, q/k/v + rotary, paged attention, o-projection,
// residual, RMSNorm, SiLU-gated MLP, residual.
struct DecoderStack : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads, head_dim, intermediate_size;
  double scale;
  bool fused_mlp;  // silu(gate) * up by silu_and_mul (bitwise ATen's only at ATen's vector width)
  bool panel_linears;  // weights packed for tokenmill_panel::linear, else for oneDNN
  std::vector<Layer> layers;

  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t intermediate_size, double scale,
               bool fused_mlp, bool panel_linears)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim),
        intermediate_size(intermediate_size), scale(scale), fused_mlp(fused_mlp), panel_linears(panel_linears) {}

  Tensor linear(const Tensor& x, const Tensor& packed_weight, const OptTensor& bias, int64_t out_features) const {
    return panel_linears ? panel_linear(x, packed_weight, bias, out_features) : packed_linear(x, packed_weight, bias);
  }

  void add_layer(Tensor input_norm, double input_eps, Tensor qkv_weight, OptTensor qkv_bias, Tensor o_weight,
                 OptTensor o_bias, Tensor post_norm, double post_eps, Tensor gate_up_weight, OptTensor gate_up_bias,
                 Tensor down_weight, OptTensor down_bias, Tensor key_cache, Tensor value_cache) {
    layers.push_back(Layer{std::move(input_norm), input_eps, std::move(qkv_weight), std::move(qkv_bias),
                           std::move(o_weight), std::move(o_bias), std::move(post_norm), post_eps,
                           std::move(gate_up_weight), std::move(gate_up_bias), std::move(down_weight),
                           std::move(down_bias), std::move(key_cache), std::move(value_cache)});
  }

  // One layer's attention block. hidden: the residual stream, [T, hidden]; delta: the previous MLP block's
  // output, not yet added to it (none before the first layer); cos, sin: [T, head_dim]; the rest is the
  // step's paged attention metadata. Returns (the residual stream with delta added, the o-projection's
  // output). With tensor parallelism that output is this rank's partial sum: the caller all-reduces it.
  std::tuple<Tensor, Tensor> attention_block(int64_t index, Tensor hidden, OptTensor delta, const Tensor& cos,
                                             const Tensor& sin, const Tensor& slot_mapping,
                                             const Tensor& block_tables, const Tensor& seq_lens,
                                             const Tensor& query_start_loc) {
    c10::InferenceMode guard;
    Layer& layer = layers.at(index);
    const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
    const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
    auto [added, x] = add_rms_norm(hidden, delta, layer.input_norm, layer.input_eps);
    Tensor qkv = linear(x, layer.qkv_weight, layer.qkv_bias, q_width + 2 * kv_width);
    Tensor q = qkv.narrow(1, 0, q_width).view({tokens, num_heads, head_dim});
    Tensor k = qkv.narrow(1, q_width, kv_width).view({tokens, num_kv_heads, head_dim});
    Tensor v = qkv.narrow(1, q_width + kv_width, kv_width).view({tokens, num_kv_heads, head_dim});
    q = rotary(q, cos, sin);
    k = rotary(k, cos, sin);
    reshape_and_cache(k, v, layer.key_cache, layer.value_cache, slot_mapping);
    Tensor attn = paged_attention(q, layer.key_cache, layer.value_cache, block_tables, seq_lens, query_start_loc,
                                  scale);
    Tensor o = linear(attn.view({tokens, q_width}), layer.o_weight, layer.o_bias, hidden_size);
    return {added, o};
  }

  // One layer's MLP block: (hidden + o, the MLP's output, not yet added to it). With tensor parallelism o is
  // the all-reduced attention output and the MLP's output is this rank's partial sum, for the caller to
  // all-reduce.
  std::tuple<Tensor, Tensor> mlp_block(int64_t index, const Tensor& hidden, const Tensor& o) {
    c10::InferenceMode guard;
    Layer& layer = layers.at(index);
    auto [added, x] = add_rms_norm(hidden, o, layer.post_norm, layer.post_eps);
    Tensor gate_up = linear(x, layer.gate_up_weight, layer.gate_up_bias, 2 * intermediate_size);
    Tensor gated = fused_mlp ? silu_and_mul(gate_up, intermediate_size)
                             : at::silu(gate_up.narrow(1, 0, intermediate_size)) *
                                   gate_up.narrow(1, intermediate_size, intermediate_size);
    return {added, linear(gated, layer.down_weight, layer.down_bias, hidden.size(1))};
  }

  // Every layer, for a whole model (no tensor parallelism): hidden is the embeddings, [T, hidden]. Returns the
  // last layer's output, [T, hidden] (before the final norm).
  Tensor forward(Tensor hidden, Tensor cos, Tensor sin, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens,
                 Tensor query_start_loc) {
    c10::InferenceMode guard;
    OptTensor delta;  // the last MLP block's output, not yet added to `hidden`
    for (int64_t index = 0; index < static_cast<int64_t>(layers.size()); ++index) {
      auto [added, o] = attention_block(index, hidden, delta, cos, sin, slot_mapping, block_tables, seq_lens,
                                        query_start_loc);
      std::tie(hidden, delta) = mlp_block(index, added, o);
    }
    if (delta) hidden = hidden + *delta;
    return hidden;
  }
};

}  // namespace

TORCH_LIBRARY(tokenmill_native, m) {
  // The at::vec width this file was compiled for, named as torch.backends.cpu.get_cpu_capability() names ATen's.
  m.def("vec_capability() -> str", [] { return std::string(TOKENMILL_VEC_CAPABILITY); });
  m.def("greedy_token_ids(Tensor logits) -> Tensor", &greedy_token_ids);
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, bool, bool>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("attention_block", &DecoderStack::attention_block)
      .def("mlp_block", &DecoderStack::mlp_block)
      .def("forward", &DecoderStack::forward);
}
