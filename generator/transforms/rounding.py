"""bf16 rounding of every product's operands (transforms/precision.py says what bf16
means; autodiff.prepare_training applies it to a training step of dg.train(...,
precision="bf16"), forward and backward products alike)."""

from __future__ import annotations

from ..errors import DeepgenError
from ..ir.graph import Node, Value, outer_reads
from ..ops import get_op


def _rounding(graph, v, node, nodes) -> Value:
    """A round_bf16 node of `v`, appended to `nodes` (before `node`, which reads it)."""
    out = Value(graph.names.unique(f"{v.name}_bf16"), "float32", tuple(v.shape), loc=node.loc)
    rounding = Node("round_bf16", [v], {}, outputs=[out], loc=node.loc, phase=node.phase)
    out.producer = rounding
    nodes.append(rounding)
    return out


def round_products(graph):
    """Every product's operands (OpDef.products) rounded to bfloat16 by a round_bf16 node
    before it, in the graph and in its recursions' cells; the graph's precision is bf16."""
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
    graph.precision = "bf16"


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



def rounded_reads(graph):
    """bf16 inference: a `round_bf16` of an activation whose every reader rounds it
    as it reads it (OpDef.rounds_on_read: a convolution or matmul by a kept bf16
    weight, whose kernel converts the activation as it packs it) is dropped, and each
    reader reads the unrounded value with the operand's index in its attr `rounded`
    (the reference rounds it there; a lowering that calls another kernel rounds it
    first, ops/precision.py read_rounded): the same values, one pass over the
    activation fewer (ResNet-18's rounding calls were 5-6% of its bf16 forward). Weights keep their
    rounding (their kept packing applies it once per change), graph outputs and
    values a recursion or a training step reads keep theirs."""
    if graph.precision != "bf16" or graph.train is not None:
        return graph
    readers = {}
    for node in graph.nodes:
        for v in node.inputs:
            readers.setdefault(id(v), []).append(node)
    outputs = {id(v) for _, v in graph.outputs}
    for node in graph.nodes:
        if node.op != "round_bf16" or getattr(node.inputs[0], "kind", None) == "param":
            continue
        out = node.outputs[0]
        users = readers.get(id(out), [])
        if not users or id(out) in outputs:
            continue
        if not all(i in get_op(u.op).rounds_on_read(u) for u in users for i, v in enumerate(u.inputs) if v is out):
            continue
        for u in users:
            at = tuple(i for i, v in enumerate(u.inputs) if v is out)
            u.inputs = [node.inputs[0] if v is out else v for v in u.inputs]
            u.attrs = {**u.attrs, "rounded": tuple(sorted(set(u.attrs.get("rounded", ())) | set(at)))}
    return graph
