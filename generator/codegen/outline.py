"""Stage `outline` (after plan_memory): a function of the user's that the model calls
more than once becomes one C++ function, called once per use.

The forward statements of one call of a user's function (ResNet's `basic_block`, an
encoder layer) come together in the plan, each group headed by the call. Calls of the
same function whose lowered lines have the same shape, differing only in what each
call gets (its input, its weights, its pieces of the arena, its sizes, the strings of
its error messages), become one function: the first call's lines with those parts
replaced by the function's parameters, and each call a line passing its own.

Which parts are "per call" is read off the typed lines, never off printed C++:
- a line's operands (`Read`/`Write`) of values made outside the call (its input,
  its weights, the model's inputs) are always parameters, named after the user's
  function parameter that received the value, else after the value without the call's
  name prefix (`layer2_0_conv1_weight` -> `conv1_weight`);
- each arena piece the call declares (`ArenaDecl`) is a pointer parameter; the caller
  declares the pieces later code reads (the call's result, what the backward pass
  keeps) and passes the others as `_arena.at(...)` (a parameter's gradient as
  `_gradients.at(index, ...)`: its member while the step keeps gradients), once where
  two are one piece in every call (the second is named inside: `float* out = bn1;  // in place`);
- the pieces of a call's frame (what it keeps for its gradient: memory/frames.py) are one
  parameter, `saved`, where the function's sizes can say each piece's offset in it
  (codegen/frames.py); the caller declares the frame, the functions the pieces;
- every other leaf (a size, a string literal) that differs between the calls is a
  parameter, one per distinct list of values; one that is the same in every call
  stays in the body. Run-time sizes (`N`) and the mode a body reads are parameters too.
Names the call declares lose the call's name prefix inside the function (the block's
own names: `conv1`, `bn1_mean`, `out`). A group whose lines hold anything else (a
recursion's level loop, a gradient's update) stays where it is, inline.
Outlining moves code, never changes it: same operations, same order, same memory.
"""

from __future__ import annotations

import dataclasses
import keyword
import re
from dataclasses import dataclass, field

from ..ir.names import fresh_name
from .derived_sizes import SizeLine, derive_sizes
from .modules import gradient_field_of_each, local_name, name_arguments
from .frames import FrameDecl, FramePiece, GradientPiece, layout, members_by_name
from .printer import size_expr
from .plan import ArenaDecl, GradientDecl, Statement
from .declared_once import declare_once
from .sections import outline_blocks
from .stmt import (Alias, Call, Comment, Copy, Declare, EarlyUpdate, Functor, PieceAs, Named, Operand, Read, Scope,
                   Struct, UpdateRows, Write, operands)

_IDENT = re.compile(r"(?<![\w.:>])[A-Za-z_]\w*(?![\w(]|::)")
_INT_EXPR = re.compile(r"^([\w\s+\-*/()]|\.size\(\))+$")
_FLOAT = re.compile(r"^-?\d+(\.\d*)?(e[+-]?\d+)?f$")
# Words a body may hold that are not values: C++ words and the runtime's.
_CPP_WORDS = {"nullptr", "true", "false", "static_cast", "sizeof", "float", "double", "int", "const",
              "_at", "_g", "_n"}  # the last: the parameters of UpdateRows's lambda
# Names of _run's that a body may read, and their types as a function's parameters.
_RUN_LOCALS = {"_gradients_only": "const std::function<void(int)>*", "_model": "Model&",
               "_gradients": "const dg::GradientPlaces<dg::Arena>&"}
_MEMBER_PTR = re.compile(r"^\w+(\.\w+)?\.ptr\(\)$")
_STRING = re.compile(r'"(\\.|[^"\\])*"')


class _NotOutlined(Exception):
    """A line outlining does not handle: the call stays inline."""


@dataclass
class Function:
    """A typed line printed before `Network::_run`: the C++ function for one user's
    function, its parameters and the first call's statements as its body."""

    name: str
    source: str  # "resnet18.py:17" where the user's function is, for the comment
    params: list  # [(C++ type, name)]
    body: list  # [Statement]
    sizes: list = field(default_factory=list)  # [(order, C++ type, name, each call's value)] of its sizes

    def __str__(self) -> str:
        params = ", ".join(f"{t} {n}" for t, n in self.params)
        out = [f"// {self.source}: the code of each call of `{self.name}` (the calls pass what differs).",
               f"void {self.name}({params}) {{"]
        for s in self.body:
            if s.comment:
                out += ["", f"  // {s.comment}"]
            out += [f"  {line}" for line in s.lines]
        out.append("}")
        return "\n".join(out)


@dataclass(eq=False)
class CallLine:
    """`basic_block(/*x=*/x, /*conv1_weight=*/layer1_0_conv1_weight.ptr(), ...);`."""

    fn: str
    args: list  # [Named]
    at: int = -1
    bare: frozenset = frozenset()  # parameters whose argument names itself: a module (layer1_0)

    def __str__(self) -> str:
        args = [str(a.arg) if a.name in self.bare or _says_its_name(a) else str(a) for a in self.args]
        return f"{self.fn}({', '.join(args)});"


def _says_its_name(arg: Named) -> bool:
    """Whether an argument's text already names the parameter it fills (`mode` for
    `mode`, `layer1_0_bn1_mean` for `bn1_mean`, `d_layer4_1_bn2_weight` for
    `d_bn2_weight`): then a /*bn1_mean=*/ beside it would repeat it."""
    text, name = str(arg.arg), arg.name
    text = text[: -len(".ptr()")] if text.endswith(".ptr()") else text
    place = re.match(r"_gradients\.at\((\w+), ", text)  # a parameter's gradient: its member names it
    text = place.group(1) if place else text
    if not re.fullmatch(r"\w+", text):
        return False
    if text == name or text.endswith("_" + name):
        return True
    return name.startswith("d_") and text.startswith("d_") and text.endswith("_" + name[2:])


@dataclass
class _Leaf:
    kind: str  # "ext" operand from outside, "arena" piece, "text" leaf
    payload: object  # the Operand, the ArenaDecl, or the (renamed) text
    slot: str = ""  # where it sits, for names: the Named label or the local value name
    of: str = ""  # the local name of what the call it is an argument of writes (a size's: what it counts)


@dataclass
class _Instance:
    statements: list
    loc: object  # the Loc of a node of the call (call_id, call_args, call_text)
    renames: dict = field(default_factory=dict)  # declared name -> local name
    leaves: list = field(default_factory=list)
    shape: list = field(default_factory=list)  # the structure: what must be equal between calls
    first: object = None  # the plan's statement this call's lines were split from, if they were
    cut: object = None  # the plan's statement whose first lines end the call, if one is cut
    vectors: set = field(default_factory=set)  # names of the std::vectors it declares
    rest: list = field(default_factory=list)  # the cut statement's other lines: inline after the call


