// dg_int8.h: int8 inference. A model generated with --precision int8 computes each
// product by a weight (a dense layer's x @ W) as
//
//   quantize_int8         the activation, with its static per-tensor scale, into
//                         rows of whole 4-byte groups (values in [-127, 127])
//   Int8PackedB           the weight quantized per output channel with its scales
//                         (quantize_weight_int8, values in [-63, 63]) and packed:
//                         once per change of the parameters (dg_int8_weights.h)
//   matmul_int8           the int8 products summed exactly in int32, then
//                         y[i][j] = float(sum) * (x_scale * w_scale[j])
//
// quantize(v, s, qmax) = clamp(round_half_even(v * (1 / s)), -qmax, qmax): 1 / s is
// one float division, v * (1 / s) one float product, rounded by nearbyint in the
// default rounding mode (to nearest, ties to even). The scales are buffers the
// weights file holds (deepgen quantize writes them); a scale that is 0 (never
// loaded), negative or not finite throws std::invalid_argument naming it.
//
// Why weights have 7 bits: the AVX2 kernel multiplies unsigned activation bytes
// (the int8 value + 128, in [1, 255]) by signed weight bytes with vpmaddubsw,
// which adds two products into an int16 and saturates. With |w| <= 63 a pair is
// at most 2 * 255 * 63 = 32130 < 32767: never saturated, so the sums are exact
// (ONNX Runtime's reduce_range makes the same choice on AVX2; keeping 8-bit
// weights exactly, |a| times the weight given a's sign by vpsignb, measured 30%
// slower). The +128 is taken off with the weight's column sums:
// sum_k (a + 128) w = sum_k a w + 128 sum_k w.
// VNNI (vpdpbusd) adds four products in int32 and needs no such bound; it uses
// the same quantized values, so every path gives the same integers.
//
// The kernels, by what the compiler targets (int8_kernel() names the one built):
//   amx           AMX tiles (tdpbssd: signed x signed, 16 x 16 int32 sums of 64
//                 products each) for products of kInt8AmxMinRows rows or more,
//                 when amx_ready() (dg_amx.h; DG_AMX=0 turns it off); fewer
//                 rows, or tiles refused, run avx512_vnni
//   avx512_vnni   zmm vpdpbusd: one 16-column panel group per instruction, blocks
//                 of up to 12 rows x 2 panels (or 1-5 rows x 4 panels)
//   avx_vnni      the AVX2 kernel with ymm vpdpbusd (AVX-VNNI)
//   avx2          the AVX2 kernel (vpmaddubsw + vpmaddwd)
//   portable      plain loops
// Each sums the same integers (exact, in int32), then the same float steps.
// A convolution (dg_int8_conv.h) may make its rows straight in the AMX tiles'
// layout and have its output written as planes with the bias (matmul_int8_tiles).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "dg_amx.h"
#include "dg_arena.h"
#include "dg_gemm.h"
#include "dg_parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The zmm VNNI kernel (AVX-512 VNNI and BW), and the AMX one on top of it.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DG_INT8_VNNI512 1
#else
#define DG_INT8_VNNI512 0
#endif
#if DG_INT8_VNNI512 && DG_AMX && defined(__AMX_INT8__)
#define DG_INT8_AMX 1
#else
#define DG_INT8_AMX 0
#endif

namespace dg {

// The largest magnitudes of a quantized activation and of a quantized weight.
constexpr int kInt8ActivationMax = 127;
constexpr int kInt8WeightMax = 63;

// Whether a convolution's channel epilogue writes the output quantized, channels
// last, for the int8 convolution that reads it (dg_int8_conv.h ChannelsLastInt8):
// then the tiles' sums are given to its store(...) instead of written as planes.
template <class E, class = void>
struct int8_channels_last : std::false_type {};
template <class E>
struct int8_channels_last<E, std::void_t<decltype(E::kChannelsLastInt8)>> : std::true_type {};

// A product's output handed over to the int8 product that reads it, and nothing
// else does, already quantized as that one's quantize_int8 would quantize it: rows
// of int8_row_bytes(N) bytes, quantize(y, *scale) (the reader's input scale, named
// scale_name in errors), in an arena piece (ops/quantize.py, handed_over). data
// null: no such output.
struct Int8Rows {
  int8_t* data = nullptr;
  const float* scale = nullptr;
  const char* scale_name = "";
};

// An arena piece (float*) holding int8 values.
inline int8_t* int8_data(float* p) {
  return reinterpret_cast<int8_t*>(p);
}
inline const int8_t* int8_data(const float* p) {
  return reinterpret_cast<const int8_t*>(p);
}

// The bytes of an activation row of K values: whole groups of four (the products
// read four k at a time), the padding zeros.
inline int64_t int8_row_bytes(int64_t K) {
  return (K + 3) / 4 * 4;
}

// Throws unless scale[0..n) are positive and finite.
inline void check_int8_scales(const float* scale, int64_t n, const char* scale_name) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = scale[i];
    if (s > 0.0f && std::isfinite(s)) continue;
    const std::string name =
        std::string("int8 scale '") + scale_name + "'" + (n > 1 ? "[" + std::to_string(i) + "]" : "");
    if (s == 0.0f)
      throw std::invalid_argument(name +
                                  " is 0: it was never set; run `deepgen quantize MODEL.py --weights W.npz "
                                  "--calibrate DATA.npz -o Wq.npz` and load Wq.npz");
    throw std::invalid_argument(name + " is " + std::to_string(s) + ": a scale must be positive and finite");
  }
}

inline int8_t quantize_int8_value(float x, float inv_scale, int qmax) {
  const float r = std::nearbyint(x * inv_scale);
  return static_cast<int8_t>(std::max(-float(qmax), std::min(float(qmax), r)));
}

