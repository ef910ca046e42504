// Paged attention on CPU, computed straight from the KV block pool (no gather into a buffer),
// and the cache write that fills that pool.
//
// tokenmill::paged_attention is the "unified varlen" op: sequence s owns query rows
// query_start_loc[s] .. query_start_loc[s+1]-1, the last positions of its seq_lens[s]-long
// context; each attends causally to the keys at positions <= its own, found through
// block_tables. Decodes (1 token), chunked prefill over a cached prefix and first chunks are all
// the same op. Python side: engine/kernels/attention/cpu_kernel.py.
//
// Work decomposition. Query tokens of a sequence are cut into tiles; a tile's "rows" are its
// (token, head-in-group) pairs, so all query heads sharing a kv head are processed together and
// each K/V row is loaded once per tile. A work item is (tile, kv heads, key range): prefill tiles
// take one kv head, decode tiles take all kv heads, so that each slot's rows (adjacent in the
// pool) are read as one contiguous span. When there are few items for the threads (small decode
// batches, long contexts), key ranges are split into partitions (flash-decoding); each partition
// keeps its own softmax max/sum and unnormalised output, merged in a second pass. Items are
// sorted longest first and handed out through an atomic counter on torch's thread pool; tiny
// calls stay on the calling thread.
//
// Keys are consumed in chunks of kKeyChunk positions, one pointer per K/V row (blocks of any size
// and placement cost the same); each chunk is scored, masked, put through an online (streaming)
// softmax and multiplied into the output, while the next chunk's rows are prefetched (when they
// are few; after an item's last chunk, the first chunk of the item the thread runs next). Two
// ways to score a chunk:
//   - few rows (decodes): dot products vectorised along head_dim, for W keys at a time, whose W
//     partial-sum vectors are reduced together by a shuffle tree (about 3 shuffles/adds per
//     score instead of ~10 for one horizontal sum each); the softmax runs along keys.
//   - many rows (prefill tiles): rows lie along the SIMD lanes. The tile's queries are
//     transposed once ([head_dim][rows]); a register-blocked micro-kernel broadcasts K[key][d]
//     into (keys x row-vectors) accumulators, and the softmax runs along rows.
// P.V is shared: a register tile of (rows x head_dim vectors) accumulators.
// On CPUs with AMX, many-row bfloat16 tiles (head_dim a multiple of 32) run on the tile unit
// instead (Workspace::chunk_tiles): tiles of 16 vectors of rows, chunks of kTileKeyChunk keys whose
// K rows are transposed into pairs and V rows interleaved in key pairs (TDPBF16PS's B layout),
// S = Q.K^T and P.V as tile products, the softmax as for few rows. P is rounded to bfloat16 for
// P.V (as SDPA's bfloat16 path does). That brings bfloat16 prefill level with SDPA's own AMX path
// (ops/bench/attention.py --quick --dtype bfloat16).
//
// Vectorisation. The register-blocked micro-kernels use GCC/Clang native vector types
// (vector_size), because GCC keeps arrays of at::vec::Vectorized in memory (measured: every
// accumulator stored and reloaded per iteration, plus a memset); arrays of native vectors stay
// in registers. Their width is at::vec's (512-bit with AVX-512, 256-bit with AVX2), and at::vec
// supplies exp, max and the bfloat16/float16 widening. at::vec is compiled into a private inline
// namespace so its inline functions can never be confused with libtorch's own copies.
//
// Registration and threads go through torch's stable C ABI (torch/csrc/stable): its headers parse
// in a fraction of the time of torch/library.h, and its parallel_for runs on torch's own pool.
//
// Accumulation is float32 (float64 for float64 inputs); bfloat16/float16 K/V rows of many-row
// (prefill) tiles are widened into a per-thread chunk buffer first, where each row serves many
// queries. Few-row (decode) tiles read them straight from the pool: V rows are widened in
// registers as P.V loads them (a widened copy was written and read back for one use, which made
// bfloat16 decode calls slower), and with AVX512-BF16 K rows of bfloat16 are scored with
// VDPBF16PS (exact pair products, float32 sums; the query stays unscaled bfloat16 and the scale
// multiplies the scores), which makes bfloat16 decode calls faster than widening them first.
// Softmax exponentials use at::vec's exp_u20 (as torch's own CPU flash attention does), faster
// than exp(): float32 relative error <= 3.8e-7 over [-104, 0], vs 8.3e-8 for exp(); for float64
// it is the exact exp().
// Needs GCC >= 12 or Clang (__builtin_shufflevector).
// Measurements behind these choices: ops/bench/README.md (its per-machine sections and "Figures
// behind the kernels' comments").

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY tokenmill_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY tokenmill_avx2
#else
#define CPU_CAPABILITY tokenmill_scalar
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include "../../csrc/amx_tiles.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using at::vec::Vectorized;
using torch::headeronly::ScalarType;
using torch::stable::Tensor;

constexpr int64_t kKeyChunk = 32;       // key positions scored and soft-maxed together
// ... on the AMX tile unit: longer chunks spread each row's softmax bookkeeping and the K/V
// re-layout over more keys (long prefills ran faster at 128 than at 32 or 64).
constexpr int64_t kTileKeyChunk = 128;
constexpr int64_t kMaxKeyChunk = std::max(kKeyChunk, kTileKeyChunk);
constexpr int64_t kMaxDotRows = 8;      // tiles with at most this many rows use dot-product scoring
// Never split a key range into pieces shorter than this. At 256, a lone decode over 257-511 keys
// made two uneven items, one per thread; at 64 its pieces balance, and batch-1 decode calls over a
// few hundred keys run faster (other shapes unchanged).
constexpr int64_t kMinPartition = 64;
// Prefetch the next key chunk (into L2) if its K + V fit in this: 32 keys of 8 kv heads x 128
// (float32). With the L2 hint, bfloat16 decodes of such heads run faster than with the earlier
// 64 KB limit (float32 level).
constexpr int64_t kPrefetchBytes = 256 << 10;
// Calls with less work than this (query rows x keys x head_dim) run on the calling thread: waking
// the thread pool costs more (tens of microseconds, far more on a busy machine).
constexpr int64_t kSerialWork = int64_t(1) << 16;

// f(0, 1) on the calling thread, or f(i, i + 1) for i < threads on torch's thread pool.
template <typename F>
void run_threads(int64_t threads, const F& f) {
  if (threads <= 1) {
    f(0, 1);
  } else {
    torch::stable::parallel_for(0, threads, 1, f);
  }
}

// ---------------------------------------------------------------------------------------------
// Native vectors, as wide as at::vec's.

constexpr int kVecBytes = int(Vectorized<float>::size() * sizeof(float));
#if defined(CPU_CAPABILITY_AVX512) || defined(__aarch64__)
constexpr int kRegs = 32;
#else
constexpr int kRegs = 16;
#endif

template <typename T>
struct Native;
template <>
struct Native<float> {
  typedef float type __attribute__((vector_size(kVecBytes)));
};
template <>
struct Native<double> {
  typedef double type __attribute__((vector_size(kVecBytes)));
};
template <typename T>
using vec_t = typename Native<T>::type;
template <typename T>
constexpr int64_t kLanes = kVecBytes / int64_t(sizeof(T));

