// dg_conv.h - 2-D convolution and pooling for the CPU runtime (NCHW layout).
//
// Tensors are dense row-major float arrays as in PyTorch: an input x[N, C, H, W],
// a weight w[O, C/groups, KH, KW], an output y[N, O, OH, OW].  One Conv2dGeom
// describes a convolution or a pooling window (pools: O == C, groups 1); the
// caller has checked the shapes, so nothing here validates them.
//
// Convolutions are GEMMs (dg_gemm.h) on column matrices (im2col): for image n
// and group g, with Cg = C/groups, Og = O/groups and Kg = Cg*KH*KW,
//   cols[Kg, OH*OW]:  cols[(c*KH + kh)*KW + kw, oh*OW + ow]
//                       = x[n, g*Cg + c, oh*sh - ph + kh*dh, ow*sw - pw + kw*dw]
//                     (0 outside the input: zero padding)
//   forward:      y[n, g] [Og, OH*OW] = w[g] [Og, Kg] @ cols (+ b, in the epilogue)
//   grad_input:   cols = w[g]^T @ dy[n, g], then col2im adds each column back
//   grad_weight:  dw[g] += dy[n, g] @ cols^T, summed over the images
// A pointwise convolution (1x1, stride 1, no padding) is its own column matrix,
// so it skips im2col.  The caller provides the column matrix's memory (ws, see
// conv2d_workspace); nothing big is allocated here.  Convolutions with one
// input channel per group and few outputs per group (depthwise: groups == C)
// do too little work per column for a GEMM and run a direct loop instead.
//
// Threads (OpenMP): the GEMMs split themselves; im2col / col2im, the direct
// loops and the pools split over rows, channels or planes when the work is big
// enough (dg::threads_for, dg_parallel.h).  Every output element gets the same
// operations in the same order whatever the thread count, so results do not
// depend on it.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.  Header-only, C++17.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include "dg_conv_geom.h"
#include "dg_gemm.h"
#include "dg_modes.h"
#include "dg_packed_weights.h"
#include "dg_parallel.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dg {

// Floats of workspace conv2d_grad_weight needs: the column matrix of one image
// and group (each image's product is added into dw in place).  The CUDA runtime
// wants more, for its K slices' partial sums: see target.json's
// "weight_grad_partials" and ops/conv.py.
constexpr int64_t conv2d_grad_weight_workspace(const Conv2dGeom& g) {
  return conv2d_workspace(g);
}

namespace conv_detail {

// Vectorizes the loop that follows (an axpy along an output row whose source
// and destination do not overlap) at any optimization level, when OpenMP is on.
#ifdef _OPENMP
#define DG_CONV_SIMD _Pragma("omp simd")
#else
#define DG_CONV_SIMD
#endif

// Whether dg_gemm.h's vector type (gemm_detail::Vec, vload, vfma, ...) is
// compiled in: the same test as its DG_GEMM_SIMD, which it does not export.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__)) || \
    (defined(__aarch64__) && defined(__ARM_NEON))
#define DG_CONV_VEC 1
#else
#define DG_CONV_VEC 0
#endif

// Outputs per group up to which a convolution with one input channel per
// group runs the direct loops (a GEMM with K = KH*KW and so few rows is
// mostly packing overhead); more outputs per group share each column enough
// for the GEMM to win.
constexpr int64_t kDirectMaxOutputsPerGroup = 4;

// Operations (dg::threads_for) one float moved by im2col or col2im counts for:
// these loops are bound by memory, not arithmetic, so that a second thread
// pays off for about 2^17 floats (one image's columns of a small layer).
constexpr int64_t kCopyWork = 8;

// True when conv2d & co. take the direct loops for g.
constexpr bool direct(const Conv2dGeom& g) {
  return g.C == g.groups && g.O / g.groups <= kDirectMaxOutputsPerGroup;
}

// [lo, hi): the outputs o in [0, out) whose input index o*stride + off lies in
// [0, in), i.e. those that do not read padding along this axis (lo <= hi).
inline void valid_range(int64_t off, int64_t stride, int64_t in, int64_t out, int64_t& lo, int64_t& hi) {
  lo = off >= 0 ? 0 : (-off + stride - 1) / stride;
  hi = in - off <= 0 ? 0 : (in - off + stride - 1) / stride;
  hi = std::min(hi, out);
  lo = std::min(lo, hi);
}

// One kernel position (tap) of g: its offsets into the input, and the output
// rows and columns [lo, hi) whose window has it inside the input.
struct Tap {
  int64_t off_h, off_w, oh_lo, oh_hi, ow_lo, ow_hi;
};

// g's taps, kh outer, kw inner (the weight's order).
inline std::vector<Tap> taps_of(const Conv2dGeom& g) {
  std::vector<Tap> taps(static_cast<size_t>(g.KH * g.KW));
  for (int64_t t = 0; t < g.KH * g.KW; ++t) {
    Tap& p = taps[static_cast<size_t>(t)];
    p.off_h = t / g.KW * g.dil_h - g.pad_h;
    p.off_w = t % g.KW * g.dil_w - g.pad_w;
    valid_range(p.off_h, g.stride_h, g.H, g.OH, p.oh_lo, p.oh_hi);
    valid_range(p.off_w, g.stride_w, g.W, g.OW, p.ow_lo, p.ow_hi);
  }
  return taps;
}

// to[0..n) = from[0..n), whole vectors where the vector type is compiled in: a
// compiler turns a plain copy loop into a call of memmove, which for a row of a
// few dozen floats costs more than the copy (im2col's rows: ~10% of a bf16
// ResNet-18 at 32x32). The last vector may overlap the one before it.
inline void copy_floats(const float* from, float* to, int64_t n) {
#if DG_CONV_VEC
  constexpr int64_t V = gemm_detail::kWidth;
  if (n >= V) {
    for (int64_t i = 0; i + V <= n; i += V)
      gemm_detail::vstore(to + i, gemm_detail::vload(from + i));
    gemm_detail::vstore(to + n - V, gemm_detail::vload(from + n - V));
    return;
  }
#endif
  DG_CONV_SIMD
  for (int64_t i = 0; i < n; ++i)
    to[i] = from[i];
}

// row[OH*OW] = one row of the column matrix: the input plane xc[H, W] at tap p
// of every output position (zeros where the window lies in the padding).
inline void tap_row(const float* xc, const Tap& p, float* row, const Conv2dGeom& g) {
  const int64_t W = g.W, OW = g.OW, OHW = g.OH * g.OW, sh = g.stride_h, sw = g.stride_w;
  for (int64_t i = 0; i < p.oh_lo * OW; ++i)
    row[i] = 0.0f;
  for (int64_t oh = p.oh_lo; oh < p.oh_hi; ++oh) {
    const float* xr = xc + (oh * sh + p.off_h) * W;
    float* out = row + oh * OW;
    for (int64_t ow = 0; ow < p.ow_lo; ++ow)
      out[ow] = 0.0f;
    if (sw == 1) {
      copy_floats(xr + p.off_w + p.ow_lo, out + p.ow_lo, p.ow_hi - p.ow_lo);
    } else {
      for (int64_t ow = p.ow_lo; ow < p.ow_hi; ++ow)
        out[ow] = xr[ow * sw + p.off_w];
    }
    for (int64_t ow = p.ow_hi; ow < OW; ++ow)
      out[ow] = 0.0f;
  }
  for (int64_t i = p.oh_hi * OW; i < OHW; ++i)
    row[i] = 0.0f;
}

// cols[Cg*KH*KW, OH*OW] = the column matrix of x[Cg, H, W] (one image, one
// group), see the top of this file.  Each row is written whole: zeros where
// the window lies in the padding, a copy elsewhere.  The unpadded range of each
// kernel position is found once per call (not per row: at 2x2 or 4x4 outputs
// a row is 4 or 16 floats, and the divisions that found it cost more than the
// copy), and rows are copied by plain loops, not memcpy calls of a few floats.
// What is left is mostly the writes of cols (ResNet-18 at 64x64, batch 1:
// im2col ~11% of the forward on Zen 3; a GEMM packing B straight from x would
// save them).  Channels are shared out over threads.
inline void im2col(const float* x, int64_t Cg, float* cols, const Conv2dGeom& g) {
  const int64_t OHW = g.OH * g.OW, KK = g.KH * g.KW;
  const std::vector<Tap> taps = taps_of(g);
  const int threads = threads_for(kCopyWork * Cg * KK * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t c = 0; c < Cg; ++c) {
    for (int64_t t = 0; t < KK; ++t)
      tap_row(x + c * g.H * g.W, taps[static_cast<size_t>(t)], cols + (c * KK + t) * OHW, g);
  }
}

// dx[Cg, H, W] = the adjoint of im2col applied to cols: dx is overwritten with
// zeros, then every column entry that im2col took from an input position is
// added back to it.  Channels are shared out over threads (the rows of one
// channel all add into its plane).
inline void col2im(const float* cols, int64_t Cg, float* dx, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW, OHW = OH * OW;
  const int64_t KH = g.KH, KW = g.KW, sh = g.stride_h, sw = g.stride_w;
  const int threads = threads_for(kCopyWork * Cg * KH * KW * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t c = 0; c < Cg; ++c) {
    float* dxc = dx + c * H * W;
    std::fill(dxc, dxc + H * W, 0.0f);
    for (int64_t kh = 0; kh < KH; ++kh) {
      const int64_t off_h = kh * g.dil_h - g.pad_h;
      int64_t oh_lo, oh_hi;
      valid_range(off_h, sh, H, OH, oh_lo, oh_hi);
      for (int64_t kw = 0; kw < KW; ++kw) {
        const int64_t off_w = kw * g.dil_w - g.pad_w;
        int64_t ow_lo, ow_hi;
        valid_range(off_w, sw, W, OW, ow_lo, ow_hi);
        const float* row = cols + ((c * KH + kh) * KW + kw) * OHW;
        for (int64_t oh = oh_lo; oh < oh_hi; ++oh) {
          float* dr = dxc + (oh * sh + off_h) * W;
          const float* in = row + oh * OW;
          if (sw == 1) {
            DG_CONV_SIMD
            for (int64_t ow = ow_lo; ow < ow_hi; ++ow)
              dr[ow + off_w] += in[ow];
          } else {
            for (int64_t ow = ow_lo; ow < ow_hi; ++ow)
              dr[ow * sw + off_w] += in[ow];
          }
        }
      }
    }
  }
}

// Calls row(k, oh, ih, off_w, ow_lo, ow_hi) for every kernel position k =
// kh*KW + kw and every output row oh whose input row ih = oh*stride_h +
// kh*dil_h - pad_h lies inside the input, where [ow_lo, ow_hi) are the output
// columns whose input column ow*stride_w + off_w does: the unpadded part of each
// tap, which the direct loops below walk.
template <typename Row>
inline void for_each_tap_row(const Conv2dGeom& g, Row&& row) {
  for (int64_t kh = 0; kh < g.KH; ++kh) {
    const int64_t off_h = kh * g.dil_h - g.pad_h;
    int64_t oh_lo, oh_hi;
    valid_range(off_h, g.stride_h, g.H, g.OH, oh_lo, oh_hi);
    for (int64_t kw = 0; kw < g.KW; ++kw) {
      const int64_t off_w = kw * g.dil_w - g.pad_w;
      int64_t ow_lo, ow_hi;
      valid_range(off_w, g.stride_w, g.W, g.OW, ow_lo, ow_hi);
      if (ow_lo == ow_hi) continue;
      for (int64_t oh = oh_lo; oh < oh_hi; ++oh)
        row(kh * g.KW + kw, oh, oh * g.stride_h + off_h, off_w, ow_lo, ow_hi);
    }
  }
}

// This thread's staging buffer for the direct forward loops, at least
// `floats` floats, 64-byte aligned; it grows on demand and is kept for later
// calls, so a steady stream of calls allocates nothing.
inline float* direct_scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  const size_t need = static_cast<size_t>(floats) + 16;
  if (buffer.size() < need) buffer.resize(need);
  const uintptr_t at = reinterpret_cast<uintptr_t>(buffer.data());
  return buffer.data() + ((64 - at % 64) % 64) / sizeof(float);
}

