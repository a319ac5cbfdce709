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
from generator import reference
from generator.samples import sample_inputs

EXAMPLES = sorted(p.stem for p in (ROOT / "examples").glob("*.py"))


@pytest.fixture(scope="module", params=EXAMPLES)
def example(request, builds):
    graph = load_example(request.param).build()
    module, where = builds.module(graph)
    return graph, module, where


def _dims(graph, size):
    return {d: size + i for i, d in enumerate(graph.dims)}


@pytest.mark.parametrize("size", [1, 2, 7])
def test_forward_matches_reference(example, size):
    graph, module, _ = example
    inputs = sample_inputs(graph, _dims(graph, size), seed=size)
    want = reference.run(graph, inputs, seed=5)
    got = module.Model(seed=5).forward(**inputs)
    assert set(got) == {name for name, _ in graph.outputs}
    for name in want:
        assert got[name].shape == want[name].shape
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_parameters_match_reference_init_exactly(example):
    graph, module, _ = example
    params = module.Model(seed=11).parameters()
    want = reference.init_params(graph, seed=11)
    assert list(params) == [p.name for p in graph.params]
    for name, value in want.items():
        assert params[name].dtype == np.float32
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def test_parameters_are_writable_views(example):
    graph, module, _ = example
    model = module.Model(seed=0)
    params = model.parameters()
    new = {k: (0.3 * np.random.default_rng(1).normal(size=v.shape)).astype(np.float32) for k, v in params.items()}
    for k, v in new.items():
        params[k][...] = v
    inputs = sample_inputs(graph)
    want = reference.run(graph, inputs, params=new)
    got = model.forward(**inputs)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5)
    del model  # the views keep the model alive
    assert all(np.isfinite(v).all() for v in params.values())


def test_save_load_roundtrip_and_bad_files(example, tmp_path):
    graph, module, _ = example
    a, b = module.Model(seed=1), module.Model(seed=2)
    a.save(str(tmp_path / "w.npz"))
    inputs = sample_inputs(graph)
    before = b.forward(**inputs)
    # A file with a wrong shape is rejected and leaves the model unchanged.
    saved = dict(np.load(tmp_path / "w.npz"))
    first = next(iter(saved))
    bad = dict(saved, **{first: np.zeros((1, 2), np.float32)})
    np.savez(tmp_path / "bad.npz", **bad)
    with pytest.raises(ValueError, match=f"parameter '{first}' has shape"):
        b.load(str(tmp_path / "bad.npz"))
    missing = {k: v for k, v in saved.items() if k != first}
    np.savez(tmp_path / "missing.npz", **missing)
    with pytest.raises(ValueError, match=f"missing parameter '{first}'"):
        b.load(str(tmp_path / "missing.npz"))
    after = b.forward(**inputs)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    b.load(str(tmp_path / "w.npz"))
    for k, v in a.forward(**inputs).items():
        np.testing.assert_array_equal(b.forward(**inputs)[k], v)


def test_bad_inputs_are_value_errors(example):
    graph, module, _ = example
    model = module.Model()
    good = sample_inputs(graph)
    name, value = next(iter(good.items()))
    declared = graph.inputs[0].shape
    cases = {
        "wrong dtype": (dict(good, **{name: value.astype(np.float16)}), "expected dtype"),
        "wrong rank": (dict(good, **{name: value[..., None]}), "expected %d dimensions" % len(declared)),
        "not contiguous": (dict(good, **{name: np.repeat(value, 2, axis=-1)[..., ::2]}), "C-contiguous"),
        "unknown": (dict(good, bogus=value), "unknown input 'bogus'"),
        "missing": ({k: v for k, v in good.items() if k != name}, f"missing input '{name}'"),
        "not an array": (dict(good, **{name: value.tolist()}), "expected a numpy array"),
    }
    for what, (inputs, message) in cases.items():
        with pytest.raises(ValueError, match=message):
            model.forward(**inputs)
        assert name in str(_error(model, inputs)) or what in ("unknown",), what


def _error(model, inputs):
    try:
        model.forward(**inputs)
    except ValueError as e:
        return e
    raise AssertionError("no error")


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
