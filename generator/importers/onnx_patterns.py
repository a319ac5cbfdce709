"""Several ONNX nodes written as one DSL statement: `plan(imp, nodes)` runs before the
walk and marks them (imp.fused, imp.absorbed): a Conv and the activation that alone reads
it (`act=`), a MatMul by a weight and the bias Add after it, GELU's Erf pattern, x *
sigmoid(x), the opset < 17 layer norm."""

from __future__ import annotations

import math

from .onnx_common import _attrs
from .onnx_elementwise import _activation, _standard_hardsigmoid

# -- patterns: several nodes, one statement -------------------------------------------


def plan(imp, nodes):
    """Mark the layers written as one statement (imp.fused, imp.absorbed)."""
    needed = {id(n) for n in nodes}

    def only_consumer(name):
        users = imp.consumers.get(name, [])
        if len(users) != 1 or name in imp.graph_outputs or id(users[0]) not in needed:
            return None
        return users[0]

    standard = [n for n in nodes if n.domain in ("", "ai.onnx")]
    for node in standard:  # activations written as several nodes
        if node.op_type == "Erf":
            _plan_gelu(imp, node, only_consumer)
        elif node.op_type in ("Sigmoid", "HardSigmoid"):
            _plan_gated(imp, node, only_consumer)
        elif node.op_type == "ReduceMean":
            _plan_layer_norm(imp, node, only_consumer)
        elif node.op_type == "IsNaN":
            _plan_nan_guard(imp, node, only_consumer)
    ends = {}  # what a multi-node activation reads -> the nodes that end one
    for node in standard:
        if imp.fused.get(id(node), ("",))[0] == "unary":
            ends.setdefault(imp.fused[id(node)][2], []).append(node)
    for node in standard:
        if id(node) in imp.absorbed:
            continue
        if node.op_type == "Conv":
            user = _sole_activation(imp, node.output[0], needed, ends.get(node.output[0], []))
            act = _activation(imp, user) if user is not None else None
            if act:
                imp.fused[id(node)] = ("act", user, act)
                imp.absorbed.add(id(user))
                for n in imp.consumers[node.output[0]]:  # (a gated activation's other node)
                    imp.absorbed.add(id(n))
        elif node.op_type == "MatMul" and len(node.input) == 2:
            weight = imp.static_const(node.input[1])
            user = only_consumer(node.output[0])
            if weight is None or weight.ndim != 2 or user is None or user.op_type != "Add":
                continue
            other = [i for i in user.input if i != node.output[0]]
            bias = imp.static_const(other[0]) if len(other) == 1 else None
            if (bias is not None and 1 <= bias.ndim <= 2 and bias.shape[-1] == weight.shape[1]
                    and bias.size == weight.shape[1] and other[0] in imp.initializers):
                imp.fused[id(node)] = ("bias", user, other[0])
                imp.absorbed.add(id(user))


def _sole_activation(imp, name, needed, ends):
    """The node that alone reads `name` (or ends the multi-node activation that alone reads it)."""
    users = imp.consumers.get(name, [])
    if name in imp.graph_outputs or not users or any(id(u) not in needed for u in users):
        return None
    if len(users) == 1 and id(users[0]) not in imp.absorbed:
        return users[0]
    if len(ends) == 1 and all(u is ends[0] or id(u) in imp.absorbed for u in users):
        return ends[0]
    return None


def _plan_gated(imp, gate, only_consumer):
    """x * sigmoid(x) -> dg.silu(x); x * hardsigmoid(x) (the standard one) -> dg.hardswish(x)."""
    if gate.op_type == "HardSigmoid" and not _standard_hardsigmoid(_attrs(gate)):
        return
    x = gate.input[0]
    mul = only_consumer(gate.output[0])
    if mul is None or mul.op_type != "Mul" or _other(mul, gate.output[0]) != x:
        return
    imp.absorbed.add(id(gate))
    imp.fused[id(mul)] = ("unary", "silu" if gate.op_type == "Sigmoid" else "hardswish", x)


def _near(value, target) -> bool:
    return value is not None and value.size == 1 and abs(float(value.reshape(-1)[0]) - target) < 1e-6 * max(1, target)


def _other(node, name):
    rest = [i for i in node.input if i != name]
    return rest[0] if len(rest) == 1 else None


