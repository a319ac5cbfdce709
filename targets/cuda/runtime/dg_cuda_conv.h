// dg_cuda_conv.h: 2-D convolution and pooling on the GPU (NCHW layout).
//
// Same names and arguments as the CPU runtime (dg_conv.h), so lowered code is
// the same for both targets; every float pointer here is a device pointer, the
// geometry (Conv2dGeom) stays on the host and travels to kernels by value.
// Tensors are dense row-major float arrays as in PyTorch: x[N, C, H, W],
// w[O, C/groups, KH, KW], y[N, O, OH, OW]. The caller has checked the shapes.
//
// Convolutions are implicit GEMMs: the column matrix (im2col) is never stored,
// each operand element is computed where a tile of it is loaded. Per group g,
// with Cg = C/groups, Og = O/groups, KK = KH*KW:
//   forward      y[n, g*Og+o, p]      = sum over k = (c, kh, kw) of w[g*Og+o, k] * xcol[k, (n, p)]
//                  M = Og, N = images*OH*OW, K = Cg*KK (bias added at the store)
//   grad_input   dx[n, g*Cg+c, q]     = sum over k = (o, kh, kw) of w[g*Og+o, c, kh, kw] * dycol[k, (n, q)]
//                  M = Cg, N = images*H*W, K = Og*KK; dycol is dy at the output position that
//                  read x at q through tap (kh, kw), or 0 (a gather: no atomics)
//   grad_weight  dw[g*Og+o, (c,kh,kw)] = sum over k = (n, p) of dy[n, g*Og+o, p] * xcol[(c,kh,kw), k]
//                  M = Og, N = Cg*KK, K = images*OH*OW, split along K into slices whose
//                  partial sums go to the workspace and are then added in a fixed order
// One tile kernel (ConvTiles, below) runs all three: the tiled SGEMM of
// dg_cuda_gemm.h (a 64x64 tile of the output per block of 256 threads, 4x4 per
// thread, steps of 16 along K through shared memory), with the operands read
// through a problem's accessors. Each thread decodes the rows and columns it
// loads once per block. Written as phases of one thread between barriers, so the
// CPU emulation runs the very same tile code thread by thread.
//
// Convolutions with few rows per group for the tile (depthwise: Og == 1) run
// direct per-element lambdas instead: each output element sums its own window.
//
// Pools are one lambda per output (forward) or per input element (gradient:
// a gather over the windows that contain it; max pooling's first-maximum rule
// is checked by rescanning each window), so nothing needs atomics.
//
// Every result is a fixed sequence of float operations chosen by the geometry
// alone (not the device): runs repeat bit for bit. Workspace: the caller passes
// conv2d_workspace / conv2d_grad_weight_workspace floats (the CPU runtime's
// im2col sizes); only conv2d_grad_weight uses it (for its K-slice partials,
// as many slices as fit); nothing is allocated here.
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_conv_geom.h"  // after dg_cuda_compat.h: it reads DG_HD
#include "dg_cuda_launch.h"
#include "dg_cuda_modes.h"

namespace dg {

// Floats of workspace for conv2d_grad_weight: the column matrix plus one group's
// weight gradient, (O/groups) x (C/groups)*KH*KW: room for the K slices' partial
// weight gradients (target.json: "weight_grad_partials").
inline int64_t conv2d_grad_weight_workspace(const Conv2dGeom& g) {
  return conv2d_workspace(g) + (g.O / g.groups) * (g.C / g.groups) * g.KH * g.KW;
}

namespace conv_detail {

// ---------------------------------------------------------------- the tile kernel

constexpr int BM = 64, BN = 64, BK = 16;  // the block's tile of the output, and its step along K
constexpr int TM = 4, TN = 4;             // each thread's piece of the tile
constexpr int PAD = 4;                    // shared-memory row padding against bank conflicts
constexpr int kTileThreads = (BM / TM) * (BN / TN);
constexpr int kLoads = BK * BM / kTileThreads;  // elements of each operand a thread loads per step
static_assert(BM == BN && BK * BN / kTileThreads == kLoads, "both operand tiles load alike");
static_assert(kTileThreads % BM == 0 && kTileThreads % BK == 0, "a thread loads the same rows in every step");

// Where load j of thread t goes in a [BK][BM] operand tile: (row or column mn,
// step offset kk). KFast: consecutive threads take consecutive k (the operand
// is contiguous along K), else consecutive rows or columns. Either way a
// thread's mn are the same in every step, so their decoding is done once.
template <bool KFast>
DG_HD inline void load_slot(int t, int j, int& mn, int& kk) {
  const int e = t + j * kTileThreads;
  if (KFast) {
    kk = e % BK;
    mn = e / BK;
  } else {
    mn = e % BM;
    kk = e / BM;
  }
}

// One thread's registers in the tile kernel: its sums and its decoded rows of A
// and columns of B.
template <typename P>
struct TileState {
  float acc[TM][TN];
  typename P::ARow a[kLoads];
  typename P::BCol b[kLoads];
};

// out = A[M, K] @ B[K, N] per group (and K slice), A and B read through P:
//   P::M, N, K, groups, splits, chunk   sizes; K slice s is [s*chunk, min(K, (s+1)*chunk))
//   P::kAKFast, kBKFast                 which way each operand is contiguous
//   a_row(grp, m) -> ARow, a(ARow, k)    element (m, k) of group grp's A (a_row reads no memory)
//   b_col(grp, n) -> BCol, b(BCol, k)    element (k, n) of group grp's B
//   store(grp, split, m, n, value)       a finished sum of that slice
template <typename P>
struct ConvTiles {
  P p;