// The padded input a direct forward reads: rows r = ih + pad_h for r in
// [0, padded_rows), columns c = iw + pad_w for c in [0, padded_cols), zero
// outside the input.  Exactly the positions the output windows reach.
inline int64_t padded_rows(const Conv2dGeom& g) {
  return (g.OH - 1) * g.stride_h + (g.KH - 1) * g.dil_h + 1;
}
inline int64_t padded_cols(const Conv2dGeom& g) {
  return (g.OW - 1) * g.stride_w + (g.KW - 1) * g.dil_w + 1;
}

// Output columns computed together by conv2d_direct_rows (one AVX-512 vector,
// two AVX2 ones, four NEON ones); and channels computed together by
// conv2d_direct_channels.
constexpr int64_t kDirectCols = 16;
constexpr int64_t kDirectLanes = 16;

// kDirectCols floats in registers (the GEMM's vector type, dg_gemm.h), for
// the direct forward loops: acc = bias; acc += w * in (a scalar weight, or one
// weight per lane); stored whole or in part.  One multiply-add per float and
// step, so every output gets the same operations whatever the vector width.
struct Piece {
#if DG_CONV_VEC
  static constexpr int kVecs = int(kDirectCols) / gemm_detail::kWidth;
  gemm_detail::Vec v[kVecs];
  Piece() = default;  // uninitialized
  explicit Piece(float bias) {
    for (int i = 0; i < kVecs; ++i)
      v[i] = gemm_detail::vbroadcast(&bias);
  }
  explicit Piece(const float* bias) {
    for (int i = 0; i < kVecs; ++i)
      v[i] = gemm_detail::vload(bias + i * gemm_detail::kWidth);
  }
  void fma(const float* w, const float* in) {
    const gemm_detail::Vec wv = gemm_detail::vbroadcast(w);
    for (int i = 0; i < kVecs; ++i)
      v[i] = gemm_detail::vfma(wv, gemm_detail::vload(in + i * gemm_detail::kWidth), v[i]);
  }
  void fma_lanes(const float* w, const float* in) {
    for (int i = 0; i < kVecs; ++i) {
      const int at = i * gemm_detail::kWidth;
      v[i] = gemm_detail::vfma(gemm_detail::vload(w + at), gemm_detail::vload(in + at), v[i]);
    }
  }
  void store(float* to, int64_t n) const {
    if (n == kDirectCols) {
      for (int i = 0; i < kVecs; ++i)
        gemm_detail::vstore(to + i * gemm_detail::kWidth, v[i]);
      return;
    }
    alignas(64) float all[kDirectCols];
    for (int i = 0; i < kVecs; ++i)
      gemm_detail::vstore(all + i * gemm_detail::kWidth, v[i]);
    std::memcpy(to, all, n * sizeof(float));
  }
#else
  float v[kDirectCols];
  Piece() = default;  // uninitialized
  explicit Piece(float bias) { std::fill(v, v + kDirectCols, bias); }
  explicit Piece(const float* bias) { std::copy(bias, bias + kDirectCols, v); }
  void fma(const float* w, const float* in) {
    for (int64_t j = 0; j < kDirectCols; ++j)
      v[j] += *w * in[j];
  }
  void fma_lanes(const float* w, const float* in) {
    for (int64_t j = 0; j < kDirectCols; ++j)
      v[j] += w[j] * in[j];
  }
  void store(float* to, int64_t n) const { std::memcpy(to, v, n * sizeof(float)); }
#endif
};
static_assert(kDirectLanes == kDirectCols, "a Piece holds the lanes of conv2d_direct_channels too");

