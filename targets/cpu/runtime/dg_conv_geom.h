// dg_conv_geom.h - the geometry of a 2-D convolution or pooling window, and the
// column-matrix workspace it needs: what lowered code passes to the CPU runtime (dg_conv.h)
// and to the CUDA runtime (dg_cuda_conv.h) alike.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project.  Header-only, C++17.
#pragma once

#include <cstdint>

// Functions that run on the host and, in the CUDA target, on the device too
// (dg_cuda_compat.h, included before this header there, defines it).
#ifndef DG_HD
#define DG_HD
#endif

namespace dg {

// Geometry of one 2-D convolution or pooling window (NCHW).
struct Conv2dGeom {
  int64_t N, C, H, W;  // input [N, C, H, W]
  int64_t O, KH, KW;   // output channels, kernel size (pools: O == C)
  int64_t OH, OW;      // output [N, O, OH, OW]
  int64_t stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups;  // pools: dil 1, groups 1

  // Plain member initialization (the parameters are the members, in order).
  DG_HD constexpr Conv2dGeom(int64_t N_, int64_t C_, int64_t H_, int64_t W_, int64_t O_, int64_t KH_,
                             int64_t KW_, int64_t OH_, int64_t OW_, int64_t stride_h_, int64_t stride_w_,
                             int64_t pad_h_, int64_t pad_w_, int64_t dil_h_, int64_t dil_w_, int64_t groups_)
      : N(N_),
        C(C_),
        H(H_),
        W(W_),
        O(O_),
        KH(KH_),
        KW(KW_),
        OH(OH_),
        OW(OW_),
        stride_h(stride_h_),
        stride_w(stride_w_),
        pad_h(pad_h_),
        pad_w(pad_w_),
        dil_h(dil_h_),
        dil_w(dil_w_),
        groups(groups_) {}

  // KH == KW == 1, stride 1, pad 0: the input is its own column matrix.
  DG_HD constexpr bool pointwise() const {
    return KH == 1 && KW == 1 && stride_h == 1 && stride_w == 1 && pad_h == 0 && pad_w == 0;
  }
};

// Floats of workspace the caller provides to conv2d and conv2d_grad_input: one
// image's column matrix for one group, (C/groups)*KH*KW x OH*OW, or 0 when
// pointwise (the CPU's im2col; the CUDA kernels compute columns in their tiles).
constexpr int64_t conv2d_workspace(const Conv2dGeom& g) {
  return g.pointwise() ? 0 : (g.C / g.groups) * g.KH * g.KW * g.OH * g.OW;
}

}  // namespace dg
