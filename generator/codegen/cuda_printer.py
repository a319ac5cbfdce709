"""sympy -> CUDA C++ expression printer.

CUDA's math library offers the single-precision C99 functions (`expf`, `tanhf`,
`log1pf`, `erff`, `fmaxf`, ...) both in device code and, through <cmath>, on the
host, so an expression printed with them compiles in a `__host__ __device__`
body: the same text runs in the GPU kernel and in a host loop (the CPU
emulation and the tests of the kernel bodies).

`CudaPrinter` is `FloatPrinter` (float literals, integer powers as products,
constants as literals, operand loads) with every function printed the plain
C99 way, whatever the CPU printer does for speed on the host (a CPU printer may
call vectorizable host functions that device code does not have).
"""

from __future__ import annotations

from sympy.printing.c import C99CodePrinter

from .printer import FloatPrinter


class CudaPrinter(FloatPrinter):
    """Single-precision C99 math, valid in CUDA device and host code."""


# The C99 printer's own methods (math functions, Max/Min/Abs, INFINITY/NAN) win
# over any host-specific override in FloatPrinter.
for _name, _method in vars(C99CodePrinter).items():
    if _name.startswith("_print_"):
        setattr(CudaPrinter, _name, _method)
del _name, _method
