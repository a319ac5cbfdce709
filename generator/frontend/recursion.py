"""Recursive models in the DSL: a cell written once for leaves and once for
internal nodes, applied over a batch of trees or DAGs.

    trees = dg.trees("trees", arity=2)
    h, c = dg.recurse(trees, leaf=leaf_cell, internal=internal_cell, names=("h", "c"))

`leaf(words)` gets the word ids of a block of leaves, `internal(words, children)`
those of a block of internal nodes and, for each child slot k, a tuple of the
children's states (zeros for empty slots: a child-sum cell just adds the slots).
Both return the node's state as a tuple of float32 tensors whose first dimension
is the block's row count. The cells are traced once into sub-graphs of one
`recurse` node (generator/ops/recurse.py), which the generated C++ runs as one
batched step for all leaves and one per tree level.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass, field

import sympy

from . import dsl
from .builder import Tensor, current
from ..errors import ModelError
from ..ir.graph import Value, outer_reads
from ..ir.shapes import dim, same
from .source import user_loc


@dataclass
class Trees:
    """A batch of trees (or DAGs) given to the model as three int64 inputs."""

    name: str
    children: Tensor  # [nodes, arity]
    words: Tensor  # [nodes]
    roots: Tensor  # [count]
    arity: int
    dag: bool


def trees(name: str, arity: int, dag: bool = False, nodes=None, count=None) -> Trees:
    """Declare a batch of trees: inputs `<name>_children` [nodes, arity],
    `<name>_words` [nodes] and `<name>_roots` [count] (int64). With dag=True a
    node may have several parents (DAG-RNN); cycles are errors either way."""
    loc = user_loc()
    if not isinstance(arity, int) or isinstance(arity, bool) or arity < 1:
        raise ModelError(f"arity must be a positive int, got {arity!r}", loc, "trees")
    nodes = nodes if nodes is not None else dim(f"{name}_nodes")
    count = count if count is not None else dim(f"{name}_count")
    return Trees(
        name,
        dsl.input(f"{name}_children", (nodes, arity), dtype="int64"),
        dsl.input(f"{name}_words", (nodes,), dtype="int64"),
        dsl.input(f"{name}_roots", (count,), dtype="int64"),
        arity,
        bool(dag),
    )


@dataclass
class Cell:
    """A traced cell: placeholders in, nodes, state values out."""

    words: Value
    children: list  # [[Value per state component] per child slot]; empty for the leaf cell
    nodes: list
    outputs: list
    free: list = field(default_factory=list)  # outer values the nodes read (parameters...)


@dataclass
class RecurseSpec:
    arity: int
    dag: bool
    rows: sympy.Symbol  # the row count of a block: all leaves, or one level
    state: list  # [(name, shape without the row dimension)]
    leaf: Cell
    internal: Cell
    free: list  # outer values either cell reads, in the order they are node inputs
    batch: str = ""  # the name given to dg.trees (its inputs are <batch>_children, ...)
    # Internal-cell values a training graph's forward loop keeps for the gradient's
    # (its level GEMMs' results): extra outputs of the op, [nodes, ...] in schedule order.
    kept: list = field(default_factory=list)
    # A batch of padded sequences (frontend/sequences.py) instead of trees: its
    # padded length (nodes are count * steps), and whether the chains run backwards.
    steps: object = None
    reverse: bool = False
    # A while loop's chains (frontend/control.py): the state component whose rows are 1
    # where the chain still runs; the time loop stops once no row of the previous step is.
    until: int | None = None
    # A while loop's step runs on the examples still running only, listed by index
    # (compaction), instead of on every example with the stopped ones masked.
    compact: bool = False
    running: str = "running"  # how the generated comments call the chains still running ("decoding")

    @property
    def sequences(self) -> bool:
        return self.steps is not None

    @property
    def prefixes(self) -> tuple:
        """What tells the two cells' values apart in the generated names: leaf_h beside
        node_h for trees, first_h (the first time step's) beside step_h for sequences."""
        return cell_prefixes(self.sequences)

    @property
    def nb(self) -> int:
        """How many of the op's inputs describe the batch: (children, words, roots)
        of trees, (lengths,) of sequences; the free values follow them."""
        return 1 if self.sequences else 3


def cell_prefixes(sequences: bool) -> tuple:
    """(the first cell's prefix, the other cell's): trees' leaves and internal nodes, or
    sequences' first time steps and later steps."""
    return ("first_", "step_") if sequences else ("leaf_", "node_")


def _placeholder(builder, base, dtype, shape):
    return Value(builder.names.unique(base), dtype, tuple(shape), kind="cell", explicit=True)


def _trace(builder, fn, args, what, loc, prefix):
    """Run a cell function; returns (its nodes, its state Values)."""
    start = len(builder.graph.nodes)
    result = fn(*args)
    nodes = builder.graph.nodes[start:]
    del builder.graph.nodes[start:]
    if isinstance(result, Tensor):
        result = (result,)
    if not isinstance(result, (tuple, list)) or not result or not all(isinstance(t, Tensor) for t in result):
        raise ModelError(f"the {what} cell must return a Tensor or a tuple of Tensors, got {result!r}", loc, "recurse")
    # Named when the model is finished, after the user's variables with a prefix
    # that tells the cells apart: leaf_i (leaf cell) beside node_i (internal cell),
    # first_i beside step_i (a sequence's first time step and the later ones).
    builder.regions.append((nodes, prefix))
    return nodes, [t.value for t in result]


def _children_names(fn, arity: int, count: int):
    """The names the internal cell unpacks its children into, when it does so in
    one statement `(h_l, c_l), (h_r, c_r) = children`: [[h_l, c_l], [h_r, c_r]];
    else None (the placeholders are then child0_h, ...)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    func = tree.body[0] if tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.Lambda)) or len(func.args.args) < 2:
        return None
    param = func.args.args[1].arg

    def slot_names(slot):
        if count == 1 and isinstance(slot, ast.Name):
            return [slot.id]
        if isinstance(slot, (ast.Tuple, ast.List)) and len(slot.elts) == count:
            if all(isinstance(e, ast.Name) for e in slot.elts):
                return [e.id for e in slot.elts]
        return None

    for node in ast.walk(func):
        if (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.value, ast.Name)
                and node.value.id == param and isinstance(node.targets[0], (ast.Tuple, ast.List))
                and len(node.targets[0].elts) == arity):
            slots = [slot_names(slot) for slot in node.targets[0].elts]
            flat = [n for s in slots if s for n in s]
            if all(slots) and len(set(flat)) == len(flat):
                return slots
    return None


def _free_values(cell: Cell) -> list:
    inside = {id(cell.words)} | {id(v) for slot in cell.children for v in slot}
    inside |= {id(v) for n in cell.nodes for v in n.outputs}
    return outer_reads(cell.nodes, inside)


def recurse(trees: Trees, leaf, internal, names=None):
    """States of every node, in the caller's node numbering: one [nodes, ...] tensor
    per state component (see the module docstring)."""
    loc = user_loc()
    if not isinstance(trees, Trees):
        raise ModelError(f"recurse needs a batch declared with dg.trees(...), got {trees!r}", loc, "recurse")
    return build_recursion([trees.children, trees.words, trees.roots], leaf, internal, names, loc,
                           arity=trees.arity, dag=trees.dag, batch=trees.name,
                           child_names=lambda count: _children_names(internal, trees.arity, count))


def build_recursion(batch_inputs, leaf, internal, names, loc, *, arity, dag=False, batch="", child_names=None,
                    steps=None, reverse=False, what="recurse", until=None, compact=False, running="running"):
    """Trace the two cells into one `recurse` node over `batch_inputs` (a batch of
    trees, or the lengths of padded sequences when `steps` is given); returns its
    state tensors. `child_names(count)` may name the children's placeholders."""
    b = current()
    rows = sympy.Symbol(b.names.unique("rows"), integer=True, nonnegative=True)
    first, later = cell_prefixes(steps is not None)
    leaf_words = _placeholder(b, f"{first}words", "int64", (rows,))
    leaf_nodes, leaf_out = _trace(b, leaf, (Tensor(leaf_words),), "leaf", loc, first)
    for v in leaf_out:
        if v.dtype != "float32" or v.rank < 1 or not same(v.shape[0], rows):
            raise ModelError(
                f"the leaf cell must return float32 states with one row per leaf, got '{v.name}' {v.type_str()}",
                loc, what)
    names = list(names) if names is not None else [f"s{j}" for j in range(len(leaf_out))]
    if len(names) != len(leaf_out):
        raise ModelError(f"names {names} do not match the {len(leaf_out)} state tensors of the leaf cell", loc, what)
    shapes = [tuple(v.shape[1:]) for v in leaf_out]
    node_words = _placeholder(b, f"{later}words", "int64", (rows,))
    user = child_names(len(shapes)) if child_names else None  # ((h_l, c_l), (h_r, c_r)) = children
    children = [
        [_placeholder(b, user[k][j] if user else f"child{k}_{names[j]}", "float32", (rows,) + shapes[j])
         for j in range(len(shapes))]
        for k in range(arity)
    ]
    args = (Tensor(node_words), [tuple(Tensor(v) for v in slot) for slot in children])
    internal_nodes, internal_out = _trace(b, internal, args, "internal", loc, later)
    if len(internal_out) != len(leaf_out) or any(
        v.dtype != "float32" or len(v.shape) != 1 + len(s) or not all(same(a, c) for a, c in zip(v.shape, (rows,) + s))
        for v, s in zip(internal_out, shapes)
    ):
        got = ", ".join(f"'{v.name}' {v.type_str()}" for v in internal_out)
        want = ", ".join(f"[rows, {', '.join(map(str, s))}]" for s in shapes)
        raise ModelError(f"the internal cell must return states shaped like the leaf cell's ({want}), got {got}",
                         loc, what)
    leaf_cell = Cell(leaf_words, [], leaf_nodes, leaf_out)
    internal_cell = Cell(node_words, children, internal_nodes, internal_out)
    leaf_cell.free, internal_cell.free = _free_values(leaf_cell), _free_values(internal_cell)
    free = list(leaf_cell.free)
    free += [v for v in internal_cell.free if all(v is not f for f in free)]
    spec = RecurseSpec(arity, dag, rows, list(zip(names, shapes)), leaf_cell, internal_cell, free, batch,
                       steps=steps, reverse=reverse, until=until, compact=compact, running=running)
    outs = b.add("recurse", list(batch_inputs) + [Tensor(v) for v in free], {"spec": spec})
    return outs[0] if len(outs) == 1 else tuple(outs)


def roots(trees: Trees, state, name=None):
    """The rows of `state` at each tree's root: [count, ...]."""
    return dsl.gather(state, trees.roots, name=name)
