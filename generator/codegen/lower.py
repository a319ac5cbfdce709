"""Lowering: Graph -> ProjectPlan.

Walks the graph once, in order. Each node's OpDef.lower() returns the typed
lines that compute it (codegen/stmt.py), using this module's LowerCtx to read
data (`ctx.read`), declare and write outputs (`ctx.write`), print sizes
(`ctx.size`), build runtime calls (`ctx.call`) and elementwise kernels
(`ctx.kernel`). Consecutive nodes from the same DSL statement share one
Statement, whose comment cites that line. Liveness and the arena plan come
later, from the lines (memory/liveness.py, memory/planner.py).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import numpy as np

from ..frontend.train import BIAS_CORRECTIONS, HYPER_RANGES
from ..version import __version__
from ..ir.names import comment_text, cpp_string, fresh_name, is_reserved
from ..ops import get_op
from ..ir.printing import format_graph
from ..ir.graph import Value
from ..ir.shapes import fmt_shape, numel, same
from ..memory.buffer import Buffer
from ..transforms.autodiff import train_only_inputs
from ..transforms.passes import regions
from .kernel_table import KernelTable
from .kernels import epilogue_kernel, ewise_kernel, update_kernel
from .modules import find_modules
from .printer import size_expr
from .plan import ArenaDecl, GradientDecl, InputSpec, KeptInt8, KeptPacking, OutputSpec, ParamSpec, ProjectPlan, Statement, TrainPlan, Update
from .stmt import CTYPE, Alias, Call, Comment, Copy, Data, Declare, Functor, Read, Write, place


def _shape_list(shape) -> str:
    return "{" + ", ".join(size_expr(d) for d in shape) + "}"


class LowerCtx:
    """What lowering knows while it walks the graph: where each value's data is
    (`place`), which values own a local vector, the kernels made so far and the
    declarations waiting for the line being lowered. Reading a value (`read`) has
    no effect: liveness is computed from the typed lines afterwards
    (codegen/liveness.py)."""

    def __init__(self, graph, target):
        self.graph = graph
        self.target = target  # codegen.targets.Target: its vector, scratch and copy names, printer
        self.place = {}  # id(value) -> C++ expression of its data where it is read now
        self.owned = set()  # id(value) of values held in a local std::vector
        self.outputs = set()  # id(value) of graph outputs: own storage, handed to the caller
        self.kept = {}  # (id(param), tb) -> KeptPacking: a weight the Model keeps packed
        self.plain_reads = set()  # id(param) of parameters the forward pass reads as stored (not packed)
        self._live = None
        self.kernels = []
        self.kernel_table = KernelTable(self.kernels)  # one elementwise kernel per body
        self.pending = []  # declarations for the line being lowered
        self.comment = ""  # the DSL statement being lowered, for buffer labels
        self.phase = "forward"
        self.modules = find_modules(graph, is_reserved)  # a repeated call's parameters: one struct (layer1_0.conv1_weight)
        self.loop = None  # the recursion being lowered: its own state (ops/recurse_scope.py, LoopState)
        self.views = {}  # id(value) -> (axis, ld): a row-strided piece of another buffer, read in place
        self.region = set()  # id(node) of the nodes lowered together now (the graph's, or a cell block's)
        self.gradients = {}  # id(value) -> gradient member, for parameter gradients the backward pass writes
        self.gradient_decls = set()  # id(value) of those declared by a GradientDecl
        self._readers = None
        self._data = {}  # id(value) -> (the value, its stmt.Data): the lines hold Data, never a graph value
        self._handed = {}  # id(value) -> the buffer its one reader reads instead (hand_over)

    def data(self, v) -> Data:
        """v as the lines name it: its one stmt.Data (plain data, no graph behind it)."""
        entry = self._data.get(id(v))
        if entry is None:
            entry = self._data[id(v)] = (v, Data(v.name, v.dtype, tuple(v.shape), v.kind))
        return entry[1]

    def plain_loc(self, loc):
        """`loc` with the values among its call's arguments as their Data (a Statement's call)."""
        if loc is None:
            return None
        plain = lambda args: tuple((n, self.data(v) if isinstance(v, Value) else v) for n, v in args)
        helper = loc.helper[:2] + (plain(loc.helper[2]),) if loc.helper else ()
        return replace(loc, call=self.plain_loc(loc.call), call_args=plain(loc.call_args), helper=helper)

    @contextmanager
    def placed(self, places: dict):
        """`with ctx.placed({value: expr}):` the values are read and written at
        those C++ expressions inside, and where they were before afterwards."""
        saved = {id(v): self.place.get(id(v)) for v in places}
        self.place.update({id(v): expr for v, expr in places.items()})
        try:
            yield
        finally:
            for key, expr in saved.items():
                if expr is None:
                    self.place.pop(key, None)
                else:
                    self.place[key] = expr

    @contextmanager
    def lowering_loop(self, state):
        """`with ctx.lowering_loop(state):` a recursion's lowering, whose own state
        (its cell blocks' declarations, packed weights, row maps: ops/recurse_scope.py's
        LoopState) the lines made inside consult as `ctx.loop`."""
        saved, self.loop = self.loop, state
        try:
            yield state
        finally:
            self.loop = saved

    def read(self, v) -> Read:
        """v's data, as the line being lowered reads it."""
        self._note_plain_read(v)
        return Read(self.data(v), self.place[id(v)])

    def _note_plain_read(self, v):
        if self.phase == "forward" and getattr(v, "kind", None) == "param":
            self.plain_reads.add(id(v))

    def kept_packings(self) -> list:
        """The KeptPackings, each marked whether it may stand in for its weight:
        the forward pass reads that weight through this one packing only (and the
        packing holds the weight's own floats, nothing it prepared from them)."""
        layouts = {}
        for k in self.kept.values():
            layouts[k.param] = layouts.get(k.param, 0) + 1
        return [replace(k, stands_in=not k.prepare and layouts[k.param] == 1 and pid not in self.plain_reads)
                if isinstance(k, KeptPacking) else k for (pid, _), k in self.kept.items()]

    def write(self, v) -> Write:
        """v's data, to write: its buffer is declared on first use (an arena piece
        for a float intermediate, a local vector otherwise or inside a cell)."""
        cell = self.loop.cell if self.loop is not None else None
        if id(v) not in self.place and cell is None and id(v) not in self.outputs and v.dtype == "float32":
            size = numel(v.shape)
            member = self.gradients.get(id(v))
            phase = "gradient" if member else self.phase
            buffer = Buffer(v.name, size, None, None, phase, label=self.comment, shape=v.shape)
            if member:
                self.pending.append(GradientDecl(buffer, self.size(size), self.data(v), member=member))
                self.gradient_decls.add(id(v))
            else:
                self.pending.append(ArenaDecl(buffer, self.size(size), self.data(v), shares=self._shares(v)))
            self.place[id(v)] = v.name
        elif id(v) not in self.place:
            if cell is not None:  # inside a cell's block: allocate once, before it
                decls, subs = cell
                size = numel(tuple(d if isinstance(d, int) else d.xreplace(subs) for d in v.shape))
                decls.append(Declare(f"{self.target.scratch_type}<{CTYPE[v.dtype]}>", v.name, [self.size(size)]))
            else:
                self.pending.append(Declare(f"{self.target.vector_type}<{CTYPE[v.dtype]}>", v.name,
                                            [self.size(numel(v.shape))], element=CTYPE[v.dtype]))
            self.place[id(v)] = f"{v.name}.data()"
            self.owned.add(id(v))
        return Write(self.data(v), self.place[id(v)])

    def _shares(self, v) -> tuple:
        """The operands of an in-place op (elementwise: each element read before it is
        written): liveness lets v (its output) take the block of one of its shape, unless
        the op also reads that block through a view (elements at other positions)."""
        node = v.producer
        if node is None or not get_op(node.op).in_place:
            return ()
        return tuple(self.data(u) for u in node.inputs)

    def workspace(self, hint: str, floats) -> Write:
        """Scratch memory the line being lowered uses and drops (a convolution's
        column matrix): a buffer of its own, live at that line only, so the arena
        plan and the memory report count it."""
        v = Value(self.graph.names.unique(hint), "float32", (floats,))
        return self.write(v)

    def sole_reader(self, v):
        """The one node that reads v, when it is lowered with the line being lowered
        (the same block) and nothing else reads v: no other node, no caller (an
        output), no view; else None."""
        readers, keep = self._reading()
        users = readers.get(id(v), [])
        if (len(users) != 1 or id(v) in keep or id(v) in self.outputs or id(v) in self.views
                or id(users[0]) not in self.region):
            return None
        return users[0]

    def hand_over(self, v, hint: str, floats) -> Write:
        """A buffer of its own (an arena piece, counted by the memory plan) where the
        line being lowered also writes v's data in the form v's one reader
        (sole_reader) takes instead of v: that reader finds it with `handed`."""
        h = Value(self.graph.names.unique(hint), "float32", (floats,))
        self._handed[id(v)] = h
        return self.write(h)

    def handed(self, v) -> Read | None:
        """The buffer hand_over made for v, to read; None when there is none."""
        h = self._handed.get(id(v))
        return None if h is None else self.read(h)

    def _reading(self):
        """(id(value) -> the nodes that read it, ids of values that must survive
        their region: outputs, the loss, gradients, a cell's results)."""
        if self._readers is None:
            readers, keep = {}, set()
            for nodes, kept in regions(self.graph):
                keep |= kept
                for n in nodes:
                    for v in n.inputs:
                        readers.setdefault(id(v), []).append(n)
            self._readers = readers, keep
        return self._readers

    def slice_view(self, piece, src, axis, start) -> Alias | None:
        """`piece` = src[..., start:start + len, ...] along `axis`, read in place
        as a row-strided view when only elementwise kernels of the block being
        lowered read it (they index it with src's row length: kernels.ewise_kernel):
        the Alias line that names it; None when it needs a copy of its own."""
        readers, keep = self._reading()
        users = readers.get(id(piece), [])
        if (not users or id(piece) in keep or id(piece) in self.outputs or id(piece) in self.place
                or id(src) in self.views or piece.dtype != "float32"
                or not self._read_in_place(users, numel(piece.shape[:axis]), _call_of(piece.producer))):
            return None
        inner = numel(src.shape[axis + 1 :])
        ld = numel(src.shape[axis:])
        offset = start * inner
        base = self.place[id(src)]
        at = base if offset == 0 else f"{base} + {self.size(offset)}"
        self.views[id(piece)] = (axis, ld)
        self.place[id(piece)] = piece.name
        note = f"{fmt_shape(piece.shape)}, read in place: rows {self.size(ld)} floats apart"
        self._note_plain_read(src)
        return Alias(self.data(piece), Read(self.data(src), at), CTYPE[piece.dtype], fmt_shape(piece.shape), note=note)

    def _read_in_place(self, users, rows, call) -> bool:
        """Whether the nodes reading a view of `rows` rows (users) all read it in
        place in the block being lowered: ops that read row-strided pieces
        (reads_views; reads_strided, made by the same call of a user's function as
        the view, `call`: its pointer is not passed between outlined functions), or
        reshapes that keep its rows whole (a head split's [N, T, 768] -> [N, T, 12,
        64]), made by that call too, their outputs read so in turn."""
        readers, keep = self._reading()
        for n in users:
            op = get_op(n.op)
            if id(n) not in self.region:
                return False
            if op.view:
                out = n.outputs[0]
                if (_call_of(n) != call or id(out) in keep or id(out) in self.outputs
                        or _row_axes(out.shape, rows) is None
                        or not self._read_in_place(readers.get(id(out), []), rows, call)):
                    return False
            elif not (op.reads_views or (op.reads_strided and _call_of(n) == call)):
                return False
        return True

    def concat_spot(self, v, nodes):
        """Where v can be written straight into its columns of a concat (a child
        state gathered into the level GEMM's operand): (the concat's output, v's
        first column, the output's row length) when v's one reader is a concat
        along axis 1 among `nodes`; else None. Concat.lower copies nothing for an
        operand placed there (the loop's `in_concat`)."""
        readers, keep = self._reading()
        users = readers.get(id(v), [])
        if len(users) != 1 or id(v) in keep or users[0].op != "concat" or users[0].attrs["axis"] != 1:
            return None
        concat = users[0]
        if not any(concat is n for n in nodes) or sum(u is v for u in concat.inputs) != 1:
            return None
        out = concat.outputs[0]
        if id(out) in keep or id(out) in self.outputs:
            return None
        column = 0
        for u in concat.inputs:
            if u is v:
                break
            column = column + numel(u.shape[1:])
        return out, column, numel(out.shape[1:])

    def claim_output(self, v) -> bool:
        """Whether the node producing v can write it straight into a given buffer."""
        return v.producer is not None and not get_op(v.producer.op).view and id(v) not in self.place

    def live_names(self) -> set:
        """Names taken in run() and the Model (for new Model members)."""
        if self._live is None:
            self._live = _live_names(self.graph)
        return self._live

    def keeps_packed(self, b, matrix: bool = False) -> bool:
        """Whether a forward-pass product reads parameter b through a packing the
        Model keeps between calls (runtime/dg_packed_weights.h). matrix: b is
        read as a matrix whatever its rank (a convolution's weight, [O, C*KH*KW])."""
        return (self.target.packs_weights and self.phase == "forward" and (matrix or b.rank == 2)
                and getattr(b, "kind", None) == "param" and any(b is p for p in self.graph.params))

    def packed_operand(self, b, tb: bool, shape: tuple | None = None) -> list | None:
        """How a product reads its right operand op(b) packed: [the loop's
        dg::PackedB], or [the Model's dg::KeptPackedB] for a parameter (packed
        once, kept until it changes; it knows its weight) or for a parameter's
        rounding that the packing applies (`prepared`); None to read b as it is.
        shape: the [rows, cols] matrix a parameter of another rank is read as
        (a convolution's weight, ops/conv.py)."""
        key = (id(b), tb)
        if self.loop is not None and key in self.loop.packed:
            return [self.loop.packed[key]]
        param, prepare = self.prepared(b)
        if not self.keeps_packed(param, matrix=shape is not None):
            return None
        if key not in self.kept:
            rows, cols = shape or b.shape
            k, n = (cols, rows) if tb else (rows, cols)
            member = _member_name(self.graph, f"{b.name}_t_packed" if tb else f"{b.name}_packed", self.live_names())
            kept_as, calls = get_op(b.producer.op).kept_as if prepare else ("", {})
            self.kept[key] = KeptPacking(member, self.modules.path(param.name), bool(tb), self.size(k), self.size(n),
                                         prepare=prepare, kept_as=kept_as, calls=calls)
        return [self.kept[key].member]

    def kept_call(self, fn: str, b, tb: bool) -> str:
        """The runtime function a product `fn` (dg::matmul, dg::conv2d ...) calls to read
        op(b): fn, or where b is read through a kept member of its own type the function
        that reads it (KeptPacking.calls: dg::matmul_bf16 for a dg::KeptBf16Weight)."""
        key = (id(b), tb)
        kept = self.kept.get(key) if self.loop is None or key not in self.loop.packed else None
        if kept is None or not kept.kept_as:
            return fn
        if fn not in kept.calls:
            raise NotImplementedError(f"{fn} cannot read {kept.member} ({kept.kept_as}): no such call in the runtime")
        return kept.calls[fn]

    def kept_int8(self, w, scale, tb: bool, k, n, taps: int = 1) -> str:
        """The Model's dg::KeptInt8Weight member of parameter w (op(w) [k, n]) quantized
        with `scale` (runtime/dg_int8_weights.h): quantized and packed once per change of
        the parameters (a convolution's with taps = KH * KW > 1: each row's k packed
        channels-last). It reads w as stored, so no packing of w may stand in for it."""
        self.plain_reads.add(id(w))
        key = (id(w), "int8")
        if key not in self.kept:
            member = _member_name(self.graph, f"{w.name}_int8", self.live_names())
            self.kept[key] = KeptInt8(member, self.modules.path(w.name), self.modules.path(scale.name), bool(tb),
                                      self.size(k), self.size(n), taps)
        return self.kept[key].member

    def prepared(self, b) -> tuple:
        """(the parameter, the function its kept packing applies as it packs) when b
        is made from a parameter by an op a packing can apply (OpDef.prepared_by_packing:
        a weight's bf16 rounding); else (b, "")."""
        node = b.producer
        fn = get_op(node.op).prepared_by_packing if node is not None else ""
        if fn and len(node.inputs) == 1 and getattr(node.inputs[0], "kind", None) == "param":
            return node.inputs[0], fn
        return b, ""

    def packing_prepares(self, node) -> bool:
        """Whether every reader of node's result reads it through a kept packing that
        applies the node itself (OpDef.packed_read, prepared): then the node emits nothing."""
        out = node.outputs[0]
        param, fn = self.prepared(out)
        readers, keep = self._reading()
        users = readers.get(id(out), [])
        if not fn or not users or id(out) in keep or id(out) in self.outputs:
            return False
        for user in users:
            how = get_op(user.op).packed_read(user)
            if how is None or user.inputs[how[0]] is not out or sum(u is out for u in user.inputs) != 1:
                return False
            if user.phase != "forward":  # a gradient's product (bf16 training) reads the rounded weight as it is
                return False
            if not self.keeps_packed(param, matrix=how[2] is not None):
                return False
        return True

    def call(self, fn: str, *args, template: str = "") -> Call:
        return Call(fn, list(args), template)

    def lower_nodes(self, nodes, subs: dict):
        """Lower a block of nodes (a cell of the recursive op being lowered): returns
        the buffer declarations, sized with `subs` applied (e.g. rows -> max_rows), to
        place before the block, and the block's lines with their DSL comments."""
        saved = self.loop.cell, self.comment, self.pending, self.region
        self.loop.cell = ([], subs)
        self.region = {id(n) for n in nodes}
        body, last = [], None
        for node in nodes:
            loc = node.loc
            key = (loc.filename, loc.stmt_line) if loc else None
            if key != last and loc is not None:
                self.comment = f"{loc.short}  {comment_text(loc.text)}"
                body.append(Comment(self.comment))
                last = key
            self.pending = []
            lines = get_op(node.op).lower(node, self)
            body += self.pending + lines
        decls = self.loop.cell[0]
        self.loop.cell, self.comment, self.pending, self.region = saved
        return decls, body

    def alias(self, v, src):
        """v shares src's data (a reshape): a named pointer, no copy."""
        self.pending.append(Alias(self.data(v), self.read(src), CTYPE[v.dtype], fmt_shape(v.shape)))
        self.place[id(v)] = v.name
        if id(src) in self.views:  # a row-strided view reshaped, its rows kept whole (_read_in_place)
            axis, ld = self.views[id(src)]
            self.views[id(v)] = (_row_axes(v.shape, numel(src.shape[:axis])), ld)

    def size(self, d) -> str:
        return size_expr(d)

    def string(self, text: str) -> str:
        return cpp_string(text)

    def _fused_comment(self, locs, fns, what="fuses") -> str:
        """A fused kernel's comment: what it computes (its functions, each once, in
        order), then each DSL statement it holds on a line of its own."""
        lines = list(dict.fromkeys(f"{loc.short}  {comment_text(loc.text)}" for loc in locs if loc))
        return "\n".join([f"{what} {', '.join(dict.fromkeys(fns))}:"] + lines)

    def epilogue(self, node, first: int = 2) -> Functor:
        """The functor a matmul with a fused epilogue passes to the GEMM: one per
        distinct body, like the elementwise kernels. Its members are the node's
        operands from `first` on (matmul_int8's: after its two scales)."""
        header, *places = self._fused_comment(node.attrs["epilogue_from"], node.attrs["epilogue_fns"],
                                              "the GEMM's epilogue, fusing").split("\n")
        use = epilogue_kernel(node, self.target.printer_cls, first)
        name = self.kernel_table.add(use, header, places)
        return Functor(name, tuple([self.read(v) for v in node.inputs[first:]] + use.extra))

    def kernel(self, node) -> Call:
        """A call of the elementwise kernel that computes node: one kernel per
        distinct body, named for what it computes (codegen/kernel_table.py); the call
        passes the node's operands, row maps and sizes."""
        fused = node.attrs.get("fused_from")
        if fused:
            header, *places = self._fused_comment(fused, node.attrs["fused_fns"]).split("\n")
        else:  # the DSL statement of the node (a gradient's: the one it differentiates)
            header, places = "", [f"{node.loc.short}  {comment_text(node.loc.text)}" if node.loc else self.comment]
        views = {k: self.views[id(v)] for k, v in enumerate(node.inputs) if id(v) in self.views}
        row_maps = {}  # operand -> the int64 pointer placing its rows
        maps = self.loop.row_maps if self.loop is not None else {}
        for k, v in enumerate(node.inputs + node.outputs[:1]):
            if id(v) in maps:  # rows placed by a map (a recursive op's state in node order)
                views[k] = (1, numel(v.shape[1:]))
                row_maps[k] = maps[id(v)]
        use = ewise_kernel(node, self.target.printer_cls, views, row_maps)
        name = self.kernel_table.add(use, header, places)
        args = [self.read(v) for v in node.inputs] + [self.write(node.outputs[0])] + use.extra
        return Call(f"kernels::{name}", args)


