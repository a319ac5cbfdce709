"""bf16 training (dg.train(..., precision="bf16")): every product of the train step,
forward and backward, multiplies bfloat16 values (its operands rounded by round_bf16
nodes, float32 sums: runtime/dg_bf16.h), while the weights, their gradients and the
optimizer state stay float32. The reference interpreter runs the same rounded graph,
so generated == reference up to the float32 sums' order (an order difference can move
a value across a bf16 rounding boundary: one bf16 step, 2^-8 of it, for that value),
and the steps differ from fp32 training's by about bf16's precision, so the
comparison can fail."""

from __future__ import annotations

import numpy as np
import pytest

import generator as dg
from conftest import load_example
from generator.errors import ModelError
from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs

N = dg.dim("N")


def _model(precision):
    @dg.model
    def small_mlp():
        x = dg.input("x", (N, 37))
        labels = dg.input("labels", (N,), dtype="int64")
        h = dg.dense(x, 48, act=dg.relu)
        logits = dg.dense(h, 10)
        dg.train(dg.softmax_cross_entropy(logits, labels), dg.sgd(lr=0.1, momentum=0.9), precision=precision)
        return {"logits": logits}

    return small_mlp


def _relative(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max() / np.abs(want).max())


def test_bf16_train_steps_match_the_reference_and_differ_from_fp32(builds):
    graph = _model("bf16").build("small_mlp_bf16_train")
    fp32 = _model("fp32").build("small_mlp_fp32_train")
    module, project = builds.module(graph)
    text = " ".join((project / "src_tree" / "src" / "model.cpp").read_text().split())
    # the gradient products too: d_W = x^T @ g and d_x = g @ W^T on bf16 values
    assert "dg::matmul_tn_bf16(" in text and "dg::matmul_nt_bf16(" in text, text[:2000]
    assert module.build_info()["precision"] == "bf16"
    model = module.Model(seed=2)
    params, state = reference.init_params(graph, seed=2), {}
    params32, state32 = reference.init_params(fp32, seed=2), {}
    for step in range(1, 6):
        batch = sample_inputs(graph, seed=10 + step, dims={d: 24 for d in graph.dims})
        want = reference.train_step(graph, batch, params, state, step=step)
        reference.train_step(fp32, batch, params32, state32, step=step)
        np.testing.assert_allclose(model.train_step(**batch), want, rtol=1e-3)
    got = model.parameters()
    for key in params:
        # generated vs reference: float32 order (seen ~1e-6 of the largest weight); bf16 vs fp32: ~1e-3
        assert _relative(got[key], params[key]) < 2e-4, (key, _relative(got[key], params[key]))
    assert max(_relative(params[k], params32[k]) for k in params) > 1e-3


def test_bf16_training_needs_fp32_or_bf16():
    with pytest.raises(ModelError, match=r"dg.train\(precision='int8'\): expected 'fp32' or 'bf16'"):
        _model("int8").build("bad_precision")


def test_the_examples_train_in_bf16_when_asked():
    """examples/mlp.py and lenet.py take precision=bf16 (`deepgen generate ... --option
    precision=bf16`): the graph keeps its train step and rounds every product."""
    for name in ("mlp", "lenet"):
        graph = load_example(name).build(f"{name}_bf16_train", precision="bf16")
        from generator.pipeline import prepare

        prepare(graph)
        assert graph.train is not None and graph.precision == "bf16"
        products = [n for n in graph.nodes if n.op in ("matmul", "conv2d")]
        assert products and all(any(v.producer is not None and v.producer.op == "round_bf16" for v in n.inputs)
                                for n in products)
