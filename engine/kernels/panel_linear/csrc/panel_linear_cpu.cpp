// Linear layers (y = x W^T + b) for float32 and bfloat16 on CPUs without AVX-512. There oneDNN
// has no bfloat16 path at all (torch's bfloat16 GEMM falls back to a scalar loop, a fraction of
// oneDNN's float32 rate), and torch's oneDNN float32 inner product is slower than this kernel at
// decode sizes on SmolLM2's shapes. And bfloat16 on CPUs with AVX512-BF16: with AMX multiplied on
// the tile unit (the section further down: torch's oneDNN inner product streams the weights more
// slowly at decode sizes), on AMD by VDPBF16PS dot products, on Intel without a usable tile unit
// widened into float32 FMAs (oneDNN's dot products are slower there; dot_products_pay says why).
// Python side: engine/kernels/panel_linear/__init__.py; engine/kernels/cpu_linear.py decides where it is used.
// Measurements behind these choices: ops/bench/README.md (its per-machine sections and "Figures
// behind the kernels' comments").
//
// The weight is packed once into panels of kPanel output features: [panels][K][kPanel] (the last
// panel zero-padded), so a micro-kernel streams one panel front to back. A bfloat16 panel row is
// interleaved so that one load and two bit operations widen it into two float32 vectors (exact).
// Products and sums are float32: each output is one float32 sum over k = 0 .. K-1 in order (one
// fused multiply-add per k), plus the bias, then (bfloat16) rounded once to nearest even. A row's
// result therefore depends only on that row: the same whatever the batch it is in.
//
// Work: rows are cut into chunks whose float32 rows fit in L2 (the panel loop re-reads them;
// bfloat16 rows are widened once per chunk), then each chunk's panels are handed out to torch's
// threads in small blocks (for_panel_blocks); within a panel, micro-tiles of kRows rows keep
// 2 x kRows accumulator vectors in registers while the panel's rows stream past.
// Needs GCC >= 12 or Clang (native vector types, __builtin_convertvector).

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../csrc/amx_tiles.h"

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
// bfloat16 layers multiply pairs of k natively (the pair layout, further down): by AVX512-BF16's
// dot products where they pay (dot_products_pay), and on the AMX tile unit where there is one (every
// AMX CPU has AVX512-BF16).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define TOKENMILL_PAIRS 1
#if TOKENMILL_AMX
#define TOKENMILL_PAIR_TILES 1
#endif
#endif
constexpr int kLanes = kVecBytes / 4;
constexpr int kPanel = 2 * kLanes;  // output features per panel: two accumulator vectors per row
constexpr int64_t kChunkBytes = 192 << 10;  // float32 input rows per chunk (L2 holds them)
// Calls with less work than this (rows x K x N) run on the calling thread.
constexpr int64_t kSerialWork = int64_t(1) << 17;

// run_panels(begin, end) over panels 0 .. panels-1: on the calling thread for calls with less work
// than kSerialWork, else on torch's threads, each claiming its next block of a few panels through an
// atomic counter until none are left. Fixed halves (parallel_for's split) left one thread waiting at
// the end of most calls on a shared 2-vCPU machine, whose cores are not always both ours; blocks
// take less time for a decode step's linear layers.
template <typename F>
void for_panel_blocks(int64_t panels, int64_t work, const F& run_panels) {
  if (work < kSerialWork) {
    run_panels(0, panels);
    return;
  }
  const int64_t threads = torch::stable::get_num_threads();
  const int64_t block = std::max<int64_t>(1, panels / (8 * threads));
  std::atomic<int64_t> next{0};
  torch::stable::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b = next.fetch_add(block, std::memory_order_relaxed); b < panels;
         b = next.fetch_add(block, std::memory_order_relaxed)) {
      run_panels(b, std::min(panels, b + block));
    }
  });
}