#if defined(__AVX512F__)
// 16 values quantized (x * inv, the bounds lo = -qmax and hi = qmax) into 16 bytes:
// clamped before they are rounded (the same values: the bounds are whole numbers),
// rounded to nearest even by the conversion itself, narrowed with saturation
// (vpmovsdb) as the AVX2 loop's packs do. (Written as the zero-masking forms with
// every lane set: GCC 12 warns of the plain forms' undefined operand.) Shared by
// quantize_int8_span and the convolutions' channels-last copy (dg_int8_conv.h).
inline __m128i quantize_int8_x16(__m512 x, __m512 inv, __m512 lo, __m512 hi) {
  const __mmask16 all = 0xffff;
  const __m512 clamped =
      _mm512_maskz_max_ps(all, lo, _mm512_maskz_min_ps(all, hi, _mm512_maskz_mul_ps(all, x, inv)));
  return _mm512_maskz_cvtsepi32_epi8(
      all, _mm512_maskz_cvt_roundps_epi32(all, clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// q[i] = quantize(x[i], scale, qmax) for n elements (inv = 1 / scale).
inline void quantize_int8_span(const float* x, int8_t* q, float inv, int64_t n, int qmax) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 inv512 = _mm512_set1_ps(inv), lo512 = _mm512_set1_ps(-float(qmax)),
               hi512 = _mm512_set1_ps(float(qmax));
  for (; i + 32 <= n; i += 32)  // two vectors a step: two independent chains
    for (int64_t h = 0; h < 32; h += 16)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i + h),
                       quantize_int8_x16(_mm512_loadu_ps(x + i + h), inv512, lo512, hi512));
#endif
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-float(qmax)),
               hi = _mm256_set1_ps(float(qmax));
  for (; i + 16 <= n; i += 16) {
    __m256 a = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 b = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8), vinv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    a = _mm256_max_ps(lo, _mm256_min_ps(hi, a));
    b = _mm256_max_ps(lo, _mm256_min_ps(hi, b));
    const __m256i words =
        _mm256_packs_epi32(_mm256_cvtps_epi32(a), _mm256_cvtps_epi32(b));  // lanes: a0-3 b0-3 a4-7 b4-7
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    // bytes: a0-3 b0-3 a4-7 b4-7 -> a0-7 b0-7
    const __m128i order = _mm_shuffle_epi32(bytes, _MM_SHUFFLE(3, 1, 2, 0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), order);
  }
#endif
  for (; i < n; ++i)
    q[i] = quantize_int8_value(x[i], inv, qmax);
}

// The activation x[rows, K] quantized with its one scale (scale[0]) into q: rows
// of int8_row_bytes(K) bytes, the padding after each row's K values zero.
inline void quantize_int8(const float* x, int8_t* q, const float* scale, int64_t rows, int64_t K,
                          const char* scale_name) {
  check_int8_scales(scale, 1, scale_name);
  const float inv = 1.0f / scale[0];
  const int64_t ld = int8_row_bytes(K);
  const int threads = threads_for(2 * rows * K);  // (rows shared out over threads)
  if (ld == K && threads == 1) {
    quantize_int8_span(x, q, inv, rows * K, kInt8ActivationMax);
    return;
  }
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    quantize_int8_span(x + i * K, q + i * ld, inv, K, kInt8ActivationMax);
    if (ld > K) std::memset(q + i * ld + K, 0, static_cast<size_t>(ld - K));
  }
}

// The weight quantized per output channel (channel j with scale[j], to
// [-kInt8WeightMax, kInt8WeightMax]) into q[P, K]: one row per channel, whether
// the weight is stored [K, P] (a dense layer's) or [P, K] (stored_PK).
inline void quantize_weight_int8(const float* w, int8_t* q, const float* scale, int64_t P, int64_t K,
                                 bool stored_PK, const char* scale_name) {
  check_int8_scales(scale, P, scale_name);
  for (int64_t j = 0; j < P; ++j) {
    const float inv = 1.0f / scale[j];
    if (stored_PK) {
      quantize_int8_span(w + j * K, q + j * K, inv, K, kInt8WeightMax);
    } else {
      for (int64_t k = 0; k < K; ++k)
        q[j * K + k] = quantize_int8_value(w[k * P + j], inv, kInt8WeightMax);
    }
  }
}

// A quantized weight as the products read it: op(W) is [K, N], cut into panels of
// 16 columns; in a panel, for each group of four k, 16 columns of 4 bytes
// (column c's w[4g..4g+3][c]: what vpmaddubsw pairs and vpmaddwd adds, what
// vpdpbusd adds at once, and one row of an AMX B tile). A panel holds its groups
// rounded up to a multiple of 16 (panel_groups): 16 groups (64 k, 1 KB) are one
// AMX B tile, so every tile, the last one too, loads from the panel with a 64-byte
// stride. Padding (k past K, columns past N) is zero. It keeps the scales it was
// quantized with and 128 * each column's sum (the correction of the activation's
// +128).
struct Int8PackedB {
  static constexpr int64_t kCols = 16;
  static constexpr int64_t kTileGroups = 16;  // groups of four k in one AMX B tile

  // q[N, K]: the weight quantize_weight_int8 made with w_scale[0..N).
  Int8PackedB(const int8_t* q, const float* w_scale, int64_t K_, int64_t N_)
      : K(K_),
        N(N_),
        groups((K_ + 3) / 4),
        panel_groups((groups + kTileGroups - 1) / kTileGroups * kTileGroups),
        panels((N_ + kCols - 1) / kCols),
        data(static_cast<size_t>(panels * panel_groups * kCols * 4), 0),
        shift(static_cast<size_t>(panels * kCols), 0),
        scale(static_cast<size_t>(panels * kCols), 1.0f) {
    for (int64_t j = 0; j < N; ++j) {
      int32_t sum = 0;
      for (int64_t k = 0; k < K; ++k) {
        data[static_cast<size_t>(at(k, j))] = q[j * K + k];
        sum += q[j * K + k];
      }
      shift[static_cast<size_t>(j)] = 128 * sum;
      scale[static_cast<size_t>(j)] = w_scale[j];
    }
  }

  int64_t K, N, groups, panel_groups, panels;
  std::vector<int8_t, LineAligned<int8_t>> data;  // (panel rows on cache lines)
  std::vector<int32_t> shift;                     // [panels * 16]: 128 * sum_k w[k][j]
  std::vector<float> scale;                       // [panels * 16]: w_scale[j] (1 past N)