// Output rows conv2d_direct_rows computes together: R rows of kDirectCols
// outputs are R*kDirectCols/width independent sums (8 AVX2 vectors for R = 4),
// enough to hide the multiply-add latency, and each weight is broadcast once
// for all R rows.
constexpr int kDirectRows = 4;

// This thread's tap offsets for conv2d_direct_rows (at least `n`), kept like
// direct_scratch's buffer.
inline int64_t* direct_taps(int64_t n) {
  thread_local std::vector<int64_t> buffer;
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(n);
  return buffer.data();
}

// R output rows of one plane for conv2d_direct_rows, kDirectCols outputs at a
// time: row i's outputs start at bias and get w[k] * in[i * row_step + tap[k]
// + (column)] added for k = 0 .. KK-1 in order (kh outer, kw inner), in
// registers, then are stored to y + i * OW.  The tap offsets are computed once
// per plane, so the loop has no index arithmetic beyond additions.
template <int R>
inline void direct_row_pass(const float* in, int64_t row_step, const int64_t* tap, int64_t KK, const float* w,
                            float bias, float* y, int64_t OW) {
  for (int64_t ow0 = 0; ow0 < OW; ow0 += kDirectCols) {
    Piece acc[R];
    for (int i = 0; i < R; ++i)
      acc[i] = Piece(bias);
    for (int64_t k = 0; k < KK; ++k) {
      const float* at = in + tap[k] + ow0;
      for (int i = 0; i < R; ++i)
        acc[i].fma(w + k, at + i * row_step);
    }
    const int64_t n = std::min(kDirectCols, OW - ow0);
    for (int i = 0; i < R; ++i)
      acc[i].store(y + i * OW + ow0, n);
  }
}

// Direct forward for one plane at a time, vectorized along the output row
// (planes at least kDirectCols wide).  The input plane is first copied into a
// zero-padded staging plane whose columns are dealt into stride_w phases
// (padded column c goes to phase c % stride_w, place c / stride_w), so that
// the window tap kw of consecutive outputs reads consecutive floats of one
// phase whatever the stride: no bounds checks and no strided loads in the
// loop.  Each piece of kDirectCols outputs of a row then starts at its bias
// and gets w * (the shifted input) added for every kernel position in order
// (kh outer, kw inner), in registers, and is stored once.  Planes are shared
// out over threads.
template <class Epi>
void conv2d_direct_rows(const float* x, const float* w, const float* b, float* y, const Conv2dGeom& g,
                        const Epi& epi) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW, OHW = OH * OW, KH = g.KH, KW = g.KW, KK = KH * KW;
  const int64_t sh = g.stride_h, sw = g.stride_w, O = g.O, Og = g.O / g.groups, planes = g.N * O;
  const int64_t PH = padded_rows(g), PC = padded_cols(g);
  const int64_t PW = (PC + sw - 1) / sw + kDirectCols;  // one phase's row, with slack for the last piece
  const int threads = threads_for(2 * planes * KK * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t p = 0; p < planes; ++p) {
    const int64_t n = p / O, o = p % O;
    const float* xp = x + (n * g.C + o / Og) * H * W;
    float* stage = direct_scratch(sw * PH * PW);
    std::fill(stage, stage + sw * PH * PW, 0.0f);
    const int64_t c_lo = std::max<int64_t>(0, g.pad_w), c_hi = std::min(PC, W + g.pad_w);
    for (int64_t r = std::max<int64_t>(0, g.pad_h); r < std::min(PH, H + g.pad_h); ++r) {
      const float* xr = xp + (r - g.pad_h) * W - g.pad_w;  // xr[c]: padded column c
      for (int64_t q = 0; q < sw; ++q) {  // phase q: the columns c = q + j*sw in [c_lo, c_hi)
        float* dst = stage + (q * PH + r) * PW;
        const int64_t j_lo = c_lo > q ? (c_lo - q + sw - 1) / sw : 0;
        const int64_t j_hi = c_hi > q ? (c_hi - q + sw - 1) / sw : 0;
        if (sw == 1) {
          if (j_hi > j_lo) std::memcpy(dst + j_lo, xr + j_lo, (j_hi - j_lo) * sizeof(float));
        } else {
          for (int64_t j = j_lo; j < j_hi; ++j)
            dst[j] = xr[q + j * sw];
        }
      }
    }
    int64_t* tap = direct_taps(KK);  // tap[kh*KW + kw]: where tap (kh, kw) of output (0, 0) starts
    for (int64_t kh = 0; kh < KH; ++kh) {
      for (int64_t kw = 0; kw < KW; ++kw) {
        const int64_t c = kw * g.dil_w;
        tap[kh * KW + kw] = ((c % sw) * PH + kh * g.dil_h) * PW + c / sw;
      }
    }
    const float* wp = w + o * KK;
    const float bias = b ? b[o] : 0.0f;
    float* yp = y + p * OHW;
    int64_t oh = 0;
    for (; oh + kDirectRows <= OH; oh += kDirectRows)
      direct_row_pass<kDirectRows>(stage + oh * sh * PW, sh * PW, tap, KK, wp, bias, yp + oh * OW, OW);
    for (; oh < OH; ++oh)
      direct_row_pass<1>(stage + oh * sh * PW, sh * PW, tap, KK, wp, bias, yp + oh * OW, OW);
    epi(o, yp, OHW);
  }
}

// [lo, hi): the taps k in [0, K) whose padded index at + k*dil lies inside the
// input, [pad, pad + in) (lo <= hi): the taps of a window starting at padded
// index `at` that do not read padding.  Called for every output position, so
// dilation 1 (the usual case) takes no division.
inline void inside_taps(int64_t at, int64_t pad, int64_t in, int64_t dil, int64_t K, int64_t& lo,
                        int64_t& hi) {
  if (dil == 1) {
    lo = std::max<int64_t>(0, pad - at);
    hi = std::max<int64_t>(0, pad + in - at);
  } else {
    lo = at >= pad ? 0 : (pad - at + dil - 1) / dil;
    hi = pad + in - at <= 0 ? 0 : (pad + in - at + dil - 1) / dil;
  }
  hi = std::min(hi, K);
  lo = std::min(lo, hi);
}

