"""Ops that move data without arithmetic: reshape, transpose, concat, split, slice."""

from __future__ import annotations

import numpy as np
import sympy

from ..codegen.stmt import Comment, Named, Scope
from ..ir.shapes import fmt_shape, numel, same
from .registry import OpDef, register


@register
class Reshape(OpDef):
    """Same elements, new shape. Lowered to an alias: no copy is made."""

    name = "reshape"
    view = True  # the output is the operand's data: lowered to a named pointer
    moves_elements = True

    def fold(self, node, consts):
        return consts[0]

    def infer(self, inputs, attrs):
        (x,) = inputs
        shape = attrs["shape"]
        if not same(numel(x.shape), numel(shape)):
            raise ValueError(
                f"cannot reshape '{x.name}' {fmt_shape(x.shape)} ({numel(x.shape)} elements) "
                f"to {fmt_shape(shape)} ({numel(shape)} elements)"
            )
        return [(x.dtype, shape)]

    def reference(self, args, attrs, dims):
        return [args[0].reshape(tuple(_eval(d, dims) for d in attrs["shape"]))]

    def lower(self, node, ctx):
        ctx.alias(node.outputs[0], node.inputs[0])
        return []

    def grad(self, node, gouts, gb):
        return [gb.reshape(gouts[0], node.inputs[0].shape)]


@register
class Transpose(OpDef):
    name = "transpose"
    moves_elements = True
    reads_strided = True  # a split's piece read in place: dg::transpose's row_axes, ld

    def fold(self, node, consts):
        return consts[0]

    def infer(self, inputs, attrs):
        (x,) = inputs
        perm = attrs["perm"]
        if sorted(perm) != list(range(x.rank)):
            raise ValueError(f"perm {perm} is not a permutation of the axes of '{x.name}' {fmt_shape(x.shape)}")
        return [(x.dtype, tuple(x.shape[p] for p in perm))]

    def reference(self, args, attrs, dims):
        return [np.ascontiguousarray(np.transpose(args[0], attrs["perm"]))]

    def lower(self, node, ctx):
        (x,) = node.inputs
        dims = [ctx.size(d) for d in x.shape]
        perm = list(node.attrs["perm"])
        strided = []
        if id(x) in ctx.views:  # rows of a larger buffer (LowerCtx.slice_view)
            row_axes, ld = ctx.views[id(x)]
            strided = [Named("row_axes", row_axes), Named("ld", ctx.size(ld))]
        call = ctx.call("dg::transpose", ctx.read(x), ctx.write(node.outputs[0]), Named("ndim", x.rank), "_shape",
                        "_perm", *strided)
        return [Scope([("std::int64_t", "_shape", dims), ("int", "_perm", perm)], [call])]

    def grad(self, node, gouts, gb):
        perm = node.attrs["perm"]
        inverse = tuple(perm.index(i) for i in range(len(perm)))
        return [gb.op("transpose", [gouts[0]], {"perm": inverse}, f"d_{node.inputs[0].name}")]


def _copy_axis(ctx, src, dst, axis, src_start, dst_start, count):
    """dg::copy_axis moving `count` slabs along `axis` from src to dst."""
    outer = numel(src.shape[:axis])
    inner = numel(src.shape[axis + 1 :])
    return ctx.call("dg::copy_axis", ctx.read(src), ctx.write(dst), Named("outer", ctx.size(outer)),
                    Named("src_len", ctx.size(src.shape[axis])), Named("src_start", ctx.size(src_start)),
                    Named("dst_len", ctx.size(dst.shape[axis])), Named("dst_start", ctx.size(dst_start)),
                    Named("count", ctx.size(count)), Named("inner", ctx.size(inner)))


@register
class Concat(OpDef):
    name = "concat"
    moves_elements = True

    def infer(self, inputs, attrs):
        axis = attrs["axis"]
        first = inputs[0]
        dtypes = {v.dtype for v in inputs}
        if len(dtypes) != 1:
            raise ValueError(f"operands have different dtypes: {sorted(dtypes)}")
        total = 0
        for v in inputs:
            if v.rank != first.rank or any(
                not same(a, b) for i, (a, b) in enumerate(zip(v.shape, first.shape)) if i != axis
            ):
                raise ValueError(
                    f"'{v.name}' {fmt_shape(v.shape)} does not match '{first.name}' "
                    f"{fmt_shape(first.shape)} outside axis {axis}"
                )
            total = total + v.shape[axis]
        shape = first.shape[:axis] + (_simplify(total),) + first.shape[axis + 1 :]
        return [(first.dtype, shape)]

    def reference(self, args, attrs, dims):
        return [np.concatenate(args, axis=attrs["axis"])]

    def lower(self, node, ctx):
        axis = node.attrs["axis"]
        out = node.outputs[0]
        lines, offset = [], 0
        in_concat = ctx.loop.in_concat if ctx.loop is not None else set()
        for v in node.inputs:
            if id(v) not in in_concat:  # else its producer wrote it in place (LowerCtx.concat_spot)
                lines.append(_copy_axis(ctx, v, out, axis, 0, offset, v.shape[axis]))
            offset = _simplify(offset + v.shape[axis])
        if len(lines) < len(node.inputs):
            placed = ", ".join(v.name for v in node.inputs if id(v) in in_concat)
            lines.append(Comment(f"{placed}: gathered straight into {out.name}'s columns"))
        return lines

    def grad(self, node, gouts, gb):
        """Each operand's gradient is its slab of g."""
        axis, bounds, offset = node.attrs["axis"], [], 0
        for v in node.inputs:
            bounds.append((offset, _simplify(offset + v.shape[axis])))
            offset = bounds[-1][1]
        pieces = gb.op("slice", [gouts[0]], {"axis": axis, "bounds": tuple(bounds)}, [f"d_{v.name}" for v in node.inputs])
        return pieces


