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
result's rows written back to their examples' rows. No gradient yet (masking, the
default, trains).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import sympy

from ..codegen.stmt import Block, Comment, Declare, Named
from ..errors import ModelError
from ..ir.printing import format_node
from ..ir.shapes import numel
from .recurse_scope import LoopState
from .registry import OpDef, get_op, register


@dataclass(eq=False)
class Branch:
    side: str  # "then" or "else"
    rows: sympy.Symbol  # the count of examples that take it (a C++ variable of its block)
    operands: list  # placeholders [rows, ...], one per operand
    nodes: list
    outputs: list


@dataclass(eq=False)
class CondSpec:
    branches: tuple  # (then, else)
    count: int  # operands
    free: list = field(default_factory=list)


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
        raise ModelError("a compacted dg.cond does not train yet: pass compact=False (masking: its gradient is "
                         "each branch's on its own examples)", node.loc, "cond")

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
        words = "then" if branch.side == "then" else "else"
        lines.append(Block(gathers + body + backs, comment=f"The examples that take the {words}-branch: one batched "
                                                                f"block of their rows ({branch.rows} of them, maybe none)."))
    return Block(lines, touches=writes)
