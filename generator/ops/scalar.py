"""Elementwise functions, each defined once as a sympy expression.

The numpy reference, the printed C++ (and later CUDA) code, and the derivative
(`sympy.diff`) all come from these expressions. A user-defined activation is
just another entry made from a sympy lambda (see `generator.frontend.dsl.elementwise`).
"""

from __future__ import annotations

import functools

import sympy
from sympy.codegen.cfunctions import log1p

# Operand i of an elementwise node is the scalar symbol ARGS[i].
ARGS = tuple(sympy.Symbol(f"x{i}", real=True) for i in range(16))


def _sigmoid(x):
    # Written with tanh rather than 1 / (1 + exp(-x)): equal, but its derivative
    # (1 - tanh(x/2)^2) / 4 cannot overflow, where exp(-x) / (1 + exp(-x))^2 gives
    # inf / inf = NaN for x < -88 in float32.
    return (1 + sympy.tanh(x / 2)) / 2


def _softplus(x):
    # log(1 + exp(x)) written so that it neither overflows nor loses precision.
    return sympy.Max(x, 0) + log1p(sympy.exp(-sympy.Abs(x)))


def _hardsigmoid(x):
    return sympy.Min(sympy.Max(x / 6 + sympy.Rational(1, 2), 0), 1)


# name -> (arity, function of sympy symbols returning the expression)
SCALAR_FUNCS = {
    "add": (2, lambda a, b: a + b),
    "sub": (2, lambda a, b: a - b),
    "mul": (2, lambda a, b: a * b),
    "div": (2, lambda a, b: a / b),
    "pow": (2, lambda a, b: a**b),
    "maximum": (2, lambda a, b: sympy.Max(a, b)),
    "minimum": (2, lambda a, b: sympy.Min(a, b)),
    "neg": (1, lambda x: -x),
    "abs": (1, lambda x: sympy.Abs(x)),
    "square": (1, lambda x: x**2),
    "sqrt": (1, lambda x: sympy.sqrt(x)),
    "rsqrt": (1, lambda x: 1 / sympy.sqrt(x)),
    "exp": (1, lambda x: sympy.exp(x)),
    "log": (1, lambda x: sympy.log(x)),
    "sin": (1, lambda x: sympy.sin(x)),
    "cos": (1, lambda x: sympy.cos(x)),
    "relu": (1, lambda x: sympy.Max(x, 0)),
    "sigmoid": (1, _sigmoid),
    "tanh": (1, lambda x: sympy.tanh(x)),
    "softplus": (1, _softplus),
    "gelu": (1, lambda x: x / 2 * (1 + sympy.erf(x / sympy.sqrt(2)))),
    "silu": (1, lambda x: x * _sigmoid(x)),
    "softsign": (1, lambda x: x / (1 + sympy.Abs(x))),
    # MobileNet's activations (PyTorch's ReLU6, Hardsigmoid, Hardswish): pieces of lines.
    "relu6": (1, lambda x: sympy.Min(sympy.Max(x, 0), 6)),
    "hardsigmoid": (1, lambda x: _hardsigmoid(x)),
    "hardswish": (1, lambda x: x * _hardsigmoid(x)),
}


def scalar_expr(fn: str, *operands):
    """Expression of `fn` applied to sympy operands (symbols or numbers)."""
    arity, f = SCALAR_FUNCS[fn]
    if len(operands) != arity:
        raise TypeError(f"{fn} takes {arity} operand(s), got {len(operands)}")
    return f(*operands)


SIMPLIFY_LIMIT = 24  # operations in a derivative above which sympy.simplify is not tried


@functools.lru_cache(maxsize=4096)
def simplified(expr):
    """sympy.simplify(expr), remembered: the same expressions come back in every
    layer and direction of a model (and in every model of a session), and
    simplify is the slowest step of generation."""
    return sympy.simplify(expr)


def is_identity(expr, arg) -> bool:
    """Whether expr equals arg for every value. Two numeric probes rule most
    expressions out before sympy is asked (simplify costs milliseconds each)."""
    if expr == arg:
        return True
    if arg not in expr.free_symbols:
        return False
    others = {s: 2 + k for k, s in enumerate(sorted(expr.free_symbols - {arg}, key=str))}
    for point in (0.37, 1.61):
        try:
            value = complex(expr.subs(others).subs(arg, point).evalf())
        except (TypeError, ValueError):
            break  # not a number there (a piecewise at its boundary): let sympy decide
        if abs(value - point) > 1e-9 * (1 + abs(point)):
            return False
    return simplified(expr - arg) == 0


def derivative(expr, symbol):
    """d expr / d symbol, ready to print: step functions become explicit choices
    (relu'(0) = 0, as in PyTorch), and sympy's simplified form is used only when
    it is smaller and brings in no new functions (simplify likes cosh and
    Eq-piecewise forms that overflow or lose values in float32)."""
    d = sympy.diff(expr, symbol)
    d = d.replace(sympy.Heaviside, lambda a, *rest: sympy.Piecewise((1, a > 0), (0, True)))
    d = d.replace(sympy.DiracDelta, lambda *args: sympy.Integer(0))
    if sympy.count_ops(d) > SIMPLIFY_LIMIT:
        return d  # a long fused expression (a GRU's gates): simplify takes seconds and rarely wins
    try:
        simple = simplified(d)
    except Exception:  # noqa: BLE001  (simplification is optional)
        return d
    if sympy.count_ops(simple) < sympy.count_ops(d) and _functions(simple) <= _functions(d):
        return simple
    return d


def output_derivative(expr, symbol, out):
    """d expr / d symbol written with the op's own output `out` where the outer
    function allows (relu: out > 0, tanh: 1 - out^2, sigmoid: out (1 - out),
    exp: out), else None. The backward pass then reads the output, which the
    next layer keeps anyway, instead of the input: the pre-activation need not
    survive the forward pass, and a GEMM can take the activation as epilogue."""
    w = sympy.Wild("w")
    inner, outer = None, None
    if isinstance(expr, sympy.Max) and len(expr.args) == 2 and sympy.S.Zero in expr.args:
        inner = expr.args[1] if expr.args[0] == 0 else expr.args[0]
        outer = sympy.Piecewise((1, out > 0), (0, True))
    elif isinstance(expr, sympy.tanh):
        inner, outer = expr.args[0], 1 - out**2
    elif isinstance(expr, sympy.exp):
        inner, outer = expr.args[0], out
    else:
        m = expr.match(sympy.tanh(w) / 2 + sympy.Rational(1, 2))
        if m and m[w].has(symbol):
            inner, outer = 2 * m[w], out * (1 - out)
    if inner is None or not inner.has(symbol):
        return None
    return outer * derivative(inner, symbol)


def _functions(expr) -> set:
    return {type(f) for f in expr.atoms(sympy.Function)} | {type(r) for r in expr.atoms(sympy.core.relational.Relational)}
