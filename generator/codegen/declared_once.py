"""A constant declared again with the same arguments in one function is declared once.

Lowering declares a convolution's geometry beside each call that takes it
(`const dg::Conv2dGeom conv1_geom(/*N=*/N, /*C=*/3, ...);`), and the forward
convolution, its input gradient and its weight gradient take the same one. Once the
code is in its functions (codegen/outline.py), a declaration of a constant equal to an
earlier one of the same function (the same type, the same arguments, sizes only, and the
same thing described: the convolution's weight, `Declare.of`) is dropped and what read it
reads the first: each convolution's geometry is printed once, named after it (`conv1_geom`),
and two convolutions of one shape keep one each.
"""

from __future__ import annotations

from .stmt import Call, Declare, Named


def declare_once(statement_lists: list) -> None:
    """Drop, in place, the repeated constants of one function's body (its statements,
    in the order they run, given as one or more lists), renaming their uses."""
    first: dict = {}  # (type, arguments) -> the name declared first
    renames: dict = {}
    for statements in statement_lists:
        for s in statements:
            kept = []
            for line in s.lines:
                if _constant(line):
                    key = (line.type, line.of, tuple(str(a) for a in line.args))
                    if key in first:
                        renames[line.name] = first[key]
                        continue
                    first[key] = line.name
                kept.append(_renamed(line, renames))
            s.lines = kept


def _constant(line) -> bool:
    """`const T name(sizes...);` that says what it describes (`of`): a value made from sizes
    only, the same wherever it is made."""
    return (isinstance(line, Declare) and bool(line.of) and line.type.startswith("const ") and line.init is None
            and bool(line.args)
            and all(isinstance(a, Named) for a in line.args))


def _renamed(line, renames: dict):
    if renames and isinstance(line, Call):
        line.args = [_arg(a, renames) for a in line.args]
    return line


def _arg(a, renames: dict):
    if isinstance(a, str):
        return renames.get(a, a)
    if isinstance(a, Named) and isinstance(a.arg, str) and a.arg in renames:
        return Named(a.name, renames[a.arg])
    return a
