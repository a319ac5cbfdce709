"""Fuzzing the generated modules' Python bindings with hypothesis.

Random dtypes, ranks, sizes (zero, huge), layouts (slices, transposes, negative
strides, broadcasts, unaligned data), NaN/inf values, non-arrays, wrong keyword
names and random tree batches (ids out of range, self loops, cycles, shared
children, wrong arity, bad roots, words out of vocabulary) are thrown at
forward(), train_step() and trees_from_nested() of mlp, digits, bow, treelstm
and dagrnn. The only outcomes allowed:

- a correct result: the numpy reference (generator.reference.interpreter) run on the same
  inputs with the module's own parameters (and optimizer state) agrees;
- a ValueError or MemoryError, after which every parameter, optimizer slot,
  gradient, the step count and the hyperparameters are bit-identical to what
  they were before the call.

Anything else is a finding: another exception type (OverflowError, TypeError,
RuntimeError...), a crash, a hang, a result the reference does not give, a
changed model, a result for inputs the reference refuses, or a ValueError for
inputs the README's contract accepts (numpy arrays of the declared dtype,
C-contiguous and aligned, that the reference accepts).

Each example is fuzzed in a child process of its own (`python tests/fuzz_child.py
--child ...`) with a timeout, so a segfault or a hang is a failing test that
names the last call, not a dead pytest. Before every call the child writes the
call, as Python code, to a progress file; hypothesis adds the same code to a
failure's report (shrunk). A reproduction runs from the repository root:

    import sys; sys.path[:0] = ["tests", BUILD_DIR]
    from fuzz_arrays import *        # the value builders the code uses
    import mlp; m = mlp.Model(seed=3); m.forward(x=floats((2, 784), seed=1).astype("float16"))

Deterministic: derandomize=True, no example database. A child's address space
is bounded (fuzz_child.CHILD_MEMORY_BYTES), so a runaway allocation is a MemoryError, not
the OOM killer. `DEEPGEN_FUZZ_STATS=1 pytest -s tests/test_fuzz.py` prints how
often each outcome (ok, each kind of ValueError) came up.

One check is a requirement being landed: a train_step whose loss is not finite
must raise NonFiniteLossError (a ValueError subclass) and change nothing. It is
test_train_step_non_finite_loss_is_refused, and its failures say "PENDING
NonFiniteLossError"; it fails wherever train_step does not do that yet, and is
deliberately not marked xfail.

This file is the pytest side: it launches the children and asserts their verdicts.
The rest is in tests/: fuzz_child.py (the child: the Fuzzer and its hypothesis tests),
fuzz_inputs.py (inputs and their mutations), fuzz_oracle.py (the allowed outcomes) and
fuzz_arrays.py (the value builders).

The runtime's weights and input file reader (dg_npz.h, dg_inflate.h, dg_weights.h) is
fuzzed too, at the end of this file: numpy's .npy and .npz files, mutated (random
bytes, truncations, lying .npy headers and zip fields), go to tests/npz_fuzz_driver.cpp
built with AddressSanitizer and UndefinedBehaviorSanitizer; tests/fuzz_files.py holds
the files, the driver's client and the allowed outcomes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = Path(__file__).resolve().with_name("fuzz_child.py")  # the child process's script

EXAMPLES = ["mlp", "digits", "bow", "treelstm", "dagrnn"]
TRAINABLE = ["mlp", "digits"]
RECURSIVE = ["treelstm", "dagrnn"]
CHILD_TIMEOUT_S = 300  # one child fuzzes one example; past this it counts as a hang


# -- the parent: pytest runs one child per example and checks its verdicts --------


_RESULTS: dict = {}


def _targets(example):
    targets = ["forward", "equal_dtypes"]
    if example in TRAINABLE:
        targets += ["train_step", "non_finite"]
    if example in RECURSIVE:
        targets += ["trees", "nested"]
    return targets


def _fuzz(builds, example) -> dict:
    """{target: (ok, report, seconds)} for every target of `example`, from child
    processes (a new child takes over the targets a crashed or hung one left)."""
    if example in _RESULTS:
        return _RESULTS[example]
    from conftest import load_example

    graph = load_example(example).build()
    _, where = builds.module(graph)
    build_dir = str(where / "build")
    results, todo = {}, _targets(example)
    with tempfile.TemporaryDirectory() as tmp:
        while todo:
            out, progress = Path(tmp) / "results.json", Path(tmp) / "progress.txt"
            out.unlink(missing_ok=True)
            progress.unlink(missing_ok=True)
            cmd = [
                sys.executable,
                str(CHILD),
                "--child",
                example,
                build_dir,
                str(out),
                str(progress),
                *todo,
            ]
            path = [str(ROOT), str(CHILD.parent), os.environ.get("PYTHONPATH", "")]  # generator, tests/
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
            start = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env, cwd=ROOT
                )
                how, tail = f"exit status {proc.returncode}", (proc.stdout + proc.stderr)[-6000:]
                if os.environ.get("DEEPGEN_FUZZ_STATS"):  # the outcome counts the child printed
                    print(proc.stderr)
                if proc.returncode < 0:
                    how = f"killed by signal {signal.Signals(-proc.returncode).name} (a crash)"
            except subprocess.TimeoutExpired as e:
                how = f"no answer after {CHILD_TIMEOUT_S} s (a hang)"
                tail = (
                    (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
                )[-6000:]
            done = json.loads(out.read_text()) if out.exists() else {}
            for target, verdict in done.items():
                results[target] = tuple(verdict)
            todo = [t for t in todo if t not in results]
            if todo:  # the child died in the middle of todo[0]
                last = progress.read_text() if progress.exists() else "(no call recorded)"
                results[todo[0]] = (
                    False,
                    f"the child fuzzing {example} ({todo[0]}) died: {how}\n"
                    f"last call (build dir {build_dir}):\n{last}\n\nchild output:\n{tail}",
                    time.monotonic() - start,
                )
                todo = todo[1:]
    _RESULTS[example] = results
    return results


def _verdict(builds, example, target):
    ok, report, seconds = _fuzz(builds, example)[target]
    print(f"{example} {target}: {seconds:.1f} s")
    assert ok, report


@pytest.mark.parametrize("example", EXAMPLES)
def test_forward_survives_fuzzed_inputs(builds, example):
    """forward() with random dtypes, shapes, layouts, values, non-arrays and names."""
    _verdict(builds, example, "forward")


@pytest.mark.parametrize("example", TRAINABLE)
def test_train_step_survives_fuzzed_inputs(builds, example):
    """train_step() likewise (finite values), after 0-2 ordinary steps."""
    _verdict(builds, example, "train_step")


@pytest.mark.parametrize("example", RECURSIVE)
def test_forward_survives_fuzzed_tree_batches(builds, example):
    """forward() of a recursive model with random, mostly broken, tree batches."""
    _verdict(builds, example, "trees")


@pytest.mark.parametrize("example", RECURSIVE)
def test_trees_from_nested_survives_fuzzed_trees(builds, example):
    """The module's <trees>_from_nested() against generator.treebatch.from_nested."""
    _verdict(builds, example, "nested")


