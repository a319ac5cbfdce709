"""The DSL's convolutional layers, over NCHW tensors as in PyTorch:

    x = dg.input("x", (N, 1, 8, 8))
    c1 = dg.conv2d_layer(x, 6, 3, padding=1, act=dg.relu)   # params c1_weight, c1_bias
    p1 = dg.max_pool2d(c1, 2)
    logits = dg.dense(dg.flatten(p1), 10)

Functions take ints or pairs for sizes, as torch.nn.functional does; a helper
named `foo` names its parameters `foo_` + PyTorch's state_dict key (`foo_weight`,
`foo_bias`), in PyTorch's layouts, so weights come over one to one.
"""

from __future__ import annotations

import math

from . import initializers as inits
from .builder import Tensor, current
from .dsl import _check_init, _helper_param, _tensor, mean, reshape
from .source import user_loc
from ..errors import ModelError, ShapeError
from ..ir.shapes import fmt_shape
from ..reference.rng import name_stream

__all__ = ["conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "global_avg_pool", "flatten", "conv2d_layer", "batch_norm",
           "batch_norm_layer", "dropout", "stochastic_depth"]


def _pair(value, what, op, low=0):
    """An int or a pair of ints, as a pair; a clear error otherwise."""
    pair = (value, value) if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(pair, (tuple, list)) or len(pair) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= low for v in pair)):
        raise ModelError(f"{what} must be an int >= {low} or a pair of them, got {value!r}", user_loc(), op)
    return tuple(pair)


def _nchw(x, op):
    x = _tensor(x, op)
    if x.ndim != 4:
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be NCHW: [N, C, H, W]", user_loc(), op)
    return x