def _call_of(node):
    """Which call of a user's function made node (None: none): the lines of one
    call are outlined together (outline.py)."""
    loc = node.loc if node is not None else None
    if loc is None or loc.call is None:
        return None
    return loc.call.filename, loc.call.line, loc.call_id


def _row_axes(shape, rows):
    """The first axis a of `shape` with `rows` elements before it (a view's rows
    kept whole through a reshape: LowerCtx._read_in_place); None when there is none."""
    for a in range(len(shape) + 1):
        if same(numel(shape[:a]), rows):
            return a
    return None


def _input_spec(v, dim_index) -> InputSpec:
    checks = []
    for axis, d in enumerate(v.shape):
        if isinstance(d, int):
            checks.append(f"_check.fixed({axis}, {d});")
        else:
            checks.append(f"_check.symbolic({axis}, {dim_index[d]}, {cpp_string(str(d))});")
    return InputSpec(v.name, CTYPE[v.dtype], v.dtype, fmt_shape(v.shape), checks, v.rank)


def _cited_once(specs) -> list:
    """The parameters in order, each citing its DSL line unless the one before it cites the
    same (a layer's weight and bias: one comment above both)."""
    out, last = [], None
    for spec in specs:
        comment = spec.comment
        if comment == last:
            spec = replace(spec, comment="")
        out.append(spec)
        last = comment
    return out


