"""A call's frame: what one call of a user's function keeps for its gradient, as one block.

A function the model calls more than once (ResNet's `basic_block`) becomes one C++
function (codegen/outline.py). The pieces of the arena that one call makes and only
the backward pass reads again (its convolutions' outputs, its batch norms' statistics)
live from the call to its gradient, all of them: planned as one block, end to end in
the order the call makes them, they are one pointer the call and its gradient are
passed (`layer1_0_saved`) instead of one each. The block lives as long as the longest
of them, which is how long they live together anyway (from the forward call to the
call's gradient), give or take the gradient's own statements.
"""

from __future__ import annotations

import sympy

from ..codegen.plan import ArenaDecl
from ..codegen.stmt import Read, nested_lines, operands
from .buffer import Buffer


def call_frames(project, live, taken: set) -> list:
    """The frames of the forward pass's calls (Buffers whose `members` are the pieces
    laid end to end), each with two pieces or more; `taken`: names a frame must avoid
    (the names it takes are added)."""
    calls = _calls(project.statements)
    per_function: dict = {}
    for call_id, (function, _) in calls.items():
        per_function.setdefault(function, set()).add(call_id)
    shared = {id(b.inplace_of) for b in live.buffers if b.inplace_of is not None}
    # who reads each piece in the forward pass (0: an output)
    read = readers([project.statements], [o.read for o in project.outputs], live)
    frames = []
    for call_id, (function, statements) in calls.items():
        if len(per_function[function]) < 2:
            continue
        inside = {id(s) for s in statements}
        end = max(p for s in statements for p in s.positions)
        members = [d.buffer for s in statements for line in s.lines for d in nested_lines(line)
                   if isinstance(d, ArenaDecl) and d.buffer.phase == "forward"]
        members = [b for b in members if b.last > end and not read.get(id(b), set()) - inside
                   and b.inplace_of is None and id(b) not in shared]
        if len(members) < 2:
            continue
        name = fresh(f"{call_name(statements[0].call, function, call_id)}_saved", taken)
        size = sympy.Add(*[sympy.sympify(b.size) for b in members])
        frame = Buffer(name, size, min(b.first for b in members), max(b.last for b in members), "forward",
                       label=f"what {statements[0].call.call_text} keeps for its gradient", members=tuple(members),
                       kind="saved")
        frames.append(frame)
    return frames


def place_members(frames: list) -> None:
    """Each member's offset: its frame's, plus its start in it (a workspace's member: its
    `frame_start`; a frame's: the sizes before it)."""
    for frame in frames:
        at = sympy.sympify(frame.offset)
        for b in frame.members:
            start = at if b.frame_start is None else sympy.sympify(frame.offset) + sympy.sympify(b.frame_start)
            b.offset = sympy.expand(start)
            b.frame = frame
            at = at + sympy.sympify(b.size)


def _calls(statements) -> dict:
    """call_id -> (the user's function, the forward statements of that call)."""
    out: dict = {}
    for s in statements:
        loc = s.call
        if loc is None or not loc.call_text:
            continue
        function = loc.call_text.split("(", 1)[0]
        out.setdefault(loc.call_id, (function, []))[1].append(s)
    return out


def readers(groups, tail, live) -> dict:
    """id(Buffer) -> the ids of the statements of `groups` (lists of statements) whose lines
    read it, and 0 where a line of `tail` (what the call reads at its end) does."""
    out: dict = {}
    for group in groups:
        for s in group:
            for line in s.lines:
                for op in operands(line):
                    if isinstance(op, Read) and id(op.value) in live.buffer_of:
                        out.setdefault(id(live.buffer_of[id(op.value)]), set()).add(id(s))
    for line in tail:
        for op in operands(line):
            if id(op.value) in live.buffer_of:
                out.setdefault(id(live.buffer_of[id(op.value)]), set()).add(0)
    return out


def call_name(loc, function: str, call_id: int) -> str:
    """The name the call was given (`name='layer1_0'`), else the function's with the call's number."""
    for parameter, value in loc.call_args:
        if parameter == "name" and isinstance(value, str) and value.isidentifier():
            return value
    return f"{function}_{call_id}"


def fresh(name: str, taken: set) -> str:
    k, out = 1, name
    while out in taken:
        k += 1
        out = f"{name}_{k}"
    taken.add(out)
    return out