def outline(plan, graph=None):
    """Replace the statements of repeated calls (forward, and backward when the model
    trains) by calls of one function each (`graph`'s name table gives the names the
    user asked for: `out`, not `out_1`)."""
    bases = graph.names.bases if graph is not None else {}
    lists = {"forward": plan.statements}
    if plan.train is not None:
        lists["backward"] = plan.train.backward_statements
    for statements in lists.values():  # a convolution's two gradients take one geometry
        for s in statements:
            declare_once([[s]])
    found, inline = {}, {}
    for part, statements in lists.items():
        found[part] = []
        for inst in _instances(statements):
            if part == "backward" and len(inst.statements) < _BACKWARD_MIN:
                continue  # a piece of a call's gradient that the schedule moved: inline
            try:
                _read_instance(inst, bases)
                found[part].append(inst)
            except _NotOutlined:
                continue
        _split_prefixes(found[part], bases)
        inline[part] = _split_first_uses(found[part], bases)
    later_reads = _reads_after(plan, lists, found, inline)
    taken = _taken_names(plan)
    called = {}  # call_id -> (the function its forward lines became, {size parameter: its value})
    forward = set()  # the functions of the forward lines
    for part, statements in lists.items():
        suffix = "" if part == "forward" else "_backward"
        new = _outline_part(statements, found[part], inline[part], plan, later_reads, taken, suffix, called)
        if part == "forward":
            forward = {f.name for f in plan.functions}
            plan.statements = new
        else:
            plan.train.backward_statements = new
    _declare_read_pieces(plan)
    _name_module_sizes(plan, {c: sizes for c, (fn, sizes) in called.items() if fn in forward}, graph)
    for f in plan.functions:
        declare_once([f.body])
    declare_once([plan.statements] + ([plan.train.loss_statements, plan.train.backward_statements] if plan.train else []))
    outline_blocks(plan)  # then each long block that runs once: a member function
    return plan


def _name_module_sizes(plan, sizes, graph) -> None:
    """A module struct's constructor arguments (codegen/modules.py) take the names of the
    forward function's sizes with the same values in every call (`sizes`: call_id -> {name:
    value}; `C`, `O`), else of the user's int arguments (`channels`)."""
    ints = {}
    for node in graph.nodes if graph is not None else ():
        loc = node.loc
        if loc is not None and loc.call is not None:
            ints.setdefault(loc.call_id, {n: v for n, v in loc.call_args if type(v) is int})
    for struct in plan.modules.structs:
        name_arguments(struct, sizes, ints)


def _declare_read_pieces(plan) -> None:
    """A frame that a function takes but no caller declared (its forward call was not
    outlined with it): declared where its first piece is. A piece of a call's frame that a
    line outside the functions reads by its name (a gradient left inline): declared by the
    caller after the frame, at its planned offset."""
    lists = [plan.statements] + ([plan.train.loss_statements, plan.train.backward_statements]
                                 if plan.train is not None else [])
    statements = [s for group in lists for s in group]
    used, declared, at = set(), set(), {}
    for s in statements:
        for line in s.lines:
            used.update(_IDENT.findall(_STRING.sub(" ", str(line))))  # not a name in an error message
            declared.add(_declared(line))
            if isinstance(line, FrameDecl):
                at[id(line.frame)] = (s, line)
    for frame in {id(m.frame): m.frame for m in members_by_name(plan).values()}.values():
        if frame.name not in used or id(frame) in at:
            continue
        for s in statements:
            mine = [line for line in s.lines if isinstance(line, ArenaDecl) and line.buffer.frame is frame]
            if mine or frame.name in _IDENT.findall(_STRING.sub(" ", " ".join(map(str, s.lines)))):
                decl = FrameDecl(frame)
                s.lines.insert(s.lines.index(mine[0]) if mine else 0, decl)
                at[id(frame)] = (s, decl)
                break
    for s, decl in at.values():
        missing = [m for m in decl.frame.members if m.name in used and m.name not in declared]
        k = s.lines.index(decl) + 1
        s.lines[k:k] = [ArenaDecl(m, size_expr(m.size)) for m in missing]


def _outline_part(statements, instances, kept_inline, plan, later_reads, taken, suffix, called) -> list:
    groups: dict = {}
    for inst in instances:
        groups.setdefault(_group_key(inst), []).append(inst)
    replaced = {}
    again = {key for key, group in groups.items() if all(s.again for s in group[0].statements)}
    names = _variant_names({key: group for key, group in groups.items() if key not in again})
    for key, group in groups.items():
        if len(group) < 2:
            continue
        if key in again:  # what the backward pass makes again of a call: named after the call's function
            forward = [called[i.loc.call_id][0] for i in group if i.loc.call_id in called]
            name = (forward[0] if forward else _function_name(group[0].loc)) + "_again"
        else:
            name = names[key] + suffix
        try:
            function, calls = _make_function(group, plan, fresh_name(name, taken), later_reads, called)
        except _NotOutlined:
            continue
        taken.add(function.name)
        plan.functions.append(function)
        for j, (inst, call_statement) in enumerate(zip(group, calls)):
            replaced[id(inst.first or inst.statements[0])] = (inst, call_statement)
            sizes = {n: values[j] for order, _, n, values in function.sizes}
            called.setdefault(inst.loc.call_id, (function.name, sizes))
    out, skip = [], set()
    for s in statements:
        if id(s) in replaced:
            inst, call_statement = replaced[id(s)]
            if id(s) in kept_inline:
                out.append(kept_inline[id(s)])
            out.append(call_statement)
            out += inst.rest
            skip.update(id(t) for t in inst.statements + [inst.cut])
        elif id(s) not in skip:
            out.append(s)
    return out


def _split_first_uses(instances, bases) -> dict:
    """A layer helper's first call may compute what later calls reuse (the attention
    mask of BERT's first encoder layer and the key mask made from it, which the others
    read): the lines that make a value another call of the same function reads, when
    they read nothing else the call makes, stay inline, before the call, and the rest
    is the call. Returns {id(first statement): the inline part}."""
    by_function: dict = {}
    for inst in instances:
        if len(inst.statements) == 1:
            by_function.setdefault((inst.loc.filename, _function_name(inst.loc)), []).append(inst)
    inline = {}
    for group in by_function.values():
        shortest = min(group, key=lambda i: len(i.statements[0].lines))
        for inst in list(group):
            head = inst.statements[0]
            if len(head.lines) <= len(shortest.statements[0].lines):
                continue
            others = " ".join(str(line) for o in group if o is not inst for line in o.statements[0].lines)
            declared = {n for n in map(_declared, head.lines) if n}
            io = [(line, *_reads_writes(line)) for line in head.lines]
            # What other calls read, and what that is made from in this call.
            passed = {getattr(v, "name", None) for o in group for _, v in o.loc.call_args}  # x of the next call
            needed = {n for n in declared - passed if re.search(rf"\b{re.escape(n)}\b", others)}
            grown = True
            while grown:
                grown = False
                for line, reads, writes in io:
                    if _declared(line) in needed or (writes and writes <= needed):
                        more = (reads & declared) - needed
                        needed |= more
                        grown = grown or bool(more)
            hoisted, rest = [], []
            for line, reads, writes in io:
                keep = _declared(line) in needed or (writes and writes <= needed)
                (hoisted if keep else rest).append(line)
            if not hoisted:
                continue
            trial = _Instance([dataclasses.replace(head, lines=rest)], inst.loc)
            try:
                _read_instance(trial, bases)
            except _NotOutlined:
                continue
            if trial.shape == shortest.shape:
                inline[id(head)] = Statement(head.comment, hoisted, head.positions, head.header)
                trial.first = head
                instances[instances.index(inst)] = trial
    return inline