// Direct forward for small planes (narrower than kDirectCols), vectorized
// across channels instead: kDirectLanes output channels of one image at a
// time.  Their input planes are staged interleaved (padded position (r, c)
// holds the kDirectLanes channels' values side by side) and their weights
// likewise, so every output position is a sum of whole-vector multiply-adds
// over the kernel positions (kh outer, kw inner), starting at the bias, as in
// conv2d_direct_rows, except that the taps reading padding are skipped
// (inside_taps): on these small planes most of a 5x5 window is padding (a 2x2
// plane's output reads 4 of its 25 taps).  Skipping a w * 0 term changes no
// finite sum except for the sign of a zero (-0 + 0 is +0); an infinite or NaN
// weight over padding gives no NaN here.  Blocks of channels are shared out
// over threads.
template <class Epi>
void conv2d_direct_channels(const float* x, const float* w, const float* b, float* y, const Conv2dGeom& g,
                            const Epi& epi) {
  constexpr int64_t L = kDirectLanes;
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW, OHW = OH * OW, KH = g.KH, KW = g.KW, KK = KH * KW;
  const int64_t O = g.O, Og = g.O / g.groups, blocks_per_image = (O + L - 1) / L,
                blocks = g.N * blocks_per_image;
  const int64_t PH = padded_rows(g), PW = padded_cols(g);
  const int threads = threads_for(2 * g.N * O * KK * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t n = blk / blocks_per_image, o0 = blk % blocks_per_image * L, lanes = std::min(L, O - o0);
    float* stage = direct_scratch(PH * PW * L + KK * L + OHW * L);
    float* wt = stage + PH * PW * L;  // wt[k * L + l] = w[o0 + l, k]
    float* out = wt + KK * L;         // out[i * L + l] = y[n, o0 + l, i]
    // Only in-input positions are staged and read (inside_taps); a partial
    // block's unused lanes are zeros.
    if (lanes < L) std::fill(stage, stage + PH * PW * L + KK * L, 0.0f);
    for (int64_t l = 0; l < lanes; ++l) {
      const float* xp = x + (n * g.C + (o0 + l) / Og) * H * W;
      for (int64_t r = std::max<int64_t>(0, g.pad_h); r < std::min(PH, H + g.pad_h); ++r)
        for (int64_t c = std::max<int64_t>(0, g.pad_w); c < std::min(PW, W + g.pad_w); ++c)
          stage[(r * PW + c) * L + l] = xp[(r - g.pad_h) * W + c - g.pad_w];
      for (int64_t k = 0; k < KK; ++k)
        wt[k * L + l] = w[(o0 + l) * KK + k];
    }
    alignas(64) float bias[L];
    for (int64_t l = 0; l < L; ++l)
      bias[l] = b && l < lanes ? b[o0 + l] : 0.0f;
    for (int64_t oh = 0; oh < OH; ++oh) {
      int64_t kh_lo, kh_hi;
      inside_taps(oh * g.stride_h, g.pad_h, H, g.dil_h, KH, kh_lo, kh_hi);
      for (int64_t ow = 0; ow < OW; ++ow) {
        int64_t kw_lo, kw_hi;
        inside_taps(ow * g.stride_w, g.pad_w, W, g.dil_w, KW, kw_lo, kw_hi);
        Piece acc(bias);
        for (int64_t kh = kh_lo; kh < kh_hi; ++kh) {
          const float* in_row = stage + (oh * g.stride_h + kh * g.dil_h) * PW * L;
          for (int64_t kw = kw_lo; kw < kw_hi; ++kw)
            acc.fma_lanes(wt + (kh * KW + kw) * L, in_row + (ow * g.stride_w + kw * g.dil_w) * L);
        }
        acc.store(out + (oh * OW + ow) * L, L);
      }
    }
    for (int64_t l = 0; l < lanes; ++l) {
      float* yp = y + (n * O + o0 + l) * OHW;
      for (int64_t i = 0; i < OHW; ++i)
        yp[i] = out[i * L + l];
      epi(o0 + l, yp, OHW);
    }
  }
}

// What conv2d_with applies to each finished piece of an output channel o's
// plane (epi(o, c, n): c points at n finished outputs of channel o, bias
// included): nothing, for conv2d.
struct NoChannelEpilogue {
  void operator()(int64_t, float*, int64_t) const {}
};

// Direct forward for one input channel per group (see direct()): every
// output is its bias plus w * the input over the window's positions inside
// the input, added in kernel order (padding positions add w * 0).  Wide
// planes are vectorized along their rows, narrow ones across channels; epi
// runs on each plane once it is complete.
template <class Epi = NoChannelEpilogue>
void conv2d_direct(const float* x, const float* w, const float* b, float* y, const Conv2dGeom& g,
                   const Epi& epi = Epi()) {
  if (g.OW >= kDirectCols) {
    conv2d_direct_rows(x, w, b, y, g, epi);
  } else {
    conv2d_direct_channels(x, w, b, y, g, epi);
  }
}

// Output planes up to this size (OH*OW: 2x2, 2x4, the last stages of
// a network at small images) run their GEMMs transposed, see conv2d_small.
// Packed per call, only for weights up to kSmallPlaneWeight floats (1 MiB, so
// that the transposed packing stays in L2): a bigger weight is bound by memory
// either way, and packing it at every call would add a write and a read of it
// (ResNet-18's 512 x 4608 layers at 2x2 measured 10% slower transposed).  A
// weight the Model keeps packed (kept_plane) has no such cost, at any size:
// the product streams the packing once, in order (dg_gemm.h,
// kStreamPackedRows), instead of reading the weight in place a few rows at a
// time with a stride.
constexpr int64_t kSmallPlane = 8;
constexpr int64_t kSmallPlaneWeight = int64_t(1) << 18;
// The most scratch (floats: 4 MiB) conv2d_small's transposed columns and
// products take; a bigger batch runs in several products.
constexpr int64_t kSmallPlaneScratch = int64_t(1) << 20;

// Whether conv2d_with runs g's forward GEMMs as conv2d_small (one group only
// reads a kept packing: the Model's dg::KeptPackedB of w as [Kg, O]).
constexpr bool small_plane(const Conv2dGeom& g) {
  return !direct(g) && g.OH * g.OW <= kSmallPlane &&
         (g.O / g.groups) * (g.C / g.groups * g.KH * g.KW) <= kSmallPlaneWeight;
}

// Whether conv2d reads g's weight through the Model's kept packing (the
// generator's rule, ops/conv.py kept_weight_read): small output planes and one
// group, whatever the weight's size.
constexpr bool kept_plane(const Conv2dGeom& g) {
  return !direct(g) && g.OH * g.OW <= kSmallPlane && g.groups == 1;
}

// The forward GEMM of one group, all images at once, for small output planes.
// As w[Og, Kg] @ cols[Kg, OHW] per image, C would be a few columns wide: the
// micro-kernel computes a whole tile width (16 or 32 columns) for 4 of them,
// and the weight is read in place, 12 rows at a time, with a stride, once per
// image.  Transposed and over the batch,
//   yt[N*OHW, Og] = cols_t[N*OHW, Kg] @ w^T,
// where cols_t holds every image's column matrix transposed (row n*OHW + i:
// output position i of image n), the weight is the wide operand, packed once
// per call (or kept packed by the Model) and read in order, and every column of the tile is an output
// channel.  Each output is a sum over k in ascending order, in the same K
// blocks as the per-image product (dot products instead where N*OHW <= 3:
// the GEMM's tiny-M path streams the weight in place); yt is then written
// out as y[n, o, i], bias added, and epi runs on each output plane.  cols_t
// and yt are scratch (a batch too big for kSmallPlaneScratch runs in
// several products); ws holds one image's columns (unless pointwise).
// packed: w^T already packed (the Model's kept packing, groups == 1, read by
// the micro-kernel at every N*OHW: sums in K blocks, the same as per call
// except where N*OHW <= 3 and Kg is over one K block, dg_gemm.h's KC), or
// null to pack wg per call.
template <class Epi>
void conv2d_small(const float* x, const float* wg, const PackedB* packed, const float* bg, float* y,
                  float* ws, const Conv2dGeom& g, int64_t grp, const Epi& epi) {
  const int64_t Cg = g.C / g.groups, Og = g.O / g.groups, Kg = Cg * g.KH * g.KW;
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW;
  // Images per product: as many as keep the scratch within kSmallPlaneScratch floats.
  const int64_t per_image = OHW * (Kg + Og);
  const int64_t chunk = std::max<int64_t>(1, std::min(g.N, kSmallPlaneScratch / per_image));
  float* yt = direct_scratch(chunk * per_image);
  float* cols_t = yt + chunk * OHW * Og;
  for (int64_t n0 = 0; n0 < g.N; n0 += chunk) {
    const int64_t images = std::min(chunk, g.N - n0);
    for (int64_t m = 0; m < images; ++m) {
      const float* cols = x + ((n0 + m) * g.C + grp * Cg) * HW;
      if (!g.pointwise()) {
        im2col(cols, Cg, ws, g);
        cols = ws;
      }
      for (int64_t i = 0; i < OHW; ++i) {
        float* row = cols_t + (m * OHW + i) * Kg;
        for (int64_t k = 0; k < Kg; ++k)
          row[k] = cols[k * OHW + i];
      }
    }
    if (packed != nullptr) {
      gemm(false, images * OHW, cols_t, Kg, *packed, yt, Og);
    } else {
      gemm(false, true, images * OHW, Og, Kg, cols_t, Kg, wg, Kg, yt, Og);
    }
    for (int64_t m = 0; m < images; ++m) {
      for (int64_t o = 0; o < Og; ++o) {
        float* yo = y + ((n0 + m) * g.O + grp * Og + o) * OHW;
        const float* from = yt + m * OHW * Og + o;
        if (bg) {
          const float v = bg[o];
          for (int64_t i = 0; i < OHW; ++i)
            yo[i] = from[i * Og] + v;
        } else {
          for (int64_t i = 0; i < OHW; ++i)
            yo[i] = from[i * Og];
        }
        epi(grp * Og + o, yo, OHW);
      }
    }
  }
}