@pytest.mark.parametrize("example", EXAMPLES)
def test_equal_dtypes_with_distinct_descriptors_are_accepted(builds, example):
    """An array whose dtype equals the declared one is of the declared dtype, even when
    its descriptor is another object (a pickled array, dtype metadata, np.longlong)."""
    _verdict(builds, example, "equal_dtypes")


@pytest.mark.parametrize("example", TRAINABLE)
def test_train_step_non_finite_loss_is_refused(builds, example):
    """PENDING NonFiniteLossError: a train_step whose loss is NaN or inf (NaN/inf inputs,
    or a parameter set to inf) must raise NonFiniteLossError, a ValueError subclass, and
    change nothing. Fails until train_step does so; deliberately not xfail."""
    _verdict(builds, example, "non_finite")


# -- the .npy/.npz reader of the runtime, under ASan and UBSan --------------------------
#
# tests/npz_fuzz_driver.cpp puts dg::read_npy, dg::read_npz and dg::stage_weights (what
# load(), --weights and --input run) behind a line protocol; it is built with the
# sanitizers of tests/test_sanitizers.py and sent numpy's own files, mutated (see
# tests/fuzz_files.py). Allowed: the arrays numpy reads from the same file, or a
# std::invalid_argument / dg::FileError / dg::OutOfMemory naming the file. Anything
# else (another exception, a crash, a sanitizer report, an allocation over 64 MiB, a
# hang) is a finding; numpy's unmutated files must be read.

FILE_EXAMPLES = {"npy": 400, "npz": 300, "weights": 200}


