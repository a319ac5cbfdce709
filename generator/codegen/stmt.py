"""Typed lowered code: the statements lowering makes and the later stages read.

A line is a small dataclass that says what it does with which values: a runtime
call with its operands, a buffer declaration, an alias, a copy, a comment. The
operands that touch graph values are `Read`s and `Write`s, so liveness, in-place
choices, the arena plan and the placement of parameter updates are computed from
the lines themselves (codegen/liveness.py), never recorded while lowering runs.
Printing is each line's `__str__`, called by the templates: the last stage.

`at` on a top-level line is the schedule position (the node's index in the
graph) that runs it; a line nested in a block (a recursive op's cell) runs at
its enclosing line's position.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass

# The C++ type of each dtype, qualified: a user value may be called int64_t (a local,
# or a kernel's argument).
# bool is one byte, 0 or 1 (numpy's layout; std::vector<bool> packs bits and has no data()): ops/logic.py
CTYPE = {"float32": "float", "int32": "std::int32_t", "int64": "std::int64_t", "bool": "std::uint8_t"}


@dataclass(frozen=True, eq=False)
class Data:
    """A graph value as the lines know it: plain, printable data, no graph behind
    it. Lowering makes one per value (LowerCtx.data), so the later stages tell two
    values apart by identity (liveness: `id(op.value)`)."""

    name: str
    dtype: str
    shape: tuple  # dims: ints and sympy expressions
    kind: str = "node"  # "input", "param", "state", "mode" or "node"

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, eq=False)
class Operand:
    """A graph value a line touches (its Data), with the C++ expression of its data there."""

    value: Data
    expr: str

    def __str__(self) -> str:
        return self.expr


class Read(Operand):
    """A value the line reads."""


class Write(Operand):
    """A value the line writes (fully)."""


@dataclass(frozen=True)
class Named:
    """An argument with its meaning printed beside it: /*width=*/256."""

    name: str
    arg: object

    def __str__(self) -> str:
        return f"/*{self.name}=*/{self.arg}"


def braced(type_name: str, members) -> str:
    """`type_name{m1, m2}`: a value built in place from its members."""
    return f"{type_name}{{{', '.join(str(m) for m in members)}}}"


@dataclass(frozen=True)
class Functor:
    """A kernels:: functor built in place, its members in order: kernels::h1_relu{h1_b}."""

    name: str
    members: tuple

    def __str__(self) -> str:
        return braced(f"kernels::{self.name}", self.members)


@dataclass(frozen=True)
class Struct:
    """A runtime struct built in place, its members in order:
    dg::Int8ChannelsLastIn{dg::int8_data(relu_q)}."""

    type: str
    members: tuple

    def __str__(self) -> str:
        return braced(f"dg::{self.type}", self.members)


@dataclass(frozen=True)
class PieceAs:
    """An arena piece (a float*) read or written as another element type: int8
    values, `dg::int8_data(x_q)`, or bf16 bits, `dg::bf16_data(h_bf16)`."""

    op: object  # a Read or Write
    kind: str = "int8"

    def __str__(self) -> str:
        return f"dg::{self.kind}_data({self.op})"


@dataclass(eq=False)
class Call:
    """A call of a runtime function or kernel: `fn<template>(args...);`."""

    fn: str
    args: list
    template: str = ""
    at: int = -1

    def expr(self) -> str:
        targs = f"<{self.template}>" if self.template else ""
        return f"{self.fn}{targs}({', '.join(str(a) for a in self.args)})"

    def __str__(self) -> str:
        return self.expr() + ";"


@dataclass(eq=False)
class Gemm(Call):
    """A matrix product by the runtime (`dg::matmul` and its layouts), printed as the
    Call it is. `n` is its N argument (the row length of the product) and `epilogue`
    whether it applies one already: the memory stage fuses a parameter's update into
    a product that writes the whole gradient and has none (UpdateRows)."""

    n: object = None
    epilogue: bool = False


@dataclass(eq=False)
class Declare:
    """A local variable: `type name(args...);` or `type name = init;`, with an
    optional trailing note."""

    type: str
    name: str
    args: list = field(default_factory=list)
    init: object = None  # a Call (printed as an expression) or an operand
    note: str = ""
    at: int = -1
    element: str = ""  # an owned buffer's element type (`float` for `std::vector<float> h(n)`), else ""
    of: str = ""  # what a constant describes (a convolution's weight): equal ones of one `of` are one (declared_once.py)

    def __str__(self) -> str:
        if self.init is not None:
            init = self.init.expr() if isinstance(self.init, Call) else str(self.init)
            text = f"{self.type} {self.name} = {init};"
        else:
            text = f"{self.type} {self.name}({', '.join(str(a) for a in self.args)});"
        return f"{text}  // {self.note}" if self.note else text


@dataclass(eq=False)
class Alias:
    """A value that is another's data under a new shape (a reshape): a named pointer."""

    value: object
    src: Read
    ctype: str
    shape: str  # the value's shape, for the comment
    at: int = -1
    note: str = ""  # the comment, when not "same data, shape ..."
    written: bool = False  # the new name is written through (a piece an in-place result shares)

    def __str__(self) -> str:
        const = "" if self.written else "const "
        return f"{const}{self.ctype}* {self.value.name} = {self.src};  // {self.note or 'same data, shape ' + self.shape}"


