// dg_bf16_conv.h: the convolutions of a model generated with --precision bf16
// (one group; depthwise and grouped ones stay dg::conv2d on rounded operands).
//
// A convolution is a product: for each output position, its window of the input
// (every tap's input channels) times the weight. So it runs on the bf16 products
// of dg_bf16.h (AMX tiles or vdpbf16ps), channels last:
//
//   - each image is copied once as bf16 [H*W, C] (to_channels_last), so that a
//     tap's input channels lie side by side, and the kw taps of one kernel row
//     too (dilation 1): one run of KW*C values;
//   - the left operand, one row per output position of a few images side by side
//     (kBf16ConvColumnBytes), is made of those runs (pack_window_rows): k is
//     (kh*KW + kw)*C + c, zeros where the window lies in the padding. The
//     images of one product are copied and packed in one parallel region, a
//     group of them (kBf16ConvCopyBytes) after another;
//   - the right operand is the weight kept in the same [tap][channel] order
//     (dg::KeptBf16Weight::use_taps), packed once per change of the parameters.
//
// Each block of the product, 32 positions by 32 output channels, is written
// into the output planes (NCHW) as it is finished (ChannelsInto), bias and the
// channel epilogue (batch norm, residual, relu) applied there while it is in
// cache. Nothing is zero-filled but the padding. (ResNet-18 at 64x64, batch 1,
// one thread: the column-matrix packing this replaced was 37% of the forward.)
// The input is rounded to bf16 as it is copied (round to nearest even, as
// dg::round_bf16), so the generator drops the rounding call before the
// convolution (transforms/rounding.py rounded_reads). Where the CPU has no bf16
// products the convolution is dg::conv2d on the input and the weight rounded per
// call (the float32 products of the same bf16 values).
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <type_traits>
#include <utility>
#include <vector>

#include "dg_bf16.h"
#include "dg_conv.h"
#include "dg_conv_geom.h"
#include "dg_modes.h"
#include "dg_precision.h"

