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

from ..errors import ModelError
from ..ir.graph import needed_nodes
from ..ir.printing import format_node
from ..ir.shapes import numel
from ..codegen.stmt import Block, Comment, Copy, Declare, Loop, Named
from .recurse import batch_nodes, reference_schedule
from .recurse_scope import (LoopScope, LoopState, has_rows, hoistable, inspector_lines, named_for_messages,
                            pack_loop_weights, replace_in_cells)
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
        replace_in_cells(node.attrs["spec"], node.attrs["back"].cells, old, new)

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
        back = node.attrs["back"]
        lines = [f"recurse_grad({', '.join(v.name for v in node.inputs)})"]
        for title, cell in (("leaf", back.leaf), ("internal", back.internal)):
            args = [cell.words.name] + [v.name for slot in cell.children for v in slot] + [v.name for v in cell.d_out]
            lines.append(f"    {title}({', '.join(args)}):")
            lines += [f"      {format_node(n)}" for n in cell.nodes]
            lines.append(f"      -> {', '.join(v.name for v in cell.results())}")
        return "\n".join(lines)

    def lower(self, node, ctx):
        with named_for_messages(node, node.attrs["back"].cells), ctx.lowering_loop(LoopState()):
            return [_Lowering(node, ctx).block()]


class _Lowering:
    """The reverse level loop of one recurse_grad node (see the module docstring),
    as one Block of structured lines (codegen/stmt.py)."""

    def __init__(self, node, ctx):
        self.node, self.ctx = node, ctx
        self.spec, self.back = node.attrs["spec"], node.attrs["back"]
        self.scope = LoopScope(ctx, node, self.back.cells, self.back.numbered)
        self.words = self.scope.words
        self.rows = str(self.spec.rows)
        self.widths = [numel(shape) for _, shape in self.spec.state]

    def width(self, v) -> str:
        """Floats per row of the block: a value of [k * rows, ...] (a reshape) has k rows of its own per node."""
        return self.ctx.size(per_row(v, self.spec.rows))

    def block(self) -> Block:
        ctx, spec, scope, words = self.ctx, self.spec, self.scope, self.words
        nodes = ctx.size(batch_nodes(spec, self.node.inputs))
        _, states, dstates, kept_inputs = _split(self.node)
        scratch = ctx.target.scratch_type
        sched, sorted_words, lines = inspector_lines(ctx, self.node, scope)
        lines.insert(0, Comment(words.inspector_again))
        # The forward states and the gradients arriving at them, in schedule order;
        # the gradient rows also collect what each node's parents send down.
        self.state_rows, self.grad_rows = [], []
        for (name, _), state, dstate, width in zip(spec.state, states, dstates, self.widths):
            s, d = scope.name(f"{name}_sorted"), scope.name(f"d_{name}_sorted")
            for var, value in ((s, state), (d, dstate)):
                lines.append(Declare(f"{scratch}<float>", var, [f"{nodes} * {ctx.size(width)}"], note="in schedule order"))
                lines.append(ctx.call("dg::sort_rows", ctx.read(value), f"{sched}.order.data()",
                                      Named("rows", f"{sched}.rows()"), Named("width", ctx.size(width)), f"{var}.data()"))
            self.state_rows.append(s)
            self.grad_rows.append(d)
        # Outputs: arena buffers the blocks write the parameters' gradients into.
        outputs = {piece: out for piece, out in zip(self.node.attrs["pieces"], self.node.outputs)}
        writes = {piece: ctx.write(out) for piece, out in outputs.items()}
        leaves, internal = scope.name(words.first), scope.name(words.later)
        lines += [Declare("const std::int64_t", leaves, init=words.firsts(sched)),
                  Declare("const std::int64_t", internal, init=f"{sched}.rows() - {leaves}")]
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
        sends = [v for slot in cell.d_children for v in slot if v is not None]
        looped_backward = [n for n in needed_nodes(backward, {id(v) for v in sends})]
        looped = looped_forward + looped_backward
        after_nodes = [n for n in backward if n not in looped_backward]
        made_in_loop = {id(v) for n in looped for v in n.outputs}
        read_after = {id(v): v for n in after_nodes for v in n.inputs}
        for piece, v in cell.d_free.items():
            read_after.setdefault(id(v), v)
        kept = [v for key, v in read_after.items() if key in made_in_loop]
        for v in kept:
            if per_row(v, rows) is None:
                raise ModelError(f"cannot differentiate the cell: '{v.name}' {v.type_str()} is not row by row "
                                 "(a cell must compute each node's row on its own)", v.loc, "recurse")
        kept_children = {key for key in read_after if any(key == id(v) for slot in cell.children for v in slot)}
        # What the forward loop kept (its level GEMMs' results), in schedule order:
        # complete before this loop starts, so work made again from them alone is hoisted.
        self.loaded = [(v, ctx.read(k)) for (v, _), k in zip(cell.loaded, kept_inputs)]

        if hoisted_nodes:
            decls, body = self._cell_lines(cell, hoisted_nodes, internal, f"{sorted_words} + {leaves}", leaves)
            lines += [Comment(words.hoisted_again)] + decls + [Block(body, part="again")]
        most = scope.name("max_rows")
        lines.append(Declare("const std::int64_t", most, init=words.most(sched)))

        # Before the loop: the children's state buffers (for all internal rows when
        # the part after the loop reads them) and the rows kept for after the loop;
        # in the loop, pointers to the level's rows of those made for all internal rows.
        loop = scope.inner()
        level, start = loop.name(words.level), loop.name("start")
        child_rows = loop.name(words.child_rows)
        head = [Declare("const std::int64_t", start, init=words.start_of(sched, level)),
                Declare("const std::int64_t", self.rows, init=f"{words.start_of(sched, f'{level} + 1')} - {start}"),
                Declare("const std::int64_t*", child_rows, init=words.links(sched, start, spec.arity))]
        offset = f"({start} - {leaves})"
        read_in_loop = {id(v) for n in looped for v in n.inputs}
        places = {}

        def at_level(v, base, writable):
            decl, places[v] = loop.pointer(v, f"{base}.data() + {offset} * {self.width(v)}", writable)
            head.append(decl)

        for n in hoisted_nodes:
            for v in n.outputs:
                if has_rows(v, rows) and id(v) in read_in_loop:
                    at_level(v, v.name, writable=False)
        buffers, kept_at = [], {}
        for slot in cell.children:
            for v in slot:
                full = id(v) in kept_children
                buffers.append(Declare(f"{scratch}<float>", v.name, [f"{internal if full else most} * {self.width(v)}"]))
                ctx.place[id(v)] = f"{v.name}.data()"
                if full:
                    at_level(v, v.name, writable=True)
        # A view (reshape) is a pointer the loop declares: its rows are copied into a buffer of another name.
        buf = {id(v): scope.name(f"{v.name}_all") if get_op(v.producer.op).view else v.name for v in kept}
        for v in kept:
            buffers.append(Declare(f"{scratch}<float>", buf[id(v)], [f"{internal} * {self.width(v)}"],
                                   note="kept for the gradient after the loop"))
            at_level(v, buf[id(v)], writable=True)
            if buf[id(v)] == v.name:
                ctx.place[id(v)] = f"{v.name}.data()"
            else:  # the view's own lines place it
                kept_at[id(v)] = places.pop(v)
        for v, base in self.loaded:
            if id(v) in read_in_loop:
                decl, places[v] = loop.pointer(v, f"{base.expr} + {start} * {self.width(v)}", writable=False)
                head.append(decl)
        for j, d in enumerate(cell.d_out):
            if id(d) in read_in_loop:
                decl, places[d] = loop.pointer(d, f"{self.grad_rows[j]}.data() + {start} * {ctx.size(self.widths[j])}",
                                               writable=False, name=loop.name(d.name))
                head.append(decl)
        places[cell.words] = f"{sorted_words} + {start}"
        lines += buffers
        packed = pack_loop_weights(ctx, scope, cell, looped)
        if packed:
            lines += [Comment(f"Weights the {words.loop_name} multiplies by, packed for the GEMM once (not per {words.level}).")]
            lines += packed
        with ctx.placed(places):
            decls, body = ctx.lower_nodes(looped, {rows: sympy.Symbol(most)})
            for v in kept:  # a view (reshape) names other data: copy it into the kept rows
                if id(v) in kept_at:
                    body.append(self._copy(v, kept_at[id(v)], self.rows))
        for v in kept:
            ctx.place[id(v)] = f"{buf[id(v)]}.data()"
        ctx.loop.packed = {}
        gathers = [
            words.move(ctx, "dg::gather_children", spec.arity, k,
                       [f"{self.state_rows[j]}.data()", Named("width", ctx.size(self.widths[j])), child_rows],
                       [Named("rows", self.rows), places.get(v, ctx.place[id(v)])])
            for k, slot in enumerate(cell.children) for j, v in enumerate(slot)
        ]
        scatters = [
            words.move(ctx, "dg::scatter_children_add", spec.arity, k,
                       [ctx.read(d), Named("width", ctx.size(self.widths[j])), child_rows],
                       [Named("rows", self.rows), f"{self.grad_rows[j]}.data()"])
            for k, slot in enumerate(cell.d_children) for j, d in enumerate(slot) if d is not None
        ]
        lines += decls
        lines.append(Loop(level, f"{words.count(sched)} - 1", f"{level} >= 1", f"--{level}",
                          head + gathers + body + [Comment(words.scatters)] + scatters, comment=words.loop_back,
                          part=words.parts[1]))
        # After the loop: every internal row at once, then the leaves.
        for comment, part, block in (
                (words.after, words.parts[2], self._cell_block(cell, after_nodes, 1, internal,
                                                               f"{sorted_words} + {leaves}", leaves, writes)),
                (words.first_back, words.parts[0], self._cell_block(self.back.leaf, self.back.leaf.nodes, 0, leaves,
                                                                    sorted_words, "0", writes))):
            if block is not None:
                decls, body = block
                lines += [Comment(comment)] + decls + [Block(body, part=part)]
        return Block(lines, touches=list(writes.values()) + [base for _, base in self.loaded])

    def _copy(self, v, target, rows):
        return Copy(self.ctx.target.copy_fn, self.ctx.read(v), f"{rows} * {self.width(v)}", target)

    def _cell_lines(self, cell, nodes, count, words_ptr, first_row, places=None):
        """`nodes` of a cell over `count` rows from `first_row` on: (the buffers to
        declare before the block, its lines): `const rows = count;`, pointers to
        the rows of what the forward loop kept, the nodes' lines."""
        ctx = self.ctx
        block = self.scope.inner()
        places = dict(places or {})
        places[cell.words] = words_ptr
        lines = [Declare("const std::int64_t", self.rows, init=count)]
        reads = {id(v) for n in nodes for v in n.inputs}
        for v, base in self.loaded:
            if id(v) in reads and cell is self.back.internal:
                decl, places[v] = block.pointer(v, f"{base.expr} + {first_row} * {self.width(v)}", writable=False)
                lines.append(decl)
        for j, d in enumerate(cell.d_out):
            if id(d) in reads:
                at = f"{self.grad_rows[j]}.data()"
                if first_row == "0":
                    places[d] = at
                else:
                    decl, places[d] = block.pointer(d, f"{at} + {first_row} * {ctx.size(self.widths[j])}",
                                                    writable=False, name=block.name(d.name))
                    lines.append(decl)
        with ctx.placed(places):
            decls, body = ctx.lower_nodes(nodes, {self.spec.rows: sympy.Symbol(count)})
        return decls, lines + body

    def _cell_block(self, cell, nodes, which, count, words_ptr, first_row, writes):
        """`nodes` of a cell over `count` rows starting at `first_row`, its
        parameters' gradient pieces written into the outputs: (declarations, lines)."""
        ctx = self.ctx
        if not nodes and not cell.d_free:
            return None
        for i, v in cell.d_free.items():
            if ctx.claim_output(v):
                ctx.place[id(v)] = writes[(which, i)].expr
        decls, body = self._cell_lines(cell, nodes, count, words_ptr, first_row)
        for i, v in cell.d_free.items():
            out = writes[(which, i)]
            if ctx.place[id(v)] != out.expr:
                body.append(Copy(ctx.target.copy_fn, ctx.read(v), ctx.size(numel(v.shape)), out.expr))
        return decls, body
