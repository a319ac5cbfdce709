"""The precision a model is generated in (`deepgen generate --precision`).

bf16 inference: the operands of every product (each operand an OpDef lists in
`products`: matmul's and bmm's a and b, a convolution's input and weight) are
rounded to bfloat16 by a `round_bf16` node before the product, weights included;
the product multiplies and accumulates in float32 and everything else (bias
adds, activations, normalization, softmax) stays float32. The rounding is an
ordinary node, so the reference interpreter computes exactly what the generated
code does, and the C++ shows it as a named call (`dg::round_bf16`). A value that
several products read is rounded once.

int8 inference: every matmul by a weight becomes a `matmul_int8` node with static
scales that are buffers (transforms/quantize.py, ops/quantize.py); the rest stays
float32.
"""

from __future__ import annotations

from ..errors import DeepgenError
from ..ir.graph import Node, Value
from ..ops import get_op
from .autodiff import train_only_inputs
from .passes import dce
from .quantize import rewrite_int8

PRECISIONS = ("fp32", "bf16", "int8")


def set_precision(graph, precision: str) -> list:
    """Rewrite the graph in place for `precision` (fp32 leaves it as built); returns
    notes for the user (what a bf16 generation left out)."""
    if precision not in PRECISIONS:
        raise DeepgenError(f"--precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
    if precision == "fp32":
        return []
    notes = []
    if graph.train is not None:  # reduced-precision training is not implemented: the project is the inference part
        labels = train_only_inputs(graph)
        graph.inputs = [v for v in graph.inputs if all(v is not w for w in labels)]
        graph.train = None
        dce(graph)  # the loss and what only it reads
        notes.append(f"{precision}: inference only: '{graph.name}' calls dg.train, but {precision} training is not "
                     f"implemented yet, so the project has forward() and no train_step()"
                     + (f" (and forward() does not take {', '.join(v.name for v in labels)})" if labels else ""))
    if precision == "int8":  # transforms/quantize.py
        weights = rewrite_int8(graph)
        notes.append(f"int8: {len(weights)} product(s) by a weight run in int8 ({', '.join(weights) or 'none'}), "
                     "everything else in float32; their scales come from `deepgen quantize`")
        graph.precision = precision
        return notes
    for node in graph.nodes:
        if get_op(node.op).regions(node):
            raise DeepgenError(f"--precision bf16: the recursive op '{node.op}' ({node.outputs[0].name}) is not "
                               "supported in bf16 yet; generate this model with --precision fp32")
    _round_products(graph)
    graph.precision = precision
    return notes


def _round_products(graph):
    rounded = {}  # id(value) -> its bf16 value, made before the first product that reads it
    nodes = []
    for node in graph.nodes:
        for i in get_op(node.op).products:
            v = node.inputs[i]
            if id(v) not in rounded:
                out = Value(graph.names.unique(f"{v.name}_bf16"), "float32", tuple(v.shape), loc=node.loc)
                rounding = Node("round_bf16", [v], {}, outputs=[out], loc=node.loc, phase=node.phase)
                out.producer = rounding
                nodes.append(rounding)
                rounded[id(v)] = out
            node.inputs[i] = rounded[id(v)]
        nodes.append(node)
    graph.nodes[:] = nodes
