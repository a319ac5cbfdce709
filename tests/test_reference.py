"""The numpy reference interpreter: input validation, parameter initialization,
and float64 evaluation (generator.reference.interpreter)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import generator as dg
from generator.reference import interpreter as reference

N = dg.dim("N")
M = dg.dim("M")

THIS_FILE = os.path.abspath(__file__)
BASENAME = os.path.basename(THIS_FILE)


def line_of(marker: str) -> int:
    """The line that ends with the comment `# @marker` (exactly one must)."""
    with open(THIS_FILE, encoding="utf-8") as f:
        hits = [i for i, text in enumerate(f, 1) if text.rstrip().endswith(f"# @{marker}")]
    assert len(hits) == 1, f"marker @{marker} found on lines {hits}"
    return hits[0]


def has_word(msg: str, word: str) -> bool:
    return re.search(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])", msg) is not None


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


# -- models ------------------------------------------------------------------------


@dg.model
def three_inputs():
    feats = dg.input("feats", (N, 4))
    mask = dg.input("mask", (N, 3))
    ids = dg.input("ids", (M,), dtype="int32")
    w = dg.param("w", (4, 3))
    table = dg.param("table", (10, 3), init=dg.normal(0.0, 1.0))
    return {"scores": feats @ w * mask, "rows": dg.gather(table, ids)}


@dg.model
def tail():
    x = dg.input("x", (N, 4))
    return x[5:]  # @tail_slice


@dg.model
def inner():
    x = dg.input("x", (N, 4))
    return x[1:-1]  # @inner_slice


@dg.model
def seeded():
    x = dg.input("x", (N, 4))
    free = dg.param("free", (4, 3))
    fixed = dg.param("fixed", (4, 3), seed=123)
    normal = dg.param("normal", (4, 3), init=dg.he_normal())
    bias = dg.param("bias", (3,), init=dg.constant(0.5))
    return {"y": x @ free + x @ fixed + x @ normal + bias}


@dg.model
def tiny_diff():
    x = dg.input("x", (N, 2))
    return x - 1


@dg.model
def mixed():
    x = dg.input("x", (N, 4))
    ids = dg.input("ids", (N,), dtype="int64")
    w = dg.param("w", (4, 3))
    t = dg.param("t", (7, 3))
    h = dg.tanh(x @ w)
    p = dg.softmax(h + dg.gather(t, ids), axis=-1)
    return {"p": p, "s": dg.sum(p * h, axis=1)}


@pytest.fixture(scope="module")
def graph():
    return three_inputs.build()


def good_inputs(n=2, m=5):
    rng = np.random.default_rng(0)
    return {
        "feats": rng.standard_normal((n, 4)).astype(np.float32),
        "mask": np.ones((n, 3), np.float32),
        "ids": np.arange(m, dtype=np.int32) % 10,
    }


def run_with(graph, **changes):
    inputs = good_inputs()
    inputs.update(changes)
    inputs = {k: v for k, v in inputs.items() if v is not None}
    return reference.run(graph, inputs)


# -- inputs ------------------------------------------------------------------------


def test_good_inputs_run(graph):
    out = run_with(graph)
    assert out["scores"].shape == (2, 3) and out["scores"].dtype == np.float32
    assert out["rows"].shape == (5, 3)
    dims = reference.bind_inputs(graph, good_inputs(n=3, m=7))
    assert dims == {N: 3, M: 7}


def test_unknown_input(graph):
    with pytest.raises(ValueError) as e:
        run_with(graph, fetaures=np.ones((2, 4), np.float32))
    msg = str(e.value)
    assert has_word(msg, "fetaures"), msg
    for name in ("feats", "mask", "ids"):  # the valid names are listed
        assert has_word(msg, name), msg


def test_missing_input(graph):
    with pytest.raises(ValueError) as e:
        run_with(graph, mask=None)
    msg = str(e.value)
    assert has_word(msg, "mask") and "missing" in msg, msg
    assert "[N,3]" in squash(msg), msg  # what was expected


@pytest.mark.parametrize("shape", [(2, 4, 1), (8,), ()], ids=["rank3", "rank1", "scalar"])
def test_wrong_rank(graph, shape):
    with pytest.raises(ValueError) as e:
        run_with(graph, feats=np.ones(shape, np.float32))
    msg = str(e.value)
    assert has_word(msg, "feats") and "rank" in msg, msg
    assert "[N,4]" in squash(msg), msg
    assert squash(str(shape)) in squash(msg), msg


def test_wrong_concrete_dim(graph):
    with pytest.raises(ValueError) as e:
        run_with(graph, feats=np.ones((2, 5), np.float32))
    msg = str(e.value)
    assert has_word(msg, "feats"), msg
    assert has_word(msg, "4") and has_word(msg, "5"), msg


def test_wrong_concrete_dim_of_second_input(graph):
    with pytest.raises(ValueError) as e:
        run_with(graph, mask=np.ones((2, 4), np.float32))
    msg = str(e.value)
    assert has_word(msg, "mask") and has_word(msg, "3") and has_word(msg, "4"), msg


def test_inconsistent_symbolic_dim_names_both_inputs(graph):
    """feats binds N=2, mask says N=3: the message names both inputs, the dim
    and both sizes, so the user knows which two arrays disagree."""
    with pytest.raises(ValueError) as e:
        run_with(graph, mask=np.ones((3, 3), np.float32))
    msg = str(e.value)
    assert has_word(msg, "mask"), msg
    assert has_word(msg, "feats"), msg
    assert has_word(msg, "N"), msg
    assert has_word(msg, "2") and has_word(msg, "3"), msg


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.int16])
def test_int_input_given_another_dtype(graph, dtype):
    with pytest.raises(ValueError) as e:
        run_with(graph, ids=np.zeros(5, dtype))
    msg = str(e.value)
    assert has_word(msg, "ids") and "int32" in msg and np.dtype(dtype).name in msg, msg


@pytest.mark.parametrize("dtype", [np.int32, np.float16, np.bool_])
def test_float_input_given_another_dtype(graph, dtype):
    with pytest.raises(ValueError) as e:
        run_with(graph, feats=np.zeros((2, 4), dtype))
    msg = str(e.value)
    assert has_word(msg, "feats") and "float32" in msg and np.dtype(dtype).name in msg, msg


def test_float64_accepted_for_float32_input(graph):
    out = run_with(graph, feats=good_inputs()["feats"].astype(np.float64))
    assert out["scores"].dtype == np.float32
    np.testing.assert_allclose(out["scores"], run_with(graph)["scores"], rtol=1e-6)


def test_symbolic_slice_requirement_violated():
    graph = tail.build()
    with pytest.raises(ValueError) as e:
        reference.run(graph, {"x": np.ones((3, 4), np.float32)})
    msg = str(e.value)
    assert "N=3" in msg, msg
    assert re.search(rf"{re.escape(BASENAME)}:{line_of('tail_slice')}(?!\d)", msg), msg
    assert "5" in msg, msg
    with pytest.raises(ValueError):
        reference.bind_inputs(graph, {"x": np.ones((4, 4), np.float32)})
    assert reference.run(graph, {"x": np.ones((7, 4), np.float32)})["slice"].shape == (2, 4)


def test_symbolic_slice_with_negative_stop_requirement():
    graph = inner.build()
    with pytest.raises(ValueError) as e:
        reference.run(graph, {"x": np.ones((1, 4), np.float32)})
    msg = str(e.value)
    assert "N=1" in msg, msg
    assert re.search(rf"{re.escape(BASENAME)}:{line_of('inner_slice')}(?!\d)", msg), msg
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(reference.run(graph, {"x": x})["slice"], x[1:-1])


@pytest.mark.parametrize("bad", [10, -1])
def test_gather_ids_out_of_range(graph, bad):
    """A run-time index error says which op (and table) it comes from."""
    ids = np.zeros(5, np.int32)
    ids[3] = bad
    with pytest.raises(ValueError) as e:
        run_with(graph, ids=ids)
    msg = str(e.value)
    assert str(bad) in msg and "10" in msg, msg
    assert "gather" in msg or has_word(msg, "table"), msg


# -- parameters ----------------------------------------------------------------------


def test_missing_parameter(graph):
    params = reference.init_params(graph, 0)
    del params["w"]
    with pytest.raises(ValueError) as e:
        reference.run(graph, good_inputs(), params)
    assert has_word(str(e.value), "w"), str(e.value)


def test_wrong_parameter_shape(graph):
    params = reference.init_params(graph, 0)
    params["w"] = np.zeros((3, 4), np.float32)
    with pytest.raises(ValueError) as e:
        reference.run(graph, good_inputs(), params)
    msg = str(e.value)
    assert has_word(msg, "w") and "[4,3]" in squash(msg) and "(3,4)" in squash(msg), msg


def test_init_params_deterministic_per_seed():
    graph = seeded.build()
    a = reference.init_params(graph, 5)
    b = reference.init_params(seeded.build(), 5)
    assert sorted(a) == ["bias", "fixed", "free", "normal"]
    for name in a:
        assert a[name].dtype == np.float32
        assert a[name].shape == tuple(p.shape for p in graph.params if p.name == name)[0]
        np.testing.assert_array_equal(a[name], b[name])


def test_init_params_differ_across_seeds():
    graph = seeded.build()
    a, b = reference.init_params(graph, 0), reference.init_params(graph, 1)
    assert not np.array_equal(a["free"], b["free"])
    assert not np.array_equal(a["normal"], b["normal"])
    np.testing.assert_array_equal(a["bias"], np.full(3, 0.5, np.float32))
    np.testing.assert_array_equal(a["bias"], b["bias"])


def test_param_seed_ignores_model_seed():
    graph = seeded.build()
    draws = [reference.init_params(graph, s)["fixed"] for s in (0, 1, 99)]
    for d in draws[1:]:
        np.testing.assert_array_equal(draws[0], d)
    # ... and it is not simply the draw of the model seed it happens to equal.
    assert not np.array_equal(draws[0], reference.init_params(graph, 123)["free"])


def test_init_params_distinct_params_differ():
    """Two parameters with the same shape and initializer get different draws."""
    a = reference.init_params(seeded.build(), 0)
    assert not np.array_equal(a["free"], a["fixed"])


def test_run_seed_selects_the_init_params():
    graph = seeded.build()
    x = np.ones((2, 4), np.float32)
    for seed in (0, 3):
        np.testing.assert_array_equal(
            reference.run(graph, {"x": x}, seed=seed)["y"],
            reference.run(graph, {"x": x}, reference.init_params(graph, seed))["y"],
        )
    assert not np.array_equal(reference.run(graph, {"x": x}, seed=0)["y"], reference.run(graph, {"x": x}, seed=3)["y"])


# -- float64 -------------------------------------------------------------------------


def test_float64_run_keeps_double_precision():
    """1 + 1e-10 is 1 in float32; in float64 the difference survives."""
    graph = tiny_diff.build()
    x = np.full((3, 2), 1.0 + 1e-10, np.float64)
    out64 = reference.run(graph, {"x": x}, float_dtype=np.float64)["sub"]
    out32 = reference.run(graph, {"x": x})["sub"]
    assert out64.dtype == np.float64
    np.testing.assert_allclose(out64, 1e-10, rtol=1e-5)
    assert out32.dtype == np.float32
    np.testing.assert_array_equal(out32, 0.0)


def test_float64_run_every_float_value_is_double():
    graph = mixed.build()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4))
    ids = np.array([0, 6, 2], np.int64)
    params = reference.init_params(graph, 0)
    values = reference.run(graph, {"x": x, "ids": ids}, params, float_dtype=np.float64, trace=True)
    for v in graph.values():
        expected = np.int64 if v.dtype == "int64" else np.float64
        assert values[v.name].dtype == expected, (v.name, values[v.name].dtype)
    # Against a float64 numpy computation of the same model.
    w, t = params["w"].astype(np.float64), params["t"].astype(np.float64)
    h = np.tanh(x @ w)
    z = h + t[ids]
    p = np.exp(z - z.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(values["p"], p, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(values["s"], (p * h).sum(axis=1), rtol=1e-12, atol=1e-15)
    out32 = reference.run(graph, {"x": x, "ids": ids}, params)
    assert out32["p"].dtype == np.float32
    np.testing.assert_allclose(out32["p"], p, rtol=1e-5, atol=1e-6)
