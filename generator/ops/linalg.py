"""Matrix multiply: a[..., M, K] @ b[K, P] -> [..., M, P].

Attrs `ta`/`tb` say an operand is stored transposed (then it must be 2-D): the
gradients a^T @ g and g @ b^T are computed without materializing a transpose.

Attr `epilogue` (set by passes.epilogue, never by the DSL): a sympy expression
applied to each output element inside the GEMM, once its sum is complete. Its x0
is the sum; x1, x2, ... are the node's operands after a and b, each a scalar, a
per-column vector (a bias), a per-row vector or a full [..., M, P] array
(`epilogue_role`)."""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.shapes import fmt_shape, numel, same
from ..codegen.stmt import Named
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


@register
class MatMul(OpDef):
    name = "matmul"

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

    def reference(self, args, attrs, dims):
        a, b = args[:2]
        a = a.T if attrs.get("ta") else a
        b = b.T if attrs.get("tb") else b
        out = np.matmul(a, b)
        if "epilogue" in attrs:
            ewise = get_op("ewise")
            out = ewise.reference([out, *args[2:]], {"expr": attrs["epilogue"], "shape": out.shape}, dims)[0]
        return [out]

    def lower(self, node, ctx):
        a, b = node.inputs[:2]
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        sa, sb = _logical(a, ta), _logical(b, tb)
        fn = "matmul" + ("_tn" if ta else "_nt" if tb else "")
        # B packed before a loop (ops/recurse.py) is passed as the PackedB itself.
        b_arg = ctx.packed.get((id(b), tb)) if not ta else None
        args = [ctx.read(a), b_arg or ctx.read(b), ctx.write(node.outputs[0]),
                Named("M", ctx.size(numel(sa[:-1]))), Named("K", ctx.size(sa[-1])), Named("N", ctx.size(sb[1]))]
        if "epilogue" in node.attrs:
            args.append(ctx.epilogue(node))
        return [ctx.call(f"dg::{fn}", *args)]

    def describe(self, node):
        a, b = node.inputs[:2]
        ta = "^T" if node.attrs.get("ta") else ""
        tb = "^T" if node.attrs.get("tb") else ""
        text = f"matmul({a.name}{ta}, {b.name}{tb})"
        if "epilogue" in node.attrs:
            names = {ARGS[0]: sympy.Symbol("acc")}
            names.update({ARGS[k]: sympy.Symbol(v.name) for k, v in enumerate(node.inputs[2:], start=1)})
            text += f" then {' + '.join(node.attrs['epilogue_fns'])}: {node.attrs['epilogue'].xreplace(names)}"
        return text

    def grad(self, node, gouts, gb):
        (g,) = gouts
        a, b = node.inputs[:2]
        if "epilogue" in node.attrs:
            raise NotImplementedError("gradient of a matmul with a fused epilogue (fuse after autodiff)")
        if node.attrs.get("ta") or node.attrs.get("tb"):
            raise NotImplementedError("second derivatives of transposed matmuls")
        rows = numel(a.shape[:-1])
        da = gb.op("matmul", [g, b], {"tb": True}, f"d_{a.name}")
        a2 = a if a.rank == 2 else gb.reshape(a, (rows, a.shape[-1]))
        g2 = g if g.rank == 2 else gb.reshape(g, (rows, g.shape[-1]))
        db = gb.op("matmul", [a2, g2], {"ta": True}, f"d_{b.name}")
        return [da, db]