def _split_prefixes(instances, bases) -> None:
    """A call whose lines are those of other calls of the same function plus more
    statements after them (ResNet's first block's gradient, which ends with its first
    convolution's weight gradient where the schedule moved the others' later) is a
    call of their function followed by the rest, inline: the instance becomes its
    longest prefix that is shaped like a group of two calls or more."""
    groups: dict = {}
    for inst in instances:
        groups.setdefault(_group_key(inst), []).append(inst)
    shared = {key for key, group in groups.items() if len(group) > 1}
    for key, group in groups.items():
        if len(group) > 1:
            continue
        inst = group[0]
        for trial in _prefixes(inst):
            try:
                _read_instance(trial, bases)
            except _NotOutlined:
                continue
            if _group_key(trial) in shared:
                instances[instances.index(inst)] = trial
                break


def _prefixes(inst):
    """The instance's shorter prefixes, longest first, cut between statements or inside
    the last one (its remaining lines, `trial.rest`, run inline after the call)."""
    for n in range(len(inst.statements), 0, -1):
        last = inst.statements[n - 1]
        for m in range(len(last.lines) - (1 if n == len(inst.statements) else 0), 0, -1):
            head = dataclasses.replace(last, lines=last.lines[:m])
            trial = _Instance(inst.statements[: n - 1] + [head], inst.loc)
            trial.cut = last
            if m < len(last.lines):
                trial.rest = [dataclasses.replace(last, lines=last.lines[m:], header="")]
            yield trial


def _group_key(inst) -> tuple:
    """Calls with equal keys become one function: the same user's function, lowered alike."""
    return (inst.loc.filename, _function_name(inst.loc), tuple(map(repr, inst.shape)))


def _reads_writes(line):
    reads = {w for op in operands(line) if isinstance(op, Read) for w in _IDENT.findall(op.expr)}
    writes = {w for op in operands(line) if isinstance(op, Write) for w in _IDENT.findall(op.expr)}
    return reads, writes


def _variant_names(groups) -> dict:
    """A function's calls that lower to different code (a block with a shortcut branch
    and one without) are different C++ functions: the most called one takes the user's
    function's name, each other one says what it has that one lacks
    (`basic_block_with_shortcut`), or lacks that it has."""
    names, by_function = {}, {}
    for key, group in groups.items():
        by_function.setdefault(key[:2], []).append((key, group))
    for variants in by_function.values():
        main_key, main = max(variants, key=lambda kv: len(kv[1]))
        fn = _function_name(main[0].loc)
        base = set(main[0].renames.values())
        for key, group in variants:
            names[key] = fn
            if key == main_key:
                continue
            own = list(group[0].renames.values())
            extra = [n for n in own if n not in base]
            missing = [n for n in main[0].renames.values() if n not in set(own)]
            if extra or missing:
                parts = (extra or missing)[0].split("_")  # shortcut_0_cols -> shortcut
                word = "_".join(parts[: next((k for k, p in enumerate(parts) if p.isdigit()), len(parts))]) or parts[0]
                word = word[2:] if word.startswith("d_") and len(word) > 2 else word  # a gradient's: d_shortcut
                names[key] = f"{fn}_{'with' if extra else 'without'}_{word}"
    return names


def _function_name(loc) -> str:
    return loc.call_text.split("(", 1)[0] if loc.call_text else ""


def _instances(statements) -> list:
    """Runs of consecutive statements from one call of a user's function, and
    statements that one call of a DSL layer helper made (two nodes or more)."""
    out = []
    for s in statements:
        loc = s.call
        if loc is None and s.helper and len(s.positions) > 1:
            out.append(_Instance([s], _helper_call(s)))
            continue
        if loc is None or not loc.call_text:
            continue
        if out and out[-1].loc.call_id == loc.call_id and out[-1].statements[-1] is _prev(statements, s):
            out[-1].statements.append(s)
        else:
            out.append(_Instance([s], loc))
    return out


@dataclass(frozen=True)
class _HelperCall:
    """A call of a deepgen function (a layer helper) seen as a call of a user's function."""

    filename: str
    short: str
    call_id: tuple
    call_text: str
    call_args: tuple


def _helper_call(statement) -> _HelperCall:
    number, text, args = statement.helper
    short = statement.comment.split()[0] if statement.comment else ""
    return _HelperCall(short.split(":")[0], short, ("helper", number), text, args)


def _prev(statements, s):
    k = statements.index(s)
    return statements[k - 1] if k else None


def _taken_names(plan) -> set:
    names = {p.name for p in plan.params} | {i.name for i in plan.all_inputs} | _dim_names(plan)
    names |= {i.name for i in plan.modules.instances()}
    for s in plan.statements:
        for line in s.lines:
            name = _declared(line)
            if name:
                names.add(name)
    return names


def _declared(line) -> str:
    if isinstance(line, ArenaDecl):
        return line.buffer.name
    if isinstance(line, Declare):
        return line.name
    if isinstance(line, Alias):
        return line.value.name
    return ""


# -- reading one call's lines ----------------------------------------------------------


def _vector_of(line) -> str:
    """The element type of an owned buffer's declaration (`std::vector<float> name(size);`), else ""."""
    return line.element if isinstance(line, Declare) else ""


def _data_of(expr: str, inst: _Instance) -> str:
    """`out.data()` of a vector the call declares is the vector's name, as an arena piece's is."""
    m = re.fullmatch(r"(\w+)\.data\(\)", expr)
    return m.group(1) if m and m.group(1) in inst.vectors else expr