  // Where w[k][j] is in data.
  int64_t at(int64_t k, int64_t j) const {
    return ((j / kCols * panel_groups + k / 4) * kCols + j % kCols) * 4 + k % 4;
  }
  const int8_t* panel(int64_t p) const { return data.data() + p * panel_groups * kCols * 4; }
  int64_t bytes() const {
    return static_cast<int64_t>(data.size() + shift.size() * sizeof(int32_t) + scale.size() * sizeof(float));
  }
};

// The weight w (stored [K, N], or [N, K] when stored_PK) quantized with its
// per-channel scales w_scale[N] and packed: what the products read.
inline Int8PackedB quantize_pack_int8(const float* w, const float* w_scale, int64_t K, int64_t N,
                                      bool stored_PK, const char* scale_name) {
  std::vector<int8_t> q(static_cast<size_t>(N * K));
  quantize_weight_int8(w, q.data(), w_scale, N, K, stored_PK, scale_name);
  return Int8PackedB(q.data(), w_scale, K, N);
}

// y = float(s) * (x_scale * w_scale[j]) for the `cols` columns of one panel row.
inline void int8_scale_out(const int32_t* sums, float xs, const float* w_scale, float* c, int64_t cols) {
  for (int64_t t = 0; t < cols; ++t)
    c[t] = static_cast<float>(sums[t]) * (xs * w_scale[t]);
}

#if defined(__AVX512F__)
// Whether a convolution's channel epilogue (dg_conv.h's conv2d_with: epi(o, c, n) on
// n finished values c of output channel o) also has a form on 16 values in a
// register, epi.in_register(o, v, c, lanes) -> the values to store at c (lanes:
// those stored), which a store runs before it stores: the values are not read back.
template <class E, class = void>
struct int8_in_register : std::false_type {};
template <class E>
struct int8_in_register<
    E, std::void_t<decltype(static_cast<void>(std::declval<const E&>().in_register(
           int64_t(0), _mm512_setzero_ps(), static_cast<const float*>(nullptr), static_cast<__mmask16>(0))))>>
    : std::true_type {};

// y, 16 values of output channel o on their way to c (`lanes` of them stored there),
// stored, with the channel epilogue epi run on them (in the register where it can).
template <class Epi>
inline void int8_store_run(const Epi& epi, int64_t o, __m512 y, float* c, __mmask16 lanes, int64_t n) {
  if constexpr (int8_in_register<Epi>::value) y = epi.in_register(o, y, c, lanes);
  if (n == 16)
    _mm512_storeu_ps(c, y);
  else
    _mm512_mask_storeu_ps(c, lanes, y);
  if constexpr (!int8_in_register<Epi>::value) epi(o, c, n);
}
#endif

#if defined(__AVX2__)
// sum += the four products of each column's 4 bytes of w with the row's 4 bytes in
// x (unsigned): vpdpbusd where the CPU has VNNI, else vpmaddubsw (pairs, exact:
// see the top of this file) and vpmaddwd by ones (the two pairs into int32).
inline __m256i int8_dot4(__m256i sum, __m256i x, __m256i w) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(sum, x, w);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(sum, x, w);
#else
  return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(x, w), _mm256_set1_epi16(1)));
#endif
}

// R rows (a, lda bytes apart) times one panel: c[r][0..cols) (ldc floats apart).
template <int R>
inline void matmul_int8_panel(const int8_t* a, int64_t lda, const Int8PackedB& b, int64_t p, float xs,
                              float* c, int64_t ldc, int64_t cols) {
  const int8_t* w = b.panel(p);
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));  // int8 a -> uint8 a + 128
  __m256i lo[R], hi[R];                                            // columns 0-7 and 8-15
  for (int r = 0; r < R; ++r)
    lo[r] = hi[r] = _mm256_setzero_si256();
  for (int64_t g = 0; g < b.groups; ++g, w += 64) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32));
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a + r * lda + 4 * g, 4);
      const __m256i x = _mm256_xor_si256(_mm256_set1_epi32(four), flip);
      lo[r] = int8_dot4(lo[r], x, w0);
      hi[r] = int8_dot4(hi[r], x, w1);
    }
  }
  const int64_t j = p * Int8PackedB::kCols;
  const __m256i shift0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.shift.data() + j));
  const __m256i shift1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.shift.data() + j + 8));
  const __m256 vxs = _mm256_set1_ps(xs);
  const __m256 scale0 =
      _mm256_mul_ps(vxs, _mm256_loadu_ps(b.scale.data() + j));  // x_scale * w_scale[j], as scalar
  const __m256 scale1 = _mm256_mul_ps(vxs, _mm256_loadu_ps(b.scale.data() + j + 8));
  for (int r = 0; r < R; ++r) {
    const __m256 y0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(lo[r], shift0)), scale0);
    const __m256 y1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(hi[r], shift1)), scale1);
    float* out = c + r * ldc;
    if (cols == Int8PackedB::kCols) {
      _mm256_storeu_ps(out, y0);
      _mm256_storeu_ps(out + 8, y1);
    } else {
      alignas(32) float row[Int8PackedB::kCols];
      _mm256_store_ps(row, y0);
      _mm256_store_ps(row + 8, y1);
      std::copy(row, row + cols, out);
    }
  }
}
#else
// The portable loop: the same integer sums (exact in any order), the same float steps.
template <int R>
inline void matmul_int8_panel(const int8_t* a, int64_t lda, const Int8PackedB& b, int64_t p, float xs,
                              float* c, int64_t ldc, int64_t cols) {
  const int64_t j0 = p * Int8PackedB::kCols;
  for (int r = 0; r < R; ++r) {
    int32_t sums[Int8PackedB::kCols];
    for (int64_t t = 0; t < cols; ++t) {
      int32_t s = 0;
      for (int64_t k = 0; k < b.K; ++k)
        s += int32_t(a[r * lda + k]) * int32_t(b.data[static_cast<size_t>(b.at(k, j0 + t))]);
      sums[t] = s;
    }
    int8_scale_out(sums, xs, b.scale.data() + j0, c + r * ldc, cols);
  }
}
#endif

