"""Recurrences over padded sequences (dg.scan, dg.lstm, dg.gru).

Oracles: PyTorch's nn.LSTM / nn.GRU on packed sequences (float64, weights
copied one to one by name) for the reference's outputs and gradients; float64
central finite differences for a scan with a hand-written cell; the reference
(one node at a time) for the generated level-batched forward and backward
passes, on batches of mixed lengths (1 and T included). Bad lengths are errors
naming the index, in the reference and in the generated module."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import CHECK_BUILD_FLAGS, ROOT, build_example
from generator.frontend.loader import load_model
from generator.reference import interpreter as reference

MODELS = ROOT / "tests" / "models" / "rnn_layers.py"
LENGTHS = np.array([3, 6, 1, 4, 6], np.int64)
VARIANTS = [("lstm", 1, False), ("lstm", 2, True), ("gru", 1, False), ("gru", 2, True)]
BUILT = [("lstm", 2, True), ("gru", 2, True)]  # compiled (each build costs the suite about a minute)


def _graph(model: str, name: str, **options):
    return load_model(f"{MODELS}:{model}").build(name, **options)


def _rnn(kind, layers, bidirectional):
    name = f"seq_{kind}{layers}{'bi' if bidirectional else ''}"
    return _graph("rnn_layers", name, kind=kind, layers=layers, bidirectional=bidirectional)


def _inputs(graph, rng, lengths=LENGTHS, steps=6, dtype=np.float32):
    out = {"lengths": lengths}
    for v in graph.inputs:
        if v.dtype == "float32":
            shape = (len(lengths), steps) + tuple(v.shape[2:])
            out[v.name] = rng.standard_normal(shape).astype(dtype)
    return out


def _torch_rnn(kind, layers, bidirectional, params, inputs):
    """(outputs, states, parameter gradients) of PyTorch's layer on the packed batch."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(inputs["x"])
    cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
    layer = cls(x.shape[2], params["rnn_weight_hh_l0"].shape[1], num_layers=layers, bidirectional=bidirectional,
                batch_first=True).double()
    with torch.no_grad():
        for key, p in layer.named_parameters():
            p.copy_(torch.from_numpy(params["rnn_" + key.replace(".", "_")]))
    packed = torch.nn.utils.rnn.pack_padded_sequence(x, torch.from_numpy(inputs["lengths"]), batch_first=True,
                                                     enforce_sorted=False)
    out, state = layer(packed)
    out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
    h_n, c_n = state if kind == "lstm" else (state, None)
    loss = (out * torch.from_numpy(inputs["weights"])).sum()
    loss = loss + (h_n.sum() + (c_n**2).sum() if kind == "lstm" else (h_n**2).sum())
    loss.backward()
    outputs = {"states": out.detach().numpy(), "h_n": h_n.detach().numpy()}
    if c_n is not None:
        outputs["c_n"] = c_n.detach().numpy()
    grads = {"rnn_" + key.replace(".", "_"): p.grad.numpy() for key, p in layer.named_parameters()}
    return outputs, float(loss), grads


@pytest.mark.parametrize("kind,layers,bidirectional", VARIANTS)
def test_reference_equals_pytorch(kind, layers, bidirectional):
    """Outputs (zero past each length), h_n/c_n and every parameter's gradient."""
    graph = _rnn(kind, layers, bidirectional)
    rng = np.random.default_rng(0)
    inputs = _inputs(graph, rng, dtype=np.float64)
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=1).items()}
    assert {p.name for p in graph.params} == set(params)
    want, want_loss, want_grads = _torch_rnn(kind, layers, bidirectional, params, inputs)
    got = reference.run(graph, inputs, params, float_dtype=np.float64)
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-10, atol=1e-12, err_msg=key)
    assert not got["states"][2, 1:].any()  # the sequence of length 1: zeros past it
    loss, grads = reference.gradients(graph, inputs, params, float_dtype=np.float64)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
    assert set(grads) == set(want_grads)
    for key, value in want_grads.items():
        np.testing.assert_allclose(grads[key], value, rtol=1e-9, atol=1e-11, err_msg=key)