typedef float fvec __attribute__((vector_size(kVecBytes)));
typedef uint32_t uvec __attribute__((vector_size(kVecBytes)));
typedef int32_t ivec __attribute__((vector_size(kVecBytes)));
typedef uint16_t hvec __attribute__((vector_size(kVecBytes / 2)));

// The two float32 vectors of one bfloat16 panel row (exact widening): the row is stored interleaved,
// element 2i = column i and element 2i + 1 = column kLanes + i (pack_weight), so one load gives
// both: the low half of each 32-bit lane shifted up, and the high half with the low one cleared.
inline void load_row(const uint16_t* p, fvec& lo, fvec& hi) {
  uvec bits;
  std::memcpy(&bits, p, sizeof bits);
  const uvec low = bits << 16, high = bits & 0xFFFF0000u;
  std::memcpy(&lo, &low, sizeof lo);
  std::memcpy(&hi, &high, sizeof hi);
}

// The two float32 vectors of one float32 panel row (columns in order).
inline void load_row(const float* p, fvec& lo, fvec& hi) {
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + kLanes, sizeof hi);
}

// One bfloat16 value (its bits) as float32: exact.
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
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

// The element types: float, or BF16 (bfloat16), stored as its bits.
struct BF16 {};
template <typename T>
using bits_t = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;

// out[0 .. count) = v, rounded to T.
template <typename T>
inline void store_part(bits_t<T>* out, fvec v, int64_t count) {
  if constexpr (std::is_same_v<T, float>) {
    if (count == kLanes) return std::memcpy(out, &v, sizeof v), void();  // a fixed size: one store
    std::memcpy(out, &v, count * sizeof(float));
  } else {
    const hvec h = narrow(v);
    if (count == kLanes) return std::memcpy(out, &h, sizeof h), void();
    std::memcpy(out, &h, count * sizeof(uint16_t));
  }
}

// A bias slice as float32 vectors (zeros past `count`).
template <typename T>
inline void load_bias(const bits_t<T>* bias, int64_t count, fvec out[2]) {
  float padded[kPanel] = {};
  for (int64_t j = 0; bias != nullptr && j < count; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      padded[j] = bias[j];
    } else {
      padded[j] = bf16_to_float(bias[j]);
    }
  }
  load_row(padded, out[0], out[1]);
}

// out[0 .. cols) = round(lo, hi + bias): one row of a panel's results (lo: its first kLanes columns).
template <typename T>
inline void store_row(bits_t<T>* out, fvec lo, fvec hi, const fvec bias[2], int64_t cols) {
  store_part<T>(out, lo + bias[0], std::min<int64_t>(kLanes, cols));
  if (cols > kLanes) store_part<T>(out + kLanes, hi + bias[1], cols - kLanes);
}

// Micro-tiles stream their panel front to back, one row of kRowBytes per step, and fetch the row
// kAheadBytes on into L1 themselves: the L2 streamer stops at each 4 KB page (a float32 panel row is
// 128 bytes: every 32 k), and its restarts left the FMAs waiting on memory. Fetching 4 KB ahead
// beat no fetching on every path and dtype; 2 KB ahead gained a little less, 1 KB about half.
constexpr int64_t kAheadBytes = 4096;
template <int64_t kRowBytes>
inline void fetch_ahead(const void* row) {
  const char* ahead = static_cast<const char*>(row) + kAheadBytes;
#pragma GCC unroll 2
  for (int64_t line = 0; line < kRowBytes; line += 64) __builtin_prefetch(ahead + line, 0, 3);
}

