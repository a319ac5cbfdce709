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

from dataclasses import dataclass

import sympy

from ..frontend.train import G, STEP_NOTES, STEP_SYMBOLS, W
from ..ops import ARGS
from ..ops.linalg import epilogue_role
from .plan import Arg, HyperStruct, Kernel
from .stmt import Named
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
    """Row-major flat index into operand k over loops of the given extents (symbols:
    the kernel's size arguments): a view's outer axes step its row stride (views[k],
    a symbol too), and a row-mapped operand's outer index goes through its map."""
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
    return inner + outer * views[k]


@dataclass
class KernelUse:
    """An elementwise kernel and what one call of it passes after its operands:
    the row maps (C++ pointers), then the sizes (`Named`: the loops' extents, the
    views' row strides), then the dims its expression reads (1/T)."""

    kernel: Kernel
    extra: list
    chain: str  # what it computes, for its name: relu, add_relu, d_mean_d_add_relu
    shape_words: list  # how it reads its operands, for a name apart: [("x1", "bias")], [("out", "mapped")]
    value: str = ""  # the name of the value one call computes (node_c), for a name apart at last


def _shape_words(extents, views, row_maps, operands) -> list:
    """How the kernel reads its operands where it differs from each element at the
    output's index, as (operand, word) in operand order: "scalar" (one value), "bias"
    (along the last loop only: a vector shared by every row), "rows" (one value per
    row), "bcast" (another broadcast), "strided" (a row-strided view), "mapped" (rows
    placed by a map: for the output, where it writes them)."""
    words = []
    for k, name in enumerate(operands):
        varies = "".join("1" if pat[k][0] else "0" for _, pat in extents)
        if k in row_maps:
            words.append((name, "mapped"))
        elif k in views:
            words.append((name, "strided"))
        elif name != "out" and "0" in varies:
            if "1" not in varies:
                words.append((name, "scalar"))
            elif varies.endswith("1") and "1" not in varies[:-1]:
                words.append((name, "bias"))
            elif varies.endswith("0") and "0" not in varies[:-1]:
                words.append((name, "rows"))
            else:
                words.append((name, "bcast"))
    return words


def operand_names(count: int) -> list:
    """A kernel's names for its inputs, whatever the values are called: x, or x0, x1, ..."""
    return ["x"] if count == 1 else [f"x{k}" for k in range(count)]


def function_chain(node) -> str:
    """What an elementwise node computes, as an identifier: its functions in order,
    each once (a fused add then relu: add_relu)."""
    fns = node.attrs.get("fused_fns") or [node.attrs["fn"]]
    return "_".join(dict.fromkeys(fns))


def ewise_kernel(node, printer_cls=FloatPrinter, views=None, row_maps=None) -> KernelUse:
    """The kernel for `node`, which names nothing of the model's: its operands are
    x0, x1, ... and out, its sizes are arguments (n or n0, n1, ...: the merged
    loops' extents; x1_ld: a view's row stride), so every node computing the same
    expression over the same broadcast pattern gets the same kernel whatever its
    sizes (LowerCtx.kernel names it and keeps one of each). `views` (operand index
    -> (axis, ld)) marks the operands read in place as row-strided pieces of a
    larger buffer; `row_maps` (operand index -> the C++ int64 pointer) the operands
    whose rows a map places (each also in `views`, with its own row length as ld).
    The kernel takes the maps after the output, each once, in operand order; each
    is named after the first operand it places (out_at)."""
    views, row_maps = dict(views or {}), dict(row_maps or {})
    out = node.outputs[0]
    k_out = len(node.inputs)
    operands = operand_names(len(node.inputs)) + ["out"]
    expr = node.attrs["expr"]
    dims = sorted((s for s in expr.free_symbols if s not in ARGS), key=str)  # sizes such as 1/T
    taken = {str(d) for d in dims}

    def own(name):  # a name of the kernel's, apart from the dims it reads
        return f"_{name}" if name in taken else name

    extents = [(s, p) for s, p in _merged_axes(node, views) if s != 1]
    loop_vars = [sympy.Symbol(f"_i{j}") for j in range(len(extents))]
    size_names = ["n"] if len(extents) == 1 else [f"n{j}" for j in range(len(extents))]
    sizes = [(own(n), size) for n, (size, _) in zip(size_names, extents)]
    sizes += [(own(f"{operands[k]}_ld"), sympy.sympify(ld)) for k, (_, ld) in sorted(views.items())]
    symbols = {name: sympy.Symbol(name) for name, _ in sizes}
    loop_extents = [(symbols[name], pat) for (name, _), (_, pat) in zip(sizes, extents)]
    strides = {k: symbols[own(f"{operands[k]}_ld")] for k in views}
    maps = {}  # the C++ pointer -> the kernel's name for it
    for k in sorted(row_maps):
        maps.setdefault(row_maps[k], own(f"{operands[k]}_at"))
    map_names = {k: maps[row_maps[k]] for k in row_maps}
    index = {k: _index(loop_vars, loop_extents, k, strides, map_names) for k in range(k_out + 1)}
    # A view read within its rows only (a bias row of a bigger buffer) needs no row stride.
    used = {str(s) for e in index.values() for s in e.atoms(sympy.Symbol)}
    sizes = sizes[: len(extents)] + [(name, ld) for name, ld in sizes[len(extents) :] if name in used]
    views = {k: v for k, v in views.items() if str(strides[k]) in used}
    maps = {ptr: name for ptr, name in maps.items() if name in used}
    row_maps = {k: ptr for k, ptr in row_maps.items() if ptr in maps}

    def at(k):
        return f"{own(operands[k])}[{size_expr(index[k])}]"

    printer = printer_cls({ARGS[k]: at(k) for k in range(k_out)})
    replacements, (folded,) = sympy.cse([printer.fold(expr)], symbols=sympy.numbered_symbols("_t"))
    temps = []
    for sym, sub in replacements:
        printer.loads[sym] = str(sym)
        temps.append(f"const float {sym} = {printer.doprint(sub)};")
    args = [Arg("const float*", own(name)) for name in operands[:-1]] + [Arg("float*", own("out"))]
    args += [Arg("const std::int64_t*", name) for name in maps.values()]
    args += [Arg("std::int64_t", name) for name, _ in sizes] + [Arg("std::int64_t", str(d)) for d in dims]
    elements = sympy.Mul(*[symbols[name] for name, _ in sizes[: len(extents)]])
    kernel = Kernel(
        name="",  # codegen/kernel_table.py names it (after its function chain) ...
        comment="",  # ... and cites the statements it is made for
        args=args,
        loops=[(str(var), name) for var, (name, _) in zip(loop_vars, sizes)],
        temps=temps,
        assign=f"{at(k_out)} = {printer.doprint(folded)};",
        work=_work(elements, [expr]),
    )
    extra = list(maps) + [Named(name, size_expr(size)) for name, size in sizes] + [str(d) for d in dims]
    value = node.outputs[0].name if node.outputs else ""
    return KernelUse(kernel, extra, function_chain(node), _shape_words(extents, views, row_maps, operands), value)


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
    # The scalars are fields of one struct, the kernel's last argument (`hyper.lr`).
    for name in scalars:
        loads[STEP_SYMBOLS[name]] = f"hyper.{name}"
    struct = HyperStruct(f"{optimizer.kind}_hyper", [(name, STEP_NOTES.get(name, "")) for name in scalars])
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
    args += [Arg("int64_t", "n"), Arg(struct.name, "hyper")]
    return Kernel(
        name=f"{optimizer.kind}_update",
        comment=f"{optimizer.kind} update of one parameter, in place: "
        + "; ".join(f"{t} <- {e}" for t, e in updates),
        args=args,
        loops=[("i", "n")],
        temps=temps,
        assign=" ".join(assign),
        work=_work(sympy.Symbol("n"), [e for _, e in updates]),
        struct=struct,
    )


