"""A module class used more than once becomes one DSL function (#37 item 5).

The importer writes one statement per layer call, each recorded with the module
path it came from (`Emitter.scopes`). Here the statements of each instance of a
repeated class (ResNet's Bottleneck, BERT's layer) are made one function, written
as a person writes `basic_block` in examples/resnet18.py:

    def bottleneck(x, out_channels, conv3_out_channels, name):
        conv1 = dg.conv2d_layer(x, out_channels, (1, 1), bias=False, name=f"{name}_conv1")
        ...
    layer1_1 = bottleneck(layer1_0, out_channels=64, conv3_out_channels=256, name="layer1_1")

Parameter and layer names are the same strings as before (`f"{name}_conv1"` with
name="layer1_1" is "layer1_1_conv1"), so the weights and their state_dict keys do
not change. Each instance is made a template: its variables renamed without the
instance's prefix, the values it reads from outside numbered (the function's
tensor arguments), strings starting with the prefix marked, and every other
number, string or tuple of them a slot (a default the converter left out is written
first, so that stride 1 and stride 2 are one template; a list of outside values, as
DenseNet concatenates, is one argument). Instances whose templates are equal share
a function; slots that differ between them (channels, stride) become its
arguments, named after the DSL parameter they fill.

Instances whose structure differs (a ResNet block with a `downsample` branch and
one without) get one function each, named after the class and, where it says what
differs, the submodules only one of them has (`bottleneck_downsample`): each
function stays straight-line code that reads like the module's forward for that
case, and an `if` would have to merge statements whose operands differ (the sum
reads the downsample's output or the block's input). Only the outermost repeated
class is a function; repeated classes inside it (BERT's attention inside its
layer) stay inline there. Classes used once stay inline, and so do the instances of
a class most of whose instances differ in structure (DenseNet's dense blocks).
"""

from __future__ import annotations

import ast
import builtins
import copy
import functools
import inspect
import keyword
import re
from dataclasses import dataclass, field

import generator as dg

from ..ir.names import problem_with


@dataclass
class Instance:
    """One instance's statements as a template (see the module docstring)."""

    path: str
    cls: type
    prefix: str
    indices: list
    stmts: list = field(default_factory=list)  # templated ast statements
    comments: list = field(default_factory=list)
    slots: list = field(default_factory=list)  # (literal node, DSL parameter, statement's variable, default)
    externals: list = field(default_factory=list)  # the outside variables it reads, in order
    outputs: list = field(default_factory=list)  # (variable, canonical name) read after it
    subpaths: frozenset = frozenset()  # the paths of its submodules that wrote statements
    names: set = field(default_factory=set)  # the function's variables
    key: str = ""


