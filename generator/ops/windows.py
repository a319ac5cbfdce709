"""Constant tables of windowed attention (Swin, MaxViT): ops with no operands whose output
depends only on their attrs, computed by the runtime (as `causal_mask` is) instead of being
stored as weights.

- `relative_position_index(window=(wh, ww))`: int64 [(wh*ww)^2], row-major over (query p,
  key q) of a window: the row of a relative position bias table [(2wh-1)*(2ww-1), heads]
  that holds the bias of q seen from p, `(hp - hq + wh - 1) * (2ww - 1) + (wp - wq + ww - 1)`.
  `dg.gather(table, index)` then makes the bias [(wh*ww)^2, heads].
- `shifted_window_mask(size=(H, W), window, shift)`: float32 [windows, wh*ww, wh*ww], the
  additive mask of shifted-window attention over an H x W map rolled back by `shift`: pixels
  of a window that came from different regions of the map (the last `window` rows, of which
  the last `shift` rows, and the rows above; likewise columns; an axis shifted by 0 is one
  region) do not attend to each other: `value` (-100) there, 0 elsewhere.
- `relative_coords_table(window=(wh, ww))`: float32 [2wh-1, 2ww-1, 2], Swin v2's log-spaced
  relative coordinates `sign(t) * log2(|t| + 1) / 3` with t = 8 * d / (w - 1) for each offset
  d in [-(w-1), w-1] along each axis (the input of its continuous position bias MLP).
"""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Named
from .registry import OpDef, register


def _pair(attrs, key, what, low=1):
    value = attrs[key]
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in value)):
        raise ValueError(f"{what}: {key} must be two ints >= {low}, got {value!r}")
    return value


def relative_position_index(wh: int, ww: int) -> np.ndarray:
    hp, wp = np.divmod(np.arange(wh * ww), ww)  # each window position's row and column
    rows = (hp[:, None] - hp[None, :] + wh - 1) * (2 * ww - 1)
    return (rows + wp[:, None] - wp[None, :] + ww - 1).reshape(-1).astype(np.int64)


def _regions(length: int, window: int, shift: int) -> np.ndarray:
    """Region of each position along one axis: 0 above the last `window`, 1 in it above the
    last `shift`, 2 in the last `shift`; one region when the axis is not shifted."""
    at = np.arange(length)
    if shift == 0:
        return np.zeros(length, dtype=np.int64)
    return (at >= length - window).astype(np.int64) + (at >= length - shift)


def shifted_window_mask(size, window, shift, value) -> np.ndarray:
    (H, W), (wh, ww), (sh, sw) = size, window, shift
    label = _regions(H, wh, sh)[:, None] * 3 + _regions(W, ww, sw)[None, :]  # [H, W]
    per_window = label.reshape(H // wh, wh, W // ww, ww).transpose(0, 2, 1, 3).reshape(-1, wh * ww)
    differs = per_window[:, :, None] != per_window[:, None, :]
    return np.where(differs, np.float32(value), np.float32(0)).astype(np.float32)


def relative_coords_table(wh: int, ww: int) -> np.ndarray:
    def axis(w):
        t = np.arange(-(w - 1), w, dtype=np.float64) * 8.0 / (w - 1)
        return np.sign(t) * np.log2(np.abs(t) + 1.0) / 3.0

    h, w = np.meshgrid(axis(wh), axis(ww), indexing="ij")
    return np.stack([h, w], axis=-1).astype(np.float32)


@register
class RelativePositionIndex(OpDef):
    name = "relative_position_index"

    def infer(self, inputs, attrs):
        wh, ww = _pair(attrs, "window", "relative_position_index")
        return [("int64", ((wh * ww) ** 2,))]

    def reference(self, args, attrs, dims):
        return [relative_position_index(*attrs["window"])]

    def lower(self, node, ctx):
        wh, ww = node.attrs["window"]
        return [ctx.call("dg::relative_position_index", ctx.write(node.outputs[0]), Named("wh", wh), Named("ww", ww))]

    def describe(self, node):
        return f"relative_position_index(window={node.attrs['window']})"

    def grad(self, node, gouts, gb):
        return []


@register
class ShiftedWindowMask(OpDef):
    name = "shifted_window_mask"

    def infer(self, inputs, attrs):
        H, W = _pair(attrs, "size", "shifted_window_mask")
        wh, ww = _pair(attrs, "window", "shifted_window_mask")
        sh, sw = _pair(attrs, "shift", "shifted_window_mask", low=0)
        if H % wh or W % ww or not (sh < wh and sw < ww):
            raise ValueError(f"shifted_window_mask: windows {wh}x{ww} must tile the map {H}x{W} and the shift "
                             f"{sh},{sw} be smaller than a window")
        return [("float32", ((H // wh) * (W // ww), wh * ww, wh * ww))]

    def reference(self, args, attrs, dims):
        return [shifted_window_mask(attrs["size"], attrs["window"], attrs["shift"], attrs["value"])]

    def lower(self, node, ctx):
        (H, W), (wh, ww), (sh, sw) = node.attrs["size"], node.attrs["window"], node.attrs["shift"]
        return [ctx.call("dg::shifted_window_mask", ctx.write(node.outputs[0]), Named("H", H), Named("W", W),
                         Named("wh", wh), Named("ww", ww), Named("sh", sh), Named("sw", sw),
                         Named("value", f"{float(node.attrs['value'])!r}f"))]

    def describe(self, node):
        a = node.attrs
        return f"shifted_window_mask(size={a['size']}, window={a['window']}, shift={a['shift']}, value={a['value']:g})"

    def grad(self, node, gouts, gb):
        return []


@register
class RelativeCoordsTable(OpDef):
    name = "relative_coords_table"

    def infer(self, inputs, attrs):
        wh, ww = _pair(attrs, "window", "relative_coords_table", low=2)
        return [("float32", (2 * wh - 1, 2 * ww - 1, 2))]

    def reference(self, args, attrs, dims):
        return [relative_coords_table(*attrs["window"])]

    def lower(self, node, ctx):
        wh, ww = node.attrs["window"]
        return [ctx.call("dg::relative_coords_table", ctx.write(node.outputs[0]), Named("wh", wh), Named("ww", ww))]

    def describe(self, node):
        return f"relative_coords_table(window={node.attrs['window']})"

    def grad(self, node, gouts, gb):
        return []
