"""Symbolic sizes as the memory planner computes with them: fast, exact, and
turned back into sympy only for printing.

A size is a polynomial with integer coefficients in the symbolic dims, each at
least 1. It is stored with every dim s written as 1 + t (t >= 0), so that
"a >= b for every size" has a sufficient test that is a glance at coefficients:
the difference has none negative. Sums and differences stay in that basis (the
substitution is linear). An offset above blocks that cannot be ordered for all
sizes is a maximum: a `Size` holds one or more polynomials (alternatives) and is
their maximum; dominated alternatives are dropped.

sympy's expand and Poly made the planner quadratic in slow operations (minutes
for a ResNet's train step); this keeps the same rule at dict speed.
"""

from __future__ import annotations

from functools import lru_cache
from math import comb

import sympy

TYPICAL = 64  # the size every dim takes when plans are compared


class Size:
    """max(alternatives), each a polynomial {exponents: coefficient} in t = dims - 1."""

    __slots__ = ("alts", "symbols")

    def __init__(self, alts, symbols):
        self.symbols = symbols  # tuple of sympy symbols, the exponents' order
        self.alts = _prune(alts)

    @classmethod
    def const(cls, value: int, symbols) -> "Size":
        return cls([_poly({(0,) * len(symbols): int(value)})], symbols)

    def __add__(self, other: "Size") -> "Size":
        return Size([_add(a, b) for a in self.alts for b in other.alts], self.symbols)

    def max(self, other: "Size") -> "Size":
        return Size(list(self.alts) + list(other.alts), self.symbols)

    def dominates(self, other: "Size") -> bool:
        """self >= other for every size (sufficient test)."""
        return all(any(_ge(a, b) for a in self.alts) for b in other.alts)

    def minus(self, other: "Size") -> "Size":
        """self - other for single polynomials (a free block's remainder)."""
        (a,), (b,) = self.alts, other.alts
        return Size([_add(a, _neg(b))], self.symbols)

    def is_zero(self) -> bool:
        return len(self.alts) == 1 and not any(self.alts[0][1])

    def same(self, other: "Size") -> bool:
        return set(self.alts) == set(other.alts)

    def typical(self) -> float:
        return max(_value(a, TYPICAL - 1) for a in self.alts)

    def expr(self):
        """The sympy expression (in the dims themselves)."""
        return _to_expr(self.alts, self.symbols)


def from_expr(e, symbols) -> Size:
    """A Size from a sympy expression or int: a polynomial in `symbols`, or a Max of them."""
    return _from_expr(sympy.sympify(e), tuple(symbols))


@lru_cache(maxsize=None)
def _from_expr(e, symbols) -> Size:
    if isinstance(e, sympy.Max):
        out = _from_expr(e.args[0], symbols)
        for arg in e.args[1:]:
            out = out.max(_from_expr(arg, symbols))
        return out
    if isinstance(e, sympy.Add) and e.has(sympy.Max):
        out = Size.const(0, symbols)
        for term in e.args:
            out = out + _from_expr(term, symbols)
        return out
    shifted = sympy.expand(e.xreplace({s: s + 1 for s in symbols})) if symbols else sympy.expand(e)
    if shifted.is_number:
        return Size.const(int(shifted), symbols)
    poly = sympy.Poly(shifted, *symbols)
    return Size([_poly({k: int(v) for k, v in poly.as_dict().items()})], symbols)


# A polynomial is a hashable pair: (exponent tuples, coefficients), sorted by exponents.
def _poly(d: dict):
    items = sorted((k, v) for k, v in d.items() if v != 0)
    return tuple(k for k, _ in items), tuple(v for _, v in items)


def _dict(p) -> dict:
    return dict(zip(*p))


def _add(a, b):
    d = _dict(a)
    for k, v in zip(*b):
        d[k] = d.get(k, 0) + v
    return _poly(d)


def _neg(a):
    return a[0], tuple(-v for v in a[1])


@lru_cache(maxsize=1 << 20)
def _ge(a, b) -> bool:
    if a == b:
        return True
    d = _dict(a)
    for k, v in zip(*b):
        d[k] = d.get(k, 0) - v
    return all(v >= 0 for v in d.values())


def _value(p, t: int) -> float:
    return float(sum(c * t ** sum(k) for k, c in zip(*p)))


def _prune(alts):
    """The alternatives no other one dominates (first of equal ones kept), in order."""
    unique = list(dict.fromkeys(alts))
    if len(unique) == 1:
        return tuple(unique)
    kept = []
    for i, a in enumerate(unique):
        if not any(j != i and _ge(b, a) and not (_ge(a, b) and j > i) for j, b in enumerate(unique)):
            kept.append(a)
    return tuple(kept)


def _to_expr(alts, symbols):
    terms = [_poly_expr(a, symbols) for a in alts]
    return terms[0] if len(terms) == 1 else sympy.Max(*terms)


@lru_cache(maxsize=None)
def _poly_expr(p, symbols):
    """Back from t = s - 1 to the dims: each t^k expands binomially."""
    total = sympy.Integer(0)
    for k, c in zip(*p):
        term = sympy.Integer(c)
        for s, e in zip(symbols, k):
            if e:
                term *= sum(comb(e, j) * s**j * (-1) ** (e - j) for j in range(e + 1))
        total += term
    return sympy.expand(total)
