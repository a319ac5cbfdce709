"""int8 inference: `matmul_int8`, the product `--precision int8` puts in place of
every matmul by a weight (transforms/quantize.py).

y[..., j] = float(sum_k qx[..., k] * qw[j, k]) * (x_scale * w_scale[j])

- qx = quantize(x, x_scale): the activation, one static scale per tensor
  (`<weight>_input_scale`, shape [1], calibrated by `deepgen quantize`);
- qw = quantize(w[j, :], w_scale[j], 63): the weight, one scale per output
  channel (`<weight>_scale`, shape [P]: max |w_j| / 63), 7 bits: the AVX2 kernel
  multiplies activation bytes shifted to [1, 255] by weight bytes with
  vpmaddubsw, whose int16 pair sums saturate above 32767; 2 * 255 * 63 = 32130
  never does (ONNX Runtime's reduce_range, the same choice), so the sums stay
  exact (runtime dg_int8.h says more). The Model quantizes the weight once per
  change of the parameters and keeps it packed (dg_int8_weights.h); the weight
  stays a float32 parameter;
- quantize(v, s, qmax) = clamp(round_half_even(v * (1 / s)), -qmax, qmax) as
  int8 (qmax 127 for activations), where 1 / s is a float32 division and
  v * (1 / s) a float32 product: numpy's np.rint and C++'s std::nearbyint (and
  _mm256_round_ps) round the same float alike;
- the sum is exact in int32 (the kernel's sum_k (qx + 128) * qw is at most
  K * 255 * 63 < 2^31: the rewrite checks K), the float32 conversion of the sum
  rounds to nearest, and the scale product x_scale * w_scale[j] is one float32
  multiply done first, then the other.

So the numpy reference below and the generated C++ (runtime dg_int8.h) agree
bit for bit. A scale that is 0 (never loaded: a new Model's buffers are zeros),
negative or not finite is an error naming it.

The C++ is two named calls, dg::quantize_int8 of the activation (an arena piece
`<name>_q`, rows of K bytes rounded up to whole floats, counted by the memory plan)
and dg::matmul_int8 of it by the Model's `<weight>_int8` member, a
dg::KeptInt8Weight that names the weight, its scale and the scale's name: it
quantizes (dg::quantize_weight_int8) and packs the weight when the parameters
have changed since it last did.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from ..codegen.stmt import PieceAs, Named, Read, Struct
from ..errors import DeepgenError
from ..ir.graph import Node
from ..ir.shapes import fmt_shape, numel, same
from .linalg import epilogue_text, with_epilogue
from .registry import OpDef, register, require_float

QMAX = 127  # an activation's int8 values: [-127, 127]
WEIGHT_QMAX = 63  # a weight's: [-63, 63] (vpmaddubsw's pairs never saturate: see the top)
# The largest K whose int32 sums cannot overflow in the kernel, which sums
# (qx + 128) * qw: K * 255 * 63 <= 2^31 - 1.
MAX_K = (2**31 - 1) // (255 * WEIGHT_QMAX)


def check_scale(scale, name: str) -> np.ndarray:
    s = np.asarray(scale, dtype=np.float32)
    bad = ~(np.isfinite(s) & (s > 0))
    if bad.any():
        value = float(s.reshape(-1)[np.flatnonzero(bad.reshape(-1))[0]])
        raise ValueError(f"int8 scale '{name}' is {value:g}: it was never set (load the weights file that "
                         "`deepgen quantize` writes)" if value == 0 else
                         f"int8 scale '{name}' is {value:g}: a scale must be positive and finite")
    return s


def quantize(x, scale, qmax: int = QMAX) -> np.ndarray:
    """clamp(rint(x * (1 / scale)), -qmax, qmax) as int8; `scale` broadcasts against x
    (a per-tensor [1] or a per-row [P, 1])."""
    inv = np.float32(1.0) / np.asarray(scale, dtype=np.float32)
    return np.clip(np.rint(np.asarray(x, dtype=np.float32) * inv), -qmax, qmax).astype(np.int8)


def weight_rows(w, tb: bool) -> np.ndarray:
    """The weight as [P, K] rows, one per output channel (w is [K, P], or [P, K] when tb)."""
    return w if tb else w.T


def weight_scales(w, tb: bool) -> np.ndarray:
    """Per output channel max |w_j| / 63 in float32; a channel of zeros gets 1 (its
    int8 row is zeros with any scale, and 0 means "never set")."""
    peak = np.abs(np.asarray(weight_rows(w, tb), dtype=np.float32)).max(axis=1)
    return np.where(peak > 0, peak / np.float32(WEIGHT_QMAX), np.float32(1.0)).astype(np.float32)


def input_scale(peak) -> np.ndarray:
    """The activation's scale from its calibrated max |x| (1 when it was always 0)."""
    peak = np.float32(peak)
    return np.array([peak / np.float32(QMAX) if peak > 0 else 1.0], dtype=np.float32)