#if DG_INT8_VNNI512
// The activation flipped to unsigned bytes (a + 128, in [1, 255]: the unsigned
// operand of vpdpbusd), once per product into a buffer of the calling thread, so
// that the kernel's broadcast of a row's 4 bytes is vpdpbusd's own memory operand
// (no xor per row, group and panel). The padding bytes become 128: the weight's
// padding is zero, so they add nothing.
inline const uint8_t* int8_flipped(const int8_t* a, int64_t bytes) {
  static thread_local std::vector<uint8_t> buffer;
  if (static_cast<int64_t>(buffer.size()) < bytes) buffer.resize(static_cast<size_t>(bytes));
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64)
    _mm512_storeu_si512(buffer.data() + i, _mm512_xor_si512(_mm512_loadu_si512(a + i), flip));
  for (; i < bytes; ++i)
    buffer[static_cast<size_t>(i)] = static_cast<uint8_t>(a[i] ^ int8_t(-128));
  return buffer.data();
}

// c[r][0..cols) = float(sum[r]) * (x_scale * w_scale[j]) for one panel's 16
// columns (scale = x_scale * w_scale[j..j+16), multiplied first, as the reference
// does); a panel past N's last column stores only its `cols` columns.
// (The conversion is written masked, all 16 lanes: GCC 12 warns of
// _mm512_cvtepi32_ps's undefined pass-through operand.)
inline void int8_store16(__m512i sum, __m512 scale, float* out, int64_t cols) {
  const __m512 y = _mm512_mul_ps(_mm512_maskz_cvtepi32_ps(static_cast<__mmask16>(0xffff), sum), scale);
  if (cols == Int8PackedB::kCols)
    _mm512_storeu_ps(out, y);
  else
    _mm512_mask_storeu_ps(out, static_cast<__mmask16>((1u << cols) - 1), y);
}

// The 16 x 16 block of sums (row r at sums + r * ld: product rows i0 + r, columns
// j..j + cols) scaled as int8_store16 scales them (+ bias[j], one float add) and
// written as planes: product row i is position i % plane of image i / plane, so
// (i, j) goes to c[((i / plane) * N + j) * plane + i % plane]. The block is
// transposed in registers; each column's 16 rows are one store where they lie in
// one plane (plane a multiple of 16), else a masked store per plane (the lanes
// moved down by vcompressps). Rows past `rows` are not stored. Each run of a
// column's values in a plane gets the channel epilogue epi (int8_store_run) as it
// is stored: a convolution's batch norm, residual and relu (dg_int8_conv.h).
template <class Epi>
inline void int8_store16_planes(const int32_t* sums, int64_t ld, __m512 scale, const float* bias, float* c,
                                int64_t i0, int64_t rows, int64_t j, int64_t cols, int64_t N, int64_t plane,
                                const Epi& epi) {
  __m512 v[16];
  for (int r = 0; r < 16; ++r)
    v[r] = _mm512_mul_ps(
        _mm512_maskz_cvtepi32_ps(static_cast<__mmask16>(0xffff), _mm512_loadu_si512(sums + r * ld)), scale);
  gemm_detail::transpose_16x16(v);
  for (int64_t t = 0; t < cols; ++t) {
    const __m512 y = bias != nullptr ? _mm512_add_ps(v[t], _mm512_set1_ps(bias[j + t])) : v[t];
    for (int64_t i = i0; i < i0 + rows;) {
      const int64_t p = i % plane, n = std::min(plane - p, i0 + rows - i);
      float* out = c + (i / plane * N + j + t) * plane + p;
      const __mmask16 first = static_cast<__mmask16>((1u << n) - 1);  // (n == 16: every lane)
      if (n == 16) {
        int8_store_run(epi, j + t, y, out, first, n);
      } else {
        const __mmask16 lanes = static_cast<__mmask16>(((1u << n) - 1) << (i - i0));
        int8_store_run(epi, j + t, _mm512_maskz_compress_ps(lanes, y), out, first, n);
      }
      i += n;
    }
  }
}

// Asks for the lines int8_store16_planes will write for rows [i0, i0 + rows) of
// columns [j, j + cols) (and those its channel epilogue will read there, the
// residual's): in short runs, one a plane, which the hardware prefetchers miss
// (a sixth of an int8 ResNet-50's product time stalled on the residual's loads).
template <class Epi>
inline void int8_prefetch_planes(float* c, int64_t i0, int64_t rows, int64_t j, int64_t cols, int64_t N,
                                 int64_t plane, const Epi& epi) {
  for (int64_t t = 0; t < cols; ++t)
    for (int64_t i = i0; i < i0 + rows;) {
      const int64_t p = i % plane, n = std::min(plane - p, i0 + rows - i);
      float* out = c + (i / plane * N + j + t) * plane + p;
      for (int64_t k = 0; k < n; k += 16)
        __builtin_prefetch(out + k, 1);
      if constexpr (gemm_detail::has_prefetch<Epi>::value) epi.prefetch(out, n);
      i += n;
    }
}

// R rows of the flipped activation (a, lda bytes apart) times P panels from p0:
// c[r][16 * p0 ...] (ldc floats apart). Per group of four k, each panel's 64
// bytes are one zmm (16 columns x 4 k) and each row's 4 bytes are broadcast to
// the 16 lanes; one vpdpbusd adds the 4 products of every column into its int32
// lane. R * P accumulators: 12 x 2 = 24 of the 32 zmm registers (the rest hold the
// panels' vectors), or 5 x 4 for a few rows, where more independent sums hide
// vpdpbusd's latency. At the end 128 * sum_k w is taken off each column.
template <int R, int P>
inline void matmul_int8_vnni_block(const uint8_t* a, int64_t lda, const Int8PackedB& b, int64_t p0, float xs,
                                   float* c, int64_t ldc) {
  const int64_t stride = b.panel_groups * Int8PackedB::kCols * 4;  // bytes from a panel to the next
  const int8_t* w = b.panel(p0);
  __m512i sum[R][P];
  for (int r = 0; r < R; ++r)
    for (int q = 0; q < P; ++q)
      sum[r][q] = _mm512_setzero_si512();
  for (int64_t g = 0; g < b.groups; ++g, w += 64) {
    __m512i wv[P];
    for (int q = 0; q < P; ++q)
      wv[q] = _mm512_loadu_si512(w + q * stride);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a + r * lda + 4 * g, 4);
      const __m512i x = _mm512_set1_epi32(four);
      for (int q = 0; q < P; ++q)
        sum[r][q] = _mm512_dpbusd_epi32(sum[r][q], x, wv[q]);
    }
  }
  const __m512 vxs = _mm512_set1_ps(xs);
  for (int q = 0; q < P; ++q) {
    const int64_t j = (p0 + q) * Int8PackedB::kCols, cols = std::min(Int8PackedB::kCols, b.N - j);
    const __m512i shift = _mm512_loadu_si512(b.shift.data() + j);
    const __m512 scale = _mm512_mul_ps(vxs, _mm512_loadu_ps(b.scale.data() + j));
    for (int r = 0; r < R; ++r)
      int8_store16(_mm512_sub_epi32(sum[r][q], shift), scale, c + r * ldc + j, cols);
  }
}

