"""ONNX nodes whose inputs are all known at import, computed here (folders): numpy for
the ops exporters use on sizes, symbolic sizes (sympy expressions in object arrays)
included, onnx's reference evaluator for other numeric ops."""

from __future__ import annotations

import numpy as np
import sympy

from .onnx_import import Const
from .onnx_common import _axis, _normalize, _onnx_dtype

# -- folding (every input known at import) ------------------------------------------


def _fold_cast(imp, node, ins, attrs):
    x, to = ins[0], attrs.get("to")
    target = _onnx_dtype(to)
    if target is None:
        raise imp.fail(node, f"Cast to ONNX type {to} is not supported")
    if x.dtype == object:
        if np.issubdtype(target, np.integer):
            return x
        raise imp.fail(node, "a size that involves a symbolic dim is cast to a float; deepgen computes sizes as "
                             "integers only")
    return x.astype(target)


def _fold_div(imp, node, ins, attrs):
    a, b = ins
    if a.dtype == object or b.dtype == object:
        a, b = np.broadcast_arrays(a.astype(object), b.astype(object))
        out = np.empty(a.shape, dtype=object)
        for i in np.ndindex(a.shape):
            q = sympy.cancel(sympy.sympify(a[i]) / sympy.sympify(b[i]))
            if sympy.fraction(q)[1] != 1:
                raise imp.fail(node, f"the size {a[i]} does not divide by {b[i]} for every value of its dims")
            out[i] = q
        return out
    if a.dtype.kind in "iu" and b.dtype.kind in "iu":
        return (np.trunc(a / b)).astype(np.result_type(a, b))  # ONNX's integer Div truncates
    return (a / b).astype(np.result_type(a, b))


def _fold_slice(imp, node, ins, attrs):
    x = ins[0]
    if imp.opset >= 10:
        starts, ends = ins[1].tolist(), ins[2].tolist()
        axes = ins[3].tolist() if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = ins[4].tolist() if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    else:
        starts, ends = attrs["starts"], attrs["ends"]
        axes, steps = attrs.get("axes", list(range(len(starts)))), [1] * len(starts)
    index = [slice(None)] * x.ndim
    for s, e, a, st in zip(starts, ends, axes, steps):
        index[_axis(imp, node, int(a), x.ndim)] = slice(int(s), int(e), int(st))
    return x[tuple(index)]


def _unsqueeze_axes(imp, node, ins, attrs):
    return [int(a) for a in (ins[1].tolist() if imp.opset >= 13 else attrs["axes"])]


def _fold_unsqueeze(imp, node, ins, attrs):
    x, axes = ins[0], _unsqueeze_axes(imp, node, ins, attrs)
    rank = x.ndim + len(axes)
    for a in sorted(_axis(imp, node, a, rank) for a in axes):
        x = np.expand_dims(x, a)
    return x


def _squeeze_axes(imp, node, ins, attrs, shape):
    given = (ins[1] if len(ins) > 1 else None) if imp.opset >= 13 else attrs.get("axes")
    if given is None:
        return [i for i, d in enumerate(shape) if d == 1]
    given = given.tolist() if isinstance(given, np.ndarray) else given
    return sorted(_axis(imp, node, int(a), len(shape)) for a in given)


def _fold_squeeze(imp, node, ins, attrs):
    x = ins[0]
    return np.squeeze(x, axis=tuple(_squeeze_axes(imp, node, ins, attrs, x.shape)))


def _fold_reshape(imp, node, ins, attrs):
    x, shape = ins[0], [int(d) for d in ins[1].tolist()]
    if not attrs.get("allowzero", 0):
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return x.reshape(shape)


def _fold_concat(imp, node, ins, attrs):
    parts = [p for p in ins if p is not None]
    dtype = object if any(p.dtype == object for p in parts) else None
    return np.concatenate([p.astype(object) if dtype else p for p in parts], axis=attrs.get("axis", 0))


def _fold_gather(imp, node, ins, attrs):
    data, idx = ins
    return np.take(data, idx.astype(np.int64), axis=attrs.get("axis", 0))


def _fold_constant_of_shape(imp, node, ins, attrs):
    from onnx import numpy_helper

    shape = ins[0]
    if shape.dtype == object:
        raise imp.fail(node, "a constant tensor whose size involves a symbolic dim is not supported")
    fill = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)
    return np.full([int(d) for d in shape.tolist()], fill.reshape(-1)[0], dtype=fill.dtype)


class _Symbolic(Exception):
    """A folder met a symbolic size it cannot make an array of: the converter writes the node."""


def _fold_expand(imp, node, ins, attrs):
    x, shape = ins
    if shape.dtype == object:
        raise _Symbolic()
    target = np.broadcast_shapes(x.shape, tuple(int(d) for d in shape.tolist()))
    return np.broadcast_to(x, target).copy()


