"""Elementwise kernels printed from sympy.

An `ewise` node computes out[i...] = expr(x0[...], x1[...], ...) with numpy
broadcasting. Output axes on which every operand behaves alike (all full, or
each either full or broadcast the same way) are merged, so a same-shape kernel
is one flat loop and a bias add over [N, 512] is two loops.

An operand may be a row-strided view (`views`: operand k -> (axis, ld)): a
piece of a larger buffer, e.g. one gate of a split [rows, 1280] read in place,
whose axes from `axis` on are contiguous and whose outer index steps ld floats
(1280) instead of the piece's own width (256). Axes on either side of `axis`
are then not merged, and the kernel indexes that operand as outer * ld + inner.

An operand, or the output, may also have its rows placed by a row map (`row_maps`:
operand k, or len(inputs) for the output -> the name of an int64 array): row r
of the value is row map[r] of its buffer, indexed map[outer] * ld + inner (a
recursive op's cell writes a state's rows straight to their nodes' rows of the
caller's array: ops/recurse.py)."""

from __future__ import annotations

import sympy

from ..frontend.train import G, STEP_SYMBOLS, W
from ..ops import ARGS
from ..ops.linalg import epilogue_role
from ..ir.shapes import numel as numel_of
from .plan import Arg, Kernel
from .printer import FloatPrinter, RowAt, size_expr


def _operands(node):
    """The operands a kernel indexes: the inputs, then the output (index len(inputs))."""
    return list(node.inputs) + [node.outputs[0]]


def _patterns(node, views):
    """For each output axis, a tuple: for each operand k (the output last), does
    it vary along the axis, and for a view, is the axis inside its contiguous rows
    (see `views`)?"""
    out = node.outputs[0].shape
    rank = len(out)
    pats = []
    for axis in range(rank):
        row = []
        for k, v in enumerate(_operands(node)):
            pad = rank - v.rank
            d = v.shape[axis - pad] if axis >= pad else 1
            varies = not (isinstance(d, int) and d == 1)
            row.append((varies, k in views and axis - pad >= views[k][0]))
        pats.append(tuple(row))
    return pats


def _merged_axes(node, views):
    """Groups of consecutive output axes with the same broadcast pattern."""
    out = node.outputs[0].shape
    groups = []
    for axis, pat in enumerate(_patterns(node, views)):
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


def _index(loop_vars, extents, k, views, row_maps):
    """Row-major flat index into operand k: a view's outer axes step its row
    stride ld, and a row-mapped operand's outer index goes through its map."""
    inner, outer, stride = sympy.Integer(0), sympy.Integer(0), sympy.Integer(1)
    past_rows = False
    for var, (size, pat) in reversed(list(zip(loop_vars, extents))):
        if k in views and not pat[k][1] and not past_rows:
            past_rows, stride = True, sympy.Integer(1)  # past the contiguous rows
        if pat[k][0]:
            if past_rows:
                outer += var * stride
            else:
                inner += var * stride
            stride *= size
    if not past_rows:
        return inner
    if k in row_maps:
        outer = RowAt(sympy.Symbol(row_maps[k]), outer)
    return inner + outer * sympy.sympify(views[k][1])


def ewise_kernel(node, names, comment: str, printer_cls=FloatPrinter, views=None, row_maps=None) -> Kernel:
    """The Kernel for `node`; `names` maps each value to its C++ name; `views`
    (operand index -> (axis, ld)) marks the operands read in place as row-strided
    pieces of a larger buffer; `row_maps` (operand index -> argument name) the
    operands whose rows a map places (each also in `views`, with its own row
    length as ld). The kernel takes the maps after the output, each name once, in
    operand order."""
    views, row_maps = dict(views or {}), dict(row_maps or {})
    out = node.outputs[0]
    k_out = len(node.inputs)
    extents = [(s, p) for s, p in _merged_axes(node, views) if s != 1]
    # The loop indices begin with '_': the kernel's arguments bear the user's names.
    loop_vars = [sympy.Symbol(f"_i{j}") for j in range(len(extents))] or []
    loads = {}
    for k, v in enumerate(node.inputs):
        loads[ARGS[k]] = f"{names[v]}[{size_expr(_index(loop_vars, extents, k, views, row_maps))}]"
    printer = printer_cls(loads)
    replacements, (expr,) = sympy.cse([printer.fold(node.attrs["expr"])], symbols=sympy.numbered_symbols("_t"))
    temps = []
    for sym, sub in replacements:
        printer.loads[sym] = str(sym)
        temps.append(f"const float {sym} = {printer.doprint(sub)};")
    sizes = [d for v in node.outputs + node.inputs for d in v.shape] + [sympy.sympify(ld) for _, ld in views.values()]
    dims = sorted({s for d in sizes for s in getattr(d, "free_symbols", ())}, key=str)
    args = [Arg("const float*", names[v]) for v in node.inputs]
    args.append(Arg("float*", names[out]))
    args += [Arg("const std::int64_t*", m) for m in dict.fromkeys(row_maps[k] for k in sorted(row_maps))]
    args += [Arg("std::int64_t", str(d)) for d in dims]
    return Kernel(
        name=names[out],
        comment=comment,
        args=args,
        loops=[(str(var), size_expr(size)) for var, (size, _) in zip(loop_vars, extents)],
        temps=temps,
        assign=f"{names[out]}[{size_expr(_index(loop_vars, extents, k_out, views, row_maps))}] = {printer.doprint(expr)};",
        work=_work(numel_of(out.shape), [node.attrs["expr"]]),
    )


