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
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dg {

// The largest magnitudes of a quantized activation and of a quantized weight.
constexpr int kInt8ActivationMax = 127;
constexpr int kInt8WeightMax = 63;

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

// q[i] = quantize(x[i], scale, qmax) for n elements (inv = 1 / scale).
inline void quantize_int8_span(const float* x, int8_t* q, float inv, int64_t n, int qmax) {
  int64_t i = 0;
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
  if (ld == K) {
    quantize_int8_span(x, q, inv, rows * K, kInt8ActivationMax);
    return;
  }
  for (int64_t i = 0; i < rows; ++i) {
    quantize_int8_span(x + i * K, q + i * ld, inv, K, kInt8ActivationMax);
    std::memset(q + i * ld + K, 0, static_cast<size_t>(ld - K));
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
// (column c's w[4g..4g+3][c]: what vpmaddubsw pairs and vpmaddwd adds, and what
// vpdpbusd adds at once). Padding (k past K, columns past N) is zero. It keeps
// the scales it was quantized with and 128 * each column's sum (the correction of
// the activation's +128).
struct Int8PackedB {
  static constexpr int64_t kCols = 16;

  // q[N, K]: the weight quantize_weight_int8 made with w_scale[0..N).
  Int8PackedB(const int8_t* q, const float* w_scale, int64_t K_, int64_t N_)
      : K(K_),
        N(N_),
        groups((K_ + 3) / 4),
        panels((N_ + kCols - 1) / kCols),
        data(static_cast<size_t>(panels * groups * kCols * 4), 0),
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

  int64_t K, N, groups, panels;
  std::vector<int8_t> data;
  std::vector<int32_t> shift;  // [panels * 16]: 128 * sum_k w[k][j]
  std::vector<float> scale;    // [panels * 16]: w_scale[j] (1 past N)

  // Where w[k][j] is in data.
  int64_t at(int64_t k, int64_t j) const {
    return ((j / kCols * groups + k / 4) * kCols + j % kCols) * 4 + k % 4;
  }
  const int8_t* panel(int64_t p) const { return data.data() + p * groups * kCols * 4; }
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

// c[M, N] = float(a[M, K] . op(W)) * (a_scale[0] * w_scale[j]): a is the quantized
// activation (rows of int8_row_bytes(K) bytes, quantize_int8), b the packed
// weight. The sums are exact in int32 (MAX_K in ops/quantize.py bounds K). Column
// panels are split over threads; each panel is read by every block of five rows
// while it is in the cache.
inline void matmul_int8(const int8_t* a, const float* a_scale, const Int8PackedB& b, float* c, int64_t M) {
  const float xs = a_scale[0];
  const int64_t lda = int8_row_bytes(b.K), N = b.N;
  const double work = 2.0 * double(M) * double(N) * double(b.K);
  const int threads = threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t p = 0; p < b.panels; ++p) {
    const int64_t cols = std::min(Int8PackedB::kCols, N - p * Int8PackedB::kCols);
    float* cp = c + p * Int8PackedB::kCols;
    int64_t i = 0;
    for (; i + 5 <= M; i += 5)  // five rows: 10 accumulators, the most that leave registers for the rest
      matmul_int8_panel<5>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 4) matmul_int8_panel<4>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 3) matmul_int8_panel<3>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 2) matmul_int8_panel<2>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
    if (M - i == 1) matmul_int8_panel<1>(a + i * lda, lda, b, p, xs, cp + i * N, N, cols);
  }
}

}  // namespace dg
