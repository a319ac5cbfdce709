"""ONNX nodes as DSL statements (converters), or as values computed at import (folders).

`convert(imp, node)` gives each output of `node` a value in `imp.env`: a Var (a
tensor of the written model) or a Const (known at import). A node whose inputs
are all Consts is folded here with numpy, sizes that involve a symbolic dim
included (object arrays of sympy expressions): that is how the Shape / Gather /
Concat arithmetic of an exported `x.view(b * t, e)` becomes `(N * T, 8)`.
Numeric nodes of other ops fold through onnx's reference evaluator. Otherwise
the op's converter writes the statement.

`plan(imp, nodes)` runs first and finds the layers written as one statement:
a Conv and the activation that alone reads it (`act=`), a MatMul by a weight
and the bias Add after it, GELU's Erf pattern.
"""

from __future__ import annotations

import math

import numpy as np
import sympy

from ..errors import DeepgenError
from .emitter import Var, code
from .onnx_import import Const, Unsupported, identifier, number, scope

_INT_MAX = 2**62  # ends at or past this (INT64_MAX in exporters' slices) mean "to the end"


# -- helpers ------------------------------------------------------------------------


def _attrs(node) -> dict:
    from onnx import helper

    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _entries(imp, node, value, what) -> list:
    """A Const's entries as Python ints or sympy sizes (axes, sizes, pads given as inputs)."""
    if value is None:
        return None
    if not isinstance(value, Const):
        raise imp.fail(node, f"its {what} is computed from tensors at run time; deepgen needs it known at import")
    return [_scalar(v) for v in np.asarray(value.value).reshape(-1)]


def _scalar(v):
    if isinstance(v, sympy.Basic):
        return int(v) if v.is_Integer else v
    if isinstance(v, (np.integer, int)):
        return int(v)
    if isinstance(v, (np.floating, float)):
        return float(v)
    return v


def _normalize(array: np.ndarray) -> np.ndarray:
    """An object array whose sizes all turned out concrete, as int64 again."""
    if array.dtype != object:
        return array
    flat = [_scalar(v) for v in array.reshape(-1)]
    if all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
        return np.array(flat, dtype=np.int64).reshape(array.shape)
    out = np.empty(array.shape, dtype=object)
    out.reshape(-1)[:] = flat
    return out


def _sizes(shape) -> np.ndarray:
    return _normalize(np.array(list(shape) or [], dtype=object).reshape(len(shape)))


def _axis(imp, node, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise imp.fail(node, f"axis {axis} is out of range for rank {rank}")
    return axis % rank if rank else 0


def _text(imp, node, value, role="input") -> str:
    """An operand of an expression: a variable, a number (a one-element Const), or a parameter."""
    if isinstance(value, Const):
        inline = imp.inline(value)
        if inline is not None:
            return inline
    return imp.tensor(value, node, role).name


def _onnx_dtype(to: int):
    return {1: np.float32, 6: np.int32, 7: np.int64, 9: np.bool_, 10: np.float16, 11: np.float64,
            2: np.uint8, 3: np.int8, 5: np.int16}.get(to)


def _pair(values) -> str:
    values = tuple(values)
    return code(values[0]) if len(set(values)) == 1 else code(values)


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


# -- converters (a tensor of the model among the inputs) ------------------------------

CONVERTERS: dict = {}


def converter(*ops):
    def register(fn):
        for op in ops:
            CONVERTERS[op] = fn
        return fn

    return register


def _x(imp, node, value, role="input") -> Var:
    return imp.tensor(value, node, role)


def _assign(imp, node, expr: str, hint: str | None = None) -> Var:
    return imp.em.assign(hint or imp.layer(node), expr)


_UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Exp": "exp", "Log": "log", "Sqrt": "sqrt",
          "Abs": "abs", "Softplus": "softplus", "Softsign": "softsign", "HardSwish": "hardswish", "Sin": "sin",
          "Cos": "cos"}


@converter(*_UNARY)
def unary(imp, node, ins, attrs):
    return _assign(imp, node, f"dg.{_UNARY[node.op_type]}({_x(imp, node, ins[0]).name})")


@converter("Neg")
def neg(imp, node, ins, attrs):
    return _assign(imp, node, f"-{_x(imp, node, ins[0]).name}")


@converter("Reciprocal")
def reciprocal(imp, node, ins, attrs):
    return _assign(imp, node, f"1.0 / {_x(imp, node, ins[0]).name}")


