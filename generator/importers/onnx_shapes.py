"""ONNX ops that move data or change shapes (reshape, transpose, concat, split, slice,
gather, expand) as DSL calls."""

from __future__ import annotations

import math

import numpy as np
import sympy

from .emitter import Var, code
from ..ir.shapes import evaluate
from .onnx_derived import Derived, embedding_rows
from .onnx_import import Const
from .onnx_common import _INT_MAX, _assign, _axis, _entries, _scalar, _x, converter

# -- shapes and data movement ----------------------------------------------------------


def _reshape_to(imp, node, x: Var, shape: list) -> Var:
    if list(shape) == list(x.tensor.shape):
        return x
    return _assign(imp, node, f"dg.reshape({x.name}, {code(tuple(shape))})")


@converter("Reshape")
def reshape(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    shape = _entries(imp, node, ins[1], "shape")
    if not attrs.get("allowzero", 0):
        shape = [x.tensor.shape[i] if isinstance(d, int) and d == 0 else d for i, d in enumerate(shape)]
    # A file exported at a fixed batch size writes it into reshapes: that size is the batch.
    if imp.static_batch and shape and all(isinstance(d, int) for d in shape) and x.tensor.ndim:

        lead = x.tensor.shape[0]
        if not isinstance(lead, int) and shape[0] == evaluate((lead,), imp.static_batch)[0]:
            shape[0] = lead
    return _reshape_to(imp, node, x, shape)


@converter("Flatten")
def flatten(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    axis = attrs.get("axis", 1)
    axis = axis % rank if rank else 0
    if axis == 1 and rank >= 2:
        return x if rank == 2 else _assign(imp, node, f"dg.flatten({x.name})")
    shape = tuple(x.tensor.shape)
    lead = sympy.expand(math.prod(sympy.sympify(d) for d in shape[:axis]))
    rest = sympy.expand(math.prod(sympy.sympify(d) for d in shape[axis:]))
    return _reshape_to(imp, node, x, [_scalar(lead), _scalar(rest)])


@converter("Transpose")
def transpose(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    perm = tuple(attrs.get("perm", range(x.tensor.ndim - 1, -1, -1)))
    if perm == tuple(range(x.tensor.ndim)):
        return x
    return _assign(imp, node, f"dg.transpose({x.name}, {code(perm)})")


@converter("Unsqueeze")
def unsqueeze(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    axes = _entries(imp, node, ins[1], "axes") if imp.opset >= 13 else attrs["axes"]
    shape = list(x.tensor.shape)
    rank = len(shape) + len(axes)
    for a in sorted(_axis(imp, node, int(a), rank) for a in axes):
        shape.insert(a, 1)
    return _reshape_to(imp, node, x, shape)


@converter("Squeeze")
def squeeze(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    shape = list(x.tensor.shape)
    given = (_entries(imp, node, ins[1], "axes") if len(ins) > 1 else None) if imp.opset >= 13 else attrs.get("axes")
    axes = ([i for i, d in enumerate(shape) if d == 1] if given is None
            else [_axis(imp, node, int(a), len(shape)) for a in given])
    for a in axes:
        if shape[a] != 1:
            raise imp.fail(node, f"axis {a} of {x.name} has size {shape[a]}, not 1")
    return _reshape_to(imp, node, x, [d for i, d in enumerate(shape) if i not in axes])


@converter("Concat")
def concat(imp, node, ins, attrs):
    parts = [imp.tensor(v, node, f"input{i}") for i, v in enumerate(ins)
             if not (isinstance(v, Const) and v.value.size == 0)]
    axis = attrs["axis"]
    if len(parts) == 1:
        return parts[0]
    return _assign(imp, node, f"dg.concat([{', '.join(p.name for p in parts)}], axis={axis})")


@converter("Split")
def split(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    axis = _axis(imp, node, attrs.get("axis", 0), x.tensor.ndim)
    sizes = (_entries(imp, node, ins[1], "split") if len(ins) > 1 and ins[1] is not None else None) \
        if imp.opset >= 13 else attrs.get("split")
    count = len(node.output)
    if sizes is None:
        length = x.tensor.shape[axis]
        if not isinstance(length, int):
            raise imp.fail(node, f"splitting the symbolic axis {axis} ({length}) in equal pieces is not supported")
        step = -(-length // count)
        sizes = [min(step, length - s) for s in range(0, length, step)]
    names = [imp.em.fresh(f"{imp.layer(node)}_{i}") for i in range(len(sizes))]
    imp.em.statement(f"{', '.join(names)}{',' if len(names) == 1 else ''} = "
                     f"dg.split({x.name}, {code(list(sizes))}, axis={axis})")
    return tuple(imp.em.var(n) for n in names)


def _slice_text(length, start, stop) -> str | None:
    """`a:b` for one axis (None: the whole axis), bounds clamped where the length is known."""
    if isinstance(length, int):
        lo = max(0, min(start + length if start < 0 else start, length))
        hi = max(0, min(stop + length if stop < 0 else stop, length))
        if lo == 0 and hi == length:
            return None
        return f"{lo if lo else ''}:{hi if hi != length else ''}"
    begin = "" if start == 0 else str(start)
    end = "" if stop >= _INT_MAX else str(stop)
    return None if not begin and not end else f"{begin}:{end}"


def _sliced(imp, node, x: Var, parts: dict, hint=None) -> str:
    """x[...] text with `parts` {axis: 'a:b'}, or x's name when nothing is sliced."""
    if not parts:
        return x.name
    last = max(parts)
    return f"{x.name}[{', '.join(parts.get(a, ':') for a in range(last + 1))}]"


@converter("Slice")
def slice_(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    if imp.opset >= 10:
        starts, ends = _entries(imp, node, ins[1], "starts"), _entries(imp, node, ins[2], "ends")
        axes = _entries(imp, node, ins[3], "axes") if len(ins) > 3 and ins[3] is not None else None
        steps = _entries(imp, node, ins[4], "steps") if len(ins) > 4 and ins[4] is not None else None
    else:
        starts, ends, axes, steps = attrs["starts"], attrs["ends"], attrs.get("axes"), None
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    parts = {}
    for s, e, a, st in zip(starts, ends, axes, steps):
        if not isinstance(st, int) or st < 1:
            raise imp.fail(node, f"a slice with step {st} is not supported (positive steps only)")
        if not isinstance(s, int) or not isinstance(e, int):
            raise imp.fail(node, "slice bounds that involve a symbolic dim are not supported")
        a = _axis(imp, node, a, rank)
        if st > 1:  # (Swin's patch merging: x[:, 0::2, 1::2])
            length = x.tensor.shape[a]
            if not isinstance(length, int):
                raise imp.fail(node, f"a slice with step {st} of the symbolic axis {a} is not supported")
            picked = range(*slice(s, min(e, length), st).indices(length))
            parts[a] = f"{picked.start}:{picked.stop if picked.stop < length else ''}:{st}"
            continue
        text = _slice_text(x.tensor.shape[a], s, e)
        if text is not None:
            parts[a] = text
    if not parts:
        return x
    return _assign(imp, node, _sliced(imp, node, x, parts))


@converter("Gather")
def gather(imp, node, ins, attrs):
    data, idx = ins
    axis = attrs.get("axis", 0)
    if isinstance(idx, Derived) and axis == 0:  # position ids, token types: rows of the table
        return embedding_rows(imp, node, imp.tensor(data, node, "weight"), idx)
    if isinstance(idx, Var):
        if axis != 0:
            raise imp.fail(node, f"gathering along axis {axis} by a tensor of indices is not supported (axis 0 only)")
        table = imp.tensor(data, node, "weight")
        return _assign(imp, node, f"dg.gather({table.name}, {idx.name})")
    x = _x(imp, node, data)
    rank = x.tensor.ndim
    axis = _axis(imp, node, axis, rank)
    if idx.symbolic:
        raise imp.fail(node, "indices that involve a symbolic dim are not supported")
    index = np.asarray(idx.value).astype(np.int64)
    length = x.tensor.shape[axis]
    flat = index.reshape(-1).tolist()
    if isinstance(length, int):
        flat = [i + length if i < 0 else i for i in flat]
    if index.ndim > 1 or any(b != a + 1 for a, b in zip(flat, flat[1:])) or not flat:
        raise imp.fail(node, f"gathering {index.tolist()} along axis {axis} is not supported (one index, or a run of "
                             "consecutive ones)")
    start, stop = flat[0], flat[-1] + 1
    if start < 0 and stop == 0:
        stop = _INT_MAX
    text = _slice_text(length, start, stop)
    sliced = _sliced(imp, node, x, {axis: text} if text else {})
    if index.ndim == 1:
        return _assign(imp, node, sliced) if text else x
    shape = list(x.tensor.shape[:axis]) + list(x.tensor.shape[axis + 1:])
    return _assign(imp, node, f"dg.reshape({sliced}, {code(tuple(shape))})")


@converter("Expand")
def expand(imp, node, ins, attrs):
    x = imp.tensor(ins[0], node, "input")
    shape = _entries(imp, node, ins[1], "shape")
    have = list(x.tensor.shape)
    rank = max(len(have), len(shape))
    have = [1] * (rank - len(have)) + have
    want = [1] * (rank - len(shape)) + list(shape)
    out = []
    for h, w in zip(have, want):
        if isinstance(w, int) and w == 1:
            out.append(h)
        elif isinstance(h, int) and h == 1 or sympy.sympify(h - w).is_zero:
            out.append(w)
        else:
            raise imp.fail(node, f"{x.name} {tuple(x.tensor.shape)} does not broadcast to {tuple(shape)}")
    if out == list(x.tensor.shape):
        return x
    return _assign(imp, node, f"dg.expand({x.name}, {code(tuple(out))})")
