"""Booleans: comparisons, logic and selection, the pieces data-dependent control
flow is built of (`dg.cond` is `where` over both branches: frontend/control.py).

- `compare(a[, b])`, attr `cmp` (one of CMP) and, when the right side is a number,
  `value`: a bool tensor, a and b broadcast as in numpy; operands of any numeric dtype.
- `logical(a[, b])`, attr `fn` ("and", "or", "not"): bool operands, a bool result.
- `where(cond, [a], [b])`, attr `values` = (a's number or None, b's number or None):
  a float32 tensor, cond ? a : b elementwise with numpy broadcasting; an operand given
  as a number is not an input. The gradient flows to a tensor a (where cond) and b
  (where not cond) only: each is `where` again with 0 on the other side.

A bool is one byte in C++ (std::uint8_t, 0 or 1): std::vector<bool> packs bits and has
no data(), while a byte is what numpy's bool is too (an array of them is the same bytes)
and reads and writes alike on the CPU and the GPU.

Broadcasting reaches the runtime as the output's shape and, for each operand, its step
along each output axis (0 where the operand is broadcast): one call, no expand copies."""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Comment, Named, Scope
from ..ir.shapes import broadcast, fmt_shape, numel
from .registry import OpDef, get_op, register

# cmp attr -> (Python operator, numpy function, the runtime's dg::Compare member)
CMP = {
    "lt": ("<", np.less, "less"),
    "le": ("<=", np.less_equal, "less_equal"),
    "gt": (">", np.greater, "greater"),
    "ge": (">=", np.greater_equal, "greater_equal"),
    "eq": ("==", np.equal, "equal"),
    "ne": ("!=", np.not_equal, "not_equal"),
}
NUMERIC = ("float32", "int32", "int64", "bool")


MAX_RANK = 8  # the runtime's kMaxBroadcastRank


def _broadcast(inputs, what):
    try:
        shape = tuple(broadcast([v.shape for v in inputs]))
    except ValueError as e:
        names = ", ".join(f"'{v.name}' {fmt_shape(v.shape)}" for v in inputs)
        raise ValueError(f"{what}: operands do not broadcast ({e}): {names}") from None
    if len(shape) > MAX_RANK:
        raise ValueError(f"{what}: the result {fmt_shape(shape)} has more than {MAX_RANK} axes")
    return shape


def _steps(v, out_shape):
    """v's step along each axis of the output it broadcasts to (0: broadcast)."""
    lead = len(out_shape) - v.rank
    steps = [0] * lead
    for k, d in enumerate(v.shape):
        steps.append(0 if isinstance(d, int) and d == 1 else numel(v.shape[k + 1 :]))
    return steps


def _float(x) -> str:
    """A number as a C++ float literal (the runtime reads it as an operand whose steps are all 0)."""
    text = repr(float(x))
    return f"{text}f" if "e" in text or "." in text else f"{text}.0f"


def _layout(ctx, out, operands):
    """Scope arrays: the output's shape and each operand's steps (a number: all 0);
    rank 0 is one element of shape [1]."""
    shape = [ctx.size(d) for d in out.shape] or [1]
    arrays = [("std::int64_t", "_shape", shape)]
    for name, v in operands:
        steps = [ctx.size(s) for s in _steps(v, out.shape)] if v is not None else [0] * len(out.shape)
        arrays.append(("std::int64_t", name, steps or [0]))
    return arrays


