// dg_bf16_conv.h: the convolutions of a model generated with --precision bf16
// (one group; depthwise and grouped ones stay dg::conv2d on rounded operands).
//
// A convolution is a product: the weight [O, C*KH*KW] times the column matrix
// [C*KH*KW, OH*OW] of each image (as dg::conv_detail::im2col makes it; the input
// itself for a 1x1 convolution of stride 1). So it runs on the bf16 products of dg_bf16.h
// (AMX tiles or vdpbf16ps): the weight, the left operand, kept as bf16 rows
// once per change (dg::KeptBf16Weight::use_rows); the column matrices of a few
// images side by side (kBf16ConvColumnBytes) packed per call as the right
// operand, each k pair of 16 columns converted and interleaved at once
// (dg::pack_pair_bf16), two rows of the column matrix made at a time in a small
// buffer rather than the whole matrix in ws. Each block of the product, 32 output channels by 32
// positions, is written into the output planes (NCHW) as it is finished, bias
// and the channel epilogue (batch norm, residual, relu) applied there while it
// is in cache. Where the CPU has no bf16 products the convolution is dg::conv2d
// on the weight rounded per call (the float32 products of the same bf16 values).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <vector>

#include "dg_bf16.h"
#include "dg_conv.h"
#include "dg_conv_geom.h"
#include "dg_modes.h"

namespace dg {

// The most bytes of packed columns one product of a convolution takes (images
// are multiplied in groups that fit; at least one image).
constexpr int64_t kBf16ConvColumnBytes = int64_t(4) << 20;

namespace bf16_detail {

#if DG_BF16_PRODUCTS
// Columns [c0, c0 + OH*OW) of `columns` = the column matrix of one image xn
// [C, H, W]: row k of it (channel k / (KH*KW), tap k % (KH*KW)) made two at a
// time into a small buffer (conv_detail::tap_row; the planes themselves for a
// 1x1 convolution of stride 1), then packed as one k pair. Pairs are shared out
// over threads.
inline void pack_window_columns(const float* xn, const Conv2dGeom& g, Bf16PackedB& columns, int64_t c0) {
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW, KK = g.KH * g.KW, K = columns.K;
  const std::vector<conv_detail::Tap> taps = conv_detail::taps_of(g);
  const bool pointwise = g.pointwise();
  const int threads = threads_for(conv_detail::kCopyWork * K * OHW);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    std::vector<float> rows(pointwise ? 0 : static_cast<size_t>(2 * OHW));
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < (K + 1) / 2; ++pair) {
      const float* two[2] = {nullptr, nullptr};
      for (int64_t h = 0; h < 2 && 2 * pair + h < K; ++h) {
        const int64_t k = 2 * pair + h;
        if (pointwise) {
          two[h] = xn + k * HW;
        } else {
          conv_detail::tap_row(xn + k / KK * HW, taps[static_cast<size_t>(k % KK)], rows.data() + h * OHW, g);
          two[h] = rows.data() + h * OHW;
        }
      }
      pack_pair_bf16(two[0], two[1], OHW, columns, c0, pair);
    }
  }
}

// to[0..n) = from[0..n) (+ v where add): 16 at a time (a call of memmove per run
// of a few dozen floats costs more than the copy).
inline void copy_plus(const float* from, float v, bool add, float* to, int64_t n) {
  const __m512 vv = _mm512_set1_ps(v);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - t >= 16 ? 0xFFFFu : (1u << (n - t)) - 1u);
    const __m512 x = _mm512_maskz_loadu_ps(mask, from + t);
    _mm512_mask_storeu_ps(to + t, mask, add ? _mm512_add_ps(x, vv) : x);
  }
}

