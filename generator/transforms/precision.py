"""The precision a model is generated in (`deepgen generate --precision`).

bf16 inference: the operands of every product (each operand an OpDef lists in
`products`: matmul's and bmm's a and b, a convolution's input and weight) are
rounded to bfloat16 by a `round_bf16` node before the product, weights included;
the product multiplies and accumulates in float32 and everything else (bias
adds, activations, normalization, softmax) stays float32. The rounding is an
ordinary node, so the reference interpreter computes exactly what the generated
code does, and the C++ shows it as a named call (`dg::round_bf16`). A value that
several products read is rounded once. Inside a recursion's cells (a TreeLSTM's,
an LSTM's time step) the same holds: a value the cell makes is rounded in the
cell, once per level or step; a value from outside it (a weight) is rounded once,
before the recursion, which reads the rounded value instead.

int8 inference: every matmul by a weight becomes a `matmul_int8` node with static
scales that are buffers (transforms/quantize.py, ops/quantize.py); the rest stays
float32.
"""

from __future__ import annotations

from ..errors import DeepgenError
from .autodiff import train_only_inputs
from .passes import dce
from .quantize import rewrite_int8
from .rounding import round_products

PRECISIONS = ("fp32", "bf16", "int8")


def set_precision(graph, precision: str) -> list:
    """Rewrite the graph in place for `precision` (fp32 leaves it as built); returns
    notes for the user (what a bf16 generation left out)."""
    if precision not in PRECISIONS:
        raise DeepgenError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return []
    notes = []
    if graph.train is not None and graph.train.precision == "bf16" and precision == "bf16":
        return notes  # trained in bf16 (dg.train(..., precision="bf16")): prepare_training rounds every product
    if graph.train is not None:  # fp32 training in bf16 or int8: the project is the inference part
        labels, trained_in = train_only_inputs(graph), graph.train.precision
        graph.inputs = [v for v in graph.inputs if all(v is not w for w in labels)]
        graph.train = None
        dce(graph)  # the loss and what only it reads
        notes.append(f"{precision}: inference only: '{graph.name}' trains in {trained_in} "
                     f"(dg.train(..., precision=...)), so the project has forward() and no train_step()"
                     + (f" (and forward() does not take {', '.join(v.name for v in labels)})" if labels else ""))
    if precision == "int8":  # transforms/quantize.py
        weights = rewrite_int8(graph)
        notes.append(f"int8: {len(weights)} product(s) by a weight run in int8 ({', '.join(weights) or 'none'}), "
                     "everything else in float32; their scales come from `deepgen quantize`")
        graph.precision = precision
        return notes
    round_products(graph)
    return notes