  DG_HD void begin(int t, int64_t grp, int64_t row0, int64_t col0, TileState<P>& s) const {
    for (int i = 0; i < TM; ++i)
      for (int j = 0; j < TN; ++j)
        s.acc[i][j] = 0.0f;
    for (int j = 0; j < kLoads; ++j) {
      int mn, kk;
      load_slot<P::kAKFast>(t, j, mn, kk);
      s.a[j] = p.a_row(grp, row0 + mn);
      load_slot<P::kBKFast>(t, j, mn, kk);
      s.b[j] = p.b_col(grp, col0 + mn);
    }
  }

  // Phase 1 of a step: this thread's share of both tiles into shared memory
  // (zeros outside the matrices and the slice).
  DG_HD void load(int t, int64_t row0, int64_t col0, int64_t k0, int64_t k_end, const TileState<P>& s,
                  float (*As)[BM + PAD], float (*Bs)[BN + PAD]) const {
    for (int j = 0; j < kLoads; ++j) {
      int mm, kk;
      load_slot<P::kAKFast>(t, j, mm, kk);
      const int64_t k = k0 + kk;
      As[kk][mm] = (row0 + mm < p.M && k < k_end) ? p.a(s.a[j], k) : 0.0f;
    }
    for (int j = 0; j < kLoads; ++j) {
      int nn, kk;
      load_slot<P::kBKFast>(t, j, nn, kk);
      const int64_t k = k0 + kk;
      Bs[kk][nn] = (col0 + nn < p.N && k < k_end) ? p.b(s.b[j], k) : 0.0f;
    }
  }

  // Phase 2: this step's products added to the thread's TM x TN sums.
  DG_HD void accumulate(int t, const float (*As)[BM + PAD], const float (*Bs)[BN + PAD],
                        TileState<P>& s) const {
    const int ty = t / (BN / TN), tx = t % (BN / TN);
    for (int kk = 0; kk < BK; ++kk) {
      float av[TM], bv[TN];
      for (int i = 0; i < TM; ++i)
        av[i] = As[kk][ty * TM + i];
      for (int j = 0; j < TN; ++j)
        bv[j] = Bs[kk][tx * TN + j];
      for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j)
          s.acc[i][j] += av[i] * bv[j];
    }
  }

  // Phase 3: the finished sums to the problem's store.
  DG_HD void store(int t, int64_t grp, int64_t split, int64_t row0, int64_t col0,
                   const TileState<P>& s) const {
    const int ty = t / (BN / TN), tx = t % (BN / TN);
    for (int i = 0; i < TM; ++i) {
      const int64_t m = row0 + ty * TM + i;
      if (m >= p.M) continue;
      for (int j = 0; j < TN; ++j) {
        const int64_t n = col0 + tx * TN + j;
        if (n < p.N) p.store(grp, split, m, n, s.acc[i][j]);
      }
    }
  }

