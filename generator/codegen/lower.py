"""Lowering: Graph -> ProjectPlan.

Walks the graph once, in order. Each node's OpDef.lower() returns the C++
statements that compute it, using this module's LowerCtx to name data
(`ctx.ptr`), declare output buffers (`ctx.out`), print sizes (`ctx.size`) and
emit elementwise kernels (`ctx.call_kernel`). Consecutive nodes from the same
DSL statement share one Statement, whose comment cites that line.
"""

from __future__ import annotations

import numpy as np

from .. import __version__
from ..names import comment_text, cpp_string
from ..ops import get_op
from ..printing import format_graph
from ..shapes import fmt_shape, numel
from .kernels import ewise_kernel
from .plan import InputSpec, OutputSpec, ParamSpec, ProjectPlan, Statement

CTYPE = {"float32": "float", "int32": "int32_t", "int64": "int64_t"}


def _shape_list(shape) -> str:
    from .printer import size_expr

    return "{" + ", ".join(size_expr(d) for d in shape) + "}"


class LowerCtx:
    def __init__(self, graph, printer_cls):
        self.graph = graph
        self.printer_cls = printer_cls
        self.expr = {}  # id(value) -> C++ pointer expression
        self.names = {}  # value -> C++ identifier (its graph name)
        self.owned = set()  # id(value) of values held in a local std::vector
        self.kernels = []
        self.pending = []  # buffer declarations for the statement being lowered
        self.comment = ""

    def name(self, v) -> str:
        return v.name

    def ptr(self, v) -> str:
        return self.expr[id(v)]

    def out(self, v) -> str:
        """Declare v's buffer (once) and return a pointer to write it."""
        if id(v) not in self.expr:
            self.pending.append(f"std::vector<{CTYPE[v.dtype]}> {v.name}({self.size(numel(v.shape))});")
            self.expr[id(v)] = f"{v.name}.data()"
            self.owned.add(id(v))
        return self.expr[id(v)]

    def alias(self, v, src):
        """v shares src's data (a reshape): a named pointer, no copy."""
        self.pending.append(
            f"const {CTYPE[v.dtype]}* {v.name} = {self.ptr(src)};  // same data, shape {fmt_shape(v.shape)}"
        )
        self.expr[id(v)] = v.name

    def size(self, d) -> str:
        from .printer import size_expr

        return size_expr(d)

    def string(self, text: str) -> str:
        return cpp_string(text)

    def call_kernel(self, node) -> str:
        names = {v: v.name for v in node.inputs + node.outputs}
        kernel = ewise_kernel(node, names, self.comment, self.printer_cls)
        self.kernels.append(kernel)
        args = [self.ptr(v) for v in node.inputs] + [self.out(node.outputs[0])]
        args += [a.name for a in kernel.args[len(args) :]]
        return f"kernels::{kernel.name}({', '.join(args)});"


def _input_spec(v, dim_index) -> InputSpec:
    checks = []
    for axis, d in enumerate(v.shape):
        if isinstance(d, int):
            checks.append(f"check.fixed({axis}, {d});")
        else:
            checks.append(f"check.symbolic({axis}, {dim_index[d]}, {cpp_string(str(d))});")
    return InputSpec(v.name, CTYPE[v.dtype], v.dtype, fmt_shape(v.shape), checks, v.rank)


def _param_spec(p) -> ParamSpec:
    prim = p.init.resolve(p.shape)
    seed = f"{p.seed}u" if p.seed is not None else "seed"
    lit = [f"{np.float32(x)!r}".replace("np.float32(", "").rstrip(")") + "f" for x in prim[1:]]
    target = f"{p.name}.ptr(), {p.name}.size()"
    if prim[0] == "constant":
        init = f"dg::init_constant({target}, {lit[0]});"
    else:
        init = f"dg::init_{prim[0]}({target}, {seed}, dg::name_stream({cpp_string(p.name)}), {lit[0]}, {lit[1]});"
    comment = f"{p.loc.short}  {comment_text(p.loc.text)}" if p.loc else ""
    return ParamSpec(p.name, list(p.shape), fmt_shape(p.shape), init, comment)


def lower(graph, target) -> ProjectPlan:
    ctx = LowerCtx(graph, target.printer_cls)
    dims = graph.dims
    dim_index = {d: i for i, d in enumerate(dims)}
    for v in graph.inputs:
        ctx.expr[id(v)] = v.name
    for p in graph.params:
        ctx.expr[id(p)] = f"{p.name}.ptr()"

    statements, key = [], object()
    for node in graph.nodes:
        loc = node.loc
        k = (loc.filename, loc.stmt_line) if loc else None
        if k != key or not statements:
            ctx.comment = f"{loc.short}  {comment_text(loc.text)}" if loc else node.op
            statements.append(Statement(ctx.comment))
            key = k
        ctx.pending = []
        lines = get_op(node.op).lower(node, ctx)
        statements[-1].lines += ctx.pending + lines

    outputs, first = [], {}
    for name, v in graph.outputs:
        shape = _shape_list(v.shape)
        ctype = CTYPE[v.dtype]
        if id(v) in first:  # the same value returned twice: copy the first output
            make = f"dg::Tensor<{ctype}>({shape}, outputs.{first[id(v)]}.ptr())"
        elif id(v) in ctx.owned:  # a local buffer: hand it over without copying
            make = f"dg::Tensor<{ctype}>({shape}, std::move({v.name}))"
        else:  # an input, a parameter or an alias: copy it
            make = f"dg::Tensor<{ctype}>({shape}, {ctx.ptr(v)})"
        first.setdefault(id(v), name)
        outputs.append(OutputSpec(name, ctype, v.dtype, fmt_shape(v.shape), make))

    requirements = [(f"{ctx.size(expr)} >= 0", cpp_string(why)) for expr, why in graph.requirements]
    source = graph.loc.short.split(":")[0] if graph.loc else "model.py"
    return ProjectPlan(
        name=graph.name,
        target=target.name,
        source=source,
        version=__version__,
        dims=[str(d) for d in dims],
        inputs=[_input_spec(v, dim_index) for v in graph.inputs],
        params=[_param_spec(p) for p in graph.params],
        outputs=outputs,
        requirements=requirements,
        statements=statements,
        kernels=ctx.kernels,
        graph_text=format_graph(graph),
        kernel_ext=target.kernel_ext,
    )
