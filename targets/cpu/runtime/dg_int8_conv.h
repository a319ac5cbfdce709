// dg_int8_conv.h: the convolutions of a model generated with --precision int8
// (one group; grouped and depthwise ones stay float32).
//
// A convolution is a product: output position p of an image is the row of its
// window's inputs (C*KH*KW values) times the weight's rows transposed. Here the
// rows are made channels-last:
//   1. the images of a product are quantized with the activation's static scale
//      (the zero padding quantizes to 0) into an int8 copy [H, W, C]
//      (quantize_channels_last: 16 x 16 register transposes, all the images'
//      blocks shared out over threads; without AVX-512, quantize_int8_span then
//      a byte transpose, an image at a time). With AMX, a 1x1 convolution of
//      stride 1 whose C is a multiple of 64 writes the copy straight into the
//      tiles' layout: its rows are the positions' channels;
//   2. an output position's row is its window's taps, tap after tap (kh outer,
//      kw inner), each tap the C channels of one input position: runs of
//      contiguous bytes (with dilation 1 a whole kernel row, KW * C bytes, is
//      one run), zeros where the window lies in the padding, then zeros to
//      quantize_int8's row length (int8_row_bytes(K)). A 1x1 convolution of
//      stride 1 reads the copy itself when C is a multiple of 4;
//   3. the rows of several images at once (up to kInt8ConvRowBytes: at small
//      planes one image has few rows, and each product reads the whole weight)
//      are multiplied by the Model's int8 weight (dg::KeptInt8Weight of
//      [O, C*KH*KW] packed with each row's k in the same channels-last order,
//      dg_int8_weights.h) with dg::matmul_int8 (AMX, VNNI, AVX2 or portable);
//   4. the [positions, O] result is written into the output planes with the bias
//      (to_planes: a transposition; with AMX the tiles' sums are written so
//      directly, int8_store16_planes), and for conv2d_batch_norm_int8 batch
//      norm's normalization, the residual and relu on each block as it is written.
// The int32 sums are exact, whatever the order of k; the float32 steps are those of
// ops/quantize_conv.py's reference, in the same order (bit for bit).
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

// The bytes of workspace one product of conv2d_int8 takes at most: its images'
// int8 copy and their rows (several images at small planes; one image, however
// large). The rows stay in the L2 cache while the weight's column blocks pass by
// (ResNet-18 at 64x64, AMX, 1 thread: rows of about 1 MB were best); the copy is
// read once, as the rows are made.
constexpr int64_t kInt8ConvScratchBytes = int64_t(2) << 20;

// Bytes rounded up to whole 64-byte lines (the workspace's pieces start on them).
inline int64_t int8_lines(int64_t bytes) {
  return (bytes + 63) / 64 * 64;
}

// The bytes of workspace a product of `images` images takes (K = C*KH*KW): their
// int8 copy (channels last), then their rows: in AMX tiles' layout (tiles), or
// else as rows and their float32 product, a space that first holds one image's
// quantized planes (the copy's first step without AVX-512).
inline int64_t conv2d_int8_bytes(const Conv2dGeom& g, int64_t K, int64_t images, bool tiles) {
  const int64_t M = images * g.OH * g.OW, copy = int8_lines(images * g.H * g.W * g.C);
  if (tiles) return copy + (M + 15) / 16 * 16 * ((K + 63) / 64) * 64;
  return copy + std::max(int8_lines(M * int8_row_bytes(K)) + M * g.O * static_cast<int64_t>(sizeof(float)),
                         g.C * g.H * g.W);
}

// The images one product takes at most: as many as keep conv2d_int8_bytes within
// kInt8ConvScratchBytes, at least one (fewer where the batch is smaller).
inline int64_t conv2d_int8_images(const Conv2dGeom& g, int64_t K, bool tiles) {
  const int64_t OHW = g.OH * g.OW;
  const int64_t each =
      g.H * g.W * g.C + (tiles ? OHW * ((K + 63) / 64) * 64
                               : OHW * (int8_row_bytes(K) + g.O * static_cast<int64_t>(sizeof(float))));
  int64_t n = std::max<int64_t>(1, kInt8ConvScratchBytes / std::max<int64_t>(1, each));
  while (n > 1 && conv2d_int8_bytes(g, K, n, tiles) > kInt8ConvScratchBytes)  // (the rounding)
    --n;
  return n;
}

