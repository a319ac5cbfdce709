"""`dg.cond` compacted (`cond(..., compact=True)`): each branch runs as one batched
block over the examples that take it, listed by index.

Inputs: pred (bool [N]), the operands ([N, ...] each), the values the branches read
from outside (`spec.free`: parameters and the like). Outputs: the results, [N, ...].
Each branch is a cell traced once over placeholders of `rows` rows (a symbol of its
own, like a recursive cell's): `spec.branches[0]` for the examples whose pred holds,
`spec.branches[1]` for the others.

Reference: per branch, the operands' rows of its examples, the branch's nodes on them,
the results put back at those rows. Lowering: `dg::branch_examples` lists each
branch's examples (one pass over the N flags); per branch with examples, the operands'
rows gathered into a compact block, the branch's statements over its rows, each
result's rows written back to their examples' rows. The gradient: `cond_grad` below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy

from ..codegen.stmt import Block, Comment, Copy, Declare, Named
from ..ir.graph import Value, needed_nodes
from ..ir.printing import format_node
from ..ir.shapes import numel
from .recurse_scope import LoopState, replace_in_cells
from .registry import OpDef, get_op, register
from .scalar import ARGS


@dataclass(eq=False)
class Branch:
    side: str  # "then" or "else"
    rows: sympy.Symbol  # the count of examples that take it (a C++ variable of its block)
    operands: list  # placeholders [rows, ...], one per operand
    nodes: list
    outputs: list
    said: str = ""  # cond(examples=...): how the generated comments call its examples, else ""


def _who(branch) -> str:
    """The generated comments' words for the examples that take `branch`."""
    if branch.said:
        return f"The examples {branch.said} (the {branch.side}-branch)"
    return f"The examples that take the {branch.side}-branch"


@dataclass(eq=False)
class CondSpec:
    branches: tuple  # (then, else)
    count: int  # operands
    free: list = field(default_factory=list)


# How a branch is differentiated: transforms/cell_grad.py registers its cell
# differentiator (ops import nothing above them), as for the recursive op.
_BRANCH_GRAD = []


def register_branch_grad(differentiate_cell):
    """`differentiate_cell(gb, spec, cell, wanted=)` -> the cell's backward pass (a BackCell)."""
    _BRANCH_GRAD[:] = [differentiate_cell]
    return differentiate_cell


@dataclass(eq=False)
class _CellView:
    """A branch as the cell differentiator reads a recursive cell: its operands are its one child slot."""

    words: Value
    children: list
    nodes: list
    outputs: list


@dataclass(eq=False)
class _SpecView:
    state: list
    free: list
    prefixes: tuple


def _run(nodes, env, dims):
    for node in nodes:
        for v, r in zip(node.outputs, get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)):
            env[id(v)] = r


