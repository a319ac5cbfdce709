"""Math as a person writes it (issue #39, requirement 6): derivatives printed in the forward's
form (a sigmoid's as s * (1 - s), s the sigmoid's own sigmoid_f and 1 - s evaluated as
sigmoid_f(-x), which does not cancel; a tanh's as 1 - t * t over one tanh_f),
powers of calls shared by the CSE, no parentheses C++ does not need, and sigmoid_f on CUDA
too. Every rewrite is an identity: checked numerically against the ops' own expressions."""

from __future__ import annotations

import re
import shutil
import subprocess

import numpy as np
import pytest
import sympy

from conftest import ROOT
from generator.codegen.cuda_printer import CudaPrinter
from generator.codegen.printer import FloatPrinter, Product, Sigmoid, SigmoidComplement
from generator.ops.scalar import derivative, scalar_expr

x, g, c = sympy.symbols("x g c", real=True)


def _printed(printer_cls, expr) -> str:
    """expr as a kernel prints it: folded, then sympy.cse, temporaries first."""
    temps, (body,) = sympy.cse([printer_cls.fold(expr)], symbols=sympy.numbered_symbols("_t"))
    p = printer_cls({})
    return " ; ".join([f"{s} = {p.doprint(v)}" for s, v in temps] + [p.doprint(body)])


def _plain(expr):
    """A folded expression back in sympy's own functions (to compare values)."""
    expr = expr.replace(lambda e: isinstance(e, Product), lambda e: sympy.Mul(*e.args))
    return expr.replace(lambda e: isinstance(e, (Sigmoid, SigmoidComplement)), lambda e: 1 / (1 + sympy.exp(-e.args[0])))


def test_sigmoid_derivative_reads_s_times_one_minus_s():
    d = derivative(scalar_expr("sigmoid", x), x) * g  # (1 - tanh(x/2)^2) / 4, the ops' form
    assert d.has(sympy.tanh)  # the ops keep the tanh form (no overflow)
    for printer in (FloatPrinter, CudaPrinter):
        text = _printed(printer, d)
        assert text == "g*dg::math::sigmoid_f(x)*dg::math::sigmoid_f(-x)", text
    # silu's derivative s + x s (1 - s): the sigmoid s computed once, for both terms.
    text = _printed(FloatPrinter, derivative(scalar_expr("silu", x), x) * g)
    assert text == "_t0 = dg::math::sigmoid_f(x) ; g*(_t0*x*dg::math::sigmoid_f(-x) + _t0)", text
    # The derivative of a product with a sigmoid (an LSTM gate: sigmoid(i) * tanh(gg)).
    gg = sympy.Symbol("gg", real=True)
    d = derivative(scalar_expr("sigmoid", x) * sympy.tanh(gg), x) * g
    text = _printed(FloatPrinter, d)
    assert "dg::math::sigmoid_f(x)*dg::math::sigmoid_f(-x)" in text and "tanh_f(0.5F" not in text, text


def test_sigmoid_derivative_is_accurate_where_the_tanh_form_cancels():
    """s * sigmoid(-x) against float64, beside the tanh form (1 - t^2) / 4 printed before and
    the plain s * (1 - s): within 4 ulp at every x in [-40, 40], where both others lose
    every digit beyond |x| = 17 and a part of them above x = 3."""
    if shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    xs = np.linspace(-40, 40, 801).astype(np.float32)
    want = np.exp(-np.abs(xs.astype(np.float64))) / (1 + np.exp(-np.abs(xs.astype(np.float64)))) ** 2
    forms = {
        "ours": _printed(FloatPrinter, derivative(scalar_expr("sigmoid", x), x) * g),
        "tanh": "g*(0.25F - 0.25F*(dg::math::tanh_f(0.5F*x) * dg::math::tanh_f(0.5F*x)))",
        "one_minus": "g*dg::math::sigmoid_f(x)*(1.0F - dg::math::sigmoid_f(x))",
    }
    got = {name: _run_cpp(form, xs) for name, form in forms.items()}
    ulp = np.spacing(want.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(got["ours"] - want) / ulp) <= 4
    for other in ("tanh", "one_minus"):
        assert np.all(np.abs(got["ours"] - want) <= np.abs(got[other] - want) + 2 * ulp), other
    big = np.abs(xs) > 20
    assert np.all(got["tanh"][big] == 0) and np.all(got["ours"][big] > 0)


def _run_cpp(form: str, xs) -> np.ndarray:
    """The printed form (one temporary at most, as `_t0 = ... ; body`) at each x, g = 1."""
    import tempfile
    from pathlib import Path

    *temps, body = form.split(" ; ")
    decls = "".join(f"    const float {t.split(' = ')[0]} = {t.split(' = ', 1)[1]};\n" for t in temps)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "f.cpp"
        src.write_text('#include "dg_math.h"\n#include <cstdio>\n#include <cstdlib>\n'
                       "int main(int argc, char** argv) {\n  const float g = 1.0F;\n"
                       "  for (int i = 1; i < argc; ++i) {\n    const float x = std::strtof(argv[i], nullptr);\n"
                       f'{decls}    std::printf("%.9e\\n", static_cast<double>({body}));\n  }}\n}}\n')
        exe = Path(tmp) / "f"
        subprocess.run(["g++", "-std=c++17", "-O2", f"-I{ROOT / 'targets' / 'cpu' / 'runtime'}", str(src), "-o",
                        str(exe)], check=True)
        out = subprocess.run([str(exe), *[repr(float(v)) for v in xs]], capture_output=True, text=True, check=True)
    return np.array([float(v) for v in out.stdout.split()])