template <typename T>
inline vec_t<T> vload(const T* p) {
  vec_t<T> v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

// A vector of acc_t from src_t elements: a plain load, or bfloat16/float16 widened to float32.
template <typename acc_t, typename src_t>
inline vec_t<acc_t> vload_as(const src_t* p) {
  if constexpr (std::is_same_v<src_t, acc_t>) {
    return vload(p);
  } else {
    static_assert(std::is_same_v<acc_t, float>, "reduced types widen to float32");
    Vectorized<float> x;
    at::vec::load_to_float(p, x);
    vec_t<float> v;
    __builtin_memcpy(&v, &x, sizeof v);
    return v;
  }
}

// The first `count` elements at p (as vload_as), zero-filled to a whole vector.
template <typename acc_t, typename src_t>
inline vec_t<acc_t> vload_part_as(const src_t* p, int64_t count) {
  if (count >= kLanes<acc_t>) return vload_as<acc_t>(p);
  vec_t<acc_t> v = {};
  for (int64_t i = 0; i < count; ++i) v[i] = static_cast<acc_t>(p[i]);
  return v;
}

template <typename T>
inline void vstore(T* p, vec_t<T> v) {
  __builtin_memcpy(p, &v, sizeof v);
}

template <typename T>
inline vec_t<T> vbroadcast(T s) {
  return s - vec_t<T>{};  // x - 0 is exact for every x (x + 0 is not for -0), so this is a plain broadcast
}

// Shuffle-tree reduction: out[i] = sum of the lanes of v[i], for W = kLanes vectors. At each
// level, a pair of vectors each holding W/S sources of S lanes becomes one vector holding 2W/S
// sources of S/2 lanes (the halves of every source added).
template <int64_t W, int64_t S>
constexpr int fold_index(int64_t i) {
  const int64_t half = S / 2, seg = i / half, per = W / S;
  return int((seg < per ? 0 : W) + (seg % per) * S + i % half);
}

template <typename T, int64_t S, std::size_t... I>
inline vec_t<T> fold_pair(vec_t<T> a, vec_t<T> b, std::index_sequence<I...>) {
  constexpr int64_t W = kLanes<T>;
  return __builtin_shufflevector(a, b, fold_index<W, S>(I)...) +
         __builtin_shufflevector(a, b, (fold_index<W, S>(I) + int(S / 2))...);
}

template <typename T, int64_t N>
inline vec_t<T> transpose_sum(vec_t<T>* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
#pragma GCC unroll 16
    for (int64_t k = 0; k < N / 2; ++k)
      v[k] = fold_pair<T, N>(v[2 * k], v[2 * k + 1], std::make_index_sequence<kLanes<T>>{});
    return transpose_sum<T, N / 2>(v);
  }
}

// ---------------------------------------------------------------------------------------------
// Micro-kernels (acc_t = float or double).

// s[j] = q . K[j] for j < W (keys past `count` repeat key 0; their scores are discarded).
template <typename acc_t>
inline void score_dots(const acc_t* q, const acc_t* const* keys, int64_t count, int64_t head_dim, acc_t* s) {
  constexpr int64_t W = kLanes<acc_t>;
  using V = vec_t<acc_t>;
  const acc_t* k[W];
  V acc[W];
#pragma GCC unroll 16
  for (int64_t j = 0; j < W; ++j) {
    k[j] = keys[j < count ? j : 0];
    acc[j] = V{};
  }
  int64_t d = 0;
  for (; d + W <= head_dim; d += W) {
    const V qv = vload(q + d);
#pragma GCC unroll 16
    for (int64_t j = 0; j < W; ++j) acc[j] += qv * vload(k[j] + d);
  }
  if (d < head_dim) {  // q is zero-padded; key rows are not
    const V qv = vload(q + d);
#pragma GCC unroll 16
    for (int64_t j = 0; j < W; ++j) acc[j] += qv * vload_part_as<acc_t>(k[j] + d, head_dim - d);
  }
  vstore(s, transpose_sum<acc_t, W>(acc));
}

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
#define TOKENMILL_BF16_DOTS 1
// s[j] = scale * (q . K[j]) for j < 16, q and K bfloat16 (raw bits), straight from the pool: VDPBF16PS
// multiplies pairs exactly and accumulates in float32, so no K row is widened first. head_dim
// tails are masked loads (zeros add nothing). Keys past `count` repeat key 0 (discarded).
inline void score_dots_bf16(const uint16_t* q, const uint16_t* const* keys, int64_t count, int64_t head_dim,
                            float scale, float* s) {
  constexpr int64_t W = 16;
  const uint16_t* k[W];
  vec_t<float> acc[W];
#pragma GCC unroll 16
  for (int64_t j = 0; j < W; ++j) {
    k[j] = keys[j < count ? j : 0];
    acc[j] = vec_t<float>{};
  }
  for (int64_t d = 0; d < head_dim; d += 32) {
    const __mmask32 mask = head_dim - d >= 32 ? ~__mmask32(0) : (__mmask32(1) << (head_dim - d)) - 1;
    const __m512bh qv = (__m512bh)_mm512_maskz_loadu_epi16(mask, q + d);
#pragma GCC unroll 16
    for (int64_t j = 0; j < W; ++j)
      acc[j] = (vec_t<float>)_mm512_dpbf16_ps((__m512)acc[j], qv, (__m512bh)_mm512_maskz_loadu_epi16(mask, k[j] + d));
  }
  vstore(s, transpose_sum<float, W>(acc) * vbroadcast(scale));
}
#endif

#if defined(TOKENMILL_BF16_DOTS) && defined(TOKENMILL_AMX)
#define TOKENMILL_AMX_TILES 1
// All eight tiles as 16 rows x 64 bytes: this thread's configuration for tile chunks, loaded at
// the start of each item and released at its end (engine/kernels/csrc/amx_tiles.h).
void configure_tiles() { tokenmill_amx::configure({16, 16, 16, 16, 16, 16, 16, 16}); }
#endif

// s[k * lds + lane] = sum_d K[k][d] * qt[d * ldq + lane] for NK keys and RV row vectors.
template <typename acc_t, int RV, int NK>
inline void score_lanes(const acc_t* qt, int64_t ldq, const acc_t* const* keys, int64_t head_dim, acc_t* s,
                        int64_t lds) {
  constexpr int64_t W = kLanes<acc_t>;
  using V = vec_t<acc_t>;
  V acc[NK][RV];
#pragma GCC unroll 16
  for (int k = 0; k < NK; ++k) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) acc[k][v] = V{};
  }
  for (int64_t d = 0; d < head_dim; ++d) {
    V q[RV];
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) q[v] = vload(qt + d * ldq + v * W);
#pragma GCC unroll 16
    for (int k = 0; k < NK; ++k) {
      const V kb = vbroadcast(keys[k][d]);
#pragma GCC unroll 4
      for (int v = 0; v < RV; ++v) acc[k][v] += kb * q[v];
    }
  }
#pragma GCC unroll 16
  for (int k = 0; k < NK; ++k) {
#pragma GCC unroll 4
    for (int v = 0; v < RV; ++v) vstore(s + k * lds + v * W, acc[k][v]);
  }
}

template <typename acc_t, int RV>
void score_lanes_all(const acc_t* qt, int64_t ldq, const acc_t* const* keys, int64_t n, int64_t head_dim,
                     acc_t* s, int64_t lds) {
  // Keys per register tile: NK * RV accumulators + RV query vectors + 1 broadcast fit in the
  // registers, and NK divides kKeyChunk (a remainder runs one key at a time: RV chains only).
  constexpr int NK = kRegs == 32 ? (RV == 4 ? 4 : 8) : (RV == 1 ? 8 : RV == 2 ? 4 : 2);
  int64_t k = 0;
  for (; k + NK <= n; k += NK) score_lanes<acc_t, RV, NK>(qt, ldq, keys + k, head_dim, s + k * lds, lds);
  for (; k < n; ++k) score_lanes<acc_t, RV, 1>(qt, ldq, keys + k, head_dim, s + k * lds, lds);
}

