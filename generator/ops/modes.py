"""Ops whose behavior depends on the train/eval mode, as in PyTorch: batch norm
and dropout. Each reads the graph's mode value (`graph.mode`, a `Mode` in the
reference, `dg::Mode` in C++: training or not, the model's seed, and the number
of training-mode calls made before this one).

Batch norm writes its running statistics (values of kind "state", operands 3
and 4) in place in training mode, as PyTorch's does: it is the one op with a
side effect (`updates_state`), and the reference applies it to the arrays it
was given. Dropout draws its mask from the counter-based RNG (reference/rng.py,
runtime dg_rng.h), so the reference and the C++ drop the same elements, and its
gradient draws the mask again instead of keeping it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..codegen.stmt import Named
from ..ir.shapes import fmt_shape, numel
from ..reference.rng import dropout_keep
from .conv import _columns as _conv_columns
from .conv import _geom as _conv_geom
from .conv import conv_call, kept_weight_read, rounds_input_on_read
from .registry import OpDef, get_op, register, require_float


@dataclass
class Mode:
    """The reference's mode operand."""

    training: bool = True
    seed: int = 0
    draw: int = 0


def _channels(x):
    """x viewed as [N, C, rest] (batch norm over axis 1)."""
    return x.shape[0], x.shape[1], numel(x.shape[2:])


def _moments(x):
    """Per-channel batch mean and biased variance of x [N, C, ...] (float64 sums)."""
    axes = (0,) + tuple(range(2, x.ndim))
    xd = x.astype(np.float64)
    mean = xd.mean(axis=axes)
    var = ((xd - _bc(mean, x.ndim)) ** 2).mean(axis=axes)
    return mean, var


def _bc(v, ndim):
    return v.reshape((1, -1) + (1,) * (ndim - 2))


@register
class BatchNorm(OpDef):
    """[y, mean, invstd] = batch_norm(x, weight, bias, running_mean, running_var, mode).

    Training: per-channel statistics of the batch (biased variance) normalize x,
    and the running ones move by `momentum` (unbiased variance); mean and invstd
    are the batch's, kept for the gradient. Evaluation: the running statistics
    normalize x, and mean and invstd are those."""

    name = "batch_norm"
    multi_output = True
    cse = False
    updates_state = (3, 4)
    output_hints = ("batch_norm", "mean", "invstd")

    def infer(self, inputs, attrs):
        x, w, b, rm, rv, mode = inputs
        require_float(inputs[:5])
        if x.rank not in (2, 3, 4) or not isinstance(x.shape[1], int):
            raise ValueError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, C] or [N, C, H, W] with C concrete")
        C = x.shape[1]
        for v in (w, b, rm, rv):
            if tuple(v.shape) != (C,):
                raise ValueError(f"'{v.name}' {fmt_shape(v.shape)} must be [{C}], the channels of '{x.name}' "
                                 f"{fmt_shape(x.shape)}")
        return [("float32", x.shape), ("float32", (C,)), ("float32", (C,))]

    def reference(self, args, attrs, dims):
        x, w, b, rm, rv, mode = args
        eps, momentum = attrs["eps"], attrs["momentum"]
        if mode.training:
            mean, var = _moments(x)
            count = x.size // x.shape[1]
            if count < 2:
                raise ValueError(f"batch norm in training mode needs more than 1 value per channel, got {count}")
            rm[...] = (1 - momentum) * rm + momentum * mean
            rv[...] = (1 - momentum) * rv + momentum * var * count / (count - 1)
        else:
            mean, var = rm.astype(np.float64), rv.astype(np.float64)
        mean, invstd = mean.astype(x.dtype), (1.0 / np.sqrt(var + eps)).astype(x.dtype)
        # normalized with the statistics as stored, as batch_norm_apply does: a recomputation is exact
        y = (x - _bc(mean, x.ndim)) * _bc(invstd * w, x.ndim) + _bc(b, x.ndim)
        return [y.astype(x.dtype), mean, invstd]

    def lower(self, node, ctx):
        x, w, b, rm, rv, mode = node.inputs
        y, mean, invstd = node.outputs
        N, C, rest = _channels(x)
        what = ctx.string(f"batch norm of '{x.name}'")
        return [ctx.call("dg::batch_norm", ctx.read(x), ctx.read(w), ctx.read(b), ctx.write(rm), ctx.write(rv),
                         ctx.write(y), ctx.write(mean), ctx.write(invstd), Named("N", ctx.size(N)),
                         Named("C", C), Named("HW", ctx.size(rest)), Named("eps", _float(node.attrs["eps"])),
                         Named("momentum", _float(node.attrs["momentum"])), ctx.read(mode), what)]

    def grad(self, node, gouts, gb):
        g = gouts[0]
        x, w, b = node.inputs[:3]
        _, mean, invstd = node.outputs
        if g is None:
            return [None] * 6
        dx, dw, db = gb.op("batch_norm_grad", [x, w, mean, invstd, g, node.inputs[5]], {},
                           [f"d_{v.name}" for v in (x, w, b)])
        return [dx, dw, db, None, None, None]


