"""Training: the generated train_step against PyTorch (each optimizer, 10 steps,
a learning-rate change half way), against the numpy reference, and optimizer
state surviving save/load."""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg
from generator.reference import interpreter as reference

N = dg.dim("N")
STEPS = 10

OPTIMIZERS = {
    "sgd": (lambda: dg.sgd(lr=0.1), 0.01),
    "momentum": (lambda: dg.sgd(lr=0.05, momentum=0.9), 0.0),
    "adam": (lambda: dg.adam(lr=0.01), 0.001),
}


def _mlp(kind):
    make_optimizer, weight_decay = OPTIMIZERS[kind]

    def fn():
        x = dg.input("x", (N, 12))
        labels = dg.input("labels", (N,), dtype="int64")
        h1 = dg.dense(x, 16, act=dg.relu)
        h2 = dg.dense(h1, 8, act=dg.tanh)
        logits = dg.dense(h2, 4)
        loss = dg.softmax_cross_entropy(logits, labels)
        dg.train(loss, make_optimizer(), weight_decay=weight_decay)
        return {"logits": logits}

    fn.__name__ = f"train_{kind}"
    return dg.model(fn).build()


def _batches():
    rng = np.random.default_rng(0)
    return [
        {"x": rng.normal(size=(8, 12)).astype(np.float32), "labels": rng.integers(0, 4, 8).astype(np.int64)}
        for _ in range(STEPS)
    ]


@pytest.fixture(scope="module", params=list(OPTIMIZERS))
def trained(request, builds):
    graph = _mlp(request.param)
    module, _ = builds.module(graph)
    return request.param, graph, module


def _train_generated(module, batches):
    model = module.Model(seed=1)
    losses = []
    for i, batch in enumerate(batches):
        if i == STEPS // 2:
            model.lr = model.lr * 0.5
        losses.append(model.train_step(**batch))
    return model, losses


