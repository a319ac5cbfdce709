"""Matrix products: `matmul`, a[..., M, K] @ b[K, P] -> [..., M, P] (activations by
a weight), and `bmm`, a[..., M, K] @ b[..., K, P] over the same leading batch axes
(two activations: attention's scores and its weighted sum).

Attrs `ta`/`tb` say an operand is stored transposed (matmul: a must then be 2-D;
bmm: the last two axes are swapped): gradients such as a^T @ g and g @ b^T, and
products by PyTorch-layout weights (x @ W^T), need no transposed copy.

Attr `epilogue` (set by passes.epilogue, never by the DSL): a sympy expression
applied to each output element inside the GEMM, once its sum is complete. Its x0
is the sum; x1, x2, ... are the node's operands after a and b, each a scalar, a
per-column vector (a bias), a per-row vector or a full [..., M, P] array
(`epilogue_role`)."""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.shapes import fmt_shape, numel, same
from ..codegen.stmt import Gemm, Named, PieceAs, Struct
from .precision import read_rounded, rounded_args, rounded_weight
from .registry import OpDef, get_op, register, require_float
from .scalar import ARGS


def _logical(v, transposed):
    return (v.shape[1], v.shape[0]) if transposed else v.shape


def epilogue_role(v, out_shape):
    """How an epilogue reads operand v for output C of `out_shape`: "scalar",
    "col" (varies along the last axis only), "row" (along the leading axes only),
    "full", or None when it cannot be read per element of C."""
    rank = len(out_shape)
    if v.rank > rank:
        return None
    shape = (1,) * (rank - v.rank) + tuple(v.shape)
    ones = [same(d, 1) for d in shape]
    if all(ones):
        return "scalar"
    if all(ones[:-1]) and same(shape[-1], out_shape[-1]):
        return "col"
    if ones[-1] and all(same(d, o) for d, o in zip(shape[:-1], out_shape[:-1])):
        return "row"
    if all(same(d, o) for d, o in zip(shape, out_shape)):
        return "full"
    return None


def with_epilogue(out, extras, attrs, dims):
    """A product's output with its fused epilogue applied (attr `epilogue`; extras:
    its operands x1, x2, ...), exactly as the elementwise op it stands for computes it."""
    if "epilogue" not in attrs:
        return out
    return get_op("ewise").reference([out, *extras], {"expr": attrs["epilogue"], "shape": out.shape}, dims)[0]


def epilogue_text(node, extras) -> str:
    """What describe adds for a fused epilogue: " then fns: expr" (or "")."""
    if "epilogue" not in node.attrs:
        return ""
    names = {ARGS[0]: sympy.Symbol("acc")}
    names.update({ARGS[k]: sympy.Symbol(v.name) for k, v in enumerate(extras, start=1)})
    return f" then {' + '.join(node.attrs['epilogue_fns'])}: {node.attrs['epilogue'].xreplace(names)}"


def _call_on(ctx, fn: str, a, b) -> str:
    """The runtime function of product `fn` on operands a and b: where both are results
    of one op that names its own for it (OpDef.kept_as: bf16 values, dg::matmul_bf16)
    and the target's runtime has it (Target.bf16_products), that one."""
    if not ctx.target.bf16_products:
        return fn
    made_by = {v.producer.op if v.producer is not None else None for v in (a, b)}
    op = get_op(made_by.pop()) if len(made_by) == 1 and None not in made_by else None
    return op.kept_as[1].get(fn, fn) if op is not None and op.kept_as else fn


