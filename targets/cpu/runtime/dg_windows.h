// dg_windows.h: windowed attention's constant tables (ops/windows.py), written by
// the runtime instead of stored as weights.
//
// Part of the deepgen runtime: hand-written, copied unchanged into every
// generated project that uses it.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace dg {

// Windowed attention's constant tables (ops/windows.py), written by the runtime instead of
// stored as weights. relative_position_index [(wh*ww)^2]: for query p and key q of a window,
// the row of the relative position bias table [(2wh-1)*(2ww-1), heads] holding q seen from p.
inline void relative_position_index(int64_t* out, int64_t wh, int64_t ww) {
  const int64_t L = wh * ww;
  for (int64_t p = 0; p < L; ++p)
    for (int64_t q = 0; q < L; ++q)
      out[p * L + q] = (p / ww - q / ww + wh - 1) * (2 * ww - 1) + (p % ww - q % ww + ww - 1);
}

// The region of position i along an axis of `length` for shifted-window attention: 0 above
// the last `window`, 1 within it above the last `shift`, 2 in the last `shift`; an axis
// shifted by 0 is one region.
inline int64_t window_region(int64_t i, int64_t length, int64_t window, int64_t shift) {
  if (shift == 0) return 0;
  return (i >= length - window ? 1 : 0) + (i >= length - shift ? 1 : 0);
}

// The additive mask of shifted-window attention over an H x W map [windows, wh*ww, wh*ww]:
// `value` between two pixels of a window from different regions, 0 between the same.
inline void shifted_window_mask(float* out, int64_t H, int64_t W, int64_t wh, int64_t ww, int64_t sh,
                                int64_t sw, float value) {
  const int64_t L = wh * ww, across = W / ww, windows = (H / wh) * across;
  std::vector<int64_t> label(static_cast<size_t>(windows * L));
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t p = 0; p < L; ++p) {
      const int64_t y = (w / across) * wh + p / ww, x = (w % across) * ww + p % ww;
      label[static_cast<size_t>(w * L + p)] = window_region(y, H, wh, sh) * 3 + window_region(x, W, ww, sw);
    }
  for (int64_t w = 0; w < windows; ++w)
    for (int64_t p = 0; p < L; ++p)
      for (int64_t q = 0; q < L; ++q)
        out[(w * L + p) * L + q] =
            label[static_cast<size_t>(w * L + p)] != label[static_cast<size_t>(w * L + q)] ? value : 0.0f;
}

// Swin v2's log-spaced relative coordinates [2wh-1, 2ww-1, 2]: sign(t) log2(|t| + 1) / 3 with
// t = 8 d / (w - 1) for the offset d along each axis (computed in double, as the reference).
inline float log_spaced_coord(int64_t d, int64_t w) {
  const double t = 8.0 * static_cast<double>(d) / static_cast<double>(w - 1);
  const double s = t > 0 ? 1.0 : (t < 0 ? -1.0 : 0.0);
  return static_cast<float>(s * std::log2(std::fabs(t) + 1.0) / 3.0);
}

inline void relative_coords_table(float* out, int64_t wh, int64_t ww) {
  for (int64_t i = 0; i < 2 * wh - 1; ++i)
    for (int64_t j = 0; j < 2 * ww - 1; ++j) {
      out[(i * (2 * ww - 1) + j) * 2] = log_spaced_coord(i - (wh - 1), wh);
      out[(i * (2 * ww - 1) + j) * 2 + 1] = log_spaced_coord(j - (ww - 1), ww);
    }
}

}  // namespace dg