using Int8VnniBlock = void (*)(const uint8_t*, int64_t, const Int8PackedB&, int64_t, float, float*, int64_t);

// The block kernel of `rows` rows (1..sizeof...(R)) and P panels.
template <int P, int... R>
inline Int8VnniBlock int8_vnni_block_of(int64_t rows, std::integer_sequence<int, R...>) {
  static constexpr Int8VnniBlock table[] = {&matmul_int8_vnni_block<R + 1, P>...};
  return table[rows - 1];
}

// matmul_int8 with the zmm VNNI kernel. Column blocks of P panels are split over
// threads; each block runs against every block of rows while its panels are in
// the cache (2 panels of K = 784: 26 KB). A last block of fewer than P panels
// runs one panel at a time. Each block of rows x panels, once stored, gets the
// epilogue epi (dg_gemm.h's convention) on the thread that stored it.
template <class Epilogue>
inline void matmul_int8_vnni(const int8_t* a8, float xs, const Int8PackedB& b, float* c, int64_t M,
                             const Epilogue& epi) {
  const int64_t lda = int8_row_bytes(b.K), N = b.N;
  const uint8_t* a = int8_flipped(a8, M * lda);
  const bool few = M <= 5;  // 1-5 rows x 4 panels: 4 to 20 independent sums
  const int P = few ? 4 : 2;
  const int64_t rows_max = few ? 5 : 12;
  const int64_t blocks = (b.panels + P - 1) / P;
  const double work = 2.0 * double(M) * double(N) * double(b.K);
  const int threads = threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t p0 = blk * P, panels = std::min<int64_t>(P, b.panels - p0);
    for (int64_t i = 0; i < M; i += rows_max) {
      const int64_t rows = std::min(rows_max, M - i);
      const uint8_t* ai = a + i * lda;
      float* ci = c + i * N;
      if (panels == P) {
        const Int8VnniBlock run = few ? int8_vnni_block_of<4>(rows, std::make_integer_sequence<int, 5>())
                                      : int8_vnni_block_of<2>(rows, std::make_integer_sequence<int, 12>());
        run(ai, lda, b, p0, xs, ci, N);
      } else {
        const Int8VnniBlock run = int8_vnni_block_of<1>(rows, std::make_integer_sequence<int, 12>());
        for (int64_t p = p0; p < p0 + panels; ++p)
          run(ai, lda, b, p, xs, ci, N);
      }
      const int64_t j0 = p0 * Int8PackedB::kCols, j1 = std::min(N, (p0 + panels) * Int8PackedB::kCols);
      gemm_detail::finish(epi, i, i + rows, j0, j1, ci + j0, N);
    }
  }
}
#endif

#if DG_INT8_AMX
// The fewest rows for which matmul_int8 uses AMX tiles. Fewer rows than a tile's
// 16 are padded with zero rows; measured on a Sapphire Rapids class Xeon (one thread, 784 x 512
// and 512 x 256): the VNNI kernel is faster up to 6 rows, even at 8, the tiles
// from 10 (1.5x) and 16 (2.4x-2.8x).
constexpr int64_t kInt8AmxMinRows = 8;

// Tiles for a block of RT x CT C tiles (16 rows x one 16-column panel each, int32):
//   tiles 0..3  C, tile 2 * r + q for row tile r and panel q
//   tiles 4, 5  A: 16 rows x 64 bytes (64 k) of the activation: row r of k tile
//               t of row tile q at a + q * a_tile + t * a_step + r * a_row
//               (int8_amx_tiles' copy: a_row 64, a_step 1 KB; the activation's
//               own rows: a_row the row's bytes, a_step 64, a_tile 16 rows)
//   tiles 6, 7  B: 16 rows x 64 bytes, one tile of a panel as Int8PackedB holds it
//               (row g: the 16 columns' 4 bytes of k = 4g..4g+3), 64 bytes apart
// tdpbssd C += A . B sums, for each row and column, the 64 products of A's row
// with B's column (signed x signed: no +128, no correction). Per 64 k: RT + CT
// tile loads and RT * CT products. The C tiles are stored to sums
// ([RT * 16][CT * 16] int32), which the caller scales into c.
template <int RT, int CT>
inline void matmul_int8_amx_block(const int8_t* a, int64_t a_row, int64_t a_step, int64_t a_tile,
                                  const Int8PackedB& b, int64_t p0, int64_t ktiles, int32_t* sums) {
  constexpr int64_t kTileBytes = Int8PackedB::kTileGroups * Int8PackedB::kCols * 4;  // 1 KB
  const int64_t stride = b.panel_groups * Int8PackedB::kCols * 4;
  const int8_t* w = b.panel(p0);
  _tile_zero(0);
  if (CT > 1) _tile_zero(1);
  if (RT > 1) _tile_zero(2);
  if (RT > 1 && CT > 1) _tile_zero(3);
  for (int64_t t = 0; t < ktiles; ++t) {
    if (t + 1 < ktiles) {  // the next k tile's lines, into L1 while these multiply (as dg_bf16.h's block_amx)
      for (int64_t r = 0; r < 16; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(a + a_step * (t + 1) + r * a_row), _MM_HINT_T0);
        if (RT > 1)
          _mm_prefetch(reinterpret_cast<const char*>(a + a_tile + a_step * (t + 1) + r * a_row), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(w + (t + 1) * kTileBytes + r * 64), _MM_HINT_T0);
        if (CT > 1)
          _mm_prefetch(reinterpret_cast<const char*>(w + stride + (t + 1) * kTileBytes + r * 64),
                       _MM_HINT_T0);
      }
    }
    _tile_loadd(4, a + a_step * t, a_row);
    _tile_loadd(6, w + t * kTileBytes, 64);
    if (CT > 1) _tile_loadd(7, w + stride + t * kTileBytes, 64);
    if (RT > 1) _tile_loadd(5, a + a_tile + a_step * t, a_row);
    _tile_dpbssd(0, 4, 6);
    if (CT > 1) _tile_dpbssd(1, 4, 7);
    if (RT > 1) _tile_dpbssd(2, 5, 6);
    if (RT > 1 && CT > 1) _tile_dpbssd(3, 5, 7);
  }
  constexpr int64_t ld = CT * Int8PackedB::kCols * 4;  // bytes from a row of sums to the next
  _tile_stored(0, sums, ld);
  if (CT > 1) _tile_stored(1, sums + 16, ld);
  if (RT > 1) _tile_stored(2, sums + 16 * CT * 16, ld);
  if (RT > 1 && CT > 1) _tile_stored(3, sums + 16 * CT * 16 + 16, ld);
}