@register
class Cond(OpDef):
    name = "cond"
    cse = False  # each holds its own branches

    def regions(self, node):
        return [(b.nodes, {id(v) for v in b.outputs}) for b in node.attrs["spec"].branches]

    def replace(self, node, old, new):
        spec = node.attrs["spec"]
        spec.free = [new if v is old else v for v in spec.free]
        for b in spec.branches:
            for inner in b.nodes:
                inner.inputs = [new if v is old else v for v in inner.inputs]
            b.outputs = [new if v is old else v for v in b.outputs]

    def infer(self, inputs, attrs):
        spec = attrs["spec"]
        pred = inputs[0]
        if pred.dtype != "bool" or pred.rank != 1:
            raise ValueError(f"pred '{pred.name}' must be bool [N], got {pred.type_str()}")
        return [("float32", (pred.shape[0],) + tuple(v.shape[1:])) for v in spec.branches[0].outputs]

    def reference(self, args, attrs, dims):
        spec = attrs["spec"]
        pred = np.asarray(args[0]).astype(bool)
        operands, free = args[1:1 + spec.count], args[1 + spec.count:]
        floats = [a for a in args[1:] if a.dtype.kind == "f"]
        dtype = np.result_type(*floats) if floats else np.float32
        outs = [np.zeros((pred.shape[0],) + tuple(int(sympy.sympify(d).subs(dims)) for d in v.shape[1:]), dtype=dtype)
                for v in spec.branches[0].outputs]
        for branch, side in zip(spec.branches, (True, False)):
            rows = np.flatnonzero(pred == side)
            if rows.size == 0:
                continue
            env = {id(v): a for v, a in zip(spec.free, free)}
            env.update({id(p): a[rows] for p, a in zip(branch.operands, operands)})
            _run(branch.nodes, env, {**dims, branch.rows: int(rows.size)})
            for out, v in zip(outs, branch.outputs):
                out[rows] = env[id(v)]
        return outs

    def grad(self, node, gouts, gb):
        """One cond_grad node: per branch, its rows made again from the gathered operands
        and its backward pass on them; the operands' gradient rows written back by the
        lists, the parameters' gradient a piece per branch, added here."""
        spec = node.attrs["spec"]
        if not _BRANCH_GRAD:
            raise RuntimeError("no differentiator of cells is registered (import generator.transforms)")
        operands = node.inputs[1:1 + spec.count]
        wanted = gb.reaches
        backs = []
        for b in spec.branches:
            words = Value(gb.graph.names.unique(f"{b.side}_examples_ids"), "int64", (b.rows,), kind="cell", explicit=True)
            view = _CellView(words, [list(b.operands)], b.nodes, b.outputs)
            back = _BRANCH_GRAD[0](gb, _SpecView([(v.name, tuple(v.shape[1:])) for v in b.outputs], spec.free,
                                                 (f"{b.side}_", f"{b.side}_")), view, wanted=wanted)
            back.d_children = [[d if d is not None and (wanted is None or id(x) in wanted) else None
                                for d, x in zip(back.d_children[0], operands)]]
            back.nodes = needed_nodes(back.nodes, {id(v) for v in back.results()})
            backs.append(back)
        d_ops = [j for j in range(spec.count) if any(back.d_children[0][j] is not None for back in backs)]
        pieces = [(which, i) for which, back in enumerate(backs) for i in sorted(back.d_free)]
        grads = [None] * len(node.inputs)
        if not d_ops and not pieces:
            return grads
        gouts = [g if g is not None else gb.fill(v.shape, 0.0) for g, v in zip(gouts, node.outputs)]
        hints = ([f"d_{operands[j].name}" for j in d_ops]
                 + [f"d_{spec.free[i].name}_{spec.branches[which].side}" for which, i in pieces])
        outs = gb.op("cond_grad", [node.inputs[0], *operands, *spec.free, *gouts],
                     {"spec": spec, "backs": backs, "pieces": pieces, "d_ops": d_ops}, hints)
        for j, g in zip(d_ops, outs):
            grads[1 + j] = g
        for (which, i), g in zip(pieces, outs[len(d_ops):]):
            slot = 1 + spec.count + i
            grads[slot] = g if grads[slot] is None else gb.ewise("add", ARGS[0] + ARGS[1], [grads[slot], g], g.shape,
                                                                 f"d_{spec.free[i].name}")
        return grads

    def describe(self, node):
        spec = node.attrs["spec"]
        lines = [f"cond[compacted]({', '.join(v.name for v in node.inputs[:1 + spec.count])})"]
        for b in spec.branches:
            lines.append(f"    {b.side}({', '.join(v.name for v in b.operands)}) over {b.rows} rows:")
            lines += [f"      {format_node(n)}" for n in b.nodes]
            lines.append(f"      -> {', '.join(v.name for v in b.outputs)}")
        return "\n".join(lines)

    def lower(self, node, ctx):
        with ctx.lowering_loop(LoopState()):
            return [_lower(node, ctx)]