// Direct input gradient for one input channel per group: each input plane is
// zeroed, then w * dy is added back to the positions its outputs read, for
// each of the group's outputs and kernel positions.  Planes are shared out.
inline void conv2d_grad_input_direct(const float* dy, const float* w, float* dx, const Conv2dGeom& g) {
  const int64_t W = g.W, OW = g.OW, OHW = g.OH * OW, KK = g.KH * g.KW, sw = g.stride_w;
  const int64_t C = g.C, Og = g.O / g.groups, planes = g.N * C;
  const int threads = threads_for(2 * g.N * g.O * KK * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t p = 0; p < planes; ++p) {
    const int64_t n = p / C, c = p % C;
    float* dxp = dx + p * g.H * W;
    std::fill(dxp, dxp + g.H * W, 0.0f);
    for (int64_t m = 0; m < Og; ++m) {
      const int64_t o = c * Og + m;
      const float* dyp = dy + (n * g.O + o) * OHW;
      const auto tap = [&](int64_t k, int64_t oh, int64_t ih, int64_t off_w, int64_t lo, int64_t hi) {
        const float wv = w[o * KK + k];
        float* dr = dxp + ih * W;
        const float* gr = dyp + oh * OW;
        if (sw == 1) {
          DG_CONV_SIMD
          for (int64_t ow = lo; ow < hi; ++ow)
            dr[ow + off_w] += wv * gr[ow];
        } else {
          for (int64_t ow = lo; ow < hi; ++ow)
            dr[ow * sw + off_w] += wv * gr[ow];
        }
      };
      for_each_tap_row(g, tap);
    }
  }
}

// sum over j in [lo, hi) of a[j] * b[j*stride + off], in 8 independent
// partial sums (which the compiler can keep in one vector) added up at the end.
inline float strided_dot(const float* a, const float* b, int64_t stride, int64_t off, int64_t lo,
                         int64_t hi) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t j = lo;
  if (stride == 1) {
    for (; j + 8 <= hi; j += 8) {
      for (int l = 0; l < 8; ++l)
        part[l] += a[j + l] * b[j + l + off];
    }
  } else {
    for (; j + 8 <= hi; j += 8) {
      for (int l = 0; l < 8; ++l)
        part[l] += a[j + l] * b[(j + l) * stride + off];
    }
  }
  for (int l = 0; j < hi; ++j, ++l)
    part[l] += a[j] * b[j * stride + off];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
}

// Direct weight gradient for one input channel per group: for each output
// channel (shared out over threads) and kernel position, the sum over the
// images and the unpadded output rows of dy * (the shifted input row), each
// row's dot product added into a double.
inline void conv2d_grad_weight_direct(const float* x, const float* dy, float* dw, const Conv2dGeom& g) {
  const int64_t W = g.W, OW = g.OW, OHW = g.OH * OW, KK = g.KH * g.KW, sw = g.stride_w;
  const int64_t O = g.O, Og = g.O / g.groups;
  const int threads = threads_for(2 * g.N * O * KK * OHW);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t o = 0; o < O; ++o) {
    std::vector<double> acc(KK, 0.0);
    for (int64_t n = 0; n < g.N; ++n) {
      const float* xp = x + (n * g.C + o / Og) * g.H * W;
      const float* dyp = dy + (n * O + o) * OHW;
      const auto tap = [&](int64_t k, int64_t oh, int64_t ih, int64_t off_w, int64_t lo, int64_t hi) {
        acc[k] += strided_dot(dyp + oh * OW, xp + ih * W, sw, off_w, lo, hi);
      };
      for_each_tap_row(g, tap);
    }
    for (int64_t k = 0; k < KK; ++k)
      dw[o * KK + k] = static_cast<float>(acc[k]);
  }
}

}  // namespace conv_detail

namespace conv_detail {

// conv2d, then epi(o, c, n) on every finished piece of output channel o (see
// NoChannelEpilogue), while it is still in cache: in the GEMM's epilogue, or
// after each plane of the direct loops.
template <class Epi>
void conv2d_with(const float* x, const float* w, const float* b, float* y, float* ws, const Conv2dGeom& g,
                 const Epi& epi) {
  if (direct(g)) {
    conv2d_direct(x, w, b, y, g, epi);
    return;
  }
  constexpr bool plain = std::is_same<Epi, NoChannelEpilogue>::value;
  const int64_t Cg = g.C / g.groups, Og = g.O / g.groups, Kg = Cg * g.KH * g.KW;
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW;
  if (small_plane(g)) {
    for (int64_t grp = 0; grp < g.groups; ++grp)
      conv2d_small(x, w + grp * Og * Kg, nullptr, b ? b + grp * Og : nullptr, y, ws, g, grp, epi);
    return;
  }
  const bool pointwise = g.pointwise();
  for (int64_t n = 0; n < g.N; ++n) {
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const float* xg = x + (n * g.C + grp * Cg) * HW;
      const float* cols = xg;
      if (!pointwise) {
        im2col(xg, Cg, ws, g);
        cols = ws;
      }
      const float* wg = w + grp * Og * Kg;
      float* yg = y + (n * g.O + grp * Og) * OHW;
      const float* bg = b ? b + grp * Og : nullptr;
      if (bg || !plain) {
        const int64_t o_first = grp * Og;
        gemm(false, false, Og, OHW, Kg, wg, Kg, cols, OHW, yg, OHW,
             [bg, o_first, &epi](int64_t row, int64_t, float* c, int64_t len) {
               if (bg) {
                 const float v = bg[row];
                 for (int64_t j = 0; j < len; ++j)
                   c[j] += v;
               }
               epi(o_first + row, c, len);
             });
      } else {
        gemm(false, false, Og, OHW, Kg, wg, Kg, cols, OHW, yg, OHW);
      }
    }
  }
}

// conv2d_with for a weight the Model keeps packed (w: the KeptPackedB of
// w[O, Kg] read transposed, [Kg, O]): the small-plane product reads the packing
// (packed at the first call, kept until the parameters change), or the weight
// as stored where KeptPackedB::use says so, then by the path conv2d_with takes
// for a stored weight (a weight over kSmallPlaneWeight: one product per image,
// the weight read in place; the same sums in the same K blocks as the packing's).
// Only for geometries kept_plane accepts (the generator's rule, ops/conv.py).
template <class Epi>
void conv2d_with(const float* x, const KeptPackedB& w, const float* b, float* y, float* ws,
                 const Conv2dGeom& g, const Epi& epi) {
  if (!kept_plane(g)) {
    throw std::logic_error(
        "dg::conv2d: a kept weight packing is read by small-plane convolutions of one group "
        "only (the generator's rule and dg_conv.h's kept_plane disagree)");
  }
  const KeptPackedB::Use use = w.use(g.N * g.OH * g.OW);
  if (use.packed() == nullptr && !small_plane(g)) {
    conv2d_with(x, use.stored(), b, y, ws, g, epi);
    return;
  }
  conv2d_small(x, use.stored(), use.packed(), b, y, ws, g, 0, epi);
}

}  // namespace conv_detail

// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C/groups,KH,KW]) (+ b[O] when b != nullptr):
// cross-correlation as torch.nn.functional.conv2d, zero padding, dilation and
// groups (depthwise included).  y is overwritten; ws holds conv2d_workspace(g)
// floats.
// W: the weight (const float*), or the Model's kept packing of it
// (KeptPackedB, small output planes of one group only: conv_detail::kept_plane).
template <class W>
void conv2d(const float* x, const W& w, const float* b, float* y, float* ws, const Conv2dGeom& g) {
  conv_detail::conv2d_with(x, w, b, y, ws, g, conv_detail::NoChannelEpilogue());
}

