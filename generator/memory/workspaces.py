"""A call's workspace: the fixed-size pieces one call of a user's function makes and reads only itself.

A function the model calls more than once becomes one C++ function (codegen/outline.py).
The pieces of the arena that one call (its forward lines, or its gradient's) declares, that
no line outside the call reads and whose size does not grow with the batch (its
convolutions' column matrices) are planned as one block, the call's workspace, which the
function is passed as one pointer (`work`) instead of one each. Inside it each piece sits
at 0 or where an earlier piece ends, the same choice in every call, the lowest that is clear
of the pieces live with it for every call: pieces that live at different times share their
place, and the function can say each one's offset in its own sizes. The planner places the
block once but checks each piece against what lives beside it (planner.py: the block's
parts). The batch-sized pieces stay blocks of their own: one rigid block of several
activations finds no hole where each of them finds one (docs/ARCHITECTURE.md).
"""

from __future__ import annotations

import sympy

from ..codegen.plan import ArenaDecl, GradientDecl
from ..codegen.stmt import nested_lines
from .buffer import Buffer
from .frames import call_name, fresh, readers
from .liveness import statement_groups
from .sizes import Size, from_expr


def call_workspaces(project, live, taken: set, framed: set) -> list:
    """The workspaces (Buffers of kind "work" whose `members` may share places, each with
    its `frame_start`) of the calls of functions called more than once, where every call's
    pieces can be placed alike; `framed`: ids of buffers already in a call's frame."""
    tail = [o.read for o in project.outputs]
    if project.train is not None:
        tail += [project.train.loss_read] + list(project.train.copies)
    read = readers(statement_groups(project), tail, live)  # who reads each piece (0: the call's end)
    shared = {id(b.inplace_of) for b in live.buffers if b.inplace_of is not None}
    groups: dict = {}
    for key, statements in _runs(project):
        groups.setdefault(key, []).append(statements)
    variants: dict = {}  # the calls of one function whose workspaces have as many pieces (a variant)
    for key, runs in groups.items():
        for statements in runs:
            members = _members(statements, read, shared, framed)
            variants.setdefault((key, False, len(members)), []).append((statements, members))
            places = _gradient_places(statements, read, framed)
            variants.setdefault((key, True, len(places)), []).append((statements, places))
    out = []
    for (key, gradients, count), found in variants.items():
        if len(found) < 2 or count < 2:
            continue
        runs, lists = [f[0] for f in found], [f[1] for f in found]
        if len({b.phase for m in lists for b in m}) != 1:
            continue
        starts = _inner_layout(lists)
        if starts is None:
            continue
        for statements, members, at in zip(runs, lists, starts):
            call = statements[0].call
            kind = "again_" if key[3] else "backward_" if key[0] == "backward" else ""
            kind = "gradients_" if gradients else kind
            name = fresh(f"{call_name(call, key[1], call.call_id)}_{kind}work", taken)
            top = at[0] + from_expr(members[0].size, at[0].symbols)
            for b, start in zip(members, at):
                top = top.max(start + from_expr(b.size, start.symbols))
                b.frame_start = start.expr()
            frame = Buffer(name, top.expr(), min(b.first for b in members), max(b.last for b in members),
                           members[0].phase, label=f"what {call.call_text} uses inside", members=tuple(members),
                           kind="work")
            out.append(frame)
    return out


def _runs(project) -> list:
    """((part, the user's function, call, made again), statements) of each run of consecutive
    statements from one call, forward and backward."""
    lists = [("forward", project.statements)]
    if project.train is not None:
        lists.append(("backward", project.train.backward_statements))
    out = []
    for part, statements in lists:
        previous = None
        for s in statements:
            loc = s.call
            if loc is None or not loc.call_text:
                previous = None
                continue
            key = (part, loc.call_text.split("(", 1)[0], loc.filename, bool(s.again))
            if previous is not None and previous[0] == key and previous[1][0].call.call_id == loc.call_id:
                previous[1].append(s)
            else:
                previous = (key, [s])
                out.append(previous)
    return out


def _members(statements, readers, shared, framed) -> list:
    inside = {id(s) for s in statements}
    found = [d.buffer for s in statements for line in s.lines for d in nested_lines(line)
             if isinstance(d, ArenaDecl) and not isinstance(d, GradientDecl)]
    return [b for b in found if id(b) not in framed and b.inplace_of is None and id(b) not in shared
            and b.phase != "gradient" and readers.get(id(b), set()) <= inside
            and not sympy.sympify(b.size).free_symbols]


def _gradient_places(statements, readers, framed) -> list:
    """The places of the parameters' gradients a call writes (GradientDecl) while train_step()
    frees them (phase "gradient": kept gradients are the Model's members), each read by its
    update in the call only: a second workspace of the call, of the gradient phase."""
    inside = {id(s) for s in statements}
    found = [d.buffer for s in statements for line in s.lines for d in nested_lines(line)
             if isinstance(d, GradientDecl)]
    return [b for b in found if id(b) not in framed and b.inplace_of is None and b.phase == "gradient"
            and readers.get(id(b), set()) <= inside and not sympy.sympify(b.size).free_symbols]


def _inner_layout(lists: list) -> list | None:
    """Each call's members' starts in its workspace (memory.sizes.Size), or None: member i
    goes at 0 or at the end of an earlier member, the same choice in every call, the lowest
    (at a typical size, in the first call) that is clear of every earlier member live with
    it, for every size, in every call."""
    symbols = tuple(sorted({s for m in lists for b in m for s in sympy.sympify(b.size).free_symbols}, key=str))
    sizes = [[from_expr(b.size, symbols) for b in members] for members in lists]
    zero = Size.const(0, symbols)
    starts = [[] for _ in lists]

    def end_of(r, c):  # where a piece on top of member c starts (c = -1: the bottom)
        return zero if c < 0 else starts[r][c] + sizes[r][c]

    def clear(r, i, at):
        members, end = lists[r], at + sizes[r][i]
        for j in range(i):
            if members[j].first <= members[i].last and members[i].first <= members[j].last:
                if not (at.dominates(end_of(r, j)) or starts[r][j].dominates(end)):
                    return False
        return True

    for i in range(len(lists[0])):
        options = sorted([-1] + list(range(i)), key=lambda c: (end_of(0, c).typical(), c))
        choice = next((c for c in options if all(clear(r, i, end_of(r, c)) for r in range(len(lists)))), None)
        if choice is None:
            return None
        for r in range(len(lists)):
            starts[r].append(end_of(r, choice))
    return starts

