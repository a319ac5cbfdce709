"""Booleans and data-dependent control flow in the DSL: comparisons (the Python
operators `<`, `<=`, `>`, `>=`, `==`, `!=` on tensors), `logical_and/or/not`,
`where`, and `cond`.

`cond(pred, then_fn, else_fn, *operands)` runs, for each example n, then_fn on
example n's operands where pred[n] is true and else_fn where it is false. By
default (the rule: docs/ARCHITECTURE.md, "dg.cond compacts") each branch is
traced once as a cell and runs as one batched block over the examples that take
it, listed by index (ops/cond.py), forward and backward. With compact=False both
branches are traced once, on the whole batch, and their results are selected per
example with `where` (masking: "dg.cond masks"): no data-dependent sizes; the
gradient reaches each branch only on its own examples (where's gradient is 0 on
the other side)."""

from __future__ import annotations

import math
import numbers

import sympy

from .builder import Tensor, current
from .dsl import concat, gather, reshape, slice_axis, sum as _sum
from .recursion import build_recursion
from ..errors import ModelError
from ..ir.graph import Value, outer_reads
from ..ir.shapes import fmt_shape, same
from .source import user_loc
from ..ops import ARGS as _ARGS
from ..ops.cond import Branch, CondSpec

__all__ = ["logical_and", "logical_or", "logical_not", "where", "cast", "cond", "while_loop"]

_OPERATOR = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_LABEL = {"lt": "less", "le": "less_equal", "gt": "greater", "ge": "greater_equal", "eq": "equal", "ne": "not_equal"}


def _number(x, what):
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        if not math.isfinite(float(x)) or abs(float(x)) > 3.4028234663852886e38:
            raise ModelError(f"{what}: the number must be a finite float32, got {x!r}", user_loc(), what)
        return float(x)
    return None


def _compare(cmp, a, b):
    if isinstance(b, Tensor):
        return current().add("compare", [a, b], {"cmp": cmp}, label=_LABEL[cmp])[0]
    value = _number(b, _LABEL[cmp])
    if value is None:
        return NotImplemented  # `x == None` and the like: Python's own answer
    return current().add("compare", [a], {"cmp": cmp, "value": value}, label=_LABEL[cmp])[0]


for _cmp, _name in (("lt", "__lt__"), ("le", "__le__"), ("gt", "__gt__"), ("ge", "__ge__"), ("eq", "__eq__"), ("ne", "__ne__")):
    setattr(Tensor, _name, lambda a, b, cmp=_cmp: _compare(cmp, a, b))
Tensor.__hash__ = object.__hash__  # a Tensor is still a dict key (by identity) with == defined


def _bools(what, *xs):
    for x in xs:
        if not isinstance(x, Tensor):
            raise ModelError(f"{what} takes bool tensors (comparisons' results), got {x!r}", user_loc(), what)


def logical_and(a, b, name=None) -> Tensor:
    """a and b elementwise (bool tensors, numpy broadcasting)."""
    _bools("logical_and", a, b)
    return current().add("logical", [a, b], {"fn": "and"}, label="logical_and", name=name)[0]


def logical_or(a, b, name=None) -> Tensor:
    """a or b elementwise (bool tensors, numpy broadcasting)."""
    _bools("logical_or", a, b)
    return current().add("logical", [a, b], {"fn": "or"}, label="logical_or", name=name)[0]


def logical_not(a, name=None) -> Tensor:
    """not a elementwise (a bool tensor)."""
    _bools("logical_not", a)
    return current().add("logical", [a], {"fn": "not"}, label="logical_not", name=name)[0]


Tensor.__and__ = lambda a, b: logical_and(a, b)
Tensor.__or__ = lambda a, b: logical_or(a, b)
Tensor.__invert__ = lambda a: logical_not(a)


def where(condition, a, b, name=None) -> Tensor:
    """cond ? a : b elementwise, numpy broadcasting; a and b are float32 tensors or
    numbers. The gradient flows to a where cond holds and to b where it does not."""
    if not isinstance(condition, Tensor):
        raise ModelError(f"where's condition must be a bool tensor, got {condition!r}", user_loc(), "where")
    tensors, values = [condition], []
    for x in (a, b):
        if isinstance(x, Tensor):
            tensors.append(x)
            values.append(None)
        else:
            value = _number(x, "where")
            if value is None:
                raise ModelError(f"where's operands must be tensors or numbers, got {x!r}", user_loc(), "where")
            values.append(value)
    return current().add("where", tensors, {"values": tuple(values)}, label="where", name=name)[0]


