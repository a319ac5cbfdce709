"""Checks this build of tiny_cuda against outputs that deepgen's numpy reference
computed at generation time (tests/expected.npz): same seed, same inputs.

Run after building: `pip install . && python -m pytest tests`."""

from pathlib import Path

import numpy as np

from tiny_cuda import Model  # (only Model: a module named np or Path would hide those names)

EXPECTED = Path(__file__).with_name("expected.npz")


def test_forward_matches_reference():
    data = np.load(EXPECTED)
    inputs = {key[len("input/") :]: data[key] for key in data.files if key.startswith("input/")}
    outputs = Model(seed=0).forward(**inputs)
    np.testing.assert_allclose(outputs["logits"], data["output/logits"], rtol=1e-4, atol=1e-5)


def test_wrong_shape_is_a_value_error():
    data = np.load(EXPECTED)
    inputs = {key[len("input/") :]: data[key] for key in data.files if key.startswith("input/")}
    name = "x"
    inputs[name] = np.zeros(inputs[name].shape + (2,), inputs[name].dtype)
    try:
        Model(seed=0).forward(**inputs)
    except ValueError as e:
        assert name in str(e)
    else:
        raise AssertionError("a wrong shape was accepted")


def test_train_step_matches_reference():
    """One train_step (momentum(lr=0.1, momentum=0.9)): the loss, then the outputs after the update."""
    data = np.load(EXPECTED)
    inputs = {key[len("input/") :]: data[key] for key in data.files if key.startswith("input/")}
    model = Model(seed=0)
    loss = model.train_step(**inputs)
    np.testing.assert_allclose(loss, data["train/loss"], rtol=1e-4, atol=1e-6)
    outputs = model.forward(**inputs)
    np.testing.assert_allclose(outputs["logits"], data["train/output/logits"], rtol=1e-3, atol=1e-5)