// out[r][0 .. cols) = round(x[r] . W[panel column] + bias) for r < R; x rows are float32 (row
// stride ldx), the panel is [K][kPanel] of T, out has row stride ldo.
template <typename T, int R>
void micro_tile(const float* x, int64_t ldx, const bits_t<T>* panel, int64_t K, const fvec bias[2], bits_t<T>* out,
                int64_t ldo, int64_t cols) {
  fvec acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = fvec{};
  for (int64_t k = 0; k < K; ++k) {
    fvec w0, w1;
    fetch_ahead<sizeof(bits_t<T>) * kPanel>(panel + k * kPanel);
    load_row(panel + k * kPanel, w0, w1);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      const fvec b = splat(x[r * ldx + k]);
      acc[r][0] += b * w0;  // -ffp-contract=fast: one fused multiply-add
      acc[r][1] += b * w1;
    }
  }
  for (int r = 0; r < R; ++r) store_row<T>(out + r * ldo, acc[r][0], acc[r][1], bias, cols);
}

#if TOKENMILL_PAIRS
template <int R>
void pair_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const fvec bias[2], uint16_t* out,
               int64_t ldo, int64_t cols);
#endif

// A micro-tile of `rows` (1 .. R) rows: x is float32 rows for micro_tile, bfloat16 rows read in
// place for pair_tile (kPairs).
template <typename T, bool kPairs, int R, typename In>
void rows_tile(int rows, const In* x, int64_t ldx, const bits_t<T>* panel, int64_t K, const fvec bias[2],
               bits_t<T>* out, int64_t ldo, int64_t cols) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<T, kPairs, R - 1>(rows, x, ldx, panel, K, bias, out, ldo, cols);
  }
  if constexpr (kPairs) {
#if TOKENMILL_PAIRS
    pair_tile<R>(x, ldx, panel, K, bias, out, ldo, cols);
#endif
  } else {
    micro_tile<T, R>(x, ldx, panel, K, bias, out, ldo, cols);
  }
}

// weight: [N, K] -> [ceil(N / kPanel), K, kPanel]: panel p holds output features p * kPanel ..
// p * kPanel + kPanel - 1 (zeros past N) for each k; bfloat16 rows interleaved (see load_row).
template <typename T>
void pack_panels(const bits_t<T>* src, int64_t N, int64_t K, bits_t<T>* dst) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t k = 0; k < K; ++k) {
      bits_t<T>* row = dst + (p * K + k) * kPanel;
      for (int64_t j = 0; j < kPanel; ++j) {
        const int64_t column = std::is_same_v<T, float> ? j : (j % 2 == 0 ? j / 2 : kLanes + j / 2);
        const int64_t n = p * kPanel + column;
        row[j] = n < N ? src[n * K + k] : bits_t<T>(0);
      }
    }
  }
}

#if TOKENMILL_PAIRS
// ---- bfloat16 in pairs: AVX512-BF16 dot products and the AMX tile unit -------------------------
// Where the CPU multiplies bfloat16 pairs itself, bfloat16 layers whose K is a multiple of 32 (as
// in every common model; other layers keep the layout above) are packed in the pair layout of its
// instructions instead of widening to float32 FMAs (a Zen 4's cannot keep up with memory beyond a
// few rows): per 32 k, a panel's two 16-column halves, each 16 rows of 32 values where row r holds,
// for each column, the weights of k = 2r and 2r + 1 side by side; zeros past N (the packed
// tensor's shape names the arrangement: packed_shape). One row is one VDPBF16PS operand
// (AVX512-BF16, used on AMD's CPUs: Zen 4 and later), one half is one TDPBF16PS B tile (AMX,
// further down, used where the OS grants the tile unit). Input rows are read in place: a pair of bfloat16 inputs is one
// 32-bit broadcast (pair_tile) or 32 k of 16 rows one A tile (AMX).
// Both instructions add the two exact products of each pair to a float32 accumulator, pairs in k
// order; the float32 sums may differ from the FMA path's in the last bits (rare, tested within
// float32 accumulation error) and denormals flush to zero. A row's result again depends on that
// row only.
static_assert(kPanel == 32, "pair panels are two 16-column halves wide (an AVX-512 build)");
constexpr int64_t kTileK = 32;  // bfloat16 k per pair-layout row block (one 64-byte row per k pair)
constexpr int kTileRows = 16;  // k pairs per 32 k
constexpr int64_t kTileStep = 2 * kTileRows * 32;  // a panel's elements per 32 k (two halves)