def cast(x, dtype, name=None) -> Tensor:
    """x's values as `dtype` ("float32" or "int64"), element by element: a float32 to
    int64 truncates toward zero (numpy's astype), a bool is 0 or 1. No gradient."""
    if not isinstance(x, Tensor):
        raise ModelError(f"cast takes a tensor, got {x!r}", user_loc(), "cast")
    return current().add("cast", [x], {"dtype": dtype}, label="cast", name=name)[0]


def _flat(result, what, branch):
    """A branch's result as a list of tensors (one tensor, or a tuple/list of them)."""
    items = list(result) if isinstance(result, (tuple, list)) else [result]
    if not items or not all(isinstance(t, Tensor) for t in items):
        raise ModelError(f"{what}: {branch} must return a tensor or a tuple of tensors, got {result!r}", user_loc(), what)
    return items


def _examples_words(examples, loc):
    """cond(examples=(then_words, else_words)): the words after "the examples" that the
    generated comments use for each branch's examples ("still running after layer 2")."""
    if examples is None:
        return "", ""
    if (not isinstance(examples, (tuple, list)) or len(examples) != 2
            or not all(isinstance(w, str) and w.strip() and w.isprintable() for w in examples)):
        raise ModelError("examples must be two phrases (then_fn's examples, else_fn's) such as "
                         f"('still running after layer 2', 'that exited by layer 2'), got {examples!r}", loc, "cond")
    return tuple(w.strip() for w in examples)


def cond(pred, then_fn, else_fn, *operands, compact=None, examples=None):
    """Per example n: then_fn(operands)[n] where pred[n], else else_fn(operands)[n].

    pred is bool [N]; every operand and every result of both branches has the batch
    N first; the branches return the same structure (a tensor or a tuple) of the same
    shapes. Compaction (compact=True, and the rule's choice with None whenever every
    operand is float32): each branch is traced once as a cell and runs as one batched
    block over the examples that take it, listed by index (ops/cond.py); its rows must
    not depend on each other (as a recursive cell's). Masking (compact=False): both
    branches run on the whole batch and the results are selected with where (see the
    module's docstring). Both train. `examples`, two phrases such as ("still running
    after layer 2", "that exited by layer 2"), says in the generated code's comments which
    examples take each branch. Returns what the branches return."""
    loc = user_loc()
    said = _examples_words(examples, loc)
    if compact is not None and not isinstance(compact, bool):
        raise ModelError(f"compact must be True, False or None (the rule decides), got {compact!r}", loc, "cond")
    if not isinstance(pred, Tensor) or pred.dtype != "bool" or pred.ndim != 1:
        got = pred.value.type_str() if isinstance(pred, Tensor) else repr(pred)
        raise ModelError(f"pred must be a bool tensor [N] (one per example, e.g. x.sum(1) > 0), got {got}", loc, "cond")
    if not callable(then_fn) or not callable(else_fn):
        raise ModelError("cond(pred, then_fn, else_fn, *operands): then_fn and else_fn must be functions", loc, "cond")
    batch = pred.shape[0]
    for i, x in enumerate(operands):
        if not isinstance(x, Tensor):
            raise ModelError(f"operand {i} must be a tensor, got {x!r}", loc, "cond")
        if x.ndim == 0 or not same(x.shape[0], batch):
            raise ModelError(f"operand '{x.name}' {fmt_shape(x.shape)} must have the batch first, "
                             f"like pred '{pred.name}' {fmt_shape(pred.shape)}", loc, "cond")
    # The rule (docs/ARCHITECTURE.md, "dg.cond compacts"): compaction, unless asked for
    # masking or an operand is not float32 (the blocks move float rows only).
    if compact or (compact is None and all(x.dtype == "float32" for x in operands)):
        return _compacted(pred, then_fn, else_fn, operands, loc, said)
    then_out = then_fn(*operands)
    else_out = else_fn(*operands)
    single = not isinstance(then_out, (tuple, list))
    taken, other = _flat(then_out, "cond", "then_fn"), _flat(else_out, "cond", "else_fn")
    if len(taken) != len(other) or single != (not isinstance(else_out, (tuple, list))):
        raise ModelError(f"then_fn returns {len(taken)} tensor(s) and else_fn {len(other)}: they must return the same structure",
                         loc, "cond")
    b = current()
    results = []
    for k, (t, e) in enumerate(zip(taken, other)):
        if t.dtype != "float32" or e.dtype != "float32":
            raise ModelError(f"result {k} of the branches must be float32, got '{t.name}' {t.dtype} and '{e.name}' {e.dtype}",
                             loc, "cond")
        if len(t.shape) != len(e.shape) or not all(same(x, y) for x, y in zip(t.shape, e.shape)):
            raise ModelError(f"result {k} of the branches differs in shape: then_fn's '{t.name}' {fmt_shape(t.shape)}, "
                             f"else_fn's '{e.name}' {fmt_shape(e.shape)}", loc, "cond")
        if t.ndim == 0 or not same(t.shape[0], batch):
            raise ModelError(f"result {k} of the branches, '{t.name}' {fmt_shape(t.shape)}, must have the batch "
                             f"{fmt_shape((batch,))} first (one row per example)", loc, "cond")
        # pred [N] against [N, ...]: one flag per example, as [N, 1, ...].
        flags = pred if t.ndim == 1 else _per_example(pred, t.ndim)
        attrs = {"values": (None, None), "cond": True}  # dg.cond's selection (the C++ says so)
        if said[0]:
            attrs["said"] = said
        results.append(b.add("where", [flags, t, e], attrs, label="where")[0])
    return results[0] if single else tuple(results)


