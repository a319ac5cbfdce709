"""Reverse-mode differentiation of a Graph, producing ordinary graph nodes.

`differentiate(graph, loss, wrt)` walks the nodes that lie between `wrt` and the
scalar `loss` backwards, asking each op's `grad` rule for the gradients of its
inputs given the gradient of its outputs. Rules build IR through a GradBuilder,
so the backward pass is printed, checked, interpreted and lowered like the
forward one. Gradients of a value used several times are added up.
"""

from __future__ import annotations

import re

import sympy

from ..errors import ModelError
from ..ir.graph import Node, Value, needed_for, needed_nodes
from ..ir.names import NameTable
from ..ops import ARGS, get_op
from ..ir.shapes import broadcast, contiguous_groups, same
from .rounding import round_products


class GradBuilder:
    """Adds backward nodes to a graph (each tagged phase="backward", located at
    the forward node it differentiates, named d_<value>...)."""

    def __init__(self, graph):
        if graph.names is None:  # continue the graph's naming: new names never clash
            graph.names = NameTable()
            for v in graph.values():
                graph.names.claim(v.name)
            for d in graph.dims:
                graph.names.claim(str(d))
        self.graph = graph
        self.loc = None
        self.nodes = []
        self.reaches = None  # ids of the values backprop differentiates for (None: all)

    def op(self, op, inputs, attrs, hint):
        opdef = get_op(op)
        try:
            results = opdef.infer(inputs, attrs)
        except ValueError as e:  # a gradient rule built something inconsistent: our bug
            raise RuntimeError(f"gradient of {self.loc}: {op}: {e}") from None
        node = Node(op, list(inputs), attrs, loc=self.loc, phase="backward")
        for i, (dtype, shape) in enumerate(results):
            if isinstance(hint, (list, tuple)):  # one name per output
                name = self.graph.names.unique(hint[i])
            else:
                name = self.graph.names.unique(hint if len(results) == 1 else f"{hint}_{i}")
            node.outputs.append(Value(name, dtype, shape, producer=node, loc=self.loc))
        self.nodes.append(node)
        return node.outputs if len(results) > 1 or opdef.multi_output else node.outputs[0]

    def ewise(self, fn, expr, operands, shape, hint):
        """An elementwise node computing `expr` over `operands` (symbol ARGS[i] is
        operands[i]); unused operands are dropped, and a bare operand of the right
        shape is returned as is."""
        expr = sympy.sympify(expr)
        used = [i for i, _ in enumerate(operands) if ARGS[i] in expr.free_symbols]
        if not used:  # a constant gradient (e.g. d(x + 1)/dx without g): fill
            return self.fill(shape, float(expr))
        if shape is None:
            shape = broadcast([operands[i].shape for i in used])
        if expr == ARGS[used[0]] and len(used) == 1 and _same_shape(operands[used[0]].shape, shape):
            return operands[used[0]]
        renamed = expr.xreplace({ARGS[i]: ARGS[j] for j, i in enumerate(used)})
        attrs = {"fn": fn, "expr": renamed}
        if not all(_same_shape(operands[i].shape, shape) for i in used):
            attrs["shape"] = tuple(shape)
        return self.op("ewise", [operands[i] for i in used], attrs, hint)

    def fill(self, shape, value):
        return self.op("fill", [], {"shape": tuple(shape), "value": float(value)}, "zeros" if value == 0 else "ones")

    def reshape(self, x, shape):
        if _same_shape(x.shape, shape):
            return x
        return self.op("reshape", [x], {"shape": tuple(shape)}, f"{x.name}_r")

    def reduce(self, kind, x, axes, keepdims):
        axes = [a % x.rank for a in axes]
        for lo, hi in reversed(contiguous_groups(axes)):
            x = self.op(kind, [x], {"axes": (lo, hi), "keepdims": keepdims}, f"{x.name}_{kind}")
        return x

    def sum_to(self, g, shape):
        """Sum g over the axes along which a value of `shape` was broadcast: the
        leading extra axes (dropped), then the axes where `shape` has 1 (kept)."""
        if _same_shape(g.shape, shape):
            return g
        lead = g.rank - len(shape)
        if lead:
            g = self.reduce("sum", g, range(lead), keepdims=False)
        ones = [i for i, d in enumerate(shape) if isinstance(d, int) and d == 1 and g.shape[i] != 1]
        if ones:
            g = self.reduce("sum", g, ones, keepdims=True)
        return self.reshape(g, shape)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def backprop(gb, nodes, grads: dict, reaches: set, needed=None) -> dict:
    """Walk `nodes` backwards from the gradients in `grads` ({id(value): gradient
    Value}, updated in place), asking each op's rule for its inputs' gradients;
    only inputs in `reaches` (ids of values that depend on what is differentiated
    for) get one, and only nodes whose inputs are `needed` (None: all) are
    visited. The new nodes are in gb.nodes. gb.loc and gb.reaches are as they
    were on return: a rule that backpropagates through nodes of its own (a
    recursion's cells) keeps the location of the node it differentiates for the
    nodes it adds after."""
    outer = gb.loc, gb.reaches
    try:
        _backprop(gb, nodes, grads, reaches, needed)
    finally:
        gb.loc, gb.reaches = outer
    return grads