@register
class BatchNormGrad(OpDef):
    """[dx, dweight, dbias] of batch_norm, from x, weight, the mean and invstd it used, g."""

    name = "batch_norm_grad"
    multi_output = True

    def infer(self, inputs, attrs):
        x, w = inputs[:2]
        return [("float32", x.shape), ("float32", w.shape), ("float32", w.shape)]

    def reference(self, args, attrs, dims):
        x, w, mean, invstd, g, mode = args
        axes = (0,) + tuple(range(2, x.ndim))
        xhat = (x - _bc(mean, x.ndim)) * _bc(invstd, x.ndim)
        db = g.sum(axis=axes)
        dw = (g * xhat).sum(axis=axes)
        if mode.training:
            count = x.size // x.shape[1]
            dx = _bc(w * invstd / count, x.ndim) * (count * g - _bc(db, x.ndim) - xhat * _bc(dw, x.ndim))
        else:
            dx = g * _bc(w * invstd, x.ndim)
        return [dx.astype(x.dtype), dw.astype(x.dtype), db.astype(x.dtype)]

    def lower(self, node, ctx):
        x, w, mean, invstd, g, mode = node.inputs
        dx, dw, db = node.outputs
        N, C, rest = _channels(x)
        return [ctx.call("dg::batch_norm_grad", ctx.read(x), ctx.read(w), ctx.read(mean), ctx.read(invstd),
                         ctx.read(g), ctx.write(dx), ctx.write(dw), ctx.write(db), Named("N", ctx.size(N)),
                         Named("C", C), Named("HW", ctx.size(rest)), ctx.read(mode))]


@register
class BatchNormApply(OpDef):
    """y = (x - mean) * (invstd * weight) + bias, per channel, with the statistics a
    batch_norm wrote: its output made again. The backward pass recomputes a batch
    norm's output (and the relu after it) from what it keeps anyway, instead of
    keeping the output from the forward pass (transforms/passes.py: remat)."""

    name = "batch_norm_apply"
    cse = False  # a recomputation, placed where backward needs it: never merged with the original

    def infer(self, inputs, attrs):
        x, w = inputs[:2]
        require_float(inputs)
        return [("float32", x.shape)]

    def reference(self, args, attrs, dims):
        x, w, b, mean, invstd = args
        return [((x - _bc(mean, x.ndim)) * _bc(invstd * w, x.ndim) + _bc(b, x.ndim)).astype(x.dtype)]

    def lower(self, node, ctx):
        x, w, b, mean, invstd = node.inputs
        N, C, rest = _channels(x)
        return [ctx.call("dg::batch_norm_apply", ctx.read(x), ctx.read(w), ctx.read(b), ctx.read(mean),
                         ctx.read(invstd), ctx.write(node.outputs[0]), Named("N", ctx.size(N)), Named("C", C),
                         Named("HW", ctx.size(rest)))]


