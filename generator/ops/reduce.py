"""Reductions, softmax and prefix sums over axes. A tensor is viewed as
[outer, len, inner] around the reduced axes, which must be contiguous (the DSL splits other cases
into a chain of nodes), so one runtime loop serves every rank."""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.shapes import numel
from ..codegen.stmt import Named
from .registry import OpDef, register, require_float
from .scalar import ARGS


def _view(shape, start, stop):
    return numel(shape[:start]), numel(shape[start:stop]), numel(shape[stop:])


class _Reduce(OpDef):
    kind = ""

    def fold(self, node, consts):
        """The reduction of a tensor of one value c: c for mean and max, c times the
        (static) count for sum."""
        if consts[0] is None:
            return None
        if self.kind != "sum":
            return consts[0]
        count = sympy.sympify(numel(node.inputs[0].shape)) / sympy.sympify(numel(node.outputs[0].shape))
        return consts[0] * float(count) if count.is_number else None

    def infer(self, inputs, attrs):
        (x,) = inputs
        require_float(inputs)
        start, stop = attrs["axes"]
        if not 0 <= start < stop <= x.rank:
            raise ValueError(f"axes {start}..{stop - 1} out of range for rank {x.rank}")
        if attrs["keepdims"]:
            shape = x.shape[:start] + (1,) * (stop - start) + x.shape[stop:]
        else:
            shape = x.shape[:start] + x.shape[stop:]
        return [("float32", shape)]

    def reference(self, args, attrs, dims):
        start, stop = attrs["axes"]
        f = {"sum": np.sum, "mean": np.mean, "max": np.max}[self.kind]
        axes = tuple(range(start, stop))
        if self.kind == "max" and any(args[0].shape[a] == 0 for a in axes):
            raise ValueError("max over an empty axis")
        return [np.asarray(f(args[0], axis=axes, keepdims=attrs["keepdims"]), dtype=args[0].dtype)]

    def lower(self, node, ctx):
        (x,) = node.inputs
        outer, length, inner = _view(x.shape, *node.attrs["axes"])
        return [ctx.call(f"dg::reduce_{self.kind}", ctx.read(x), ctx.write(node.outputs[0]),
                         Named("outer", ctx.size(outer)), Named("len", ctx.size(length)),
                         Named("inner", ctx.size(inner)))]

    def grad(self, node, gouts, gb):
        """Spread g back over the reduced axes: sum copies it, mean scales it by
        1/len, max sends it to the elements equal to the maximum."""
        (g,), (x,), (y,) = gouts, node.inputs, node.outputs
        start, stop = node.attrs["axes"]
        kept = x.shape[:start] + (1,) * (stop - start) + x.shape[stop:]
        g = gb.reshape(g, kept)
        a = ARGS
        if self.kind == "sum":
            return [gb.ewise("d_sum", a[0], [g], x.shape, f"d_{x.name}")]
        if self.kind == "mean":
            length = sympy.sympify(numel(x.shape[start:stop]))
            return [gb.ewise("d_mean", a[0] / length, [g], x.shape, f"d_{x.name}")]
        y = gb.reshape(y, kept)
        pick = sympy.Piecewise((a[2], sympy.Eq(a[0], a[1])), (0, True))
        return [gb.ewise("d_max", pick, [x, y, g], x.shape, f"d_{x.name}")]

    def describe(self, node):
        start, stop = node.attrs["axes"]
        axes = tuple(range(start, stop))
        keep = ", keepdims" if node.attrs["keepdims"] else ""
        return f"{self.name}({node.inputs[0].name}, axes={axes}{keep})"


@register
class Sum(_Reduce):
    name = kind = "sum"


@register
class Mean(_Reduce):
    name = kind = "mean"


@register
class Max(_Reduce):
    name = kind = "max"


class _Softmax(OpDef):
    # Every runtime reads a whole row (its maximum and sum) before it writes any of it,
    # and then each element right after reading it: the output may take x's buffer
    # (attention's [N, h, T, T] weights overwrite the scores).
    in_place = True

    def infer(self, inputs, attrs):
        return _along_axis(inputs, attrs)

    def reference(self, args, attrs, dims):
        x = args[0]
        axis = attrs["axis"]
        shifted = x - np.max(x, axis=axis, keepdims=True)
        logz = np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
        out = shifted - logz
        return [(out if self.name == "log_softmax" else np.exp(out)).astype(x.dtype)]

    def lower(self, node, ctx):
        (x,) = node.inputs
        axis = node.attrs["axis"]
        outer, length, inner = _view(x.shape, axis, axis + 1)
        return [ctx.call(f"dg::{self.name}", ctx.read(x), ctx.write(node.outputs[0]),
                         Named("outer", ctx.size(outer)), Named("len", ctx.size(length)),
                         Named("inner", ctx.size(inner)))]


@register
class Softmax(_Softmax):
    name = "softmax"

    def grad(self, node, gouts, gb):
        """dx = y * (g - sum(g * y, axis))."""
        (g,), (x,), (y,) = gouts, node.inputs, node.outputs
        a = ARGS
        gy = gb.ewise("mul", a[0] * a[1], [g, y], None, f"d_{x.name}_gy")
        s = gb.reduce("sum", gy, [node.attrs["axis"]], keepdims=True)
        return [gb.ewise("d_softmax", a[0] * (a[1] - a[2]), [y, g, s], None, f"d_{x.name}")]


@register
class LogSoftmax(_Softmax):
    name = "log_softmax"

    def grad(self, node, gouts, gb):
        """dx = g - exp(y) * sum(g, axis)."""
        (g,), (x,), (y,) = gouts, node.inputs, node.outputs
        a = ARGS
        s = gb.reduce("sum", g, [node.attrs["axis"]], keepdims=True)
        return [gb.ewise("d_log_softmax", a[0] - sympy.exp(a[1]) * a[2], [g, y, s], None, f"d_{x.name}")]


@register
class Cumsum(OpDef):
    """Inclusive prefix sums along one axis (numpy.cumsum); `reverse` sums from the
    end instead, which is cumsum's adjoint."""

    name = "cumsum"

    def infer(self, inputs, attrs):
        return _along_axis(inputs, attrs)

    def reference(self, args, attrs, dims):
        x, axis = args[0], attrs["axis"]
        if attrs["reverse"]:
            return [np.flip(np.cumsum(np.flip(x, axis), axis=axis, dtype=x.dtype), axis)]
        return [np.cumsum(x, axis=axis, dtype=x.dtype)]

    def lower(self, node, ctx):
        (x,) = node.inputs
        axis = node.attrs["axis"]
        outer, length, inner = _view(x.shape, axis, axis + 1)
        return [ctx.call("dg::cumsum", ctx.read(x), ctx.write(node.outputs[0]),
                         Named("outer", ctx.size(outer)), Named("len", ctx.size(length)),
                         Named("inner", ctx.size(inner)), Named("reverse", "true" if node.attrs["reverse"] else "false"))]

    def grad(self, node, gouts, gb):
        """Each x[l] is in the sums at l and after: dx is g summed from the other end."""
        (g,), (x,) = gouts, node.inputs
        attrs = {"axis": node.attrs["axis"], "reverse": not node.attrs["reverse"]}
        return [gb.op("cumsum", [g], attrs, f"d_{x.name}")]


def _along_axis(inputs, attrs) -> list:
    """The output of an op along one axis (softmax, cumsum): a float tensor of x's shape."""
    require_float(inputs)
    if not 0 <= attrs["axis"] < inputs[0].rank:
        raise ValueError(f"axis {attrs['axis']} out of range for rank {inputs[0].rank}")
    return [("float32", inputs[0].shape)]