@pytest.fixture(scope="module")
def npz_reader(tmp_path_factory):
    import shutil

    from conftest import _cache_root
    from fuzz_files import Reader, build_reader, compiler_and_flags

    cxx, flags = compiler_and_flags()
    if cxx is None or shutil.which(cxx) is None:
        pytest.skip("no g++ to build the reader with")
    reader = Reader(build_reader(_cache_root(), cxx, flags), tmp_path_factory.mktemp("npz_fuzz"))
    reader.instrumented = bool(flags)
    yield reader
    reader.close()


def _fuzz_files(reader, target, body):
    from datetime import timedelta

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from fuzz_files import Finding

    stats: dict = {}

    @settings(max_examples=FILE_EXAMPLES[target], derandomize=True, database=None, deadline=timedelta(seconds=30),
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(data=st.data())
    def fuzz(data):
        try:
            body(data.draw, st, stats)
        except Finding as e:
            e.__traceback__ = None
            raise

    fuzz.__name__ = fuzz.__qualname__ = f"fuzz_{target}_files"
    fuzz()
    if os.environ.get("DEEPGEN_FUZZ_STATS"):
        print(f"\n{target} ({'ASan+UBSan' if reader.instrumented else 'not instrumented'}):")
        for what, count in sorted(stats.items(), key=lambda kv: -kv[1]):
            print(f"  {count:5d}  {what}")


def test_npy_reader_survives_fuzzed_files(npz_reader):
    """dg::read_npy (the example program's --input) on .npy files: every numeric dtype,
    byte order, layout and format version, mutated (lying headers among others)."""
    from fuzz_files import arrays, check_npy, mutate, npy_image, npy_lie, write

    def body(draw, st, stats):
        a = draw(arrays(st), label="array")
        image = npy_image(a, draw(st.sampled_from([None, (1, 0), (2, 0), (3, 0)]), label="version"))
        data, expect = mutate(draw, st, image, npy_lie(st))
        check_npy(npz_reader, write(npz_reader.tmp, data, ".npy"), expect, stats)

    _fuzz_files(npz_reader, "npy", body)


def _named_arrays(draw, st, **kwargs):
    from fuzz_files import NAME_CHARS, arrays

    names = draw(st.lists(st.text(NAME_CHARS, min_size=1, max_size=6), min_size=1, max_size=3, unique=True),
                 label="names")
    names = [n for n in names if not n.endswith(".npy") and n != "."] or ["a"]
    return {n: draw(arrays(st, **kwargs), label=f"array {n}") for n in names}


def test_npz_reader_survives_fuzzed_archives(npz_reader):
    """dg::read_npz on archives as np.savez, np.savez_compressed and zipfile (stored,
    deflate levels 0, 1, 9, zip64) write them, mutated: bytes, truncations, lying zip
    fields, lying .npy headers inside members whose CRC is right."""
    from fuzz_files import WRITERS, check_npz, mutate, npy_lie, npz_archive, write, zip_lie

    def body(draw, st, stats):
        named = _named_arrays(draw, st)
        how = draw(st.sampled_from(WRITERS), label="writer")
        lying_member = draw(st.booleans(), label="a lying member")
        data, expect = npz_archive(draw, st, named, how, npy_lie(st) if lying_member else None)
        data, expect = mutate(draw, st, data, zip_lie(st), expect)
        check_npz(npz_reader, write(npz_reader.tmp, data, ".npz"), expect, stats)

    _fuzz_files(npz_reader, "npz", body)


def test_weights_loader_survives_fuzzed_archives(npz_reader):
    """dg::stage_weights (every module's load() and --weights) on archives of float
    arrays a model expects, mutated as above: it must load what numpy reads, or refuse
    with an error naming the file."""
    from fuzz_files import FLOATS, WRITERS, check_weights, mutate, npy_lie, npz_archive, write, zip_lie

    def body(draw, st, stats):
        named = _named_arrays(draw, st, dtypes=FLOATS, finite=True)
        expected = {n: a.shape for n, a in named.items()}
        how = draw(st.sampled_from(WRITERS), label="writer")
        lying_member = draw(st.booleans(), label="a lying member")
        data, expect = npz_archive(draw, st, named, how, npy_lie(st) if lying_member else None)
        data, expect = mutate(draw, st, data, zip_lie(st), expect)
        check_weights(npz_reader, write(npz_reader.tmp, data, ".npz"), expected, expect, stats)

    _fuzz_files(npz_reader, "weights", body)


# -- user names (#38 item 7) ------------------------------------------------------
#
# Random name lists: valid identifiers, and the generated code's own identifiers
# (tests/test_names.py: every one of them), as a model's inputs, parameters, nodes,
# outputs and dim. Each model is generated and its sources checked at the syntax
# level: the C++ translation units with `g++ -fsyntax-only` (model, kernels, bindings,
# the example program), the Python files parsed, and every name found as itself in
# the C++. Generating and compiling is slow, so few examples; tests/test_names.py
# compiles and runs one model whose names are all the generated code's identifiers.

NAME_EXAMPLES = 5


def _names_strategy(st):
    from generator.ir.names import problem_with
    from test_names import user_names

    plain = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,10}", fullmatch=True)
    name = st.one_of(st.sampled_from(user_names()), plain).filter(lambda n: problem_with(n) is None)
    return st.lists(name, min_size=7, max_size=13, unique=True)