// The workspace conv2d_int8 takes, in floats: the larger of its two layouts'
// (conv2d_int8_bytes at conv2d_int8_images), and up to 63 bytes before them to
// start them on a cache line (an arena's values start on any float; a tile's
// 64-byte rows must not straddle two lines). The generator reserves it in the
// arena, so the memory plan counts it (ops/quantize_conv.py int8_conv_workspace
// computes the same number).
inline int64_t conv2d_int8_workspace(const Conv2dGeom& g, int64_t K) {
  const int64_t tiles = conv2d_int8_bytes(g, K, conv2d_int8_images(g, K, true), true);
  const int64_t rows = conv2d_int8_bytes(g, K, conv2d_int8_images(g, K, false), false);
  return (63 + std::max(tiles, rows) + 3) / 4;
}

// An int8 convolution's output handed to the int8 convolution that reads it, and
// nothing else does, already quantized as that one would quantize it: the images
// [N][OH*OW][O] channels last, quantize(y, *scale) (the reader's input scale,
// named scale_name in errors), in an arena piece. The reader then neither reads
// the float32 output nor quantizes it (ops/quantize_conv.py, handed_over). data
// null: no such output.
struct Int8ChannelsLast {
  int8_t* data = nullptr;
  const float* scale = nullptr;
  const char* scale_name = "";
};

// The input of an int8 convolution as such an output: quantized, channels last.
struct Int8ChannelsLastIn {
  const int8_t* data;
};

namespace int8_conv_detail {

// to[p * ld + k] = from[k * P + p] for k < K, p < P (bytes): the quantized column
// matrix [K, P] as rows of output positions. With AVX-512 VBMI, four k rows of 16
// positions at a time: one 64-byte permute puts each position's four bytes side by
// side, one scatter writes them into 16 rows (a byte at a time: ~4x the time).
// (The insert and the permute are written as their zero-masking forms with every
// lane set: GCC 12 warns of the plain forms' undefined operand.)
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
      const __m512i four = _mm512_maskz_inserti64x4(
          static_cast<__mmask8>(0xff),
          _mm512_castsi256_si512(_mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + P)),
                                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(at)))),
          _mm256_set_m128i(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 3 * P)),
                           _mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 2 * P))),
          1);
      _mm512_i32scatter_epi32(to + p0 * ld + k0, rows,
                              _mm512_maskz_permutexvar_epi8(~__mmask64(0), order, four), 1);
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

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// The images x[count][C][HW] quantized with inv (quantize_int8_span's arithmetic
// on every value) channels last: position p of image i's channels [c0, c0 + 16)
// are the 16 bytes at at(i * HW + p, c0) (those past C not stored). 16 channels
// x 16 positions at a time: 16 plane rows read, transposed in registers
// (gemm_detail::transpose_16x16), each position's channels quantized and stored
// at once. One pass over the chunk's images, blocks shared out over threads (the
// quantization of a plane and then a byte transpose, one image after the other,
// were a quarter of an int8 ResNet-50's time at batch 64 and ran on one thread).
template <class At>
inline void quantize_channels_last(const float* x, int64_t count, int64_t C, int64_t HW, float inv,
                                   const At& at) {
  const int64_t pblocks = (HW + 15) / 16, cblocks = (C + 15) / 16, blocks = count * cblocks * pblocks;
  const int threads = threads_for(conv_detail::kCopyWork * count * C * HW);
  const __m512 inv512 = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-float(kInt8ActivationMax)),
               hi = _mm512_set1_ps(float(kInt8ActivationMax));
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
  (void)threads;
#endif
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const int64_t i = blk / (cblocks * pblocks), c0 = blk / pblocks % cblocks * 16, p0 = blk % pblocks * 16;
    const int64_t channels = std::min<int64_t>(16, C - c0), positions = std::min<int64_t>(16, HW - p0);
    const __mmask16 cmask = static_cast<__mmask16>((1u << channels) - 1u);
    const __mmask16 pmask = static_cast<__mmask16>((1u << positions) - 1u);
    const float* from = x + (i * C + c0) * HW + p0;
    __m512 r[16];
    if (channels == 16) {  // (every plane read: the registers stay registers)
      for (int64_t c = 0; c < 16; ++c) {
        r[c] = _mm512_maskz_loadu_ps(pmask, from + c * HW);
        _mm_prefetch(reinterpret_cast<const char*>(from + c * HW + 64), _MM_HINT_T0);  // 4 blocks on
      }
    } else {
      for (int64_t c = 0; c < 16; ++c)
        r[c] = c < channels ? _mm512_maskz_loadu_ps(pmask, from + c * HW) : _mm512_setzero_ps();
    }
    gemm_detail::transpose_16x16(r);
    for (int64_t q = 0; q < 16; ++q) {  // as quantize_int8_span
      if (q == positions) break;
      _mm_mask_storeu_epi8(at(i * HW + p0 + q, c0), cmask, quantize_int8_x16(r[q], inv512, lo, hi));
    }
  }
}
#endif

