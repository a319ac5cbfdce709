"""Correctness at every optimization level and thread count: compiled modules
against the reference interpreter, and 1 thread against 2 (bit for bit: no
kernel's result may depend on how its work is split)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import load_example
from module_checks import check_train_steps
from generator.reference import interpreter as reference
from generator.reference.samples import sample_inputs

# One trainable model (GEMMs, epilogues, softmax cross-entropy, momentum) and one
# recursive model (level loop, packed weights), compiled at each level below -O2
# (the -O2 builds are those of test_examples.py).
LEVELED = ["mlp", "treelstm"]


def _module(builds, name: str, opt: str):
    # -O2 modules keep the example's name: they are test_examples.py's builds.
    model = load_example(name)
    graph = model.build() if opt == "O2" else model.build(name=f"{name}_{opt.lower()}")
    return graph, builds.module(graph, opt=opt)[0]


def _big_inputs(graph, seed=3):
    # Big enough that GEMMs and elementwise loops split over threads (dg_parallel.h).
    dims = {d: 96 + 5 * i for i, d in enumerate(graph.dims)}
    return sample_inputs(graph, dims, seed=seed)


def _close(got: dict, want: dict):
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("opt", ["O0", "O1"])
@pytest.mark.parametrize("name", LEVELED)
def test_lower_levels_match_reference(builds, name, opt):
    graph, module = _module(builds, name, opt)
    inputs = sample_inputs(graph, seed=4)
    _close(module.Model(seed=2).forward(**inputs), reference.run(graph, inputs, seed=2))
    if graph.train is not None:
        check_train_steps(graph, module)


def _run(module, graph, threads: int):
    """forward() on big inputs and, for a trainable model, two train steps."""
    module.set_num_threads(threads)
    assert module.get_num_threads() == (threads if module.build_info()["openmp"] else 1)
    model = module.Model(seed=1)
    out = {k: np.array(v) for k, v in model.forward(**_big_inputs(graph)).items()}
    if graph.train is not None:
        out["losses"] = np.array([model.train_step(**_big_inputs(graph, seed=20 + k)) for k in range(2)])
        out.update({f"param {k}": np.array(v) for k, v in model.parameters().items()})
    return out


@pytest.mark.parametrize("name,opt", [(n, "O0") for n in LEVELED]
                         + [(n, "O2") for n in LEVELED + ["bow", "digits", "treegru"]])
def test_thread_count_does_not_change_results(builds, name, opt):
    graph, module = _module(builds, name, opt)
    before = module.get_num_threads()
    try:
        one, two = _run(module, graph, 1), _run(module, graph, 2)
    finally:
        module.set_num_threads(before)
    assert one.keys() == two.keys()
    for key in one:
        assert np.array_equal(one[key], two[key]), f"{key} differs between 1 and 2 threads"
    _close({k: one[k] for k, _ in graph.outputs}, reference.run(graph, _big_inputs(graph), seed=1))