def _small_names_model(names):
    """inputs, parameters, nodes and outputs named from `names` (the last one is the
    dim): a product by a parameter with an epilogue, elementwise nodes, training."""
    import generator as dg

    *names, dim = names
    inputs, params, nodes = names[0::3], names[1::3], names[2::3]  # two or more each
    D = dg.dim(dim)

    def model():
        xs = [dg.input(n, (D, 3)) for n in inputs]
        w = dg.param(params[0], (3, 3), init=dg.normal(0, 0.5))
        vs = [dg.param(n, (3,), init=dg.normal(0, 0.5)) for n in params[1:]]
        values = [dg.tanh(dg.matmul(xs[k % len(xs)], w) + vs[k % len(vs)], name=n) for k, n in enumerate(nodes)]
        total = values[0]
        for v in values[1:]:
            total = total * v
        dg.train(dg.mean(total * total), dg.sgd(lr=0.1, momentum=0.9))
        return {n: values[k % len(values)] for k, n in enumerate(names)}

    return model


def _syntax_check(files, where):
    import ast
    import sysconfig

    import pybind11

    from generator.codegen.writer import write_project

    write_project(where, files, force=True)
    for rel in files:
        if str(rel).endswith((".py", ".pyi")):
            ast.parse((where / rel).read_text(), filename=str(rel))
    includes = [where / "include", where / "src", where / "runtime", sysconfig.get_paths()["include"],
                pybind11.get_include()]
    from concurrent.futures import ThreadPoolExecutor

    def check(tu):
        return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", *(f"-I{i}" for i in includes),
                               str(where / tu)], capture_output=True, text=True)

    # The four translation units are checked two at a time (the CI machine's two cores:
    # pytest runs one test at a time, and one g++ leaves the other core idle).
    tus = ["src/model.cpp", "src/kernels.cpp", "src/bindings.cpp", "examples/main.cpp"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(check, tus))
    for tu, proc in zip(tus, procs):
        assert proc.returncode == 0, f"{tu}:\n{proc.stderr[-4000:]}"


def test_random_user_names_generate_valid_code(tmp_path):
    """Random name lists (plain identifiers and the generated code's own) as a
    trainable model's names: it builds, generates, parses and passes the C++
    compiler's syntax and type checks, and every name is itself in the C++."""
    import re
    import shutil
    from datetime import timedelta

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    import generator as dg
    from generator.pipeline import project_files

    if shutil.which("g++") is None:
        pytest.skip("no g++")
    sys.path.insert(0, str(ROOT / "tests"))
    seen = []

    # No shrinking: each example takes seconds; a failure is reported as drawn.
    @settings(max_examples=NAME_EXAMPLES, derandomize=True, database=None, deadline=timedelta(seconds=300),
              suppress_health_check=list(HealthCheck), print_blob=False, phases=[Phase.explicit, Phase.generate])
    @given(names=_names_strategy(st), project=st.sampled_from(["m", "Model", "net", "run", "names"]))
    def fuzz(names, project):
        graph = dg.model(_small_names_model(names), name=project).build()
        files = project_files(graph)
        header = files[f"include/{project}/model.h"].decode()
        for n in names[:-1]:  # each as a member of Inputs, Outputs or the Network
            assert re.search(rf"\b{n}\b", header), n
        where = tmp_path / f"case{len(seen)}"
        seen.append(names)
        _syntax_check(files, where)

    fuzz()
    assert len(seen) == NAME_EXAMPLES
