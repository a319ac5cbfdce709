"""Convolution and pooling over NCHW tensors (PyTorch's layouts, inside and out).

Every op here carries the same geometry attrs: `stride`, `padding`, `dilation`
(pairs) and `groups`; the gradient ops add the forward input's spatial size or
the kernel size. Lowering declares the geometry once per call as a
`dg::Conv2dGeom` named after the output (`conv1_geom`), so a call reads
`dg::conv2d(x, conv1_w.ptr(), conv1_b.ptr(), conv1, conv1_cols, conv1_geom)`.
A convolution's column matrix (im2col of one image and group) is a workspace in
the arena, so the memory plan counts it. The numpy references loop over kernel
positions with einsum: a different computation from the runtime's im2col+GEMM.
"""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Declare, Named
from ..ir.shapes import fmt_shape
from .precision import read_rounded, rounded_args, rounded_weight
from .registry import OpDef, get_op, register, require_float

GEOM = ("stride", "padding", "dilation")


def out_size(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool = False) -> int:
    """Output length of a window sliding over `size` (PyTorch's formula). ceil_mode
    rounds up, so a last window may hang past the padded input, as long as it starts
    inside the input or its left padding."""
    span = size + 2 * pad - dilation * (kernel - 1) - 1
    if not ceil_mode:
        return span // stride + 1
    out = -(-span // stride) + 1
    return out - 1 if (out - 1) * stride >= size + pad else out


def _spatial(x, what):
    if x.dtype != "float32" or x.rank != 4:
        raise ValueError(f"{what} '{x.name}' must be float32 [N, C, H, W], got {x.type_str()}")
    if not all(isinstance(d, int) for d in x.shape[1:]):
        raise ValueError(f"{what} '{x.name}' {fmt_shape(x.shape)}: channels, height and width must be concrete")


def _window(x, kernel, attrs, op):
    """(OH, OW) of a window `kernel` over x, or a ValueError naming the sizes."""
    (sh, sw), (ph, pw), (dh, dw) = (attrs[k] for k in GEOM)
    H, W = x.shape[2:]
    KH, KW = kernel
    ceil = attrs.get("ceil_mode", False)
    OH, OW = out_size(H, KH, sh, ph, dh, ceil), out_size(W, KW, sw, pw, dw, ceil)
    if OH < 1 or OW < 1:
        span = (dh * (KH - 1) + 1, dw * (KW - 1) + 1)
        raise ValueError(
            f"input '{x.name}' {fmt_shape(x.shape)} is too small for {op}: the window spans "
            f"{span[0]}x{span[1]} but the padded input is {H + 2 * ph}x{W + 2 * pw}"
        )
    return OH, OW


def _geom(ctx, node, x_shape, out_channels, kernel, out_hw, weight: str = ""):
    """The Declare of this call's dg::Conv2dGeom, and its name: a convolution's (and its
    gradients') after its `weight` (`conv1_geom` for conv1_weight), so that the code of a
    function declares it once (codegen/declared_once.py); a pool's after its output."""
    (sh, sw), (ph, pw), (dh, dw) = (node.attrs[k] for k in GEOM)
    N, C, H, W = x_shape
    base = weight[: -len("_weight")] if weight.endswith("_weight") and len(weight) > len("_weight") else ""
    name = ctx.graph.names.unique(f"{base or node.outputs[0].name}_geom")
    args = [Named("N", ctx.size(N)), Named("C", C), Named("H", H), Named("W", W), Named("O", out_channels),
            Named("KH", kernel[0]), Named("KW", kernel[1]), Named("OH", out_hw[0]), Named("OW", out_hw[1]),
            Named("stride_h", sh), Named("stride_w", sw), Named("pad_h", ph), Named("pad_w", pw),
            Named("dil_h", dh), Named("dil_w", dw), Named("groups", node.attrs.get("groups", 1))]
    return Declare("const dg::Conv2dGeom", name, args, of=weight), name


def _columns(node, x_shape, kernel, out_hw):
    """Floats of one image's and group's column matrix; 0 for a pointwise conv."""
    (sh, sw), (ph, pw) = node.attrs["stride"], node.attrs["padding"]
    if kernel == (1, 1) and (sh, sw) == (1, 1) and (ph, pw) == (0, 0):
        return 0
    return x_shape[1] // node.attrs["groups"] * kernel[0] * kernel[1] * out_hw[0] * out_hw[1]


# dg_conv.h's kept-packing rule (conv_detail::kept_plane): output planes of up to
# SMALL_PLANE positions, one group, any weight size, run as one product over the
# batch by the transposed weight, kept packed by the Model.
SMALL_PLANE, DIRECT_MAX_OUTPUTS = 8, 4


def kept_weight_read(node):
    """(1, tb, [O, C*KH*KW]) where a convolution reads its weight (operand 1) through
    the Model's kept packing (dg::KeptPackedB, as for a Linear layer's weight): the
    runtime multiplies by it transposed over the whole batch (small output planes,
    one group: the packing is made once, not at every call, so a weight bigger than
    the caches is streamed once, in order); else None. The runtime checks the rule.
    A weight prepared by an op with a kept type of its own (OpDef.kept_as: the bf16
    rounding) is read through it at every plane size (one group, not direct)."""
    x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
    O = w.shape[0]
    G = node.attrs.get("groups", 1)
    OH, OW = y.shape[2:]
    direct = x.shape[1] == G and O // G <= DIRECT_MAX_OUTPUTS
    own_kept = w.producer is not None and bool(get_op(w.producer.op).kept_as)
    small = not direct and (OH * OW <= SMALL_PLANE or own_kept)
    return (1, True, (O, w.shape[1] * w.shape[2] * w.shape[3])) if small and G == 1 else None


def rounds_input_on_read(node) -> tuple:
    """(0,) where the convolution may run on a bf16 kernel, which rounds its input to
    bfloat16 as it copies it channels last (dg::conv2d_bf16): its weight is a
    parameter's bf16 rounding (ops/precision.py rounded_weight) read through a kept
    packing (kept_weight_read); else ()."""
    return (0,) if rounded_weight(node.inputs[1]) and kept_weight_read(node) is not None else ()


def conv_call(ctx, node, fn: str, w) -> tuple:
    """(the runtime function, how it reads the weight w, how it reads the input x, the
    lines before the call) of a convolution's call `fn` (dg::conv2d ...): w's kept
    packing where kept_weight_read says so and the Model keeps it (read by the
    function ctx.kept_call names: dg::conv2d_bf16 for a bf16 weight, which rounds x as
    it reads it), else fn and w as stored; x rounded first where the node reads it
    rounded and the call does not round it (ops/precision.py read_rounded)."""
    kept = kept_weight_read(node)
    packed = ctx.packed_operand(w, True, kept[2]) if kept else None
    call, weight = (ctx.kept_call(fn, w, True), packed[0]) if packed else (fn, ctx.read(w))
    x, rounding = read_rounded(ctx, node, 0, call_rounds=call != fn)
    return call, weight, x, rounding


def _pad(x, ph, pw, value=0.0):
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)), constant_values=value)