def _read_instance(inst: _Instance, bases: dict) -> None:
    strings = [v for _, v in inst.loc.call_args if isinstance(v, str) and v.isidentifier()]
    declared = []
    for s in inst.statements:
        for line in s.lines:
            if isinstance(line, Scope):
                declared += [name for _, name, _ in line.arrays]
            name = _declared(line)
            if name:
                declared.append(name)
    local, results = {}, set()
    # A name made from a tensor argument's (the gradient of the block's input, d_relu_4)
    # is made from the parameter's name inside (d_x); other names as the user asked.
    arguments = {v.name: n for n, v in inst.loc.call_args if hasattr(v, "dtype") and hasattr(v, "name")}
    for name in declared:
        # An argument's gradient by the argument's name (d_relu_6_1 -> d_x_1: bases would
        # make it d_relu_1), its number kept: its parts are told apart by it (_last_takes_stem).
        parts = name.split("_")
        of_argument = parts[0] == "d" and any("_".join(parts[1:j]) in arguments for j in range(2, len(parts) + 1))
        short = _asked_for(name, {}, arguments) if of_argument else _asked_for(name, bases)
        for prefix in strings:  # the call's output named after its module: layer1_0_out
            if short in (f"{prefix}_out", f"{prefix}_out_again"):
                short = prefix + short[len(prefix) + len("_out"):]
                break
        for prefix in strings:
            if short.startswith(prefix + "_") and len(short) > len(prefix) + 1:
                short = short[len(prefix) + 1 :]
                short = "result_again" if short == "again" else short  # what the call returned, made again
                break
            if f"_{prefix}_" in short:  # a gradient's name: d_layer4_1_bn2 -> d_bn2
                short = short.replace(f"_{prefix}_", "_", 1)
                break
        if short in strings:  # named just `name=` (a layer helper's result): the call's output
            short = "out"
            results.add(name)
        if short[0].isdigit() or keyword.iskeyword(short):
            short = name
        local[name] = short
    if any(local[n] == "out" for n in local if n not in results):  # the user's own `out`
        local.update({n: "result" for n in results})
    local = _last_takes_stem(local, arguments)
    if len(set(local.values())) != len(local):  # two names would become one: keep them whole
        counts = {}
        for short in local.values():
            counts[short] = counts.get(short, 0) + 1
        local = {n: (s if counts[s] == 1 else n) for n, s in local.items()}
    inst.renames = local
    inst.vectors = {line.name for s in inst.statements for line in s.lines if _vector_of(line)}
    for s in inst.statements:
        inst.shape.append(("statement", s.comment))
        for line in s.lines:
            _walk(line, inst)


def _last_takes_stem(local: dict, arguments: dict) -> dict:
    """The gradient of an argument summed from parts (`d_x_8` from one use, `d_x_9` the
    sum, numbered model-wide): the last one, the gradient itself, is `d_x`; the parts are
    numbered from 1 within the call (`d_x_1`, with its `d_x_1_cols`), so every call of
    the function names them alike."""
    found: dict = {}  # stem -> {number: [(name, tail)]}
    for name, short in local.items():
        m = re.match(r"^(d_(\w+?))_(\d+)((_[a-z]\w*)?)$", short)
        if m and m.group(2) in arguments.values():
            found.setdefault(m.group(1), {}).setdefault(int(m.group(3)), []).append((name, m.group(4)))
    taken = set(local.values())
    out = dict(local)
    for stem, numbers in found.items():
        if stem in taken:
            continue
        ordered = sorted(numbers)
        for rank, number in enumerate(ordered, start=1):
            label = stem if number == ordered[-1] else f"{stem}_{rank}"
            for name, tail in numbers[number]:
                out[name] = label + tail
    return out


def _asked_for(name: str, *tables) -> str:
    """The name the user's code asked for: `out` for `out_5`, `d_out_cols` for
    `d_out_5_cols` (a name made from a suffixed one: a gradient's, a workspace's),
    each table in turn replacing the longest `_`-bounded run of parts it knows (the
    tables after the first: a run that is not the whole name)."""
    for k, table in enumerate(tables):
        parts = name.split("_")
        # Past the first table, only a part of the name: d_relu_4 -> d_x, but relu stays relu.
        spans = [(j - i, i, j) for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)
                 if "_".join(parts[i:j]) in table and (k == 0 or j - i < len(parts))]
        if spans:
            _, i, j = max(spans)
            name = "_".join(parts[:i] + [table["_".join(parts[i:j])]] + parts[j:])
    return name


def _rename(text: str, renames: dict) -> str:
    if text.startswith('"'):
        return text
    return _IDENT.sub(lambda m: renames.get(m.group(0), m.group(0)), text)


def _walk(obj, inst: _Instance, slot: str = "", of: str = "") -> None:
    """Record `obj`'s structure and leaves (in the order _rebuild visits them)."""
    shape, leaves = inst.shape, inst.leaves
    if isinstance(obj, ArenaDecl):  # a GradientDecl too
        local = inst.renames[obj.buffer.name]
        shape.append(("arena", local, isinstance(obj, GradientDecl)))
        leaves.append(_Leaf("arena", obj, local))
    elif _vector_of(obj):  # an output's own vector (the last layer's): a piece the caller declares
        local = inst.renames[obj.name]
        shape.append(("arena", local, False) if _vector_of(obj) == "float" else ("vector", _vector_of(obj), local))
        leaves.append(_Leaf("arena", obj, local))
    elif isinstance(obj, EarlyUpdate):
        shape.append(("early_update", obj.report, obj.fused))
        _walk(obj.index, inst, "index")
        _walk(obj.call, inst, slot)
    elif isinstance(obj, UpdateRows):
        shape.append(("update_rows", len(obj.arrays)))
        _walk(obj.ld, inst, "ld")
        _walk(obj.call, inst, slot)
        for a in obj.arrays:
            _walk(a, inst, slot)
    elif isinstance(obj, Operand):
        words = set(_IDENT.findall(obj.expr))
        if words and words <= set(inst.renames):  # data the call declares (at an offset, maybe)
            shape.append((type(obj).__name__, "local", _rename(_data_of(obj.expr, inst), inst.renames)))
        elif words & set(inst.renames):
            raise _NotOutlined  # mixed: not a case lowering makes
        else:
            shape.append((type(obj).__name__, "ext"))
            leaves.append(_Leaf("ext", obj, slot))
    elif isinstance(obj, Named):
        shape.append(("named", obj.name))
        _walk(obj.arg, inst, obj.name, of)
    elif isinstance(obj, Functor):
        shape.append(("functor", obj.name, len(obj.members)))
        for m in obj.members:
            _walk(m, inst, slot)
    elif isinstance(obj, Struct):
        shape.append(("struct", obj.type, len(obj.members)))
        for m in obj.members:
            _walk(m, inst, slot)
    elif isinstance(obj, PieceAs):
        shape.append(("piece_as", obj.kind))
        _walk(obj.op, inst, slot)
    elif isinstance(obj, Call):
        shape.append(("call", obj.fn, obj.template, len(obj.args)))
        # What the call writes names its other arguments (batch norm's label: `bn1_label`).
        own = next((inst.renames[a.expr] for a in obj.args if isinstance(a, Write) and a.expr in inst.renames), slot)
        for a in obj.args:
            _walk(a, inst, slot if isinstance(a, Named) else own, own)
    elif isinstance(obj, Declare):
        shape.append(("declare", obj.type, inst.renames[obj.name], len(obj.args), obj.init is None, obj.note))
        for a in obj.args:
            _walk(a, inst, inst.renames[obj.name])
        if obj.init is not None:
            _walk(obj.init, inst, inst.renames[obj.name])
    elif isinstance(obj, Alias):
        shape.append(("alias", obj.ctype, inst.renames[obj.value.name], obj.shape, obj.note))
        _walk(obj.src, inst, inst.renames[obj.value.name])
    elif isinstance(obj, Copy):
        shape.append(("copy", obj.fn))
        _walk(obj.src, inst, slot)
        _walk(obj.count, inst, "count")
        _walk(obj.dst, inst, slot)
    elif isinstance(obj, Comment):
        shape.append(("comment", obj.text))
    elif isinstance(obj, Scope):
        shape.append(("scope", tuple((t, inst.renames[n], len(items)) for t, n, items in obj.arrays), len(obj.lines)))
        for _, name, items in obj.arrays:
            for item in items:
                _walk(item, inst, inst.renames[name])
        for line in obj.lines:
            _walk(line, inst, slot)
    elif obj is None:
        shape.append(("none",))
    elif isinstance(obj, (str, int, float)) or type(obj).__module__.startswith("sympy"):
        text = _rename(str(obj), inst.renames)
        shape.append(("text",))
        leaves.append(_Leaf("text", text, slot, of))
    else:
        raise _NotOutlined  # a level loop, an update, anything else: not moved