// out[i][HW][C] = the images y[i][C][HW] (count of them) quantized with inv and
// made channels last: what conv2d_int8 makes of its input (the same bytes).
inline void quantize_images_channels_last(const float* y, int64_t count, int64_t C, int64_t HW, float inv,
                                          int8_t* out) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  quantize_channels_last(y, count, C, HW, inv, [out, C](int64_t r, int64_t c0) { return out + r * C + c0; });
#else
  std::vector<int8_t> planes(static_cast<size_t>(C * HW));
  for (int64_t i = 0; i < count; ++i) {
    quantize_int8_span(y + i * C * HW, planes.data(), inv, C * HW, kInt8ActivationMax);
    transpose(planes.data(), C, HW, out + i * HW * C, C);
  }
#endif
}

// The channel epilogue of a convolution whose output is handed over quantized
// (Int8ChannelsLast): with AMX the product's sums are scaled, given the bias and
// the batch norm's normalization and relu (norm, NormalizeEpilogue::in_columns:
// an output position's 16 channels at once, the arithmetic of in_register lane by
// lane) and quantized (quantize_int8_x16) straight into out's rows, the float32
// output left unwritten; other paths write the planes with norm (operator()),
// then quantize them into out (quantize_images_channels_last): the same bytes.
template <class Norm>
struct ChannelsLastInt8 {
  static constexpr bool kChannelsLastInt8 = true;
  const Norm& norm;
  int8_t* out;  // the rows of the convolution's images (for_images: of the product's)
  int64_t O;
  float inv;
  void operator()(int64_t o, float* c, int64_t n) const { norm(o, c, n); }
#if defined(__AVX512F__)
  __m512 in_register(int64_t o, __m512 v, const float* c, __mmask16 lanes) const {
    return norm.in_register(o, v, c, lanes);
  }
#endif
  ChannelsLastInt8 for_images(int64_t first_row) const { return {norm, out + first_row * O, O, inv}; }
#if DG_INT8_AMX
  // The 16 x 16 block of sums (row r at sums + r * ld: product rows i0 + r, columns
  // j..j + cols), as int8_store16_planes scales it, into out's rows.
  void store(const int32_t* sums, int64_t ld, __m512 scale, const float* bias, int64_t i0, int64_t rows,
             int64_t j, int64_t cols) const {
    const __mmask16 lanes = static_cast<__mmask16>(cols == 16 ? 0xffffu : (1u << cols) - 1u);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(lanes, bias + j) : _mm512_setzero_ps();
    const __m512 inv512 = _mm512_set1_ps(inv), lo = _mm512_set1_ps(-float(kInt8ActivationMax)),
                 hi = _mm512_set1_ps(float(kInt8ActivationMax));
    const __mmask16 all = 0xffff;
    for (int64_t r = 0; r < rows; ++r) {
      // (the zero-masking multiply: a plain one would be fused with the bias add or the
      // normalization's subtraction, rounding once where the planes' store rounds twice)
      __m512 v =
          _mm512_maskz_mul_ps(all, _mm512_maskz_cvtepi32_ps(all, _mm512_loadu_si512(sums + r * ld)), scale);
      if (bias != nullptr) v = _mm512_add_ps(v, b);
      _mm_mask_storeu_epi8(out + (i0 + r) * O + j, lanes,
                           quantize_int8_x16(norm.in_columns(j, v, lanes), inv512, lo, hi));
    }
  }
#endif
};

// The epilogue a product of the images from row first_row (of positions) takes:
// epi itself, or a ChannelsLastInt8 moved to those images' rows.
template <class Epi>
inline const Epi& for_images(const Epi& epi, int64_t) {
  return epi;
}
template <class Norm>
inline ChannelsLastInt8<Norm> for_images(const ChannelsLastInt8<Norm>& epi, int64_t first_row) {
  return epi.for_images(first_row);
}

