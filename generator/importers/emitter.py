"""The text of an imported model, written and run one statement at a time.

Each statement the importer writes is executed at once under a live deepgen
Builder, so the next statement can use what the DSL knows (symbolic shapes such
as `(N, 32)`) and a mistake is caught at the node that made it, not in a file
the user later fails to load.
"""

from __future__ import annotations

import builtins
import keyword
import linecache
import os
from dataclasses import dataclass

import sympy

from ..errors import DeepgenError
import generator as dg

from ..frontend.builder import _ACTIVE, Builder, ModelDef, Tensor
from ..ir.names import RESERVED, is_identifier, problem_with
from .blocks import structure


class StatementError(DeepgenError):
    """A statement the importer wrote does not check under the DSL (a shape that the
    example inputs make impossible): the message without the statement's pseudo file."""

    def __init__(self, statement: str, message: str):
        super().__init__(message)
        self.statement = statement


@dataclass(frozen=True)
class Var:
    """A tensor of the generated model: its variable in the text and its live DSL Tensor."""

    name: str
    tensor: Tensor


class Emitter:
    """Input declarations and body statements of one model function."""

    def __init__(self, graph_name: str):
        self.builder = Builder(graph_name)
        self.graph_name = graph_name
        self.ns = {"dg": dg}
        self.imports: set[str] = set()  # modules the statements use besides dg (use_module)
        self.dims: dict[str, sympy.Symbol] = {}  # symbolic dims the inputs declared, in order
        self.inputs: list[str] = []  # dg.input statements
        self.body: list[tuple[str, str | None]] = []  # (statement, comment above it or None)
        # The module paths (outermost first) of the layer call being written, and each body
        # statement's: the importer sets `scope`; blocks.py makes repeated classes functions.
        self.scope: tuple = ()
        self.scopes: list[tuple] = []
        self.taken = set(RESERVED) | set(dir(builtins)) | {"dg", "N", "T"}
        self.locals: set[str] = set()  # the variables fresh() handed out
        self._count = 0
        self._comment: str | None = None

    def __enter__(self):
        _ACTIVE.append(self.builder)
        return self

    def __exit__(self, *exc):
        _ACTIVE.remove(self.builder)
        return False

    # -- names --------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        """An unused variable name made from `hint` (a module path or an fx node name)."""
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in hint).strip("_") or "t"
        if base[0].isdigit():
            base = "t" + base
        name, k = base, 1
        while name in self.taken or keyword.iskeyword(name) or not is_identifier(name):
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        self.locals.add(name)
        return name

    def dim(self, name: str) -> sympy.Symbol:
        """The symbolic dim `name` (declared once at the file's top)."""
        if name not in self.dims:
            # Checked before it becomes code: `class = ...` is no statement, and a dim must not
            # share its name with the model function or a variable of it (a local there).
            problem = problem_with(name) if isinstance(name, str) else f"{name!r} is not a name"
            if problem is None and (name == self.graph_name or name in self.locals):
                problem = f"name {name!r} is already a name in the model"
            if problem:
                raise DeepgenError(f"dim {problem}")
            self.taken.add(name)
            self._run(f'{name} = dg.dim("{name}")')
            self.dims[name] = self.ns[name]
        return self.dims[name]

    def use_module(self, module: str):
        """Import `module` in the file (and here) for the statements that name it (`sympy`)."""
        import importlib

        self.imports.add(module)
        self.taken.add(module)
        self.ns[module] = importlib.import_module(module)

    # -- statements -----------------------------------------------------------------
    def comment(self, text: str | None):
        """A comment written above the next statement (the PyTorch line it comes from)."""
        self._comment = text

    def note(self, text: str):
        """A comment line added to the one written above the next statement."""
        self._comment = f"{self._comment}\n{text}" if self._comment else text

    def declare_input(self, name: str, shape, dtype: str) -> Var:
        var = self.fresh(name)
        dtype_arg = "" if dtype == "float32" else f', dtype="{dtype}"'
        statement = f'{var} = dg.input("{name}", {code(tuple(shape))}{dtype_arg})'
        self._run(statement)
        self.inputs.append(statement)
        return Var(var, self.ns[var])

    def assign(self, hint: str, expr: str) -> Var:
        """`hint = expr` (hint made unique); the Var of the new tensor."""
        name = self.fresh(hint)
        self.statement(f"{name} = {expr}")
        value = self.ns[name]
        if not isinstance(value, Tensor):
            raise DeepgenError(f"internal: `{expr}` made {type(value).__name__}, not a Tensor")
        return Var(name, value)

    def statement(self, text: str):
        self._run(text)
        self.body.append((text, self._comment))
        self.scopes.append(self.scope)
        self._comment = None

    def var(self, name: str) -> Var:
        return Var(name, self.ns[name])

    def _run(self, text: str):
        # A file name per statement: the DSL reads its source lines (to name values), and
        # caches what it parsed by file name.
        self._count += 1
        filename = os.path.abspath(f"<deepgen from-torch {self._count}>")
        linecache.cache[filename] = (len(text), None, [text + "\n"], filename)
        try:
            exec(compile(text, filename, "exec"), self.ns)
        except StatementError:
            raise
        except DeepgenError as e:
            message = str(e).replace(f"{filename}:1: ", "").split("\n")[0]
            raise StatementError(text, message) from None
        finally:
            linecache.cache.pop(filename, None)