def structure(body, scopes, module, outputs: dict, inputs, taken) -> tuple:
    """(functions, main body, renames) for the statements `body` [(text, comment)] whose
    module scopes are `scopes`; `outputs` the model's {key: variable name}, `inputs` the
    input statements, `taken` every name the file uses at its top level (dims, dg, the
    model's name). Functions are source texts; renames map a variable of the main body
    to the call result that replaces it."""
    trees = [_parse(text) for text, _ in body]
    assigned = [_assigned(t) for t in trees]
    reads = [_reads(t) for t in trees]
    model_locals = set().union(*assigned, *(_assigned(_parse(s)) for s in inputs))
    given = body, scopes, trees, assigned, reads
    excluded: set = set()
    while True:
        classes = _classes(scopes, module, excluded)
        body, scopes, trees, assigned, reads, instances = _instances(
            *given, classes, model_locals, outputs, taken
        )
        # A class most of whose instances differ in structure (DenseNet's dense blocks of 6, 12,
        # 24 and 16 layers) is no block: its instances stay inline, and a repeated class inside
        # them (the dense layer) may be the outermost one instead.
        variants: dict = {}
        for inst in instances:
            variants.setdefault(inst.cls, set()).add(inst.key)
        count = {cls: sum(inst.cls is cls for inst in instances) for cls in variants}
        scattered = {cls for cls, keys in variants.items() if len(keys) > max(2, count[cls] // 2)}
        if not scattered:
            break
        excluded |= scattered
    from .block_functions import argument, functions as write_functions

    functions, calls = write_functions(instances, model_locals | set(taken), set(taken))

    renames, main = {}, []
    first = {inst.indices[0]: inst for inst in instances}
    inside = {i for inst in instances for i in inst.indices}
    for i, (text, comment) in enumerate(body):
        if i in first:
            inst = first[i]
            result, fname, keywords = calls[inst.path]
            args = [argument(e, renames) for e in inst.externals] + keywords
            main.append((f"{result} = {fname}({', '.join(args)})", None))
            if len(inst.outputs) == 1 and result != inst.outputs[0][0]:
                renames[inst.outputs[0][0]] = result
        elif i not in inside:
            if reads[i] & set(renames):
                text = ast.unparse(_Rename(renames).visit(trees[i]))
            main.append((text, comment))
    return functions, main, renames


# -- which statements ----------------------------------------------------------------------


def _instances(body, scopes, trees, assigned, reads, classes, model_locals, outputs, taken) -> tuple:
    """The statements (hoisted: see _hoist) and their instances of the repeated `classes`."""
    owner = [next((p for p in scope if p in classes), None) for scope in scopes]
    order = _hoist(owner, scopes, assigned, reads)
    body, trees, assigned, reads = ([x[i] for i in order] for x in (body, trees, assigned, reads))
    owner, scopes = [owner[i] for i in order], [scopes[i] for i in order]
    instances = []
    for path in dict.fromkeys(p for p in owner if p is not None):
        indices = [i for i, p in enumerate(owner) if p == path]
        later = set().union(*reads[indices[-1] + 1 :], outputs.values())
        inst = Instance(path, classes[path], _identifier(path), indices)
        inst.subpaths = frozenset(
            p[len(path) + 1 :] for i in indices for p in scopes[i] if p.startswith(path + ".")
        )
        if _template(
            inst, [trees[i] for i in indices], [body[i][1] for i in indices], model_locals, later, taken
        ):
            instances.append(inst)
    return body, scopes, trees, assigned, reads, instances


def _classes(scopes, module, excluded=()) -> dict:
    """{module path: class} of the instances of repeated classes: classes defined outside
    torch.nn (a torch.nn module is one layer call; Sequential and ModuleList are containers)
    and not `excluded`, with two instances or more that wrote statements."""
    seen: dict = {}
    for scope in scopes:
        for path in scope:
            if path not in seen:
                try:
                    seen[path] = type(module.get_submodule(path))
                except AttributeError:
                    seen[path] = None
    count: dict = {}
    for path, cls in seen.items():
        if cls is not None and not cls.__module__.startswith("torch.nn") and cls not in excluded:
            count[cls] = count.get(cls, 0) + 1
    return {path: cls for path, cls in seen.items() if count.get(cls, 0) >= 2}


def _hoist(owner, scopes, assigned, reads) -> list:
    """The statements' order, with statements of the model's own scope that were written
    amid an instance's (an attention mask made at its first use) moved before it. An
    instance whose statements are not contiguous otherwise stays inline."""
    position = {i: float(i) for i in range(len(owner))}
    for path in dict.fromkeys(p for p in owner if p is not None):
        indices = [i for i, p in enumerate(owner) if p == path]
        between = [i for i in range(indices[0], indices[-1] + 1) if owner[i] != path]
        mine = set().union(*(assigned[i] for i in indices))
        if all(owner[i] is None and not scopes[i] and not reads[i] & mine for i in between):
            for k, i in enumerate(between):
                position[i] = indices[0] - 0.5 + k / (2 * len(between) + 2)
        else:
            for i in indices:
                owner[i] = None
    return sorted(position, key=position.get)


# -- templates --------------------------------------------------------------------------------


def _template(inst, trees, comments, model_locals, later, taken) -> bool:
    """Fill `inst` from its statements; False when it cannot be a function (it returns nothing)."""
    t = _Template(inst.prefix, model_locals, taken, [n for tree in trees for n in _assigned(tree)])
    inst.stmts = [t.statement(copy.deepcopy(tree)) for tree in trees]
    inst.comments = comments
    inst.slots, inst.externals, inst.names = t.slots, t.externals, t.locals
    inst.outputs = [(name, t.local[name]) for name in t.local if name in later]
    body = "\n".join(ast.unparse(s) for s in inst.stmts)
    inst.key = f"{body}\nreturn {[c for _, c in inst.outputs]} {len(inst.externals)}"
    return bool(inst.outputs)


class _Template:
    """Rewrites one instance's statements into its template."""

    def __init__(self, prefix, model_locals, taken, targets):
        self.prefix, self.model_locals = prefix, model_locals
        self.local: dict = {}  # variable -> its name in the function
        self.externals: list = []
        self.slots: list = []
        self.target = ""
        avoid = set(taken) | {"name", "dg"} | set(dir(builtins))
        used = set()
        # Names made from module paths keep their suffix (compare matches `relu_1` to the
        # second call of `relu`): they are named first, the fx node names (`add_3`) after.
        for name in sorted(dict.fromkeys(targets), key=lambda n: not n.startswith(prefix + "_")):
            own = name.startswith(prefix + "_")
            base = name[len(prefix) + 1 :] if own else re.sub(r"_\d+$", "", name)
            if not base.isidentifier() or keyword.iskeyword(base):
                base = f"t_{base}" if base else "out"
            if base in avoid or problem_with(base):
                base += "_value"
            canon, k = base, 1
            while canon in used:
                canon, k = f"{base}_{k}", k + 1
            used.add(canon)
            self.local[name] = canon
        self.locals = used

    def statement(self, tree):
        if isinstance(tree, ast.Assign):
            names = [n.id for t in tree.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            self.target = self.local.get(names[0], "value") if names else "value"
            tree.value = self.expr(tree.value, "value")
            tree.targets = [self.expr(t, "value") for t in tree.targets]
            return tree
        return self.expr(tree, "value")

    def expr(self, node, ctx, default=None):
        """`node` templated; `ctx`: the DSL parameter it fills, `default`: that parameter's
        default (repr) where node is the whole value of a keyword."""
        literal = _literal(node)
        if literal is not None:
            value = literal[0]
            if isinstance(value, str) and (value == self.prefix or value.startswith(self.prefix + "_")):
                return ast.Call(
                    ast.Name("__prefixed", ast.Load()), [ast.Constant(value[len(self.prefix) :])], []
                )
            self.slots.append((node, ctx, self.target, default))
            return ast.Name(f"__slot{len(self.slots) - 1}", ast.Load())
        if (
            isinstance(node, (ast.List, ast.Tuple))
            and node.elts
            and all(
                isinstance(e, ast.Name) and e.id in self.model_locals and e.id not in self.local
                for e in node.elts
            )
        ):
            # A list of outside values (DenseNet's concatenation of the features so far, longer
            # in each layer) is one argument, so that the instances share a template.
            names = tuple(e.id for e in node.elts)
            if names not in self.externals:
                self.externals.append(names)
            return ast.Name(f"__ext{self.externals.index(names)}", ast.Load())
        if isinstance(node, ast.Name):
            if node.id in self.local:
                return ast.Name(self.local[node.id], type(node.ctx)())
            if node.id in self.model_locals:
                if node.id not in self.externals:
                    self.externals.append(node.id)
                return ast.Name(f"__ext{self.externals.index(node.id)}", ast.Load())
            return node
        if isinstance(node, ast.Call):
            params = _parameters(node.func)
            node.args = [
                self.expr(a, params[i][0] if i < len(params) else ctx) for i, a in enumerate(node.args)
            ]
            # A default the converter left out is written as a keyword here, so that an
            # instance with stride 1 (left out) and one with stride 2 share one template;
            # the keyword is left out again where every instance has the default.
            given = {kw.arg for kw in node.keywords} | {p for p, _ in params[: len(node.args)]}
            node.keywords += [
                ast.keyword(p, ast.Constant(d) if not isinstance(d, tuple) else _tuple(d))
                for p, d in params[len(node.args) :]
                if p not in given and _plain(d)
            ]
            rank = {p: k for k, (p, _) in enumerate(params)}
            node.keywords.sort(key=lambda kw: rank.get(kw.arg, len(rank)))
            defaults = {p: repr(d) for p, d in params if _plain(d)}
            for kw in node.keywords:
                kw.value = self.expr(kw.value, kw.arg or ctx, defaults.get(kw.arg))
            return node
        for name, value in ast.iter_fields(node):
            if isinstance(value, ast.expr):
                setattr(node, name, self.expr(value, ctx))
            elif isinstance(value, list):
                setattr(node, name, [self.expr(v, ctx) if isinstance(v, ast.expr) else v for v in value])
            elif isinstance(value, ast.AST) and not isinstance(value, (ast.expr_context, ast.operator)):
                self.expr(value, ctx)
        return node


def _literal(node):
    """(value,) when `node` is a number, a string or a tuple of them; None otherwise."""
    if not isinstance(node, (ast.Constant, ast.Tuple, ast.UnaryOp)):
        return None
    try:
        value = ast.literal_eval(node)
    except ValueError:
        return None
    return (value,) if _plain(value) else None


def _plain(value) -> bool:
    if isinstance(value, tuple):
        return bool(value) and all(_plain(v) for v in value)
    return isinstance(value, (int, float, str)) and not isinstance(value, bool)


def _tuple(values):
    return ast.Tuple([ast.Constant(v) for v in values], ast.Load())


@functools.lru_cache(maxsize=None)
def _dg_parameters(fn: str) -> tuple:
    try:
        parameters = inspect.signature(getattr(dg, fn)).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return ()
    return tuple(
        (p.name, p.default) for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    )


def _parameters(func) -> tuple:
    """The (name, default) of each parameter of a `dg.<fn>` call, in order."""
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "dg":
        return _dg_parameters(func.attr)
    return ()


class _Rename(ast.NodeTransformer):
    def __init__(self, renames):
        self.renames = renames

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load) and node.id in self.renames:
            return ast.Name(self.renames[node.id], ast.Load())
        return node


# -- small helpers ------------------------------------------------------------------------------


def _parse(text):
    return ast.parse(text).body[0]


def _assigned(tree) -> set:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _reads(tree) -> set:
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}


def _identifier(path: str) -> str:
    from .torch_import import identifier

    return identifier(path)


def _snake(text: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", text).lower()


def scope_of(node) -> tuple:
    """The module paths, outermost first, of an fx or exported node (its `nn_module_stack`)."""
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(dict.fromkeys(v[0] for v in stack.values() if v and v[0]))