  DG_HD int64_t k_begin(int64_t split) const { return split * p.chunk; }
  DG_HD int64_t k_end(int64_t split) const {
    const int64_t end = (split + 1) * p.chunk;
    return end < p.K ? end : p.K;
  }
};

// Most blocks along grid.y and grid.z.
constexpr int64_t kMaxGridYZ = 65535;

#ifdef __CUDACC__

template <typename P>
__global__ void __launch_bounds__(kTileThreads) conv_tiles_kernel(ConvTiles<P> g, int64_t z0) {
  __shared__ float As[BK][BM + PAD];
  __shared__ float Bs[BK][BN + PAD];
  const int t = static_cast<int>(threadIdx.x);
  const int64_t col0 = static_cast<int64_t>(blockIdx.x) * BN;
  const int64_t row0 = static_cast<int64_t>(blockIdx.y) * BM;
  const int64_t z = z0 + blockIdx.z;
  const int64_t grp = z / g.p.splits, split = z % g.p.splits;
  TileState<P> s;
  g.begin(t, grp, row0, col0, s);
  const int64_t k_end = g.k_end(split);
  for (int64_t k0 = g.k_begin(split); k0 < k_end; k0 += BK) {
    g.load(t, row0, col0, k0, k_end, s, As, Bs);
    __syncthreads();
    g.accumulate(t, As, Bs, s);
    __syncthreads();
  }
  g.store(t, grp, split, row0, col0, s);
}

#endif

// Runs the tiles of every group and slice: under nvcc as one grid (z: group
// and slice), in the emulation block by block and, within a block, thread by
// thread between the barriers.
template <typename P>
void run_tiles(const char* what, const P& problem) {
  const ConvTiles<P> g{problem};
  const int64_t zs = problem.groups * problem.splits;
  if (problem.M <= 0 || problem.N <= 0 || zs <= 0) return;
  const int64_t row_tiles = (problem.M + BM - 1) / BM, col_tiles = (problem.N + BN - 1) / BN;
  if (row_tiles > kMaxGridYZ || col_tiles > int64_t{0x7fffffff})
    throw std::invalid_argument(std::string(what) + ": convolution too large for one grid");
#ifdef __CUDACC__
  for (int64_t z0 = 0; z0 < zs; z0 += kMaxGridYZ) {
    const dim3 grid(static_cast<unsigned>(col_tiles), static_cast<unsigned>(row_tiles),
                    static_cast<unsigned>(std::min(zs - z0, kMaxGridYZ)));
    conv_tiles_kernel<P><<<grid, kTileThreads, 0, stream()>>>(g, z0);
    check_launch(what);
  }
#else
  (void)what;
  std::vector<TileState<P>> state(kTileThreads);
  float As[BK][BM + PAD], Bs[BK][BN + PAD];
  for (int64_t z = 0; z < zs; ++z) {
    const int64_t grp = z / problem.splits, split = z % problem.splits;
    const int64_t k_end = g.k_end(split);
    for (int64_t rt = 0; rt < row_tiles; ++rt) {
      for (int64_t ct = 0; ct < col_tiles; ++ct) {
        const int64_t row0 = rt * BM, col0 = ct * BN;
        for (int t = 0; t < kTileThreads; ++t)
          g.begin(t, grp, row0, col0, state[t]);
        for (int64_t k0 = g.k_begin(split); k0 < k_end; k0 += BK) {
          for (int t = 0; t < kTileThreads; ++t)
            g.load(t, row0, col0, k0, k_end, state[t], As, Bs);
          for (int t = 0; t < kTileThreads; ++t)
            g.accumulate(t, As, Bs, state[t]);
        }
        for (int t = 0; t < kTileThreads; ++t)
          g.store(t, grp, split, row0, col0, state[t]);
      }
    }
  }
#endif
}

// ---------------------------------------------------------------- the three products

// Whether a tap at input coordinate i (in [0, n)) exists.
DG_HD inline bool inside(int64_t i, int64_t n) {
  return i >= 0 && i < n;
}

// Forward: A = w[g] [Og, Cg*KK] (rows contiguous), B = xcol [Cg*KK, images*OH*OW].
struct ForwardProblem {
  const float* x;
  const float* w;
  const float* bias;  // nullable
  float* y;
  int64_t M, N, K, groups, splits, chunk;
  Conv2dGeom g;
  static constexpr bool kAKFast = true, kBKFast = false;

  struct ARow {
    int64_t at;  // w offset of the row
  };
  struct BCol {
    int64_t base, ih0, iw0;  // x offset of the image's group, the window's corner
  };

  DG_HD ARow a_row(int64_t grp, int64_t m) const { return {(grp * M + m) * K}; }
  DG_HD float a(const ARow& r, int64_t k) const { return w[r.at + k]; }

  DG_HD BCol b_col(int64_t grp, int64_t n) const {
    const int64_t OHW = g.OH * g.OW;
    const int64_t img = n / OHW, p = n - img * OHW, oh = p / g.OW, ow = p - oh * g.OW;
    const int64_t Cg = g.C / g.groups;
    return {(img * g.C + grp * Cg) * g.H * g.W, oh * g.stride_h - g.pad_h, ow * g.stride_w - g.pad_w};
  }
  DG_HD float b(const BCol& col, int64_t k) const {
    const int64_t KK = g.KH * g.KW;
    const int64_t c = k / KK, r = k - c * KK, kh = r / g.KW, kw = r - kh * g.KW;
    const int64_t ih = col.ih0 + kh * g.dil_h, iw = col.iw0 + kw * g.dil_w;
    return (inside(ih, g.H) && inside(iw, g.W)) ? x[col.base + (c * g.H + ih) * g.W + iw] : 0.0f;
  }

  DG_HD void store(int64_t grp, int64_t, int64_t m, int64_t n, float value) const {
    const int64_t OHW = g.OH * g.OW;
    const int64_t img = n / OHW, p = n - img * OHW, o = grp * M + m;
    y[(img * g.O + o) * OHW + p] = bias != nullptr ? value + bias[o] : value;
  }
};

// Input gradient: A[c, (o, kh, kw)] = w[g*Og+o, c, kh, kw], B = dycol [Og*KK, images*H*W].
struct GradInputProblem {
  const float* dy;
  const float* w;
  float* dx;
  int64_t M, N, K, groups, splits, chunk;
  Conv2dGeom g;
  static constexpr bool kAKFast = true, kBKFast = false;

  struct ARow {
    int64_t at;  // w offset of (group's first output, c)
  };
  struct BCol {
    int64_t base, ihp, iwp;  // dy offset of the image's group; the input position, padded
  };

  DG_HD ARow a_row(int64_t grp, int64_t c) const {
    const int64_t KK = g.KH * g.KW, Og = g.O / g.groups;
    return {(grp * Og * M + c) * KK};
  }
  DG_HD float a(const ARow& r, int64_t k) const {
    const int64_t KK = g.KH * g.KW;
    const int64_t o = k / KK;
    return w[r.at + o * M * KK + (k - o * KK)];
  }

