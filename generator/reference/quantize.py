"""Calibration of an int8 graph's scales (`deepgen quantize`, and the expected outputs
a generated int8 project records): the fp32 model run by the interpreter."""

from __future__ import annotations

import numpy as np

from ..ops.quantize import float_twin, input_scale, int8_nodes, int8_weight_scales
from ..transforms.quantize import scale_names
from .interpreter import run


def calibrate(graph, batches, params: dict) -> dict:
    """The scales of an int8 graph: {name: float32 array}. Each weight's input scale
    is max |x| / 127 over every batch (a dict of inputs) and every product that
    reads the weight, x computed in float32 (the fp32 model); each weight scale is
    max |w_j| / 63 per output channel (ops/quantize.py: 7-bit weights). Max-abs, no clipping: see ARCHITECTURE.
    The model runs in evaluation mode, as the int8 project does (inference only): batch
    norm reads its running statistics and leaves them as they are."""
    twin = float_twin(graph)
    at = [graph.nodes.index(n) for n in int8_nodes(graph)]
    products = [twin.nodes[i] for i in at]  # the float32 matmuls in their places
    names = scale_names(graph)
    peaks = {w: 0.0 for w in names}
    xs = [n.inputs[0] for n in products]
    for batch in batches:
        got = run(twin, batch, params, values=xs, training=False)  # inference: batch norm's running statistics
        for n in products:
            a = got[n.inputs[0].name]
            if a.size:
                peaks[n.inputs[1].name] = max(peaks[n.inputs[1].name], float(np.abs(a).max()))
    scales = {}
    for n in int8_nodes(graph):
        if n.inputs[2].name not in scales:
            w = n.inputs[1]
            scales[n.inputs[2].name] = input_scale(peaks[w.name])
            scales[n.inputs[3].name] = int8_weight_scales(n, params[w.name])
    return scales
