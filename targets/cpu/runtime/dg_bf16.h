// dg_bf16.h: the products by a weight of a model generated with --precision bf16.
//
// Both operands of such a product are bfloat16 values (transforms/precision.py
// rounds them: dg::round_bf16, dg_precision.h), so the product can run on the
// CPU's bf16 instructions, which multiply pairs of bf16 values exactly and add
// them into float32 sums:
//
//   amx          AMX tiles (tdpbf16ps: a 16 x 16 block of sums, 32 products
//                each, per instruction), for 16 rows or more
//   avx512_bf16  vdpbf16ps (16 sums, two products each, per instruction)
//   float32      where the CPU has neither: the rounded operands multiplied
//                in float32 by dg::gemm (the kept packing of the rounded
//                weight, dg_packed_weights.h)
//
// bf16_kernel() names the one a product of M rows runs. Every path multiplies
// the same bf16 values exactly; the sums differ only in the order of the float32
// additions (vdpbf16ps and tdpbf16ps add each pair before the running sum, and
// treat float32 subnormals as zero), a few float32 ulps of the sum.
//
// KeptBf16Weight is the Model's member for one weight: the weight rounded and
// packed in bf16 once per change of the parameters (dg::ParameterVersion), as
// a KeptPackedB keeps an fp32 packing; matmul_bf16 by it chooses the path.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "dg_amx.h"
#include "dg_arena.h"
#include "dg_gemm.h"
#include "dg_packed_weights.h"
#include "dg_parallel.h"
#include "dg_precision.h"
#include "dg_tensor.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DG_BF16_PRODUCTS 1
#include <immintrin.h>
#else
#define DG_BF16_PRODUCTS 0
#endif

namespace dg {

// The bf16 bits of x rounded to bfloat16 (ties to even): its float32's top half.
inline uint16_t bf16_bits(float x) {
  const float y = round_bf16_value(x);
  uint32_t bits;
  std::memcpy(&bits, &y, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

// The rows an AMX block covers at once and the k one tile holds.
constexpr int64_t kBf16TileRows = 16;
constexpr int64_t kBf16TileK = 32;

// A weight as the bf16 products read it: op(W) is [K, N], cut into panels of 16
// columns; in a panel, for each pair of k (2g, 2g + 1), the 16 columns' two bf16
// values side by side (64 bytes): what vdpbf16ps multiplies with a broadcast pair
// of the activation row, and what an AMX tile of 16 such rows (32 k) holds as
// its right operand. k is padded with zeros to whole tiles, columns to whole
// panels.
struct Bf16PackedB {
  static constexpr int64_t kCols = 16;

  // Zeros, [K, N].
  Bf16PackedB(int64_t K_, int64_t N_)
      : K(K_),
        N(N_),
        pairs((K_ + kBf16TileK - 1) / kBf16TileK * kBf16TileK / 2),
        panels((N_ + kCols - 1) / kCols),
        data(static_cast<size_t>(panels * pairs * kCols * 2), 0) {}
  // w stored [K, N], or [N, K] when tb (a PyTorch Linear weight); each value is
  // rounded to bf16 as it is packed.
  Bf16PackedB(const float* w, bool tb, int64_t K_, int64_t N_) : Bf16PackedB(K_, N_) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < N; ++j)
        data[static_cast<size_t>(at(k, j))] = bf16_bits(tb ? w[j * K + k] : w[k * N + j]);
  }

  int64_t K, N, pairs, panels;
  std::vector<uint16_t, LineAligned<uint16_t>> data;  // (panel rows on cache lines)

  int64_t at(int64_t k, int64_t j) const {
    return ((j / kCols * pairs + k / 2) * kCols + j % kCols) * 2 + k % 2;
  }
  const uint16_t* panel(int64_t p) const { return data.data() + p * pairs * kCols * 2; }
  uint16_t* panel(int64_t p) { return data.data() + p * pairs * kCols * 2; }
  int64_t bytes() const { return static_cast<int64_t>(data.size() * sizeof(uint16_t)); }
};

// From 3 rows on, tiles beat vdpbf16ps (784 x 512, one thread, Xeon with AMX: 3
// rows 0.021 vs 0.028 ms, 12 rows 0.023 vs 0.098); at 1-2 rows the tiles' 16 rows
// are mostly padding (1 row 0.020 vs 0.014 ms).
constexpr int64_t kBf16AmxRows = 3;
// Whether a product of M rows runs on AMX tiles.
inline bool bf16_uses_amx(int64_t M) {
  return M >= kBf16AmxRows && amx_ready();
}

// The path a product of M rows takes (see the top of this file).
inline const char* bf16_kernel(int64_t M = kBf16TileRows) {
#if DG_BF16_PRODUCTS
  return bf16_uses_amx(M) ? "amx" : "avx512_bf16";
#else
  (void)M;
  return "float32";
#endif
}

// The width (values) of a bf16 activation row that b multiplies, and the rows of
// such a matrix of M rows: padded to whole tiles with zeros.
inline int64_t bf16_row_width(const Bf16PackedB& b) {
  return b.pairs * 2;
}
inline int64_t bf16_padded_rows(int64_t M) {
  return (M + kBf16TileRows - 1) / kBf16TileRows * kBf16TileRows;
}

// A product's output handed over to the one bf16 product that reads it as its
// activation, and nothing else does (ops/linalg.py, handed_over): where the CPU
// has bf16 products it is written only as that reader's pack_rows would write
// it, rows of bf16_handed_width(N) values laid out as bf16_tiled_at says, rows
// up to whole tiles, zeros in the padding, and its float32 output is left
// unwritten (BERT's GELU'd FFN rows, 25 MB at batch 64, went out to memory and
// were read back by the next product's pack_rows); elsewhere the float32 output
// is written as usual. data null: no such output.
struct Bf16Rows {
  uint16_t* data = nullptr;
};

// The activation of a bf16 product that another one handed over (Bf16Rows): its
// bf16 rows where the CPU has bf16 products, its float32 values where not.
struct Bf16RowsIn {
  const float* values;
  const uint16_t* rows;
};

// An arena piece (float*) holding bf16 bits.
inline uint16_t* bf16_data(float* p) {
  return reinterpret_cast<uint16_t*>(p);
}
inline const uint16_t* bf16_data(const float* p) {
  return reinterpret_cast<const uint16_t*>(p);
}

// The width of the rows a product with N columns hands over (Bf16Rows): N
// rounded up to whole tiles of k, as the reader's bf16_row_width is.
inline int64_t bf16_handed_width(int64_t N) {
  return (N + kBf16TileK - 1) / kBf16TileK * kBf16TileK;
}

// Where the left operand of bf16_products (M rows of `width` bf16 values) holds
// value k of row r: tile after tile (16 rows x 32 values, 1 KB, rows of 64 bytes
// side by side), the tiles of 16 rows in order of k, then the next 16 rows. An
// AMX tile is then one contiguous kilobyte (loads from L2 that stream; rows
// `width` apart took ~3x longer at 64 rows x 784), and a row's k pair is 4 bytes.
inline int64_t bf16_tiled_at(int64_t width, int64_t r, int64_t k) {
  return ((r / kBf16TileRows * (width / kBf16TileK) + k / kBf16TileK) * kBf16TileRows + r % kBf16TileRows) *
             kBf16TileK +
         k % kBf16TileK;
}

#if DG_BF16_PRODUCTS
namespace bf16_detail {

// 16 floats (the first n: masked) as bf16, each followed by the same lane of
// `second`: the 32 values of one k pair of a panel row (16 columns x 2).
inline __m512i bf16_pairs(const float* first, const float* second, __mmask16 mask) {
  const __m512 lo = _mm512_maskz_loadu_ps(mask, first);
  const __m512 hi = second != nullptr ? _mm512_maskz_loadu_ps(mask, second) : _mm512_setzero_ps();
  const __m512bh both = _mm512_cvtne2ps_pbh(hi, lo);  // lanes 0-15: first, 16-31: second
  __m512i bits;
  std::memcpy(&bits, &both, sizeof bits);
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, bits);
}

}  // namespace bf16_detail