def epilogue_kernel(node, printer_cls=FloatPrinter, first: int = 2) -> KernelUse:
    """The epilogue functor of a matmul node with attrs["epilogue"] (see
    passes.epilogue): acc[j] = expr(acc[j], extras...) for the n finished
    elements of C[row, col0 : col0 + n]. x0 is the accumulated value; each other
    operand (the node's from `first` on: 4 for matmul_int8, after its scales), a
    member x1, x2, ..., is read by its role (ops.linalg.epilogue_role);
    one read at every element of C has the row length `ld` beside it. Like a loop
    kernel it names nothing of the model's, so one functor serves every product
    with the same epilogue (codegen/kernel_table.py names it). Its operator()'s own
    names begin with '_' (_row, _col0, _acc, _n, _j: kernels.h.j2)."""
    out = node.outputs[0]
    extras = node.inputs[first:]
    roles = [epilogue_role(v, out.shape) for v in extras]
    ld = sympy.Symbol("ld")
    col = sympy.Symbol("_col0") + sympy.Symbol("_j")
    row = sympy.Symbol("_row")
    loads = {ARGS[0]: "_acc[_j]"}
    for k, role in enumerate(roles, start=1):
        index = {"scalar": 0, "col": col, "row": row, "full": row * ld + col}[role]
        loads[ARGS[k]] = f"x{k}[{size_expr(index)}]"
    printer = printer_cls(loads)
    replacements, (expr,) = sympy.cse([printer.fold(node.attrs["epilogue"])], symbols=sympy.numbered_symbols("_t"))
    temps = []
    for sym, sub in replacements:
        printer.loads[sym] = str(sym)
        temps.append(f"const float {sym} = {printer.doprint(sub)};")
    full = "full" in roles
    args = [Arg("const float*", f"x{k}") for k in range(1, len(extras) + 1)] + ([Arg("std::int64_t", "ld")] if full else [])
    kernel = Kernel(
        name="",
        comment="",
        args=args,
        loops=[("_j", "_n")],
        temps=temps,
        assign=f"_acc[_j] = {printer.doprint(expr)};",
        kind="epilogue",
        uses_row=any(r in ("row", "full") for r in roles),
        uses_col=any(r in ("col", "full") for r in roles),
    )
    words = {"scalar": "scalar", "col": "bias", "row": "rows", "full": "full"}
    extra = [Named("ld", size_expr(out.shape[-1]))] if full else []
    chain = "_".join(dict.fromkeys(node.attrs["epilogue_fns"]))
    return KernelUse(kernel, extra, chain, [(f"x{k}", words[r]) for k, r in enumerate(roles, start=1)])
