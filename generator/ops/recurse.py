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

from ..ir.shapes import numel
from .registry import OpDef, get_op, register


def _run_cell(cell, env, dims):
    for node in cell.nodes:
        results = get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)
        for v, r in zip(node.outputs, results):
            env[id(v)] = r
    return [env[id(v)] for v in cell.outputs]


def _depends_on_children(cell) -> set:
    """ids of the cell's values that (transitively) read a child's state."""
    tainted = {id(v) for slot in cell.children for v in slot}
    for node in cell.nodes:
        if any(id(v) in tainted for v in node.inputs):
            tainted.update(id(v) for v in node.outputs)
    return tainted


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
        from ..reference.samples import id_limit
        from ..treebatch import random_batch

        spec = node.attrs["spec"]
        if spec.sequences:
            lengths = node.inputs[0]
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
        from ..ir.graph import Value
        from ..transforms.cell_grad import differentiate_recursion
        from .scalar import ARGS

        spec = node.attrs["spec"]
        ns = len(spec.state)
        back = differentiate_recursion(gb, spec, keep=not spec.kept, wanted=gb.reaches)
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
        from ..ir.printing import format_node

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
        """Cortex's executor as a typed LevelLoop (codegen/plan.py) that the
        template's level_loop macro renders: the inspector, the leaf block, the
        hoisted block, the buffers made once before the loop, and per level the
        children's gathers and the cell's body."""
        from ..codegen.plan import CellBlock, LevelLoop
        from ..codegen.stmt import Copy, Declare, Named

        spec = node.attrs["spec"]
        names = ctx.graph.names
        rows = str(spec.rows)
        widths = [numel(shape) for _, shape in spec.state]
        ns = len(spec.state)
        scratch = ctx.target.scratch_type
        sched, sorted_words, inspector = inspector_lines(ctx, node)
        # The states live in the caller's arrays, in node order, from the start: a cell
        # writes each level's rows straight to their nodes' rows (the schedule's order
        # maps them) and the children are gathered from there, so each state is
        # written once and nothing is put back in order after the loop.
        state_writes = [ctx.write(out) for out in node.outputs[:ns]]
        if spec.sequences:  # zeros past each sequence's length (no step writes those rows)
            inspector += [ctx.call("dg::fill", w, Named("n", ctx.size(numel(out.shape))), Named("value", "0.0f"))
                          for w, out in zip(state_writes, node.outputs[:ns])]

        def order_at(first_row):
            """The node ids of the rows from `first_row` on (the leaves start at row 0)."""
            return f"{sched}.order.data()" + ("" if first_row == "0" else f" + {first_row}")

        def run_block(cell, nodes_to_run, count_expr, bound_name, words_ptr, out_rows) -> CellBlock:
            """A cell's statements over `count_expr` rows; its buffers are sized with
            rows = bound_name, declared before the block. With `out_rows`, the cell's
            results are the states of rows [out_rows, out_rows + count)."""
            mapped = set()
            if out_rows is not None:
                for v in cell.outputs:
                    if _writes_through_map(ctx, v, cell, nodes_to_run, spec):
                        j = cell.outputs.index(v)
                        ctx.place[id(v)] = state_writes[j].expr
                        ctx.row_maps[id(v)] = order_at(out_rows)
                        mapped.add(id(v))
            ctx.place[id(cell.words)] = words_ptr
            decls, body = ctx.lower_nodes(nodes_to_run, {spec.rows: sympy.Symbol(bound_name)})
            if out_rows is not None:
                for j, v in enumerate(cell.outputs):
                    if id(v) not in mapped:  # made elsewhere, or by an op that cannot place rows: copied
                        body.append(ctx.call("dg::unsort_rows", ctx.read(v), order_at(out_rows), Named("rows", rows),
                                             Named("width", ctx.size(widths[j])), state_writes[j].expr))
            return CellBlock(decls, rows, count_expr, body)

        # Leaves: one batched step over rows [0, leaves).
        leaves = names.unique("leaves")
        leaf = run_block(spec.leaf, spec.leaf.nodes, leaves, leaves, sorted_words, "0")

        # Hoisted: internal-cell work that does not read children, for all internal rows.
        cell = spec.internal
        hoisted_nodes = hoistable(cell.nodes, _depends_on_children(cell), spec.rows)
        looped = [n for n in cell.nodes if n not in hoisted_nodes]
        inner = names.unique("internal_rows")
        hoisted = None
        if hoisted_nodes:
            hoisted = run_block(cell, hoisted_nodes, inner, inner, f"{sorted_words} + {leaves}", None)

        # Buffers for the children's states, sized for the largest level.
        most = names.unique("max_rows")
        # A child state whose one reader is a concat (the level GEMM's operand) is
        # gathered straight into its columns of the concat's buffer.
        child_buffers, out_stride = [], {}
        for slot in cell.children:
            for j, v in enumerate(slot):
                spot = ctx.concat_spot(v, looped)
                if spot is None:
                    child_buffers.append(Declare(f"{scratch}<float>", v.name, [f"{most} * {ctx.size(widths[j])}"]))
                    ctx.place[id(v)] = f"{v.name}.data()"
                    continue
                out, column, ld = spot
                if id(out) not in ctx.place:
                    child_buffers.append(Declare(f"{scratch}<float>", out.name, [f"{most} * {ctx.size(ld)}"]))
                    ctx.place[id(out)] = f"{out.name}.data()"
                ctx.place[id(v)] = ctx.place[id(out)] + ("" if column == 0 else f" + {ctx.size(column)}")
                ctx.in_concat.add(id(v))
                out_stride[id(v)] = ld
        level, start = names.unique("level"), names.unique("start")
        for n in hoisted_nodes:  # inside the loop, hoisted values are read at the level's rows
            for v in n.outputs:
                if has_rows(v, spec.rows):
                    ctx.place[id(v)] = f"{v.name}.data() + ({start} - {leaves}) * {ctx.size(numel(v.shape[1:]))}"
        level_rows = f"{sched}.level_start[{level} + 1] - {start}"
        packed = _pack_loop_weights(ctx, names, cell, looped)
        # Values kept for the gradient (spec.kept): written at the level's rows of outputs of their own.
        kept_writes = [ctx.write(out) for out in node.outputs[ns:]]
        kept_at = {id(v): f"{w.expr} + {start} * {ctx.size(numel(v.shape[1:]))}" for v, w in zip(spec.kept, kept_writes)}
        for v in spec.kept:
            if ctx.claim_output(v):
                ctx.place[id(v)] = kept_at[id(v)]
        body = run_block(cell, looped, level_rows, most, f"{sorted_words} + {start}", start)
        for v in spec.kept:
            if ctx.place[id(v)] != kept_at[id(v)]:
                body.body.append(Copy(ctx.target.copy_fn, ctx.read(v), f"{rows} * {ctx.size(numel(v.shape[1:]))}",
                                      kept_at[id(v)]))
        gathers = [
            ctx.call("dg::gather_child_nodes", state_writes[j].expr, Named("width", ctx.size(widths[j])),
                     f"{sched}.order.data()", f"{sched}.child_row.data() + {start} * {spec.arity}",
                     Named("arity", spec.arity), Named("slot", k), Named("rows", level_rows), ctx.place[id(v)],
                     *([Named("out_stride", ctx.size(out_stride[id(v)]))] if id(v) in out_stride else []))
            for k, slot in enumerate(cell.children) for j, v in enumerate(slot)
        ]
        ctx.packed = {}
        return [LevelLoop(
            batch=node.inputs[0].name, schedule=sched, inspector=inspector, leaves=leaves, leaf=leaf,
            internal_rows=f"{sched}.rows() - {leaves}", hoisted=hoisted, max_rows=most,
            child_buffers=child_buffers, packed=packed, level=level, start=start, gathers=gathers, body=body,
            writes=state_writes + kept_writes,
        )]


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