def code(value) -> str:
    """Python source for a value of the generated model: a Var's name, a number,
    a symbolic size (`N*T`), or a tuple / list of them."""
    if isinstance(value, Var):
        return value.name
    if value is None or isinstance(value, (bool, str)):
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, sympy.Basic):
        return str(value).replace(" ", "") if value.is_Atom else str(value)
    if isinstance(value, tuple):
        inner = ", ".join(code(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(code(v) for v in value) + "]"
    raise TypeError(f"no source form for {type(value).__name__} {value!r}")


def model_file(docstring_lines: list, em: "Emitter", name: str, outputs: dict, module=None) -> str:
    """The text of an imported model file: its docstring, the dims, the model function
    with each statement under its comment, the outputs returned; formatted by black.
    With `module` (the nn.Module the statements' scopes name), the instances of a module
    class used more than once are calls of one function each (blocks.py)."""
    import black

    body, functions, renames = em.body, [], {}
    if module is not None:
        returned = {k: code(v) for k, v in outputs.items()}
        functions, body, renames = structure(em.body, em.scopes, module, returned, em.inputs, {*em.dims, "dg", name})
    lines = list(docstring_lines) + ['"""', "", *sorted(f"import {m}" for m in em.imports), "import generator as dg", ""]
    lines += [f'{d} = dg.dim("{d}")' for d in em.dims]
    for function in functions:
        lines += ["", "", function]
    lines += ["", "", "@dg.model", f"def {name}():"]
    lines += [f"    {s}" for s in em.inputs]
    for statement, comment in body:
        lines += [f"    # {line}" for line in (comment.split("\n") if comment else ())]
        lines.append(f"    {statement}")
    returned = ", ".join(f'"{k}": {renames.get(code(v), code(v))}' for k, v in outputs.items())
    lines.append(f"    return {{{returned}}}")
    return black.format_str("\n".join(lines) + "\n", mode=black.Mode(line_length=110))


def validate_model_file(source: str, name: str, weights: dict, tool: str) -> None:
    """Build the written file as `deepgen generate` will, and check its parameters
    against the weights (`tool`: the command that wrote it, for the file's pseudo-name)."""
    filename = os.path.abspath(f"<deepgen {tool} {name}.py>")
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    try:
        namespace: dict = {"__name__": f"deepgen_{tool.replace('-', '_')}_{name}"}
        exec(compile(source, filename, "exec"), namespace)
        graph = next(v for v in namespace.values() if isinstance(v, ModelDef)).build()
    finally:
        linecache.cache.pop(filename, None)
    declared = {p.name: tuple(p.shape) for p in graph.params}
    stored = {k: tuple(v.shape) for k, v in weights.items()}
    if declared != stored:
        diff = sorted(set(declared.items()) ^ set(stored.items()))
        raise DeepgenError(f"internal: the imported model's parameters differ from the weights: {diff[:6]}")
