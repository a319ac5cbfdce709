"""Booleans and data-dependent branches (issue #42): comparisons, logical_and/or/not,
where, and dg.cond, masked (compact=False: both branches run on the whole batch,
where selects per example) and compacted (the default: each branch one batched
block over the examples that take it; docs/ARCHITECTURE.md), and dg.while_loop.

The reference against numpy oracles; the generated C++ (one trainable project,
built once) against the reference at several batch sizes, pred all true, all
false and mixed; gradients through where and cond against float64 finite
differences and against PyTorch autograd of an eager per-example twin; the
arena's measured peak against the static plan."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import generator as dg
from generator.errors import ModelError, ShapeError
from generator.pipeline import lowered, prepare
from generator.reference import interpreter as reference
from generator.transforms.autodiff import differentiate

N = dg.dim("N")


def _gated(compact=False):
    """Every boolean op, and a classifier whose hidden layer is chosen per example
    (masked; compact=True: the cond compacted)."""

    @dg.model
    def gated():
        x = dg.input("x", (N, 4))
        y = dg.input("y", (4,))
        labels = dg.input("labels", (N,), dtype="int64")
        below = x < y
        inside = dg.logical_and(x >= -0.5, x <= 0.5)
        either = dg.logical_or(below, inside)
        odd = dg.logical_not(either) != (x > 1.0)
        picked = dg.where(odd, x, 0.5 * y)
        same = dg.where(x == y, 1.0, picked)
        confident = dg.sum(x, 1) > 0.0
        hidden = dg.cond(confident,
                         lambda v: dg.tanh(dg.dense(v, 6, name="deep")),
                         lambda v: dg.relu(dg.dense(v, 6, name="shallow")),
                         x, compact=compact)
        logits = dg.dense(hidden, 3, name="out")
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1))
        return {"picked": same, "logits": logits}

    return gated


def _oracle_picked(x, y):
    below, inside = x < y, (x >= -0.5) & (x <= 0.5)
    odd = (~(below | inside)) != (x > 1.0)
    return np.where(x == y, 1.0, np.where(odd, x, 0.5 * y))


def _oracle_logits(p, x):
    """Per example: tanh(deep) if its row sums above 0, else relu(shallow)."""
    rows = []
    for row in x:
        if row.sum() > 0:
            h = np.tanh(row @ p["deep_w"] + p["deep_b"])
        else:
            h = np.maximum(row @ p["shallow_w"] + p["shallow_b"], 0)
        rows.append(h @ p["out_w"] + p["out_b"])
    return np.stack(rows)


def _inputs(seed, n, sign=None):
    rng = np.random.default_rng(seed)
    x = rng.uniform(-2, 2, (n, 4)).astype(np.float32)
    y = rng.uniform(-2, 2, 4).astype(np.float32)
    x[0, 1] = y[1]  # an equal pair
    if sign is not None:  # every example takes one branch
        x = np.abs(x) * sign
        x[0, 1] = abs(y[1]) * sign
        y[1] = x[0, 1]
    return {"x": x, "y": y, "labels": rng.integers(0, 3, n).astype(np.int64)}


def test_reference_matches_numpy():
    graph = _gated().build()
    params = reference.init_params(graph, seed=1)
    for seed, n, sign in ((0, 5, None), (1, 3, 1.0), (2, 3, -1.0), (3, 1, None)):
        inputs = _inputs(seed, n, sign)
        got = reference.run(graph, inputs, params)
        np.testing.assert_allclose(got["picked"], _oracle_picked(inputs["x"], inputs["y"]), rtol=1e-6)
        np.testing.assert_allclose(got["logits"], _oracle_logits(params, inputs["x"]), rtol=1e-5, atol=1e-6)


def test_cond_returns_what_the_branches_return():
    """A tuple from each branch, several operands, a rank-3 result: per example, its branch's."""

    @dg.model
    def pair():
        x = dg.input("x", (N, 2, 3))
        s = dg.input("s", (N,))
        a, b = dg.cond(s >= 0.0, lambda u, v: (u * 2.0, dg.exp(v)), lambda u, v: (u - 1.0, v * v), x, s)
        return {"a": a, "b": b}

    graph = pair.build()
    x = np.arange(12, dtype=np.float32).reshape(2, 2, 3) / 7
    s = np.array([0.5, -0.25], dtype=np.float32)
    got = reference.run(graph, {"x": x, "s": s})
    np.testing.assert_allclose(got["a"], np.stack([x[0] * 2, x[1] - 1]), rtol=1e-6)
    np.testing.assert_allclose(got["b"], np.array([np.exp(0.5), 0.0625], dtype=np.float32), rtol=1e-6)


