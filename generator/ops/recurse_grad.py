"""The gradient of the recursive op: backpropagation through structure, as
batched loops (the cells' backward passes: transforms/cell_grad.py).

Inputs: the batch (children, words, roots of trees; lengths of sequences), the values the cells read from
outside (`spec.free`), the forward states of every node and their gradients.
Outputs: one gradient piece per (cell, float free value) the cell reads; the
grad rule of `recurse` adds a value's pieces.

Reference: per node, parents before children, each node's cell made again and
differentiated at one row; a child's state gradient is the sum over its parents.

Lowering: the inspector again; states and their gradients in schedule order;
then levels from the roots down, each one batched step: gather the children's
states, make the looped part of the cell again, run the part of its backward
pass that the children's gradients need, add those into the children's rows
(in a DAG a shared child sums every parent's). A level's gradient rows are
complete before it runs, since every parent sits on a higher level. What the
loop does not need (the parameters' gradients: sums over rows) runs once after
it over all internal rows, reading the row values the loop kept for it; then
the leaf cell's gradient, all leaves at once.
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.shapes import numel
from .recurse import _pack_loop_weights, batch_nodes, has_rows, hoistable, inspector_lines, reference_schedule
from .registry import OpDef, get_op, register


def _run(nodes, env, dims):
    for node in nodes:
        results = get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)
        for v, r in zip(node.outputs, results):
            env[id(v)] = r


def per_row(v, rows):
    """The floats of v per row of its block (v is [rows, ...] or [k * rows, ...]), or
    None when v does not grow with the rows as a whole multiple."""
    w = sympy.expand(sympy.sympify(numel(v.shape)) / rows)
    return w if rows not in w.free_symbols and sympy.fraction(sympy.together(w))[1].free_symbols == set() else None


def _split(node):
    """(free values, forward states, their gradients, values the forward loop kept)
    among the node's inputs."""
    spec = node.attrs["spec"]
    nf, ns = len(spec.free), len(spec.state)
    rest = node.inputs[spec.nb:]
    return rest[:nf], rest[nf : nf + ns], rest[nf + ns : nf + 2 * ns], rest[nf + 2 * ns :]


@register
class RecurseGrad(OpDef):
    name = "recurse_grad"
    cse = False
    multi_output = True

    def regions(self, node):
        back = node.attrs["back"]
        return [(cell.nodes, {id(v) for v in cell.results()}) for cell in back.cells]

    def replace(self, node, old, new):
        spec, back = node.attrs["spec"], node.attrs["back"]
        spec.free = [new if v is old else v for v in spec.free]
        for cell in back.cells:
            for inner in cell.nodes:
                inner.inputs = [new if v is old else v for v in inner.inputs]
            cell.d_children = [[new if v is old else v for v in slot] for slot in cell.d_children]
            cell.d_free = {i: new if v is old else v for i, v in cell.d_free.items()}

    def infer(self, inputs, attrs):
        spec = attrs["spec"]
        return [("float32", tuple(spec.free[i].shape)) for _, i in attrs["pieces"]]

    def reference(self, args, attrs, dims):
        spec, back = attrs["spec"], attrs["back"]
        nf, ns, nb = len(spec.free), len(spec.state), spec.nb
        free = args[nb : nb + nf]
        states = args[nb + nf : nb + nf + ns]
        dstates = [np.array(d, copy=True) for d in args[nb + nf + ns : nb + nf + 2 * ns]]
        kept = args[nb + nf + 2 * ns :]
        children, words, order, row = reference_schedule(spec, args, dims)
        totals = {piece: np.zeros(np.shape(free[piece[1]]), dstates[0].dtype) for piece in attrs["pieces"]}
        one = {**dims, spec.rows: 1}
        for n in reversed(order):  # parents before children
            kids = [int(c) for c in children[n]]
            which = 0 if all(c == -1 for c in kids) else 1
            cell = back.cells[which]
            env = {id(v): a for v, a in zip(spec.free, free)}
            env[id(cell.words)] = words[n : n + 1]
            for slot, c in zip(cell.children, kids):
                for j, v in enumerate(slot):
                    env[id(v)] = states[j][c : c + 1] if c != -1 else np.zeros_like(states[j][:1])
            for j, v in enumerate(cell.d_out):
                env[id(v)] = dstates[j][n : n + 1]
            for (v, _), values in zip(cell.loaded, kept):  # what the forward pass kept
                env[id(v)] = values[row[n] : row[n] + 1]
            _run(cell.nodes, env, one)
            for slot, c in zip(cell.d_children, kids):
                for j, d in enumerate(slot):
                    if d is not None and c != -1:
                        dstates[j][c] += env[id(d)][0]
            for i, d in cell.d_free.items():
                totals[(which, i)] += env[id(d)]
        return [totals[piece] for piece in attrs["pieces"]]

    def describe(self, node):
        from ..ir.printing import format_node

        back = node.attrs["back"]
        lines = [f"recurse_grad({', '.join(v.name for v in node.inputs)})"]
        for title, cell in (("leaf", back.leaf), ("internal", back.internal)):
            args = [cell.words.name] + [v.name for slot in cell.children for v in slot] + [v.name for v in cell.d_out]
            lines.append(f"    {title}({', '.join(args)}):")
            lines += [f"      {format_node(n)}" for n in cell.nodes]
            lines.append(f"      -> {', '.join(v.name for v in cell.results())}")
        return "\n".join(lines)

    def lower(self, node, ctx):
        return [_Lowering(node, ctx).loop()]


