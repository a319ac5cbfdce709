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
#include <cstring>
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

// The channels-last path (see the top of this file) where the input channels
// fill whole halves of a tile row (16 bf16 values): each tap's channels are then
// one run of 32-byte pieces in a row of the left operand.
inline bool channels_last(const Conv2dGeom& g) {
  return g.C % 16 == 0;
}

// xt[H*W, C] = the image xn[C, H, W] (holding bf16 values) as bf16 bits,
// channels last: 16 channels x 16 positions at a time through a small block
// (read along the planes, written along the channels).
inline void to_channels_last(const float* xn, int64_t C, int64_t HW, uint16_t* xt) {
  alignas(64) uint16_t block[16][16];
  for (int64_t p0 = 0; p0 < HW; p0 += 16) {
    const int64_t n = std::min<int64_t>(16, HW - p0);
    const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
    for (int64_t c0 = 0; c0 < C; c0 += 16) {
      for (int64_t c = 0; c < 16; ++c) {
        const __m256bh half = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, xn + (c0 + c) * HW + p0));
        std::memcpy(block[c], &half, sizeof half);
      }
      for (int64_t q = 0; q < n; ++q) {
        uint16_t* to = xt + (p0 + q) * C + c0;
        for (int64_t c = 0; c < 16; ++c)
          to[c] = block[c][q];
      }
    }
  }
}

// Rows [r0, r0 + OH*OW) of the left operand a (bf16_tiled_at, `width` values a
// row) for one image xt (channels last): row (oh, ow) holds, for each tap t in
// the weight's order, the C input channels at that tap of the position's window
// as values [t*C, (t + 1)*C), zeros where the window lies in the padding, then
// zeros up to `width`. Positions are shared out over threads.
inline void pack_window_rows(const uint16_t* xt, const Conv2dGeom& g, uint16_t* a, int64_t width,
                             int64_t r0) {
  const int64_t C = g.C, KK = g.KH * g.KW, OW = g.OW, OHW = g.OH * g.OW;
  const int threads = threads_for(conv_detail::kCopyWork * C * KK * OHW);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t q = 0; q < OHW; ++q) {
    const int64_t r = r0 + q, oh = q / OW, ow = q % OW;
    for (int64_t t = 0; t < KK; ++t) {
      const int64_t ih = oh * g.stride_h + t / g.KW * g.dil_h - g.pad_h;
      const int64_t iw = ow * g.stride_w + t % g.KW * g.dil_w - g.pad_w;
      const bool inside = ih >= 0 && ih < g.H && iw >= 0 && iw < g.W;
      const uint16_t* from = xt + (ih * g.W + iw) * C;
      for (int64_t c = 0; c < C; c += 16) {
        const __m256i v =
            inside ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(from + c)) : _mm256_setzero_si256();
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + bf16_tiled_at(width, r, t * C + c)), v);
      }
    }
    for (int64_t k = C * KK; k < width; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + bf16_tiled_at(width, r, k)), _mm256_setzero_si256());
  }
}

// store for the channels-last product: rows are the output positions of the
// images from n0, side by side, columns output channels; each channel's run of
// one image's positions is written into its output plane, bias added, then
// epi(channel, values, count) on it.
template <class Epi>
struct ChannelsInto {
  float* y;
  const float* bias;
  const Conv2dGeom& g;
  int64_t n0;
  const Epi& epi;
  void operator()(int64_t i0, int64_t i1, int64_t j0, int64_t j1, const float* sums, int64_t ld) const {
    const int64_t OHW = g.OH * g.OW;
    for (int64_t i = i0; i < i1;) {
      const int64_t n = n0 + i / OHW, at = i % OHW, run = std::min(i1 - i, OHW - at);
      for (int64_t o = j0; o < j1; ++o) {
        float* yo = y + (n * g.O + o) * OHW + at;
        const float* from = sums + (i - i0) * ld + (o - j0);
        const float v = bias != nullptr ? bias[o] : 0.0f;
        for (int64_t r = 0; r < run; ++r)
          yo[r] = from[r * ld] + v;
        epi(o, yo, run);
      }
      i += run;
    }
  }
};

// A buffer of n bf16 values left unset (every value is written before it is read).
inline std::unique_ptr<uint16_t[]> bf16_buffer(int64_t n) {
  return std::unique_ptr<uint16_t[]>(new uint16_t[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// conv2d_bf16_with's channels-last path: the images in groups whose left operand
// fits kBf16ConvColumnBytes, each group's rows packed from the channels-last
// copies of its images, times the weight kept in the same [tap][channel] order.
template <class Epi>
void conv2d_channels_last(const float* x, const KeptBf16Weight& w, const float* b, float* y,
                          const Conv2dGeom& g, const Epi& epi) {
  const std::shared_ptr<const Bf16PackedB> weight = w.use_taps(g.KH * g.KW);
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW, width = bf16_row_width(*weight);
  const int64_t image_bytes = OHW * width * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t chunk =
      std::max<int64_t>(1, std::min(g.N, kBf16ConvColumnBytes / std::max<int64_t>(1, image_bytes)));
  const std::unique_ptr<uint16_t[]> xt = bf16_buffer(HW * g.C);
  const std::unique_ptr<uint16_t[]> a = bf16_buffer(bf16_padded_rows(chunk * OHW) * width);
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t images = std::min(chunk, g.N - n0), M = images * OHW;
    for (int64_t m = 0; m < images; ++m) {
      to_channels_last(x + (n0 + m) * g.C * HW, g.C, HW, xt.get());
      pack_window_rows(xt.get(), g, a.get(), width, m * OHW);
    }
    // the zero rows up to whole tiles (the last row tile's, tile after tile)
    for (int64_t r = M; r < bf16_padded_rows(M); ++r)
      for (int64_t k = 0; k < width; k += kBf16TileK)
        std::memset(a.get() + bf16_tiled_at(width, r, k), 0, kBf16TileK * sizeof(uint16_t));
    bf16_products(a.get(), *weight, M, ChannelsInto<Epi>{y, b, g, n0, epi});
  }
}
#endif

// conv2d_bf16 with the channel epilogue epi (dg_conv.h's conv2d_with).
template <class Epi>
void conv2d_bf16_with(const float* x, const KeptBf16Weight& w, const float* b, float* y, float* ws,
                      const Conv2dGeom& g, const Epi& epi) {
  if (g.groups != 1)
    throw std::logic_error(
        "dg::conv2d_bf16: one group only (the generator's rule, ops/conv.py kept_weight_read)");
#if DG_BF16_PRODUCTS
  (void)ws;  // (the column matrix is made two rows at a time, or not at all)
  if (channels_last(g)) return conv2d_channels_last(x, w, b, y, g, epi);
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

// The path conv2d_bf16 takes for g (bf16_kernel of its product's rows: the
// positions of the images it multiplies at once on the channels-last path, the
// output channels otherwise).
inline const char* conv2d_bf16_kernel(const Conv2dGeom& g) {
#if DG_BF16_PRODUCTS
  if (bf16_detail::channels_last(g)) {
    const int64_t OHW = g.OH * g.OW, width = (g.C * g.KH * g.KW + kBf16TileK - 1) / kBf16TileK * kBf16TileK;
    const int64_t bytes = OHW * width * static_cast<int64_t>(sizeof(uint16_t));
    return bf16_kernel(
        std::max<int64_t>(1, std::min(g.N, kBf16ConvColumnBytes / std::max<int64_t>(1, bytes))) * OHW);
  }
#endif
  return bf16_kernel(g.O);
}

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