def conv2d(x, w, b=None, stride=1, padding=0, dilation=1, groups=1, name=None) -> Tensor:
    """torch.nn.functional.conv2d: x [N, C, H, W], w [O, C/groups, KH, KW], b [O] or None.
    padding may be "same" (stride 1; the kernel's span must be odd)."""
    x, w = _nchw(x, "conv2d"), _tensor(w, "conv2d")
    stride = _pair(stride, "stride", "conv2d", 1)
    dilation = _pair(dilation, "dilation", "conv2d", 1)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
        raise ModelError(f"groups must be a positive int, got {groups!r}", user_loc(), "conv2d")
    if padding == "same":
        if stride != (1, 1):
            raise ModelError(f"padding='same' needs stride 1, got {stride}", user_loc(), "conv2d")
        if w.ndim != 4:
            raise ShapeError(f"weight '{w.name}' {fmt_shape(w.shape)} must be [O, C/groups, KH, KW]", user_loc(), "conv2d")
        spans = [d * (k - 1) for d, k in zip(dilation, w.shape[2:])]
        if any(s % 2 for s in spans):
            raise ModelError(f"padding='same' needs an odd kernel span, got {w.shape[2]}x{w.shape[3]} with "
                             f"dilation {dilation}: pad explicitly", user_loc(), "conv2d")
        padding = tuple(s // 2 for s in spans)
    padding = _pair(padding, "padding", "conv2d")
    operands = [x, w] + ([_tensor(b, "conv2d")] if b is not None else [])
    attrs = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    return current().add("conv2d", operands, attrs, name=name)[0]


def _pool(op, x, kernel, stride, padding, ceil_mode, name):
    x = _nchw(x, op)
    kernel = _pair(kernel, "kernel", op, 1)
    stride = kernel if stride is None else _pair(stride, "stride", op, 1)
    if not isinstance(ceil_mode, bool):
        raise ModelError(f"ceil_mode must be True or False, got {ceil_mode!r}", user_loc(), op)
    attrs = {"kernel": kernel, "stride": stride, "padding": _pair(padding, "padding", op), "dilation": (1, 1)}
    if ceil_mode:
        attrs["ceil_mode"] = True
    return current().add(op, [x], attrs, name=name)[0]


def max_pool2d(x, kernel, stride=None, padding=0, ceil_mode=False, name=None) -> Tensor:
    """The maximum of each window; stride defaults to the kernel, padding positions
    are ignored. ceil_mode rounds the output size up (a last window may be partial)."""
    return _pool("max_pool2d", x, kernel, stride, padding, ceil_mode, name)


def avg_pool2d(x, kernel, stride=None, padding=0, ceil_mode=False, name=None) -> Tensor:
    """The mean of each window, padding counted as zeros (PyTorch's default); under
    ceil_mode a window cut at the far edge divides by its taps inside the padded input."""
    return _pool("avg_pool2d", x, kernel, stride, padding, ceil_mode, name)


def adaptive_avg_pool2d(x, output_size, name=None) -> Tensor:
    """torch.nn.functional.adaptive_avg_pool2d: [N, C, H, W] -> [N, C, OH, OW] for an
    output_size OH (square), (OH, OW), or None in place of a size to keep. Output row
    i averages input rows floor(i H / OH) to ceil((i + 1) H / OH); where the sizes
    divide evenly that is a plain avg_pool2d, and that is what is made."""
    x = _nchw(x, "adaptive_avg_pool2d")
    sizes = (output_size, output_size) if not isinstance(output_size, (tuple, list)) else tuple(output_size)
    if len(sizes) != 2 or not all(s is None or (isinstance(s, int) and not isinstance(s, bool) and s >= 1)
                                  for s in sizes):
        raise ModelError(f"output_size must be an int >= 1, a pair of them, or None for a size to keep, "
                         f"got {output_size!r}", user_loc(), "adaptive_avg_pool2d")
    if not all(isinstance(d, int) for d in x.shape[2:]):
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)}: height and width must be concrete",
                         user_loc(), "adaptive_avg_pool2d")
    H, W = x.shape[2:]
    OH, OW = (H if sizes[0] is None else sizes[0]), (W if sizes[1] is None else sizes[1])
    if H % OH == 0 and W % OW == 0:
        return _pool("avg_pool2d", x, (H // OH, W // OW), None, 0, False, name)
    return current().add("adaptive_avg_pool2d", [x], {"output_size": (OH, OW)}, name=name)[0]


def global_avg_pool(x, name=None) -> Tensor:
    """[N, C, H, W] -> [N, C]: the mean over each channel's plane."""
    return mean(_nchw(x, "global_avg_pool"), axis=(2, 3), name=name)


def flatten(x, name=None) -> Tensor:
    """[N, ...] -> [N, product of the rest], in row-major (NCHW) order like torch.flatten(x, 1)."""
    x = _tensor(x, "flatten")
    if x.ndim < 2:
        raise ShapeError(f"'{x.name}' {fmt_shape(x.shape)} has no axes to flatten after the batch", user_loc(), "flatten")
    return reshape(x, (x.shape[0], -1), name=name)


def conv2d_layer(x, out_channels, kernel, stride=1, padding=0, dilation=1, groups=1, bias=True, act=None,
                 name=None, init=None, bias_init=None) -> Tensor:
    """torch.nn.Conv2d: parameters `<name>_weight` [O, C/groups, KH, KW] and `<name>_bias` [O],
    initialized as PyTorch does (uniform in +-1/sqrt(fan_in)); then `act`."""
    x = _nchw(x, "conv2d_layer")
    loc, b = user_loc(), current()
    if not isinstance(out_channels, int) or isinstance(out_channels, bool) or out_channels <= 0:
        raise ModelError(f"out_channels must be a positive int, got {out_channels!r}", loc, "conv2d_layer")
    kh, kw = _pair(kernel, "kernel", "conv2d_layer", 1)
    channels = x.shape[1]
    if not isinstance(channels, int) or not isinstance(groups, int) or groups < 1 or channels % groups:
        raise ShapeError(f"groups={groups!r} must divide the {channels} channels of '{x.name}' {fmt_shape(x.shape)}",
                         loc, "conv2d_layer")
    _check_init(init, loc, "conv2d_layer")
    _check_init(bias_init, loc, "conv2d_layer")
    bound = 1.0 / math.sqrt(channels // groups * kh * kw)
    base = name if name is not None else b.default_name(loc, "convolution layer")
    names = b.derived_names(base, ["weight", "bias"] if bias else ["weight"], name is not None, loc, "conv2d_layer")
    w = _helper_param(b, loc, names[0], (out_channels, channels // groups, kh, kw), init or inits.uniform(-bound, bound))
    bias_param = _helper_param(b, loc, names[1], (out_channels,), bias_init or inits.uniform(-bound, bound)) if bias else None
    y = conv2d(x, w, bias_param, stride, padding, dilation, groups)
    y = act(y) if act is not None else y
    if name is not None:  # inside a function building several blocks, the layer's name says more
        b.layer_names[id(y.value)] = name
    return y


def _rate(value, what, op, top):
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value < top:
        raise ModelError(f"{what} must be a number in [0, {top}), got {value!r}", user_loc(), op)
    return float(value)


def batch_norm(x, weight, bias, eps=1e-5, momentum=0.1, name=None) -> Tensor:
    """torch.nn.functional.batch_norm over axis 1 of x [N, C] or [N, C, H, W]. Its running
    statistics are module state `<name>_running_mean` (zeros) and `<name>_running_var` (ones),
    named after the assigned variable: in training mode the batch's statistics normalize x
    and the running ones move by `momentum`; in evaluation mode the running ones normalize."""
    x = _tensor(x, "batch_norm")
    loc, b = user_loc(), current()
    base = name if name is not None else b.default_name(loc, "batch norm")
    names = b.derived_names(base, ["running_mean", "running_var"], name is not None, loc, "batch_norm")
    return _batch_norm(x, _tensor(weight, "batch_norm"), _tensor(bias, "batch_norm"), eps, momentum, names, name)


def _batch_norm(x, weight, bias, eps, momentum, state_names, out_name, op="batch_norm"):
    """The batch_norm node, with its running statistics named `state_names` (claimed)."""
    loc, b = user_loc(), current()
    if x.ndim not in (2, 3, 4):
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, C] or [N, C, H, W]", loc, op)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < float("inf"):
        raise ModelError(f"eps must be a positive finite number, got {eps!r}", loc, op)
    momentum = _rate(momentum, "momentum", op, 1.0 + 1e-12)
    names = state_names
    channels = (x.shape[1],)
    rm = b.declare("state", names[0], channels, "float32", True, loc, claimed=True, init=inits.zeros(), seed=None)
    rv = b.declare("state", names[1], channels, "float32", True, loc, claimed=True, init=inits.ones(), seed=None)
    operands = [x, weight, bias, rm, rv, Tensor(b.mode())]
    return b.add("batch_norm", operands, {"eps": float(eps), "momentum": momentum}, name=out_name)[0]


def batch_norm_layer(x, eps=1e-5, momentum=0.1, name=None) -> Tensor:
    """torch.nn.BatchNorm2d (or 1d): parameters `<name>_weight` (ones) and `<name>_bias` (zeros),
    state `<name>_running_mean` and `<name>_running_var`."""
    x = _tensor(x, "batch_norm_layer")
    loc, b = user_loc(), current()
    if x.ndim < 2 or not isinstance(x.shape[1], int):
        raise ShapeError(f"input '{x.name}' {fmt_shape(x.shape)} must be [N, C, ...] with C concrete", loc,
                         "batch_norm_layer")
    base = name if name is not None else b.default_name(loc, "batch norm layer")
    names = b.derived_names(base, ["weight", "bias", "running_mean", "running_var"], name is not None, loc,
                            "batch_norm_layer")
    w = _helper_param(b, loc, names[0], (x.shape[1],), inits.ones())
    bias = _helper_param(b, loc, names[1], (x.shape[1],), inits.zeros())
    y = _batch_norm(x, w, bias, eps, momentum, names[2:], None, "batch_norm_layer")
    if name is not None:
        b.layer_names[id(y.value)] = name
    return y


def dropout(x, p=0.5, name=None) -> Tensor:
    """torch.nn.functional.dropout: in training mode each element is zeroed with probability p
    and the rest scaled by 1/(1-p), a new mask each call; in evaluation mode x itself."""
    x = _tensor(x, "dropout")
    p = _rate(p, "p", "dropout", 1.0)
    b = current()
    index = sum(1 for n in b.graph.nodes if n.op == "dropout")
    attrs = {"p": p, "scale": 1.0 / (1.0 - p), "stream": name_stream(f"dropout{index}")}
    return b.add("dropout", [x, Tensor(b.mode())], attrs, name=name)[0]


def stochastic_depth(x, p, mode="row", name=None) -> Tensor:
    """torchvision.ops.stochastic_depth: in training mode the residual branch x is zeroed
    with probability p per sample (mode "row") or for the whole batch ("batch"), and kept
    ones are scaled by 1/(1-p), a new draw each call; in evaluation mode x itself."""
    x = _tensor(x, "stochastic_depth")
    p = _rate(p, "p", "stochastic_depth", 1.0)
    if mode not in ("row", "batch"):
        raise ModelError(f"mode must be 'row' or 'batch', got {mode!r}", user_loc(), "stochastic_depth")
    if x.ndim < 1:
        raise ShapeError(f"'{x.name}' is a scalar: stochastic depth drops samples along axis 0", user_loc(),
                         "stochastic_depth")
    b = current()
    index = sum(1 for n in b.graph.nodes if n.op == "stochastic_depth")
    attrs = {"p": p, "scale": 1.0 / (1.0 - p), "stream": name_stream(f"stochastic_depth{index}"), "mode": mode}
    return b.add("stochastic_depth", [x, Tensor(b.mode())], attrs, name=name)[0]