  DG_HD BCol b_col(int64_t grp, int64_t n) const {
    const int64_t HW = g.H * g.W;
    const int64_t img = n / HW, q = n - img * HW, ih = q / g.W, iw = q - ih * g.W;
    const int64_t Og = g.O / g.groups;
    return {(img * g.O + grp * Og) * g.OH * g.OW, ih + g.pad_h, iw + g.pad_w};
  }
  // dy at the output position whose tap (kh, kw) read this input position, or 0.
  DG_HD float b(const BCol& col, int64_t k) const {
    const int64_t KK = g.KH * g.KW;
    const int64_t o = k / KK, r = k - o * KK, kh = r / g.KW, kw = r - kh * g.KW;
    const int64_t th = col.ihp - kh * g.dil_h, tw = col.iwp - kw * g.dil_w;
    if (th < 0 || tw < 0) return 0.0f;
    const int64_t oh = th / g.stride_h, ow = tw / g.stride_w;
    if (oh * g.stride_h != th || ow * g.stride_w != tw || oh >= g.OH || ow >= g.OW) return 0.0f;
    return dy[col.base + (o * g.OH + oh) * g.OW + ow];
  }

  DG_HD void store(int64_t grp, int64_t, int64_t c, int64_t n, float value) const {
    const int64_t HW = g.H * g.W;
    const int64_t img = n / HW, q = n - img * HW;
    dx[(img * g.C + grp * M + c) * HW + q] = value;
  }
};

// Weight gradient: A = dy [Og, images*OH*OW] (contiguous within an image),
// B = xcol^T [images*OH*OW, Cg*KK]; slice s's sums go to out + s * O*Cg*KK.
struct GradWeightProblem {
  const float* x;
  const float* dy;
  float* out;
  int64_t M, N, K, groups, splits, chunk;
  Conv2dGeom g;
  static constexpr bool kAKFast = true, kBKFast = true;

  struct ARow {
    int64_t at;  // dy offset of (image 0, output channel)
  };
  struct BCol {
    int64_t base, ioff, joff;  // x offset of (image 0, channel); the tap's offsets
  };

  DG_HD ARow a_row(int64_t grp, int64_t m) const { return {(grp * M + m) * g.OH * g.OW}; }
  DG_HD float a(const ARow& r, int64_t k) const {
    const int64_t OHW = g.OH * g.OW;
    const int64_t img = k / OHW;
    return dy[r.at + img * g.O * OHW + (k - img * OHW)];
  }

  DG_HD BCol b_col(int64_t grp, int64_t n) const {
    const int64_t KK = g.KH * g.KW, Cg = g.C / g.groups;
    const int64_t c = n / KK, r = n - c * KK, kh = r / g.KW, kw = r - kh * g.KW;
    return {(grp * Cg + c) * g.H * g.W, kh * g.dil_h - g.pad_h, kw * g.dil_w - g.pad_w};
  }
  DG_HD float b(const BCol& col, int64_t k) const {
    const int64_t OHW = g.OH * g.OW;
    const int64_t img = k / OHW, p = k - img * OHW, oh = p / g.OW, ow = p - oh * g.OW;
    const int64_t ih = oh * g.stride_h + col.ioff, iw = ow * g.stride_w + col.joff;
    return (inside(ih, g.H) && inside(iw, g.W)) ? x[img * g.C * g.H * g.W + col.base + ih * g.W + iw] : 0.0f;
  }