def test_matches_pytorch(trained):
    torch = pytest.importorskip("torch")
    kind, graph, module = trained
    batches = _batches()
    model, losses = _train_generated(module, batches)
    start = module.Model(seed=1).parameters()
    params = {k: torch.tensor(np.array(v), requires_grad=True) for k, v in start.items()}
    _, weight_decay = OPTIMIZERS[kind]
    hyper = graph.train.optimizer.hyper
    h = dict(hyper)
    if kind == "adam":
        opt = torch.optim.Adam(params.values(), lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                               weight_decay=weight_decay)
    else:
        opt = torch.optim.SGD(params.values(), lr=h["lr"], momentum=h.get("momentum", 0.0), weight_decay=weight_decay)
    torch_losses = []
    for i, batch in enumerate(batches):
        if i == STEPS // 2:
            for group in opt.param_groups:
                group["lr"] *= 0.5
        x = torch.tensor(batch["x"])
        h1 = torch.relu(x @ params["h1_w"] + params["h1_b"])
        h2 = torch.tanh(h1 @ params["h2_w"] + params["h2_b"])
        logits = h2 @ params["logits_w"] + params["logits_b"]
        loss = torch.nn.functional.cross_entropy(logits, torch.tensor(batch["labels"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
        torch_losses.append(loss.item())
    np.testing.assert_allclose(losses, torch_losses, rtol=1e-5, atol=1e-6)
    for name, value in model.parameters().items():
        np.testing.assert_allclose(value, params[name].detach().numpy(), rtol=1e-4, atol=1e-4, err_msg=name)


def test_matches_reference(trained):
    kind, graph, module = trained
    batches = _batches()
    model, losses = _train_generated(module, batches)
    params = reference.init_params(graph, seed=1)
    state = {}
    hyper = dict(graph.train.hyper)
    for i, batch in enumerate(batches):
        if i == STEPS // 2:
            hyper["lr"] = float(np.float32(hyper["lr"]) * np.float32(0.5))
        want = reference.train_step(graph, batch, params, state, step=i + 1, hyper=hyper)
        np.testing.assert_allclose(losses[i], want, rtol=1e-5, atol=1e-6)
    for name, value in model.parameters().items():
        np.testing.assert_allclose(value, params[name], rtol=1e-4, atol=1e-5, err_msg=name)
    for key, value in model.optimizer_state().items():
        np.testing.assert_allclose(value, state[key], rtol=1e-4, atol=1e-5, err_msg=key)
    assert model.step == STEPS


def test_gradients_are_those_of_the_last_step(trained):
    kind, graph, module = trained
    batch = _batches()[0]
    model = module.Model(seed=1)
    assert all(not v.any() for v in model.gradients().values())
    start = {k: np.array(v) for k, v in model.parameters().items()}
    model.train_step(**batch)
    _, want = reference.gradients(graph, batch, start)
    for name, value in model.gradients().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_optimizer_state_survives_save_and_load(trained, tmp_path):
    kind, graph, module = trained
    batches = _batches()
    a = module.Model(seed=1)
    for batch in batches[:3]:
        a.train_step(**batch)
    a.save(str(tmp_path / "ckpt.npz"))
    b = module.Model(seed=2)
    b.load(str(tmp_path / "ckpt.npz"))
    assert b.step == a.step == 3
    for batch in batches[3:6]:
        assert a.train_step(**batch) == b.train_step(**batch)
    for name, value in a.parameters().items():
        np.testing.assert_array_equal(value, b.parameters()[name])
    # A file with parameters only resets the optimizer, and says so.
    np.savez(tmp_path / "params.npz", **{k: np.array(v) for k, v in a.parameters().items()})
    with pytest.warns(UserWarning, match="holds no optimizer state: the model's optimizer state and step were reset"):
        b.load(str(tmp_path / "params.npz"))
    assert b.step == 0 and all(not v.any() for v in b.optimizer_state().values())


def test_train_step_input_errors(trained):
    kind, graph, module = trained
    batch = _batches()[0]
    model = module.Model()
    with pytest.raises(ValueError, match="missing input 'labels'"):
        model.train_step(x=batch["x"])
    with pytest.raises(ValueError, match=r"label 4 at position 0 is out of range \[0, 4\)"):
        model.train_step(x=batch["x"], labels=np.full(8, 4, np.int64))
    with pytest.raises(ValueError, match="input 'labels': dimension 0 is N"):
        model.train_step(x=batch["x"], labels=batch["labels"][:5])
    before = {k: np.array(v) for k, v in model.parameters().items()}
    assert model.step == 0 and all(np.array_equal(before[k], v) for k, v in model.parameters().items())
    # forward() takes the labels too (and ignores them), so one batch dict serves both.
    assert model.forward(**batch)["logits"].shape == (8, 4)


def test_decayed_optimizer_state_is_flushed_to_zero(trained):
    """Where a step's gradient is exactly 0 (a ReLU unit no row of the batch turns on),
    a subnormal momentum buffer or Adam moment would decay into the subnormals and stay
    there (slow on Intel cores): it becomes 0, in the generated update and the reference."""
    kind, graph, module = trained
    if kind == "sgd":
        pytest.skip("plain SGD keeps no state")
    model = module.Model(seed=1)
    model.weight_decay = 0.0  # else every gradient has the weight's share
    model.allocate_training_state()
    tiny = np.float32(1e-39)  # subnormal: 2^-126 is 1.18e-38
    for view in model.optimizer_state().values():
        view[...] = tiny
    before_state = {k: np.array(v) for k, v in model.optimizer_state().items()}
    before = {k: np.array(v) for k, v in model.parameters().items()}
    batch = {k: v[:1] for k, v in _batches()[0].items()}  # one row: about half the units stay off
    model.train_step(**batch)
    hyper = {name: getattr(model, name) for name, _ in graph.train.hyper}
    state, zero_grads = model.optimizer_state(), 0
    for name, g in model.gradients().items():
        slots = {k.split("/")[1]: v for k, v in before_state.items() if k.startswith(name + "/")}
        want_w, want_slots = graph.train.optimizer.apply(before[name], np.array(g), slots, hyper, step=1)
        for slot, want in want_slots.items():
            got = state[f"{name}/{slot}"]
            dead = np.asarray(g) == 0
            zero_grads += int(dead.sum())
            assert (got[dead] == 0).all() and (want[dead] == 0).all(), f"{name}/{slot}"
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30, err_msg=f"{name}/{slot}")
        np.testing.assert_allclose(model.parameters()[name], want_w, rtol=1e-5, atol=1e-7, err_msg=name)
    assert zero_grads > 0  # the batch did leave units off