def inspector_lines(ctx, node):
    """The inspector of a recursive op (or of its gradient): the schedule (the
    batch checked, nodes numbered by height) and the word ids in row order.
    Returns (schedule variable, a pointer to the words in row order, lines).
    A sequence's step reads its node id as its word: the schedule's order."""
    from ..codegen.stmt import Call, Declare, Named

    spec = node.attrs["spec"]
    names = ctx.graph.names
    sched = names.unique("schedule")
    what = ctx.string(f"recurse over '{node.inputs[0].name}' ({node.loc.short if node.loc else ''})")
    if spec.sequences:
        lengths = node.inputs[0]
        schedule = Call("dg::schedule_sequences", [ctx.read(lengths), Named("count", ctx.size(lengths.shape[0])),
                                                   Named("steps", ctx.size(spec.steps)),
                                                   Named("reverse", "true" if spec.reverse else "false"), what])
        return sched, f"{sched}.order.data()", [Declare("const dg::LevelSchedule", sched, init=schedule)]
    children, words, roots = node.inputs[:3]
    nodes, count = children.shape[0], roots.shape[0]
    sorted_words = names.unique("sorted_words")
    schedule = Call("dg::schedule_levels", [ctx.read(children), Named("nodes", ctx.size(nodes)),
                                            Named("arity", spec.arity), ctx.read(roots),
                                            Named("num_roots", ctx.size(count)),
                                            Named("dag", "true" if spec.dag else "false"), what])
    return sched, f"{sorted_words}.data()", [
        Declare("const dg::LevelSchedule", sched, init=schedule),
        Declare(f"{ctx.target.scratch_type}<std::int64_t>", sorted_words, [ctx.size(nodes)]),
        ctx.call("dg::permute_rows", ctx.read(words), f"{sched}.order.data()", Named("count", f"{sched}.rows()"),
                 f"{sorted_words}.data()"),
    ]


