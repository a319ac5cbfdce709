// dg_int8.h: int8 inference. A model generated with --precision int8 computes each
// product by a weight (a dense layer's x @ W) in three steps:
//
//   quantize_int8         the activation, with its static per-tensor scale
//   quantize_weight_int8  the float32 weight, with its per-output-channel scales
//                         (kept in the weight's stored layout)
//   matmul_int8           int8 x int8 products summed exactly in int32, then
//                         y[i][j] = float(sum) * (x_scale * w_scale[j])
//
// quantize(v, s) = clamp(round_half_even(v * (1 / s)), -127, 127): 1 / s is one
// float division, v * (1 / s) one float product, rounded by nearbyint in the
// default rounding mode (to nearest, ties to even). The scales are buffers the
// weights file holds (deepgen quantize writes them); a scale that is 0 (never
// loaded), negative or not finite throws std::invalid_argument naming it.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_parallel.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace dg {

// An arena piece (float*) holding int8 values.
inline int8_t* int8_data(float* p) {
  return reinterpret_cast<int8_t*>(p);
}
inline const int8_t* int8_data(const float* p) {
  return reinterpret_cast<const int8_t*>(p);
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

inline int8_t quantize_int8_value(float x, float inv_scale) {
  const float r = std::nearbyint(x * inv_scale);
  return static_cast<int8_t>(std::max(-127.0f, std::min(127.0f, r)));
}

// q[i] = quantize(x[i], scale) for n elements.
inline void quantize_int8_span(const float* x, int8_t* q, float inv, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
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
    q[i] = quantize_int8_value(x[i], inv);
}

// The activation x[rows, K] quantized with its one scale (scale[0]) into q[rows, K].
inline void quantize_int8(const float* x, int8_t* q, const float* scale, int64_t rows, int64_t K,
                          const char* scale_name) {
  check_int8_scales(scale, 1, scale_name);
  quantize_int8_span(x, q, 1.0f / scale[0], rows * K);
}

// q[i] = quantize(x[i], scale[i]): a row of a weight stored [K, P], each element
// with its output channel's inverse scale inv[i].
inline void quantize_int8_columns(const float* x, int8_t* q, const float* inv, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  for (; i + 8 <= n; i += 8) {  // the same float steps as quantize_int8_value, 8 channels at once
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(inv + i)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    alignas(32) int32_t v[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(v),
                       _mm256_cvtps_epi32(_mm256_max_ps(lo, _mm256_min_ps(hi, r))));
    for (int t = 0; t < 8; ++t)
      q[i + t] = static_cast<int8_t>(v[t]);
  }
#endif
  for (; i < n; ++i)
    q[i] = quantize_int8_value(x[i], inv[i]);
}

// The weight quantized per output channel (channel j with scale[j]), kept in its
// stored layout: [K, P] (a dense layer's), or [P, K] when stored_PK.
inline void quantize_weight_int8(const float* w, int8_t* q, const float* scale, int64_t P, int64_t K,
                                 bool stored_PK, const char* scale_name) {
  check_int8_scales(scale, P, scale_name);
  if (stored_PK) {
    for (int64_t j = 0; j < P; ++j)
      quantize_int8_span(w + j * K, q + j * K, 1.0f / scale[j], K);
    return;
  }
  std::vector<float> inv(P);
  for (int64_t j = 0; j < P; ++j)
    inv[j] = 1.0f / scale[j];
  for (int64_t k = 0; k < K; ++k)
    quantize_int8_columns(w + k * P, q + k * P, inv.data(), P);
}

// sum_k a[k] * b[k] of two int8 rows, exact in int32 (K * 127 * 127 < 2^31).
inline int32_t dot_int8(const int8_t* a, const int8_t* b, int64_t K) {
  int32_t s = 0;
  for (int64_t k = 0; k < K; ++k)
    s += int32_t(a[k]) * int32_t(b[k]);
  return s;
}

#if defined(__AVX2__)
inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// 16 int8 values sign-extended to 16 int16 lanes.
inline __m256i load_int8_as_int16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// R rows of c = float(a . b) * scales with b stored [K, N] (see matmul_int8). The
// AVX2 path runs 16 columns at a time, two k at once: the pairs (b[k][j],
// b[k + 1][j]) interleaved as int16, _mm256_madd_epi16 with each row's pair
// (a[r][k], a[r][k + 1]) broadcast; R rows share each load of b.
template <int R>
inline void matmul_int8_kn_rows(const int8_t* a, const int8_t* b, float xs, const float* b_scale, float* c,
                                int64_t K, int64_t N) {
  int64_t j = 0;
#if defined(__AVX2__)
  // Each row's pairs (a[r][k], a[r][k + 1]) as the int32 that _mm256_madd_epi16 reads
  // (a[r][K] taken as 0), made once for all the column blocks.
  const int64_t half = (K + 1) / 2;
  std::vector<int32_t> pairs(R * half);
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < K; k += 2) {
      const int32_t high = k + 1 < K ? int32_t(a[r * K + k + 1]) : 0;
      pairs[r * half + k / 2] = int32_t(uint16_t(int16_t(a[r * K + k]))) | int32_t(uint32_t(high) << 16);
    }
  for (; j + 16 <= N; j += 16) {
    __m256i lo_sum[R], hi_sum[R];
    for (int r = 0; r < R; ++r)
      lo_sum[r] = hi_sum[r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < K; k += 2) {
      const bool pair = k + 1 < K;
      const __m256i b0 = load_int8_as_int16(b + k * N + j);
      const __m256i b1 = pair ? load_int8_as_int16(b + (k + 1) * N + j) : _mm256_setzero_si256();
      // per 128-bit lane: unpacklo holds columns 0-3 (and 8-11), unpackhi 4-7 (and 12-15)
      const __m256i b_lo = _mm256_unpacklo_epi16(b0, b1), b_hi = _mm256_unpackhi_epi16(b0, b1);
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(pairs[r * half + k / 2]);
        lo_sum[r] = _mm256_add_epi32(lo_sum[r], _mm256_madd_epi16(b_lo, x));
        hi_sum[r] = _mm256_add_epi32(hi_sum[r], _mm256_madd_epi16(b_hi, x));
      }
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) int32_t sums[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums),
                         _mm256_permute2x128_si256(lo_sum[r], hi_sum[r], 0x20));
      _mm256_store_si256(reinterpret_cast<__m256i*>(sums + 8),
                         _mm256_permute2x128_si256(lo_sum[r], hi_sum[r], 0x31));
      for (int t = 0; t < 16; ++t)
        c[r * N + j + t] = static_cast<float>(sums[t]) * (xs * b_scale[j + t]);
    }
  }