// k pair `pair` (k = 2 pair, 2 pair + 1) of columns [c0, c0 + n) of b = first[j]
// and second[j] (second null: zeros, past K), as bf16 (rounded to nearest even),
// up to 16 columns at a time (pack_b: a weight, or an operand packed per call).
inline void pack_pair_bf16(const float* first, const float* second, int64_t n, Bf16PackedB& b, int64_t c0,
                           int64_t pair) {
  for (int64_t j = 0; j < n;) {
    const int64_t c = c0 + j, at = c % Bf16PackedB::kCols;
    const int64_t len = std::min(Bf16PackedB::kCols - at, n - j);
    const __m512i pairs = bf16_detail::bf16_pairs(first + j, second != nullptr ? second + j : nullptr,
                                                  static_cast<__mmask16>((1u << len) - 1u));
    uint16_t* to = b.panel(c / Bf16PackedB::kCols) + (pair * Bf16PackedB::kCols + at) * 2;
    _mm512_mask_storeu_epi16(to, static_cast<__mmask32>((uint64_t(1) << (2 * len)) - 1u), pairs);
    j += len;
  }
}

namespace bf16_detail {

// Operations (threads_for) one value converted and moved by pack_rows counts for
// (dg_conv.h's kCopyWork for a float moved).
constexpr int64_t kPackWork = 8;

// The activation a [M, K] (row stride lda) as bf16 tiles (bf16_tiled_at), zeros
// past K and in the rows up to whole tiles: tile after tile, each row's 32 values
// rounded to nearest even (as bf16_bits) into one 64-byte store, every value
// written once (no zeroing of the whole first). 2048 x 3072, one thread: 3.7 ->
// 2.3 ms (zeroing, then two masked 32-byte stores per row and tile). Row tiles
// are shared out over threads (on one, it was 7% of a 2-thread bf16 BERT at
// batch 64, the other thread waiting).
inline Scratch<uint16_t> pack_rows(const float* a, int64_t lda, int64_t M, const Bf16PackedB& b) {
  const int64_t width = bf16_row_width(b), ktiles = width / kBf16TileK, rows = bf16_padded_rows(M);
  Scratch<uint16_t> out(rows * width);  // (on cache lines: a tile row is one; kept by the thread)
  const auto mask = [&](int64_t k) {    // those of the values [k, k + 16) that exist
    return static_cast<__mmask16>(b.K - k >= 16 ? 0xFFFFu : b.K <= k ? 0u : (1u << (b.K - k)) - 1u);
  };
  uint16_t* const first = out.data();
  const int threads = threads_for(kPackWork * rows * width);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i0 = 0; i0 < rows; i0 += kBf16TileRows) {
    uint16_t* to = first + i0 * width;  // (its row tile's first tile)
    for (int64_t t = 0; t < ktiles; ++t) {
      const int64_t k = t * kBf16TileK;
      const __mmask16 lo = mask(k), hi = mask(k + 16);
      for (int64_t i = i0; i < i0 + kBf16TileRows; ++i, to += kBf16TileK) {
        __m512i bits = _mm512_setzero_si512();
        if (i < M) {
          const float* row = a + i * lda + k;
          const __m512bh both = _mm512_cvtne2ps_pbh(
              _mm512_maskz_loadu_ps(hi, row + 16), _mm512_maskz_loadu_ps(lo, row));  // lanes 0-15: row[0, 16)
          std::memcpy(&bits, &both, sizeof bits);
        }
        _mm512_storeu_si512(to, bits);
      }
    }
  }
  return out;
}