@dataclass(eq=False)
class Copy:
    """`copy(src, src + count, dst);` with the target's copy function."""

    fn: str
    src: Read
    count: str
    dst: object  # a Write, or the expression of storage outside the graph (a gradient member)
    at: int = -1

    def __str__(self) -> str:
        return f"{self.fn}({self.src}, {self.src} + {self.count}, {self.dst});"


@dataclass(eq=False)
class Comment:
    text: str
    at: int = -1

    def __str__(self) -> str:
        return f"// {self.text}"


@dataclass(eq=False)
class UpdateRows:
    """A GEMM's last argument that makes it update the parameter whose gradient it
    writes, a block of rows at a time (dg::update_rows, dg_matmul.h): `call` is the
    update kernel's call on elements [at, at + n) from the gradient g there, and
    `arrays` the parameter and its optimizer state (prefetched block by block).
    Only in train_step(): compute_gradients() runs the product alone."""

    ld: str  # the parameter's row length
    call: Call
    arrays: list

    def __str__(self) -> str:
        body = f"[&](std::int64_t _at, const float* _g, std::int64_t _n) {{ {self.call} }}"
        return f"dg::update_rows(_gradients_only == nullptr, /*ld=*/{self.ld}, {body}, {', '.join(self.arrays)})"


@dataclass(eq=False)
class EarlyUpdate:
    """A parameter's update inside the backward pass, once its gradient is complete:
    train_step() runs it there; compute_gradients() (`gradients_only` set) leaves the
    update to apply_update() and, where `report` is set, hands the gradient's index
    to its callback at once, so that an allreduce of it can start."""

    index: int
    call: Call
    report: bool = True
    at: int = -1
    fused: bool = False  # the product that makes the gradient runs the update (UpdateRows)

    def __str__(self) -> str:
        if self.fused:
            return f"if (_gradients_only != nullptr) dg::gradient_ready(*_gradients_only, {self.index});"
        if not self.report:
            return f"if (_gradients_only == nullptr) {self.call}"
        return f"if (!dg::gradients_only(_gradients_only, {self.index})) {self.call}"


@dataclass(eq=False)
class Scope:
    """A braced block: its local arrays (`const std::int64_t _shape[] = {...};`), then its lines."""

    arrays: list  # [(C++ element type, name, [items])]
    lines: list
    at: int = -1

    def __str__(self) -> str:
        body = [f"const {t} {name}[] = {{{', '.join(str(i) for i in items)}}};" for t, name, items in self.arrays]
        return "\n".join(["{"] + body + [str(line) for line in self.lines] + ["}"])


def _comment_lines(text: str) -> list:
    return [f"// {t}" for t in text.split("\n")] if text else []


def _indented(lines) -> list:
    return ["  " + t if t else t for line in lines for t in str(line).split("\n")]


@dataclass(eq=False)
class Block:
    """A braced scope with a comment above it: the names its lines declare end
    with it, so a block reuses the names of its siblings (a recursion's
    `schedule`, `start`, a cell's `c_l`). `touches` holds the graph values its
    lines reach under other names (a state written through a row map, a kept
    value read at a level's rows): liveness reads them there."""

    lines: list
    comment: str = ""
    touches: list = field(default_factory=list)  # Read and Write operands
    at: int = -1
    part: str = ""  # a recursion's part it holds (`later_steps`): a function of its own where that is long

    def __str__(self) -> str:
        return "\n".join(_comment_lines(self.comment) + ["{"] + _indented(self.lines) + ["}"])


@dataclass(eq=False)
class Break:
    """`if (test) break;` with a comment above it: a loop that may end before its
    bound (a while loop once none of its examples runs)."""

    test: str
    comment: str = ""
    at: int = -1

    def __str__(self) -> str:
        return "\n".join(_comment_lines(self.comment) + [f"if ({self.test}) break;"])


@dataclass(eq=False)
class Loop:
    """`for (std::int64_t var = first; test; step) { lines }`, a comment above it."""

    var: str
    first: str
    test: str
    step: str
    lines: list
    comment: str = ""
    at: int = -1
    part: str = ""  # as Block's

    def __str__(self) -> str:
        head = f"for (std::int64_t {self.var} = {self.first}; {self.test}; {self.step}) {{"
        return "\n".join(_comment_lines(self.comment) + [head] + _indented(self.lines) + ["}"])


def operands(obj):
    """Every Read and Write in a line, in order, however deeply nested (a level
    loop's blocks, a call's named arguments, a functor's members)."""
    if isinstance(obj, Operand):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from operands(item)
    elif is_dataclass(obj) and not isinstance(obj, type):
        for f in fields(obj):
            if f.name not in ("value", "buffer"):
                yield from operands(getattr(obj, f.name))


def nested_lines(obj):
    """Every line in a line, itself first (the aliases a level loop's cell makes)."""
    if isinstance(obj, (list, tuple)):
        for item in obj:
            yield from nested_lines(item)
    elif is_dataclass(obj) and not isinstance(obj, type) and not isinstance(obj, (Operand, Named, Functor, Struct)):
        yield obj
        for f in fields(obj):
            if f.name not in ("value", "buffer", "src"):
                yield from nested_lines(getattr(obj, f.name))


def place(lines, position: int) -> list:
    """Mark top-level lines as run at `position`."""
    for line in lines:
        if hasattr(line, "at"):
            line.at = position
    return lines
