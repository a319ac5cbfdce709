"""sympy -> C++ expression printers.

`FloatPrinter` prints an elementwise op's expression in single precision: float
literals with an F suffix, the runtime's vectorizable functions for exp, expm1,
log, log1p, tanh, erf, max and min (runtime/dg_math.h: libm's cannot be
vectorized without -ffast-math) and the float overloads of <cmath> for the rest,
small integer powers as products, and numeric constants (sqrt(2), pi) as
literals instead of non-standard M_* macros. Operand symbols are printed as the
loads given in `loads`. A CUDA printer can subclass this one.

`FloatPrinter.fold` rewrites an expression for this printer before sympy.cse: the
ops write sigmoid as (1 + tanh(x/2)) / 2 (its derivative cannot overflow), which
prints as dg::math::sigmoid_f(x), one exp and one division instead of tanh's two
paths, and accurate where 1 + tanh cancels (x below about -10).

`size_expr` prints a size expression in the symbolic dims (`784*N`).
"""

from __future__ import annotations

from collections import Counter

import sympy
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter


class Sigmoid(sympy.Function):
    """1 / (1 + e^-x), for printing only (fold_sigmoid makes it; the ops, their
    gradients and the reference interpreter keep the tanh form)."""

    nargs = 1


def _as_sigmoid(e):
    """For a sum k + k tanh(u) + rest (or k - k tanh(u) + rest): (2k Sigmoid(+-2u) + rest,
    the tanh), else None. A tanh of a number is left alone (a Sigmoid of a number could not be
    compared inside a Max or Min)."""
    if not isinstance(e, sympy.Add):
        return None
    k = next((a for a in e.args if a.is_Number and a != 0), None)
    if k is None:
        return None
    for term in e.args:
        coeff, rest = term.as_coeff_Mul()
        if isinstance(rest, sympy.tanh) and coeff in (k, -k) and not rest.args[0].is_number:
            u = rest.args[0]
            others = [a for a in e.args if a is not k and a is not term]
            return 2 * k * Sigmoid(2 * u if coeff == k else -2 * u) + sympy.Add(*others), rest
    return None


def fold_sigmoid(expr):
    """Every k (1 +- tanh(u)) in a sum in expr as 2k sigmoid(+-2u) (an identity), for each
    tanh(u) that is read only in such sums (one tanh shared with other reads costs less
    than a sigmoid beside it); where sigmoid(v) and sigmoid(-v) both result, the second
    is written 1 - sigmoid(v), so that one evaluation serves both."""
    uses = Counter(e for e in sympy.preorder_traversal(expr) if isinstance(e, sympy.tanh))
    in_sums = Counter(found[1] for found in map(_as_sigmoid, sympy.preorder_traversal(expr)) if found)
    only = {t for t, n in in_sums.items() if n == uses[t]}
    if not only:
        return expr
    folded = expr.replace(lambda e: (_as_sigmoid(e) or (0, None))[1] in only, lambda e: _as_sigmoid(e)[0])
    sigmoids = folded.atoms(Sigmoid)
    pairs = {s: 1 - Sigmoid(-s.args[0]) for s in sigmoids
             if Sigmoid(-s.args[0]) in sigmoids and s.args[0].could_extract_minus_sign()}
    return folded.xreplace(pairs) if pairs else folded