def _plan_gelu(imp, erf, only_consumer):
    """x * 0.5 * (1 + erf(x / sqrt(2))) in the orders exporters write it -> dg.gelu(x)."""
    scaled = imp.producer.get(erf.input[0])
    if scaled is None or scaled.op_type not in ("Div", "Mul") or only_consumer(scaled.output[0]) is not erf:
        return
    x = scaled.input[0]
    k = imp.static_const(scaled.input[1])
    if not _near(k, math.sqrt(2) if scaled.op_type == "Div" else 1 / math.sqrt(2)):
        return
    add = only_consumer(erf.output[0])
    if add is None or add.op_type != "Add" or not _near(imp.static_const(_other(add, erf.output[0])), 1.0):
        return
    m1 = only_consumer(add.output[0])
    if m1 is None or m1.op_type != "Mul":
        return
    partner = _other(m1, add.output[0])
    group = [scaled, erf, add, m1]
    if partner == x:  # (x * (1 + erf)) * 0.5
        m2 = only_consumer(m1.output[0])
        if m2 is None or m2.op_type != "Mul" or not _near(imp.static_const(_other(m2, m1.output[0])), 0.5):
            return
        group.append(m2)
    elif _near(imp.static_const(partner), 0.5):  # ((1 + erf) * 0.5) * x
        m2 = only_consumer(m1.output[0])
        if m2 is None or m2.op_type != "Mul" or _other(m2, m1.output[0]) != x:
            return
        group.append(m2)
    else:  # (x * 0.5) * (1 + erf)
        half = imp.producer.get(partner)
        if (half is None or half.op_type != "Mul" or only_consumer(partner) is not m1 or x not in half.input
                or not _near(imp.static_const(_other(half, x)), 0.5)):
            return
        group.insert(0, half)
    end = group[-1]
    for n in group[:-1]:
        imp.absorbed.add(id(n))
    imp.fused[id(end)] = ("unary", "gelu", x)


def _reduced_axes(imp, node):
    """The axes a ReduceMean node reduces, where known at import (None otherwise)."""
    attrs = _attrs(node)
    if imp.opset < 18:
        return attrs.get("axes")
    given = imp.static_const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
    return None if given is None else given.reshape(-1).tolist()


def _plan_layer_norm(imp, mean, only_consumer):
    """(x - mean(x)) / sqrt(mean((x - mean(x))^2) + eps) [* w] [+ b] over the last axis, as
    exporters write layer norm before opset 17 -> dg.layer_norm (imp.fused: ("layer_norm", x,
    eps, w, b), w and b initializer names or None)."""
    x = mean.input[0]
    axes = _reduced_axes(imp, mean)
    if axes is None or len(axes) != 1 or _attrs(mean).get("keepdims", 1) != 1:
        return
    sub = only_consumer(mean.output[0])
    if sub is None or sub.op_type != "Sub" or list(sub.input) != [x, mean.output[0]]:
        return
    users = imp.consumers.get(sub.output[0], [])
    if len(users) != 2 or sub.output[0] in imp.graph_outputs:
        return
    square = next((u for u in users if u.op_type == "Pow" and _near(imp.static_const(u.input[1]), 2.0)), None)
    div = next((u for u in users if u.op_type == "Div" and u.input[0] == sub.output[0]), None)
    if square is None or div is None:
        return
    var = only_consumer(square.output[0])
    if var is None or var.op_type != "ReduceMean" or _reduced_axes(imp, var) != axes:
        return
    add = only_consumer(var.output[0])
    eps = imp.static_const(_other(add, var.output[0])) if add is not None and add.op_type == "Add" else None
    if eps is None or eps.size != 1:
        return
    root = only_consumer(add.output[0])
    if root is None or root.op_type != "Sqrt" or only_consumer(root.output[0]) is not div or div.input[1] != root.output[0]:
        return
    group, end, weight, bias = [mean, sub, square, var, add, root, div], div, None, None
    mul = only_consumer(div.output[0])
    if mul is not None and mul.op_type == "Mul" and _vector(imp, _other(mul, div.output[0])):
        weight, end = _other(mul, div.output[0]), mul
        group.append(mul)
        plus = only_consumer(mul.output[0])
        if plus is not None and plus.op_type == "Add" and _vector(imp, _other(plus, mul.output[0])):
            bias, end = _other(plus, mul.output[0]), plus
            group.append(plus)
    for n in group[:-1]:
        imp.absorbed.add(id(n))
    imp.fused[id(end)] = ("layer_norm", x, float(eps.reshape(-1)[0]), weight, bias, axes[0])


def _vector(imp, name) -> bool:
    """name is a 1-D float constant (an initializer, or one behind Identity nodes)."""
    value = imp.static_const(name) if name else None
    return value is not None and value.ndim == 1 and value.dtype.kind == "f"


def _plan_nan_guard(imp, isnan, only_consumer):
    """where(isnan(p), 0, p) for p a softmax (transformers' guard against rows with no key
    left) -> p: the DSL's key_mask refuses such a row at run time, so p is never NaN from it."""
    p = isnan.input[0]
    source = imp.producer.get(p)
    where = only_consumer(isnan.output[0])
    if source is None or source.op_type != "Softmax" or where is None or where.op_type != "Where":
        return
    if list(where.input[::2]) != [isnan.output[0], p] or not _near(imp.static_const(where.input[1]), 0.0):
        return
    imp.absorbed.add(id(isnan))
    imp.fused[id(where)] = ("alias", p)