namespace dg {

// The most bytes of left operand one product of a convolution takes (images
// are multiplied in groups that fit; at least one image): about half of a
// core's L2, so that the rows packed are still there when the tiles read them
// (ResNet-18 64px, batch 64, one thread: 4 MB 79 ms, 1 MB 65 ms, 512 KB 66 ms).
constexpr int64_t kBf16ConvColumnBytes = int64_t(1) << 20;

// The most bytes of input a convolution copies channels last (bf16) before it
// packs their windows, a thread: images are copied and packed in groups of
// about this size (at least one image), so that the copy is still in cache
// when the packing reads it. (ResNet-50's 1x1 from 256 channels at 16x16,
// batch 64, one thread: the product's 8 images at once 2.59 ms, 256 KB 2.28 ms,
// 32 KB 2.26 ms; two threads: 1.66 ms, 256 KB each 1.40 ms, 32 KB for both
// 2.05 ms, a barrier a group.)
constexpr int64_t kBf16ConvCopyBytes = int64_t(1) << 18;

// The positions of the images one product of conv2d_bf16 multiplies at once (its rows).
inline int64_t conv2d_bf16_rows(const Conv2dGeom& g) {
  const int64_t OHW = g.OH * g.OW, width = (g.C * g.KH * g.KW + kBf16TileK - 1) / kBf16TileK * kBf16TileK;
  const int64_t image_bytes = OHW * width * static_cast<int64_t>(sizeof(uint16_t));
  return std::max<int64_t>(1, std::min(g.N, kBf16ConvColumnBytes / std::max<int64_t>(1, image_bytes))) * OHW;
}

// The path conv2d_bf16 takes for g (bf16_kernel of its product's rows).
inline const char* conv2d_bf16_kernel(const Conv2dGeom& g) {
  return bf16_kernel(conv2d_bf16_rows(g));
}

namespace bf16_detail {

#if DG_BF16_PRODUCTS
// Values [k, k + n) of one row of the left operand (bf16_tiled_at: `row` is
// where its value 0 is; its values k and k + 32 are a tile, 16 x 32 values,
// apart) = from[0, n), or zeros where from is null: a piece per tile it
// crosses.
inline void put_run(const uint16_t* from, int64_t n, uint16_t* row, int64_t k) {
  constexpr int64_t kTile = kBf16TileRows * kBf16TileK;
  while (n > 0) {
    const int64_t in_tile = k % kBf16TileK, len = std::min(n, kBf16TileK - in_tile);
    const __mmask32 mask = static_cast<__mmask32>((uint64_t(1) << len) - 1u);
    const __m512i v = from != nullptr ? _mm512_maskz_loadu_epi16(mask, from) : _mm512_setzero_si512();
    _mm512_mask_storeu_epi16(row + k / kBf16TileK * kTile + in_tile, mask, v);
    if (from != nullptr) from += len;
    k += len;
    n -= len;
  }
}

// Rows [r0, r1) of the left operand a (bf16_tiled_at, `width` values a row),
// those of the images in xt (to_channels_last: H*W*C values each, one after
// another; row r0 is the first position of the first): row r0 + m*OH*OW +
// oh*OW + ow holds the window of image m's position (oh, ow), tap after tap in
// the weight's order, C channels each (zeros where the window lies in the
// padding), then zeros up to `width`. Rows from M on (the last row tile's
// padding) are zeros. A kernel row's taps that lie inside the input are one run
// of xt where the dilation is 1. The rows are shared out over the threads of the
// parallel region this is called in (an orphaned omp for; on the calling thread
// outside one).
inline void pack_window_rows(const uint16_t* xt, const Conv2dGeom& g, uint16_t* a, int64_t width, int64_t r0,
                             int64_t r1, int64_t M) {
  const int64_t C = g.C, KW = g.KW, OW = g.OW, OHW = g.OH * g.OW, HW = g.H * g.W, K = C * g.KH * KW;
#pragma omp for schedule(static)
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* row = a + bf16_tiled_at(width, r, 0);
    if (r >= M) {
      put_run(nullptr, width, row, 0);
      continue;
    }
    const uint16_t* image = xt + (r - r0) / OHW * HW * C;
    const int64_t q = (r - r0) % OHW, iw0 = q % OW * g.stride_w - g.pad_w,
                  ih0 = q / OW * g.stride_h - g.pad_h;
    const bool columns_inside = g.dil_w == 1 && iw0 >= 0 && iw0 + KW <= g.W;
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const int64_t ih = ih0 + kh * g.dil_h, k = kh * KW * C;
      const bool row_inside = ih >= 0 && ih < g.H;
      if (!row_inside || columns_inside) {  // the kernel row's taps: one run, zeros or input
        put_run(row_inside ? image + (ih * g.W + iw0) * C : nullptr, KW * C, row, k);
        continue;
      }
      for (int64_t kw = 0; kw < KW;) {  // runs of taps all inside (contiguous at dilation 1) or all outside
        const int64_t iw = iw0 + kw * g.dil_w;
        const bool inside = iw >= 0 && iw < g.W;
        int64_t taps = 1;
        while (kw + taps < KW && (iw + taps * g.dil_w >= 0 && iw + taps * g.dil_w < g.W) == inside &&
               (!inside || g.dil_w == 1))
          ++taps;
        put_run(inside ? image + (ih * g.W + iw) * C : nullptr, taps * C, row, k + kw * C);
        kw += taps;
      }
    }
    put_run(nullptr, width - K, row, K);
  }
}

// to[c * ldt + r] = from[r * ldf + c] for r, c < 16: a 16 x 16 block of floats
// transposed in registers (gemm_detail::transpose_16x16).
inline void transpose16(const float* from, int64_t ldf, float* to, int64_t ldt) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i)
    r[i] = _mm512_loadu_ps(from + i * ldf);
  gemm_detail::transpose_16x16(r);
  for (int i = 0; i < 16; ++i)
    _mm512_storeu_ps(to + i * ldt, r[i]);
}