def matmul_int8(x, w, x_scale, w_scale, tb: bool, names=("x_scale", "w_scale")) -> np.ndarray:
    xs = check_scale(x_scale, names[0])
    ws = check_scale(w_scale, names[1])
    qx = quantize(x, xs[0])
    qw = quantize(weight_rows(w, tb), ws[:, None], WEIGHT_QMAX)
    # int8 x int8 sums are exact in float64 (|sum| < 2^31 < 2^53), where BLAS computes them fast
    acc = np.matmul(qx.astype(np.float64), qw.T.astype(np.float64)).astype(np.int32)
    return acc.astype(np.float32) * (xs[0] * ws)


@register
class MatMulInt8(OpDef):
    """y = x @ w (w stored [K, P], or [P, K] with tb) in int8 with int32 sums:
    operands x, w, x_scale [1], w_scale [P]; attrs tb and the scales' names. Attr
    `epilogue` (passes.epilogue, through float_form: as matmul's, ops/linalg.py) is
    applied to the dequantized product, its operands after the scales; the runtime
    applies it to each finished piece of the output while in cache."""

    name = "matmul_int8"

    def infer(self, inputs, attrs):
        require_float(inputs)
        if len(inputs) != 4 and not (len(inputs) > 4 and "epilogue" in attrs):
            raise ValueError(f"matmul_int8 takes x, w, x_scale, w_scale, got {len(inputs)} operands")
        x, w, xs, ws = inputs[:4]
        if x.rank < 1 or w.rank != 2:
            raise ValueError(f"expected x[..., K] and a 2-D weight, got '{x.name}' {fmt_shape(x.shape)} "
                             f"and '{w.name}' {fmt_shape(w.shape)}")
        k, p = (w.shape[1], w.shape[0]) if attrs.get("tb") else w.shape
        if not same(x.shape[-1], k):
            raise ValueError(f"inner dimensions differ: '{x.name}' {fmt_shape(x.shape)}, weight '{w.name}' "
                             f"{fmt_shape(w.shape)}{' (stored [P, K])' if attrs.get('tb') else ''}")
        if tuple(xs.shape) != (1,) or len(ws.shape) != 1 or not same(ws.shape[0], p):
            raise ValueError(f"scales: expected '{xs.name}' [1] and '{ws.name}' [{p}], got "
                             f"{fmt_shape(xs.shape)} and {fmt_shape(ws.shape)}")
        return [("float32", tuple(x.shape[:-1]) + (p,))]

    def reference(self, args, attrs, dims):
        x, w, xs, ws = args[:4]
        out = matmul_int8(x, w, xs, ws, attrs.get("tb", False), (attrs["x_scale"], attrs["w_scale"]))
        return [with_epilogue(out, args[4:], attrs, dims)]

    def lower(self, node, ctx):
        x, w, xs, ws = node.inputs[:4]
        if "dg_int8.h" not in ctx.target.runtime:  # the target's runtime has no int8 kernels (CUDA, for now)
            raise DeepgenError(f"--precision int8: the {ctx.target.name} target has no int8 runtime (dg_int8.h) yet")
        tb = node.attrs.get("tb", False)
        k = x.shape[-1]
        p = w.shape[0] if tb else w.shape[1]
        m = numel(x.shape[:-1])
        xs_r = ctx.read(xs)
        kept = ctx.kept_int8(w, ws, tb, k, p)  # the Model's dg::KeptInt8Weight: quantized once per change
        size = ctx.size
        lines = []
        quantized = ctx.handed(x)  # x handed over quantized by the product that made it
        if quantized is None:
            qx = ctx.workspace(f"{x.name}_q", m * _row_floats(k))
            lines.append(ctx.call("dg::quantize_int8", ctx.read(x), PieceAs(qx), xs_r, Named("rows", size(m)),
                                  Named("K", size(k)), Named("scale_name", ctx.string(xs.name))))
            quantized = Read(qx.value, qx.expr)
        out = _hand_over(ctx, node, m, p)
        epi = [ctx.epilogue(node, first=4)] if "epilogue" in node.attrs else ["dg::NoEpilogue()"] if out else []
        lines.append(ctx.call("dg::matmul_int8", PieceAs(quantized), xs_r, kept, ctx.write(node.outputs[0]),
                              Named("M", size(m)), *epi, *out))
        return lines

    def describe(self, node):
        x, w, xs, ws = node.inputs[:4]
        tb = "^T" if node.attrs.get("tb") else ""
        return f"matmul_int8({x.name}, {w.name}{tb}; scales {xs.name}, {ws.name})" + epilogue_text(node, node.inputs[4:])


def _row_floats(k):
    """An int8 row of K bytes in whole groups of four, in floats of the arena."""
    return (k + 3) // 4


