"""Stage `outline`, second part: a long block that runs once (a recursion's levels, a
sequence's time steps, and the gradient loops of each) becomes a member function of
the Network, named after the DSL statement that made it and called where it was.

A block is a C++ scope (stmt.Block): the names it declares end with it, so the only
names it reads from `_run` are the locals declared before it (the arena pieces, the
inputs, the run-time sizes, the mode, the gradients' pointers); those become the
function's parameters, in the order the block first reads them, with the types
they were declared with. The Network's members (weights, packed weights, gradient
members) need no passing: the function is the Network's. Moving a block into a
function changes no operation and no memory: the same lines, the same order.
"""

from __future__ import annotations

import ast
import keyword
import re
from dataclasses import dataclass

from ..ir.names import fresh_name
from .emit import clang_format_cpp
from .frames import FrameDecl
from .plan import ArenaDecl, Statement
from .stmt import Alias, Block, Comment, Declare, Loop

# Printed lines from which a block becomes a function: shorter ones read well inline.
MIN_LINES = 40
# A function made from a block that is longer than this is cut further: each of its parts
# (a recursion's first step, its loop, the rest of its later rows: stmt.Block.part) of
# MIN_LINES or more becomes a function of its own that it calls.
MAX_LINES = 200
# What model.cpp.j2 prints in `_run` around the statements (the input checks, the arena, the
# outputs, the loss check, the banners): a training `_run` whose statements take more than
# MAX_LINES less this calls its gradient phase as a member function (`backward`).
_RUN_FRAME_LINES = 50

_STRING = re.compile(r'"(\\.|[^"\\])*"')
_COMMENT = re.compile(r"//[^\n]*")
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)  # and the /*name=*/ of arguments
_WORD = re.compile(r"(?<![\w.:>])[A-Za-z_]\w*(?!\w|::)")
_BY_VALUE = re.compile(r"^(const )?(std::int64_t|bool|float|double|int)$")
# _run's own locals, declared by the template, and how a function takes each.
_RUN_LOCALS = {"_arena": "dg::Arena&", "_gradients_kept": "const bool",
               "_gradients": "const dg::GradientPlaces<dg::Arena>&",
               "_gradients_only": "const std::function<void(int)>*"}


@dataclass
class Method:
    """A member function of the Network printed before `_run`: one block's lines."""

    name: str
    source: str  # "treelstm_sentiment.py:51  h, c = dg.recurse(...)": the statement it runs
    params: list  # [(C++ type, name)]
    body: list  # the block's lines
    const: bool = False  # an inference-only Network's _run is const, and so is this

    def signature(self, qualified: bool) -> str:
        params = ", ".join(f"{t} {n}" for t, n in self.params)
        name = f"Network::{self.name}" if qualified else self.name
        return f"void {name}({params}){' const' if self.const else ''}"

    def declaration(self) -> str:
        return self.signature(False) + ";"

    def __str__(self) -> str:
        out = [f"// {self.source}", self.signature(True) + " {"]
        for line in self.body:
            out += [f"  {text}" if text else "" for text in str(line).split("\n")]
        out.append("}")
        return "\n".join(out)


@dataclass(eq=False)
class MethodCall:
    """`recurse_h_c(trees_children, trees_nodes, h, c);`."""

    fn: str
    args: list  # [name]
    at: int = -1

    def __str__(self) -> str:
        return f"{self.fn}({', '.join(self.args)});"


def outline_blocks(plan) -> None:
    """Replace each long block of the forward and backward statements by a call of a
    member function made from it (plan.methods)."""
    parts = [plan.statements]
    if plan.train is not None:
        parts += [plan.train.loss_statements, plan.train.backward_statements]
    taken = _taken(plan, parts)
    scope = _template_locals(plan)
    before_backward = scope
    for statements in parts:
        if plan.train is not None and statements is plan.train.backward_statements:
            before_backward = dict(scope)
        for s in statements:
            lines = []
            for line in s.lines:
                lines.append(_outlined(line, s, scope, plan, taken))
                _declare(line, scope)
            s.lines = lines
    if plan.train is not None:
        plan.train.tail = _train_tail(plan.train)
        if _formatted_length("\n".join(_emitted(p) for p in parts)) > MAX_LINES - _RUN_FRAME_LINES:
            _outline_backward(plan, before_backward, taken)
    plan.kernel_structs = sorted({t.split("::", 1)[1].rstrip("&") for m in plan.methods for t, _ in m.params
                                  if t.startswith("const kernels::")})