inline __m512bh as_bf16x32(__m512i v) {
  __m512bh out;
  std::memcpy(&out, &v, sizeof out);
  return out;
}

// Rows [i, i + R) x the panels [p, p + P) with vdpbf16ps: R * P accumulators of
// 16 sums; each k pair of a row is broadcast against the panels' 64-byte rows.
// The sums go to store (see bf16_products).
template <int R, int P, class Store>
void block_avx512(const uint16_t* a, int64_t width, const Bf16PackedB& b, int64_t i, int64_t p,
                  const Store& store) {
  constexpr int64_t kOut = P * Bf16PackedB::kCols;
  __m512 sum[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      sum[r][q] = _mm512_setzero_ps();
  const int64_t used = (b.K + 1) / 2;
  const uint16_t* w[P];
  for (int q = 0; q < P; ++q)
    w[q] = b.panel(p + q);
  for (int64_t g = 0; g < used; ++g) {
    __m512bh wg[P];
    for (int q = 0; q < P; ++q)
      wg[q] = as_bf16x32(_mm512_loadu_si512(w[q] + g * Bf16PackedB::kCols * 2));
    for (int r = 0; r < R; ++r) {
      int32_t two;
      std::memcpy(&two, a + bf16_tiled_at(width, i + r, 2 * g), sizeof two);
      const __m512bh x = as_bf16x32(_mm512_set1_epi32(two));
      for (int q = 0; q < P; ++q)
        sum[r][q] = _mm512_dpbf16_ps(sum[r][q], x, wg[q]);
    }
  }
  alignas(64) float out[R * kOut];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      _mm512_store_ps(out + r * kOut + q * Bf16PackedB::kCols, sum[r][q]);
  const int64_t c0 = p * Bf16PackedB::kCols;
  store(i, i + R, c0, std::min(b.N, c0 + kOut), out, kOut);
}

// Rows [i, i + rows) (rows <= 8) of the panels [p, p + P).
template <int P, class Store>
void rows_avx512(const uint16_t* a, int64_t width, const Bf16PackedB& b, int64_t i, int64_t rows, int64_t p,
                 const Store& store) {
  switch (rows) {
    case 8:
      return block_avx512<8, P>(a, width, b, i, p, store);
    case 7:
      return block_avx512<7, P>(a, width, b, i, p, store);
    case 6:
      return block_avx512<6, P>(a, width, b, i, p, store);
    case 5:
      return block_avx512<5, P>(a, width, b, i, p, store);
    case 4:
      return block_avx512<4, P>(a, width, b, i, p, store);
    case 3:
      return block_avx512<3, P>(a, width, b, i, p, store);
    case 2:
      return block_avx512<2, P>(a, width, b, i, p, store);
    default:
      return block_avx512<1, P>(a, width, b, i, p, store);
  }
}

// Rows [i, i + rows) of `panels` panels (1-4) from p.
template <class Store>
void panels_avx512(const uint16_t* a, int64_t width, const Bf16PackedB& b, int64_t i, int64_t rows, int64_t p,
                   int64_t panels, const Store& store) {
  switch (panels) {
    case 4:
      return rows_avx512<4>(a, width, b, i, rows, p, store);
    case 3:
      return rows_avx512<3>(a, width, b, i, rows, p, store);
    case 2:
      return rows_avx512<2>(a, width, b, i, rows, p, store);
    default:
      return rows_avx512<1>(a, width, b, i, rows, p, store);
  }
}

// Whether a store of bf16_products takes a whole block's sums straight where
// they go (S::kDirect: target(i0, j0) and ld(), then finish(i0, i1, j0, j1) on
// them), rather than from a block of sums on the stack.
template <class S, class = void>
struct direct : std::false_type {};
template <class S>
struct direct<S, std::void_t<decltype(S::kDirect)>> : std::bool_constant<S::kDirect> {};

// A direct store's block whose epilogue (finish) waits until the next block's
// products are under way (see block_amx); i0 < 0: none.
struct PendingFinish {
  int64_t i0 = -1, i1 = 0, j0 = 0, j1 = 0;
  template <class Store>
  void run(const Store& store) {
    if (i0 >= 0) store.finish(i0, i1, j0, j1);
    i0 = -1;
  }
};

#if DG_AMX
// Rows [i, i + 16 RT) x panels [p, p + CT) on tiles: sums in tiles 0-3 (row
// tile r, column tile q: tile 2r + q), the activation's row tiles in 4-5, the
// weight's panels in 6-7; every tile 16 rows of 64 bytes (the thread's
// configuration, see bf16_products). Each load comes just before the first
// product that needs it, so that it overlaps the products before it. The sums
// of the rows and columns that exist go to store. A direct store
// (bf16_detail::direct) takes a whole block's tiles where they go, the lines of
// its rows prefetched for writing during the products (a row or two per k tile)
// so that the tile stores and the epilogue find them in L1; other blocks go
// through the stack. With pending (bf16_products: a direct store whose epilogue
// runs per block), a block's epilogue waits in it until the next block's
// products have been issued: the vector units run it while the tiles multiply
// (the epilogue after the block's own products left the tiles idle: a GELU's
// erf on each sum). The four products of a BERT layer at 2048 rows (with their
// epilogues and pack_rows), one thread, mins of 5 alternate runs: 68.2 ms; all
// four loads first 72.2; without the prefetch 71.1; before these and pack_rows's
// change (through the stack: RowsInto's copy into c, whose lines miss, the
// 2048 x 3072 product writing 25 MB) 84.7. Deferring the epilogue: 66.8 -> 62.5
// (the GELU product 23.1 -> 19.9).
template <int RT, int CT, class Store>
void block_amx(const uint16_t* a, int64_t width, const Bf16PackedB& b, int64_t M, int64_t i, int64_t p,
               const Store& store, PendingFinish* pending = nullptr) {
  const int64_t c0 = p * Bf16PackedB::kCols;
  const int64_t i1 = std::min(M, i + RT * kBf16TileRows), c1 = std::min(b.N, c0 + CT * Bf16PackedB::kCols);
  float* to = nullptr;
  int64_t ld = 0;
  if constexpr (direct<Store>::value) {
    if (i1 - i == RT * kBf16TileRows && c1 - c0 == CT * Bf16PackedB::kCols) {
      to = store.target(i, c0);
      ld = store.ld();
    }
  }
  _tile_zero(0);
  if constexpr (CT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && CT == 2) _tile_zero(3);
  constexpr int64_t kTile = kBf16TileRows * kBf16TileK;  // values per tile (bf16_tiled_at)
  const int64_t ktiles = width / kBf16TileK;
  const uint16_t* at = a + i / kBf16TileRows * ktiles * kTile;
  const uint16_t* w0 = b.panel(p);
  const uint16_t* w1 = CT == 2 ? b.panel(p + 1) : w0;
  constexpr int64_t kRows = RT * kBf16TileRows;
  int64_t prefetched = 0;  // rows of `to` prefetched
  for (int64_t t = 0; t < ktiles; ++t) {
    const int64_t w_at = t * (kBf16TileK / 2) * Bf16PackedB::kCols * 2;
    if (t + 1 < ktiles) {  // the next k tile's lines, into L1 while these multiply (from L2 the tile
      // loads waited: 2048 x 768 x 3072, one thread, 0.90 -> 0.98 TFLOP/s in a microbenchmark)
      const char* next[4] = {reinterpret_cast<const char*>(at + (t + 1) * kTile),
                             reinterpret_cast<const char*>(w0 + w_at + kTile),
                             reinterpret_cast<const char*>(w1 + w_at + kTile),
                             reinterpret_cast<const char*>(at + (ktiles + t + 1) * kTile)};
      for (int q = 0; q < 4; ++q) {
        if ((q == 2 && CT == 1) || (q == 3 && RT == 1)) continue;
        for (int line = 0; line < 1024; line += 64)
          _mm_prefetch(next[q] + line, _MM_HINT_T0);
      }
    }
    _tile_loadd(4, at + t * kTile, 64);
    _tile_loadd(6, w0 + w_at, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT == 2) {
      _tile_loadd(7, w1 + w_at, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT == 2) {
      _tile_loadd(5, at + (ktiles + t) * kTile, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (CT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    if (to != nullptr) {  // rows up to (t + 1) / ktiles of the block
      const int64_t upto = t + 1 == ktiles ? kRows : (t + 1) * kRows / ktiles;
      for (; prefetched < upto; ++prefetched) {
        _mm_prefetch(reinterpret_cast<const char*>(to + prefetched * ld), _MM_HINT_ET0);
        if constexpr (CT == 2)
          _mm_prefetch(reinterpret_cast<const char*>(to + prefetched * ld + 16), _MM_HINT_ET0);
      }
    }
  }
  if constexpr (direct<Store>::value) {
    if (pending != nullptr) pending->run(store);
    if (to != nullptr) {
      const int64_t bytes = ld * static_cast<int64_t>(sizeof(float));
      _tile_stored(0, to, bytes);
      if constexpr (CT == 2) _tile_stored(1, to + 16, bytes);
      if constexpr (RT == 2) _tile_stored(2, to + 16 * ld, bytes);
      if constexpr (RT == 2 && CT == 2) _tile_stored(3, to + 16 * ld + 16, bytes);
      if (pending != nullptr)
        *pending = PendingFinish{i, i1, c0, c1};
      else
        store.finish(i, i1, c0, c1);
      return;
    }
  }
  constexpr int64_t kOut = 2 * Bf16PackedB::kCols;  // floats per row of out
  alignas(64) float out[2 * kBf16TileRows * kOut];
  constexpr int64_t kOutBytes = kOut * static_cast<int64_t>(sizeof(float));
  _tile_stored(0, out, kOutBytes);
  if constexpr (CT == 2) _tile_stored(1, out + 16, kOutBytes);
  if constexpr (RT == 2) _tile_stored(2, out + 16 * kOut, kOutBytes);
  if constexpr (RT == 2 && CT == 2) _tile_stored(3, out + 16 * kOut + 16, kOutBytes);
  store(i, i1, c0, c1, out, kOut);
}
#endif

// store for matmul_bf16: the block's rows into c (row stride ldc), then the
// GEMM epilogue on them (dg_gemm.h); a row-block epilogue (dg::UpdateRows) on
// whole rows once they are done (rows_done), with its prefetch hints.
template <class Epilogue>
struct RowsInto {
  static constexpr bool kWholeRows = gemm_detail::row_blocks<Epilogue>::value;
  float* c;
  int64_t ldc, N;
  const Epilogue& epi;
  void operator()(int64_t i0, int64_t i1, int64_t j0, int64_t j1, const float* sums, int64_t ld) const {
    for (int64_t r = i0; r < i1; ++r)
      std::memcpy(c + r * ldc + j0, sums + (r - i0) * ld, static_cast<size_t>(j1 - j0) * sizeof(float));
    finish(i0, i1, j0, j1);
  }
  // A direct store (bf16_detail::direct): the block's sums go to target(i0, j0),
  // rows ld() apart, then finish runs the epilogue on them.
  static constexpr bool kDirect = true;
  float* target(int64_t i0, int64_t j0) const { return c + i0 * ldc + j0; }
  int64_t ld() const { return ldc; }
  void finish(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    if constexpr (!kWholeRows) gemm_detail::finish(epi, i0, i1, j0, j1, c + i0 * ldc + j0, ldc);
  }
  void rows_done(int64_t i0, int64_t i1) const {
    if constexpr (kWholeRows) epi.rows_done(i0, i1, 0, N, c + i0 * ldc, ldc);
  }
  void prefetch(int64_t i0, int64_t i1, int64_t part, int64_t parts) const {
    if constexpr (kWholeRows) epi.prefetch(i0, i1, 0, N, part, parts);
  }
};

// store for a product whose output is handed over (Bf16Rows): each block's sums
// land in the thread's staging block (in L1; a whole AMX block straight from
// the tiles), the epilogue runs on them there, and they are rounded to bf16
// (to nearest even, as pack_rows) into the reader's rows, the tiles of
// bf16_tiled_at(width, ...); the float32 output is not written. Whole blocks'
// epilogues are deferred as RowsInto's are (bf16_products: one block of sums
// pending at a time, finished before the next block's are stored).
template <class Epilogue>
struct TilesInto {
  uint16_t* rows;
  int64_t width, N;
  const Epilogue& epi;
  static constexpr int64_t kStaging = 2 * kBf16TileRows * 4 * Bf16PackedB::kCols;  // the largest block
  static float* staging() {
    alignas(64) static thread_local float block[kStaging];
    return block;
  }
  void operator()(int64_t i0, int64_t i1, int64_t j0, int64_t j1, const float* sums, int64_t ld) const {
    float* s = staging();
    for (int64_t r = i0; r < i1; ++r)
      std::memcpy(s + (r - i0) * ld, sums + (r - i0) * ld, static_cast<size_t>(j1 - j0) * sizeof(float));
    round_into(i0, i1, j0, j1, s, ld);
  }
  static constexpr bool kDirect = true;
  float* target(int64_t, int64_t) const { return staging(); }
  int64_t ld() const { return 2 * Bf16PackedB::kCols; }
  void finish(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    round_into(i0, i1, j0, j1, staging(), ld());
  }
  // The epilogue on the block s (rows ld apart), then its values into the rows
  // 16 at a time (j0 is a whole panel's first column, so 16 values stay in one
  // tile row); after the last column, zeros up to the width.
  void round_into(int64_t i0, int64_t i1, int64_t j0, int64_t j1, float* s, int64_t ld) const {
    gemm_detail::finish(epi, i0, i1, j0, j1, s, ld);
    for (int64_t r = i0; r < i1; ++r) {
      const float* from = s + (r - i0) * ld;
      for (int64_t j = j0; j < j1; j += 16) {
        const int64_t n = std::min<int64_t>(16, j1 - j);
        const __mmask16 mask = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1u);
        const __m256bh bits = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, from + (j - j0)));
        __m256i raw;
        std::memcpy(&raw, &bits, sizeof raw);
        _mm256_mask_storeu_epi16(rows + bf16_tiled_at(width, r, j), mask, raw);
      }
      if (j1 == N)
        for (int64_t k = N; k < width; ++k)
          rows[bf16_tiled_at(width, r, k)] = 0;
    }
  }
};

// Whether a store of bf16_products finishes whole rows (RowsInto of a row-block epilogue).
template <class S, class = void>
struct whole_rows : std::false_type {};
template <class S>
struct whole_rows<S, std::void_t<decltype(S::kWholeRows)>> : std::bool_constant<S::kWholeRows> {};

// Whether a store of bf16_products wants the blocks column block by column block
// (S::kColumnOrder: a convolution's, whose columns are output channels, so that
// each channel's plane is written, and its residual read, in order).
template <class S, class = void>
struct column_order : std::false_type {};
template <class S>
struct column_order<S, std::void_t<decltype(S::kColumnOrder)>> : std::bool_constant<S::kColumnOrder> {};

}  // namespace bf16_detail

// The most bytes of the weight's panels that bf16_products multiplies by every
// row block before it goes on (about half of a core's L2).
constexpr int64_t kBf16SliceBytes = int64_t(1) << 20;

// The products of M bf16 activation rows a (bf16_row_width(b) values each,
// bf16_padded_rows(M) rows: the padding zeros; laid out as bf16_tiled_at says) by b, in blocks: rows x two
// panels (32 columns) on tiles, or up to 8 rows x 2-4 panels with vdpbf16ps.
// Each block's float32 sums go to store(i0, i1, j0, j1, sums, ld): rows
// [i0, i1) and columns [j0, j1) of the product, sums[(i - i0) * ld + j - j0]; a
// whole block on tiles to a direct store (bf16_detail::direct, matmul_bf16's)
// straight where it goes, then store.finish(i0, i1, j0, j1) once the thread's
// next block's products are issued (or its last block is done).
// Blocks are split over threads in row-block order: the blocks of one row block
// follow each other on one thread, its activation tiles staying in L1 while the
// weight's panels stream from L2 (784 x 512 at 256 rows, 2 threads: 0.23 ms,
// column-block order 0.27); a weight larger than kBf16SliceBytes is taken a slice
// of column blocks at a time, so that it is read from L3 once rather than once a
// row block (the BERT encoder at batch 64, one thread, loaded machine: 179-193 ->
// 173-181 ms, mins of alternate runs); unless the store asks for column-block order
// (column_order: a convolution's, ResNet-50 64px batch 64, one thread: 316 ->
// 231 ms, its planes written in order); store runs on the thread that made the block.
template <class Store>
void bf16_products(const uint16_t* a, const Bf16PackedB& b, int64_t M, const Store& store) {
  if (M <= 0) return;
  const int64_t width = bf16_row_width(b);
  const bool amx = bf16_uses_amx(M);
  // Tiles: blocks of 32 rows x 2 panels. vdpbf16ps: 8 rows x 2 panels, or 1-2 rows
  // x 4 panels (one row's sums depend on each other: more panels, more chains).
  const int64_t block_rows = amx ? 2 * kBf16TileRows : 8, block_panels = !amx && M <= 2 ? 4 : 2;
  const int64_t row_blocks = (M + block_rows - 1) / block_rows;
  const int64_t col_blocks = (b.panels + block_panels - 1) / block_panels;
  const double work = 2.0 * double(M) * double(b.N) * double(b.K);
  const int threads = threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#if DG_AMX
    TileConfig config;
    for (int t = 0; t < 8; ++t)
      config.set(t, static_cast<int>(kBf16TileRows), 64);
    std::unique_ptr<TileScope> tiles(amx ? new TileScope(config) : nullptr);
#endif
    bf16_detail::PendingFinish deferred;
    bf16_detail::PendingFinish* const pending =
        (bf16_detail::direct<Store>::value && !bf16_detail::whole_rows<Store>::value) ? &deferred : nullptr;
    const auto block = [&](int64_t i, int64_t p) {
      const int64_t rows = std::min(block_rows, M - i), panels = std::min(block_panels, b.panels - p);
#if DG_AMX
      if (amx) {
        if (rows > kBf16TileRows) {
          if (panels == 2)
            bf16_detail::block_amx<2, 2>(a, width, b, M, i, p, store, pending);
          else
            bf16_detail::block_amx<2, 1>(a, width, b, M, i, p, store, pending);
        } else {
          if (panels == 2)
            bf16_detail::block_amx<1, 2>(a, width, b, M, i, p, store, pending);
          else
            bf16_detail::block_amx<1, 1>(a, width, b, M, i, p, store, pending);
        }
        return;
      }
#endif
      bf16_detail::panels_avx512(a, width, b, i, rows, p, panels, store);
    };
    if constexpr (bf16_detail::whole_rows<Store>::value) {
      // A store that finishes whole rows (a parameter's update from its gradient,
      // dg::UpdateRows): each thread makes whole row blocks, column block after
      // column block, prefetching a share of the next row block's parameter rows
      // with each, then finishes the rows.
#pragma omp for schedule(static)
      for (int64_t r = 0; r < row_blocks; ++r) {
        const int64_t i = r * block_rows, i1 = std::min(M, i + block_rows);
        for (int64_t q = 0; q < col_blocks; ++q) {
          block(i, q * block_panels);
          if (i1 < M) store.prefetch(i1, std::min(M, i1 + block_rows), q, col_blocks);
        }
        store.rows_done(i, i1);
      }
    } else {
      // Row-block order within slices of the weight's column blocks that fit in
      // L2 (kBf16SliceBytes), slice after slice.
      const int64_t block_bytes = block_panels * b.pairs * Bf16PackedB::kCols * 2 * int64_t(sizeof(uint16_t));
      const int64_t slice = std::max<int64_t>(1, kBf16SliceBytes / block_bytes);
#pragma omp for schedule(static) nowait
      for (int64_t item = 0; item < row_blocks * col_blocks; ++item) {
        if constexpr (bf16_detail::column_order<Store>::value) {
          block(item % row_blocks * block_rows, item / row_blocks * block_panels);
        } else {
          const int64_t first = item / (row_blocks * slice) * slice;  // the slice's first column block
          const int64_t width = std::min(slice, col_blocks - first), at = item - first * row_blocks;
          block(at / width * block_rows, (first + at % width) * block_panels);
        }
      }
      if constexpr (bf16_detail::direct<Store>::value) deferred.run(store);
    }
  }
}