namespace conv_detail {

// What the conv_batch_norm pass folds after a batch norm, on n normalized
// values v in place: v + r[i] where r (the residual, read at the same
// positions) is not null, then relu where relu is set, as the elementwise
// kernels compute them (relu: dg::math::max_f(0, v), 0 > v ? 0 : v, so a NaN
// stays NaN and -0 stays -0): the same bits as the separate ops.
inline void add_relu(float* v, const float* r, int64_t n, bool relu) {
  if (r != nullptr && relu) {
    for (int64_t i = 0; i < n; ++i) {
      const float s = v[i] + r[i];
      v[i] = 0.0f > s ? 0.0f : s;
    }
  } else if (r != nullptr) {
    for (int64_t i = 0; i < n; ++i)
      v[i] = v[i] + r[i];
  } else if (relu) {
    for (int64_t i = 0; i < n; ++i)
      v[i] = 0.0f > v[i] ? 0.0f : v[i];
  }
}

}  // namespace conv_detail

namespace conv_detail {

// conv2d_batch_norm's channel epilogue in evaluation mode: on n values c of
// channel o of y, the normalization by the stored statistics, then the residual
// (read at the same place in its tensor) and relu (add_relu).
struct NormalizeEpilogue {
  const float *mean, *invstd, *bn_w, *bn_b, *residual, *y;
  bool relu;
  void operator()(int64_t o, float* c, int64_t n) const {
    modes_detail::normalize_values(c, c, n, mean[o], invstd[o] * bn_w[o], bn_b[o]);
    add_relu(c, residual != nullptr ? residual + (c - y) : nullptr, n, relu);
  }
#if defined(__AVX512F__)
  // operator() on 16 values v of channel o in a register, bound for c (the lanes
  // `lanes`; the residual is read there only): what the int8 convolutions store
  // (dg_int8.h, int8_store_run). The normalization is normalize_values' one
  // expression (so a compiler that contracts it into a fused multiply-add
  // contracts both), the add and relu add_relu's: 0 > s ? 0 : s is vmaxps(0, s),
  // which returns s when either is NaN and s when both are zeros.
  __m512 in_register(int64_t o, __m512 v, const float* c, __mmask16 lanes) const {
    const __m512 m = _mm512_set1_ps(mean[o]), scale = _mm512_set1_ps(invstd[o] * bn_w[o]),
                 shift = _mm512_set1_ps(bn_b[o]);
    __m512 s = (v - m) * scale + shift;
    if (residual != nullptr) s = s + _mm512_maskz_loadu_ps(lanes, residual + (c - y));
    // (the zero-masking form with every lane set: GCC 12 warns of the plain form's undefined operand)
    return relu ? _mm512_maskz_max_ps(static_cast<__mmask16>(0xffff), _mm512_setzero_ps(), s) : s;
  }
  // in_register on one output position's channels [j, j + 16) (the lanes `lanes`),
  // each lane with its channel's statistics: the same arithmetic, lane by lane.
  // Without a residual only (its values lie in planes).
  __m512 in_columns(int64_t j, __m512 v, __mmask16 lanes) const {
    const __m512 m = _mm512_maskz_loadu_ps(lanes, mean + j),
                 scale = _mm512_maskz_loadu_ps(lanes, invstd + j) * _mm512_maskz_loadu_ps(lanes, bn_w + j),
                 shift = _mm512_maskz_loadu_ps(lanes, bn_b + j);
    const __m512 s = (v - m) * scale + shift;
    return relu ? _mm512_maskz_max_ps(static_cast<__mmask16>(0xffff), _mm512_setzero_ps(), s) : s;
  }
#endif
  // Asks for the lines of what operator() will read for the n values at c (the
  // residual's): a convolution writing its planes in short runs (dg_bf16_conv.h)
  // calls it a block ahead.
  void prefetch(const float* c, int64_t n) const {
    if (residual == nullptr) return;
    const float* r = residual + (c - y);
    for (int64_t i = 0; i < n; i += 16)
      __builtin_prefetch(r + i);
  }
};

// conv2d_batch_norm's batch norm, residual and relu after (training) or inside
// (evaluation, as its channel epilogue) the convolution `run(epi)` writes into y
// with the channel epilogue epi (see conv2d_with); the bf16 convolutions share it
// (dg_bf16_conv.h).
template <class Run>
void batch_norm_after(const Run& run, const float* bn_w, const float* bn_b, float* running_mean,
                      float* running_var, const float* residual, float* y, float* mean, float* invstd,
                      const Conv2dGeom& g, float eps, float momentum, bool relu, const Mode& mode,
                      const char* what) {
  const int64_t OHW = g.OH * g.OW;
  if (mode.training) {
    run(NoChannelEpilogue());
    batch_norm(y, bn_w, bn_b, running_mean, running_var, y, mean, invstd, g.N, g.O, OHW, eps, momentum, mode,
               what);
    add_relu(y, residual, g.N * g.O * OHW, relu);
    return;
  }
  batch_norm_eval_statistics(running_mean, running_var, mean, invstd, g.O, eps);
  run(NormalizeEpilogue{mean, invstd, bn_w, bn_b, residual, y, relu});
}

}  // namespace conv_detail

// y = batch_norm(conv2d(x, w, b)) with batch norm's weight bn_w, bias bn_b and
// running statistics, as dg::batch_norm (dg_modes.h) computes it on conv2d's
// output; mean and invstd are written as it writes them.  Then, as the
// conv_batch_norm pass folds the ops that follow: residual added (unless null:
// a tensor of y's shape, not y itself) and relu (when relu), see add_relu.  In
// evaluation mode the normalization, (v - mean) * (invstd * bn_w) + bn_b, and
// what follows are applied to each piece of output as the convolution finishes
// it (the GEMM's epilogue), while it is in cache: the same arithmetic as the
// separate calls, one pass fewer over y for each.  In training mode the batch's
// statistics need the whole output first: conv2d into y, then batch norm,
// residual and relu in place.  w: the weight, or its kept packing (conv2d).
// ws as conv2d's.
template <class W>
void conv2d_batch_norm(const float* x, const W& w, const float* b, const float* bn_w, const float* bn_b,
                       float* running_mean, float* running_var, const float* residual, float* y, float* mean,
                       float* invstd, float* ws, const Conv2dGeom& g, float eps, float momentum, bool relu,
                       const Mode& mode, const char* what) {
  conv_detail::batch_norm_after([&](const auto& epi) { conv_detail::conv2d_with(x, w, b, y, ws, g, epi); },
                                bn_w, bn_b, running_mean, running_var, residual, y, mean, invstd, g, eps,
                                momentum, relu, mode, what);
}

// dx[N,C,H,W] = the gradient of conv2d with respect to x, given dy[N,O,OH,OW];
// dx is overwritten; ws holds conv2d_workspace(g) floats.
inline void conv2d_grad_input(const float* dy, const float* w, float* dx, float* ws, const Conv2dGeom& g) {
  if (conv_detail::direct(g)) {
    conv_detail::conv2d_grad_input_direct(dy, w, dx, g);
    return;
  }
  const int64_t Cg = g.C / g.groups, Og = g.O / g.groups, Kg = Cg * g.KH * g.KW;
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW;
  const bool pointwise = g.pointwise();
  for (int64_t n = 0; n < g.N; ++n) {
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const float* wg = w + grp * Og * Kg;
      const float* dyg = dy + (n * g.O + grp * Og) * OHW;
      float* dxg = dx + (n * g.C + grp * Cg) * HW;
      if (pointwise) {
        gemm(true, false, Cg, HW, Og, wg, Kg, dyg, OHW, dxg, HW);
      } else {
        gemm(true, false, Kg, OHW, Og, wg, Kg, dyg, OHW, ws, OHW);
        conv_detail::col2im(ws, Cg, dxg, g);
      }
    }
  }
}