// o[i][d0 : d0 + NV*W] = alpha[i] * o[i][...] + sum_j p(i, j) * V[j][...] for MR rows; the last
// vector of V holds only `tail` valid elements (o is padded, so it is stored whole). V rows are
// acc_t, or bfloat16/float16 rows straight from the pool, widened as they are loaded.
template <typename acc_t, int MR, int NV, typename v_t>
inline void pv_tile(acc_t* o, int64_t ldo, const acc_t* p, int64_t p_row, int64_t p_key,
                    const v_t* const* values, int64_t n, int64_t d0, int64_t tail, const acc_t* alpha) {
  constexpr int64_t W = kLanes<acc_t>;
  using V = vec_t<acc_t>;
  V acc[MR][NV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
    const V a = vbroadcast(alpha[i]);
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[i][v] = vload(o + i * ldo + d0 + v * W) * a;
  }
  for (int64_t j = 0; j < n; ++j) {
    const v_t* vrow = values[j] + d0;
    V vv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV - 1; ++v) vv[v] = vload_as<acc_t>(vrow + v * W);
    vv[NV - 1] = vload_part_as<acc_t>(vrow + (NV - 1) * W, tail);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const V pb = vbroadcast(p[i * p_row + j * p_key]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[i][v] += pb * vv[v];
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) vstore(o + i * ldo + d0 + v * W, acc[i][v]);
  }
}

template <typename acc_t, int NV, int MR, typename v_t>
void pv_rows(acc_t* o, int64_t ldo, const acc_t* p, int64_t p_row, int64_t p_key, const v_t* const* values,
             int64_t n, int64_t rows, int64_t d0, int64_t tail, const acc_t* alpha) {
  int64_t i = 0;
  for (; i + MR <= rows; i += MR)
    pv_tile<acc_t, MR, NV>(o + i * ldo, ldo, p + i * p_row, p_row, p_key, values, n, d0, tail, alpha + i);
  if constexpr (MR > 1) {
    if (i < rows)
      pv_rows<acc_t, NV, MR - 1>(o + i * ldo, ldo, p + i * p_row, p_row, p_key, values, n, rows - i, d0, tail,
                                 alpha + i);
  }
}

// O = alpha * O + P . V over all rows and the whole head_dim (in pieces of up to 4 vectors).
template <typename acc_t, typename v_t>
void accumulate_pv(acc_t* o, int64_t ldo, const acc_t* p, int64_t p_row, int64_t p_key,
                   const v_t* const* values, int64_t n, int64_t rows, int64_t head_dim, const acc_t* alpha) {
  constexpr int64_t W = kLanes<acc_t>;
  constexpr int MR = (kRegs - 5) / 4;  // rows per register tile (4 output vectors each)
  for (int64_t d0 = 0; d0 < head_dim; d0 += 4 * W) {
    const int64_t nv = std::min<int64_t>(4, (head_dim - d0 + W - 1) / W);
    const int64_t tail = head_dim - d0 - (nv - 1) * W;
    switch (nv) {
      case 1: pv_rows<acc_t, 1, MR>(o, ldo, p, p_row, p_key, values, n, rows, d0, tail, alpha); break;
      case 2: pv_rows<acc_t, 2, MR>(o, ldo, p, p_row, p_key, values, n, rows, d0, tail, alpha); break;
      case 3: pv_rows<acc_t, 3, MR>(o, ldo, p, p_row, p_key, values, n, rows, d0, tail, alpha); break;
      default: pv_rows<acc_t, 4, MR>(o, ldo, p, p_row, p_key, values, n, rows, d0, tail, alpha); break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One tile's state and the per-chunk steps (independent of the input dtype).

template <typename scalar_t, typename acc_t>
struct Workspace {
  static constexpr int64_t W = kLanes<acc_t>;
  static constexpr bool kWiden = !std::is_same_v<scalar_t, acc_t>;  // bfloat16/float16 rows
#ifdef TOKENMILL_BF16_DOTS
  static constexpr bool kBf16Dots = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>;
#else
  static constexpr bool kBf16Dots = false;
#endif

  int64_t rows = 0;       // rows of the current tile
  int64_t chunk_keys = kKeyChunk;  // keys per chunk (kTileKeyChunk on the tile unit): scores' row stride
  int64_t ldq = 0;        // rows rounded up to W (lane layout: qt[d][row], scores[key][row])
  int64_t head_dim = 0;
  int64_t head_dim_pad = 0;
  std::unique_ptr<acc_t[]> buffer;
  acc_t *q, *o, *s, *m, *l, *alpha, *pos, *kwide, *vwide;
  const acc_t* keys[kMaxKeyChunk];
  const acc_t* values[kMaxKeyChunk];
  // Few-row tiles of bfloat16/float16 (kWiden) take their V rows straight from the pool, widened
  // as the P.V micro-kernel loads them: a widened copy would be written and read back for one use.
  const scalar_t* pool_values[kMaxKeyChunk];
  // bfloat16 dot scoring (kBf16Dots, few-row tiles): the tile's queries unscaled in bfloat16,
  // [rows][head_dim], the K rows straight from the pool, and the softmax scale applied to the scores.
  std::unique_ptr<uint16_t[]> qb;
  const uint16_t* bf16_keys[kMaxKeyChunk];
  acc_t score_scale = 1;
#ifdef TOKENMILL_AMX_TILES
  // Many-row bfloat16 tiles on the AMX tile unit (`tiles`, set per item): the queries unscaled in
  // bfloat16 ([rows rounded up to 16][head_dim], zero rows past `rows`), the chunk's K rows as
  // pairs transposed ([head_dim / 2][kTileKeyChunk] 32-bit pairs: TDPBF16PS's B layout for Q.K^T), its V
  // rows interleaved in key pairs ([kTileKeyChunk / 2][head_dim][2]: the B layout for P.V), the
  // probabilities in bfloat16 ([rows rounded up to 16][kTileKeyChunk]) and P.V in float32.
  static constexpr bool kTileCapable = std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>;
  bool tiles = false;
  std::unique_ptr<uint16_t[]> qtile, vpairs, ptile;
  std::unique_ptr<uint32_t[]> kpairs;
  std::unique_ptr<float[]> pv;
#endif

  Workspace(int64_t max_rows, int64_t head_dim_) : head_dim(head_dim_) {
    head_dim_pad = (head_dim + W - 1) / W * W;
    const int64_t r = (max_rows + W - 1) / W * W, dp = head_dim_pad;
    const int64_t sizes[] = {r * dp, r * dp, kMaxKeyChunk * r, r, r, r, r, kWiden ? kKeyChunk * dp : 0,
                             kWiden ? kKeyChunk * dp : 0};
    int64_t total = 0;
    for (int64_t size : sizes) total += size;
    buffer.reset(new acc_t[total]);
    acc_t** slots[] = {&q, &o, &s, &m, &l, &alpha, &pos, &kwide, &vwide};
    acc_t* at = buffer.get();
    for (int i = 0; i < 9; ++i) {
      *slots[i] = at;
      at += sizes[i];
    }
    if constexpr (kBf16Dots) qb.reset(new uint16_t[std::min<int64_t>(max_rows, kMaxDotRows) * head_dim]);
#ifdef TOKENMILL_AMX_TILES
    if constexpr (kTileCapable) {
      if (max_rows > kMaxDotRows && tile_unit(head_dim)) {
        const int64_t padded_rows = (max_rows + 15) / 16 * 16;
        qtile.reset(new uint16_t[padded_rows * head_dim]);
        kpairs.reset(new uint32_t[head_dim / 2 * kTileKeyChunk]);
        vpairs.reset(new uint16_t[kTileKeyChunk * head_dim]);
        ptile.reset(new uint16_t[padded_rows * kTileKeyChunk]);
        pv.reset(new float[padded_rows * head_dim]);
      }
    }
#endif
  }

  // Whether many-row tiles of this input type and head_dim run on the AMX tile unit here.
  static bool tile_unit(int64_t head_dim) {
#ifdef TOKENMILL_AMX_TILES
    return kTileCapable && head_dim % 32 == 0 && tokenmill_amx::usable();
#else
    (void)head_dim;
    return false;
#endif
  }

  // Whether this workspace's many-row tiles run on the tile unit (its buffers exist).
  bool tile_capable() const {
#ifdef TOKENMILL_AMX_TILES
    return qtile != nullptr;
#else
    return false;
#endif
  }

  bool lanes() const { return rows > kMaxDotRows; }

  // Starts a tile of `rows_` rows whose row r sits at position first_pos + r / group; the caller
  // then fills the queries with set_query.
  void begin(int64_t rows_, int64_t first_pos, int64_t group) {
    rows = rows_;
    ldq = (rows + W - 1) / W * W;
    for (int64_t r = 0; r < ldq; ++r) {
      pos[r] = r < rows ? acc_t(first_pos + r / group) : std::numeric_limits<acc_t>::max();
      m[r] = std::numeric_limits<acc_t>::lowest();
      l[r] = 0;
    }
    std::fill(o, o + rows * head_dim_pad, acc_t(0));
    std::fill(q, q + ldq * head_dim_pad, acc_t(0));
  }

  void set_query(int64_t r, int64_t d, acc_t value) {
    if (lanes()) {
      q[d * ldq + r] = value;
    } else {
      q[r * head_dim_pad + d] = value;
    }
  }

  // Scores, masks and accumulates the n keys at positions c .. c+n-1 (keys/values set).
  void chunk(int64_t c, int64_t n, bool masked) {
#ifdef TOKENMILL_AMX_TILES
    if constexpr (kTileCapable) {
      if (tiles) return chunk_tiles(c, n, masked);
    }
#endif
    if (lanes()) {
      chunk_lanes(c, n, masked);
    } else {
      chunk_dots(c, n, masked);
    }
  }

  // Few rows: scores[row][key]; softmax vectorised over keys.
  __attribute__((noinline)) void chunk_dots(int64_t c, int64_t n, bool masked) {
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* sr = s + r * chunk_keys;
      const int64_t visible = masked ? std::clamp<int64_t>(int64_t(pos[r]) + 1 - c, 0, n) : n;
      if constexpr (kBf16Dots) {
#ifdef TOKENMILL_BF16_DOTS
        for (int64_t j = 0; j < visible; j += W)
          score_dots_bf16(qb.get() + r * head_dim, bf16_keys + j, visible - j, head_dim, score_scale, sr + j);
#endif
      } else {
        for (int64_t j = 0; j < visible; j += W)
          score_dots(q + r * head_dim_pad, keys + j, visible - j, head_dim, sr + j);
      }
    }
    softmax_rows(c, n, masked);
    if constexpr (kWiden) {
      accumulate_pv(o, head_dim_pad, s, chunk_keys, 1, pool_values, n, rows, head_dim, alpha);
    } else {
      accumulate_pv(o, head_dim_pad, s, chunk_keys, 1, values, n, rows, head_dim, alpha);
    }
  }

  // Scores s[row][key] (keys < n visible to the row) -> probabilities: masked keys and keys past n
  // become 0, the online softmax's max m, sum l and rescale factor alpha are updated per row.
  void softmax_rows(int64_t c, int64_t n, bool masked) {
    using Vec = Vectorized<acc_t>;
    const acc_t neg_inf = -std::numeric_limits<acc_t>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      acc_t* sr = s + r * chunk_keys;
      const int64_t visible = masked ? std::clamp<int64_t>(int64_t(pos[r]) + 1 - c, 0, n) : n;
      std::fill(sr + visible, sr + chunk_keys, neg_inf);
      Vec mx(m[r]);
      for (int64_t j = 0; j < chunk_keys; j += W) mx = at::vec::maximum(mx, Vec::loadu(sr + j));
      const acc_t m_new =
          at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return at::vec::maximum(x, y); }, mx);
      const Vec m_vec(m_new);
      Vec sum(acc_t(0));
      for (int64_t j = 0; j < chunk_keys; j += W) {
        const Vec e = (Vec::loadu(sr + j) - m_vec).exp_u20();
        e.store(sr + j);
        sum = sum + e;
      }
      alpha[r] = std::exp(m[r] - m_new);
      l[r] = l[r] * alpha[r] + at::vec::vec_reduce_all<acc_t>([](Vec x, Vec y) { return x + y; }, sum);
      m[r] = m_new;
    }
  }