// c[M, N] = a[M, K] @ op(W) in bf16 products with float32 sums, then epi on each
// finished piece of c (dg_gemm.h's epilogues).
template <class Epilogue = NoEpilogue>
void matmul_bf16(const float* a, const Bf16PackedB& b, float* c, int64_t M,
                 const Epilogue& epi = Epilogue()) {
  if (M <= 0) return;
  const Scratch<uint16_t> rows = bf16_detail::pack_rows(a, b.K, M, b);
  bf16_products(rows.data(), b, M, bf16_detail::RowsInto<Epilogue>{c, b.N, b.N, epi});
}

namespace bf16_detail {

// to[c][r] = from[r][c] for a rows x cols matrix (row strides: cols, rows), in
// 16 x 16 blocks that stay in the cache.
inline void transpose(const float* from, int64_t rows, int64_t cols, float* to) {
  for (int64_t r0 = 0; r0 < rows; r0 += 16)
    for (int64_t c0 = 0; c0 < cols; c0 += 16)
      for (int64_t r = r0; r < std::min(rows, r0 + 16); ++r)
        for (int64_t c = c0; c < std::min(cols, c0 + 16); ++c)
          to[c * rows + r] = from[r * cols + c];
}

// b [K, N] (row stride N) packed: each k pair of rows converted and interleaved
// 16 columns at a time (pack_pair_bf16).
inline Bf16PackedB pack_b(const float* b, int64_t K, int64_t N) {
  Bf16PackedB packed(K, N);
  for (int64_t k = 0; k < K; k += 2)
    pack_pair_bf16(b + k * N, k + 1 < K ? b + (k + 1) * N : nullptr, N, packed, 0, k / 2);
  return packed;
}

// The weight w [K, N] (or [N, K] when tb) packed: pack_b, after a transpose for tb.
inline Bf16PackedB pack_weight(const float* w, bool tb, int64_t K, int64_t N) {
  if (!tb) return pack_b(w, K, N);
  std::vector<float> flipped(static_cast<size_t>(K * N));
  transpose(w, N, K, flipped.data());
  return pack_b(flipped.data(), K, N);
}

}  // namespace bf16_detail
#endif