// dw[O,C/groups,KH,KW] = the gradient of conv2d with respect to w, given x and
// dy (summed over the images); dw is overwritten; ws holds
// conv2d_grad_weight_workspace(g) floats.
inline void conv2d_grad_weight(const float* x, const float* dy, float* dw, float* ws, const Conv2dGeom& g) {
  if (conv_detail::direct(g)) {
    conv_detail::conv2d_grad_weight_direct(x, dy, dw, g);
    return;
  }
  const int64_t Cg = g.C / g.groups, Og = g.O / g.groups, Kg = Cg * g.KH * g.KW;
  const int64_t HW = g.H * g.W, OHW = g.OH * g.OW;
  const bool pointwise = g.pointwise();
  if (g.N == 0) std::fill(dw, dw + g.O * Kg, 0.0f);
  for (int64_t n = 0; n < g.N; ++n) {
    for (int64_t grp = 0; grp < g.groups; ++grp) {
      const float* xg = x + (n * g.C + grp * Cg) * HW;
      const float* cols = xg;
      if (!pointwise) {
        conv_detail::im2col(xg, Cg, ws, g);
        cols = ws;
      }
      const float* dyg = dy + (n * g.O + grp * Og) * OHW;
      float* dwg = dw + grp * Og * Kg;
      if (n == 0) {
        gemm(false, true, Og, Kg, OHW, dyg, OHW, cols, OHW, dwg, Kg);
      } else {  // the next image's product is added in place: no weight-sized workspace
        gemm_add(false, true, Og, Kg, OHW, dyg, OHW, cols, OHW, dwg, Kg);
      }
    }
  }
}

namespace conv_detail {

// Runs body(plane) for every plane in [0, planes), shared out over threads
// when `work` (operations in all) is big enough.
template <class Body>
void for_planes(int64_t planes, int64_t work, const Body& body) {
  const int threads = threads_for(work);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t p = 0; p < planes; ++p)
    body(p);
}

// True when a pooled maximum y came from the input value v (NaN matches NaN).
inline bool same_max(float v, float y) {
  return v == y || (std::isnan(v) && std::isnan(y));
}

// The number of window positions along one axis that lie inside the padded
// input [-pad, in + pad), for the window starting at i0 (PyTorch's divisor
// for avg_pool2d with count_include_pad; k unless ceil_mode cut the window).
inline int64_t padded_count(int64_t i0, int64_t k, int64_t dil, int64_t in, int64_t pad) {
  int64_t count = 0;
  for (int64_t j = 0; j < k; ++j)
    count += i0 + j * dil < in + pad ? 1 : 0;
  return count;
}

// The scalar max_pool2d: one output at a time.  Windows whose columns all lie
// inside the input (most of them) take a loop without the column checks,
// visiting the same positions in the same order: same results.
inline void max_pool2d_scalar(const float* x, float* y, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW;
  // [ow_lo, ow_hi): the windows with ow*stride_w - pad_w >= 0 and their last
  // column ow*stride_w - pad_w + (KW-1)*dil_w < W.
  const int64_t last = W - 1 + g.pad_w - (g.KW - 1) * g.dil_w;
  const int64_t ow_hi = last < 0 ? 0 : std::min(OW, last / g.stride_w + 1);
  const int64_t ow_lo = std::min(ow_hi, (g.pad_w + g.stride_w - 1) / g.stride_w);
  for_planes(g.N * g.C, g.N * g.C * OH * OW * g.KH * g.KW, [&](int64_t p) {
    const float* xp = x + p * H * W;
    float* yp = y + p * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t ih0 = oh * g.stride_h - g.pad_h;
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t iw0 = ow * g.stride_w - g.pad_w;
        const bool inside = ow >= ow_lo && ow < ow_hi;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          const int64_t ih = ih0 + kh * g.dil_h;
          if (ih < 0 || ih >= H) continue;
          const float* xr = xp + ih * W;
          // Once m holds NaN, `v > NaN` is false, so the NaN is kept.  Two
          // selects rather than `||`, which compiled to unpredictable branches.
          if (inside) {
            for (int64_t kw = 0; kw < g.KW; ++kw) {
              const float v = xr[iw0 + kw * g.dil_w];
              const float larger = v > m ? v : m;
              m = std::isnan(v) ? v : larger;
            }
            continue;
          }
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const int64_t iw = iw0 + kw * g.dil_w;
            if (iw < 0 || iw >= W) continue;
            const float v = xr[iw];
            if (v > m || std::isnan(v)) m = v;
          }
        }
        yp[oh * OW + ow] = m;
      }
    }
  });
}

#if defined(__AVX512F__)

// The AVX-512 max_pool2d: 16 outputs of a row at a time, one lane each.  A
// padding position reads as -inf, which changes no maximum (`-inf > m` is
// false whatever m is), so every lane can visit all KH*KW positions of its
// window in the scalar order, kh outer, kw inner, with the same choice:
//   m = v > m || isnan(v) ? v : m
// as two compares and a blend (not vmaxps alone, which keeps m when v is NaN).
// The results are the scalar loop's bit for bit, NaN payloads included.

// The lanes [lo, hi) of a 16-lane mask, 0 <= lo <= hi <= 16.
inline __mmask16 lanes(int64_t lo, int64_t hi) {
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// The 16 values xr[start + t], t = 0..15, of a row of W floats: -inf where
// start + t lies outside [0, W).  A plain load inside the row; at its edges a
// masked load, which reads only the lanes in the row.  Before the row, the
// first values are expanded into the lanes from -start on, so that no address
// before xr is formed.
inline __m512 load_row16(const float* xr, int64_t W, int64_t start) {
  if (start >= 0 && start + 16 <= W) return _mm512_loadu_ps(xr + start);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __mmask16 in_row = lanes(std::clamp<int64_t>(-start, 0, 16), std::clamp<int64_t>(W - start, 0, 16));
  if (start < 0) return _mm512_mask_expandloadu_ps(neg_inf, in_row, xr);
  return _mm512_mask_loadu_ps(neg_inf, in_row, xr + std::min(start, W));
}

// The 16 values xr[start + j*stride], j = 0..15 (-inf outside the row).
// kStride 1: one load; 2: the even lanes of two loads; 0 (any other stride):
// a gather of the lanes in the row.
template <int kStride>
inline __m512 load_strided16(const float* xr, int64_t W, int64_t start, int64_t stride) {
  if (kStride == 1) return load_row16(xr, W, start);
  if (kStride == 2) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    return _mm512_permutex2var_ps(load_row16(xr, W, start), even, load_row16(xr, W, start + 16));
  }
  const __m512i j = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(start)),
                                      _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int32_t>(stride))));
  const __mmask16 in_row = _mm512_cmpge_epi32_mask(at, _mm512_setzero_si512()) &
                           _mm512_cmplt_epi32_mask(at, _mm512_set1_epi32(static_cast<int32_t>(W)));
  return _mm512_mask_i32gather_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), in_row, at, xr, 4);
}

template <int kStride>
inline void max_pool2d_avx512(const float* x, float* y, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW, sw = g.stride_w;
  for_planes(g.N * g.C, g.N * g.C * OH * OW * g.KH * g.KW, [&](int64_t p) {
    const float* xp = x + p * H * W;
    float* yp = y + p * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t ih0 = oh * g.stride_h - g.pad_h;
      for (int64_t ow0 = 0; ow0 < OW; ow0 += 16) {
        __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          const int64_t ih = ih0 + kh * g.dil_h;
          if (ih < 0 || ih >= H) continue;
          const float* xr = xp + ih * W;
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const __m512 v = load_strided16<kStride>(xr, W, ow0 * sw - g.pad_w + kw * g.dil_w, sw);
            const __mmask16 take =
                _mm512_cmp_ps_mask(v, m, _CMP_GT_OQ) | _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            m = _mm512_mask_mov_ps(m, take, v);
          }
        }
        _mm512_mask_storeu_ps(yp + oh * OW + ow0, lanes(0, std::min<int64_t>(16, OW - ow0)), m);
      }
    }
  });
}

