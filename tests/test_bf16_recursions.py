"""bf16 inside a recursion's cells (transforms/precision.py): the TreeLSTM sentiment
example and the LSTM classifier generated in bf16 against the numpy reference (which
rounds exactly where the C++ does), and how far bf16 moves them from fp32."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_example
from generator.reference import interpreter as reference
from generator.transforms.precision import set_precision
from test_precision import ORDER_TOLERANCE, _error


def _trees(rng, count):
    import runpy

    from conftest import ROOT

    example = runpy.run_path(str(ROOT / "examples" / "treelstm_sentiment.py"))
    batch = example["batch_of"](example["make_treebank"](count, int(rng.integers(1000))))
    return {k: v for k, v in batch.items() if k != "labels"}


def _sequences(rng, count):
    steps = 7
    return {"columns": rng.normal(size=(count, steps, 8)).astype(np.float32),
            "lengths": rng.integers(1, steps + 1, count).astype(np.int64)}


def _logits(probs):
    """The logits up to each row's constant: the random initial weights give probabilities
    all near 1/3 (1/10), whose differences would hide in their size."""
    logs = np.log(np.asarray(probs, np.float64))
    return logs - logs.mean(axis=1, keepdims=True)


# (example, its inputs for a batch of `count`)
MODELS = [("treelstm_sentiment", _trees), ("lstm_classifier", _sequences)]


@pytest.mark.parametrize("name,inputs", MODELS, ids=[m[0] for m in MODELS])
def test_bf16_recursion_matches_reference_and_differs_from_fp32(name, inputs, builds):
    fp32 = load_example(name).build()
    graph = load_example(name).build(f"{name}_bf16")
    set_precision(graph, "bf16")
    (recursion,) = [n for n in graph.nodes if n.op == "recurse"]
    spec = recursion.attrs["spec"]
    # every product in the cells reads rounded operands; the weights are rounded once,
    # outside the recursion, which reads them in place of the float32 ones
    for cell in (spec.leaf, spec.internal):
        products = [n for n in cell.nodes if n.op == "matmul"]
        assert products and all(n.inputs[i].producer is not None and n.inputs[i].producer.op == "round_bf16"
                                for n in products for i in (0, 1)), name
    weights = [v for v in spec.free if v.producer is not None and v.producer.op == "round_bf16"]
    assert weights and all(graph.nodes.index(v.producer) < graph.nodes.index(recursion) for v in weights)
    assert recursion.inputs[spec.nb:] == spec.free
    module, _ = builds.module(graph)
    assert module.build_info()["precision"] == "bf16"
    params = reference.init_params(graph, seed=3)
    model = module.Model(seed=3)
    for k, v in model.parameters().items():
        np.testing.assert_array_equal(v, params[k], err_msg=k)
    rng = np.random.default_rng(5)
    for count in (1, 6, 40):
        feed = inputs(rng, count)
        got = _logits(model.forward(**feed)["probs"])
        want = _logits(reference.run(graph, feed, params)["probs"])
        exact = _logits(reference.run(fp32, feed, params)["probs"])
        print(f"{name} count={count}: generated vs reference {_error(got, want):.2e}, "
              f"bf16 vs fp32 {_error(want, exact):.2e} (of the largest logit)")
        # float32 accumulation order only (as the MLP's and LeNet's, test_precision.py)
        assert _error(got, want) <= ORDER_TOLERANCE, (count, _error(got, want))
        assert 2 * ORDER_TOLERANCE < _error(want, exact) < 2**-4, (count, _error(want, exact))