# -- making the function -----------------------------------------------------------------


# A run of fewer backward statements than this from one call stays inline: a short piece
# (a plain residual block's output made again: its batch norm and its add + relu) reads as
# well there as a call would.
_BACKWARD_MIN = 3

# The order of a function's parameters: the tensors the user passed, the weights and
# other values from outside, sizes, labels, the arena pieces, then run-time sizes and the mode.
_ORDER = ("argument", "outside", "size", "label", "arena", "run")


def _make_function(group, plan, fn_name, later_reads, called=None):
    """The function for `group`'s calls, and each call's statement. Where the calls keep
    pieces for their gradient in a frame each (memory/frames.py) whose layout the function's
    sizes can say, the function takes the frame and finds the pieces in it (codegen/frames.py)."""
    function, calls, params = _make_function_with(group, plan, fn_name, later_reads, called, {})
    layouts = _frame_layouts(group, plan, params)
    if layouts:
        function, calls, _ = _make_function_with(group, plan, fn_name, later_reads, called, layouts)
    return function, calls


def _frame_slots(group, plan) -> dict | None:
    """leaf position -> (the frame of each call, the member's index in it), for the leaves
    that are pieces of the calls' frames: the pieces the forward function makes, or what its
    gradient reads of them. None where some call's leaf is a member and another's is not."""
    members = members_by_name(plan)
    slots = {}
    for k, leaf in enumerate(group[0].leaves):
        leaves = [inst.leaves[k] for inst in group]
        if leaf.kind == "arena":
            found = [members.get(lv.payload.buffer.name) if isinstance(lv.payload, ArenaDecl) else None
                     for lv in leaves]
        elif leaf.kind == "ext":
            found = [members.get(lv.payload.expr) for lv in leaves]
        else:
            continue
        if all(m is None for m in found):
            continue
        if leaf.kind == "arena" and isinstance(leaf.payload, GradientDecl):
            # a gradient's place: in the calls' gradient workspaces where every call's is, and
            # its member a field of their modules' gradients; else passed as it is
            same = len({m.frame.members.index(m) if m else -1 for m in found}) == 1
            if any(m is None for m in found) or not same or gradient_field_of_each(
                    plan.modules, [lv.payload.member for lv in leaves]) is None:
                continue
        if any(m is None for m in found):
            return None
        index = {m.frame.members.index(m) for m in found}
        if len(index) != 1:
            return None
        slots[k] = (tuple(m.frame for m in found), index.pop())
    return slots


def _frame_layouts(group, plan, params) -> dict:
    """{frames of the calls: the members' offsets in the function's terms}, for every frame
    the calls' leaves touch; {} where one cannot be said (the pieces are then passed one by one)."""
    slots = _frame_slots(group, plan)
    if not slots:
        return {}
    sizes = {name: values for order, _, name, values in params if order == _ORDER.index("size")}
    out = {}
    for frames, _ in slots.values():
        if frames not in out:
            offsets = layout(list(frames), sizes, _dim_names(plan))
            if offsets is None:
                return {}
            out[frames] = offsets
    return out