def test_tanh_derivative_reads_one_minus_t_times_t_over_one_call():
    d = derivative(sympy.tanh(c), c) * g
    for printer, call in ((FloatPrinter, "dg::math::tanh_f(c)"), (CudaPrinter, "::tanhf(c)")):
        assert _printed(printer, d) == f"_t0 = {call} ; g*(1.0F - _t0 * _t0)"


def test_powers_of_calls_are_computed_once():
    for expr, calls in ((sympy.tanh(c) ** 2 + x, 1), (sympy.exp(x) ** 3 * g, 1), (sympy.erf(x) ** 2 * sympy.erf(x), 1)):
        text = _printed(FloatPrinter, expr)
        assert len(re.findall(r"dg::math::\w+_f\(", text)) == calls, text


def test_derivative_from_the_forward_output():
    """Where the backward reads the forward's output s = sigmoid(x) (or t = tanh(x)), the
    rule writes the derivative with it: s * (1 - s), 1 - t * t, no call at all."""
    from generator.ops.scalar import output_derivative

    out = sympy.Symbol("s", real=True)
    d = output_derivative(scalar_expr("sigmoid", x), x, out) * g
    assert FloatPrinter({}).doprint(FloatPrinter.fold(d)) == "g*s*(1.0F - s)"
    d = output_derivative(sympy.tanh(x), x, out) * g
    assert FloatPrinter({}).doprint(FloatPrinter.fold(d)) == "g*(1.0F - s * s)"


FOLDS = [  # expressions whose folded printing must equal the expression everywhere
    derivative(scalar_expr("sigmoid", x), x),
    derivative(scalar_expr("silu", x), x),
    derivative(scalar_expr("sigmoid", x) * sympy.tanh(c), x) * g,
    derivative(scalar_expr("sigmoid", x) * sympy.tanh(c), c) * g,
    sympy.Rational(1, 2) - sympy.tanh(x / 2) ** 2 / 2 + g * sympy.tanh(c) ** 2,
    (1 - sympy.tanh(x / 2) ** 2) * -g,
    sympy.tanh((x + c) / 2) ** 2 / 4 - sympy.Rational(1, 4),  # a GRU's fused gate, the sign flipped
]


@pytest.mark.parametrize("expr", FOLDS, ids=range(len(FOLDS)))
def test_folded_forms_are_identities(expr):
    folded = FloatPrinter.fold(expr)
    assert not folded.has(sympy.tanh) or folded.has(sympy.tanh(c)), folded  # sigmoid forms folded
    plain = _plain(folded)
    for value in (-40.0, -12.0, -3.5, -0.25, 0.0, 0.7, 5.0, 30.0):
        at = {x: value, c: 0.6, g: -1.3}
        want, got = float(expr.evalf(40, subs=at)), float(plain.evalf(40, subs=at))
        assert abs(got - want) <= 1e-12 * max(1.0, abs(want)), (expr, value, got, want)


def test_no_parentheses_cpp_does_not_need():
    y = sympy.Symbol("y", real=True)
    p = FloatPrinter({})
    cases = {
        x / 2: "0.5F*x",  # sympy prints (0.5F)*x, as for the fraction 1/2
        sympy.tanh(x / 2): "dg::math::tanh_f(0.5F*x)",
        1 - x**2: "1.0F - x * x",
        -(x**2): "-x * x",
        1 / (x + y): "1.0F / (x + y)",
        1 / x: "1.0F / x",
        # Where parentheses fix the order of the roundings they stay: 0.5F * x * x would
        # round 0.5F * x first.
        x**2 / 3: "0.333333333F*(x * x)",
        g * (x + y) ** 2: "g*((x + y) * (x + y))",
        x / y**2: "x/(y * y)",
        -sympy.Float(0.7) / x**2: "-0.7F/(x * x)",  # a divisor keeps them
        -(x**2) / y: "-x * x/y",
        g * (1 / sympy.sqrt(x + y)) * (x + 1): "g*(x + 1.0F)/::sqrtf(x + y)",
    }
    for expr, text in cases.items():
        assert p.doprint(expr) == text, (expr, p.doprint(expr))