  DG_HD void store(int64_t grp, int64_t split, int64_t m, int64_t n, float value) const {
    out[split * g.O * N + (grp * M + m) * N + n] = value;
  }
};

// ---------------------------------------------------------------- choices

// Rows per group (Og, or Cg for the input gradient) below which the direct
// lambdas run: a 64-row tile would be mostly padding (depthwise: 1 row).
constexpr int64_t kDirectRows = 16;

inline bool forward_direct(const Conv2dGeom& g) {
  return g.O / g.groups < kDirectRows;
}
inline bool grad_input_direct(const Conv2dGeom& g) {
  return g.C / g.groups < kDirectRows;
}
inline bool grad_weight_direct(const Conv2dGeom& g) {
  return g.O / g.groups < kDirectRows;
}

// K slices for a weight gradient: enough for `target` units of parallel work
// (blocks or threads) when there are `units` without slicing, each slice at
// least `min_chunk` long, and no more than `fit` (the workspace's room for
// partials). Returns the chunk length; the slice count is ceil(K / chunk).
inline int64_t slice_chunk(int64_t K, int64_t units, int64_t target, int64_t min_chunk, int64_t fit) {
  int64_t splits = std::max<int64_t>(1, (target + units - 1) / std::max<int64_t>(units, 1));
  splits = std::min(splits, std::max<int64_t>(1, (K + min_chunk - 1) / min_chunk));
  splits = std::max<int64_t>(1, std::min(splits, fit));
  int64_t chunk = (K + splits - 1) / splits;
  chunk = (chunk + BK - 1) / BK * BK;  // whole steps of the tile kernel
  return std::max<int64_t>(chunk, 1);
}

constexpr int64_t kTargetBlocks = 1024;     // tile blocks a weight gradient aims at
constexpr int64_t kTargetThreads = 131072;  // threads the direct weight gradient aims at
constexpr int64_t kMinChunk = 256;          // shortest K slice

// dw = the sum of `splits` partial weight gradients (in slice order).
inline void add_slices(const float* partial, float* dw, int64_t count, int64_t splits) {
  for_each("conv2d_grad_weight slices", count, [=] DG_HD(int64_t i) {
    float s = partial[i];
    for (int64_t k = 1; k < splits; ++k)
      s += partial[k * count + i];
    dw[i] = s;
  });
}

// How many partial weight gradients fit in the workspace.
inline int64_t partials_fit(const float* ws, const Conv2dGeom& g) {
  const int64_t count = g.O * (g.C / g.groups) * g.KH * g.KW;
  return ws == nullptr || count == 0 ? 1 : std::max<int64_t>(1, conv2d_grad_weight_workspace(g) / count);
}

// ---------------------------------------------------------------- the two ways of each convolution

inline void conv2d_tiled(const float* x, const float* w, const float* b, float* y, const Conv2dGeom& g) {
  const int64_t Og = g.O / g.groups, K = (g.C / g.groups) * g.KH * g.KW;
  run_tiles("conv2d", ForwardProblem{x, w, b, y, Og, g.N * g.OH * g.OW, K, g.groups, 1, K, g});
}

// Each output element: its bias plus the sum over its window and channels.
inline void conv2d_direct(const float* x, const float* w, const float* b, float* y, const Conv2dGeom& g) {
  const int64_t Og = g.O / g.groups, Cg = g.C / g.groups;
  for_each("conv2d (direct)", g.N * g.O * g.OH * g.OW, [=] DG_HD(int64_t i) {
    const int64_t ow = i % g.OW, oh = (i / g.OW) % g.OH, o = (i / (g.OW * g.OH)) % g.O,
                  img = i / (g.OW * g.OH * g.O);
    const float* xg = x + (img * g.C + (o / Og) * Cg) * g.H * g.W;
    const float* wo = w + o * Cg * g.KH * g.KW;
    const int64_t ih0 = oh * g.stride_h - g.pad_h, iw0 = ow * g.stride_w - g.pad_w;
    float s = b != nullptr ? b[o] : 0.0f;
    for (int64_t c = 0; c < Cg; ++c) {
      for (int64_t kh = 0; kh < g.KH; ++kh) {
        const int64_t ih = ih0 + kh * g.dil_h;
        if (!inside(ih, g.H)) continue;
        for (int64_t kw = 0; kw < g.KW; ++kw) {
          const int64_t iw = iw0 + kw * g.dil_w;
          if (inside(iw, g.W)) s += wo[(c * g.KH + kh) * g.KW + kw] * xg[(c * g.H + ih) * g.W + iw];
        }
      }
    }
    y[i] = s;
  });
}

inline void conv2d_grad_input_tiled(const float* dy, const float* w, float* dx, const Conv2dGeom& g) {
  const int64_t Cg = g.C / g.groups, K = (g.O / g.groups) * g.KH * g.KW;
  run_tiles("conv2d_grad_input", GradInputProblem{dy, w, dx, Cg, g.N * g.H * g.W, K, g.groups, 1, K, g});
}

// Each input element: the sum over the outputs and taps that read it.
inline void conv2d_grad_input_direct(const float* dy, const float* w, float* dx, const Conv2dGeom& g) {
  const int64_t Og = g.O / g.groups, Cg = g.C / g.groups;
  for_each("conv2d_grad_input (direct)", g.N * g.C * g.H * g.W, [=] DG_HD(int64_t i) {
    const int64_t iw = i % g.W, ih = (i / g.W) % g.H, c = (i / (g.W * g.H)) % g.C,
                  img = i / (g.W * g.H * g.C);
    const int64_t grp = c / Cg, cl = c - grp * Cg;
    float s = 0.0f;
    for (int64_t m = 0; m < Og; ++m) {
      const int64_t o = grp * Og + m;
      const float* dyo = dy + (img * g.O + o) * g.OH * g.OW;
      const float* wo = w + (o * Cg + cl) * g.KH * g.KW;
      for (int64_t kh = 0; kh < g.KH; ++kh) {
        const int64_t th = ih + g.pad_h - kh * g.dil_h;
        if (th < 0) continue;
        const int64_t oh = th / g.stride_h;
        if (oh * g.stride_h != th || oh >= g.OH) continue;
        for (int64_t kw = 0; kw < g.KW; ++kw) {
          const int64_t tw = iw + g.pad_w - kw * g.dil_w;
          if (tw < 0) continue;
          const int64_t ow = tw / g.stride_w;
          if (ow * g.stride_w != tw || ow >= g.OW) continue;
          s += wo[kh * g.KW + kw] * dyo[oh * g.OW + ow];
        }
      }
    }
    dx[i] = s;
  });
}

// dw through the tile kernel; partials of the K slices in ws when there are several.
inline void conv2d_grad_weight_tiled(const float* x, const float* dy, float* dw, float* ws,
                                     const Conv2dGeom& g) {
  const int64_t Og = g.O / g.groups, Ncols = (g.C / g.groups) * g.KH * g.KW, K = g.N * g.OH * g.OW;
  const int64_t tiles = g.groups * ((Og + BM - 1) / BM) * ((Ncols + BN - 1) / BN);
  const int64_t chunk = slice_chunk(K, tiles, kTargetBlocks, kMinChunk, partials_fit(ws, g));
  const int64_t splits = std::max<int64_t>(1, (K + chunk - 1) / chunk);  // 1 when K == 0: zeros
  float* out = splits > 1 ? ws : dw;
  run_tiles("conv2d_grad_weight", GradWeightProblem{x, dy, out, Og, Ncols, K, g.groups, splits, chunk, g});
  if (splits > 1) add_slices(ws, dw, g.O * Ncols, splits);
}

// dw by one lambda per (K slice, weight element), each summing its slice of the
// images' output positions; partials in ws when there are several slices.
inline void conv2d_grad_weight_direct(const float* x, const float* dy, float* dw, float* ws,
                                      const Conv2dGeom& g) {
  const int64_t Og = g.O / g.groups, Cg = g.C / g.groups, KK = g.KH * g.KW;
  const int64_t count = g.O * Cg * KK, K = g.N * g.OH * g.OW;
  const int64_t chunk = slice_chunk(K, count, kTargetThreads, kMinChunk, partials_fit(ws, g));
  const int64_t splits = std::max<int64_t>(1, (K + chunk - 1) / chunk);  // 1 when K == 0: zeros
  float* out = splits > 1 ? ws : dw;
  for_each("conv2d_grad_weight (direct)", splits * count, [=] DG_HD(int64_t i) {
    const int64_t slice = i / count, e = i - slice * count;
    const int64_t o = e / (Cg * KK), r = e - o * (Cg * KK), c = r / KK, kh = (r % KK) / g.KW, kw = r % g.KW;
    const int64_t OHW = g.OH * g.OW;
    const float* xc = x + ((o / Og) * Cg + c) * g.H * g.W;  // image 0
    const float* dyo = dy + o * OHW;                        // image 0
    const int64_t ioff = kh * g.dil_h - g.pad_h, joff = kw * g.dil_w - g.pad_w;
    const int64_t k0 = slice * chunk, k1 = k0 + chunk < K ? k0 + chunk : K;
    int64_t img = k0 / OHW, p = k0 - img * OHW;
    int64_t oh = p / g.OW, ow = p - oh * g.OW;
    float s = 0.0f;
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t ih = oh * g.stride_h + ioff, iw = ow * g.stride_w + joff;
      if (inside(ih, g.H) && inside(iw, g.W))
        s += dyo[img * g.O * OHW + oh * g.OW + ow] * xc[img * g.C * g.H * g.W + ih * g.W + iw];
      if (++ow == g.OW) {
        ow = 0;
        if (++oh == g.OH) {
          oh = 0;
          ++img;
        }
      }
    }
    out[i] = s;
  });
  if (splits > 1) add_slices(ws, dw, count, splits);
}