def _lower(node, ctx):
    spec = node.attrs["spec"]
    pred, operands = node.inputs[0], node.inputs[1:1 + spec.count]
    scratch = ctx.target.scratch_type
    batch = ctx.size(pred.shape[0])
    then, other = spec.branches
    lists = {b.side: f"{b.side}_examples" for b in spec.branches}
    writes = [ctx.write(v) for v in node.outputs]
    if then.said:
        lines = [Comment(f"dg.cond, compacted: the examples {then.said}, and those {other.said}, listed by index;"),
                 Comment("each branch is one batched block over its examples' rows.")]
    else:
        lines = [Comment("dg.cond, compacted: the examples that take the then-branch, and those that take the else-branch,"),
                 Comment("listed by index; each branch is one batched block over its examples' rows.")]
    lines += [Declare(f"{scratch}<std::int64_t>", name, [batch]) for name in lists.values()]
    lines.append(Declare("const std::int64_t", str(then.rows), init=ctx.call(
        "dg::branch_examples", ctx.read(pred), Named("n", batch), f"{lists['then']}.data()", f"{lists['else']}.data()")))
    lines.append(Declare("const std::int64_t", str(other.rows), init=f"{batch} - {then.rows}"))
    for branch in spec.branches:
        listed = f"{lists[branch.side]}.data()"
        decls, places = [], {}
        for p, x in zip(branch.operands, operands):
            decls.append(Declare(f"{scratch}<float>", p.name,
                                 [f"{batch} * {ctx.size(numel(x.shape[1:]))}"]))
            places[p] = f"{p.name}.data()"
        with ctx.placed(places):
            inner_decls, body = ctx.lower_nodes(branch.nodes, {branch.rows: pred.shape[0]})
            gathers = [ctx.call("dg::sort_rows", ctx.read(x), listed, Named("rows", str(branch.rows)),
                                Named("width", ctx.size(numel(x.shape[1:]))), places[p])
                       for p, x in zip(branch.operands, operands)]
            backs = [ctx.call("dg::unsort_rows", ctx.read(v), listed, Named("rows", str(branch.rows)),
                              Named("width", ctx.size(numel(v.shape[1:]))), w.expr)
                     for v, w in zip(branch.outputs, writes)]
        lines += decls + inner_decls
        lines.append(Block(gathers + body + backs, comment=f"{_who(branch)}: one batched block of their rows "
                                                                f"({branch.rows} of them, maybe none)."))
    return Block(lines, touches=writes)


@register
class CondGrad(OpDef):
    """The gradient of a compacted cond. Inputs: pred, the operands, spec.free, the
    results' gradients. Outputs: the gradients of the operands in `d_ops` ([N, ...]),
    then one piece per (branch, free float value) in `pieces`."""

    name = "cond_grad"
    cse = False
    multi_output = True

    def regions(self, node):
        return [(back.nodes, {id(v) for v in back.results()}) for back in node.attrs["backs"]]

    def replace(self, node, old, new):
        replace_in_cells(node.attrs["spec"], node.attrs["backs"], old, new)

    def infer(self, inputs, attrs):
        spec = attrs["spec"]
        operands = inputs[1:1 + spec.count]
        return ([("float32", tuple(operands[j].shape)) for j in attrs["d_ops"]]
                + [("float32", tuple(spec.free[i].shape)) for _, i in attrs["pieces"]])

    def reference(self, args, attrs, dims):
        spec, backs = attrs["spec"], attrs["backs"]
        pred = np.asarray(args[0]).astype(bool)
        operands = args[1:1 + spec.count]
        free = args[1 + spec.count:1 + spec.count + len(spec.free)]
        gouts = args[1 + spec.count + len(spec.free):]
        floats = [a for a in args[1:] if a.dtype.kind == "f"]
        dtype = np.result_type(*floats) if floats else np.float32
        d_ops = {j: np.zeros(operands[j].shape, dtype=dtype) for j in attrs["d_ops"]}
        pieces = {key: np.zeros(free[key[1]].shape, dtype=dtype) for key in attrs["pieces"]}
        for which, (branch, back, side) in enumerate(zip(spec.branches, backs, (True, False))):
            rows = np.flatnonzero(pred == side)
            if rows.size == 0:
                continue
            env = {id(v): a for v, a in zip(spec.free, free)}
            env.update({id(p): a[rows] for p, a in zip(back.children[0], operands)})
            env.update({id(d): g[rows] for d, g in zip(back.d_out, gouts)})
            _run(back.nodes, env, {**dims, branch.rows: int(rows.size)})
            for j in d_ops:
                d = back.d_children[0][j]
                if d is not None:
                    d_ops[j][rows] = env[id(d)]
            for i, v in back.d_free.items():
                if (which, i) in pieces:
                    pieces[(which, i)] = np.asarray(env[id(v)], dtype=dtype)
        return [d_ops[j] for j in attrs["d_ops"]] + [pieces[key] for key in attrs["pieces"]]

    def describe(self, node):
        spec = node.attrs["spec"]
        lines = [f"cond_grad[compacted]({', '.join(v.name for v in node.inputs)})"]
        for b, back in zip(spec.branches, node.attrs["backs"]):
            lines.append(f"    {b.side} backward over {b.rows} rows:")
            lines += [f"      {format_node(n)}" for n in back.nodes]
        return "\n".join(lines)

    def lower(self, node, ctx):
        with ctx.lowering_loop(LoopState()):
            return [_lower_grad(node, ctx)]