// A buffer of the calling thread that only grows: its bytes are all written before
// they are read, so they are never zeroed per call.
template <typename T>
inline T* grown(std::vector<T>& buffer, int64_t n) {
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// to[0..n) = from[0..n), or zeros where from is null: with AVX-512 BW, 64 bytes
// at a time and a masked last piece (a memcpy call costs more than a run of a
// few dozen bytes).
inline void copy_run(const int8_t* from, int8_t* to, int64_t n) {
#if defined(__AVX512BW__)
  const __m512i zero = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    _mm512_storeu_si512(to + i, from != nullptr ? _mm512_loadu_si512(from + i) : zero);
  if (i < n) {
    const __mmask64 rest = _cvtu64_mask64(~uint64_t(0) >> (64 - (n - i)));
    _mm512_mask_storeu_epi8(to + i, rest, from != nullptr ? _mm512_maskz_loadu_epi8(rest, from + i) : zero);
  }
#else
  if (from != nullptr)
    std::memcpy(to, from, static_cast<size_t>(n));
  else
    std::memset(to, 0, static_cast<size_t>(n));
#endif
}

// Where window_row writes a row: put(from, at, n) writes bytes [at, at + n) of
// the row (from[0, n), or zeros where from is null). Linear: a row of lda bytes
// at `row`; Tiled: a row of int8_amx_tiles' layout (its byte k at row + (k / 64)
// * 1024 + k % 64), written where the tiles read it, in pieces that end at tile
// edges (a line of whole k tiles, then its 64-byte pieces copied there, was a
// tenth of an int8 ResNet-18's time at batch 64).
struct LinearRow {
  int8_t* row;
  void operator()(const int8_t* from, int64_t at, int64_t n) const { copy_run(from, row + at, n); }
};
struct TiledRow {
  int8_t* row;
  void operator()(const int8_t* from, int64_t at, int64_t n) const {
    while (n > 0) {
      const int64_t in = at % 64, len = std::min(n, 64 - in);
      copy_run(from, row + at / 64 * 1024 + in, len);
      if (from != nullptr) from += len;
      at += len;
      n -= len;
    }
  }
};

// Bytes [0, lda) of a row (put: LinearRow or TiledRow) = output position (oh,
// ow)'s window of xq (one image [H, W, C]): the taps in order, C bytes each
// (zeros where the tap is in the padding), then zeros. Neighbouring taps whose
// bytes lie side by side in xq (or which are both padding) are one run.
// (window_row_runs: any dilation; window_row below.)
template <class Put>
inline void window_row_runs(const int8_t* xq, const std::vector<conv_detail::Tap>& taps, int64_t oh,
                            int64_t ow, const Put& put, int64_t lda, const Conv2dGeom& g) {
  const int64_t C = g.C;
  const int8_t* from = nullptr;  // the pending run: from (null: zeros), to bytes [at, at + n)
  int64_t at = 0, n = 0;
  for (size_t t = 0; t < taps.size(); ++t) {
    const conv_detail::Tap& p = taps[t];
    const bool inside = oh >= p.oh_lo && oh < p.oh_hi && ow >= p.ow_lo && ow < p.ow_hi;
    const int8_t* src =
        inside ? xq + ((oh * g.stride_h + p.off_h) * g.W + ow * g.stride_w + p.off_w) * C : nullptr;
    if (n > 0 && (src == nullptr ? from == nullptr : from != nullptr && src == from + n)) {
      n += C;
      continue;
    }
    if (n > 0) put(from, at, n);
    from = src;
    at = static_cast<int64_t>(t) * C;
    n = C;
  }
  if (from == nullptr) n = lda - at;  // the padding after K with the last zeros
  put(from, at, n);
  if (from != nullptr && at + n < lda) put(nullptr, at + n, lda - at - n);
}

// window_row_runs where the kernel's columns are next to each other (dilation 1 in
// width): a kernel row's taps inside the input are one run of bytes, so the row
// is KH runs with the zeros around them, found without going through the taps
// (which cost as much as the copies at 3 x 3 kernels).
template <class Put>
inline void window_row(const int8_t* xq, const std::vector<conv_detail::Tap>& taps, int64_t oh, int64_t ow,
                       const Put& put, int64_t lda, const Conv2dGeom& g) {
  if (g.dil_w != 1) {
    window_row_runs(xq, taps, oh, ow, put, lda, g);
    return;
  }
  const int64_t C = g.C, KW = g.KW, run = KW * C, iw = ow * g.stride_w - g.pad_w;
  const int64_t lo = std::min(KW, std::max<int64_t>(0, -iw)), hi = std::max(lo, std::min(KW, g.W - iw));
  for (int64_t kh = 0; kh < g.KH; ++kh) {
    const int64_t ih = oh * g.stride_h - g.pad_h + kh * g.dil_h, out = kh * run;
    if (ih < 0 || ih >= g.H || lo == hi) {
      put(nullptr, out, run);
      continue;
    }
    if (lo > 0) put(nullptr, out, lo * C);
    put(xq + (ih * g.W + iw + lo) * C, out + lo * C, (hi - lo) * C);
    if (hi < KW) put(nullptr, out + hi * C, (KW - hi) * C);
  }
  if (g.KH * run < lda) put(nullptr, g.KH * run, lda - g.KH * run);
}

// y[o * P + p] = from[p * O + o] (+ b[o]): the product's rows (P positions of O
// channels) as the image's O output planes, each run of a channel's values given
// the channel epilogue epi (dg_conv.h's conv2d_with) as it is written. With
// AVX-512, 16 positions x 16 channels at a time (16 loads,
// gemm_detail::transpose_16x16, 16 stores through int8_store_run); the rest by
// blocks of 16 positions, which stay in the L1 cache while every channel reads
// them (read a channel at a time over all positions, the rows missed the cache:
// ~15% of an int8 ResNet-18's time).
template <class Epi>
inline void to_planes(const float* from, int64_t P, int64_t O, const float* b, float* y, const Epi& epi) {
  int64_t p0 = 0;
#if defined(__AVX512F__)
  for (; p0 + 16 <= P; p0 += 16) {
    int64_t o0 = 0;
    for (; o0 + 16 <= O; o0 += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_loadu_ps(from + (p0 + i) * O + o0);
      gemm_detail::transpose_16x16(r);
      for (int i = 0; i < 16; ++i)
        int8_store_run(epi, o0 + i, b != nullptr ? _mm512_add_ps(r[i], _mm512_set1_ps(b[o0 + i])) : r[i],
                       y + (o0 + i) * P + p0, static_cast<__mmask16>(0xffff), 16);
    }
    for (; o0 < O; ++o0) {
      for (int64_t p = p0; p < p0 + 16; ++p)
        y[o0 * P + p] = b != nullptr ? from[p * O + o0] + b[o0] : from[p * O + o0];
      epi(o0, y + o0 * P + p0, 16);
    }
  }
#endif
  for (; p0 < P; p0 += 16) {
    const int64_t p1 = std::min(P, p0 + 16);
    for (int64_t o = 0; o < O; ++o) {
      float* plane = y + o * P;
      if (b != nullptr) {
        const float v = b[o];
        for (int64_t p = p0; p < p1; ++p)
          plane[p] = from[p * O + o] + v;
      } else {
        for (int64_t p = p0; p < p1; ++p)
          plane[p] = from[p * O + o];
      }
      epi(o, plane + p0, p1 - p0);
    }
  }
}

// The images of a product and the bytes of workspace it takes when each of
// `threads` threads makes its own products (image_parallel): as many images as keep
// both layouts (tiles, and rows for a last product too small for them) within the
// thread's share of kInt8ConvScratchBytes, at least one; then fewer, the same in
// every product, so that each thread makes as many products (rounds) as the others.
struct ImageShare {
  int64_t images, bytes;
};
inline ImageShare image_share(const Conv2dGeom& g, int64_t K, int threads) {
  const int64_t budget = kInt8ConvScratchBytes / threads / 64 * 64 - 64;
  const auto bytes = [&](int64_t n) {
    return int8_lines(std::max(conv2d_int8_bytes(g, K, n, true), conv2d_int8_bytes(g, K, n, false)));
  };
  int64_t n = 1;
  while (n < g.N && bytes(n + 1) <= budget)
    ++n;
  const int64_t rounds = (g.N + threads * n - 1) / (threads * n);
  n = (g.N + threads * rounds - 1) / (threads * rounds);
  return {n, bytes(n)};
}

// conv2d_int8 (below) with the channel epilogue epi (dg_conv.h's conv2d_with): run
// on each run of a channel's values as the output planes are written, while they
// are in registers (int8_store16_planes, to_planes).
//
// Threads: where there are at least as many images as threads, each thread makes
// the products of its own images start to end (the copy, the rows, the product
// and the output, one thread each), in its share of the workspace: no thread
// waits for another until the convolution ends. Sharing out each step of every
// product instead (the copy's blocks, the rows, the weight's column blocks) made
// the threads wait at three joins a product: a sixth of the time of two threads
// on an int8 ResNet-18 at batch 64 was spent waiting. One image (or fewer images
// than threads, or a workspace too small for a share each): each step shared out.
//
// x_q: the input already quantized channels last (Int8ChannelsLastIn), or null:
// then x is quantized here.
template <class Epi>
void conv2d_int8_with(const float* x, const int8_t* x_q, const float* x_scale, const KeptInt8Weight& w,
                      const float* b, float* y, float* ws, const Conv2dGeom& g, const char* scale_name,
                      const Epi& epi) {
  if (g.groups != 1) throw std::logic_error("dg::conv2d_int8: one group only (the generator's rule)");
  check_int8_scales(x_scale, 1, scale_name);
  if (g.N <= 0) return;
  const std::shared_ptr<const Int8PackedB> packed = w.use();
  const int64_t C = g.C, HW = g.H * g.W, OHW = g.OH * g.OW, K = packed->K, lda = int8_row_bytes(K), O = g.O;
  const float inv = 1.0f / x_scale[0];  // as quantize_int8 computes it
#if DG_INT8_AMX
  const bool amx = amx_ready();
#else
  const bool amx = false;
#endif
  // images a product: as many as conv2d_int8_images gives the tiles (AMX) or the rows
  const int64_t tiled = std::min(g.N, conv2d_int8_images(g, K, true));
  const int64_t rowed = std::min(g.N, conv2d_int8_images(g, K, false));
  const bool own_rows = g.pointwise() && lda == C;  // the channels-last copy is the rows
  // The buffers: in the workspace (ws, or a thread's share of it) as conv2d_int8_bytes
  // lays them out (the copy of `count` images, then from the next line the tiles, or
  // the planes, or the rows and the product), or where ws is null the calling
  // thread's own, grown once.
  static thread_local std::vector<int8_t> plane_buffer, copy_buffer, row_buffer, tile_buffer;
  static thread_local std::vector<float> product_buffer;
  int8_t* const scratch =  // (its first cache line)
      ws != nullptr ? reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(ws) + 63) / 64 * 64) : nullptr;
  const std::vector<conv_detail::Tap> taps = conv_detail::taps_of(g);
  // One product: images [n0, n0 + count) (fewer where a last product has too few rows
  // for the tiles: it returns the images it did), its buffers at part (null: the
  // thread's own). Each step shares itself out over threads where it is called
  // outside a parallel region (threads_for).
  const auto product_of = [&](int64_t n0, int64_t count, int8_t* part) -> int64_t {
    int8_t* const copy =
        part != nullptr ? part : grown(copy_buffer, x_q != nullptr ? 0 : std::max(tiled, rowed) * HW * C);
    const int8_t* const xq = x_q != nullptr ? x_q + n0 * HW * C : copy;
    const auto second = [&](int64_t n) { return part + int8_lines(n * HW * C); };
    const auto& chunk_epi = for_images(epi, n0 * OHW);  // (with AMX)
    (void)chunk_epi;
    // xq = images [n0, n0 + n) quantized, channels last (unless handed over so)
    const auto to_copy = [&](int64_t n) {
      if (x_q != nullptr) return;
#if defined(__AVX512BW__) && defined(__AVX512VL__)
      quantize_channels_last(x + n0 * C * HW, n, C, HW, inv,
                             [copy, C](int64_t r, int64_t c0) { return copy + r * C + c0; });
#else
      int8_t* planes = part != nullptr ? second(n) : grown(plane_buffer, C * HW);
      for (int64_t i = 0; i < n; ++i) {
        quantize_int8_span(x + (n0 + i) * C * HW, planes, inv, C * HW, kInt8ActivationMax);  // vectorized
        transpose(planes, C, HW, copy + i * HW * C, C);
      }
#endif
    };
    int64_t M = count * OHW;
#if DG_INT8_AMX
    if (amx && int8_amx_used(M)) {
      // the rows made where matmul_int8_tiles reads them (int8_amx_tiles' layout)
      const int64_t ktiles = int8_amx_ktiles(K), rows_in_tiles = (M + 15) / 16 * 16;
      int8_t* tiles = part != nullptr ? second(count) : grown(tile_buffer, rows_in_tiles * ktiles * 64);
      const auto tile_row = [tiles, ktiles](int64_t r) {
        return tiles + ((r / 16) * ktiles * 16 + r % 16) * 64;
      };
#if defined(__AVX512BW__) && defined(__AVX512VL__)
      if (x_q == nullptr && g.pointwise() &&
          C % 64 == 0) {  // a position's channels are its row: into the tiles
        quantize_channels_last(x + n0 * C * HW, count, C, HW, inv, [&tile_row](int64_t r, int64_t c0) {
          return tile_row(r) + c0 / 64 * 1024 + c0 % 64;
        });
        for (int64_t r = M; r < rows_in_tiles; ++r)
          for (int64_t t = 0; t < ktiles; ++t)
            _mm512_storeu_si512(tile_row(r) + t * 1024, _mm512_setzero_si512());
        matmul_int8_tiles(tiles, x_scale, *packed, y + n0 * O * OHW, M, /*plane=*/OHW, b, chunk_epi);
        return count;
      }
#endif
      // else each row made where the tiles read it (TiledRow), the rows past M zeros
      to_copy(count);
      const int threads = threads_for(conv_detail::kCopyWork * M * K);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
      (void)threads;
#endif
      for (int64_t r = 0; r < rows_in_tiles; ++r) {
        if (r < M) {
          window_row(xq + r / OHW * HW * C, taps, r % OHW / g.OW, r % OHW % g.OW, TiledRow{tile_row(r)},
                     ktiles * 64, g);
          continue;
        }
        for (int64_t t = 0; t < ktiles; ++t)
          _mm512_storeu_si512(tile_row(r) + t * 1024, _mm512_setzero_si512());
      }
      matmul_int8_tiles(tiles, x_scale, *packed, y + n0 * O * OHW, M, /*plane=*/OHW, b, chunk_epi);
      return count;
    }
#endif
    count = std::min(count, rowed);  // (a last product of too few rows for the tiles)
    M = count * OHW;
    to_copy(count);
    int8_t* made = own_rows ? nullptr : part != nullptr ? second(count) : grown(row_buffer, M * lda);
    const int8_t* rows = own_rows ? xq : made;
    if (!own_rows) {
      const int threads = threads_for(conv_detail::kCopyWork * M * K);
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
#else
      (void)threads;
#endif
      for (int64_t r = 0; r < M; ++r) {
        const int64_t i = r / OHW, p = r % OHW;
        window_row(xq + i * HW * C, taps, p / g.OW, p % g.OW, LinearRow{made + r * lda}, lda, g);
      }
    }
    float* product = part != nullptr ? reinterpret_cast<float*>(second(count) + int8_lines(M * lda))
                                     : grown(product_buffer, M * O);
    matmul_int8(rows, x_scale, *packed, product, M);
    for (int64_t i = 0; i < count; ++i)
      to_planes(product + i * OHW * O, OHW, O, b, y + (n0 + i) * O * OHW, epi);
    if constexpr (int8_channels_last<Epi>::value)  // the planes just written, quantized for the reader
      quantize_images_channels_last(y + n0 * O * OHW, count, O, OHW, epi.inv, epi.out + n0 * OHW * O);
    return count;
  };