def _backprop(gb, nodes, grads: dict, reaches: set, needed) -> None:
    came_from = {}  # id(a gradient part) -> the node whose rule made it
    for node in reversed(list(nodes)):
        if not any(id(v) in grads for v in node.outputs):
            continue
        if not any(id(v) in reaches and (needed is None or id(v) in needed) for v in node.inputs):
            continue
        opdef = get_op(node.op)
        if opdef.grad is None:
            raise ModelError(f"'{node.op}' has no gradient rule", node.loc, node.op)
        gb.loc = node.loc
        gb.reaches = reaches  # a rule may skip inputs whose gradient nobody wants (ops/recurse.py)
        gouts = [grads.get(id(v)) for v in node.outputs]
        if any(g is None for g in gouts) and not opdef.multi_output:
            gouts = [g if g is not None else gb.fill(v.shape, 0.0) for g, v in zip(gouts, node.outputs)]
        for v, g in zip(node.inputs, opdef.grad(node, gouts, gb)):
            if g is None or id(v) not in reaches:
                continue
            if id(v) in grads:
                a, b = ARGS[0], ARGS[1]
                parts = [grads[id(v)], g]
                freed = _name_parts(gb, v, parts, [came_from.get(id(grads[id(v)])), node])
                g = gb.ewise("add", a + b, parts, v.shape, f"d_{v.name}")
                if freed is not None and g.producer is not None:
                    g.name = freed  # the sum is the gradient: d_<v>, the name its part had
                _total_takes_the_name(g, parts, f"d_{v.name}")
            else:
                came_from[id(g)] = node
            grads[id(v)] = g


def _name_parts(gb, v, parts, consumers) -> str | None:
    """The parts of a gradient summed from several uses of v are named after the use each
    comes from (`d_x_from_conv1`, `d_x_from_shortcut_0`) instead of numbered, where a part is
    a value made for v's gradient alone (named d_<v>, numbered) by the rule of a use whose
    result the user named (a variable or name=, not one deepgen made from the op's name).
    Returns the name d_<v> where a renamed part had it (the sum takes it), else None."""
    stem, freed = f"d_{v.name}", None
    for part, consumer in zip(parts, consumers):
        if consumer is None or part.producer is None or part.producer not in gb.nodes or not consumer.outputs:
            continue
        if not re.fullmatch(rf"{re.escape(stem)}(_\d+)?", part.name):
            continue
        made = consumer.outputs[0]
        use = made.name if made.explicit else re.sub(r"_\d+$", "", made.name)  # a variable's out_3: out
        if use.isidentifier() and not use.startswith("_") and use != consumer.op:  # not a name made from the op's
            freed = part.name if part.name == stem else freed
            part.name = gb.graph.names.unique(f"{stem}_from_{use}")
    return freed


def _total_takes_the_name(total, parts, name) -> None:
    """The sum of a value's gradient parts is its gradient: it is called d_<value>
    (`d_layer4_0`), and the part that had that name takes the sum's numbered one
    (`d_layer4_0_2`), so the name that leaves a block's gradient is the user's."""
    for part in parts:
        if part.name == name and part.producer is not None and total.name != name:
            part.name, total.name = total.name, name
            return


def reaching(nodes, sources) -> set:
    """ids of `sources` and of every value of `nodes` computed from them."""
    reaches = {id(v) for v in sources}
    for node in nodes:
        if any(id(v) in reaches for v in node.inputs):
            reaches.update(id(v) for v in node.outputs)
    return reaches


def differentiate(graph, loss: Value, wrt: list) -> dict:
    """Append backward nodes to graph.nodes; returns {id(value): gradient Value}
    for each value in `wrt` that the loss depends on."""
    if loss.shape != () or loss.dtype != "float32":
        raise ModelError(f"the loss must be a float32 scalar, got '{loss.name}' {loss.type_str()}", loss.loc)
    # Nodes on a path from wrt to the loss.
    needed = {id(loss)}
    for node in reversed(graph.nodes):
        if any(id(v) in needed for v in node.outputs):
            needed.update(id(v) for v in node.inputs)
    reaches = reaching(graph.nodes, wrt)
    gb = GradBuilder(graph)
    gb.loc = loss.loc
    grads = {id(loss): gb.fill((), 1.0)}
    grads[id(loss)].name = graph.names.unique(f"d_{loss.name}")
    backprop(gb, graph.nodes, grads, reaches, needed)
    result = {id(v): grads[id(v)] for v in wrt if id(v) in grads}
    # Rules compute every input's gradient (matmul: both operands); keep only
    # the backward nodes that the requested gradients need.
    graph.nodes.extend(needed_nodes(gb.nodes, {id(g) for g in result.values()}))
    return result


def train_only_inputs(graph) -> list:
    """Inputs that no output needs (labels, targets): only train_step takes them."""
    need = needed_for(graph, [v for _, v in graph.outputs])
    return [v for v in graph.inputs if id(v) not in need]


def prepare_training(graph):
    """Add the backward pass for graph.train (once): tags nodes that need
    training-only inputs with phase "loss", differentiates the loss with respect
    to every parameter, and records the gradients in graph.train.grads."""
    spec = graph.train
    if spec is None or spec.prepared:
        return graph
    tainted = {id(v) for v in train_only_inputs(graph)}
    for node in graph.nodes:
        if any(id(v) in tainted for v in node.inputs):
            node.phase = "loss"
            tainted.update(id(v) for v in node.outputs)
    grads = differentiate(graph, spec.loss, graph.trainable)
    spec.grads = {p.name: grads[id(p)] for p in graph.trainable if id(p) in grads}
    for p in graph.params:  # call a parameter's gradient d_<param> where that is free
        g = spec.grads.get(p.name)
        if g is not None and g.producer is not None and g.producer.phase == "backward":
            if graph.names.claim(f"d_{p.name}"):
                g.name = f"d_{p.name}"
    if spec.precision == "bf16":  # every product, forward and backward, on bf16 values (the gradient of a
        round_products(graph)  # rounding is taken as 1: products round what they read, nothing else changes)
    spec.prepared = True
    return graph
