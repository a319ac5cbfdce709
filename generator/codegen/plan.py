"""ProjectPlan: everything the templates render, as plain data.

Lowering (lower.py) decides every name, size and statement; the templates only
lay these out into files and functions."""

from __future__ import annotations

from dataclasses import dataclass, field

from .modules import Modules


@dataclass
class Arg:
    ctype: str
    name: str


@dataclass
class Kernel:
    """A printed elementwise kernel: nested loops around one assignment.

    kind "loop": a function in kernels.cpp. kind "epilogue": a functor struct in
    kernels.h (its args are members) that a GEMM calls on each finished piece of
    an output row, so the compiler inlines it into the GEMM."""

    name: str
    comment: str
    args: list  # [Arg]
    loops: list  # [(loop variable, extent expression)]
    temps: list  # ["const float t0 = ...;"] from sympy.cse
    assign: str  # "h1[i0] = fmaxf(...);"
    kind: str = "loop"
    uses_row: bool = False  # epilogue: whether the body reads the row index
    uses_col: bool = False  # epilogue: whether the body reads the column index
    # loop: the kernel's work in GEMM-flop equivalents (dg_parallel.h), a C++
    # expression; the outer loop is split over threads when it is worth it.
    work: str = ""
    # An optimizer's update kernel: the HyperStruct it takes, printed before it in kernels.h
    # (its thread-free twin takes the same one and leaves this None).
    struct: object = None

    @property
    def comment_lines(self) -> list:
        """The comment, one C++ comment line each (a fused kernel's DSL lines)."""
        return self.comment.split("\n")

    @property
    def count(self) -> str:
        """The elements the loops visit, as C++: their extents multiplied (a sum in
        parentheses), "1" without loops; a flat launch (the CUDA target) runs this many."""
        extents = [f"({e})" if " + " in e or " - " in e else e for _, e in self.loops]
        return " * ".join(extents) or "1"


@dataclass
class HyperStruct:
    """An optimizer's hyperparameters at one step, as one struct (`kernels::adam_hyper`)
    printed beside its update kernel: train_step() and apply_update() fill one
    (`const kernels::adam_hyper _hyper = {...};`, the step's values included: Adam's bias
    corrections), and every update call passes it, a single argument."""

    name: str  # the type, in namespace kernels
    fields: list  # [(name, comment)]: floats, in the order the struct declares them
    values: list = field(default_factory=list)  # [C++ expression] of each field at this step (lowering)
    local: str = "_hyper"  # the variable of train_step() and apply_update() that holds it

    def __str__(self) -> str:
        return f"const kernels::{self.name} {self.local} = {{{', '.join(self.values)}}};"


@dataclass(eq=False)
class ArenaDecl:
    """A typed line: the pointer to an intermediate's piece of the arena. Lowering
    makes it with its memory.Buffer (positions not yet known) and the value it
    holds; liveness fills in the positions, the memory stage the offset; printing
    it (str) is the last step."""

    buffer: object  # memory.Buffer
    size: str  # C++ element count
    value: object = None  # stmt.Data of the graph value whose data it holds
    at: int = -1
    # An in-place op's output: its operands (stmt.Data) of the same shape, whose block it may take.
    shares: tuple = ()

    def piece(self) -> str:
        """_arena.at(offset, size): where the plan put this buffer."""
        offset = self.buffer.printed or "/*not yet planned*/"
        return f"_arena.at({offset}, {self.size})"

    def __str__(self) -> str:
        return f"float* {self.buffer.name} = {self.piece()};"


@dataclass(eq=False)
class GradientDecl(ArenaDecl):
    """A parameter's gradient as the backward pass writes it: the Model's gradient
    member while gradients are kept (compute_gradients(), or train_step() with
    keep_gradients set), else a piece of the arena (phase "gradient") that lives
    until the update has consumed it."""

    member: str = ""  # the Model's gradient member: d_h1_w

    def place(self, declared: bool = False) -> str:
        """_gradients.at(member, offset): the member, or the arena piece (as many floats as
        the member holds) when not kept; `this->member` where the line declares a local of
        the member's name."""
        offset = self.buffer.printed or "/*not yet planned*/"
        member = f"this->{self.member}" if declared else self.member
        return f"_gradients.at({member}, {offset})"

    def __str__(self) -> str:
        return f"float* {self.buffer.name} = {self.place(declared=True)};"