@register
class Compare(OpDef):
    name = "compare"

    def infer(self, inputs, attrs):
        if attrs.get("cmp") not in CMP:
            raise ValueError(f"comparison must be one of {', '.join(CMP)}, got {attrs.get('cmp')!r}")
        for v in inputs:
            if v.dtype not in NUMERIC:
                raise ValueError(f"'{v.name}' must be a float32, int32, int64 or bool tensor to compare, got {v.type_str()}")
        if len(inputs) != (1 if "value" in attrs else 2):
            raise ValueError("compare takes two tensors, or a tensor and a number")
        return [("bool", _broadcast(inputs, CMP[attrs["cmp"]][0]))]

    def reference(self, args, attrs, dims):
        right = args[1] if len(args) == 2 else attrs["value"]
        return [np.asarray(CMP[attrs["cmp"]][1](args[0], right), dtype=bool)]

    def lower(self, node, ctx):
        out = node.outputs[0]
        a = node.inputs[0]
        b = node.inputs[1] if len(node.inputs) == 2 else None
        arrays = _layout(ctx, out, [("_a_step", a), ("_b_step", b)])
        right = ctx.read(b) if b is not None else _float(node.attrs["value"])
        call = ctx.call("dg::compare", ctx.read(a), right, ctx.write(out), f"dg::Compare::{CMP[node.attrs['cmp']][2]}",
                        Named("ndim", max(out.rank, 1)), "_shape", "_a_step", "_b_step")
        return [Scope(arrays, [call])]

    def describe(self, node):
        right = node.inputs[1].name if len(node.inputs) == 2 else repr(node.attrs["value"])
        return f"{node.inputs[0].name} {CMP[node.attrs['cmp']][0]} {right}"

    def grad(self, node, gouts, gb):
        return [None] * len(node.inputs)  # a step: no gradient


@register
class Logical(OpDef):
    name = "logical"

    def infer(self, inputs, attrs):
        fn = attrs.get("fn")
        if fn not in ("and", "or", "not"):
            raise ValueError(f"logical fn must be and, or or not, got {fn!r}")
        if len(inputs) != (1 if fn == "not" else 2):
            raise ValueError(f"logical_{fn} takes {1 if fn == 'not' else 2} operand(s), got {len(inputs)}")
        for v in inputs:
            if v.dtype != "bool":
                raise ValueError(f"'{v.name}' must be bool (a comparison's result), got {v.type_str()}")
        return [("bool", _broadcast(inputs, f"logical_{fn}"))]

    def reference(self, args, attrs, dims):
        fn = {"and": np.logical_and, "or": np.logical_or, "not": np.logical_not}[attrs["fn"]]
        return [np.asarray(fn(*args), dtype=bool)]

    def lower(self, node, ctx):
        out = node.outputs[0]
        if node.attrs["fn"] == "not":
            (a,) = node.inputs
            return [ctx.call("dg::logical_not", ctx.read(a), ctx.write(out), Named("n", ctx.size(numel(out.shape))))]
        a, b = node.inputs
        arrays = _layout(ctx, out, [("_a_step", a), ("_b_step", b)])
        call = ctx.call(f"dg::logical_{node.attrs['fn']}", ctx.read(a), ctx.read(b), ctx.write(out),
                        Named("ndim", max(out.rank, 1)), "_shape", "_a_step", "_b_step")
        return [Scope(arrays, [call])]

    def describe(self, node):
        return f"logical_{node.attrs['fn']}({', '.join(v.name for v in node.inputs)})"

    def grad(self, node, gouts, gb):
        return [None] * len(node.inputs)


def _where_operands(node):
    """[cond, a or None, b or None]: the tensors, None where a number stands."""
    rest = iter(node.inputs[1:])
    return [node.inputs[0]] + [next(rest) if v is None else None for v in node.attrs["values"]]


