"""Deterministic sample inputs for a graph: used to record expected outputs in a
generated project, by the example program, and by tests."""

from __future__ import annotations

import numpy as np
import sympy

from . import rng
from .shapes import evaluate


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


def id_limit(graph, value) -> int:
    """Ids for `value` must index every table it gathers from (labels: every class count)."""
    limit = 10
    rows = [n.inputs[0].shape[0] for n in graph.nodes if n.op == "gather" and n.inputs[1] is value]
    for n in graph.nodes:  # word ids of a recursive op index the tables its cells gather from
        if n.op == "recurse" and n.inputs[1] is value:
            spec = n.attrs["spec"]
            for cell in (spec.leaf, spec.internal):
                rows += [m.inputs[0].shape[0] for m in cell.nodes if m.op == "gather" and m.inputs[1] is cell.words]
    rows += [n.inputs[0].shape[1] for n in graph.nodes if n.op == "softmax_xent" and n.inputs[1] is value]
    rows = [r for r in rows if isinstance(r, int)]
    return min(rows) if rows else limit


def sample_inputs(graph, dims: dict | None = None, seed: int = 1, floats: bool = True) -> dict:
    """Inputs for `graph`; a recursive op's trees are a random batch (whose sizes
    then fix the node and tree counts). floats=False leaves out the float inputs
    (only the integer ones, ids and trees, are made)."""
    dims = dict(sample_dims(graph) if dims is None else dims)
    out = {}
    for n in graph.nodes:
        if n.op == "recurse" and n.inputs[0].name not in out:
            from .treebatch import random_batch

            spec = n.attrs["spec"]
            count = dims.get(n.inputs[2].shape[0], 2) if not isinstance(n.inputs[2].shape[0], int) else n.inputs[2].shape[0]
            batch = random_batch(np.random.default_rng(seed), count, spec.arity, id_limit(graph, n.inputs[1]),
                                 dag=spec.dag)
            for v, key in zip(n.inputs[:3], ("children", "words", "roots")):
                out[v.name] = batch[key]
                for d, size in zip(v.shape, batch[key].shape):
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
