"""ProjectPlan: everything the templates render, as plain data.

Lowering (lower.py) decides every name, size and statement; the templates only
lay these out into files and functions."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Arg:
    ctype: str
    name: str


@dataclass
class Kernel:
    """A printed elementwise kernel: nested loops around one assignment."""

    name: str
    comment: str
    args: list  # [Arg]
    loops: list  # [(loop variable, extent expression)]
    temps: list  # ["const float t0 = ...;"] from sympy.cse
    assign: str  # "h1[i0] = fmaxf(...);"


@dataclass
class Statement:
    """The C++ for one DSL statement: a comment citing it, then its lines."""

    comment: str
    lines: list = field(default_factory=list)


@dataclass
class InputSpec:
    name: str
    ctype: str  # float, int32_t, int64_t
    dtype: str  # numpy dtype name
    declared: str  # "[N, 784]"
    checks: list  # C++ lines: check.fixed(1, 784); ...
    rank: int


@dataclass
class ParamSpec:
    name: str
    shape: list  # ints
    declared: str
    init: str  # C++ call that fills it
    comment: str


@dataclass
class OutputSpec:
    name: str
    ctype: str
    dtype: str
    declared: str
    make: str  # C++ expression building the dg::Tensor


@dataclass
class ProjectPlan:
    name: str
    target: str
    source: str  # model file name
    version: str
    dims: list  # names of the symbolic dims, in binding order
    inputs: list  # [InputSpec]
    params: list  # [ParamSpec]
    outputs: list  # [OutputSpec]
    requirements: list  # [(C++ condition, why as a C++ string literal)]
    statements: list  # [Statement]
    kernels: list  # [Kernel]
    graph_text: str  # `deepgen ir` of the model, for the README
    kernel_ext: str = ".cpp"
    extra: dict = field(default_factory=dict)
