"""The gradient of a recursive op's cells (backpropagation through structure).

Each cell is differentiated on its own, like a small graph: its forward nodes
are copied over placeholders of their own (the copies are what the backward
pass makes again: only the node states are kept between the passes), then
`autodiff.backprop` builds the backward nodes from one placeholder per state
component, `d_out` (the gradient arriving at the block's rows). What comes out:
the gradient of each child's state (added into the child's rows, level by level)
and, for every float value the cell reads from outside (parameters), the
gradient summed over the block's rows. ops/recurse_grad.py runs the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir.graph import Node, Value, needed_nodes
from ..ir.names import NameTable, safe_identifier
from ..ops import ARGS
from ..ops.cond import register_branch_grad
from ..ops.recurse import register_cell_grad
from ..ops.recurse_scope import cell_values
from .autodiff import GradBuilder, backprop, reaching


@dataclass(eq=False)
class BackCell:
    """A cell's backward pass: forward copies (phase "forward", attr recomputed),
    then backward nodes, over the placeholders below."""

    words: Value
    children: list  # [[Value per state component] per child slot]: the children's states
    d_out: list  # [Value per state component]: the gradient at the block's rows
    nodes: list
    d_children: list  # [[Value or None]] like children
    d_free: dict = field(default_factory=dict)  # index into spec.free -> gradient summed over the rows
    loaded: list = field(default_factory=list)  # [(placeholder, forward cell value)]: kept by the forward loop

    def results(self) -> list:
        """The values the block must keep: the children's and the free values' gradients."""
        out = [v for slot in self.d_children for v in slot if v is not None]
        return out + list(self.d_free.values())


@dataclass(eq=False)
class BackSpec:
    leaf: BackCell
    internal: BackCell
    numbered: dict = field(default_factory=dict)  # a name the cells' naming numbered -> the name it asked for

    @property
    def cells(self):
        return (self.leaf, self.internal)


class _ScopeNames(NameTable):
    """The names of the gradient loop's scope: taken from the graph's, less the
    forward cells' (free again there); remembers each name it had to number."""

    def __init__(self, graph_names, forward: set):
        super().__init__()
        self.used = set(graph_names.used) - forward
        self.numbered = {}

    def unique(self, base: str) -> str:
        name = super().unique(base)
        if name != safe_identifier(base):
            self.numbered[name] = safe_identifier(base)
        return name


def _placeholder(names, base, like):
    return Value(names.unique(base), like.dtype, tuple(like.shape), kind="cell", explicit=True)


def kept_candidates(cell, rows) -> list:
    """The values of the internal cell the forward level loop keeps for the backward
    one instead of having them made again: each child-dependent product's result
    (the level's GEMM), or the elementwise node that is its only reader (the bias add
    an epilogue fuses into it). The rest of the cell is cheap to make again."""
    tainted = {id(v) for slot in cell.children for v in slot}
    for node in cell.nodes:
        if any(id(v) in tainted for v in node.inputs):
            tainted.update(id(v) for v in node.outputs)
    out = []
    for node in cell.nodes:
        if node.op != "matmul" or len(node.outputs) != 1 or id(node.outputs[0]) not in tainted:
            continue
        v = node.outputs[0]
        readers = [n for n in cell.nodes if any(x is v for x in n.inputs)]
        if (len(readers) == 1 and readers[0].op == "ewise" and len(readers[0].outputs) == 1
                and tuple(readers[0].outputs[0].shape) == tuple(v.shape)):
            v = readers[0].outputs[0]
        # one row per node (a product over [2 * rows, ...] rows is made again instead)
        row_wise = v.rank and not isinstance(v.shape[0], int) and v.shape[0] == rows
        if v.dtype == "float32" and row_wise and all(v is not k for k in out):
            out.append(v)
    return out