class FloatPrinter(C99CodePrinter):
    # sympy function name -> the runtime function printed for it (dg_math.h)
    VECTOR_MATH = {"exp": "exp_f", "expm1": "expm1_f", "log": "log_f", "log1p": "log1p_f", "tanh": "tanh_f",
                   "erf": "erf_f"}
    # <cmath>'s functions as ::sqrtf, ::powf: a kernel's arguments bear the names of the
    # user's values, and one called sqrtf would hide the unqualified function.
    _ns = "::"
    _prec_funcs = set(C99CodePrinter._prec_funcs) | {"::" + f for f in C99CodePrinter._prec_funcs}

    def __init__(self, loads: dict | None = None):
        super().__init__({"type_aliases": {real: float32}})
        self.loads = loads or {}

    def _print_Function(self, expr):
        name = self.VECTOR_MATH.get(type(expr).__name__)
        if name is not None and len(expr.args) == 1:
            return f"dg::math::{name}({self._print(expr.args[0])})"
        return super()._print_Function(expr)

    def _print_exp(self, expr):
        return self._print_Function(expr)

    def _print_log(self, expr):
        if len(expr.args) == 1:
            return self._print_Function(expr)
        return super()._print_log(expr)

    _print_tanh = _print_erf = _print_log1p = _print_expm1 = _print_exp

    @staticmethod
    def fold(expr):
        """The expression as this printer prints it best (see the module docstring)."""
        return fold_sigmoid(expr)

    def _print_Sigmoid(self, expr):
        return f"dg::math::sigmoid_f({self._print(expr.args[0])})"

    def _print_FlushSubnormal(self, expr):  # frontend/train.py: the optimizers' decaying state
        return f"dg::math::flush_subnormal_f({self._print(expr.args[0])})"

    def _print_Max(self, expr):
        return self._fold_minmax("max_f", expr.args)

    def _print_Min(self, expr):
        return self._fold_minmax("min_f", expr.args)

    def _fold_minmax(self, name, args):
        # sympy puts numbers first (Max(0, x)), so a NaN operand is the second: propagated.
        text = self._print(args[0])
        for a in args[1:]:
            text = f"dg::math::{name}({text}, {self._print(a)})"
        return text

    def _print_Symbol(self, expr):
        if expr in self.loads:
            return self.loads[expr]
        return super()._print_Symbol(expr)

    def _number(self, expr):
        return self._print_Float(sympy.Float(sympy.N(expr, 17), 17))

    def _print_Pow(self, expr):
        if expr.is_number:
            return self._number(expr)
        base, exp = expr.args
        if exp.is_Integer and 1 <= abs(int(exp)) <= 4:
            prod = " * ".join([self.parenthesize(base, 50)] * abs(int(exp)))
            return f"({prod})" if exp > 0 else f"(1.0F / ({prod}))"
        if exp == sympy.Rational(-1, 2):
            return f"(1.0F / ::sqrtf({self._print(base)}))"
        return super()._print_Pow(expr)

    def _print_sign(self, expr):
        a = self._print(expr.args[0])
        return f"static_cast<float>(({a} > 0.0F) - ({a} < 0.0F))"

    def _print_NumberSymbol(self, expr):
        return self._number(expr)

    _print_Pi = _print_Exp1 = _print_NumberSymbol

    def _print_Integer(self, expr):
        # Integers inside float expressions are floats: no int division, no double promotion.
        return f"{int(expr)}.0F"

    def _print_Rational(self, expr):
        return self._number(expr)


class RowAt(sympy.Function):
    """RowAt(map, i) in an index expression: the row that row i of a value lives
    at, read from the int64 array `map` (printed map[i]; see kernels.ewise_kernel)."""

    nargs = 2


class SizePrinter(C99CodePrinter):
    """int64 size arithmetic: N*784, N - 1, N*N (no pow() on integers)."""

    max_fn = "std::max<std::int64_t>"

    def _print_RowAt(self, expr):
        return f"{expr.args[0]}[{self._print(expr.args[1])}]"

    def _print_Pow(self, expr):
        base, exp = expr.args
        if exp.is_Integer and exp > 0:
            return "*".join([self.parenthesize(base, 50)] * int(exp))
        raise ValueError(f"size expression {expr} is not a polynomial")

    def _print_Max(self, expr):
        args = [self._print(a) for a in expr.args]
        text = args[0]
        for a in args[1:]:
            text = f"{self.max_fn}({text}, {a})"
        return text


class ExactSizePrinter(SizePrinter):
    """The same size arithmetic in double: N*784 as (double)N*784.0, so a run-time
    check can see a size that int64 arithmetic would wrap around."""

    max_fn = "std::max"

    def _print_Symbol(self, expr):
        return f"static_cast<double>({expr.name})"

    def _print_Integer(self, expr):
        return f"{int(expr)}.0"


_SIZE = SizePrinter()
_EXACT = ExactSizePrinter()


def size_expr(d) -> str:
    if isinstance(d, int):
        return str(d)
    return _SIZE.doprint(sympy.expand(d))


def print_float(expr, loads: dict) -> str:
    return FloatPrinter(loads).doprint(expr)


def exact_size_expr(d) -> str:
    """size_expr in double precision (see ExactSizePrinter)."""
    if isinstance(d, int):
        return f"{d}.0"
    return _EXACT.doprint(sympy.expand(d))

