"""ONNX elementwise ops and activations as DSL expressions."""

from __future__ import annotations

import numpy as np

from ..errors import DeepgenError
from .emitter import Var
from .onnx_derived import Derived, additive_mask
from .onnx_import import Const, Unsupported, number
from .onnx_common import _assign, _attrs, _entries, _onnx_dtype, _text, _x, converter

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
    """erf outside GELU's pattern: a DSL elementwise function of sympy's erf (the C++
    printer's erf_f, the reference's lambdified erf)."""
    imp.em.use_module("sympy")
    return _assign(imp, node, f'dg.elementwise(lambda v: sympy.erf(v), "erf")({_x(imp, node, ins[0]).name})')


_BINARY = {"Add": "+", "Sub": "-", "Mul": "*", "Div": "/", "Pow": "**"}


@converter(*_BINARY)
def binary(imp, node, ins, attrs):
    a, b = ins
    if node.op_type == "Add" and any(isinstance(v, Derived) for v in ins):  # scores + an attention mask
        scores, mask = (a, b) if isinstance(b, Derived) else (b, a)
        if isinstance(scores, Var) and scores.tensor.ndim >= 2:
            mask_var = additive_mask(imp, node, mask, scores)
            return _assign(imp, node, f"{scores.name} + {mask_var.name}")
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
    """Constant padding: dg.pad (pads [begin per axis..., end per axis...] become F.pad's
    pairs, last axis first); none at all is the tensor itself."""
    pads = attrs.get("pads") if imp.opset < 11 else _entries(imp, node, ins[1], "pads")
    if pads is not None and all(isinstance(p, int) and p == 0 for p in pads):
        return _x(imp, node, ins[0])
    x = _x(imp, node, ins[0])
    mode = attrs.get("mode", b"constant")
    mode = mode.decode() if isinstance(mode, bytes) else mode
    value = attrs.get("value", 0.0) if imp.opset < 11 else (
        float(np.asarray(ins[2].value)) if len(ins) > 2 and isinstance(ins[2], Const) else 0.0)
    axes = _entries(imp, node, ins[3], "axes") if imp.opset >= 18 and len(ins) > 3 and ins[3] is not None else None
    if mode != "constant" or pads is None or not all(isinstance(p, int) for p in pads) or \
            (len(ins) > 2 and ins[2] is not None and not isinstance(ins[2], Const)):
        raise Unsupported(f"unsupported ONNX op: {imp.describe(node)} with mode {mode!r} and pads {pads} (constant "
                          "padding by known amounts only)")
    rank = x.tensor.ndim
    axes = [a % rank for a in axes] if axes is not None else list(range(rank))
    begin = dict(zip(axes, pads[:len(axes)]))
    end = dict(zip(axes, pads[len(axes):]))
    pairs = []
    for a in reversed(range(min(begin, default=rank), rank)):
        pairs += [begin.get(a, 0), end.get(a, 0)]
    while pairs[-2:] == [0, 0]:  # (leading axes not padded)
        pairs = pairs[:-2]
    return _assign(imp, node, f"dg.pad({x.name}, {tuple(pairs)}{f', value={value!r}' if value else ''})")


@converter("Cast")
def cast(imp, node, ins, attrs):
    x, target = ins[0], _onnx_dtype(attrs.get("to"))
    have = x.tensor.dtype
    if (target is np.float32 and have == "float32") or (target in (np.int64, np.int32) and have in ("int64", "int32")):
        return x
    name = np.dtype(target).name if target is not None else f"ONNX type {attrs.get('to')}"
    raise imp.fail(node, f"a cast of the {have} tensor {x.name} to {name} is not supported")