@converter("Erf")
def erf(imp, node, ins, attrs):
    raise Unsupported(f"unsupported ONNX op: {imp.describe(node)}; deepgen reads Erf only inside GELU's pattern "
                      "x * 0.5 * (1 + erf(x / sqrt(2)))")


_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Pow": "**"}


@converter(*_BINARY)
def binary(imp, node, ins, attrs):
    a, b = ins
    if node.op_type == "Pow" and isinstance(a, Var) and isinstance(b, Const) and imp.inline(b) is not None:
        exponent = float(b.value.reshape(-1)[0])
        if exponent == 1:
            return a
        if exponent in (2, 0.5):
            return _assign(imp, node, f"dg.{'square' if exponent == 2 else 'sqrt'}({a.name})")
    for v in (a, b):
        if isinstance(v, Var) and v.tensor.dtype != "float32" and node.op_type in ("Div", "Pow"):
            raise imp.fail(node, f"{node.op_type} of {v.tensor.dtype} tensors is not supported")
    left = _text(imp, node, a, "input")
    right = _text(imp, node, b, "bias" if node.op_type in ("Add", "Sub") else "scale")
    return _assign(imp, node, f"{left} {_BINARY[node.op_type]} {right}")


@converter("Sum")
def sum_(imp, node, ins, attrs):
    return _assign(imp, node, " + ".join(_text(imp, node, v, f"input{i}") for i, v in enumerate(ins)))


@converter("Min", "Max")
def min_max(imp, node, ins, attrs):
    fn = "minimum" if node.op_type == "Min" else "maximum"
    texts = [_text(imp, node, v, f"input{i}") for i, v in enumerate(ins)]
    expr = texts[0]
    for t in texts[1:]:
        expr = f"dg.{fn}({expr}, {t})"
    return _assign(imp, node, expr) if len(texts) > 1 else _x(imp, node, ins[0])


def _clip_bounds(imp, node, ins, attrs):
    if imp.opset >= 11:
        lo, hi = (ins[i] if len(ins) > i else None for i in (1, 2))
        bounds = []
        for v, what in ((lo, "min"), (hi, "max")):
            if v is None:
                bounds.append(None)
            elif isinstance(v, Const) and v.value.size == 1 and not v.symbolic:
                bounds.append(float(v.value.reshape(-1)[0]))
            else:
                raise imp.fail(node, f"its {what} is computed at run time; deepgen needs it known at import")
        return bounds
    lo, hi = attrs.get("min"), attrs.get("max")
    return [None if lo is None or lo <= -3.4e38 else lo, None if hi is None or hi >= 3.4e38 else hi]


def _activation(imp, node) -> str | None:
    """The DSL function an activation node is (`dg.relu`), for conv2d_layer's act=; None
    when it is no single function of the DSL."""
    op, attrs = node.op_type, _attrs(node)
    fused = imp.fused.get(id(node))
    if fused:
        return f"dg.{fused[1]}" if fused[0] == "unary" else None
    if op in ("Relu", "HardSwish", "Sigmoid", "Tanh"):
        return f"dg.{_UNARY[op]}"
    if op == "HardSigmoid" and _standard_hardsigmoid(attrs):
        return "dg.hardsigmoid"
    if op == "Gelu" and attrs.get("approximate", "none") == "none":
        return "dg.gelu"
    if op == "Clip":
        ins = [Const(imp.static_const(i)) if i and imp.static_const(i) is not None else None for i in node.input]
        if any(i and c is None for i, c in zip(node.input[1:], ins[1:])):
            return None
        try:
            bounds = _clip_bounds(imp, node, ins, attrs)
        except DeepgenError:
            return None
        return {(0.0, 6.0): "dg.relu6", (0.0, None): "dg.relu"}.get(tuple(bounds))
    return None