def _make_function_with(group, plan, fn_name, later_reads, called, layouts):
    for inst in group:  # a view or local another statement reads cannot move into a function
        for s in inst.statements:
            for line in s.lines:
                if not isinstance(line, ArenaDecl) and not _vector_of(line) and _declared(line) in later_reads:
                    raise _NotOutlined(f"{_declared(line)} is read after the call")
    first = group[0]
    params = []  # [(order, C++ type, name, values across the calls)]
    by_values: dict = {}  # (kind, values across calls) -> parameter name
    replace = []  # per leaf of the first call: its text in the body
    local_names = set(first.renames.values())
    names = set(local_names)

    def add_param(ctype, wanted, values, kind, order, exact=False):
        key = (kind, tuple(values))
        if key in by_values:
            return by_values[key]
        if order == "size":  # the name the calls' forward function gave the same sizes (C, O)
            known = [(called or {}).get(inst.loc.call_id, ("", {}))[1] for inst in group]
            same = [n for n in known[0] if n not in names and all(k.get(n) == v for k, v in zip(known, values))]
            wanted, exact = (same[0], True) if same else (wanted, exact)
        name = wanted if exact else fresh_name(wanted, names)
        names.add(name)
        by_values[key] = name
        params.append([_ORDER.index(order), ctype, name, values])
        return name

    trainable = {q.member: q.trainable for q in plan.params}
    module_types = {s.type for s in plan.modules.structs}

    def module_param(found, written):
        """A field of the calls' module structs: the function takes the struct (`layer`)."""
        type_name, owners, member, rest = found
        wanted = local_name(owners)
        wanted = "module" if wanted == fn_name else wanted  # not the function's own name
        name = add_param(f"const {type_name}&", wanted, owners, ("module", type_name), "outside")
        if written and trainable.get(f"{owners[0]}.{member}", True):  # running statistics are mutable
            _make_writable(params, name)
        return f"{name}.{member}.{rest}"

    hoisted = [[] for _ in group]
    slots = _frame_slots(group, plan) if layouts else {}
    frame_params = {}  # frames of the calls -> the function's parameter that takes them
    read_pieces = {}  # (frames, index) -> the local name of a piece the function reads of them
    reads = []  # FramePiece lines the body starts with: the pieces of a frame it reads

    def frame_param(frames, written):
        if frames in frame_params and frames[0].phase == "gradient":
            return frame_params[frames]
        if frames not in frame_params:
            work = frames[0].kind == "work"  # a workspace: passed as its piece of the arena
            if work and frames[0].phase == "gradient":  # the gradients' places: an offset (none when kept)
                values = [str(f.printed) for f in frames]
                frame_params[frames] = add_param("const std::int64_t", "gradients_at", values,
                                                 ("frame", tuple(values)), "arena")
                return frame_params[frames]
            values = [f"_arena.at({f.printed}, {size_expr(f.size)})" if work else f.name for f in frames]
            frame_params[frames] = add_param("float*" if written else "const float*", "work" if work else "saved",
                                             values, ("frame", tuple(values)), "arena")
        elif written:
            _make_writable(params, frame_params[frames])
        return frame_params[frames]

    # The pieces each call's caller declares (read after the call), by place: a piece of the
    # call at the same place (the in-place result made again: bn2_again under result_again)
    # is passed as that variable, so its place is printed once.
    declared = [{lv.payload.piece(): lv.payload.buffer.name for lv in inst.leaves
                 if lv.kind == "arena" and isinstance(lv.payload, ArenaDecl) and not isinstance(lv.payload, GradientDecl)
                 and lv.payload.buffer.name in later_reads} for inst in group]
    for k, leaf in enumerate(first.leaves):
        leaves = [inst.leaves[k] for inst in group]
        if k in slots:  # a piece of the calls' frames
            frames, index = slots[k]
            offset = layouts[frames][index]
            if isinstance(leaf.payload, GradientDecl):  # a gradient's place in the calls' gradient workspace
                type_name, owners, field = gradient_field_of_each(plan.modules, [lv.payload.member for lv in leaves])
                grads = add_param(f"{type_name}&", "d_" + local_name([o[2:] for o in owners]), owners,
                                  ("gradients", type_name), "outside")
                replace.append(GradientPiece(first.renames[leaf.payload.buffer.name], f"{grads}.{field}",
                                             frame_param(frames, True), offset))
                continue
            if leaf.kind == "arena":  # made here: the caller declares the frame (a workspace: passes it)
                for j, f in enumerate(frames):
                    if f.kind != "work" and not any(isinstance(h, FrameDecl) and h.frame is f for h in hoisted[j]):
                        hoisted[j].append(FrameDecl(f))
                replace.append(FramePiece(first.renames[leaf.payload.buffer.name], frame_param(frames, True),
                                          offset))
                continue
            written = isinstance(leaf.payload, Write)
            if (frames, index) not in read_pieces:
                local = fresh_name(_strip(frames[0].members[index].name, first), names)
                names.add(local)
                read_pieces[(frames, index)] = local
                reads.append(FramePiece(local, frame_param(frames, written), offset, written))
            elif written:
                frame_param(frames, True)
                next(r for r in reads if r.name == read_pieces[(frames, index)]).written = True
            replace.append(read_pieces[(frames, index)])
            continue
        if leaf.kind == "ext":
            op = leaf.payload
            values = [lv.payload.expr for lv in leaves]
            found = plan.modules.field_of_each(values)
            if found is not None:
                replace.append(module_param(found, isinstance(op, Write)))
                continue
            arg_names = {_argument_name(inst, lv.payload.value) for inst, lv in zip(group, leaves)}
            given = arg_names.pop() if len(arg_names) == 1 else None
            kind = "write" if isinstance(op, Write) else "read"
            name = by_values.get(("write", tuple(values))) or by_values.get(("read", tuple(values)))
            if name is None:
                if getattr(op.value, "kind", "") == "mode":
                    ctype = "const dg::Mode&"
                else:
                    ctype = f"{'' if kind == 'write' else 'const '}{_ctype(op.value)}*"
                name = add_param(ctype, given or _strip(op.value.name, first), values, kind,
                                 "argument" if given else "outside")
            elif kind == "write":
                _make_writable(params, name)
            replace.append(name)
        elif leaf.kind == "arena":
            values = []
            for j, (inst, lv) in enumerate(zip(group, leaves)):
                decl = lv.payload
                if _vector_of(decl):  # the caller's, always: it outlives the call
                    hoisted[j].append(decl)
                    values.append(f"{decl.name}.data()")
                elif decl.buffer.name in later_reads:
                    hoisted[j].append(decl)
                    values.append(decl.buffer.name)
                elif isinstance(decl, GradientDecl):  # the Model's member, or an arena piece
                    values.append(decl.place())
                else:
                    values.append(declared[j].get(decl.piece(), decl.piece()))
            # A piece that is another piece of the call in every call (an in-place result:
            # the relu's `out` over batch norm's `bn1`) is that parameter under its own name.
            shared = by_values.get(("piece", tuple(values)))
            if shared is not None and all(v.startswith("_arena.at(") or v in declared[j].values()
                                          for j, v in enumerate(values)):
                replace.append(shared)
                continue
            name = add_param("float*", leaf.slot, values, ("arena", leaf.slot), "arena", exact=True)
            by_values.setdefault(("piece", tuple(values)), _SamePiece(name, leaf.payload.buffer.name))
            replace.append(name)
        else:
            values = [lv.payload for lv in leaves]
            found = plan.modules.field_of_each(values)
            if found is not None:  # an update's parameter (it writes it) or its size
                replace.append(module_param(found, found[3].startswith("ptr()")))
                continue
            if len(set(values)) == 1:
                replace.append(values[0])
                continue
            kept = {k.member: k.cpp_type for k in plan.kept}
            if all(v in kept for v in values) and len({kept[v] for v in values}) == 1:  # a weight the Model keeps
                replace.append(add_param(f"const {kept[values[0]]}&", _strip(values[0], first), values, "text",
                                         "outside"))
                continue
            ctype = _text_type(values)
            derived = _derived(values, leaf.slot, params, group, plan)
            if derived is not None:  # from parameters the function has: `C`, `9 * C * C`, `first_index + 2`
                if derived[0] is not None:
                    add_param(ctype, *derived[0], "text", "size", exact=True)
                replace.append(derived[1])
                continue
            label = ctype == "const char*"
            wanted = f"{leaf.slot}_label" if label and leaf.slot else (leaf.slot or "size")
            member = re.match(r"^([\w.]+)\.(ptr|size)\(\)$", values[0])
            same = by_values.get(("read", tuple(values))) or by_values.get(("write", tuple(values)))
            if member and member.group(2) == "ptr" and same:  # the pointer an operand passes already
                _make_writable(params, same)  # the update writes the parameter
                replace.append(same)
                continue
            if member:  # a parameter's data or size, by the update
                stem = _strip(member.group(1), first)
                wanted = stem if member.group(2) == "ptr" else f"{stem}_size"
            elif not label and wanted in names and leaf.of:  # a second `n`: what it counts (n_x for d_x's)
                counted = leaf.of[len("d_"):] if leaf.of.startswith("d_") else leaf.of
                wanted = f"{wanted}_{counted}" if f"{wanted}_{counted}".isidentifier() else wanted
            replace.append(add_param(ctype, wanted, values, "text", "label" if label else "size"))
    # Free names the body reads: the run-time sizes and the mode.
    body_text = re.sub(r'"(\\.|[^"\\])*"', " ", " ".join(str(r) for r in replace))
    for word in sorted(set(_IDENT.findall(body_text)) - names - _CPP_WORDS):
        if word in _dim_names(plan):
            ctype = "const std::int64_t"
        elif plan.mode and word == plan.mode:
            ctype = "const dg::Mode&"
        elif word in _RUN_LOCALS:
            ctype = _RUN_LOCALS[word]
        elif plan.train is not None and word == plan.train.hyper_struct.local:  # what update calls take
            ctype = f"const kernels::{plan.train.hyper_struct.name}&"
        else:
            raise _NotOutlined(f"reads {word}")
        params.append([_ORDER.index("run"), ctype, word, [word] * len(group)])
    if any(entry[0] in ("early_update", "update_rows") for entry in first.shape):
        # Their printed form tests whether train_step() or compute_gradients() runs.
        params.append([_ORDER.index("run"), _RUN_LOCALS["_gradients_only"], "_gradients_only",
                       ["_gradients_only"] * len(group)])
    params.sort(key=lambda p: p[0])  # stable: first use within each kind
    body = _rebuild_body(first, replace)
    order = {read_pieces[key]: key[1] for key in read_pieces}
    reads.sort(key=lambda r: order[r.name])
    if reads:  # the pieces of a frame the function reads, named first
        body.insert(0, Statement("", reads))
    # Sizes that follow from the others are named inside, not passed (HW = H * H).
    derived = derive_sizes([(n, values) for order, t, n, values in params
                            if order == _ORDER.index("size") and t == "const std::int64_t"], _dim_names(plan))
    if derived:
        body.insert(0, Statement("", [SizeLine(n, e) for n, e in derived.items()]))
    passed = [p for p in params if p[2] not in derived]
    function = Function(fn_name, first.loc.short.split(":")[0], [(t, n) for _, t, n, _ in passed], body,
                        [p for p in params if p[0] == _ORDER.index("size")])
    calls = []
    for j, inst in enumerate(group):
        head = inst.statements[0]
        args = [Named(n, values[j]) for _, _, n, values in passed]
        bare = frozenset(n for _, t, n, _ in params if t.rstrip("&").split()[-1] in module_types
                         or t.rstrip("&").split()[-1] in {f"{m}Gradients" for m in module_types})
        lines = list(hoisted[j]) + [CallLine(fn_name, args, at=_first_at(inst), bare=bare)]
        # A layer helper's call has no header (that is for a user's function): its comment
        # cites the call with its arguments' values (name='encoder_layers_1').
        comment = f"{inst.loc.short}  {inst.loc.call_text}" if isinstance(inst.loc, _HelperCall) else ""
        calls.append(Statement(comment, lines, [p for s in inst.statements for p in s.positions], head.header,
                               head.call))
    return function, calls, params


