"""Checks of a compiled model module's Python API against the reference, shared by
every target's tests (test_examples.py for the CPU, test_cuda.py for CUDA): the
API is the same whichever target built the module."""

from __future__ import annotations

import numpy as np
import pytest

from generator import reference
from generator.samples import sample_inputs


def dims_at(graph, size):
    return {d: size + i for i, d in enumerate(graph.dims)}


def check_forward(graph, module, size):
    """forward() at `size` (every symbolic dim near it) against the reference."""
    inputs = sample_inputs(graph, dims_at(graph, size), seed=size)
    want = reference.run(graph, inputs, seed=5)
    got = module.Model(seed=5).forward(**inputs)
    assert set(got) == {name for name, _ in graph.outputs}
    for name in want:
        assert got[name].shape == want[name].shape and got[name].dtype == want[name].dtype
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def check_init(graph, module):
    """Model(seed) draws exactly reference.init_params(graph, seed)."""
    params = module.Model(seed=11).parameters()
    want = reference.init_params(graph, seed=11)
    assert list(params) == [p.name for p in graph.params]
    for name, value in want.items():
        assert params[name].dtype == np.float32
        np.testing.assert_array_equal(params[name], value, err_msg=name)


def check_parameter_views(graph, module):
    """parameters() are writable views: writing them changes what forward() computes."""
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


def check_save_load(graph, module, tmp_path):
    """save/load round trip; a file with a wrong shape or a missing parameter is
    refused and leaves the model as it was."""
    a, b = module.Model(seed=1), module.Model(seed=2)
    a.save(str(tmp_path / "w.npz"))
    inputs = sample_inputs(graph)
    before = b.forward(**inputs)
    saved = dict(np.load(tmp_path / "w.npz"))
    first = next(iter(saved))
    np.savez(tmp_path / "bad.npz", **dict(saved, **{first: np.zeros((1, 2), np.float32)}))
    with pytest.raises(ValueError, match=f"parameter '{first}' has shape"):
        b.load(str(tmp_path / "bad.npz"))
    np.savez(tmp_path / "missing.npz", **{k: v for k, v in saved.items() if k != first})
    with pytest.raises(ValueError, match=f"missing parameter '{first}'"):
        b.load(str(tmp_path / "missing.npz"))
    after = b.forward(**inputs)
    for k in before:
        np.testing.assert_array_equal(before[k], after[k])
    b.load(str(tmp_path / "w.npz"))
    for k, v in a.forward(**inputs).items():
        np.testing.assert_array_equal(b.forward(**inputs)[k], v)


def check_bad_inputs(graph, module):
    """Wrong dtype, rank, layout, names or type: a ValueError naming the input."""
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
        with pytest.raises(ValueError, match=message) as error:
            model.forward(**inputs)
        assert name in str(error.value) or what == "unknown", what