@pytest.mark.parametrize("reverse", [False, True])
def test_scan_gradient_matches_finite_differences(reverse):
    graph = _graph("two_input_scan", f"seq_scan{int(reverse)}", reverse=reverse)
    rng = np.random.default_rng(3)
    inputs = _inputs(graph, rng, dtype=np.float64)
    params = {k: v.astype(np.float64) for k, v in reference.init_params(graph, seed=2).items()}
    _, grads = reference.gradients(graph, inputs, params, float_dtype=np.float64)
    for name, grad in grads.items():
        for idx in list(np.ndindex(grad.shape))[:: max(1, grad.size // 5)]:
            shifted = []
            for sign in (1, -1):
                p = {k: v.copy() for k, v in params.items()}
                p[name][idx] += sign * 1e-6
                out = reference.run(graph, inputs, p, float_dtype=np.float64)
                shifted.append(np.sum(out["states"] ** 2) + np.sum(out["last"]))
            numeric = (shifted[0] - shifted[1]) / 2e-6
            assert abs(numeric - grad[idx]) <= 1e-6 + 1e-5 * abs(numeric), (name, idx, numeric, grad[idx])


def _built_graphs():
    """The graphs this file compiles: the layers of BUILT, and a backward scan."""
    return [_rnn(*variant) for variant in BUILT] + [_graph("two_input_scan", "seq_scan1", reverse=True)]


@pytest.fixture(scope="module")
def compiled(builds):
    """conftest's builds, with every graph of _built_graphs built side by side when
    the first test here asks for one (Builds.prebuild), at CHECK_BUILD_FLAGS' -O0: the
    tests compare values with the reference and PyTorch at tiny sizes, and time nothing."""
    builds.prebuild(_built_graphs(), flags=CHECK_BUILD_FLAGS)
    return builds


def _generated_vs_reference(graph, module, inputs, seed=4):
    model = module.Model(seed=seed)
    params = reference.init_params(graph, seed=seed)
    want = reference.run(graph, inputs, params)
    got = model.forward(**{k: v for k, v in inputs.items() if k != "weights"})
    for key, value in want.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-5, err_msg=key)
    want_loss, want_grads = reference.gradients(graph, inputs, params)
    np.testing.assert_allclose(model.train_step(**inputs), want_loss, rtol=1e-4, atol=1e-5)
    got_grads = model.gradients()
    assert set(got_grads) == set(want_grads)
    for key, value in want_grads.items():
        scale = max(float(np.abs(value).max()), 1e-3)
        assert float(np.abs(np.asarray(got_grads[key]) - value).max()) <= 2e-4 * scale, key


@pytest.mark.parametrize("kind,layers,bidirectional", BUILT)
def test_generated_equals_reference(kind, layers, bidirectional, compiled):
    graph = _rnn(kind, layers, bidirectional)
    module, _ = compiled.module(graph)
    rng = np.random.default_rng(5)
    for lengths, steps in ((LENGTHS, 6), (np.array([1], np.int64), 1), (np.array([9, 2, 9], np.int64), 9)):
        _generated_vs_reference(graph, module, _inputs(graph, rng, lengths, steps))


def test_generated_scan_equals_reference(compiled):
    """Backwards in time, two inputs, a state of rank 2 (forwards: the RNN layers above)."""
    graph = _graph("two_input_scan", "seq_scan1", reverse=True)
    module, _ = compiled.module(graph)
    _generated_vs_reference(graph, module, _inputs(graph, np.random.default_rng(6)))


def test_generated_equals_pytorch_with_copied_weights(compiled):
    """Weights written through parameters() from a PyTorch state_dict, float32."""
    torch = pytest.importorskip("torch")
    graph = _rnn("lstm", 2, True)
    module, _ = compiled.module(graph)
    model = module.Model(seed=0)
    layer = torch.nn.LSTM(5, 7, num_layers=2, bidirectional=True, batch_first=True)
    views = model.parameters()
    for key, value in layer.state_dict().items():
        views["rnn_" + key.replace(".", "_")][...] = value.numpy()
    inputs = _inputs(graph, np.random.default_rng(7))
    got = model.forward(x=inputs["x"], lengths=inputs["lengths"])
    packed = torch.nn.utils.rnn.pack_padded_sequence(torch.from_numpy(inputs["x"]), torch.from_numpy(LENGTHS),
                                                     batch_first=True, enforce_sorted=False)
    with torch.no_grad():
        out, (h_n, c_n) = layer(packed)
    out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=6)
    for key, value in (("states", out), ("h_n", h_n), ("c_n", c_n)):
        np.testing.assert_allclose(got[key], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("lengths,message", [
    (np.array([3, 7, 1, 4, 6]), r"lengths\[1\] is 7, outside \[1, 6\]"),
    (np.array([3, 6, 0, 4, 6]), r"lengths\[2\] is 0, outside \[1, 6\]"),
    (np.array([3, 6, 1, -2, 6]), r"lengths\[3\] is -2, outside \[1, 6\]"),
])
def test_bad_lengths_are_errors_naming_the_index(lengths, message, compiled):
    graph = _rnn("gru", 2, True)
    module, _ = compiled.module(graph)
    inputs = _inputs(graph, np.random.default_rng(8))
    inputs["lengths"] = lengths.astype(np.int64)
    with pytest.raises(ValueError, match=message):
        reference.run(graph, inputs, reference.init_params(graph))
    model = module.Model(seed=0)
    with pytest.raises(ValueError, match="lengths.*" + message):
        model.forward(x=inputs["x"], lengths=inputs["lengths"])
    with pytest.raises(ValueError, match=message):
        model.train_step(**inputs)


def test_lengths_of_the_wrong_dtype_or_count(compiled):
    graph = _rnn("gru", 2, True)
    module, _ = compiled.module(graph)
    model = module.Model(seed=0)
    x = np.zeros((5, 6, 5), np.float32)
    with pytest.raises(ValueError, match="lengths"):
        model.forward(x=x, lengths=LENGTHS.astype(np.int32))
    with pytest.raises(ValueError, match="lengths"):
        model.forward(x=x, lengths=LENGTHS[:4])


def test_two_threads_give_the_same_bits(compiled):
    graph = _rnn("lstm", 2, True)
    module, _ = compiled.module(graph)
    inputs = _inputs(graph, np.random.default_rng(9), np.array([5, 17, 3, 17, 9, 1, 12, 2], np.int64), 17)
    results = []
    before = module.get_num_threads()
    try:
        for threads in (1, 2):
            module.set_num_threads(threads)
            model = module.Model(seed=1)
            loss = model.train_step(**inputs)
            results.append((loss, {k: np.array(v) for k, v in model.parameters().items()}))
    finally:
        module.set_num_threads(before)
    assert results[0][0] == results[1][0]
    for key in results[0][1]:
        np.testing.assert_array_equal(results[0][1][key], results[1][1][key], err_msg=key)


def test_lstm_classifier_learns_digits(builds):
    """examples/lstm_classifier.py: digits read column by column, mixed lengths."""
    pytest.importorskip("sklearn")
    import runpy

    example = runpy.run_path(str(ROOT / "examples" / "lstm_classifier.py"))
    module, _ = builds.module(build_example("lstm_classifier"))  # the build tests/test_examples.py checks
    assert example["train"](module, epochs=6, log=lambda *_: None) >= 0.9