// store for a convolution's product (bf16_products): rows are output channels,
// columns the output positions of the images from n0, side by side; each run of
// one image's positions is written into its output plane, bias added, then
// epi(channel, values, count) on it.
template <class Epi>
struct PlanesInto {
  float* y;
  const float* bias;
  const Conv2dGeom& g;
  int64_t n0;
  const Epi& epi;
  void operator()(int64_t i0, int64_t i1, int64_t j0, int64_t j1, const float* sums, int64_t ld) const {
    const int64_t OHW = g.OH * g.OW;
    for (int64_t j = j0; j < j1;) {
      const int64_t n = n0 + j / OHW, at = j % OHW, run = std::min(j1 - j, OHW - at);
      for (int64_t o = i0; o < i1; ++o) {
        float* yo = y + (n * g.O + o) * OHW + at;
        const float* from = sums + (o - i0) * ld + (j - j0);
        copy_plus(from, bias != nullptr ? bias[o] : 0.0f, bias != nullptr, yo, run);
        epi(o, yo, run);
      }
      j += run;
    }
  }
};
#endif

// conv2d_bf16 with the channel epilogue epi (dg_conv.h's conv2d_with).
template <class Epi>
void conv2d_bf16_with(const float* x, const KeptBf16Weight& w, const float* b, float* y, float* ws,
                      const Conv2dGeom& g, const Epi& epi) {
  if (g.groups != 1)
    throw std::logic_error(
        "dg::conv2d_bf16: one group only (the generator's rule, ops/conv.py kept_weight_read)");
#if DG_BF16_PRODUCTS
  (void)ws;  // (the column matrix is made two rows at a time)
  const std::shared_ptr<const Bf16Rows> weight = w.use_rows();
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW, K = weight->K;
  const int64_t image_bytes = OHW * weight->width * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t chunk =
      std::max<int64_t>(1, std::min(g.N, kBf16ConvColumnBytes / std::max<int64_t>(1, image_bytes)));
  Bf16PackedB columns(K, chunk * OHW);
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t images = std::min(chunk, g.N - n0);
    for (int64_t m = 0; m < images; ++m)
      pack_window_columns(x + (n0 + m) * g.C * HW, g, columns, m * OHW);
    columns.N = images * OHW;  // the last group may have fewer images: the columns it fills
    columns.panels = (columns.N + Bf16PackedB::kCols - 1) / Bf16PackedB::kCols;
    bf16_products(weight->data.data(), columns, g.O, PlanesInto<Epi>{y, b, g, n0, epi});
  }
#else
  const std::vector<float> rounded = w.rounded();
  conv_detail::conv2d_with(x, rounded.data(), b, y, ws, g, epi);
#endif
}

}  // namespace bf16_detail

// y = conv2d(x, w, b) as dg::conv2d computes it (dg_conv.h), for x holding bf16
// values and the Model's kept bf16 weight w: bf16 products, float32 sums.
inline void conv2d_bf16(const float* x, const KeptBf16Weight& w, const float* b, float* y, float* ws,
                        const Conv2dGeom& g) {
  bf16_detail::conv2d_bf16_with(x, w, b, y, ws, g, conv_detail::NoChannelEpilogue());
}

// dg::conv2d_batch_norm (dg_conv.h) with the convolution of conv2d_bf16: in
// evaluation mode the normalization, residual and relu run on each block of
// output as the product finishes it; in training mode after the whole output.
inline void conv2d_batch_norm_bf16(const float* x, const KeptBf16Weight& w, const float* b, const float* bn_w,
                                   const float* bn_b, float* running_mean, float* running_var,
                                   const float* residual, float* y, float* mean, float* invstd, float* ws,
                                   const Conv2dGeom& g, float eps, float momentum, bool relu,
                                   const Mode& mode, const char* what) {
  conv_detail::batch_norm_after(
      [&](const auto& epi) { bf16_detail::conv2d_bf16_with(x, w, b, y, ws, g, epi); }, bn_w, bn_b,
      running_mean, running_var, residual, y, mean, invstd, g, eps, momentum, relu, mode, what);
}

}  // namespace dg