def _compacted(pred, then_fn, else_fn, operands, loc, said):
    """cond(compact=True): each branch traced once as a cell over `rows` rows (the
    examples that take it), into one `cond` node (ops/cond.py)."""
    b = current()
    batch = pred.shape[0]
    for x in operands:
        if x.dtype != "float32":
            raise ModelError(f"a compacted cond takes float32 operands, got '{x.name}' {x.dtype}", loc, "cond")
    branches, structure, users = [], [], {}

    def shown(t):
        """The user's name of a branch's value: an operand's own name for its rows."""
        return users.get(id(t.value), t.name)

    for side, fn in (("then", then_fn), ("else", else_fn)):
        rows = sympy.Symbol(b.names.unique(f"{side}_rows"), integer=True, nonnegative=True)
        places = [Value(b.names.unique(f"{side}_{x.name}"), "float32", (rows,) + tuple(x.shape[1:]), kind="cell",
                        explicit=True) for x in operands]
        users.update({id(p): x.name for p, x in zip(places, operands)})
        b.operand_rows += [(p, x.value, f"{side}_") for p, x in zip(places, operands)]
        start = len(b.graph.nodes)
        result = fn(*[Tensor(p) for p in places])
        nodes = b.graph.nodes[start:]
        del b.graph.nodes[start:]
        b.regions.append((nodes, f"{side}_"))
        structure.append(not isinstance(result, (tuple, list)))
        outs = _flat(result, "cond", f"{side}_fn")
        for k, t in enumerate(outs):
            if t.dtype != "float32" or t.ndim == 0 or not same(t.shape[0], rows):
                raise ModelError(f"result {k} of {side}_fn, '{shown(t)}' {_as_batch(t.shape, rows, batch)} {t.dtype}, "
                                 f"must be float32 with the batch {fmt_shape((batch,))} first (one row per example)",
                                 loc, "cond")
        branches.append(Branch(side, rows, places, nodes, [t.value for t in outs], said[len(branches)]))
    then, other = branches
    if len(then.outputs) != len(other.outputs) or structure[0] != structure[1]:
        raise ModelError(f"then_fn returns {len(then.outputs)} tensor(s) and else_fn {len(other.outputs)}: they must "
                         "return the same structure", loc, "cond")
    for k, (t, e) in enumerate(zip(then.outputs, other.outputs)):
        if len(t.shape) != len(e.shape) or not all(same(x, y) for x, y in zip(t.shape[1:], e.shape[1:])):
            raise ModelError(f"result {k} of the branches differs in shape: then_fn's '{users.get(id(t), t.name)}' "
                             f"{_as_batch(t.shape, then.rows, batch)}, else_fn's '{users.get(id(e), e.name)}' "
                             f"{_as_batch(e.shape, other.rows, batch)}", loc, "cond")
    free = []
    for branch in branches:
        inside = {id(p) for p in branch.operands} | {id(v) for n in branch.nodes for v in n.outputs}
        # (An outer value read row by row against the block fails its op's shape check: rows vs N.)
        for v in outer_reads(branch.nodes, inside):
            if all(v is not f for f in free):
                free.append(v)
    spec = CondSpec((then, other), len(operands), free)
    results = b.add("cond", [pred, *operands, *[Tensor(v) for v in free]], {"spec": spec}, label="cond")
    return results[0] if structure[0] else tuple(results)


