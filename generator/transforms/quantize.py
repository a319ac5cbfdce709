"""`--precision int8`: every matmul by a weight (a dense layer's product, the weight
stored [K, P] or, with tb, [P, K]) becomes a `matmul_int8` node (ops/quantize.py),
and every one-group convolution by a weight a `conv2d_int8` (ops/quantize_conv.py),
that reads two new buffers beside the weight:

- `<weight>_input_scale` [1]: the static scale of the activation the weight
  multiplies (calibrated by `deepgen quantize`: max |x| / 127; one per weight,
  over every product that reads it);
- `<weight>_scale` [P]: the weight's per-output-channel scale (max |w_j| / 63: the
  weight's int8 values are in [-63, 63], ops/quantize.py says why).

Both are module state (kind "state", like batch norm's running statistics): saved
and loaded with the weights under those names, zeros in a new Model, which the
product refuses at run time. The weight itself stays a float32 parameter.

Everything else stays float32: grouped and depthwise convolutions, bmm (attention's
products), products of two activations, and the products inside recursive ops' cells.
"""

from __future__ import annotations

from dataclasses import replace

from ..errors import DeepgenError
from ..ir.graph import Value
from ..ops.quantize import MAX_K, int8_candidates, int8_nodes, int8_sizes, to_int8


def scale_names(graph) -> dict:
    """{weight name: (input scale name, weight scale name)} of an int8 graph."""
    return {n.inputs[1].name: (n.inputs[2].name, n.inputs[3].name) for n in int8_nodes(graph)}


def rewrite_int8(graph) -> list:
    """Rewrite the products in place; returns the names of the weights now used in int8."""
    scales = {}  # id(weight) -> (input scale, weight scale)
    for node in int8_candidates(graph):
        w = node.inputs[1]
        k, p = int8_sizes(node)
        if not isinstance(k, int) or k > MAX_K:
            raise DeepgenError(f"--precision int8: the product by '{w.name}' sums K={k} terms, more than {MAX_K} "
                               "(int32 sums of int8 products could overflow)")
        if id(w) not in scales:
            made = []
            # zeros: the weight's initializer type (frontend's Init) as the constant 0
            zeros = replace(w.init, kind="constant", a=0.0, b=0.0)
            for suffix, shape in (("input_scale", (1,)), ("scale", (p,))):
                v = Value(graph.names.unique(f"{w.name}_{suffix}"), "float32", shape, kind="state", loc=w.loc,
                          init=zeros, explicit=True)
                graph.params.append(v)
                made.append(v)
            scales[id(w)] = tuple(made)
        to_int8(node, *scales[id(w)])
    return list(dict.fromkeys(n.inputs[1].name for n in int8_nodes(graph)))