// The activation as the tiles read it, copied once per product into a buffer of
// the calling thread: tile after tile, each 16 rows x 64 bytes (1 KB, rows 64
// bytes apart), the k tiles of a row tile in order, zeros past K and past M. A
// tile load then reads 1 KB in a row, as it reads the weight's panels. Read from
// the activation's own rows, a tile load reads 16 pieces a row apart: measured,
// 2x slower at 64 rows x 512 columns whatever K (512 to 1024), so the copy pays
// for itself once several column blocks read the activation; and a tile read
// from the rows would read past a row's end where K is not a multiple of 64 (and
// past the activation's end where M is not one of 16). Returns the bytes from a
// row tile to the next.
inline int64_t int8_amx_tiles(const int8_t* a, int64_t M, int64_t K, int64_t ktiles, int8_t* out) {
  const int64_t row = int8_row_bytes(K), row_tiles = (M + 15) / 16;
  for (int64_t rt = 0; rt < row_tiles; ++rt)
    for (int64_t r = 0; r < 16; ++r) {
      const int64_t i = rt * 16 + r;
      for (int64_t t = 0; t < ktiles; ++t) {
        int8_t* o = out + ((rt * ktiles + t) * 16 + r) * 64;
        const int64_t n = i < M ? std::min<int64_t>(64, row - 64 * t) : 0;  // ktiles * 64 >= row: n >= 1
        // one masked 64-byte load and store (memcpy and memset calls: 2x the time)
        const __mmask64 keep = _cvtu64_mask64(n == 64 ? ~uint64_t(0) : (uint64_t(1) << n) - 1);
        _mm512_storeu_si512(o, _mm512_maskz_loadu_epi8(keep, a + i * row + 64 * t));
      }
    }
  return ktiles * 1024;
}

// The work (2 * M * N * K) from which the tiles split a product over threads:
// they do ~1.9 T int8 operations/s on one core, so kMinParallelWork (tuned for
// the float GEMM) would split products of a few microseconds. Measured on a
// 2-vCPU Sapphire Rapids class Xeon VM (784 x 512, one thread against two,
// medians of 3 alternated runs): 64 rows (51 M operations) 27 us against 32, 128
// rows 53 against 52, 256 rows 194 against 149, 512 rows 402 against 299. The
// BERT encoder at batch 1 (32 rows; its 768 x 2304 product, 113 M, on two
// threads), 2 threads: 1.04-1.05 -> 0.96-0.98 ms (2^27 -> 2^26; 2^25 the same).
constexpr int64_t kInt8AmxMinParallelWork = int64_t(1) << 26;  // 67 M
// The bytes of a product's activation (in tiles) its AMX blocks read at a time
// (matmul_int8_amx_from): about half of a core's L2.
constexpr int64_t kInt8AmxChunkBytes = int64_t(1) << 20;