def batch_nodes(spec, inputs):
    """The node count of the op's batch: the trees' nodes, or count * steps."""
    if spec.sequences:
        return sympy.sympify(inputs[0].shape[0]) * sympy.sympify(spec.steps)
    return inputs[0].shape[0]


def reference_schedule(spec, args, dims):
    """What the references walk: (children [nodes, arity], words [nodes], the
    nodes in schedule order (children first), each node's schedule row (-1 for a
    padded step: no node))."""
    from ..treebatch import check_batch, sequence_schedule

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


def has_rows(v, rows) -> bool:
    """Whether v's first dimension is the block's row count."""
    return bool(v.rank) and not isinstance(v.shape[0], int) and v.shape[0] == rows


def hoistable(nodes, tainted: set, rows) -> list:
    """The nodes of an internal cell that can run once for all internal rows
    before the level loop: they read no child (`tainted`: ids of values that do),
    read no cell value made in the loop, are row-wise (their outputs have the rows
    first, or no rows at all) and write data of their own (a view, a reshape, stays
    in the loop: the loop reads hoisted values at the level's rows of their buffers)."""
    made = {id(v) for n in nodes for v in n.outputs}
    hoisted, done = [], set()
    for n in nodes:
        if (not any(id(v) in tainted for v in n.outputs) and not get_op(n.op).view
                and all(id(v) not in made or id(v) in done for v in n.inputs)
                and all(not isinstance(d, int) and d == rows or rows not in getattr(d, "free_symbols", ())
                        for v in n.outputs for d in v.shape[:1])):
            hoisted.append(n)
            done.update(id(v) for v in n.outputs)
    return hoisted


def _pack_loop_weights(ctx, names, cell, looped) -> list:
    """Code motion for the level loop's products: a matmul whose right operand is
    defined before the loop (a weight) reads it packed once (dg::PackedB) instead
    of packing it again at every level; a product by its transpose (the gradient
    loop's d_gates @ u^T) gets a PackedB of the transpose. Only where the target's
    runtime has it."""
    from ..codegen.stmt import Declare, Named

    if not ctx.target.packs_weights:
        return []
    inside = {id(v) for n in cell.nodes for v in n.outputs}
    inside |= {id(v) for slot in cell.children for v in slot} | {id(cell.words)}
    lines = []  # each a PackedB declaration
    for n in looped:
        tb = bool(n.attrs.get("tb"))
        if n.op != "matmul" or n.attrs.get("ta"):
            continue
        b = n.inputs[1]
        key = (id(b), tb)
        if id(b) in inside or key in ctx.packed or id(b) not in ctx.place or b.rank != 2 or ctx.keeps_packed(b):
            continue  # (a parameter the Model keeps packed is read through that)
        name = names.unique(f"{b.name}_t_packed" if tb else f"{b.name}_packed")
        rows, cols = (ctx.size(d) for d in b.shape)
        k, width = (cols, rows) if tb else (rows, cols)
        lines.append(Declare("const dg::PackedB", name, [Named("tb", "true" if tb else "false"), Named("K", k),
                                                          Named("N", width), ctx.read(b), Named("ldb", cols)]))
        ctx.packed[key] = name
    return lines