def test_cuda_kernel_loops_have_no_redundant_parentheses():
    from generator.frontend.loader import load_model
    from generator.pipeline import project_files

    graph = load_model(str(ROOT / "tests" / "models" / "tiny.py") + ":tiny_train").build()
    kernels = project_files(graph, "cuda")["src/kernels.cu"].decode()
    assert "dg::for_each(" in kernels
    assert not re.search(r"\(\w+\) \*|\* \(\w+\)|for_each\(\"\w+\", \(\w+\)", kernels), kernels


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_cuda_sigmoid_f_matches_numpy(tmp_path):
    """dg_cuda_compat.h's sigmoid_f (host side, as the CPU emulation runs it) against
    float64 numpy, over the whole range: no overflow at -inf, no NaN, 2 ulp."""
    src = tmp_path / "s.cpp"
    src.write_text('#include "dg_cuda_compat.h"\n#include <cstdio>\n#include <cstdlib>\n'
                   "int main(int argc, char** argv) {\n  for (int i = 1; i < argc; ++i)\n"
                   '    std::printf("%.9e\\n", static_cast<double>(dg::math::sigmoid_f(std::strtof(argv[i], nullptr))));\n'
                   "}\n")
    exe = tmp_path / "s"
    subprocess.run(["g++", "-std=c++17", "-O2", f"-I{ROOT / 'targets' / 'cuda' / 'runtime'}", str(src), "-o", str(exe)],
                   check=True)
    xs = np.array([-1e30, -120.0, -103.0, -88.5, -40.0, -17.3, -10.0, -1.5, -1e-8, 0.0, 1e-8, 0.3, 2.0, 9.5,
                   16.0, 17.5, 40.0, 1e30, -np.inf, np.inf], np.float32)
    out = subprocess.run([str(exe), *[repr(float(v)) for v in xs]], capture_output=True, text=True, check=True)
    got = np.array([float(v) for v in out.stdout.split()], np.float32)
    with np.errstate(over="ignore"):
        want = (1.0 / (1.0 + np.exp(-xs.astype(np.float64)))).astype(np.float32)
    assert np.all(np.isfinite(got))
    ulp = np.abs(got.view(np.int32).astype(np.int64) - want.view(np.int32).astype(np.int64))
    assert ulp.max() <= 2, list(zip(xs, got, want))


COMPILED = [  # printed, compiled and run against float64 sympy: the printing is the same math
    derivative(scalar_expr("sigmoid", x), x) * g,
    derivative(scalar_expr("silu", x), x) * g,
    derivative(scalar_expr("sigmoid", x) * sympy.tanh(c), x) * g,
    derivative(sympy.tanh(c), c) * -g,
    -g * (sympy.tanh(c) ** 2 - 1) * scalar_expr("sigmoid", x),
    derivative(scalar_expr("rsqrt", c), c) * g + sympy.Float(-0.7) / c**2,
    -(x**2) / c + g / (x * c) ** 2 - 1 / (x + c) ** 2,
    x**2 / 3 - sympy.exp(x / 4) ** 3 * g,
    (1 + sympy.tanh(x / 2)) / 2 * c + (1 - sympy.tanh(x / 2)) * g,
]


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_printed_expressions_compute_what_they_print(tmp_path):
    """Each expression as a kernel prints it (fold, cse, temporaries) in a C++ function,
    evaluated at points across the sigmoid's range (x down to -30, where 1 - tanh^2
    cancels) against float64: parentheses and rewrites keep the value."""
    fns = []
    for i, expr in enumerate(COMPILED):
        temps, (body,) = sympy.cse([FloatPrinter.fold(expr)], symbols=sympy.numbered_symbols("_t"))
        p = FloatPrinter({})
        lines = [f"  const float {s} = {p.doprint(v)};" for s, v in temps]
        fns.append(f"float f{i}(float x, float g, float c) {{\n" + "\n".join(lines) + f"\n  return {p.doprint(body)};\n}}")
    points = [(-30.0, 0.8, 1.7), (-12.5, -1.1, 0.45), (-2.25, 0.3, 2.5), (0.125, 1.5, 0.9), (3.5, -0.6, 1.3),
              (9.0, 2.0, 0.7)]
    calls = "\n".join(f'  std::printf("%.9e\\n", static_cast<double>(f{i}({a}F, {b}F, {cc}F)));'
                       for i in range(len(COMPILED)) for a, b, cc in points)
    src = tmp_path / "forms.cpp"
    src.write_text('#include "dg_math.h"\n#include <cmath>\n#include <cstdio>\n' + "\n".join(fns)
                   + "\nint main() {\n" + calls + "\n}\n")
    exe = tmp_path / "forms"
    subprocess.run(["g++", "-std=c++17", "-O2", f"-I{ROOT / 'targets' / 'cpu' / 'runtime'}", str(src), "-o", str(exe)],
                   check=True)
    got = iter(float(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split())
    for expr in COMPILED:
        for a, b, cc in points:
            want = float(expr.evalf(30, subs={x: a, g: b, c: cc}))
            value = next(got)
            # float32 roundings of terms as large as (1 + |g| + |c|)(1 + |x|) may cancel
            scale = (1 + abs(b) + abs(cc)) * (1 + abs(a))
            assert abs(value - want) <= 2e-5 * abs(want) + 3e-7 * scale, (expr, (a, b, cc), value, want)