// xt[m][H*W, C] = the image x[m][C, H, W] rounded to bf16 (to nearest even)
// for m < images, channels last: blocks of 16 channels x 16 positions of one
// image transposed in registers (the planes' rows read whole), each position's
// 16 channels then converted at once. The blocks are shared out over the
// threads of the parallel region this is called in (an orphaned omp for, as
// pack_window_rows), image after image: a thread then packs mostly the rows of
// the images it copied.
inline void to_channels_last(const float* x, int64_t images, int64_t C, int64_t HW, uint16_t* xt) {
  const int64_t position_blocks = (HW + 15) / 16, image_blocks = (C + 15) / 16 * position_blocks;
#pragma omp for schedule(static)
  for (int64_t at = 0; at < images * image_blocks; ++at) {
    const int64_t m = at / image_blocks, in_image = at % image_blocks;
    const int64_t c0 = in_image / position_blocks * 16, p0 = in_image % position_blocks * 16;
    const int64_t channels = std::min<int64_t>(16, C - c0), positions = std::min<int64_t>(16, HW - p0);
    const __mmask16 cmask = static_cast<__mmask16>((1u << channels) - 1u);
    const __mmask16 pmask = static_cast<__mmask16>((1u << positions) - 1u);
    const float* xn = x + m * C * HW;
    uint16_t* to = xt + m * HW * C;
    __m512 r[16];
    for (int64_t c = 0; c < 16; ++c)
      r[c] = c < channels ? _mm512_maskz_loadu_ps(pmask, xn + (c0 + c) * HW + p0) : _mm512_setzero_ps();
    gemm_detail::transpose_16x16(r);
    for (int64_t q = 0; q < positions; ++q) {
      const __m256bh half = _mm512_cvtneps_pbh(r[q]);
      __m256i bits;
      std::memcpy(&bits, &half, sizeof bits);
      _mm256_mask_storeu_epi16(to + (p0 + q) * C + c0, cmask, bits);
    }
  }
}

// to[0..n) = from[0..n) + v, 16 at a time.
inline void copy_plus(const float* from, float v, float* to, int64_t n) {
  const __m512 vv = _mm512_set1_ps(v);
  for (int64_t t = 0; t < n; t += 16) {
    const __mmask16 mask = static_cast<__mmask16>(n - t >= 16 ? 0xFFFFu : (1u << (n - t)) - 1u);
    _mm512_mask_storeu_ps(to + t, mask, _mm512_add_ps(_mm512_maskz_loadu_ps(mask, from + t), vv));
  }
}