// ---------------------------------------------------------------- pools

// True when a pooled maximum y came from the input value v (NaN matches NaN).
DG_HD inline bool same_max(float v, float y) {
  return v == y || (v != v && y != y);
}

// Window positions along one axis inside the padded input [-pad, in + pad) for
// the window starting at i0 (the divisor of avg_pool2d, count_include_pad: k
// unless an output size rounded up cut the window).
DG_HD inline int64_t padded_count(int64_t i0, int64_t k, int64_t dil, int64_t in, int64_t pad) {
  int64_t count = 0;
  for (int64_t j = 0; j < k; ++j)
    count += i0 + j * dil < in + pad ? 1 : 0;
  return count;
}

// The flat position (ih * W + iw) in its plane of the first maximum of window
// (oh, ow), row-major; -1 if none matches.
DG_HD inline int64_t first_max(const float* xp, float m, int64_t oh, int64_t ow, const Conv2dGeom& g) {
  const int64_t ih0 = oh * g.stride_h - g.pad_h, iw0 = ow * g.stride_w - g.pad_w;
  for (int64_t kh = 0; kh < g.KH; ++kh) {
    const int64_t ih = ih0 + kh * g.dil_h;
    if (!inside(ih, g.H)) continue;
    for (int64_t kw = 0; kw < g.KW; ++kw) {
      const int64_t iw = iw0 + kw * g.dil_w;
      if (inside(iw, g.W) && same_max(xp[ih * g.W + iw], m)) return ih * g.W + iw;
    }
  }
  return -1;
}

// Calls f(oh, ow) for every window containing input position (ih, iw), in the
// order oh ascending, then ow ascending (the CPU runtime's scatter order).
template <typename F>
DG_HD void windows_containing(int64_t ih, int64_t iw, const Conv2dGeom& g, F f) {
  for (int64_t kh = g.KH - 1; kh >= 0; --kh) {
    const int64_t th = ih + g.pad_h - kh * g.dil_h;
    if (th < 0) continue;
    const int64_t oh = th / g.stride_h;
    if (oh * g.stride_h != th || oh >= g.OH) continue;
    for (int64_t kw = g.KW - 1; kw >= 0; --kw) {
      const int64_t tw = iw + g.pad_w - kw * g.dil_w;
      if (tw < 0) continue;
      const int64_t ow = tw / g.stride_w;
      if (ow * g.stride_w != tw || ow >= g.OW) continue;
      f(oh, ow);
    }
  }
}

}  // namespace conv_detail

// ---------------------------------------------------------------- convolutions

// y[N,O,OH,OW] = conv(x[N,C,H,W], w[O,C/groups,KH,KW]) (+ b[O] when b != nullptr):
// cross-correlation as torch.nn.functional.conv2d, zero padding, dilation and
// groups (depthwise included). y is overwritten; ws (conv2d_workspace(g)
// floats, nullptr when 0) is not needed here.
inline void conv2d(const float* x, const float* w, const float* b, float* y, float* ws, const Conv2dGeom& g) {
  (void)ws;
  if (conv_detail::forward_direct(g)) {
    conv_detail::conv2d_direct(x, w, b, y, g);
  } else {
    conv_detail::conv2d_tiled(x, w, b, y, g);
  }
}