def _param_spec(p, modules) -> ParamSpec:
    prim = p.init.resolve(p.shape)
    seed = f"{p.seed}u" if p.seed is not None else "_seed"  # Network::_init's argument
    lit = [f"{np.float32(x)!r}".replace("np.float32(", "").rstrip(")") + "f" for x in prim[1:]]
    path = modules.path(p.name)
    target = f"{path}.ptr(), {path}.size()"
    if prim[0] == "constant":
        args = lit[0]
    else:
        args = f"{seed}, dg::name_stream({cpp_string(p.name)}), {lit[0]}, {lit[1]}"
    init = f"dg::init_{prim[0]}({target}, {args});"
    comment = f"{p.loc.short}  {comment_text(p.loc.text)}" if p.loc else ""
    found = modules.instance_of(p.name)
    first = found is not None and found[0].params[0] == p.name  # where the Network declares the module
    instance = found[0] if first else None
    return ParamSpec(p.name, list(p.shape), fmt_shape(p.shape), init, comment, f"dg::init_{prim[0]}", args,
                     trainable=p.kind == "param", member=path, instance=instance)


def _statements(ctx, nodes, first: int) -> list:
    """One Statement per run of consecutive nodes from the same DSL statement;
    node k runs at schedule position first + k."""
    statements, key, call_key = [], object(), None
    for position, node in enumerate(nodes, first):
        loc = node.loc
        again = bool(node.attrs.get("recomputed"))  # made again for the gradient (transforms/remat.py)
        k = (loc.filename, loc.stmt_line, loc.call_id, loc.run, again) if loc else None
        if k != key or not statements:
            text = f"{loc.short}  {comment_text(loc.text)}" if loc else node.op
            if node.phase == "backward":
                text = f"{'made again for the gradient:' if again else 'gradient of'} {text}"
            ctx.comment = text
            plain = ctx.plain_loc(loc)
            statements.append(Statement(ctx.comment, call=plain if loc and loc.call else None,
                                        helper=plain.helper if loc else (), again=again))
            key = k
            # The statements of one call of a user's function (a residual block) come
            # together under the line that called it.
            call = loc.call if loc else None
            new_call_key = (call.filename, call.line, loc.call_id) if call else None
            if call and new_call_key != call_key:
                # The call with its arguments' values: the loop's `f"layer{stage}_0"` as 'layer2_0'.
                header = f"{call.short}  {comment_text(loc.call_text or call.text)}"
                statements[-1].header = f"gradient of {header}" if node.phase == "backward" else header
            call_key = new_call_key
        helper = statements[-1].helper
        if not (loc and loc.helper and helper and loc.helper[0] == helper[0]):
            statements[-1].helper = ()  # made by several calls (`relu(x @ w + b)`), or by none
        ctx.pending = []
        ctx.phase = node.phase
        statements[-1].positions.append(position)
        lines = get_op(node.op).lower(node, ctx)
        statements[-1].lines += place(ctx.pending + lines, position)
    return statements


