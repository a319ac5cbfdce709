"""int8 inference of a convolution: `conv2d_int8`, what `--precision int8` puts in
place of a one-group conv2d by a weight (transforms/quantize.py), as matmul_int8
(ops/quantize.py) is for a dense layer's product:

y[n, o] = float(sum_k qx[n, window k] * qw[o, k]) * (x_scale * w_scale[o]) (+ b[o])

with qx = quantize(x, x_scale) (one static scale per tensor, `<weight>_input_scale`;
the zero padding quantizes to 0), qw the weight's rows [O, C*KH*KW] quantized per
output channel to [-63, 63] (`<weight>_scale` [O]), the sum exact in int32, the
float32 steps in the same order as the runtime's (dg_int8_conv.h: the input quantized,
its windows' rows times the weight by the int8 product of dg_int8.h, then the bias; the
runtime orders each row's k tap-major, channels-last, and the kept weight's rows the
same way: /*taps=*/KH*KW). So the numpy reference and the C++ agree bit for bit.

`conv2d_batch_norm_int8` is conv2d_batch_norm (ops/modes.py) with this convolution: what
the conv_batch_norm pass makes of an int8 convolution and the batch norm after it."""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import PieceAs, Named, Struct
from ..errors import DeepgenError
from ..ir.shapes import fmt_shape, numel, same
from .conv import _conv_ref, _describe, _geom
from .modes import ConvBatchNorm, _float
from .quantize import WEIGHT_QMAX, check_scale, quantize
from .registry import OpDef, get_op, register


def conv_int8(x, w, x_scale, w_scale, attrs, names=("x_scale", "w_scale")) -> np.ndarray:
    xs = check_scale(x_scale, names[0])
    ws = check_scale(w_scale, names[1])
    qx = quantize(x, xs[0]).astype(np.float64)
    O = w.shape[0]
    qw = quantize(np.asarray(w, np.float32).reshape(O, -1), ws[:, None], WEIGHT_QMAX).reshape(w.shape)
    # int8 x int8 sums are exact in float64 (|sum| < 2^31 < 2^53)
    acc = _conv_ref(qx, qw.astype(np.float64), attrs).astype(np.int32)
    return acc.astype(np.float32) * (xs[0] * ws)[None, :, None, None]


@register
class Conv2dInt8(OpDef):
    """y = conv2d(x, w) (+ b) in int8 with int32 sums: operands x, w, x_scale [1],
    w_scale [O], then b when the convolution has one; attrs: conv2d's and the
    scales' names. One group only (the rewrite's rule)."""

    name = "conv2d_int8"
    describe = _describe

    def infer(self, inputs, attrs):
        if len(inputs) not in (4, 5):
            raise ValueError(f"conv2d_int8 takes x, w, x_scale, w_scale and an optional b, got {len(inputs)} operands")
        x, w, xs, ws = inputs[:4]
        (y,) = get_op("conv2d").infer([x, w, *inputs[4:]], attrs)
        if attrs.get("groups", 1) != 1:
            raise ValueError(f"conv2d_int8: one group only, got groups={attrs['groups']}")
        if tuple(xs.shape) != (1,) or len(ws.shape) != 1 or not same(ws.shape[0], w.shape[0]):
            raise ValueError(f"scales: expected '{xs.name}' [1] and '{ws.name}' [{w.shape[0]}], got "
                             f"{fmt_shape(xs.shape)} and {fmt_shape(ws.shape)}")
        return [y]

    def reference(self, args, attrs, dims):
        x, w, xs, ws = args[:4]
        y = conv_int8(x, w, xs, ws, attrs, (attrs["x_scale"], attrs["w_scale"]))
        if len(args) == 5:
            y = y + args[4].reshape(1, -1, 1, 1)
        return [y.astype(np.float32)]

    def lower(self, node, ctx):
        x, w, xs, ws = node.inputs[:4]
        y = node.outputs[0]
        geom, name, kept, scratch = _int8_conv(ctx, node, x, w, ws, y)
        b = ctx.read(node.inputs[4]) if len(node.inputs) == 5 else "nullptr"
        return [geom, ctx.call("dg::conv2d_int8", ctx.read(x), ctx.read(xs), kept, b, ctx.write(y), scratch, name,
                               Named("scale_name", ctx.string(xs.name)))]


# dg_int8_conv.h's kInt8ConvScratchBytes: the workspace one product takes at most.
INT8_CONV_SCRATCH_BYTES = 2 << 20