def test_graph_reads_as_written():
    text = str(_gated().build())
    for line in ("below: bool[N, 4] = x < y", "inside_greater_equal: bool[N, 4] = x >= -0.5",
                 "odd: bool[N, 4] = odd_logical_not != odd_greater", "same: f32[N, 4] = where(same_equal, 1.0, picked)",
                 "hidden_then_rows: bool[N, 1] = reshape(confident, shape=(N, 1))",
                 "hidden: f32[N, 6] = where(hidden_then_rows, hidden_tanh, hidden_relu)"):
        assert line in text, line


def test_where_gradient_matches_finite_differences():
    """where with broadcasting (cond [N, 1], a [N, 3], b [3]) and a number side."""

    @dg.model
    def sel():
        a = dg.input("a", (N, 3))
        b = dg.input("b", (3,))
        c = dg.input("c", (N, 1))
        keep = c > 0.0
        out = dg.where(keep, a * b, dg.sin(b)) + dg.where(~keep, 0.0, dg.exp(c))
        return {"loss": dg.sum(dg.sin(out * 1.7 + 0.3) * out)}

    graph = sel.build()
    rng = np.random.default_rng(4)
    arrays = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=3), "c": np.array([[0.5], [-0.7], [1.2], [-0.1]])}
    wrt = list(graph.inputs)
    grads = differentiate(graph, dict(graph.outputs)["loss"], wrt)
    values = reference.run(graph, arrays, float_dtype=np.float64, values=list(grads.values()))
    eps = 1e-6
    for v in wrt:
        numeric = np.zeros(arrays[v.name].size)
        for i in range(numeric.size):
            loss = []
            for delta in (eps, -eps):
                shifted = {k: w.copy() for k, w in arrays.items()}
                shifted[v.name].reshape(-1)[i] += delta
                loss.append(float(reference.run(graph, shifted, float_dtype=np.float64)["loss"]))
            numeric[i] = (loss[0] - loss[1]) / (2 * eps)
        analytic = values[grads[id(v)].name]
        assert analytic.shape == arrays[v.name].shape
        np.testing.assert_allclose(analytic.reshape(-1), numeric, rtol=1e-5, atol=1e-6, err_msg=v.name)


def _check_finite_differences(graph, inputs64, params):
    """The reference's float64 gradients against central differences of its loss."""
    _, grads = reference.gradients(graph, inputs64, params, float_dtype=np.float64)
    eps = 1e-6
    for name, p in params.items():
        numeric = np.zeros(p.size)
        for i in range(p.size):
            loss = []
            for delta in (eps, -eps):
                shifted = {k: v.copy() for k, v in params.items()}
                shifted[name].reshape(-1)[i] += delta
                loss.append(reference.gradients(graph, inputs64, shifted, float_dtype=np.float64)[0])
            numeric[i] = (loss[0] - loss[1]) / (2 * eps)
        np.testing.assert_allclose(grads[name].reshape(-1), numeric, rtol=1e-5, atol=1e-7, err_msg=name)


def test_cond_gradient_matches_finite_differences():
    graph = _gated().build()
    inputs = _inputs(5, 5)
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=2).items()}
    x = inputs["x"].astype(np.float64)
    assert 0 < (x.sum(1) > 0).sum() < len(x)  # both branches taken
    inputs64 = dict(inputs, x=x, y=inputs["y"].astype(np.float64))
    _check_finite_differences(graph, inputs64, params)
    # each branch's parameters get gradient from its own examples only
    only_deep = dict(inputs64, x=np.abs(x))
    _, g = reference.gradients(graph, only_deep, params, float_dtype=np.float64)
    assert not g["shallow_w"].any() and not g["shallow_b"].any() and g["deep_w"].any()


@pytest.fixture(scope="module")
def gated(builds):
    graph = _gated().build()
    module, where = builds.module(graph)
    return graph, module, where


@pytest.mark.parametrize("seed,n,sign", [(0, 5, None), (1, 1, None), (2, 3, 1.0), (3, 4, -1.0)])
def test_generated_matches_reference(gated, seed, n, sign):
    graph, module, _ = gated
    inputs = _inputs(seed, n, sign)
    model = module.Model(seed=7)
    got = model.forward(x=inputs["x"], y=inputs["y"])
    want = reference.run(graph, inputs, reference.init_params(graph, seed=7))
    for name in ("picked", "logits"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_generated_code_says_what_it_does(gated):
    _, _, where = gated
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    assert "dg::Compare::less" in code and "dg::logical_and(" in code and "dg::where(" in code
    assert "for (int64_t n" not in code  # no per-example loop in the generated code
    assert "// examples taking the then branch (confident) take hidden_tanh, the others hidden_relu" in code


def _torch_twin_loss(torch, p, inputs):
    """The model eagerly, one example at a time, each taking its own branch."""
    x = torch.tensor(inputs["x"], dtype=torch.float64)
    losses = []
    for n in range(len(x)):
        v = x[n : n + 1]
        if float(v.sum()) > 0:
            h = torch.tanh(v @ p["deep_w"] + p["deep_b"])
        else:
            h = torch.relu(v @ p["shallow_w"] + p["shallow_b"])
        logits = h @ p["out_w"] + p["out_b"]
        losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(inputs["labels"][n : n + 1])))
    return torch.stack(losses).mean()