def _outline_backward(plan, scope: dict, taken: set) -> None:
    """train_step()'s gradient phase (the backward statements, then the gradient copies and
    the updates left to its end) as the member function `backward`, called where it was:
    `_run` would be too long to read in one sitting otherwise. It takes the locals of the
    forward pass and the loss that it reads, as any long block does."""
    train = plan.train
    body = _emitted(train.backward_statements).split("\n") + list(train.tail)
    train.backward_call = _method(None, "backward", body, "train_step(): the gradients and the updates",
                                  scope, plan, taken)
    train.backward_statements, train.tail = [], []


def _emitted(statements) -> str:
    """The statements as model.cpp.j2's `emit` prints them: a banner for the call of the
    user's function a statement starts, the comment citing its line, its lines."""
    out = []
    for s in statements:
        if s.header:
            out += ["", f"// ---- {s.header}"]
        if s.comment:
            out += ["", f"// {s.comment}"]
        out += [str(line) for line in s.lines]
    return "\n".join(out)


def _train_tail(train) -> list:
    """What train_step() runs after the backward statements: the gradient copies (when the
    gradients are kept) and the updates that could not run earlier."""
    out = []
    if train.copies:
        out += ["if (_gradients_kept) {  // gradients() shows these too"]
        out += [f"  {line}" for line in train.copies] + ["}"]
    if train.updates:
        out += ["if (_gradients_only == nullptr) {"] + [f"  {line}" for line in train.updates] + ["}"]
    return out


def _outlined(line, statement: Statement, scope: dict, plan, taken: set):
    if not isinstance(line, Block) or _length(line) < MIN_LINES:
        return line
    body = ([f"// {line.comment}"] if line.comment else []) + list(line.lines)
    return _method(line, _method_name(statement), body, statement.comment, scope, plan, taken)


def _method(line, wanted: str, body: list, source: str, scope: dict, plan, taken: set) -> MethodCall:
    """The member function `wanted` made of `body` (what `line` held), taking the names of
    `scope` it reads; a long one cut into its parts. Returns its call."""
    text = _COMMENTS.sub("", _STRING.sub(" ", "\n".join(str(b) for b in body)))  # words in comments name nothing
    params, seen = [], set()
    for word in _WORD.findall(text):
        if word in scope and word not in seen:
            seen.add(word)
            params.append((_param_type(scope[word]), word))
    name = fresh_name(wanted, taken)
    taken.add(name)
    method = Method(name, source, params, body, const=plan.train is None)
    plan.methods.append(method)
    if _formatted_length(method) > MAX_LINES:
        inner = {n: t for t, n in params}
        cut = []
        for k, part in enumerate(method.body):
            if isinstance(part, (Block, Loop)) and part.part and _formatted_length(part) >= MIN_LINES:
                # The buffers declared just before the part that nothing after it reads are its own.
                later = set(_WORD.findall(_STRING.sub(" ", "\n".join(str(b) for b in method.body[k + 1:]))))
                own = []
                while cut and isinstance(cut[-1], Declare) and cut[-1].name not in later:
                    own.insert(0, cut.pop())
                if own and isinstance(part, Loop) and cut and isinstance(cut[-1], Comment):
                    own.insert(0, cut.pop())  # what those declarations are (a loop's comment is its own)
                outside = {n: t for n, t in inner.items() if n not in {d.name for d in own if isinstance(d, Declare)}}
                lines = own + (list(part.lines) if isinstance(part, Block) else [part])
                cut.append(_method(part, f"{name}_{part.part}", lines, source, outside, plan, taken))
            else:
                cut.append(part)
            _declare(part, inner)
        method.body = cut
    return MethodCall(name, [n for _, n in params], at=getattr(line, "at", -1))