// store for a convolution's product (bf16_products): rows are the output
// positions of the images from n0, side by side, columns output channels. The
// block (at most 32 rows, 64 columns) is turned channels-major (16 x 16 pieces
// in registers where 16 rows exist), then each channel's run of one image's
// positions is written into its output plane, bias added, and epi(channel,
// values, count) run on it.
template <class Epi>
struct ChannelsInto {
  static constexpr int64_t kRows = 2 * kBf16TileRows, kCols = 64;
  static constexpr bool kColumnOrder = true;  // (bf16_products: channel after channel)
  float* y;
  const float* bias;
  const Conv2dGeom& g;
  int64_t n0;
  const Epi& epi;
  void operator()(int64_t i0, int64_t i1, int64_t j0, int64_t j1, const float* sums, int64_t ld) const {
    const int64_t OHW = g.OH * g.OW, rows = i1 - i0, cols = j1 - j0;
    alignas(64) float t[kCols * kRows];  // t[c * kRows + r] = sums[r * ld + c]
    for (int64_t r0 = 0; r0 < rows; r0 += 16) {
      if (r0 + 16 <= rows) {  // (ld is a whole number of 16s: the last 16 columns can be read)
        for (int64_t c0 = 0; c0 < cols; c0 += 16)
          transpose16(sums + r0 * ld + c0, ld, t + c0 * kRows + r0, kRows);
        continue;
      }
      for (int64_t r = r0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          t[c * kRows + r] = sums[r * ld + c];
    }
    for (int64_t i = i0; i < i1;) {
      const int64_t n = n0 + i / OHW, at = i % OHW, run = std::min(i1 - i, OHW - at);
      for (int64_t o = j0; o < j1; ++o) {
        float* yo = y + (n * g.O + o) * OHW + at;
        copy_plus(t + (o - j0) * kRows + (i - i0), bias != nullptr ? bias[o] : 0.0f, yo, run);
        epi(o, yo, run);
      }
      i += run;
    }
    ask_next(i1, std::min(i1 + (i1 - i0), g.N * OHW - n0 * OHW), j0, j1);
  }

  // The lines the block of rows [i0, i1) of the same channels (the next one
  // this thread makes, in column order) will write, and its epilogue read, asked
  // for now: they lie in short runs, one a plane, that the prefetchers miss.
  void ask_next(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    const int64_t OHW = g.OH * g.OW;
    for (int64_t i = i0; i < i1;) {
      const int64_t n = n0 + i / OHW, at = i % OHW, run = std::min(i1 - i, OHW - at);
      for (int64_t o = j0; o < j1; ++o) {
        float* yo = y + (n * g.O + o) * OHW + at;
        for (int64_t r = 0; r < run; r += 16)
          __builtin_prefetch(yo + r, 1);
        if constexpr (gemm_detail::has_prefetch<Epi>::value) epi.prefetch(yo, run);
      }
      i += run;
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
  (void)ws;  // (no column matrix is made)
  const std::shared_ptr<const Bf16PackedB> weight = w.use_taps(g.KH * g.KW);
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW, width = bf16_row_width(*weight);
  const int64_t chunk = conv2d_bf16_rows(g) / std::max<int64_t>(1, OHW);
  // xt: the images copied channels last at a time, `group` of them (their
  // H*W*C bf16 values: at most kBf16ConvCopyBytes for each thread preparing a
  // product, or one image); a: the rows of one product (conv2d_bf16_rows: at
  // most kBf16ConvColumnBytes, or one image's rows). Both Scratch (dg_arena.h):
  // 64-byte aligned, where new[] gave 16 (glibc: 16 bytes past a page for large
  // blocks) and each 64-byte row of a tile the products load lay across two
  // cache lines; and kept by the thread for its next call.
  const int64_t most = conv_detail::kCopyWork * (chunk * HW * g.C + bf16_padded_rows(chunk * OHW) * width);
  const int64_t group =
      std::max<int64_t>(1, std::min(chunk, threads_for(most) * kBf16ConvCopyBytes /
                                               (HW * g.C * static_cast<int64_t>(sizeof(uint16_t)))));
  Scratch<uint16_t> xt(group * HW * g.C);
  Scratch<uint16_t> a(bf16_padded_rows(chunk * OHW) * width);
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t images = std::min(chunk, g.N - n0), M = images * OHW, rows = bf16_padded_rows(M);
    // One parallel region prepares the product's rows, group after group of
    // images (copy, packing): sized on the work of all, where a region for
    // each image's copy and each image's packing cost a fork and a join for a
    // few rows at small planes (ResNet's 4x4 and 2x2), most of them too small
    // for threads_for to give two threads.
    const int threads = threads_for(conv_detail::kCopyWork * (images * HW * g.C + rows * width));
#pragma omp parallel num_threads(threads) if (threads > 1)
    for (int64_t m0 = 0; m0 < images; m0 += group) {
      const int64_t count = std::min(group, images - m0), r0 = m0 * OHW;
      to_channels_last(x + (n0 + m0) * g.C * HW, count, g.C, HW, xt.data());
      pack_window_rows(xt.data(), g, a.data(), width, r0, m0 + count < images ? r0 + count * OHW : rows, M);
    }
    bf16_products(a.data(), *weight, M, ChannelsInto<Epi>{y, b, g, n0, epi});
  }
#else
  std::vector<float> xr(static_cast<size_t>(g.N * g.C * g.H * g.W));
  round_bf16(x, xr.data(), static_cast<int64_t>(xr.size()));
  const std::vector<float> rounded = w.rounded();
  conv_detail::conv2d_with(xr.data(), rounded.data(), b, y, ws, g, epi);
#endif
}

}  // namespace bf16_detail

// y = conv2d(x, w, b) as dg::conv2d computes it (dg_conv.h), for x rounded to
// bf16 (as it is read: x itself need not hold bf16 values) and the Model's kept
// bf16 weight w: bf16 products, float32 sums.
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
