"""Building generated projects the ways a user would: hand-edit and rebuild,
`deepgen build` (steps, timings, the compiler's message on failure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from conftest import CHECK_BUILD_FLAGS, ROOT, cmake_build
from generator.tools import cli
from generator.reference import interpreter as reference
from generator.pipeline import generate
from generator.frontend.loader import load_model
from generator.reference.samples import sample_inputs

TINY = str(ROOT / "tests" / "models" / "tiny.py")
# These tests check that a build works and computes the reference's values, not how
# fast its code runs: they build at CHECK_BUILD_FLAGS' -O0 (the CMake ones for the
# hand edit, without the example program it does not run; `deepgen build`'s pip
# through scikit-build-core's SKBUILD_CMAKE_ARGS, which only these tests set). On the
# 2-core AMD EPYC CI machine, loaded: the tiny project's build 97 s at the Release
# -O3, 52 s so.
CHECK_CMAKE = (*CHECK_BUILD_FLAGS, "-DTINY_EXAMPLE=OFF")

RUN = """
import json, sys, numpy as np
sys.path.insert(0, sys.argv[1])
import tiny
x = np.array(json.loads(sys.argv[2]), np.float32)
print(json.dumps(tiny.Model(seed=0).forward(x=x)["y"].tolist()))
"""


def _forward(module_dir, x):
    """Runs the module in a fresh process (a rebuilt module cannot be re-imported in this one)."""
    proc = subprocess.run([sys.executable, "-c", RUN, str(module_dir), json.dumps(x.tolist())],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return np.array(json.loads(proc.stdout), np.float32)


def test_hand_edit_of_model_cpp_changes_the_module(tmp_path):
    relu = load_model(TINY + ":tiny").build()
    project, build = tmp_path / "tiny", tmp_path / "build"
    generate(relu, project)
    cmake_build(project, build, extra_args=CHECK_CMAKE)
    x = sample_inputs(relu)["x"]
    np.testing.assert_allclose(_forward(build, x), reference.run(relu, {"x": x})["y"], rtol=1e-5, atol=1e-6)

    # The user swaps the activation by hand: the GEMM with its fused bias + relu epilogue
    # becomes a plain GEMM followed by a tanh loop.
    model_cpp = project / "src" / "model.cpp"
    text = model_cpp.read_text()
    call = "dg::matmul(x, h_w_packed, h, /*M=*/N, /*K=*/3, /*N=*/4, kernels::add_relu_bias_epilogue{h_b.ptr()});"
    assert call in text
    by_hand = ("dg::matmul(x, h_w_packed, h, /*M=*/N, /*K=*/3, /*N=*/4);\n"
               "  for (int64_t i = 0; i < N * 4; ++i) h[i] = std::tanh(h[i] + h_b.ptr()[i % 4]);")
    model_cpp.write_text(text.replace(call, by_hand))
    cmake_build(project, build, extra_args=CHECK_CMAKE)

    tanh = load_model(TINY + ":tiny_tanh").build()
    got = _forward(build, x)
    np.testing.assert_allclose(got, reference.run(tanh, {"x": x})["y"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, reference.run(relu, {"x": x})["y"])


def _check_flags(monkeypatch):
    monkeypatch.setenv("SKBUILD_CMAKE_ARGS", ";".join(CHECK_BUILD_FLAGS))


def test_deepgen_build_installs_a_working_module(tmp_path, capsys, monkeypatch):
    _check_flags(monkeypatch)
    project, site = tmp_path / "tiny", tmp_path / "site"
    assert cli.main(["generate", TINY + ":tiny", "-o", str(project)]) == 0
    assert cli.main(["build", str(project), "--target-dir", str(site)]) == 0
    out = capsys.readouterr().out
    for step in ("configure (cmake)", "compile", "built and installed in"):
        assert step in out, out
    graph = load_model(TINY + ":tiny").build()
    x = sample_inputs(graph)["x"]
    np.testing.assert_allclose(_forward(site, x), reference.run(graph, {"x": x})["y"], rtol=1e-5, atol=1e-6)


def test_deepgen_build_shows_the_compiler_error(tmp_path, capsys, monkeypatch):
    _check_flags(monkeypatch)
    project = tmp_path / "tiny"
    assert cli.main(["generate", TINY + ":tiny", "-o", str(project)]) == 0
    model_cpp = project / "src" / "model.cpp"
    model_cpp.write_text(model_cpp.read_text().replace("return outputs;", "return outputs + oops;"))
    assert cli.main(["build", str(project), "--target-dir", str(tmp_path / "site")]) == 1
    err = capsys.readouterr().err
    assert "deepgen build: error: build of" in err
    assert "model.cpp" in err and "oops" in err
    assert not (tmp_path / "site").exists() or not list((tmp_path / "site").glob("tiny*.so"))