def test_train_step_matches_pytorch_per_example_twin(gated):
    torch = pytest.importorskip("torch")
    graph, module, _ = gated
    inputs = _inputs(6, 6)
    model = module.Model(seed=3)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    loss = model.train_step(**inputs)
    got = model.gradients()
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in start.items()}
    want = _torch_twin_loss(torch, p, inputs)
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    for name, t in p.items():
        np.testing.assert_allclose(np.asarray(got[name]), t.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    ref_loss, ref_grads = reference.gradients(graph, inputs, start)
    for name, g in ref_grads.items():
        np.testing.assert_allclose(np.asarray(got[name]), g, rtol=1e-4, atol=1e-6, err_msg=name)


def test_measured_memory_equals_plan(gated):
    graph, module, _ = gated
    memory = lowered(prepare(_gated().build())).memory
    model = module.Model(seed=0)
    for seed, n in ((1, 1), (2, 3), (3, 9)):
        inputs = _inputs(seed, n)
        model.forward(x=inputs["x"], y=inputs["y"])
        stats = model.memory_stats()
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(sympy.sympify(memory["forward_floats"]).subs({N: n}))
        model.train_step(**inputs)
        stats = model.memory_stats()
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(sympy.sympify(memory["train_floats"]).subs({N: n}))


def _error(fn):
    with pytest.raises((ModelError, ShapeError)) as e:
        dg.model(fn).build()
    return str(e.value)


def test_errors_name_the_users_line_and_values():
    def bad_broadcast():
        x = dg.input("x", (N, 4))
        z = dg.input("z", (3,))
        return x < z

    msg = _error(bad_broadcast)
    assert "'x' [N, 4]" in msg and "'z' [3]" in msg and "return x < z" in msg

    def float_condition():
        x = dg.input("x", (N, 4))
        return dg.where(x, x, 0.0)

    assert "condition 'x' must be bool" in _error(float_condition)

    def not_of_float():
        x = dg.input("x", (N, 4))
        return dg.where(dg.logical_not(x), x, 0.0)

    assert "'x' must be bool" in _error(not_of_float)

    def branches_differ():
        x = dg.input("x", (N, 4))
        return dg.cond(dg.sum(x, 1) > 0, lambda v: v, lambda v: dg.sum(v, 1, keepdims=True), x)

    msg = _error(branches_differ)
    assert "then_fn's 'x' [N, 4]" in msg and "[N, 1]" in msg and "dg.cond(" in msg

    def pred_not_per_example():
        x = dg.input("x", (N, 4))
        return dg.cond(x > 0, lambda v: v, lambda v: -v, x)

    assert "pred must be a bool tensor [N]" in _error(pred_not_per_example)

    def truth_value():
        x = dg.input("x", (N, 4))
        return x if x > 0 else -x

    def infinite_number():
        x = dg.input("x", (N, 4))
        return dg.where(x > 0, x, float("-inf"))

    assert "the number must be a finite float32, got -inf" in _error(infinite_number)

    def bool_output():
        x = dg.input("x", (N, 4))
        return {"positive": x > 0}

    assert "output 'positive'" in _error(bool_output) and "cannot be an output yet" in _error(bool_output)

    msg = _error(truth_value)
    assert "no truth value" in msg and "dg.cond" in msg and "return x if x > 0 else -x" in msg


def _cuda_emulated(graph):
    """`graph` for the CUDA target, built with DG_CUDA_EMULATE (every kernel body a
    host loop), as tests/test_cuda.py builds the op table: (its module, its files)."""
    import importlib
    import sys

    from conftest import _cache_root
    from generator.codegen.writer import write_project
    from generator.pipeline import project_files
    from test_cuda import _cmake, _digest

    files = project_files(graph, "cuda")
    defines = {"DG_CUDA_EMULATE": "ON", "CMAKE_BUILD_TYPE": "Debug", "CMAKE_CXX_FLAGS_DEBUG": "-O1",
               f"{graph.name.upper()}_EXAMPLE": "OFF"}
    where = _cache_root() / f"cuda-emulated-{graph.name}-{_digest(files, sys.version, defines)}"
    if not (where / "build" / ".ok").is_file():
        write_project(where / "src_tree", files, force=True)
        _cmake(where / "src_tree", where / "build", defines)
        (where / "build" / ".ok").write_text("ok\n")
    sys.path.insert(0, str(where / "build"))
    try:
        module = importlib.import_module(graph.name)
    finally:
        sys.path.remove(str(where / "build"))
    return module, files


@pytest.fixture(scope="module")
def gated_cuda_emulated():
    graph = _gated().build("gated_emu")
    module, files = _cuda_emulated(graph)
    return graph, module, files


def test_cuda_target_emulated_matches_reference(gated_cuda_emulated):
    graph, module, files = gated_cuda_emulated
    code = b"\n".join(data for path, data in files.items() if path.endswith((".cu", ".h")))
    assert b"dg::where(" in code and b"dg_cuda_logic.h" in code
    for seed, n, sign in ((0, 5, None), (2, 3, 1.0), (3, 1, -1.0)):
        inputs = _inputs(seed, n, sign)
        got = module.Model(seed=7).forward(x=inputs["x"], y=inputs["y"])
        want = reference.run(graph, inputs, reference.init_params(graph, seed=7))
        for name in ("picked", "logits"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    model = module.Model(seed=3)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    inputs = _inputs(6, 6)
    loss = model.train_step(**inputs)
    want_loss, want_grads = reference.gradients(graph, inputs, start)
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    for name, g in want_grads.items():
        np.testing.assert_allclose(np.asarray(model.gradients()[name]), g, rtol=1e-4, atol=1e-6, err_msg=name)


# -- cond compacted (compact=True: each branch one batched block over its examples) --


def _gated_infer(compact):
    """The gated classifier's branch, untrained: compacted or masked."""

    @dg.model
    def gated_infer():
        x = dg.input("x", (N, 4))
        confident = dg.sum(x, 1) > 0.0
        hidden, scaled = dg.cond(confident,
                                 lambda v, s: (dg.tanh(dg.dense(v, 6, name="deep")), s * 2.0),
                                 lambda v, s: (dg.relu(dg.dense(v, 6, name="shallow")), s - 1.0),
                                 x, x * 0.5, compact=compact)
        return {"logits": dg.dense(hidden, 3, name="out"), "scaled": scaled}

    return gated_infer


def test_cond_compacted_reference_matches_masked_and_numpy():
    compacted, masked = _gated_infer(True).build(), _gated_infer(False).build()
    assert [n.op for n in compacted.nodes].count("cond") == 1 and "where" not in [n.op for n in compacted.nodes]
    params = reference.init_params(masked, seed=1)
    for seed, n, sign in ((0, 5, None), (1, 3, 1.0), (2, 3, -1.0), (3, 1, None)):
        x = _inputs(seed, n, sign)["x"]
        got, want = reference.run(compacted, {"x": x}, params), reference.run(masked, {"x": x}, params)
        for name in ("logits", "scaled"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)
        np.testing.assert_allclose(got["scaled"], np.where(x.sum(1, keepdims=True) > 0, x, x * 0.5 - 1.0), rtol=1e-6)


@pytest.fixture(scope="module")
def gated_compacted(builds):
    graph = _gated_infer(True).build("gated_compacted")
    module, where = builds.module(graph)
    return graph, module, where


def test_cond_compacted_generated_matches_reference_and_plan(gated_compacted):
    graph, module, where = gated_compacted
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    assert "dg::branch_examples(" in code and "dg::where(" not in code
    assert "// The examples that take the then-branch: one batched block of their rows" in code
    assert "dg::sort_rows(x, then_examples.data(), /*rows=*/then_rows" in code
    assert "for (int64_t n" not in code  # no per-example loop
    memory = lowered(prepare(_gated_infer(True).build())).memory
    model = module.Model(seed=7)
    params = reference.init_params(graph, seed=7)
    for seed, n, sign in ((0, 5, None), (1, 1, None), (2, 3, 1.0), (3, 4, -1.0), (4, 40, None)):
        x = _inputs(seed, n, sign)["x"]
        got, want = model.forward(x=x), reference.run(graph, {"x": x}, params)
        for name in ("logits", "scaled"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
        stats = model.memory_stats()
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(
            sympy.sympify(memory["forward_floats"]).subs({N: n}))


def test_cond_compacted_row_reads_from_outside_name_the_users_line():
    def outer_batch():
        x = dg.input("x", (N, 4))
        return dg.cond(dg.sum(x, 1) > 0.0, lambda v: v + x, lambda v: v, x, compact=True)

    msg = _error(outer_batch)
    assert "'then_x' [then_rows, 4], 'x' [N, 4]" in msg and "lambda v: v + x" in msg  # pass x as an operand


def test_cond_compacted_gradient_matches_finite_differences_and_masked():
    compacted, masked = _gated(True).build(), _gated(False).build()
    assert "cond" in [n.op for n in compacted.nodes]
    params = {k: v.astype(np.float64) for k, v in reference.init_params(masked, seed=2).items()}
    for seed, n, sign in ((5, 5, None), (6, 3, 1.0), (7, 3, -1.0)):
        inputs = _inputs(seed, n, sign)
        inputs64 = dict(inputs, x=inputs["x"].astype(np.float64), y=inputs["y"].astype(np.float64))
        loss, grads = reference.gradients(compacted, inputs64, params, float_dtype=np.float64)
        want_loss, want = reference.gradients(masked, inputs64, params, float_dtype=np.float64)
        assert abs(loss - want_loss) <= 1e-12
        for name, g in want.items():
            np.testing.assert_allclose(grads[name], g, rtol=1e-10, atol=1e-12, err_msg=name)
        if sign is None:
            _check_finite_differences(compacted, inputs64, params)


@pytest.fixture(scope="module")
def gated_compact_train(builds):
    graph = _gated(True).build("gated_compact_train")
    module, where = builds.module(graph)
    return graph, module, where


def test_cond_compacted_train_step_matches_reference_twin_and_plan(gated_compact_train):
    """A trained compacted cond: train_step's loss and gradients against the reference
    and the PyTorch per-example twin (mixed, all then, all else), then several steps of
    training against the reference's; memory measured == planned, forward and train."""
    graph, module, where = gated_compact_train
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    assert "dg::branch_examples(" in code and "backward: one batched block of their rows" in code
    memory = lowered(prepare(_gated(True).build())).memory
    torch = pytest.importorskip("torch")
    for seed, n, sign in ((6, 6, None), (7, 4, 1.0), (8, 3, -1.0)):
        inputs = _inputs(seed, n, sign)
        model = module.Model(seed=3)
        start = {k: np.array(v) for k, v in model.parameters().items()}
        loss = model.train_step(**inputs)
        stats = model.memory_stats()
        assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(
            sympy.sympify(memory["train_floats"]).subs({N: n}))
        got = {k: np.asarray(v) for k, v in model.gradients().items()}
        ref_loss, ref_grads = reference.gradients(graph, inputs, start)
        assert abs(loss - ref_loss) <= 1e-5 * max(1.0, abs(ref_loss))
        for name, g in ref_grads.items():
            np.testing.assert_allclose(got[name], g, rtol=1e-4, atol=1e-6, err_msg=name)
        p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in start.items()}
        want = _torch_twin_loss(torch, p, inputs)
        want.backward()
        assert abs(loss - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
        for name, t in p.items():  # (a branch no example takes: no gradient in the twin, zeros here)
            want_grad = t.grad.numpy() if t.grad is not None else np.zeros(t.shape)
            np.testing.assert_allclose(got[name], want_grad, rtol=1e-4, atol=1e-6, err_msg=name)
    # Trained: ten steps, compacted C++ against the reference's own SGD from the same start.
    model = module.Model(seed=4)
    params = {k: np.array(v, dtype=np.float64) for k, v in model.parameters().items()}
    inputs = _inputs(9, 8)
    for _ in range(10):
        loss = model.train_step(**inputs)
        ref_loss, ref_grads = reference.gradients(graph, inputs, params, float_dtype=np.float64)
        assert abs(loss - ref_loss) <= 1e-4 * max(1.0, abs(ref_loss))
        params = {k: v - 0.1 * ref_grads[k] for k, v in params.items()}
    for name, v in model.parameters().items():
        np.testing.assert_allclose(np.asarray(v), params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    x = inputs["x"]
    np.testing.assert_allclose(model.forward(x=x, y=inputs["y"])["logits"],
                               reference.run(graph, inputs, {k: v.astype(np.float32) for k, v in params.items()})["logits"],
                               rtol=1e-4, atol=1e-5)


def test_cond_compacted_branch_returning_its_operand_passes_the_gradient_on():
    """A branch that returns its operand as it is (early exit's examples that exited, carried
    along): its backward block passes the result's gradient rows on to the operand's; the
    generated train_step's values are checked in tests/test_early_exit.py."""
    from generator.pipeline import project_files

    @dg.model
    def passes_on():
        x = dg.input("x", (N, 4))
        labels = dg.input("labels", (N,), dtype="int64")
        h = dg.dense(x, 4, name="first")
        hidden = dg.cond(dg.sum(x, 1) > 0.0, lambda v: dg.tanh(dg.dense(v, 4, name="deep")), lambda v: v, h,
                         examples=("with a positive sum", "without"))
        dg.train(dg.softmax_cross_entropy(dg.dense(hidden, 3, name="out"), labels), dg.sgd(lr=0.1))
        return {"hidden": hidden}

    code = project_files(passes_on.build())["src/model.cpp"].decode()
    block = code[code.index("// The examples without (the else-branch), backward: one batched block of their rows"):]
    block = block[: block.index("\n    }\n")]
    assert "dg::sort_rows(d_hidden, else_examples.data()" in block and "else_examples.data(), /*rows=*/else_rows" in block
    assert block.rstrip().endswith(", d_h);")  # the gradient rows written back to the operand's
    assert "// dg.cond, compacted: the examples with a positive sum, and those without, listed by index;" in code


def test_cond_examples_must_be_two_phrases():
    from generator.pipeline import project_files

    def bad(examples):
        def model():
            x = dg.input("x", (N, 4))
            return dg.cond(dg.sum(x, 1) > 0.0, lambda v: v * 2.0, lambda v: v, x, examples=examples)
        return model

    for examples in ("running", ("running",), ("running", ""), ("a\nb", "c"), ("a", 3)):
        msg = _error(bad(examples))
        assert "examples must be two phrases" in msg and "examples=examples" in msg

    @dg.model
    def masked():  # masking says it too, where it selects
        x = dg.input("x", (N, 4))
        positive = dg.sum(x, 1) > 0.0
        return dg.cond(positive, lambda v: v * 2.0, lambda v: v - 1.0, x, compact=False,
                       examples=("with a positive sum", "without"))

    code = project_files(masked.build())["src/model.cpp"].decode()
    assert "// the examples with a positive sum (positive) take " in code and ", those without " in code


def test_cond_compacted_cuda_target_emulated_matches_reference():
    """The CUDA target's cond: dg::branch_examples reads the flags back to the host and
    copies each branch's list to the device; the blocks as on the CPU."""
    graph = _gated_infer(True).build("gated_compacted_emu")
    module, files = _cuda_emulated(graph)
    code = b"\n".join(data for path, data in files.items() if path.endswith((".cu", ".h")))
    assert b"dg::branch_examples(" in code
    params = reference.init_params(graph, seed=7)
    for seed, n, sign in ((0, 5, None), (2, 3, 1.0), (3, 1, -1.0)):
        x = _inputs(seed, n, sign)["x"]
        got, want = module.Model(seed=7).forward(x=x), reference.run(graph, {"x": x}, params)
        for name in ("logits", "scaled"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    graph = _gated(True).build("gated_compact_emu")
    module, files = _cuda_emulated(graph)
    for seed, n, sign in ((6, 6, None), (7, 3, 1.0)):
        inputs = _inputs(seed, n, sign)
        model = module.Model(seed=3)
        start = {k: np.array(v) for k, v in model.parameters().items()}
        loss = model.train_step(**inputs)
        want_loss, want_grads = reference.gradients(graph, inputs, start)
        assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
        for name, g in want_grads.items():
            np.testing.assert_allclose(np.asarray(model.gradients()[name]), g, rtol=1e-4, atol=1e-6, err_msg=name)


# -- while_loop (one loop op, masked: docs/ARCHITECTURE.md "dg.while_loop is one loop") --

MAX_STEPS = 4


def _grower(traced=None):
    """`traced` gets one entry per tracing of the loop's cond and body."""

    @dg.model
    def grower():
        x = dg.input("x", (N, 3))
        labels = dg.input("labels", (N,), dtype="int64")
        w = dg.param("w", (3, 3), init=dg.normal(0, 0.6), seed=1)

        def small(s):
            h, _ = s
            (traced if traced is not None else []).append("cond")
            return dg.sum(h * h, 1) < 3.0

        def grow(s):
            h, total = s
            (traced if traced is not None else []).append("body")
            return dg.tanh(h @ w) + h, total + dg.sum(h, 1, keepdims=True)

        (h, total), steps, every = dg.while_loop(small, grow, (x, dg.sum(x, 1, keepdims=True)), MAX_STEPS,
                                                 outputs=True, names=("h", "total"))
        logits = dg.dense(h * total, 2, name="head")
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1))
        return {"logits": logits, "steps": steps, "every": every[0]}

    return grower


def _numpy_grower(p, x, module=np):
    """Each example on its own: iterate while |h|^2 < 3, at most MAX_STEPS times."""
    logits, steps, every = [], [], []
    for row in x:
        h, total, count = row[None, :], module.sum(row)[None, None] if module is np else row.sum().reshape(1, 1), 0
        kept = []
        while count < MAX_STEPS and _number((h * h).sum()) < 3.0:
            h, total = module.tanh(h @ p["w"]) + h, total + h.sum(1, keepdims=True)
            count += 1
            kept.append(h)
        logits.append((h * total) @ p["head_w"] + p["head_b"])
        steps.append(count)
        every.append(kept)
    return logits, steps, every


def _number(t) -> float:
    return float(t.detach()) if hasattr(t, "detach") else float(t)


def _grower_inputs(seed, n, scale=1.2):
    """Examples that stop at different steps; with a larger `scale`, every one of them
    before MAX_STEPS (the generated loop then ends early)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-scale, scale, (n, 3)).astype(np.float32)
    x[0] = [1.5, 1.2, 0.0]  # already done: no step
    return {"x": x, "labels": rng.integers(0, 2, n).astype(np.int64)}


def test_while_loop_is_one_loop_op_traced_once():
    traced = []
    graph = _grower(traced).build()
    assert traced == ["cond", "body"]
    loops = [n for n in graph.nodes if n.op == "recurse"]
    assert len(loops) == 1 and not any(n.op == "matmul" and n.inputs[1].name == "w" for n in graph.nodes)
    assert dict(graph.outputs)["steps"].dtype == "int64"


def test_while_loop_reference_matches_a_per_example_loop():
    graph = _grower().build()
    params = reference.init_params(graph, seed=2)
    inputs = _grower_inputs(0, 6)
    got = reference.run(graph, inputs, params)
    logits, steps, every = _numpy_grower(params, inputs["x"])
    assert len(set(steps)) >= 3, steps  # examples stop at different steps
    assert got["steps"].dtype == np.int64
    np.testing.assert_array_equal(got["steps"], np.array(steps, dtype=np.int64))
    np.testing.assert_allclose(got["logits"], np.concatenate(logits), rtol=1e-5, atol=1e-6)
    for n, kept in enumerate(every):
        want = np.zeros((MAX_STEPS, 3), np.float32)
        for t, h in enumerate(kept):
            want[t] = h[0]
        np.testing.assert_allclose(got["every"][n], want, rtol=1e-5, atol=1e-6)


def test_while_loop_gradient_matches_finite_differences():
    graph = _grower().build()
    inputs = _grower_inputs(1, 5)
    inputs64 = dict(inputs, x=inputs["x"].astype(np.float64))
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=2).items()}
    _check_finite_differences(graph, inputs64, params)


@pytest.fixture(scope="module")
def grower(builds):
    graph = _grower().build()
    module, where = builds.module(graph)
    return graph, module, where


def test_while_loop_generated_code_is_one_loop(grower):
    _, _, where = grower
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    assert "// No example is still running: the steps left would change nothing.\n" in code
    assert "if (rows == 0) break;" in code and "dg::any_running" not in code
    # compaction by index lists: the step's block is the examples still running, listed in `live`
    assert "const std::int64_t rows = dg::still_running(" in code and "live.data(), live_prev_rows.data()" in code
    assert "const std::int64_t* prev_rows = live_prev_rows.data();" in code
    assert "// examples still running take " in code and ", the others keep h_prev" in code
    forward = code[code.index("void Network::while_loop"):]
    forward = forward[: forward.index("\n}\n")]
    assert forward.count("dg::matmul(") == 1  # the body once, in the loop
    assert "for (int64_t n" not in code  # no per-example loop


def test_while_loop_generated_matches_reference_and_pytorch(grower):
    torch = pytest.importorskip("torch")
    graph, module, _ = grower
    for seed, n, scale in ((3, 1, 1.2), (4, 7, 1.2), (14, 5, 2.0)):
        inputs = _grower_inputs(seed, n, scale)
        if scale > 1.5:
            assert max(_numpy_grower(reference.init_params(graph, seed=5), inputs["x"])[1]) < MAX_STEPS
        got = module.Model(seed=5).forward(x=inputs["x"])
        want = reference.run(graph, inputs, reference.init_params(graph, seed=5))
        assert got["steps"].dtype == np.int64
        for name in ("logits", "steps", "every"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    memory = lowered(prepare(_grower().build())).memory
    for seed, scale in ((5, 1.2), (14, 2.0)):  # all stopping early: the rows past the loop's end stay zero
        _while_train_step_matches_pytorch(torch, module, memory, seed, scale)


def _while_train_step_matches_pytorch(torch, module, memory, seed, scale):
    model = module.Model(seed=6)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    inputs = _grower_inputs(seed, 6, scale)
    model.forward(x=inputs["x"])
    stats = model.memory_stats()
    assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(sympy.sympify(memory["forward_floats"]).subs({N: 6}))
    loss = model.train_step(**inputs)
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in start.items()}
    logits, steps, _ = _numpy_grower(p, torch.tensor(inputs["x"], dtype=torch.float64), module=torch)
    assert len(set(steps)) >= 2 and (max(steps) < MAX_STEPS) == (scale > 1.5), steps
    want = torch.nn.functional.cross_entropy(torch.cat(logits), torch.tensor(inputs["labels"]))
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * max(1.0, abs(want.item()))
    for name, t in p.items():
        np.testing.assert_allclose(np.asarray(model.gradients()[name]), t.grad.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
    stats = model.memory_stats()
    assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(sympy.sympify(memory["train_floats"]).subs({N: 6}))


def test_while_loop_errors_name_the_users_line():
    def symbolic_steps():
        x = dg.input("x", (N, 3))
        return dg.while_loop(lambda h: dg.sum(h, 1) < 1.0, lambda h: h + 1.0, x, N)[0]

    assert "max_steps must be a positive int" in _error(symbolic_steps)

    def cond_per_element():
        x = dg.input("x", (N, 3))
        return dg.while_loop(lambda h: h < 1.0, lambda h: h + 1.0, x, 3)[0]

    msg = _error(cond_per_element)
    assert "cond_fn must return bool [N]" in msg and "bool[N, 3]" in msg and "dg.while_loop(lambda h: h < 1.0" in msg

    def body_changes_shape():
        x = dg.input("x", (N, 3))
        return dg.while_loop(lambda h: dg.sum(h, 1) < 1.0, lambda h: dg.sum(h, 1, keepdims=True), x, 3)[0]

    assert "body_fn changes state 0's shape: 'x' [N, 3]" in _error(body_changes_shape)


def test_while_loop_cuda_target_emulated_matches_reference():
    """The CUDA target's loop (dg::still_running reads the flags back to the host and lists
    the examples still running on the device), emulated."""
    graph = _grower().build("grower_emu")
    module, files = _cuda_emulated(graph)
    code = b"\n".join(data for path, data in files.items() if path.endswith((".cu", ".h")))
    assert b"if (rows == 0) break;" in code and b"const std::int64_t rows = dg::still_running(" in code
    for seed, n, scale in ((4, 7, 1.2), (14, 5, 2.0)):
        inputs = _grower_inputs(seed, n, scale)
        got = module.Model(seed=5).forward(x=inputs["x"])
        want = reference.run(graph, inputs, reference.init_params(graph, seed=5))
        for name in ("logits", "steps", "every"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)
    model = module.Model(seed=3)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    inputs = _grower_inputs(14, 6, 2.0)
    loss = model.train_step(**inputs)
    want_loss, want_grads = reference.gradients(graph, inputs, start)
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    for name, g in want_grads.items():
        np.testing.assert_allclose(np.asarray(model.gradients()[name]), g, rtol=1e-4, atol=1e-6, err_msg=name)


def _looper(compact):
    """A while loop whose body's products the training forward loop keeps for the
    gradient (step_a): with compaction, the live examples' rows are scattered to their
    places among the step's rows."""

    @dg.model
    def looper():
        x = dg.input("x", (N, 4))
        labels = dg.input("labels", (N,), dtype="int64")
        w = dg.param("w", (4, 8), init=dg.normal(0, 0.5), seed=1)
        u = dg.param("u", (8, 4), init=dg.normal(0, 0.5), seed=2)

        def body(h):
            a = dg.sigmoid(h @ w)
            return h + dg.tanh(a @ u) * 0.5

        h, steps = dg.while_loop(lambda h: dg.sum(h * h, 1) < 4.0, body, x, 5, compact=compact)
        logits = dg.dense(h, 2, name="head")
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1))
        return {"logits": logits, "steps": steps}

    return looper


