"""The arena plan's offsets as C++ a person can read: shared bases named once.

A block that goes on top of others whose sizes grow differently with the dims
(memory/planner.py) sits at the largest of their ends, a maximum of several
polynomials. Blocks placed one after another there share that maximum and differ
by a constant: they are one region. Each region's start is printed once, as a
named local (`const std::int64_t layer3_0_bn1_mean_at = std::max<std::int64_t>({...});`,
named after the block at its start), and each of its blocks as that name plus a
constant. A region whose maximum holds another region's, moved by a constant,
says so: `std::max<std::int64_t>({589824 * N + 589824, layer2_0_bn1_mean_at + 1280})`
is above the first polynomial and 1280 floats above the other region's start.
The arena's sizes are written the same way. Polynomial offsets print as they
are (`65536 * N`); only maxima get names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from ..codegen.printer import size_expr
from ..ir.names import fresh_name
from .sizes import _poly_expr, _value, from_expr


@dataclass
class Region:
    """A named start shared by blocks: the maximum of `alts` (polynomials in t = dim - 1)."""

    name: str
    alts: frozenset
    members: list = field(default_factory=list)  # [(constant above the start, Buffer)]
    expr: str = ""  # its C++ value, in terms of the regions before it


class Bases:
    """The regions of one arena plan, and how offsets and sizes print with them."""

    def __init__(self, symbols: tuple, taken: set):
        self.symbols = symbols
        self.taken = set(taken)  # identifiers the function already uses
        self.regions: dict = {}  # alternatives moved to constant 0 (see _normal) -> Region
        self.at: dict = {}  # id(Buffer) -> (Region, constant)

    def place(self, buffers: list) -> None:
        """Group the buffers whose offsets are maxima into regions, named in buffer order."""
        groups = {}
        for b in buffers:
            alts = from_expr(b.offset, self.symbols).alts
            if len(alts) > 1:
                key, c = _normal(alts)
                groups.setdefault(key, []).append((c, b))
        for key, members in groups.items():
            low = min(c for c, _ in members)
            members.sort(key=lambda m: m[0])
            region = Region(self._name(members), frozenset(_shift(a, low) for a in key),
                            [(c - low, b) for c, b in members])
            self.regions[key] = region
            for c, b in region.members:
                self.at[id(b)] = (region, c)

    def offset(self, b) -> str:
        """Buffer b's offset in C++: `region + c`, or its polynomial."""
        if id(b) in self.at:
            region, c = self.at[id(b)]
            return _plus(region.name, c)
        return _int(b.offset)

    def size(self, expr, name: str) -> str:
        """A size (one of the arena's) in C++: a region's start plus a constant where
        it is one, else its polynomial, else a region `name` of its own."""
        alts = from_expr(expr, self.symbols).alts
        if len(alts) == 1:
            return _int(expr)
        key, c = _normal(alts)
        if key not in self.regions:
            self.regions[key] = Region(self._fresh(name), frozenset(alts))
        region = self.regions[key]
        return _plus(region.name, c - _normal(region.alts)[1])

    def declarations(self) -> list:
        """[(name, C++ value)], each using only names before it: a region's maximum with
        any earlier region's (moved by a constant) that it holds written as that name."""
        done, out = [], []
        for region in sorted(self.regions.values(), key=lambda r: (len(r.alts), _top(r.alts), r.name)):
            rest, terms = set(region.alts), []
            while True:
                found = [(len(other.alts), i, other, d) for i, other in enumerate(done)
                         if (d := _inside(other.alts, rest)) is not None]
                if not found:
                    break
                _, _, other, d = max(found, key=lambda f: (f[0], -f[1]))
                if isinstance(d, int):
                    rest -= {_shift(a, d) for a in other.alts}
                    terms.append(_plus(other.name, d))
                else:
                    rest -= {_add(a, d) for a in other.alts}
                    terms.append(f"{other.name} + {_int(_poly_expr(d, self.symbols))}")
            items = [_int(_poly_expr(a, self.symbols)) for a in sorted(rest, key=_top_key)] + terms
            out.append((region.name, items[0] if len(items) == 1 else
                        f"std::max<std::int64_t>({{{', '.join(items)}}})"))
            done.append(region)
        return out

    def bound(self, exprs: list):
        """An upper bound on every polynomial in `exprs` (all alternatives of a maximum)
        and on each step of computing one in int64: per monomial of the dims, the
        largest magnitude of its coefficient. Checked in double first, it keeps int64
        arithmetic from wrapping."""
        largest = {}
        if not self.symbols:
            return max([abs(_const(alt)) for e in exprs for alt in from_expr(e, ()).alts], default=0)
        for e in exprs:
            for alt in from_expr(e, self.symbols).alts:
                poly = sympy.Poly(_poly_expr(alt, self.symbols), *self.symbols)
                for monomial, coeff in poly.as_dict().items():
                    largest[monomial] = max(largest.get(monomial, 0), abs(int(coeff)))
        total = sympy.Integer(0)
        for monomial, coeff in sorted(largest.items()):
            term = sympy.Integer(coeff)
            for s, e in zip(self.symbols, monomial):
                term *= s**e
            total += term
        return total

    def _name(self, members: list) -> str:
        """A region of freed gradients is `freed_gradients`; another is named after its first block."""
        if all(b.phase == "gradient" for _, b in members):
            return self._fresh("freed_gradients")
        return self._fresh(f"{members[0][1].name}_at")

    def _fresh(self, name: str) -> str:
        name = fresh_name(name, self.taken)
        self.taken.add(name)
        return name


