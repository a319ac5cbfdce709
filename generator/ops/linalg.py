"""Matrix multiply: a[..., M, K] @ b[K, P] -> [..., M, P]."""

from __future__ import annotations

import numpy as np

from ..shapes import fmt_shape, numel, same
from .registry import OpDef, register, require_float


@register
class MatMul(OpDef):
    name = "matmul"

    def infer(self, inputs, attrs):
        a, b = inputs
        require_float(inputs)
        if a.rank < 1 or b.rank != 2:
            raise ValueError(
                f"expected a[..., K] @ b[K, P] with b 2-D, got '{a.name}' {fmt_shape(a.shape)} "
                f"and '{b.name}' {fmt_shape(b.shape)}"
            )
        if not same(a.shape[-1], b.shape[0]):
            raise ValueError(
                f"inner dimensions differ: '{a.name}' {fmt_shape(a.shape)} has K={a.shape[-1]}, "
                f"'{b.name}' {fmt_shape(b.shape)} has K={b.shape[0]}"
            )
        return [("float32", a.shape[:-1] + (b.shape[1],))]

    def reference(self, args, attrs, dims):
        return [np.matmul(args[0], args[1])]

    def lower(self, node, ctx):
        a, b = node.inputs
        rows = numel(a.shape[:-1])
        return [
            f"dg::matmul({ctx.ptr(a)}, {ctx.ptr(b)}, {ctx.out(node.outputs[0])}, "
            f"{ctx.size(rows)}, {ctx.size(a.shape[-1])}, {ctx.size(b.shape[1])});"
        ]