// The products with AMX tiles of the activation a as tile loads read it: row r of
// k tile t of row tile q at a + q * a_tile + t * a_step + r * a_row (see
// matmul_int8_amx_block). Column blocks of two panels are split over threads,
// each thread with its own tile configuration (every tile 16 rows x 64 bytes); a
// block runs against every 32 rows (2 A tiles: 2 x 2 C tiles) while its panels
// are in the cache. plane > 0: the result written as planes with the bias and the
// channel epilogue epi (int8_store16_planes); else rows, and epi is not run.
template <class Epi>
inline void matmul_int8_amx_from(const int8_t* a, int64_t a_row, int64_t a_step, int64_t a_tile, float xs,
                                 const Int8PackedB& b, float* c, int64_t M, int64_t plane, const float* bias,
                                 const Epi& epi) {
  const int64_t N = b.N, ktiles = b.panel_groups / Int8PackedB::kTileGroups;
  const int64_t row_tiles = (M + 15) / 16, blocks = (b.panels + 1) / 2;
  const double work = 2.0 * double(M) * double(N) * double(b.K);
  const int threads =
      work < double(kInt8AmxMinParallelWork) ? 1 : threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    TileConfig config;
    for (int t = 0; t < 8; ++t)
      config.set(t, 16, 64);
    const TileScope scope(config);
    alignas(64) int32_t sums[32 * 32];
    const __m512 vxs = _mm512_set1_ps(xs);
    constexpr int64_t kAhead = 4;  // row tiles: the lines of the rows two blocks on (ResNet-50 int8: 3-10%)
    // A product's rows (plane 0) are taken a chunk of row tiles at a time, the
    // chunk's activation (kInt8AmxChunkBytes) staying in L2 while every column
    // block reads it: all the rows at once were read again from memory by each
    // column block once they outgrew L2 (BERT's second FFN product, 2048 rows of
    // 3072 bytes, read 24 times). A convolution's (planes) go column block by
    // column block over all rows, its planes written in order.
    const int64_t chunk =
        plane > 0 ? row_tiles : std::max<int64_t>(2, kInt8AmxChunkBytes / (ktiles * 1024) / 2 * 2);
    for (int64_t r0 = 0; r0 < row_tiles; r0 += chunk) {
      const int64_t r1 = std::min(row_tiles, r0 + chunk);
#pragma omp for schedule(static)
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const int64_t p0 = 2 * blk;
        const int ct = b.panels - p0 >= 2 ? 2 : 1;
        for (int64_t rt = r0; rt < r1; rt += 2) {
          const int rts = row_tiles - rt >= 2 ? 2 : 1;
          const int8_t* ai = a + rt * a_tile;
          if (!int8_channels_last<Epi>::value && plane > 0 &&
              rt + kAhead < row_tiles)  // rows a few blocks on
            int8_prefetch_planes(
                c, (rt + kAhead) * 16, std::min<int64_t>(32, M - (rt + kAhead) * 16), p0 * Int8PackedB::kCols,
                std::min(ct * Int8PackedB::kCols, N - p0 * Int8PackedB::kCols), N, plane, epi);
          if (rts == 2 && ct == 2)
            matmul_int8_amx_block<2, 2>(ai, a_row, a_step, a_tile, b, p0, ktiles, sums);
          if (rts == 2 && ct == 1)
            matmul_int8_amx_block<2, 1>(ai, a_row, a_step, a_tile, b, p0, ktiles, sums);
          if (rts == 1 && ct == 2)
            matmul_int8_amx_block<1, 2>(ai, a_row, a_step, a_tile, b, p0, ktiles, sums);
          if (rts == 1 && ct == 1)
            matmul_int8_amx_block<1, 1>(ai, a_row, a_step, a_tile, b, p0, ktiles, sums);
          const int64_t rows = std::min<int64_t>(16 * rts, M - rt * 16);
          for (int q = 0; q < ct; ++q) {
            const int64_t j = (p0 + q) * Int8PackedB::kCols, cols = std::min(Int8PackedB::kCols, N - j);
            const __m512 scale = _mm512_mul_ps(vxs, _mm512_loadu_ps(b.scale.data() + j));
            if constexpr (int8_channels_last<Epi>::value) {
              for (int h = 0; h < rts; ++h)
                epi.store(sums + h * 16 * ct * 16 + q * 16, ct * 16, scale, bias, (rt + h) * 16,
                          std::min<int64_t>(16, rows - 16 * h), j, cols);
              continue;
            }
            if (plane > 0) {
              for (int h = 0; h < rts; ++h)
                int8_store16_planes(sums + h * 16 * ct * 16 + q * 16, ct * 16, scale, bias, c, (rt + h) * 16,
                                    std::min<int64_t>(16, rows - 16 * h), j, cols, N, plane, epi);
              continue;
            }
            for (int64_t r = 0; r < rows; ++r)
              int8_store16(_mm512_load_si512(sums + r * ct * 16 + q * 16), scale, c + (rt * 16 + r) * N + j,
                           cols);
          }
        }
      }
    }
  }
}

// epi (dg_gemm.h's GEMM epilogue) on all of c [M, N], rows shared out over
// threads: the AMX path's epilogue, one pass after the product. Called on each
// 16 x 16 piece as the tiles are stored (a fused bias + GELU + residual reading
// 64-byte pieces of rows N floats apart), it made BERT int8 at batch 64 8-15%
// slower than a separate pass (one thread, alternated runs); after the product
// it is that pass, in place, with no buffer of its own.
template <class Epilogue>
inline void int8_finish_rows(const Epilogue& epi, float* c, int64_t M, int64_t N) {
  if constexpr (!std::is_same<Epilogue, NoEpilogue>::value) {
    const int64_t blocks = (M + 15) / 16;
    const int threads = threads_for(4 * M * N);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t q = 0; q < blocks; ++q)
      gemm_detail::finish(epi, q * 16, std::min(M, q * 16 + 16), 0, N, c + q * 16 * N, N);
  }
}

// int8_finish_rows with each row's epilogue run on a copy of the row (the calling
// thread's, in cache), which is then quantized with inv into q's row (rows of
// int8_row_bytes(N) bytes, the padding zero): c keeps the product, the finished
// row is never written back (BERT's FFN: the GELU'd rows, 12 KB each at 3072
// columns, went out to memory and were read back by the next product's quantize).
template <class Epilogue>
inline void int8_finish_rows_into(const Epilogue& epi, const float* c, int64_t M, int64_t N, int8_t* q,
                                  float inv) {
  const int64_t ld = int8_row_bytes(N);
  // (16 operations a value: a GELU's erf is some 40; counted as 4, BERT's at batch 1,
  // 32 x 3072 values, ran on one thread: 2 threads 0.97-1.02 -> 0.88-0.90 ms)
  const int threads = threads_for(16 * M * N);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    Scratch<float> row(N);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M; ++i) {
      std::memcpy(row.data(), c + i * N, static_cast<size_t>(N) * sizeof(float));
      gemm_detail::finish(epi, i, i + 1, 0, N, row.data(), N);
      quantize_int8_span(row.data(), q + i * ld, inv, N, kInt8ActivationMax);
      if (ld > N) std::memset(q + i * ld + N, 0, static_cast<size_t>(ld - N));
    }
  }
}

// matmul_int8 with AMX tiles (M >= kInt8AmxMinRows, amx_ready()). One column
// block (N <= 32) reads the activation once: straight from its rows where they
// are whole tiles; else (and for more column blocks) from int8_amx_tiles' copy.
// Then epi on the whole product (int8_finish_rows).
template <class Epilogue>
inline void matmul_int8_amx(const int8_t* a8, float xs, const Int8PackedB& b, float* c, int64_t M,
                            const Epilogue& epi) {
  const auto rows_only = [](int64_t, float*, int64_t) {};  // (no planes: no epilogue)
  const int64_t ktiles = b.panel_groups / Int8PackedB::kTileGroups, row = int8_row_bytes(b.K);
  const int64_t row_tiles = (M + 15) / 16, blocks = (b.panels + 1) / 2;
  if (blocks == 1 && row % 64 == 0 && M % 16 == 0) {
    matmul_int8_amx_from(a8, row, 64, 16 * row, xs, b, c, M, 0, nullptr, rows_only);
  } else {
    Scratch<int8_t> tiles(row_tiles * ktiles * 1024);  // (on cache lines: a tile row is one)
    const int64_t a_tile = int8_amx_tiles(a8, M, b.K, ktiles, tiles.data());
    matmul_int8_amx_from(tiles.data(), 64, 1024, a_tile, xs, b, c, M, 0, nullptr, rows_only);
  }
  int8_finish_rows(epi, c, M, b.N);
}

