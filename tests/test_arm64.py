"""The ARM64 target (issue #43): a generated CPU project cross-built for aarch64
with the toolchain file it ships (`deepgen build DIR --cross aarch64`), its example
program run under qemu-user on `--weights` and `--input` files the x86 module wrote,
and its `--output` compared with the x86 module and the numpy reference.

Needs Debian's g++-aarch64-linux-gnu and qemu-user (.ci/run installs them); the
tests that run aarch64 code skip without them. Cross builds and emulated runs are
slow: four small models (DEEPGEN_ARM64_MODELS, see below)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import CHECK_BUILD_FLAGS, build_example
from module_checks import _forward_input_names, dims_at
from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs
from generator.tools import cli
from generator.tools.build import cmake_build

CROSS_CXX = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # the aarch64 C/C++ libraries Debian's cross compiler links against


def _need_cross_tools():
    missing = [(tool, package) for tool, package in ((CROSS_CXX, "g++-aarch64-linux-gnu"), (QEMU, "qemu-user"))
               if shutil.which(tool) is None]
    if missing:
        pytest.skip("the aarch64 tests need " + " and ".join(f"{tool} (apt-get install {package})"
                                                          for tool, package in missing))


def run_aarch64(program: Path, *args) -> subprocess.CompletedProcess:
    """Runs an aarch64 Linux program on this machine under qemu-user."""
    return subprocess.run([QEMU, "-L", SYSROOT, str(program), *map(str, args)], capture_output=True, text=True,
                          timeout=120)


def cross_built(builds, name: str):
    """(graph, x86 module, project folder, aarch64 build folder) of examples/<name>.py.
    The x86 build is test_examples.py's (cached); the aarch64 build goes beside it and
    is cached with it. The MLP's goes through the command line (`deepgen build
    --cross`, at its Release -O3); the others' through CMake and the same toolchain
    file at the suite's -O0 for checks (CHECK_BUILD_FLAGS): their test compares values
    at tiny sizes and the NEON kernels are intrinsics at any level. LeNet's cross build
    on the 2-core AMD EPYC CI machine, loaded: 127 s at -O2, 44 s at -O0."""
    _need_cross_tools()
    graph = build_example(name)
    module, where = builds.module(graph)
    # (the folder names the flags: a cache holding a build at other flags does not answer)
    cross = where / ("build-aarch64" if name == "mlp" else "build-aarch64-check")
    if not (cross / ".ok").is_file():
        if name == "mlp":
            argv = ["build", str(where / "src_tree"), "--cross", "aarch64", "--build-dir", str(cross)]
            assert cli.main(argv) == 0
        else:
            toolchain = where / "src_tree" / "cmake" / "aarch64-linux-gnu.cmake"
            cmake_build(where / "src_tree", cross, extra_args=(f"-DCMAKE_TOOLCHAIN_FILE={toolchain}",
                                                              *CHECK_BUILD_FLAGS), python=False)
        (cross / ".ok").write_text("ok\n")
    return graph, module, where, cross


@pytest.fixture(scope="module")
def mlp(builds):
    return cross_built(builds, "mlp")


def test_example_program_cross_built_for_aarch64(mlp):
    _, _, _, cross = mlp
    program = cross / "mlp_example"
    assert program.read_bytes()[:4] == b"\x7fELF" and program.read_bytes()[18] == 183  # e_machine EM_AARCH64
    flags = (cross / "build.ninja").read_text() if (cross / "build.ninja").is_file() else \
        (cross / "CMakeFiles" / "mlp_model.dir" / "flags.make").read_text()
    assert "-march=armv8.2-a+fp16+dotprod" in flags and "-march=native" not in flags


# The four models issue #43 names: an MLP, a CNN (LeNet), the LSTM classifier and the
# TreeLSTM (its batch of trees is three integer inputs, written to .npy files like any
# other). Their x86 modules are test_examples.py's builds (the same cache entries), so
# in the suite this file adds only the cross builds and the emulated runs. The whole file
# on 2 busy cores: 3 min 56 s with those x86 builds cached, 8 min 58 s alone on a fresh
# cache. DEEPGEN_ARM64_MODELS="mlp" (or any list of examples) replaces the default.
ARM64_MODELS = os.environ.get("DEEPGEN_ARM64_MODELS", "mlp lenet lstm_classifier treelstm").split()


@pytest.mark.parametrize("name", ARM64_MODELS)
def test_aarch64_output_matches_x86_and_reference(builds, name, tmp_path):
    graph, module, _, cross = cross_built(builds, name)
    inputs = sample_inputs(graph, dims_at(graph, 5), seed=3)
    forward = {k: v for k, v in inputs.items() if k in _forward_input_names(graph)}
    model = module.Model(seed=5)
    model.save(str(tmp_path / "weights.npz"))
    args = ["--weights", tmp_path / "weights.npz", "--output", tmp_path / "out.npz"]
    for key, value in forward.items():
        np.save(tmp_path / f"{key}.npy", value)
        args += ["--input", f"{key}={tmp_path / key}.npy"]
    proc = run_aarch64(cross / f"{graph.name}_example", *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the NEON paths are the ones compiled: the program's first line is its build_info
    assert proc.stdout.startswith("build_info: gemm_kernel neon, openmp on, compiler "), proc.stdout
    got = np.load(tmp_path / "out.npz")
    x86 = model.forward(**forward)
    want = reference.run(graph, inputs, seed=5)
    assert sorted(got.files) == sorted(x86)
    for out in x86:
        assert got[out].dtype == x86[out].dtype and got[out].shape == x86[out].shape
        # the x86 tests' tolerance (module_checks.check_forward)
        np.testing.assert_allclose(got[out], x86[out], rtol=1e-4, atol=1e-5, err_msg=out)
        np.testing.assert_allclose(got[out], want[out], rtol=1e-4, atol=1e-5, err_msg=out)


def test_arm_arch_is_overridable(mlp, tmp_path):
    """-D<NAME>_ARM_ARCH (deepgen build --march) replaces the default target CPU (configure only)."""
    _, _, where, _ = mlp
    proc = subprocess.run(["cmake", "-S", str(where / "src_tree"), "-B", str(tmp_path / "b"),
                           f"-DCMAKE_TOOLCHAIN_FILE={where / 'src_tree' / 'cmake' / 'aarch64-linux-gnu.cmake'}",
                           "-DMLP_ARM_ARCH=armv8-a", "-DMLP_OPENMP=OFF"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    flags = "".join(p.read_text() for p in (tmp_path / "b").rglob("*") if p.name in ("build.ninja", "flags.make"))
    assert "-march=armv8-a" in flags and "armv8.2-a" not in flags and "-march=native" not in flags


def test_cross_build_without_the_cross_compiler_names_the_package(tmp_path, capsys, monkeypatch):
    """No aarch64-linux-gnu-g++ on PATH: the error says which Debian package installs it."""
    project = tmp_path / "proj"
    project.mkdir()
    (project / "CMakeLists.txt").write_text("project(p)\n")
    (project / "pyproject.toml").write_text('name = "p"\n')
    (project / "cmake").mkdir()
    (project / "cmake" / "aarch64-linux-gnu.cmake").write_text("")
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert cli.main(["build", str(project), "--cross", "aarch64"]) == 1
    err = capsys.readouterr().err
    assert "aarch64-linux-gnu-g++" in err and "apt-get install g++-aarch64-linux-gnu" in err


def test_march_without_cross_is_refused(tmp_path, capsys):
    assert cli.main(["build", str(tmp_path), "--march", "armv8-a"]) == 1
    assert "--build-dir and --march go with --cross" in capsys.readouterr().err


def test_project_ships_the_toolchain_file_and_says_how_to_use_it():
    from generator.pipeline import project_files

    files = project_files(build_example("mlp"))
    toolchain = files["cmake/aarch64-linux-gnu.cmake"].decode()
    assert "set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)" in toolchain
    readme = files["README.md"].decode()
    assert "-DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake" in readme and "-DMLP_ARM_ARCH=" in readme
    assert "MLP_ARM_ARCH" in files["CMakeLists.txt"].decode()


# --------------------------------------------------------------------------- the runtime under qemu
#
# The runtime's own unit drivers (tests/runtime_driver.cpp, tests/conv_runtime_driver.cpp),
# cross-compiled with the projects' default target CPU, so that dg_gemm.h compiles its NEON
# micro-kernel (8 x 12 tile, 4-wide narrow edge tile) and dg_conv.h its vector direct loops;
# run under qemu on the same cases and with the same tolerances as test_runtime.py and
# test_conv_runtime.py run them on x86.

from test_runtime import (  # noqa: E402  (helpers only: no test of that file is collected here)
    CXX_FLAGS,
    DRIVER_SRC,
    EDGE_SHAPES,
    RUNTIME_DIR,
    TATB,
    Driver,
    assert_gemm_close,
    gemm_reference,
    rand,
    run_gemm,
    same_bits,
)

ARM_FLAGS = ["-march=armv8.2-a+fp16+dotprod", "-fopenmp"]


class QemuDriver(Driver):
    def call(self, op, *args, inputs=()):
        stdin = b"".join(np.ascontiguousarray(a).tobytes() for a in inputs)
        cmd = [QEMU, "-L", SYSROOT, str(self.exe), op, *[str(a) for a in args]]
        return subprocess.run(cmd, input=stdin, capture_output=True, timeout=120)


def _cross_compile(source: Path, exe: Path, flags) -> str:
    cmd = [CROSS_CXX, *flags, "-I", str(RUNTIME_DIR), str(source), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}"
    return proc.stderr


@pytest.fixture(scope="module")
def neon(tmp_path_factory):
    """The runtime driver for aarch64 (runs under qemu)."""
    _need_cross_tools()
    exe = tmp_path_factory.mktemp("arm64") / "runtime_driver"
    diagnostics = _cross_compile(DRIVER_SRC, exe, [*CXX_FLAGS, *ARM_FLAGS])
    assert diagnostics == "", diagnostics
    return QemuDriver(exe)


def test_runtime_compiles_the_neon_gemm_kernel(neon):
    proc = neon.call("gemm_info", 2)
    assert proc.returncode == 0, proc.stderr
    isa, threads, openmp = proc.stdout.decode().split()
    assert (isa, openmp) == ("neon", "1") and int(threads) >= 1


# test_runtime.py's edge shapes, and the NEON tile's: one less / equal / one more than
# MR x NR = 8 x 12, the narrow edge tile (N <= 4), K around KC = 256.
NEON_EDGES = [(7, 11, 3), (8, 12, 255), (9, 13, 256), (17, 25, 257), (16, 4, 9), (9, 3, 5), (15, 23, 100)]


@pytest.mark.parametrize("ta,tb", TATB)
def test_neon_gemm_edge_shapes(neon, ta, tb):
    for M, N, K in EDGE_SHAPES + NEON_EDGES:
        a, b, got = run_gemm(neon, ta, tb, M, N, K)
        assert_gemm_close(got, gemm_reference(a, b, ta, tb, M, N, K), K)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("M,N,K,ta,tb", [(1, 1280, 512, False, False), (3, 33, 20, False, True),
                                         (64, 512, 784, False, False), (64, 784, 512, False, True),
                                         (784, 512, 64, True, False), (256, 10, 256, True, False)])
def test_neon_gemm_model_shapes(neon, M, N, K, ta, tb, threads):
    a, b, got = run_gemm(neon, ta, tb, M, N, K, threads=threads)
    assert_gemm_close(got, gemm_reference(a, b, ta, tb, M, N, K), K)


@pytest.mark.parametrize("M,N,K,ta,tb", [(2, 100, 30, False, False), (9, 1280, 512, False, False),
                                         (64, 10, 256, False, False), (7, 13, 29, True, True)])
def test_neon_gemm_epilogue_once_per_element(neon, M, N, K, ta, tb):
    bias = rand(N)
    a, b, got, count, _ = run_gemm(neon, ta, tb, M, N, K, pad=(0, 0, 2), threads=2, bias=bias)
    assert np.array_equal(count[:, :N], np.ones((M, N), np.float32))
    assert np.array_equal(count[:, N:], np.zeros((M, 2), np.float32))
    assert_gemm_close(got[:, :N], np.maximum(gemm_reference(a, b, ta, tb, M, N, K) + bias, 0.0), K)


@pytest.mark.parametrize("M,N,K,ta,tb", [(3, 33, 20, True, False), (13, 33, 257, False, True),
                                         (70, 1280, 512, False, False)])
def test_neon_gemm_with_packed_b_equals_gemm(neon, M, N, K, ta, tb):
    lda, ldb, ldc = (M if ta else K) + 1, (K if tb else N) + 2, N + 3
    a, b = rand(K if ta else M, lda), rand(N if tb else K, ldb)
    out = neon("gemm_packed", int(ta), int(tb), M, N, K, lda, ldb, ldc, 2, inputs=[a, b, np.zeros((M, ldc), np.float32)])
    *uses, plain, _, one = (x.reshape(M, ldc) for x in np.split(out, 7))
    assert all(same_bits(use, plain) for use in uses)
    assert_gemm_close(plain[:, :N], gemm_reference(a, b, ta, tb, M, N, K), K)
    if tb and M > 3:  # one row by a packed transposed B: micro_kernel_panels<1, 4>, the micro-kernel's bits
        assert same_bits(one[:1], plain[:1])


def test_neon_conv2d(tmp_path):
    """dg_conv.h with the NEON vector type, forward and both gradients against PyTorch: the
    cases of test_conv_runtime.py that take the vectorized direct loops (depthwise, one
    input channel per group), and a few that take the GEMM (im2col, pointwise, 1x1)."""
    _need_cross_tools()
    pytest.importorskip("torch")
    import torch
    import test_conv_runtime as conv

    exe = tmp_path / "conv_runtime_driver"
    diagnostics = _cross_compile(conv.DRIVER_SRC, exe, [*conv.CXX_FLAGS, *ARM_FLAGS])
    assert "warning" not in diagnostics, diagnostics

    class QemuConvDriver(conv.Driver):
        def run(self, op, geom, *extra, inputs=(), threads=1):
            stdin = b"".join(np.ascontiguousarray(a, dtype=np.float32).tobytes() for a in inputs)
            cmd = [QEMU, "-L", SYSROOT, str(self.exe), op, *map(str, geom.args()), *map(str, extra)]
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            return subprocess.run(cmd, input=stdin, capture_output=True, timeout=120, env=env)

    driver = QemuConvDriver(exe, "neon")
    gen = torch.Generator().manual_seed(7)
    direct = [g for g in conv.CONV_CASES if g.C == g.groups and g.C < 100]
    gemm = [g for g in conv.CONV_CASES if repr(g) in ("N1C3_8x8_O4_k3x3_s(1, 1)_p(0, 0)_d(1, 1)_g1",
                                                       "N1C8_6x5_O12_k1x1_s(1, 1)_p(0, 0)_d(1, 1)_g1",
                                                       "N2C40_2x2_O70_k1x1_s(1, 1)_p(0, 0)_d(1, 1)_g1")]
    assert len(gemm) == 3
    cases = direct + gemm
    for g in cases:
        x, w, b, dy, y, dx, dw = conv.conv_reference(g, gen, True)
        conv.close(driver("conv2d", g, 1, inputs=[x, w, b]), y)
        conv.close(driver("conv2d_grad_input", g, inputs=[dy, w]), dx)
        conv.close(driver("conv2d_grad_weight", g, inputs=[x, dy]), dw)


# --------------------------------------------------------------------------- vectorized math under qemu
#
# dg_math.h has no ISA-specific code: its branch-free functions are written so that GCC
# vectorizes the loops that call them, with whatever vector unit -march gives. For aarch64 that
# is NEON (Advanced SIMD, 4 floats a vector) with fused multiply-add (__FP_FAST_FMAF). The
# checks are test_math.py's, on tests/math_driver.cpp cross-compiled with the projects' default
# target CPU and run under qemu: the loops vectorized with 16-byte vectors and no call left,
# then the same libm sweeps (a dense stride over all 2^32 floats plus the windows where
# the methods switch), special values, tiny arguments and tails, with the same bounds
# (2 ulp from the correctly rounded float; 1.5 ulp of error, 2.45 for sigmoid).

import test_math as math_checks  # noqa: E402  (helpers and check bodies; no test of that file is collected here)

MATH_FLAGS = [*math_checks.BASE_FLAGS, "-march=armv8.2-a+fp16+dotprod"]


@pytest.fixture(scope="module")
def neon_math(tmp_path_factory):
    """(math_checks.Driver running the aarch64 math_driver under qemu, compiler stderr, vectorizer report)."""
    _need_cross_tools()
    tmp = tmp_path_factory.mktemp("arm64-math")
    exe, report = tmp / "math_driver", tmp / "vec.txt"
    cmd = [CROSS_CXX, *MATH_FLAGS, f"-fopt-info-vec-optimized={report}", "-I", str(RUNTIME_DIR),
           str(math_checks.DRIVER_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"compile failed:\n{' '.join(cmd)}\n{proc.stderr}"
    # emulated, on a machine the other tests keep busy: a generous timeout (each sweep takes seconds)
    return math_checks.Driver(exe, runner=[QEMU, "-L", SYSROOT], timeout=300), proc.stderr, report.read_text()


def test_neon_math_compiles_without_warnings_and_vectorizes(neon_math):
    _, stderr, report = neon_math
    assert stderr == "", stderr
    line = next(i for i, s in enumerate(math_checks.DRIVER_SRC.read_text().splitlines(), 1) if "= F{}(x[i + j])" in s)
    hits = re.findall(rf"math_driver\.cpp:{line}:\d+: optimized: loop vectorized using 16 byte vectors", report)
    assert len(hits) == len(math_checks.FUNCS), f"{len(hits)} loops vectorized:\n{report}"


def test_neon_math_plain_loops_vectorize_without_calls(tmp_path):
    """Loops shaped like the generated elementwise kernels, at -O3 as a project builds them:
    NEON (16-byte vectors), no call to libm or to an out-of-line helper."""
    _need_cross_tools()
    src = tmp_path / "kernels.cpp"
    src.write_text(math_checks.KERNEL.format(loops="\n".join(math_checks.LOOP.format(f=f) for f in math_checks.FUNCS)))
    obj = tmp_path / "k.o"
    cmd = [CROSS_CXX, "-std=c++17", "-O3", "-march=armv8.2-a+fp16+dotprod", "-fopt-info-vec-optimized",
           "-I", str(RUNTIME_DIR), "-c", str(src), "-o", str(obj)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    lines = src.read_text().splitlines()
    for name in [f"k_{f}" for f in math_checks.FUNCS] + ["sigmoid_like", "momentum_update_like"]:
        n = next(i for i, s in enumerate(lines, 1) if f" {name}(" in s) + (not name.startswith("k_"))
        assert re.search(rf"kernels\.cpp:{n}:\d+: optimized: loop vectorized using 16 byte vectors", proc.stderr), \
            f"{name} (line {n}) not vectorized:\n{proc.stderr}"
    objdump = shutil.which("aarch64-linux-gnu-objdump")
    if objdump:
        disassembly = subprocess.run([objdump, "-d", str(obj)], capture_output=True, text=True, check=True).stdout
        assert not re.search(r"\sbl\s", disassembly), "a call is left in the vectorized loops"
        assert re.search(r"\sfmla\s+v\d+\.4s", disassembly), "no vector FMA (fmla v.4s) in the loops"


@pytest.mark.parametrize("fn", math_checks.FUNCS)
def test_neon_math_dense_sweep_vs_libm(neon_math, fn):
    math_checks.test_dense_sweep_vs_libm(neon_math[0], fn)


@pytest.mark.parametrize("fn", math_checks.FUNCS)
def test_neon_math_sample_vs_numpy_and_oracle(neon_math, fn):
    math_checks.test_sample_vs_numpy(neon_math[0], fn)
    math_checks.test_libm_oracle_agrees_with_numpy(neon_math[0], fn)  # aarch64 glibc's libm, the sweeps' oracle


@pytest.mark.parametrize("fn", math_checks.FUNCS)
def test_neon_math_special_values(neon_math, fn):
    math_checks.test_special_values(neon_math[0], fn)


def test_neon_math_tiny_arguments_and_tails(neon_math):
    for fn, x in math_checks.TINY_ARGUMENTS:
        math_checks.test_tiny_arguments_relative_accuracy(neon_math[0], fn, x)
    math_checks.test_tail_lengths_and_subnormal_inputs(neon_math[0])
