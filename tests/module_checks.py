"""Checks of a compiled model module's Python API against the reference, shared by
every target's tests (test_examples.py for the CPU, test_cuda.py for CUDA): the
API is the same whichever target built the module."""

from __future__ import annotations

import re

import numpy as np
import pytest

from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs


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
    model = module.Model(seed=11)
    params = dict(model.parameters())
    assert list(params) == [p.name for p in graph.trainable]
    if graph.states:  # batch norm's running statistics
        assert list(model.buffers()) == [p.name for p in graph.states]
        params.update(model.buffers())
    want = reference.init_params(graph, seed=11)
    assert set(want) == set(params)
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
    state = {k: np.array(v) for k, v in model.buffers().items()} if graph.states else {}
    want = reference.run(graph, inputs, params=dict(new, **state))
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


def _unaligned(a):
    """The same values at an address one byte off the dtype's alignment."""
    raw = np.zeros(a.nbytes + 1, np.uint8)[1:]
    out = raw.view(a.dtype).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned
    return out


def check_bad_inputs(graph, module):
    """Wrong dtype, rank, layout, names or type: a ValueError naming the input."""
    model = module.Model()
    good = sample_inputs(graph)
    name, value = next(iter(good.items()))
    declared = next(v.shape for v in graph.inputs if v.name == name)
    every = re.escape(", ".join(v.name for v in graph.inputs))  # the messages list the model's inputs
    cases = {
        "wrong dtype": (dict(good, **{name: value.astype(np.float16)}),
                        f"expected dtype {value.dtype}, got float16 \\(convert with .astype\\(np.{value.dtype}\\)\\)"),
        "wrong rank": (dict(good, **{name: value[..., None]}), "expected %d dimensions" % len(declared)),
        "not contiguous": (dict(good, **{name: np.repeat(value, 2, axis=-1)[..., ::2]}), "C-contiguous"),
        "unknown": (dict(good, bogus=value), f"unknown input 'bogus'; the model's inputs are: {every}$"),
        "missing": ({k: v for k, v in good.items() if k != name}, f"missing input '{name}'; .* {every}$"),
        "not an array": (dict(good, **{name: value.tolist()}), f"expected a numpy array of {value.dtype} with shape"),
        "unaligned": (dict(good, **{name: _unaligned(value)}), "not aligned"),
    }
    for what, (inputs, message) in cases.items():
        with pytest.raises(ValueError, match=message) as error:
            model.forward(**inputs)
        assert name in str(error.value) or what == "unknown", what


def state_of(model) -> dict:
    """Everything a Model keeps between calls, copied: parameters, module state (running
    statistics, the mode and its draw count), optimizer state, step."""
    state = {k: np.array(v) for k, v in model.parameters().items()}
    if hasattr(model, "buffers"):
        state.update({f"buffer/{k}": np.array(v) for k, v in model.buffers().items()})
    state["training"] = model.training  # every module has the flag (#37); draws only with dropout/batch norm
    if hasattr(model, "draws"):
        state["draws"] = model.draws
    if hasattr(model, "train_step"):
        state.update({f"optimizer/{k}": np.array(v) for k, v in model.optimizer_state().items()})
        state["step"] = model.step
        state["hyper"] = model.hyperparameters()
    return state


def assert_same_state(before, after):
    assert before.keys() == after.keys()
    for k in before:
        if isinstance(before[k], np.ndarray):
            np.testing.assert_array_equal(before[k], after[k], err_msg=k)
        else:
            assert before[k] == after[k], k


