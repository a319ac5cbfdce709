"""The recursive op: a leaf cell and an internal cell applied over a batch of
trees or DAGs (see generator/frontend/recursion.py for the DSL).

Reference: plain per-node recursion in topological order, one node at a time
(independent of the batched lowering it checks). Lowering (Cortex's): an
inspector numbers nodes by height (runtime/dg_tree.h), the leaf cell runs once
on all leaves, work of the internal cell that does not depend on children is
hoisted out of the level loop and done for all internal nodes at once, and the
loop runs the rest once per level: gather the children's states, then the
cell's statements. The states live in the caller's arrays in node order: a
cell's kernels write each row straight to its node's row (through the schedule's
order), so a state is written once. Buffers are sized for the largest level
before the loop: nothing is allocated inside it.
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.graph import Value
from ..ir.printing import format_node
from ..treebatch import check_batch, random_batch, sequence_schedule
from .recurse_lower import forward_loop
from .registry import OpDef, get_op, id_limit, register
from .scalar import ARGS


# How a recursion's cells are differentiated: the differentiator registers it
# (transforms/cell_grad.py, loaded with the generator.transforms package that runs
# the grad rules), so that ops import nothing above them.
_CELL_GRAD = []


def register_cell_grad(differentiate):
    """`differentiate(gb, spec, keep=, wanted=)` -> the cells' backward passes (a BackSpec)."""
    _CELL_GRAD[:] = [differentiate]
    return differentiate


def _run_cell(cell, env, dims):
    for node in cell.nodes:
        results = get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)
        for v, r in zip(node.outputs, results):
            env[id(v)] = r
    return [env[id(v)] for v in cell.outputs]


