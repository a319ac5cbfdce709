"""Generated sources: deterministic, matching the golden files, safe to regenerate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from generator.codegen.writer import write_project
from generator.pipeline import project_files
from generator.errors import DeepgenError
from generator.frontend.loader import load_model

TINY = str(ROOT / "tests" / "models" / "tiny.py")


def _tiny():
    return load_model(TINY + ":tiny").build()


def test_same_model_gives_byte_identical_output():
    assert project_files(_tiny()) == project_files(_tiny())


def test_output_does_not_depend_on_hash_seed_or_folder(tmp_path):
    script = (
        "import sys, hashlib; from generator.frontend.loader import load_model; from generator.pipeline import project_files;"
        f"files = project_files(load_model({TINY!r} + ':tiny').build());"
        "print(hashlib.sha256(b''.join(k.encode() + v for k, v in files.items())).hexdigest())"
    )
    digests = set()
    for seed, cwd in (("1", tmp_path), ("2", ROOT)):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=cwd,
                              env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        digests.add(proc.stdout.strip())
    assert len(digests) == 1


# name in tests/golden -> (model in tests/models/tiny.py, target)
GOLDENS = {
    "tiny": ("tiny", "cpu"),  # forward only
    "tiny_train": ("tiny_train", "cpu"),  # train_step: loss, backward, updates
    "tiny_tree": ("tiny_tree", "cpu"),  # a recursive model's level loop
    "tiny_cuda": ("tiny_train", "cuda"),  # the CUDA target
}


@pytest.mark.parametrize("golden", sorted(GOLDENS))
def test_golden_files(update_golden, golden):
    """Generated projects, file by file. Refresh with `pytest --update-golden`
    after an intended change, and review the diff."""
    model, target = GOLDENS[golden]
    folder = ROOT / "tests" / "golden" / golden
    graph = load_model(f"{TINY}:{model}").build(golden)
    # Runtime headers are copied verbatim (and tested on their own in test_runtime.py).
    files = {k: v for k, v in project_files(graph, target).items() if not k.endswith(".npz") and not k.startswith("runtime/")}
    if update_golden:
        for old in folder.rglob("*"):
            if old.is_file():
                old.unlink()
        for rel, data in files.items():
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
        pytest.skip("golden files rewritten")
    expected = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert sorted(files) == sorted(expected), "file list changed (run pytest --update-golden)"
    for rel in files:
        assert files[rel] == expected[rel], f"{rel} differs from tests/golden/{golden} (run pytest --update-golden)"


def test_generated_code_names_come_from_the_user():
    files = project_files(_tiny())
    model = files["src/model.cpp"].decode()
    for name in ("h_w", "h_b", "y_w", "kernels::add_relu_bias_epilogue{h_b.ptr()}"):
        assert name in model
    assert "// tiny.py:11  h = dg.dense(x, 4, act=dg.relu)" in model
    # -O2 folds the bias + relu into the GEMM: the epilogue is named for what it computes.
    assert "struct add_relu_bias_epilogue {" in files["src/kernels.h"].decode()
    assert "dg::math::max_f(0.0F, _acc[_j] + x1[_col0 + _j])" in files["src/kernels.h"].decode()
    assert "float* h = _arena.at(" in model
    # Without fusion the matmul keeps its own buffer, named after the statement it serves.
    plain = project_files(_tiny(), opt="O0")
    assert "float* h_matmul = _arena.at(" in plain["src/model.cpp"].decode()
    # Kernels are named for what they compute and take the sizes: one add_bias serves both layers.
    assert "out[_i0 * n1 + _i1] = x0[_i0 * n1 + _i1] + x1[_i1];" in plain["src/kernels.cpp"].decode()
    assert "kernels::add_bias(h_matmul, h_b.ptr(), h_add, /*n0=*/N, /*n1=*/4);" in plain["src/model.cpp"].decode()
    assert "kernels::add_bias(y_matmul, y_b.ptr(), y.data(), /*n0=*/N, /*n1=*/2);" in plain["src/model.cpp"].decode()


def test_generated_cpp_is_formatted():
    import clang_format

    from generator.resources import resource_dir

    style = resource_dir("templates") / "project" / "clang-format"
    for rel, data in project_files(_tiny()).items():
        if rel.endswith((".cpp", ".h")) and not rel.startswith("runtime/"):
            proc = subprocess.run([clang_format.get_executable("clang-format"), f"--style=file:{style}",
                                   f"--assume-filename={rel}"], input=data, capture_output=True)
            assert proc.stdout == data, f"{rel} is not clang-formatted"


def test_regenerating_keeps_hand_edits(tmp_path):
    """(The merge itself: tests/test_regenerate.py.)"""
    out = tmp_path / "tiny"
    files = project_files(_tiny())
    write_project(out, files)
    write_project(out, files)  # unchanged: fine
    model_cpp = out / "src" / "model.cpp"
    model_cpp.write_text(model_cpp.read_text() + "// my edit\n")
    write_project(out, files)  # the generation did not change: the edit stands
    assert model_cpp.read_text().endswith("// my edit\n")
    write_project(out, files, force=True)
    assert not model_cpp.read_text().endswith("// my edit\n")
    assert (out / ".deepgen" / "premerge" / "src" / "model.cpp").read_text().endswith("// my edit\n")
    manifest = json.loads((out / ".deepgen" / "manifest.json").read_text())
    assert set(manifest["files"]) == set(files)


def test_refuses_a_folder_deepgen_did_not_make(tmp_path):
    (tmp_path / "mine.txt").write_text("precious")
    with pytest.raises(DeepgenError, match="not made by deepgen"):
        write_project(tmp_path, project_files(_tiny()))
    assert (tmp_path / "mine.txt").read_text() == "precious"


def test_stale_generated_files_are_removed(tmp_path):
    files = project_files(_tiny())
    write_project(tmp_path / "p", dict(files, **{"src/old.cpp": b"// old\n"}))
    write_project(tmp_path / "p", files)
    assert not (tmp_path / "p" / "src" / "old.cpp").exists()


def test_user_source_text_cannot_break_out_of_comments(tmp_path):
    model = tmp_path / "weird.py"
    model.write_text(
        "import generator as dg\n"
        "@dg.model\n"
        "def weird():\n"
        "    x = dg.input('x', (2, 3))\n"
        "    y = dg.relu(x) \\\n"
        "        * 2.0  # é */ \"quoted\"\n"
        "    z = dg.relu(y)\n"
        "    return {'z': z}\n"
    )
    files = project_files(load_model(str(model)).build())
    text = files["src/model.cpp"].decode()
    for line in text.splitlines():
        if "//" in line:
            assert not line.rstrip().endswith("\\"), line
    assert all(b < 128 for b in files["src/model.cpp"])


@pytest.mark.parametrize("stage, expect", [("optimize", "matmul"), ("differentiate", "d_logits"),
                                           ("lower", "(unplaced)"), ("plan_memory", "## arena")])
def test_ir_stops_after_each_stage(capsys, stage, expect):
    from generator.tools.cli import main

    assert main(["ir", f"{TINY}:tiny_train", "--after", stage]) == 0
    out = capsys.readouterr().out
    assert expect in out
    if stage == "optimize":
        assert "d_logits" not in out  # the backward pass comes with differentiate


def test_ir_prints_a_recursions_level_loops(capsys):
    """`deepgen ir --after lower` on a model that trains through recursion prints
    the forward level loop and the gradient's reverse loop as the C++ blocks they are."""
    from generator.tools.cli import main

    assert main(["ir", str(ROOT / "examples" / "treelstm_sentiment.py"), "--after", "lower"]) == 0
    out = capsys.readouterr().out
    for part in ("// Leaves: all leaves at once.", "for (std::int64_t level = 1; level < schedule.levels(); ++level) {",
                 "for (std::int64_t level = schedule.levels() - 1; level >= 1; --level) {",
                 "const std::int64_t rows = schedule.level_start[level + 1] - start;",
                 "dg::gather_child_nodes(", "dg::scatter_children_add("):
        assert part in out, part