#ifdef _OPENMP
  // a thread's own products where each thread has images and a share of the workspace
  const int threads = threads_for(2 * g.N * OHW * K * O);
  if (threads > 1 && g.N >= threads) {
    const ImageShare share = image_share(g, K, threads);
    const int64_t whole = conv2d_int8_workspace(g, K) * 4 - 63;  // the bytes from ws's first cache line
    if (scratch == nullptr || threads * share.bytes <= whole) {
      const int64_t products = (g.N + share.images - 1) / share.images;
#pragma omp parallel for num_threads(threads) schedule(static)
      for (int64_t q = 0; q < products; ++q) {
        int8_t* part = scratch != nullptr ? scratch + omp_get_thread_num() * share.bytes : nullptr;
        const int64_t n0 = q * share.images, count = std::min(share.images, g.N - n0);
        for (int64_t done = 0; done < count;)
          done += product_of(n0 + done, count - done, part);
      }
      return;
    }
  }
#endif
  for (int64_t n0 = 0; n0 < g.N;)
    n0 += product_of(n0, std::min(amx ? tiled : rowed, g.N - n0), scratch);
}

}  // namespace int8_conv_detail

// y[N, O, OH, OW] = conv2d(x, w) (+ b) in int8: x quantized with x_scale[0]
// (named scale_name in errors), w the Model's kept int8 weight (packed
// channels-last: taps = KH * KW). ws: conv2d_int8_workspace(g, C*KH*KW) floats,
// or null (then buffers of the calling thread, grown once and kept).
inline void conv2d_int8(const float* x, const float* x_scale, const KeptInt8Weight& w, const float* b,
                        float* y, float* ws, const Conv2dGeom& g, const char* scale_name) {
  int8_conv_detail::conv2d_int8_with(x, nullptr, x_scale, w, b, y, ws, g, scale_name,
                                     conv_detail::NoChannelEpilogue());
}

