// dg_cuda_windows.h: windowed attention's constant tables on the GPU
// (ops/windows.py; the same formulas as dg_windows.h's).
//
// Part of the deepgen CUDA runtime: hand-written, copied unchanged into every
// generated project that uses it. Header-only, C++17 (CUDA: needs --extended-lambda).
#pragma once

#include <cmath>
#include <cstdint>

#include "dg_cuda.h"
#include "dg_cuda_compat.h"
#include "dg_cuda_launch.h"

namespace dg {

// Windowed attention's constant tables (ops/windows.py; the same formulas as dg_windows.h's).
inline void relative_position_index(int64_t* out, int64_t wh, int64_t ww) {
  const int64_t L = wh * ww;
  for_each("relative_position_index", L * L, [=] DG_HD(int64_t j) {
    const int64_t p = j / L, q = j % L;
    out[j] = (p / ww - q / ww + wh - 1) * (2 * ww - 1) + (p % ww - q % ww + ww - 1);
  });
}

DG_HD inline int64_t window_region(int64_t i, int64_t length, int64_t window, int64_t shift) {
  if (shift == 0) return 0;
  return (i >= length - window ? 1 : 0) + (i >= length - shift ? 1 : 0);
}

inline void shifted_window_mask(float* out, int64_t H, int64_t W, int64_t wh, int64_t ww, int64_t sh,
                                int64_t sw, float value) {
  const int64_t L = wh * ww, across = W / ww, windows = (H / wh) * across;
  for_each("shifted_window_mask", windows * L * L, [=] DG_HD(int64_t j) {
    const int64_t w = j / (L * L), p = (j / L) % L, q = j % L;
    const int64_t top = (w / across) * wh, left = (w % across) * ww;
    const int64_t lp = window_region(top + p / ww, H, wh, sh) * 3 + window_region(left + p % ww, W, ww, sw);
    const int64_t lq = window_region(top + q / ww, H, wh, sh) * 3 + window_region(left + q % ww, W, ww, sw);
    out[j] = lp != lq ? value : 0.0f;
  });
}

DG_HD inline float log_spaced_coord(int64_t d, int64_t w) {
  const double t = 8.0 * static_cast<double>(d) / static_cast<double>(w - 1);
  const double s = t > 0 ? 1.0 : (t < 0 ? -1.0 : 0.0);
  return static_cast<float>(s * log2(fabs(t) + 1.0) / 3.0);
}

inline void relative_coords_table(float* out, int64_t wh, int64_t ww) {
  const int64_t across = 2 * ww - 1;
  for_each("relative_coords_table", (2 * wh - 1) * across, [=] DG_HD(int64_t j) {
    out[j * 2] = log_spaced_coord(j / across - (wh - 1), wh);
    out[j * 2 + 1] = log_spaced_coord(j % across - (ww - 1), ww);
  });
}

}  // namespace dg