def _lower_grad(node, ctx):
    spec, backs, d_ops, pieces = node.attrs["spec"], node.attrs["backs"], node.attrs["d_ops"], node.attrs["pieces"]
    pred, operands = node.inputs[0], node.inputs[1:1 + spec.count]
    gouts = node.inputs[1 + spec.count + len(spec.free):]
    scratch = ctx.target.scratch_type
    batch = ctx.size(pred.shape[0])
    lists = {b.side: f"{b.side}_examples" for b in spec.branches}
    writes = [ctx.write(v) for v in node.outputs]
    d_writes = dict(zip(d_ops, writes))
    piece_writes = dict(zip(pieces, writes[len(d_ops):]))
    lines = [Comment("The gradient of dg.cond, compacted: the examples that take each branch listed again; per"),
             Comment("branch, its rows made again from their operands and its backward pass on that block.")]
    lines += [Declare(f"{scratch}<std::int64_t>", name, [batch]) for name in lists.values()]
    then, other = spec.branches
    lines.append(Declare("const std::int64_t", str(then.rows), init=ctx.call(
        "dg::branch_examples", ctx.read(pred), Named("n", batch), f"{lists['then']}.data()", f"{lists['else']}.data()")))
    lines.append(Declare("const std::int64_t", str(other.rows), init=f"{batch} - {then.rows}"))
    for j in d_ops:  # rows of a branch whose result does not depend on operand j: zero
        if any(back.d_children[0][j] is None for back in backs):
            lines.append(ctx.call("dg::fill", d_writes[j], Named("n", ctx.size(numel(operands[j].shape))),
                                  Named("value", "0.0f")))
    for which, (branch, back) in enumerate(zip(spec.branches, backs)):
        listed, rows = f"{lists[branch.side]}.data()", str(branch.rows)
        # What the block reads: its statements' inputs, and the gradients it writes back as they
        # come (a branch that returns an operand as it is passes that result's gradient on).
        reads = {id(v) for n in back.nodes for v in n.inputs}
        reads |= {id(d) for d in back.d_children[0] if d is not None} | {id(v) for v in back.d_free.values()}
        decls, places, gathers = [], {}, []
        for p, x in [(p, x) for p, x in zip(back.children[0], operands)] + list(zip(back.d_out, gouts)):
            if id(p) not in reads:
                continue
            width = ctx.size(numel(x.shape[1:]))
            decls.append(Declare(f"{scratch}<float>", p.name, [f"{batch} * {width}"]))
            places[p] = f"{p.name}.data()"
        with ctx.placed(places):
            gathers = [ctx.call("dg::sort_rows", ctx.read(x), listed, Named("rows", rows),
                                Named("width", ctx.size(numel(x.shape[1:]))), places[p])
                       for p, x in list(zip(back.children[0], operands)) + list(zip(back.d_out, gouts)) if p in places]
            inner_decls, body = ctx.lower_nodes(back.nodes, {branch.rows: pred.shape[0]})
            backs_out = [ctx.call("dg::unsort_rows", ctx.read(back.d_children[0][j]), listed, Named("rows", rows),
                                  Named("width", ctx.size(numel(operands[j].shape[1:]))), d_writes[j].expr)
                         for j in d_ops if back.d_children[0][j] is not None]
            copies = [Copy(ctx.target.copy_fn, ctx.read(v), ctx.size(numel(v.shape)), piece_writes[(which, i)].expr)
                      for i, v in back.d_free.items() if (which, i) in piece_writes]
        lines += decls + inner_decls
        lines.append(Block(gathers + body + backs_out + copies,
                           comment=f"{_who(branch)}, backward: one batched block of their rows ({rows} of them, "
                                   "maybe none)."))
    return Block(lines, touches=writes)