def test_sigmoid_prints_as_one_function_where_its_tanh_is_not_shared():
    """The ops write sigmoid as (1 + tanh(x/2)) / 2; the CPU printer folds each such sum into
    dg::math::sigmoid_f (an identity: checked numerically), unless the tanh is read elsewhere too,
    and serves sigmoid(v) and sigmoid(-v) with one evaluation; the sigmoid's derivative
    (1 - tanh(x/2)^2) / 4 reads s (1 - s), with 1 - s evaluated as sigmoid(-x) (no
    cancellation). CUDA prints the same calls."""
    import sympy

    from generator.codegen.cuda_printer import CudaPrinter
    from generator.codegen.printer import FloatPrinter, Product, Sigmoid

    x, c, n, h = sympy.symbols("x c n h", real=True)
    t = sympy.tanh(x / 2)
    z = (1 + t) / 2
    cases = {  # expression -> (sigmoid_f calls, tanh_f calls) in the CPU's printing
        z: (1, 0),
        c * z + (1 - t) * n: (1, 0),  # sigmoid(x) and sigmoid(-x): one call, 1 - it
        (1 - z) * n + z * h: (1, 0),  # a GRU's mix
        1 - sympy.tanh(2 * x): (1, 0),
        z + c: (1, 0),  # a sum of three terms (sympy flattens sigmoid(x) + c)
        sympy.Max(x, (1 + sympy.tanh(1)) / 2): (0, 1),  # a tanh of a number: left alone
        z + t**2: (0, 1),  # the tanh is read outside the sum: kept (one call, shared)
        (1 - t**2) / 4: (2, 0),  # the sigmoid's derivative: s * (1 - s), 1 - s as sigmoid(-x)
        z * c + (1 - t**2) / 4: (2, 0),  # a sigmoid and its derivative: s shared
        1 - sympy.tanh(x) ** 2: (0, 1),  # a tanh's derivative: 1 - t * t, one call
    }
    for expr, (sigmoids, tanhs) in cases.items():
        folded = FloatPrinter.fold(expr)
        temps, (body,) = sympy.cse([folded])  # as the kernels print it: shared calls once
        text = " ; ".join(FloatPrinter({}).doprint(e) for e in [*(v for _, v in temps), body])
        assert (text.count("sigmoid_f("), text.count("tanh_f(")) == (sigmoids, tanhs), (expr, text)
        cuda = CudaPrinter({}).doprint(CudaPrinter.fold(expr))
        assert cuda.count("dg::math::sigmoid_f(") == FloatPrinter({}).doprint(folded).count("sigmoid_f("), cuda
        plain = folded.replace(lambda e: isinstance(e, Product), lambda e: sympy.Mul(*e.args))
        plain = plain.replace(lambda e: isinstance(e, Sigmoid), lambda e: 1 / (1 + sympy.exp(-e.args[0])))
        for value in (-30.0, -3.5, -0.25, 0.0, 0.7, 12.0):
            at = {x: value, c: 1.5, n: -2.0, h: 0.75}
            assert abs(float(plain.evalf(subs=at)) - float(expr.evalf(subs=at))) < 1e-12, (expr, value)


