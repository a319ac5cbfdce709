"""The one elementwise op: a sympy expression in operand symbols, with broadcasting.

`add`, `relu`, `x * 2 + 1` and a user's sympy lambda are all `ewise` nodes whose
attrs hold the function's name (for readability) and its expression."""

from __future__ import annotations

import functools
import math

import numpy as np
import sympy

from ..shapes import broadcast, fmt_shape
from .registry import OpDef, register, require_float
from .scalar import ARGS, SCALAR_FUNCS, scalar_expr


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

    def infer(self, inputs, attrs):
        require_float(inputs)
        try:
            shape = broadcast([v.shape for v in inputs])
        except ValueError as e:
            shapes = ", ".join(f"'{v.name}' {fmt_shape(v.shape)}" for v in inputs)
            raise ValueError(f"operands do not broadcast ({e}): {shapes}") from None
        return [("float32", shape)]

    def reference(self, args, attrs, dims):
        shape = np.broadcast_shapes(*(a.shape for a in args))
        dtype = np.result_type(*args)
        with np.errstate(all="ignore"):
            out = _numpy_fn(attrs["expr"], len(args))(*args)
        return [np.broadcast_to(np.asarray(out, dtype=dtype), shape).copy()]

    def lower(self, node, ctx):
        return [ctx.call_kernel(node)]

    def describe(self, node):
        """`relu(h)` for a plain call of a named function, else the expression too."""
        fn, n = node.attrs["fn"], len(node.inputs)
        call = f"{fn}({', '.join(v.name for v in node.inputs)})"
        if fn in SCALAR_FUNCS and SCALAR_FUNCS[fn][0] == n and scalar_expr(fn, *ARGS[:n]) == node.attrs["expr"]:
            return call
        return f"{call} := {_expr_text(node)}"