// c[M, N] = op(a) @ op(b) in bf16 products with float32 sums, then epi (dg_gemm.h's
// epilogues, row blocks included): both operands hold bf16 values and are packed
// per call (a product of a training step, where nothing is kept); ta: a is
// stored [K, M], tb: b is stored [N, K]. Where the CPU has no bf16 products:
// dg::gemm, the float32 products of the same values.
template <class Epilogue = NoEpilogue>
void gemm_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* a, const float* b, float* c,
               const Epilogue& epi = Epilogue()) {
#if DG_BF16_PRODUCTS
  if (M <= 0 || N <= 0) return;
  const Bf16PackedB packed = bf16_detail::pack_weight(b, tb, K, N);
  std::vector<float> a_rows;
  if (ta) {  // a [M, K] from a [K, M]
    a_rows.resize(static_cast<size_t>(M * K));
    bf16_detail::transpose(a, K, M, a_rows.data());
    a = a_rows.data();
  }
  const Scratch<uint16_t> rows = bf16_detail::pack_rows(a, K, M, packed);
  bf16_products(rows.data(), packed, M, bf16_detail::RowsInto<Epilogue>{c, N, N, epi});
#else
  gemm(ta, tb, M, N, K, a, ta ? M : K, b, tb ? K : N, c, N, epi);
#endif
}

