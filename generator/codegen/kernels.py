"""Elementwise kernels printed from sympy.

An `ewise` node computes out[i...] = expr(x0[...], x1[...], ...) with numpy
broadcasting. Output axes on which every operand behaves alike (all full, or
each either full or broadcast the same way) are merged, so a same-shape kernel
is one flat loop and a bias add over [N, 512] is two loops."""

from __future__ import annotations

import sympy

from ..ops import ARGS
from .plan import Arg, Kernel
from .printer import FloatPrinter, size_expr


def _patterns(node):
    """For each output axis, a tuple: does operand k vary along it?"""
    out = node.outputs[0].shape
    rank = len(out)
    pats = []
    for axis in range(rank):
        row = []
        for v in node.inputs:
            pad = rank - v.rank
            d = v.shape[axis - pad] if axis >= pad else 1
            row.append(not (isinstance(d, int) and d == 1))
        pats.append(tuple(row))
    return pats


def _merged_axes(node):
    """Groups of consecutive output axes with the same broadcast pattern."""
    out = node.outputs[0].shape
    groups = []
    for axis, pat in enumerate(_patterns(node)):
        if groups and groups[-1][1] == pat:
            groups[-1][0].append(axis)
        else:
            groups.append(([axis], pat))
    extents = []
    for axes, pat in groups:
        size = sympy.Integer(1)
        for a in axes:
            size *= sympy.sympify(out[a])
        extents.append((sympy.expand(size), pat))
    return extents


def _index(loop_vars, extents, k):
    """Row-major flat index into operand k (or the output when k is None)."""
    index, stride = sympy.Integer(0), sympy.Integer(1)
    for var, (size, pat) in reversed(list(zip(loop_vars, extents))):
        if k is None or pat[k]:
            index += var * stride
            stride *= size
    return index


def ewise_kernel(node, names, comment: str, printer_cls=FloatPrinter) -> Kernel:
    """The Kernel for `node`; `names` maps each value to its C++ name."""
    out = node.outputs[0]
    extents = [(s, p) for s, p in _merged_axes(node) if s != 1]
    loop_vars = [sympy.Symbol(f"i{j}") for j in range(len(extents))] or []
    loads = {}
    for k, v in enumerate(node.inputs):
        loads[ARGS[k]] = f"{names[v]}[{size_expr(_index(loop_vars, extents, k))}]"
    printer = printer_cls(loads)
    replacements, (expr,) = sympy.cse([node.attrs["expr"]], symbols=sympy.numbered_symbols("_t"))
    temps = []
    for sym, sub in replacements:
        printer.loads[sym] = str(sym)
        temps.append(f"const float {sym} = {printer.doprint(sub)};")
    dims = sorted({s for v in node.outputs + node.inputs for d in v.shape for s in getattr(d, "free_symbols", ())}, key=str)
    args = [Arg("const float*", names[v]) for v in node.inputs]
    args.append(Arg("float*", names[out]))
    args += [Arg("int64_t", str(d)) for d in dims]
    return Kernel(
        name=names[out],
        comment=comment,
        args=args,
        loops=[(str(var), size_expr(size)) for var, (size, _) in zip(loop_vars, extents)],
        temps=temps,
        assign=f"{names[out]}[{size_expr(_index(loop_vars, extents, None))}] = {printer.doprint(expr)};",
    )