@pytest.mark.parametrize("compact", [True, False])
def test_while_loop_compacted_or_masked_trains_like_the_reference(builds, compact):
    graph = _looper(compact).build(f"looper_{'compact' if compact else 'masked'}")
    assert [v.name for n in prepare(_looper(compact).build()).nodes if n.op == "recurse"
            for v in n.attrs["spec"].kept] == ["step_a"]
    module, where = builds.module(graph)
    code = "\n".join(p.read_text() for p in (where / "src_tree").rglob("*.cpp"))
    assert ("dg::still_running(" in code) == compact and ("dg::any_running(" in code) == (not compact)
    if compact:  # the kept products of the live rows, put at their rows of the step
        assert "dg::unsort_rows(step_a.data(), live.data(), /*rows=*/rows, /*width=*/8, step_a_rows);" in code
    memory = lowered(prepare(_looper(compact).build())).memory
    rng = np.random.default_rng(21)
    x = rng.uniform(-1.5, 1.5, (7, 4)).astype(np.float32)
    x[0] = [1.5, 1.5, 0.5, 0.0]  # already done: no step
    inputs = {"x": x, "labels": rng.integers(0, 2, 7).astype(np.int64)}
    model = module.Model(seed=4)
    start = {k: np.array(v) for k, v in model.parameters().items()}
    got = model.forward(x=x)
    want = reference.run(graph, inputs, start)
    assert len(set(want["steps"].tolist())) >= 3, want["steps"]
    np.testing.assert_array_equal(got["steps"], want["steps"])
    np.testing.assert_allclose(got["logits"], want["logits"], rtol=1e-5, atol=1e-6)
    loss = model.train_step(**inputs)
    want_loss, want_grads = reference.gradients(graph, inputs, start)
    assert abs(loss - want_loss) <= 1e-5 * max(1.0, abs(want_loss))
    for name, g in want_grads.items():
        np.testing.assert_allclose(np.asarray(model.gradients()[name]), g, rtol=1e-4, atol=1e-6, err_msg=name)
    stats = model.memory_stats()
    assert stats["peak_bytes"] == stats["predicted_peak_bytes"] == 4 * int(sympy.sympify(memory["train_floats"]).subs({N: 7}))