@register
class MatMul(OpDef):
    name = "matmul"
    products = (0, 1)

    def fold(self, node, consts):
        """A product by zeros is zeros (unless an epilogue adds to it)."""
        return 0.0 if "epilogue" not in node.attrs and 0.0 in consts[:2] else None

    def infer(self, inputs, attrs):
        a, b = inputs[:2]
        require_float(inputs)
        if len(inputs) > 2 and "epilogue" not in attrs:
            raise ValueError(f"matmul takes 2 operands, got {len(inputs)}")
        ta, tb = attrs.get("ta", False), attrs.get("tb", False)
        if a.rank < 1 or b.rank != 2 or (ta and a.rank != 2):
            raise ValueError(
                f"expected a[..., K] @ b[K, P] with b 2-D, got '{a.name}' {fmt_shape(a.shape)} "
                f"and '{b.name}' {fmt_shape(b.shape)}"
            )
        sa, sb = _logical(a, ta), _logical(b, tb)
        if not same(sa[-1], sb[0]):
            raise ValueError(
                f"inner dimensions differ: '{a.name}' {fmt_shape(sa)} has K={sa[-1]}, "
                f"'{b.name}' {fmt_shape(sb)} has K={sb[0]}"
            )
        return [("float32", tuple(sa[:-1]) + (sb[1],))]

    def packed_read(self, node):
        """b, as stored, where a is not transposed (lower: ctx.packed_operand)."""
        return None if node.attrs.get("ta") else (1, bool(node.attrs.get("tb")), None)

    def rounds_on_read(self, node) -> tuple:
        """(0,) where b is a parameter's bf16 rounding read through its kept packing:
        dg::matmul_bf16 rounds a as it packs its rows."""
        return (0,) if rounded_weight(node.inputs[1]) and self.packed_read(node) is not None else ()

    def reference(self, args, attrs, dims):
        args = rounded_args(args, attrs)
        a, b = args[:2]
        a = a.T if attrs.get("ta") else a
        b = b.T if attrs.get("tb") else b
        return [with_epilogue(np.matmul(a, b), args[2:], attrs, dims)]

    def lower(self, node, ctx):
        a, b = node.inputs[:2]
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        sa, sb = _logical(a, ta), _logical(b, tb)
        fn = "matmul" + ("_tn" if ta else "_nt" if tb else "")
        # B packed before a loop (ops/recurse.py) is passed as the PackedB itself,
        # a parameter the Model keeps packed as that packing (which knows its B).
        packed = None if ta else ctx.packed_operand(b, tb)
        b_args = packed or [ctx.read(b)]
        plain = f"dg::{fn}"
        fn = ctx.kept_call(plain, b, tb) if packed else _call_on(ctx, plain, a, b)  # (bf16: matmul_bf16)
        a_arg, rounding = read_rounded(ctx, node, 0, call_rounds=bool(packed) and fn != plain)
        handed = ctx.handed(a) if packed and fn != plain else None  # a's bf16 rows, from the product that made it
        if handed is not None:
            a_arg = Struct("Bf16RowsIn", (a_arg, PieceAs(handed, "bf16")))
        n = Named("N", ctx.size(sb[1]))
        rows = numel(sa[:-1])
        args = [a_arg, *b_args, ctx.write(node.outputs[0]), Named("M", ctx.size(rows)), Named("K", ctx.size(sa[-1])), n]
        out = _bf16_hand_over(ctx, node, rows, sb[1]) if packed and fn != plain else []
        if "epilogue" in node.attrs:
            args.append(ctx.epilogue(node))
        elif out:
            args.append("dg::NoEpilogue()")
        return [*rounding, Gemm(fn, args + out, n=n, epilogue="epilogue" in node.attrs)]

    def describe(self, node):
        a, b = node.inputs[:2]
        ta = "^T" if node.attrs.get("ta") else ""
        tb = "^T" if node.attrs.get("tb") else ""
        return f"matmul({a.name}{ta}, {b.name}{tb})" + epilogue_text(node, node.inputs[2:])

    def grad(self, node, gouts, gb):
        """c = op(a) @ op(b): d op(a) = g @ op(b)^T and d op(b) = op(a)^T @ g, each
        written for the layout its operand is stored in (no transpose is made)."""
        (g,) = gouts
        a, b = node.inputs[:2]
        if "epilogue" in node.attrs:
            raise NotImplementedError("gradient of a matmul with a fused epilogue (fuse after autodiff)")
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        if ta:  # a is 2-D, stored [K, M]: da = (g @ op(b)^T)^T, db = op((a @ g)^T if tb)
            both = {"ta": True, "tb": True}
            da = gb.op("matmul", [b, g], both if tb else {"tb": True}, f"d_{a.name}")
            db = gb.op("matmul", [g, a] if tb else [a, g], both if tb else {}, f"d_{b.name}")
            return [da, db]
        rows = numel(a.shape[:-1])
        a2 = a if a.rank == 2 else gb.reshape(a, (rows, a.shape[-1]))
        g2 = g if g.rank == 2 else gb.reshape(g, (rows, g.shape[-1]))
        if tb:  # b stored [P, K]: da = g @ b, db = g^T @ a
            da = gb.op("matmul", [g, b], {}, f"d_{a.name}")
            db = gb.op("matmul", [g2, a2], {"ta": True}, f"d_{b.name}")
            return [da, db]
        da = gb.op("matmul", [g, b], {"tb": True}, f"d_{a.name}")
        db = gb.op("matmul", [a2, g2], {"ta": True}, f"d_{b.name}")
        return [da, db]