namespace int8_conv_detail {

// conv2d_batch_norm_int8 (below) of x, or of x_q where it is not null (the input
// handed over quantized); where out.data is set, its output handed over too: in
// evaluation mode without a residual written there only (ChannelsLastInt8: y is
// not written), else y as always, then quantized into out.
inline void conv2d_batch_norm_int8_of(const float* x, const int8_t* x_q, const float* x_scale,
                                      const KeptInt8Weight& w, const float* b, const float* bn_w,
                                      const float* bn_b, float* running_mean, float* running_var,
                                      const float* residual, float* y, float* mean, float* invstd, float* ws,
                                      const Conv2dGeom& g, const char* scale_name, float eps, float momentum,
                                      bool relu, const Mode& mode, const char* what,
                                      const Int8ChannelsLast& out) {
  const auto run = [&](const auto& epi) {
    conv2d_int8_with(x, x_q, x_scale, w, b, y, ws, g, scale_name, epi);
  };
  if (out.data == nullptr) {
    conv_detail::batch_norm_after(run, bn_w, bn_b, running_mean, running_var, residual, y, mean, invstd, g,
                                  eps, momentum, relu, mode, what);
    return;
  }
  check_int8_scales(out.scale, 1, out.scale_name);
  const float inv = 1.0f / out.scale[0];  // as the reader computes it
  if (!mode.training && residual == nullptr) {
    batch_norm_eval_statistics(running_mean, running_var, mean, invstd, g.O, eps);
    const conv_detail::NormalizeEpilogue norm{mean, invstd, bn_w, bn_b, nullptr, y, relu};
    run(ChannelsLastInt8<conv_detail::NormalizeEpilogue>{norm, out.data, g.O, inv});
    return;
  }
  conv_detail::batch_norm_after(run, bn_w, bn_b, running_mean, running_var, residual, y, mean, invstd, g, eps,
                                momentum, relu, mode, what);
  quantize_images_channels_last(y, g.N, g.O, g.OH * g.OW, inv, out.data);
}

}  // namespace int8_conv_detail