// Where row r of half h sits in a panel's 32-k step: at r * row + h * half elements.
struct PairLayout {
  int64_t row, half;
};
// AMX: each half one contiguous B tile. VDPBF16PS: each pair's two halves side by side, so the
// micro-tile reads one stream front to back (the two streams 1 KB apart of the tile arrangement
// are slower at decode sizes on a Zen 4: its prefetchers follow them poorly).
constexpr PairLayout kTileLayout{32, kTileRows * 32};
constexpr PairLayout kDotLayout{64, 32};

// weight [N, K] -> [panels][K / 32][kTileStep] (see above).
void pack_pairs(const uint16_t* src, int64_t N, int64_t K, uint16_t* dst, PairLayout layout) {
  const int64_t panels = (N + kPanel - 1) / kPanel, steps = K / kTileK;
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t s = 0; s < steps; ++s) {
      for (int half = 0; half < 2; ++half) {
        for (int r = 0; r < kTileRows; ++r) {
          uint16_t* row = dst + (p * steps + s) * kTileStep + r * layout.row + half * layout.half;
          for (int c = 0; c < 16; ++c) {
            for (int e = 0; e < 2; ++e) {
              const int64_t n = p * kPanel + half * 16 + c, k = s * kTileK + 2 * r + e;
              row[2 * c + e] = n < N ? src[n * K + k] : uint16_t(0);
            }
          }
        }
      }
    }
  }
}

// pair_tile: rows_tile's micro-tile on VDPBF16PS; the panel is packed as pack_pairs (kDotLayout).
template <int R>
void pair_tile(const uint16_t* x, int64_t ldx, const uint16_t* panel, int64_t K, const fvec bias[2], uint16_t* out,
               int64_t ldo, int64_t cols) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kTileK) {
    const uint16_t* step = panel + k / kTileK * kTileStep;
#pragma GCC unroll 2
    for (int q = 0; q < kTileRows; ++q) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(step + q * kDotLayout.row);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(step + q * kDotLayout.row + kDotLayout.half);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + k + 2 * q, sizeof pair);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
      }
      // After the products: before the loads, GCC 12 (-std=c++20 -march=znver4) kept half the
      // accumulators on the stack, a store and a reload around every VDPBF16PS.
      fetch_ahead<kDotLayout.row * 2>(step + q * kDotLayout.row);
    }
  }
  for (int r = 0; r < R; ++r) store_row<BF16>(out + r * ldo, fvec(acc[r][0]), fvec(acc[r][1]), bias, cols);
}
#endif

#if TOKENMILL_PAIR_TILES
// ---- bfloat16 on the AMX tile unit -------------------------------------------------------------
// Pair-layout panels multiplied by TDPBF16PS, 32 rows x 32 columns (2 x 2 tiles) at a time.
constexpr int64_t kPrefetchAhead = 32 * kTileStep;  // elements: weights fetched into L2 64 KB ahead
// Panels per group: a group's weights stay in L2 while each 32-row block of inputs passes over them.
constexpr int64_t kGroupBytes = 512 << 10;

// This thread's tiles for a block of rows0 + rows1 input rows (rows1 = 0: one 16-row block),
// configured per call and released at its end (engine/kernels/csrc/amx_tiles.h): 0-1 the accumulators of
// rows 0-15 (left and right panel halves), 2-3 those of rows 16-31, 4-5 the two blocks' input
// rows, 6-7 the panel's two weight tiles.
void configure_tiles(int rows0, int rows1) {
  tokenmill_amx::configure({rows0, rows0, rows1, rows1, rows0, rows1, kTileRows, kTileRows});
}

