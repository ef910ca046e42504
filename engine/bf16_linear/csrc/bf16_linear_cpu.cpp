// bfloat16 linear layers (y = x W^T + b) on CPUs where oneDNN has no bfloat16 path (x86 without
// AVX-512 or AVX-NE-CONVERT, e.g. AMD Zen 2/3 and Intel before Ice Lake), where torch's own
// bfloat16 GEMM falls back to a scalar loop (~14 GFLOPS on 2 Zen 3 cores, a 7th of oneDNN's
// float32). Python side: engine/bf16_linear/__init__.py.
//
// The weight is packed once into panels of kPanel output features: [panels][K][kPanel] bfloat16
// (the last panel zero-padded), so a micro-kernel streams one panel front to back; each panel row
// is interleaved so that one load and two bit operations widen it into two float32 vectors. Products and
// sums are float32, as every bfloat16 GEMM computes them: a bfloat16 weight widens to float32
// exactly (its bits shifted left by 16), the input rows are widened once per call, and each
// output is one float32 sum over k = 0 .. K-1 in order (one fused multiply-add per k), plus the
// bias, rounded once to bfloat16 (nearest even). A row's result therefore depends only on that
// row: the same whatever the batch it is in or the rows beside it.
//
// Work: rows are cut into chunks whose widened rows fit in L2 (the panel loop re-reads them); each
// chunk is widened to float32 once, then its panels are split over torch's thread pool; within a panel, micro-tiles of kRows rows
// keep 2 x kRows accumulator vectors in registers while the panel's rows stream past.
// Needs GCC >= 12 or Clang (native vector types, __builtin_convertvector).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>

namespace {

using torch::headeronly::ScalarType;
using torch::stable::Tensor;

#if defined(__AVX512F__)
constexpr int kVecBytes = 64;
constexpr int kRows = 12;  // 24 accumulators + 2 weight vectors + a broadcast of 32 registers
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int kVecBytes = 32;
constexpr int kRows = 6;  // 12 accumulators + 2 weight vectors + a broadcast of 16 registers
#else
constexpr int kVecBytes = 16;
constexpr int kRows = 6;
#endif
constexpr int kLanes = kVecBytes / 4;
constexpr int kPanel = 2 * kLanes;  // output features per panel: two accumulator vectors per row
constexpr int64_t kChunkBytes = 192 << 10;  // widened input rows per chunk (L2 holds them)
// Calls with less work than this (rows x K x N) run on the calling thread.
constexpr int64_t kSerialWork = int64_t(1) << 17;

typedef float fvec __attribute__((vector_size(kVecBytes)));
typedef uint32_t uvec __attribute__((vector_size(kVecBytes)));
typedef int32_t ivec __attribute__((vector_size(kVecBytes)));
typedef uint16_t hvec __attribute__((vector_size(kVecBytes / 2)));

// The two float32 vectors of one panel row (exact widening): the row is stored interleaved,
// element 2i = column i and element 2i + 1 = column kLanes + i (pack_weight), so one load gives
// both: the low half of each 32-bit lane shifted up, and the high half with the low one cleared.
inline void widen_row(const uint16_t* p, fvec& lo, fvec& hi) {
  uvec bits;
  std::memcpy(&bits, p, sizeof bits);
  const uvec low = bits << 16, high = bits & 0xFFFF0000u;
  std::memcpy(&lo, &low, sizeof lo);
  std::memcpy(&hi, &high, sizeof hi);
}

// kLanes consecutive bfloat16 values as float32.
inline fvec widen(const uint16_t* p) {
  hvec h;
  std::memcpy(&h, p, sizeof h);
  const uvec bits = __builtin_convertvector(h, uvec) << 16;
  fvec f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float32 -> bfloat16, round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16 converts).
inline hvec narrow(fvec v) {
  uvec bits;
  std::memcpy(&bits, &v, sizeof bits);
  const uvec rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const ivec is_nan = v != v;
  const uvec out = is_nan ? uvec{} + 0x7FC0u : rounded;
  return __builtin_convertvector(out, hvec);
}

template <std::size_t... I>
inline fvec splat_lanes(float s, std::index_sequence<I...>) {
  return fvec{((void)I, s)...};  // a broadcast (fvec{} + s would add a zero first)
}
inline fvec splat(float s) { return splat_lanes(s, std::make_index_sequence<kLanes>{}); }

// out[r][0 .. cols) = round(x[r] . W[panel column] + bias) for r < R; x rows are widened
// (float32, row stride ldx), the panel is [K][kPanel], out has row stride ldo.
template <int R>
void micro_tile(const float* x, int64_t ldx, const uint16_t* panel, int64_t K, const fvec bias[2], uint16_t* out,
                int64_t ldo, int64_t cols) {
  fvec acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = fvec{};
  for (int64_t k = 0; k < K; ++k) {
    fvec w0, w1;
    widen_row(panel + k * kPanel, w0, w1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const fvec b = splat(x[r * ldx + k]);
      acc[r][0] += b * w0;  // -ffp-contract=fast: one fused multiply-add
      acc[r][1] += b * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    const hvec lo = narrow(acc[r][0] + bias[0]), hi = narrow(acc[r][1] + bias[1]);
    uint16_t* row = out + r * ldo;
    if (cols == kPanel) {
      std::memcpy(row, &lo, sizeof lo);
      std::memcpy(row + kLanes, &hi, sizeof hi);
    } else {
      uint16_t both[kPanel];
      std::memcpy(both, &lo, sizeof lo);
      std::memcpy(both + kLanes, &hi, sizeof hi);
      std::memcpy(row, both, cols * sizeof(uint16_t));
    }
  }
}

template <int R>
void rows_tile(int rows, const float* x, int64_t ldx, const uint16_t* panel, int64_t K, const fvec bias[2],
               uint16_t* out, int64_t ldo, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<R - 1>(rows, x, ldx, panel, K, bias, out, ldo, cols);
  }
  micro_tile<R>(x, ldx, panel, K, bias, out, ldo, cols);
}

// weight: [N, K] bfloat16 -> [ceil(N / kPanel), K, kPanel]: panel p holds output features
// p * kPanel .. p * kPanel + kPanel - 1 (zeros past N) for each k, interleaved (see widen_row).
Tensor pack_weight(Tensor weight) {
  STD_TORCH_CHECK(weight.is_cpu() && weight.scalar_type() == ScalarType::BFloat16 && weight.dim() == 2,
                  "bf16_linear.pack_weight: weight must be a bfloat16 [out_features, in_features] CPU tensor");
  weight = torch::stable::contiguous(weight);
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  Tensor packed = torch::stable::new_empty(weight, {panels, K, kPanel});
  const uint16_t* src = static_cast<const uint16_t*>(weight.const_data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(packed.mutable_data_ptr());
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t k = 0; k < K; ++k) {
      uint16_t* row = dst + (p * K + k) * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + (j % 2 == 0 ? j / 2 : kLanes + j / 2);
        row[j] = n < N ? src[n * K + k] : uint16_t(0);
      }
    }
  }
  return packed;
}