#ifdef TOKENMILL_AMX_TILES
  // Many rows of bfloat16 on the AMX tile unit (the thread's tiles configured by configure_tiles):
  // S = Q.K^T and P.V as tile products with float32 accumulation, the softmax between them as in
  // chunk_dots (scores[row][key]); P is rounded to bfloat16 for P.V, as SDPA's bfloat16 path does.
  __attribute__((noinline)) void chunk_tiles(int64_t c, int64_t n, bool masked) {
    const int64_t blocks = (rows + 15) / 16, pairs = head_dim / 2;
    for (int64_t j = 0; j < kTileKeyChunk; ++j) {  // K^T in pairs; keys past n are zero (and masked)
      const uint16_t* key = j < n ? bf16_keys[j] : nullptr;
      for (int64_t p = 0; p < pairs; ++p) {
        uint32_t pair = 0;
        if (key != nullptr) std::memcpy(&pair, key + 2 * p, sizeof pair);
        kpairs[p * kTileKeyChunk + j] = pair;
      }
    }
    // V rows interleaved in key pairs: out[2d] = even[d], out[2d + 1] = odd[d], 32 d per two stores.
    static const __m512i low = [] {
      alignas(64) uint16_t index[32];
      for (int i = 0; i < 32; ++i) index[i] = uint16_t(i % 2 == 0 ? i / 2 : 32 + i / 2);
      return _mm512_load_si512(index);
    }();
    const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
    for (int64_t kp = 0; kp < kTileKeyChunk / 2; ++kp) {
      const auto* even = 2 * kp < n ? reinterpret_cast<const uint16_t*>(pool_values[2 * kp]) : nullptr;
      const auto* odd = 2 * kp + 1 < n ? reinterpret_cast<const uint16_t*>(pool_values[2 * kp + 1]) : nullptr;
      uint16_t* out = vpairs.get() + kp * head_dim * 2;
      for (int64_t d = 0; d < head_dim; d += 32) {
        const __m512i e = even != nullptr ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
        const __m512i o = odd != nullptr ? _mm512_loadu_si512(odd + d) : _mm512_setzero_si512();
        _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(e, low, o));
        _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(e, high, o));
      }
    }
    const int64_t kstride = kTileKeyChunk * int64_t(sizeof(uint32_t)), sstride = kTileKeyChunk * int64_t(sizeof(float));
    for (int64_t b = 0; b < blocks; ++b) {  // S: 16 rows x 32 keys per tile pair, 32 head_dim per step
      for (int64_t k0 = 0; k0 < kTileKeyChunk; k0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t step = 0; step < head_dim / 32; ++step) {
          _tile_loadd(4, qtile.get() + b * 16 * head_dim + step * 32, head_dim * int64_t(sizeof(uint16_t)));
          _tile_loadd(5, kpairs.get() + step * 16 * kTileKeyChunk + k0, kstride);
          _tile_loadd(6, kpairs.get() + step * 16 * kTileKeyChunk + k0 + 16, kstride);
          _tile_dpbf16ps(0, 4, 5);
          _tile_dpbf16ps(1, 4, 6);
        }
        _tile_stored(0, s + b * 16 * kTileKeyChunk + k0, sstride);
        _tile_stored(1, s + b * 16 * kTileKeyChunk + k0 + 16, sstride);
      }
    }
    const vec_t<float> scale = vbroadcast(score_scale);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t j = 0; j < kTileKeyChunk; j += 16) vstore(s + r * kTileKeyChunk + j, vload(s + r * kTileKeyChunk + j) * scale);
    }
    softmax_rows(c, n, masked);
    for (int64_t r = 0; r < blocks * 16; ++r) {  // P in bfloat16 (round to nearest even); zero pad rows
      for (int64_t j = 0; j < kTileKeyChunk; j += 32) {
        __m512i bits = _mm512_setzero_si512();
        if (r < rows) {
          const float* p = s + r * kTileKeyChunk + j;
          const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
          std::memcpy(&bits, &pair, sizeof bits);
        }
        _mm512_storeu_si512(ptile.get() + r * kTileKeyChunk + j, bits);
      }
    }
    const int64_t vstride = head_dim * 2 * int64_t(sizeof(uint16_t)), pvstride = head_dim * int64_t(sizeof(float));
    const int64_t pstride = kTileKeyChunk * int64_t(sizeof(uint16_t));
    for (int64_t b = 0; b < blocks; ++b) {  // P.V: 16 rows x 64 head_dim in four tiles, 32 keys per step
      float* out = pv.get() + b * 16 * head_dim;
      for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
        const int64_t nd = std::min<int64_t>(4, (head_dim - d0) / 16);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t k0 = 0; k0 < kTileKeyChunk; k0 += 32) {
          const uint16_t* v = vpairs.get() + (k0 / 2) * head_dim * 2 + d0 * 2;
          _tile_loadd(4, ptile.get() + b * 16 * kTileKeyChunk + k0, pstride);
          _tile_loadd(5, v, vstride);
          _tile_dpbf16ps(0, 4, 5);
          if (nd > 1) {
            _tile_loadd(6, v + 32, vstride);
            _tile_dpbf16ps(1, 4, 6);
          }
          if (nd > 2) {
            _tile_loadd(7, v + 64, vstride);
            _tile_dpbf16ps(2, 4, 7);
          }
          if (nd > 3) {
            _tile_loadd(5, v + 96, vstride);
            _tile_dpbf16ps(3, 4, 5);
          }
        }
        _tile_stored(0, out + d0, pvstride);
        if (nd > 1) _tile_stored(1, out + d0 + 16, pvstride);
        if (nd > 2) _tile_stored(2, out + d0 + 32, pvstride);
        if (nd > 3) _tile_stored(3, out + d0 + 48, pvstride);
      }
    }
    for (int64_t r = 0; r < rows; ++r) {  // O = alpha O + P.V
      const vec_t<float> a = vbroadcast(alpha[r]);
      for (int64_t d = 0; d < head_dim; d += 16) {
        vstore(o + r * head_dim_pad + d, vload(o + r * head_dim_pad + d) * a + vload(pv.get() + r * head_dim + d));
      }
    }
  }
