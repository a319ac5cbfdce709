"""What a Model holds between calls (#20 items 0 and 5).

Weights kept packed (runtime/dg_packed_weights.h): a forward-pass product by a
parameter reads the Model's kept packing of it; every way of changing a parameter
must reach the next call: a numpy view (alive or released), train_step,
compute_gradients + apply_update, load; concurrent forward() calls share one
packing; training steps do not keep packings. The oracle is numpy on a copy of
the parameters.

Training state allocated lazily: gradients and optimizer state take memory at the
first training call (or on request), not in the constructor; save/load round-trip
it either way.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import generator as dg

N = dg.dim("N")


@dg.model
def packed_mlp():
    # Both layouts: a row-major [in, out] weight (dg.dense) and a PyTorch [out, in]
    # one (linear_t reads it transposed), with a training step.
    x = dg.input("x", (N, 40))
    labels = dg.input("labels", (N,), dtype="int64")
    h = dg.dense(x, 48, act=dg.relu)
    fc_weight = dg.param("fc_weight", (24, 48), init=dg.normal(0, 0.2))
    fc_bias = dg.param("fc_bias", (24,), init=dg.constant(0.1))
    g = dg.tanh(dg.linear_t(h, fc_weight, fc_bias))
    logits = dg.dense(g, 5)
    dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.05, momentum=0.9))
    return {"logits": logits}


def oracle(p, x):
    h = np.maximum(x @ p["h_w"] + p["h_b"], 0)
    g = np.tanh(h @ p["fc_weight"].T + p["fc_bias"])
    return g @ p["logits_w"] + p["logits_b"]


@pytest.fixture(scope="module")
def module(builds):
    mod, _ = builds.module(packed_mlp.build("packed_mlp"))
    return mod


def params(model):
    return {k: v.copy() for k, v in model.parameters().items()}


def check(model, x):
    """forward() against numpy on the current parameters, at several batch sizes
    (1-3 rows stream row-major weights, more read the packing)."""
    p = params(model)
    for rows in (1, 2, 5, len(x)):
        got = model.forward(x=x[:rows])["logits"]
        np.testing.assert_allclose(got, oracle(p, x[:rows]), rtol=1e-4, atol=1e-5)


def inputs(rows=33, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, 40)).astype(np.float32), rng.integers(0, 5, rows)


def test_forward_packs_once_and_release_frees(module):
    model = module.Model(3)
    x, _ = inputs()
    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(model, x)
    held = model.memory_stats()["packed_weight_bytes"]
    # op(h_w) [40, 48], op(fc_weight) = fc_weight^T [48, 24], op(logits_w) [24, 5]: at least their floats
    assert held >= 4 * (40 * 48 + 48 * 24 + 24 * 5)
    check(model, x)
    assert model.memory_stats()["packed_weight_bytes"] == held  # kept, not packed again elsewhere
    model.release_packed_weights()
    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(model, x)


def test_writes_through_views_reach_the_next_call(module):
    model = module.Model(4)
    x, _ = inputs()
    check(model, x)  # packings made
    views = model.parameters()  # held: products read the weights in place meanwhile
    views["h_w"][:5] *= -1.5
    views["fc_weight"][3, :] = 0.25
    check(model, x)
    views["logits_w"] += 0.5
    check(model, x)
    del views  # released: counts as a change, the packings are made again
    check(model, x)
    model.parameters()["fc_weight"][:] *= 0.5  # a temporary view, written and dropped at once
    check(model, x)


def test_training_and_load_reach_the_next_call(module, tmp_path):
    model = module.Model(5)
    x, labels = inputs()
    check(model, x)
    before = params(model)
    model.train_step(x=x, labels=labels)
    assert not np.allclose(before["fc_weight"], params(model)["fc_weight"])
    check(model, x)
    model.compute_gradients(x=x, labels=labels)
    check(model, x)  # compute_gradients changes nothing
    model.apply_update()
    check(model, x)
    model.save(str(tmp_path / "w.npz"))
    other = module.Model(6)
    check(other, x)
    other.load(str(tmp_path / "w.npz"))
    check(other, x)
    np.testing.assert_array_equal(other.forward(x=x)["logits"], model.forward(x=x)["logits"])


def test_same_results_packed_or_not(module):
    """A product reads the same numbers whether the weights are packed or read in
    place (a view alive): same sums in the same order at 5+ rows."""
    model = module.Model(7)
    x, _ = inputs(64)
    packed = model.forward(x=x)["logits"]
    views = model.parameters()
    unpacked = model.forward(x=x)["logits"]
    del views
    np.testing.assert_array_equal(packed, unpacked)


def test_concurrent_forwards_share_the_packing(module):
    model = module.Model(8)
    x, _ = inputs(40)
    model.parameters()["h_w"][:] *= 1.0  # a change: the first calls below pack
    expected = oracle(params(model), x)
    results, errors = [], []

    def work():
        try:
            for _ in range(20):
                results.append(model.forward(x=x)["logits"])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(results) == 80
    for r in results:
        np.testing.assert_allclose(r, expected, rtol=1e-4, atol=1e-5)


def test_training_steps_keep_no_packing(module):
    model = module.Model(9)
    x, labels = inputs()
    model.train_step(x=x, labels=labels)
    model.compute_gradients(x=x, labels=labels)
    model.apply_update()
    assert model.memory_stats()["packed_weight_bytes"] == 0
    check(model, x)
    assert model.memory_stats()["packed_weight_bytes"] > 0


def training_state_floats(model):
    return sum(v.size for v in model.parameters().values()) + sum(
        v.size for v in model.optimizer_state().values())


def test_training_state_is_allocated_when_training_starts(module, tmp_path):
    model = module.Model(10)
    x, labels = inputs()
    assert model.memory_stats()["training_state_bytes"] == 0
    model.forward(x=x)
    model.save(str(tmp_path / "fresh.npz"))  # optimizer state saved as zeros, still not allocated
    assert model.memory_stats()["training_state_bytes"] == 0
    saved = np.load(tmp_path / "fresh.npz")
    assert all(not saved[k].any() for k in saved.files if k.startswith("optimizer/") and k != "optimizer/step")
    weights_only = tmp_path / "weights.npz"
    np.savez(weights_only, **model.parameters())
    model.load(str(weights_only))  # no optimizer state in the file: nothing to allocate
    assert model.memory_stats()["training_state_bytes"] == 0

    trained = module.Model(10)
    trained.train_step(x=x, labels=labels)
    expected = 4 * training_state_floats(trained)  # gradients (one per parameter float) + slots
    assert trained.memory_stats()["training_state_bytes"] == expected
    assert any(v.any() for v in trained.optimizer_state().values())

    # A lazily allocated model takes the same step as one allocated up front.
    up_front = module.Model(10)
    up_front.allocate_training_state()
    assert up_front.memory_stats()["training_state_bytes"] == expected
    assert not up_front.gradient_buffer().any()
    up_front.train_step(x=x, labels=labels)
    for name, value in trained.parameters().items():
        np.testing.assert_array_equal(up_front.parameters()[name], value)

    # load() with optimizer state allocates it (not the gradients) and takes its values.
    trained.save(str(tmp_path / "trained.npz"))
    other = module.Model(11)
    other.load(str(tmp_path / "trained.npz"))
    gradient_bytes = 4 * sum(g.size for g in trained.gradients().values())
    assert other.memory_stats()["training_state_bytes"] == expected - gradient_bytes
    for name, value in trained.optimizer_state().items():
        np.testing.assert_array_equal(other.optimizer_state()[name], value)
    a, b = module.Model(12), module.Model(12)
    a.load(str(tmp_path / "trained.npz"))
    b.load(str(tmp_path / "trained.npz"))
    assert a.train_step(x=x, labels=labels) == b.train_step(x=x, labels=labels) == other.train_step(x=x, labels=labels)


@pytest.mark.parametrize("ask", ["gradients", "optimizer_state", "gradient_buffer", "apply_update"])
def test_asking_for_training_state_allocates_it(module, ask):
    model = module.Model(13)
    result = getattr(model, ask)()
    assert model.memory_stats()["training_state_bytes"] > 0
    if ask == "gradients":
        assert set(result) == set(model.parameters()) and not any(v.any() for v in result.values())
    if ask == "gradient_buffer":
        assert result.size == sum(v.size for v in model.parameters().values())