// acc[32][32] (float32) = the configured rows of `a` (row stride lda elements) x one
// panel; kTwo: two 16-row blocks; kFetch: prefetch the weights ahead (they come from memory).
template <bool kTwo, bool kFetch>
void tile_panel(const uint16_t* a, int64_t lda, const uint16_t* panel, int64_t steps, float* acc) {
  const int64_t stride = lda * int64_t(sizeof(uint16_t));
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kTwo) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t s = 0; s < steps; ++s) {
    const uint16_t* b = panel + s * kTileStep;
    // NOTE: the L2 streamer stops at 4 KB pages, each 2 steps here: fetch across them by hand.
    if constexpr (kFetch) {
      for (int64_t line = 0; line < kTileStep; line += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(b + kPrefetchAhead + line), _MM_HINT_T1);
      }
    }
    _tile_loadd(6, b, kTileLayout.row * 2);
    _tile_loadd(7, b + kTileLayout.half, kTileLayout.row * 2);
    _tile_loadd(4, a + s * kTileK, stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kTwo) {
      _tile_loadd(5, a + kTileRows * lda + s * kTileK, stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, acc, 32 * sizeof(float));
  _tile_stored(1, acc + 16, 32 * sizeof(float));
  if constexpr (kTwo) {
    _tile_stored(2, acc + kTileRows * 32, 32 * sizeof(float));
    _tile_stored(3, acc + kTileRows * 32 + 16, 32 * sizeof(float));
  }
}

// multiply<BF16>'s result on the tile unit; packed as pack_pairs (kTileLayout).
void multiply_tiles(const uint16_t* xp, int64_t ldx, int64_t M, int64_t K, const uint16_t* wp, int64_t panels,
                    const uint16_t* bp, int64_t N, uint16_t* op) {
  const int64_t steps = K / kTileK;
  const int64_t group = std::max<int64_t>(1, kGroupBytes / (K * kPanel * int64_t(sizeof(uint16_t))));
  const auto run_panels = [&](int64_t begin, int64_t end) {
    alignas(64) float acc[2 * kTileRows * 32];
    int configured = -1;  // rows of the current configuration
    for (int64_t g = begin; g < end; g += group) {
      for (int64_t m = 0; m < M; m += 2 * kTileRows) {
        const int rows = int(std::min<int64_t>(2 * kTileRows, M - m));
        if (rows != configured) {
          configure_tiles(std::min(rows, kTileRows), std::max(rows - kTileRows, 0));
          configured = rows;
        }
        for (int64_t p = g; p < std::min(end, g + group); ++p) {
          const uint16_t* panel = wp + p * K * kPanel;
          const uint16_t* a = xp + m * ldx;
          if (rows <= kTileRows) {
            tile_panel<false, true>(a, ldx, panel, steps, acc);  // M <= 16: one pass over the weights
          } else if (m == 0) {
            tile_panel<true, true>(a, ldx, panel, steps, acc);
          } else {
            tile_panel<true, false>(a, ldx, panel, steps, acc);  // the group's weights are in L2
          }
          const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
          fvec bias[2];
          load_bias<BF16>(bp != nullptr ? bp + n0 : nullptr, cols, bias);
          for (int r = 0; r < rows; ++r) {
            fvec lo, hi;
            load_row(acc + r * 32, lo, hi);
            store_row<BF16>(op + (m + r) * N + n0, lo, hi, bias, cols);
          }
        }
      }
    }
    _tile_release();
  };
  for_panel_blocks(panels, M * K * N, run_panels);
}
#endif

// How bfloat16 layers with in_features K multiply in this process (and how they are packed).
enum class Bf16Path : int64_t {
  kWiden = 0,  // float32 FMAs on widened weights (pack_panels)
  kDotPairs = 1,  // VDPBF16PS (pack_pairs)
  kTiles = 2,  // the AMX tile unit (pack_pairs)
};