#endif

  // Many rows: scores[key][row] from the lane micro-kernel; softmax vectorised over rows.
  __attribute__((noinline)) void chunk_lanes(int64_t c, int64_t n, bool masked) {
    using Vec = Vectorized<acc_t>;
    const int64_t vecs = ldq / W;
    for (int64_t v = 0; v < vecs; v += 4) {
      const acc_t* qt = q + v * W;
      acc_t* sv = s + v * W;
      switch (std::min<int64_t>(4, vecs - v)) {
        case 1: score_lanes_all<acc_t, 1>(qt, ldq, keys, n, head_dim, sv, ldq); break;
        case 2: score_lanes_all<acc_t, 2>(qt, ldq, keys, n, head_dim, sv, ldq); break;
        case 3: score_lanes_all<acc_t, 3>(qt, ldq, keys, n, head_dim, sv, ldq); break;
        default: score_lanes_all<acc_t, 4>(qt, ldq, keys, n, head_dim, sv, ldq); break;
      }
    }
    if (masked) {
      const Vec neg_inf(-std::numeric_limits<acc_t>::infinity());
      for (int64_t j = 0; j < n; ++j) {
        const Vec key_pos(acc_t(c + j));
        for (int64_t v = 0; v < vecs; ++v) {
          acc_t* sv = s + j * ldq + v * W;
          Vec::blendv(Vec::loadu(sv), neg_inf, key_pos > Vec::loadu(pos + v * W)).store(sv);
        }
      }
    }
    for (int64_t v = 0; v < vecs; ++v) {
      const Vec m_old = Vec::loadu(m + v * W);
      Vec m_new = m_old;
      for (int64_t j = 0; j < n; ++j) m_new = at::vec::maximum(m_new, Vec::loadu(s + j * ldq + v * W));
      Vec sum(acc_t(0));
      for (int64_t j = 0; j < n; ++j) {
        acc_t* sv = s + j * ldq + v * W;
        const Vec e = (Vec::loadu(sv) - m_new).exp_u20();
        e.store(sv);
        sum = sum + e;
      }
      const Vec a = (m_old - m_new).exp();
      a.store(alpha + v * W);
      at::vec::fmadd(Vec::loadu(l + v * W), a, sum).store(l + v * W);
      m_new.store(m + v * W);
    }
    accumulate_pv(o, head_dim_pad, s, 1, ldq, values, n, rows, head_dim, alpha);
  }
};

// ---------------------------------------------------------------------------------------------
// The op.

struct Tile {
  int64_t seq;        // sequence index
  int64_t tok_begin;  // first query token (row of `query`)
  int64_t num_tok;    // query tokens in the tile
  int64_t first_pos;  // context position of tok_begin
};

struct Item {
  int64_t tile;
  int64_t kv_begin, kv_end;    // kv heads [kv_begin, kv_end)
  int64_t key_begin, key_end;  // key positions [key_begin, key_end)
  int64_t partial;             // -1: writes the output; else the partial slot of kv_begin (then +1 per head)
  int64_t cost;
};

struct Merge {
  int64_t tile;
  int64_t kv_head;
  int64_t first_partial, num_parts, part_stride;  // slots first + p * part_stride, p < num_parts
};

template <typename scalar_t, typename acc_t>
class PagedAttention {
  static constexpr int64_t W = kLanes<acc_t>;
  static constexpr bool kWiden = Workspace<scalar_t, acc_t>::kWiden;
  static constexpr bool kBf16Dots = Workspace<scalar_t, acc_t>::kBf16Dots;