@dataclass
class Statement:
    """The code for one DSL statement: a comment citing it, then its typed lines
    (codegen/stmt.py, ArenaDecl; a loop is a stmt.Block and stmt.Loop), each printing itself."""

    comment: str
    lines: list = field(default_factory=list)
    positions: list = field(default_factory=list)  # the schedule positions of its nodes
    header: str = ""  # the call of the user's function it is part of, at the first of them
    call: object = None  # that call: the Loc of a node in it (loc.call_id, loc.call_args), or None
    helper: tuple = ()  # the one call of a deepgen function that made all its nodes (Loc.helper), if one did
    again: bool = False  # its nodes make forward values again for the gradient (transforms/remat.py)


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
    init_fn: str = ""  # the same call in parts: the function (dg::init_normal) ...
    init_args: str = ""  # ... and its arguments after the data pointer and size
    trainable: bool = True  # False for module state (batch norm's running statistics)
    member: str = ""  # its C++ member path in the Network: the name, or in a module struct layer1_0.conv1_weight
    instance: object = None  # the module (codegen/modules.py ModuleInstance) the Network declares here, at its first parameter

    @property
    def flat(self) -> bool:
        """A member of the Network itself, not of a module struct."""
        return self.member in ("", self.name)

    @property
    def declared_here(self) -> bool:
        """The Network declares something at this parameter: it, or its module."""
        return self.flat or self.instance is not None


@dataclass
class OutputSpec:
    name: str
    ctype: str
    dtype: str
    declared: str
    make: str  # C++ expression building the dg::Tensor
    shape: str = ""  # C++ shape list, e.g. {N, 10}
    data: str = ""  # C++ pointer to the output's elements (a device pointer on a GPU target)
    read: object = None  # stmt.Read of the value, read when the call returns


@dataclass
class TrainPlan:
    """train_step(): the loss and backward statements, gradient copies, updates."""

    optimizer: str  # "adam(lr=0.001, ...)"
    kind: str
    inputs: list  # [InputSpec] of inputs only training needs (labels)
    input_names: list  # every input, in order
    dims: list  # [(name, index)] of dims only those inputs bind
    loss: str  # C++ expression of the loss value
    loss_read: object  # stmt.Read of it, read when train_step returns
    loss_statements: list
    backward_statements: list
    copies: list  # stmt.Copy lines copying gradients into the Model's gradient members (when kept)
    updates: list  # [Update]; plan_memory moves each it can into the backward statements
    all_updates: list  # [Update] of every parameter, in gradients() order: apply_update() runs them all
    hyper: list  # [(name, C++ float literal default)]
    hyper_checks: list  # [(name, dg_range_checks.h range check)], applied when set and by every train_step
    hyper_struct: HyperStruct  # the step's hyperparameters, the one argument every update call takes them in
    grads: list  # [(param, gradient member, C++ shape list)]
    slots: list  # [(param, slot, member, C++ shape list)]
    grad_offsets: list = field(default_factory=list)  # [offset] of each gradient in the one gradient buffer
    places: bool = False  # a GradientDecl: the backward pass writes a gradient where dg::GradientPlaces says
    grad_total: int = 0  # elements of that buffer (every gradient, in gradients() order)
    tail: list = field(default_factory=list)  # C++ lines after the backward statements: copies, late updates
    backward_call: object = None  # sections.MethodCall of `backward` where the gradient phase is one


@dataclass(eq=False)
class Update:
    """One parameter's optimizer step: the kernel call, and what deciding where it
    runs needs (the parameter and its gradient, and whether the gradient is copied
    into its member after the backward pass, so that the update must wait)."""

    param: str
    param_value: object  # stmt.Data of the parameter
    grad_value: object  # stmt.Data of its gradient
    call: object  # stmt.Call in train_step(): reads the gradient where the backward pass left it
    after_copies: bool
    index: int = 0  # the gradient's position in gradients() (compute_gradients() reports it ready)
    apply_call: object = None  # stmt.Call in apply_update(): reads the gradient member
    rows_call: object = None  # stmt.Call on elements [at, at + n) from g (stmt.UpdateRows)
    arrays: list = None  # the parameter and its optimizer state, as C++ pointers
    rows_kernel: object = None  # the update kernel without threads, that rows_call calls

    def __str__(self) -> str:
        return str(self.call)


@dataclass
class Recording:
    """What the project carries about itself (stage `record`, codegen/record.py)."""

    expected_npz: bytes | None  # tests/expected.npz; None for a model too large to run the reference on
    example_inputs: list  # [{name, ctype, size, shape, declared, dims, data}] for examples/main.cpp
    example_call: str  # forward(...) arguments in the README
    example_train_call: str  # train_step(...) arguments in the README
    param_count: str  # "535,818"
    param_bytes: str
    memory_report: str  # `deepgen memory` at batch 32, for the README