def _taps(attrs, kernel, out_hw):
    """(kh, kw, slice rows, slice cols) of each kernel position in the padded input."""
    (sh, sw), (dh, dw) = attrs["stride"], attrs["dilation"]
    OH, OW = out_hw
    for kh in range(kernel[0]):
        for kw in range(kernel[1]):
            rows = slice(kh * dh, kh * dh + sh * (OH - 1) + 1, sh)
            cols = slice(kw * dw, kw * dw + sw * (OW - 1) + 1, sw)
            yield kh, kw, rows, cols


def _crop(xp, ph, pw, H, W):
    return np.ascontiguousarray(xp[:, :, ph : ph + H, pw : pw + W])


def _describe(self, node):
    args = [v.name for v in node.inputs]
    geom = [f"{k}={node.attrs[k]}" for k in (*GEOM, "groups", "kernel") if k in node.attrs]
    return f"{self.name}({', '.join(args + geom)})"


# -- convolution -----------------------------------------------------------------


def _conv_ref(x, w, attrs):
    """Cross-correlation as torch.nn.functional.conv2d: a sum over kernel taps."""
    N, C = x.shape[:2]
    O, Cg, KH, KW = w.shape
    G = attrs["groups"]
    out_hw = _ref_out(x.shape, (KH, KW), attrs)
    xp = _pad(x, *attrs["padding"])
    y = np.zeros((N, G, O // G) + out_hw, dtype=x.dtype)
    for kh, kw, rows, cols in _taps(attrs, (KH, KW), out_hw):
        patch = xp[:, :, rows, cols].reshape(N, G, Cg, *out_hw)
        y += np.einsum("ngchw,goc->ngohw", patch, w[:, :, kh, kw].reshape(G, O // G, Cg))
    return y.reshape(N, O, *out_hw)


def _ref_out(x_shape, kernel, attrs):
    (sh, sw), (ph, pw), (dh, dw) = (attrs[k] for k in GEOM)
    ceil = attrs.get("ceil_mode", False)
    return (out_size(x_shape[2], kernel[0], sh, ph, dh, ceil), out_size(x_shape[3], kernel[1], sw, pw, dw, ceil))


def _ceil_pad(x, attrs, out_hw, value=0.0):
    """x padded (attrs' padding, `value`) and, under ceil_mode, extended at the far
    edges so that every window fits; with the [OH, OW] count of each window's taps
    inside the padded input (avg_pool2d's divisor, count_include_pad)."""
    (ph, pw), (sh, sw) = attrs["padding"], attrs["stride"]
    KH, KW = attrs["kernel"]
    H, W = x.shape[2:]
    need_h, need_w = (out_hw[0] - 1) * sh + KH, (out_hw[1] - 1) * sw + KW
    extra_h, extra_w = max(0, need_h - (H + 2 * ph)), max(0, need_w - (W + 2 * pw))
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph + extra_h), (pw, pw + extra_w)), constant_values=value)
    rows = np.minimum(np.arange(out_hw[0]) * sh + KH, H + 2 * ph) - np.arange(out_hw[0]) * sh
    cols = np.minimum(np.arange(out_hw[1]) * sw + KW, W + 2 * pw) - np.arange(out_hw[1]) * sw
    return xp, np.outer(rows, cols).astype(x.dtype)


@register
class Conv2d(OpDef):
    """y[N, O, OH, OW] = conv(x[N, C, H, W], w[O, C/groups, KH, KW]) (+ b[O])."""

    name = "conv2d"
    describe = _describe
    products = (0, 1)

    def infer(self, inputs, attrs):
        if len(inputs) not in (2, 3):
            raise ValueError(f"conv2d takes x, w and an optional b, got {len(inputs)} operands")
        x, w = inputs[:2]
        _spatial(x, "input")
        require_float(inputs)
        G = attrs["groups"]
        C = x.shape[1]
        if w.rank != 4 or not all(isinstance(d, int) for d in w.shape):
            raise ValueError(f"weight '{w.name}' must be [O, C/groups, KH, KW], got {fmt_shape(w.shape)}")
        O, Cg, KH, KW = w.shape
        if C % G or O % G:
            raise ValueError(f"groups={G} must divide the input's {C} channels and the weight's {O} outputs")
        if Cg * G != C:
            raise ValueError(
                f"input '{x.name}' {fmt_shape(x.shape)} has {C} channels but weight '{w.name}' "
                f"{fmt_shape(w.shape)} expects {Cg * G} (C/groups = {Cg}, groups = {G}); the input "
                f"must be NCHW"
            )
        if len(inputs) == 3 and tuple(inputs[2].shape) != (O,):
            raise ValueError(f"bias '{inputs[2].name}' must be [{O}], got {fmt_shape(inputs[2].shape)}")
        OH, OW = _window(x, (KH, KW), attrs, f"a {KH}x{KW} kernel")
        return [("float32", (x.shape[0], O, OH, OW))]

    def packed_read(self, node):
        return kept_weight_read(node)

    def rounds_on_read(self, node) -> tuple:
        return rounds_input_on_read(node)

    def reference(self, args, attrs, dims):
        args = rounded_args(args, attrs)
        y = _conv_ref(args[0], args[1], attrs)
        if len(args) == 3:
            y = y + args[2].reshape(1, -1, 1, 1)
        return [y.astype(args[0].dtype)]

    def lower(self, node, ctx):
        x, w = node.inputs[:2]
        y = node.outputs[0]
        kernel, out_hw = tuple(w.shape[2:]), tuple(y.shape[2:])
        geom, name = _geom(ctx, node, x.shape, w.shape[0], kernel, out_hw, w.name)
        cols = _columns(node, x.shape, kernel, out_hw)
        ws = ctx.workspace(f"{y.name}_cols", cols) if cols else "nullptr"
        b = ctx.read(node.inputs[2]) if len(node.inputs) == 3 else "nullptr"
        fn, weight, xr, rounding = conv_call(ctx, node, "dg::conv2d", w)
        return [geom, *rounding, ctx.call(fn, xr, weight, b, ctx.write(y), ws, name)]

    def grad(self, node, gouts, gb):
        (g,) = gouts
        x, w = node.inputs[:2]
        geom = {k: node.attrs[k] for k in (*GEOM, "groups")}
        dx = gb.op("conv2d_grad_input", [g, w], {**geom, "input_hw": tuple(x.shape[2:])}, f"d_{x.name}")
        dw = gb.op("conv2d_grad_weight", [x, g], {**geom, "kernel": tuple(w.shape[2:])}, f"d_{w.name}")
        grads = [dx, dw]
        if len(node.inputs) == 3:
            grads.append(gb.reduce("sum", g, [0, 2, 3], keepdims=False))
        return grads


@register
class Conv2dGradInput(OpDef):
    """dx[N, C, H, W] of a conv2d, from dy[N, O, OH, OW] and w (attr input_hw = (H, W))."""

    name = "conv2d_grad_input"
    describe = _describe

    def infer(self, inputs, attrs):
        g, w = inputs
        O, Cg, KH, KW = w.shape
        return [("float32", (g.shape[0], Cg * attrs["groups"]) + tuple(attrs["input_hw"]))]

    def reference(self, args, attrs, dims):
        g, w = args
        N, O = g.shape[:2]
        _, Cg, KH, KW = w.shape
        G = attrs["groups"]
        H, W = attrs["input_hw"]
        (ph, pw) = attrs["padding"]
        out_hw = g.shape[2:]
        dxp = np.zeros((N, G * Cg, H + 2 * ph, W + 2 * pw), dtype=g.dtype)
        gg = g.reshape(N, G, O // G, *out_hw)
        for kh, kw, rows, cols in _taps(attrs, (KH, KW), out_hw):
            part = np.einsum("ngohw,goc->ngchw", gg, w[:, :, kh, kw].reshape(G, O // G, Cg))
            dxp[:, :, rows, cols] += part.reshape(N, G * Cg, *out_hw)
        return [_crop(dxp, ph, pw, H, W)]

    def lower(self, node, ctx):
        g, w = node.inputs
        dx = node.outputs[0]
        kernel, out_hw = tuple(w.shape[2:]), tuple(g.shape[2:])
        geom, name = _geom(ctx, node, dx.shape, w.shape[0], kernel, out_hw, w.name)
        cols = _columns(node, dx.shape, kernel, out_hw)
        ws = ctx.workspace(f"{dx.name}_cols", cols) if cols else "nullptr"
        return [geom, ctx.call("dg::conv2d_grad_input", ctx.read(g), ctx.read(w), ctx.write(dx), ws, name)]


@register
class Conv2dGradWeight(OpDef):
    """dw[O, C/groups, KH, KW] of a conv2d, from x and dy (attr kernel = (KH, KW))."""

    name = "conv2d_grad_weight"
    describe = _describe

    def infer(self, inputs, attrs):
        x, g = inputs
        return [("float32", (g.shape[1], x.shape[1] // attrs["groups"]) + tuple(attrs["kernel"]))]

    def reference(self, args, attrs, dims):
        x, g = args
        N, C = x.shape[:2]
        O = g.shape[1]
        G = attrs["groups"]
        KH, KW = attrs["kernel"]
        out_hw = g.shape[2:]
        xp = _pad(x, *attrs["padding"])
        gg = g.reshape(N, G, O // G, *out_hw)
        dw = np.zeros((O, C // G, KH, KW), dtype=x.dtype)
        for kh, kw, rows, cols in _taps(attrs, (KH, KW), out_hw):
            patch = xp[:, :, rows, cols].reshape(N, G, C // G, *out_hw)
            dw[:, :, kh, kw] = np.einsum("ngohw,ngchw->goc", gg, patch).reshape(O, C // G)
        return [dw]

    def lower(self, node, ctx):
        x, g = node.inputs
        dw = node.outputs[0]
        kernel, out_hw = tuple(node.attrs["kernel"]), tuple(g.shape[2:])
        weight = dw.name[len("d_"):] if dw.name.startswith("d_") else ""  # d_conv1_weight: conv1_weight's
        geom, name = _geom(ctx, node, x.shape, g.shape[1], kernel, out_hw, weight)
        floats = _columns(node, x.shape, kernel, out_hw)
        if ctx.target.weight_grad_partials:  # room for partial sums of one group's weight gradient
            floats += dw.shape[0] // node.attrs["groups"] * dw.shape[1] * kernel[0] * kernel[1]
        ws = ctx.workspace(f"{dw.name}_cols", floats) if floats else "nullptr"
        return [geom, ctx.call("dg::conv2d_grad_weight", ctx.read(x), ctx.read(g), ctx.write(dw), ws, name)]


# -- pooling ---------------------------------------------------------------------


class _Pool(OpDef):
    """A window reduction over each channel; attrs kernel, stride, padding (dilation 1)."""

    kind = ""
    describe = _describe

    def infer(self, inputs, attrs):
        (x,) = inputs
        _spatial(x, "input")
        kernel = attrs["kernel"]
        if any(2 * p > k for p, k in zip(attrs["padding"], kernel)):
            raise ValueError(f"padding {attrs['padding']} must be at most half the kernel {kernel}")
        OH, OW = _window(x, kernel, attrs, f"a {kernel[0]}x{kernel[1]} {self.name}")
        return [("float32", tuple(x.shape[:2]) + (OH, OW))]

    def call(self, node, ctx, fn, reads, out, x_shape, out_hw):
        geom, name = _geom(ctx, node, x_shape, x_shape[1], tuple(node.attrs["kernel"]), out_hw)
        return [geom, ctx.call(fn, *[ctx.read(v) for v in reads], ctx.write(out), name)]


@register
class MaxPool2d(_Pool):
    name = "max_pool2d"

    def reference(self, args, attrs, dims):
        (x,) = args
        out_hw = _ref_out(x.shape, attrs["kernel"], attrs)
        xp, _ = _ceil_pad(x, attrs, out_hw, value=-np.inf)
        y = np.full(x.shape[:2] + out_hw, -np.inf, dtype=x.dtype)
        for _, _, rows, cols in _taps(attrs, attrs["kernel"], out_hw):
            y = np.maximum(y, xp[:, :, rows, cols])  # NaN propagates
        return [y]

    def lower(self, node, ctx):
        x, y = node.inputs[0], node.outputs[0]
        return self.call(node, ctx, "dg::max_pool2d", [x], y, x.shape, tuple(y.shape[2:]))

    def grad(self, node, gouts, gb):
        attrs = dict(node.attrs)
        return [gb.op("max_pool2d_grad", [node.inputs[0], node.outputs[0], gouts[0]], attrs,
                      f"d_{node.inputs[0].name}")]


@register
class MaxPool2dGrad(_Pool):
    """dx: each window's gradient goes to its first maximum (PyTorch's choice)."""

    name = "max_pool2d_grad"

    def infer(self, inputs, attrs):
        return [("float32", inputs[0].shape)]

    def reference(self, args, attrs, dims):
        x, y, g = args
        ph, pw = attrs["padding"]
        xp, _ = _ceil_pad(x, attrs, y.shape[2:], value=-np.inf)
        dxp = np.zeros_like(xp)
        taken = np.zeros(y.shape, dtype=bool)
        for _, _, rows, cols in _taps(attrs, attrs["kernel"], y.shape[2:]):
            first = (xp[:, :, rows, cols] == y) & ~taken
            dxp[:, :, rows, cols] += np.where(first, g, 0)
            taken |= first
        return [_crop(dxp, ph, pw, *x.shape[2:])]

    def lower(self, node, ctx):
        x, y, g = node.inputs
        return self.call(node, ctx, "dg::max_pool2d_grad", [x, y, g], node.outputs[0], x.shape, tuple(y.shape[2:]))


@register
class AvgPool2d(_Pool):
    """The window's mean, padding counted as zeros (PyTorch's count_include_pad)."""

    name = "avg_pool2d"

    def reference(self, args, attrs, dims):
        (x,) = args
        out_hw = _ref_out(x.shape, attrs["kernel"], attrs)
        xp, counts = _ceil_pad(x, attrs, out_hw)
        y = np.zeros(x.shape[:2] + out_hw, dtype=x.dtype)
        for _, _, rows, cols in _taps(attrs, attrs["kernel"], out_hw):
            y += xp[:, :, rows, cols]
        return [y / counts]

    def lower(self, node, ctx):
        x, y = node.inputs[0], node.outputs[0]
        return self.call(node, ctx, "dg::avg_pool2d", [x], y, x.shape, tuple(y.shape[2:]))

    def grad(self, node, gouts, gb):
        attrs = {**node.attrs, "input_hw": tuple(node.inputs[0].shape[2:])}
        return [gb.op("avg_pool2d_grad", [gouts[0]], attrs, f"d_{node.inputs[0].name}")]


@register
class AvgPool2dGrad(_Pool):
    name = "avg_pool2d_grad"

    def infer(self, inputs, attrs):
        return [("float32", tuple(inputs[0].shape[:2]) + tuple(attrs["input_hw"]))]

    def reference(self, args, attrs, dims):
        (g,) = args
        ph, pw = attrs["padding"]
        H, W = attrs["input_hw"]
        dxp, counts = _ceil_pad(np.zeros(g.shape[:2] + (H, W), dtype=g.dtype), attrs, g.shape[2:])
        share = g / counts
        for _, _, rows, cols in _taps(attrs, attrs["kernel"], g.shape[2:]):
            dxp[:, :, rows, cols] += share
        return [_crop(dxp, ph, pw, H, W)]

    def lower(self, node, ctx):
        (g,), dx = node.inputs, node.outputs[0]
        return self.call(node, ctx, "dg::avg_pool2d_grad", [g], dx, dx.shape, tuple(g.shape[2:]))
