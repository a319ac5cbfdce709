"""The numpy reference interpreter: runs any Graph. It is the oracle for tests.

It checks inputs the way the generated module does (names, dtypes, shapes,
symbolic dims bound consistently), then evaluates nodes in order with each
op's `reference` rule. `float_dtype=np.float64` runs the same graph in double
precision (for finite-difference checks).
"""

from __future__ import annotations

import numpy as np
import sympy

from .ops import get_op
from .shapes import bind_dims, evaluate, fmt_shape


def init_params(graph, seed: int = 0) -> dict:
    """Initial parameter values, identical to the generated `Model(seed)`."""
    return {
        p.name: p.init.sample(p.shape, p.seed if p.seed is not None else seed, p.name) for p in graph.params
    }


def bind_inputs(graph, inputs: dict) -> dict:
    """Check `inputs` against the graph's declarations; returns {dim symbol: size}."""
    names = [v.name for v in graph.inputs]
    unknown = sorted(set(inputs) - set(names))
    if unknown:
        raise ValueError(f"unknown input(s) {', '.join(unknown)}; the model's inputs are: {', '.join(names)}")
    dims: dict = {}
    for v in graph.inputs:
        if v.name not in inputs:
            raise ValueError(f"missing input '{v.name}' (expected {v.type_str()})")
        a = np.asarray(inputs[v.name])
        if a.dtype != np.dtype(v.dtype) and not (v.dtype == "float32" and a.dtype == np.float64):
            raise ValueError(f"input '{v.name}': expected dtype {v.dtype}, got {a.dtype}")
        problem = bind_dims(v.shape, a.shape, dims)
        if problem:
            raise ValueError(f"input '{v.name}': {problem}")
    for expr, why in graph.requirements:
        if int(sympy.sympify(expr).subs(dims)) < 0:
            raise ValueError(f"sizes {_fmt_dims(dims)} violate a requirement: {why}")
    return dims


def run(graph, inputs: dict, params: dict | None = None, seed: int = 0, float_dtype=np.float32, trace=False) -> dict:
    """Evaluate the graph; returns {output name: array} (and every value if trace)."""
    dims = bind_inputs(graph, inputs)
    params = init_params(graph, seed) if params is None else params
    env = {}
    for v in graph.inputs:
        a = np.asarray(inputs[v.name])
        env[id(v)] = a.astype(float_dtype) if v.dtype == "float32" else a
    for p in graph.params:
        if p.name not in params:
            raise ValueError(f"missing parameter '{p.name}'")
        a = np.asarray(params[p.name])
        if a.shape != tuple(p.shape):
            raise ValueError(f"parameter '{p.name}': expected shape {fmt_shape(p.shape)}, got {a.shape}")
        env[id(p)] = a.astype(float_dtype)
    for node in graph.nodes:
        results = get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)
        for v, r in zip(node.outputs, results):
            expected = evaluate(v.shape, dims)
            assert r.shape == expected, f"{node.op} produced {r.shape}, shape rule says {expected}"
            env[id(v)] = r
    out = {name: env[id(v)] for name, v in graph.outputs}
    if trace:
        out = {**out, **{v.name: env[id(v)] for v in graph.values()}}
    return out


def _fmt_dims(dims):
    return ", ".join(f"{k}={v}" for k, v in dims.items())