// x: [M, K] bfloat16 (rows contiguous); packed_weight: [panels, K, kPanel] bfloat16 from
// pack_weight's layout; bias: [N] bfloat16 or none. Returns [M, N] bfloat16.
Tensor linear(Tensor x, Tensor packed_weight, std::optional<Tensor> bias, int64_t out_features) {
  STD_TORCH_CHECK(x.is_cpu() && packed_weight.is_cpu(), "bf16_linear needs CPU tensors");
  STD_TORCH_CHECK(x.scalar_type() == ScalarType::BFloat16 && packed_weight.scalar_type() == ScalarType::BFloat16,
                  "bf16_linear: input and weight must be bfloat16");
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "bf16_linear: input must be [rows, in_features], rows contiguous");
  STD_TORCH_CHECK(packed_weight.dim() == 3 && packed_weight.size(2) == kPanel && packed_weight.is_contiguous(),
                  "bf16_linear: the weight is not packed for this build (panel width ", kPanel, ")");
  const int64_t M = x.size(0), K = x.size(1), panels = packed_weight.size(0), N = out_features;
  STD_TORCH_CHECK(K > 0, "bf16_linear: in_features must be positive");
  STD_TORCH_CHECK(packed_weight.size(1) == K, "bf16_linear: in_features ", K, " does not match the weight's ",
                  packed_weight.size(1));
  STD_TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "bf16_linear: out_features ", N,
                  " does not match the packed weight");
  const uint16_t* bp = nullptr;
  if (bias.has_value()) {
    STD_TORCH_CHECK(bias->scalar_type() == ScalarType::BFloat16 && bias->dim() == 1 && bias->size(0) == N &&
                        bias->is_contiguous() && bias->is_cpu(),
                    "bf16_linear: bias must be a contiguous bfloat16 [out_features]");
    bp = static_cast<const uint16_t*>(bias->const_data_ptr());
  }
  Tensor out = torch::stable::new_empty(x, {M, N});
  if (M == 0) return out;
  const uint16_t* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const uint16_t* wp = static_cast<const uint16_t*>(packed_weight.const_data_ptr());
  uint16_t* op = static_cast<uint16_t*>(out.mutable_data_ptr());
  const int64_t ldx = x.stride(0);

  const int64_t chunk_rows = std::min(M, std::max<int64_t>(kRows, kChunkBytes / (K * 4) / kRows * kRows));
  std::unique_ptr<float[]> xf(new float[chunk_rows * K]);  // the chunk's rows, widened
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, M - m0);
    for (int64_t m = 0; m < rows; ++m) {
      const uint16_t* src = xp + (m0 + m) * ldx;
      float* dst = xf.get() + m * K;
      for (int64_t k = 0; k < K; ++k) {
        const uint32_t bits = uint32_t(src[k]) << 16;
        std::memcpy(dst + k, &bits, sizeof bits);
      }
    }
    const auto run_panels = [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
        uint16_t padded_bias[kPanel] = {};
        if (bp != nullptr) std::memcpy(padded_bias, bp + n0, cols * sizeof(uint16_t));
        const fvec bias_vec[2] = {widen(padded_bias), widen(padded_bias + kLanes)};
        const uint16_t* panel = wp + p * K * kPanel;
        for (int64_t m = m0; m < m0 + rows; m += kRows) {
          rows_tile<kRows>(int(std::min<int64_t>(kRows, m0 + rows - m)), xf.get() + (m - m0) * K, K, panel, K,
                           bias_vec, op + m * N + n0, N, cols);
        }
      }
    };
    if (rows * K * N < kSerialWork) {
      run_panels(0, panels);
    } else {
      torch::stable::parallel_for(0, panels, 1, run_panels);
    }
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(tokenmill_bf16, m) {
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
}

STABLE_TORCH_LIBRARY_IMPL(tokenmill_bf16, CPU, m) {
  m.impl("pack_weight", TORCH_BOX(&pack_weight));
  m.impl("linear", TORCH_BOX(&linear));
}
