"""Convolutional networks against PyTorch: the CNN examples (LeNet, ResNet-18, VGG-11)
with weights copied from the generated Model into PyTorch twins (tests/torch_models.py),
forward and train_step compared, a few optimizer steps tracked; PyTorch's train/eval
modes (batch norm, dropout) against the reference; LeNet trained on the digits."""

from __future__ import annotations

import copy
import runpy

import numpy as np
import pytest

import generator as dg
from conftest import ROOT, load_example
from generator.reference import interpreter as reference

torch = pytest.importorskip("torch")
from torch.nn import functional as F  # noqa: E402

from torch_models import DENSE, TWINS, copy_into_torch, torch_grads  # noqa: E402

BATCH = {"lenet": 5, "resnet18": 2, "vgg11": 2}


def _close(got, want, what, rtol=1e-4, floor=1e-12):
    """Equal to rtol relative to the array's largest magnitude (float32 sums differ in
    order), or to `floor` for an array that is zero but for rounding (the gradient of a
    convolution's bias under batch norm, which removes it)."""
    err = _error(got, want, floor)
    assert err <= rtol, f"{what}: max error {err:.2e} of the largest magnitude {max(np.abs(want).max(), floor):.3g}"


def _error(got, want, floor=1e-12) -> float:
    """The largest difference relative to the largest magnitude of `want` (at least `floor`)."""
    scale = max(float(np.abs(want).max()), floor)
    return float(np.abs(np.asarray(got, np.float64) - want).max()) / scale


def _setup(name, builds, seed=3):
    graph = load_example(name).build()
    module, _ = builds.module(graph)
    model = module.Model(seed=seed)
    buffers = {k: v.copy() for k, v in model.buffers().items()} if hasattr(model, "buffers") else {}
    net = TWINS[name]()
    copy_into_torch(net, {k: v.copy() for k, v in model.parameters().items()}, buffers, DENSE.get(name, ()))
    rng = np.random.default_rng(seed)
    shape = (BATCH[name],) + tuple(graph.inputs[0].shape[1:])
    images = rng.normal(size=shape).astype(np.float32)
    labels = rng.integers(0, 10, BATCH[name]).astype(np.int64)
    return graph, model, net, images, labels


def _logits(name, model, images):
    out = model.forward(images=images)
    return np.log(out["probs"]) if "probs" in out else out["logits"]


@pytest.mark.parametrize("name", ["lenet", "resnet18", "vgg11"])
def test_forward_and_train_step_equal_pytorch(name, builds):
    graph, model, net, images, labels = _setup(name, builds)
    x, y = torch.tensor(images), torch.tensor(labels)
    net.train()
    want = net(x)
    got = _logits(name, model, images)
    if name == "lenet":
        want = F.log_softmax(want, dim=1)
    _close(got, want.detach().numpy(), f"{name} forward (training mode)")
    if hasattr(model, "buffers"):  # the forward moved the running statistics, as PyTorch's did
        state = net.state_dict()
        for k, v in model.buffers().items():
            torch_key = next(t for t in state if t.replace(".", "_") == k)
            _close(v, state[torch_key].numpy(), f"{name} {k} after forward", 1e-5)

    exact = copy.deepcopy(net).double()  # the same twin, after the same forward, in float64
    loss = model.train_step(images=images, labels=labels)
    net.zero_grad()
    torch_loss = F.cross_entropy(net(x), y)
    torch_loss.backward()
    assert abs(loss - torch_loss.item()) <= 1e-4 * abs(torch_loss.item()), (loss, torch_loss.item())
    F.cross_entropy(exact(x.double()), y).backward()
    dense = DENSE.get(name, ())
    want_grads, torch32 = torch_grads(exact, dense), torch_grads(net, dense)
    got_grads = model.gradients()
    assert set(got_grads) == set(want_grads)
    # Through many batch norms and relus a float32 gradient is only as close to the exact
    # one as the problem's conditioning allows (a relu input within rounding of zero flips):
    # ours must be as close as PyTorch's own float32 gradient is, or within 2e-4.
    def worst(grads):
        return max(_error(grads[k], want_grads[k], floor=1e-2) for k in want_grads)

    allowed = max(2e-4, 3 * worst(torch32))
    for k, g in got_grads.items():
        _close(g, want_grads[k], f"{name} d loss / d {k} (PyTorch float32 is within {worst(torch32):.1e})",
               allowed, floor=1e-2)


