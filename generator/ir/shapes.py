"""Shapes whose entries are Python ints or sympy expressions in symbolic dims.

A symbolic dim (Nimble's `Any`) is a sympy Symbol such as the batch size `N`;
it becomes a run-time size in the generated code, so one build serves any value.
"""

from __future__ import annotations

import math

import sympy

from ..errors import ModelError
from ..frontend.source import user_loc
from .names import problem_with

Dim = "int | sympy.Expr"


def dim(name: str) -> sympy.Symbol:
    """A symbolic dimension: `N = dg.dim("N")`."""
    problem = problem_with(name)
    if problem:
        raise ModelError(problem, user_loc(), "dg.dim")
    return sympy.Symbol(name, integer=True, nonnegative=True)


def norm_dim(d):
    """An int for concrete sizes, a sympy expression for symbolic ones."""
    if isinstance(d, bool):
        raise TypeError(f"a dimension must be an int or a sympy expression, got {d!r}")
    if isinstance(d, int):
        return d
    if isinstance(d, sympy.Basic):
        d = sympy.sympify(d)
        if d.is_Integer:
            return int(d)
        if not d.free_symbols:
            raise TypeError(f"dimension {d} is not an integer")
        return d
    if hasattr(d, "__index__"):
        return int(d)
    raise TypeError(f"a dimension must be an int or a sympy expression, got {d!r}")


def norm_shape(shape) -> tuple:
    if isinstance(shape, (int, sympy.Basic)):
        shape = (shape,)
    return tuple(norm_dim(d) for d in shape)


def same(a, b) -> bool:
    """Two dims are equal for every value of the symbols."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return sympy.simplify(sympy.sympify(a) - sympy.sympify(b)) == 0


def numel(shape):
    return norm_dim(sympy.expand(math.prod((sympy.sympify(d) for d in shape), start=sympy.Integer(1))))


def fmt_dim(d) -> str:
    return str(d).replace(" ", "")


def fmt_shape(shape) -> str:
    return "[" + ", ".join(fmt_dim(d) for d in shape) + "]"


def broadcast(shapes):
    """numpy broadcasting over ints and symbols; returns the shape or raises ValueError.

    A symbolic dim only broadcasts against itself or 1: `N` against `3` is an error,
    because the model must be valid for every N."""
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + tuple(s) for s in shapes]
    out = []
    for axis in range(rank):
        size = 1
        for s in padded:
            d = s[axis]
            if isinstance(d, int) and d == 1:
                continue
            if isinstance(size, int) and size == 1:
                size = d
            elif not same(size, d):
                raise ValueError(f"axis {axis - rank}: {fmt_dim(size)} vs {fmt_dim(d)}")
        out.append(size)
    return tuple(out)


def normalize_axis(axis: int, rank: int) -> int:
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise ValueError(f"axis must be an int, got {axis!r}")
    if not -rank <= axis < rank:
        raise ValueError(f"axis {axis} is out of range for a tensor of rank {rank}")
    return axis % rank


def bind_dims(shape, actual, bound: dict, bound_by: dict | None = None, name: str | None = None) -> str | None:
    """Match a declared shape against an actual one, binding symbols in `bound`.
    Returns a description of the mismatch, or None. With `bound_by` (symbol ->
    the input that set it) and this input's `name`, a disagreement names both
    inputs, as the generated code does."""
    if len(shape) != len(actual):
        return f"expected rank {len(shape)} {fmt_shape(shape)}, got shape {tuple(actual)}"
    for axis, (d, a) in enumerate(zip(shape, actual)):
        if isinstance(d, int):
            if d != a:
                return f"dimension {axis} must be {d}, got {a} (expected {fmt_shape(shape)}, got {tuple(actual)})"
        else:
            value = d.subs(bound) if d.free_symbols - set(bound) == set() else None
            if value is not None:
                if int(value) != a:
                    setter = bound_by.get(d) if bound_by is not None and isinstance(d, sympy.Symbol) else None
                    if setter is not None:
                        return (
                            f"dimension {axis} is {fmt_dim(d)}, which input '{setter}' set to {int(value)}, "
                            f"but here it is {a} (expected {fmt_shape(shape)}, got {tuple(actual)})"
                        )
                    return f"dimension {axis} is {fmt_dim(d)} = {int(value)}, got {a}"
            elif isinstance(d, sympy.Symbol):
                if a < 1:
                    return (f"dimension {axis} is {fmt_dim(d)}, which must be at least 1 (got {a}); "
                            "memory plans assume every symbolic size is 1 or more")
                bound[d] = a
                if bound_by is not None and name is not None:
                    bound_by[d] = name
            else:
                return f"dimension {axis} ({fmt_dim(d)}) cannot be matched"
    return None


def evaluate(shape, bound: dict) -> tuple:
    return tuple(int(sympy.sympify(d).subs(bound)) if not isinstance(d, int) else d for d in shape)


def contiguous_groups(axes) -> list:
    """Sorted axes as runs of consecutive axes, as (start, stop) pairs:
    [0, 2, 3] -> [(0, 1), (2, 4)]. Reductions handle one run per node."""
    axes = sorted(set(axes))
    groups = []
    for a in axes:
        if groups and groups[-1][1] == a:
            groups[-1] = (groups[-1][0], a + 1)
        else:
            groups.append((a, a + 1))
    return groups


# Limits that keep every size the generated code computes inside int64, and a
# model's parameters inside what a machine could hold (checked at build time).
MAX_ELEMENTS = 2**60  # elements of one tensor: its byte count (x8) still fits int64
MAX_PARAM_ELEMENTS = 2**36  # all parameters together: 256 GiB of float32


def size_problem(shape) -> str | None:
    """Why a tensor of `shape` is too large for the generated code, or None.
    Multiplied in Python's exact integers (no wrap-around), with every symbolic
    size at its least value, 1; larger run-time sizes are checked in C++."""
    smallest = math.prod(_at_least(d) for d in shape)
    if smallest > MAX_ELEMENTS:
        least = " even with every symbolic size 1" if any(not isinstance(d, int) for d in shape) else ""
        return (f"shape {fmt_shape(shape)} has {smallest:.3g} elements{least}, more than the limit of "
                "2**60 (sizes and byte offsets must fit int64)")
    return None


def _at_least(d) -> int:
    if isinstance(d, int):
        return d
    d = sympy.sympify(d)
    return max(int(d.subs({s: 1 for s in d.free_symbols})), 0)
