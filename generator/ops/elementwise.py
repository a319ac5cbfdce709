"""The one elementwise op: a sympy expression in operand symbols, with broadcasting.

`add`, `relu`, `x * 2 + 1` and a user's sympy lambda are all `ewise` nodes whose
attrs hold the function's name (for readability) and its expression."""

from __future__ import annotations

import functools
import math

import numpy as np
import sympy

from ..ir.shapes import broadcast, fmt_shape
from .registry import OpDef, register, require_float
from .scalar import ARGS, SCALAR_FUNCS, derivative, is_identity, output_derivative, scalar_expr


# numpy has no erf/erfc; math's, applied per element, are exact enough for an oracle.
_NUMPY_EXTRAS = {
    "erf": np.vectorize(math.erf, otypes=[np.float64]),
    "erfc": np.vectorize(math.erfc, otypes=[np.float64]),
}


@functools.lru_cache(maxsize=None)
def _numpy_fn(expr, arity):
    return sympy.lambdify(ARGS[:arity], expr, modules=[_NUMPY_EXTRAS, "numpy"])


def _expr_text(node):
    """The expression with operand names in place of x0, x1, ..."""
    names = {ARGS[i]: sympy.Symbol(v.name) for i, v in enumerate(node.inputs)}
    return str(node.attrs["expr"].xreplace(names))


@register
class Elementwise(OpDef):
    name = "ewise"
    in_place = True
    reads_views = True  # its kernel indexes a view with the view's row stride

    def infer(self, inputs, attrs):
        require_float(inputs)
        # attrs["shape"], when given, is the output shape: the operands broadcast up
        # to it (gradients use this to spread a reduced value back over its axes).
        shapes = [v.shape for v in inputs] + ([attrs["shape"]] if "shape" in attrs else [])
        try:
            shape = broadcast(shapes)
        except ValueError as e:
            names = ", ".join(f"'{v.name}' {fmt_shape(v.shape)}" for v in inputs)
            raise ValueError(f"operands do not broadcast ({e}): {names}") from None
        if "shape" in attrs and len(shape) != len(attrs["shape"]):
            raise ValueError(f"operands have more dimensions than the output shape {fmt_shape(attrs['shape'])}")
        return [("float32", shape)]

    def reference(self, args, attrs, dims):
        shape = np.broadcast_shapes(*(a.shape for a in args)) if args else ()
        if "shape" in attrs:
            shape = tuple(int(sympy.sympify(d).subs(dims)) for d in attrs["shape"])
        dtype = np.result_type(*args) if args else np.float32
        expr = attrs["expr"]
        if expr.free_symbols - set(ARGS):  # sizes such as 1/T in a mean's gradient
            expr = expr.subs(dims)
        with np.errstate(all="ignore"):
            out = _numpy_fn(expr, len(args))(*args)
        return [np.broadcast_to(np.asarray(out, dtype=dtype), shape).copy()]

    def lower(self, node, ctx):
        return [ctx.kernel(node)]

    def copy_of(self, node):
        # An identity that broadcasts (dg.expand) makes a larger tensor: not a copy.
        if (len(node.inputs) == 1 and tuple(node.inputs[0].shape) == tuple(node.outputs[0].shape)
                and is_identity(node.attrs["expr"], ARGS[0])):
            return node.inputs[0]
        return None

    def fold(self, node, consts):
        """Constant operands become numbers in the expression (in place); the value
        when none is left and the expression is a number."""
        keep = [v for v, c in zip(node.inputs, consts) if c is None]
        values = {ARGS[k]: sympy.Float(c) for k, c in enumerate(consts) if c is not None}
        expr = node.attrs["expr"].xreplace(values).xreplace(
            {ARGS[node.inputs.index(v)]: ARGS[j] for j, v in enumerate(keep)})
        out = node.outputs[0]
        if not keep and expr.is_number:
            return expr
        attrs = {**node.attrs, "expr": expr}  # with no operands left: a function of the sizes (1/N)
        if not keep or tuple(broadcast([v.shape for v in keep])) != tuple(out.shape):
            attrs["shape"] = tuple(out.shape)
        node.inputs, node.attrs = keep, attrs
        return None

    def describe(self, node):
        """`relu(h)` for a plain call of a named function, else the expression too."""
        fn, n = node.attrs["fn"], len(node.inputs)
        call = f"{fn}({', '.join(v.name for v in node.inputs)})"
        if fn in SCALAR_FUNCS and SCALAR_FUNCS[fn][0] == n and scalar_expr(fn, *ARGS[:n]) == node.attrs["expr"]:
            return call
        return f"{call} := {_expr_text(node)}"

    def grad(self, node, gouts, gb):
        """d input_k = g * d expr / d x_k (sympy.diff), summed back to input_k's shape."""
        (g,) = gouts
        out = node.outputs[0]
        n = len(node.inputs)
        operands = list(node.inputs) + [g, out]
        derivs = []
        for k in range(n):
            d = output_derivative(node.attrs["expr"], ARGS[k], ARGS[n + 1])
            if d is None:
                d = derivative(node.attrs["expr"], ARGS[k])
            derivs.append(d * ARGS[n])
        # Named after what it differentiates (d_relu; for a fused node d_add_relu), and
        # where the operands' derivatives differ, after the operand too (d_mul_add_wrt_x1).
        fn = "d_" + "_".join(dict.fromkeys(node.attrs.get("fused_fns") or [node.attrs["fn"]]))
        several = len({_operands_in_order(d) for d in derivs}) > 1
        grads = []
        for k, (v, d) in enumerate(zip(node.inputs, derivs)):
            dv = gb.ewise(f"{fn}_wrt_x{k}" if several else fn, d, operands, out.shape, f"d_{v.name}")
            grads.append(gb.sum_to(dv, v.shape))
        return grads


def _operands_in_order(expr):
    """expr with its operand symbols renumbered x0, x1, ... in order (as an
    elementwise node holds it once its unused operands are dropped)."""
    used = sorted((s for s in expr.free_symbols if s in ARGS), key=ARGS.index)
    return expr.xreplace({s: ARGS[j] for j, s in enumerate(used)})
