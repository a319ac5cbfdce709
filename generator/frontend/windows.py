"""The DSL's padding, rolling, strided slicing and windowed-attention tables (Swin, MaxViT).

Padding, rolling and strided slices are compositions of slices, concats, fills and reshapes,
which are exact and whose gradients the pipeline already has:

    y = dg.pad(x, (0, 0, 0, 1, 0, 1))          # torch.nn.functional.pad's order: last axis first
    y = dg.roll(x, (-3, -3), (1, 2))            # torch.roll
    y = x[:, 0::2, 1::2, :]                     # a step > 1: reshape, then the first of each step

The tables are ops of their own (ops/windows.py), made by the runtime:
`relative_position_index(window)` (gather a bias table with it), `shifted_window_mask(size,
window, shift)` and `relative_coords_table(window)` (Swin v2's continuous position bias input).
"""

from __future__ import annotations

from .builder import current
from .dsl import _tensor, concat, div, maximum, reshape, slice_axis, sqrt, sum as dsl_sum
from .source import user_loc
from ..errors import ModelError, ShapeError
from ..ir.shapes import fmt_shape

__all__ = ["pad", "roll", "normalize", "relative_position_index", "shifted_window_mask", "relative_coords_table"]


def _int(value, what, op, loc, low=None):
    if not isinstance(value, int) or isinstance(value, bool) or (low is not None and value < low):
        raise ModelError(f"{what} must be an int{'' if low is None else f' >= {low}'}, got {value!r}", loc, op)
    return value


def _fill(x, axis, count, value):
    shape = x.shape[:axis] + (count,) + x.shape[axis + 1:]
    return current().add("fill", [], {"shape": tuple(shape), "value": float(value)}, label="pad")[0]