@register
class Dropout(OpDef):
    """y = x * mask / (1 - p) in training mode (mask ~ Bernoulli(1 - p), drawn anew
    each call), y = x in evaluation. attrs: p, stream (the RNG stream of this op)."""

    name = "dropout"
    cse = False

    def infer(self, inputs, attrs):
        x, mode = inputs
        require_float([x])
        return [("float32", x.shape)]

    def reference(self, args, attrs, dims):
        x, mode = args
        if not mode.training:
            return [x.copy()]
        keep = dropout_keep(x.size, mode.seed, attrs["stream"], mode.draw, attrs["p"]).reshape(x.shape)
        return [np.where(keep, x * x.dtype.type(attrs["scale"]), 0).astype(x.dtype)]

    def lower(self, node, ctx):
        (x, mode), y = node.inputs, node.outputs[0]
        return [ctx.call("dg::dropout", ctx.read(x), ctx.write(y), Named("n", ctx.size(numel(x.shape))),
                         *_dropout_args(node), ctx.read(mode))]

    def grad(self, node, gouts, gb):
        return [gb.op("dropout_grad", [gouts[0], node.inputs[1]], dict(node.attrs), f"d_{node.inputs[0].name}"), None]

    def describe(self, node):
        return f"dropout({node.inputs[0].name}, p={node.attrs['p']:g}, {node.inputs[1].name})"


@register
class DropoutGrad(Dropout):
    """dx = g * mask / (1 - p): the same mask, drawn again from the same counter."""

    name = "dropout_grad"  # lowered and evaluated as dropout itself, on g

    def grad(self, node, gouts, gb):
        raise NotImplementedError("second derivative of dropout")


@register
class StochasticDepth(Dropout):
    """torchvision's stochastic_depth: a residual branch x dropped whole, with probability p,
    per sample (mode "row": one draw for each index of axis 0) or for the whole batch
    (mode "batch": one draw), the rest scaled by 1/(1-p); in evaluation x itself."""

    name = "stochastic_depth"

    def reference(self, args, attrs, dims):
        x, mode = args
        if not mode.training:
            return [x.copy()]
        draws = x.shape[0] if attrs["mode"] == "row" else 1
        keep = dropout_keep(draws, mode.seed, attrs["stream"], mode.draw, attrs["p"])
        keep = np.broadcast_to(keep.reshape((draws,) + (1,) * (x.ndim - 1)), x.shape)
        return [np.where(keep, x * x.dtype.type(attrs["scale"]), 0).astype(x.dtype)]

    def lower(self, node, ctx):
        (x, mode), y = node.inputs, node.outputs[0]
        group = numel(x.shape[1:]) if node.attrs["mode"] == "row" else numel(x.shape)
        return [ctx.call("dg::stochastic_depth", ctx.read(x), ctx.write(y), Named("n", ctx.size(numel(x.shape))),
                         Named("group", ctx.size(group)), *_dropout_args(node), ctx.read(mode))]

    def grad(self, node, gouts, gb):
        return [gb.op("stochastic_depth_grad", [gouts[0], node.inputs[1]], dict(node.attrs),
                      f"d_{node.inputs[0].name}"), None]

    def describe(self, node):
        return (f"stochastic_depth({node.inputs[0].name}, p={node.attrs['p']:g}, mode={node.attrs['mode']}, "
                f"{node.inputs[1].name})")


@register
class StochasticDepthGrad(StochasticDepth):
    """dx = g where the branch was kept, times 1/(1-p): the same draws again."""

    name = "stochastic_depth_grad"

    def grad(self, node, gouts, gb):
        raise NotImplementedError("second derivative of stochastic_depth")


def _dropout_args(node):
    return [Named("p", _float(node.attrs["p"])), Named("scale", _float(node.attrs["scale"])),
            Named("stream", f"{node.attrs['stream']}ULL")]


def _float(value) -> str:
    """A float32 literal that C++ reads back to the same float (numpy's shortest repr)."""
    text = str(np.float32(value))
    return (text if "e" in text or "." in text else text + ".0") + "f"


