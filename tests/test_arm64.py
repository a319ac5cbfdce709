"""The ARM64 target (issue #43): a generated CPU project cross-built for aarch64
with the toolchain file it ships (`deepgen build DIR --cross aarch64`), its example
program run under qemu-user on `--weights` and `--input` files the x86 module wrote,
and its `--output` compared with the x86 module and the numpy reference.

Needs Debian's g++-aarch64-linux-gnu and qemu-user (.ci/run installs them); the
tests that run aarch64 code skip without them. Emulated runs are slow: one small
model here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import build_example
from module_checks import dims_at
from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs
from generator.tools import cli

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


@pytest.fixture(scope="module")
def mlp(builds):
    """(graph, x86 module, project folder, aarch64 build folder) of examples/mlp.py.
    The x86 build is test_examples.py's (cached); the aarch64 build goes beside it,
    through the command line, and is cached with it."""
    _need_cross_tools()
    graph = build_example("mlp")
    module, where = builds.module(graph)
    cross = where / "build-aarch64"
    if not (cross / ".ok").is_file():
        argv = ["build", str(where / "src_tree"), "--cross", "aarch64", "--build-dir", str(cross)]
        assert cli.main(argv) == 0
        (cross / ".ok").write_text("ok\n")
    return graph, module, where, cross


def test_example_program_cross_built_for_aarch64(mlp):
    _, _, _, cross = mlp
    program = cross / "mlp_example"
    assert program.read_bytes()[:4] == b"\x7fELF" and program.read_bytes()[18] == 183  # e_machine EM_AARCH64
    flags = (cross / "build.ninja").read_text() if (cross / "build.ninja").is_file() else \
        (cross / "CMakeFiles" / "mlp_model.dir" / "flags.make").read_text()
    assert "-march=armv8.2-a+fp16+dotprod" in flags and "-march=native" not in flags


def test_aarch64_output_matches_x86_and_reference(mlp, tmp_path):
    graph, module, _, cross = mlp
    inputs = sample_inputs(graph, dims_at(graph, 5), seed=3)
    model = module.Model(seed=5)
    model.save(str(tmp_path / "weights.npz"))
    np.save(tmp_path / "x.npy", inputs["x"])
    proc = run_aarch64(cross / "mlp_example", "--weights", tmp_path / "weights.npz", "--input",
                       f"x={tmp_path / 'x.npy'}", "--output", tmp_path / "out.npz")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "logits: shape [5, 10]" in proc.stdout
    got = np.load(tmp_path / "out.npz")["logits"]
    assert got.dtype == np.float32 and got.shape == (5, 10)
    x86 = model.forward(x=inputs["x"])["logits"]
    want = reference.run(graph, inputs, seed=5)["logits"]
    # the x86 tests' tolerance (module_checks.check_forward)
    np.testing.assert_allclose(got, x86, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


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
