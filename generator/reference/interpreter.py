"""The numpy reference interpreter: runs any Graph. It is the oracle for tests.

It checks inputs the way the generated module does (names, dtypes, shapes,
symbolic dims bound consistently), then evaluates nodes in order with each
op's `reference` rule. `float_dtype=np.float64` runs the same graph in double
precision (for finite-difference checks).
"""

from __future__ import annotations

import numpy as np
import sympy

from ..ir.graph import needed_for
from ..ops import get_op
from ..ops.modes import Mode
from ..ir.shapes import bind_dims, evaluate, fmt_shape
from ..transforms.autodiff import prepare_training


def init_params(graph, seed: int = 0) -> dict:
    """Initial parameter values, identical to the generated `Model(seed)`."""
    return {
        p.name: p.init.sample(p.shape, p.seed if p.seed is not None else seed, p.name) for p in graph.params
    }


def bind_inputs(graph, inputs: dict, needed=None) -> dict:
    """Check `inputs` against the graph's declarations; returns {dim symbol: size}.
    With `needed` (a list of input Values), only those must be given."""
    names = [v.name for v in graph.inputs]
    unknown = sorted(set(inputs) - set(names))
    if unknown:
        raise ValueError(f"unknown input(s) {', '.join(unknown)}; the model's inputs are: {', '.join(names)}")
    dims: dict = {}
    bound_by: dict = {}  # dim symbol -> the input that set it
    for v in graph.inputs:
        if v.name not in inputs:
            if needed is not None and all(v is not n for n in needed):
                continue
            raise ValueError(f"missing input '{v.name}' (expected {v.type_str()})")
        a = np.asarray(inputs[v.name])
        if a.dtype != np.dtype(v.dtype) and not (v.dtype == "float32" and a.dtype == np.float64):
            raise ValueError(f"input '{v.name}': expected dtype {v.dtype}, got {a.dtype}")
        problem = bind_dims(v.shape, a.shape, dims, bound_by, v.name)
        if problem:
            raise ValueError(f"input '{v.name}': {problem}")
    for expr, why in graph.requirements:
        if int(sympy.sympify(expr).subs(dims)) < 0:
            raise ValueError(f"sizes {_fmt_dims(dims)} violate a requirement: {why}")
    return dims


def run(graph, inputs: dict, params: dict | None = None, seed: int = 0, float_dtype=np.float32,
        trace: bool = False, values=None, training: bool = True, draw: int = 0) -> dict:
    """Evaluate what the outputs need; returns {output name: array}. With `values`
    (a list of Values), evaluates those instead and returns {value name: array};
    with `trace`, every value as well. Only the inputs needed must be given (a
    forward pass of a trainable model needs no labels).

    `training`, `seed` and `draw` are the mode of a model with batch norm or
    dropout (a new Model is in training mode; `draw` counts its earlier
    training-mode calls). Batch norm in training mode updates the running
    statistics in `params` in place, as the generated forward() does."""
    wanted = list(values) if values is not None else [v for _, v in graph.outputs]
    if trace:
        wanted += [v for n in graph.nodes for v in n.outputs]
    need = needed_for(graph, wanted)
    dims = bind_inputs(graph, inputs, needed=[v for v in graph.inputs if id(v) in need])
    params = init_params(graph, seed) if params is None else params
    env = {}
    for v in graph.inputs:
        if v.name in inputs:
            a = np.asarray(inputs[v.name])
            env[id(v)] = a.astype(float_dtype) if v.dtype == "float32" else a
    for p in graph.params:
        if id(p) not in need:
            continue
        if p.name not in params:
            raise ValueError(f"missing parameter '{p.name}'")
        a = np.asarray(params[p.name])
        if a.shape != tuple(p.shape):
            raise ValueError(f"parameter '{p.name}': expected shape {fmt_shape(p.shape)}, got {a.shape}")
        # States are the caller's arrays (batch norm updates them), parameters copies.
        env[id(p)] = a.astype(float_dtype, copy=p.kind != "state")
    if graph.mode is not None:
        env[id(graph.mode)] = Mode(training, seed, draw)
    for node in graph.nodes:
        if not any(id(v) in need for v in node.outputs):
            continue
        results = get_op(node.op).reference([env[id(v)] for v in node.inputs], node.attrs, dims)
        for v, r in zip(node.outputs, results):
            expected = evaluate(v.shape, dims)
            assert r.shape == expected, f"{node.op} produced {r.shape}, shape rule says {expected}"
            env[id(v)] = r
    if values is not None:
        return {v.name: env[id(v)] for v in values}
    out = {name: env[id(v)] for name, v in graph.outputs}
    if trace:
        out = {**out, **{v.name: env[id(v)] for v in graph.values() if id(v) in env}}
    return out


def gradients(graph, inputs: dict, params: dict, float_dtype=np.float32, **mode):
    """(loss, {parameter name: gradient}) of a trainable model (dg.train); `mode`:
    run()'s training, seed and draw."""
    prepare_training(graph)
    spec = graph.train
    grads = list(spec.grads.items())
    got = run(graph, inputs, params, float_dtype=float_dtype, values=[spec.loss] + [g for _, g in grads], **mode)
    return float(got[spec.loss.name]), {name: got[g.name] for name, g in grads}


def train_step(graph, inputs: dict, params: dict, state: dict, step: int, hyper: dict | None = None,
               **mode) -> float:
    """One step of training, as the generated train_step does it: updates `params`
    and `state` ({"param/slot": array}) in place; `step` counts from 1. `mode`:
    run()'s training, seed and draw."""
    spec = graph.train
    loss, grads = gradients(graph, inputs, params, **mode)
    values = dict(spec.hyper, **(hyper or {}))
    for name, g in grads.items():
        slots = {slot: state.setdefault(f"{name}/{slot}", np.zeros_like(params[name])) for slot in spec.optimizer.slots}
        new_w, new_slots = spec.optimizer.apply(params[name], g, slots, values, step)
        params[name][...] = new_w
        for slot, value in new_slots.items():
            slots[slot][...] = value
    return loss


def train_epochs(graph, data: dict, epochs: int, batch: int, seed: int = 0) -> dict:
    """Parameters drawn from `seed` and trained by train_step over `data` (arrays with the
    examples first) for `epochs`, each a fresh permutation (numpy's generator at `seed`)
    cut into batches of `batch`: the fp32 model the reduced-precision checks start from."""
    params, state, step = init_params(graph, seed=seed), {}, 0
    rng = np.random.default_rng(seed)
    count = len(next(iter(data.values())))
    for _ in range(epochs):
        order = rng.permutation(count)
        for start in range(0, count, batch):
            pick, step = order[start : start + batch], step + 1
            train_step(graph, {k: v[pick] for k, v in data.items()}, params, state, step)
    return params


def _fmt_dims(dims):
    return ", ".join(f"{k}={v}" for k, v in dims.items())