 public:
  PagedAttention(const Tensor& query, const Tensor& key_cache, const Tensor& value_cache, const Tensor& block_tables,
                 const Tensor& seq_lens, const Tensor& query_start_loc, double scale, Tensor& out)
      : q_(static_cast<const scalar_t*>(query.const_data_ptr())),
        q_tok_stride_(query.stride(0)),
        q_head_stride_(query.stride(1)),
        k_(static_cast<const scalar_t*>(key_cache.const_data_ptr())),
        v_(static_cast<const scalar_t*>(value_cache.const_data_ptr())),
        k_strides_{key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)},
        v_strides_{value_cache.stride(0), value_cache.stride(1), value_cache.stride(2)},
        tables_(static_cast<const int32_t*>(block_tables.const_data_ptr())),
        table_stride_(block_tables.stride(0)),
        out_(static_cast<scalar_t*>(out.mutable_data_ptr())),
        num_heads_(query.size(1)),
        num_kv_heads_(key_cache.size(2)),
        group_(num_heads_ / num_kv_heads_),
        head_dim_(query.size(2)),
        head_dim_pad_((head_dim_ + W - 1) / W * W),
        block_size_(key_cache.size(1)),
        scale_(static_cast<acc_t>(scale)) {
    plan(key_cache.size(0), block_tables.size(1), static_cast<const int32_t*>(seq_lens.const_data_ptr()),
         static_cast<const int32_t*>(query_start_loc.const_data_ptr()), block_tables.size(0));
  }

  void run() {
    if (items_.empty()) return;
    partials_.reset(new acc_t[std::max<int64_t>(1, num_partials_ * partial_stride())]);
    std::atomic<int64_t> next_item{0};
    run_threads(threads_, [&](int64_t, int64_t) {
      std::vector<Workspace<scalar_t, acc_t>> ws;
      for (int64_t h = 0; h < max_heads_per_item_; ++h) ws.emplace_back(max_rows_, head_dim_);
      // Each thread claims its next item before running the current one, so that it can prefetch
      // that item's first chunk.
      const int64_t count = int64_t(items_.size());
      for (int64_t i = next_item.fetch_add(1, std::memory_order_relaxed); i < count;) {
        const int64_t following = next_item.fetch_add(1, std::memory_order_relaxed);
        run_item(items_[i], following < count ? &items_[following] : nullptr, ws.data());
        i = following;
      }
    });
    if (merges_.empty()) return;
    std::atomic<int64_t> next_merge{0};
    run_threads(std::min<int64_t>(threads_, merges_.size()), [&](int64_t, int64_t) {
      std::vector<acc_t> row(head_dim_pad_);
      for (int64_t i; (i = next_merge.fetch_add(1, std::memory_order_relaxed)) < int64_t(merges_.size());)
        merge(merges_[i], row.data());
    });
  }

 private:
  int64_t partial_stride() const { return max_rows_ * (head_dim_pad_ + 2); }  // m, l, o[head_dim_pad]

  void plan(int64_t num_blocks, int64_t table_width, const int32_t* seq_lens, const int32_t* qsl,
            int64_t num_seqs) {
    // Rows per tile: 4 vectors for the lane micro-kernel when a sequence has many query tokens
    // (16 for the AMX tile unit, where each chunk's K/V re-layout serves every row of the tile);
    // decodes are one token, i.e. `group_` rows.
    const int64_t tile_vectors = Workspace<scalar_t, acc_t>::tile_unit(head_dim_) ? 16 : 4;
    const int64_t tile_tokens = std::max<int64_t>(1, tile_vectors * W / group_);
    for (int64_t s = 0; s < num_seqs; ++s) {
      const int64_t q_begin = qsl[s], q_end = qsl[s + 1], context = seq_lens[s];
      const int64_t q_len = q_end - q_begin;
      STD_TORCH_CHECK(q_len >= 0, "query_start_loc must be non-decreasing");
      STD_TORCH_CHECK(context >= q_len, "seq_lens[", s, "] = ", context, " is shorter than its ", q_len,
                      " query tokens");
      if (q_len == 0) continue;
      const int64_t used_blocks = (context + block_size_ - 1) / block_size_;
      STD_TORCH_CHECK(used_blocks <= table_width, "block_tables has ", table_width, " columns; sequence ", s,
                      " needs ", used_blocks);
      for (int64_t b = 0; b < used_blocks; ++b) {
        const int32_t id = tables_[s * table_stride_ + b];
        STD_TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " of sequence ", s, " is out of range");
      }
      for (int64_t t = q_begin; t < q_end; t += tile_tokens) {
        const int64_t n = std::min(tile_tokens, q_end - t);
        tiles_.push_back({s, t, n, context - q_len + (t - q_begin)});
        max_rows_ = std::max(max_rows_, n * group_);
      }
    }
    // Few-row tiles (decodes) take all kv heads in one item, so that each block is read front to
    // back (the rows of one kv head are strided); many-row tiles take one kv head per item.
    const auto heads_per_item = [&](const Tile& tile) {
      return tile.num_tok * group_ <= kMaxDotRows ? num_kv_heads_ : int64_t(1);
    };
    int64_t total_keys = 0, work = 0;  // keys summed over would-be items; rows x keys x head_dim
    for (const Tile& tile : tiles_) {
      const int64_t keys = tile.first_pos + tile.num_tok;
      total_keys += keys * (num_kv_heads_ / heads_per_item(tile));
      work += keys * tile.num_tok * num_heads_ * head_dim_;
    }
    threads_ = work < kSerialWork ? 1 : torch::stable::get_num_threads();
    // Flash-decoding split: with several threads, cut long key ranges so that there are at least
    // ~4 items per thread.
    const int64_t max_keys =
        threads_ > 1 ? std::max(kMinPartition, (total_keys + 4 * threads_ - 1) / (4 * threads_))
                     : std::numeric_limits<int64_t>::max();
    for (int64_t t = 0; t < int64_t(tiles_.size()); ++t) {
      const Tile& tile = tiles_[t];
      const int64_t keys = tile.first_pos + tile.num_tok;
      const int64_t pieces = (keys - 1) / max_keys + 1;  // keys >= 1
      const int64_t part_len = ((keys + pieces - 1) / pieces + kKeyChunk - 1) / kKeyChunk * kKeyChunk;
      const int64_t parts = (keys + part_len - 1) / part_len;
      const int64_t rows = tile.num_tok * group_, heads = heads_per_item(tile);
      max_heads_per_item_ = std::max(max_heads_per_item_, heads);
      for (int64_t h = 0; h < num_kv_heads_; h += heads) {
        const int64_t first = num_partials_;
        if (parts > 1) {
          for (int64_t k = h; k < h + heads; ++k) merges_.push_back({t, k, first + (k - h), parts, heads});
          num_partials_ += parts * heads;
        }
        for (int64_t p = 0; p < parts; ++p) {
          const int64_t begin = p * part_len, end = std::min(keys, begin + part_len);
          // Rows at positions below `begin` see no key here: their partial stays empty (l = 0).
          items_.push_back(
              {t, h, h + heads, begin, end, parts > 1 ? first + p * heads : -1, (end - begin) * (rows + 8) * heads});
        }
      }
    }
    std::stable_sort(items_.begin(), items_.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  }

  // Pointers to the kv-head-0 K/V rows of positions [begin, begin + n) of one sequence.
  void locate(const Tile& tile, int64_t begin, int64_t n, const scalar_t** keys, const scalar_t** values) const {
    const int32_t* table = tables_ + tile.seq * table_stride_;
    int64_t block = begin / block_size_, slot = begin % block_size_;
    for (int64_t j = 0; j < n; ++j, ++slot) {
      if (slot == block_size_) {
        slot = 0;
        ++block;
      }
      keys[j] = k_ + table[block] * k_strides_[0] + slot * k_strides_[1];
      values[j] = v_ + table[block] * v_strides_[0] + slot * v_strides_[1];
    }
  }

  // Into L2 (prefetcht1), not L1: a float32 chunk's K + V (48 KB for 3 kv heads x 64) is more than
  // a 32 KB L1 (a Zen 4's), so fetching the next chunk into L1 evicted the current one; with the L2
  // hint decode calls with the pool in memory run much faster there, and about the same on a CPU
  // with a 48 KB L1.
  void prefetch(const scalar_t* const* rows, int64_t n, int64_t head_stride, int64_t kv_begin, int64_t kv_end) const {
    const int64_t bytes = head_dim_ * int64_t(sizeof(scalar_t));
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t h = kv_begin; h < kv_end; ++h) {
        const char* row = reinterpret_cast<const char*>(rows[j] + h * head_stride);
        for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
      }
    }
  }

  void widen(const scalar_t* src, acc_t* dst) const {
    int64_t d = 0;
    if constexpr (std::is_same_v<acc_t, float> && at::vec::is_reduced_floating_point_v<scalar_t>) {
      using Vec = Vectorized<float>;
      for (; d + Vec::size() <= head_dim_; d += Vec::size()) {
        Vec x;
        at::vec::load_to_float(src + d, x);
        x.store(dst + d);
      }
    }
    for (; d < head_dim_; ++d) dst[d] = static_cast<acc_t>(src[d]);
  }

  void run_item(const Item& item, const Item* follow, Workspace<scalar_t, acc_t>* ws) const {
    const Tile& tile = tiles_[item.tile];
    const int64_t rows = tile.num_tok * group_, heads = item.kv_end - item.kv_begin;
    const bool bf16_dots = kBf16Dots && rows <= kMaxDotRows;
    // Many-row bfloat16 tiles go to the AMX tile unit where there is one.
    const bool tiles = rows > kMaxDotRows && ws[0].tile_capable();
    const bool values_in_pool = kWiden && (rows <= kMaxDotRows || tiles);
    const int64_t chunk = tiles ? kTileKeyChunk : kKeyChunk;
    for (int64_t h = 0; h < heads; ++h) {
      ws[h].begin(rows, tile.first_pos, group_);
      ws[h].score_scale = scale_;
      uint16_t* bf16_rows = nullptr;  // where the queries go unscaled in bfloat16, if they do
      if (bf16_dots) bf16_rows = ws[h].qb.get();
      ws[h].chunk_keys = chunk;
#ifdef TOKENMILL_AMX_TILES
      ws[h].tiles = tiles;
      if (tiles) {
        bf16_rows = ws[h].qtile.get();
        std::fill(bf16_rows + rows * head_dim_, bf16_rows + (rows + 15) / 16 * 16 * head_dim_, uint16_t(0));
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const scalar_t* src = q_ + (tile.tok_begin + r / group_) * q_tok_stride_ +
                              ((item.kv_begin + h) * group_ + r % group_) * q_head_stride_;
        if (bf16_rows != nullptr) {
          std::memcpy(bf16_rows + r * head_dim_, src, head_dim_ * sizeof(uint16_t));
        } else {
          for (int64_t d = 0; d < head_dim_; ++d) ws[h].set_query(r, d, static_cast<acc_t>(src[d]) * scale_);
        }
      }
    }
#ifdef TOKENMILL_AMX_TILES
    if (tiles) configure_tiles();
#endif
    // Row pointers of the current chunk and of the one prefetched while it runs: the item's next
    // chunk, or after its last the first chunk of `follow`, the item this thread runs next.
    const scalar_t* raw_keys[2][kMaxKeyChunk];
    const scalar_t* raw_values[2][kMaxKeyChunk];
    int cur = 0;
    locate(tile, item.key_begin, std::min(chunk, item.key_end - item.key_begin), raw_keys[0], raw_values[0]);
    const int64_t first_masked = tile.first_pos + 1;  // keys from here on are masked for some row
    for (int64_t c = item.key_begin; c < item.key_end; c += chunk) {
      const int64_t n = std::min(chunk, item.key_end - c);
      const Item* ahead = c + n < item.key_end ? &item : follow;
      const int64_t ahead_begin = ahead == &item ? c + n : ahead != nullptr ? ahead->key_begin : 0;
      const int64_t ahead_n = ahead != nullptr ? std::min(chunk, ahead->key_end - ahead_begin) : 0;
      const int64_t ahead_heads = ahead != nullptr ? ahead->kv_end - ahead->kv_begin : 0;
      if (ahead_n > 0) locate(tiles_[ahead->tile], ahead_begin, ahead_n, raw_keys[1 - cur], raw_values[1 - cur]);
      // NOTE: with prefetches into L1, a bigger chunk (many kv heads x long rows) ran slower
      // than none: the burst stalled the core on fill buffers while the hardware prefetcher already
      // streamed the contiguous per-slot spans. The prefetches are spread over the chunk's heads
      // (faster bfloat16 decodes than one burst).
      const bool prefetch_ahead =
          ahead_n > 0 && 2 * chunk * ahead_heads * head_dim_ * int64_t(sizeof(scalar_t)) <= kPrefetchBytes;
      for (int64_t h = 0; h < heads; ++h) {
        if (prefetch_ahead) {
          const int64_t from = ahead->kv_begin + h * ahead_heads / heads;
          const int64_t to = ahead->kv_begin + (h + 1) * ahead_heads / heads;
          prefetch(raw_keys[1 - cur], ahead_n, k_strides_[2], from, to);
          prefetch(raw_values[1 - cur], ahead_n, v_strides_[2], from, to);
        }
        Workspace<scalar_t, acc_t>& w = ws[h];
        const int64_t k_off = (item.kv_begin + h) * k_strides_[2], v_off = (item.kv_begin + h) * v_strides_[2];
        for (int64_t j = 0; j < n; ++j) {
          if constexpr (kWiden) {
            if (bf16_dots || tiles) {
              w.bf16_keys[j] = reinterpret_cast<const uint16_t*>(raw_keys[cur][j] + k_off);
            } else {
              widen(raw_keys[cur][j] + k_off, w.kwide + j * head_dim_pad_);
            }
            if (values_in_pool) {
              w.pool_values[j] = raw_values[cur][j] + v_off;
            } else {
              widen(raw_values[cur][j] + v_off, w.vwide + j * head_dim_pad_);
              w.values[j] = w.vwide + j * head_dim_pad_;
            }
            w.keys[j] = w.kwide + j * head_dim_pad_;
          } else {
            w.keys[j] = raw_keys[cur][j] + k_off;
            w.values[j] = raw_values[cur][j] + v_off;
          }
        }
        w.chunk(c, n, c + n > first_masked);
      }
      cur = 1 - cur;
    }
#ifdef TOKENMILL_AMX_TILES
    if (tiles) _tile_release();
#endif
    for (int64_t h = 0; h < heads; ++h) {
      if (item.partial < 0) {
        write_rows(tile, item.kv_begin + h, ws[h].o, ws[h].l);
      } else {
        acc_t* slot = partials_.get() + (item.partial + h) * partial_stride();
        std::copy(ws[h].m, ws[h].m + rows, slot);
        std::copy(ws[h].l, ws[h].l + rows, slot + max_rows_);
        std::copy(ws[h].o, ws[h].o + rows * head_dim_pad_, slot + 2 * max_rows_);
      }
    }
  }

  scalar_t* out_row(const Tile& tile, int64_t kv_head, int64_t r) const {
    return out_ + ((tile.tok_begin + r / group_) * num_heads_ + kv_head * group_ + r % group_) * head_dim_;
  }

  // out[token][head] = o[row] / l[row] for every row of a tile.
  void write_rows(const Tile& tile, int64_t kv_head, const acc_t* o, const acc_t* l) const {
    for (int64_t r = 0, rows = tile.num_tok * group_; r < rows; ++r) {
      scalar_t* dst = out_row(tile, kv_head, r);
      const acc_t* src = o + r * head_dim_pad_;
      for (int64_t d = 0; d < head_dim_; ++d) dst[d] = static_cast<scalar_t>(src[d] / l[r]);
    }
  }

  // Combines the partitions of one (tile, kv head).
  void merge(const Merge& mg, acc_t* row) const {
    using Vec = Vectorized<acc_t>;
    const Tile& tile = tiles_[mg.tile];
    const int64_t rows = tile.num_tok * group_, stride = mg.part_stride * partial_stride();
    const acc_t* first = partials_.get() + mg.first_partial * partial_stride();
    for (int64_t r = 0; r < rows; ++r) {
      acc_t m = std::numeric_limits<acc_t>::lowest();
      for (int64_t p = 0; p < mg.num_parts; ++p) m = std::max(m, first[p * stride + r]);
      acc_t l = 0;
      std::fill(row, row + head_dim_pad_, acc_t(0));
      for (int64_t p = 0; p < mg.num_parts; ++p) {
        const acc_t* part = first + p * stride;
        const acc_t w = std::exp(part[r] - m);
        l += w * part[max_rows_ + r];
        const acc_t* o = part + 2 * max_rows_ + r * head_dim_pad_;
        for (int64_t d = 0; d < head_dim_pad_; d += W)
          at::vec::fmadd(Vec(w), Vec::loadu(o + d), Vec::loadu(row + d)).store(row + d);
      }
      scalar_t* dst = out_row(tile, mg.kv_head, r);
      for (int64_t d = 0; d < head_dim_; ++d) dst[d] = static_cast<scalar_t>(row[d] / l);
    }
  }

  const scalar_t* q_;
  int64_t q_tok_stride_, q_head_stride_;
  const scalar_t* k_;
  const scalar_t* v_;
  int64_t k_strides_[3], v_strides_[3];  // block, slot, kv head
  const int32_t* tables_;
  int64_t table_stride_;
  scalar_t* out_;
  int64_t num_heads_, num_kv_heads_, group_, head_dim_, head_dim_pad_, block_size_;
  acc_t scale_;

  std::vector<Tile> tiles_;
  std::vector<Item> items_;
  std::vector<Merge> merges_;
  int64_t threads_ = 1;
  int64_t max_rows_ = 0;
  int64_t max_heads_per_item_ = 1;
  int64_t num_partials_ = 0;
  std::unique_ptr<acc_t[]> partials_;  // per slot: m[max_rows], l[max_rows], o[max_rows][head_dim_pad]
};

