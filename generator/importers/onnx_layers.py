"""ONNX layers (convolution, normalization, products, pooling, softmax, reductions) as
DSL calls, layer helpers where the weights are initializers."""

from __future__ import annotations

import numpy as np

from .emitter import Var, code
from .onnx_import import Const, identifier, number, scope
from .onnx_common import CONVERTERS, _assign, _axis, _entries, _pair, _text, _x, converter

# -- layers --------------------------------------------------------------------------


def _conv_geometry(imp, node, attrs, kernel):
    if any(d != 1 for d in attrs.get("dilations", [1, 1])) and node.op_type != "Conv":
        raise imp.fail(node, f"dilations {attrs['dilations']} are not supported")
    strides = list(attrs.get("strides", [1] * len(kernel)))
    pads = list(attrs.get("pads", [0] * 2 * len(kernel)))
    auto = attrs.get("auto_pad", "NOTSET")
    dilations = list(attrs.get("dilations", [1] * len(kernel)))
    if auto == "VALID":
        pads = [0] * 2 * len(kernel)
    elif auto in ("SAME_UPPER", "SAME_LOWER"):
        spans = [d * (k - 1) for d, k in zip(dilations, kernel)]
        if any(s != 1 for s in strides) or any(s % 2 for s in spans):
            raise imp.fail(node, f"auto_pad={auto} with strides {strides} and kernel {list(kernel)} pads unevenly; "
                                 "deepgen pads both sides alike")
        pads = [s // 2 for s in spans] * 2
    elif auto != "NOTSET":
        raise imp.fail(node, f"auto_pad={auto} is not supported")
    half = len(pads) // 2
    if pads[:half] != pads[half:]:
        raise imp.fail(node, f"pads {pads} differ at the start and the end of an axis; deepgen pads both sides alike")
    return strides, pads[:half], dilations


@converter("Conv")
def conv(imp, node, ins, attrs):
    x, w = _x(imp, node, ins[0]), ins[1]
    b = ins[2] if len(ins) > 2 else None
    if x.tensor.ndim != 4:
        raise imp.fail(node, f"a {x.tensor.ndim - 2}-D convolution is not supported (deepgen's is 2-D, NCHW)")
    shape = w.value.shape if isinstance(w, Const) else tuple(w.tensor.shape)
    kernel = list(attrs.get("kernel_shape", shape[2:]))
    strides, pads, dilations = _conv_geometry(imp, node, attrs, kernel)
    groups = attrs.get("group", 1)
    fused = imp.fused.get(id(node))
    act = fused[2] if fused else None
    opts = []
    for key, value, default in (("stride", strides, [1, 1]), ("padding", pads, [0, 0]),
                                ("dilation", dilations, [1, 1])):
        if list(value) != default:
            opts.append(f"{key}={_pair(value)}")
    if groups != 1:
        opts.append(f"groups={groups}")
    if isinstance(w, Const) and (b is None or isinstance(b, Const)) and not w.symbolic:
        base = imp.layer_base(node, ("weight", "bias"))
        imp.store(f"{base}_weight", w.value)
        if b is not None:
            imp.store(f"{base}_bias", b.value)
        else:
            opts.append("bias=False")
        if act:
            opts.append(f"act={act}")
        opts.append(f'name="{base}"')
        out = imp.em.assign(base, f"dg.conv2d_layer({x.name}, {shape[0]}, {_pair(kernel)}, {', '.join(opts)})")
    else:
        operands = [x.name, imp.tensor(w, node, "weight").name] + ([imp.tensor(b, node, "bias").name] if b else [])
        out = _assign(imp, node, f"dg.conv2d({', '.join(operands + opts)})")
        if act:
            out = imp.em.assign(imp.layer(fused[1]), f"{act}({out.name})")
    if fused:
        imp.env[fused[1].output[0]] = out
    return out


@converter("BatchNormalization")
def batch_norm(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    if attrs.get("training_mode", 0):
        raise imp.fail(node, "training_mode=1 is not supported (export the model in eval mode)")
    stats = ins[1:5]
    if not all(isinstance(s, Const) and not s.symbolic for s in stats):
        raise imp.fail(node, "its scale, bias, mean and variance must be initializers")
    base = imp.layer_base(node, ("weight", "bias", "running_mean", "running_var"))
    for role, s in zip(("weight", "bias", "running_mean", "running_var"), stats):
        imp.store(f"{base}_{role}", s.value)
    eps = number(attrs.get("epsilon", 1e-5))
    momentum = float(f"{1 - attrs.get('momentum', 0.9):.6g}")  # ONNX keeps the old statistic's weight
    return imp.em.assign(base, f'dg.batch_norm_layer({x.name}, eps={eps}, momentum={momentum!r}, name="{base}")')


@converter("LayerNormalization")
def layer_norm(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    if _axis(imp, node, attrs.get("axis", -1), rank) != rank - 1:
        raise imp.fail(node, f"normalizing from axis {attrs.get('axis')} is not supported (the last axis only)")
    w = imp.tensor(ins[1], node, "weight")
    if len(ins) > 2 and ins[2] is not None:
        b = imp.tensor(ins[2], node, "bias")
    else:
        b = imp.param(Const(np.zeros(x.tensor.shape[-1], np.float32)), node, "bias")
    eps = number(attrs.get("epsilon", 1e-5))
    return _assign(imp, node, f"dg.layer_norm({x.name}, {w.name}, {b.name}, eps={eps})")


@converter("Gemm")
def gemm(imp, node, ins, attrs):
    a, bm = ins[0], ins[1]
    c = ins[2] if len(ins) > 2 else None
    if attrs.get("transA", 0):
        raise imp.fail(node, "transA=1 is not supported")
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if alpha != 1.0:
        if not isinstance(bm, Const):
            raise imp.fail(node, f"alpha={alpha} with a B computed at run time is not supported")
        bm = Const((bm.value * np.float32(alpha)).astype(np.float32), bm.name)
        imp.em.note(f"{bm.name or 'B'} times alpha = {number(alpha)} (Gemm {node.name or node.output[0]})")
    if beta != 1.0 and c is not None:
        if not isinstance(c, Const):
            raise imp.fail(node, f"beta={beta} with a C computed at run time is not supported")
        c = Const((c.value * np.float32(beta)).astype(np.float32), c.name)
        imp.em.note(f"{c.name or 'C'} times beta = {number(beta)} (Gemm {node.name or node.output[0]})")
    x = _x(imp, node, a)
    w = imp.tensor(bm, node, "weight")
    bias = _text(imp, node, c, "bias") if c is not None else None
    one_dim = c is None or isinstance(c, Const) and c.value.ndim <= 1 or isinstance(c, Var) and c.tensor.ndim == 1
    if attrs.get("transB", 0) and one_dim:
        return _assign(imp, node, f"dg.linear_t({x.name}, {w.name}{', ' + bias if bias else ''})")
    product = f"dg.matmul({x.name}, {w.name}{', tb=True' if attrs.get('transB', 0) else ''})"
    return _assign(imp, node, product + (f" + {bias}" if bias else ""))


@converter("MatMul")
def matmul(imp, node, ins, attrs):
    a, b = ins
    fused = imp.fused.get(id(node))
    if isinstance(a, Const) and isinstance(b, Var):
        if a.value.ndim != 2 or b.tensor.ndim != 2:
            raise imp.fail(node, "a constant left operand is supported with 2-D operands only")
    elif isinstance(b, Var) and b.tensor.ndim > 2 and a.tensor.ndim != b.tensor.ndim:
        raise imp.fail(node, f"a batched product of ranks {a.tensor.ndim} and {b.tensor.ndim} (broadcast) is not "
                             "supported")
    hint = (identifier("_".join(scope(node))) if scope(node) else imp.layer(fused[1])) if fused else None
    left, right = imp.tensor(a, node, "weight", hint), imp.tensor(b, node, "weight", hint)
    if left.tensor.ndim < 2 or right.tensor.ndim < 2:
        raise imp.fail(node, "a product with a 1-D operand is not supported")
    text = f"dg.matmul({left.name}, {right.name})"
    if fused:
        add, bias_name = fused[1], fused[2]
        bias = imp.tensor(imp.env[bias_name], add, "bias", hint)
        out = imp.em.assign(hint, f"{text} + {bias.name}")
        imp.env[add.output[0]] = out
        return out
    return _assign(imp, node, text)


def _pool(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    kernel = list(attrs["kernel_shape"])
    if len(kernel) != 2 or x.tensor.ndim != 4:
        raise imp.fail(node, f"{len(kernel)}-D pooling is not supported (deepgen's is 2-D, NCHW)")
    if any(d != 1 for d in attrs.get("dilations", [1, 1])):
        raise imp.fail(node, f"dilations {attrs['dilations']} are not supported")
    strides, pads, _ = _conv_geometry(imp, node, {k: v for k, v in attrs.items() if k != "dilations"}, kernel)
    if node.op_type == "AveragePool" and not attrs.get("count_include_pad", 0) and any(pads):
        raise imp.fail(node, "count_include_pad=0 with padding is not supported (deepgen counts the padding, as "
                             "PyTorch's default)")
    if len(node.output) > 1 and node.output[1] and imp.consumers.get(node.output[1]):
        raise imp.fail(node, "its Indices output is not supported")
    opts = [_pair(kernel)]
    if strides != kernel:
        opts.append(f"stride={_pair(strides)}")
    if any(pads):
        opts.append(f"padding={_pair(pads)}")
    if attrs.get("ceil_mode", 0):
        opts.append("ceil_mode=True")
    fn = "max_pool2d" if node.op_type == "MaxPool" else "avg_pool2d"
    return _assign(imp, node, f"dg.{fn}({x.name}, {', '.join(opts)})")


CONVERTERS["MaxPool"] = CONVERTERS["AveragePool"] = _pool


@converter("GlobalAveragePool", "GlobalMaxPool")
def global_pool(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    fn = "mean" if node.op_type == "GlobalAveragePool" else "max"
    axes = tuple(range(2, x.tensor.ndim))
    return _assign(imp, node, f"dg.{fn}({x.name}, axis={code(axes)}, keepdims=True)")


@converter("Softmax", "LogSoftmax")
def softmax(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    rank = x.tensor.ndim
    axis = _axis(imp, node, attrs.get("axis", -1 if imp.opset >= 13 else 1), rank)
    if imp.opset < 13 and any(d != 1 for d in x.tensor.shape[axis + 1:]):
        raise imp.fail(node, f"opset {imp.opset}'s softmax over axes {axis}.. flattened together is not supported "
                             "(only over the last axis)")
    if imp.opset < 13:
        axis = rank - 1
    fn = "softmax" if node.op_type == "Softmax" else "log_softmax"
    return _assign(imp, node, f"dg.{fn}({x.name}, axis={-1 if axis == rank - 1 else axis})")


@converter("ReduceMean", "ReduceSum", "ReduceMax")
def reduce(imp, node, ins, attrs):
    x = _x(imp, node, ins[0])
    in_attr = imp.opset < (13 if node.op_type == "ReduceSum" else 18)
    axes = attrs.get("axes") if in_attr else _entries(imp, node, ins[1] if len(ins) > 1 else None, "axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return x
        axes = list(range(x.tensor.ndim))
    axes = tuple(sorted(_axis(imp, node, int(a), x.tensor.ndim) for a in axes))
    fn = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceMax": "max"}[node.op_type]
    keep = ", keepdims=True" if attrs.get("keepdims", 1) else ""
    axis = "" if len(axes) == x.tensor.ndim else f", axis={code(axes if len(axes) > 1 else axes[0])}"
    return _assign(imp, node, f"dg.{fn}({x.name}{axis}{keep})")



def _layer_norm_pattern(imp, node, x_name, eps, weight, bias, axis):
    x = _x(imp, node, imp.env[x_name])
    if _axis(imp, node, axis, x.tensor.ndim) != x.tensor.ndim - 1:
        raise imp.fail(node, f"layer norm over axis {axis} is not supported (the last axis only)")
    width = x.tensor.shape[-1]
    layer = identifier("_".join(scope(node))) if scope(node) else imp.layer(node, "layer_norm")
    w = imp.tensor(imp.env[weight], node, "weight", layer) if weight else \
        imp.param(Const(np.ones(width, np.float32)), node, "weight", layer)
    b = imp.tensor(imp.env[bias], node, "bias", layer) if bias else \
        imp.param(Const(np.zeros(width, np.float32)), node, "bias", layer)
    return imp.em.assign(layer, f"dg.layer_norm({x.name}, {w.name}, {b.name}, eps={number(eps)})")