@dataclass
class KeptPacking:
    """A weight the Model keeps packed for its forward-pass products
    (dg::KeptPackedB): op(param) is [K, N]. Prints its member's declaration."""

    member: str
    param: str
    tb: bool  # the param is stored [N, K] (a PyTorch Linear weight)
    K: str
    N: str
    stands_in: bool = False  # the forward pass reads the param through this packing only
    prepare: str = ""  # a function the packing applies to the param as it packs it (dg::round_bf16)
    kept_as: str = ""  # the member's type where it is not a dg::KeptPackedB (OpDef.kept_as: dg::KeptBf16Weight)
    calls: dict = field(default_factory=dict)  # then {a product's function: the one that reads it}
    quantized = False  # (a KeptInt8's is True)

    @property
    def cpp_type(self) -> str:
        return self.kept_as or "dg::KeptPackedB"

    def __str__(self) -> str:
        tb, stands_in = ("true" if flag else "false" for flag in (self.tb, self.stands_in))
        if self.kept_as:  # it prepares the param itself, and never stands in
            return f"{self.kept_as} {self.member}{{_version, {self.param}, /*tb=*/{tb}, /*K=*/{self.K}, /*N=*/{self.N}}};"
        prepare = f", /*prepare=*/{self.prepare}" if self.prepare else ""
        return (f"dg::KeptPackedB {self.member}{{_version, {self.param}, /*tb=*/{tb}, /*K=*/{self.K}, /*N=*/{self.N}, "
                f"/*stands_in=*/{stands_in}{prepare}}};")


@dataclass
class KeptInt8:
    """A weight the Model keeps quantized to int8 and packed for its forward-pass
    products (dg::KeptInt8Weight): op(param) is [K, N], quantized per output
    channel with `scale`. Prints its member's declaration."""

    member: str
    param: str
    scale: str  # the buffer of its per-channel scales (named in the member, and in errors)
    tb: bool  # the param is stored [N, K] (a PyTorch Linear weight)
    K: str
    N: str
    taps: int = 1  # a convolution's KH * KW: its rows packed channels-last (dg_int8_weights.h)
    quantized: bool = True  # (the templates tell it from a KeptPacking by this)
    prepare = ""  # (a KeptPacking's: none here)
    kept_as = ""
    cpp_type = "dg::KeptInt8Weight"

    def __str__(self) -> str:
        tb = "true" if self.tb else "false"
        taps = f", /*taps=*/{self.taps}" if self.taps > 1 else ""
        return (f'dg::KeptInt8Weight {self.member}{{_version, {self.param}, {self.scale}, "{self.scale}", /*tb=*/{tb}, '
                f"/*K=*/{self.K}, /*N=*/{self.N}{taps}}};")


@dataclass
class ProjectPlan:
    name: str
    target: str
    source: str  # model file name
    version: str
    dims: list  # names of the symbolic dims, in binding order
    dim_count: int  # all symbolic dims, including those only training inputs bind
    inputs: list  # [InputSpec] that forward() takes
    all_inputs: list  # [InputSpec] of every input (train_step takes them all)
    params: list  # [ParamSpec]
    outputs: list  # [OutputSpec]
    requirements: list  # [(C++ condition, why as a C++ string literal)]
    statements: list  # [Statement]
    kernels: list  # [Kernel]
    graph_text: str  # `deepgen ir` of the model, for the README
    kernel_ext: str = ".cpp"
    model_ext: str = ".cpp"
    train: TrainPlan | None = None
    bound: set = field(default_factory=set)  # the symbolic dims forward() binds (sympy symbols)
    end: int = 0  # the schedule position after every node: outputs and gradient copies read there
    buffers: list = field(default_factory=list)  # the arena's memory.Buffers (plan_memory, from liveness)
    memory: dict = field(default_factory=dict)  # the arena plan (stage plan_memory: memory.plan_memory)
    trees: list = field(default_factory=list)  # [{arity, children, words, roots, function}] from OpDef.helpers
    mode: str = ""  # the local dg::Mode the mode-dependent ops read (batch norm, dropout), if any
    recording: Recording | None = None  # filled by the record stage
    kept: list = field(default_factory=list)  # [KeptPacking]: weights packed once, kept by the Model
    param_floats: int = 0  # floats of the trainable parameters, as stored
    # The .pyi stub's names for a method's own positional arguments (self, compute_gradients'
    # on_ready): an input called so would repeat the name, so it becomes _self, _on_ready.
    functions: list = field(default_factory=list)  # [outline.Function]: a user's function called more than once
    methods: list = field(default_factory=list)  # [sections.Method]: a long block that runs once
    kernel_structs: list = field(default_factory=list)  # kernels.h structs a method takes (model.h declares them)
    py_self: str = "self"
    modules: Modules = field(default_factory=Modules)  # the module structs and each parameter's C++ path
    precision: str = "fp32"  # "bf16": products read operands rounded to bfloat16 (transforms/precision.py)
    py_on_ready: str = "on_ready"