def _per_example(pred, rank, label="then_rows"):
    """pred [N] as [N, 1, ...] of the given rank: a view, no copy."""
    return current().add("reshape", [pred], {"shape": (pred.shape[0],) + (1,) * (rank - 1)}, label=label)[0]


def _states(state, what, loc):
    items = list(state) if isinstance(state, (tuple, list)) else [state]
    if not items or not all(isinstance(t, Tensor) and t.dtype == "float32" and t.ndim >= 1 for t in items):
        raise ModelError(f"{what} must be a float32 tensor or a tuple of them, each with the batch first, got {state!r}",
                         loc, "while_loop")
    return items


def _as_batch(shape, rows, batch):
    """A cell value's shape as the user sees it: the block's rows shown as the batch."""
    return fmt_shape(tuple(batch if not isinstance(d, int) and d == rows else d for d in shape))


def _named(t: Tensor, name: str) -> Tensor:
    t.value.name = name  # a hint: the model's naming keeps it unique
    return t


def _running_word(cond_fn) -> str:
    """What the generated comments call the examples still iterating: the word after
    `still_` in cond_fn's name (`still_decoding`: "decoding"), else "running"."""
    name = getattr(cond_fn, "__name__", "")
    word = name[len("still_"):] if name.startswith("still_") else ""
    return word if word.isidentifier() and word.replace("_", "").isalpha() else "running"