@converter("Clip")
def clip(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    lo, hi = _clip_bounds(imp, node, ins, attrs)
    if (lo, hi) == (0.0, 6.0):
        return _assign(imp, node, f"dg.relu6({x.name})")
    if (lo, hi) == (0.0, None):
        return _assign(imp, node, f"dg.relu({x.name})")
    expr = x.name
    if lo is not None:
        expr = f"dg.maximum({expr}, {number(lo)})"
    if hi is not None:
        expr = f"dg.minimum({expr}, {number(hi)})"
    return _assign(imp, node, expr) if expr != x.name else x


def _standard_hardsigmoid(attrs) -> bool:
    return abs(attrs.get("alpha", 0.2) - 1 / 6) < 1e-6 and abs(attrs.get("beta", 0.5) - 0.5) < 1e-7


@converter("HardSigmoid")
def hardsigmoid(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    if _standard_hardsigmoid(attrs):
        return _assign(imp, node, f"dg.hardsigmoid({x.name})")
    alpha, beta = number(attrs.get("alpha", 0.2)), number(attrs.get("beta", 0.5))
    return _assign(imp, node, f"dg.minimum(dg.maximum({x.name} * {alpha} + {beta}, 0.0), 1.0)")


@converter("LeakyRelu")
def leaky_relu(imp, node, ins, attrs):
    return _assign(imp, node, f"dg.leaky_relu({_x(imp, node, ins[0]).name}, alpha={number(attrs.get('alpha', 0.01))})")


@converter("Elu")
def elu(imp, node, ins, attrs):
    return _assign(imp, node, f"dg.elu({_x(imp, node, ins[0]).name}, alpha={number(attrs.get('alpha', 1.0))})")


@converter("Gelu")
def gelu(imp, node, ins, attrs):
    x = _x(imp, node, ins[0]).name
    if attrs.get("approximate", "none") == "tanh":
        return _assign(imp, node, f"0.5 * {x} * (1.0 + dg.tanh(0.7978845608028654 * ({x} + 0.044715 * {x} ** 3)))")
    return _assign(imp, node, f"dg.gelu({x})")


@converter("Identity", "Dropout")
def identity(imp, node, ins, attrs):
    if node.op_type == "Dropout" and len(ins) > 2 and isinstance(ins[2], Const) and ins[2].value.any():
        raise imp.fail(node, "training_mode=True is not supported (export the model in eval mode)")
    return ins[0]


@converter("Pad")
def pad(imp, node, ins, attrs):
    """Padding by zero on every side (torchvision's Swin pads to a window multiple that the
    sizes already are) is the tensor itself; anything else needs a pad op the DSL lacks."""
    pads = attrs.get("pads") if imp.opset < 11 else _entries(imp, node, ins[1], "pads")
    if pads is not None and all(isinstance(p, int) and p == 0 for p in pads):
        return _x(imp, node, ins[0])
    raise Unsupported(f"unsupported ONNX op: {imp.describe(node)} with pads {pads} (deepgen has no pad op; "
                      "zero pads only)")


@converter("Cast")
def cast(imp, node, ins, attrs):
    x, target = ins[0], _onnx_dtype(attrs.get("to"))
    have = x.tensor.dtype
    if (target is np.float32 and have == "float32") or (target in (np.int64, np.int32) and have in ("int64", "int32")):
        return x
    name = np.dtype(target).name if target is not None else f"ONNX type {attrs.get('to')}"
    raise imp.fail(node, f"a cast of the {have} tensor {x.name} to {name} is not supported")


# -- layers --------------------------------------------------------------------------


def _conv_geometry(imp, node, attrs, kernel):
    if any(d != 1 for d in attrs.get("dilations", [1, 1])) and node.op_type != "Conv":
        raise imp.fail(node, f"dilations {attrs['dilations']} are not supported")
    strides = list(attrs.get("strides", [1] * len(kernel)))
    pads = list(attrs.get("pads", [0] * 2 * len(kernel)))
    auto = attrs.get("auto_pad", "NOTSET")
    dilations = list(attrs.get("dilations", [1] * len(kernel)))
    if auto == "VALID":
        pads = [0] * 2 * len(kernel)
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        spans = [d * (k - 1) for d, k in zip(dilations, kernel)]
        if any(s != 1 for s in strides) or any(s % 2 for s in spans):
            raise imp.fail(node, f"auto_pad={auto} with strides {strides} and kernel {list(kernel)} pads unevenly; "
                                 "deepgen pads both sides alike")
        pads = [s // 2 for s in spans] * 2
    elif auto != "NOTSET":
        raise imp.fail(node, f"auto_pad={auto} is not supported")
    half = len(pads) // 2
    if pads[:half] != pads[half:]:
        raise imp.fail(node, f"pads {pads} differ at the start and the end of an axis; deepgen pads both sides alike")
    return strides, pads[:half], dilations


@converter("Conv")
def conv(imp, node, ins, attrs):
    x, w = _x(imp, node, ins[0]), ins[1]
    b = ins[2] if len(ins) > 2 else None
    if x.tensor.ndim != 4:
        raise imp.fail(node, f"a {x.tensor.ndim - 2}-D convolution is not supported (deepgen's is 2-D, NCHW)")
    shape = w.value.shape if isinstance(w, Const) else tuple(w.tensor.shape)
    kernel = list(attrs.get("kernel_shape", shape[2:]))
    strides, pads, dilations = _conv_geometry(imp, node, attrs, kernel)
    groups = attrs.get("group", 1)
    fused = imp.fused.get(id(node))
    act = fused[2] if fused else None
    opts = []
    for key, value, default in (("stride", strides, [1, 1]), ("padding", pads, [0, 0]),
                                ("dilation", dilations, [1, 1])):
        if list(value) != default:
            opts.append(f"{key}={_pair(value)}")
    if groups != 1:
        opts.append(f"groups={groups}")
    if isinstance(w, Const) and (b is None or isinstance(b, Const)) and not w.symbolic:
        base = imp.layer_base(node, ("weight", "bias"))
        imp.store(f"{base}_weight", w.value)
        if b is not None:
            imp.store(f"{base}_bias", b.value)
        else:
            opts.append("bias=False")
        if act:
            opts.append(f"act={act}")
        opts.append(f'name="{base}"')
        out = imp.em.assign(base, f"dg.conv2d_layer({x.name}, {shape[0]}, {_pair(kernel)}, {', '.join(opts)})")
    else:
        operands = [x.name, imp.tensor(w, node, "weight").name] + ([imp.tensor(b, node, "bias").name] if b else [])
        out = _assign(imp, node, f"dg.conv2d({', '.join(operands + opts)})")
        if act:
            out = imp.em.assign(imp.layer(fused[1]), f"{act}({out.name})")
    if fused:
        imp.env[fused[1].output[0]] = out
    return out


@converter("BatchNormalization")
def batch_norm(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    if attrs.get("training_mode", 0):
        raise imp.fail(node, "training_mode=1 is not supported (export the model in eval mode)")
    stats = ins[1:5]
    if not all(isinstance(s, Const) and not s.symbolic for s in stats):
        raise imp.fail(node, "its scale, bias, mean and variance must be initializers")
    base = imp.layer_base(node, ("weight", "bias", "running_mean", "running_var"))
    for role, s in zip(("weight", "bias", "running_mean", "running_var"), stats):
        imp.store(f"{base}_{role}", s.value)
    eps = number(attrs.get("epsilon", 1e-5))
    momentum = float(f"{1 - attrs.get('momentum', 0.9):.6g}")  # ONNX keeps the old statistic's weight
    return imp.em.assign(base, f'dg.batch_norm_layer({x.name}, eps={eps}, momentum={momentum!r}, name="{base}")')


@converter("LayerNormalization")
def layer_norm(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    if _axis(imp, node, attrs.get("axis", -1), rank) != rank - 1:
        raise imp.fail(node, f"normalizing from axis {attrs.get('axis')} is not supported (the last axis only)")
    w = imp.tensor(ins[1], node, "weight")
    if len(ins) > 2 and ins[2] is not None:
        b = imp.tensor(ins[2], node, "bias")
    else:
        b = imp.param(Const(np.zeros(x.tensor.shape[-1], np.float32)), node, "bias")
    eps = number(attrs.get("epsilon", 1e-5))
    return _assign(imp, node, f"dg.layer_norm({x.name}, {w.name}, {b.name}, eps={eps})")


@converter("Gemm")
def gemm(imp, node, ins, attrs):
    a, bm = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if attrs.get("transA", 0):
        raise imp.fail(node, "transA=1 is not supported")
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if alpha != 1.0:
        if not isinstance(bm, Const):
            raise imp.fail(node, f"alpha={alpha} with a B computed at run time is not supported")
        bm = Const((bm.value * np.float32(alpha)).astype(np.float32), bm.name)
        imp.em.note(f"{bm.name or 'B'} times alpha = {number(alpha)} (Gemm {node.name or node.output[0]})")
    if beta != 1.0 and c is not None:
        if not isinstance(c, Const):
            raise imp.fail(node, f"beta={beta} with a C computed at run time is not supported")
        c = Const((c.value * np.float32(beta)).astype(np.float32), c.name)
        imp.em.note(f"{c.name or 'C'} times beta = {number(beta)} (Gemm {node.name or node.output[0]})")
    x = _x(imp, node, a)
    w = imp.tensor(bm, node, "weight")
    bias = _text(imp, node, c, "bias") if c is not None else None
    one_dim = c is None or isinstance(c, Const) and c.value.ndim <= 1 or isinstance(c, Var) and c.tensor.ndim == 1
    if attrs.get("transB", 0) and one_dim:
        return _assign(imp, node, f"dg.linear_t({x.name}, {w.name}{', ' + bias if bias else ''})")
    product = f"dg.matmul({x.name}, {w.name}{', tb=True' if attrs.get('transB', 0) else ''})"
    return _assign(imp, node, product + (f" + {bias}" if bias else ""))


@converter("MatMul")
def matmul(imp, node, ins, attrs):
    a, b = ins
    fused = imp.fused.get(id(node))
    if isinstance(a, Const) and isinstance(b, Var):
        if a.value.ndim != 2 or b.tensor.ndim != 2:
            raise imp.fail(node, "a constant left operand is supported with 2-D operands only")
    elif isinstance(b, Var) and b.tensor.ndim > 2 and a.tensor.ndim != b.tensor.ndim:
        raise imp.fail(node, f"a batched product of ranks {a.tensor.ndim} and {b.tensor.ndim} (broadcast) is not "
                             "supported")
    hint = (identifier("_".join(scope(node))) if scope(node) else imp.layer(fused[1])) if fused else None
    left, right = imp.tensor(a, node, "weight", hint), imp.tensor(b, node, "weight", hint)
    if left.tensor.ndim < 2 or right.tensor.ndim < 2:
        raise imp.fail(node, "a product with a 1-D operand is not supported")
    text = f"dg.matmul({left.name}, {right.name})"
    if fused:
        add, bias_name = fused[1], fused[2]
        bias = imp.tensor(imp.env[bias_name], add, "bias", hint)
        out = imp.em.assign(hint, f"{text} + {bias.name}")
        imp.env[add.output[0]] = out
        return out
    return _assign(imp, node, text)


def _pool(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    kernel = list(attrs["kernel_shape"])
    if len(kernel) != 2 or x.tensor.ndim != 4:
        raise imp.fail(node, f"{len(kernel)}-D pooling is not supported (deepgen's is 2-D, NCHW)")
    if any(d != 1 for d in attrs.get("dilations", [1, 1])):
        raise imp.fail(node, f"dilations {attrs['dilations']} are not supported")
    strides, pads, _ = _conv_geometry(imp, node, {k: v for k, v in attrs.items() if k != "dilations"}, kernel)
    if node.op_type == "AveragePool" and not attrs.get("count_include_pad", 0) and any(pads):
        raise imp.fail(node, "count_include_pad=0 with padding is not supported (deepgen counts the padding, as "
                             "PyTorch's default)")
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        raise imp.fail(node, "its Indices output is not supported")
    opts = [_pair(kernel)]
    if strides != kernel:
        opts.append(f"stride={_pair(strides)}")
    if any(pads):
        opts.append(f"padding={_pair(pads)}")
    if attrs.get("ceil_mode", 0):
        opts.append("ceil_mode=True")
    fn = "max_pool2d" if node.op_type == "MaxPool" else "avg_pool2d"
    return _assign(imp, node, f"dg.{fn}({x.name}, {', '.join(opts)})")


CONVERTERS["MaxPool"] = CONVERTERS["AveragePool"] = _pool


@converter("GlobalAveragePool", "GlobalMaxPool")
def global_pool(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    fn = "mean" if node.op_type == "GlobalAveragePool" else "max"
    axes = tuple(range(2, x.tensor.ndim))
    return _assign(imp, node, f"dg.{fn}({x.name}, axis={code(axes)}, keepdims=True)")


@converter("Softmax", "LogSoftmax")
def softmax(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    axis = _axis(imp, node, attrs.get("axis", -1 if imp.opset >= 13 else 1), rank)
    if imp.opset < 13 and any(d != 1 for d in x.tensor.shape[axis + 1:]):
        raise imp.fail(node, f"opset {imp.opset}'s softmax over axes {axis}.. flattened together is not supported "
                             "(only over the last axis)")
    if imp.opset < 13:
        axis = rank - 1
    fn = "softmax" if node.op_type == "Softmax" else "log_softmax"
    return _assign(imp, node, f"dg.{fn}({x.name}, axis={-1 if axis == rank - 1 else axis})")


@converter("ReduceMean", "ReduceSum", "ReduceMax")
def reduce(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    in_attr = imp.opset < (13 if node.op_type == "ReduceSum" else 18)
    axes = attrs.get("axes") if in_attr else _entries(imp, node, ins[1] if len(ins) > 1 else None, "axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return x
        axes = list(range(x.tensor.ndim))
    axes = tuple(sorted(_axis(imp, node, int(a), x.tensor.ndim) for a in axes))
    fn = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "max"}[node.op_type]
    keep = ", keepdims=True" if attrs.get("keepdims", 1) else ""
    axis = "" if len(axes) == x.tensor.ndim else f", axis={code(axes if len(axes) > 1 else axes[0])}"
    return _assign(imp, node, f"dg.{fn}({x.name}{axis}{keep})")


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
        from ..ir.shapes import evaluate

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
        if st != 1:
            raise imp.fail(node, f"a slice with step {st} is not supported (step 1 only)")
        if not isinstance(s, int) or not isinstance(e, int):
            raise imp.fail(node, "slice bounds that involve a symbolic dim are not supported")
        a = _axis(imp, node, a, rank)
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


# -- the node's driver ------------------------------------------------------------------


def convert(imp, node):
    """Give node's outputs their values in imp.env."""
    fused = imp.fused.get(id(node))
    if fused and fused[0] == "unary":  # an activation written as several nodes
        fn, x = fused[1:]
        imp.env[node.output[0]] = _assign(imp, node, f"dg.{fn}({_x(imp, node, imp.env[x]).name})",
                                          imp.layer(node, fn))
        return
    if fused and fused[0] == "layer_norm":
        imp.env[node.output[0]] = _layer_norm_pattern(imp, node, *fused[1:])
        return
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(f"unsupported ONNX op: {imp.describe(node)} (deepgen reads the standard ai.onnx domain)")
    ins = []
    for name in node.input:
        if not name:
            ins.append(None)
        elif name not in imp.env:
            raise imp.fail(node, f"its input {name!r} is neither a graph input, an initializer nor an earlier "
                                 "node's output")
        else:
            ins.append(imp.env[name])
    attrs = _attrs(node)
    op = node.op_type
    if op == "Constant":
        result = Const(_constant(imp, node, attrs))
    elif op in ("Shape", "Size") and isinstance(ins[0], Var):
        sizes = _sizes(ins[0].tensor.shape)
        if op == "Size":
            total = sympy.expand(math.prod(sympy.sympify(d) for d in ins[0].tensor.shape))
            result = Const(_normalize(np.array(_scalar(total), dtype=object)))
        else:
            result = Const(_shape_slice(sizes, attrs))
    elif any(v is not None for v in ins) and all(v is None or isinstance(v, Const) for v in ins):
        try:
            result = _fold(imp, node, ins, attrs)
        except _Symbolic:
            result = CONVERTERS[op](imp, node, ins, attrs)
    else:
        fn = CONVERTERS.get(op)
        if fn is None:
            raise Unsupported(f"unsupported ONNX op: {imp.describe(node)}")
        result = fn(imp, node, ins, attrs)
    results = result if isinstance(result, tuple) else (result,)
    for i, out in enumerate(node.output):
        if not out:
            continue
        if i >= len(results):
            if imp.consumers.get(out) or out in imp.graph_outputs:
                raise imp.fail(node, f"its output {i} ({out!r}) is not supported")
            continue
        imp.env[out] = results[i]


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


# -- patterns: several nodes, one statement -------------------------------------------


def plan(imp, nodes):
    """Mark the layers written as one statement (imp.fused, imp.absorbed)."""
    needed = {id(n) for n in nodes}

    def only_consumer(name):
        users = imp.consumers.get(name, [])
        if len(users) != 1 or name in imp.graph_outputs or id(users[0]) not in needed:
            return None
        return users[0]

    standard = [n for n in nodes if n.domain in ("", "ai.onnx")]
    for node in standard:  # activations written as several nodes
        if node.op_type == "Erf":
            _plan_gelu(imp, node, only_consumer)
        elif node.op_type in ("Sigmoid", "HardSigmoid"):
            _plan_gated(imp, node, only_consumer)
        elif node.op_type == "ReduceMean":
            _plan_layer_norm(imp, node, only_consumer)
    ends = {}  # what a multi-node activation reads -> the nodes that end one
    for node in standard:
        if imp.fused.get(id(node), ("",))[0] == "unary":
            ends.setdefault(imp.fused[id(node)][2], []).append(node)
    for node in standard:
        if id(node) in imp.absorbed:
            continue
        if node.op_type == "Conv":
            user = _sole_activation(imp, node.output[0], needed, ends.get(node.output[0], []))
            act = _activation(imp, user) if user is not None else None
            if act:
                imp.fused[id(node)] = ("act", user, act)
                imp.absorbed.add(id(user))
                for n in imp.consumers[node.output[0]]:  # (a gated activation's other node)
                    imp.absorbed.add(id(n))
        elif node.op_type == "MatMul" and len(node.input) == 2:
            weight = imp.static_const(node.input[1])
            user = only_consumer(node.output[0])
            if weight is None or weight.ndim != 2 or user is None or user.op_type != "Add":
                continue
            other = [i for i in user.input if i != node.output[0]]
            bias = imp.static_const(other[0]) if len(other) == 1 else None
            if (bias is not None and 1 <= bias.ndim <= 2 and bias.shape[-1] == weight.shape[1]
                    and bias.size == weight.shape[1] and other[0] in imp.initializers):
                imp.fused[id(node)] = ("bias", user, other[0])
                imp.absorbed.add(id(user))


def _sole_activation(imp, name, needed, ends):
    """The node that alone reads `name` (or ends the multi-node activation that alone reads it)."""
    users = imp.consumers.get(name, [])
    if name in imp.graph_outputs or not users or any(id(u) not in needed for u in users):
        return None
    if len(users) == 1 and id(users[0]) not in imp.absorbed:
        return users[0]
    if len(ends) == 1 and all(u is ends[0] or id(u) in imp.absorbed for u in users):
        return ends[0]
    return None


def _plan_gated(imp, gate, only_consumer):
    """x * sigmoid(x) -> dg.silu(x); x * hardsigmoid(x) (the standard one) -> dg.hardswish(x)."""
    if gate.op_type == "HardSigmoid" and not _standard_hardsigmoid(_attrs(gate)):
        return
    x = gate.input[0]
    mul = only_consumer(gate.output[0])
    if mul is None or mul.op_type != "Mul" or _other(mul, gate.output[0]) != x:
        return
    imp.absorbed.add(id(gate))
    imp.fused[id(mul)] = ("unary", "silu" if gate.op_type == "Sigmoid" else "hardswish", x)


def _near(value, target) -> bool:
    return value is not None and value.size == 1 and abs(float(value.reshape(-1)[0]) - target) < 1e-6 * max(1, target)


def _other(node, name):
    rest = [i for i in node.input if i != name]
    return rest[0] if len(rest) == 1 else None


def _plan_gelu(imp, erf, only_consumer):
    """x * 0.5 * (1 + erf(x / sqrt(2))) in the orders exporters write it -> dg.gelu(x)."""
    scaled = imp.producer.get(erf.input[0])
    if scaled is None or scaled.op_type not in ("Div", "Mul") or only_consumer(scaled.output[0]) is not erf:
        return
    x = scaled.input[0]
    k = imp.static_const(scaled.input[1])
    if not _near(k, math.sqrt(2) if scaled.op_type == "Div" else 1 / math.sqrt(2)):
        return
    add = only_consumer(erf.output[0])
    if add is None or add.op_type != "Add" or not _near(imp.static_const(_other(add, erf.output[0])), 1.0):
        return
    m1 = only_consumer(add.output[0])
    if m1 is None or m1.op_type != "Mul":
        return
    partner = _other(m1, add.output[0])
    group = [scaled, erf, add, m1]
    if partner == x:  # (x * (1 + erf)) * 0.5
        m2 = only_consumer(m1.output[0])
        if m2 is None or m2.op_type != "Mul" or not _near(imp.static_const(_other(m2, m1.output[0])), 0.5):
            return
        group.append(m2)
    elif _near(imp.static_const(partner), 0.5):  # ((1 + erf) * 0.5) * x
        m2 = only_consumer(m1.output[0])
        if m2 is None or m2.op_type != "Mul" or _other(m2, m1.output[0]) != x:
            return
        group.append(m2)
    else:  # (x * 0.5) * (1 + erf)
        half = imp.producer.get(partner)
        if (half is None or half.op_type != "Mul" or only_consumer(partner) is not m1 or x not in half.input
                or not _near(imp.static_const(_other(half, x)), 0.5)):
            return
        group.insert(0, half)
    end = group[-1]
    for n in group[:-1]:
        imp.absorbed.add(id(n))
    imp.fused[id(end)] = ("unary", "gelu", x)


def _reduced_axes(imp, node):
    """The axes a ReduceMean node reduces, where known at import (None otherwise)."""
    attrs = _attrs(node)
    if imp.opset < 18:
        return attrs.get("axes")
    given = imp.static_const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    return None if given is None else given.reshape(-1).tolist()


def _plan_layer_norm(imp, mean, only_consumer):
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* w] [+ b] over the last axis, as
    exporters write layer norm before opset 17 -> dg.layer_norm (imp.fused: ("layer_norm", x,
    eps, w, b), w and b initializer names or None)."""
    x = mean.input[0]
    axes = _reduced_axes(imp, mean)
    if axes is None or len(axes) != 1 or _attrs(mean).get("keepdims", 1) != 1:
        return
    sub = only_consumer(mean.output[0])
    if sub is None or sub.op_type != "Sub" or list(sub.input) != [x, mean.output[0]]:
        return
    users = imp.consumers.get(sub.output[0], [])
    if len(users) != 2 or sub.output[0] in imp.graph_outputs:
        return
    square = next((u for u in users if u.op_type == "Pow" and _near(imp.static_const(u.input[1]), 2.0)), None)
    div = next((u for u in users if u.op_type == "Div" and u.input[0] == sub.output[0]), None)
    if square is None or div is None:
        return
    var = only_consumer(square.output[0])
    if var is None or var.op_type != "ReduceMean" or _reduced_axes(imp, var) != axes:
        return
    add = only_consumer(var.output[0])
    eps = imp.static_const(_other(add, var.output[0])) if add is not None and add.op_type == "Add" else None
    if eps is None or eps.size != 1:
        return
    root = only_consumer(add.output[0])
    if root is None or root.op_type != "Sqrt" or only_consumer(root.output[0]) is not div or div.input[1] != root.output[0]:
        return
    group, end, weight, bias = [mean, sub, square, var, add, root, div], div, None, None
    mul = only_consumer(div.output[0])
    if mul is not None and mul.op_type == "Mul" and _vector(imp, _other(mul, div.output[0])):
        weight, end = _other(mul, div.output[0]), mul
        group.append(mul)
        plus = only_consumer(mul.output[0])
        if plus is not None and plus.op_type == "Add" and _vector(imp, _other(plus, mul.output[0])):
            bias, end = _other(plus, mul.output[0]), plus
            group.append(plus)
    for n in group[:-1]:
        imp.absorbed.add(id(n))
    imp.fused[id(end)] = ("layer_norm", x, float(eps.reshape(-1)[0]), weight, bias, axes[0])


def _vector(imp, name) -> bool:
    """name is a 1-D float constant (an initializer, or one behind Identity nodes)."""
    value = imp.static_const(name) if name else None
    return value is not None and value.ndim == 1 and value.dtype.kind == "f"


def _layer_norm_pattern(imp, node, x_name, eps, weight, bias, axis):
    x = _x(imp, node, imp.env[x_name])
    if _axis(imp, node, axis, x.tensor.ndim) != x.tensor.ndim - 1:
        raise imp.fail(node, f"layer norm over axis {axis} is not supported (the last axis only)")
    width = x.tensor.shape[-1]
    layer = identifier("_".join(scope(node))) if scope(node) else imp.layer(node, "layer_norm")
    w = imp.tensor(imp.env[weight], node, "weight", layer) if weight else \
        imp.param(Const(np.ones(width, np.float32)), node, "weight", layer)
    b = imp.tensor(imp.env[bias], node, "bias", layer) if bias else \
        imp.param(Const(np.zeros(width, np.float32)), node, "bias", layer)
    return imp.em.assign(layer, f"dg.layer_norm({x.name}, {w.name}, {b.name}, eps={number(eps)})")
