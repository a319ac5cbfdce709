"""An outlined function's sizes that follow from its others, named once inside it.

A function made from the calls of a user's function (codegen/outline.py) takes each size
that differs between the calls as a parameter: ResNet's block takes `C`, `H`, `HW` (the
plane, 1024 = 32 * 32) and `n` (the elements of an activation, 65536 * N = C * HW * N).
Where a size is, in every call, the product of two of the function's other sizes (times
run-time sizes such as `N`), the calls need not pass it: the function declares it first
thing (`const std::int64_t HW = H * H;`). Each size is derived only from sizes smaller than
it (in the first call), so the declarations form no cycle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import combinations_with_replacement
from math import prod

import sympy


@dataclass
class SizeLine:
    """`const std::int64_t HW = H * H;`"""

    name: str
    expr: str

    def __str__(self) -> str:
        return f"const std::int64_t {self.name} = {self.expr};"


def derive_sizes(sizes: list, run_sizes: set) -> dict:
    """{size name: its C++ expression}, in the order to declare them, for the sizes of
    `sizes` ([(name, each call's value as text)]) that follow from the others."""
    parsed = {}
    for name, values in sizes:
        split = _split(values, run_sizes)
        if split is not None:
            parsed[name] = split
    key = {n: (len(mono.free_symbols), coeffs[0]) for n, (coeffs, mono) in parsed.items()}
    order = sorted(parsed, key=lambda n: key[n])
    derived = {}
    for name in reversed(order):  # the largest first: it may use sizes derived after it
        coeffs, mono = parsed[name]
        basis = [n for n in parsed if n not in derived and key[n] < key[name] and parsed[n][1] == 1]
        combo = _product(coeffs, basis, parsed)
        if combo is None:
            continue
        factors = list(combo) + ([str(mono)] if mono != 1 else [])
        derived[name] = (" * ".join(factors), combo)
    return _declaration_order(derived)


def _split(values: list, run_sizes: set):
    """(each call's positive integer coefficient, the run-time monomial they share) or None."""
    try:  # every name a symbol (sympy's own N is its numeric evaluation)
        exprs = [sympy.sympify(v, locals={w: sympy.Symbol(w) for w in re.findall(r"[A-Za-z_]\w*", str(v))})
                 for v in values]
    except (sympy.SympifyError, TypeError, SyntaxError):
        return None
    parts = [e.as_coeff_Mul() for e in exprs]
    monos = {m for _, m in parts}
    if len(monos) != 1 or not all(c.is_Integer and c > 0 for c, _ in parts):
        return None
    mono = monos.pop()
    factors = sympy.Mul.make_args(mono)
    if mono != 1 and not all(f.is_Symbol and str(f) in run_sizes for f in factors):
        return None  # N**2, or a symbol the function does not have
    return [int(c) for c, _ in parts], mono


def _product(coeffs: list, basis: list, parsed: dict):
    """Two sizes of `basis` whose product is `coeffs` in every call, or None. Two, with no
    constant: three sizes or a factor match by chance too often (a block's input, C * H * H
    elements, is also O * H * OH and 2 * O * HW where O is 2 * C)."""
    for combo in combinations_with_replacement(basis, 2):
        if all(c == prod(parsed[b][0][j] for b in combo) for j, c in enumerate(coeffs)):
            return combo
    return None


def _declaration_order(derived: dict) -> dict:
    """The derived sizes, each after the derived sizes its expression reads."""
    out = {}
    while len(out) < len(derived):
        ready = [n for n, (_, combo) in derived.items() if n not in out and all(c in out or c not in derived for c in combo)]
        if not ready:  # cannot happen (each reads smaller sizes only): pass the rest
            break
        out.update((n, derived[n][0]) for n in ready)
    return out
