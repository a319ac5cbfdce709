"""User names never clash with the generated code's (#38 item 7).

A user name (input, output, parameter, dim, node, project) is any ASCII
identifier not starting with '_' that is not a C++ or Python keyword or a macro
of the headers the generated C++ includes. The generated code keeps its own
identifiers where no such name can reach (docs/ARCHITECTURE.md, "Names"), so the
test that holds it is a model whose names are every identifier the generated
code uses, compiled and run against the reference.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import numpy as np
import pytest

import generator as dg
from generator.errors import DeepgenError
from generator.ir.names import CPP_GLOBALS, KEYWORDS, MACROS, check_project_name, names_macro, problem_with

from conftest import CHECK_BUILD_FLAGS, ROOT, child_env
from platform_names import compiler_globals, compiler_macros, write_list

TINY = str(ROOT / "tests" / "models" / "tiny.py")

# Names the generated code used for itself before #38, and the ones the issue found
# refused or failing: each is a plain name again.
OLD_NAMES = """dg std kernels Model Inputs Outputs Dims Tensor View out seed dims self model result check i j
    k n i0 i1 i2 i3 i4 i5 i6 i7 int8_t int16_t int32_t int64_t uint8_t uint16_t uint32_t uint64_t size_t
    main m py np numpy inputs outputs parameters forward save load memory_stats train_step
    gradients expf logf log1pf expm1f fmaxf fminf fabsf tanhf sqrtf cbrtf powf sinf cosf erff erfcf step
    arena gradient_buffer parameter_version memory hyper keep_gradients state_lock optimizer_state_allocated
    Network net acc row col0 flat at g on_ready""".split()


def _cpp_identifiers(text: str) -> set[str]:
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r'"(\\.|[^"\\])*"', " ", text)
    text = re.sub(r"^\s*#\s*include[^\n]*", " ", text, flags=re.M)
    return set(re.findall(r"\b[A-Za-z_][A-Za-z0-9_]*\b", text))


def _py_identifiers(text: str) -> set[str]:
    return {t.string for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME}


@functools.lru_cache(maxsize=None)
def generated_identifiers() -> frozenset[str]:
    """Every identifier in the files deepgen generates for the tiny models (forward
    only, training, a recursion, dropout, the CUDA target), and the old and failing
    names above: the names a user must be able to use. (Generated once for both tests
    that read it.)"""
    from generator.frontend.loader import load_model
    from generator.pipeline import project_files

    names = set(OLD_NAMES)
    for model, target in [("tiny", "cpu"), ("tiny_train", "cpu"), ("tiny_tree", "cpu"), ("tiny_train", "cuda")]:
        files = project_files(load_model(f"{TINY}:{model}").build(model), target=target)
        names |= _identifiers(files)
    names |= _identifiers(project_files(dropout_mlp.build("dropout_mlp")))
    return frozenset(names)


def _identifiers(files) -> set[str]:
    names = set()
    for rel, data in files.items():
        rel = str(rel)
        if rel.startswith("runtime/"):  # the hand-written runtime: its names live in dg::, apart from the user's
            continue
        if rel.endswith((".cpp", ".h", ".cu")):
            names |= _cpp_identifiers(data.decode())
        elif rel.endswith((".py", ".pyi")):
            names |= _py_identifiers(data.decode())
    return names


N = dg.dim("N")


@dg.model
def dropout_mlp():
    x = dg.input("x", (N, 6))
    labels = dg.input("labels", (N,), dtype="int64")
    h = dg.dropout(dg.dense(x, 5, act=dg.relu), 0.25)
    logits = dg.dense(h, 3)
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.adam(lr=0.01))
    return {"logits": logits}


def user_names() -> list[str]:
    """The generated code's identifiers that the rules let a user take: all but
    keywords, macros and those beginning with '_'."""
    return sorted(n for n in generated_identifiers() if problem_with(n) is None)


def test_every_name_of_the_generated_code_is_a_user_name():
    """Only keywords, macros and '_' names are refused: the generated code has no list of its own."""
    names = generated_identifiers()
    for n in names:
        if problem_with(n) is not None:
            assert n.startswith("_") or n in KEYWORDS or names_macro(n), (n, problem_with(n))
    for n in OLD_NAMES:
        assert problem_with(n) is None, (n, problem_with(n))


def names_model(names: list[str], dim: str):
    """A trainable model whose inputs, parameters, node names and outputs are
    `names` (each one once among inputs, parameters and nodes, all as outputs), with
    one dim, products by parameters (kept packings, GEMM epilogues, updates fused into
    the GEMM) and dropout (the mode)."""
    inputs, params, nodes = names[0::3], names[1::3], names[2::3]
    B = dg.dim(dim)

    def every_name():
        xs = [dg.input(n, (B, 4)) for n in inputs]
        # Matrices for the products (the first few), vectors for the rest.
        square = params[: len(params) // 4]
        ps = {n: dg.param(n, (4, 4) if n in square else (4,), init=dg.normal(0, 0.5)) for n in params}
        vectors = [ps[n] for n in params if n not in square]
        values = []
        for k, n in enumerate(nodes):
            x = xs[k % len(xs)]
            if k < len(square):  # a product with a fused epilogue, then dropout
                y = dg.dropout(dg.tanh(dg.matmul(x, ps[square[k]]) + vectors[k % len(vectors)]), 0.125, name=n)
            else:
                y = dg.tanh(x * vectors[k % len(vectors)] + 0.5, name=n)
            values.append(y)
        total = values[0]
        for v in values[1:]:
            total = total + v
        dg.train(dg.mean(total * total), dg.adam(lr=0.01))
        return {n: values[k % len(values)] for k, n in enumerate(names)}

    return every_name


def test_user_names_compile_and_compute(builds):
    """A model named `m` whose names are every identifier the generated code uses
    (and the old reserved ones): it generates, compiles (module, library, example)
    and its own tests pass (forward and a train step against the reference)."""
    names = user_names()
    assert {"step", "arena", "check", "inputs", "outputs", "memory", "hyper", "Model", "Network", "std", "dg",
            "int64_t", "self", "on_ready", "m", "out", "forward", "parameters", "net"} <= set(names)
    # The dim is i0 (the kernels' loop index before #38), the rest each once among the
    # inputs, parameters and nodes, and all of them outputs.
    graph = dg.model(names_model([n for n in names if n != "i0"], "i0"), name="m").build()
    # -O0: a clash is a compile error or a wrong value, whatever GCC's optimization level.
    module, where = builds.module(graph, flags=CHECK_BUILD_FLAGS)
    tests = where / "src_tree" / "tests"
    env = child_env(PYTHONPATH=str(where / "build"))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=tests)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    example = subprocess.run([str(where / "build" / "m_example")], capture_output=True, text=True, timeout=120)
    assert example.returncode == 0 and "\nstep: shape [" in example.stdout, example.stdout + example.stderr
    model = module.Model(seed=1)
    inputs = {n: np.full((2, 4), 0.25, np.float32) for n in module.INPUTS}
    assert np.isfinite(model.train_step(**inputs)) and model.step == 1
    assert {"step", "arena", "inputs"} <= set(module.INPUTS) | set(model.parameters()) | set(module.OUTPUTS)


def test_the_stub_and_tests_of_such_a_model_are_valid_python():
    """Inputs called self and on_ready (the stub's own argument names) and a module
    called np (the generated test's numpy): the files still parse and mean the same."""
    from generator.pipeline import project_files

    @dg.model(name="np")
    def net():
        a = dg.input("self", (N, 2))
        b = dg.input("on_ready", (N, 2))
        c = dg.input("labels", (N,), dtype="int64")
        y = dg.dense(a + b, 3)
        dg.train(dg.softmax_cross_entropy(y, c), dg.sgd(lr=0.1))
        return {"Model": y}

    files = project_files(net.build())
    model = next(n for n in ast.parse(files["np.pyi"].decode()).body if getattr(n, "name", "") == "Model")
    methods = {f.name: f.args for f in model.body if isinstance(f, ast.FunctionDef)}
    forward, halves = methods["forward"], methods["compute_gradients"]
    assert [a.arg for a in forward.args] == ["_self"] and [a.arg for a in forward.kwonlyargs] == [
        "self", "on_ready", "labels"]
    assert [a.arg for a in halves.posonlyargs] == ["_self", "_on_ready"]
    assert [a.arg for a in halves.kwonlyargs] == ["self", "on_ready", "labels"]
    assert [a.arg for a in methods["parameters"].args] == ["self"]  # no input there: the usual name
    test = files["tests/test_model.py"].decode()
    ast.parse(test)
    assert "from np import Model" in test and "import numpy as np" in test


def test_project_names():
    """A project name is a namespace at global scope: names of the generated code
    are fine, global names of the C/C++ libraries and CMake's targets are not."""
    for name in ["m", "Model", "Inputs", "Outputs", "Network", "kernels", "run", "kUsage", "py", "out", "net"]:
        assert check_project_name(name) == name
    for name in ["exp", "read", "time", "printf", "int64_t", "main", "dg", "std", "pybind11", "test", "install",
                 "NULL", "float", "_x"]:
        with pytest.raises(ValueError, match="invalid project name"):
            check_project_name(name)
    with pytest.raises(DeepgenError, match="'exp'"):
        dg.model(lambda: dg.relu(dg.input("x", (N, 4))), name="exp").build()


@pytest.mark.parametrize("name,why", [("float", "keyword"), ("lambda", "keyword"), ("NULL", "macro"),
                                      ("errno", "macro"), ("INT64_MAX", "macro"), ("DG_HD", "DG_"),
                                      ("tiny_EXPORTS", "_EXPORTS"), ("_x", "identifier")])
def test_what_is_still_refused(name, why):
    assert why in problem_with(name)


def test_platform_lists_cover_this_compiler(tmp_path, update_golden):
    """generator/ir/cpp_macros.txt and cpp_globals.txt hold every macro and global
    name the compiler here declares in the generated C++'s headers (rewritten with
    --update-golden)."""
    macros, globals_ = compiler_macros(tmp_path), compiler_globals(tmp_path)
    folder = ROOT / "generator" / "ir"
    if update_golden:
        write_list(folder / "cpp_macros.txt", macros, "Macros the generated C++ sees (C/C++ libraries, Python's C API, "
                   "pybind11, OpenMP, the runtime); no user name may be one.")
        if globals_ is not None:
            write_list(folder / "cpp_globals.txt", globals_, "Global names of the generated C++ (C/C++ libraries, "
                       "Python's C API, pybind11, dg); no project name may be one.")
        pytest.skip("platform name lists rewritten")
    assert not macros - MACROS, sorted(macros - MACROS)[:50]
    if globals_ is None:
        pytest.skip("no Universal Ctags here to list the global names")
    assert not globals_ - CPP_GLOBALS, sorted(globals_ - CPP_GLOBALS)[:50]