// dg_matmul.h's matmul, matmul_nt and matmul_tn for operands that hold bf16
// values (dg::round_bf16 made them): gemm_bf16.
template <class Epilogue = NoEpilogue>
void matmul_bf16(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
                 const Epilogue& epi = Epilogue()) {
  gemm_bf16(false, false, M, N, K, a, b, c, epi);
}
template <class Epilogue = NoEpilogue>
void matmul_nt_bf16(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
                    const Epilogue& epi = Epilogue()) {
  gemm_bf16(false, true, M, N, K, a, b, c, epi);
}
template <class Epilogue = NoEpilogue>
void matmul_tn_bf16(const float* a, const float* b, float* c, int64_t M, int64_t K, int64_t N,
                    const Epilogue& epi = Epilogue()) {
  gemm_bf16(true, false, M, N, K, a, b, c, epi);
}

// weight [K, N] (or [N, K] when tb) kept rounded and packed for the bf16 products:
// remade when the Model's ParameterVersion has counted a change, made per call
// (and not kept) while a numpy view may be writing the weight. Where the CPU has
// no bf16 products it keeps the float32 packing of the rounded weight instead
// (a KeptPackedB that rounds as it packs). It never stands in for the stored
// weight. Thread-safe as KeptPackedB is.
class KeptBf16Weight {
 public:
  KeptBf16Weight(ParameterVersion& version, Tensor<float>& weight, bool tb, int64_t K, int64_t N)
      : float32_(version, weight, tb, K, N, /*stands_in=*/false, /*prepare=*/round_bf16),
        version_(version),
        weight_(weight),
        tb_(tb),
        K_(K),
        N_(N) {}
  KeptBf16Weight(const KeptBf16Weight&) = delete;
  KeptBf16Weight& operator=(const KeptBf16Weight&) = delete;

