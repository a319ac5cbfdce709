"""Tracing a model function into a Graph.

`@dg.model` wraps the user's function in a ModelDef. `ModelDef.build()` runs it
with a Builder active: every DSL call adds a node (checking shapes at once, so
errors point at the user's line) and returns a Tensor. When the function
returns, values are named after the user's variables (see `_name_values`).
"""

from __future__ import annotations

import inspect
import math
import os
from types import SimpleNamespace

from ..errors import DeepgenError, ModelError, ShapeError
from ..ir.graph import DTYPES, Graph, Node, Value
from ..ir.names import NameTable, check_project_name, problem_with
from ..ops import get_op
from ..ir.shapes import MAX_PARAM_ELEMENTS, fmt_shape, norm_shape, size_problem
from .source import Loc, assigned_names, describe_exception, error_site, forget_calls, in_return, user_loc

_ACTIVE: list = []


def current() -> "Builder":
    if not _ACTIVE:
        raise ModelError(
            "DSL calls must run inside a function decorated with @dg.model "
            "(deepgen builds the graph when it calls that function)",
            user_loc(),
        )
    return _ACTIVE[-1]


class Tensor:
    """What DSL calls return: a handle on an IR value, with Python operators."""

    __array_priority__ = 1000  # numpy scalars defer to our operators

    def __init__(self, value: Value):
        self.value = value

    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.rank)
    name = property(lambda self: self.value.name)

    def __repr__(self):
        return f"Tensor({self.value.name}: {self.value.type_str()})"

    def __bool__(self):
        raise TypeError("a deepgen Tensor has no truth value while the graph is being built "
                        "(choose per example at run time with dg.where or dg.cond)")

    # Operators are defined in dsl.py (they need the op functions).


