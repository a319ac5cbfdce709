"""A call's frame inside the function it calls (stage `outline`; memory/frames.py plans it).

What a call of a user's function keeps for its gradient is one block of the arena (its
frame), the pieces end to end in the order the call makes them. The function the calls
become takes the block as one pointer (`saved`) and finds each piece in it at an offset
written in the function's own sizes: `float* bn1_mean = saved + C * H * H * N;`. Its
gradient, and what the backward pass makes again of it, take the same block.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import sympy

from .printer import size_expr


@dataclass(eq=False)
class FrameDecl:
    """The caller's pointer to one call's frame: `float* layer1_0_saved = _arena.at(...);`."""

    frame: object  # memory.Buffer with members

    def __str__(self) -> str:
        return f"float* {self.frame.name} = _arena.at({self.frame.printed}, {size_expr(self.frame.size)});"


@dataclass(eq=False)
class FramePiece:
    """A piece of the frame inside the function: `float* conv1 = saved + C * H * H * N;`."""

    name: str
    frame: str  # the function's parameter holding the frame
    offset: str  # C++, in the function's sizes
    written: bool = True

    def __str__(self) -> str:
        const = "" if self.written else "const "
        at = self.frame if self.offset == "0" else f"{self.frame} + {self.offset}"
        return f"{const}float* {self.name} = {at};"


@dataclass
class GradientPiece:
    """A parameter's gradient inside the function: its member while the step keeps gradients,
    else its place in the call's gradient workspace (memory/workspaces.py):
    `float* d_conv1_weight = _gradients.at(d_layer.conv1_weight, gradients_at + 9 * C * C);`."""

    name: str
    member: str  # the gradient struct's field: d_layer.conv1_weight
    frame: str  # the function's parameter holding the workspace's offset in the arena
    offset: str  # C++, in the function's sizes

    def __str__(self) -> str:
        at = self.frame if self.offset == "0" else f"{self.frame} + {self.offset}"
        return f"float* {self.name} = _gradients.at({self.member}, {at});"


def members_by_name(plan) -> dict:
    """name -> the arena buffer of a frame's member (memory/frames.py)."""
    out = {}
    for b in (plan.memory or {}).get("buffers", []):
        for m in getattr(b, "members", ()):
            out[m.name] = m
    return out


def layout(frames: list, sizes: dict, run_sizes: set) -> list | None:
    """The offsets (C++) of one frame slot's members in the function's terms, or None (a
    workspace's too: each member at 0 or where an earlier one ends).

    frames: the frame (memory.Buffer) of each call; sizes: {size parameter: its value in
    each call}; run_sizes: the run-time sizes (N), the same in every call. Each member's
    element count is read off its shape, a dimension at a time: one that is the same in every
    call is itself (a number, or `N`); one that differs is the size parameter with those values."""
    count = {len(f.members) for f in frames}
    if len(count) != 1:
        return None
    by_values = {tuple(int(v) for v in values): name for name, values in sizes.items()
                 if all(re.fullmatch(r"\d+", str(v)) for v in values)}
    values = [{sympy.Symbol(n, positive=True, integer=True): int(v[j]) for n, v in sizes.items()
               if all(re.fullmatch(r"\d+", str(x)) for x in v)} for j in range(len(frames))]
    starts, ends = [], []  # in the function's terms
    for i in range(count.pop()):
        planned = [sympy.expand(sympy.sympify(f.members[i].offset) - sympy.sympify(f.offset)) for f in frames]
        planned = [p.xreplace(_plain(p)) for p in planned]
        # At the frame's start or where an earlier member ends (the one before it, in a frame),
        # the same in every call, as the plan put it.
        at = next((e for e in [sympy.Integer(0)] + ends[::-1]
                   if all(sympy.expand(e.xreplace(values[j]) - planned[j]) == 0 for j in range(len(frames)))), None)
        if at is None:
            return None
        shapes = [tuple(f.members[i].shape) for f in frames]
        if len({len(s) for s in shapes}) != 1:
            return None
        term = _count(list(zip(*shapes)), by_values, run_sizes)
        if term is None:
            return None
        starts.append(at)
        ends.append(at + term)
    return [size_expr(at) if at != 0 else "0" for at in starts]


def _plain(expr) -> dict:
    """The run-time sizes in an offset the plan gave, as the symbols `layout` writes."""
    return {s: sympy.Symbol(str(s), positive=True, integer=True) for s in expr.free_symbols}


def _count(columns: list, by_values: dict, run_sizes: set):
    """A member's element count from its shape's columns (a dimension's value in each call):
    a column the same in every call is itself; a run of columns that differ is the size
    parameter whose values are their product (`C`, or `HW` for `H, W`). None if one is not."""
    term, c = sympy.Integer(1), 0
    while c < len(columns):
        column = columns[c]
        if len(set(map(str, column))) == 1:
            value = column[0]
            if _is_int(value):
                term *= int(value)
            elif str(value) in run_sizes:
                term *= sympy.Symbol(str(value), positive=True, integer=True)
            else:
                return None
            c += 1
            continue
        for end in range(c + 1, len(columns) + 1):
            run = columns[c:end]
            if not all(_is_int(v) for col in run for v in col):
                return None
            product = tuple(int(sympy.prod([int(col[j]) for col in run])) for j in range(len(column)))
            name = by_values.get(product)
            if name is not None:
                term *= sympy.Symbol(name, positive=True, integer=True)
                c = end
                break
        else:
            if not all(_is_int(v) for v in column):
                return None
            found = _product_of(tuple(int(v) for v in column), by_values)  # a column matrix's `9 * C * HW`
            if found is None:
                return None
            term *= found
            c += 1
    return term


def _product_of(values: tuple, by_values: dict):
    """values (one per call) as a constant times a product of up to three size parameters
    (the fewest that do), or None."""
    names = sorted(by_values.items(), key=lambda kv: kv[1])
    for count in (1, 2, 3):
        for combo in itertools.combinations_with_replacement(names, count):
            product = [int(sympy.prod([v[j] for v, _ in combo])) for j in range(len(values))]
            if all(x % p == 0 for x, p in zip(values, product)) and len({x // p for x, p in zip(values, product)}) == 1:
                factor = values[0] // product[0]
                return factor * sympy.prod([sympy.Symbol(n, positive=True, integer=True) for _, n in combo])
    return None


def _is_int(value) -> bool:
    return isinstance(value, int) or getattr(value, "is_Integer", False)