  // The weight rounded and packed as the parameters are now.
  std::shared_ptr<const Bf16PackedB> use() const {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t now = version_.current();
    if (!version_.watched()) return make();
    if (!kept_ || kept_version_ != now || kept_from_ != weight_.ptr()) {
      kept_ = make();
      kept_version_ = now;
      kept_from_ = weight_.ptr();
    }
    return kept_;
  }
  // The weight [N, K] of a convolution with `taps` kernel positions (stored [O,
  // C, KH, KW]) as the right operand of its channels-last product
  // (dg_bf16_conv.h): op(W) [K, N] with k in [tap][channel] order, packed as
  // use()'s is and kept as it is.
  std::shared_ptr<const Bf16PackedB> use_taps(int64_t taps) const {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t now = version_.current();
    if (!version_.watched()) return make_taps(taps);
    if (!taps_ || taps_version_ != now || taps_from_ != weight_.ptr()) {
      taps_ = make_taps(taps);
      taps_version_ = now;
      taps_from_ = weight_.ptr();
    }
    return taps_;
  }
  // The float32 packing of the rounded weight, and the weight rounded as stored
  // (CPUs without bf16 products).
  const KeptPackedB& float32() const { return float32_; }
  std::vector<float> rounded() const {
    std::vector<float> out(weight_.data.size());
    round_bf16(weight_.ptr(), out.data(), static_cast<int64_t>(out.size()));
    return out;
  }

