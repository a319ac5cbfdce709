"""Matrix multiply: a[..., M, K] @ b[K, P] -> [..., M, P].

Attrs `ta`/`tb` say an operand is stored transposed (then it must be 2-D): the
gradients a^T @ g and g @ b^T are computed without materializing a transpose."""

from __future__ import annotations

import numpy as np

from ..shapes import fmt_shape, numel, same
from .registry import OpDef, register, require_float


def _logical(v, transposed):
    return (v.shape[1], v.shape[0]) if transposed else v.shape


@register
class MatMul(OpDef):
    name = "matmul"

    def infer(self, inputs, attrs):
        a, b = inputs
        require_float(inputs)
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
        a, b = args
        a = a.T if attrs.get("ta") else a
        b = b.T if attrs.get("tb") else b
        return [np.matmul(a, b)]

    def lower(self, node, ctx):
        a, b = node.inputs
        ta, tb = node.attrs.get("ta", False), node.attrs.get("tb", False)
        sa, sb = _logical(a, ta), _logical(b, tb)
        fn = "matmul" + ("_tn" if ta else "_nt" if tb else "")
        return [
            f"dg::{fn}({ctx.ptr(a)}, {ctx.ptr(b)}, {ctx.out(node.outputs[0])}, "
            f"{ctx.size(numel(sa[:-1]))}, {ctx.size(sa[-1])}, {ctx.size(sb[1])});"
        ]

    def describe(self, node):
        a, b = node.inputs
        ta = "^T" if node.attrs.get("ta") else ""
        tb = "^T" if node.attrs.get("tb") else ""
        return f"matmul({a.name}{ta}, {b.name}{tb})"

    def grad(self, node, gouts, gb):
        (g,) = gouts
        a, b = node.inputs
        if node.attrs.get("ta") or node.attrs.get("tb"):
            raise NotImplementedError("second derivatives of transposed matmuls")
        rows = numel(a.shape[:-1])
        da = gb.op("matmul", [g, b], {"tb": True}, f"d_{a.name}")
        a2 = a if a.rank == 2 else gb.reshape(a, (rows, a.shape[-1]))
        g2 = g if g.rank == 2 else gb.reshape(g, (rows, g.shape[-1]))
        db = gb.op("matmul", [a2, g2], {"ta": True}, f"d_{b.name}")
        return [da, db]