#if TOKENMILL_PAIRS
// Whether VDPBF16PS multiplies bfloat16 faster than widening it into float32 FMAs: on AMD's CPUs
// (Zen 4: one dot product per cycle, twice the work of its one 512-bit FMA), not on Intel's, where it
// issues once every two cycles against two FMAs per cycle: there the widening micro-tile is faster
// at all but the smallest row counts, and only slightly slower at those.
bool dot_products_pay() {
  static const bool pay = [] {
    __builtin_cpu_init();
    return !__builtin_cpu_is("intel");
  }();
  return pay;
}
#endif

Bf16Path bf16_path(int64_t K) {
#if TOKENMILL_PAIRS
  if (K % kTileK == 0) {
#if TOKENMILL_PAIR_TILES
    if (tokenmill_amx::usable()) return Bf16Path::kTiles;
#endif
    if (dot_products_pay()) return Bf16Path::kDotPairs;
  }
#endif
  (void)K;
  return Bf16Path::kWiden;
}

// bf16_path of layers whose in_features is a multiple of 32 (the op; Python's bfloat16_path).
int64_t bfloat16_path() { return static_cast<int64_t>(bf16_path(32)); }

// Whether bfloat16 layers with in_features K can multiply on `path` in this process.
bool runs_here(Bf16Path path, int64_t K) {
  switch (path) {
    case Bf16Path::kWiden: return true;
#if TOKENMILL_PAIRS
    case Bf16Path::kDotPairs: return K % kTileK == 0;
#endif
#if TOKENMILL_PAIR_TILES
    case Bf16Path::kTiles: return K % kTileK == 0 && tokenmill_amx::usable();
#endif
    default: return false;
  }
}

// Python's names for the paths (panel_linear.BFLOAT16_PATHS).
const char* path_name(Bf16Path path) {
  return path == Bf16Path::kTiles ? "amx" : path == Bf16Path::kDotPairs ? "avx512_bf16" : "widen";
}

bool supported(ScalarType type) { return type == ScalarType::Float || type == ScalarType::BFloat16; }

// The packed tensor's shape says its layout (so a weight is never multiplied in another's):
// [panels][K][kPanel] panels, [panels][K / 32][16][64] pairs side by side (kDotLayout),
// [panels][K / 32][2][16][32] pairs in two tiles (kTileLayout). Its first `rank` sizes count.
struct PackedShape {
  int64_t rank;
  int64_t sizes[5];
};
PackedShape packed_shape(int64_t N, int64_t K, Bf16Path path) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  switch (path) {
    case Bf16Path::kDotPairs: return {4, {panels, K / 32, 16, 64}};
    case Bf16Path::kTiles: return {5, {panels, K / 32, 2, 16, 32}};
    default: return {3, {panels, K, kPanel}};
  }
}

// The path a packed weight of in_features K was packed for (its shape; checked whole). Runs on
// every call: no allocation.
Bf16Path packed_path(const Tensor& packed, int64_t K) {
  const int64_t dim = packed.dim();
  STD_TORCH_CHECK(dim >= 3 && dim <= 5 && packed.is_contiguous(), "panel_linear: the weight is not packed (pack_weight)");
  const Bf16Path path = dim == 4 ? Bf16Path::kDotPairs : dim == 5 ? Bf16Path::kTiles : Bf16Path::kWiden;
  const PackedShape expected = packed_shape(packed.size(0) * kPanel, K, path);
  bool matches = path == Bf16Path::kWiden || K % 32 == 0;
  for (int64_t d = 1; matches && d < dim; ++d) matches = packed.size(d) == expected.sizes[d];
  STD_TORCH_CHECK(matches, "panel_linear: the packed weight does not match in_features ", K,
                  " (or was packed by a build with another panel width)");
  STD_TORCH_CHECK(runs_here(path, K), "panel_linear: the weight is packed for the bfloat16 path ", path_name(path),
                  ", which this process cannot run");
  return path;
}