@pytest.mark.parametrize("name", ["lenet", "resnet18", "vgg11"])
def test_optimizer_steps_track_pytorch(name, builds):
    graph, model, net, images, labels = _setup(name, builds, seed=5)
    model.lr = 0.01  # a batch of 5 or 2: the examples' rates are for real batches
    hyper = model.hyperparameters()
    if graph.train.optimizer.kind == "adam":
        opt = torch.optim.Adam(net.parameters(), lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]),
                               eps=hyper["eps"])
    else:
        opt = torch.optim.SGD(net.parameters(), lr=hyper["lr"])
    x, y = torch.tensor(images), torch.tensor(labels)
    ours, theirs = [], []
    for _ in range(4):
        ours.append(model.train_step(images=images, labels=labels))
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        theirs.append(loss.item())
    np.testing.assert_allclose(ours, theirs, rtol=2e-3, atol=1e-5)
    assert ours[-1] < ours[0]


N = dg.dim("N")


@dg.model
def modes():
    x = dg.input("x", (N, 2, 5, 5))
    v = dg.input("v", (N, 3))
    conv = dg.conv2d_layer(x, 3, 3, padding=1)
    bn = dg.batch_norm_layer(conv, momentum=0.3)
    return {"y": dg.dropout(dg.relu(bn), 0.4), "flat": dg.flatten(bn), "v": dg.batch_norm_layer(v, name="vbn")}


def test_train_and_eval_modes_behave_as_pytorch(builds, tmp_path):
    graph = modes.build()
    module, _ = builds.module(graph)
    m = module.Model(seed=2)
    assert m.training and m.draws == 0
    x = np.random.default_rng(0).normal(size=(4, 2, 5, 5)).astype(np.float32)
    v = np.random.default_rng(1).normal(size=(4, 3)).astype(np.float32)
    params = {**{k: v.copy() for k, v in m.parameters().items()}, **{k: v.copy() for k, v in m.buffers().items()}}
    assert set(m.buffers()) == {"bn_running_mean", "bn_running_var", "vbn_running_mean", "vbn_running_var"}
    for draw in range(2):  # training mode: batch statistics, a new dropout mask each call
        got = m.forward(x=x, v=v)
        want = reference.run(graph, {"x": x, "v": v}, params, seed=2, draw=draw)
        np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(m.buffers()["bn_running_var"], params["bn_running_var"], rtol=1e-6)
    assert m.draws == 2
    assert m.eval() is m and not m.training
    got = m.forward(x=x, v=v)
    want = reference.run(graph, {"x": x, "v": v}, params, training=False)
    np.testing.assert_allclose(got["y"], want["y"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["y"], np.maximum(got["flat"].reshape(x.shape[0], 3, 5, 5), 0), rtol=1e-6)
    assert m.draws == 2  # evaluation draws nothing
    conv_w = torch.tensor(m.parameters()["conv_weight"])
    rm, rv = (torch.tensor(m.buffers()[k].copy()) for k in ("bn_running_mean", "bn_running_var"))
    bn = F.batch_norm(F.conv2d(torch.tensor(x), conv_w, torch.tensor(m.parameters()["conv_bias"]), padding=1),
                      rm, rv, torch.tensor(m.parameters()["bn_weight"]), torch.tensor(m.parameters()["bn_bias"]))
    np.testing.assert_allclose(got["flat"], bn.flatten(1).numpy(), rtol=1e-5, atol=1e-5)
    m.buffers()["bn_running_mean"][...] = 7.0  # writable views
    m.save(str(tmp_path / "m.npz"))
    other = module.Model(seed=9).train(False)
    other.load(str(tmp_path / "m.npz"))
    np.testing.assert_array_equal(other.buffers()["bn_running_mean"], np.full(3, 7.0, np.float32))
    np.testing.assert_array_equal(other.forward(x=x, v=v)["y"], m.forward(x=x, v=v)["y"])
    m.train()
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        m.forward(x=x[:1], v=v[:1])  # vbn has one value per channel


def test_conv_errors_name_the_input_and_the_shapes():
    @dg.model
    def small():
        x = dg.input("x", (N, 3, 4, 4))
        return {"y": dg.conv2d_layer(x, 2, 5, name="c")}

    with pytest.raises(dg.ShapeError, match=r"input 'x' \[N, 3, 4, 4\] is too small.*5x5"):
        small.build()

    @dg.model
    def channels_last():
        x = dg.input("x", (N, 8, 8, 3))
        w = dg.param("w", (4, 3, 3, 3))
        return {"y": dg.conv2d(x, w)}

    with pytest.raises(dg.ShapeError, match=r"has 8 channels but weight 'w' \[4, 3, 3, 3\] expects 3.*NCHW"):
        channels_last.build()


def test_lenet_trains_to_97_percent_on_digits(builds):
    pytest.importorskip("sklearn")
    example = runpy.run_path(str(ROOT / "examples" / "lenet.py"))
    module, _ = builds.module(example["lenet"].build())
    lines = []
    accuracy = example["train"](module, log=lines.append)
    assert accuracy >= 0.97, lines[-3:]