def _outputs(ctx, graph, access: str) -> list:
    outputs, first = [], {}
    for name, v in graph.outputs:
        shape = _shape_list(v.shape)
        ctype = CTYPE[v.dtype]
        data = ctx.read(v)
        if id(v) in first:  # the same value returned twice: copy the first output
            make = f"dg::Tensor<{ctype}>({shape}, {access}{first[id(v)]}.ptr())"
        elif id(v) in ctx.owned:  # a local buffer: hand it over without copying
            make = f"dg::Tensor<{ctype}>({shape}, std::move({v.name}))"
        else:  # an input, a parameter or an alias: copy it
            make = f"dg::Tensor<{ctype}>({shape}, {data})"
        output_make = ctx.target.names.get("output_make", "")
        if output_make:  # a target whose outputs are copied from elsewhere (the GPU)
            make = output_make.format(ctype=ctype, shape=shape, data=data)
        first.setdefault(id(v), name)
        outputs.append(OutputSpec(name, ctype, v.dtype, fmt_shape(v.shape), make, shape, str(data), data))
    return outputs


def _live_names(graph) -> set:
    """Names of the values the optimized graph still holds (and of its dims)."""
    names = {v.name for v in list(graph.inputs) + list(graph.params)} | {str(d) for d in graph.dims}
    nodes = list(graph.nodes)
    for node in graph.nodes:
        for region, _ in get_op(node.op).regions(node):
            nodes += region
    for node in nodes:
        names.update(v.name for v in node.inputs + node.outputs)
    return names


