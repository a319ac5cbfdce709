"""Every example, generated and compiled: the module against the reference at
several batch sizes, the module's API (parameters, save/load, bad inputs), the
generated project's own test, and the C++ example program."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, build_example, child_env, load_example
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
)
from generator.reference import interpreter as reference

from conftest import EXAMPLES  # noqa: E402  (the example model files)


@pytest.fixture(scope="module", params=EXAMPLES)
def example(request, builds):
    graph = build_example(request.param)
    module, where = builds.module(graph)
    return graph, module, where


@pytest.mark.parametrize("size", [1, 2, 7])
def test_forward_matches_reference(example, size):
    check_forward(*example[:2], size)


def test_every_module_has_pytorchs_mode_methods(example):
    """train()/eval()/training on every module (#37), no-ops where no op reads the mode:
    eval() changes no output of a model without batch norm or dropout."""
    graph, module = example[:2]
    m = module.Model(seed=0)
    assert m.training is True and m.eval() is m and m.training is False
    assert m.train() is m and m.training is True and m.train(False).training is False
    m.training = True
    if graph.mode is None:
        from generator.reference.samples import sample_inputs

        inputs = sample_inputs(graph)
        first = m.forward(**inputs)
        second = m.eval().forward(**inputs)
        for name in first:
            np.testing.assert_array_equal(first[name], second[name])


def test_parameters_match_reference_init_exactly(example):
    check_init(*example[:2])


def test_parameters_are_writable_views(example):
    check_parameter_views(*example[:2])


def test_save_load_roundtrip_and_bad_files(example, tmp_path):
    check_save_load(*example[:2], tmp_path)


def test_bad_inputs_are_value_errors(example):
    check_bad_inputs(*example[:2])


def test_load_validates_everything_before_changing_anything(example, tmp_path):
    check_load_validates_everything_first(*example[:2], tmp_path)


@pytest.mark.parametrize("name", ["mlp", "digits", "resnet18"])
def test_trainable_module_guards_its_state(builds, name):
    """Hyperparameters checked when set, a non-finite loss changes nothing (batch
    norm's running statistics and the draw count included), and threads may share
    the Model (README: "What deepgen guarantees")."""
    graph = build_example(name)
    module, _ = builds.module(graph)
    check_hyperparameters_are_validated(module)
    check_non_finite_loss_changes_nothing(graph, module)
    check_threads_share_a_model(graph, module)


def test_forward_calls_overlap_while_no_one_writes(builds):
    """Readers share the lock: two threads' forward() calls run at the same time
    (their GIL is released), and each gives the reference's outputs."""
    import threading

    graph = load_example("treelstm").build()
    module, _ = builds.module(graph)
    model = module.Model(seed=0)
    from generator.reference.samples import sample_inputs

    inputs = sample_inputs(graph)
    want = model.forward(**inputs)
    errors = []

    def run():
        for _ in range(50):
            got = model.forward(**inputs)
            if not all(np.array_equal(got[k], want[k]) for k in want):
                errors.append("different outputs")

    workers = [threading.Thread(target=run) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors


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
    env = child_env(PYTHONPATH=str(where / "build"))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(where / "src_tree" / "tests")],
                          capture_output=True, text=True, env=env, cwd=where)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("3 passed" if graph.train else "2 passed") in proc.stdout


def test_cpp_example_program_runs(example):
    graph, _, where = example
    proc = subprocess.run([str(where / "build" / f"{graph.name}_example")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert re.match(r"build_info: gemm_kernel (avx512|avx2|neon|portable), openmp (on|off), compiler ", proc.stdout), proc.stdout
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


def test_nested_tree_ids_beyond_int64_are_value_errors(builds):
    graph = load_example("treelstm").build()
    module, _ = builds.module(graph)
    convert = next(getattr(module, n) for n in dir(module) if n.endswith("_from_nested"))
    for tree in ([2**70], [(1, 2**64)], [(-(2**63) - 1, 3)], [((2**80, [1, 2]))], [("word", [1, 2])]):
        with pytest.raises(ValueError, match="int64|must be an int"):
            convert(tree)