// dx[N,C,H,W] = the gradient of conv2d with respect to x, given dy[N,O,OH,OW]
// and w. dx is overwritten (positions no window reads get 0); ws is not needed.
inline void conv2d_grad_input(const float* dy, const float* w, float* dx, float* ws, const Conv2dGeom& g) {
  (void)ws;
  if (conv_detail::grad_input_direct(g)) {
    conv_detail::conv2d_grad_input_direct(dy, w, dx, g);
  } else {
    conv_detail::conv2d_grad_input_tiled(dy, w, dx, g);
  }
}

// dw[O,C/groups,KH,KW] = the gradient of conv2d with respect to w, given x and
// dy, summed over the images. dw is overwritten; ws holds
// conv2d_grad_weight_workspace(g) floats (partial sums of K slices).
inline void conv2d_grad_weight(const float* x, const float* dy, float* dw, float* ws, const Conv2dGeom& g) {
  if (conv_detail::grad_weight_direct(g)) {
    conv_detail::conv2d_grad_weight_direct(x, dy, dw, ws, g);
  } else {
    conv_detail::conv2d_grad_weight_tiled(x, dy, dw, ws, g);
  }
}

// ---------------------------------------------------------------- pools

// y[N,C,OH,OW] = the maximum over each window of x[N,C,H,W]; padding positions
// are ignored (as -inf) and NaN propagates. y is overwritten.
inline void max_pool2d(const float* x, float* y, const Conv2dGeom& g) {
  for_each("max_pool2d", g.N * g.C * g.OH * g.OW, [=] DG_HD(int64_t i) {
    const int64_t ow = i % g.OW, oh = (i / g.OW) % g.OH, plane = i / (g.OW * g.OH);
    const float* xp = x + plane * g.H * g.W;
    const int64_t ih0 = oh * g.stride_h - g.pad_h, iw0 = ow * g.stride_w - g.pad_w;
    float m = -INFINITY;
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const int64_t ih = ih0 + kh * g.dil_h;
      if (!conv_detail::inside(ih, g.H)) continue;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const int64_t iw = iw0 + kw * g.dil_w;
        if (!conv_detail::inside(iw, g.W)) continue;
        const float v = xp[ih * g.W + iw];
        if (v > m || v != v) m = v;  // once m is NaN, `v > NaN` is false: the NaN stays
      }
    }
    y[i] = m;
  });
}

// dx[N,C,H,W] = the gradient of max_pool2d given x, its output y and dy: each
// dy goes to the first position of its window (kh outer, kw inner) whose x
// equals the window's y (a NaN y: the first NaN); 0 elsewhere. One lambda per
// input element gathers from the windows containing it. dx is overwritten.
inline void max_pool2d_grad(const float* x, const float* y, const float* dy, float* dx, const Conv2dGeom& g) {
  for_each("max_pool2d_grad", g.N * g.C * g.H * g.W, [=] DG_HD(int64_t i) {
    const int64_t q = i % (g.H * g.W), plane = i / (g.H * g.W);
    const int64_t ih = q / g.W, iw = q % g.W;
    const float* xp = x + plane * g.H * g.W;
    const int64_t out = plane * g.OH * g.OW;
    float s = 0.0f;
    conv_detail::windows_containing(ih, iw, g, [&](int64_t oh, int64_t ow) {
      const int64_t at = out + oh * g.OW + ow;
      if (conv_detail::first_max(xp, y[at], oh, ow, g) == q) s += dy[at];
    });
    dx[i] = s;
  });
}

// y[N,C,OH,OW] = the sum over each window of x / the window size, padding
// counted as zeros (count_include_pad): KH*KW, or fewer where an output size
// rounded up cut the window at the far padding edge. y is overwritten.
inline void avg_pool2d(const float* x, float* y, const Conv2dGeom& g) {
  for_each("avg_pool2d", g.N * g.C * g.OH * g.OW, [=] DG_HD(int64_t i) {
    const int64_t ow = i % g.OW, oh = (i / g.OW) % g.OH, plane = i / (g.OW * g.OH);
    const float* xp = x + plane * g.H * g.W;
    const int64_t ih0 = oh * g.stride_h - g.pad_h, iw0 = ow * g.stride_w - g.pad_w;
    const int64_t count = conv_detail::padded_count(ih0, g.KH, g.dil_h, g.H, g.pad_h) *
                          conv_detail::padded_count(iw0, g.KW, g.dil_w, g.W, g.pad_w);
    float s = 0.0f;
    for (int64_t kh = 0; kh < g.KH; ++kh) {
      const int64_t ih = ih0 + kh * g.dil_h;
      if (!conv_detail::inside(ih, g.H)) continue;
      for (int64_t kw = 0; kw < g.KW; ++kw) {
        const int64_t iw = iw0 + kw * g.dil_w;
        if (conv_detail::inside(iw, g.W)) s += xp[ih * g.W + iw];
      }
    }
    y[i] = s / static_cast<float>(count);
  });
}