// weight [N, K] in its kernel's layout (packed_shape). path: a Bf16Path for bfloat16 weights (-1:
// this CPU's, bf16_path; tests pack every path that runs here); float32 has only the panels.
Tensor pack_weight(Tensor weight, int64_t path_index) {
  STD_TORCH_CHECK(weight.is_cpu() && supported(weight.scalar_type()) && weight.dim() == 2,
                  "panel_linear.pack_weight: weight must be a float32 or bfloat16 [out_features, in_features] "
                  "CPU tensor");
  weight = torch::stable::contiguous(weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  const bool bf16 = weight.scalar_type() == ScalarType::BFloat16;
  const Bf16Path path = path_index < 0 ? (bf16 ? bf16_path(K) : Bf16Path::kWiden) : static_cast<Bf16Path>(path_index);
  STD_TORCH_CHECK(path_index <= int64_t(Bf16Path::kTiles), "panel_linear.pack_weight: no bfloat16 path ", path_index);
  STD_TORCH_CHECK(path_index < 0 || path == Bf16Path::kWiden || (bf16 && runs_here(path, K)),
                  "panel_linear.pack_weight: the bfloat16 path ", path_name(path), " cannot multiply this ",
                  bf16 ? "weight here" : "float32 weight");
  const PackedShape shape = packed_shape(N, K, path);
  Tensor packed = torch::stable::new_empty(weight, std::vector<int64_t>(shape.sizes, shape.sizes + shape.rank));
#if TOKENMILL_PAIRS
  if (path != Bf16Path::kWiden) {
    pack_pairs(static_cast<const uint16_t*>(weight.const_data_ptr()), N, K,
               static_cast<uint16_t*>(packed.mutable_data_ptr()),
               path == Bf16Path::kTiles ? kTileLayout : kDotLayout);
    return packed;
  }
#endif
  if (bf16) {
    pack_panels<BF16>(static_cast<const uint16_t*>(weight.const_data_ptr()), N, K,
                      static_cast<uint16_t*>(packed.mutable_data_ptr()));
  } else {
    pack_panels<float>(static_cast<const float*>(weight.const_data_ptr()), N, K,
                       static_cast<float*>(packed.mutable_data_ptr()));
  }
  return packed;
}

// x: [M, K] rows (stride ldx); packed: [panels, K, kPanel]; bias: [N] or null; out: [M, N].
// kPairs: bfloat16 packed as pack_pairs, rows read in place by pair_tile; otherwise micro_tile's
// float32 rows (bfloat16 rows widened once per chunk).
template <typename T, bool kPairs = false>
void multiply(const bits_t<T>* xp, int64_t ldx, int64_t M, int64_t K, const bits_t<T>* wp, int64_t panels,
              const bits_t<T>* bp, int64_t N, bits_t<T>* op) {
  constexpr bool kWiden = !std::is_same_v<T, float> && !kPairs;
  using In = std::conditional_t<kPairs, uint16_t, float>;
  const int64_t row_bytes = K * int64_t(sizeof(In));
  const int64_t chunk_rows = std::min(M, std::max<int64_t>(kRows, kChunkBytes / row_bytes / kRows * kRows));
  std::unique_ptr<float[]> widened(kWiden ? new float[chunk_rows * K] : nullptr);  // a chunk's rows
  for (int64_t m0 = 0; m0 < M; m0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, M - m0);
    const In* x;
    int64_t ld;
    if constexpr (kWiden) {
      for (int64_t m = 0; m < rows; ++m) {
        const uint16_t* src = xp + (m0 + m) * ldx;
        float* dst = widened.get() + m * K;
        for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_float(src[k]);
      }
      x = widened.get(), ld = K;
    } else {
      x = xp + m0 * ldx, ld = ldx;
    }
    const auto run_panels = [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min<int64_t>(kPanel, N - n0);
        fvec bias[2];
        load_bias<T>(bp != nullptr ? bp + n0 : nullptr, cols, bias);
        const bits_t<T>* panel = wp + p * K * kPanel;
        for (int64_t m = 0; m < rows; m += kRows) {
          rows_tile<T, kPairs, kRows>(int(std::min<int64_t>(kRows, rows - m)), x + m * ld, ld, panel, K, bias,
                                      op + (m0 + m) * N + n0, N, cols);
        }
      }
    };
    for_panel_blocks(panels, rows * K * N, run_panels);
  }
}