class Builder:
    def __init__(self, name: str):
        self.graph = Graph(name)
        self.names = NameTable()
        self.dims = set()  # symbolic dims seen so far (their names are taken)
        self.regions = []  # node lists traced apart (recursive cells), named after the graph
        # (placeholder, operand, prefix): a cond branch's rows of an operand, named `<prefix><the
        # operand's name>` once the operand has its final name (the user's variable's)
        self.operand_rows = []
        self.layer_names = {}  # id(value) -> the name= of the layer helper that made it

    # -- declarations -------------------------------------------------------
    def declare(self, kind: str, name, shape, dtype, explicit: bool, loc, claimed: bool = False, **extra) -> Tensor:
        """A new input or parameter. `claimed`: `name` was already taken for it
        (see `derived_names`)."""
        if dtype not in DTYPES:
            raise ModelError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}", loc, kind)
        try:
            shape = norm_shape(shape)
        except TypeError as e:
            raise ModelError(str(e), loc, kind) from None
        for d in shape:
            if isinstance(d, int) and d < 0:
                raise ModelError(f"dimension {d} in shape {fmt_shape(shape)} is negative", loc, kind)
        too_large = size_problem(shape)
        if too_large:
            raise ModelError(too_large, loc, kind)
        if kind in ("param", "state"):
            count = sum(math.prod(p.shape) for p in self.graph.params) + math.prod(shape)
            if count > MAX_PARAM_ELEMENTS:
                raise ModelError(
                    f"parameter of shape {fmt_shape(shape)} brings the model to {count:.3g} parameters, more than "
                    f"the limit of 2**36 ({4 * MAX_PARAM_ELEMENTS // 2**30} GiB of float32)", loc, kind)
        for d in shape:
            for sym in sorted(getattr(d, "free_symbols", ()), key=str):
                if sym not in self.dims:
                    if not self.names.claim(str(sym)):
                        raise ModelError(f"dimension name {str(sym)!r} is already used in this model", loc, kind)
                    self.dims.add(sym)
        if claimed:
            pass
        elif explicit:
            problem = problem_with(name)
            if problem:
                raise ModelError(problem, loc, kind)
            if not self.names.claim(name):
                raise ModelError(f"name {name!r} is already used in this model", loc, kind)
        else:
            name = self.names.unique(name)
        value = Value(name, dtype, shape, kind=kind, loc=loc, explicit=True, **extra)
        (self.graph.inputs if kind == "input" else self.graph.params).append(value)
        return Tensor(value)

    def mode(self) -> Value:
        """The graph's train/eval mode value, made on first use (batch norm, dropout)."""
        if self.graph.mode is None:  # named in finish(), after every name the user gives
            self.graph.mode = Value("mode", "mode", (), kind="mode")
        return self.graph.mode

    def default_name(self, loc, what: str, index: int = 0) -> str:
        """The variable the current statement assigns to, for things that need a name now."""
        targets = assigned_names(loc)
        if targets and index < len(targets):
            return targets[index]
        raise ModelError(f"cannot infer a name for this {what}; pass name='...'", loc, what)

    def derived_names(self, base: str, suffixes, explicit: bool, loc, op: str) -> list[str]:
        """Claim the names of the parameters a helper such as dense makes from one
        base name (`fc` -> fc_w, fc_b). An explicit base must be valid and free,
        and errors name the helper and the base the user wrote; a base inferred
        from a variable (`_h`, `x` used twice) is made safe instead."""
        if not explicit:
            return self.names.unique_group(base, suffixes)
        problem = problem_with(base)
        if problem:
            raise ModelError(problem, loc, op)
        names = [f"{base}_{s}" for s in suffixes]
        for n in names:
            problem = problem_with(n)
            if problem:
                raise ModelError(f"{problem} (made from name {base!r})", loc, op)
        for n in names:
            if n in self.names.used:
                raise ModelError(
                    f"name {base!r} is already used in this model (parameter {n!r} exists)", loc, op
                )
        for n in names:
            self.names.claim(n)
        return names

    # -- nodes ----------------------------------------------------------------
    def add(self, op: str, inputs, attrs: dict, label: str | None = None, name: str | None = None):
        """Add a node; returns its output Tensors. Shape errors name the user's line."""
        loc = user_loc()
        values = [t.value for t in inputs]
        opdef = get_op(op)
        try:
            results = opdef.infer(values, attrs)
        except ValueError as e:
            raise ShapeError(str(e), loc, label or op) from None
        node = Node(op, values, attrs, loc=loc)
        hint = label or op
        for dtype, shape in results:
            too_large = size_problem(shape)
            if too_large:
                raise ShapeError(f"the result's {too_large}", loc, label or op)
        hints = opdef.output_hints or [f"{hint}{i}" for i in range(len(results))]
        for i, (dtype, shape) in enumerate(results):
            out = Value(f"{hint}" if len(results) == 1 else hints[i], dtype, shape, producer=node, loc=loc)
            node.outputs.append(out)
        if name is not None:
            problem = problem_with(name)
            if problem:
                raise ModelError(problem, loc, label or op)
            node.outputs[0].name = name
            node.outputs[0].explicit = True
        self.graph.nodes.append(node)
        return [Tensor(v) for v in node.outputs]

    def require(self, expr, why: str):
        if not (isinstance(expr, int) and expr >= 0):
            self.graph.requirements.append((expr, why))

    # -- finishing ----------------------------------------------------------
    def finish(self, result, loc) -> Graph:
        outputs = _collect_outputs(result, loc)
        for key, _ in outputs:
            if key is not None:
                problem = problem_with(key)
                if problem:
                    raise ModelError(f"output {problem}", loc)
        # `return {"probs": dg.softmax(logits)}`: the value made in the return
        # statement takes the output's name.
        preferred = dict(self.layer_names)
        preferred |= {
            id(t.value): key
            for key, t in outputs
            if key is not None and t.value.producer is not None and in_return(t.value.loc)
        }
        _name_values(self.graph, self.names, preferred)
        for place, operand, prefix in self.operand_rows:
            place.name = self.names.unique(f"{prefix}{operand.name}")
        for nodes, prefix in self.regions:  # the model's own names first, then the cells'
            _name_values(SimpleNamespace(nodes=nodes), self.names, {}, prefix)
        if self.graph.mode is not None:  # the C++ local the mode-dependent ops read: no user's name
            self.graph.mode.name = self.names.unique("mode")
        graph = self.graph
        taken = set()
        for key, tensor in outputs:
            name = key if key is not None else tensor.value.name
            if name in taken:
                raise ModelError(f"output name {name!r} is used twice", loc)
            taken.add(name)
            graph.outputs.append((name, tensor.value))
        if not graph.outputs:
            raise ModelError("the model returns no outputs", loc)
        _check_dims_bound(graph)
        graph.names = self.names  # later passes (autodiff) continue this naming
        return graph