@register
class Where(OpDef):
    name = "where"

    def infer(self, inputs, attrs):
        values = attrs.get("values", (None, None))
        if len(values) != 2 or len(inputs) != 1 + sum(v is None for v in values):
            raise ValueError("where takes a condition and two operands (tensors or numbers)")
        cond, *rest = inputs
        if cond.dtype != "bool":
            raise ValueError(f"condition '{cond.name}' must be bool (a comparison's result), got {cond.type_str()}")
        for v in rest:
            if v.dtype != "float32":
                raise ValueError(f"'{v.name}' must be float32, got {v.type_str()}")
        return [("float32", _broadcast(inputs, "where"))]

    def reference(self, args, attrs, dims):
        cond, *rest = args
        rest = iter(rest)
        a, b = (next(rest) if v is None else v for v in attrs["values"])
        dtype = np.result_type(*[x for x in (a, b) if isinstance(x, np.ndarray)] or [np.float32])
        shape = np.broadcast_shapes(*(x.shape for x in args))
        return [np.broadcast_to(np.where(cond, a, b).astype(dtype), shape).copy()]

    def lower(self, node, ctx):
        out = node.outputs[0]
        cond, a, b = _where_operands(node)
        arrays = _layout(ctx, out, [("_cond_step", cond), ("_a_step", a), ("_b_step", b)])
        args = [ctx.read(v) if v is not None else _float(x) for v, x in zip((a, b), node.attrs["values"])]
        call = ctx.call("dg::where", ctx.read(cond), *args, ctx.write(out), Named("ndim", max(out.rank, 1)),
                        "_shape", "_cond_step", "_a_step", "_b_step")
        if node.attrs.get("cond"):  # dg.cond's selection: say which rows come from which branch
            viewed = cond.producer is not None and get_op(cond.producer.op).view  # pred as [N, 1, ...]
            pred = cond.producer.inputs[0] if viewed else cond
            then, other = node.attrs.get("said") or ("", "")
            if then:
                said = f"the examples {then} ({pred.name}) take {a.name}, those {other} {b.name}"
            else:
                said = f"examples taking the then branch ({pred.name}) take {a.name}, the others {b.name}"
            return [Comment(said), Scope(arrays, [call])]
        if node.attrs.get("loop"):  # a while loop's step: the examples that stopped keep their state
            return [Comment(f"examples still running take {a.name}, the others keep {b.name}"), Scope(arrays, [call])]
        return [Scope(arrays, [call])]

    def describe(self, node):
        cond, a, b = _where_operands(node)
        side = [v.name if v is not None else repr(x) for v, x in zip((a, b), node.attrs["values"])]
        return f"where({cond.name}, {side[0]}, {side[1]})"

    def grad(self, node, gouts, gb):
        """d a = where(cond, g, 0), d b = where(cond, 0, g), each summed to its shape."""
        (g,) = gouts
        cond, a, b = _where_operands(node)
        grads = [None]
        if a is not None:
            da = gb.op("where", [cond, g], {"values": (None, 0.0)}, f"d_{a.name}")
            grads.append(gb.sum_to(da, a.shape))
        if b is not None:
            db = gb.op("where", [cond, g], {"values": (0.0, None)}, f"d_{b.name}")
            grads.append(gb.sum_to(db, b.shape))
        return grads


CASTS = ("float32", "int64")  # what a cast makes
_CAST_FROM = ("float32", "int64", "bool")


@register
class Cast(OpDef):
    """`cast(x)`, attr `dtype`: x's values as another numeric type, element by element
    (float32 to int64 truncates toward zero, as numpy's astype; a bool is 0 or 1). No
    gradient: an integer carries none (a float32 result of an integer or a bool neither)."""

    name = "cast"

    def infer(self, inputs, attrs):
        (x,) = inputs
        if attrs.get("dtype") not in CASTS:
            raise ValueError(f"cast makes one of {', '.join(CASTS)}, got {attrs.get('dtype')!r}")
        if x.dtype not in _CAST_FROM:
            raise ValueError(f"'{x.name}' must be float32, int64 or bool to cast, got {x.type_str()}")
        if x.dtype == attrs["dtype"]:
            raise ValueError(f"'{x.name}' is {x.dtype} already")
        return [(attrs["dtype"], x.shape)]

    def reference(self, args, attrs, dims):
        return [np.asarray(args[0]).astype(np.float32 if attrs["dtype"] == "float32" else np.int64)]

    def lower(self, node, ctx):
        (x,) = node.inputs
        out = node.outputs[0]
        return [ctx.call("dg::cast", ctx.read(x), ctx.write(out), Named("n", ctx.size(numel(out.shape))))]

    def describe(self, node):
        return f"cast({node.inputs[0].name}, {node.attrs['dtype']})"

    def grad(self, node, gouts, gb):
        return [None]