Tensor paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, Tensor seq_lens,
                       Tensor query_start_loc, double scale) {
  STD_TORCH_CHECK(query.dim() == 3, "query must be [tokens, heads, head_dim]");
  STD_TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
                  "key_cache and value_cache must be [blocks, block_size, kv_heads, head_dim]");
  for (int64_t d = 0; d < 4; ++d) {
    STD_TORCH_CHECK(key_cache.size(d) == value_cache.size(d), "key_cache and value_cache shapes differ");
  }
  STD_TORCH_CHECK(query.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu(),
                  "paged_attention (CPU kernel) needs CPU tensors");
  STD_TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() && value_cache.scalar_type() == query.scalar_type(),
                  "query, key_cache and value_cache must share a dtype");
  STD_TORCH_CHECK(query.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                  "the head_dim axis must be contiguous");
  STD_TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim of query and cache differ");
  STD_TORCH_CHECK(key_cache.size(1) > 0 && key_cache.size(2) > 0 && query.size(1) % key_cache.size(2) == 0,
                  "num_heads must be a multiple of num_kv_heads");
  for (const Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    STD_TORCH_CHECK(t->scalar_type() == ScalarType::Int && t->is_cpu(),
                    "block_tables, seq_lens and query_start_loc must be int32 CPU tensors");
  }
  STD_TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1,
                  "block_tables must be [seqs, max_blocks] with contiguous rows");
  STD_TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0),
                  "seq_lens must be [seqs]");
  STD_TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.is_contiguous() &&
                      query_start_loc.size(0) == seq_lens.size(0) + 1,
                  "query_start_loc must be [seqs + 1]");
  const int64_t num_seqs = seq_lens.size(0);
  const int32_t* qsl = static_cast<const int32_t*>(query_start_loc.const_data_ptr());
  STD_TORCH_CHECK(qsl[0] == 0 && qsl[num_seqs] == query.size(0),
                  "query_start_loc must run from 0 to the number of query tokens");
  Tensor out = torch::stable::new_empty(query, {query.size(0), query.size(1), query.size(2)});
  const auto run = [&](auto scalar, auto acc) {
    using scalar_t = decltype(scalar);
    using acc_t = decltype(acc);
    PagedAttention<scalar_t, acc_t>(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                                    out)
        .run();
  };
  switch (query.scalar_type()) {
    case ScalarType::Float: run(float{}, float{}); break;
    case ScalarType::Double: run(double{}, double{}); break;
    case ScalarType::BFloat16: run(c10::BFloat16{}, float{}); break;
    case ScalarType::Half: run(c10::Half{}, float{}); break;
    default: STD_TORCH_CHECK(false, "paged_attention supports float32, float64, bfloat16 and float16");
  }
  return out;
}