def _member_name(graph, name: str, live: set) -> str:
    """`name` for a Model member (d_h1_b, h1_w_buf) unless a live value holds it; a
    name only a value the passes removed had is free again (no d_h1_b_1)."""
    if name not in live and not is_reserved(name):
        graph.names.used.add(name)
        live.add(name)
        return name
    unique = graph.names.unique(name)
    live.add(unique)
    return unique


def _lower_training(ctx, graph, dim_index, bound_dims, first: int) -> TrainPlan:
    """The loss, backward and update parts of train_step."""
    spec = graph.train
    train_inputs = train_only_inputs(graph)
    checks = [_input_spec(v, dim_index) for v in train_inputs]
    later_dims = [(str(d), i) for d, i in dim_index.items() if d not in bound_dims]
    # Gradients of parameters are Model members (gradients() shows them). The
    # backward pass writes a gradient straight into its member where it can (a
    # GradientDecl: an arena piece instead when train_step() does not keep them),
    # else it is copied there when gradients are kept.
    live = ctx.live_names()
    grads, direct = [], {}
    # A module's gradients are one struct too (d_layer1_0.conv1_weight), its name kept from values'.
    ctx.modules.use_gradient_structs(set(spec.grads), lambda n: n not in live and n not in graph.names.used
                                     and not is_reserved(n))
    for struct in ctx.modules.structs:
        if struct.gradients:
            graph.names.used.update(f"d_{i.name}" for i in struct.instances)
            live.update(f"d_{i.name}" for i in struct.instances)
    for p in graph.params:
        g = spec.grads.get(p.name)
        if g is None:
            continue
        own = (g.producer is not None and g.producer.phase == "backward" and not get_op(g.producer.op).view
               and id(g) not in ctx.place and sum(x is g for x in spec.grads.values()) == 1)
        member = ctx.modules.gradient_path(p.name)
        if member is None:
            member = g.name if own and g.name == f"d_{p.name}" else _member_name(graph, f"d_{p.name}", live)
        grads.append((p.name, member, _shape_list(p.shape)))
        if own:
            ctx.gradients[id(g)] = direct[p.name] = member
    loss_nodes = [n for n in graph.nodes if n.phase == "loss"]
    backward = [n for n in graph.nodes if n.phase == "backward"]
    # The loss lives to the end of the step: a vector of its own, like an output, so
    # that it does not pin a float on top of the arena (where the gradients go when
    # train_step does not keep them).
    ctx.outputs.add(id(spec.loss))
    loss_statements = _statements(ctx, loss_nodes, first)
    backward_statements = _statements(ctx, backward, first + len(loss_nodes))
    end = first + len(loss_nodes) + len(backward)
    # A gradient written inside a block (a recursive op's cell) is in a buffer of that block: copied.
    copies = [(p, spec.grads[p], member) for p, member, _ in grads
              if p not in direct or id(spec.grads[p]) not in ctx.gradient_decls]
    copy_lines = place([Copy(ctx.target.copy_fn, ctx.read(g), f"{member}.size()", f"{member}.ptr()")
                        for _, g, member in copies], end)
    opt = spec.optimizer
    kernel = update_kernel(opt, ctx.target.printer_cls)
    # kernels:: holds one function per value name: keep the update's (and its twin's) apart
    taken = {k.name for k in ctx.kernels} | set(graph.names.used)
    kernel.name = fresh_name(kernel.name, taken)
    taken.add(kernel.name)
    ctx.kernels.append(kernel)
    # Its hyperparameters, one struct: each field the Model's setting, or Adam's bias
    # correction 1 - beta^step, computed in double from the step count (std::pow casts
    # the integer step to double).
    hyper = kernel.struct
    hyper.name = fresh_name(hyper.name, taken | {kernel.name})
    kernel.args[-1] = replace(kernel.args[-1], ctype=hyper.name)
    hyper.values = [f"static_cast<float>(1.0 - std::pow(static_cast<double>(_model.hyper.{BIAS_CORRECTIONS[name]}), "
                    "_model.step))" if name in BIAS_CORRECTIONS else f"_model.hyper.{name}" for name, _ in hyper.fields]
    # Its twin without threads, for a GEMM's threads to call on their blocks of rows
    # (added to the kernels where the memory stage fuses an update into a product).
    serial = replace(kernel, name=fresh_name(f"{kernel.name}_serial", taken), work="",
                     comment=f"{kernel.comment}\nOn one thread: the GEMM that makes a gradient calls it on each block\n"
                     "of its rows (dg::update_rows), from the thread that computed the block.", struct=None)
    slots = {p: [(slot, _member_name(graph, f"{p}_{slot}", live)) for slot in opt.slots] for p, _, _ in grads}
    # One update call per parameter; the memory stage moves each into the statement
    # where its gradient is complete and it is no longer read (DeepDSL's rescheduling).
    updates = []
    copied = {p for p, _, _ in copies}
    params = {p.name: p for p in graph.params}
    for index, (p, member, _) in enumerate(grads):
        path = ctx.modules.path(p)
        rest = [f"{m}.ptr()" for _, m in slots[p]] + [f"{path}.size()", hyper.local]
        fn = f"kernels::{kernel.name}"
        # train_step() reads the gradient where the backward pass left it (kept or not);
        # apply_update() reads the member compute_gradients() filled.
        run_call = Call(fn, [f"{path}.ptr()", ctx.read(spec.grads[p])] + rest)
        apply_call = Call(fn, [f"{path}.ptr()", f"{member}.ptr()"] + rest)
        # The same step on elements [at, at + n), run by the product that makes the gradient
        # where the memory stage can fuse it (memory/liveness.py: place_updates).
        arrays = [f"{path}.ptr()"] + [f"{m}.ptr()" for _, m in slots[p]]
        rows_call = Call(f"kernels::{serial.name}",
                         [f"{arrays[0]} + _at", "_g"] + [f"{a} + _at" for a in arrays[1:]] + ["_n"] + rest[len(arrays):])
        updates.append(Update(p, ctx.data(params[p]), ctx.data(spec.grads[p]), run_call, p in copied, index, apply_call, rows_call, arrays,
                              serial))
    # The gradients lie end to end in one buffer (gradient_buffer(): one allreduce for all).
    offsets, total = [], 0
    for p, _, _ in grads:
        offsets.append(total)
        total += int(np.prod(params[p].shape, dtype=np.int64))
    settings = [(name, f"{np.float32(value)!r}".replace("np.float32(", "").rstrip(")") + "f") for name, value in spec.hyper]
    hyper_checks = [(name, f"dg::{HYPER_RANGES[name]}") for name, _ in spec.hyper]
    loss = ctx.read(spec.loss)
    return TrainPlan(
        optimizer=opt.describe(),
        kind=opt.kind,
        inputs=checks,
        input_names=[v.name for v in graph.inputs],
        dims=later_dims,
        loss=f"{loss}[0]",
        loss_read=loss,
        loss_statements=loss_statements,
        backward_statements=backward_statements,
        copies=copy_lines,
        updates=updates,
        all_updates=list(updates),
        hyper=settings,
        hyper_checks=hyper_checks,
        hyper_struct=hyper,
        grads=grads,
        slots=[(p, slot, member, shape) for p, _, shape in grads for slot, member in slots[p]],
        grad_offsets=offsets,
        grad_total=total,
        places=bool(ctx.gradient_decls),
    )