def check_load_validates_everything_first(graph, module, tmp_path):
    """load() refuses, before changing anything: non-float arrays, values beyond
    float32, non-finite values, unexpected arrays, a bad optimizer/step, .npy and
    text files; and finds the x.npz that save("x") wrote."""
    model = module.Model(seed=3)
    if hasattr(model, "train_step"):  # some optimizer state worth keeping
        model.train_step(**sample_inputs(graph))
    model.save(str(tmp_path / "w"))  # numpy adds .npz
    saved = dict(np.load(tmp_path / "w.npz"))
    first = next(iter(saved))
    other = module.Model(seed=4)
    before = state_of(other)
    big = saved[first].astype(np.float64)
    big.flat[0] = 1e300
    nan = saved[first].copy()
    nan.flat[-1] = np.nan
    cases = {
        "ints": ({first: saved[first].astype(np.int32)}, "expected a float array"),
        "overflow": ({first: big}, "beyond float32's range"),
        "nan": ({first: nan}, "non-finite"),
        "extra": ({"bogus": np.zeros(2, np.float32)}, "unexpected array 'bogus'"),
    }
    if "optimizer/step" in saved:
        cases.update({
            "fractional step": ({"optimizer/step": np.float64(2.5)}, "whole number"),
            "negative step": ({"optimizer/step": np.int64(-1)}, ">= 0"),
            "last step": ({"optimizer/step": np.int64(2**63 - 1)}, "below 2\\*\\*63"),
            "step array": ({"optimizer/step": np.arange(2)}, "scalar"),
            "text step": ({"optimizer/step": np.array("one")}, "must be an integer"),
        })
        state_keys = [k for k in saved if k.startswith("optimizer/") and k != "optimizer/step"]
        if state_keys:  # plain SGD keeps no state but the step
            cases["bad state last"] = ({state_keys[-1]: np.zeros((1,), np.float32)}, "has shape")
    for what, (change, message) in cases.items():
        np.savez(tmp_path / "bad.npz", **dict(saved, **change))
        with pytest.raises(ValueError, match=message):
            other.load(str(tmp_path / "bad.npz"))
        assert_same_state(before, state_of(other))
    np.save(tmp_path / "one.npy", saved[first])
    with pytest.raises(ValueError, match=r"single array \(\.npy\)"):
        other.load(str(tmp_path / "one.npy"))
    (tmp_path / "notes.txt").write_text("not weights\n")
    with pytest.raises(ValueError, match="not an .npz archive"):
        other.load(str(tmp_path / "notes.txt"))
    with pytest.raises(FileNotFoundError, match="nope"):
        other.load(str(tmp_path / "nope"))
    assert_same_state(before, state_of(other))
    other.load(str(tmp_path / "w"))
    # What a file carries: not the mode or its draw count (PyTorch's state_dict keeps neither).
    saved_state, loaded_state = state_of(model), state_of(other)
    for k in ("training", "draws"):
        saved_state.pop(k, None), loaded_state.pop(k, None)
    assert_same_state(saved_state, loaded_state)


def check_hyperparameters_are_validated(module):
    """Setting a hyperparameter out of range is a ValueError that changes nothing."""
    model = module.Model()
    before = model.hyperparameters()
    bad = {"lr": [float("nan"), -0.1, float("inf"), 1e300], "momentum": [-1.0, float("nan")],
           "beta1": [1.0, -0.5], "beta2": [1.5], "eps": [0.0, -1e-8], "weight_decay": [-1.0, float("inf")]}
    for name in before:
        for value in bad[name]:
            with pytest.raises(ValueError, match=name):
                setattr(model, name, value)
    for step in (-1, 2**63 - 1):  # a step count train_step could not add one to
        with pytest.raises(ValueError, match="step"):
            model.step = step
    assert model.hyperparameters() == before and model.step == 0
    model.lr = 0.0  # zero is a valid learning rate
    assert model.lr == 0.0


def _inputs_the_loss_computes_with(graph) -> set:
    """The float inputs whose values reach the loss through float values: a NaN in one makes
    the loss NaN. One that only decides comparisons (early_exit's threshold picks each
    example's branch) does not: its path to the loss goes through a bool."""
    seen, found, stack = set(), set(), [graph.train.loss]
    while stack:
        v = stack.pop()
        if id(v) in seen or v.dtype != "float32":
            continue
        seen.add(id(v))
        if v.kind == "input":
            found.add(v.name)
        if v.producer is not None:
            stack.extend(v.producer.inputs)
    return found