def differentiate_cell(gb: GradBuilder, spec, cell, keep=(), wanted=None) -> BackCell:
    """`cell`'s backward pass as a BackCell (see the module docstring). Values in
    `keep` (forward cell values) are read where the forward loop kept them instead
    of being made again: they become placeholders (BackCell.loaded). Only free
    values in `wanted` (ids; None: all) get a gradient: not a graph input such as
    a scan's x, whose gradient nothing reads."""
    names = gb.graph.names
    copy = {id(cell.words): _placeholder(names, cell.words.name, cell.words)}
    children = [[_placeholder(names, v.name, v) for v in slot] for slot in cell.children]
    for slot, new in zip(cell.children, children):
        copy.update({id(v): n for v, n in zip(slot, new)})
    nodes = []
    for node in cell.nodes:
        new = Node(node.op, [copy.get(id(v), v) for v in node.inputs], {**node.attrs, "recomputed": True},
                   loc=node.loc, phase="forward")
        for v in node.outputs:
            out = Value(names.unique(v.name), v.dtype, v.shape, producer=new, loc=v.loc, explicit=True)
            new.outputs.append(out)
            copy[id(v)] = out
        nodes.append(new)
    outputs = [copy.get(id(v), v) for v in cell.outputs]
    d_out = [Value(names.unique(f"d_{name}_rows"), "float32", v.shape, kind="cell", explicit=True)
             for (name, _), v in zip(spec.state, outputs)]
    floats = [v for v in spec.free if v.dtype == "float32" and (wanted is None or id(v) in wanted)]
    wrt = [v for slot in children for v in slot] + floats
    grads = {}
    start = len(gb.nodes)
    for v, d in zip(outputs, d_out):
        if id(v) in grads:  # the same value returned as two components
            grads[id(v)] = gb.ewise("add", ARGS[0] + ARGS[1], [grads[id(v)], d], v.shape, f"d_{v.name}")
        else:
            grads[id(v)] = d
    backprop(gb, nodes, grads, reaching(nodes, wrt))
    d_children = [[grads.get(id(v)) for v in slot] for slot in children]
    d_free = {i: grads[id(v)] for i, v in enumerate(spec.free) if v.dtype == "float32" and id(v) in grads}
    prefix = spec.prefixes[1] if cell.children else spec.prefixes[0]
    for i, v in d_free.items():  # d_u names the parameter's whole gradient (a Model member): node_d_u a piece
        if v.producer is not None and v.producer in gb.nodes[start:]:
            v.name = names.unique(f"{prefix}d_{spec.free[i].name}")
    made = gb.nodes[start:]
    del gb.nodes[start:]  # the backward nodes live in the cell, not in the graph
    back = BackCell(copy[id(cell.words)], children, d_out, [], d_children, d_free)
    backward = needed_nodes(made, {id(v) for v in back.results()})
    load = {id(copy[id(v)]): (_placeholder(names, f"{v.name}_kept", v), v) for v in keep if id(v) in copy}
    for node in nodes + backward:  # read what the forward loop kept
        node.inputs = [load[id(x)][0] if id(x) in load else x for x in node.inputs]
    forward = needed_nodes(nodes, {id(v) for n in backward for v in n.inputs} | {id(v) for v in back.results()})
    back.nodes = forward + backward
    read = {id(x) for n in back.nodes for x in n.inputs}
    back.loaded = [pair for pair in load.values() if id(pair[0]) in read]
    return back


register_branch_grad(differentiate_cell)  # a compacted dg.cond's branches (ops/cond.py)


@register_cell_grad
def differentiate_recursion(gb: GradBuilder, spec, keep: bool = True, wanted=None) -> BackSpec:
    """Both cells of a recursive op, differentiated; with `keep`, the internal
    cell reads its products' results where the forward loop kept them."""
    # The backward cells live in the gradient loop's C++ scope, where the forward
    # cells' names are free again: a cell made again keeps its names (node_c, not
    # node_c_1). Names of the graph's own values stay taken.
    # A name numbered here (the sum d_node_c_1 beside its part d_node_c) takes the
    # name it asked for when lowered, if that is free by then (the fusion pass
    # merged the part away): LoopScope.

    graph_names = gb.graph.names
    gb.graph.names = _ScopeNames(graph_names, {v.name for cell in (spec.leaf, spec.internal) for v in cell_values(cell)})
    try:
        internal = differentiate_cell(gb, spec, spec.internal,
                                      kept_candidates(spec.internal, spec.rows) if keep else (), wanted)
        return BackSpec(differentiate_cell(gb, spec, spec.leaf, wanted=wanted), internal, gb.graph.names.numbered)
    finally:
        gb.graph.names = graph_names
