"""What the lowering of a recursion (ops/recurse_lower.py, ops/recurse_grad.py)
shares: its own lowering state (LoopState), the C++ scope of one loop (its names,
its vocabulary), the inspector, and which of a cell's nodes run before the loop.

A recursion lowers to one Block (codegen/stmt.py): everything it declares
ends with it, so a gradient's loop reuses the forward loop's names (`schedule`,
`start`, `c_l`) instead of numbering them, and a buffer's rows at the current
level are one named pointer (`node_i_rows`) declared once per level.
"""

from __future__ import annotations

from contextlib import contextmanager
from copy import copy
from dataclasses import dataclass, field

from ..codegen.stmt import CTYPE, Call, Declare, Named
from ..ir.names import fresh_name, is_reserved
from ..ir.shapes import numel
from .registry import get_op


@dataclass
class LoopState:
    """What lowering one recursion knows besides the general lowering context: the
    lines made while it lowers read it as `ctx.loop` (LowerCtx.lowering_loop)."""

    cell: tuple | None = None  # while a cell's nodes lower: (declarations before its block, dims to size them with)
    packed: dict = field(default_factory=dict)  # (id(value), tb) -> the dg::PackedB the level loop reads it through
    in_concat: set = field(default_factory=set)  # id(value) gathered straight into its columns of a concat's output
    row_maps: dict = field(default_factory=dict)  # id(value) -> int64 pointer: row r of the value is row map[r]


@dataclass(frozen=True)
class Vocabulary:
    """How the generated code speaks of a recursion: of trees (levels, leaves,
    children) or of sequences (time steps, sequences, the previous step)."""

    level: str  # the loop variable
    loop_name: str
    first: str  # the rows of the first batched step (leaves; the sequences' first steps)
    later: str  # the rows after them (internal nodes; the later steps)
    child_rows: str  # the pointer to a level's rows' child rows
    inspector: str
    first_block: str
    hoisted: str
    loop: str
    inspector_again: str
    hoisted_again: str
    loop_back: str
    scatters: str
    after: str
    first_back: str
    steps: bool = False  # one child slot, the previous step: the runtime's words for sequences
    # The parts a long function of the recursion's lines is cut into, each a function named after
    # it (codegen/sections.py): the first batched step, the loop, the rest of the later rows' work.
    parts: tuple = ("leaves", "levels", "internal_nodes")

    # The runtime's schedule and row moves, in the same words (dg_schedule.h, dg_tree.h).
    def firsts(self, sched: str) -> str:
        return f"{sched}.sequences()" if self.steps else f"{sched}.leaves()"

    def count(self, sched: str) -> str:
        return f"{sched}.steps()" if self.steps else f"{sched}.levels()"

    def start_of(self, sched: str, level: str) -> str:
        return f"{sched}.step_start({level})" if self.steps else f"{sched}.level_start[{level}]"

    def links(self, sched: str, start: str, arity: int) -> str:
        if self.steps:
            return f"{sched}.previous_rows({start})"
        return f"{sched}.child_row.data() + {start}" + ("" if arity == 1 else f" * {arity}")

    def most(self, sched: str) -> str:
        return f"{sched}.max_step_rows()" if self.steps else f"{sched}.max_level_rows"

    def move(self, ctx, tree_fn: str, arity: int, slot: int, before: list, after: list):
        """The call of a row move: `dg::gather_children(*before, /*arity=*/2, /*slot=*/1, *after)`
        of a tree; `dg::gather_previous(*before, *after)` of a sequence."""
        if not self.steps:
            return ctx.call(tree_fn, *before, Named("arity", arity), Named("slot", slot), *after)
        assert arity == 1 and slot == 0, "a sequence's row has one child: its previous step"
        return ctx.call(_SEQUENCE_MOVES[tree_fn], *before, *after)


_SEQUENCE_MOVES = {"dg::gather_children": "dg::gather_previous", "dg::gather_child_nodes": "dg::gather_previous_step",
                   "dg::scatter_children_add": "dg::scatter_previous_add"}