def while_loop(cond_fn, body_fn, state, max_steps, outputs: bool = False, names=None, compact=None):
    """Per example: while cond_fn(state) holds and fewer than max_steps steps ran,
    state = body_fn(state). Returns (final_state, steps), steps being each example's
    count of iterations as int64 [N]; with outputs=True, also every step's state
    [N, max_steps, ...] (zeros past each example's count), one per component.

    state is a float32 tensor or a tuple of them with the batch first; body_fn
    returns the same structure and shapes, cond_fn returns bool [N]; `names` names
    the state components in the generated code (else the initial tensors' names).
    cond_fn and body_fn are traced once, into the cell of one loop op (the `recurse`
    op over chains of max_steps + 1 rows per example: ops/recurse.py): row 0 holds
    the initial state, row t the state after step t. Each step runs on the examples
    still running only, listed by index (compaction; `compact=False`: on every
    example, masking), and keeps, with where, the new state of those whose cond_fn
    still holds; the loop stops when no example runs (docs/ARCHITECTURE.md,
    "dg.while_loop compacts"; `compact=None` is that rule: compaction). The
    gradient is that loop's reverse over the kept rows."""
    loc = user_loc()
    if not callable(cond_fn) or not callable(body_fn):
        raise ModelError("while_loop(cond_fn, body_fn, state, max_steps): cond_fn and body_fn must be functions",
                         loc, "while_loop")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        raise ModelError(f"max_steps must be a positive int (a symbolic dim is not supported yet), got {max_steps!r}",
                         loc, "while_loop")
    single = not isinstance(state, (tuple, list))
    start = _states(state, "state", loc)
    batch = start[0].shape[0]
    for t in start:
        if not same(t.shape[0], batch):
            raise ModelError(f"state '{t.name}' {fmt_shape(t.shape)} must have the batch {fmt_shape((batch,))} first, "
                             f"like '{start[0].name}' {fmt_shape(start[0].shape)}", loc, "while_loop")
    if compact is not None and not isinstance(compact, bool):
        raise ModelError(f"compact must be True, False or None (the rule decides), got {compact!r}", loc, "while_loop")
    if names is None:
        names = [t.name if t.value.explicit else f"state{k}" for k, t in enumerate(start)]
    names = list(names)
    if len(names) != len(start) or len(set(names)) != len(names) or "running" in names:
        raise ModelError(f"names {names} must name the {len(start)} state tensor(s) once each (not 'running')",
                         loc, "while_loop")
    b = current()
    rows_per = max_steps + 1  # row 0: the initial state; row t: the state after step t
    # The initial state at row 0 of each example's rows, zeros at the rows the loop writes.
    flats = []
    for t, name in zip(start, names):
        rest = tuple(t.shape[1:])
        pad = b.add("fill", [], {"shape": (batch, max_steps) + rest, "value": 0.0}, label=f"{name}_later")[0]
        padded = concat([reshape(t, (batch, 1) + rest), pad], axis=1)
        flats.append(_named(reshape(padded, (batch * rows_per,) + rest), f"{name}_start"))
    every_row = b.add("fill", [], {"shape": (batch,), "value": float(rows_per)}, label="loop_rows")[0]
    lengths = b.add("cast", [every_row], {"dtype": "int64"}, label="rows_per_example")[0]
    cell_rows = {}

    def leaf(words):
        rows = words.shape[0]
        running = b.add("fill", [], {"shape": (rows, 1), "value": 1.0}, label="running")[0]
        return (running,) + tuple(_named(gather(f, words), n) for f, n in zip(flats, names))

    def internal(words, children):
        running_prev, *prev = children[0]
        rows = words.shape[0]
        cell_rows["rows"] = rows
        structure = prev[0] if single else tuple(prev)
        go = cond_fn(structure)
        if not isinstance(go, Tensor) or go.dtype != "bool" or go.ndim != 1 or not same(go.shape[0], rows):
            got = f"{go.dtype}{_as_batch(go.shape, rows, batch)}" if isinstance(go, Tensor) else repr(go)
            raise ModelError(f"cond_fn must return bool [{batch}] (one per example), got {got}", loc, "while_loop")
        was = b.add("compare", [reshape(running_prev, (rows,))], {"cmp": "gt", "value": 0.5}, label="was_running")[0]
        still = b.add("logical", [was, go], {"fn": "and"}, label="still_running")[0]
        new = body_fn(structure)
        if single == isinstance(new, (tuple, list)):
            raise ModelError("body_fn must return the structure of the state (a tensor, or a tuple as long)", loc, "while_loop")
        new = _states(new, "body_fn's result", loc)
        if len(new) != len(prev):
            raise ModelError(f"body_fn returns {len(new)} tensor(s) for a state of {len(prev)}", loc, "while_loop")
        flags, out = {}, []
        for k, (old, n, first) in enumerate(zip(prev, new, start)):
            if len(old.shape) != len(n.shape) or not all(same(x, y) for x, y in zip(old.shape, n.shape)):
                raise ModelError(f"body_fn changes state {k}'s shape: '{first.name}' {fmt_shape(first.shape)} becomes "
                                 f"'{n.name}' {_as_batch(n.shape, rows, batch)}", loc, "while_loop")
            if n.ndim not in flags:
                flags[n.ndim] = still if n.ndim == 1 else reshape(still, (rows,) + (1,) * (n.ndim - 1))
            out.append(_named(b.add("where", [flags[n.ndim], n, old], {"values": (None, None), "loop": True},
                                    label="where")[0], names[k]))
        running = b.add("where", [reshape(still, (rows, 1))], {"values": (1.0, 0.0)}, label="running")[0]
        return (running,) + tuple(out)

    states = build_recursion([lengths], leaf, internal, ["running"] + names, loc, arity=1, batch="examples",
                             child_names=lambda k: [[f"{n}_prev" for n in ["running"] + names]], steps=rows_per,
                             what="while_loop", until=0, compact=True if compact is None else compact,
                             running=_running_word(cond_fn))
    states = [_named(s, f"{n}_by_step") for s, n in zip(states, ["running"] + names)]
    # running [N, rows_per]: 1 where the example ran the step that made the row (row 0: 1);
    # an example's final state is at its last such row.
    running = reshape(states[0], (batch, rows_per))
    after = concat([slice_axis(running, 1, 1, None), b.add("fill", [], {"shape": (batch, 1), "value": 0.0})[0]], axis=1)
    last = _named(running * (1.0 - after), "last_row")
    finals, every = [], []
    for s, t, name in zip(states[1:], start, names):
        rest = tuple(t.shape[1:])
        rows = reshape(s, (batch, rows_per) + rest)
        pick = last if not rest else reshape(last, (batch, rows_per) + (1,) * len(rest))
        finals.append(_named(_sum(rows * pick, 1), f"{name}_final"))
        if outputs:
            ran = running if not rest else reshape(running, (batch, rows_per) + (1,) * len(rest))
            every.append(_named(slice_axis(rows * ran, 1, 1, None), f"{name}_steps"))
    counted = _named(_sum(running, 1) - 1.0, "step_count")
    steps = b.add("cast", [counted], {"dtype": "int64"}, label="steps")[0]
    final = finals[0] if single else tuple(finals)
    if not outputs:
        return final, steps
    return final, steps, (every[0] if single else tuple(every))