// dx[N,C,H,W] = the gradient of avg_pool2d given dy: each input element gets
// dy / (its window's size, as avg_pool2d) of every window containing it; 0 if
// none. dx is overwritten.
inline void avg_pool2d_grad(const float* dy, float* dx, const Conv2dGeom& g) {
  for_each("avg_pool2d_grad", g.N * g.C * g.H * g.W, [=] DG_HD(int64_t i) {
    const int64_t q = i % (g.H * g.W), plane = i / (g.H * g.W);
    const int64_t ih = q / g.W, iw = q % g.W;
    const int64_t out = plane * g.OH * g.OW;
    float s = 0.0f;
    conv_detail::windows_containing(ih, iw, g, [&](int64_t oh, int64_t ow) {
      const int64_t count =
          conv_detail::padded_count(oh * g.stride_h - g.pad_h, g.KH, g.dil_h, g.H, g.pad_h) *
          conv_detail::padded_count(ow * g.stride_w - g.pad_w, g.KW, g.dil_w, g.W, g.pad_w);
      s += dy[out + oh * g.OW + ow] / static_cast<float>(count);
    });
    dx[i] = s;
  });
}

// The adaptive window [start, end) of output position i of `out` over `size`
// input positions (PyTorch's adaptive pooling): floor(i*size/out) to
// ceil((i+1)*size/out).
DG_HD inline int64_t adaptive_start(int64_t i, int64_t size, int64_t out) {
  return i * size / out;
}
DG_HD inline int64_t adaptive_end(int64_t i, int64_t size, int64_t out) {
  return ((i + 1) * size + out - 1) / out;
}

// y[planes, OH, OW] = the mean of each adaptive window of x[planes, H, W]
// (adaptive_avg_pool2d). y is overwritten.
inline void adaptive_avg_pool2d(const float* x, float* y, int64_t planes, int64_t H, int64_t W, int64_t OH,
                                int64_t OW) {
  for_each("adaptive_avg_pool2d", planes * OH * OW, [=] DG_HD(int64_t i) {
    const int64_t ow = i % OW, oh = (i / OW) % OH, plane = i / (OW * OH);
    const float* xp = x + plane * H * W;
    const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
    const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
    float s = 0.0f;
    for (int64_t h = h0; h < h1; ++h)
      for (int64_t w = w0; w < w1; ++w)
        s += xp[h * W + w];
    y[i] = s / static_cast<float>((h1 - h0) * (w1 - w0));
  });
}

// dx[planes, H, W] = the gradient of adaptive_avg_pool2d given dy: each input
// element gathers dy / (window size) from every window containing it. dx is
// overwritten.
inline void adaptive_avg_pool2d_grad(const float* dy, float* dx, int64_t planes, int64_t H, int64_t W,
                                     int64_t OH, int64_t OW) {
  for_each("adaptive_avg_pool2d_grad", planes * H * W, [=] DG_HD(int64_t i) {
    const int64_t w = i % W, h = (i / W) % H, plane = i / (W * H);
    const float* gp = dy + plane * OH * OW;
    // Windows containing row h start at or before h: output rows from h*OH/H - 1 on cover every candidate.
    const int64_t oh_lo = h * OH / H > 0 ? h * OH / H - 1 : 0, ow_lo = w * OW / W > 0 ? w * OW / W - 1 : 0;
    float s = 0.0f;
    for (int64_t oh = oh_lo; oh < OH && adaptive_start(oh, H, OH) <= h; ++oh) {
      const int64_t h0 = adaptive_start(oh, H, OH), h1 = adaptive_end(oh, H, OH);
      if (h < h0 || h >= h1) continue;
      for (int64_t ow = ow_lo; ow < OW && adaptive_start(ow, W, OW) <= w; ++ow) {
        const int64_t w0 = adaptive_start(ow, W, OW), w1 = adaptive_end(ow, W, OW);
        if (w >= w0 && w < w1) s += gp[oh * OW + ow] / static_cast<float>((h1 - h0) * (w1 - w0));
      }
    }
    dx[i] = s;
  });
}

// y = batch_norm(conv2d(x, w, b)) with batch norm's weight, bias and running
// statistics (the conv_batch_norm pass's op; the CPU runtime applies the
// normalization in the convolution's epilogue at inference), then residual
// added (unless null: a tensor of y's shape) and relu (when relu), as the pass
// folds them: conv2d into y, then batch norm, residual and relu in place, so
// the results are those of the separate calls (relu: 0 > v ? 0 : v, as
// dg::math::max_f(0, v)).
inline void conv2d_batch_norm(const float* x, const float* w, const float* b, const float* bn_w,
                              const float* bn_b, float* running_mean, float* running_var,
                              const float* residual, float* y, float* mean, float* invstd, float* ws,
                              const Conv2dGeom& g, float eps, float momentum, bool relu, const Mode& mode,
                              const char* what) {
  conv2d(x, w, b, y, ws, g);
  batch_norm(y, bn_w, bn_b, running_mean, running_var, y, mean, invstd, g.N, g.O, g.OH * g.OW, eps, momentum,
             mode, what);
  if (residual == nullptr && !relu) return;
  for_each("conv2d_batch_norm residual and relu", g.N * g.O * g.OH * g.OW, [=] DG_HD(int64_t i) {
    const float v = residual != nullptr ? y[i] + residual[i] : y[i];
    y[i] = relu && 0.0f > v ? 0.0f : v;
  });
}

}  // namespace dg