# A vectorized elementwise operation costs about what this many GEMM flops do
# (a GEMM does some 32 flops per cycle on AVX2, a loop some 8 simple operations),
# and a dg_math function about 20 operations.
EWISE_OP_FLOPS, FUNCTION_OPS = 4, 20
CHEAP_FUNCTIONS = ("FlushSubnormal",)  # a compare and a blend: one operation, not a dg_math function


def _work(elements, exprs) -> str:
    """The parallel-work estimate of a kernel over `elements` computing `exprs`."""
    ops = sum(sympy.count_ops(e) + FUNCTION_OPS * sum(type(f).__name__ not in CHEAP_FUNCTIONS
                                                      for f in e.atoms(sympy.Function)) for e in exprs)
    return size_expr(sympy.expand(elements * EWISE_OP_FLOPS * (int(ops) + 2)))


def update_kernel(optimizer, printer_cls=FloatPrinter) -> Kernel:
    """The optimizer's in-place update of one parameter, printed from its sympy
    update rules (generator.frontend.train.Optimizer.updates): a loop over the elements that
    updates the state slots first, then the weight from the new slot values."""
    updates = optimizer.updates()
    loads = {W: "w[i]", G: "g[i]"}
    slots = [t for t, _ in updates if t != "w"]
    for slot in slots:
        loads[sympy.Symbol(slot, real=True)] = f"{slot}[i]"
    used = set().union(*(e.free_symbols for _, e in updates))
    scalars = [name for name, sym in STEP_SYMBOLS.items() if sym in used]
    for name in scalars:
        loads[STEP_SYMBOLS[name]] = name
    printer = printer_cls(loads)
    temps, assign = [], []
    for target, expr in updates:
        text = printer.doprint(expr)
        if target == "w":
            assign.append(f"w[i] = {text};")
        else:
            temps.append(f"const float new_{target} = {text};")
            temps.append(f"{target}[i] = new_{target};")
            printer.loads[sympy.Symbol(target, real=True)] = f"new_{target}"
    args = [Arg("float*", "w"), Arg("const float*", "g")] + [Arg("float*", s) for s in slots]
    args += [Arg("int64_t", "n")] + [Arg("float", name) for name in scalars]
    return Kernel(
        name=f"{optimizer.kind}_update",
        comment=f"{optimizer.kind} update of one parameter, in place: "
        + "; ".join(f"{t} <- {e}" for t, e in updates),
        args=args,
        loops=[("i", "n")],
        temps=temps,
        assign=" ".join(assign),
        work=_work(sympy.Symbol("n"), [e for _, e in updates]),
    )


def epilogue_kernel(node, names, comment: str, printer_cls=FloatPrinter) -> Kernel:
    """The epilogue functor of a matmul node with attrs["epilogue"] (see
    passes.epilogue): acc[j] = expr(acc[j], extras...) for the n finished
    elements of C[row, col0 : col0 + n]. x0 is the accumulated value; each other
    operand is read by its role (ops.linalg.epilogue_role). The functor's members
    bear the user's names; its operator()'s own names begin with '_' (_row, _col0,
    _acc, _n, _j: kernels.h.j2)."""
    out = node.outputs[0]
    width = out.shape[-1]
    col = sympy.Symbol("_col0") + sympy.Symbol("_j")
    row = sympy.Symbol("_row")
    loads = {ARGS[0]: "_acc[_j]"}
    uses_row = uses_col = False
    for k, v in enumerate(node.inputs[2:], start=1):
        role = epilogue_role(v, out.shape)
        index = {"scalar": 0, "col": col, "row": row, "full": row * width + col}[role]
        uses_row |= role in ("row", "full")
        uses_col |= role in ("col", "full")
        loads[ARGS[k]] = f"{names[v]}[{size_expr(index)}]"
    printer = printer_cls(loads)
    replacements, (expr,) = sympy.cse([printer.fold(node.attrs["epilogue"])], symbols=sympy.numbered_symbols("_t"))
    temps = []
    for sym, sub in replacements:
        printer.loads[sym] = str(sym)
        temps.append(f"const float {sym} = {printer.doprint(sub)};")
    full = any(epilogue_role(v, out.shape) == "full" for v in node.inputs[2:])
    dims = sorted(getattr(width, "free_symbols", ()), key=str) if full else []  # the row stride
    args = [Arg("const float*", names[v]) for v in node.inputs[2:]] + [Arg("std::int64_t", str(d)) for d in dims]
    return Kernel(
        name=f"{names[out]}_epilogue",
        comment=comment,
        args=args,
        loops=[("_j", "_n")],
        temps=temps,
        assign=f"_acc[_j] = {printer.doprint(expr)};",
        kind="epilogue",
        uses_row=uses_row,
        uses_col=uses_col,
    )
