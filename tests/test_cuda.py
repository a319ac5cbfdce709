"""The CUDA target (`deepgen generate --target cuda`), in three kinds of check:

- compile: every example, the op table and the gradient table generated for
  CUDA and compiled by nvcc for one architecture (sm_90): src/model.cu and
  src/kernels.cu of each (many models to a translation unit: two nvcc runs in
  all), and the whole project through its CMakeLists (C++ library, example
  program, Python module) for two examples. Skipped where nvcc is absent.
- emulated: the same generated projects built with the C++ compiler and
  DG_CUDA_EMULATE, where every kernel body (the generated per-element lambdas,
  the runtime's ops, the GEMM's tile phases) runs as a host loop, checked
  against the numpy reference as the CPU target is: outputs at several sizes,
  exact initial parameters, writable parameter views, save/load, bad inputs and
  bad ids, train_step and gradients, the arena's measured peak, the project's
  own tests. Also the runtime's ops on their own (tests/cuda_runtime_driver.cpp).
- gpu: the real CUDA builds through the same checks. Only where a GPU is
  present: DEEPGEN_GPU=1, or `nvidia-smi -L` lists one (DEEPGEN_GPU=0 turns
  them off); DEEPGEN_CUDA_ARCHS picks the architectures (default: native).

Builds are cached like the CPU target's (tests/conftest.py), keyed by a hash of
the generated sources and the build mode.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import importlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, _cache_root, build_example, child_env
from module_checks import (
    check_bad_inputs,
    check_forward,
    check_hyperparameters_are_validated,
    check_init,
    check_load_validates_everything_first,
    check_non_finite_loss_changes_nothing,
    check_parameter_views,
    check_save_load,
    check_threads_share_a_model,
    dims_at,
)
from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs

from conftest import EXAMPLES  # noqa: E402  (the example model files)
TABLES = ["optable", "gradtable"]
FULL_BUILDS = ["mlp", "treelstm"]  # compiled through CMake with nvcc, module included
RUNTIME = ROOT / "targets" / "cuda" / "runtime"
CPU_RUNTIME = ROOT / "targets" / "cpu" / "runtime"
COMPILE_ARCH = "90"  # H100 / H200


def _nvcc():
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").is_file():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def _gpu_present() -> bool:
    flag = os.environ.get("DEEPGEN_GPU")
    if flag is not None:
        return flag.strip() not in ("", "0")
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        proc = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and "GPU" in proc.stdout


NVCC = _nvcc()
GPU = _gpu_present()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not found (the CUDA toolkit is not installed)")
needs_gpu = pytest.mark.skipif(
    not GPU or NVCC is None, reason="no GPU here (set DEEPGEN_GPU=1 on a machine with one and nvcc)"
)
MODES = [pytest.param("emulated", id="emulated"), pytest.param("gpu", id="gpu", marks=needs_gpu)]


# -- the models ----------------------------------------------------------------


SUFFIX = {"emulated": "emu", "gpu": "gpu", "compile": "cuda"}


@functools.lru_cache(maxsize=None)
def _graph(name, mode="compile"):
    """The model `name` (an example, or one of TABLES) for a build mode, lowered
    once per session. Its module is `<name>_<emu|gpu|cuda>`: pybind11 refuses a
    second `mlp::Model` in one process, and the CPU target's tests import theirs."""
    module = f"{name}_{SUFFIX[mode]}"
    if name == "optable":
        from op_cases import CASES, case_model

        return case_model(CASES).build(module)
    if name == "gradtable":
        from test_grad import _grad_table

        return _grad_table().build(module)
    return build_example(name, module)


@functools.lru_cache(maxsize=None)
def _files(name, mode="compile") -> dict:
    from generator.pipeline import project_files

    return project_files(_graph(name, mode), "cuda")


def _digest(files: dict, *extra) -> str:
    h = hashlib.sha256()
    for rel, data in files.items():
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    for e in extra:
        h.update(str(e).encode() + b"\0")
    return h.hexdigest()[:16]