TREES = Vocabulary(
    "level", "level loop", "leaves", "internal_rows", "child_rows",
    "Inspector: check the batch and number its nodes by height, leaves first.",
    "Leaves: all leaves at once.",
    "Hoisted out of the level loop: internal-node work that does not read children, all internal nodes at once.",
    "Executor: one batched step per level, children before parents.",
    "Inspector again, for the gradient; the states and the gradients arriving at them in schedule order.",
    "Made again for the gradient: internal-node work that does not read children, all internal nodes at once.",
    "Backward executor: one batched step per level, parents before children (every\n"
    "parent is on a higher level, so a level's gradient rows are complete when it runs).",
    "The children's state gradients, added into their rows.",
    "The rest of the internal cell's gradient (sums over rows), all internal nodes at once.",
    "The leaf cell's gradient, all leaves at once.",
)

SEQUENCES = Vocabulary(
    "step", "time loop", "sequences", "later_rows", "prev_rows",
    "Schedule: check the lengths and give each (sequence, time step) a row, time step by time step.",
    "The first time step of every sequence, all at once.",
    "Hoisted out of the time loop: the later steps' work that does not read the previous step, all at once.",
    "One batched step per time step, over the sequences still running.",
    "Schedule again, for the gradient; the states and the gradients arriving at them in row order.",
    "Made again for the gradient: the later steps' work that does not read the previous step, all at once.",
    "Backward through time: one batched step per time step, in the reverse order of the forward\n"
    "loop (a step's state gradients are complete when it runs: the step after it sent them).",
    "The previous step's state gradients, added into its rows.",
    "The rest of the later steps' gradient (sums over rows), all at once.",
    "The first time step's gradient, all sequences at once.",
    steps=True,
    parts=("first_steps", "time_steps", "later_steps"),
)

WHILE = Vocabulary(
    "step", "loop", "examples", "later_rows", "prev_rows",
    "Schedule: each example's rows, step by step: row 0 its initial state, row t its state after step t.",
    "Row 0 of every example: its initial state, all at once.",
    "Hoisted out of the loop: the steps' work that does not read the previous state, all at once.",
    "One batched step per loop step, over every example (masking, not compaction): the examples\n"
    "still running take the body's new state, the others keep theirs; the loop stops once no\n"
    "example is still running.",
    "Schedule again, for the gradient; the states and the gradients arriving at them in row order.",
    "Made again for the gradient: the steps' work that does not read the previous state, all at once.",
    "Backward through the loop: one batched step per loop step, in the reverse order of the forward\n"
    "loop, from the states it kept at every step (past its last step: zeros, and no gradient).",
    "The previous step's state gradients, added into its rows.",
    "The rest of the steps' gradient (sums over rows), all at once.",
    "The initial states' gradient, all examples at once.",
    steps=True,
    parts=("initial_states", "steps", "later_steps"),
)


class LoopScope:
    """The names of one recursion's C++ scope. A name is taken as asked unless
    the function around the scope declares it (a graph value, a dim, a member
    read unqualified), a cell value of this recursion bears it, or this scope
    declared it already; then it is numbered."""

    def __init__(self, ctx, node, cells, numbered=None):
        self.ctx = ctx
        self.spec = node.attrs["spec"]
        self.words = WHILE if self.spec.until is not None else SEQUENCES if self.spec.sequences else TREES
        graph = ctx.graph
        outer = {v.name for v in list(graph.inputs) + list(graph.params)} | {str(d) for d in graph.dims}
        outer |= {v.name for n in graph.nodes for v in n.inputs + n.outputs}
        outer |= {k.member for k in ctx.kept.values()}
        self.taken = outer | {str(self.spec.rows)}
        first, later = self.spec.prefixes
        for cell in cells:  # a value the scope declares must not hide one of the function's: leaf_zeros
            prefix = later if cell.children else first
            for v in [u for slot in cell.children for u in slot] + [u for n in cell.nodes for u in n.outputs]:
                if v.name in outer:
                    v.name = self.name(prefix + v.name)
        self.taken |= {v.name for cell in cells for v in cell_values(cell)}
        for cell in cells:  # a numbered name (numbered: BackSpec): its base if free again, else leaf_<base>
            prefix = later if cell.children else first
            for v in [u for n in cell.nodes for u in n.outputs]:
                base = (numbered or {}).get(v.name)
                free = [b for b in (base, prefix + str(base)) if base and b not in self.taken and not is_reserved(b)]
                if free:
                    self.taken.add(free[0])
                    v.name = free[0]

    def inner(self) -> "LoopScope":
        """The scope of a block inside this one: it sees this scope's names, and
        its own end with it (a sibling block takes them again)."""
        sub = copy(self)
        sub.taken = set(self.taken)
        return sub

    def name(self, base: str) -> str:
        name = fresh_name(base, self.taken)
        self.taken.add(name)
        return name

    def pointer(self, v, expr: str, writable: bool, name: str | None = None):
        """A pointer to v's rows at `expr`, declared once: (its Declare, its name)."""
        name = name or self.name(f"{v.name}_rows")
        return Declare(f"{'' if writable else 'const '}{CTYPE[v.dtype]}*", name, init=expr), name


