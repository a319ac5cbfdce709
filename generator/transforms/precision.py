"""The precision a model is generated in (`deepgen generate --precision`).

bf16 inference: the operands of every product (each operand an OpDef lists in
`products`: matmul's and bmm's a and b, a convolution's input and weight) are
rounded to bfloat16 by a `round_bf16` node before the product, weights included;
the product multiplies and accumulates in float32 and everything else (bias
adds, activations, normalization, softmax) stays float32. The rounding is an
ordinary node, so the reference interpreter computes exactly what the generated
code does, and the C++ shows it as a named call (`dg::round_bf16`). A value that
several products read is rounded once. Inside a recursion's cells (a TreeLSTM's,
an LSTM's time step) the same holds: a value the cell makes is rounded in the
cell, once per level or step; a value from outside it (a weight) is rounded once,
before the recursion, which reads the rounded value instead.

int8 inference: every matmul by a weight becomes a `matmul_int8` node with static
scales that are buffers (transforms/quantize.py, ops/quantize.py); the rest stays
float32.
"""

from __future__ import annotations

from ..errors import DeepgenError
from ..ir.graph import Node, Value, outer_reads
from ..ops import get_op
from .autodiff import train_only_inputs
from .passes import dce
from .quantize import rewrite_int8

PRECISIONS = ("fp32", "bf16", "int8")


def set_precision(graph, precision: str) -> list:
    """Rewrite the graph in place for `precision` (fp32 leaves it as built); returns
    notes for the user (what a bf16 generation left out)."""
    if precision not in PRECISIONS:
        raise DeepgenError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return []
    notes = []
    if graph.train is not None:  # reduced-precision training is not implemented: the project is the inference part
        labels = train_only_inputs(graph)
        graph.inputs = [v for v in graph.inputs if all(v is not w for w in labels)]
        graph.train = None
        dce(graph)  # the loss and what only it reads
        notes.append(f"{precision}: inference only: '{graph.name}' calls dg.train, but {precision} training is not "
                     f"implemented yet, so the project has forward() and no train_step()"
                     + (f" (and forward() does not take {', '.join(v.name for v in labels)})" if labels else ""))
    if precision == "int8":  # transforms/quantize.py
        weights = rewrite_int8(graph)
        notes.append(f"int8: {len(weights)} product(s) by a weight run in int8 ({', '.join(weights) or 'none'}), "
                     "everything else in float32; their scales come from `deepgen quantize`")
        graph.precision = precision
        return notes
    _round_products(graph)
    graph.precision = precision
    return notes


def _rounding(graph, v, node, nodes) -> Value:
    """A round_bf16 node of `v`, appended to `nodes` (before `node`, which reads it)."""
    out = Value(graph.names.unique(f"{v.name}_bf16"), "float32", tuple(v.shape), loc=node.loc)
    rounding = Node("round_bf16", [v], {}, outputs=[out], loc=node.loc, phase=node.phase)
    out.producer = rounding
    nodes.append(rounding)
    return out


def _round_products(graph):
    rounded = {}  # id(value) -> its bf16 value, made before the first product that reads it
    nodes = []
    for node in graph.nodes:
        if get_op(node.op).regions(node):
            _round_cells(graph, node, rounded, nodes)
        for i in get_op(node.op).products:
            v = node.inputs[i]
            if id(v) not in rounded:
                rounded[id(v)] = _rounding(graph, v, node, nodes)
            node.inputs[i] = rounded[id(v)]
        nodes.append(node)
    graph.nodes[:] = nodes


def _round_cells(graph, node, outer, nodes):
    """The products in the cells of the recursion `node`: operands the cell makes are
    rounded in the cell; outer values (its free values: weights) are rounded in the
    graph before `node` (in `nodes`, shared through `outer`), and the recursion reads
    the rounded ones instead (its free values and inputs are listed again)."""
    spec = node.attrs.get("spec")
    if not all(hasattr(spec, a) for a in ("leaf", "internal", "free", "nb")):  # a recursion's (RecurseSpec)
        raise DeepgenError(f"--precision bf16: the op '{node.op}' ({node.outputs[0].name}) has no bf16 rewrite")
    for cell in (spec.leaf, spec.internal):
        made = {id(cell.words)} | {id(v) for slot in cell.children for v in slot}
        made |= {id(v) for inner in cell.nodes for v in inner.outputs}
        inside, cell_nodes = {}, []
        for inner in cell.nodes:
            if get_op(inner.op).regions(inner):
                raise DeepgenError(f"--precision bf16: a recursion inside a recursion's cell ('{inner.op}', "
                                   f"{inner.outputs[0].name}) is not supported in bf16")
            for i in get_op(inner.op).products:
                v = inner.inputs[i]
                if id(v) in made:
                    if id(v) not in inside:
                        inside[id(v)] = _rounding(graph, v, inner, cell_nodes)
                    inner.inputs[i] = inside[id(v)]
                else:
                    if id(v) not in outer:
                        outer[id(v)] = _rounding(graph, v, node, nodes)
                    inner.inputs[i] = outer[id(v)]
            cell_nodes.append(inner)
        cell.nodes[:] = cell_nodes
        cell.free = outer_reads(cell.nodes, made | {id(v) for inner in cell_nodes for v in inner.outputs})
    spec.free = list(spec.leaf.free) + [v for v in spec.internal.free if all(v is not f for f in spec.leaf.free)]
    node.inputs = node.inputs[: spec.nb] + spec.free

