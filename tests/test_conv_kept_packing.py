"""A convolution's weight kept packed between calls (#40).

Convolutions with small output planes (dg_conv.h: conv_detail::small_plane) run
one product over the whole batch by the transposed weight. In the forward pass
they read the Model's kept packing of it (dg::KeptPackedB, the mechanism Linear
layers use: runtime/dg_packed_weights.h), packed at the first call and kept until
a parameter changes; the packing is counted in memory_stats and may stand in for
the stored weight. The oracle is PyTorch on a copy of the parameters.
"""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg

torch = pytest.importorskip("torch")
F = torch.nn.functional

N = dg.dim("N")


@dg.model
def small_plane_convs():
    # 4x4 -> 2x2 (im2col, 3x3 stride 2), then a 3x3 conv at 2x2 whose weight (520 x 576
    # floats) is over dg_conv.h's kSmallPlaneWeight: both small planes, both packings kept;
    # a grouped one keeps reading its weight as stored (one group only reads a packing).
    x = dg.input("x", (N, 8, 4, 4))
    labels = dg.input("labels", (N,), dtype="int64")
    h = dg.conv2d_layer(x, 64, 3, stride=2, padding=1, act=dg.relu, name="c1")
    h = dg.conv2d_layer(h, 520, 3, padding=1, name="c2")
    h = dg.conv2d_layer(h, 12, 1, groups=2, bias=False, name="c3")
    logits = dg.dense(dg.flatten(h), 5, name="logits")
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.05))
    return {"logits": logits}


def oracle(p, x):
    t = {k: torch.from_numpy(v) for k, v in p.items()}
    h = F.relu(F.conv2d(torch.from_numpy(x), t["c1_weight"], t["c1_bias"], stride=2, padding=1))
    h = F.conv2d(h, t["c2_weight"], t["c2_bias"], padding=1)
    h = F.conv2d(h, t["c3_weight"], groups=2)
    return (h.flatten(1) @ t["logits_w"] + t["logits_b"]).numpy()


@pytest.fixture(scope="module")
def built(builds):
    return builds.module(small_plane_convs.build("small_plane_convs"))


def params(model):
    return {k: v.copy() for k, v in model.parameters().items()}


def check(model, x):
    p = params(model)
    for rows in (1, 2, 5, len(x)):
        np.testing.assert_allclose(model.forward(x=x[:rows])["logits"], oracle(p, x[:rows]), rtol=1e-4, atol=1e-5)


def inputs(rows=9, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 8, 4, 4)).astype(np.float32), rng.integers(0, 5, rows)


def test_small_plane_convolutions_read_kept_packings(built):
    module, where = built
    code = (where / "src_tree" / "src" / "model.cpp").read_text()
    assert "c1_weight_t_packed" in code and "c2_weight_t_packed" in code
    assert "c3_weight_t_packed" not in code  # two groups: read as stored
    model = module.Model(seed=1)
    model.keep_plain_weights = True
    x, _ = inputs()
    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(model, x)
    held = model.memory_stats()["packed_weight_bytes"]
    assert held >= 4 * (64 * 72 + 520 * 576 + 48 * 5)  # both conv weights and the dense layer's
    check(model, x)
    assert model.memory_stats()["packed_weight_bytes"] == held  # kept, not packed again


def test_training_and_views_reach_the_next_call(built):
    module, _ = built
    model = module.Model(seed=2)
    x, labels = inputs(seed=3)
    check(model, x)
    model.train_step(x=x, labels=labels)  # the step reads the weights as stored
    check(model, x)
    model.parameters()["c1_weight"][0, 0, 1, 1] += 1.0  # a view's write counts as a change
    check(model, x)


def test_packed_conv_weights_held_once_and_written_back(built):
    module, _ = built
    model, twin = module.Model(seed=4), module.Model(seed=4)
    twin.keep_plain_weights = True
    assert not model.keep_plain_weights
    x, _ = inputs(seed=5)
    np.testing.assert_array_equal(model.forward(x=x)["logits"], twin.forward(x=x)["logits"])
    conv_bytes = 4 * (64 * 72 + 520 * 576)
    stats, twin_stats = model.memory_stats(), twin.memory_stats()
    assert stats["parameter_bytes"] <= twin_stats["parameter_bytes"] - conv_bytes  # the packings stand in
    for name, value in model.parameters().items():  # written back bit for bit
        np.testing.assert_array_equal(value, twin.parameters()[name])
    np.testing.assert_array_equal(model.forward(x=x)["logits"], twin.forward(x=x)["logits"])