// y = batch_norm(conv2d_int8(x, w, b)) with batch norm's weight bn_w, bias bn_b and
// running statistics, then residual and relu: dg::conv2d_batch_norm (dg_conv.h)
// with the convolution of conv2d_int8. In evaluation mode the normalization,
// residual and relu run on each output block as the product stores it (in its
// registers: NormalizeEpilogue::in_register), with batch norm's arithmetic: the
// same values as conv2d_int8, then dg::batch_norm and the add and relu kernels.
// In training mode conv2d_int8 into y, then batch norm, residual and relu in place.
// out: the output also handed over, quantized for the one int8 convolution that
// reads it (Int8ChannelsLast; in evaluation mode without a residual, only there).
inline void conv2d_batch_norm_int8(const float* x, const float* x_scale, const KeptInt8Weight& w,
                                   const float* b, const float* bn_w, const float* bn_b, float* running_mean,
                                   float* running_var, const float* residual, float* y, float* mean,
                                   float* invstd, float* ws, const Conv2dGeom& g, const char* scale_name,
                                   float eps, float momentum, bool relu, const Mode& mode, const char* what,
                                   const Int8ChannelsLast& out = Int8ChannelsLast()) {
  int8_conv_detail::conv2d_batch_norm_int8_of(x, nullptr, x_scale, w, b, bn_w, bn_b, running_mean,
                                              running_var, residual, y, mean, invstd, ws, g, scale_name, eps,
                                              momentum, relu, mode, what, out);
}

// conv2d_batch_norm_int8 of an input handed over quantized by the convolution that
// made it (x_scale is the scale it was quantized with).
inline void conv2d_batch_norm_int8(const Int8ChannelsLastIn& x, const float* x_scale, const KeptInt8Weight& w,
                                   const float* b, const float* bn_w, const float* bn_b, float* running_mean,
                                   float* running_var, const float* residual, float* y, float* mean,
                                   float* invstd, float* ws, const Conv2dGeom& g, const char* scale_name,
                                   float eps, float momentum, bool relu, const Mode& mode, const char* what,
                                   const Int8ChannelsLast& out = Int8ChannelsLast()) {
  int8_conv_detail::conv2d_batch_norm_int8_of(nullptr, x.data, x_scale, w, b, bn_w, bn_b, running_mean,
                                              running_var, residual, y, mean, invstd, ws, g, scale_name, eps,
                                              momentum, relu, mode, what, out);
}

}  // namespace dg