def _collect_outputs(result, loc):
    if isinstance(result, Tensor):
        return [(None, result)]
    if isinstance(result, dict):
        items = list(result.items())
        for key, _ in items:
            if not isinstance(key, str):
                raise ModelError(f"output name must be a string, got {type(key).__name__} {key!r}", loc)
        which = [repr(key) for key, _ in items]
    elif isinstance(result, (tuple, list)):
        items = [(None, t) for t in result]
        which = [str(i) for i in range(len(items))]
    else:
        raise ModelError(
            f"a model must return a Tensor, a tuple/list of Tensors or a dict name -> Tensor, "
            f"got {type(result).__name__}",
            loc,
        )
    for (key, t), what in zip(items, which):
        if not isinstance(t, Tensor):
            raise ModelError(f"output {what} is a {type(t).__name__}, not a Tensor", loc)
        if t.dtype == "bool":  # (ops/logic.py) a project's outputs are numbers for now
            raise ModelError(f"output {what} ('{t.name}') is a bool tensor, which cannot be an output yet: "
                             f"return dg.where({t.name}, 1.0, 0.0) for 0/1 floats", loc)
    return items


def _name_values(graph: Graph, names: NameTable, preferred: dict, prefix: str = ""):
    """Name node outputs after the user's variables.

    Nodes are grouped into runs of consecutive nodes from the same statement. The
    last node of a run gets the assigned variable's name (`h = relu(x @ w + b)`
    names the relu `h`); the others become `h_matmul`, `h_add`. Explicit `name=`
    always wins; names clashing with earlier ones get a numeric suffix. A
    recursive op's cell values get `prefix` (leaf_, node_) before the user's name."""
    runs, current, key = [], [], None
    for node in graph.nodes:
        k = (node.loc.filename, node.loc.stmt_line) if node.loc else None
        if current and k != key:
            runs.append(current)
            current = []
        current.append(node)
        key = k
    if current:
        runs.append(current)
    modules = {p.loc.call_id for p in getattr(graph, "params", ()) if p.loc is not None and p.loc.call is not None}
    for run in runs:
        targets = assigned_names(run[-1].loc)
        base = targets[0] if targets and len(targets) == 1 else _returned_by_named_call(run[-1].loc, modules)
        for node in run:
            last = node is run[-1]
            main = preferred.get(id(node.outputs[0])) if get_op(node.op).output_hints else None
            for i, v in enumerate(node.outputs):
                if v.explicit:
                    continue  # claimed below, in order
                if id(v) in preferred:
                    v.name = preferred[id(v)]
                elif main:  # a layer's other outputs: bn1_mean, bn1_invstd
                    v.name = f"{main}_{v.name}"
                elif last and targets and len(targets) == len(node.outputs):
                    v.name = targets[i]
                elif last and base and i == 0 and (get_op(node.op).output_hints or not targets):
                    v.name = base  # the main result; the others are base_<hint> (bn_mean)
                elif base:
                    v.name = f"{base}_{v.name}"
    for node in graph.nodes:
        for v in node.outputs:
            if v.explicit:
                if not names.claim(v.name):
                    raise ModelError(f"name {v.name!r} is already used in this model", node.loc)
            else:
                v.name = names.unique(prefix + v.name)


