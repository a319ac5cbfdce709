"""sympy -> CUDA C++ expression printer.

CUDA's math library offers the single-precision C99 functions (`expf`, `tanhf`,
`log1pf`, `erff`, `fmaxf`, ...) both in device code and, through <cmath>, on the
host, so an expression printed with them compiles in a `__host__ __device__`
body: the same text runs in the GPU kernel and in a host loop (the CPU
emulation and the tests of the kernel bodies).

`CudaPrinter` is `FloatPrinter` (float literals, integer powers as products,
constants as literals, operand loads, and its `fold`: sigmoid as
`dg::math::sigmoid_f`, which dg_cuda_compat.h defines for both sides) with every
other function printed the plain C99 way, whatever the CPU printer does for speed
on the host (a CPU printer may call vectorizable host functions that device code
does not have).
"""

from __future__ import annotations

from sympy.printing.c import C99CodePrinter

from .printer import FloatPrinter


# Every C99 method (math functions, Abs, INFINITY/NAN) wins over a host-specific
# override in FloatPrinter, except Max/Min: FloatPrinter's dg::math::max_f keeps
# a NaN operand, where C99's fmaxf drops it (dg_cuda_compat.h defines max_f for
# both sides).
_KEEP = ("_print_Max", "_print_Min")
_C99 = {name: method for name, method in vars(C99CodePrinter).items()
        if name.startswith("_print_") and name not in _KEEP}

CudaPrinter = type(
    "CudaPrinter",
    (FloatPrinter,),
    {**_C99, "__doc__": "Single-precision C99 math, valid in CUDA device and host code.",
     "__module__": __name__},
)
