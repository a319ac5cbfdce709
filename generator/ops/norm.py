"""Layer normalization over the last axis (torch.nn.functional.layer_norm with a
[D] weight and bias): each row of x [..., D] is normalized by its own mean and
biased variance. The forward op also writes each row's mean and 1/sqrt(var + eps)
(`rstd`), which its gradient op reads instead of computing them again."""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Named
from ..ir.shapes import fmt_shape, numel
from .modes import _float
from .registry import OpDef, register, require_float


def _rows(x):
    """x viewed as [rows, D]."""
    return numel(x.shape[:-1]), x.shape[-1]


def _row_stats(x, eps):
    """Each row's mean and 1/sqrt(biased variance + eps), computed in float64."""
    xd = x.astype(np.float64)
    mean = xd.mean(axis=-1)
    var = ((xd - mean[..., None]) ** 2).mean(axis=-1)
    return mean, 1.0 / np.sqrt(var + eps)


@register
class LayerNorm(OpDef):
    """[y, mean, rstd] = layer_norm(x, weight, bias): y = (x - mean) * rstd * weight + bias
    per row of the last axis; mean and rstd are [...] (x's shape without its last axis)."""

    name = "layer_norm"
    multi_output = True
    output_hints = ("layer_norm", "mean", "rstd")

    def infer(self, inputs, attrs):
        require_float(inputs)
        x, w, b = inputs
        if x.rank < 1 or not isinstance(x.shape[-1], int):
            raise ValueError(f"input '{x.name}' {fmt_shape(x.shape)} must be [..., D] with D concrete")
        D = x.shape[-1]
        for v in (w, b):
            if tuple(v.shape) != (D,):
                raise ValueError(f"'{v.name}' {fmt_shape(v.shape)} must be [{D}], the last axis of '{x.name}' "
                                 f"{fmt_shape(x.shape)}")
        return [("float32", x.shape), ("float32", x.shape[:-1]), ("float32", x.shape[:-1])]

    def reference(self, args, attrs, dims):
        x, w, b = args
        mean, rstd = _row_stats(x, attrs["eps"])
        y = (x - mean[..., None]) * rstd[..., None] * w + b
        return [y.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)]

    def lower(self, node, ctx):
        x, w, b = node.inputs
        y, mean, rstd = node.outputs
        rows, D = _rows(x)
        return [ctx.call("dg::layer_norm", ctx.read(x), ctx.read(w), ctx.read(b), ctx.write(y), ctx.write(mean),
                         ctx.write(rstd), Named("rows", ctx.size(rows)), Named("D", D),
                         Named("eps", _float(node.attrs["eps"])))]

    def describe(self, node):
        x, w, b = node.inputs
        return f"layer_norm({x.name}, {w.name}, {b.name}, eps={node.attrs['eps']:g})"

    def grad(self, node, gouts, gb):
        g = gouts[0]
        x, w, b = node.inputs
        _, mean, rstd = node.outputs
        if g is None:  # only mean or rstd is read: not differentiated
            raise NotImplementedError("gradient through layer_norm's mean or rstd")
        dx, dw, db = gb.op("layer_norm_grad", [x, w, mean, rstd, g], {}, [f"d_{v.name}" for v in (x, w, b)])
        return [dx, dw, db]


@register
class LayerNormGrad(OpDef):
    """[dx, dweight, dbias] of layer_norm from x, weight, the mean and rstd it wrote, and g:
    with xhat = (x - mean) * rstd and gw = g * weight, per row
    dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat)); dweight and dbias sum
    g * xhat and g over the rows."""

    name = "layer_norm_grad"
    multi_output = True

    def infer(self, inputs, attrs):
        require_float(inputs)
        x, w = inputs[:2]
        return [("float32", x.shape), ("float32", w.shape), ("float32", w.shape)]

    def reference(self, args, attrs, dims):
        x, w, mean, rstd, g = args
        xhat = (x - mean[..., None]) * rstd[..., None]
        gw = g * w
        dx = rstd[..., None] * (gw - gw.mean(axis=-1, keepdims=True) - xhat * (gw * xhat).mean(axis=-1, keepdims=True))
        lead = tuple(range(x.ndim - 1))
        return [dx.astype(x.dtype), (g * xhat).sum(axis=lead).astype(x.dtype), g.sum(axis=lead).astype(x.dtype)]

    def lower(self, node, ctx):
        x, w, mean, rstd, g = node.inputs
        dx, dw, db = node.outputs
        rows, D = _rows(x)
        return [ctx.call("dg::layer_norm_grad", ctx.read(x), ctx.read(w), ctx.read(mean), ctx.read(rstd),
                         ctx.read(g), ctx.write(dx), ctx.write(dw), ctx.write(db), Named("rows", ctx.size(rows)),
                         Named("D", D))]
