"""Shared fixtures: build generated projects once per test session (and reuse a
build across sessions when the generated sources are byte-identical)."""

from __future__ import annotations

import functools
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from generator.tools.build import cmake_build  # noqa: F401  (tests import it from here)

ROOT = Path(__file__).resolve().parents[1]
# The example model files (a script that only drives another example's model, such
# as digits_mpi.py, is not one: its model is checked under its own name).
EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py") if "@dg.model" in p.read_text())

# Golden copies of generated projects hold a test file of their own; it is not ours to run.
collect_ignore_glob = ["golden/*"]


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true", help="rewrite tests/golden from the current generator")


@pytest.fixture(scope="session")
def update_golden(request):
    return request.config.getoption("--update-golden")


def _cache_root() -> Path:
    root = os.environ.get("DEEPGEN_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "deepgen-tests")
    return Path(root)


# cmake_build: generator.tools.build.cmake_build (shared with the tests and the other benchmarks).

# The tests build the generated projects at -O2, not the Release default -O3: on the
# 2-core CI machine GCC 12 compiles the largest test project (test_grad's table of every
# op) in about half the time (68 s against 146 s, AMD EPYC, loaded), and most of the
# suite's time is compiling. Users' builds and the benchmarks keep -O3; the runtime's
# kernels are intrinsics either way, and GCC reorders no float arithmetic at either level.
# Both flag sets also compile the pybind11 bindings at -O0 without link-time
# optimization (tests/cmake/test_bindings.cmake, read by CMake after the project's
# project() call): in a small project they were the longest compile, and the module's
# LTO link compiled them again. The tests check values, not the bindings' speed.
TEST_CMAKE_INCLUDE = ROOT / "tests" / "cmake" / "test_bindings.cmake"
_TEST_INCLUDE = (f"-DCMAKE_PROJECT_INCLUDE={TEST_CMAKE_INCLUDE}",)
TEST_BUILD_FLAGS = ("-DCMAKE_CXX_FLAGS_RELEASE=-O2 -DNDEBUG", *_TEST_INCLUDE)
# For a build whose test checks only that the generated code compiles and computes the
# reference's values at tiny sizes (nothing timed, no optimizer-dependent claim):
# GCC at -O0 compiles test_names' 468-name model in about 40% of -O2's time.
CHECK_BUILD_FLAGS = ("-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG", *_TEST_INCLUDE)


def flags_key(flags) -> bytes:
    """What a build's cache key holds of its CMake settings `flags`: the settings, with
    the test include file's contents in place of its path (the key is the same in every
    checkout, and changes when the file does)."""
    path = str(TEST_CMAKE_INCLUDE)
    text = " ".join(flags)
    if path in text:
        text = text.replace(path, "<tests/cmake/test_bindings.cmake>") + "\0" + TEST_CMAKE_INCLUDE.read_text()
    return text.encode()


class Builds:
    """Generated + compiled projects, keyed by project name, for one session."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.built = {}

    def project(self, graph, files=None, flags=TEST_BUILD_FLAGS) -> Path:
        from generator.codegen.writer import write_project
        from generator.pipeline import project_files

        files = files or project_files(graph)
        digest = hashlib.sha256()
        for rel, data in files.items():
            digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        digest.update(sys.version.encode())
        digest.update(flags_key(flags))
        key = f"{graph.name}-{digest.hexdigest()[:16]}"
        cached = _cache_root() / key
        if (cached / "build" / ".ok").is_file():
            return cached
        project = self.tmp / key
        write_project(project / "src_tree", files, force=True)
        cmake_build(project / "src_tree", project / "build", extra_args=flags)
        (project / "build" / ".ok").write_text("ok\n")
        try:  # keep it for later sessions; a failure to cache is not a test failure
            cached.parent.mkdir(parents=True, exist_ok=True)
            if not cached.exists():
                shutil.copytree(project, cached, symlinks=True)
        except OSError:
            return project
        return cached

    def module(self, graph, opt: str = "O2", flags=TEST_BUILD_FLAGS):
        """The compiled Python module for `graph` at optimization level `opt`
        (imported once per session: give each level its own graph name), built
        with the CMake settings `flags`."""
        if graph.name in self.built:
            return self.built[graph.name]
        from generator.pipeline import project_files

        return self._import(graph, self.project(graph, project_files(graph, opt=opt), flags))

    def prebuild(self, graphs, opt: str = "O2", workers: int = 2, flags=TEST_BUILD_FLAGS) -> None:
        """Build the modules of `graphs` side by side, `workers` at a time, and import
        them (module() then returns them without rendering again). A build is mostly
        one long compile (model.cpp), which leaves the other core idle; so does
        rendering (Python), which is done here, in turn (it is not thread-safe),
        while the graphs rendered before it compile."""
        from concurrent.futures import ThreadPoolExecutor

        from generator.pipeline import project_files

        graphs = [g for g in graphs if g.name not in self.built]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            started = [pool.submit(self.project, g, project_files(g, opt=opt), flags) for g in graphs]
            places = [f.result() for f in started]
        for graph, where in zip(graphs, places):
            self._import(graph, where)

    def _import(self, graph, where: Path):
        sys.path.insert(0, str(where / "build"))
        try:
            module = importlib.import_module(graph.name)
        finally:
            sys.path.remove(str(where / "build"))
        self.built[graph.name] = (module, where)
        return self.built[graph.name]


@pytest.fixture(scope="session")
def builds(tmp_path_factory):
    return Builds(tmp_path_factory.mktemp("builds"))


def held_out_agreement(got, want, labels, precision: str) -> tuple:
    """(fp32 accuracy, `precision`'s accuracy, top-1 agreement) of probabilities `got`
    against fp32's `want` on the held-out `labels`, printed for the test's log."""
    import numpy as np

    agree = float(np.mean(got.argmax(1) == want.argmax(1)))
    fp32_accuracy = float(np.mean(want.argmax(1) == labels))
    accuracy = float(np.mean(got.argmax(1) == labels))
    print(f"digits, {len(labels)} held-out images: fp32 accuracy {fp32_accuracy:.4f}, {precision} {accuracy:.4f}, "
          f"top-1 agreement {agree:.4f}, largest probability difference {np.abs(got - want).max():.2e}")
    return fp32_accuracy, accuracy, agree


def child_env(**extra) -> dict:
    """The environment for a child process that runs a generated project's own tests:
    this one's, less PYTEST_ADDOPTS (options meant for this run, such as -q or
    --durations, would change the child's summary line the tests read), plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env.update(extra)
    return env


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset:
    """This CPU's feature flags (/proc/cpuinfo); empty where there is none (not Linux),
    which skips the builds and paths that need one."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def build_runtime_drivers(folder: Path, source: str, builds: dict) -> dict:
    """{name: executable} of tests/<source>.cpp compiled against the CPU runtime once per
    entry of `builds` ({name: extra g++ flags}), two at a time, warnings refused."""
    from concurrent.futures import ThreadPoolExecutor

    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("g++ not found")

    def build(name):
        exe = folder / f"{source}_{name}"
        cmd = [cxx, "-std=c++17", "-O2", "-fopenmp", "-Wall", "-Wextra", *builds[name], "-I",
               str(ROOT / "targets" / "cpu" / "runtime"), str(ROOT / "tests" / f"{source}.cpp"), "-o", str(exe)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0 and "warning" not in proc.stderr, proc.stderr
        return name, exe

    with ThreadPoolExecutor(2) as pool:
        return dict(pool.map(build, builds))


def load_example(name: str):
    from generator.frontend.loader import load_model

    return load_model(str(ROOT / "examples" / f"{name}.py"))


@pytest.fixture(scope="session")
def trained_digits():
    """examples/digits.py trained in fp32 by the reference's train_step (8 epochs, batches
    of 32, seed 0), once per session for the precision tests: (train set, held-out set,
    the fp32 graph, its trained parameters). Read it; do not change it."""
    pytest.importorskip("sklearn")
    import runpy

    from generator.reference import interpreter as reference

    example = runpy.run_path(str(ROOT / "examples" / "digits.py"))
    train_set, test_set = example["load_data"](0)
    fp32 = load_example("digits").build()
    return train_set, test_set, fp32, reference.train_epochs(fp32, train_set, epochs=8, batch=32, seed=0)


# The checks every example goes through (API, memory, passes, sanitizers, the CUDA
# emulation) build the CNN examples smaller, with the same structure: at their real
# sizes the emulated CUDA train steps alone would take longer than the whole suite.
# tests/test_cnn.py compares the real sizes against PyTorch. BERT's encoder layers
# are generated one after another, so its code (and its compile times: CPU, ASan,
# emulated and nvcc) grows with the depth: one layer here, the same code as each of
# two; tests/test_attention.py builds the two-layer default and compares it (forward,
# gradients, Adam) against PyTorch.
SMALL = {"resnet18": {"image": 16, "width": 8}, "vgg11": {"width": 8}, "bert_encoder": {"layers": 1}}


def build_example(name: str, graph_name: str | None = None):
    """The example's Graph as the generic checks use it (SMALL options applied: the
    graph is then `<name>_small` unless `graph_name` says otherwise)."""
    options = SMALL.get(name, {})
    default = f"{name}_small" if options else None
    return load_example(name).build(graph_name or default, **options)