@register
class ConvBatchNorm(OpDef):
    """[y, mean, invstd] = conv2d_batch_norm(x, w, bn_weight, bn_bias, running_mean, running_var,
    mode[, b][, residual]): batch_norm(conv2d(x, w[, b]), ...), the two ops of a conv -> batch
    norm pair in a model that does not train (transforms/passes.py: conv_batch_norm), as one
    runtime call; then + residual (attr residual) and relu (attr relu) where the pass folded
    them too. In evaluation mode the convolution's epilogue normalizes each piece of output
    while it is in cache, with batch norm's own arithmetic, and adds and rectifies it (the
    same results, one pass fewer over the output for each); in training mode it is conv2d,
    then batch norm, residual and relu in place. Attrs: the convolution's geometry, batch
    norm's eps and momentum, residual and relu (absent: False)."""

    name = "conv2d_batch_norm"
    multi_output = True
    cse = False
    conv_op = "conv2d"  # the convolution it computes (its int8 form: ops/quantize_conv.py)
    lead = 2  # the convolution's operands before batch norm's (x, w); the rest (b) after them
    updates_state = (4, 5)  # lead + 2, lead + 3: the running statistics
    output_hints = ("batch_norm", "mean", "invstd")

    def _split(self, inputs, attrs):
        """(conv operands [x, w(, b)], batch norm's [w, b, mean, var, mode], residual or None)."""
        residual = inputs[-1] if attrs.get("residual") else None
        rest = list(inputs[: len(inputs) - (residual is not None)])
        k = self.lead
        return rest[:k] + rest[k + 5 :], rest[k : k + 5], residual

    def packed_read(self, node):
        return kept_weight_read(node)

    def rounds_on_read(self, node) -> tuple:
        return rounds_input_on_read(node)

    def infer(self, inputs, attrs):
        conv, bn, residual = self._split(inputs, attrs)
        (y_type,) = get_op(self.conv_op).infer(conv, attrs)
        if residual is not None and (residual.dtype, tuple(residual.shape)) != (y_type[0], tuple(y_type[1])):
            raise ValueError(f"residual '{residual.name}' {fmt_shape(residual.shape)} must be the convolution's "
                             f"{y_type[0]} {fmt_shape(y_type[1])}")
        return [y_type] + BatchNorm().infer([_Typed(*y_type)] + bn, attrs)[1:]

    def reference(self, args, attrs, dims):
        conv, bn, residual = self._split(args, attrs)
        (y,) = get_op(self.conv_op).reference(conv, attrs, dims)
        y, *stats = BatchNorm().reference([y] + bn, attrs, dims)
        if residual is not None:
            y = y + residual
        if attrs.get("relu"):
            y = np.where(0 > y, np.float32(0), y).astype(y.dtype)  # max_f(0, v): a NaN stays NaN
        return [y, *stats]

    def lower(self, node, ctx):
        (x, w, *conv_b), (bn_w, bn_b, rm, rv, mode), residual = self._split(node.inputs, node.attrs)
        b = ctx.read(conv_b[0]) if conv_b else "nullptr"
        y, mean, invstd = node.outputs
        kernel, out_hw = tuple(w.shape[2:]), tuple(y.shape[2:])
        geom, name = _conv_geom(ctx, node, x.shape, w.shape[0], kernel, out_hw, w.name)
        cols = _conv_columns(node, x.shape, kernel, out_hw)
        ws = ctx.workspace(f"{y.name}_cols", cols) if cols else "nullptr"
        what = ctx.string(f"batch norm of the convolution of '{x.name}'")
        r = ctx.read(residual) if residual is not None else "nullptr"
        fn, weight, xr, rounding = conv_call(ctx, node, "dg::conv2d_batch_norm", w)
        return [geom, *rounding, ctx.call(fn, xr, weight, b,
                               ctx.read(bn_w), ctx.read(bn_b), ctx.write(rm), ctx.write(rv), Named("residual", r),
                               ctx.write(y), ctx.write(mean), ctx.write(invstd), ws, name,
                               Named("eps", _float(node.attrs["eps"])),
                               Named("momentum", _float(node.attrs["momentum"])),
                               Named("relu", "true" if node.attrs.get("relu") else "false"), ctx.read(mode), what)]


class _Typed:
    """A stand-in operand for BatchNorm.infer: the convolution's output type."""

    def __init__(self, dtype, shape, name="conv2d"):
        self.dtype, self.shape, self.name = dtype, tuple(shape), name
        self.rank = len(self.shape)
