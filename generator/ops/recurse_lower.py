"""The forward lowering of the recursive op (ops/recurse.py): Cortex's executor
as generic structured lines (codegen/stmt.py), one Block for the recursion:

    {
      inspector (the schedule, the words in row order)
      const leaves = ...;  the leaf Block: { const rows = leaves; leaf cell }
      the hoisted Block: internal-cell work that reads no child, all internal rows
      buffers sized for the largest level, weights packed once
      for (level ...) { start, rows, this level's pointers, the children's gathers, the cell }
    }

The states live in the caller's arrays, in node order, from the start: a cell
writes each level's rows straight to their nodes' rows (the schedule's order
maps them) and the children are gathered from there, so each state is written
once and nothing is put back in order after the loop. Buffers are sized for the
largest level before the loop: nothing is allocated inside it.
"""

from __future__ import annotations

import sympy

from ..codegen.stmt import Block, Break, Comment, Copy, Declare, Loop, Named
from ..ir.shapes import numel
from .recurse_scope import (LoopScope, LoopState, has_rows, hoistable, inspector_lines, named_for_messages,
                            pack_loop_weights, width)
from .registry import get_op


_COMPACT_LOOP = ("One batched step per loop step, over the examples still {still} only (compaction by\n"
                 "index lists): an example whose `cond_fn` is now false keeps its old state and stops; the\n"
                 "loop stops once no example is still {still}.")


def depends_on_children(cell) -> set:
    """ids of the cell's values that (transitively) read a child's state."""
    tainted = {id(v) for slot in cell.children for v in slot}
    for node in cell.nodes:
        if any(id(v) in tainted for v in node.inputs):
            tainted.update(id(v) for v in node.outputs)
    return tainted


def forward_loop(node, ctx) -> list:
    spec = node.attrs["spec"]
    with named_for_messages(node, (spec.leaf, spec.internal)), ctx.lowering_loop(LoopState()):
        return [_Forward(node, ctx).block()]