class _Lowering:
    """The reverse level loop of one recurse_grad node (see the module docstring)."""

    def __init__(self, node, ctx):
        self.node, self.ctx = node, ctx
        self.spec, self.back = node.attrs["spec"], node.attrs["back"]
        self.names = ctx.graph.names
        self.widths = [numel(shape) for _, shape in self.spec.state]

    def width(self, v) -> str:
        """Floats per row of the block: a value of [k * rows, ...] (a reshape) has k rows of its own per node."""
        return self.ctx.size(per_row(v, self.spec.rows))

    def loop(self):
        from ..codegen.plan import ReverseLevelLoop
        from ..codegen.stmt import Declare, Named

        ctx, spec, names = self.ctx, self.spec, self.names
        nodes = ctx.size(batch_nodes(spec, self.node.inputs))
        _, states, dstates, kept_inputs = _split(self.node)
        scratch = ctx.target.scratch_type
        sched, sorted_words, inspector = inspector_lines(ctx, self.node)
        # The forward states and the gradients arriving at them, in schedule order;
        # the gradient rows also collect what each node's parents send down.
        self.state_rows, self.grad_rows = [], []
        for (name, _), state, dstate, width in zip(spec.state, states, dstates, self.widths):
            s, d = names.unique(f"{name}_rows"), names.unique(f"d_{name}_rows")
            for var, value in ((s, state), (d, dstate)):
                inspector.append(Declare(f"{scratch}<float>", var, [f"{nodes} * {ctx.size(width)}"],
                                         note="in schedule order"))
                inspector.append(ctx.call("dg::sort_rows", ctx.read(value), f"{sched}.order.data()",
                                          Named("rows", f"{sched}.rows()"), Named("width", ctx.size(width)), f"{var}.data()"))
            self.state_rows.append(s)
            self.grad_rows.append(d)
        # Outputs: arena buffers the blocks write the parameters' gradients into.
        outputs = {piece: out for piece, out in zip(self.node.attrs["pieces"], self.node.outputs)}
        writes = {piece: ctx.write(out) for piece, out in outputs.items()}
        leaves, internal = names.unique("leaves"), names.unique("internal_rows")
        most, level, start = names.unique("max_rows"), names.unique("level"), names.unique("start")
        self.leaves, self.start = leaves, start
        cell = self.back.internal
        rows = spec.rows

        # Partition the internal cell: forward work that reads no child (hoisted,
        # once for all internal rows), forward work made again per level, the
        # backward work the children's gradients need (per level), and the rest
        # (after the loop, all internal rows at once).
        forward = [n for n in cell.nodes if n.phase != "backward"]
        backward = [n for n in cell.nodes if n.phase == "backward"]
        tainted = {id(v) for slot in cell.children for v in slot}
        for n in forward:
            if any(id(v) in tainted for v in n.inputs):
                tainted.update(id(v) for v in n.outputs)
        hoisted_nodes = hoistable(forward, tainted, rows)
        looped_forward = [n for n in forward if n not in hoisted_nodes]
        from ..transforms.autodiff import needed_nodes

        sends = [v for slot in cell.d_children for v in slot if v is not None]
        looped_backward = [n for n in needed_nodes(backward, {id(v) for v in sends})]
        after_nodes = [n for n in backward if n not in looped_backward]
        made_in_loop = {id(v) for n in looped_forward + looped_backward for v in n.outputs}
        read_after = {id(v): v for n in after_nodes for v in n.inputs}
        for piece, v in cell.d_free.items():
            read_after.setdefault(id(v), v)
        kept = [v for key, v in read_after.items() if key in made_in_loop]
        for v in kept:
            if per_row(v, rows) is None:
                from ..errors import ModelError

                raise ModelError(f"cannot differentiate the cell: '{v.name}' {v.type_str()} is not row by row "
                                 "(a cell must compute each node's row on its own)", v.loc, "recurse")
        kept_children = {key for key in read_after if any(key == id(v) for slot in cell.children for v in slot)}

        # What the forward loop kept (its level GEMMs' results), in schedule order:
        # complete before this loop starts, so work made again from them alone is hoisted.
        loaded = [(v, ctx.read(k)) for (v, _), k in zip(cell.loaded, kept_inputs)]
        for v, base in loaded:
            ctx.place[id(v)] = f"{base.expr} + {leaves} * {self.width(v)}"
        hoisted = None
        if hoisted_nodes:
            ctx.place[id(cell.words)] = f"{sorted_words} + {leaves}"
            decls, body = ctx.lower_nodes(hoisted_nodes, {rows: sympy.Symbol(internal)})
            hoisted = self._block(decls, str(rows), internal, body)
        offset = f"({start} - {leaves})"

        def at_level(v, base):
            return f"{base}.data() + {offset} * {self.width(v)}"

        for n in hoisted_nodes:
            for v in n.outputs:
                if has_rows(v, rows):
                    ctx.place[id(v)] = at_level(v, v.name)
        # Before the loop: the children's state buffers (for all internal rows when
        # the part after the loop reads them) and the rows kept for after the loop.
        buffers = []
        for slot in cell.children:
            for v in slot:
                full = id(v) in kept_children
                buffers.append(Declare(f"{scratch}<float>", v.name,
                                       [f"{internal if full else most} * {self.width(v)}"]))
                ctx.place[id(v)] = at_level(v, v.name) if full else f"{v.name}.data()"
        # A view (reshape) is a pointer the loop's scope declares: its rows are copied
        # into a buffer of another name.
        buf = {id(v): names.unique(f"{v.name}_rows") if get_op(v.producer.op).view else v.name for v in kept}
        for v in kept:
            buffers.append(Declare(f"{scratch}<float>", buf[id(v)], [f"{internal} * {self.width(v)}"],
                                   note="kept for the gradient after the loop"))
            if buf[id(v)] == v.name:
                ctx.place[id(v)] = at_level(v, v.name)
        for v, base in loaded:
            ctx.place[id(v)] = f"{base.expr} + {start} * {self.width(v)}"
        ctx.place[id(cell.words)] = f"{sorted_words} + {start}"
        for j, d in enumerate(cell.d_out):
            ctx.place[id(d)] = f"{self.grad_rows[j]}.data() + {start} * {ctx.size(self.widths[j])}"
        packed = _pack_loop_weights(ctx, names, cell, looped_forward + looped_backward)
        level_rows = f"{sched}.level_start[{level} + 1] - {start}"
        decls, body = ctx.lower_nodes(looped_forward + looped_backward, {rows: sympy.Symbol(most)})
        for v in kept:  # a view (reshape) names other data: copy it into the kept rows
            target = at_level(v, buf[id(v)])
            if ctx.place[id(v)] != target:
                body.append(self._copy(v, target, str(rows)))
                ctx.place[id(v)] = target
        ctx.packed = {}
        loop_body = self._block(decls, str(rows), level_rows, body)
        gathers = [
            ctx.call("dg::gather_children", f"{self.state_rows[j]}.data()", Named("width", ctx.size(self.widths[j])),
                     f"{sched}.child_row.data() + {start} * {spec.arity}", Named("arity", spec.arity),
                     Named("slot", k), Named("rows", level_rows), ctx.place[id(v)])
            for k, slot in enumerate(cell.children) for j, v in enumerate(slot)
        ]
        scatters = [
            ctx.call("dg::scatter_children_add", ctx.read(d), Named("width", ctx.size(self.widths[j])),
                     f"{sched}.child_row.data() + {start} * {spec.arity}", Named("arity", spec.arity),
                     Named("slot", k), Named("rows", level_rows), f"{self.grad_rows[j]}.data()")
            for k, slot in enumerate(cell.d_children) for j, d in enumerate(slot) if d is not None
        ]
        # After the loop: every internal row at once.
        for v, base in loaded:
            ctx.place[id(v)] = f"{base.expr} + {leaves} * {self.width(v)}"
        for v in kept:
            ctx.place[id(v)] = f"{buf[id(v)]}.data()"
        for slot in cell.children:
            for v in slot:
                if id(v) in kept_children:
                    ctx.place[id(v)] = f"{v.name}.data()"
        for n in hoisted_nodes:
            for v in n.outputs:
                if has_rows(v, rows):
                    ctx.place[id(v)] = f"{v.name}.data()"
        after = self._cell_block(cell, after_nodes, 1, internal, f"{sorted_words} + {leaves}", leaves, writes)
        leaf = self._cell_block(self.back.leaf, self.back.leaf.nodes, 0, leaves, sorted_words, "0", writes)
        return ReverseLevelLoop(
            batch=self.node.inputs[0].name, schedule=sched, inspector=inspector, leaves=leaves, internal=internal,
            internal_rows=f"{sched}.rows() - {leaves}", hoisted=hoisted, max_rows=most, buffers=buffers, packed=packed,
            level=level, start=start, gathers=gathers, body=loop_body, scatters=scatters, after=after,
            leaf=leaf, writes=list(writes.values()), reads=[base for _, base in loaded],
        )

    def _block(self, decls, rows, count, body):
        from ..codegen.plan import CellBlock

        return CellBlock(decls, rows, count, body)

    def _copy(self, v, target, rows):
        from ..codegen.stmt import Copy

        return Copy(self.ctx.target.copy_fn, self.ctx.read(v), f"{rows} * {self.width(v)}", target)

    def _cell_block(self, cell, nodes, which, count, words_ptr, first_row, writes):
        """`nodes` of a cell over `count` rows starting at `first_row`, its
        parameters' gradient pieces written into the outputs."""
        from ..codegen.stmt import Copy

        ctx, spec = self.ctx, self.spec
        if not nodes and not cell.d_free:
            return None
        ctx.place[id(cell.words)] = words_ptr
        for j, d in enumerate(cell.d_out):
            start = f"{first_row} * {ctx.size(self.widths[j])}"
            ctx.place[id(d)] = f"{self.grad_rows[j]}.data()" + ("" if first_row == "0" else f" + {start}")
        for i, v in cell.d_free.items():
            if ctx.claim_output(v):
                ctx.place[id(v)] = writes[(which, i)].expr
        decls, body = ctx.lower_nodes(nodes, {spec.rows: sympy.Symbol(count)})
        for i, v in cell.d_free.items():
            out = writes[(which, i)]
            if ctx.place[id(v)] != out.expr:
                body.append(Copy(ctx.target.copy_fn, ctx.read(v), ctx.size(numel(v.shape)), out.expr))
        return self._block(decls, str(spec.rows), count, body)
