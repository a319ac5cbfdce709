"""Liveness over the typed lowered code, and what follows from it alone.

Stage `plan_memory` starts here (memory.plan_memory): which schedule position
writes and last reads each value is read off the lines' operands
(codegen/stmt.py), not recorded while lowering ran; a read of a view (an
`Alias`: a reshaped weight) counts as a read of its source. From it come the arena
buffers' positions, the operands an in-place op may share a block with, and the
place of each parameter update (DeepDSL's rescheduling: a parameter is updated
in the statement where its gradient is complete and nothing reads it any more).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codegen.plan import ArenaDecl
from ..codegen.targets import load_target
from ..codegen.stmt import Alias, EarlyUpdate, Gemm, Read, UpdateRows, Write, nested_lines, operands


@dataclass
class Liveness:
    buffers: list  # the arena's memory.Buffers, in declaration order, positions filled in
    in_place_candidates: dict  # buffer name -> [Buffer] it may take the block of
    last_read: dict  # id(value) -> the last position that reads it
    last_write: dict  # id(value) -> the last position that writes it
    statement_at: dict  # position -> the Statement holding that node's lines
    buffer_of: dict  # id(value) -> the arena Buffer holding its data (through aliases)


def statement_groups(plan) -> list:
    groups = [plan.statements]
    if plan.train is not None:
        groups += [plan.train.loss_statements, plan.train.backward_statements]
    return groups


def liveness(plan) -> Liveness:
    decls, root = {}, {}  # id(value) -> its ArenaDecl; id(alias) -> id(value whose data it is)
    last_read, last_write, statement_at = {}, {}, {}

    def visit(line, position):
        for sub in nested_lines(line):
            if isinstance(sub, ArenaDecl):
                decls[id(sub.value)] = sub
                sub.buffer.first = sub.buffer.last = position
            elif isinstance(sub, Alias):
                root[id(sub.value)] = root.get(id(sub.src.value), id(sub.src.value))
        for op in operands(line):
            seen = last_read if isinstance(op, Read) else last_write
            seen[id(op.value)] = max(seen.get(id(op.value), -1), position)
            if isinstance(op, Read) and id(op.value) in root:  # a view's read reads its source's data
                last_read[root[id(op.value)]] = max(last_read.get(root[id(op.value)], -1), position)
            decl = decls.get(root.get(id(op.value), id(op.value)))
            if decl is not None and isinstance(op, Read):
                decl.buffer.last = max(decl.buffer.last, position)

    for group in statement_groups(plan):
        for statement in group:
            for position in statement.positions:
                statement_at[position] = statement
            for line in statement.lines:
                visit(line, line.at)
    # What the call reads once every node has run: the outputs, the loss, the gradient copies.
    tail = [o.read for o in plan.outputs]
    if plan.train is not None:
        tail += [plan.train.loss_read] + plan.train.copies
    for line in tail:
        visit(line, plan.end)

    buffers = [d.buffer for d in decls.values()]
    candidates = {}
    for decl in decls.values():
        if not decl.shares:  # not an in-place op's output
            continue
        b = decl.buffer
        # Not over a buffer the node also reads through an alias (a view's elements are
        # read at other positions than the ones being written).
        aliased = {root[id(u)] for u in decl.shares if id(u) in root}
        candidates[b.name] = [decls[id(u)].buffer for u in decl.shares
                              if id(u) in decls and id(u) not in root and id(u) not in aliased
                              and tuple(u.shape) == tuple(decl.value.shape)
                              and decls[id(u)].buffer.phase == b.phase]
    buffer_of = {v: decls[root.get(v, v)].buffer for v in set(root) | set(decls) if root.get(v, v) in decls}
    return Liveness(buffers, candidates, last_read, last_write, statement_at, buffer_of)


def place_updates(plan, live: Liveness):
    """Move each parameter update whose gradient is complete, and whose parameter
    is no longer read, inside the backward pass into that statement; the rest run
    after the gradient copies. An update reads the gradient where the backward pass
    left it, so that buffer lives until then (a gradient train_step() does not keep
    is freed once its update has consumed it)."""
    if plan.train is None:
        return
    target = load_target(plan.target)  # what its runtime can do, not its name
    backward = {id(s) for s in plan.train.backward_statements}
    remaining = []
    for u in plan.train.updates:
        ready = max(live.last_write.get(id(u.grad_value), -1), live.last_read.get(id(u.param_value), -1))
        statement = live.statement_at.get(ready)
        held = live.buffer_of.get(id(u.grad_value))
        if u.after_copies or statement is None or id(statement) not in backward:
            remaining.append(u)
            if held is not None:
                held.last = max(held.last, plan.end)
            continue
        if held is not None:  # the update runs after the statement's other lines
            held.last = max(held.last, max(statement.positions))
        u.call.at = ready
        product = _fuse_into_product(statement, u, plan.kernels) if target.update_rows else None
        early = EarlyUpdate(u.index, u.call, report=target.early_ready, at=ready, fused=product is not None)
        statement.lines.append(early)  # train_step's comment says why it runs here
    plan.train.updates = remaining


def _fuse_into_product(statement, u, kernels):
    """Hand update `u` to the GEMM of `statement` that writes the whole gradient, as
    its row-block epilogue (stmt.UpdateRows), where that changes nothing but the
    memory traffic: the GEMM takes no epilogue already and does not read the
    parameter, and no later line of the statement reads or writes the parameter
    or the gradient (the update then runs before them). Returns the GEMM's index
    in the statement's lines, or None where it is not fused."""
    lines = statement.lines
    for i, line in enumerate(lines):
        if not isinstance(line, Gemm) or line.epilogue:
            continue
        writes = [op for op in operands(line.args) if isinstance(op, Write)]
        if len(writes) != 1 or writes[0].value is not u.grad_value:
            continue
        shape = tuple(u.param_value.shape)
        if len(shape) != 2 or tuple(u.grad_value.shape) != shape:
            return None
        if any(op.value is u.param_value for op in operands(line.args)):
            return None
        later = [op.value for op in operands(lines[i + 1:])]
        if any(v is u.param_value or v is u.grad_value for v in later):
            return None
        line.args.append(UpdateRows(str(line.n.arg), u.rows_call, u.arrays))
        if u.rows_kernel not in kernels:
            kernels.append(u.rows_kernel)
        return i
    return None
