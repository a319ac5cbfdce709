"""The layers of the generator package: every import points downwards.

Each module belongs to one unit: a package (`generator.ops`), or one of the leaf modules
that anyone may import (errors, typed lines, the op table, ...). LAYERS lists the units
from the bottom up, in one place: a unit imports only the units before it. Imports are
read with `ast`, those inside functions included, so a cycle cannot hide in a function.
A function-local import of a generator module is allowed only where LAZY says why a
module loads others on first use (optional dependencies such as torch are imported in
functions, and are not generator modules). Targets differ by configuration: no module
compares anything with a target's name.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "generator"

LAYERS = [
    # leaf modules: the standard library, third-party packages and earlier leaves only
    "generator.version",
    "generator.errors",
    "generator.resources",
    "generator.fileio",
    "generator.treebatch",
    "generator.reference.rng",
    "generator.frontend.source",
    "generator.codegen.printer",
    "generator.codegen.cuda_printer",
    "generator.codegen.stmt",
    "generator.codegen.modules",
    "generator.codegen.plan",
    "generator.memory.buffer",
    # the stages' packages, from the IR up to the command line
    "generator.ir",
    "generator.ops",
    "generator.transforms",
    "generator.reference",
    "generator.frontend",
    "generator.codegen",
    "generator.memory",
    "generator.pipeline",
    "generator",  # the package itself: `import generator as dg` (version only; namespace on first use)
    "generator.importers",
    "generator.namespace",
    "generator.distributed",
    "generator.tools",
]

LAZY = {
    # `deepgen` loads a command's stages when that command runs: starting it (and Ctrl-C
    # while it starts) does not wait for sympy
    "generator.tools.cli",
}

# Imports that other work under way removes (the importers and the tools being split).
# Each test fails for anything else, and for an entry that no longer occurs (strike it then).
PENDING_UPWARD = set()
PENDING_LOCAL = {  # each breaks an import cycle between two modules of its package
    "generator.frontend.dsl",  # windows.py builds on dsl.py (strided slices)
    "generator.importers.blocks",  # block_functions.py and torch_import.py build on blocks.py
    "generator.importers.functions",  # functions.py <-> modules.py (pooling and flatten helpers)
    "generator.importers.modules",
    "generator.importers.onnx_import",  # onnx_ops.py builds on onnx_import.py (Const, Unsupported)
    "generator.importers.torch_import",  # export.py builds on torch_import.py (identifier)
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The LAYERS entry that `module` belongs to: the longest that names it or a package above it."""
    found = [u for u in LAYERS if module == u or (u != "generator" and module.startswith(u + "."))]
    assert found, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return max(found, key=len)


def imports(path: Path):
    """(module imported, line, inside a function) for each import in the file; a
    `from package import name` where name is a module counts as importing that module."""
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    local = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = []
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_module = sub.startswith("generator") and _exists(sub)
                names.append(sub if is_module else target)
        else:
            continue
        for name in names:
            yield name, node.lineno, id(node) in local
            for package in _packages_run(name, module):
                yield package, node.lineno, id(node) in local


def _packages_run(name: str, importer: str) -> list:
    """The sub-packages of generator whose __init__.py importing `name` runs and that
    import something themselves (ops/__init__.py registers every op): importing
    ops.registry imports all of ops."""
    parts = name.split(".")
    found = []
    for i in range(2, len(parts)):
        package = ".".join(parts[:i])
        init = ROOT.joinpath(*parts[:i], "__init__.py")
        if not importer.startswith(package + ".") and init.exists() and _imports_something(init):
            found.append(package)
    return found


def _imports_something(path: Path) -> bool:
    return any(isinstance(n, (ast.Import, ast.ImportFrom)) and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
               for n in ast.walk(ast.parse(path.read_text())))


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def edges():
    """(importing module, imported generator module, line, inside a function) for every import."""
    for path in sorted(PACKAGE.rglob("*.py")):
        for name, line, local in imports(path):
            if name.split(".")[0] == "generator":
                yield module_name(path), name, line, local


def cycles(graph: dict) -> list:
    """The pairs of nodes of `graph` ({node: nodes it points to}) that reach each other."""

    def reach(u):
        seen, todo = set(), [u]
        while todo:
            for v in graph.get(todo.pop(), ()):
                if v not in seen:
                    seen.add(v)
                    todo.append(v)
        return seen

    reached = {u: reach(u) for u in graph}
    return sorted({tuple(sorted((a, b))) for a in graph for b in reached[a] if a != b and a in reached.get(b, ())})