@register
class Slice(OpDef):
    """x[start:stop] along one axis (the DSL chains these for multi-axis slices);
    `split` is one node with an output per piece. Bounds may be symbolic (N - 1)."""

    name = "slice"
    multi_output = True  # one node makes every piece of a split; unread pieces get no gradient
    moves_elements = True

    def infer(self, inputs, attrs):
        (x,) = inputs
        axis = attrs["axis"]
        length = x.shape[axis]
        outs = []
        for start, stop in attrs["bounds"]:
            size = _simplify(stop - start)
            concrete = all(isinstance(d, int) for d in (start, stop, length))
            if (isinstance(size, int) and size < 0) or (concrete and not 0 <= start <= stop <= length):
                raise ValueError(
                    f"slice {start}:{stop} of axis {axis} is out of range for '{x.name}' {fmt_shape(x.shape)}"
                )
            outs.append((x.dtype, x.shape[:axis] + (size,) + x.shape[axis + 1 :]))
        return outs

    def reference(self, args, attrs, dims):
        x = args[0]
        axis = attrs["axis"]
        out = []
        for start, stop in attrs["bounds"]:
            index = [slice(None)] * x.ndim
            index[axis] = slice(_eval(start, dims), _eval(stop, dims))
            out.append(np.ascontiguousarray(x[tuple(index)]))
        return out

    def lower(self, node, ctx):
        """A piece only elementwise kernels read is a view of x read in place
        (no copy); any other piece is copied out."""
        axis = node.attrs["axis"]
        (x,) = node.inputs
        lines = []
        for out, (start, stop) in zip(node.outputs, node.attrs["bounds"]):
            view = ctx.slice_view(out, x, axis, start)
            lines.append(view if view is not None else _copy_axis(ctx, x, out, axis, start, 0, _simplify(stop - start)))
        return lines

    def grad(self, node, gouts, gb):
        """Put each piece's gradient back in place, zeros elsewhere (one concat)."""
        (x,) = node.inputs
        axis = node.attrs["axis"]
        pieces, at = [], 0
        for g, out, (start, stop) in zip(gouts, node.outputs, node.attrs["bounds"]):  # in axis order
            if not (isinstance(start, int) and isinstance(at, int) and start == at):
                gap = _simplify(start - at)
                if gap != 0:
                    pieces.append(gb.fill(x.shape[:axis] + (gap,) + x.shape[axis + 1 :], 0.0))
            pieces.append(g if g is not None else gb.fill(out.shape, 0.0))
            at = stop
        tail = _simplify(x.shape[axis] - at)
        if tail != 0:
            pieces.append(gb.fill(x.shape[:axis] + (tail,) + x.shape[axis + 1 :], 0.0))
        if len(pieces) == 1:
            return [pieces[0]]
        return [gb.op("concat", pieces, {"axis": axis}, f"d_{x.name}")]

    def describe(self, node):
        bounds = ", ".join(f"{a}:{b}" for a, b in node.attrs["bounds"])
        name = "slice" if len(node.outputs) == 1 else "split"
        return f"{name}({node.inputs[0].name}, axis={node.attrs['axis']}, [{bounds}])"


def _simplify(e):
    if isinstance(e, int):
        return e
    e = sympy.expand(e)
    return int(e) if e.is_Integer else e


def _eval(d, dims):
    return d if isinstance(d, int) else int(sympy.sympify(d).subs(dims))


@register
class Fill(OpDef):
    """A tensor of one value (zeros for gradients, the loss gradient's 1)."""

    name = "fill"

    def constant(self, node):
        return node.attrs["value"]

    def infer(self, inputs, attrs):
        return [("float32", attrs["shape"])]

    def reference(self, args, attrs, dims):
        return [np.full(tuple(_eval(d, dims) for d in attrs["shape"]), attrs["value"], dtype=np.float32)]

    def lower(self, node, ctx):
        out = node.outputs[0]
        return [ctx.call("dg::fill", ctx.write(out), Named("n", ctx.size(numel(out.shape))),
                         Named("value", f"{float(node.attrs['value'])!r}f"))]

    def describe(self, node):
        return f"fill({node.attrs['value']:g})"

    @staticmethod
    def make_constant(node, value):
        """Rewrite `node` (one output) into a fill of its output's shape with
        `value`: how constant folding replaces a node it has evaluated."""
        node.op, node.inputs = Fill.name, []
        node.attrs = {"shape": tuple(node.outputs[0].shape), "value": float(value)}