def _fold_equal(imp, node, ins, attrs):
    a, b = ins
    if a.dtype == object or b.dtype == object:
        a, b = np.broadcast_arrays(a.astype(object), b.astype(object))
        out = np.empty(a.shape, dtype=bool)
        for i in np.ndindex(a.shape):
            diff = sympy.simplify(sympy.sympify(a[i]) - sympy.sympify(b[i]))
            if diff.is_zero is None and not (diff.is_positive or diff.is_negative):
                # A dim against a constant it may equal: dims are sizes, so -1 (an exporter's
                # "infer") never does; anything else depends on the size.
                if not ((diff + 1).is_positive or (diff - 1).is_negative):
                    raise imp.fail(node, f"whether {a[i]} equals {b[i]} depends on the size")
            out[i] = bool(diff.is_zero)
        return out
    return np.equal(a, b)


def _numeric(imp, node, x):
    if x.dtype == object:
        raise imp.fail(node, "a size that involves a symbolic dim is used in float arithmetic; deepgen computes "
                             "sizes as integers only")
    return x


def _fold_arith(fn):
    def fold(imp, node, ins, attrs):
        a, b = ins
        if a.dtype == object or b.dtype == object:
            return fn(a.astype(object), b.astype(object))
        return fn(a, b).astype(np.result_type(a, b))

    return fold


def _fold_where(imp, node, ins, attrs):
    c, a, b = ins
    return np.where(c.astype(bool), a, b)


def _fold_shape_of(imp, node, ins, attrs):
    return _shape_slice(np.array(ins[0].shape, dtype=np.int64), attrs)


def _shape_slice(sizes: np.ndarray, attrs) -> np.ndarray:
    start, end = attrs.get("start", 0), attrs.get("end")
    return sizes[start:end]


FOLDERS = {
    "Identity": lambda imp, node, ins, attrs: ins[0],
    "Cast": _fold_cast,
    "Shape": _fold_shape_of,
    "Size": lambda imp, node, ins, attrs: np.array(ins[0].size, dtype=np.int64),
    "Gather": _fold_gather,
    "Slice": _fold_slice,
    "Concat": _fold_concat,
    "Unsqueeze": _fold_unsqueeze,
    "Squeeze": _fold_squeeze,
    "Reshape": _fold_reshape,
    "Flatten": lambda imp, node, ins, attrs: ins[0].reshape(
        int(np.prod(ins[0].shape[: attrs.get("axis", 1)])), -1),
    "Transpose": lambda imp, node, ins, attrs: np.transpose(ins[0], attrs.get("perm")),
    "Add": _fold_arith(lambda a, b: a + b),
    "Sub": _fold_arith(lambda a, b: a - b),
    "Mul": _fold_arith(lambda a, b: a * b),
    "Div": _fold_div,
    "Neg": lambda imp, node, ins, attrs: -ins[0],
    "Equal": _fold_equal,
    "Where": _fold_where,
    "ConstantOfShape": _fold_constant_of_shape,
    "Expand": _fold_expand,
    "Sqrt": lambda imp, node, ins, attrs: np.sqrt(_numeric(imp, node, ins[0])),
    "Reciprocal": lambda imp, node, ins, attrs: (1 / _numeric(imp, node, ins[0])).astype(ins[0].dtype),
    "Dropout": lambda imp, node, ins, attrs: ins[0],
}


def _evaluate(imp, node, arrays):
    """A numeric node folded by onnx's reference evaluator (ops FOLDERS does not know)."""
    from onnx.reference import ReferenceEvaluator

    feeds = {name: a for name, a in zip(node.input, arrays) if name}
    try:
        results = ReferenceEvaluator(node, opsets={"": imp.opset}).run(None, feeds)
    except Exception as e:
        first = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise imp.fail(node, f"folding it at import failed: {first}") from None
    return tuple(np.asarray(r) for r in results)


def _fold(imp, node, ins, attrs):
    """A node of known inputs, computed at import."""
    arrays = [v.value if v is not None else None for v in ins]
    op = node.op_type
    if op in FOLDERS:
        if op == "Identity" and ins[0].name is not None:  # an alias of an initializer: a parameter of its own
            out = node.output[0]
            return Const(ins[0].value.copy(), None if out.startswith("onnx::") or "/" in out else out)
        result = FOLDERS[op](imp, node, arrays, attrs)
        return Const(_normalize(np.asarray(result)))
    if any(a is not None and a.dtype == object for a in arrays):
        raise imp.fail(node, "it computes on sizes that involve a symbolic dim, which deepgen does not fold for this op")
    return tuple(Const(r) for r in _evaluate(imp, node, arrays))


def _constant(imp, node, attrs) -> np.ndarray:
    from onnx import numpy_helper

    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in attrs:
            return np.array(attrs[key], dtype=dtype)
    raise imp.fail(node, f"a Constant given as {', '.join(attrs) or 'nothing'} is not supported")