def lower(graph, target) -> ProjectPlan:
    if graph.train is not None and not graph.train.prepared:
        raise ValueError(f"lower: graph {graph.name!r} trains but is not differentiated yet (pipeline.differentiate)")
    ctx = LowerCtx(graph, target)
    graph.names.used.update(i.name for i in ctx.modules.instances())
    dims = graph.dims
    dim_index = {d: i for i, d in enumerate(dims)}
    for v in graph.inputs:
        ctx.place[id(v)] = v.name
    for p in graph.params:
        ctx.place[id(p)] = f"{ctx.modules.path(p.name)}.ptr()"
    if graph.mode is not None:
        ctx.place[id(graph.mode)] = graph.mode.name
    train_inputs = {id(v) for v in train_only_inputs(graph)} if graph.train else set()
    forward_inputs = [v for v in graph.inputs if id(v) not in train_inputs]
    bound = {s for v in forward_inputs for d in v.shape for s in getattr(d, "free_symbols", ())}

    ctx.outputs = {id(v) for _, v in graph.outputs}
    ctx.region = {id(n) for n in graph.nodes}
    forward = [n for n in graph.nodes if n.phase == "forward"]
    statements = _statements(ctx, forward, 0)
    train = _lower_training(ctx, graph, dim_index, bound, len(forward)) if graph.train else None
    outputs = _outputs(ctx, graph, "_outputs->")

    requirements = [(f"{ctx.size(expr)} >= 0", cpp_string(why)) for expr, why in graph.requirements]
    source = graph.loc.short.split(":")[0] if graph.loc else "model.py"
    return ProjectPlan(
        name=graph.name,
        target=target.name,
        source=source,
        version=__version__,
        dims=[(str(d), i) for d, i in dim_index.items() if d in bound],
        dim_count=len(dims),
        inputs=[_input_spec(v, dim_index) for v in forward_inputs],
        all_inputs=[_input_spec(v, dim_index) for v in graph.inputs],
        params=_cited_once(_param_spec(p, ctx.modules) for p in graph.params),
        modules=ctx.modules,
        mode=graph.mode.name if graph.mode is not None else "",
        outputs=outputs,
        requirements=requirements,
        statements=statements,
        kernels=ctx.kernels,
        graph_text=format_graph(graph),
        kernel_ext=target.kernel_ext,
        model_ext=target.model_ext,
        train=train,
        bound=bound,
        end=sum(n.phase in ("forward", "loss", "backward") for n in graph.nodes),
        trees=[helper for n in graph.nodes for helper in get_op(n.op).helpers(n)],
        kept=ctx.kept_packings(),
        param_floats=sum(int(np.prod(p.shape)) for p in graph.params if p.kind == "param"),
        py_self=_stub_name("self", graph.inputs),
        py_on_ready=_stub_name("on_ready", graph.inputs),
        precision=graph.precision,
    )


def _stub_name(name: str, inputs) -> str:
    """`name` for a positional argument in the .pyi stub, or `_name` where an input
    (a keyword argument of the same method) is called so."""
    return f"_{name}" if any(v.name == name for v in inputs) else name