// x: [M, K] (rows contiguous); packed_weight: pack_weight's; bias: [N] or none; all float32 or
// all bfloat16. Returns [M, N].
Tensor linear(Tensor x, Tensor packed_weight, std::optional<Tensor> bias, int64_t out_features) {
  STD_TORCH_CHECK(x.is_cpu() && packed_weight.is_cpu(), "panel_linear needs CPU tensors");
  const ScalarType type = x.scalar_type();
  STD_TORCH_CHECK(supported(type) && packed_weight.scalar_type() == type,
                  "panel_linear: input and weight must both be float32 or both bfloat16");
  STD_TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "panel_linear: input must be [rows, in_features], rows contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  STD_TORCH_CHECK(K > 0, "panel_linear: in_features must be positive");
  const Bf16Path path = packed_path(packed_weight, K);
  STD_TORCH_CHECK(type == ScalarType::BFloat16 || path == Bf16Path::kWiden, "panel_linear: float32 weights are packed in panels");
  const int64_t panels = packed_weight.size(0);
  STD_TORCH_CHECK(N > (panels - 1) * kPanel && N <= panels * kPanel, "panel_linear: out_features ", N,
                  " does not match the packed weight");
  if (bias.has_value()) {
    STD_TORCH_CHECK(bias->scalar_type() == type && bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                        bias->is_cpu(),
                    "panel_linear: bias must be a contiguous [out_features] of the input's dtype");
  }
  Tensor out = torch::stable::new_empty(x, {M, N});
  if (M == 0) return out;
  const auto run = [&](auto element, auto pairs) {
    using T = decltype(element);
    using B = bits_t<T>;
    const auto* xp = static_cast<const B*>(x.const_data_ptr());
    const auto* wp = static_cast<const B*>(packed_weight.const_data_ptr());
    const B* bp = bias.has_value() ? static_cast<const B*>(bias->const_data_ptr()) : nullptr;
    auto* op = static_cast<B*>(out.mutable_data_ptr());
#if TOKENMILL_PAIR_TILES
    if constexpr (decltype(pairs)::value) {
      if (path == Bf16Path::kTiles) return multiply_tiles(xp, x.stride(0), M, K, wp, panels, bp, N, op);
    }
#endif
    multiply<T, decltype(pairs)::value>(xp, x.stride(0), M, K, wp, panels, bp, N, op);
  };
  if (type == ScalarType::Float) {
    run(float{}, std::false_type{});
  } else if (path == Bf16Path::kWiden) {
    run(BF16{}, std::false_type{});
  } else {
#if TOKENMILL_PAIRS
    run(BF16{}, std::true_type{});
#endif
  }
  return out;
}

}  // namespace

STABLE_TORCH_LIBRARY(tokenmill_panel, m) {
  m.def("pack_weight(Tensor weight, int path=-1) -> Tensor");
  m.def("linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor");
  m.def("bfloat16_path() -> int");
}

STABLE_TORCH_LIBRARY_IMPL(tokenmill_panel, CPU, m) {
  m.impl("pack_weight", TORCH_BOX(&pack_weight));
  m.impl("linear", TORCH_BOX(&linear));
}

STABLE_TORCH_LIBRARY_IMPL(tokenmill_panel, CompositeExplicitAutograd, m) {
  m.impl("bfloat16_path", TORCH_BOX(&bfloat16_path));  // no tensor arguments: no device to dispatch on
}