def _returned_by_named_call(loc, modules: set) -> str | None:
    """The call's `name=` for what a user's function returns (`return dg.relu(out + shortcut)`
    in `basic_block(x, ..., name='layer1_0')` makes `layer1_0_out`: the block's output, named
    after the block, whose parameters are the module `layer1_0` when the call made some
    (`modules`: the calls that did), else `layer1_0`), when the function was given one; else None."""
    if loc is None or loc.call is None or not in_return(loc):
        return None
    name = dict(loc.call_args).get("name")
    if not (isinstance(name, str) and name.isidentifier()):
        return None
    return f"{name}_out" if loc.call_id in modules else name


def _check_dims_bound(graph: Graph):
    bound = set(graph.dims)
    for v in graph.inputs:
        for d in v.shape:
            if not isinstance(d, int) and not d.is_Symbol:
                raise ModelError(
                    f"input '{v.name}': dimension {d} must be an int or a plain symbol such as N", v.loc
                )
    for v in graph.values():
        for d in v.shape:
            if not isinstance(d, int):
                free = d.free_symbols - bound
                if free:
                    names = ", ".join(sorted(map(str, free)))
                    raise ModelError(f"'{v.name}' uses dimension(s) {names} that no input determines", v.loc)


class ModelDef:
    """A model function marked with @dg.model; build() traces it into a Graph."""

    def __init__(self, fn, name: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        code = fn.__code__
        self.loc = Loc(os.path.abspath(code.co_filename), code.co_firstlineno, code.co_firstlineno, "")
        self._check_signature()

    def _check_signature(self):
        """deepgen calls the model function with no arguments."""
        try:
            sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            return
        required = [
            p.name
            for p in sig.parameters.values()
            if p.default is inspect.Parameter.empty
            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
        ]
        if required:
            raise ModelError(
                f"a @dg.model function takes no arguments, but {self.fn.__name__}() requires "
                f"{', '.join(required)} (use a default value, or build the model in a function "
                f"that takes no arguments)",
                self.loc,
            )

    def _check_options(self, options: dict):
        """Every option must be a keyword parameter of the model function."""
        if not options:
            return
        try:
            params = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            return
        known = [p.name for p in params.values() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ModelError(
                f"{self.fn.__name__}() has no option {', '.join(map(repr, unknown))}; "
                f"its options are: {', '.join(known) or 'none'}",
                self.loc,
            )

    def build(self, name: str | None = None, **options) -> Graph:
        """Trace the model function into a Graph named `name` (default: the function's).
        `options` are passed to the function as keyword arguments: a model written as
        `def resnet18(image=32, width=64)` builds smaller with `build(image=8, width=8)`."""
        name = name or self.name
        problem = problem_with(name)
        if problem:
            raise ModelError(f"invalid model name: {problem}", self.loc)
        try:  # it names a C++ namespace at global scope, a Python module and a CMake target too
            check_project_name(name)
        except ValueError as e:
            raise ModelError(str(e).replace("invalid project name", "invalid model name"), self.loc) from None
        self._check_signature()
        self._check_options(options)
        builder = Builder(name)
        _ACTIVE.append(builder)
        try:
            result = self.fn(**options)
        except DeepgenError:
            raise
        except (Exception, SystemExit) as e:  # the user's code failed: say where, in one line
            where, text = error_site(e, self.loc.filename)
            raise ModelError(f"{where}: {describe_exception(e)} (while building model '{name}'){text}") from e
        finally:
            _ACTIVE.pop()
            if not _ACTIVE:
                forget_calls()
        builder.graph.loc = self.loc
        return builder.finish(result, self.loc)

    def __repr__(self):
        return f"<deepgen model {self.name} at {self.loc}>"
