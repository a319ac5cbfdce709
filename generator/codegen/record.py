"""Recording: what a generated project carries about itself, computed from the
graph and its plan before rendering (so that rendering is pure): the reference
outputs its test compares against (tests/expected.npz), the example inputs of
examples/main.cpp and the README, parameter counts, and the memory report.

Stage `record`: (Graph, ProjectPlan, memory report text) -> ProjectPlan with `recording`
filled in (the pipeline makes the report: memory/report.py is a stage above this package).
"""

from __future__ import annotations

import io
import math

import numpy as np

from ..reference.interpreter import init_params, run, train_step
from ..reference.quantize import calibrate
from ..reference.samples import sample_dims, sample_inputs
from ..ir.shapes import evaluate
from .plan import Recording


def record(graph, plan, memory_report: str):
    """Fill plan.recording from the graph (the numpy reference runs here)."""
    expected = _expected_npz(graph)
    examples, call, train_call = _examples(plan, graph)
    count = sum(math.prod(p.shape) for p in graph.params)
    plan.recording = Recording(
        expected_npz=expected,
        example_inputs=examples,
        example_call=call,
        example_train_call=train_call,
        param_count=f"{count:,}",
        param_bytes=f"{4 * count:,}",
        memory_report=memory_report,
    )
    return plan


def _examples(plan, graph):
    """Example inputs for the README and examples/main.cpp: zeros for float inputs,
    and for integer inputs (ids, labels, trees) the valid sample values; returns
    (inputs, forward call text, train_step call text)."""
    samples = sample_inputs(graph, floats=False)  # the float inputs' values are not needed here
    dims = dict(sample_dims(graph))
    for v in graph.inputs:
        for d, size in zip(v.shape, samples[v.name].shape if v.name in samples else ()):
            if not isinstance(d, int):
                dims[d] = size
    example = []
    forward_names = {i.name for i in plan.inputs}
    for v in [v for v in graph.inputs if v.name in forward_names]:
        shape = evaluate(v.shape, dims)
        dims_text = ", ".join(f"{d}={dims[d]}" for d in graph.dims if d in getattr(v, "shape", ())) or "fixed sizes"
        values = "" if v.dtype == "float32" else ", ".join(str(int(x)) for x in samples[v.name].reshape(-1))
        example.append(
            {"name": v.name, "ctype": plan.all_inputs[graph.inputs.index(v)].ctype, "size": math.prod(shape),
             "shape": ", ".join(map(str, shape)), "declared": plan.all_inputs[graph.inputs.index(v)].declared,
             "dims": dims_text, "data": values}
        )
    def call(values):
        return ", ".join(
            f"{v.name}=np.zeros(({', '.join(map(str, evaluate(v.shape, dims)))}{',' if v.rank == 1 else ''}), "
            f"np.{v.dtype})"
            for v in values
        )

    return example, call([v for v in graph.inputs if v.name in forward_names]), call(graph.inputs)


# Generation runs the numpy reference once to record expected outputs; a model
# whose parameters and values at the sample sizes need more than this is
# generated without them (its project's test says so) rather than materialized.
REFERENCE_BYTES_LIMIT = 512 * 2**20


def reference_bytes(graph) -> int:
    """Bytes of parameters, inputs and values at the sample sizes: roughly what
    recording the expected outputs holds in memory at once."""
    dims = sample_dims(graph)
    values = list(graph.params) + list(graph.inputs) + [v for n in graph.nodes for v in n.outputs]
    return sum(8 * math.prod(evaluate(v.shape, dims)) for v in values)


def _expected_npz(graph) -> bytes | None:
    """Reference outputs for deterministic inputs and the seed-0 parameters (and,
    for a trainable model, the loss of one train_step and the outputs after it);
    None for a model too large to run the reference on at generation time."""
    if reference_bytes(graph) > REFERENCE_BYTES_LIMIT:
        return None
    inputs = sample_inputs(graph)
    params = init_params(graph, seed=0)
    arrays = {f"input/{k}": v for k, v in inputs.items()}
    if graph.precision == "int8":  # the scales, calibrated on these inputs: the test loads them
        scales = calibrate(graph, [inputs], params)
        params.update(scales)
        arrays.update({f"param/{k}": v for k, v in scales.items()})
    outputs = run(graph, inputs, params)
    arrays.update({f"output/{k}": np.asarray(v) for k, v in outputs.items()})
    if graph.train is not None:
        arrays["train/loss"] = np.float32(train_step(graph, inputs, params, {}, step=1))
        # The model's next call is its second in training mode: dropout takes draw 1.
        after = run(graph, inputs, params, draw=1)
        arrays.update({f"train/output/{k}": np.asarray(v) for k, v in after.items()})
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # zip entries carry a fixed 1980 date: deterministic
    return buf.getvalue()