def check_non_finite_loss_changes_nothing(graph, module):
    """A train_step whose loss is NaN or inf raises NonFiniteLossError (a
    ValueError) naming the step, and changes nothing; training then goes on."""
    model = module.Model(seed=1)
    inputs = sample_inputs(graph)
    model.train_step(**inputs)
    floats = [k for k, v in inputs.items() if v.dtype == np.float32 and k in _inputs_the_loss_computes_with(graph)]
    # Poison a float input the loss computes with; a model with none (a tree batch is ints) gets a poisoned
    # parameter instead, through its view, put back afterwards.
    # (The view stays alive while it is used: the CUDA target uploads a parameter's host
    # copy only while a view of it exists.)
    view = None if floats else next(iter(model.parameters().values()))
    kept = None if floats else np.array(view)
    for poison in (np.nan, np.inf):
        bad = dict(inputs)
        if floats:
            bad[floats[0]] = np.full_like(inputs[floats[0]], poison)
        else:
            view[...] = poison
        before = state_of(model)
        with pytest.raises(module.NonFiniteLossError, match=r"train_step 2: the loss is (nan|inf); nothing was updated"):
            model.train_step(**bad)
        assert_same_state(before, state_of(model))
    if not floats:
        view[...] = kept  # (uploaded by the next call, while the view lives)
    assert issubclass(module.NonFiniteLossError, ValueError)
    assert np.isfinite(model.train_step(**inputs)) and model.step == 2


def check_threads_share_a_model(graph, module, threads=4, steps=100):
    """One Model, many threads: 4 x 100 train_steps on one batch give bit-identical
    parameters to 400 sequential steps, and every forward() that overlaps a
    training loop returns the outputs of some whole number of steps."""
    import threading

    inputs = sample_inputs(graph)
    sequential, shared = module.Model(seed=2), module.Model(seed=2)
    for _ in range(threads * steps):
        sequential.train_step(**inputs)

    def train():
        for _ in range(steps):
            shared.train_step(**inputs)

    workers = [threading.Thread(target=train) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert shared.step == threads * steps
    assert_same_state(state_of(sequential), state_of(shared))

    forward_names = [v.name for v in graph.inputs if v.name in _forward_input_names(graph)]
    fwd = {k: inputs[k] for k in forward_names}
    rounds = 40
    reference_model = module.Model(seed=3)
    if hasattr(reference_model, "eval"):  # a training-mode forward() changes the model: readers evaluate
        reference_model.eval()
    expected = [reference_model.forward(**fwd)]
    for _ in range(rounds):
        reference_model.train_step(**inputs)
        expected.append(reference_model.forward(**fwd))
    model, seen, done = module.Model(seed=3), [], threading.Event()
    if hasattr(model, "eval"):
        model.eval()

    def read():
        while not done.is_set():
            seen.append(model.forward(**fwd))

    readers = [threading.Thread(target=read) for _ in range(2)]
    for r in readers:
        r.start()
    for _ in range(rounds):
        model.train_step(**inputs)
    done.set()
    for r in readers:
        r.join()
    assert seen, "no forward() overlapped the training loop"
    for out in seen:
        assert any(all(np.array_equal(out[k], e[k]) for k in out) for e in expected), "a torn forward()"


def _forward_input_names(graph):
    from generator.transforms.autodiff import train_only_inputs

    training_only = {v.name for v in train_only_inputs(graph)} if graph.train is not None else set()
    return {v.name for v in graph.inputs} - training_only


def check_train_steps(graph, module, steps: int = 3):
    """train_step() `steps` times (losses), then every parameter, against the reference's steps."""
    model, params, state = module.Model(seed=2), reference.init_params(graph, seed=2), {}
    for step in range(1, steps + 1):
        batch = sample_inputs(graph, seed=10 + step)
        want = reference.train_step(graph, batch, params, state, step=step)
        np.testing.assert_allclose(model.train_step(**batch), want, rtol=1e-5, atol=1e-6)
    for key, value in model.parameters().items():
        np.testing.assert_allclose(value, params[key], rtol=1e-4, atol=1e-5, err_msg=key)
