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
from .plan import ArenaDecl, Statement
from .stmt import Alias, Block, Declare

# Printed lines from which a block becomes a function: shorter ones read well inline.
MIN_LINES = 40

_STRING = re.compile(r'"(\\.|[^"\\])*"')
_COMMENT = re.compile(r"//[^\n]*")
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
    for statements in parts:
        for s in statements:
            lines = []
            for line in s.lines:
                lines.append(_outlined(line, s, scope, plan, taken))
                _declare(line, scope)
            s.lines = lines


def _outlined(line, statement: Statement, scope: dict, plan, taken: set):
    if not isinstance(line, Block) or str(line).count("\n") + 1 < MIN_LINES:
        return line
    text = _STRING.sub(" ", str(line))
    params, seen = [], set()
    for word in _WORD.findall(text):
        if word in scope and word not in seen:
            seen.add(word)
            params.append((_param_type(scope[word]), word))
    name = fresh_name(_method_name(statement), taken)
    taken.add(name)
    body = ([f"// {line.comment}"] if line.comment else []) + list(line.lines)
    plan.methods.append(Method(name, statement.comment, params, body, const=plan.train is None))
    return MethodCall(name, [n for _, n in params], at=line.at)


def _taken(plan, parts) -> set:
    """Names a method must not take: every word `_run` prints (a local of that name
    would hide the method there), the members, the functions."""
    taken = {p.name for p in plan.params} | {f.name for f in plan.functions} | set(_RUN_LOCALS)
    if plan.train is not None:
        taken |= {member for _, member, _ in plan.train.grads}
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
    return scope


def _declare(line, scope: dict) -> None:
    if isinstance(line, ArenaDecl):
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