@register
class Recurse(OpDef):
    name = "recurse"
    cse = False  # two recursions are never the same node: each holds its own cells
    memory_note = ("recursive ops also use per-batch workspace sized by the tree schedule at run time "
                   "(the level buffers); it is not in the arena")

    def regions(self, node):
        spec = node.attrs["spec"]
        kept = {id(v) for v in spec.kept}
        return [(spec.leaf.nodes, {id(v) for v in spec.leaf.outputs}),
                (spec.internal.nodes, {id(v) for v in spec.internal.outputs} | kept)]

    def replace(self, node, old, new):
        spec = node.attrs["spec"]
        spec.free = [new if v is old else v for v in spec.free]
        for cell in (spec.leaf, spec.internal):
            for inner in cell.nodes:
                inner.inputs = [new if v is old else v for v in inner.inputs]
            cell.outputs = [new if v is old else v for v in cell.outputs]
            cell.free = [new if v is old else v for v in cell.free]
        spec.kept = [new if v is old else v for v in spec.kept]

    def id_limit(self, node, value):
        """Word ids must index every table the cells gather from by their words."""
        if node.attrs["spec"].sequences or node.inputs[1] is not value:
            return None
        spec = node.attrs["spec"]
        limits = [get_op(m.op).id_limit(m, cell.words) for cell in (spec.leaf, spec.internal) for m in cell.nodes]
        limits = [x for x in limits if x is not None]
        return min(limits) if limits else None

    def sample_inputs(self, node, rng, dims, graph):
        """A random batch of trees (its sizes then fix the node and tree counts), or
        random lengths of the padded sequences."""
        spec = node.attrs["spec"]
        if spec.sequences:
            lengths = node.inputs[0]
            if lengths.producer is not None:  # made by the model (a while loop's): not an input
                return {}
            count = lengths.shape[0] if isinstance(lengths.shape[0], int) else dims.get(lengths.shape[0], 2)
            steps = int(sympy.sympify(spec.steps).subs(dims))
            return {lengths.name: rng.integers(1, steps + 1, count).astype(np.int64)}
        roots = node.inputs[2].shape[0]
        count = roots if isinstance(roots, int) else dims.get(roots, 2)
        batch = random_batch(rng, count, spec.arity, id_limit(graph, node.inputs[1]), dag=spec.dag)
        return {v.name: batch[key] for v, key in zip(node.inputs[:3], ("children", "words", "roots"))}

    def helpers(self, node):
        spec = node.attrs["spec"]
        if spec.sequences:
            return []
        return [{"arity": spec.arity, "children": node.inputs[0].name, "words": node.inputs[1].name,
                 "roots": node.inputs[2].name, "function": f"{spec.batch}_from_nested"}]

    def infer(self, inputs, attrs):
        spec = attrs["spec"]
        ranks = (1,) if spec.sequences else (2, 1, 1)
        for v, rank in zip(inputs, ranks):
            if v.dtype != "int64" or v.rank != rank:
                raise ValueError(f"'{v.name}' must be int64 of rank {rank}, got {v.type_str()}")
        nodes = batch_nodes(spec, inputs)
        return ([("float32", (nodes,) + tuple(shape)) for _, shape in spec.state]
                + [("float32", (nodes,) + tuple(v.shape[1:])) for v in spec.kept])

    def reference(self, args, attrs, dims):
        spec = attrs["spec"]
        children, words, order, row = reference_schedule(spec, args, dims)
        free = {id(v): a for v, a in zip(spec.free, args[spec.nb:])}
        nodes = children.shape[0]
        dtype = np.result_type(*[a for a in args[spec.nb:] if a.dtype.kind == "f"] or [np.float32])
        states = [np.zeros((nodes,) + tuple(int(sympy.sympify(d).subs(dims)) for d in shape), dtype=dtype)
                  for _, shape in spec.state]
        kept = [np.zeros((nodes,) + tuple(int(sympy.sympify(d).subs(dims)) for d in v.shape[1:]), dtype=dtype)
                for v in spec.kept]
        one = {**dims, spec.rows: 1}
        for n in order:  # children before parents
            kids = [int(c) for c in children[n]]
            if all(c == -1 for c in kids):
                env = dict(free)
                env[id(spec.leaf.words)] = words[n : n + 1]
                out = _run_cell(spec.leaf, env, one)
            else:
                env = dict(free)
                env[id(spec.internal.words)] = words[n : n + 1]
                for slot, c in zip(spec.internal.children, kids):
                    for j, v in enumerate(slot):
                        env[id(v)] = states[j][c : c + 1] if c != -1 else np.zeros_like(states[j][:1])
                out = _run_cell(spec.internal, env, one)
                for j, v in enumerate(spec.kept):
                    kept[j][row[n]] = env[id(v)][0]
            for j, value in enumerate(out):
                states[j][n] = value[0]
        return states + kept

    def grad(self, node, gouts, gb):
        """One recurse_grad node (ops/recurse_grad.py) computes each free float
        value's gradient, a piece per cell that reads it; pieces are added here."""
        spec = node.attrs["spec"]
        ns = len(spec.state)
        if not _CELL_GRAD:
            raise RuntimeError("no differentiator of recursive cells is registered (import generator.transforms)")
        back = _CELL_GRAD[0](gb, spec, keep=not spec.kept, wanted=gb.reaches)
        pieces = [(which, i) for which, cell in enumerate(back.cells) for i in sorted(cell.d_free)]
        grads = [None] * len(node.inputs)
        if not pieces:
            return grads
        # The forward loop keeps what the gradient's loop reads instead of making it
        # again (its level GEMMs' results): outputs of this node from now on.
        if not spec.kept:
            spec.kept = [v for _, v in back.internal.loaded]
            nodes = batch_nodes(spec, node.inputs)
            for v in spec.kept:
                node.outputs.append(Value(gb.graph.names.unique(f"{v.name}_kept"), "float32",
                                          (nodes,) + tuple(v.shape[1:]), producer=node, loc=node.loc))
        states, kept = node.outputs[:ns], node.outputs[ns:]
        gouts = [g if g is not None else gb.fill(v.shape, 0.0) for g, v in zip(gouts[:ns], states)]
        hints = [f"d_{spec.free[i].name}_{'leaf' if which == 0 else 'node'}" for which, i in pieces]
        outs = gb.op("recurse_grad", list(node.inputs[:spec.nb]) + list(spec.free) + list(states) + gouts + list(kept),
                     {"spec": spec, "back": back, "pieces": pieces}, hints)
        for (which, i), g in zip(pieces, outs):
            slot = next((spec.nb + k for k, v in enumerate(node.inputs[spec.nb:]) if v is spec.free[i]), None)
            if slot is None:
                continue
            if grads[slot] is None:
                grads[slot] = g
            else:
                grads[slot] = gb.ewise("add", ARGS[0] + ARGS[1], [grads[slot], g], g.shape, f"d_{spec.free[i].name}")
        return grads

    def describe(self, node):
        spec = node.attrs["spec"]
        if spec.sequences:
            kind = f"sequences of {spec.steps} steps{', reversed' if spec.reverse else ''}"
        else:
            kind = f"{'dag' if spec.dag else 'trees'}, arity {spec.arity}"
        lines = [f"recurse[{kind}]({', '.join(v.name for v in node.inputs[:spec.nb])})"]
        for title, cell in (("leaf", spec.leaf), ("internal", spec.internal)):
            args = [cell.words.name] + [v.name for slot in cell.children for v in slot]
            lines.append(f"    {title}({', '.join(args)}):")
            lines += [f"      {format_node(n)}" for n in cell.nodes]
            lines.append(f"      -> {', '.join(v.name for v in cell.outputs)}")
        return "\n".join(lines)

    def lower(self, node, ctx):
        """Cortex's executor as structured lines: ops/recurse_lower.py."""
        return forward_loop(node, ctx)


def batch_nodes(spec, inputs):
    """The node count of the op's batch: the trees' nodes, or count * steps."""
    if spec.sequences:
        return sympy.sympify(inputs[0].shape[0]) * sympy.sympify(spec.steps)
    return inputs[0].shape[0]


def reference_schedule(spec, args, dims):
    """What the references walk: (children [nodes, arity], words [nodes], the
    nodes in schedule order (children first), each node's schedule row (-1 for a
    padded step: no node))."""
    if spec.sequences:
        lengths = args[0]
        steps = int(sympy.sympify(spec.steps).subs(dims))
        children, order, row = sequence_schedule(lengths, steps, spec.reverse, "recurse")
        return children, np.arange(len(children), dtype=np.int64), order, row
    children, words, roots = args[:3]
    height, order = check_batch(children, roots, spec.dag, "recurse")
    return children, words, order, schedule_rows(height)


def schedule_rows(height):
    """Each node's row in the generated code's schedule: nodes sorted by height,
    ties in node order (dg_schedule.h's counting sort)."""
    row = np.empty(len(height), np.int64)
    row[np.argsort(height, kind="stable")] = np.arange(len(height))
    return row