def _derived(values, slot, params, group, plan):
    """A per-call integer as an expression of the function's other parameters, so the
    call need not pass it: a weight's size from its shape's dimensions (`bn2_weight`'s
    `C`, `conv2_weight`'s `C * C * 9`), a gradient's index (which update is ready) as
    the first index of the call's parameters plus a constant. Returns (the parameter
    to add first or None, the expression), or None."""
    ints = {p[2]: [int(v) for v in p[3]] for p in params if all(re.fullmatch(r"\d+", str(v)) for v in p[3])}
    if slot == "index" and all(re.fullmatch(r"\d+", v) for v in values):
        numbers = [int(v) for v in values]
        # The call's first index: the smallest of its update indices.
        base = [min(column) for column in zip(*[[int(v) for v in leaf] for leaf in _index_lists(group)])]
        shift = {n - b for n, b in zip(numbers, base)}
        if len(shift) != 1:
            return None
        d = shift.pop()
        name = next((n for n, v in ints.items() if v == base), None)
        new = None
        if name is None:
            name = "first_index"
            if any(p[2] == name for p in params):
                return None
            new = (name, [str(b) for b in base])
        return new, f"{name} + {d}" if d else name
    shapes = {p.member: p.shape for p in plan.params}
    member = [re.fullmatch(r"([\w.]+)\.size\(\)", v) for v in values]
    if not all(m and m.group(1) in shapes for m in member):
        return None
    dims = list(zip(*[shapes[m.group(1)] for m in member]))
    if len({len(shapes[m.group(1)]) for m in member}) != 1:
        return None
    names, constant = [], 1
    for column in dims:
        if len(set(column)) == 1:
            constant *= column[0]
            continue
        name = next((n for n, v in ints.items() if v == list(column)), None)
        if name is None:
            return None
        names.append(name)
    if not names:
        return None
    return None, " * ".join(names + ([str(constant)] if constant != 1 else []))


def _index_lists(group) -> list:
    """The update indices of the first call's lines, one list per line (its value in each call)."""
    lists = [[] for _ in group[0].leaves]
    for inst in group:
        for k, leaf in enumerate(inst.leaves):
            if leaf.kind == "text" and leaf.slot == "index" and re.fullmatch(r"\d+", str(leaf.payload)):
                lists[k].append(str(leaf.payload))
    return [values for values in lists if len(values) == len(group)]


def _argument_name(inst, value):
    """The user's function parameter that received `value` in this call, if one did (or
    the value it is made again from, for the gradient: `relu_1_again` is `relu_1`)."""
    for name, given in inst.loc.call_args:
        if given is value:
            return name
    again = getattr(value, "name", "")
    for name, given in inst.loc.call_args:
        if hasattr(given, "dtype") and again.startswith(f"{getattr(given, 'name', '')}_again"):
            return name
    return None


def _dim_names(plan) -> set:
    names = {d for d, _ in plan.dims}
    if plan.train is not None:
        names |= {d for d, _ in plan.train.dims}
    return names


def _first_at(inst) -> int:
    for s in inst.statements:
        for line in s.lines:
            if getattr(line, "at", -1) >= 0:
                return line.at
    return -1