# A polynomial is memory.sizes' pair (exponent tuples, coefficients), in t = dim - 1;
# moving it by a constant changes only its constant term (exponents all zero).
_ZERO = ()  # the exponents of a constant when there are no dims


def _const(p) -> int:
    exps, coeffs = p
    return coeffs[0] if exps and not any(exps[0]) else 0


def _shift(p, d: int):
    exps, coeffs = p
    terms = dict(zip(exps, coeffs))
    zero = tuple(0 for _ in next(iter(exps), _ZERO))
    terms[zero] = terms.get(zero, 0) + d
    items = sorted((k, v) for k, v in terms.items() if v != 0)
    return tuple(k for k, _ in items), tuple(v for _, v in items)


def _normal(alts) -> tuple:
    """(key, c): the alternatives moved down by c, the constant of the one whose
    non-constant part sorts first, so that maxima that differ by a constant share a key."""
    first = min(alts, key=lambda p: _shift(p, -_const(p)))
    c = _const(first)
    return frozenset(_shift(a, -c) for a in alts), c


def _inside(alts, rest: set):
    """d such that every one of `alts` moved by d is in `rest`, or None: a constant
    where one does, else a polynomial (the maximum moves with it: max(a + d) = max(a) + d)."""
    a0 = min(alts, key=lambda p: _shift(p, -_const(p)))
    for r in rest:
        d = _const(r) - _const(a0)
        if _shift(a0, d) == r and all(_shift(a, d) in rest for a in alts):
            return d
    for r in sorted(rest):
        d = _add(r, a0, -1)
        if all(_add(a, d) in rest for a in alts):
            return d
    return None


def _add(p, q, sign: int = 1):
    """p + sign * q, two polynomials."""
    terms = dict(zip(*p))
    for k, v in zip(*q):
        terms[k] = terms.get(k, 0) + sign * v
    items = sorted((k, v) for k, v in terms.items() if v != 0)
    return tuple(k for k, _ in items), tuple(v for _, v in items)


def _top(alts) -> float:
    return max(_value(a, 63) for a in alts)


def _top_key(p):
    return (-_value(p, 63), p)


def _plus(name: str, c: int) -> str:
    return name if c == 0 else f"{name} + {c}" if c > 0 else f"{name} - {-c}"


def _int(expr) -> str:
    return size_expr(expr)
