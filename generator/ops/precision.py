"""Reduced precision: the rounding step that `--precision bf16` puts before every
product's operands (transforms/precision.py)."""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Named
from ..ir.shapes import numel
from .registry import OpDef, get_op, register, require_float


def round_to_bf16(x) -> np.ndarray:
    """x rounded to the nearest bfloat16 value, ties to even, kept in a float32
    (its low 16 bits zero): the float32 bits plus 0x7FFF plus the lowest kept bit,
    the low 16 bits then cleared. A NaN stays the same NaN; the largest finite
    floats round up to infinity, as round-to-nearest-even does."""
    x32 = np.asarray(x, dtype=np.float32)
    bits = x32.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(x32), x32, rounded).astype(np.asarray(x).dtype)


def rounded_weight(v) -> bool:
    """Whether v is a parameter rounded by an op whose kept type has product kernels of
    its own (OpDef.kept_as: a dg::KeptBf16Weight, read by dg::matmul_bf16 and
    dg::conv2d_bf16, which round their other operand as they read it)."""
    node = v.producer
    return node is not None and bool(get_op(node.op).kept_as) and getattr(node.inputs[0], "kind", None) == "param"


def read_rounded(ctx, node, i: int, call_rounds: bool) -> tuple:
    """(how a product's call reads operand i, the lines before the call): the operand as
    it is, unless the node reads it rounded (attr `rounded`, transforms/rounding.py) and
    the call it lowers to does not round it (call_rounds false: another kernel, another
    target); then it is rounded into a workspace by dg::round_bf16 first."""
    v = node.inputs[i]
    if i not in node.attrs.get("rounded", ()) or call_rounds:
        return ctx.read(v), []
    n = numel(v.shape)
    rounded = ctx.workspace(f"{v.name}_bf16", n)
    return rounded, [ctx.call("dg::round_bf16", ctx.read(v), rounded, Named("n", ctx.size(n)))]


def rounded_args(args, attrs) -> list:
    """The reference's operands of a product: those the node reads rounded (attr
    `rounded`) rounded to bf16."""
    at = attrs.get("rounded", ())
    return [round_to_bf16(a) if i in at else a for i, a in enumerate(args)]


@register
class RoundBf16(OpDef):
    """y = x rounded to bfloat16 (round to nearest, ties to even), stored as float32."""

    name = "round_bf16"
    in_place = True
    prepared_by_packing = "dg::round_bf16"  # a weight's kept packing rounds it as it packs
    # a weight read by products kept in bf16 for the bf16 products (dg_bf16.h, dg_bf16_conv.h), and
    # the function each product calls on bf16 values (kept, or two of them: dg::matmul_tn_bf16)
    kept_as = ("dg::KeptBf16Weight", {"dg::matmul": "dg::matmul_bf16", "dg::matmul_nt": "dg::matmul_nt_bf16",
                                      "dg::matmul_tn": "dg::matmul_tn_bf16", "dg::conv2d": "dg::conv2d_bf16",
                                      "dg::conv2d_batch_norm": "dg::conv2d_batch_norm_bf16"})

    def infer(self, inputs, attrs):
        require_float(inputs)
        return [("float32", inputs[0].shape)]

    def reference(self, args, attrs, dims):
        return [round_to_bf16(args[0])]

    def lower(self, node, ctx):
        if ctx.packing_prepares(node):
            return []  # each reader's kept packing of the weight rounds it, once per change
        (x,) = node.inputs
        return [ctx.call("dg::round_bf16", ctx.read(x), ctx.write(node.outputs[0]), Named("n", ctx.size(numel(x.shape))))]