def test_each_call_of_a_users_function_is_headed_by_its_evaluated_arguments(tmp_path):
    """Calls in a loop at one line are told apart (each its own banner), and the banner
    shows the values the call got (`name='block_1'`, not the unevaluated f-string)."""
    model = tmp_path / "blocks.py"
    model.write_text(
        "import generator as dg\n"
        "def block(x, scale, name):\n"
        "    w = dg.param(f'{name}_w', (3, 3))\n"
        "    return dg.tanh(x @ w) * scale\n"
        "@dg.model\n"
        "def blocks():\n"
        "    x = dg.input('x', (2, 3))\n"
        "    for i in range(3):\n"
        "        x = block(x, i + 1.5, f'block_{i}')\n"
        "    return {'y': x}\n"
    )
    text = project_files(load_model(str(model)).build())["src/model.cpp"].decode()
    banners = [line.strip() for line in text.splitlines() if line.strip().startswith("// ----")]
    assert banners == [f"// ---- blocks.py:9  block(x, scale={i + 1.5}, name='block_{i}')" for i in range(3)]


def _graph_objects(root) -> list:
    """Paths to the ir.graph Values and Nodes reachable from `root` through
    dataclass fields, lists, tuples, sets and dicts."""
    import dataclasses

    from generator.ir.graph import Node, Value

    found, seen, todo = [], set(), [(root, "plan")]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, int, float, bool, bytes)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (Value, Node)):
            found.append(path)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            todo += [(getattr(obj, f.name), f"{path}.{f.name}") for f in dataclasses.fields(obj)]
        elif isinstance(obj, dict):
            todo += [(v, f"{path}[{k!r}]") for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += [(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    return found


@pytest.mark.parametrize("example", ["mlp", "treelstm_sentiment", "lstm_classifier"])
def test_the_plan_holds_no_graph_values(example):
    """The ProjectPlan is plain data (#39.8): its lines name values by stmt.Data, a
    statement's call holds its arguments as Data; no Value or Node of the graph."""
    from generator.pipeline import _recorded, outline

    graph = load_model(str(ROOT / "examples" / f"{example}.py")).build()
    plan = outline(_recorded(graph, "O2", None, "cpu"), graph)  # what rendering receives
    found = _graph_objects(plan)
    assert not found, f"{len(found)} graph objects in the plan, e.g. {sorted(found)[:5]}"
