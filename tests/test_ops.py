"""Every op, twice: the numpy reference interpreter against an independent numpy
oracle, and the generated C++ (one project holding all cases, built once)
against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from generator.reference import interpreter as reference
from generator.ops import REGISTRY, SCALAR_FUNCS
from op_cases import CASES, DIMS, N, T, case_inputs, case_model

IDS = [c.name for c in CASES]


def _prefixed(case, arrays):
    return {f"{case.name}_{k}": v for k, v in arrays.items()}


# recurse: tests/test_recursion.py and test_tree_training.py; conv2d_batch_norm (made only by the
# conv_batch_norm pass): test_passes.py and test_conv_runtime.py (bit for bit the two calls);
# matmul_int8, conv2d_int8 and conv2d_batch_norm_int8 (made only by --precision int8, their scales
# loaded; the last by conv_batch_norm on an int8 graph): test_int8.py, bit for bit and LeNet's
# convolutions; cond and cond_grad (dg.cond's branches are cells):
# test_control_flow.py
TESTED_ELSEWHERE = {"recurse", "recurse_grad", "conv2d_batch_norm", "matmul_int8", "conv2d_int8",
                    "conv2d_batch_norm_int8", "cond", "cond_grad"}


def test_every_op_and_function_is_in_the_table():
    assert set(REGISTRY) - TESTED_ELSEWHERE <= {op for c in CASES for op in c.ops + c.grad_ops}
    assert set(SCALAR_FUNCS) <= {f for c in CASES for f in c.funcs}


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_reference_matches_numpy(case):
    graph = case_model([case], name="single").build()
    arrays = case_inputs(case)
    got = reference.run(graph, _prefixed(case, arrays))[case.name]
    want = np.asarray(case.oracle(arrays), dtype=np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=case.tol, atol=case.tol)


@pytest.fixture(scope="module")
def optable(builds):
    graph = case_model(CASES).build()
    module, _ = builds.module(graph)
    return graph, module


@pytest.mark.parametrize("sizes", [DIMS, {N: 1, T: 1}, {N: 5, T: 2}], ids=["N3T4", "N1T1", "N5T2"])
def test_generated_matches_reference(optable, sizes):
    graph, module = optable
    inputs = {}
    for case in CASES:
        inputs.update(_prefixed(case, case_inputs(case, sizes)))
    want = reference.run(graph, inputs)
    got = module.Model(seed=0).forward(**inputs)
    assert set(got) == set(want)
    for case in CASES:
        g, w = got[case.name], want[case.name]
        assert g.dtype == np.float32 and g.shape == w.shape, case.name
        np.testing.assert_allclose(g, w, rtol=max(case.tol, 1e-5), atol=max(case.tol, 1e-5), err_msg=case.name)


def test_generated_gather_rejects_bad_ids(optable):
    graph, module = optable
    inputs = {}
    for case in CASES:
        inputs.update(_prefixed(case, case_inputs(case)))
    inputs["gather_int64_ids"] = inputs["gather_int64_ids"].copy()
    inputs["gather_int64_ids"][1, 2] = 7
    with pytest.raises(ValueError, match=r"index 7 at position 6 is out of range \[0, 7\)"):
        module.Model().forward(**inputs)
    with pytest.raises(ValueError, match=r"index 7 at position 6"):
        reference.run(graph, inputs)
