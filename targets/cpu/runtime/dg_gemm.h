// dg_gemm.h - single-precision matrix multiply (GEMM) for the CPU runtime.
//
//   dg::gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc [, epilogue]);
//
// computes C[M,N] = op(A)[M,K] @ op(B)[K,N], where op(X) is X or X^T:
//   op(A)[i,k] = ta ? A[k*lda + i] : A[i*lda + k]   (A stored [K,M] or [M,K])
//   op(B)[k,j] = tb ? B[j*ldb + k] : B[k*ldb + j]   (B stored [N,K] or [K,N])
// C[i,j] is C[i*ldc + j].  C is overwritten (its old contents are never read);
// K == 0 gives zeros.
//
// How it is fast (the Goto / BLIS scheme, section numbers below):
//
//   * Micro-kernel (2): one MR x NR tile of C lives in vector registers while
//     k runs over a block of K; per k it loads NR floats of B, broadcasts MR
//     floats of A and does MR * NR / width fused multiply-adds.
//   * Cache blocking (5): K is cut into blocks of at most KC, so that one B
//     micro-panel (KC x NR floats) stays in cache while the kernel runs down
//     all row panels of a block of at most MC x KC floats of packed A, which
//     stays in L2.  Packed B is made in blocks of at most KC x NC.  The last
//     micro-panel, when it has at most kEdgeCols columns (N = 10 logits), gets
//     a tile half as wide: half the multiply-adds.
//   * Packing A (3): A is copied into row panels of at most MR rows, the values
//     of one k side by side, so that the kernel reads it sequentially.  Rows are
//     shared out evenly (20 rows: 5 + 5 + 5 + 5, not 6 + 6 + 6 + 2).  When N
//     fits in one micro-panel every value of A is used once, and A is read in
//     place instead (e.g. [256, 256] @ [256, 10]).
//   * B (3, 5): packed as a whole when stored transposed, or when more than MC
//     rows (several A blocks) reuse it.  Otherwise, e.g. the TreeLSTM level
//     GEMMs [M, 512] @ [512, 1280] with small M, B is read in place and only
//     the micro-panel in use is copied into L1 when several row panels share
//     it: copying all of B would cost as much as the product.
//   * Tiny M (2, 5): up to kStreamMaxRows rows, no tiles at all: stream_rows
//     reads a row-major B row after row, which the memory system serves
//     fastest, and keeps the few rows of C in L1; a transposed B (PyTorch's
//     Linear weight) times a row-major A is dot products of rows
//     (stream_dots), B again read in place from start to end.
//   * Threads (6): with OpenMP, C is cut into one rectangle per thread; each
//     thread packs its own copies and runs the serial code on its rectangle.
//     K is never split and no choice that changes rounding depends on the
//     split, so results are bitwise identical for any number of threads.
//     Small products stay on one thread (dg::threads_for, dg_parallel.h).
//
// The micro-kernel is chosen at compile time from the compiler's target macros
// (-march=native, -mavx2 -mfma, ...): AVX-512, AVX2 + FMA, NEON on 64-bit ARM
// (aarch64), or portable C++ that the compiler may vectorize by itself.
// dg::gemm_isa() names the one compiled.
// Without any -m/-march flag x86-64 compilers target SSE2 only, so the portable
// kernel runs at about a third of the AVX2 speed: build with -march=native
// (or at least -mavx2 -mfma) where the machine allows.
//
// Epilogue: gemm(..., epi) calls epi(row, col0, c, n) once for every finished
// piece of an output row, i.e. after the whole K sum is in C: c points at
// C[row, col0] and the call may rewrite c[0..n).  Pieces are disjoint and
// cover C exactly once; they are usually NR wide (up to a few thousand floats
// on the tiny-M path), and several threads may run epilogues at the same time
// on different pieces.  Doing bias + activation here touches C while it is
// still in L1, e.g.
//   dg::gemm(false, false, M, N, K, x, K, w, N, y, N,
//            [&](int64_t, int64_t col0, float* c, int64_t n) {
//                for (int64_t j = 0; j < n; ++j) c[j] = std::max(c[j] + bias[col0 + j], 0.0f);
//            });
//
// Row-block epilogues: an epilogue type that declares
// `static constexpr bool kRowBlocks = true` is called on whole blocks of rows
// instead, for work that reads other arrays row by row (a parameter's update
// from the gradient the GEMM makes, dg::UpdateRows): rows_done(r0, r1, c0, c1,
// c, ldc) once C[r0:r1, c0:c1] is complete (c points at C[r0, c0]; the blocks
// are disjoint and cover C), and, while the micro-kernels compute one block,
// prefetch(r0, r1, c0, c1, part, parts) for parts = 0, 1, ... of the next
// block the same thread will finish (a hint: fetch that share of what
// rows_done will read, so that it arrives from L3 while the kernels compute).
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX__)
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include "dg_arena.h"
#include "dg_parallel.h"