def _hand_over(ctx, node, m, p) -> list:
    """The output y [m, p] of an int8 product handed over to the one int8 product that
    reads it as its activation (nothing else reads y): quantized with that one's input
    scale into rows of an arena piece of its own (a quarter of y's bytes), which the reader
    takes instead of its dg::quantize_int8 call. The same bytes (dg_int8.h: Int8Rows;
    with AMX the epilogue's rows are quantized from a copy in cache, not written back:
    BERT's GELU'd FFN rows). Returns the call's last argument, or nothing."""
    y = node.outputs[0]
    reader = ctx.sole_reader(y)
    if reader is None or ctx.loop is not None or reader.op != node.op or reader.inputs[0] is not y:
        return []
    scale = reader.inputs[2]
    q = ctx.hand_over(y, f"{y.name}_q", m * _row_floats(p))
    return [Named("handed_over", Struct("Int8Rows", (PieceAs(q), ctx.read(scale), ctx.string(scale.name))))]


# What transforms/quantize.py, calibration and `deepgen quantize` ask about the ops
# (the stages name no op: ARCHITECTURE, "What a stage may know").

# A float32 product -> its int8 form, whose operands are the product's with the two
# scales after the weight (to_int8). A convolution fused with the batch norm after it
# (transforms/passes.py conv_batch_norm) has one too: the pass fuses an int8
# convolution as the conv2d it stands for (float_form), then makes the fused node int8.
INT8_OPS = {"matmul": "matmul_int8", "conv2d": "conv2d_int8", "conv2d_batch_norm": "conv2d_batch_norm_int8"}
CONVS = ("conv2d", "conv2d_batch_norm")  # the float32 products by a convolution's weight [O, C, KH, KW]


def int8_candidates(graph) -> list:
    """The nodes `--precision int8` rewrites, in order: matmuls whose right operand
    is a parameter (not transposed on the left, no epilogue yet) and one-group
    convolutions by a parameter (ops/quantize_conv.py; fused with a batch norm or not)."""
    return [n for n in graph.nodes
            if (n.op == "matmul" and len(n.inputs) == 2 and not n.attrs.get("ta") and "epilogue" not in n.attrs
                or n.op in CONVS and n.attrs.get("groups", 1) == 1)
            and n.inputs[1].kind == "param"]


def _is_conv(node) -> bool:
    return float_form(node)[0].op in CONVS


def int8_sizes(node) -> tuple:
    """(K, P) of a candidate or int8 node: the terms of each sum and the output channels."""
    w = node.inputs[1]
    if _is_conv(node):
        return numel(w.shape[1:]), w.shape[0]
    return (w.shape[1], w.shape[0]) if node.attrs.get("tb") else tuple(w.shape)


def int8_weight_scales(node, w) -> np.ndarray:
    """The per-output-channel scales of the weight array w of an int8 node."""
    w = np.asarray(w, np.float32)
    if _is_conv(node):
        return weight_scales(w.reshape(w.shape[0], -1), True)
    return weight_scales(w, bool(node.attrs.get("tb")))


def to_int8(node, x_scale, w_scale) -> None:
    """Turn a candidate into its int8 op in place, reading the two scales (after the
    weight; the rest of its operands, a convolution's bias or batch norm's, after them)."""
    x, w, *rest = node.inputs
    scales = {"x_scale": x_scale.name, "w_scale": w_scale.name}
    if node.op in CONVS:
        node.attrs = {**node.attrs, **scales}
    else:  # a matmul keeps tb and a fused epilogue (passes.epilogue)
        kept = {k: v for k, v in node.attrs.items() if k.startswith("epilogue")}
        node.attrs = {**({"tb": True} if node.attrs.get("tb") else {}), **scales, **kept}
    node.op = INT8_OPS[node.op]
    node.inputs = [x, w, x_scale, w_scale, *rest]


def int8_nodes(graph) -> list:
    return [n for n in graph.nodes if n.op in INT8_OPS.values()]


def _float_node(n) -> Node:
    """An int8 node's float32 product (the same values, the same place)."""
    op = next(f for f, q in INT8_OPS.items() if q == n.op)
    attrs = {k: v for k, v in n.attrs.items() if k not in ("x_scale", "w_scale")}
    return Node(op, n.inputs[:2] + n.inputs[4:], attrs, outputs=n.outputs, loc=n.loc, phase=n.phase)


def float_form(node) -> tuple:
    """(the float32 node an int8 node computes in int8, its [x_scale, w_scale]): what a
    pass that matches float32 products sees of it (to_int8 makes its result int8
    again); a node that is not int8: (node, [])."""
    if node.op not in INT8_OPS.values():
        return node, []
    return _float_node(node), node.inputs[2:4]


def float_twin(graph):
    """The same graph with each int8 node back to its float32 product (the values,
    scales included, are shared; the nodes at the same places): what calibration runs."""
    nodes = [_float_node(n) if n.op in INT8_OPS.values() else n for n in graph.nodes]
    return replace(graph, nodes=nodes, precision="fp32")