// key_cache[slot / block_size, slot % block_size] = key[t] (and the same for values), for
// slot = slot_mapping[t]; negative slots are skipped.
void reshape_and_cache(Tensor key, Tensor value, Tensor key_cache, Tensor value_cache, Tensor slot_mapping) {
  STD_TORCH_CHECK(key.dim() == 3 && value.dim() == 3, "key and value must be [tokens, kv_heads, head_dim]");
  STD_TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4,
                  "key_cache and value_cache must be [blocks, block_size, kv_heads, head_dim]");
  STD_TORCH_CHECK(key.is_cpu() && value.is_cpu() && key_cache.is_cpu() && value_cache.is_cpu() && slot_mapping.is_cpu(),
                  "reshape_and_cache (CPU kernel) needs CPU tensors");
  for (int64_t d = 0; d < 3; ++d) {
    STD_TORCH_CHECK(key.size(d) == value.size(d), "key and value shapes differ");
  }
  for (int64_t d = 0; d < 4; ++d) {
    STD_TORCH_CHECK(key_cache.size(d) == value_cache.size(d), "key_cache and value_cache shapes differ");
  }
  STD_TORCH_CHECK(key.size(1) == key_cache.size(2) && key.size(2) == key_cache.size(3),
                  "key rows do not match the cache's [kv_heads, head_dim]");
  STD_TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() && value.scalar_type() == key_cache.scalar_type() &&
                      value_cache.scalar_type() == key_cache.scalar_type(),
                  "key, value and the caches must share a dtype");
  STD_TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && key_cache.stride(3) == 1 && value_cache.stride(3) == 1,
                  "the head_dim axis must be contiguous");
  STD_TORCH_CHECK(slot_mapping.scalar_type() == ScalarType::Long && slot_mapping.dim() == 1 &&
                      slot_mapping.is_contiguous() && slot_mapping.size(0) == key.size(0),
                  "slot_mapping must be int64 [tokens]");
  const int64_t tokens = key.size(0), heads = key.size(1), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t row_bytes = key.size(2) * int64_t(key.element_size());
  const int64_t* slots = static_cast<const int64_t*>(slot_mapping.const_data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    STD_TORCH_CHECK(slots[t] < num_slots, "slot ", slots[t], " is out of range");
  }
  const char* src[2] = {static_cast<const char*>(key.const_data_ptr()), static_cast<const char*>(value.const_data_ptr())};
  char* dst[2] = {static_cast<char*>(key_cache.mutable_data_ptr()), static_cast<char*>(value_cache.mutable_data_ptr())};
  // Byte strides, read once (each accessor is a call through the stable C ABI).
  const int64_t item = int64_t(key.element_size());
  const int64_t src_stride[2][2] = {{key.stride(0) * item, key.stride(1) * item},
                                    {value.stride(0) * item, value.stride(1) * item}};
  const int64_t dst_stride[2][3] = {
      {key_cache.stride(0) * item, key_cache.stride(1) * item, key_cache.stride(2) * item},
      {value_cache.stride(0) * item, value_cache.stride(1) * item, value_cache.stride(2) * item}};
  const auto slot_row = [&](int kv, int64_t slot) {
    return dst[kv] + slot / block_size * dst_stride[kv][0] + slot % block_size * dst_stride[kv][1];
  };
  // The destination slots are scattered over the pool, so nearly every store misses the cache:
  // prefetching (for writing) the slots a few tokens ahead overlaps those misses.
  constexpr int64_t kAhead = 4;
  const auto copy_rows = [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (t + kAhead < end && slots[t + kAhead] >= 0) {
        for (int kv = 0; kv < 2; ++kv) {
          const char* row = slot_row(kv, slots[t + kAhead]);
          for (int64_t h = 0; h < heads; ++h)
            for (int64_t byte = 0; byte < row_bytes; byte += 64) __builtin_prefetch(row + h * dst_stride[kv][2] + byte, 1);
        }
      }
      if (slots[t] < 0) continue;
      for (int kv = 0; kv < 2; ++kv) {
        char* row = slot_row(kv, slots[t]);
        const char* from = src[kv] + t * src_stride[kv][0];
        for (int64_t h = 0; h < heads; ++h)
          std::memcpy(row + h * dst_stride[kv][2], from + h * src_stride[kv][1], row_bytes);
      }
    }
  };
  if (tokens * heads * row_bytes < (1 << 18)) {
    copy_rows(0, tokens);  // a parallel region would cost more than the copy
  } else {
    torch::stable::parallel_for(0, tokens, 16, copy_rows);
  }
}

}  // namespace

STABLE_TORCH_LIBRARY(tokenmill, m) {
  m.def(
      "paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale) -> Tensor");
  m.def(
      "reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
      "Tensor slot_mapping) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_attention", TORCH_BOX(&paged_attention));
  m.impl("reshape_and_cache", TORCH_BOX(&reshape_and_cache));
}
