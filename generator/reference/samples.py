"""Deterministic sample inputs for a graph: used to record expected outputs in a
generated project, by the example program, and by tests."""

from __future__ import annotations

import numpy as np
import sympy

from . import rng
from ..ir.shapes import evaluate
from ..ops import get_op
from ..ops.registry import id_limit


def sample_dims(graph, start: int = 2) -> dict:
    """Small sizes for the symbolic dims (distinct, so mix-ups show) that meet
    the graph's run-time requirements."""
    dims = {}
    for i, d in enumerate(graph.dims):
        dims[d] = start + i
    for _ in range(64):
        failing = [e for e, _ in graph.requirements if int(sympy.sympify(e).subs(dims)) < 0]
        if not failing:
            return dims
        for d in sympy.sympify(failing[0]).free_symbols:
            dims[d] += 1
    raise ValueError("no small sizes satisfy the model's requirements")


def sample_inputs(graph, dims: dict | None = None, seed: int = 1, floats: bool = True) -> dict:
    """Inputs for `graph`; a recursive op's trees are a random batch (whose sizes
    then fix the node and tree counts). floats=False leaves out the float inputs
    (only the integer ones, ids and trees, are made)."""
    dims = dict(sample_dims(graph) if dims is None else dims)
    out = {}
    for n in graph.nodes:  # inputs an op makes together (a batch of trees) come first
        made = get_op(n.op).sample_inputs(n, np.random.default_rng(seed), dims, graph)
        if any(name in out for name in made):  # another node made them already
            continue
        out.update(made)
        for v in n.inputs:
            for d, size in zip(v.shape, made[v.name].shape if v.name in made else ()):
                if not isinstance(d, int):
                    dims[d] = size
    for v in graph.inputs:
        if v.name in out or (v.dtype == "float32" and not floats):
            continue
        shape = evaluate(v.shape, dims)
        u = rng.init_uniform(shape, seed, "input:" + v.name, 0.0, 1.0)
        if v.dtype == "float32":
            out[v.name] = (u * 2 - 1).astype(np.float32)
        else:
            out[v.name] = np.minimum((u * id_limit(graph, v)).astype(v.dtype), id_limit(graph, v) - 1)
    return out