def _make_writable(params, name) -> None:
    for p in params:
        if p[2] == name and p[1].startswith("const "):
            p[1] = p[1][len("const "):]


def _ctype(value) -> str:
    return {"float32": "float", "int32": "std::int32_t", "int64": "std::int64_t", "bool": "std::uint8_t"}.get(getattr(value, "dtype", ""), "float")


def _text_type(values) -> str:
    if all(v.startswith('"') for v in values):
        return "const char*"
    if all(_MEMBER_PTR.match(v) for v in values):
        return "float*"
    if all(_FLOAT.match(v) for v in values):
        return "const float"
    if all(_INT_EXPR.match(v) for v in values):
        return "const std::int64_t"
    raise _NotOutlined


def _strip(name: str, inst: _Instance) -> str:
    """`name` without this call's name prefix (`layer2_0_conv1_weight` -> `conv1_weight`),
    or without another call's (`encoder_layers_0_keys`, made by the first layer -> `keys`);
    the call's own name (`layer2_0` or `layer2_0_out`, what it returned) is `result`, its gradient `d_result`,
    its recomputation `result_again`."""
    for _, v in inst.loc.call_args:
        own = re.fullmatch(rf"(d_)?{re.escape(v)}(?:_out)?(_again)?(_\d+)?", name) if isinstance(v, str) else None
        if own:  # what the call returned (layer2_0), its gradient, it made again
            return f"{own.group(1) or ''}result{own.group(2) or ''}"
        if isinstance(v, str) and name.startswith(v + "_") and len(name) > len(v) + 1:
            short = name[len(v) + 1 :]
            if short.isidentifier() and not keyword.iskeyword(short):
                return short
    short = "_".join(p for p in name.split("_") if not p.isdigit())  # relu_6_again -> relu_again
    if short and short.isidentifier() and not keyword.iskeyword(short):
        return short
    return name


def _rebuild_body(inst: _Instance, replace: list) -> list:
    it = iter(replace)
    body = []
    for s in inst.statements:
        lines = [_rebuild(line, inst, it) for line in s.lines]
        body.append(Statement(s.comment, [line for line in lines if line is not None]))
    return body


class _Name:
    """A stand-in for a value where only its printed name matters (an Alias's)."""

    def __init__(self, name):
        self.name = name


@dataclass(frozen=True)
class _SamePiece:
    """An arena piece of the call that another parameter (`name`, the first call's
    `first`) already passes: an in-place result, or a piece used again."""

    name: str
    first: str

    def __str__(self) -> str:
        return self.name


def _rebuild(obj, inst, it):
    if isinstance(obj, ArenaDecl) or _vector_of(obj):
        given = next(it)
        if isinstance(given, (FramePiece, GradientPiece)):  # `float* conv1 = saved + ...;`
            return given
        if isinstance(given, _SamePiece):  # `float* out = bn1;  // in place`
            in_place = any(getattr(d, "name", None) == given.first for d in obj.shares)
            note = "in place" if in_place else f"{given.name}'s piece, used again"
            return Alias(_Name(inst.renames[obj.buffer.name]), given.name, "float", "", note=note, written=True)
        return None  # a parameter of the function
    if isinstance(obj, Operand):
        words = set(_IDENT.findall(obj.expr))
        if words and words <= set(inst.renames):
            return type(obj)(obj.value, _rename(_data_of(obj.expr, inst), inst.renames))
        return type(obj)(obj.value, next(it))
    if isinstance(obj, EarlyUpdate):
        return dataclasses.replace(obj, index=_rebuild(obj.index, inst, it), call=_rebuild(obj.call, inst, it))
    if isinstance(obj, UpdateRows):
        return dataclasses.replace(obj, ld=_rebuild(obj.ld, inst, it), call=_rebuild(obj.call, inst, it),
                                   arrays=[_rebuild(a, inst, it) for a in obj.arrays])
    if isinstance(obj, Named):
        return Named(obj.name, _rebuild(obj.arg, inst, it))
    if isinstance(obj, Functor):
        return Functor(obj.name, tuple(_rebuild(m, inst, it) for m in obj.members))
    if isinstance(obj, Struct):
        return Struct(obj.type, tuple(_rebuild(m, inst, it) for m in obj.members))
    if isinstance(obj, PieceAs):
        return dataclasses.replace(obj, op=_rebuild(obj.op, inst, it))
    if isinstance(obj, Call):
        return dataclasses.replace(obj, args=[_rebuild(a, inst, it) for a in obj.args])
    if isinstance(obj, Declare):
        args = [_rebuild(a, inst, it) for a in obj.args]
        init = _rebuild(obj.init, inst, it) if obj.init is not None else None
        return dataclasses.replace(obj, name=inst.renames[obj.name], args=args, init=init)
    if isinstance(obj, Alias):
        return dataclasses.replace(obj, value=_Name(inst.renames[obj.value.name]), src=_rebuild(obj.src, inst, it))
    if isinstance(obj, Copy):
        return dataclasses.replace(obj, src=_rebuild(obj.src, inst, it), count=_rebuild(obj.count, inst, it),
                                   dst=_rebuild(obj.dst, inst, it))
    if isinstance(obj, Comment) or obj is None:
        return obj
    if isinstance(obj, Scope):
        arrays = [(t, inst.renames[n], [_rebuild(i, inst, it) for i in items]) for t, n, items in obj.arrays]
        return dataclasses.replace(obj, arrays=arrays, lines=[_rebuild(line, inst, it) for line in obj.lines])
    return next(it)  # a text leaf


def _reads_after(plan, lists, found, inline) -> set:
    """Names of arena buffers that lines outside the call that declares them read:
    those the caller declares (a call's result, what the loss and the backward read)."""
    owner = {}  # id(statement) -> the call (instance) whose lines it holds
    parts = {}  # id(plan statement) -> the statements it is read as (a split one: two)
    for part, instances in found.items():
        for inst in instances:
            for t in inst.statements:
                owner[id(t)] = id(inst)
            if inst.first is not None:
                parts[id(inst.first)] = [inline[part][id(inst.first)], inst.statements[0]]
            if inst.cut is not None:
                parts[id(inst.cut)] = [inst.statements[-1]] + inst.rest
    every = [t for statements in lists.values() for s in statements for t in parts.get(id(s), [s])]
    if plan.train is not None:
        every += list(plan.train.loss_statements)
    reads = {}
    for s in every:
        for line in s.lines:
            for op in operands(line):
                for word in _IDENT.findall(op.expr):
                    reads.setdefault(word, set()).add(owner.get(id(s), id(s)))
    names = {name for name, owners in reads.items() if len(owners) > 1}
    for o in plan.outputs:
        for text in (o.data, o.make):
            names.update(_IDENT.findall(str(text)))
    return names