def test_every_import_points_down_the_layers():
    order = {u: i for i, u in enumerate(LAYERS)}
    wrong, pending = [], set()
    for src, dst, line, _ in edges():
        a, b = unit_of(src), unit_of(dst)
        if a != b and order[b] > order[a]:
            if (src, dst) in PENDING_UPWARD:
                pending.add((src, dst))
            else:
                wrong.append(f"{src}:{line} imports {dst} ({a} -> {b}, a higher layer)")
    assert not wrong, "imports that point up the layers:\n" + "\n".join(sorted(wrong))
    assert pending == PENDING_UPWARD, f"no longer imported, strike from PENDING_UPWARD: {PENDING_UPWARD - pending}"


def test_the_unit_graph_has_no_cycle():
    """Follows from the order; checked on its own so that a failure lists the cycles."""
    graph = {}
    for src, dst, _, _ in edges():
        if unit_of(src) != unit_of(dst) and (src, dst) not in PENDING_UPWARD:
            graph.setdefault(unit_of(src), set()).add(unit_of(dst))
    found = cycles(graph)
    assert not found, f"{len(found)} pairs of units import each other:\n" + "\n".join(f"{a} <-> {b}" for a, b in found)


def test_no_generator_module_is_imported_inside_a_function():
    wrong = []
    for src, dst, line, local in edges():
        if local and src not in LAZY and src not in PENDING_LOCAL:
            wrong.append(f"{src}:{line} imports {dst} inside a function")
    assert not wrong, f"{len(wrong)} function-local imports:\n" + "\n".join(wrong)


def test_the_checks_see_imports_and_cycles():
    """The reader maps relative imports the way Python does, and a cycle is found (the tests can fail)."""
    assert unit_of("generator.codegen.stmt") == "generator.codegen.stmt"
    assert unit_of("generator.codegen.lower") == "generator.codegen"
    assert unit_of("generator") == "generator"
    found = {name for name, _, _ in imports(PACKAGE / "ops" / "linalg.py")}
    assert {"generator.ir.shapes", "generator.codegen.stmt"} <= found
    assert cycles({"ir": {"ops"}, "ops": {"codegen", "ir"}, "codegen": set()}) == [("ir", "ops")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [("a", "b"), ("a", "c"), ("b", "c")]


def _target_names() -> set:
    return {p.name for p in (ROOT / "targets").iterdir() if (p / "target.json").is_file()}


def target_branches(path: Path, names: set) -> list:
    """Comparisons in the file with a target's name (`plan.target == "cpu"`, `in ("cuda",)`)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        consts = [c for s in sides for c in ([s] if isinstance(s, ast.Constant) else getattr(s, "elts", []))]
        hit = [c.value for c in consts if isinstance(c, ast.Constant) and c.value in names]
        if hit:
            found.append(f"{path}:{node.lineno} compares with target {hit[0]!r}")
    return found


def test_no_stage_branches_on_a_target_name():
    """Targets differ by configuration (targets/<t>/target.json, codegen/targets.py),
    never by `if target == ...` in the generator."""
    names = _target_names()
    assert {"cpu", "cuda"} <= names
    found = [hit for path in sorted(PACKAGE.rglob("*.py")) for hit in target_branches(path, names)]
    assert not found, "\n".join(found)


def test_the_target_check_sees_a_branch(tmp_path):
    sample = tmp_path / "stage.py"
    sample.write_text('def f(plan, target="cpu"):\n    return 1 if plan.target == "cpu" else plan.target in ("cuda",)\n')
    assert len(target_branches(sample, {"cpu", "cuda"})) == 2  # a default argument is no branch


def test_the_memory_stage_reads_no_cpp_names():
    """The memory stage finds what it needs by the lines' types and fields (a stmt.Gemm,
    its `n`), never by a runtime function's name (`line.fn`, a "dg::..." string)."""
    found = []
    for path in sorted((PACKAGE / "memory").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "dg::" in node.value:
                found.append(f"{path.name}:{node.lineno} {node.value!r}")
            if isinstance(node, ast.Attribute) and node.attr == "fn":
                found.append(f"{path.name}:{node.lineno} reads a call's function name")
    assert not found, "\n".join(found)
