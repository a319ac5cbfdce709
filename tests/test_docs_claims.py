"""The claims docs/ARCHITECTURE.md and docs/ADDING_AN_OP.md make that a test can check
cheaply: which code names ops, that templates do no arithmetic, the import order the map
gives, that the runtime headers are formatted with the project's style, and that the docs
and a generated project's README point only at files that exist."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import jinja2
import pytest
from jinja2 import nodes

from test_layers import LAYERS

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "docs" / "ARCHITECTURE.md", ROOT / "docs" / "ADDING_AN_OP.md", ROOT / "README.md"]
STYLE = ROOT / "templates" / "project" / "clang-format"


def _op_names() -> set:
    from generator.ops import REGISTRY

    return set(REGISTRY)


def _named_ops(path: Path, names: set) -> set:
    """The op names a module compares a value with (`node.op == "matmul"`, `op in ("a", "b")`)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for part in [node.left] + node.comparators:
                items = part.elts if isinstance(part, (ast.Tuple, ast.List, ast.Set)) else [part]
                found |= {p.value for p in items if isinstance(p, ast.Constant) and p.value in names}
    return found


# ARCHITECTURE.md, "What a stage may know": the only code outside ops/ and the DSL that names ops.
NAMES_OPS = {
    "transforms/passes.py": {"ewise", "matmul", "conv2d", "batch_norm"},  # fuse, simplify, epilogue, weight_grads_last, conv_batch_norm
    "transforms/remat.py": {"ewise", "batch_norm"},
    "transforms/cell_grad.py": {"ewise", "matmul"},  # a cell's kept GEMM results
    "transforms/rounding.py": {"round_bf16"},  # rounded_reads
    "codegen/lower.py": {"concat"},  # LowerCtx.concat_spot
}


def test_only_the_documented_code_names_ops():
    names = _op_names()
    stages = ["transforms", "reference", "codegen", "memory"]
    files = [p for s in stages for p in (ROOT / "generator" / s).rglob("*.py")] + [ROOT / "generator" / "pipeline.py"]
    found = {}
    for path in files:
        ops = _named_ops(path, names)
        if ops:
            found[path.relative_to(ROOT / "generator").as_posix()] = ops
    assert found == NAMES_OPS


def test_templates_do_no_arithmetic():
    env = jinja2.Environment()
    arithmetic = (nodes.Add, nodes.Sub, nodes.Mul, nodes.Div, nodes.FloorDiv, nodes.Mod, nodes.Pow, nodes.Neg)
    found = []
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        for node in env.parse(path.read_text()).find_all(arithmetic):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {type(node).__name__}")
    assert not found


def test_the_map_gives_the_import_order_of_test_layers():
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    section = text.split("## Packages, in import order")[1].split("\n## ")[0]
    leaves_text, table = section.split("| layer | owns |")
    leaves = ["generator." + m for m in re.findall(r"`([\w.]+)`", leaves_text.split("import:")[1])]
    layers = [m if m == "generator" else "generator." + m for m in re.findall(r"^\| `([\w.]+)` \|", table, re.M)]
    assert leaves + layers == LAYERS


def _runtime_headers():
    return sorted((ROOT / "targets").glob("*/runtime/*.h"))


NOT_YET_FORMATTED = set()


@pytest.mark.parametrize("header", _runtime_headers(), ids=lambda p: p.name)
def test_runtime_headers_are_formatted_with_the_project_style(header):
    import clang_format

    if header.name in NOT_YET_FORMATTED:
        pytest.skip("not yet formatted")
    exe = clang_format.get_executable("clang-format")
    formatted = subprocess.run([exe, f"--style=file:{STYLE}", f"--assume-filename={header.name}"],
                               input=header.read_bytes(), capture_output=True, check=True).stdout
    assert formatted == header.read_bytes(), f"clang-format -i --style=file:{STYLE.relative_to(ROOT)} {header}"


def test_the_repository_style_is_the_project_style():
    assert (ROOT / ".clang-format").resolve() == STYLE.resolve()


_PATH = re.compile(r"`([\w./-]+\.(?:py|h|cpp|cu|j2|json|md|toml|txt|sh))`|`([A-Za-z_][\w.-]*/[\w./-]*)`")


def _repo_paths() -> set:
    """Every file and folder of the checkout, relative to it."""
    found = set()
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(".git") and "__pycache__" not in rel:
            found.add(rel + ("/" if path.is_dir() else ""))
    return found


# Backquoted words that look like paths and are not the repository's: files of a generated
# project, members of an .npz, a list of functions.
NOT_REPOSITORY_PATHS = {"tests/expected.npz", ".deepgen/manifest.json", "meta/", "meta/torch_state_dict_keys",
                        "exp/expm1/log/log1p/tanh/erf"}


def _exists(ref: str, paths: set) -> bool:
    """`ref` names a file or folder of the repository: in full or as its tail (`ops/recurse.py`,
    `dg_reduce.h`); `runtime/x.h` is a project's runtime folder, filled from a target's."""
    ref = ref.split(":")[0]
    if ref in NOT_REPOSITORY_PATHS:
        return True
    ref = ref[len("runtime/"):] if ref.startswith("runtime/") and not ref.endswith("/") else ref
    return any(p == ref or p.endswith("/" + ref) for p in paths)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_point_only_at_files_in_the_repository(doc):
    text = doc.read_text()
    assert "DESIGN.md" not in text and "../" not in text
    if doc.name == "README.md":
        return  # its paths are also those of generated projects; the links above are what matter
    paths = _repo_paths()
    missing = [a or b for a, b in _PATH.findall(text) if not _exists(a or b, paths)]
    assert not missing


@pytest.mark.parametrize("model,target", [("tiny", "cpu"), ("tiny", "cuda"), ("tiny_tree", "cpu")])
def test_generated_readme_points_only_inside_the_project(model, target):
    from generator.frontend.loader import load_model
    from generator.pipeline import project_files

    graph = load_model(f"{ROOT / 'tests' / 'models' / 'tiny.py'}:{model}").build()
    files = project_files(graph, target)
    readme = files["README.md"].decode()
    name = graph.name
    inside = set(files) | {f"{name}/model.h"}  # include/<name>/model.h, as the C++ includes it
    folders = {p.rsplit("/", 1)[0] + "/" for p in files if "/" in p}
    for ref in re.findall(r"`([^`\s]+)`", readme):
        if "/" not in ref and not re.search(r"\w\.(h|cpp|cu|py|pyi|npz|toml|txt|md|json)$", ref):
            continue
        if ref == "tiny.py" or ref.startswith(".deepgen/"):  # the model file it cites; deepgen's own folder
            continue
        assert ref in inside or ref in folders or ref.startswith(("src/*", "runtime/*")), ref