def _bf16_hand_over(ctx, node, rows, n) -> list:
    """The output y [rows, n] of a product by a kept bf16 weight handed over to the one
    product that reads it, and nothing else does, when that one is a product by a kept
    bf16 weight too that takes y as its activation: written as the bf16 rows that one
    would pack (dg_bf16.h: Bf16Rows, rows of n rounded up to 32 values, up to 15 rows
    of padding) into an arena piece of its own, which the reader takes instead of
    packing y (Bf16RowsIn); y itself is then not written where the CPU has bf16
    products. BERT's GELU'd FFN rows. Returns the call's last argument, or nothing."""
    y = node.outputs[0]
    reader = ctx.sole_reader(y)
    if (reader is None or ctx.loop is not None or reader.op != "matmul" or reader.inputs[0] is not y
            or reader.attrs.get("ta") or get_op("matmul").rounds_on_read(reader) != (0,) or not isinstance(n, int)):
        return []
    width = (n + 31) // 32 * 32  # dg::bf16_handed_width
    h = ctx.hand_over(y, f"{y.name}_bf16_rows", (rows + 15) * (width // 2))  # bf16 values, two to a float
    return [Named("handed_over", Struct("Bf16Rows", (PieceAs(h, "bf16"),)))]


def _swap_last(shape, transposed):
    shape = tuple(shape)
    return shape[:-2] + (shape[-1], shape[-2]) if transposed else shape


def _transposed(ta, tb) -> dict:
    """bmm's attrs: only the flags that are set."""
    return {k: True for k, v in (("ta", ta), ("tb", tb)) if v}


def _flag(value) -> str:
    return "true" if value else "false"


@register
class BatchedMatMul(OpDef):
    """c[..., M, P] = op(a)[..., M, K] @ op(b)[..., K, P], one product per index of
    the leading (batch) axes, which both operands have alike."""

    name = "bmm"
    products = (0, 1)

    def fold(self, node, consts):
        return 0.0 if 0.0 in consts[:2] else None

    def infer(self, inputs, attrs):
        require_float(inputs)
        if len(inputs) != 2:
            raise ValueError(f"bmm takes 2 operands, got {len(inputs)}")
        a, b = inputs
        sa, sb = _swap_last(a.shape, attrs.get("ta")), _swap_last(b.shape, attrs.get("tb"))
        if a.rank < 2 or a.rank != b.rank or not all(same(x, y) for x, y in zip(sa[:-2], sb[:-2])):
            raise ValueError(
                f"expected a[..., M, K] @ b[..., K, P] with the same leading axes, got '{a.name}' "
                f"{fmt_shape(sa)} and '{b.name}' {fmt_shape(sb)}"
            )
        if not same(sa[-1], sb[-2]):
            raise ValueError(
                f"inner dimensions differ: '{a.name}' {fmt_shape(sa)} has K={sa[-1]}, "
                f"'{b.name}' {fmt_shape(sb)} has K={sb[-2]}"
            )
        return [("float32", tuple(sa[:-1]) + (sb[-1],))]

    def reference(self, args, attrs, dims):
        a, b = args
        a = np.swapaxes(a, -1, -2) if attrs.get("ta") else a
        b = np.swapaxes(b, -1, -2) if attrs.get("tb") else b
        return [np.matmul(a, b)]

    def lower(self, node, ctx):
        a, b = node.inputs
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        sa, sb = _swap_last(a.shape, ta), _swap_last(b.shape, tb)
        return [ctx.call("dg::batched_matmul", ctx.read(a), ctx.read(b), ctx.write(node.outputs[0]),
                         Named("batch", ctx.size(numel(sa[:-2]))), Named("M", ctx.size(sa[-2])),
                         Named("K", ctx.size(sa[-1])), Named("N", ctx.size(sb[-1])),
                         Named("ta", _flag(ta)), Named("tb", _flag(tb)))]

    def describe(self, node):
        a, b = node.inputs
        ta = "^T" if node.attrs.get("ta") else ""
        tb = "^T" if node.attrs.get("tb") else ""
        return f"bmm({a.name}{ta}, {b.name}{tb})"

    def grad(self, node, gouts, gb):
        """C = A @ B with A = op(a), B = op(b): dA = g @ B^T and dB = A^T @ g, each
        made in the layout its operand is stored in (dA^T = B @ g^T when ta)."""
        (g,) = gouts
        a, b = node.inputs
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        if ta:  # da = dA^T = op(b) @ g^T
            da = gb.op("bmm", [b, g], _transposed(tb, True), f"d_{a.name}")
        else:  # da = g @ op(b)^T
            da = gb.op("bmm", [g, b], _transposed(False, not tb), f"d_{a.name}")
        if tb:  # db = dB^T = g^T @ op(a)
            db = gb.op("bmm", [g, a], _transposed(True, ta), f"d_{b.name}")
        else:  # db = op(a)^T @ g
            db = gb.op("bmm", [a, g], _transposed(not ta, False), f"d_{b.name}")
        return [da, db]
