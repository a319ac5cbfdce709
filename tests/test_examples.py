"""Every example, generated and compiled: the module against the reference at
several batch sizes, the module's API (parameters, save/load, bad inputs), the
generated project's own test, and the C++ example program."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, load_example
from module_checks import check_bad_inputs, check_forward, check_init, check_parameter_views, check_save_load
from generator import reference

EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module", params=EXAMPLES)
def example(request, builds):
    graph = load_example(request.param).build()
    module, where = builds.module(graph)
    return graph, module, where


@pytest.mark.parametrize("size", [1, 2, 7])
def test_forward_matches_reference(example, size):
    check_forward(*example[:2], size)


def test_parameters_match_reference_init_exactly(example):
    check_init(*example[:2])


def test_parameters_are_writable_views(example):
    check_parameter_views(*example[:2])


def test_save_load_roundtrip_and_bad_files(example, tmp_path):
    check_save_load(*example[:2], tmp_path)


def test_bad_inputs_are_value_errors(example):
    check_bad_inputs(*example[:2])


def test_wrong_concrete_dimension_names_expected_shape(builds):
    graph = load_example("mlp").build()
    module, _ = builds.module(graph)
    with pytest.raises(ValueError, match=r"input 'x': dimension 1 must be 784 \(expected \[N, 784\], got \[3, 783\]\)"):
        module.Model().forward(x=np.zeros((3, 783), np.float32))


def test_batch_of_zero_is_refused(builds):
    """Memory plans assume symbolic sizes of at least 1; an empty batch is a clear error."""
    graph = load_example("mlp").build()
    module, _ = builds.module(graph)
    with pytest.raises(ValueError, match=r"input 'x': dimension 0 is N, which must be at least 1 \(got 0\)"):
        module.Model().forward(x=np.zeros((0, 784), np.float32))
    with pytest.raises(ValueError, match="must be at least 1"):
        reference.run(graph, {"x": np.zeros((0, 784), np.float32)})


def test_generated_project_tests_pass(example):
    graph, module, where = example
    env = dict(os.environ, PYTHONPATH=str(where / "build"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(where / "src_tree" / "tests")],
                          capture_output=True, text=True, env=env, cwd=where)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("3 passed" if graph.train else "2 passed") in proc.stdout


def test_cpp_example_program_runs(example):
    graph, _, where = example
    proc = subprocess.run([str(where / "build" / f"{graph.name}_example")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for name, _ in graph.outputs:
        assert f"{name}: shape [" in proc.stdout


def test_digits_trains_to_95_percent(builds):
    pytest.importorskip("sklearn")
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "digits.py"))
    module, _ = builds.module(example["digits"].build())
    lines = []
    accuracy = example["train"](module, log=lines.append)
    assert len([line for line in lines if line.startswith("epoch")]) == 30
    assert accuracy >= 0.95, lines[-3:]