  // Bytes the kept packing holds (0 before the first product and after release()).
  int64_t bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return (kept_ ? kept_->bytes() : 0) + (taps_ ? taps_->bytes() : 0) + float32_.bytes();
  }
  // Frees the packing (the next product makes it again); a call still reading it
  // keeps it alive until it is done.
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_.reset();
    taps_.reset();
    float32_.release();
  }

 private:
  std::shared_ptr<const Bf16PackedB> make() const {
#if DG_BF16_PRODUCTS
    return std::make_shared<const Bf16PackedB>(bf16_detail::pack_weight(weight_.ptr(), tb_, K_, N_));
#else
    return std::make_shared<const Bf16PackedB>(weight_.ptr(), tb_, K_, N_);
#endif
  }

  std::shared_ptr<const Bf16PackedB> make_taps(int64_t taps) const {
    const int64_t C = K_ / taps;
    std::vector<float> b(static_cast<size_t>(K_ * N_));  // b[t*C + c][o] = w[o][c][t]
    const float* w = weight_.ptr();
    for (int64_t o = 0; o < N_; ++o)
      for (int64_t c = 0; c < C; ++c)
        for (int64_t t = 0; t < taps; ++t)
          b[static_cast<size_t>((t * C + c) * N_ + o)] = w[(o * C + c) * taps + t];
#if DG_BF16_PRODUCTS
    return std::make_shared<const Bf16PackedB>(bf16_detail::pack_b(b.data(), K_, N_));
#else
    return std::make_shared<const Bf16PackedB>(b.data(), false, K_, N_);
#endif
  }

  KeptPackedB float32_;
  ParameterVersion& version_;
  const Tensor<float>& weight_;
  bool tb_;
  int64_t K_, N_;
  mutable std::mutex mutex_;
  mutable std::shared_ptr<const Bf16PackedB> kept_;
  mutable uint64_t kept_version_ = 0;
  mutable const float* kept_from_ = nullptr;
  mutable std::shared_ptr<const Bf16PackedB> taps_;
  mutable uint64_t taps_version_ = 0;
  mutable const float* taps_from_ = nullptr;
};

// c[M,N] = a[M,K] @ op(W) for the kept bf16 weight W (stored [K, N], or [N, K]:
// the kept weight knows which), then epi. a is rounded to bf16 (to nearest even,
// as dg::round_bf16) as it is read: packed into the product's rows, or, where the
// CPU has no bf16 products, copied rounded for the float32 product. So the
// generator drops the rounding call before it (transforms/rounding.py).
template <class Epilogue = NoEpilogue>
void matmul_bf16(const float* a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                 const Epilogue& epi = Epilogue()) {
#if DG_BF16_PRODUCTS
  (void)K;
  (void)N;
  if (M > 0) matmul_bf16(a, *w.use(), c, M, epi);
#else
  std::vector<float> rounded(static_cast<size_t>(std::max<int64_t>(M, 0) * K));
  round_bf16(a, rounded.data(), static_cast<int64_t>(rounded.size()));
  matmul(rounded.data(), w.float32(), c, M, K, N, epi);
#endif
}
template <class Epilogue = NoEpilogue>
void matmul_nt_bf16(const float* a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                    const Epilogue& epi = Epilogue()) {
  matmul_bf16(a, w, c, M, K, N, epi);
}

#if DG_BF16_PRODUCTS
namespace bf16_detail {
// The product of the bf16 rows `rows` (pack_rows's layout) by b into c, or
// handed over into out's rows (TilesInto; their padding rows zeroed first).
template <class Epilogue>
void product_of_rows(const uint16_t* rows, const Bf16PackedB& b, float* c, int64_t M, const Epilogue& epi,
                     const Bf16Rows& out) {
  if (out.data == nullptr) {
    bf16_products(rows, b, M, RowsInto<Epilogue>{c, b.N, b.N, epi});
    return;
  }
  const int64_t width = bf16_handed_width(b.N);
  for (int64_t r = M; r < bf16_padded_rows(M); ++r)
    for (int64_t k = 0; k < width; k += kBf16TileK)
      std::memset(out.data + bf16_tiled_at(width, r, k), 0, kBf16TileK * sizeof(uint16_t));
  bf16_products(rows, b, M, TilesInto<Epilogue>{out.data, width, b.N, epi});
}
}  // namespace bf16_detail
#endif

// matmul_bf16 by a kept weight whose output is also handed over (out.data set:
// Bf16Rows; where the CPU has bf16 products, c is then not written).
template <class Epilogue>
void matmul_bf16(const float* a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                 const Epilogue& epi, const Bf16Rows& out) {
#if DG_BF16_PRODUCTS
  (void)K;
  (void)N;
  if (M <= 0) return;
  const std::shared_ptr<const Bf16PackedB> b = w.use();
  const Scratch<uint16_t> rows = bf16_detail::pack_rows(a, b->K, M, *b);
  bf16_detail::product_of_rows(rows.data(), *b, c, M, epi, out);
#else
  (void)out;
  matmul_bf16(a, w, c, M, K, N, epi);
#endif
}

// matmul_bf16 of an activation handed over by the product that made it (its bf16
// rows taken as they are: no pack_rows), its own output handed over in turn
// where out.data is set.
template <class Epilogue = NoEpilogue>
void matmul_bf16(const Bf16RowsIn& a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                 const Epilogue& epi = Epilogue(), const Bf16Rows& out = Bf16Rows()) {
#if DG_BF16_PRODUCTS
  (void)K;
  (void)N;
  if (M <= 0) return;
  const std::shared_ptr<const Bf16PackedB> b = w.use();
  bf16_detail::product_of_rows(a.rows, *b, c, M, epi, out);
#else
  (void)out;
  matmul_bf16(a.values, w, c, M, K, N, epi);
#endif
}

template <class Epilogue>
void matmul_nt_bf16(const float* a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                    const Epilogue& epi, const Bf16Rows& out) {
  matmul_bf16(a, w, c, M, K, N, epi, out);
}
template <class Epilogue = NoEpilogue>
void matmul_nt_bf16(const Bf16RowsIn& a, const KeptBf16Weight& w, float* c, int64_t M, int64_t K, int64_t N,
                    const Epilogue& epi = Epilogue(), const Bf16Rows& out = Bf16Rows()) {
  matmul_bf16(a, w, c, M, K, N, epi, out);
}

}  // namespace dg