#endif  // __AVX512F__

}  // namespace conv_detail

// y[N,C,OH,OW] = the maximum over each window of x[N,C,H,W]; padding positions
// are ignored (as -inf) and NaN propagates (the window's last NaN, in the
// order kh outer, kw inner); a window all padding gives -inf.  y is
// overwritten.  AVX-512 builds run 16 outputs of a row at a time, others one
// at a time: the same results.
inline void max_pool2d(const float* x, float* y, const Conv2dGeom& g) {
#if defined(__AVX512F__)
  if (g.stride_w == 1) return conv_detail::max_pool2d_avx512<1>(x, y, g);
  if (g.stride_w == 2) return conv_detail::max_pool2d_avx512<2>(x, y, g);
  // Other strides gather, by int32 indices into a row: rows too long for them take the scalar loop.
  const int64_t reach = (g.OW + 15) * g.stride_w + (g.KW - 1) * g.dil_w + g.pad_w + g.W;
  if (reach <= std::numeric_limits<int32_t>::max()) return conv_detail::max_pool2d_avx512<0>(x, y, g);
#endif
  conv_detail::max_pool2d_scalar(x, y, g);
}

// dx[N,C,H,W] = the gradient of max_pool2d given x, its output y and dy: zeros,
// then each dy goes to the first position of its window (row-major: kh outer,
// kw inner) whose x equals the window's y (a NaN y: the first NaN), as
// PyTorch's CPU kernel for ties.  dx is overwritten.
inline void max_pool2d_grad(const float* x, const float* y, const float* dy, float* dx, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW;
  conv_detail::for_planes(g.N * g.C, g.N * g.C * OH * OW * g.KH * g.KW, [&](int64_t p) {
    const float* xp = x + p * H * W;
    const float* yp = y + p * OH * OW;
    const float* gp = dy + p * OH * OW;
    float* dxp = dx + p * H * W;
    std::fill(dxp, dxp + H * W, 0.0f);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t ih0 = oh * g.stride_h - g.pad_h;
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t iw0 = ow * g.stride_w - g.pad_w;
        const float m = yp[oh * OW + ow];
        int64_t at = -1;
        for (int64_t kh = 0; kh < g.KH && at < 0; ++kh) {
          const int64_t ih = ih0 + kh * g.dil_h;
          if (ih < 0 || ih >= H) continue;
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const int64_t iw = iw0 + kw * g.dil_w;
            if (iw < 0 || iw >= W) continue;
            if (conv_detail::same_max(xp[ih * W + iw], m)) {
              at = ih * W + iw;
              break;
            }
          }
        }
        if (at >= 0) dxp[at] += gp[oh * OW + ow];
      }
    }
  });
}

// y[N,C,OH,OW] = the sum over each window of x / the window size, padding
// counted as zeros (PyTorch's count_include_pad=True): the size is KH*KW, or
// fewer where an output size rounded up (ceil_mode) cut the window at the far
// padding edge.  y is overwritten.
inline void avg_pool2d(const float* x, float* y, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW;
  conv_detail::for_planes(g.N * g.C, g.N * g.C * OH * OW * g.KH * g.KW, [&](int64_t p) {
    const float* xp = x + p * H * W;
    float* yp = y + p * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t ih0 = oh * g.stride_h - g.pad_h;
      const int64_t count_h = conv_detail::padded_count(ih0, g.KH, g.dil_h, H, g.pad_h);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t iw0 = ow * g.stride_w - g.pad_w;
        const int64_t count = count_h * conv_detail::padded_count(iw0, g.KW, g.dil_w, W, g.pad_w);
        float s = 0.0f;
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          const int64_t ih = ih0 + kh * g.dil_h;
          if (ih < 0 || ih >= H) continue;
          const float* xr = xp + ih * W;
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const int64_t iw = iw0 + kw * g.dil_w;
            if (iw >= 0 && iw < W) s += xr[iw];
          }
        }
        yp[oh * OW + ow] = s / static_cast<float>(count);
      }
    }
  });
}

// dx[N,C,H,W] = the gradient of avg_pool2d given dy: zeros, then each dy / its
// window size (as avg_pool2d) added to every input position of its window.
// dx is overwritten.
inline void avg_pool2d_grad(const float* dy, float* dx, const Conv2dGeom& g) {
  const int64_t H = g.H, W = g.W, OH = g.OH, OW = g.OW;
  conv_detail::for_planes(g.N * g.C, g.N * g.C * OH * OW * g.KH * g.KW, [&](int64_t p) {
    const float* gp = dy + p * OH * OW;
    float* dxp = dx + p * H * W;
    std::fill(dxp, dxp + H * W, 0.0f);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t ih0 = oh * g.stride_h - g.pad_h;
      const int64_t count_h = conv_detail::padded_count(ih0, g.KH, g.dil_h, H, g.pad_h);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t iw0 = ow * g.stride_w - g.pad_w;
        const int64_t count = count_h * conv_detail::padded_count(iw0, g.KW, g.dil_w, W, g.pad_w);
        const float v = gp[oh * OW + ow] / static_cast<float>(count);
        for (int64_t kh = 0; kh < g.KH; ++kh) {
          const int64_t ih = ih0 + kh * g.dil_h;
          if (ih < 0 || ih >= H) continue;
          float* dr = dxp + ih * W;
          for (int64_t kw = 0; kw < g.KW; ++kw) {
            const int64_t iw = iw0 + kw * g.dil_w;
            if (iw >= 0 && iw < W) dr[iw] += v;
          }
        }
      }
    }
  });
}

// The adaptive window [start, end) of output position i of `out` over `size`
// input positions (PyTorch's adaptive pooling): floor(i*size/out) to
// ceil((i+1)*size/out).
inline int64_t adaptive_start(int64_t i, int64_t size, int64_t out) {
  return i * size / out;
}
inline int64_t adaptive_end(int64_t i, int64_t size, int64_t out) {
  return ((i + 1) * size + out - 1) / out;
}

// y[planes, OH, OW] = the mean of each adaptive window of x[planes, H, W]
// (adaptive_avg_pool2d).  y is overwritten.
inline void adaptive_avg_pool2d(const float* x, float* y, int64_t planes, int64_t H, int64_t W, int64_t OH,
                                int64_t OW) {
  conv_detail::for_planes(planes, planes * H * W, [&](int64_t p) {
    const float* xp = x + p * H * W;
    float* yp = y + p * OH * OW;
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
        float s = 0.0f;
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w)
            s += xp[h * W + w];
        yp[oh * OW + ow] = s / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
  });
}

// dx[planes, H, W] = the gradient of adaptive_avg_pool2d given dy: zeros, then
// each dy / its window's size added over its window.  dx is overwritten.
inline void adaptive_avg_pool2d_grad(const float* dy, float* dx, int64_t planes, int64_t H, int64_t W,
                                     int64_t OH, int64_t OW) {
  conv_detail::for_planes(planes, planes * H * W, [&](int64_t p) {
    const float* gp = dy + p * OH * OW;
    float* dxp = dx + p * H * W;
    std::fill(dxp, dxp + H * W, 0.0f);
    for (int64_t oh = 0; oh < OH; ++oh) {
      const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
      for (int64_t ow = 0; ow < OW; ++ow) {
        const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
        const float v = gp[oh * OW + ow] / static_cast<float>((h1 - h0) * (w1 - w0));
        for (int64_t h = h0; h < h1; ++h)
          for (int64_t w = w0; w < w1; ++w)
            dxp[h * W + w] += v;
      }
    }
  });
}

}  // namespace dg

#undef DG_CONV_SIMD
#undef DG_CONV_VEC
