"""sympy -> C++ expression printers.

`FloatPrinter` prints an elementwise op's expression in single precision: float
literals with an F suffix, the float overloads of <cmath> (expf, tanhf, ...),
small integer powers as products, and numeric constants (sqrt(2), pi) as
literals instead of non-standard M_* macros. Operand symbols are printed as the
loads given in `loads`. A CUDA printer can subclass this one.

`size_expr` prints a size expression in the symbolic dims (`784*N`).
"""

from __future__ import annotations

import sympy
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter


class FloatPrinter(C99CodePrinter):
    def __init__(self, loads: dict | None = None):
        super().__init__({"type_aliases": {real: float32}})
        self.loads = loads or {}

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
            return f"(1.0F / sqrtf({self._print(base)}))"
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


class SizePrinter(C99CodePrinter):
    """int64 size arithmetic: N*784, N - 1, N*N (no pow() on integers)."""

    def _print_Pow(self, expr):
        base, exp = expr.args
        if exp.is_Integer and exp > 0:
            return "*".join([self.parenthesize(base, 50)] * int(exp))
        raise ValueError(f"size expression {expr} is not a polynomial")

    def _print_Max(self, expr):
        args = [self._print(a) for a in expr.args]
        text = args[0]
        for a in args[1:]:
            text = f"std::max<int64_t>({text}, {a})"
        return text


_SIZE = SizePrinter()


def size_expr(d) -> str:
    if isinstance(d, int):
        return str(d)
    return _SIZE.doprint(sympy.expand(d))


def print_float(expr, loads: dict) -> str:
    return FloatPrinter(loads).doprint(expr)