def pad(x, pads, value=0.0, mode="constant", name=None):
    """torch.nn.functional.pad: `pads` is (before, after) for the last axis, then for the one
    before it, and so on; `value` fills the new positions; a negative pad crops. Only
    mode="constant"."""
    x = _tensor(x, "pad")
    loc = user_loc()
    if mode != "constant":
        raise ModelError(f"mode={mode!r} is not supported (only 'constant')", loc, "pad")
    pads = tuple(pads)
    if len(pads) % 2 or len(pads) // 2 > x.ndim:
        raise ShapeError(f"pads {pads} must be (before, after) pairs for at most {x.ndim} axes of '{x.name}' "
                         f"{fmt_shape(x.shape)}", loc, "pad")
    if x.value.dtype != "float32":
        raise ModelError(f"'{x.name}' is {x.value.dtype}; pad takes float32 tensors", loc, "pad")
    y = x
    for k in range(len(pads) // 2):
        axis = x.ndim - 1 - k
        before, after = (_int(p, "each pad", "pad", loc) for p in pads[2 * k: 2 * k + 2])
        if before < 0 or after < 0:
            y = slice_axis(y, axis, -before if before < 0 else None, after if after < 0 else None)
        pieces = ([_fill(y, axis, before, value)] if before > 0 else []) + [y] + \
                 ([_fill(y, axis, after, value)] if after > 0 else [])
        if len(pieces) > 1:
            last = not any(pads[2 * j: 2 * j + 2] != (0, 0) for j in range(k + 1, len(pads) // 2))
            y = concat(pieces, axis=axis, name=name if last else None)
    return y


def roll(x, shifts, dims, name=None):
    """torch.roll with dims given: element i of an axis moves to (i + shift) mod its length
    (a concat of the axis's two pieces)."""
    x = _tensor(x, "roll")
    loc = user_loc()
    shifts = tuple(shifts) if isinstance(shifts, (tuple, list)) else (shifts,)
    dims = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    if len(shifts) != len(dims):
        raise ModelError(f"{len(shifts)} shifts for {len(dims)} dims", loc, "roll")
    y, moves = x, []
    for shift, axis in zip(shifts, dims):
        shift, axis = _int(shift, "a shift", "roll", loc), _int(axis, "a dim", "roll", loc)
        if not -x.ndim <= axis < x.ndim:
            raise ShapeError(f"dim {axis} is out of range for '{x.name}' {fmt_shape(x.shape)}", loc, "roll")
        length = y.shape[axis]
        if not isinstance(length, int):
            raise ShapeError(f"roll along the symbolic axis {axis} ({length}) is not supported", loc, "roll")
        cut = length - shift % length if length else 0
        if cut not in (0, length):
            moves.append((axis % x.ndim, cut))
    for i, (axis, cut) in enumerate(moves):
        y = concat([slice_axis(y, axis, cut, None), slice_axis(y, axis, None, cut)], axis=axis,
                   name=name if i == len(moves) - 1 else None)
    return y


def strided_slice(x, axis, start, stop, step):
    """x[start:stop:step] along `axis` for step > 1: the range is cut (and zero-padded at its
    end) to a whole number of steps, reshaped to [..., count, step, ...], and the first of
    each step kept. Python's rules for the bounds (clamped to the axis)."""
    loc = user_loc()
    length = x.shape[axis]
    step = _int(step, "a slice step", "slice", loc, low=1)
    if not isinstance(length, int):
        raise ShapeError(f"a slice with step {step} of the symbolic axis {axis} ({length}) is not supported",
                         loc, "slice")
    picked = range(*slice(start, stop, step).indices(length))
    if len(picked) == 0:
        raise ShapeError(f"slice {start}:{stop}:{step} of axis {axis} of '{x.name}' {fmt_shape(x.shape)} is empty",
                         loc, "slice")
    first, count = picked.start, len(picked)
    end = first + count * step
    y = slice_axis(x, axis, first, min(end, length)) if (first, min(end, length)) != (0, length) else x
    if end > length:
        y = concat([y, _fill(y, axis, end - length, 0.0)], axis=axis)
    y = reshape(y, x.shape[:axis] + (count, step) + x.shape[axis + 1:])
    y = slice_axis(y, axis + 1, 0, 1)
    return reshape(y, x.shape[:axis] + (count,) + x.shape[axis + 1:])


def normalize(x, axis=-1, eps=1e-12, name=None):
    """torch.nn.functional.normalize (p=2): x / max(||x||, eps) along `axis`."""
    x = _tensor(x, "normalize")
    norm = sqrt(dsl_sum(x * x, axis=axis, keepdims=True))
    return div(x, maximum(norm, float(eps)), name=name)


def _window(value, what, op, loc, low=1):
    value = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    if len(value) != 2:
        raise ModelError(f"{what} must be an int or two ints, got {value!r}", loc, op)
    return tuple(_int(v, what, op, loc, low=low) for v in value)


def relative_position_index(window, name=None):
    """int64 [(wh*ww)^2]: for query p and key q of a wh x ww window (row-major), the row of a
    relative position bias table [(2wh-1)*(2ww-1), heads] holding the bias of q seen from p:
    `dg.gather(table, dg.relative_position_index((7, 7)))` is the bias [(49*49), heads]."""
    loc = user_loc()
    return current().add("relative_position_index", [],
                         {"window": _window(window, "window", "relative_position_index", loc)}, name=name)[0]


def shifted_window_mask(size, window, shift, value=-100.0, name=None):
    """float32 [windows, wh*ww, wh*ww]: Swin's additive mask of shifted-window attention over
    an H x W map (size) rolled by -shift: `value` between pixels of one window that came
    from different regions of the map, 0 elsewhere. Windows must tile the map."""
    loc = user_loc()
    attrs = {"size": _window(size, "size", "shifted_window_mask", loc),
             "window": _window(window, "window", "shifted_window_mask", loc),
             "shift": _window(shift, "shift", "shifted_window_mask", loc, low=0), "value": float(value)}
    (H, W), (wh, ww), (sh, sw) = attrs["size"], attrs["window"], attrs["shift"]
    if H % wh or W % ww or sh >= wh or sw >= ww:
        raise ShapeError(f"windows {wh}x{ww} must tile the map {H}x{W}, and the shift ({sh}, {sw}) be smaller "
                         "than a window", loc, "shifted_window_mask")
    return current().add("shifted_window_mask", [], attrs, name=name)[0]


def relative_coords_table(window, name=None):
    """float32 [2wh-1, 2ww-1, 2]: Swin v2's log-spaced relative coordinates of a window
    (sign(t) * log2(|t| + 1) / 3, t = 8 d / (w - 1) per axis), its position-bias MLP's input."""
    loc = user_loc()
    return current().add("relative_coords_table", [],
                         {"window": _window(window, "window", "relative_coords_table", loc, low=2)}, name=name)[0]

