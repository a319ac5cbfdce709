"""A buffer of the arena: lowering declares one for each float intermediate (an
`ArenaDecl` line holds it), the planner (planner.py) fills in its lifetime and its
offset. A leaf module, so that lowering needs nothing else of the memory stage."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class Buffer:
    name: str
    size: object  # floats, a sympy expression or int
    first: int  # schedule position that writes it
    last: int  # last position that reads it
    phase: str  # forward | loss | backward | gradient (a parameter gradient train_step() may free)
    inplace_of: "Buffer | None" = None  # shares this buffer's block (elementwise in place)
    offset: object = None
    label: str = ""  # the statement, for reports
    printed: str = ""  # the offset in C++ (memory/bases.py: a named region's start + a constant)
    shape: tuple = ()
    members: tuple = ()  # a call's frame (memory/frames.py: the buffers laid end to end in it) or workspace
    kind: str = ""  # a block of members: "saved" (a call's frame) or "work" (its workspace, memory/workspaces.py)
    frame: "Buffer | None" = None  # the frame or workspace this buffer is a member of
    frame_start: object = None  # a workspace member's start in it (sympy), the same in every call