def _lines(n: int) -> int:
    """Bytes rounded up to whole 64-byte lines (dg_int8_conv.h int8_lines)."""
    return -(-n // 64) * 64


def _int8_conv_bytes(C, H, W, O, K, positions, images, tiles) -> int:
    """dg_int8_conv.h conv2d_int8_bytes: a product's int8 copy, then its rows in AMX tiles,
    or its rows and float32 product (a space that first holds one image's planes)."""
    M, copy = images * positions, _lines(images * H * W * C)
    if tiles:
        return copy + -(-M // 16) * 16 * -(-K // 64) * 64
    return copy + max(_lines(M * -(-K // 4) * 4) + M * O * 4, C * H * W)


def _int8_conv_images(C, H, W, O, K, positions, tiles) -> int:
    """dg_int8_conv.h conv2d_int8_images: the images one product takes at most."""
    each = H * W * C + positions * (-(-K // 64) * 64 if tiles else -(-K // 4) * 4 + O * 4)
    n = max(1, INT8_CONV_SCRATCH_BYTES // max(1, each))
    while n > 1 and _int8_conv_bytes(C, H, W, O, K, positions, n, tiles) > INT8_CONV_SCRATCH_BYTES:
        n -= 1
    return n


def int8_conv_workspace(x_shape, w_shape, out_hw) -> int:
    """Floats of dg::conv2d_int8's workspace (dg_int8_conv.h conv2d_int8_workspace, the
    same arithmetic): the larger of its two layouts, each for as many images as keep a
    product within INT8_CONV_SCRATCH_BYTES (at least one), from the workspace's first
    cache line. A constant: the batch does not enter it (a product takes fewer images
    where the batch is smaller)."""
    C, H, W = (int(d) for d in x_shape[1:])
    O, K = int(w_shape[0]), int(w_shape[1]) * int(w_shape[2]) * int(w_shape[3])
    positions = int(out_hw[0]) * int(out_hw[1])
    most = max(_int8_conv_bytes(C, H, W, O, K, positions, _int8_conv_images(C, H, W, O, K, positions, t), t)
               for t in (True, False))
    return -(-(63 + most) // 4)  # (up to 63 bytes to start on a cache line)


def _int8_conv(ctx, node, x, w, ws, y) -> tuple:
    """(the geometry's line, its name, the kept int8 weight, the workspace) of an int8
    convolution's call. The workspace is in the arena, so the memory plan counts the
    int8 copy of the input and the rows (no buffer outside it)."""
    if "dg_int8_conv.h" not in ctx.target.runtime:
        raise DeepgenError(f"--precision int8: the {ctx.target.name} target has no int8 runtime (dg_int8.h) yet")
    kernel, out_hw = tuple(w.shape[2:]), tuple(y.shape[2:])
    geom, name = _geom(ctx, node, x.shape, w.shape[0], kernel, out_hw, w.name)
    # rows [O, C*KH*KW], each row's k packed channels-last (tap by tap), once per change
    kept = ctx.kept_int8(w, ws, True, numel(w.shape[1:]), w.shape[0], int(kernel[0]) * int(kernel[1]))
    scratch = ctx.workspace(f"{y.name}_rows", int8_conv_workspace(x.shape, w.shape, out_hw))
    return geom, name, kept, scratch


@register
class ConvBatchNormInt8(ConvBatchNorm):
    """[y, mean, invstd] = conv2d_batch_norm_int8(x, w, x_scale, w_scale, bn_weight, bn_bias,
    running_mean, running_var, mode[, b][, residual]): conv2d_batch_norm (ops/modes.py) with
    the convolution of conv2d_int8, the operands of conv2d_batch_norm with the two scales after
    the weight (what the conv_batch_norm pass makes of an int8 convolution and its batch norm,
    transforms/passes.py). dg::conv2d_batch_norm_int8 normalizes, adds the residual and
    rectifies each block of output as the int8 product stores it (evaluation mode), with
    batch norm's own arithmetic; in training mode it is conv2d_int8, then batch norm's
    training path, the residual and relu. The reference is conv2d_int8's, then batch norm's."""

    name = "conv2d_batch_norm_int8"
    conv_op = "conv2d_int8"
    lead = 4  # x, w, x_scale, w_scale
    updates_state = (6, 7)

    def packed_read(self, node):
        return None  # the Model's dg::KeptInt8Weight (LowerCtx.kept_int8), not a float packing

    def lower(self, node, ctx):
        (x, w, xs, ws, *conv_b), (bn_w, bn_b, rm, rv, mode), residual = self._split(node.inputs, node.attrs)
        y, mean, invstd = node.outputs
        geom, name, kept, scratch = _int8_conv(ctx, node, x, w, ws, y)
        b = ctx.read(conv_b[0]) if conv_b else "nullptr"
        r = ctx.read(residual) if residual is not None else "nullptr"
        what = ctx.string(f"batch norm of the convolution of '{x.name}'")
        quantized = ctx.handed(x)  # x handed over quantized by the convolution that made it
        source = Struct("Int8ChannelsLastIn", (PieceAs(quantized),)) if quantized is not None else ctx.read(x)
        out = _hand_over(ctx, node, y)
        return [geom, ctx.call("dg::conv2d_batch_norm_int8", source, ctx.read(xs), kept, b,
                               ctx.read(bn_w), ctx.read(bn_b), ctx.write(rm), ctx.write(rv), Named("residual", r),
                               ctx.write(y), ctx.write(mean), ctx.write(invstd), scratch, name,
                               Named("scale_name", ctx.string(xs.name)),
                               Named("eps", _float(node.attrs["eps"])),
                               Named("momentum", _float(node.attrs["momentum"])),
                               Named("relu", "true" if node.attrs.get("relu") else "false"), ctx.read(mode), what,
                               *out)]


def _hand_over(ctx, node, y) -> list:
    """The output y of an int8 convolution with batch norm handed over to the one int8
    convolution with batch norm that reads it (its input; nothing else reads y): quantized
    with that one's input scale, channels last, into an arena piece of its own (a quarter
    of y's bytes), which the reader takes instead of quantizing y itself (its first step).
    The same bytes as the reader would make (dg_int8_conv.h: ChannelsLastInt8, quantize_int8_x16);
    in evaluation mode without a residual y is not written at all. Returns the call's
    last argument (dg::Int8ChannelsLast), or nothing."""
    reader = ctx.sole_reader(y)
    if reader is None or reader.op != node.op or reader.inputs[0] is not y:
        return []
    scale = reader.inputs[2]
    q = ctx.hand_over(y, f"{y.name}_q", -(-numel(y.shape) // 4))
    return [Named("handed_over", Struct("Int8ChannelsLast", (PieceAs(q), ctx.read(scale), ctx.string(scale.name))))]
