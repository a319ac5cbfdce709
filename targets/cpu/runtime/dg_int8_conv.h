// dg_int8_conv.h: the convolutions of a model generated with --precision int8
// (one group; grouped and depthwise ones stay float32).
//
// A convolution is a product: output position p of an image is the row of its
// window's inputs (C*KH*KW values, in the weight's order) times the weight's
// rows transposed. So each image's column matrix (conv_detail::im2col, in ws;
// the input itself for a 1x1 of stride 1) is quantized with the activation's
// static scale and laid out as int8 rows, one per output position
// (quantize_int8's layout: rows of int8_row_bytes(K) bytes), multiplied by the
// Model's int8 weight (dg::KeptInt8Weight of [O, C*KH*KW]: quantized per output
// channel and packed once per change) with dg::matmul_int8 (AMX, VNNI, AVX2 or
// portable: the same int32 sums), and the [positions, O] result written into
// the output planes with the bias: the float32 steps of ops/quantize_conv.py's
// reference, in the same order (bit for bit).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "dg_conv.h"
#include "dg_conv_geom.h"
#include "dg_int8.h"
#include "dg_int8_weights.h"

namespace dg {

namespace int8_conv_detail {

// to[p * ld + k] = from[k * P + p] for k < K, p < P (bytes): the quantized column
// matrix [K, P] as rows of output positions. With AVX-512 VBMI, four k rows of 16
// positions at a time: one 64-byte permute puts each position's four bytes side by
// side, one scatter writes them into 16 rows (a byte at a time: ~4x the time).
inline void transpose(const int8_t* from, int64_t K, int64_t P, int8_t* to, int64_t ld) {
  int64_t k0 = 0;
#if defined(__AVX512VBMI__)
  const __m512i order =
      _mm512_set_epi8(63, 47, 31, 15, 62, 46, 30, 14, 61, 45, 29, 13, 60, 44, 28, 12, 59, 43, 27, 11, 58, 42,
                      26, 10, 57, 41, 25, 9, 56, 40, 24, 8, 55, 39, 23, 7, 54, 38, 22, 6, 53, 37, 21, 5, 52,
                      36, 20, 4, 51, 35, 19, 3, 50, 34, 18, 2, 49, 33, 17, 1, 48, 32, 16, 0);
  const __m512i rows =
      _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                         _mm512_set1_epi32(static_cast<int>(ld)));
  for (; k0 + 4 <= K; k0 += 4) {
    int64_t p0 = 0;
    for (; p0 + 16 <= P; p0 += 16) {
      const int8_t* at = from + k0 * P + p0;
      const __m512i four = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + P)),
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))),
          _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 3 * P)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 2 * P))),
          1);
      _mm512_i32scatter_epi32(to + p0 * ld + k0, rows, _mm512_permutexvar_epi8(order, four), 1);
    }
    for (; p0 < P; ++p0)
      for (int64_t k = k0; k < k0 + 4; ++k)
        to[p0 * ld + k] = from[k * P + p0];
  }
#endif
  for (int64_t p0 = 0; p0 < P; p0 += 64)  // what is left, in 64 x 64 blocks
    for (int64_t k1 = k0; k1 < K; k1 += 64)
      for (int64_t p = p0; p < std::min(P, p0 + 64); ++p)
        for (int64_t k = k1; k < std::min(K, k1 + 64); ++k)
          to[p * ld + k] = from[k * P + p];
}

}  // namespace int8_conv_detail

// y[N, O, OH, OW] = conv2d(x, w) (+ b) in int8: x quantized with x_scale[0]
// (named scale_name in errors), w the Model's kept int8 weight. ws holds
// conv2d_workspace(g) floats.
inline void conv2d_int8(const float* x, const float* x_scale, const KeptInt8Weight& w, const float* b,
                        float* y, float* ws, const Conv2dGeom& g, const char* scale_name) {
  if (g.groups != 1) throw std::logic_error("dg::conv2d_int8: one group only (the generator's rule)");
  check_int8_scales(x_scale, 1, scale_name);
  if (g.N <= 0) return;
  const std::shared_ptr<const Int8PackedB> packed = w.use();
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW, K = packed->K, lda = int8_row_bytes(K), O = g.O;
  const float inv = 1.0f / x_scale[0];  // as quantize_int8 computes it
  std::vector<int8_t> rows(static_cast<size_t>(OHW * lda), 0), quantized(static_cast<size_t>(K * OHW));
  std::vector<float> product(static_cast<size_t>(OHW * O));
  for (int64_t n = 0; n < g.N; ++n) {
    const float* cols = x + n * g.C * HW;
    if (!g.pointwise()) {
      conv_detail::im2col(cols, g.C, ws, g);
      cols = ws;
    }
    quantize_int8_span(cols, quantized.data(), inv, K * OHW, kInt8ActivationMax);  // vectorized
    int8_conv_detail::transpose(quantized.data(), K, OHW, rows.data(), lda);
    matmul_int8(rows.data(), x_scale, *packed, product.data(), OHW);
    for (int64_t o = 0; o < O; ++o) {
      float* plane = y + (n * O + o) * OHW;
      if (b != nullptr) {
        const float v = b[o];
        for (int64_t p = 0; p < OHW; ++p)
          plane[p] = product[static_cast<size_t>(p * O + o)] + v;
      } else {
        for (int64_t p = 0; p < OHW; ++p)
          plane[p] = product[static_cast<size_t>(p * O + o)];
      }
    }
  }
}

}  // namespace dg