class _Forward:
    def __init__(self, node, ctx):
        self.node, self.ctx, self.spec = node, ctx, node.attrs["spec"]
        self.scope = LoopScope(ctx, node, (self.spec.leaf, self.spec.internal))
        self.words = self.scope.words
        self.rows = str(self.spec.rows)
        self.widths = [numel(shape) for _, shape in self.spec.state]

    def block(self) -> Block:
        ctx, spec, scope, words = self.ctx, self.spec, self.scope, self.words
        ns = len(spec.state)
        sched, sorted_words, lines = inspector_lines(ctx, self.node, scope)
        lines.insert(0, Comment(words.inspector))
        # Written in the blocks through the schedule's order (the arena pieces are declared before the Block).
        self.state_writes = [ctx.write(out) for out in self.node.outputs[:ns]]
        kept_writes = [ctx.write(out) for out in self.node.outputs[ns:]]
        # Zeros past each sequence's length (no step writes those rows); past a while loop's
        # last step also in the values kept for the gradient (its reverse loop reads them).
        zeroed = list(zip(self.state_writes, self.node.outputs[:ns])) if spec.sequences else []
        if spec.until is not None:
            zeroed += list(zip(kept_writes, self.node.outputs[ns:]))
        lines += [ctx.call("dg::fill", w, Named("n", ctx.size(numel(out.shape))), Named("value", "0.0f"))
                  for w, out in zeroed]

        # The first batched step: rows [0, leaves).
        leaves = scope.name(words.first)
        lines.append(Declare("const std::int64_t", leaves, init=words.firsts(sched)))
        decls, body = self.cell_block(spec.leaf, spec.leaf.nodes, leaves, sorted_words, f"{sched}.order.data()")
        lines += [Comment(words.first_block)] + decls + [Block(self.rows_line(leaves) + body, part=words.parts[0])]

        # Hoisted: internal-cell work that does not read children, for all internal rows.
        cell = spec.internal
        # (A compacted while loop's step rows are its live examples, not the step's rows in
        # schedule order that a hoisted value's rows are: nothing is hoisted there.)
        compact = spec.until is not None and spec.compact
        hoisted_nodes = [] if compact else hoistable(cell.nodes, depends_on_children(cell), spec.rows)
        looped = [n for n in cell.nodes if n not in hoisted_nodes]
        if hoisted_nodes:
            inner = scope.name(words.later)
            lines.append(Declare("const std::int64_t", inner, init=f"{sched}.rows() - {leaves}"))
            decls, body = self.cell_block(cell, hoisted_nodes, inner, f"{sorted_words} + {leaves}", None)
            lines += [Comment(words.hoisted)] + decls + [Block(self.rows_line(inner) + body, part="hoisted")]

        most = scope.name("max_rows")
        lines.append(Declare("const std::int64_t", most, init=words.most(sched)))
        lines += self.child_buffers(cell, looped, most)
        packed = pack_loop_weights(ctx, scope, cell, looped)
        if packed:
            lines += [Comment(f"Weights the {words.loop_name} multiplies by, packed for the GEMM once (not per {words.level}).")]
            lines += packed

        # Per level: its first row, its row count, pointers to its rows.
        level, start, rows = scope.name(words.level), scope.name("start"), self.rows
        child_rows, order = scope.name(words.child_rows), scope.name("order")
        if compact:
            # Compaction by index lists: the step runs on the examples still running only.
            live, live_prev, live_order = scope.name("live"), scope.name("live_prev_rows"), scope.name("live_rows")
            scratch = ctx.target.scratch_type
            lines += [Declare(f"{scratch}<std::int64_t>", name, [most]) for name in (live, live_prev, live_order)]
            running_at = self.state_writes[spec.until].expr
            # (a word that names a value of the function would read as one where it is outlined)
            still = "running" if set(spec.running.split("_")) & scope.taken else spec.running.replace("_", " ")
            head = [Declare("const std::int64_t", start, init=words.start_of(sched, level)),
                    Comment(f"The examples still {still} (their previous step ran), listed by index in `live`:"),
                    Comment("this step is one batched block of their rows; a stopped example's rows stay zero."),
                    Declare("const std::int64_t", rows, init=ctx.call(
                        "dg::still_running", running_at, f"{sched}.order.data()", words.links(sched, start, 1),
                        f"{sched}.order.data() + {start}",
                        Named("rows", f"{words.start_of(sched, f'{level} + 1')} - {start}"),
                        f"{live}.data()", f"{live_prev}.data()", f"{live_order}.data()")),
                    Break(f"{rows} == 0", f"No example is still {still}: the steps left would change nothing."),
                    Declare("const std::int64_t*", child_rows, init=f"{live_prev}.data()"),
                    Declare("const std::int64_t*", order, init=f"{live_order}.data()")]
        else:
            head = [Declare("const std::int64_t", start, init=words.start_of(sched, level)),
                    Declare("const std::int64_t", rows, init=f"{words.start_of(sched, f'{level} + 1')} - {start}"),
                    Declare("const std::int64_t*", child_rows, init=words.links(sched, start, spec.arity)),
                    Declare("const std::int64_t*", order, init=f"{sched}.order.data() + {start}")]
        # Read at the level's rows: by the looped nodes, or as a state (copied to its nodes' rows).
        read_in_loop = {id(v) for n in looped for v in n.inputs} | {id(v) for v in cell.outputs}
        places = {}
        for n in hoisted_nodes:  # made for all internal rows: read at the level's
            for v in n.outputs:
                if has_rows(v, spec.rows) and id(v) in read_in_loop:
                    decl, places[v] = scope.pointer(v, f"{ctx.place[id(v)]} + ({start} - {leaves}) * "
                                                       f"{ctx.size(width(v))}", writable=False)
                    head.append(decl)
        # Values kept for the gradient (spec.kept): written at the level's rows of outputs of their own.
        kept_at = {}
        for v, w in zip(spec.kept, kept_writes):
            claimed = not compact and ctx.claim_output(v)  # (compacted: scattered to the step's rows below)
            decl, kept_at[id(v)] = scope.pointer(v, f"{w.expr} + {start} * {ctx.size(width(v))}", writable=True,
                                                 name=v.name if claimed else None)
            head.append(decl)
            if claimed:
                places[v] = kept_at[id(v)]
        with ctx.placed(places):
            decls, body = self.cell_block(cell, looped, most, order if compact else f"{sorted_words} + {start}", order)
            for v in spec.kept:
                if compact:  # the live examples' rows, at their places among the step's rows
                    body.append(ctx.call("dg::unsort_rows", ctx.read(v), f"{live}.data()", Named("rows", rows),
                                         Named("width", ctx.size(width(v))), kept_at[id(v)]))
                elif ctx.place[id(v)] != kept_at[id(v)]:
                    body.append(Copy(ctx.target.copy_fn, ctx.read(v), f"{rows} * {ctx.size(width(v))}",
                                     kept_at[id(v)]))
            gathers = [
                words.move(ctx, "dg::gather_child_nodes", spec.arity, k,
                           [self.state_writes[j].expr, Named("width", ctx.size(self.widths[j])),
                            f"{sched}.order.data()", child_rows],
                           [Named("rows", rows), ctx.place[id(v)],
                            *([Named("out_stride", ctx.size(self.out_stride[id(v)]))] if id(v) in self.out_stride
                              else [])])
                for k, slot in enumerate(cell.children) for j, v in enumerate(slot)
            ]
            if spec.until is not None and not compact:  # a while loop: stop once no example runs
                running = cell.children[0][spec.until]
                first = gathers.pop(spec.until)
                gathers[:0] = [first, Break(f"!dg::any_running({ctx.place[id(running)]}, {rows})",
                                            "No example is still running: the steps left would change nothing.")]
        ctx.loop.packed = {}
        lines += decls
        lines.append(Loop(level, "1", f"{level} < {words.count(sched)}", f"++{level}", head + gathers + body,
                          comment=_COMPACT_LOOP.format(still=still) if compact
                          else words.loop, part=words.parts[1]))
        return Block(lines, touches=self.state_writes + kept_writes)

    def rows_line(self, count) -> list:
        return [Declare("const std::int64_t", self.rows, init=count)]

    def child_buffers(self, cell, looped, most) -> list:
        """Buffers for the children's states, sized for the largest level. A child
        state whose one reader is a concat (the level GEMM's operand) is gathered
        straight into its columns of the concat's buffer."""
        ctx, scratch = self.ctx, self.ctx.target.scratch_type
        lines, self.out_stride = [], {}
        for slot in cell.children:
            for j, v in enumerate(slot):
                spot = ctx.concat_spot(v, looped)
                if spot is None:
                    lines.append(Declare(f"{scratch}<float>", v.name, [f"{most} * {ctx.size(self.widths[j])}"]))
                    ctx.place[id(v)] = f"{v.name}.data()"
                    continue
                out, column, ld = spot
                if id(out) not in ctx.place:
                    lines.append(Declare(f"{scratch}<float>", out.name, [f"{most} * {ctx.size(ld)}"]))
                    ctx.place[id(out)] = f"{out.name}.data()"
                ctx.place[id(v)] = ctx.place[id(out)] + ("" if column == 0 else f" + {ctx.size(column)}")
                ctx.loop.in_concat.add(id(v))
                self.out_stride[id(v)] = ld
        return lines

    def cell_block(self, cell, nodes, bound, words_ptr, order):
        """A cell's statements over a block of rows: (its buffers, sized with
        rows = `bound`, to declare before the block; its lines).
        With `order` (the node ids of its rows), the cell's results are the states
        of its rows, written straight to their nodes' rows where the kernel that
        makes them can, else copied there."""
        ctx, spec = self.ctx, self.spec
        mapped = set()
        if order is not None:
            for j, v in enumerate(cell.outputs):
                if _writes_through_map(ctx, v, cell, nodes, spec):
                    ctx.place[id(v)] = self.state_writes[j].expr
                    ctx.loop.row_maps[id(v)] = order
                    mapped.add(id(v))
        with ctx.placed({cell.words: words_ptr}):
            decls, body = ctx.lower_nodes(nodes, {spec.rows: sympy.Symbol(bound)})
        if order is not None:
            for j, v in enumerate(cell.outputs):
                if id(v) not in mapped:  # made elsewhere, or by an op that cannot place rows: copied
                    body.append(ctx.call("dg::unsort_rows", ctx.read(v), order, Named("rows", self.rows),
                                         Named("width", ctx.size(self.widths[j])), self.state_writes[j].expr))
        return decls, body


def _writes_through_map(ctx, v, cell, nodes, spec) -> bool:
    """Whether the cell's result v can be written straight to its nodes' rows of
    the state it is (row r at row order[r]): a kernel of this block that indexes
    rows through a map makes it and only such kernels read it here (`reads_views`:
    codegen/kernels.py), it is one state only, not kept for the gradient, and
    nothing placed it already (a hoisted value)."""
    if sum(u is v for u in cell.outputs) != 1 or id(v) in ctx.place or v.dtype != "float32":
        return False
    if any(u is v for u in spec.kept):
        return False
    made = v.producer
    if made is None or not any(made is n for n in nodes) or not get_op(made.op).reads_views:
        return False
    return all(get_op(n.op).reads_views for n in nodes if any(u is v for u in n.inputs))