def _length(line) -> int:
    return str(line).count("\n") + 1


def _formatted_length(line) -> int:
    """The lines `line` takes once formatted as the project is (clang-format)."""
    return clang_format_cpp(str(line), "model.cpp").count("\n") + 1


def _taken(plan, parts) -> set:
    """Names a method must not take: every word `_run` prints (a local of that name
    would hide the method there), the members, the functions."""
    taken = {p.name for p in plan.params} | {f.name for f in plan.functions} | set(_RUN_LOCALS)
    taken |= {i.name for i in plan.modules.instances()}
    if plan.train is not None:
        taken |= {member.split(".")[0] for _, member, _ in plan.train.grads}  # d_layer1_0.conv1_weight: d_layer1_0
        taken |= {member for _, _, member, _ in plan.train.slots}
    for statements in parts:
        for s in statements:
            for line in s.lines:
                code = _COMMENT.sub("", _STRING.sub(" ", str(line)))
                taken.update(_WORD.findall(code))
    return taken


def _template_locals(plan) -> dict:
    """The locals `_run` declares before the first statement (model.cpp.j2)."""
    scope = {}
    dims = {d for d, _ in plan.dims}
    if plan.train is not None:
        dims |= {d for d, _ in plan.train.dims}
        scope.update(_RUN_LOCALS)
        scope["_model"] = f"::{plan.name}::Model&"
        scope[plan.train.hyper_struct.local] = f"const kernels::{plan.train.hyper_struct.name}&"
    for d in dims:
        scope[d] = "const std::int64_t"
    for i in plan.all_inputs:
        scope[i.name] = f"const {i.ctype}*"
    if plan.mode:
        scope[plan.mode] = "const dg::Mode&"
    for name, _ in (plan.memory or {}).get("bases", []):
        scope[name] = "const std::int64_t"
    return scope


def _declare(line, scope: dict) -> None:
    if isinstance(line, FrameDecl):
        scope[line.frame.name] = "float*"
    elif isinstance(line, ArenaDecl):
        scope[line.buffer.name] = "float*"
    elif isinstance(line, Declare):
        scope[line.name] = line.type
    elif isinstance(line, Alias):
        scope[line.value.name] = f"const {line.ctype}*"


def _param_type(declared: str) -> str:
    if declared.endswith(("*", "&")) or _BY_VALUE.match(declared):
        return declared
    return f"{declared}&"  # a vector, a geometry: by reference


def _method_name(statement: Statement) -> str:
    """`lstm` for `... = dg.lstm(..., name="lstm")`, else the function and what it
    assigns: `recurse_h_c` for `h, c = dg.recurse(...)`; `_backward` for its gradient."""
    comment = statement.comment or ""
    backward = comment.startswith("gradient of ")
    source = comment.split("  ", 1)[1] if "  " in comment else ""
    base = "block"
    try:
        node = ast.parse(source.split("  #", 1)[0].strip()).body[0]
    except (SyntaxError, IndexError, ValueError):
        node = None
    value = getattr(node, "value", None)
    if isinstance(value, ast.Call):
        fn = value.func.attr if isinstance(value.func, ast.Attribute) else getattr(value.func, "id", "")
        given = next((k.value.value for k in value.keywords
                      if k.arg == "name" and isinstance(k.value, ast.Constant) and isinstance(k.value.value, str)), "")
        targets = [n.id for t in getattr(node, "targets", []) for n in ast.walk(t)
                   if isinstance(n, ast.Name) and n.id.strip("_")]  # not the `_` a target discards
        base = given if _usable(given) else "_".join([fn] + targets)
    if not _usable(base):
        base = "block"
    return f"{base}_backward" if backward else base


def _usable(name: str) -> bool:
    return bool(name) and name.isidentifier() and not keyword.iskeyword(name) and not name.startswith("_")