// Whether matmul_int8 multiplies M rows with AMX tiles (then matmul_int8_tiles can
// take the activation already laid out as int8_amx_tiles lays it out).
inline bool int8_amx_used(int64_t M) {
  return M >= kInt8AmxMinRows && amx_ready();
}

// The k tiles (64 bytes of a row each) of an activation row of K values.
inline int64_t int8_amx_ktiles(int64_t K) {
  return (K + 63) / 64;
}

// matmul_int8 of an activation made in int8_amx_tiles' layout by the caller
// (a convolution writes its rows there directly): row i's k at tiles +
// ((i / 16) * ktiles + k / 64) * 1024 + (i % 16) * 64 + k % 64, with ktiles =
// int8_amx_ktiles(K); zeros past K and past M. Only where int8_amx_used(M). With
// plane > 0 the result is written as planes, (i, j) + bias[j] (bias may be null)
// at c[((i / plane) * N + j) * plane + i % plane]: a convolution's output, rows
// being positions of images, each run of a channel's values in a plane given the
// channel epilogue epi as it is stored (int8_store16_planes).
template <class Epi>
inline void matmul_int8_tiles(const int8_t* tiles, const float* a_scale, const Int8PackedB& b, float* c,
                              int64_t M, int64_t plane, const float* bias, const Epi& epi) {
  matmul_int8_amx_from(tiles, 64, 1024, int8_amx_ktiles(b.K) * 1024, a_scale[0], b, c, M, plane, bias, epi);
}
#endif

// c[M, N] = float(a[M, K] . op(W)) * (a_scale[0] * w_scale[j]): a is the quantized
// activation (rows of int8_row_bytes(K) bytes, quantize_int8), b the packed
// weight. The sums are exact in int32 (MAX_K in ops/quantize.py bounds K). AMX
// tiles or the zmm VNNI kernel where compiled in (above); else column panels are
// split over threads and each panel is read by every block of five rows while it
// is in the cache.
// Epilogue: as dg::gemm's (dg_gemm.h: epi(row, col0, c, n), or a row-block one's
// rows_done), called once on every finished piece of c (rows x the columns of the
// panels one thread just stored, dequantized: the values above) by that thread
// while it is in cache; the pieces are disjoint and cover c. A fused bias and
// activation (passes.epilogue on matmul_int8).
template <class Epilogue = NoEpilogue>
inline void matmul_int8(const int8_t* a, const float* a_scale, const Int8PackedB& b, float* c, int64_t M,
                        const Epilogue& epi = Epilogue()) {
  const float xs = a_scale[0];
#if DG_INT8_AMX
  if (int8_amx_used(M)) {
    matmul_int8_amx(a, xs, b, c, M, epi);
    return;
  }
#endif
#if DG_INT8_VNNI512
  matmul_int8_vnni(a, xs, b, c, M, epi);
#else
  const int64_t lda = int8_row_bytes(b.K), N = b.N;
  const double work = 2.0 * double(M) * double(N) * double(b.K);
  const int threads = threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t p = 0; p < b.panels; ++p) {
    const int64_t j = p * Int8PackedB::kCols, cols = std::min(Int8PackedB::kCols, N - j);
    float* cp = c + j;
    int64_t i = 0;
    for (; i + 5 <= M; i += 5) {  // five rows: 10 accumulators, the most that leave registers for the rest
      matmul_int8_panel<5>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
      gemm_detail::finish(epi, i, i + 5, j, j + cols, cp + i * N, N);
    }
    if (M - i == 4) matmul_int8_panel<4>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 3) matmul_int8_panel<3>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 2) matmul_int8_panel<2>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 1) matmul_int8_panel<1>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (i < M) gemm_detail::finish(epi, i, M, j, j + cols, cp + i * N, N);
  }
#endif
}

// matmul_int8 with its output also handed over (out.data set): quantized with the
// reader's scale into out's rows, as quantize_int8 would (the same bytes). With
// AMX the epilogue runs on a copy of each row, which is quantized from there
// (int8_finish_rows_into: c keeps the product); else matmul_int8, then
// quantize_int8 of c.
template <class Epilogue>
inline void matmul_int8(const int8_t* a, const float* a_scale, const Int8PackedB& b, float* c, int64_t M,
                        const Epilogue& epi, const Int8Rows& out) {
  if (out.data == nullptr) {
    matmul_int8(a, a_scale, b, c, M, epi);
    return;
  }
  check_int8_scales(out.scale, 1, out.scale_name);
#if DG_INT8_AMX
  if (int8_amx_used(M)) {
    matmul_int8_amx(a, a_scale[0], b, c, M, NoEpilogue());
    int8_finish_rows_into(epi, c, M, b.N, out.data, 1.0f / out.scale[0]);  // (quantize_int8's 1 / scale)
    return;
  }
#endif
  matmul_int8(a, a_scale, b, c, M, epi);
  quantize_int8(c, out.data, out.scale, M, b.N, out.scale_name);
}

// Which kernel matmul_int8 runs (see the top of this file): "amx" (products of
// kInt8AmxMinRows rows or more; fewer run avx512_vnni), "avx512_vnni",
// "avx_vnni", "avx2" or "portable".
inline const char* int8_kernel() {
#if DG_INT8_AMX
  if (amx_ready()) return "amx";
#endif
#if DG_INT8_VNNI512
  return "avx512_vnni";
#elif defined(__AVX2__) && (defined(__AVXVNNI__) || (defined(__AVX512VNNI__) && defined(__AVX512VL__)))
  return "avx_vnni";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace dg
