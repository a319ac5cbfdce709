"""ONNX nodes as DSL statements (converters), or as values computed at import (folders).

`convert(imp, node)` gives each output of `node` a value in `imp.env`: a Var (a
tensor of the written model) or a Const (known at import). A node whose inputs
are all Consts is folded (onnx_fold.py) with numpy, sizes that involve a symbolic
dim included (object arrays of sympy expressions): that is how the Shape / Gather /
Concat arithmetic of an exported `x.view(b * t, e)` becomes `(N * T, 8)`.
Numeric nodes of other ops fold through onnx's reference evaluator. Otherwise
the op's converter writes the statement; converters are registered by op family:
onnx_elementwise.py (elementwise ops, activations, casts), onnx_layers.py
(convolution, normalization, products, pooling, softmax, reductions), onnx_shapes.py
(reshapes, transposes, concat, split, slice, gather, expand).

`plan(imp, nodes)` (onnx_patterns.py) runs first and finds the layers written as
one statement: a Conv and the activation that alone reads it (`act=`), a MatMul by
a weight and the bias Add after it, GELU's Erf pattern.
"""

from __future__ import annotations

import math

import numpy as np
import sympy

from . import onnx_elementwise, onnx_layers, onnx_shapes  # noqa: F401 (they register their converters)
from .onnx_common import CONVERTERS, _assign, _attrs, _normalize, _scalar, _sizes, _x
from .onnx_derived import Derived, is_derived
from .onnx_fold import FOLDERS, _constant, _fold, _shape_slice, _Symbolic
from .emitter import Var
from .onnx_import import Const, Unsupported
from .onnx_layers import _layer_norm_pattern
from .onnx_patterns import plan

__all__ = ["convert", "plan"]


# -- the node's driver ------------------------------------------------------------------


def convert(imp, node):
    """Give node's outputs their values in imp.env."""
    fused = imp.fused.get(id(node))
    if fused and fused[0] == "unary":  # an activation written as several nodes
        fn, x = fused[1:]
        imp.env[node.output[0]] = _assign(imp, node, f"dg.{fn}({_x(imp, node, imp.env[x]).name})",
                                          imp.layer(node, fn))
        return
    if fused and fused[0] == "layer_norm":
        imp.env[node.output[0]] = _layer_norm_pattern(imp, node, *fused[1:])
        return
    if fused and fused[0] == "alias":  # where(isnan(softmax), 0, softmax): the softmax (onnx_patterns)
        imp.env[node.output[0]] = imp.env[fused[1]]
        return
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(f"unsupported ONNX op: {imp.describe(node)} (deepgen reads the standard ai.onnx domain)")
    ins = []
    for name in node.input:
        if not name:
            ins.append(None)
        elif name not in imp.env:
            raise imp.fail(node, f"its input {name!r} is neither a graph input, an initializer nor an earlier "
                                 "node's output")
        else:
            ins.append(imp.env[name])
    attrs = _attrs(node)
    op = node.op_type
    if op == "Constant":
        result = Const(_constant(imp, node, attrs))
    elif op in ("Shape", "Size") and isinstance(ins[0], Var):
        sizes = _sizes(ins[0].tensor.shape)
        if op == "Size":
            total = sympy.expand(math.prod(sympy.sympify(d) for d in ins[0].tensor.shape))
            result = Const(_normalize(np.array(_scalar(total), dtype=object)))
        else:
            result = Const(_shape_slice(sizes, attrs))
    elif any(v is not None for v in ins) and all(v is None or isinstance(v, Const) for v in ins):
        symbolic = any(v is not None and v.symbolic for v in ins)
        try:
            if symbolic and op not in FOLDERS:
                raise _Symbolic()
            result = _fold(imp, node, ins, attrs)
        except _Symbolic:
            if ins[0].value.dtype.kind == "f" and op in CONVERTERS:
                result = CONVERTERS[op](imp, node, ins, attrs)
            else:  # integer arithmetic on sizes that the numpy folders do not follow: known by value
                result = tuple(Derived(out, node) for out in node.output)
        except (TypeError, ValueError):
            if not symbolic:
                raise
            result = tuple(Derived(out, node) for out in node.output)
    elif is_derived(imp, node, ins):
        result = tuple(Derived(out, node) for out in node.output)
    else:
        fn = CONVERTERS.get(op)
        if fn is None:
            raise Unsupported(f"unsupported ONNX op: {imp.describe(node)}")
        result = fn(imp, node, ins, attrs)
    results = result if isinstance(result, tuple) else (result,)
    for i, out in enumerate(node.output):
        if not out:
            continue
        if i >= len(results):
            if imp.consumers.get(out) or out in imp.graph_outputs:
                raise imp.fail(node, f"its output {i} ({out!r}) is not supported")
            continue
        imp.env[out] = results[i]