#endif
  for (; j < N; ++j)
    for (int r = 0; r < R; ++r) {
      int32_t s = 0;
      for (int64_t k = 0; k < K; ++k)
        s += int32_t(a[r * K + k]) * int32_t(b[k * N + j]);
      c[r * N + j] = static_cast<float>(s) * (xs * b_scale[j]);
    }
}

// c[M, N] = float(a[M, K] . b[N, K]^T) * (a_scale[0] * b_scale[j]): a is the
// quantized activation, b the quantized weight (row j: output channel j, as a
// weight stored [P, K] is). The
// sums are exact int32 in any order; the AVX2 path sign-extends 16 int8 values
// to int16 and multiplies pairs with _mm256_madd_epi16 (each pair sum at most
// 2 * 127 * 127, exact), four output columns at a time.
// With b_stored_KN, b is [K, N] (a dense layer's weight as stored), four rows of
// c at a time (matmul_int8_kn_rows).
inline void matmul_int8(const int8_t* a, const int8_t* b, const float* a_scale, const float* b_scale,
                        float* c, int64_t M, int64_t K, int64_t N, bool b_stored_KN) {
  const float xs = a_scale[0];
  const double work = 2.0 * double(M) * double(N) * double(K);
  const int threads = threads_for(work < 1e18 ? int64_t(work) : int64_t(1e18));
  if (b_stored_KN) {
    const int64_t blocks = (M + 3) / 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t i = 4 * block, rows = std::min<int64_t>(4, M - i);
      const int8_t* a_rows = a + i * K;
      float* c_rows = c + i * N;
      if (rows == 4)
        matmul_int8_kn_rows<4>(a_rows, b, xs, b_scale, c_rows, K, N);
      else if (rows == 3)
        matmul_int8_kn_rows<3>(a_rows, b, xs, b_scale, c_rows, K, N);
      else if (rows == 2)
        matmul_int8_kn_rows<2>(a_rows, b, xs, b_scale, c_rows, K, N);
      else
        matmul_int8_kn_rows<1>(a_rows, b, xs, b_scale, c_rows, K, N);
    }
    return;
  }
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t i = 0; i < M; ++i) {
    const int8_t* row = a + i * K;
    float* out = c + i * N;
    int64_t j = 0;
#if defined(__AVX2__)
    for (; j + 4 <= N; j += 4) {
      const int8_t* b0 = b + j * K;
      __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        const __m256i x = load_int8_as_int16(row + k);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(x, load_int8_as_int16(b0 + k)));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(x, load_int8_as_int16(b0 + K + k)));
        s2 = _mm256_add_epi32(s2, _mm256_madd_epi16(x, load_int8_as_int16(b0 + 2 * K + k)));
        s3 = _mm256_add_epi32(s3, _mm256_madd_epi16(x, load_int8_as_int16(b0 + 3 * K + k)));
      }
      const int32_t sums[4] = {sum_lanes(s0) + dot_int8(row + k, b0 + k, K - k),
                               sum_lanes(s1) + dot_int8(row + k, b0 + K + k, K - k),
                               sum_lanes(s2) + dot_int8(row + k, b0 + 2 * K + k, K - k),
                               sum_lanes(s3) + dot_int8(row + k, b0 + 3 * K + k, K - k)};
      for (int t = 0; t < 4; ++t)
        out[j + t] = static_cast<float>(sums[t]) * (xs * b_scale[j + t]);
    }
#endif
    for (; j < N; ++j)
      out[j] = static_cast<float>(dot_int8(row, b + j * K, K)) * (xs * b_scale[j]);
  }
}

}  // namespace dg