namespace dg {

// The default epilogue: leaves C as computed.
struct NoEpilogue {
  void operator()(int64_t, int64_t, float*, int64_t) const {}
};

namespace gemm_detail {

// Whether an epilogue takes whole blocks of rows (see the top of this file).
template <class E, class = void>
struct row_blocks : std::false_type {};
template <class E>
struct row_blocks<E, std::void_t<decltype(E::kRowBlocks)>> : std::bool_constant<E::kRowBlocks> {};

// Whether a (convolution's channel) epilogue reads memory that it can ask for
// ahead: epi.prefetch(c, n) for the n values it will be given at c. The
// convolutions that write their output planes in short runs (dg_bf16_conv.h,
// dg_int8.h) call it a block ahead, as they ask for the lines they will write.
template <class E, class = void>
struct has_prefetch : std::false_type {};
template <class E>
struct has_prefetch<E, std::void_t<decltype(std::declval<const E&>().prefetch(nullptr, 0))>>
    : std::true_type {};

// C[r0:r1, c0:c1] is complete (c points at C[r0, c0]): the epilogue's call(s) on it.
template <class Epilogue>
void finish(const Epilogue& epi, int64_t r0, int64_t r1, int64_t c0, int64_t c1, float* c, int64_t ldc) {
  if constexpr (row_blocks<Epilogue>::value) {
    epi.rows_done(r0, r1, c0, c1, c, ldc);
  } else {
    for (int64_t r = r0; r < r1; ++r)
      epi(r, c0, c + (r - r0) * ldc, c1 - c0);
  }
}

// Asks the compiler to fully unroll the loop that follows (constant trip
// counts in the micro-kernel), so that the accumulators live in registers.
#if defined(__clang__)
#define DG_GEMM_UNROLL _Pragma("unroll")
#elif defined(__GNUC__)
#define DG_GEMM_UNROLL _Pragma("GCC unroll 32")
#else
#define DG_GEMM_UNROLL
#endif

// =============================================================================
// 1. Instruction set, tile and block sizes
// =============================================================================
//
// MR x NR: the register tile of C.  It takes MR * NR / width accumulator
//     registers, plus NR / width for a row of B and one for a broadcast of A.
// KC: depth of a K block.  Each K block ends with every tile of C read, added
//     to and written back, and each micro-kernel call with its accumulators
//     stored, so deeper blocks cost less as long as a B micro-panel (KC x NR
//     floats) streams from L2 at the kernel's pace (2 cache lines per k for
//     MR x NR multiply-adds) and the A block fits in L2 beside it.  Measured
//     on an AVX-512 Zen 4 core (1 MiB L2): KC 1024 instead of 192 takes
//     [256, 784] @ [784, 512] from 110 to 113 GFLOP/s on one core and from
//     203 to 224 on two; the AVX2 tile (6 x 16) gained nothing from it there.
// MC: rows of packed A per block; MC x KC floats should fit in L2.
// NC: columns of packed B per block; KC x NC floats should fit in L2/L3.
// MC must be a multiple of MR and NC of NR.
//
// The SIMD kernels are written once, over a handful of vector operations
// (vload, vfma, ...) that each instruction set defines.

#if defined(__AVX512F__)

// 32 zmm registers: 12 x 2 = 24 accumulators + 2 for B + 1 for A.
constexpr const char* kIsa = "avx512";
constexpr int MR = 12, NR = 32;
constexpr int kEdgeCols = 16;                      // see below
constexpr int64_t KC = 1024, MC = 144, NC = 2048;  // A block 576 KiB

using Vec = __m512;
constexpr int kWidth = 16;  // floats per vector
inline Vec vzero() {
  return _mm512_setzero_ps();
}
inline Vec vload(const float* p) {
  return _mm512_loadu_ps(p);
}
inline void vstore(float* p, Vec v) {
  _mm512_storeu_ps(p, v);
}
inline Vec vbroadcast(const float* p) {
  return _mm512_set1_ps(*p);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return _mm512_fmadd_ps(a, b, c);
}  // a * b + c
inline Vec vadd(Vec a, Vec b) {
  return _mm512_add_ps(a, b);
}
inline float vsum(Vec v) {  // the lanes' sum
  // Through memory: gcc 12's headers warn inside _mm512_reduce_add_ps and every 256-bit extract.
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  const __m256 h = _mm256_add_ps(_mm256_load_ps(lanes), _mm256_load_ps(lanes + 8));
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define DG_GEMM_SIMD 1

#elif defined(__AVX2__) && defined(__FMA__)

// 16 ymm registers: 6 x 2 = 12 accumulators + 2 for B + 1 for A.
constexpr const char* kIsa = "avx2";
constexpr int MR = 6, NR = 16;
constexpr int kEdgeCols = 8;
constexpr int64_t KC = 256, MC = 144, NC = 2048;

using Vec = __m256;
constexpr int kWidth = 8;  // floats per vector
inline Vec vzero() {
  return _mm256_setzero_ps();
}
inline Vec vload(const float* p) {
  return _mm256_loadu_ps(p);
}
inline void vstore(float* p, Vec v) {
  _mm256_storeu_ps(p, v);
}
inline Vec vbroadcast(const float* p) {
  return _mm256_broadcast_ss(p);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return _mm256_fmadd_ps(a, b, c);
}  // a * b + c
inline Vec vadd(Vec a, Vec b) {
  return _mm256_add_ps(a, b);
}
inline float vsum(Vec v) {  // the lanes' sum
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define DG_GEMM_SIMD 1

#elif defined(__aarch64__) && defined(__ARM_NEON)

// A64 NEON (every 64-bit ARM CPU has it): 32 vector registers v0-v31 of 128 bits,
// 4 floats each, and a fused multiply-add (FMLA) that can take one operand from a
// lane of another register ("by element").  The tile is 8 x 12:
//   8 rows x 3 vectors = 24 accumulators + 3 for the row of B + 2 for the 8
//   values of A (two vector loads of a packed panel, used lane by lane, see
//   vfma_lanes) = 29 registers, 3 left for the compiler.
// Per k that is 24 FMLAs for 5 vector loads, 4.8 FMLAs per load.  12 x 8 ties
// (24 + 2 + 3 = 29 registers, 5 loads; not compared on hardware); 4 x 24 needs
// 7 loads and 31 registers; 8 x 16 would need 32 accumulators.  On cores with
// two FMLA pipes of 4 cycles latency (Cortex-A76, Neoverse N1: 8 independent
// FMLAs in flight suffice; there are 24) that is 12 cycles of FMLAs per k with
// the loads in their shadow.  Compiled by GCC 12 (-O2 -march=armv8.2-a), the loop over k is
// 32 instructions for those 24 FMLAs (96 multiply-adds): 24 FMLA, 3 loads (LDP q,
// LDP q, LDR q), 3 adds, compare and branch; no spills.
// The narrow edge tile is one vector wide (N <= 4).
// Block sizes from the cache sizes of such cores (64 KiB L1D, 512 KiB - 1 MiB L2),
// not measured on ARM hardware yet: a B micro-panel of KC x NR = 256 x 12 floats
// (12 KiB) stays in L1, an A block of MC x KC = 128 x 256 floats (128 KiB) in L2.
constexpr const char* kIsa = "neon";
constexpr int MR = 8, NR = 12;
constexpr int kEdgeCols = 4;
constexpr int64_t KC = 256, MC = 128, NC = 2040;  // NC: a multiple of NR near 2048

using Vec = float32x4_t;
constexpr int kWidth = 4;  // floats per vector
inline Vec vzero() {
  return vdupq_n_f32(0.0F);
}
inline Vec vload(const float* p) {
  return vld1q_f32(p);
}
inline void vstore(float* p, Vec v) {
  vst1q_f32(p, v);
}
inline Vec vbroadcast(const float* p) {
  return vld1q_dup_f32(p);
}
inline Vec vfma(Vec a, Vec b, Vec c) {
  return vfmaq_f32(c, a, b);
}  // a * b + c
inline Vec vadd(Vec a, Vec b) {
  return vaddq_f32(a, b);
}
inline float vsum(Vec v) {  // the lanes' sum
  return vaddvq_f32(v);
}
// acc[i][v] = b[v] * (lane i of a4) + acc[i][v] for i < 4: four rows of a packed A
// panel come in one vector load, and FMLA (by element) takes each row's value from
// its lane.  Broadcasting instead, GCC 12 loads the 8 values of A into 8 registers
// (24 + 3 + 8 = 35 > 32) and spills accumulators to the stack in the loop.
template <int NV>
inline void vfma_lanes(Vec (*acc)[NV], const Vec* b, Vec a4) {
  DG_GEMM_UNROLL
  for (int v = 0; v < NV; ++v) {
    acc[0][v] = vfmaq_laneq_f32(acc[0][v], b[v], a4, 0);
    acc[1][v] = vfmaq_laneq_f32(acc[1][v], b[v], a4, 1);
    acc[2][v] = vfmaq_laneq_f32(acc[2][v], b[v], a4, 2);
    acc[3][v] = vfmaq_laneq_f32(acc[3][v], b[v], a4, 3);
  }
}
#define DG_GEMM_SIMD 1
#define DG_GEMM_LANES 1  // the micro-kernel uses vfma_lanes on packed A

#else

// Plain C++: a 4 x 8 tile is 8 SSE registers.
constexpr const char* kIsa = "portable";
constexpr int MR = 4, NR = 8;
constexpr int kEdgeCols = NR;  // no narrower tile
constexpr int64_t KC = 256, MC = 128, NC = 2048;
#define DG_GEMM_SIMD 0

#endif

static_assert(MC % MR == 0 && NC % NR == 0, "MC must be a multiple of MR and NC of NR");
// kEdgeCols: the width of the narrow tile that a last micro-panel of at most
// that many columns gets (half of NR where a vector is half a tile row): a
// product with N = 10 then does 16 columns of multiply-adds per row, not 32.
static_assert(NR % kEdgeCols == 0, "kEdgeCols must divide NR");

// Products with at most this many rows and a row-major B take the streaming
// path (SIMD builds only).  Measured on Zen 3: streaming wins for 1-3 rows,
// the micro-kernel from about 5.
constexpr int64_t kStreamMaxRows = 3;
// The streaming path sums this many floats of C at a time (rows x width).
constexpr int64_t kStreamFloats = 8192;
// A packed B (dg::PackedB) times at most this many rows is streamed: each of
// its floats is used once per product, read from memory (a kept weight bigger
// than the caches: batch 1 through a 512 x 4608 convolution or a 1280 x 1000
// classifier), and the micro-kernel asks for the panel data kPrefetchK rows
// of k ahead of its use (section 2).  With only a few rows of A there is too
// little arithmetic per cache line of B for the out-of-order core to keep
// enough loads in flight, and the hardware prefetcher alone fell behind:
// Zen 3, one thread, weight from memory, 4 x 4608 @ [4608, 512] packed:
// ~950 -> ~600 us (min of 25), the time of a plain read of the packing;
// prefetching 128, 256 or 512 steps ahead, or into L2 only, gained nothing.
constexpr int64_t kStreamPackedRows = MC;
constexpr int64_t kPrefetchK = 64;  // 4 KiB ahead with the AVX2 tile (NR = 16)
// Row-major B is read in place (not packed as a whole) when a thread's part of
// C has at most this many rows, i.e. fits in one block of packed A, so that
// each micro-panel of B is needed during one sweep only.
constexpr int64_t kInPlaceBMaxRows = MC;

// =============================================================================
// 2. Micro-kernels
// =============================================================================
//
// micro_kernel<ROWS, PACKED, COLS>(kc, a, a_rs, a_ks, b, ldb, c, ldc, accumulate)
// computes, for r < ROWS and j < COLS (NR, or kEdgeCols for a narrow last panel),
//     sum[r][j] = sum over k < kc of a[r*a_rs + k*a_ks] * b[k*ldb + j]
// and stores c[r*ldc + j] = sum[r][j], or adds it to c when accumulate is set.
//   a: a packed A row panel (a_rs == 1, a_ks == ROWS: dense, see pack_a), or
//      A itself when it is read in place (either layout),
//   b: COLS floats per k, ldb floats apart: a packed B micro-panel (ldb == NR),
//      or B itself when it is read in place.
// Row panels have MR rows or a few less (see panel_start), so no work is
// wasted on padding rows.  Every element gets the same multiply-adds in the
// same order whatever ROWS and COLS are.
// STREAM: b is a packed B streamed from memory (ldb == NR, the panels one after
// another: see kStreamPackedRows); each step of k also prefetches the cache
// lines kPrefetchK steps ahead.  A hint only: the sums are the same.

// PACKED: a is a packed panel, i.e. a_rs == 1 and a_ks == ROWS, known to the
// compiler: the broadcasts then take constant offsets from one pointer instead
// of a register per row (12 rows of strides do not fit in the registers left).

// Asks for the cache lines of one step of k of a packed B panel, kPrefetchK
// steps ahead (past the panel's end: the next panel's, which follows it).
inline void prefetch_panel_row(const float* b) {
#if defined(__GNUC__) || defined(__clang__)
  for (int line = 0; line < NR; line += 16)  // 16 floats: one 64-byte line
    __builtin_prefetch(b + kPrefetchK * NR + line, 0, 3);
#else
  (void)b;
#endif
}

#if DG_GEMM_SIMD

template <int ROWS, bool PACKED, int COLS, bool STREAM = false>
inline void micro_kernel(int64_t kc, const float* a, int64_t a_rs, int64_t a_ks, const float* b, int64_t ldb,
                         float* c, int64_t ldc, bool accumulate) {
  if (PACKED) a_rs = 1, a_ks = ROWS;
  constexpr int NV = COLS / kWidth;  // vectors per tile row
  Vec acc[ROWS][NV];
  DG_GEMM_UNROLL
  for (int r = 0; r < ROWS; ++r) {
    DG_GEMM_UNROLL
    for (int v = 0; v < NV; ++v)
      acc[r][v] = vzero();
  }
  for (int64_t k = 0; k < kc; ++k) {
    if (STREAM) prefetch_panel_row(b);
    Vec bv[NV];
    DG_GEMM_UNROLL
    for (int v = 0; v < NV; ++v)
      bv[v] = vload(b + v * kWidth);
#ifdef DG_GEMM_LANES
    constexpr int kLaneRows = PACKED ? ROWS / 4 * 4 : 0;  // rows of A taken four at a time
    DG_GEMM_UNROLL
    for (int r = 0; r < kLaneRows; r += 4)
      vfma_lanes<NV>(acc + r, bv, vload(a + r));
#else
    constexpr int kLaneRows = 0;
#endif
    DG_GEMM_UNROLL
    for (int r = kLaneRows; r < ROWS; ++r) {
      const Vec ar = vbroadcast(a + r * a_rs);
      DG_GEMM_UNROLL
      for (int v = 0; v < NV; ++v)
        acc[r][v] = vfma(ar, bv[v], acc[r][v]);
    }
    a += a_ks;
    b += ldb;
  }
  DG_GEMM_UNROLL
  for (int r = 0; r < ROWS; ++r) {
    DG_GEMM_UNROLL
    for (int v = 0; v < NV; ++v) {
      float* p = c + r * ldc + v * kWidth;
      vstore(p, accumulate ? vadd(vload(p), acc[r][v]) : acc[r][v]);
    }
  }
}

#else  // portable

template <int ROWS, bool PACKED, int COLS, bool STREAM = false>
inline void micro_kernel(int64_t kc, const float* a, int64_t a_rs, int64_t a_ks, const float* b, int64_t ldb,
                         float* c, int64_t ldc, bool accumulate) {
  if (PACKED) a_rs = 1, a_ks = ROWS;
  float acc[ROWS][COLS] = {};
  for (int64_t k = 0; k < kc; ++k) {
    if (STREAM) prefetch_panel_row(b);
    DG_GEMM_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      const float ar = a[r * a_rs];
      for (int j = 0; j < COLS; ++j)
        acc[r][j] += ar * b[j];
    }
    a += a_ks;
    b += ldb;
  }
  for (int r = 0; r < ROWS; ++r) {
    float* p = c + r * ldc;
    for (int j = 0; j < COLS; ++j)
      p[j] = accumulate ? p[j] + acc[r][j] : acc[r][j];
  }
}

#endif

// kernel_for(rows, packed, narrow, stream): the micro-kernel for a panel of
// `rows` rows (1..MR) of packed A (or of A in place), NR columns wide or, when
// `narrow`, kEdgeCols, prefetching a streamed packed B when `stream` (with
// packed A only), from tables of micro_kernel<1>, ..., <MR>.
using KernelFn = void (*)(int64_t kc, const float* a, int64_t a_rs, int64_t a_ks, const float* b, int64_t ldb,
                          float* c, int64_t ldc, bool accumulate);

template <bool PACKED, int COLS, bool STREAM, size_t... R>
constexpr std::array<KernelFn, sizeof...(R)> kernel_table(std::index_sequence<R...>) {
  return {{&micro_kernel<int(R) + 1, PACKED, COLS, STREAM>...}};
}

inline KernelFn kernel_for(int64_t rows, bool packed, bool narrow = false, bool stream = false) {
  using Rows = std::make_index_sequence<MR>;
  static constexpr std::array<KernelFn, MR> in_place = kernel_table<false, NR, false>(Rows());
  static constexpr std::array<KernelFn, MR> panels = kernel_table<true, NR, false>(Rows());
  static constexpr std::array<KernelFn, MR> in_place_narrow = kernel_table<false, kEdgeCols, false>(Rows());
  static constexpr std::array<KernelFn, MR> panels_narrow = kernel_table<true, kEdgeCols, false>(Rows());
  static constexpr std::array<KernelFn, MR> streamed = kernel_table<true, NR, true>(Rows());
  static constexpr std::array<KernelFn, MR> streamed_narrow = kernel_table<true, kEdgeCols, true>(Rows());
  if (stream && packed) return narrow ? streamed_narrow[rows - 1] : streamed[rows - 1];
  if (narrow) return packed ? panels_narrow[rows - 1] : in_place_narrow[rows - 1];
  return packed ? panels[rows - 1] : in_place[rows - 1];
}

// Whole micro-panels of a streamed packed B that micro_kernel_panels takes at
// once for a row panel of 1 or 2 rows: 1 x 4 and 2 x 2 panels are 8 vector sums
// with the AVX2 or AVX-512 tile, enough to hide the multiply-add latency (a
// 1-row tile alone has 2 and waits on it: Zen 3, 1280 x 1000 classifier weight
// in L3, ~50 -> ~25% of the micro-kernel's time per float).
inline int streamed_panels(int64_t rows) {
  return rows == 1 ? 4 : rows == 2 ? 2 : 1;
}

// micro_kernel<ROWS, true, NR, true> on P whole micro-panels of a packed B at
// once: panel p at b + p*b_step (its k rows NR floats apart), its tile of C at
// c + p*c_step.  The same multiply-adds in the same order for every element as
// P calls of micro_kernel, only interleaved.
template <int ROWS, int P>
inline void micro_kernel_panels(int64_t kc, const float* a, const float* b, int64_t b_step, float* c,
                                int64_t c_step, int64_t ldc, bool accumulate) {
#if DG_GEMM_SIMD
  constexpr int NV = NR / kWidth;
  Vec acc[P][ROWS][NV];
  DG_GEMM_UNROLL
  for (int p = 0; p < P; ++p) {
    DG_GEMM_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      DG_GEMM_UNROLL
      for (int v = 0; v < NV; ++v)
        acc[p][r][v] = vzero();
    }
  }
  for (int64_t k = 0; k < kc; ++k) {
    Vec ar[ROWS];
    DG_GEMM_UNROLL
    for (int r = 0; r < ROWS; ++r)
      ar[r] = vbroadcast(a + k * ROWS + r);
    DG_GEMM_UNROLL
    for (int p = 0; p < P; ++p) {
      const float* bk = b + p * b_step + k * NR;
      prefetch_panel_row(bk);
      DG_GEMM_UNROLL
      for (int v = 0; v < NV; ++v) {
        const Vec bv = vload(bk + v * kWidth);
        DG_GEMM_UNROLL
        for (int r = 0; r < ROWS; ++r)
          acc[p][r][v] = vfma(ar[r], bv, acc[p][r][v]);
      }
    }
  }
  DG_GEMM_UNROLL
  for (int p = 0; p < P; ++p) {
    DG_GEMM_UNROLL
    for (int r = 0; r < ROWS; ++r) {
      DG_GEMM_UNROLL
      for (int v = 0; v < NV; ++v) {
        float* q = c + p * c_step + r * ldc + v * kWidth;
        vstore(q, accumulate ? vadd(vload(q), acc[p][r][v]) : acc[p][r][v]);
      }
    }
  }
#else
  for (int p = 0; p < P; ++p)
    micro_kernel<ROWS, true, NR, true>(kc, a, 1, ROWS, b + p * b_step, NR, c + p * c_step, ldc, accumulate);
#endif
}

#if DG_GEMM_SIMD
// The tiny-M path, B row-major and read in place:
//   c[r*ldc + j] = sum over k < K of a[r*a_rs + k*a_ks] * b[k*ldb + j]
// for r < rows and j < w (w a multiple of kWidth); c is overwritten.
// The micro-kernel walks down a column strip of B: one cache line per row of
// B, each on another page, which the hardware prefetchers do not follow.  With
// few rows of A there is too little arithmetic per line to hide that, so this
// walks B four rows at a time from left to right instead (sequential reads,
// streamed at full memory speed) and keeps the `rows` x w sums of C in L1.
// A is read in place (a_rs, a_ks: its strides along rows and along k).
inline void stream_rows(int64_t rows, int64_t K, const float* a, int64_t a_rs, int64_t a_ks, const float* b,
                        int64_t ldb, int64_t w, float* c, int64_t ldc) {
  for (int64_t r = 0; r < rows; ++r)
    std::fill(c + r * ldc, c + r * ldc + w, 0.0f);
  int64_t k = 0;
  for (; k + 4 <= K; k += 4) {
    const float* b0 = b + k * ldb;
    const float* b1 = b0 + ldb;
    const float* b2 = b1 + ldb;
    const float* b3 = b2 + ldb;
    // Two rows of C at a time: 8 broadcasts of A, 4 vectors of B, 2 of C.
    for (int64_t r = 0; r < rows; r += 2) {
      const float* a0 = a + r * a_rs + k * a_ks;
      const Vec x0 = vbroadcast(a0), x1 = vbroadcast(a0 + a_ks);
      const Vec x2 = vbroadcast(a0 + 2 * a_ks), x3 = vbroadcast(a0 + 3 * a_ks);
      float* c0 = c + r * ldc;
      if (r + 1 < rows) {
        const float* a1 = a0 + a_rs;
        const Vec y0 = vbroadcast(a1), y1 = vbroadcast(a1 + a_ks);
        const Vec y2 = vbroadcast(a1 + 2 * a_ks), y3 = vbroadcast(a1 + 3 * a_ks);
        float* c1 = c0 + ldc;
        for (int64_t j = 0; j < w; j += kWidth) {
          const Vec v0 = vload(b0 + j), v1 = vload(b1 + j), v2 = vload(b2 + j), v3 = vload(b3 + j);
          Vec s = vload(c0 + j), t = vload(c1 + j);
          s = vfma(x0, v0, s);
          t = vfma(y0, v0, t);
          s = vfma(x1, v1, s);
          t = vfma(y1, v1, t);
          s = vfma(x2, v2, s);
          t = vfma(y2, v2, t);
          s = vfma(x3, v3, s);
          t = vfma(y3, v3, t);
          vstore(c0 + j, s);
          vstore(c1 + j, t);
        }
      } else {
        for (int64_t j = 0; j < w; j += kWidth) {
          Vec s = vload(c0 + j);
          s = vfma(x0, vload(b0 + j), s);
          s = vfma(x1, vload(b1 + j), s);
          s = vfma(x2, vload(b2 + j), s);
          s = vfma(x3, vload(b3 + j), s);
          vstore(c0 + j, s);
        }
      }
    }
  }
  for (; k < K; ++k) {  // the last K % 4 rows of B
    const float* bk = b + k * ldb;
    for (int64_t r = 0; r < rows; ++r) {
      const Vec x = vbroadcast(a + r * a_rs + k * a_ks);
      float* cr = c + r * ldc;
      for (int64_t j = 0; j < w; j += kWidth)
        vstore(cr + j, vfma(x, vload(bk + j), vload(cr + j)));
    }
  }
}
#endif

#if DG_GEMM_SIMD
// The tiny-M path for a transposed B (stored [N, K]: PyTorch's nn.Linear weight),
// read in place: every c[r*ldc + j] is the dot product of row r of A (row-major,
// unit stride along k) and row j of B.  COLS rows of B at a time are read left to
// right (sequential, streamed at memory speed) against all ROWS rows of A, with
// ROWS x COLS independent vector sums (enough to hide the FMA latency), each added
// across its lanes at the end; the last K % kWidth products are added after.
// c is overwritten.
template <int ROWS, int COLS>
inline void stream_dots(int64_t K, const float* a, int64_t lda, const float* b, int64_t ldb, int64_t n,
                        float* c, int64_t ldc) {
  const int64_t k_vec = K / kWidth * kWidth;
  int64_t j = 0;
  for (; j + COLS <= n; j += COLS) {
    Vec s[ROWS][COLS];
    for (int r = 0; r < ROWS; ++r)
      for (int q = 0; q < COLS; ++q)
        s[r][q] = vzero();
    for (int64_t k = 0; k < k_vec; k += kWidth) {
      Vec v[COLS];
      for (int q = 0; q < COLS; ++q)
        v[q] = vload(b + (j + q) * ldb + k);
      for (int r = 0; r < ROWS; ++r) {
        const Vec x = vload(a + r * lda + k);
        for (int q = 0; q < COLS; ++q)
          s[r][q] = vfma(x, v[q], s[r][q]);
      }
    }
    for (int r = 0; r < ROWS; ++r) {
      for (int q = 0; q < COLS; ++q) {
        const float* bq = b + (j + q) * ldb;
        float t = 0.0f;
        for (int64_t k = k_vec; k < K; ++k)
          t += a[r * lda + k] * bq[k];
        c[r * ldc + j + q] = vsum(s[r][q]) + t;
      }
    }
  }
  if (j < n) stream_dots<ROWS, 1>(K, a, lda, b + j * ldb, ldb, n - j, c + j, ldc);  // the last n % COLS
}

// stream_dots for 1..kStreamMaxRows rows.
inline void stream_dots_rows(int64_t rows, int64_t K, const float* a, int64_t lda, const float* b,
                             int64_t ldb, int64_t n, float* c, int64_t ldc) {
  static_assert(kStreamMaxRows == 3, "stream_dots_rows covers 1 to 3 rows");
  if (rows == 1) stream_dots<1, 4>(K, a, lda, b, ldb, n, c, ldc);
  if (rows == 2) stream_dots<2, 2>(K, a, lda, b, ldb, n, c, ldc);
  if (rows == 3) stream_dots<3, 2>(K, a, lda, b, ldb, n, c, ldc);
}
#endif

// =============================================================================
// 3. Packing
// =============================================================================

// A matrix operand as the product sees it: op(X)[r, s] for row r, column s.
struct Operand {
  const float* p;
  int64_t ld;
  bool trans;  // stored transposed: op(X)[r, s] = p[s*ld + r], else p[r*ld + s]
  // B only: op(B) already packed whole (dg::PackedB): for the K block that
  // starts at k0, micro-panel q sits at packed + k0*n_pad + q*NR*kc.
  const float* packed = nullptr;
  int64_t n_pad = 0;
  // B only, read in place: also copy each micro-panel to where `packed`
  // would have it (so that the product packs B for the next ones).
  float* pack_into = nullptr;
  // B only: walk the micro-panels from the last to the first (see PackedB::walk_backward).
  bool backward = false;
};

#if defined(__AVX512F__)
// r[i][j] = r[j][i]: a 16 x 16 float block transposed in registers (pairs of rows
// interleaved, then pairs of pairs, then 128-bit lanes twice).
inline void transpose_16x16(__m512 r[16]) {
  const __mmask16 all = 0xffff;  // (the zero-masking forms, every lane set: the plain ones warn in gcc 12)
  const __mmask8 all8 = 0xff;
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_maskz_unpacklo_ps(all, r[i], r[i + 1]);
    t[i + 1] = _mm512_maskz_unpackhi_ps(all, r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] =
        _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, _mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] =
        _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, _mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(
        _mm512_maskz_unpacklo_pd(all8, _mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(
        _mm512_maskz_unpackhi_pd(all8, _mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_maskz_shuffle_f32x4(all, r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_maskz_shuffle_f32x4(all, r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_maskz_shuffle_f32x4(all, r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_maskz_shuffle_f32x4(all, r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_maskz_shuffle_f32x4(all, t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_maskz_shuffle_f32x4(all, t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_maskz_shuffle_f32x4(all, t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_maskz_shuffle_f32x4(all, t[4 + i], t[12 + i], 0xdd);
  }
}
#endif

#if defined(__AVX__)
// Transposes an 8 x 8 block in registers: given rows[j] = x[j][0..8),
// returns cols[k] = (x[0][k], x[1][k], ..., x[7][k]).
inline void transpose_8x8(const __m256 rows[8], __m256 cols[8]) {
  __m256 t[8], s[8];
  for (int j = 0; j < 8; j += 2) {
    t[j] = _mm256_unpacklo_ps(rows[j], rows[j + 1]);      // x[j][0] x[j+1][0] x[j][1] x[j+1][1] | 4, 5
    t[j + 1] = _mm256_unpackhi_ps(rows[j], rows[j + 1]);  // x[j][2] x[j+1][2] x[j][3] x[j+1][3] | 6, 7
  }
  for (int j = 0; j < 8; j += 4) {
    s[j] = _mm256_shuffle_ps(t[j], t[j + 2], 0x44);          // column 0 | 4 of rows j..j+3
    s[j + 1] = _mm256_shuffle_ps(t[j], t[j + 2], 0xEE);      // column 1 | 5
    s[j + 2] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0x44);  // column 2 | 6
    s[j + 3] = _mm256_shuffle_ps(t[j + 1], t[j + 3], 0xEE);  // column 3 | 7
  }
  for (int k = 0; k < 4; ++k) {
    cols[k] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x20);      // low halves: column k
    cols[k + 4] = _mm256_permute2f128_ps(s[k], s[k + 4], 0x31);  // high halves: column k + 4
  }
}
#endif

// Row panels: mc rows are cut into panel_count(mc) panels of nearly equal
// heights (at most MR); panel q holds rows [panel_start(mc, q), panel_start(mc,
// q + 1)).  20 rows make 5 + 5 + 5 + 5 rather than 6 + 6 + 6 + 2: a panel of
// few rows has few independent accumulators and waits on the FMA latency.
inline int64_t panel_count(int64_t mc) {
  return (mc + MR - 1) / MR;
}
inline int64_t panel_start(int64_t mc, int64_t q) {
  return q * mc / panel_count(mc);
}

// Packs rows [i0, i0+mc) and k in [p0, p0+kc) of op(A) into row panels (see
// panel_start): panel q starts at dst + q*MR*kc and holds, for each k, its
// `rows` values op(A)[i, k] side by side, `rows` floats apart (dense: a panel
// of one row read against a deep K block is kc floats, not MR * kc of which
// one in MR is used, which with KC 1024 would not stay in L1 beside B; batch
// 1 [1, 784] @ [784, 512] took 25 us that way, 18.5 dense).  dst needs 8
// floats of slack after the last panel.
inline void pack_a(const Operand& A, int64_t i0, int64_t mc, int64_t p0, int64_t kc, float* dst) {
  if (A.trans) {
    // A stored [K, M]: the values of one k are adjacent in memory, one
    // copy per k (of a constant size for whole panels, which the compiler
    // turns into a few vector moves).
    for (int64_t q = 0; q < panel_count(mc); ++q) {
      const int64_t ir = panel_start(mc, q), rows = panel_start(mc, q + 1) - ir;
      const float* s = A.p + p0 * A.ld + i0 + ir;
      float* d = dst + q * MR * kc;
      if (rows == MR) {
        for (int64_t k = 0; k < kc; ++k)
          std::memcpy(d + k * MR, s + k * A.ld, MR * sizeof(float));
      } else {
        for (int64_t k = 0; k < kc; ++k)
          std::memcpy(d + k * rows, s + k * A.ld, rows * sizeof(float));
      }
    }
    return;
  }
  // A stored [M, K]: interleave the rows of each panel, i.e. a transpose.
  for (int64_t q = 0; q < panel_count(mc); ++q) {
    const int64_t ir = panel_start(mc, q), rows = panel_start(mc, q + 1) - ir;
    const float* s = A.p + (i0 + ir) * A.ld + p0;
    float* d = dst + q * MR * kc;
    int64_t k = 0;
#if defined(__AVX__)
    // 8 k at a time: transpose 8 x 8 blocks of rows (rows past the panel's
    // height repeat its row 0) and store 8 floats per k.  The lanes past
    // the height are garbage and spill into the next k (or past the
    // panel's end), which is written afterwards, in order.
    // Rows 8..11 of a taller panel (AVX-512's 12) go through a 4 x 8
    // transpose and 4-float stores.
    static_assert(MR <= 12, "pack_a transposes at most 8 + 4 rows");
    for (; k + 8 <= kc; k += 8) {
      __m256 in[8], cols[8];
      for (int j = 0; j < 8; ++j)
        in[j] = _mm256_loadu_ps(s + (j < rows ? j : 0) * A.ld + k);
      transpose_8x8(in, cols);
      if (rows <= 8) {
        for (int kk = 0; kk < 8; ++kk)
          _mm256_storeu_ps(d + (k + kk) * rows, cols[kk]);
        continue;
      }
      for (int j = 0; j < 4; ++j)
        in[j] = _mm256_loadu_ps(s + (8 + j < rows ? 8 + j : 0) * A.ld + k);
      const __m256 t0 = _mm256_unpacklo_ps(in[0], in[1]), t1 = _mm256_unpackhi_ps(in[0], in[1]);
      const __m256 t2 = _mm256_unpacklo_ps(in[2], in[3]), t3 = _mm256_unpackhi_ps(in[2], in[3]);
      const __m256 tail[4] = {
          _mm256_shuffle_ps(t0, t2, 0x44),  // k + 0 | k + 4
          _mm256_shuffle_ps(t0, t2, 0xEE),  // k + 1 | k + 5
          _mm256_shuffle_ps(t1, t3, 0x44),  // k + 2 | k + 6
          _mm256_shuffle_ps(t1, t3, 0xEE),  // k + 3 | k + 7
      };
      for (int kk = 0; kk < 8; ++kk) {
        _mm256_storeu_ps(d + (k + kk) * rows, cols[kk]);
        const __m256 t = tail[kk % 4];
        _mm_storeu_ps(d + (k + kk) * rows + 8,
                      kk < 4 ? _mm256_castps256_ps128(t) : _mm256_extractf128_ps(t, 1));
      }
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t kk = k; kk < kc; ++kk)
        d[kk * rows + r] = s[r * A.ld + kk];
    }
  }
}

// Packs k in [p0, p0+kc) and columns [j0, j0+nc) of op(B) into micro-panels of
// NR columns: panel q (columns j0 + q*NR ...) starts at dst + q*NR*kc and holds,
// for each k, the NR values op(B)[k, j] side by side.  Columns past nc in the
// last panel are zero.
inline void pack_b(const Operand& B, int64_t p0, int64_t kc, int64_t j0, int64_t nc, float* dst) {
  const int64_t n_full = nc / NR * NR, edge = nc - n_full;
  float* const d_edge = dst + n_full * kc;  // the partial last panel, if any
  if (edge > 0) std::fill(d_edge, d_edge + kc * NR, 0.0f);

  if (!B.trans) {
    // B stored [K, N]: walk each row of B once, left to right (sequential
    // reads, which the hardware prefetchers follow), dealing NR floats to
    // each panel.
    for (int64_t k = 0; k < kc; ++k) {
      const float* s = B.p + (p0 + k) * B.ld + j0;
      float* d = dst + k * NR;
      for (int64_t jr = 0; jr < n_full; jr += NR)
        std::memcpy(d + jr * kc, s + jr, NR * sizeof(float));
      for (int64_t j = 0; j < edge; ++j)
        d_edge[k * NR + j] = s[n_full + j];
    }
    return;
  }
  // B stored [N, K]: a transpose, in 8 x 8 blocks through registers where
  // the instruction set allows.
  for (int64_t jr = 0; jr < nc; jr += NR) {
    const int64_t cols = std::min<int64_t>(NR, nc - jr);
    const float* s = B.p + (j0 + jr) * B.ld + p0;
    float* d = dst + jr * kc;
    int64_t k = 0;
#if defined(__AVX__)
    if (cols == NR) {
      for (; k + 8 <= kc; k += 8) {
        for (int j0b = 0; j0b < NR; j0b += 8) {
          __m256 in[8], out[8];
          for (int j = 0; j < 8; ++j)
            in[j] = _mm256_loadu_ps(s + (j0b + j) * B.ld + k);
          transpose_8x8(in, out);
          for (int kk = 0; kk < 8; ++kk)
            _mm256_storeu_ps(d + (k + kk) * NR + j0b, out[kk]);
        }
      }
    }
#endif
    for (int64_t j = 0; j < cols; ++j) {
      for (int64_t kk = k; kk < kc; ++kk)
        d[kk * NR + j] = s[j * B.ld + kk];
    }
  }
}

// =============================================================================
// 4. Blocking helpers and scratch memory
// =============================================================================

// Splits n into the fewest blocks of at most `most`, of equal size rounded up
// to a multiple of `unit` (the last block takes the rest).  Equal blocks avoid
// a thin last block: K = 784 gives 200, 200, 200, 184 rather than 256 x 3, 16.
inline int64_t even_block(int64_t n, int64_t most, int64_t unit) {
  const int64_t blocks = (n + most - 1) / most;
  const int64_t size = (n + blocks - 1) / blocks;
  return (size + unit - 1) / unit * unit;
}

inline int64_t round_up16(int64_t n) {
  return (n + 15) / 16 * 16;
}

// Operations (dg::threads_for) one float of A, B or C moved through memory counts for.
// A product with few rows is bound by reading B, not by arithmetic (batch 1: one
// multiply-add per float of B), and two cores read it about twice as fast, so its
// work is its flops plus its floats moved, each weighing this much.
constexpr double kMoveWork = 8;

// The work of C[M,N] = A[M,K] @ B[K,N] for threads_for: flops and floats moved.
inline int64_t gemm_work(int64_t M, int64_t N, int64_t K) {
  const double m = double(M), n = double(N), k = double(K);
  const double work = 2.0 * m * n * k + kMoveWork * (m * k + k * n + m * n);
  return work < 1e18 ? int64_t(work) : int64_t(1e18);
}

// This thread's packing buffer of at least `floats` floats, 64-byte aligned.
// It grows on demand and is kept for later calls, so a steady stream of
// products allocates nothing.
inline float* scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  const size_t need = static_cast<size_t>(floats) + 16;
  if (buffer.size() < need) buffer.resize(need);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

// =============================================================================
// 5. One thread's rectangle C[m0:m1, n0:n1]
// =============================================================================

// `stream`: take the tiny-M path (decided by gemm from M alone).
template <class Epilogue>
void gemm_part(const Operand& A, const Operand& B, int64_t K, float* C, int64_t ldc, int64_t m0, int64_t m1,
               int64_t n0, int64_t n1, bool stream, const Epilogue& epi, bool add_to_c = false) {
#if DG_GEMM_SIMD
  if (stream && B.trans) {
    // B transposed: dot products of rows, in column strips of kStreamFloats / K.
    const int64_t rows = m1 - m0;
    const int64_t w_max = std::max<int64_t>(8, kStreamFloats / std::max<int64_t>(K, 1));
    for (int64_t j0 = n0; j0 < n1; j0 += w_max) {
      const int64_t w = std::min(w_max, n1 - j0);
      float* c = C + m0 * ldc + j0;
      stream_dots_rows(rows, K, A.p + m0 * A.ld, A.ld, B.p + j0 * B.ld, B.ld, w, c, ldc);
      finish(epi, m0, m1, j0, j0 + w, c, ldc);
    }
    return;
  }
  if (stream) {
    // Every whole NR-wide strip is streamed; a partial last strip goes
    // through the micro-kernel below.
    const int64_t rows = m1 - m0;
    const int64_t n_full = n0 + (n1 - n0) / NR * NR;
    const int64_t a_rs = A.trans ? 1 : A.ld, a_ks = A.trans ? A.ld : 1;
    const float* a_rows = A.p + m0 * a_rs;
    const int64_t w_max = std::max<int64_t>(NR, kStreamFloats / rows / NR * NR);
    for (int64_t j0 = n0; j0 < n_full; j0 += w_max) {
      const int64_t w = std::min(w_max, n_full - j0);
      float* c = C + m0 * ldc + j0;
      stream_rows(rows, K, a_rows, a_rs, a_ks, B.p + j0, B.ld, w, c, ldc);
      finish(epi, m0, m1, j0, j0 + w, c, ldc);
    }
    n0 = n_full;
    if (n0 == n1) return;
  }
#else
  (void)stream;
#endif
  const bool b_packed = B.packed != nullptr;  // packed once for many products (PackedB)
  // Few rows by a packed B: each B panel is read from memory once, prefetched.
  const bool b_streamed = b_packed && m1 - m0 <= kStreamPackedRows;
  const bool b_in_place = !b_packed && !B.trans && m1 - m0 <= kInPlaceBMaxRows;
  // With a single column strip each value of A is used once, and packing it
  // would cost as much as the product: read it in place.
  const bool a_in_place = n1 - n0 <= NR;
  // Where the kernel finds op(A)[i + r, k + 1] from op(A)[i, k]: a + r*a_rs + a_ks.
  const int64_t a_rs = a_in_place && !A.trans ? A.ld : 1;
  const int64_t a_ks = !a_in_place ? MR : A.trans ? A.ld : 1;
  const int64_t kc_max = even_block(K, KC, 8);
  const int64_t mc_max = even_block(m1 - m0, MC, MR);
  // In place, all of B's columns form one block; packed, blocks of <= NC.
  const int64_t nc_max = b_in_place || b_packed ? n1 - n0 : even_block(n1 - n0, NC, NR);

  // Scratch: packed A block | packed B block (or, with B in place, the
  // partial last micro-panel and a copy of the current one) | a tile for
  // partial-width results.
  const int64_t a_size = round_up16(mc_max * kc_max + 8);  // + 8: pack_a's slack
  const int64_t b_size =
      b_packed ? 0 : round_up16((b_in_place ? 2 * NR : (nc_max + NR - 1) / NR * NR) * kc_max);
  float* const a_pack = scratch(a_size + b_size + MR * NR);
  float* const b_pack = a_pack + a_size;
  float* const b_strip = b_pack + NR * kc_max;  // B in place: the copied micro-panel
  float* const tile = b_pack + b_size;

  for (int64_t jc = n0; jc < n1; jc += nc_max) {
    const int64_t nc = std::min(nc_max, n1 - jc);
    const int64_t n_full = nc / NR * NR;
    for (int64_t pc = 0; pc < K; pc += kc_max) {
      const int64_t kc = std::min(kc_max, K - pc);
      const bool first = pc == 0 && !add_to_c, last = pc + kc == K;

      // B for this (jc, pc) block.  In place, only a partial-width last
      // micro-panel is copied (zero padded), so that the kernel never
      // reads past the end of a row of B.
      if (b_packed) {
        // nothing to do: the micro-panels are read where PackedB put them
      } else if (!b_in_place) {
        pack_b(B, pc, kc, jc, nc, b_pack);
      } else if (n_full < nc) {
        pack_b(B, pc, kc, jc + n_full, nc - n_full, b_pack);
      }

      for (int64_t ic = m0; ic < m1; ic += mc_max) {
        const int64_t mc = std::min(mc_max, m1 - ic);
        if (!a_in_place) pack_a(A, ic, mc, pc, kc, a_pack);

        const int64_t panels = (nc + NR - 1) / NR;
        for (int64_t walk = 0; walk < panels; ++walk) {
          const int64_t jr = (B.backward ? panels - 1 - walk : walk) * NR;
          const int64_t nr = std::min<int64_t>(NR, nc - jr);
          // This B micro-panel and the distance between its k rows.
          const float* bp = b_pack + jr * kc;
          int64_t ldbp = NR;
          if (b_packed) {
            bp = B.packed + pc * B.n_pad + (jc + jr) * kc;
          } else if (b_in_place && B.pack_into != nullptr) {
            // Copy the micro-panel to its place in the PackedB and read it there.
            float* dst = B.pack_into + pc * B.n_pad + (jc + jr) * kc;
            if (jr < n_full) {
              const float* src = B.p + pc * B.ld + jc + jr;
              for (int64_t k = 0; k < kc; ++k) {
                std::memcpy(dst + k * NR, src + k * B.ld, NR * sizeof(float));
              }
            } else {
              std::memcpy(dst, b_pack, kc * NR * sizeof(float));
            }
            bp = dst;
          } else if (b_in_place && jr < n_full) {
            bp = B.p + pc * B.ld + jc + jr;
            ldbp = B.ld;
            if (mc > MR) {
              // Several row panels will use this micro-panel.  Its rows
              // lie B.ld floats apart, often a multiple of a large power
              // of two, so they map to a few cache sets and would not stay
              // in L1: copy them side by side first.
              for (int64_t k = 0; k < kc; ++k) {
                std::memcpy(b_strip + k * NR, bp + k * ldbp, NR * sizeof(float));
              }
              bp = b_strip;
              ldbp = NR;
            }
          } else if (b_in_place) {
            bp = b_pack;  // the partial last micro-panel, packed above
          }

          // A streamed B times one or two rows: streamed_panels(mc) whole
          // panels (the next ones in the walk) at once.
          const int group = b_streamed && !row_blocks<Epilogue>::value ? streamed_panels(mc) : 1;
          const int64_t step = B.backward ? -1 : 1;
          if (group > 1 && walk + group <= panels && std::max(jr, jr + (group - 1) * step * NR) + NR <= nc) {
            float* cp = C + ic * ldc + jc + jr;
            if (group == 4) {
              micro_kernel_panels<1, 4>(kc, a_pack, bp, step * NR * kc, cp, step * NR, ldc, !first);
            } else {
              micro_kernel_panels<2, 2>(kc, a_pack, bp, step * NR * kc, cp, step * NR, ldc, !first);
            }
            for (int p = 0; last && p < group; ++p) {
              const int64_t j = jc + jr + p * step * NR;
              finish(epi, ic, ic + mc, j, j + NR, C + ic * ldc + j, ldc);
            }
            walk += group - 1;
            continue;
          }
          // A last panel of at most kEdgeCols columns gets the narrow tile.
          const bool narrow = nr <= kEdgeCols && kEdgeCols < NR;
          for (int64_t q = 0; q < panel_count(mc); ++q) {
            const int64_t ir = panel_start(mc, q), mr = panel_start(mc, q + 1) - ir;
            const KernelFn kernel = kernel_for(mr, !a_in_place, narrow, b_streamed);
            const float* ap = a_pack + q * MR * kc;
            if (a_in_place) {
              ap = A.trans ? A.p + pc * A.ld + ic + ir : A.p + (ic + ir) * A.ld + pc;
            }
            float* cp = C + (ic + ir) * ldc + jc + jr;
            if (nr == (narrow ? kEdgeCols : NR)) {
              kernel(kc, ap, a_rs, a_ks, bp, ldbp, cp, ldc, !first);
            } else {
              // Partial width: compute the tile aside, keep nr columns.
              kernel(kc, ap, a_rs, a_ks, bp, ldbp, tile, NR, false);
              for (int64_t r = 0; r < mr; ++r) {
                float* c_row = cp + r * ldc;
                const float* t_row = tile + r * NR;
                for (int64_t j = 0; j < nr; ++j) {
                  c_row[j] = first ? t_row[j] : c_row[j] + t_row[j];
                }
              }
            }
            if constexpr (row_blocks<Epilogue>::value) {
              // The next block's share, spread over this block's kernel calls.
              const int64_t next0 = ic + mc, next1 = std::min(m1, ic + 2 * mc);
              if (last && next0 < next1) {
                epi.prefetch(next0, next1, jc, jc + nc, walk * panel_count(mc) + q, panels * panel_count(mc));
              }
            } else if (last) {
              finish(epi, ic + ir, ic + ir + mr, jc + jr, jc + jr + nr, cp, ldc);
            }
          }
        }
        if (row_blocks<Epilogue>::value && last)
          finish(epi, ic, ic + mc, jc, jc + nc, C + ic * ldc + jc, ldc);
      }
    }
  }
}

// =============================================================================
// 6. Splitting C over threads
// =============================================================================

// C is cut into a grid of tm x tn rectangles made of whole MR x NR tiles, one
// per thread.
struct Grid {
  int tm = 1, tn = 1;
};

// The grid of at most `threads` parts whose largest part has the least work:
// its multiply-adds plus copying its own packed A and B (an element copied
// counted as 8 multiply-adds, per k).  So M = 9, N = 1280 on two threads is
// split along N; M = 256, N = 10 along M.
// With `whole_rows` (a row-block epilogue, which reads other arrays row by
// row) C is split by rows only, where it has a row panel for every thread.
inline Grid choose_grid(int64_t M, int64_t N, int threads, bool whole_rows = false) {
  const int64_t m_tiles = (M + MR - 1) / MR, n_tiles = (N + NR - 1) / NR;
  const int64_t tn_max = whole_rows && m_tiles >= threads ? 1 : n_tiles;
  Grid best;
  double best_cost = -1.0;
  for (int tm = 1; tm <= threads && tm <= m_tiles; ++tm) {
    for (int tn = 1; tm * tn <= threads && tn <= tn_max; ++tn) {
      const double rows = double(std::min(M, (m_tiles + tm - 1) / tm * MR));
      const double cols = double(std::min(N, (n_tiles + tn - 1) / tn * NR));
      const double cost = rows * cols + 8.0 * (rows + cols);
      if (best_cost < 0.0 || cost < best_cost) {
        best = {tm, tn};
        best_cost = cost;
      }
    }
  }
  return best;
}

// The first row (or column) of part `index` when n is cut into `parts` parts
// made of whole units of `unit`; part_start(.., parts) == n.
inline int64_t part_start(int64_t n, int64_t unit, int parts, int index) {
  const int64_t units = (n + unit - 1) / unit;
  return std::min(n, units * index / parts * unit);
}

inline void check_args(int64_t M, int64_t N, int64_t K, int64_t lda, int64_t a_width, int64_t ldb,
                       int64_t b_width, int64_t ldc) {
  if (M < 0 || N < 0 || K < 0) {
    throw std::invalid_argument("dg::gemm: negative size (M=" + std::to_string(M) +
                                ", N=" + std::to_string(N) + ", K=" + std::to_string(K) + ")");
  }
  if (lda < a_width || ldb < b_width || ldc < N) {
    throw std::invalid_argument(
        "dg::gemm: a leading dimension is smaller than its row (lda=" + std::to_string(lda) + " < " +
        std::to_string(a_width) + ", ldb=" + std::to_string(ldb) + " < " + std::to_string(b_width) +
        " or ldc=" + std::to_string(ldc) + " < " + std::to_string(N) + ")");
  }
}

}  // namespace gemm_detail

// The micro-kernel compiled in: "avx512", "avx2", "neon" or "portable".
constexpr const char* gemm_isa() {
  return gemm_detail::kIsa;
}

// C[M,N] = op(A) @ op(B), then epi on every finished piece of C (see the top
// of this file).  ta: A is stored [K,M] (row stride lda), else [M,K]; tb: B is
// stored [N,K] (row stride ldb), else [K,N].  K == 0 gives zeros.
// Throws std::invalid_argument for negative sizes or a leading dimension
// smaller than its row.
namespace gemm_detail {

// gemm and gemm_add: C = op(A) @ op(B), or C += it (add_to_c), then epi.
template <class Epilogue>
void gemm_into(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, const Epilogue& epi, bool add_to_c) {
  check_args(M, N, K, lda, ta ? M : K, ldb, tb ? K : N, ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    for (int64_t i = 0; i < M; ++i) {
      float* row = C + i * ldc;
      if (!add_to_c) std::fill(row, row + N, 0.0f);
      finish(epi, i, i + 1, 0, N, row, ldc);
    }
    return;
  }
  const Operand a{A, lda, ta}, b{B, ldb, tb};
  // The tiny-M path sums K in one block, unlike the micro-kernel, so the
  // choice depends on M alone, never on how C is split over threads.  (With
  // M <= MR, C is only ever split along N.)  It writes C, never adds to it.
  // A transposed B streams as dot products when A is row-major (unit stride along k).
  const bool stream = DG_GEMM_SIMD && (!tb || !ta) && M <= kStreamMaxRows && !add_to_c;
  const int threads = threads_for(gemm_work(M, N, K));
  const Grid grid = choose_grid(M, N, threads, row_blocks<Epilogue>::value);
  const int parts = grid.tm * grid.tn;
  if (parts == 1) {
    gemm_part(a, b, K, C, ldc, 0, M, 0, N, stream, epi, add_to_c);
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1)
#endif
  for (int part = 0; part < parts; ++part) {
    const int pi = part / grid.tn, pj = part % grid.tn;
    gemm_part(a, b, K, C, ldc, part_start(M, MR, grid.tm, pi), part_start(M, MR, grid.tm, pi + 1),
              part_start(N, NR, grid.tn, pj), part_start(N, NR, grid.tn, pj + 1), stream, epi, add_to_c);
  }
}

}  // namespace gemm_detail

template <class Epilogue = NoEpilogue>
void gemm(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
          int64_t ldb, float* C, int64_t ldc, const Epilogue& epi = Epilogue()) {
  gemm_detail::gemm_into(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, epi, false);
}

// C[M,N] += op(A) @ op(B): a sum of products made in place (a convolution's
// weight gradient over the images), K blocked as gemm's.  Arguments as gemm's.
inline void gemm_add(bool ta, bool tb, int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                     const float* B, int64_t ldb, float* C, int64_t ldc) {
  gemm_detail::gemm_into(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, NoEpilogue(), true);
}

// op(B)[K, N] packed once into the micro-panels every product with it reads,
// for loops that multiply many matrices by the same B: a recursive model's
// level loop makes one before the loop for each weight (deepgen hoists the
// packing there) instead of copying B again at every level.  The packing is
// gemm's for a product with K and N (the same K blocks, so the same sums in
// the same order: results equal gemm's with the unpacked B).
//
// Packing happens during the first product with more than MR rows: that
// product, reading B in place, copies each micro-panel once anyway (to an L1
// strip, for its several row panels); it copies it to its packed place instead,
// so packing costs little.  Smaller products read row-major B in place while it
// is not packed yet (streamed up to kStreamMaxRows rows, one row panel up to
// MR), so a loop of one- to few-row products (a batch of one tree) never packs;
// once packed, products of every M read the panels.  The memory is scratch
// (dg_arena.h): reused across calls.  B must not change while a PackedB of it is alive, and
// a PackedB is used by one thread at a time.
class PackedB {
 public:
  // tb: B is stored [N, K] (row stride ldb), else [K, N].
  // storage: where the panels go (storage_floats(K, N) floats, owned by the
  // caller: dg::KeptPackedB keeps them between calls), or null for scratch.
  PackedB(bool tb, int64_t K, int64_t N, const float* B, int64_t ldb, float* storage = nullptr)
      : tb_(tb),
        K_(K),
        N_(N),
        B_(B),
        ldb_(ldb),
        n_pad_((N + gemm_detail::NR - 1) / gemm_detail::NR * gemm_detail::NR),
        storage_(storage) {
    gemm_detail::check_args(1, N, K, K, K, ldb, tb ? K : N, N);
  }
  static int64_t storage_floats(int64_t K, int64_t N) {
    return K * ((N + gemm_detail::NR - 1) / gemm_detail::NR * gemm_detail::NR) + 16;
  }
  PackedB(const PackedB&) = delete;
  PackedB& operator=(const PackedB&) = delete;

  bool tb() const { return tb_; }
  int64_t K() const { return K_; }
  int64_t N() const { return N_; }
  const float* source() const { return B_; }
  int64_t ldb() const { return ldb_; }
  int64_t n_pad() const { return n_pad_; }
  bool is_packed() const { return packed_; }

  // Which way the next product walks the panels: every other product goes
  // from the last panel to the first.  A weight a little larger than the L2
  // cache (a TreeLSTM's U at H 256 is 2.6 MB; an L2 of 1 or 2 MB) read the
  // same way round at every level misses on every panel (each one was evicted
  // by the ones after it); read back and forth, the panels a product read last
  // are the first the next one needs, still cached.  The order of the panels
  // changes no sum (each tile of C is computed alone), so results are the
  // same.  Atomic: forward() calls on several threads share a kept packing.
  bool walk_backward() const { return (walks_.fetch_add(1, std::memory_order_relaxed) & 1) != 0; }

  // The packed panels, packed now if no product has packed them yet.
  const float* packed() const {
    using namespace gemm_detail;
    if (!packed_) {
      const Operand b{B_, ldb_, tb_};
      const int64_t kc_max = even_block(K_, KC, 8);
      for (int64_t pc = 0; pc < K_; pc += kc_max) {
        pack_b(b, pc, std::min(kc_max, K_ - pc), 0, N_, storage() + pc * n_pad_);
      }
      packed_ = true;
    }
    return storage();
  }

  // B's values now live at `B` (the same values, moved), or only in the
  // packing (null: dg::KeptPackedB freed the stored weight; a packing without
  // a source is always read packed).
  void set_source(const float* B) { B_ = B; }

  // Writes op(B) back in B's stored layout (row stride ldb): the inverse of
  // packing, exact (the panels hold B's floats unchanged).
  void unpack(float* B, int64_t ldb) const {
    using namespace gemm_detail;
    const float* panels = packed();
    const int64_t kc_max = even_block(K_, KC, 8);
    for (int64_t pc = 0; pc < K_; pc += kc_max) {
      const int64_t kc = std::min(kc_max, K_ - pc);
      for (int64_t j0 = 0; j0 < N_; j0 += NR) {
        const float* panel = panels + pc * n_pad_ + j0 * kc;  // panel j0 / NR of this K block
        const int64_t cols = std::min<int64_t>(NR, N_ - j0);
        for (int64_t k = 0; k < kc; ++k) {
          for (int64_t j = 0; j < cols; ++j) {
            const float v = panel[k * NR + j];
            if (tb_) {
              B[(j0 + j) * ldb + pc + k] = v;
            } else {
              B[(pc + k) * ldb + j0 + j] = v;
            }
          }
        }
      }
    }
  }

  // Where a product that reads B in place writes the panels (then mark_packed).
  float* storage() const {
    if (storage_ != nullptr) return storage_;
    if (!data_) data_.emplace(storage_floats(K_, N_));
    return data_->data();
  }
  void mark_packed() const { packed_ = true; }

 private:
  bool tb_;
  int64_t K_, N_;
  const float* B_;
  int64_t ldb_, n_pad_;
  float* storage_;
  mutable std::optional<Scratch<float>> data_;
  mutable bool packed_ = false;
  mutable std::atomic<uint32_t> walks_{0};
};

// C[M,N] = op(A) @ B for a PackedB B (K and N are B's), then epi as above.
template <class Epilogue = NoEpilogue>
void gemm(bool ta, int64_t M, const float* A, int64_t lda, const PackedB& B, float* C, int64_t ldc,
          const Epilogue& epi = Epilogue()) {
  using namespace gemm_detail;
  const int64_t N = B.N(), K = B.K();
  // A transposed B is packed (once for the loop) rather than streamed: the
  // micro-kernel reads packed panels faster than dot products read its rows.
  // Once packed, B is read packed at every M: the panels are contiguous, each
  // thread's share of N stays in its own cache from call to call, and that
  // beats streaming the rows again (a forward pass's 1- to 3-row products by a
  // kept weight, dg_packed_weights.h).
  const bool stream = DG_GEMM_SIMD && !B.tb() && M <= kStreamMaxRows && !B.is_packed();
  // Up to MR rows (one row panel), gemm reads row-major B in place without any
  // copy: cheaper than packing unless B is packed already.
  const bool one_panel = !B.tb() && M <= MR && !B.is_packed();
  if (M <= 0 || N == 0 || K == 0 || stream || one_panel) {
    gemm(ta, B.tb(), M, N, K, A, lda, B.source(), B.ldb(), C, ldc, epi);
    return;
  }
  check_args(M, N, K, lda, ta ? M : K, N, N, ldc);
  const Operand a{A, lda, ta};
  const int threads = threads_for(gemm_work(M, N, K));
  const Grid grid = choose_grid(M, N, threads, gemm_detail::row_blocks<Epilogue>::value);
  Operand b{B.source(), B.ldb(), B.tb()};
  b.n_pad = B.n_pad();
  // Pack while multiplying where gemm_part reads B in place and each thread
  // owns its columns (so each panel is written once); else pack first.
  const bool pack_while = !B.is_packed() && !B.tb() && M <= kInPlaceBMaxRows && grid.tm == 1;
  if (pack_while) {
    b.pack_into = B.storage();
  } else {
    b.packed = B.packed();
    b.backward = B.walk_backward();
  }
  const int parts = grid.tm * grid.tn;
  if (parts == 1) {
    gemm_part(a, b, K, C, ldc, 0, M, 0, N, false, epi);
    if (pack_while) B.mark_packed();
    return;
  }
#ifdef _OPENMP
#pragma omp parallel for num_threads(parts) schedule(static, 1)
#endif
  for (int part = 0; part < parts; ++part) {
    const int pi = part / grid.tn, pj = part % grid.tn;
    gemm_part(a, b, K, C, ldc, part_start(M, MR, grid.tm, pi), part_start(M, MR, grid.tm, pi + 1),
              part_start(N, NR, grid.tn, pj), part_start(N, NR, grid.tn, pj + 1), false, epi);
  }
  if (pack_while) B.mark_packed();
}

}  // namespace dg

#undef DG_GEMM_UNROLL
#undef DG_GEMM_SIMD
#undef DG_GEMM_LANES
