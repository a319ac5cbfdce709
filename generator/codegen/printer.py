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
paths, and accurate where 1 + tanh cancels (x below about -10); the sigmoid's
derivative (1 - tanh(x/2)^2) / 4 as s * (1 - s) with s that call and 1 - s
evaluated as sigmoid_f(-x) (accurate at every x, where both 1 - s and 1 - tanh^2
cancel for |x| above about 3); and each
small power of a call (tanh(u)^2, a tanh's derivative) as a product that sympy.cse
computes the call of once (1.0F - _t0 * _t0). Parentheses are only those C++
needs (0.5F * x, not (0.5F) * x), and those that fix the order of roundings.

`size_expr` prints a size expression in the symbolic dims (`784*N`).
"""

from __future__ import annotations

from collections import Counter

import sympy
from sympy.codegen.ast import float32, real
from sympy.printing.c import C99CodePrinter
from sympy.printing.precedence import PRECEDENCE


class Sigmoid(sympy.Function):
    """1 / (1 + e^-x), for printing only (fold_sigmoid makes it; the ops, their
    gradients and the reference interpreter keep the tanh form)."""

    nargs = 1


class SigmoidComplement(Sigmoid):
    """sigmoid(-u) beside sigmoid(u) in a sigmoid's derivative s * sigmoid(-u): evaluated
    as such (printed sigmoid_f(-u)), never as 1 - s, which cancels for u above about 3
    (four times the error of (1 - tanh(u/2)^2) / 4 there; sigmoid(-u) has none)."""


def _as_sigmoid(e):
    """For a sum k + k tanh(u) + rest (or k - k tanh(u) + rest): (2k Sigmoid(+-2u) + rest,
    the tanh, False); for a sum k - k tanh(u)^2 + rest, the derivative of a sigmoid:
    (4k s (1 - s) + rest with s = Sigmoid(2u) and 1 - s = SigmoidComplement(-2u), the tanh,
    True); else None. A tanh of a
    number is left alone (a Sigmoid of a number could not be compared inside a Max or Min)."""
    if not isinstance(e, sympy.Add):
        return None
    k = next((a for a in e.args if a.is_Number and a != 0), None)
    if k is None:
        return None
    for term in e.args:
        coeff, rest = term.as_coeff_Mul()
        others = [a for a in e.args if a is not k and a is not term]
        if isinstance(rest, sympy.tanh) and coeff in (k, -k) and not rest.args[0].is_number:
            u = rest.args[0]
            return 2 * k * Sigmoid(2 * u if coeff == k else -2 * u) + sympy.Add(*others), rest, False
        if (isinstance(rest, sympy.Pow) and rest.exp == 2 and isinstance(rest.base, sympy.tanh) and coeff == -k
                and not rest.base.args[0].is_number):
            u = rest.base.args[0]
            return 4 * k * Sigmoid(2 * u) * SigmoidComplement(-2 * u) + sympy.Add(*others), rest.base, True
    return None


def _halved(u) -> bool:
    """Whether u is half of a simpler expression (x/2, (a + b)/2): the argument of the
    tanh in a sigmoid's (1 + tanh(x/2)) / 2."""
    return sympy.count_ops(2 * u) < sympy.count_ops(u)


def fold_sigmoid(expr):
    """Every k (1 +- tanh(u)) in a sum in expr as 2k sigmoid(+-2u) (an identity), for each
    tanh(u) that is read only in such sums (one tanh shared with other reads costs less
    than a sigmoid beside it), and every k (1 - tanh(u)^2) of such a tanh, the sigmoid's
    derivative, as 4k s (1 - s) with s = sigmoid(2u), shared with the sigmoid itself, and
    1 - s evaluated as sigmoid(-2u) (a SigmoidComplement: accurate where 1 - s cancels); a tanh's
    own derivative 1 - tanh(u)^2, where u is not halved and no sigmoid reads the tanh,
    stays as it is. Where sigmoid(v) and sigmoid(-v) both result otherwise (a GRU's z and
    1 - z), the second is written 1 - sigmoid(v), so that one evaluation serves both."""
    uses = Counter(e for e in sympy.preorder_traversal(expr) if isinstance(e, sympy.tanh))
    found = [f for f in map(_as_sigmoid, sympy.preorder_traversal(expr)) if f]
    in_sums = Counter(f[1] for f in found)
    plain = {f[1] for f in found if not f[2]}  # read as a sigmoid, not only as a derivative
    only = {t for t, n in in_sums.items() if n == uses[t] and (t in plain or _halved(t.args[0]))}
    if not only:
        return expr
    folded = expr.replace(lambda e: (_as_sigmoid(e) or (0, None))[1] in only, lambda e: _as_sigmoid(e)[0])
    sigmoids = folded.atoms(Sigmoid)
    pairs = {s: 1 - Sigmoid(-s.args[0]) for s in sigmoids
             if type(s) is Sigmoid and Sigmoid(-s.args[0]) in sigmoids and s.args[0].could_extract_minus_sign()}
    return folded.xreplace(pairs) if pairs else folded


def positive_sums(expr):
    """-g (t^2 - 1) s as g (1 - t^2) s: in a product with a negative coefficient, a sum
    that reads better negated (more terms negative than not, or as many and a negative
    constant) takes the sign. Both negations are exact, so the value is the same to the
    bit. (A number times one sum is left alone: sympy would distribute it.)"""
    def negative(f):
        signs = [a.could_extract_minus_sign() for a in f.args]
        constant = next((a for a in f.args if a.is_Number), sympy.S.Zero)
        return 2 * sum(signs) > len(signs) or (2 * sum(signs) == len(signs) and constant < 0)

    def flip(m):
        c, rest = m.as_coeff_Mul()
        factors = sympy.Mul.make_args(rest)
        if len(factors) < 2:
            return m
        for i, f in enumerate(factors):
            if f.is_Add and negative(f):
                return sympy.Mul(-c, *factors[:i], -f, *factors[i + 1:])
        return m

    return expr.replace(lambda e: e.is_Mul and e.as_coeff_Mul()[0] < 0, flip)


class Product(sympy.Function):
    """a * b * ..., for printing only: a power of a call that share_powers spelled out
    (sympy would multiply a Mul of equal factors back into the power)."""

    precedence = PRECEDENCE["Mul"]


def share_powers(expr):
    """Every small power of a call (tanh(u)^2) written as the product it prints as, so
    that sympy.cse sees the call twice and computes it once: the derivative of tanh reads
    `1.0F - _t0 * _t0`, not two calls of tanh_f."""
    return expr.replace(
        lambda e: e.is_Pow and e.exp.is_Integer and 2 <= int(e.exp) <= 4 and isinstance(e.base, sympy.Function),
        lambda e: Product(*[e.base] * int(e.exp)))


def _product_like(e) -> bool:
    """Whether the printer writes e as a product or quotient (x * x, 1.0F / x): a factor
    in a product needs parentheses around it (they fix the order of the roundings, and a
    divisor's meaning), a term of a sum, an argument or a negated expression does not."""
    if isinstance(e, Product):
        return True
    if not (isinstance(e, sympy.Pow) and not e.is_number):
        return False
    return (e.exp.is_Integer and 1 <= abs(int(e.exp)) <= 4) or e.exp == sympy.Rational(-1, 2)


_NEGATED = 0.5 * (PRECEDENCE["Pow"] + PRECEDENCE["Mul"])  # sympy's level for the operand of a unary minus


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
        return share_powers(fold_sigmoid(positive_sums(expr)))

    def _print_Sigmoid(self, expr):
        return f"dg::math::sigmoid_f({self._print(expr.args[0])})"

    _print_SigmoidComplement = _print_Sigmoid

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
            prod = " * ".join([self.parenthesize(base, PRECEDENCE["Mul"])] * abs(int(exp)))
            if exp > 0:
                return prod
            return f"1.0F / {prod}" if exp == -1 else f"1.0F / ({prod})"
        if exp == sympy.Rational(-1, 2):
            return f"1.0F / ::sqrtf({self._print(base)})"
        return super()._print_Pow(expr)

    def _print_Product(self, expr):
        return " * ".join(self.parenthesize(a, PRECEDENCE["Mul"]) for a in expr.args)

    def parenthesize(self, item, level, strict=False):
        # Only the parentheses C++ needs: none around a number's literal (0.5F * x, where
        # sympy writes (0.5F)*x as for the fraction 1/2), nor around a product or quotient
        # the printer spells out (x * x) where it is negated (-x * x). (As a term of a sum
        # or an argument it is printed without asking; as a factor, a divisor or a power's
        # base it keeps them.)
        if isinstance(item, sympy.Rational) and item > 0:
            return self._print(item)
        if _product_like(item):
            text = self._print(item)
            return text if level == _NEGATED else f"({text})"
        return super().parenthesize(item, level, strict)

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

