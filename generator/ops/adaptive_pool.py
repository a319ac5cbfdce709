"""Adaptive average pooling (torch.nn.functional.adaptive_avg_pool2d): x [N, C, H, W]
-> [N, C, OH, OW] whatever H and W are. Output row i averages the input rows
[floor(i H / OH), ceil((i + 1) H / OH)), and likewise for columns, so windows may
differ in size by one and overlap. Where OH divides H and OW divides W the windows
are a plain average pool's; `dg.adaptive_avg_pool2d` then makes an `avg_pool2d`."""

from __future__ import annotations

import numpy as np

from ..codegen.stmt import Named
from ..ir.shapes import fmt_shape
from .registry import OpDef, register


def windows(size: int, out: int) -> list:
    """[(start, end)] of each of `out` adaptive windows over `size` positions."""
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


def _sizes(ctx, x_shape, out_hw):
    N, C, H, W = x_shape
    return [Named("planes", ctx.size(N * C)), Named("H", H), Named("W", W), Named("OH", out_hw[0]),
            Named("OW", out_hw[1])]


@register
class AdaptiveAvgPool2d(OpDef):
    """y[N, C, OH, OW] = the mean of each adaptive window of x[N, C, H, W]; attrs output_size."""

    name = "adaptive_avg_pool2d"

    def infer(self, inputs, attrs):
        (x,) = inputs
        if x.dtype != "float32" or x.rank != 4 or not all(isinstance(d, int) for d in x.shape[1:]):
            raise ValueError(f"input '{x.name}' must be float32 [N, C, H, W] with C, H, W concrete, "
                             f"got {x.type_str()}")
        OH, OW = attrs["output_size"]
        if OH < 1 or OW < 1:
            raise ValueError(f"output size {OH}x{OW} must be at least 1x1")
        return [("float32", tuple(x.shape[:2]) + (OH, OW))]

    def reference(self, args, attrs, dims):
        (x,) = args
        OH, OW = attrs["output_size"]
        y = np.empty(x.shape[:2] + (OH, OW), dtype=x.dtype)
        for i, (h0, h1) in enumerate(windows(x.shape[2], OH)):
            for j, (w0, w1) in enumerate(windows(x.shape[3], OW)):
                y[:, :, i, j] = x[:, :, h0:h1, w0:w1].astype(np.float64).mean(axis=(2, 3))
        return [y]

    def lower(self, node, ctx):
        x, y = node.inputs[0], node.outputs[0]
        return [ctx.call("dg::adaptive_avg_pool2d", ctx.read(x), ctx.write(y),
                         *_sizes(ctx, x.shape, node.attrs["output_size"]))]

    def grad(self, node, gouts, gb):
        x = node.inputs[0]
        attrs = {"output_size": node.attrs["output_size"], "input_hw": tuple(x.shape[2:])}
        return [gb.op("adaptive_avg_pool2d_grad", [gouts[0]], attrs, f"d_{x.name}")]

    def describe(self, node):
        OH, OW = node.attrs["output_size"]
        return f"adaptive_avg_pool2d({node.inputs[0].name}, output_size=({OH}, {OW}))"


@register
class AdaptiveAvgPool2dGrad(OpDef):
    """dx[N, C, H, W]: each dy[i, j] / its window's size added over its window."""

    name = "adaptive_avg_pool2d_grad"

    def infer(self, inputs, attrs):
        (g,) = inputs
        if tuple(g.shape[2:]) != tuple(attrs["output_size"]):
            raise ValueError(f"gradient '{g.name}' {fmt_shape(g.shape)} must be [N, C, {attrs['output_size'][0]}, "
                             f"{attrs['output_size'][1]}]")
        return [("float32", tuple(g.shape[:2]) + tuple(attrs["input_hw"]))]

    def reference(self, args, attrs, dims):
        (g,) = args
        H, W = attrs["input_hw"]
        OH, OW = attrs["output_size"]
        dx = np.zeros(g.shape[:2] + (H, W), dtype=np.float64)
        for i, (h0, h1) in enumerate(windows(H, OH)):
            for j, (w0, w1) in enumerate(windows(W, OW)):
                dx[:, :, h0:h1, w0:w1] += (g[:, :, i, j] / ((h1 - h0) * (w1 - w0)))[:, :, None, None]
        return [dx.astype(g.dtype)]

    def lower(self, node, ctx):
        (g,), dx = node.inputs, node.outputs[0]
        return [ctx.call("dg::adaptive_avg_pool2d_grad", ctx.read(g), ctx.write(dx),
                         *_sizes(ctx, dx.shape, node.attrs["output_size"]))]