def _cmake(project: Path, build: Path, defines: dict) -> None:
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = ["cmake", "-S", str(project), "-B", str(build), *gen, f"-DPython_EXECUTABLE={sys.executable}"]
    configure += [f"-D{k}={v}" for k, v in defines.items()]
    for cmd in (configure, ["cmake", "--build", str(build), "--parallel", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")


def _defines(name: str, mode: str) -> dict:
    upper = _graph(name, mode).name.upper()
    if mode == "emulated":  # -O1: these builds are for checking, and compile faster
        return {"DG_CUDA_EMULATE": "ON", "CMAKE_BUILD_TYPE": "Debug", "CMAKE_CXX_FLAGS_DEBUG": "-O1",
                f"{upper}_EXAMPLE": "OFF"}
    archs = os.environ.get("DEEPGEN_CUDA_ARCHS") or ("native" if mode == "gpu" else COMPILE_ARCH)
    return {"CMAKE_BUILD_TYPE": "Release", "CMAKE_CUDA_ARCHITECTURES": archs, "CMAKE_CUDA_COMPILER": NVCC}


def build_project(name: str, mode: str) -> Path:
    """The project for `name` generated for CUDA and built in `mode` ("emulated",
    "gpu", or "compile": the real build for COMPILE_ARCH); cached by source hash."""
    files = _files(name, mode)
    key = f"cuda-{mode}-{_graph(name, mode).name}-{_digest(files, mode, sys.version, _defines(name, mode))}"
    cached = _cache_root() / key
    if (cached / "build" / ".ok").is_file():
        return cached
    from generator.codegen.writer import write_project

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"deepgen-{os.getpid()}" / key
    if work.exists():
        shutil.rmtree(work)
    write_project(work / "src_tree", files, force=True)
    _cmake(work / "src_tree", work / "build", _defines(name, mode))
    (work / "build" / ".ok").write_text("ok\n")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        if not cached.exists():
            shutil.copytree(work, cached, symlinks=True)
        return cached
    except OSError:
        return work


def prebuild(mode: str, names=None, workers=None) -> dict:
    """Build every model for `mode` at once, `workers` builds at a time (default:
    half the cores, each build using two); returns {name: error or None}."""
    names = list(names or EXAMPLES + TABLES)
    for n in names:  # render here: sympy and the graph caches are not thread-safe
        _files(n, mode)
    workers = workers or max(1, (os.cpu_count() or 2) // 2)

    def one(n):
        try:
            build_project(n, mode)
            return None
        except AssertionError as e:
            return str(e)

    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        return dict(zip(names, pool.map(one, names)))


_MODULES = {}
_PREBUILT = set()


def load_module(name: str, mode: str):
    if mode not in _PREBUILT and mode in ("emulated", "gpu"):  # every model is run in these modes
        _PREBUILT.add(mode)
        if (os.cpu_count() or 2) > 2:  # builds side by side where there are cores for it
            prebuild(mode)
    if (name, mode) not in _MODULES:
        where = build_project(name, mode)
        sys.path.insert(0, str(where / "build"))
        try:
            module = importlib.import_module(_graph(name, mode).name)
        finally:
            sys.path.remove(str(where / "build"))
        _MODULES[name, mode] = (module, where)
    return _MODULES[name, mode]


# -- generation ----------------------------------------------------------------


def test_cuda_target_is_accepted_by_the_cli(tmp_path):
    from generator.tools.cli import main

    assert main(["generate", str(ROOT / "tests" / "models" / "tiny.py") + ":tiny", "-o", str(tmp_path / "t"),
                 "--target", "cuda"]) == 0
    names = {str(p.relative_to(tmp_path / "t")) for p in (tmp_path / "t").rglob("*") if p.is_file()}
    assert {"src/model.cu", "src/kernels.cu", "src/kernels.h", "CMakeLists.txt", "runtime/dg_cuda.h"} <= names
    assert "src/model.cpp" not in names and "runtime/dg_matmul.h" not in names


def test_generated_cuda_code_uses_device_buffers_and_launches():
    files = _files("mlp", "emulated")
    model = files["src/model.cu"].decode()
    kernels = files["src/kernels.cu"].decode()
    cmake = files["CMakeLists.txt"].decode()
    # device buffers only: no host vectors or copies in the lowered statements
    assert "std::vector<float>" not in model and "std::vector<int" not in model and "std::copy(" not in model
    assert "dg::DeviceInputs _on_device;" in model and "dg::to_host<float>(" in model
    assert "_call.finish();" in model
    assert "dg::for_each(" in kernels and "[=] DG_HD(std::int64_t _flat)" in kernels
    assert "_update(float* w, const float* g" in kernels  # the optimizer step
    assert "LANGUAGES CXX CUDA" in cmake and '"80-real;90"' in cmake and "--extended-lambda" in cmake
    header = files["src/kernels.h"].decode()
    assert "struct " not in header or "DG_HD void operator()" in header  # GEMM epilogues run on the device


def test_cuda_output_is_deterministic():
    from generator.pipeline import project_files
    from generator.frontend.loader import load_model

    tiny = str(ROOT / "tests" / "models" / "tiny.py") + ":tiny"
    assert project_files(load_model(tiny).build(), "cuda") == project_files(load_model(tiny).build(), "cuda")


def test_cuda_printer_prints_only_c99_float_math():
    import sympy

    from generator.codegen.cuda_printer import CudaPrinter
    from generator.ops.scalar import ARGS, SCALAR_FUNCS, scalar_expr

    x, y = ARGS[:2]
    for fn, (arity, _) in SCALAR_FUNCS.items():
        text = CudaPrinter({x: "a[i]", y: "b[i]"}).doprint(scalar_expr(fn, *ARGS[:arity]))
        # dg::math::max_f/min_f are DG_HD (dg_cuda_compat.h): they keep NaN, as fmaxf does not
        assert "std::" not in text and "dg::" not in text.replace("dg::math::max_f", "").replace(
            "dg::math::min_f", ""), (fn, text)
    assert CudaPrinter({x: "a[i]"}).doprint(sympy.exp(x) + sympy.tanh(x)) == "::expf(a[i]) + ::tanhf(a[i])"
    assert CudaPrinter({x: "a[i]"}).doprint(sympy.Max(0, x)) == "dg::math::max_f(0.0F, a[i])"


# -- compile with nvcc -----------------------------------------------------------


NVCC_FLAGS = ["-std=c++17", "-O0", "--extended-lambda", f"-arch=sm_{COMPILE_ARCH}"]


def _nvcc_key(name: str) -> str:
    files = _files(name, "emulated")
    return f"cuda-nvcc-{_graph(name, 'emulated').name}-{_digest(files, COMPILE_ARCH, NVCC, 'one-tu')}"


def _nvcc_sources(name: str) -> Path:
    """The emulated build's sources of `name` (the same code under the module name
    *_emu) written to a folder of their own."""
    from generator.codegen.writer import write_project

    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"deepgen-{os.getpid()}" / _nvcc_key(name)
    write_project(work, _files(name, "emulated"), force=True)
    return work


def _nvcc(tu: Path, includes: list) -> tuple:
    """(ok, log) of compiling the translation unit `tu` with nvcc. -O0 for the host
    side only: the device code goes through ptxas's optimizer as in a release build."""
    cmd = [NVCC, *NVCC_FLAGS, *(f"-I{i}" for i in includes), "-c", tu.name, "-o", tu.with_suffix(".o").name]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tu.parent)
    if proc.returncode != 0:
        return False, f"{' '.join(cmd)} (in {tu.parent}):\n{proc.stdout[-6000:]}{proc.stderr[-6000:]}"
    return True, ""


def _mark_compiled(name: str) -> None:
    try:
        cached = _cache_root() / _nvcc_key(name)
        cached.mkdir(parents=True, exist_ok=True)
        (cached / ".ok").write_text("ok\n")
    except OSError:
        pass


def _nvcc_compile(name: str) -> tuple:
    """(ok, log) of compiling src/model.cu and src/kernels.cu of `name` with nvcc, in
    one run (each run has seconds of fixed cost; the emulated build compiles
    kernels.cu on its own); cached."""
    if (_cache_root() / _nvcc_key(name) / ".ok").is_file():
        return True, ""
    work = _nvcc_sources(name)
    (work / "both.cu").write_text('#include "src/model.cu"\n#include "src/kernels.cu"\n')
    ok, log = _nvcc(work / "both.cu", ["include", "runtime", "src"])
    if ok:
        _mark_compiled(name)
    return ok, log


def _self_contained(files: dict) -> bool:
    """Whether every quoted #include of src/model.cu and src/kernels.cu, and of the
    files they include in turn (under any #if: a superset), is a file of the project
    itself, where nvcc's -I include -I runtime -I src and the including file's own
    folder would find it."""
    import re

    seen, todo = set(), ["src/model.cu", "src/kernels.cu"]
    while todo:
        rel = todo.pop()
        if rel in seen:
            continue
        seen.add(rel)
        for name in re.findall(rb'^\s*#\s*include\s*"([^"]+)"', files[rel], re.M):
            name = name.decode()
            here = str(Path(rel).parent / name)
            found = [c for c in (here, f"include/{name}", f"runtime/{name}", f"src/{name}") if c in files]
            if not found:
                return False
            todo.append(found[0])
    return True


def _nvcc_compile_group(names: list) -> dict:
    """{name: (ok, log)} for the models `names`, those not cached compiled in one
    nvcc run: most of a run's time is fixed (the runtime headers, host and device),
    and every model lives in a namespace of its own, so one translation unit holds
    them all. They include one copy of the runtime (the union of the headers each
    project ships: a model whose runtime/ has a header of the same name that differs,
    or whose sources include a header its own project lacks, is compiled on its own)
    and each its own include/ folder; its src/kernels.h is found beside the file
    including it. (Before the union, every model shipped a different subset of the
    headers, so none were grouped: 16 nvcc runs of 5-45 s; the fixture took 304 s
    cold on the 2-core AMD EPYC CI machine, loaded, 194 s with the two groups, 90 s
    of both rendering the models.) Where that run fails, each model is compiled on
    its own, as _nvcc_compile does, so that the failure is reported against the
    models that have it."""
    todo = [n for n in names if not (_cache_root() / _nvcc_key(n) / ".ok").is_file()]
    results = {n: (True, "") for n in names if n not in todo}

    def runtime(n):
        return {k: v for k, v in _files(n, "emulated").items() if k.startswith("runtime/")}

    # A project ships only the runtime headers its model uses: the group's runtime is
    # their union, which every model's own headers must agree with, name by name.
    # A model whose own project lacks a header it includes (which the union could
    # hide) is compiled on its own, against its own runtime.
    shared = {}
    for n in list(todo):
        if any(shared.get(k, v) != v for k, v in runtime(n).items()) or not _self_contained(_files(n, "emulated")):
            todo.remove(n)
            results[n] = _nvcc_compile(n)
        else:
            shared.update(runtime(n))
    if len(todo) < 2:
        return {**results, **{n: _nvcc_compile(n) for n in todo}}
    folders = [_nvcc_sources(n) for n in todo]
    group = folders[0].parent / f"nvcc-group-{_digest({}, *(f.name for f in folders))}"
    group.mkdir(parents=True, exist_ok=True)
    for rel, data in shared.items():
        (group / rel).parent.mkdir(parents=True, exist_ok=True)
        (group / rel).write_bytes(data)
    (group / "group.cu").write_text("".join(f'#include "{f}/src/model.cu"\n#include "{f}/src/kernels.cu"\n'
                                            for f in folders))
    ok, _ = _nvcc(group / "group.cu", [group / "runtime", *(f / "include" for f in folders)])
    for n in todo:
        if ok:
            _mark_compiled(n)
        results[n] = (True, "") if ok else _nvcc_compile(n)
    return results


def _balanced(names: list, groups: int) -> list:
    """`names` split into `groups` lists of about the same amount of source."""
    size = {n: len(_files(n, "emulated")["src/model.cu"]) + len(_files(n, "emulated")["src/kernels.cu"])
            for n in names}
    out = [[] for _ in range(groups)]
    for n in sorted(names, key=size.get, reverse=True):
        min(out, key=lambda g: sum(size[m] for m in g)).append(n)
    return [g for g in out if g]


@pytest.fixture(scope="module")
def nvcc_results():
    """Every model compiled by nvcc: in two groups at a time, one nvcc run each."""
    names = [n for n in EXAMPLES + TABLES if n not in FULL_BUILDS]
    for n in names:  # render in this thread (sympy and the graph caches are not thread-safe)
        _files(n, "emulated")
    workers = max(2, (os.cpu_count() or 2) // 2)
    results = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for part in pool.map(_nvcc_compile_group, _balanced(names, workers)):
            results.update(part)
    return results


@needs_nvcc
@pytest.mark.parametrize("name", [n for n in EXAMPLES + TABLES if n not in FULL_BUILDS])
def test_compiles_with_nvcc(nvcc_results, name):
    ok, log = nvcc_results[name]
    assert ok, log


@needs_nvcc
@pytest.mark.parametrize("name", FULL_BUILDS)
def test_whole_project_builds_with_nvcc(name):
    where = build_project(name, "compile")
    built = list((where / "build").glob(f"{_graph(name).name}*.so"))
    assert built, "the Python module was not built"
    assert (where / "build" / f"{_graph(name).name}_example").is_file()


@needs_nvcc
def test_cuda_errors_become_runtime_errors_naming_the_call():
    """On a machine without a GPU the real build's first CUDA call fails: the
    module raises RuntimeError with the call, file:line and CUDA's message."""
    if GPU:
        pytest.skip("a GPU is present: CUDA calls succeed")
    module, _ = load_module("mlp", "compile")
    assert module.build_info()["emulated"] is False
    with pytest.raises(RuntimeError, match=r"CUDA error in cuda\w+\(.*\) at .*dg_cuda\.h:\d+: cudaError\w+: "):
        module.Model(seed=0)


# -- the runtime's ops on their own ---------------------------------------------


def _runtime_driver(mode: str) -> Path:
    src = ROOT / "tests" / "cuda_runtime_driver.cpp"
    headers = sorted(RUNTIME.glob("*.h")) + sorted(CPU_RUNTIME.glob("*.h"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in [src] + headers)).hexdigest()[:16]
    exe = _cache_root() / f"cuda-driver-{mode}-{digest}"
    if exe.is_file():
        return exe
    exe.parent.mkdir(parents=True, exist_ok=True)
    includes = ["-I", str(RUNTIME), "-I", str(CPU_RUNTIME)]
    if mode == "emulated":
        cmd = [os.environ.get("CXX", "g++"), "-std=c++17", "-O1", "-DDG_CUDA_EMULATE", *includes, "-x", "c++",
               str(src), "-o", str(exe)]
    else:
        arch = os.environ.get("DEEPGEN_CUDA_ARCHS", "native").split(";")[0].replace("-real", "")
        arch_flag = "-arch=native" if arch == "native" else f"-arch=sm_{arch}"
        cmd = [NVCC, "-std=c++17", "-O2", "--extended-lambda", arch_flag, *includes, "-x", "cu", str(src), "-o",
               str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return exe


@pytest.mark.parametrize("mode", MODES)
def test_runtime_ops_match_host_loops(mode):
    proc = subprocess.run([str(_runtime_driver(mode))], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr


# -- run: emulated on the CPU, or on a GPU ---------------------------------------


@pytest.fixture(scope="module", params=[pytest.param((m.values[0], n), id=f"{m.id}-{n}", marks=m.marks)
                                        for m in MODES for n in EXAMPLES])
def example(request):
    mode, name = request.param
    module, where = load_module(name, mode)
    return _graph(name, mode), module, where


@pytest.mark.parametrize("size", [1, 2, 7])
def test_forward_matches_reference(example, size):
    check_forward(*example[:2], size)


def test_parameters_match_reference_init_exactly(example):
    check_init(*example[:2])


def test_parameter_views_reach_the_device(example):
    check_parameter_views(*example[:2])


def test_save_load_roundtrip(example, tmp_path):
    check_save_load(*example[:2], tmp_path)


def test_bad_inputs_are_value_errors(example):
    check_bad_inputs(*example[:2])


def test_load_validates_everything_before_changing_anything(example, tmp_path):
    check_load_validates_everything_first(*example[:2], tmp_path)


def test_trainable_module_guards_its_state(example):
    graph, module, _ = example
    if graph.train is None:
        pytest.skip("not trainable")
    check_hyperparameters_are_validated(module)
    check_non_finite_loss_changes_nothing(graph, module)
    check_threads_share_a_model(graph, module, threads=2, steps=20)


def test_bad_ids_found_on_the_device_are_value_errors(example):
    """Ids are checked where the gather runs (on the GPU); the error names the
    first bad position, as on the CPU, and the model still works afterwards."""
    graph, module, _ = example
    lookups = [n for n in _all_nodes(graph) if n.op == "gather" and n.inputs[0].kind == "param"]
    direct = [n for n in lookups if any(n.inputs[1] is v for v in graph.inputs)]
    words = [v for v in graph.inputs if v.name.endswith("_words")]  # a recursive cell's ids
    if not direct and not (words and lookups):
        pytest.skip("no lookup in a parameter table by an input")
    good = sample_inputs(graph)
    bad = dict(good)
    ids = direct[0].inputs[1] if direct else words[0]
    rows = (direct or lookups)[0].inputs[0].shape[0]
    bad[ids.name] = good[ids.name].copy()
    at = -1
    if not direct:  # a leaf's word: the leaf cell reads it
        children = good[ids.name.removesuffix("_words") + "_children"]
        at = int(np.flatnonzero((children == -1).all(axis=1))[0])
    bad[ids.name].reshape(-1)[at] = rows + 3
    model = module.Model(seed=0)
    with pytest.raises(ValueError, match=rf"index {rows + 3} at position \d+ is out of range \[0, {rows}\)"):
        model.forward(**bad)
    want = reference.run(graph, good, seed=0)
    for k, v in model.forward(**good).items():
        np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-5)


def _all_nodes(graph):
    for node in graph.nodes:
        yield node
        spec = node.attrs.get("spec")
        if node.op == "recurse":
            yield from spec.leaf.nodes
            yield from spec.internal.nodes


def test_memory_stats_match_the_plan(example):
    graph, module, _ = example
    model = module.Model()
    model.forward(**sample_inputs(graph))
    stats = model.memory_stats()
    assert stats["calls"] == 1
    assert stats["peak_bytes"] == stats["predicted_peak_bytes"]


def test_training_state_is_allocated_when_training_starts(example):
    """Gradients and optimizer state take no memory until the first training call,
    then exactly one copy of each (the CUDA target as the CPU one); none of the
    gradients with keep_gradients off."""
    graph, module, _ = example
    if graph.train is None:
        pytest.skip("not trainable")
    model = module.Model(seed=1)
    model.forward(**sample_inputs(graph))
    assert model.memory_stats()["training_state_bytes"] == 0
    floats = sum(int(np.prod(p.shape)) for p in graph.params if p.kind == "param")
    slots = len(graph.train.optimizer.slots)
    model.train_step(**sample_inputs(graph))
    assert model.memory_stats()["training_state_bytes"] == 4 * floats * (1 + slots)
    fresh = module.Model(seed=1)
    assert all(not np.asarray(v).any() for v in fresh.optimizer_state().values())  # allocates: zeros
    assert fresh.memory_stats()["training_state_bytes"] == 4 * floats * slots  # the optimizer state only
    assert all(not np.asarray(v).any() for v in fresh.gradients().values())
    assert fresh.memory_stats()["training_state_bytes"] == 4 * floats * (1 + slots)
    # keep_gradients off: each gradient in the arena until its update; the same step
    freed = module.Model(seed=1)
    freed.keep_gradients = False
    again = module.Model(seed=1)
    batch = sample_inputs(graph, seed=3)
    assert freed.train_step(**batch) == again.train_step(**batch)
    assert freed.memory_stats()["training_state_bytes"] == 4 * floats * slots
    for name, value in again.parameters().items():
        np.testing.assert_array_equal(freed.parameters()[name], value, err_msg=name)


def test_generated_project_tests_pass(example):
    graph, _, where = example
    env = child_env(PYTHONPATH=str(where / "build"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(where / "src_tree" / "tests")], capture_output=True, text=True, env=env, cwd=where)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("3 passed" if graph.train else "2 passed") in proc.stdout


def test_train_steps_match_reference(example):
    """Three train_steps (optimizer state carried over, a learning-rate change),
    then the gradients of the last step and the state, against the reference."""
    graph, module, _ = example
    if graph.train is None:
        pytest.skip("not trainable")
    batches = [sample_inputs(graph, dims_at(graph, 3 + i), seed=i) for i in range(3)]
    model = module.Model(seed=1)
    params = reference.init_params(graph, seed=1)
    state, hyper = {}, dict(graph.train.hyper)
    for i, batch in enumerate(batches):
        if i == 2:
            model.lr = model.lr * 0.5
            hyper["lr"] = float(np.float32(hyper["lr"]) * np.float32(0.5))
        # the last step's gradients are checked at the module's own parameters: Adam may have
        # moved an element whose gradient is rounding noise differently (see below), and
        # elsewhere a gradient can depend on it (attention's key bias, early_exit's)
        before = {k: np.array(v) for k, v in model.parameters().items()}
        if graph.states:  # batch norm's running statistics
            before.update({k: np.array(v) for k, v in model.buffers().items()})
        want = reference.train_step(graph, batch, params, state, step=i + 1, hyper=hyper)
        np.testing.assert_allclose(model.train_step(**batch), want, rtol=1e-5, atol=1e-6)
    _, grads = reference.gradients(graph, batches[-1], before)
    for name, value in model.gradients().items():
        # float32 sums in another order: through batch norms a few elements of a small
        # gradient move by up to 3e-5 of the largest (the CNN examples)
        atol = max(1e-6, 1e-4 * float(np.abs(grads[name]).max()))
        np.testing.assert_allclose(value, grads[name], rtol=1e-4, atol=atol, err_msg=name)
    # Adam moves an element whose gradient is rounding noise (|g| near eps: a sum that
    # cancels, 1e-9 against terms of 1e-4) by up to lr per step, in a direction the
    # noise picks: a few elements in 10,000 (in a smaller tensor, two) may differ by up to the
    # learning rates summed, and so may every element whose gradient is only noise (attention's
    # key bias: softmax ignores a shift of every key's score, so its gradient is 0 but for rounding).
    lr_total = sum(float(np.float32(dict(graph.train.hyper)["lr"])) * f for f in (1, 1, 0.5)) \
        if graph.train.optimizer.kind == "adam" else 0.0
    for name, value in model.parameters().items():
        diff = np.abs(np.asarray(value) - params[name])
        loose = diff > 1e-5 + 1e-4 * np.abs(params[name])
        noise = np.abs(grads[name]) <= 1e-6 * np.abs(grads[name]).max()
        assert (loose & ~noise).sum() <= max(2, 1e-4 * loose.size) and (diff[loose] <= lr_total).all(), (
            f"{name}: {int(loose.sum())} of {loose.size} elements differ, by up to {diff.max():.3g}")
    for key, value in model.optimizer_state().items():
        np.testing.assert_allclose(value, state[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert model.step == 3


def test_views_follow_training(example):
    """A parameter view held across train_step shows the new values."""
    graph, module, _ = example
    if graph.train is None:
        pytest.skip("not trainable")
    model = module.Model(seed=1)
    view = model.parameters()[graph.params[0].name]
    before = view.copy()
    model.train_step(**sample_inputs(graph))
    assert not np.array_equal(view, before)
    np.testing.assert_array_equal(view, model.parameters()[graph.params[0].name])


# -- the op table and the gradient table ------------------------------------------


def _table_inputs(graph, sizes=None):
    """Inputs `<case>_<name>` of the op table (every case) or of the gradient table (ids only)."""
    from op_cases import CASES, DIMS, case_inputs

    names = {v.name for v in graph.inputs}
    inputs = {}
    for case in CASES:
        for k, value in case_inputs(case, sizes or DIMS).items():
            if f"{case.name}_{k}" in names:
                inputs[f"{case.name}_{k}"] = value
    return inputs


@pytest.mark.parametrize("mode", MODES)
def test_every_op_matches_reference(mode):
    from op_cases import CASES, N, T

    graph = _graph("optable", mode)
    module, _ = load_module("optable", mode)
    for sizes in (None, {N: 1, T: 1}, {N: 5, T: 2}):
        inputs = _table_inputs(graph, sizes)
        want = reference.run(graph, inputs)
        got = module.Model(seed=0).forward(**inputs)
        for case in CASES:
            np.testing.assert_allclose(got[case.name], want[case.name], rtol=max(case.tol, 1e-5),
                                       atol=max(case.tol, 1e-5), err_msg=f"{case.name} at {sizes}")
    inputs = _table_inputs(graph)
    inputs["gather_int64_ids"] = inputs["gather_int64_ids"].copy()
    inputs["gather_int64_ids"][1, 2] = 7
    with pytest.raises(ValueError, match=r"index 7 at position 6 is out of range \[0, 7\)"):
        module.Model().forward(**inputs)


@pytest.mark.parametrize("mode", MODES)
def test_every_gradient_matches_reference(mode):
    from op_cases import CASES

    graph = _graph("gradtable", mode)
    module, _ = load_module("gradtable", mode)
    inputs = _table_inputs(graph)
    model = module.Model(seed=4)
    loss = model.train_step(**inputs)
    want_loss, want_grads = reference.gradients(graph, inputs, reference.init_params(graph, seed=4), seed=4)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    got = model.gradients()
    assert set(got) == set(want_grads)
    for name, want in want_grads.items():
        case = next(c for c in CASES if name.startswith(c.name + "_"))
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=max(case.tol, 1e-5), err_msg=name)


@needs_gpu
def test_cpp_example_program_runs_on_the_gpu():
    where = build_project("mlp", "gpu")
    proc = subprocess.run([str(where / "build" / "mlp_gpu_example")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "logits: shape [" in proc.stdout


if __name__ == "__main__":
    # python tests/test_cuda.py prebuild [emulated|gpu|compile]: fill the build cache
    # (benchmarks/gpu_check.sh does this before running the tests on a GPU machine).
    import time

    if len(sys.argv) != 3 or sys.argv[1] != "prebuild" or sys.argv[2] not in SUFFIX:
        raise SystemExit("usage: python tests/test_cuda.py prebuild emulated|gpu|compile")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    start = time.perf_counter()
    failed = {n: e for n, e in prebuild(sys.argv[2]).items() if e}
    for n, e in failed.items():
        print(f"{n}: build failed\n{e}\n")
    print(f"built {len(EXAMPLES + TABLES) - len(failed)} of {len(EXAMPLES + TABLES)} models for {sys.argv[2]} "
          f"in {time.perf_counter() - start:.0f} s")
    raise SystemExit(1 if failed else 0)
