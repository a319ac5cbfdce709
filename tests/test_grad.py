"""Gradients: every differentiable op's gradient in the reference against central
finite differences in float64 (like JAX's check_grads), and the generated C++
backward pass against the reference, for every op in the table at once."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import generator as dg
from generator.reference import interpreter as reference
from generator.transforms.autodiff import differentiate
from op_cases import CASES, DIMS, case_inputs

# Ops whose operands are not differentiable (integer ids) are still differentiated
# with respect to their float operands.
DIFFERENTIABLE = [c for c in CASES if c.differentiable and any(dtype == "float32" for _, dtype, _, _ in c.inputs.values())]


def _loss_model(case):
    """loss = sum(sin(1.7 out + 0.3) * out): a different weight for every output element."""

    def grad():
        ins = {k: dg.input(f"in_{k}", shape, dtype) for k, (shape, dtype, _, _) in case.inputs.items()}
        out = case.build(ins)
        return {"loss": dg.sum(dg.sin(out * 1.7 + 0.3) * out)}

    return dg.model(grad).build()


@pytest.mark.parametrize("case", DIFFERENTIABLE, ids=[c.name for c in DIFFERENTIABLE])
def test_reference_gradient_matches_finite_differences(case):
    graph = _loss_model(case)
    arrays = {f"in_{k}": v.astype(np.float64) if v.dtype == np.float32 else v for k, v in case_inputs(case).items()}
    wrt = [v for v in graph.inputs if v.dtype == "float32"]
    grads = differentiate(graph, dict(graph.outputs)["loss"], wrt)
    values = reference.run(graph, arrays, float_dtype=np.float64, values=list(grads.values()))

    def loss_at(name, flat_index, delta):
        shifted = {k: v.copy() for k, v in arrays.items()}
        shifted[name].reshape(-1)[flat_index] += delta
        return float(reference.run(graph, shifted, float_dtype=np.float64)["loss"])

    eps = 1e-6
    for v in wrt:
        analytic = values[grads[id(v)].name]
        numeric = np.zeros(arrays[v.name].size)
        for i in range(numeric.size):
            numeric[i] = (loss_at(v.name, i, eps) - loss_at(v.name, i, -eps)) / (2 * eps)
        assert analytic.shape == arrays[v.name].shape
        np.testing.assert_allclose(analytic.reshape(-1), numeric, rtol=1e-5, atol=1e-6, err_msg=f"d loss / d {v.name}")


def test_user_defined_activation_is_differentiated():
    swish = dg.elementwise(lambda x: x * sympy.tanh(sympy.log(1 + sympy.exp(x))), "mish")

    @dg.model
    def net():
        x = dg.input("x", (3, 4))
        return {"loss": dg.sum(swish(x))}

    graph = net.build()
    x = graph.inputs[0]
    (grad,) = differentiate(graph, graph.outputs[0][1], [x]).values()
    data = np.random.default_rng(0).normal(size=(3, 4))
    got = reference.run(graph, {"x": data}, float_dtype=np.float64, values=[grad])[grad.name]
    sp = np.log1p(np.exp(data))
    want = np.tanh(sp) + data * (1 - np.tanh(sp) ** 2) / (1 + np.exp(-data))
    np.testing.assert_allclose(got, want, rtol=1e-10)


# -- the generated backward pass -------------------------------------------------


def _param_shape(shape):
    return tuple(d if isinstance(d, int) else int(d.subs(DIMS)) for d in shape)


def _grad_table():
    """Every case with its float operands as parameters (initialized in their
    domains) and loss = sum over cases of sum((0.7 out + 0.3) * out): the gradient
    reaching each output element, 1.4 out + 0.3, differs as the outputs do. (Not
    _loss_model's sin: the generator's simplification of trigonometric expressions
    makes generating this table take about three times as long.)"""

    def fn():
        total = None
        for case in DIFFERENTIABLE:
            ins = {}
            for k, (shape, dtype, low, high) in case.inputs.items():
                if dtype == "float32":
                    ins[k] = dg.param(f"{case.name}_{k}", _param_shape(shape), init=dg.uniform(low, high))
                else:
                    ins[k] = dg.input(f"{case.name}_{k}", _param_shape(shape), dtype)
            out = case.build(ins)
            term = dg.sum((out * 0.7 + 0.3) * out)
            total = term if total is None else total + term
        dg.train(total, dg.sgd(lr=1e-30))
        return {"total": total}

    fn.__name__ = "gradtable"
    return dg.model(fn)


def test_generated_gradients_match_reference(builds):
    graph = _grad_table().build()
    module, _ = builds.module(graph)
    inputs = {}
    for v in graph.inputs:  # only gather ids are inputs here
        case = next(c for c in CASES if v.name.startswith(c.name + "_"))
        inputs[v.name] = case_inputs(case)[v.name[len(case.name) + 1 :]]
    model = module.Model(seed=4)
    loss = model.train_step(**inputs)
    want_loss, want_grads = reference.gradients(graph, inputs, reference.init_params(graph, seed=4), seed=4)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-4)
    got = model.gradients()
    assert set(got) == set(want_grads)
    for name, want in want_grads.items():
        case = next(c for c in CASES if name.startswith(c.name + "_"))
        np.testing.assert_allclose(got[name], want, rtol=1e-4, atol=max(case.tol, 1e-5), err_msg=name)