def cell_values(cell) -> list:
    """Every value of a cell: its words, children, nodes' outputs."""
    values = [cell.words] + [v for slot in cell.children for v in slot]
    return values + [v for n in cell.nodes for v in n.outputs]


def replace_in_cells(spec, cells, old, new) -> None:
    """A value the graph replaced (OpDef.replace), also where a gradient op's cells and its
    spec read it: the free values, the cells' nodes, their children's and free gradients."""
    spec.free = [new if v is old else v for v in spec.free]
    for cell in cells:
        for inner in cell.nodes:
            inner.inputs = [new if v is old else v for v in inner.inputs]
        cell.d_children = [[new if v is old else v for v in slot] for slot in cell.d_children]
        cell.d_free = {i: new if v is old else v for i, v in cell.d_free.items()}


@contextmanager
def named_for_messages(node, cells):
    """The cells' word ids named after the user's input while the cells lower
    (a gather's error names them): a tree's words are `trees_words`' rows; a
    sequence step's ids are its rows."""
    spec = node.attrs["spec"]
    name = "step_rows" if spec.sequences else node.inputs[1].name
    saved = [(cell.words, cell.words.name) for cell in cells]
    for cell in cells:
        cell.words.name = name
    try:
        yield
    finally:
        for words, old in saved:
            words.name = old


def inspector_lines(ctx, node, scope):
    """The inspector of a recursive op (or of its gradient): the schedule (the
    batch checked, nodes numbered by height) and the word ids in row order.
    Returns (schedule variable, a pointer to the words in row order, lines).
    A sequence's step reads its node id as its word: the schedule's order."""
    spec = node.attrs["spec"]
    sched = scope.name("schedule")
    what = ctx.string(f"recurse over '{node.inputs[0].name}' ({node.loc.short if node.loc else ''})")
    if spec.sequences:
        lengths = node.inputs[0]
        schedule = Call("dg::schedule_sequences", [ctx.read(lengths), Named("count", ctx.size(lengths.shape[0])),
                                                   Named("steps", ctx.size(spec.steps)),
                                                   Named("reverse", "true" if spec.reverse else "false"), what])
        return sched, f"{sched}.order.data()", [Declare("const dg::LevelSchedule", sched, init=schedule)]
    children, words, roots = node.inputs[:3]
    nodes, count = children.shape[0], roots.shape[0]
    sorted_words = scope.name("sorted_words")
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


def pack_loop_weights(ctx, scope, cell, looped) -> list:
    """Code motion for the level loop's products: a matmul whose right operand is
    defined before the loop (a weight) reads it packed once (dg::PackedB) instead
    of packing it again at every level; a product by its transpose (the gradient
    loop's d_gates @ u^T) gets a PackedB of the transpose. Only where the target's
    runtime has it. Returns the declarations; ctx.loop.packed holds them while the loop lowers."""
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
        if id(b) in inside or key in ctx.loop.packed or id(b) not in ctx.place or b.rank != 2 or ctx.keeps_packed(b):
            continue  # (a parameter the Model keeps packed is read through that)
        name = scope.name(f"{b.name}_t_packed" if tb else f"{b.name}_packed")
        rows, cols = (ctx.size(d) for d in b.shape)
        k, width = (cols, rows) if tb else (rows, cols)
        lines.append(Declare("const dg::PackedB", name, [Named("tb", "true" if tb else "false"), Named("K", k),
                                                          Named("N", width), ctx.read(b), Named("ldb", cols)]))
        ctx.loop.packed[key] = name
    return lines


def width(v) -> object:
    """Floats per row of a [rows, ...] value."""
    return numel(v.shape[1:])
